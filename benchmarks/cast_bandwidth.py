"""Builds and runs cast_bandwidth.c: the bandwidth of the reducer's casts between float32 gradients
and the bfloat16 wire (ddpc_device_cast_many in csrc/kernels.cu) over GPT-2's 148 parameter
arrays, on the vectorized path (arrays on 16-byte boundaries) and the element-wise one (offset by
one element), against a cudaMemcpy of as many bytes. Needs nvcc and one GPU.

    python benchmarks/cast_bandwidth.py [--archs 90]
"""
import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # _cbuild: the build the GPU kernel test uses
import _cbuild  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=os.environ.get("DDPC_CUDA_ARCHS", "90"),
                    help="CUDA architectures, separated by semicolons (default 90: H100/H200)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            exe = _cbuild.build_with_kernels(os.path.join(ROOT, "benchmarks", "cast_bandwidth.c"),
                                             tmp, args.archs)
        except RuntimeError as e:
            sys.exit(f"cast_bandwidth: build failed: {e}")
        r = subprocess.run([exe], text=True)
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
