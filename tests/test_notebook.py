"""Tests of ddpc.notebook.notebook_launcher, driven through a real Jupyter kernel (results, a
rank's exception, interrupting the cell, calling again) plus argument checks and fork mode in
plain processes."""
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYDIR = os.path.join(ROOT, "python")

sys.path.insert(0, PYDIR)

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_case(tmp_path, name, text, args=(), drop=(), **env_vars):
    """Writes text to tmp_path/name and runs it with this checkout's ddpc importable (plus
    env_vars, without the variables in drop); returns the CompletedProcess."""
    script = tmp_path / name
    script.write_text(text)
    env = dict(os.environ, **env_vars)
    for k in drop:
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PYDIR, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env=env, timeout=100)


def children_of(pid):
    """Pids whose parent is pid (from /proc), zombies excluded."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def pid_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


class Kernel:
    """A real ipykernel, with a helper that runs one cell and gathers what it shows."""

    def __init__(self, cwd):
        from jupyter_client import KernelManager
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PYDIR, env.get("PYTHONPATH")) if p)
        env.pop("DDPC_TOKEN", None)
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env, cwd=str(cwd))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.pid = self.km.provisioner.process.pid

    def run(self, code, timeout=90, during=None):
        """Executes code; returns {"stdout", "stderr", "error": None or (ename, evalue, text)}.
        during(), when given, is called while the cell runs until it returns True."""
        msg_id = self.kc.execute(textwrap.dedent(code))
        out = {"stdout": "", "stderr": "", "error": None}
        deadline = time.monotonic() + timeout
        while True:
            assert time.monotonic() < deadline, f"cell did not finish in {timeout} s: {out}"
            if during is not None and during():
                during = None
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except Exception:  # queue.Empty: nothing yet
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out[content["name"]] += content["text"]
            elif kind == "error":
                text = ANSI.sub("", "\n".join(content["traceback"]))
                out["error"] = (content["ename"], content["evalue"], text)
            elif kind == "status" and content["execution_state"] == "idle":
                return out

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    k = Kernel(tmp_path_factory.mktemp("nb"))
    try:
        res = k.run("""
            import os, time
            import numpy as np
            import ddpc.distributed as dist
            from ddpc.notebook import notebook_launcher, WorkerError
        """)
        assert res["error"] is None, res
        yield k
    finally:
        k.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_training_function_defined_in_a_cell(kernel):
    res = kernel.run("""
        class Target:                      # a class defined in the notebook travels by value
            def __init__(self, w):
                self.w = np.asarray(w)

        def make_train(target):            # and so does a closure over it
            def train(steps, lr):
                rank, world = dist.get_rank(), dist.get_world_size()
                rng = np.random.default_rng(rank)
                X = rng.normal(size=(64, 3))
                y = X @ target.w
                w = np.zeros(3)
                for _ in range(steps):
                    grad = 2 * X.T @ (X @ w - y) / len(X)
                    dist.all_reduce(grad)
                    w -= lr * grad / world
                ones = np.full(4, rank + 1.0, dtype=np.float32)
                dist.all_reduce(ones)
                print(f"trained on rank {rank} of {world}")
                return {"w": w, "sum": ones.tolist(), "pid": os.getpid()}
            return train

        results = notebook_launcher(make_train(Target([1.0, -2.0, 0.5])), args=(100, 0.1),
                                    nprocs=2, return_all=True)
        first = notebook_launcher(lambda k: dist.get_rank() * k + dist.get_world_size(),
                                  args=(7,), nprocs=2)
        print("RESULT", [r["w"].round(3).tolist() for r in results],
              bool((results[0]["w"] == results[1]["w"]).all()),
              results[0]["sum"], results[0]["pid"] != os.getpid(), first)
    """)
    assert res["error"] is None, res
    for r in (0, 1):
        assert f"[rank{r}]: trained on rank {r} of 2" in res["stdout"]
    line = res["stdout"][res["stdout"].index("RESULT"):].splitlines()[0]
    # Averaged gradients keep both replicas identical, and they fit the target.
    assert line == ("RESULT [[1.0, -2.0, 0.5], [1.0, -2.0, 0.5]] True [3.0, 3.0, 3.0, 3.0] "
                    "True 2")
    assert children_of(kernel.pid) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_exception_in_one_rank_reaches_the_cell(kernel, tmp_path):
    pidfile = tmp_path / "rank0.pid"
    start = time.monotonic()
    res = kernel.run(f"""
        def fragile(n):
            if dist.get_rank() == 1:
                while not os.path.exists({str(pidfile)!r}):  # fail once rank 0 is asleep
                    time.sleep(0.05)
                raise ValueError(f"rank one is unhappy {{n}}")
            with open({str(pidfile)!r} + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace({str(pidfile)!r} + ".tmp", {str(pidfile)!r})
            time.sleep(60)

        notebook_launcher(fragile, args=(5,), nprocs=2)
    """)
    elapsed = time.monotonic() - start
    assert res["error"] is not None, res
    ename, evalue, text = res["error"]
    assert ename == "WorkerError"
    assert "rank 1 raised ValueError: rank one is unhappy 5" in evalue
    assert "in fragile" in text
    assert 'raise ValueError(f"rank one is unhappy {n}")' in text  # the cell's source line
    assert "rank 0: stopped by the launcher (SIGTERM)" in evalue
    assert elapsed < 40, "the sleeping rank was not stopped promptly"
    assert not pid_alive(int(pidfile.read_text()))
    assert children_of(kernel.pid) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_interrupting_the_cell_stops_every_rank(kernel, tmp_path):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    interrupted = []

    def interrupt_once_sleeping():
        if len([p for p in piddir.iterdir() if not p.name.endswith(".tmp")]) < 2:
            return False
        kernel.km.interrupt_kernel()
        interrupted.append(time.monotonic())
        return True

    res = kernel.run(f"""
        def sleeper():
            path = os.path.join({str(piddir)!r}, str(dist.get_rank()))
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path)  # the test counts finished files only
            time.sleep(60)

        notebook_launcher(sleeper, nprocs=2)
    """, during=interrupt_once_sleeping)
    assert interrupted, "the ranks never started"
    assert res["error"] is not None and res["error"][0] == "KeyboardInterrupt", res
    assert time.monotonic() - interrupted[0] < 30
    pids = [int(p.read_text()) for p in piddir.iterdir() if not p.name.endswith(".tmp")]
    assert wait_until(lambda: not any(pid_alive(p) for p in pids), 5), pids
    assert children_of(kernel.pid) == []

    # The kernel is still usable: a fresh call gets a fresh port and token.
    res = kernel.run("""
        envs = notebook_launcher(lambda: (os.environ["MASTER_PORT"], os.environ["DDPC_TOKEN"]),
                                 nprocs=2, return_all=True)
        again = notebook_launcher(lambda: (os.environ["MASTER_PORT"], os.environ["DDPC_TOKEN"]),
                                  nprocs=2)
        print("SAME_JOB", envs[0] == envs[1], "FRESH", envs[0][1] != again[1])
    """)
    assert res["error"] is None, res
    assert "SAME_JOB True FRESH True" in res["stdout"]


# ------------------------------------------------------------------ without a kernel

def test_bad_arguments():
    from ddpc.notebook import notebook_launcher
    with pytest.raises(TypeError, match="fn must be callable"):
        notebook_launcher(42)
    with pytest.raises(TypeError, match=r"args must be a tuple.*args=\(x,\)"):
        notebook_launcher(print, args=5)
    with pytest.raises(TypeError, match="kwargs must be a dict"):
        notebook_launcher(print, kwargs=[1])
    with pytest.raises(ValueError, match="nprocs must be between 1 and 65536 .*got 0"):
        notebook_launcher(print, nprocs=0)
    with pytest.raises(ValueError, match="nprocs must be between 1 and 65536 .*got 10{12}"):
        notebook_launcher(print, nprocs=10 ** 12)
    with pytest.raises(TypeError, match="nprocs must be an int"):
        notebook_launcher(print, nprocs=2.0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        notebook_launcher(print, nprocs=1, timeout=0)
    with pytest.raises(TypeError, match="return_all must be True or False"):
        notebook_launcher(print, nprocs=1, return_all="yes")
    with pytest.raises(ValueError, match="start_method must be 'spawn' or 'fork'"):
        notebook_launcher(print, start_method="forkserver")
    with pytest.raises(TypeError, match="gpus must be"):
        notebook_launcher(print, gpus=[1.5])
    with pytest.raises(ValueError, match="gpus='1,1'.*distinct"):
        notebook_launcher(print, gpus="1,1")


def test_unpicklable_argument_is_named():
    import threading

    from ddpc.notebook import notebook_launcher
    with pytest.raises(TypeError, match="could not be sent to the ranks with cloudpickle"):
        notebook_launcher(print, args=(threading.Lock(),), nprocs=1)


def test_fork_refused_once_cuda_is_initialised(monkeypatch):
    from types import SimpleNamespace

    from ddpc.notebook import notebook_launcher
    # A stand-in for a torch that initialised CUDA (this machine may have neither).
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    with pytest.raises(RuntimeError, match=r"CUDA is already initialised.*start_method='spawn'"):
        notebook_launcher(print, nprocs=1, start_method="fork")


def test_worker_error_is_a_distributed_error():
    import pickle

    import ddpc
    from ddpc.notebook import WorkerError
    e = WorkerError("rank 1 raised ValueError: x", 1, "ValueError", "Traceback ...")
    assert isinstance(e, ddpc.DistributedError) and isinstance(e, RuntimeError)
    back = pickle.loads(pickle.dumps(e))
    assert (str(back), back.rank, back.exc_type) == (str(e), 1, "ValueError")


FORK_SCRIPT = """
import os, sys, time
import ddpc.distributed as dist
from ddpc.notebook import notebook_launcher, WorkerError

