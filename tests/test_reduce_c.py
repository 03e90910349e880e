"""Compiles and runs plain-C unit tests: of csrc/reduce.c (tests/c/test_reduce.c): every dtype x
reduce op against a scalar reference, and float16/bfloat16 rounding against a table of every half
value; and of csrc/group.c (tests/c/test_group.c): the guard against a backend that stopped
answering, and the checks of a post's reduction."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "tests", "c", "bin")


SANITIZE = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all"]


def build(name: str, sources: list, sanitize: bool = False) -> str:
    """Compiles tests/c/<name>.c with the given csrc sources (at -O3, as setup.py does, so the
    vectorized loops are what gets tested; or under AddressSanitizer and
    UndefinedBehaviorSanitizer); returns the binary's path."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (gcc/cc) on PATH")
    os.makedirs(BIN, exist_ok=True)
    out = os.path.join(BIN, name + ("_asan" if sanitize else ""))
    cmd = [cc, "-std=c11", "-D_GNU_SOURCE", *(SANITIZE if sanitize else ["-O3"]), "-Wall",
           "-Wextra",
           "-I", os.path.join(ROOT, "csrc"), "-pthread",
           os.path.join(ROOT, "tests", "c", name + ".c")]
    cmd += [os.path.join(ROOT, "csrc", s) for s in sources] + ["-lm", "-o", out]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"compiling {name} failed:\n{' '.join(cmd)}\n{res.stderr}"
    return out


@pytest.mark.parametrize("sanitize", [False, True], ids=["O3", "asan_ubsan"])
def test_reduce_c(sanitize):
    exe = build("test_reduce", ["reduce.c", "common.c"], sanitize)
    res = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"test_reduce failed:\n{res.stdout}\n{res.stderr}"
    assert res.stdout.startswith("ok: "), res.stdout


@pytest.mark.parametrize("sanitize", [False, True], ids=["O3", "asan_ubsan"])
def test_group_c(sanitize):
    """A collective queued behind one the backend's thread never finishes fails within the
    timeout plus the grace period, naming itself; one queued behind works that keep ending does
    not; bitwise reductions are refused for floats and on nccl (the real group.c, a fake
    backend driven by the test)."""
    exe = build("test_group", ["group.c", "common.c", "settings.c", "reduce.c"], sanitize)
    res = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"test_group failed:\n{res.stdout}\n{res.stderr}"
    assert "all checks passed" in res.stdout, res.stdout
