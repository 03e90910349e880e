"""notebook_launcher: run a function on several ranks from a Jupyter cell (or any Python
session). Each rank is a fresh interpreter that receives the function by value (cloudpickle),
joins the process group, and calls it; output streams into the cell with rank prefixes."""
from __future__ import annotations

import collections
import io
import linecache
import numbers
import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from typing import Any, Callable, Sequence

from ddpc import _C, _settings, distributed
from ddpc._nbworker import error_path, exception_path, result_path, run_rank
from ddpc._worker import die_with_parent, enable_stack_dumps
from ddpc.launch import (MAX_LOCAL_RANKS, DevicePlan, Worker, WorkerGroup,
                         any_waited_for_others, describe_exit, describe_other, first_failure,
                         free_port, oom_lines, plan_devices, rank_env, stack_lines,
                         start_failure, worker_pythonpath)

STOP_GRACE_S = 3.0  # seconds between SIGINT/SIGTERM and SIGKILL when stopping ranks


class WorkerError(_C.DistributedError):
    """A rank raised (or died) inside notebook_launcher. The message carries that rank's
    traceback; `rank`, `exc_type` and `remote_traceback` hold the parts, and `exception` the
    original exception object when it could be sent back (else None)."""

    def __init__(self, message: str, rank: int, exc_type: str | None = None,
                 remote_traceback: str | None = None, exception: BaseException | None = None):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.exception = exception

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.rank, self.exc_type, self.remote_traceback, None))