lock_in_closure = __import__("threading").Lock()   # unpicklable: fork needs no pickling
def work(scale):
    with lock_in_closure:
        x = __import__("numpy").full(2, dist.get_rank() + 1.0)
    dist.all_reduce(x)
    print("forked rank", dist.get_rank(), flush=True)
    return (x * scale).tolist()
print("FORK", notebook_launcher(work, args=(2,), nprocs=2, start_method="fork",
                                return_all=True))

def stuck_here():
    time.sleep(60)
def timeout_case():
    stuck_here()
t = time.monotonic()
try:
    notebook_launcher(timeout_case, nprocs=2, timeout=2)
except TimeoutError as e:
    print("TIMEOUT", type(e).__name__, round(time.monotonic() - t) < 20)
    print("WHERE", str(e))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fork_mode_and_timeout(tmp_path):
    res = run_case(tmp_path, "fork_case.py", FORK_SCRIPT)
    assert res.returncode == 0, res.stderr
    assert "[rank0]: forked rank 0" in res.stdout and "[rank1]: forked rank 1" in res.stdout
    assert "FORK [[6.0, 6.0], [6.0, 6.0]]" in res.stdout
    assert "TIMEOUT DistributedTimeoutError True" in res.stdout
    # The timeout shows where each rank was (fork: the function's file is this script).
    where = res.stdout[res.stdout.index("WHERE"):]
    assert "where they were:" in where and "rank 1:" in where, where
    assert len(re.findall(r'File ".*fork_case\.py", line 17 in stuck_here', where)) == 2, where


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_example_notebook_runs(tmp_path):
    """examples/notebook.ipynb, executed top to bottom by nbclient as a reader would."""
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    import nbformat
    from nbclient import NotebookClient
    path = os.path.join(ROOT, "examples", "notebook.ipynb")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=200, kernel_name="python3",
                   resources={"metadata": {"path": os.path.join(ROOT, "examples")}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.get("outputs", []))
    accuracy = float(re.search(r"held-out accuracy: ([0-9.]+)", text).group(1))
    assert accuracy > 0.8
    assert "[rank0]: step 0: loss" in text and "[rank1]: step 0: loss" in text
    assert "all replicas identical: True" in text


