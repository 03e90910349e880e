"""Builds the extension ddpc._C from csrc/: C11 sources with the system compiler, and the .cu
files with nvcc when CUDA is found (CUDA_HOME, nvcc on PATH, /usr/local/cuda, or the nvidia-*
wheels). The CUDA runtime is linked statically and NCCL is dlopen'ed at run time, so one build
imports and runs every CPU feature on a machine with no GPU, no driver and no NCCL."""
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
C_SOURCES = sorted(
    os.path.join(CSRC, f) for f in os.listdir(os.path.join(HERE, CSRC)) if f.endswith(".c")
)
CU_SOURCES = sorted(
    os.path.join(CSRC, f) for f in os.listdir(os.path.join(HERE, CSRC)) if f.endswith(".cu")
)
# Compute capabilities we generate machine code for (plus PTX of the newest, for later GPUs).
CUDA_ARCHS = os.environ.get("DDPC_CUDA_ARCHS", "80;90")


def find_cuda():
    """Returns (nvcc, include_dir, lib_dir) or None. DDPC_NO_CUDA=1 forces a CPU-only build."""
    if os.environ.get("DDPC_NO_CUDA", "0") not in ("", "0"):
        return None
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.environ[var])
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for root in candidates:
        nvcc_path = os.path.join(root, "bin", "nvcc")
        inc = os.path.join(root, "include")
        for libdir in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
            lib = os.path.join(root, libdir)
            if (os.path.exists(nvcc_path) and os.path.exists(os.path.join(inc, "cuda_runtime_api.h"))
                    and os.path.exists(os.path.join(lib, "libcudart_static.a"))):
                return nvcc_path, inc, lib
    return None


class BuildExt(build_ext):
    def build_extensions(self):
        cuda = find_cuda()
        ext = self.extensions[0]
        if cuda is None:
            print("ddpc: CUDA toolkit not found (set CUDA_HOME or put nvcc on PATH): "
                  "building CPU-only", file=sys.stderr)
        else:
            nvcc, inc, lib = cuda
            print(f"ddpc: building with CUDA from {os.path.dirname(inc)} (archs {CUDA_ARCHS})",
                  file=sys.stderr)
            ext.define_macros.append(("DDPC_WITH_CUDA", "1"))
            ext.include_dirs.append(inc)
            objs = []
            build_tmp = os.path.join(self.build_temp, "cuda")
            os.makedirs(build_tmp, exist_ok=True)
            gencode = []
            archs = [a for a in CUDA_ARCHS.split(";") if a]
            for a in archs:
                gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
            gencode += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
            for src in CU_SOURCES:
                obj = os.path.join(build_tmp, os.path.basename(src) + ".o")
                cmd = [nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17", "-Xcompiler", "-fPIC",
                       "-Xcompiler", "-Wall", "-I", CSRC, "-DDDPC_WITH_CUDA=1",
                       "--expt-relaxed-constexpr"] + gencode
                print(" ".join(cmd), file=sys.stderr)
                subprocess.check_call(cmd, cwd=HERE)
                objs.append(obj)
            ext.extra_objects += objs
            ext.extra_link_args += [os.path.join(lib, "libcudart_static.a"), "-lrt", "-lpthread",
                                    "-ldl", "-lstdc++"]
        super().build_extensions()


ext = Extension(
    "ddpc._C",
    sources=C_SOURCES,
    include_dirs=[CSRC],
    extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                        "-fvisibility=hidden", "-D_GNU_SOURCE"],
    extra_link_args=["-lpthread", "-ldl", "-lrt"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExt})
