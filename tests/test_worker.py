"""How a rank runs its script (python/ddpc/_worker.py): as `python script.py` and `python -m`
would, also after the script's top-level code has returned (its threads and atexit handlers),
with an absolute __file__, and with the real directory of a symlinked script on sys.path."""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(60)

# Pickles a class of its own from a thread that outlives the top-level code, and from an atexit
# handler: both look the class up in sys.modules["__main__"].
LATE_PICKLE = """
    import atexit, os, pickle, sys, threading, time

    class Cfg:
        pass

    def later():
        time.sleep(0.3)
        pickle.dumps(Cfg())
        print("thread pickled", flush=True)

    def at_exit():
        pickle.dumps(Cfg())
        print("atexit pickled", flush=True)

    atexit.register(at_exit)
    threading.Thread(target=later).start()
    print("absolute __file__:", os.path.isabs(__file__), __file__.endswith("late.py"), flush=True)
    print("argv:", sys.argv[1:], flush=True)
"""


def run_launch(args, cwd):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    env.pop("DDPC_TOKEN", None)
    res = subprocess.run([sys.executable, "-m", "ddpc.launch", "--nproc-per-node", "1"] + args,
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=50)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_a_script_stays_main_after_its_top_level_code_returns(tmp_path):
    (tmp_path / "late.py").write_text(textwrap.dedent(LATE_PICKLE))
    out = run_launch(["late.py", "--x", "1"], tmp_path)
    for line in ("absolute __file__: True True", "argv: ['--x', '1']", "thread pickled",
                 "atexit pickled"):
        assert line in out, out


def test_a_module_stays_main_after_its_top_level_code_returns(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "late.py").write_text(textwrap.dedent(LATE_PICKLE))
    out = run_launch(["-m", "pkg.late", "--x", "1"], tmp_path)
    for line in ("absolute __file__: True True", "argv: ['--x', '1']", "thread pickled",
                 "atexit pickled"):
        assert line in out, out


def test_a_symlinked_script_imports_the_modules_beside_its_real_file(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "helper.py").write_text("VALUE = 'from the real folder'\n")
    (real / "main.py").write_text("import helper\nprint('helper:', helper.VALUE, flush=True)\n")
    os.symlink(real / "main.py", tmp_path / "linked.py")
    out = run_launch(["linked.py"], tmp_path)
    assert "helper: from the real folder" in out, out


def test_a_module_runs_in_a_namespace_of_its_own(tmp_path):
    """The rank's process starts as `python -m ddpc._worker`: a -m target must not run in that
    module's globals (a function of the user's named like the worker's replaced it, and the
    traceback kept the worker's frames)."""
    (tmp_path / "usermod.py").write_text(textwrap.dedent("""
        print("clean:", "user_traceback" not in globals() and "_run_script" not in globals(),
              flush=True)
        def write_error_file(*args):
            print("the user's function was called", flush=True)
        def fail():
            raise RuntimeError("from the user's module")
        fail()
    """))
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    res = subprocess.run([sys.executable, "-m", "ddpc.launch", "--nproc-per-node", "1", "-m",
                          "usermod"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=50)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "clean: True" in res.stdout, res.stdout
    assert "the user's function was called" not in res.stdout + res.stderr
    summary = res.stderr[res.stderr.index("failed first"):] if "failed first" in res.stderr \
        else res.stderr
    assert "RuntimeError: from the user's module" in summary, res.stderr
    assert "_worker.py" not in res.stderr and "runpy" not in res.stderr, res.stderr
