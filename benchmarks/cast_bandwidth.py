"""Builds and runs cast_bandwidth.c: the bandwidth of the reducer's casts between float32 gradients
and the bfloat16 wire (ddpc_device_cast_many in csrc/kernels.cu) over GPT-2's 148 parameter
arrays, on the vectorized path (arrays on 16-byte boundaries) and the element-wise one (offset by
one element), against a cudaMemcpy of as many bytes. Needs nvcc and one GPU.

    python benchmarks/cast_bandwidth.py [--archs 90]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd: list) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"cast_bandwidth: build failed:\n{' '.join(cmd)}\n{r.stderr}")


def build(archs: str, out_dir: str) -> str:
    """The C files with the C compiler, kernels.cu with nvcc, linked by nvcc (as the GPU tests
    build tests/c/test_kernels.c)."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cc = shutil.which("gcc") or shutil.which("cc")
    if not os.path.exists(nvcc) or cc is None:
        sys.exit("cast_bandwidth: needs nvcc (on PATH or in /usr/local/cuda/bin) and a C compiler")
    csrc = os.path.join(ROOT, "csrc")
    cuda_inc = next((d for d in (
        os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include"),
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include"))
        if os.path.exists(os.path.join(d, "cuda_runtime_api.h"))), None)
    if cuda_inc is None:
        sys.exit("cast_bandwidth: cuda_runtime_api.h not found beside nvcc: set CUDA_HOME")
    objs = []
    for src in (os.path.join(csrc, "common.c"), os.path.join(csrc, "reduce.c"),
                os.path.join(ROOT, "benchmarks", "cast_bandwidth.c")):
        obj = os.path.join(out_dir, os.path.basename(src) + ".o")
        run([cc, "-std=c11", "-D_GNU_SOURCE", "-O2", "-DDDPC_WITH_CUDA=1", "-I", csrc, "-I",
             cuda_inc, "-c", src, "-o", obj])
        objs.append(obj)
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs.split(";") if a]
    obj = os.path.join(out_dir, "kernels.cu.o")
    run([nvcc, "-std=c++17", "-O3", "-DDDPC_WITH_CUDA=1", "-I", csrc, *gencode, "-c",
         os.path.join(csrc, "kernels.cu"), "-o", obj])
    exe = os.path.join(out_dir, "cast_bandwidth")
    run([nvcc, *objs, obj, "-o", exe])
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=os.environ.get("DDPC_CUDA_ARCHS", "90"),
                    help="CUDA architectures, separated by semicolons (default 90: H100/H200)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(args.archs, tmp)
        r = subprocess.run([exe], text=True)
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