class _ForkedProcess:
    """The Popen-like handle of a rank started with os.fork (start_method="fork")."""

    def __init__(self, pid: int, stdout: io.BufferedReader, stderr: io.BufferedReader):
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def wait(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _fork_rank(fn: Callable[..., Any], args: tuple, kwargs: dict, env: dict[str, str],
               job_dir: str, return_all: bool) -> _ForkedProcess:
    """Forks one rank: its own session (so it can be stopped as a group), stdout/stderr on
    pipes, the rank's environment, then run_rank; the child never returns from here."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only async-signal-safe-ish work until the interpreter is ours
        code = 1
        try:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (out_r, err_r, out_w, err_w, devnull):
                os.close(fd)
            os.environ.clear()
            os.environ.update(env)
            die_with_parent()
            # The parent's sys.stdout may be a Jupyter stream bound to its sockets: replace it.
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            enable_stack_dumps()  # (after the stderr above: it writes to the current one)
            code = run_rank(fn, args, kwargs, job_dir, return_all)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    os.close(out_w)
    os.close(err_w)
    return _ForkedProcess(pid, os.fdopen(out_r, "rb", buffering=0),
                          os.fdopen(err_r, "rb", buffering=0))


def _gpu_count_in_subprocess() -> int:
    """Visible CUDA devices, counted in a child so this process (the notebook) never
    initialises CUDA itself, which would break start_method="fork"."""
    code = "from ddpc import _C; print(_C.cuda_device_count())"
    env = dict(os.environ)
    env["PYTHONPATH"] = worker_pythonpath(env)
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, timeout=120)
        return int(res.stdout.strip()) if res.returncode == 0 else 0
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def _cuda_initialized_here() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001 - a torch without CUDA support cannot have initialised it
        return False


def _check_arguments(fn: Any, args: Any, kwargs: Any, nprocs: Any, gpus: Any, timeout: Any,
                     return_all: Any, start_method: Any) -> str | None:
    """Raises TypeError/ValueError for bad arguments; returns gpus as the launcher's string."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of positional arguments for fn, got "
                        f"{type(args).__name__} (for one argument write args=(x,))")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
    if nprocs is not None:
        if isinstance(nprocs, bool) or not isinstance(nprocs, numbers.Integral):
            raise TypeError(f"nprocs must be an int or None, got {type(nprocs).__name__}")
        if not 1 <= nprocs <= MAX_LOCAL_RANKS:
            raise ValueError(f"nprocs must be between 1 and {MAX_LOCAL_RANKS} (one process per "
                             f"rank on this machine), got {nprocs}")
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
            raise TypeError(f"timeout must be a number of seconds or None, got "
                            f"{type(timeout).__name__}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    if not isinstance(return_all, bool):
        raise TypeError(f"return_all must be True or False, got {return_all!r}")
    if start_method not in ("spawn", "fork"):
        raise ValueError(f"start_method must be 'spawn' or 'fork', got {start_method!r}")
    if start_method == "fork" and _cuda_initialized_here():
        raise RuntimeError("start_method='fork': CUDA is already initialised in this process "
                           "(torch.cuda.is_initialized() is True), and forked children cannot "
                           "use CUDA then. Use the default start_method='spawn' (the function "
                           "is sent by value with cloudpickle), or restart the kernel and call "
                           "notebook_launcher before any CUDA work.")
    if start_method == "fork" and distributed._state is not None:
        raise RuntimeError("start_method='fork': this process has a ddpc process group (from "
                           "ddpc.init_process_group()), and forked ranks would inherit it. Call "
                           "ddpc.destroy_process_group() here first, or use the default "
                           "start_method='spawn'.")
    if gpus is None or gpus == "auto":
        return gpus
    if isinstance(gpus, str):
        return gpus
    if isinstance(gpus, Sequence) and all(
            isinstance(g, numbers.Integral) and not isinstance(g, bool) for g in gpus):
        return ",".join(str(int(g)) for g in gpus)
    raise TypeError(f"gpus must be None, 'auto', '2,3' or a list of GPU indices, got {gpus!r}")


def _dumps_keeping_filenames(cloudpickle: Any, obj: Any) -> bytes:
    """cloudpickle.dumps, except that code keeps its file name: cloudpickle writes
    "<dynamic-code>", which would leave a rank's traceback without file names or source lines
    (the cell sources travel in the payload's linecache). Falls back to plain cloudpickle when
    its code reducer is not where this cloudpickle version keeps it."""
    code_reduce = getattr(getattr(cloudpickle, "cloudpickle", None), "_code_reduce", None)
    if code_reduce is None:
        return cloudpickle.dumps(obj)

    def reduce_code(code: types.CodeType) -> tuple:
        ctor, ctor_args = code_reduce(code)
        return ctor, tuple(code.co_filename if isinstance(a, str) and a == "<dynamic-code>"
                           else a for a in ctor_args)

    class Pickler(cloudpickle.Pickler):
        dispatch_table = collections.ChainMap({types.CodeType: reduce_code},
                                              cloudpickle.Pickler.dispatch_table)

    buf = io.BytesIO()
    Pickler(buf).dump(obj)
    return buf.getvalue()


def _payload(fn: Callable[..., Any], args: tuple, kwargs: dict, return_all: bool) -> bytes:
    """payload.pkl: plain-pickled metadata (read first: it sets up sys.path), then
    (fn, args, kwargs) pickled by value with cloudpickle."""
    try:
        import cloudpickle
    except ImportError as e:
        raise ImportError("notebook_launcher needs cloudpickle to send fn to the ranks: "
                          "pip install cloudpickle") from e
    meta = {
        "sys_path": [p for p in sys.path if isinstance(p, str)],
        "argv": list(sys.argv),
        "return_all": return_all,
        # IPython keeps cell sources here with mtime None; real files are read from disk.
        "linecache": {k: v for k, v in linecache.cache.items() if len(v) == 4 and v[1] is None},
    }
    try:
        call = _dumps_keeping_filenames(cloudpickle, (fn, tuple(args), kwargs))
    except Exception as e:
        raise TypeError(f"fn, args and kwargs could not be sent to the ranks with cloudpickle: "
                        f"{type(e).__name__}: {e}. Objects such as open files, locks, sockets or "
                        f"CUDA tensors cannot travel: create them inside fn (or pass "
                        f"start_method='fork')") from e
    return pickle.dumps(meta) + call


def notebook_launcher(fn: Callable[..., Any], args: Sequence[Any] = (),
                      kwargs: dict[str, Any] | None = None, nprocs: int | None = None,
                      gpus: str | Sequence[int] | None = None, timeout: float | None = None,
                      return_all: bool = False, start_method: str = "spawn") -> Any:
    """Runs fn(*args, **kwargs) on nprocs ranks with the process group set up, and returns rank
    0's return value (with return_all=True, the list of every rank's value, by rank).

    Each rank is a new process with torchrun's environment variables (RANK, WORLD_SIZE,
    MASTER_ADDR, a fresh free MASTER_PORT, a fresh DDPC_TOKEN; OMP_NUM_THREADS=1 unless set);
    it calls ddpc.init_process_group(), fn, then ddpc.destroy_process_group(). A call of
    ddpc.init_process_group() in fn (as torch.multiprocessing.spawn code makes) is a no-op
    when its rank, world_size and backend do not conflict with that group.

    fn: any callable; with start_method="spawn" (the default) it travels by value with
        cloudpickle, so functions, classes, closures and lambdas defined in notebook cells work,
        and the ranks start clean even when this process already initialised CUDA.
        start_method="fork" forks this process instead (nothing is pickled; refused once CUDA
        is initialised here).
    nprocs: number of ranks; default one per visible GPU (or per entry of gpus), else 2.
    gpus: physical GPU indices (list or "2,3") or "auto" (the idle GPUs with the most free
        memory, via nvidia-smi); sets CUDA_VISIBLE_DEVICES for the ranks.
    timeout: seconds for the whole run; None waits as long as it takes.

    Output of every rank streams into the cell as it happens, as "[rank0]: ...". Raises
    WorkerError (a ddpc.DistributedError) carrying the traceback of the rank that failed first,
    after stopping the others; ddpc.DistributedTimeoutError when timeout passes; TypeError or
    ValueError for bad arguments. On KeyboardInterrupt (interrupting the cell) the ranks get
    SIGINT, then SIGKILL after 3 s; no process outlives the call.
    """
    kwargs = {} if kwargs is None else kwargs
    gpu_spec = _check_arguments(fn, args, kwargs, nprocs, gpus, timeout, return_all,
                                start_method)
    _C.check_settings()  # a DDPC_* value every rank would refuse: ValueError before any starts
    counted: list[int] = []

    def gpu_count() -> int:
        if not counted:
            counted.append(_gpu_count_in_subprocess())
        return counted[0]

    if gpu_spec is None and nprocs is None:
        nprocs = gpu_count() or 2
    try:
        plan = plan_devices(gpu_spec, nprocs, gpu_count=gpu_count)
    except ValueError as e:
        raise ValueError(f"gpus={gpus!r}: {e}") from None
    for note in plan.notes:
        print(f"notebook_launcher: note: {note}", file=sys.stderr)
    for name, text in (_settings.unknown_names(os.environ)
                       + _settings.misspelt_visible_devices(os.environ)):
        print(f"notebook_launcher: warning: {text}", file=sys.stderr)
    payload = _payload(fn, args, kwargs, return_all) if start_method == "spawn" else b""

    out, err = sys.stdout, sys.stderr
    lock = threading.Lock()

    def sink(worker: Worker, stream: str, line: bytes) -> None:
        text = f"[rank{worker.rank}]: {line.decode('utf-8', 'replace')}\n"
        target = out if stream == "stdout" else err
        with lock:
            try:
                target.write(text)
                target.flush()
            except (OSError, ValueError):
                pass  # the notebook's stream went away; keep draining the pipe

    job_dir = tempfile.mkdtemp(prefix="ddpc-notebook-")
    group = WorkerGroup(sink, STOP_GRACE_S)
    try:
        _start_ranks(group, plan, job_dir, payload, fn, tuple(args), kwargs, return_all,
                     start_method)
        return _wait(group, plan.nproc, job_dir, timeout, return_all, plan.rank_gpus)
    finally:
        _stop_for_good(group)
        shutil.rmtree(job_dir, ignore_errors=True)


def _start_ranks(group: WorkerGroup, plan: DevicePlan, job_dir: str, payload: bytes,
                 fn: Callable[..., Any], args: tuple, kwargs: dict, return_all: bool,
                 start_method: str) -> None:
    """Starts every rank of one call (fresh port, token and run id) and adds it to group."""
    nproc = plan.nproc
    port = free_port()
    token = secrets.token_hex(16)
    run_id = uuid.uuid4().hex
    base = dict(os.environ)
    if "OMP_NUM_THREADS" not in base and nproc > 1:
        base["OMP_NUM_THREADS"] = "1"
    if payload:
        with open(os.path.join(job_dir, "payload.pkl"), "wb") as f:
            f.write(payload)
    for rank in range(nproc):
        env = rank_env(base, rank=rank, local_rank=rank, world_size=nproc,
                       local_world_size=nproc, node_rank=0, nnodes=1, master_addr="127.0.0.1",
                       master_port=port, restart_count=0, max_restarts=0, run_id=run_id,
                       token=token, error_file=error_path(job_dir, rank),
                       cuda_visible_devices=plan.cuda_visible_devices)
        try:
            if start_method == "spawn":
                proc: Any = subprocess.Popen(
                    [sys.executable, "-m", "ddpc._nbworker", job_dir], env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                    start_new_session=True)
            else:
                proc = _fork_rank(fn, args, kwargs, env, job_dir, return_all)
        except OSError as e:
            _stop_for_good(group)
            raise WorkerError("notebook_launcher: " + start_failure(rank, rank, nproc, e,
                                                                    "nprocs"), rank) from None
        group.add(Worker(rank, rank, proc, error_path(job_dir, rank)))


def _wait(group: WorkerGroup, nproc: int, job_dir: str, timeout: float | None,
          return_all: bool, rank_gpus: Any = None) -> Any:
    """Waits for every rank; stops the rest and raises on the first failure or the timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        running = group.running()  # before failures(): see Launcher.watch
        failures = group.failures()
        if failures:
            first = first_failure(group)
            if any_waited_for_others(group):
                group.dump_stacks()
            group.stop(signal.SIGTERM)
            group.finish()
            raise _worker_error(group, first, job_dir, rank_gpus)
        if not running:
            group.finish()
            break
        if deadline is not None and time.monotonic() > deadline:
            running = group.running()
            group.dump_stacks()  # before stopping: where each rank was is what the user needs
            group.stop(signal.SIGTERM)
            group.finish()
            where = "".join("\n".join([f"\n  rank {w.rank}:"] + ["    " + ln
                                                                for ln in stack_lines(w)])
                            for w in running)
            raise _C.DistributedTimeoutError(
                f"notebook_launcher: rank(s) {[w.rank for w in running]} still running after "
                f"timeout={timeout} s; stopped all ranks. Raise timeout (or pass None) if the "
                f"work needs longer" + (f"\n\nwhere they were:{where}" if where else ""))
        group.wait_change(0.1)
    import cloudpickle

    ranks = range(nproc) if return_all else [0]
    results = []
    for r in ranks:
        try:
            with open(result_path(job_dir, r), "rb") as f:
                results.append(cloudpickle.load(f))
        except FileNotFoundError:
            raise WorkerError(f"rank {r} exited with code 0 but sent no return value back: did "
                              f"fn end the process itself (os._exit)?", r) from None
        except Exception as e:  # noqa: BLE001 - whatever unpickling the user's object raises
            raise WorkerError(f"the return value of rank {r} could not be loaded in this "
                              f"process: {type(e).__name__}: {e}. Return plain data (numbers, "
                              f"arrays, tensors on cpu), or objects of modules this process "
                              f"can import too", r) from None
    return results if return_all else results[0]


def _worker_error(group: WorkerGroup, first: Worker, job_dir: str,
                  rank_gpus: Any = None) -> WorkerError:
    report = first.error_report() or {}
    exception = None
    try:
        with open(exception_path(job_dir, first.rank), "rb") as f:
            exception = pickle.load(f)
    except Exception:  # noqa: BLE001 - missing or not unpicklable here: the text suffices
        pass
    if report.get("traceback"):
        head = (f"rank {first.rank} raised {report.get('exception_type')}: "
                f"{report.get('message')}")
        body = f"traceback of rank {first.rank}:\n{report['traceback'].rstrip()}"
        oom = oom_lines(report, group, first, rank_gpus)
        if oom:
            body += "\n\n" + "\n".join(oom)
    else:
        head = f"rank {first.rank} died with {describe_exit(first.returncode)}"
        body = (f"last lines of rank {first.rank}'s stderr:\n" + "\n".join(first.tail)
                if first.tail else f"rank {first.rank} wrote nothing to stderr")
    others = "\n".join("\n".join([f"  rank {w.rank}: {describe_other(w)}"] +
                                 ["    " + ln for ln in stack_lines(w)])
                       for w in sorted(group.workers, key=lambda w: w.rank) if w is not first)
    message = f"{head}\n\n{body}" + (f"\n\nother ranks:\n{others}" if others else "")
    return WorkerError(message, first.rank, report.get("exception_type"),
                       report.get("traceback"), exception)


def _stop_for_good(group: WorkerGroup) -> None:
    """Stops every rank that still runs (SIGINT, then SIGKILL) and kills their process groups.
    A second interrupt while this runs only makes it skip the grace period: it never leaves
    a rank behind."""
    first_signal = signal.SIGINT
    while True:
        try:
            if group.running():
                group.stop(first_signal)
            group.finish()
            return
        except KeyboardInterrupt:
            first_signal = signal.SIGKILL