OOM_CASE = """
import os
from ddpc.notebook import notebook_launcher, WorkerError

def work():
    import torch
    if os.environ["RANK"] == "1":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has "
                                     "a total capacity of 139.81 GiB of which 1.06 GiB is free.")
try:
    notebook_launcher(work, nprocs=2)
except WorkerError as e:
    print("MESSAGE", " ".join(str(e).split()))
"""


@pytest.mark.timeout(120)
def test_cuda_oom_is_explained_in_the_error(tmp_path):
    """A rank's CUDA out-of-memory error (torch's type and message; no GPU here) comes back with
    the launcher's explanation: rank 1 allocated on cuda:0, which is not its GPU."""
    res = run_case(tmp_path, "oom_case.py", OOM_CASE, drop=("CUDA_VISIBLE_DEVICES",))
    assert res.returncode == 0, res.stderr
    msg = res.stdout[res.stdout.index("MESSAGE"):]
    assert "rank 1 raised torch.OutOfMemoryError" in msg
    assert "rank 1 ran out of GPU memory on cuda:0" in msg
    assert "That is not its own GPU: rank 1 works on cuda:1" in msg


HANG_CASE = """
import os, time
import numpy as np
from ddpc.notebook import notebook_launcher, WorkerError
import ddpc.distributed as dist

def stuck_in_user_code():
    time.sleep(60)

def work():
    x = np.ones(2)
    if dist.get_rank() == 1:
        stuck_in_user_code()
    dist.all_reduce(x)

try:
    notebook_launcher(work, nprocs=2)
except WorkerError as e:
    print("MESSAGE", str(e))
"""


