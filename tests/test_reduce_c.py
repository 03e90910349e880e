"""Compiles and runs the plain-C unit test of csrc/reduce.c (tests/c/test_reduce.c): every dtype x
reduce op against a scalar reference, and float16/bfloat16 rounding against a table of every half
value."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "tests", "c", "bin")


def build(name: str, sources: list) -> str:
    """Compiles tests/c/<name>.c with the given csrc sources (at -O3, as setup.py does, so the
    vectorized loops are what gets tested); returns the binary's path."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (gcc/cc) on PATH")
    os.makedirs(BIN, exist_ok=True)
    out = os.path.join(BIN, name)
    cmd = [cc, "-std=c11", "-D_GNU_SOURCE", "-O3", "-Wall", "-Wextra",
           "-I", os.path.join(ROOT, "csrc"), "-pthread",
           os.path.join(ROOT, "tests", "c", name + ".c")]
    cmd += [os.path.join(ROOT, "csrc", s) for s in sources] + ["-lm", "-o", out]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"compiling {name} failed:\n{' '.join(cmd)}\n{res.stderr}"
    return out


def test_reduce_c():
    exe = build("test_reduce", ["reduce.c", "common.c"])
    res = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"test_reduce failed:\n{res.stdout}\n{res.stderr}"
    assert res.stdout.startswith("ok: "), res.stdout
