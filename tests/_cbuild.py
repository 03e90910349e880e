"""Builds a C program against the core's CUDA kernels (csrc/kernels.cu) with the C core's own
helpers (csrc/common.c, csrc/reduce.c), outside setup.py: for the GPU kernel test
(tests/c/test_kernels.c) and benchmarks/cast_bandwidth.py. The C files go through the C
compiler, kernels.cu through nvcc, and nvcc links them."""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")


def find_toolchain() -> Optional[Tuple[str, str, str]]:
    """(nvcc, C compiler, CUDA include directory), or None when one of them is missing. The
    include directory is the one beside nvcc's real path, else $CUDA_HOME's (or
    /usr/local/cuda's): nvcc on PATH may be a wrapper script elsewhere."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cc = shutil.which("gcc") or shutil.which("cc")
    if not os.path.exists(nvcc) or cc is None:
        return None
    for inc in (os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include"),
                os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")):
        if os.path.exists(os.path.join(inc, "cuda_runtime_api.h")):
            return nvcc, cc, inc
    return None


def _run(cmd: Sequence[str], timeout: float) -> None:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{r.stderr}")


def build_with_kernels(main_c: str, out_dir: str, archs: str, werror: bool = False) -> str:
    """Compiles main_c (a path) with the core's helpers and kernels into out_dir; returns the
    executable's path. archs: CUDA architectures separated by semicolons ("80;90"). Raises
    RuntimeError with the failing command and its output, or when the toolchain is missing."""
    tools = find_toolchain()
    if tools is None:
        raise RuntimeError("needs nvcc (on PATH or in /usr/local/cuda/bin), a C compiler and the "
                           "CUDA headers (set CUDA_HOME)")
    nvcc, cc, cuda_inc = tools
    os.makedirs(out_dir, exist_ok=True)
    name = os.path.splitext(os.path.basename(main_c))[0]
    objs = []
    for src in (main_c, os.path.join(CSRC, "common.c"), os.path.join(CSRC, "reduce.c")):
        obj = os.path.join(out_dir, f"{name}_{os.path.basename(src)}.o")
        _run([cc, "-std=c11", "-D_GNU_SOURCE", "-O2", "-Wall", "-Wextra",
              *(["-Werror"] if werror else []), "-DDDPC_WITH_CUDA=1", "-I", CSRC, "-I", cuda_inc,
              "-c", src, "-o", obj], 120)
        objs.append(obj)
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs.split(";") if a]
    obj = os.path.join(out_dir, f"{name}_kernels.cu.o")
    _run([nvcc, "-std=c++17", "-O3", "-DDDPC_WITH_CUDA=1", "-I", CSRC, *gencode, "-c",
          os.path.join(CSRC, "kernels.cu"), "-o", obj], 300)
    exe = os.path.join(out_dir, name)
    _run([nvcc, *objs, obj, "-o", exe, "-lm"], 120)
    return exe