@pytest.mark.timeout(120)
def test_a_hang_shows_where_the_missing_rank_was(tmp_path):
    """Rank 0 times out waiting for rank 1 (DDPC_TIMEOUT=3): the error shows rank 1's stack."""
    res = run_case(tmp_path, "hang_case.py", HANG_CASE, DDPC_TIMEOUT="3")
    assert res.returncode == 0, res.stderr
    msg = res.stdout[res.stdout.index("MESSAGE"):]
    assert "DistributedTimeoutError" in msg and "rank 1 never arrived" in msg, msg
    assert "where its threads were when asked" in msg, msg
    assert re.search(r'File ".*hang_case\.py", line 8 in stuck_in_user_code', msg), msg


HANG3_CASE = """
import atexit, os, time
import numpy as np
from ddpc.notebook import notebook_launcher, WorkerError
import ddpc.distributed as dist

def work():
    if dist.get_rank() == 2:
        time.sleep(60)  # the stuck rank
    if dist.get_rank() == 1:
        atexit.register(time.sleep, 2)  # exits slowly after its error (a big CUDA teardown)
    dist.all_reduce(np.ones(2))

try:
    notebook_launcher(work, nprocs=3)
except WorkerError as e:
    print("MESSAGE", str(e))
"""


@pytest.mark.timeout(120)
def test_a_hang_asks_only_the_stuck_rank_for_its_stack(tmp_path):
    """Ranks 0 and 1 time out waiting for rank 2; rank 1 is still exiting when rank 0's failure
    is seen. Only rank 2 is asked for its stack: the signal would kill (or uselessly interrupt)
    a rank that is exiting."""
    res = run_case(tmp_path, "hang3_case.py", HANG3_CASE, DDPC_TIMEOUT="3")
    assert res.returncode == 0, res.stderr
    msg = res.stdout[res.stdout.index("MESSAGE"):]
    assert msg.startswith("MESSAGE rank 0 raised ddpc.DistributedTimeoutError"), msg
    assert "SIGUSR1" not in msg
    assert msg.count("where its threads were when asked") == 1, msg
    assert re.search(r'File ".*hang3_case\.py", line 9 in work', msg), msg


INIT_AGAIN_CASE = """
import ddpc
from ddpc.notebook import notebook_launcher, WorkerError

def spawn_style(rank_arg):
    # Written for torch.multiprocessing.spawn: it makes the group itself.
    ddpc.init_process_group("gloo", rank=ddpc.get_rank(), world_size=2)
    ddpc.init_process_group()
    return ddpc.get_world_size()
print("AGAIN", notebook_launcher(spawn_style, args=(0,), nprocs=2, return_all=True))

def conflicting():
    ddpc.init_process_group(rank=0, world_size=1)
try:
    notebook_launcher(conflicting, nprocs=2)
except WorkerError as e:
    print("CONFLICT", str(e).splitlines()[0])

import sys
def exits(code):
    ddpc.barrier()
    sys.exit(code)  # spawn-style code ends so; 0 is a success, as under mp.spawn
print("EXIT0", notebook_launcher(exits, args=(0,), nprocs=2))
try:
    notebook_launcher(exits, args=(3,), nprocs=2)
except WorkerError as e:
    print("EXIT3", str(e).splitlines()[0])

ddpc.init_process_group(backend="cpu", rank=0, world_size=1)  # trying things in the notebook
try:
    notebook_launcher(ddpc.get_rank, nprocs=2, start_method="fork")
except RuntimeError as e:
    print("FORK", e)
"""


@pytest.mark.timeout(120)
def test_fn_that_makes_the_group_itself(tmp_path):
    """fn calling init_process_group (as mp.spawn code does) gets the launcher's group; a
    conflicting call says to remove it; sys.exit(0) in fn is a success, sys.exit(3) a failure;
    fork is refused once this process has a group."""
    res = run_case(tmp_path, "init_again.py", INIT_AGAIN_CASE, DDPC_TIMEOUT="10")
    assert res.returncode == 0, res.stderr
    assert "AGAIN [2, 2]" in res.stdout, res.stdout + res.stderr
    assert re.search(r"CONFLICT rank [01] raised RuntimeError: notebook_launcher made this "
                     r"rank's process group \(rank [01] of 2, backend 'cpu'\) before calling "
                     r"fn, .*world_size=1\), which conflicts with it: remove the call from fn",
                     res.stdout), res.stdout
    assert "EXIT0 None" in res.stdout, res.stdout + res.stderr
    assert re.search(r"EXIT3 .*rank [01].*SystemExit", res.stdout), res.stdout
    assert ("FORK start_method='fork': this process has a ddpc process group" in res.stdout
            and "ddpc.destroy_process_group() here first" in res.stdout), res.stdout


UNLOADABLE_CASE = """
import os, sys
from ddpc.notebook import notebook_launcher, WorkerError

def work(moddir):
    sys.path.insert(0, moddir)  # a module only the ranks can import
    import rankmod
    return rankmod.Thing()
try:
    notebook_launcher(work, args=(sys.argv[1],), nprocs=1)
except WorkerError as e:
    print("ERROR", e.rank, e)
"""


@pytest.mark.timeout(60)
def test_a_return_value_that_cannot_be_loaded_is_named(tmp_path):
    moddir = tmp_path / "onlyrank"
    moddir.mkdir()
    (moddir / "rankmod.py").write_text("class Thing:\n    pass\n")
    res = run_case(tmp_path, "unloadable.py", UNLOADABLE_CASE, args=[str(moddir)])
    assert res.returncode == 0, res.stderr
    assert ("ERROR 0 the return value of rank 0 could not be loaded in this process: "
            "ModuleNotFoundError: No module named 'rankmod'. Return plain data") in res.stdout, \
        res.stdout + res.stderr
