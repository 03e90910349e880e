"""python -m ddpc.launch: starts one process per rank with torchrun's environment variables,
prefixes their output with the rank, watches them, and on the first failure stops the rest and
says which rank failed and why (its Python traceback, exit code or signal)."""
from __future__ import annotations

import argparse
import collections
import contextvars
import dataclasses
import errno
import functools
import importlib.util
import json
import os
import resource
import secrets
import select
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from typing import Any, Callable, Sequence

from ddpc import _oom, _settings, doctor
from ddpc._worker import STACK_SIGNAL

DEFAULT_MASTER_PORT = 29500  # torchrun's default, so multi-node firewall rules carry over
TAIL_LINES = 20              # stderr lines kept per rank for the failure summary
PARTIAL_FLUSH_S = 1.0        # a line without newline is shown after this long without output
MAX_LINE = 64 * 1024         # longer lines are cut into pieces rather than held in memory
OUTPUT_JOIN_S = 2.0          # how long to wait for the last output after the processes exit
STACK_WAIT_S = 3.0           # how long ranks get to print their Python stacks when asked
STACK_LINES = 40             # stack lines kept per rank for the failure summary
FATAL_LINES = 400            # lines of a crash report (faulthandler's) kept per rank
MAX_LOCAL_RANKS = 65536      # more processes than any one machine runs: a typo, not a job
MAX_WORLD_SIZE = 2 ** 31 - 1  # ranks are 32-bit in the process group
FAILURE_WINDOW_S = 1.0       # failures this close together are one event: the cause is picked
MAX_TIMEOUT_KILL_S = 3600.0  # --timeout-kill's bound: stopping a rank that ignores SIGTERM ends
DEFAULT_TIMEOUT_KILL_S = 5.0

SIGNAL_HINTS = {
    "SIGKILL": "likely the out-of-memory killer: check dmesg / lower the batch size",
    "SIGBUS": "often a full /dev/shm: check df -h /dev/shm (docker: --shm-size)",
    "SIGSEGV": "a crash in native code: rerun with DDPC_DEBUG=1 or under gdb",
    "SIGABRT": "a native library aborted: its message is in the stderr lines above",
}


# ------------------------------------------------------------------------------------ GPUs

@dataclasses.dataclass
class GpuInfo:
    """One physical GPU as nvidia-smi reports it (indices ignore CUDA_VISIBLE_DEVICES)."""
    index: int
    bus_id: str
    uuid: str
    name: str
    free_mib: int
    total_mib: int
    pids: list[int] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        return (f"GPU {self.index} ({self.bus_id}, {self.name}, "
                f"{self.free_mib / 1024:.1f} of {self.total_mib / 1024:.1f} GiB free)")


def parse_gpu_csv(text: str) -> list[GpuInfo]:
    """Parses `nvidia-smi --query-gpu=index,pci.bus_id,uuid,name,memory.free,memory.total
    --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 6:
            continue
        index, bus_id, gpu_uuid, name, free, total = fields
        gpus.append(GpuInfo(int(index), bus_id, gpu_uuid, name, _mib(free), _mib(total)))
    return gpus


def parse_apps_csv(text: str) -> dict[str, list[int]]:
    """Parses `nvidia-smi --query-compute-apps=gpu_uuid,pid --format=csv,noheader,nounits`
    into {gpu uuid: [pid, ...]}."""
    apps: dict[str, list[int]] = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) >= 2 and fields[1].isdigit():
            apps.setdefault(fields[0], []).append(int(fields[1]))
    return apps


def _mib(field: str) -> int:
    try:
        return int(float(field))
    except ValueError:  # "[N/A]" on some MIG and virtual GPUs
        return 0


def query_gpus() -> list[GpuInfo]:
    """The machine's physical GPUs with free memory and the compute processes on each.
    Raises RuntimeError when nvidia-smi is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise RuntimeError("nvidia-smi was not found on PATH, so the physical GPUs cannot be "
                           "listed (install the NVIDIA driver utilities, or pass no --gpus)")

    def run(query: str) -> str:
        try:
            res = subprocess.run([smi, query, "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(f"{smi} {query} failed: {e}") from e
        if res.returncode != 0:
            raise RuntimeError(f"{smi} {query} exited with {res.returncode}: "
                               f"{(res.stderr or res.stdout).strip()}")
        return res.stdout

    gpus = parse_gpu_csv(run("--query-gpu=index,pci.bus_id,uuid,name,memory.free,memory.total"))
    apps = parse_apps_csv(run("--query-compute-apps=gpu_uuid,pid"))
    for g in gpus:
        g.pids = apps.get(g.uuid, [])
    return gpus


def visible_gpu_count() -> int:
    """CUDA devices this process may use (honours CUDA_VISIBLE_DEVICES); 0 when the extension
    is missing or was built without CUDA."""
    try:
        from ddpc import _C
    except ImportError:
        return 0
    return int(_C.cuda_device_count())


def parse_gpu_list(spec: str) -> list[int]:
    """'2,3' -> [2, 3]; raises ValueError on anything else."""
    parts = [p.strip() for p in spec.split(",")]
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"expected 'auto' or comma-separated GPU indices such as 2,3; "
                         f"got {spec!r}")
    indices = [int(p) for p in parts]
    if len(set(indices)) != len(indices):
        raise ValueError(f"GPU indices must be distinct; got {spec!r}")
    return indices


@dataclasses.dataclass
class DevicePlan:
    """How many ranks this node runs and which GPU each one gets."""
    nproc: int
    cuda_visible_devices: str | None        # set for the workers when GPUs were chosen
    rank_gpus: list[GpuInfo | None]          # per local rank; None: unknown or no GPU
    notes: list[str]
    gpus: int = 0                            # how many of the ranks have a GPU


def _sharing_gpus() -> bool:
    """DDPC_SHARE_GPUS=1 in the launcher's environment, which its ranks inherit (a value that is
    not a flag was refused before the plan, with the others: _settings.bad_values)."""
    try:
        from ddpc import _C
    except ImportError:
        return False
    return bool(_C.setting_flag("DDPC_SHARE_GPUS", False))


def plan_devices(gpus: str | None, nproc: int | None,
                 gpu_count: Callable[[], int] = visible_gpu_count) -> DevicePlan:
    """Resolves --gpus and --nproc-per-node (None meaning one rank per visible GPU, else 1).
    gpu_count counts the visible GPUs (a caller that must not touch CUDA itself passes one that
    asks a subprocess). Raises ValueError with a message for the user when the request cannot
    be met."""
    if gpus is None:
        count = gpu_count()
        n = nproc if nproc is not None else max(count, 1)
        notes = []
        infos = _visible_gpu_infos(min(count, n))
        if 0 < count < n and _sharing_gpus():
            notes.append(f"{n} ranks share {count} visible GPU(s) (DDPC_SHARE_GPUS=1): local "
                         f"rank k runs on GPU k % {count}, slowly")
            return DevicePlan(n, None, [infos[k % count] for k in range(n)], notes, n)
        if 0 < count < n:
            notes.append(f"{n} ranks but {count} visible GPUs: local ranks {count}..{n - 1} "
                         f"have no GPU of their own (under NCCL they fail; DDPC_SHARE_GPUS=1 "
                         f"lets ranks share GPUs, to run or debug the job on fewer, slowly)")
        return DevicePlan(n, None, infos + [None] * (n - count), notes, min(count, n))
    if gpus == "auto":
        try:
            physical = query_gpus()
        except RuntimeError as e:
            raise ValueError(f"auto needs nvidia-smi: {e}") from e
        if not physical:
            raise ValueError("auto: nvidia-smi lists no GPUs on this machine")
        idle = sorted((g for g in physical if not g.pids), key=lambda g: -g.free_mib)
        n = nproc if nproc is not None else len(idle)
        if n == 0 or len(idle) < n:
            busy = "; ".join(f"GPU {g.index}: pids {', '.join(map(str, g.pids))}"
                             for g in physical if g.pids)
            raise ValueError(f"auto: {n or 'any'} idle GPU(s) needed but only {len(idle)} of "
                             f"{len(physical)} have no other processes ({busy}); stop those "
                             f"processes or pass the indices, e.g. --gpus 0,1")
        chosen = sorted(idle[:n], key=lambda g: g.index)
        return DevicePlan(n, ",".join(str(g.index) for g in chosen), list(chosen), [], n)
    indices = parse_gpu_list(gpus)
    share = nproc is not None and nproc > len(indices) and _sharing_gpus()
    if nproc is not None and nproc != len(indices) and not share:
        raise ValueError(f"{gpus} lists {len(indices)} GPU(s) but --nproc-per-node is {nproc}; "
                         f"each rank needs one GPU of its own (leave out --nproc-per-node, or set "
                         f"DDPC_SHARE_GPUS=1 to run more ranks than GPUs, slowly)")
    try:
        by_index = {g.index: g for g in query_gpus()}
    except RuntimeError:
        # Without nvidia-smi the CUDA count is physical only while nothing narrows it.
        if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            raise ValueError(f"{gpus}: nvidia-smi is not available and CUDA_VISIBLE_DEVICES is "
                             f"set, so physical indices cannot be checked; unset "
                             f"CUDA_VISIBLE_DEVICES or install nvidia-smi") from None
        by_index = {i: None for i in range(gpu_count())}
    missing = [i for i in indices if i not in by_index]
    if missing:
        present = ", ".join(map(str, sorted(by_index))) or "none"
        raise ValueError(f"GPU index {missing[0]} is not present on this machine "
                         f"(GPUs present: {present})")
    if share:
        shared = [indices[k % len(indices)] for k in range(nproc)]
        return DevicePlan(nproc, ",".join(map(str, indices)), [by_index[i] for i in shared],
                          [f"{nproc} ranks share GPU(s) {gpus} (DDPC_SHARE_GPUS=1): local ranks "
                           f"0..{nproc - 1} run on GPUs {','.join(map(str, shared))}, slowly"],
                          nproc)
    return DevicePlan(len(indices), ",".join(map(str, indices)),
                      [by_index[i] for i in indices], [], len(indices))


def _visible_gpu_infos(n: int) -> list[GpuInfo | None]:
    """nvidia-smi details of visible devices 0..n-1, mapped through CUDA_VISIBLE_DEVICES when it
    holds indices or UUIDs; None where the mapping is unknown (or nvidia-smi is missing)."""
    if n == 0:
        return []
    try:
        physical = query_gpus()
    except RuntimeError:
        return [None] * n
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        order: list[GpuInfo | None] = list(physical)
    else:
        by_key = {str(g.index): g for g in physical} | {g.uuid: g for g in physical}
        order = [by_key.get(k.strip()) for k in visible.split(",") if k.strip()]
    return (order + [None] * n)[:n]


# ------------------------------------------------------------------------------ processes

@dataclasses.dataclass
class Worker:
    """One rank's process. `proc` is a subprocess.Popen or anything with pid, stdout, stderr
    (binary pipes), wait() and returncode; it leads its own process group."""
    rank: int
    local_rank: int
    proc: Any
    error_file: str | None = None
    tail: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    threads: list[threading.Thread] = dataclasses.field(default_factory=list)
    returncode: int | None = None
    exited_at: float | None = None
    signalled: int | None = None   # the last signal the launcher sent this rank
    capturing: list[str] | None = None  # stderr lines kept while its stacks are being printed
    stack: list[str] | None = None      # its threads' Python stacks, when asked for them
    python: bool = True  # False: an executable of --no-python (it has no stacks to ask for)
    fatal: list[str] | None = None  # faulthandler's report of a crash (from "Fatal Python error")

    def error_report(self) -> dict | None:
        """The JSON report the worker wrote on an uncaught exception, or None."""
        if not self.error_file:
            return None
        try:
            with open(self.error_file, encoding="utf-8") as f:
                report = json.load(f)
        except (OSError, ValueError):
            return None
        return report if isinstance(report, dict) else None


Sink = Callable[[Worker, str, bytes], None]


def terminal_view(line: bytes) -> bytes:
    """What a terminal shows of a line with carriage returns (progress bars): its last
    non-empty \\r-separated piece, so the rank prefix is not overwritten."""
    if b"\r" not in line:
        return line
    pieces = [p for p in line.split(b"\r") if p]
    return pieces[-1] if pieces else b""


def pump(pipe: Any, on_line: Callable[[bytes], None],
         on_chunk: Callable[[bytes], None] | None = None) -> None:
    """Reads a pipe until EOF and calls on_line for each line (without the newline). A partial
    line is passed on once it has waited PARTIAL_FLUSH_S for its newline (so prompts and
    \\r-progress bars show, about once a second), or when it reaches MAX_LINE bytes. on_chunk,
    if given, gets every read's bytes first, exactly as the process wrote them (for log files,
    which keep partial lines and \\r frames that the console's lines cannot)."""
    fd = pipe.fileno()
    buf = b""
    since = 0.0  # when the partial line in buf began
    continued = False  # part of the current line was already passed on
    while True:
        wait = None if not buf else max(0.0, since + PARTIAL_FLUSH_S - time.monotonic())
        try:
            ready, _, _ = select.select([fd], [], [], wait)
        except (OSError, ValueError):
            break  # the pipe was closed under us: finish with what we have
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            if on_chunk is not None:
                on_chunk(chunk)
            had_partial = bool(buf)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if not (continued and not terminal_view(line)):  # a bare end of a shown line
                    on_line(line)
                continued = False
            if buf and (lines or not had_partial):
                since = time.monotonic()
            while len(buf) >= MAX_LINE:
                on_line(buf[:MAX_LINE])
                buf = buf[MAX_LINE:]
        if buf and time.monotonic() - since >= PARTIAL_FLUSH_S:
            on_line(buf)
            buf = b""
            continued = True
    if buf:
        on_line(buf)


class WorkerGroup:
    """The ranks of one attempt: their output is pumped to `sink` line by line, their exits are
    recorded in order, and they are stopped together (whole process groups, so grandchildren
    such as data-loader workers go too)."""

    def __init__(self, sink: Sink, timeout_kill: float, raw_sink: Sink | None = None) -> None:
        self.sink = sink
        self.raw_sink = raw_sink  # gets the pipes' bytes as read, before they are cut into lines
        self.timeout_kill = timeout_kill
        self.workers: list[Worker] = []
        self.changed = threading.Condition()
        self.finished = False

    def add(self, worker: Worker) -> None:
        """Starts the output readers and the exit waiter of a started process."""
        self.workers.append(worker)
        for name in ("stdout", "stderr"):
            pipe = getattr(worker.proc, name)
            if pipe is not None:
                # Each reader runs in a copy of the caller's context: Jupyter routes output by a
                # context variable, so lines land in the cell that started the ranks.
                ctx = contextvars.copy_context()
                on_chunk = (None if self.raw_sink is None else
                            functools.partial(self.raw_sink, worker, name))
                t = threading.Thread(target=ctx.run,
                                     args=(pump, pipe, self._line_handler(worker, name),
                                           on_chunk),
                                     name=f"ddpc-rank{worker.rank}-{name}", daemon=True)
                t.start()
                worker.threads.append(t)
        threading.Thread(target=self._wait, args=(worker,), name=f"ddpc-rank{worker.rank}-wait",
                         daemon=True).start()

    def _line_handler(self, worker: Worker, stream: str) -> Callable[[bytes], None]:
        def on_line(line: bytes) -> None:
            line = terminal_view(line)
            if stream == "stderr":
                text = line.decode("utf-8", "replace")
                worker.tail.append(text)
                if text.startswith("Fatal Python error:"):
                    worker.fatal = [text]
                elif worker.fatal is not None and len(worker.fatal) < FATAL_LINES:
                    worker.fatal.append(text)
                capturing = worker.capturing
                if capturing is not None:
                    capturing.append(text)
            self.sink(worker, stream, line)
        return on_line

    def _wait(self, worker: Worker) -> None:
        rc = worker.proc.wait()
        with self.changed:
            # exited_at first: readers that skip the lock may see a returncode at any moment.
            worker.exited_at = time.monotonic()
            worker.returncode = rc
            self.changed.notify_all()

    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.returncode is None]

    def failures(self) -> list[Worker]:
        """Ranks that exited non-zero, in the order they exited."""
        failed = [w for w in self.workers if w.returncode not in (None, 0)]
        return sorted(failed, key=lambda w: (w.exited_at, w.rank))

    def wait_change(self, timeout: float) -> None:
        """Returns when a rank exits or after `timeout` seconds (signal handlers run meanwhile)."""
        with self.changed:
            self.changed.wait(timeout)

    def dump_stacks(self) -> None:
        """Asks every running rank for its threads' Python stacks (STACK_SIGNAL, to the rank's
        process alone: its children would die of it) and keeps what each prints in its `stack`.
        Ranks that already wrote an error report are left out: they are exiting, not stuck, and
        the signal would kill them once the interpreter stopped handling it. Waits until the
        lines stop coming, at most STACK_WAIT_S."""
        asked = []
        for w in self.running():
            if not w.python or w.error_report() is not None:
                continue  # (the signal would kill an executable: its default action)
            w.capturing = []
            try:
                os.kill(w.proc.pid, STACK_SIGNAL)
                w.signalled = STACK_SIGNAL
                asked.append(w)
            except (ProcessLookupError, PermissionError):
                w.capturing = None
        deadline = time.monotonic() + STACK_WAIT_S
        seen, quiet_since = -1, time.monotonic()
        while asked and time.monotonic() < deadline:
            time.sleep(0.05)
            lines = [len(w.capturing or ()) for w in asked]
            if sum(lines) != seen:
                seen, quiet_since = sum(lines), time.monotonic()
            elif all(lines) and time.monotonic() - quiet_since > 0.3:
                break
        for w in asked:
            got = w.capturing or []
            # A rank that exited meanwhile printed nothing because it was gone, not stuck.
            w.stack = _stack_lines(got) if got or w.returncode is None else None
            w.capturing = None

    def signal_all(self, sig: int) -> None:
        """Sends sig to the process group of every rank still running."""
        for w in self.running():
            w.signalled = sig
            _killpg(w.proc.pid, sig)

    def stop(self, first_signal: int = signal.SIGTERM,
             escalate: Callable[[], bool] | None = None) -> str:
        """Sends first_signal to every running rank, then SIGKILL to those still running after
        timeout_kill seconds (or as soon as escalate() says so, e.g. on a second Ctrl-C).
        Returns how it ended, for messages: "signal" (every rank exited after first_signal),
        "timeout" or "escalated" (SIGKILL was sent, after timeout_kill or at once)."""
        self.signal_all(first_signal)
        deadline = time.monotonic() + self.timeout_kill
        how = "timeout"
        while self.running() and time.monotonic() < deadline:
            if escalate is not None and escalate():
                how = "escalated"
                break
            self.wait_change(0.05)
        if not self.running():
            return "signal"
        self.signal_all(signal.SIGKILL)
        while self.running():
            self.wait_change(0.05)
        return how

    def finish(self) -> None:
        """After every rank exited: kills what is left in their process groups (grandchildren
        that outlived their rank) and waits briefly for the last output lines."""
        if self.finished:
            return
        for w in self.workers:
            _killpg(w.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + OUTPUT_JOIN_S
        for w in self.workers:
            for t in w.threads:
                t.join(max(0.0, deadline - time.monotonic()))
        self.finished = True  # only now: an interrupted finish() must be redone in full


def _stack_lines(lines: list[str]) -> list[str]:
    """The lines of a faulthandler dump worth showing: ddpc's own worker frames and runpy's are
    left out, and at most STACK_LINES are kept."""
    keep = [ln for ln in lines if not (ln.lstrip().startswith('File "<frozen runpy>"') or
                                       "ddpc/_worker.py" in ln or "ddpc/_nbworker.py" in ln)]
    if len(keep) > STACK_LINES:
        keep = keep[:STACK_LINES] + [f"... ({len(keep) - STACK_LINES} more lines in its output "
                                     f"above)"]
    return keep


def waited_for_others(report: dict | None) -> bool:
    """Did this failure come from waiting for other ranks (a collective timed out)? Then the ranks
    still running are where the job hung, and their stacks say where."""
    return bool(report) and str(report.get("exception_type", "")).endswith(
        "DistributedTimeoutError")


def first_failure(group: WorkerGroup,
                  interrupted: Callable[[], bool] = lambda: False) -> Worker:
    """The failure to name as the cause, once at least one rank failed. One rank's error
    makes others fail soon after (rank 0 times out, stops serving the store, and rank 1
    gets a PeerError for the lost connection, possibly exiting first), so this waits up to
    FAILURE_WINDOW_S after the first exit while the best candidate is such a consequence, or
    while ranks that wrote an error report are still exiting; then it picks by kind (see
    failure_kind), then by exit order. A rank that wrote its report counts as failed even
    if it is still exiting."""
    deadline = time.monotonic() + FAILURE_WINDOW_S
    while True:
        # running() before failures(): a rank exiting between the two calls is in one.
        exiting = [w for w in group.running() if w.error_report() is not None]
        failed = group.failures()
        best = min(failed + exiting, key=lambda w: (
            failure_kind(w.error_report()), w.exited_at is None,
            w.exited_at or 0.0, w.rank))
        settled = failure_kind(best.error_report()) < 2 and not exiting
        if settled or time.monotonic() >= deadline or interrupted():
            return best
        group.wait_change(0.05)


def failure_kind(report: dict | None) -> int:
    """How likely a failure is the cause rather than a consequence: 0 for a rank's own error
    (or a death without a report), 1 for a timeout waiting for others, 2 for a PeerError (a
    peer or the store went away, usually because another rank failed)."""
    if waited_for_others(report):
        return 1
    if report and str(report.get("exception_type", "")).endswith("PeerError"):
        return 2
    return 0


def any_waited_for_others(group: WorkerGroup) -> bool:
    """Did any rank fail by timing out while waiting for others? Then the job hung somewhere,
    and the stacks of the ranks still running say where."""
    return any(waited_for_others(w.error_report()) for w in group.workers)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already (or its id was reused by someone else's group)


def free_port() -> int:
    """A TCP port that was free a moment ago (bind port 0); the store binds it right after."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def worker_pythonpath(env: dict[str, str]) -> str:
    """PYTHONPATH for workers, so that `python -m ddpc._worker` imports the ddpc this process
    runs even when it was found through the working directory or sys.path edits."""
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    current = env.get("PYTHONPATH", "")
    known = set(site.getsitepackages()) | {site.getusersitepackages()}
    known |= {os.path.abspath(p) for p in current.split(os.pathsep) if p}
    if pkg_parent in known:
        return current
    return os.pathsep.join(p for p in (current, pkg_parent) if p)


def launcher_rank_base_env(environ: Any) -> dict[str, str]:
    """The environment the ranks of `ddpc.launch` start from: the user's, plus torchrun's
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless it is set (torch's NCCL then ends a rank on an error
    or timeout rather than leaving it hung). Importing ddpc set NCCL_RUNTIME_CONNECT=0 in this
    process when the user had not set it: that default is not passed on. (A rank that imports
    ddpc, as every rank of a Python target does through ddpc._worker, sets it in its own
    process.)"""
    from ddpc import distributed
    env = dict(environ)
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if distributed._NCCL_RUNTIME_CONNECT_IS_OURS:
        env.pop("NCCL_RUNTIME_CONNECT", None)
    return env


def rank_env(base: dict[str, str], *, rank: int, local_rank: int, world_size: int,
             local_world_size: int, node_rank: int, nnodes: int, master_addr: str,
             master_port: int, restart_count: int, max_restarts: int, run_id: str, token: str,
             error_file: str, cuda_visible_devices: str | None) -> dict[str, str]:
    """The environment of one rank: the variables torchrun sets, plus ddpc's own."""
    env = dict(base)
    env.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "DDPC_TOKEN": token,
        "DDPC_ERROR_FILE": error_file,
        "DDPC_PARENT_PID": str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": worker_pythonpath(base),
    })
    # torchrun's TORCHELASTIC_USE_AGENT_STORE would make torch look for a store that no agent
    # serves here; rank 0 serves it, as with a plain env:// init.
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if cuda_visible_devices is not None:
        # nvidia-smi numbers GPUs in PCI bus order; make CUDA agree so "2,3" means those GPUs.
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


def start_failure(rank: int, local: int, nproc: int, error: OSError, fewer: str) -> str:
    """What to say when rank's process could not be started (local of nproc on this node):
    the cause and what to change. fewer: how the user asks for fewer ranks."""
    if error.errno in (errno.EMFILE, errno.ENFILE):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
        hint = (f"the open-file limit is reached (ulimit -n is {limit}; each rank holds about 4 "
                f"descriptors here): raise it, e.g. ulimit -n 65536, or lower {fewer}")
    elif error.errno == errno.EAGAIN:
        hint = f"the process limit is reached: raise ulimit -u, or lower {fewer}"
    elif error.errno == errno.ENOMEM:
        hint = f"the machine is out of memory: free some, or lower {fewer}"
    else:
        hint = f"fix the cause, or lower {fewer}"
    started = (f"; stopped the {local} rank(s) already started" if local else "")
    return (f"could not start rank {rank} (local rank {local} of {nproc}): "
            f"{error.strerror or error}{started}. {hint[0].upper()}{hint[1:]}")


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def setting_warnings(environ: Any, uses_gpus: bool) -> list[str]:
    """Printed once at the start of a job, since every rank inherits the environment: DDPC_*
    names ddpc does not read and a misspelt CUDA_VISIBLE_DEVICES (typos), and for a job on GPUs
    the doctor's other warnings, on settings that slowed GPU training here (a forced NCCL
    protocol, P2P turned off, CUDA_LAUNCH_BLOCKING, ...)."""
    if not uses_gpus:
        env = dict(environ)
        return [text for _, text in
                _settings.unknown_names(env) + _settings.misspelt_visible_devices(env)]
    return [f"{text} (python -m ddpc.doctor lists every setting)"
            for kind, text in doctor.env_verdicts(dict(environ)) if kind == "WARNING"]


def stop_detail(how: str, signals: Sequence[int], timeout_kill: float) -> str:
    """The end of the message about a stop on a signal: whether SIGKILL was needed, and why
    (how: WorkerGroup.stop's answer; signals: those the launcher got, in order)."""
    if how == "timeout":
        return f", then SIGKILL after {timeout_kill:g} s for those still running"
    if how == "escalated":
        second = signal_name(signals[1]) if len(signals) > 1 else "signal"
        return f", then SIGKILL at once on the second {second}"
    return ""


def describe_exit(rc: int) -> str:
    """'exit code 3', or 'signal SIGKILL (likely the out-of-memory killer: ...)'."""
    if rc >= 0:
        return f"exit code {rc}"
    name = signal_name(-rc)
    hint = SIGNAL_HINTS.get(name)
    return f"signal {name}" + (f" ({hint})" if hint else "")


def exit_status(rc: int) -> int:
    """A shell-style status for a return code: the code itself, or 128 + signal number."""
    return rc if rc >= 0 else 128 - rc


def oom_lines(report: dict | None, group: WorkerGroup, first: Worker,
              rank_gpus: Sequence[GpuInfo | None] | None) -> list[str]:
    """What the failure summary says about a rank that ran out of GPU memory (its report says
    so): on which physical GPU, how full it was, who else holds memory there, what to change.
    rank_gpus: the physical GPU of each visible device (the plan's, per local rank)."""
    if not report:
        return []
    ours = {w.proc.pid for w in group.workers}

    def physical(i: int) -> GpuInfo | None:
        return rank_gpus[i] if rank_gpus and 0 <= i < len(rank_gpus) else None

    def others_on(info: GpuInfo) -> list[int]:
        try:
            now = {g.index: g for g in query_gpus()}
        except RuntimeError:
            return []
        g = now.get(info.index)
        return [p for p in (g.pids if g else []) if p not in ours]

    out: list[str] = []
    for paragraph in _oom.explain(report, first.rank, physical, others_on):
        out += textwrap.wrap(paragraph, 96, break_on_hyphens=False) or [""]
    return out


def failure_summary(group: WorkerGroup, first: Worker, who: str = "ddpc.launch",
                    rank_gpus: Sequence[GpuInfo | None] | None = None) -> str:
    """Which rank failed first and how, its traceback (or last stderr lines), what an
    out-of-memory error means here, and the other ranks. rank_gpus: see oom_lines."""
    how = describe_exit(first.returncode)
    if first.signalled is not None and first.returncode == -first.signalled:
        how = f"it was still exiting when the launcher stopped it ({signal_name(first.signalled)})"
    lines = [f"{who}: rank {first.rank} (local rank {first.local_rank}, pid {first.proc.pid}) "
             f"failed first: {how}"]
    report = first.error_report()
    if report and report.get("traceback"):
        lines.append(f"  rank {first.rank} raised {report.get('exception_type')}: "
                     f"{report.get('message')}")
        lines += ["  " + ln for ln in str(report["traceback"]).rstrip("\n").split("\n")]
        lines += ["  " + ln for ln in oom_lines(report, group, first, rank_gpus)]
    elif first.fatal and first.returncode is not None and first.returncode < 0:
        lines.append(f"  rank {first.rank}'s Python stacks at the crash (faulthandler):")
        lines += ["    " + ln for ln in _stack_lines(
            [ln for ln in first.fatal if not ln.startswith("Extension modules:")])]
    elif first.tail:
        lines.append(f"  last lines of rank {first.rank}'s stderr (no Python traceback was "
                     f"recorded):")
        lines += ["    " + ln for ln in first.tail]
    else:
        lines.append(f"  rank {first.rank} wrote nothing to stderr")
    others = [w for w in group.workers if w is not first]
    if others:
        lines.append("  other ranks:")
        for w in sorted(others, key=lambda w: w.rank):
            lines.append(f"    rank {w.rank}: {describe_other(w)}")
            lines += ["      " + ln for ln in stack_lines(w)]
    return "\n".join(lines)


def stack_lines(w: Worker) -> list[str]:
    """The summary's lines for a rank whose stacks were dumped (none otherwise)."""
    if w.stack is None:
        return []
    if not w.stack:
        return ["it printed no Python stack when asked (a handler of its own for SIGUSR1?)"]
    return ["where its threads were when asked:"] + [
        "  " + ln for ln in w.stack]


def describe_other(w: Worker) -> str:
    rc = w.returncode
    if rc is None:
        return "still running"
    if rc == 0:
        return "finished (exit code 0)"
    report = w.error_report()
    if w.signalled is not None and rc == -w.signalled:
        text = f"stopped by the launcher ({signal_name(w.signalled)})"
    else:
        text = describe_exit(rc)
    if report:
        text += f" after raising {report.get('exception_type')}: {report.get('message')}"
    return text


# ------------------------------------------------------------------------------ the launcher

@dataclasses.dataclass
class LaunchConfig:
    """Validated launch settings for this node."""
    target: list[str]              # ["script.py", args...], ["-m", "module", args...], or
                                   # with no_python ["program", args...]
    plan: DevicePlan
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None        # None: a fresh free port per attempt (single node)
    max_restarts: int
    timeout_kill: float
    run_id: str
    token: str | None              # None: a fresh secret per attempt
    log_dir: str | None = None     # also write each rank's output under this directory
    no_python: bool = False        # target is an executable and its arguments
    console_ranks: tuple[int, ...] | None = None  # --local-ranks-filter: only these on console
    redirects: Any = ()            # --redirects: streams kept off the console (tuple of stream
                                   # names, or {local rank: tuple})
    tee: Any = ()                  # --tee: streams shown even when redirected (same form)
    bind_addr: str | None = None   # --local-addr: DDPC_BIND_ADDR for the ranks
    extra_signals: tuple[int, ...] = ()  # --signals-to-handle: forwarded as they are
    filters: Any = dataclasses.field(default_factory=dict)  # --duplicate-*-filters: {stream:
                                   # substrings}; matching console lines also go to
                                   # attempt_K/filtered_<stream>.log

    def on_console(self, local_rank: int, stream: str) -> bool:
        """Does this local rank's stream go to the launcher's console?"""
        if self.console_ranks is not None and local_rank not in self.console_ranks:
            return False

        def streams(spec: Any) -> tuple[str, ...]:
            return spec.get(local_rank, ()) if isinstance(spec, dict) else spec
        return stream not in streams(self.redirects) or stream in streams(self.tee)


class Launcher:
    """Runs the attempts of one launch and turns signals to the launcher into a clean stop."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.lock = threading.Lock()
        self.signals: list[int] = []
        self.attempt_dir: str | None = None  # --log-dir's directory for the current attempt
        self.logs: dict[tuple[int | None, str], Any] = {}  # (rank, stream) -> file, under lock

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)

    def sink(self, worker: Worker, stream: str, line: bytes) -> None:
        """Writes one worker line, prefixed with its rank, to our stdout or stderr (raw bytes, so
        any encoding or binary noise passes through untouched), and to the filtered log when it
        matches a --duplicate-*-filters substring."""
        out = sys.stdout if stream == "stdout" else sys.stderr
        data = f"[rank{worker.rank}]: ".encode() + line + b"\n"
        with self.lock:
            needles = self.cfg.filters.get(stream) if self.attempt_dir is not None else None
            if needles and any(n in line for n in needles):
                self._log(None, f"filtered_{stream}", data)
            if not self.cfg.on_console(worker.local_rank, stream):
                return
            try:
                out.flush()
                buffer = getattr(out, "buffer", None)
                if buffer is not None:
                    buffer.write(data)
                    buffer.flush()
                else:
                    out.write(data.decode("utf-8", "replace"))
                    out.flush()
            except (OSError, ValueError):
                pass  # our own stdout is gone (closed pipe): keep draining the workers

    def raw_sink(self, worker: Worker, stream: str, chunk: bytes) -> None:
        """Writes a worker's bytes, as read from its pipe, to its --log-dir file: the file holds
        what the rank wrote (a line without its newline yet, \\r progress-bar frames), which the
        console's line-by-line view cannot keep."""
        with self.lock:
            if self.attempt_dir is not None:
                self._log(worker.rank, stream, chunk)

    def _log(self, rank: int | None, stream: str, data: bytes) -> None:
        """Appends to --log-dir's file of this rank and stream, or with rank None to the
        attempt's file named by stream (under self.lock). A file that cannot be written is
        reported once and skipped: the job goes on."""
        key = (rank, stream)
        f = self.logs.get(key)
        if f is None:
            where = [f"rank{rank}"] if rank is not None else []
            path = os.path.join(self.attempt_dir, *where, f"{stream}.log")
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                f = open(path, "ab")
            except OSError as e:
                whose = (f"rank {rank}'s {stream} goes" if rank is not None else
                         "the lines it would hold go")
                print(f"ddpc.launch: cannot write {path}: {e}; {whose} to the console only",
                      file=sys.stderr, flush=True)
                f = False
            self.logs[key] = f
        if f:
            try:
                f.write(data)
                f.flush()
            except OSError:
                pass

    def _close_logs(self) -> None:
        with self.lock:
            for f in self.logs.values():
                if f:
                    f.close()
            self.logs = {}

    def say(self, text: str) -> None:
        with self.lock:
            print(text, file=sys.stderr, flush=True)

    def run(self) -> int:
        """Runs the job; returns the exit status for the launcher."""
        cfg = self.cfg
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) + cfg.extra_signals:
            signal.signal(sig, self._on_signal)
        if "OMP_NUM_THREADS" not in os.environ and cfg.plan.nproc > 1:
            self.say("ddpc.launch: setting OMP_NUM_THREADS=1 for each rank (as torchrun does) to "
                     "avoid oversubscribing the CPU; set it yourself to tune")
        for note in cfg.plan.notes:
            self.say(f"ddpc.launch: note: {note}")
        cpus = usable_cpus()
        if cfg.plan.gpus == 0 and cfg.plan.nproc > cpus:
            self.say(f"ddpc.launch: warning: {cfg.plan.nproc} ranks on a node without GPUs and "
                     f"with {cpus} CPU(s): they share the CPUs and each step waits for the "
                     f"slowest; --nproc-per-node {cpus} or fewer is usually faster")
        for warning in setting_warnings(os.environ, cfg.plan.gpus > 0):
            self.say(f"ddpc.launch: warning: {warning}")
        for local, gpu in enumerate(cfg.plan.rank_gpus):
            if gpu is not None:
                self.say(f"ddpc.launch: rank {cfg.node_rank * cfg.plan.nproc + local} -> "
                         f"{gpu.describe()}")
        restart = 0
        while True:
            status, failed = self.attempt(restart)
            if failed is None or self.signals:
                return status
            if restart >= cfg.max_restarts:
                if cfg.max_restarts:
                    self.say(f"ddpc.launch: gave up after {restart} restart(s) (--max-restarts "
                             f"{cfg.max_restarts}): the last attempt failed too, as above")
                return status
            restart += 1
            self.say(f"ddpc.launch: restarting all {cfg.plan.nproc} local ranks (restart "
                     f"{restart} of {cfg.max_restarts}) because rank {failed.rank} failed with "
                     f"{describe_exit(failed.returncode)}")

    def attempt(self, restart: int) -> tuple[int, Worker | None]:
        """One start of every local rank. Returns (exit status, the rank that failed first or
        None when all succeeded or the launcher was interrupted)."""
        cfg = self.cfg
        port = cfg.master_port if cfg.master_port is not None else free_port()
        token = cfg.token if cfg.token is not None else secrets.token_hex(16)
        nproc = cfg.plan.nproc
        world = cfg.nnodes * nproc
        err_dir = tempfile.mkdtemp(prefix="ddpc-launch-")
        group = WorkerGroup(self.sink, cfg.timeout_kill, raw_sink=self.raw_sink)
        base = launcher_rank_base_env(os.environ)
        if "OMP_NUM_THREADS" not in base and nproc > 1:
            base["OMP_NUM_THREADS"] = "1"
        if cfg.bind_addr is not None:
            base["DDPC_BIND_ADDR"] = cfg.bind_addr
        if cfg.log_dir is not None:
            self.attempt_dir = os.path.join(cfg.log_dir, f"attempt_{restart}")
        try:
            for local in range(nproc):
                if self.signals:
                    break
                rank = cfg.node_rank * nproc + local
                error_file = os.path.join(err_dir, f"rank{rank}-error.json")
                env = rank_env(base, rank=rank, local_rank=local, world_size=world,
                               local_world_size=nproc, node_rank=cfg.node_rank,
                               nnodes=cfg.nnodes, master_addr=cfg.master_addr, master_port=port,
                               restart_count=restart, max_restarts=cfg.max_restarts,
                               run_id=cfg.run_id, token=token, error_file=error_file,
                               cuda_visible_devices=cfg.plan.cuda_visible_devices)
                try:
                    # stdin is inherited, as torchrun's ranks inherit it: piped input reaches
                    # the ranks, and breakpoint() in a rank reads the terminal (the ranks lead
                    # sessions of their own, so the terminal is not theirs to control, but
                    # reading it works). Several ranks reading it share it, as under torchrun.
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "ddpc._worker"]
                        + (["--exec"] if cfg.no_python else []) + cfg.target, env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
                except OSError as e:
                    group.stop(signal.SIGTERM, escalate=lambda: bool(self.signals))
                    self.say("ddpc.launch: " + start_failure(rank, local, nproc, e,
                                                             "--nproc-per-node"))
                    return 1, None
                group.add(Worker(rank, local, proc, error_file, python=not cfg.no_python))
            return self.watch(group)
        finally:
            if group.running():
                group.stop(signal.SIGKILL)
            group.finish()
            shutil.rmtree(err_dir, ignore_errors=True)
            self._close_logs()

    def watch(self, group: WorkerGroup) -> tuple[int, Worker | None]:
        """Waits until every rank succeeded, one failed, or the launcher got a signal."""
        while True:
            if self.signals:
                sig = self.signals[0]
                # Ctrl-C reaches the ranks as Ctrl-C (KeyboardInterrupt); SIGTERM and SIGHUP as
                # SIGTERM; a signal of --signals-to-handle (SLURM's SIGUSR1) as itself.
                forward = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM,
                           signal.SIGHUP: signal.SIGTERM}.get(sig, sig)
                n_running = len(group.running())
                how = group.stop(forward, escalate=lambda: len(self.signals) > 1)
                group.finish()
                self.say(f"ddpc.launch: got {signal_name(sig)}: stopped {n_running} running "
                         f"rank(s) with {signal_name(forward)}"
                         + stop_detail(how, self.signals, self.cfg.timeout_kill))
                return 128 + sig, None
            # running() before failures(): a rank that fails between the two calls is then
            # still running in the first, rather than missing from both and the job a success.
            running = group.running()
            failures = group.failures()
            if failures:
                first = first_failure(group, lambda: bool(self.signals))
                if any_waited_for_others(group):
                    group.dump_stacks()
                group.stop(signal.SIGTERM, escalate=lambda: bool(self.signals))
                group.finish()
                summary = failure_summary(group, first, rank_gpus=self.cfg.plan.rank_gpus)
                self.say(summary)
                if self.attempt_dir is not None:
                    try:
                        with open(os.path.join(self.attempt_dir, "summary.log"), "w") as f:
                            f.write(summary + "\n")
                    except OSError as e:
                        self.say(f"ddpc.launch: cannot write the summary under --log-dir: {e}")
                stopped = first.signalled is not None and first.returncode == -first.signalled
                return (1 if stopped else exit_status(first.returncode)), first
            if not running:
                group.finish()
                return 0, None
            group.wait_change(0.1)


# ---------------------------------------------------------------------------- command line

def _checked(convert: Callable[[str], Any], valid: Callable[[Any], bool],
             expected: str) -> Callable[[str], Any]:
    """An argparse type: convert(text), accepted when valid(value); otherwise the error says what
    was expected and what was given."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not valid(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


_positive_int = _checked(int, lambda v: v >= 1, "a positive integer")
_nonneg_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
# NaN fails the comparison too; inf or 1e300 would leave a rank that ignores SIGTERM running.
_timeout_kill = _checked(float, lambda v: 0 < v <= MAX_TIMEOUT_KILL_S,
                         f"a number of seconds above 0 and at most {MAX_TIMEOUT_KILL_S:g} (how "
                         f"long ranks get to exit after SIGTERM/SIGINT before SIGKILL)")
_port = _checked(int, lambda v: 1 <= v <= 65535, "a TCP port in 1..65535")
# torchrun's words for a number of ranks; resolve_nproc turns them into one.
NPROC_WORDS = ("auto", "cpu", "gpu")
_nproc = _checked(lambda t: t if t in NPROC_WORDS else int(t),
                  lambda v: isinstance(v, str) or 1 <= v <= MAX_LOCAL_RANKS,
                  f"a positive integer up to {MAX_LOCAL_RANKS}, or auto, cpu or gpu")

# torchrun flags ddpc.launch does not have: what to do instead (refused with this advice).
TORCHRUN_ONLY = {
    "--rdzv-conf": "ddpc's rendezvous (rank 0's store) has no options to set: drop it",
    "--role": "ddpc.launch runs one role: drop it",
    "--logs-specs": "ddpc.launch has no pluggable log layout: --log-dir DIR writes "
                    "DIR/attempt_K/rankR/stdout.log and stderr.log (with --redirects and --tee "
                    "as in torchrun): drop it",
    "--event-log-handler": "ddpc.launch emits no torchelastic events; its failure summary (and "
                           "DIR/attempt_K/summary.log with --log-dir) says which rank failed and "
                           "why: drop it",
    "--numa-binding": "ddpc.launch does not pin ranks to CPUs: drop it, or run each rank under "
                      "numactl (--no-python ./run.sh, where run.sh picks the node from "
                      "LOCAL_RANK and runs numactl --cpunodebind=N python train.py)",
    "--virtual-local-rank": "ddpc binds each rank to GPU LOCAL_RANK itself (ddpc.device()) and "
                            "keeps every GPU of the job visible to every rank, so that ranks reach "
                            "each other's memory directly (P2P): drop it (--gpus 2,3 picks the "
                            "GPUs)",
}
TORCHRUN_ONLY_SWITCHES = {"--virtual-local-rank"}  # flags that take no value

STREAM_CODES = {0: (), 1: ("stdout",), 2: ("stderr",), 3: ("stdout", "stderr")}


def _std_spec(text: str) -> Any:
    """torchrun's --redirects / --tee value: 0 (none), 1 (stdout), 2 (stderr) or 3 (both) for
    every local rank, or per local rank as "0:3,1:1" (ranks left out: 0)."""
    def code(t: str) -> tuple[str, ...]:
        t = t.strip()
        if t not in ("0", "1", "2", "3"):
            raise argparse.ArgumentTypeError(
                f"expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), or per local rank as "
                f"0:3,1:1, got {text!r}")
        return STREAM_CODES[int(t)]
    if ":" not in text:
        return code(text)
    per: dict[int, tuple[str, ...]] = {}
    for part in text.split(","):
        rank, sep, value = part.partition(":")
        try:
            r = int(rank)
        except ValueError:
            r = -1
        if not sep or r < 0:
            raise argparse.ArgumentTypeError(
                f"expected LOCAL_RANK:CODE pairs such as 0:3,1:1, got {text!r}")
        per[r] = code(value)
    return per


def _signal_list(text: str) -> tuple[int, ...]:
    """--signals-to-handle: signal names separated by commas, such as SIGTERM,SIGUSR1."""
    sigs = []
    for part in text.split(","):
        name = part.strip().upper()
        if not name:
            continue
        full = name if name.startswith("SIG") else "SIG" + name
        sig = getattr(signal, full, None)
        if not isinstance(sig, signal.Signals):
            raise argparse.ArgumentTypeError(f"expected signal names separated by commas, such as "
                                             f"SIGTERM,SIGUSR1; {part.strip()!r} is not a signal "
                                             f"here")
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise argparse.ArgumentTypeError(f"{full} cannot be caught, so the launcher cannot "
                                             f"handle it: leave it out")
        if sig == signal.SIGCHLD:
            raise argparse.ArgumentTypeError("SIGCHLD comes whenever a rank exits, and the "
                                             "launcher watches the ranks itself: leave it out")
        sigs.append(sig)
    return tuple(dict.fromkeys(sigs))


def _filters(text: str) -> tuple[bytes, ...]:
    """--duplicate-*-filters, as torchrun reads them: substrings separated by commas, a double
    comma standing for a comma in one. Empty ones are dropped (an empty one would match every
    line)."""
    parts = text.replace(",,", "\0").split(",")
    return tuple(p.replace("\0", ",").encode() for p in parts if p)


def _ranks_filter(text: str) -> tuple[int, ...]:
    """--local-ranks-filter: comma-separated local ranks, e.g. 0 or 0,2."""
    try:
        ranks = tuple(int(t) for t in text.split(","))
    except ValueError:
        ranks = (-1,)
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"expected local ranks separated by commas, such as 0 "
                                         f"or 0,2, got {text!r}")
    return ranks


def _nnodes(text: str) -> int:
    """--nnodes: a positive integer; torchrun's elastic MIN:MAX only when MIN == MAX."""
    lo, sep, hi = text.partition(":")
    if sep:
        n = _positive_int(lo)
        if _positive_int(hi) != n:
            raise argparse.ArgumentTypeError(
                f"{text!r} is an elastic range, and ddpc runs a fixed number of nodes: pass one "
                f"number (every node must be there from the start)")
        return n
    return _positive_int(text)


def _endpoint(text: str) -> tuple[str, int | None]:
    """--rdzv-endpoint HOST[:PORT] (torchrun's), IPv6 in brackets: [::1]:29400."""
    host, port = text, None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise argparse.ArgumentTypeError(f"expected HOST[:PORT], got {text!r}")
        host, rest = text[1:end], text[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise argparse.ArgumentTypeError(f"expected HOST[:PORT], got {text!r}")
            port = _port(rest[1:])
    elif text.count(":") == 1:
        host, _, p = text.partition(":")
        port = _port(p)
    if not host:
        raise argparse.ArgumentTypeError(f"expected HOST[:PORT], got {text!r}")
    return host, port


class _Parser(argparse.ArgumentParser):
    """argparse, except that -m with nothing after it asks for a module name (argparse would
    say that the script and its arguments are missing)."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        # Kept so that error() can see whether -m was given (or PET_MODULE=1 set).
        self._namespace = argparse.Namespace() if namespace is None else namespace
        return super().parse_known_args(args, self._namespace)

    def error(self, message: str) -> Any:
        if (message.startswith("the following arguments are required: script.py|module")
                and getattr(getattr(self, "_namespace", None), "module", False)):
            message = ("argument -m/--module: expected a module name after -m (as in python -m), "
                       "e.g. -m mypkg.train")
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m ddpc.launch", allow_abbrev=False,
        description="Start one process per rank with torchrun's environment variables (RANK, "
                    "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), prefix their output with the "
                    "rank, and stop them all when one fails.",
        epilog="examples:\n  python -m ddpc.launch --nproc-per-node 2 train.py --lr 3e-5\n"
               "  python -m ddpc.launch --gpus auto --nproc-per-node 2 -m mypkg.train\n"
               "  DDPC_TOKEN=<shared secret> python -m ddpc.launch --nnodes 2 --node-rank 0 "
               "--master-addr host0 train.py\n\n"
               "torchrun's PET_<FLAG> environment variables (PET_NNODES, PET_NODE_RANK, "
               "PET_NPROC_PER_NODE,\nPET_MASTER_ADDR, PET_MASTER_PORT, ...) set the defaults of "
               "the matching flags, as in torchrun.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=_nproc, default=None,
                   metavar="N|auto|cpu|gpu", help="ranks on this node: N, or as in torchrun cpu "
                   "(one per CPU this process may use), gpu (one per visible GPU; an error "
                   "without one) or auto (one per visible GPU, else one per CPU); with --gpus, "
                   "gpu and auto mean one per GPU listed. Default: one per visible GPU (or per "
                   "--gpus), else 1")
    p.add_argument("--nnodes", type=_nnodes, default=1,
                   help="number of nodes (default 1; torchrun's N:N is accepted)")
    p.add_argument("--node-rank", "--node_rank", type=_nonneg_int, default=None,
                   help="this node's index, 0..nnodes-1 (required with --nnodes > 1; else 0)")
    p.add_argument("--master-addr", "--master_addr", default=None, metavar="ADDR",
                   help="address of node 0, where rank 0 serves the rendezvous store (default "
                   "127.0.0.1 on one node; required with --nnodes > 1)")
    p.add_argument("--master-port", "--master_port", type=_port, default=None, metavar="PORT",
                   help=f"port of the store (default: a free port on one node, "
                   f"{DEFAULT_MASTER_PORT} with --nnodes > 1)")
    p.add_argument("--max-restarts", "--max_restarts", type=_nonneg_int, default=0, metavar="K",
                   help="restart all local ranks up to K times after a failure (default 0); "
                   "across nodes this works when every node's ranks fail and restart together")
    p.add_argument("--gpus", default=None, metavar="2,3|auto",
                   help="physical GPU indices for the ranks (sets CUDA_VISIBLE_DEVICES), or auto: "
                   "the idle GPUs with the most free memory (needs nvidia-smi)")
    p.add_argument("--timeout-kill", "--timeout_kill", type=_timeout_kill, default=None,
                   metavar="S", help="seconds between SIGTERM/SIGINT and SIGKILL when stopping "
                   f"ranks (default {DEFAULT_TIMEOUT_KILL_S:g}, at most {MAX_TIMEOUT_KILL_S:g})")
    p.add_argument("--shutdown-timeout", "--shutdown_timeout", type=_timeout_kill, default=None,
                   metavar="S", help="torchrun's name for --timeout-kill")
    p.add_argument("--signals-to-handle", "--signals_to_handle", type=_signal_list,
                   default=None, metavar="SIGUSR1,..",
                   help="as torchrun: on one of these signals, send it on to the ranks and stop "
                   "them (SIGKILL after --timeout-kill), e.g. SLURM's SIGUSR1 before the time "
                   "limit, for ranks that checkpoint on it. SIGINT, SIGTERM and SIGHUP are "
                   "always handled (Ctrl-C reaches the ranks as SIGINT, the others as SIGTERM)")
    p.add_argument("--local-addr", "--local_addr", default=None, metavar="ADDR",
                   help="this node's address for the CPU backend's TCP transport (sets "
                   "DDPC_BIND_ADDR for the ranks), when the route to --master-addr picks the "
                   "wrong one; NCCL picks its own interface (NCCL_SOCKET_IFNAME)")
    p.add_argument("--run-id", "--run_id", default=None,
                   help="TORCHELASTIC_RUN_ID (default: random on one node, 'none' across nodes)")
    p.add_argument("--log-dir", "--log_dir", default=None, metavar="DIR",
                   help="also write each rank's output to DIR/attempt_K/rankR/stdout.log and "
                   "stderr.log (K: the restart), and a failure's summary to "
                   "DIR/attempt_K/summary.log; DIR is created before the ranks start. When DIR "
                   "holds an earlier run's logs, this run's go to a new DIR/run-N (printed), so "
                   "that runs never mix. The files hold each rank's bytes as written (no rank "
                   "prefix). An empty DIR (or /dev/null) means no log files, as in torchrun")
    p.add_argument("--local-ranks-filter", "--local_ranks_filter", type=_ranks_filter,
                   default=None, metavar="0,2", help="show only these local ranks' output on "
                   "the console, as torchrun's flag does (the --log-dir files and a failure's "
                   "summary still have every rank's)")
    p.add_argument("-r", "--redirects", type=_std_spec, default=None,
                   metavar="0-3|R:C,..", help="as torchrun: send 1 stdout, 2 stderr, 3 both of "
                   "every rank (or per local rank: 0:3,1:1) to the log files only, not the "
                   "console; without --log-dir, to a new temporary directory (printed)")
    p.add_argument("-t", "--tee", type=_std_spec, default=None, metavar="0-3|R:C,..",
                   help="as torchrun: write the output to log files as well as the console. "
                   "ddpc writes both streams of every rank to the files once there is a log "
                   "directory (--log-dir, else a new temporary one, printed)")
    p.add_argument("--duplicate-stdout-filters", "--duplicate_stdout_filters", type=_filters,
                   default=(), metavar="A,B", help="as torchrun: also write the ranks' stdout "
                   "lines that contain A or B (a double comma for a comma) to "
                   "DIR/attempt_K/filtered_stdout.log, prefixed with the rank (without "
                   "--log-dir, in a new temporary directory, printed)")
    p.add_argument("--duplicate-stderr-filters", "--duplicate_stderr_filters", type=_filters,
                   default=(), metavar="A,B", help="the same for stderr, into "
                   "filtered_stderr.log")
    p.add_argument("--standalone", action="store_true",
                   help="accepted for torchrun compatibility: one node is the default")
    rdzv = p.add_argument_group("torchrun's rendezvous flags, accepted so its commands carry over")
    rdzv.add_argument("--rdzv-endpoint", "--rdzv_endpoint", type=_endpoint, default=None,
                      metavar="HOST[:PORT]", help="the same as --master-addr HOST --master-port "
                      "PORT")
    rdzv.add_argument("--rdzv-backend", "--rdzv_backend", default=None, metavar="c10d",
                      help="c10d or static (ddpc's own store plays that part); others are refused")
    rdzv.add_argument("--rdzv-id", "--rdzv_id", default=None, metavar="ID",
                      help="the same as --run-id")
    rdzv.add_argument("--monitor-interval", "--monitor_interval", default=None, metavar="S",
                      help="accepted and ignored: ddpc watches the ranks continuously")
    rdzv.add_argument("--start-method", "--start_method", default=None, metavar="spawn",
                      help="accepted and ignored: every rank is a fresh interpreter (spawn)")
    for flag in TORCHRUN_ONLY:
        names = [flag, flag.replace("-", "_").replace("__", "--", 1)]
        kind: dict[str, Any] = ({"action": "store_true"} if flag in TORCHRUN_ONLY_SWITCHES
                                else {"default": None})
        p.add_argument(*dict.fromkeys(names), dest=f"torchrun_{flag[2:].replace('-', '_')}",
                       help=argparse.SUPPRESS, **kind)
    p.add_argument("-m", "--module", action="store_true",
                   help="run the target as a module, like python -m")
    p.add_argument("--run-path", "--run_path", action="store_true",
                   help="as torchrun: run the script in the rank's interpreter, as "
                   "runpy.run_path does, which is how ddpc runs a script anyway (it wins over "
                   "--no-python, as in torchrun)")
    p.add_argument("--no-python", "--no_python", action="store_true",
                   help="run the target as a program (found on PATH, or a path), not as a "
                   "Python script, as torchrun's flag does: e.g. a shell script that starts "
                   "Python. Its ranks' failures are reported with their exit code and last "
                   "stderr lines; a hang shows no Python stacks")
    p.add_argument("script", metavar="script.py|module", help="what each rank runs")
    script_args = p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    script_args.required = False  # it may be empty: not named when the script is missing
    return p


# torchrun reads each of its flags from PET_<DEST> when the flag is not given (Kubeflow's
# PyTorchJob and other operators configure nodes that way); these are the ones ddpc shares.
PET_DESTS = ("nnodes", "node_rank", "nproc_per_node", "master_addr", "master_port",
             "max_restarts", "rdzv_endpoint", "rdzv_backend", "rdzv_id", "standalone",
             "log_dir", "module", "no_python", "redirects", "tee", "local_ranks_filter",
             "run_path", "local_addr", "signals_to_handle", "shutdown_timeout",
             "duplicate_stdout_filters", "duplicate_stderr_filters")


def pet_defaults(parser: argparse.ArgumentParser, environ: Any) -> list[str]:
    """Makes torchrun's PET_* environment variables the defaults of the matching flags (a flag
    on the command line still wins), as torchrun does. Returns a note per variable used; a
    value the flag would refuse exits via parser.error, naming the variable."""
    notes = []
    for action in parser._actions:
        name = f"PET_{action.dest.upper()}"
        text = environ.get(name)
        if action.dest not in PET_DESTS or not text:
            continue
        flag = max(action.option_strings, key=len, default=action.dest)
        if action.nargs == 0:  # a store_true flag: torchrun reads 1 / 0
            if text.strip() not in ("0", "1"):
                parser.error(f"{name}={text!r} (torchrun's environment form of {flag}): "
                             f"expected 1 or 0")
            value: Any = text.strip() == "1"
        else:
            try:
                value = action.type(text) if action.type else text
            except argparse.ArgumentTypeError as e:
                parser.error(f"{name}={text!r} (torchrun's environment form of {flag}): {e}; "
                             f"fix or unset it, or pass {flag}")
        parser.set_defaults(**{action.dest: value})
        notes.append(f"{name}={text} is set: using it as {flag} (torchrun does); a flag on the "
                     f"command line would win")
    return notes


# Source text by which a package's __init__ (or a module) can make submodules that are not files
# in its directory: then only running it could tell whether one exists.
_DYNAMIC_SUBMODULE_HINTS = ("__path__", "sys.modules", "meta_path", "path_hooks",
                            "declare_namespace")


def _may_add_submodules(spec: Any) -> bool:
    """Could running this module or package's code make submodules its directories lack?"""
    if spec.loader is None and spec.origin is None:
        return False  # a namespace package: no code of its own
    try:
        source = spec.loader.get_source(spec.name)
    except Exception:  # any loader's failure means the same here: the source cannot be read
        return True
    return source is None or any(hint in source for hint in _DYNAMIC_SUBMODULE_HINTS)


def _submodule_spec(name: str, locations: Any) -> Any:
    """What import would find for `name` in its (not imported) package's directories: the spec,
    None, or True when a finder failed (it cannot be told)."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(name, list(locations))
        except Exception:  # a third-party finder's failure: leave the answer to the ranks
            return True
        if spec is not None:
            return spec
    return None


def rank_sys_path(env: Any) -> list[str]:
    """The sys.path a rank started with `python -m` and environment env begins with: the working
    directory (unless PYTHONSAFEPATH is set), env's PYTHONPATH, then the interpreter's own
    entries (the standard library, site-packages), which the ranks share with this process. This
    process's own first entry is not theirs: under the ddpc-launch console script it is the
    script's bin directory."""
    own = sys.path[0 if sys.flags.safe_path else 1:]
    ours = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    theirs = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = [] if env.get("PYTHONSAFEPATH") else [os.getcwd()]
    return first + theirs + [p for p in own if os.path.abspath(p) not in ours]


def module_problem(name: str, env: Any = None) -> str | None:
    """Why `python -m name` in a rank (environment env, by default this one's) would find no
    module, or None when it may find one. The ranks' sys.path is looked in (rank_sys_path), not
    this process's. Only finders are asked: importlib.util.find_spec("pkg.sub") would import
    pkg, running the user's __init__ in the launcher (its side effects, such as CUDA or threads,
    and once more than expected). So a submodule is looked up in its package's directories as
    import would; when the package (or a module) could make submodules some other way (its
    source mentions __path__, sys.modules, ...; or it has no source), nothing is refused and the
    ranks find out."""
    env = os.environ if env is None else env
    parts = name.split(".")
    if not all(parts):
        return (f"{name!r} is not a module name (python -m takes a full dotted name such as "
                f"mypkg.train)")
    saved = sys.path[:]
    sys.path[:] = rank_sys_path(env)
    try:
        return _module_problem(name, parts, env)
    finally:
        sys.path[:] = saved


def _module_problem(name: str, parts: list[str], env: Any) -> str | None:
    """module_problem's search, with sys.path already the ranks'."""
    try:
        spec = importlib.util.find_spec(parts[0])  # top level: imports nothing
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        there = f": there is no package {parts[0]!r}" if len(parts) > 1 else ""
        if env.get("PYTHONSAFEPATH"):
            where = (f"PYTHONSAFEPATH is set, so the ranks' sys.path lacks the working "
                     f"directory {os.getcwd()}")
        else:
            where = (f"the ranks' sys.path starts with the working directory {os.getcwd()}, "
                     f"then PYTHONPATH")
        return f"no module named {name!r}{there} ({where})"
    for i in range(1, len(parts)):
        parent, child = ".".join(parts[:i]), ".".join(parts[:i + 1])
        if parent in sys.modules:  # imported here already (os, json): asking runs nothing new
            try:
                sub = importlib.util.find_spec(child)
            except ImportError:
                sub = None
            except ValueError:  # a module without __spec__ in sys.modules
                return None
        elif _may_add_submodules(spec):
            return None
        elif spec.submodule_search_locations is None:
            sub = None
        else:
            sub = _submodule_spec(child, spec.submodule_search_locations)
            if sub is True:
                return None
        if sub is None:
            if spec.submodule_search_locations is None:
                origin = f" ({spec.origin})" if os.path.isabs(spec.origin or "") else ""
                return (f"no module named {name!r}: {parent!r} is a module{origin}, not a "
                        f"package, so it has no submodules")
            where = ", ".join(spec.submodule_search_locations)
            return (f"no module named {name!r}: package {parent!r} ({where}) has no module or "
                    f"subpackage {parts[i]!r}")
        spec = sub
    return None


def program_problem(name: str) -> str | None:
    """Why `name` cannot be run as a program (--no-python), as execvp would see it; or None."""
    if os.sep not in name:
        if shutil.which(name) is None:
            return (f"no program {name!r} on PATH (working directory {os.getcwd()}); for one "
                    f"in this directory write ./{name}")
        return None
    if os.path.isdir(name):
        return f"{name!r} is a directory, not a program"
    if not os.path.isfile(name):
        return f"{name!r} not found (working directory {os.getcwd()})"
    if not os.access(name, os.X_OK):
        return (f"{name!r} is not executable: chmod +x it, or leave --no-python out if it is a "
                f"Python script")
    return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, as torchrun counts them for cpu)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def resolve_nproc(value: int | str | None, gpus: str | None,
                  gpu_count: Callable[[], int] = visible_gpu_count) -> int | None:
    """--nproc-per-node as a number, or None for one rank per visible GPU (else 1) or per GPU
    of --gpus (gpus: that flag's value). torchrun's words: cpu, one rank per usable CPU; gpu,
    one per visible GPU; auto, one per visible GPU, else per CPU. Raises ValueError for gpu
    when no GPU is visible (torchrun's error too)."""
    if value is None or isinstance(value, int):
        return value
    if value == "cpu":
        return usable_cpus()
    if gpus is not None:
        return None  # gpu or auto with --gpus: one rank per GPU chosen there
    count = gpu_count()
    if count:
        return count
    if value == "gpu":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
        raise ValueError(f"gpu means one rank per visible GPU, but no GPU is visible here{why}: "
                         f"give a number of ranks (--nproc-per-node 2), or cpu for one per CPU "
                         f"({usable_cpus()} here)")
    return usable_cpus()


def run_log_dir(base: str) -> str:
    """Where this run's log files go under --log-dir base: base itself while it holds no earlier
    run's (no attempt_* entry), else a new base/run-N (N one above the highest there, from 2, as
    base itself held the first run), so that two runs' files never mix: a rank's files are
    appended to, and an earlier run's later attempts would stay beside this run's. base is
    claimed by making its attempt_0 folder (atomic: a run started alongside one whose ranks
    have written nothing yet does not take base too)."""
    names = os.listdir(base)
    if not any(n.startswith("attempt_") for n in names):
        try:
            os.mkdir(os.path.join(base, "attempt_0"))
            return base
        except FileExistsError:
            names = os.listdir(base)
    n = max([int(m[4:]) for m in names if m.startswith("run-") and m[4:].isdigit()] + [1])
    while True:
        n += 1
        path = os.path.join(base, f"run-{n}")
        try:
            os.mkdir(path)  # (atomic: two launchers starting together get different ones)
            return path
        except FileExistsError:
            continue


def bind_problem(addr: str) -> str | None:
    """Why the ranks could not bind addr (--local-addr), or None when they can."""
    try:
        infos = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"{addr!r} cannot be resolved ({e.strerror})"
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind(sockaddr)
            return None
        except OSError as e:
            error = e
    return f"{addr!r} is not an address of this host ({error.strerror if error else 'no address'})"


def resolve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> LaunchConfig:
    """Checks the arguments against each other and the machine; exits via parser.error."""
    for flag, advice in TORCHRUN_ONLY.items():
        if getattr(args, f"torchrun_{flag[2:].replace('-', '_')}") not in (None, False):
            parser.error(f"argument {flag}: torchrun's flag is not supported: {advice}")
    if args.run_path:
        if args.module:
            parser.error("argument --run-path: runs a script file (as runpy.run_path), not a "
                         "module: leave out -m or --run-path")
        args.no_python = False  # torchrun's --run-path wins over --no-python
    if args.no_python:
        if args.module:
            parser.error("argument --no-python: not with -m, which runs a Python module: give "
                         "one of them")
        problem = program_problem(args.script)
        if problem:
            parser.error(f"argument script.py (with --no-python): {problem}")
        target = [args.script] + args.script_args
    elif args.module:
        problem = module_problem(args.script,
                                 {**os.environ, "PYTHONPATH": worker_pythonpath(os.environ)})
        if problem:
            parser.error(f"argument -m/--module: {problem}; check the spelling (and that "
                         f"the package is installed or in the working directory)")
        target = ["-m", args.script] + args.script_args
    else:
        if os.path.isdir(args.script):
            if not os.path.isfile(os.path.join(args.script, "__main__.py")):
                parser.error(f"argument script.py: {args.script!r} is a directory without "
                             f"__main__.py: name the script inside it, or to run a package "
                             f"use -m")
        elif not os.path.isfile(args.script):
            parser.error(f"argument script.py: {args.script!r} not found (working directory "
                         f"{os.getcwd()}); to run a module use -m")
        target = [args.script] + args.script_args
    if args.log_dir in ("", os.devnull):
        args.log_dir = None  # torchrun's meaning of both: no log files
    if args.log_dir is not None:
        if os.path.exists(args.log_dir) and not os.path.isdir(args.log_dir):
            parser.error(f"argument --log-dir: {args.log_dir!r} is a file, not a directory: "
                         f"name a directory (it is created if missing)")
        try:
            os.makedirs(args.log_dir, exist_ok=True)
        except OSError as e:
            parser.error(f"argument --log-dir: cannot create {args.log_dir!r}: "
                         f"{e.strerror or e}: name a directory that can be created")
        if not os.access(args.log_dir, os.W_OK | os.X_OK):
            parser.error(f"argument --log-dir: cannot write in {args.log_dir!r} (permission "
                         f"denied): name a directory you can write in")
    if args.shutdown_timeout is not None:
        if args.timeout_kill is not None and args.timeout_kill != args.shutdown_timeout:
            parser.error(f"argument --shutdown-timeout: {args.shutdown_timeout:g} differs from "
                         f"--timeout-kill {args.timeout_kill:g} (torchrun's name for the same "
                         f"thing): give one of them")
        args.timeout_kill = args.shutdown_timeout
    if args.timeout_kill is None:
        args.timeout_kill = DEFAULT_TIMEOUT_KILL_S
    if args.local_addr is not None:
        bound = os.environ.get("DDPC_BIND_ADDR")
        if bound and bound != args.local_addr:
            parser.error(f"argument --local-addr: {args.local_addr!r} differs from "
                         f"DDPC_BIND_ADDR={bound!r} in the environment (the same setting): give "
                         f"one of them")
        problem = bind_problem(args.local_addr)
        if problem:
            parser.error(f"argument --local-addr: {problem}: give this node's address on the "
                         f"network the other nodes reach")
    if args.rdzv_backend is not None and args.rdzv_backend not in ("c10d", "static"):
        parser.error(f"argument --rdzv-backend: {args.rdzv_backend!r} is not supported: ddpc "
                     f"serves the rendezvous store from rank 0 itself (c10d's role); use c10d or "
                     f"leave it out")
    if args.rdzv_endpoint is not None:
        host, port = args.rdzv_endpoint
        if args.master_addr is not None and args.master_addr != host:
            parser.error(f"argument --rdzv-endpoint: host {host!r} differs from --master-addr "
                         f"{args.master_addr!r}: give one of them")
        if port is not None and args.master_port is not None and args.master_port != port:
            parser.error(f"argument --rdzv-endpoint: port {port} differs from --master-port "
                         f"{args.master_port}: give one of them")
        args.master_addr = host
        if port is not None:
            args.master_port = port
    if args.rdzv_id is not None:
        if args.run_id is not None and args.run_id != args.rdzv_id:
            parser.error(f"argument --rdzv-id: {args.rdzv_id!r} differs from --run-id "
                         f"{args.run_id!r}: give one of them")
        args.run_id = args.rdzv_id
    try:
        args.nproc_per_node = resolve_nproc(args.nproc_per_node, args.gpus)
    except ValueError as e:
        parser.error(f"argument --nproc-per-node: {e}")
    if args.nproc_per_node is not None and args.nnodes * args.nproc_per_node > MAX_WORLD_SIZE:
        parser.error(f"--nnodes {args.nnodes} times --nproc-per-node {args.nproc_per_node} is "
                     f"{args.nnodes * args.nproc_per_node} ranks; a job has at most "
                     f"{MAX_WORLD_SIZE} (2**31 - 1): check both numbers")
    if args.nnodes > MAX_WORLD_SIZE:
        parser.error(f"argument --nnodes: {args.nnodes} nodes; a job has at most "
                     f"{MAX_WORLD_SIZE} (2**31 - 1) ranks: check the number")
    if args.standalone and args.nnodes != 1:
        parser.error(f"argument --standalone: means one node, but --nnodes is {args.nnodes}")
    if args.node_rank is None and args.nnodes == 1:
        args.node_rank = 0
    if args.node_rank is not None and args.node_rank >= args.nnodes:
        parser.error(f"argument --node-rank: {args.node_rank} is not below --nnodes "
                     f"{args.nnodes}")
    token = os.environ.get("DDPC_TOKEN") or None
    if args.nnodes > 1:
        if not args.master_addr:
            parser.error("argument --master-addr: required with --nnodes > 1 (the address of "
                         "node 0, reachable from every node)")
        if token is None:
            parser.error("multi-node jobs need a shared job token: run\n"
                         "  export DDPC_TOKEN=$(python -c 'import secrets; "
                         "print(secrets.token_hex(16))')\n"
                         "once, and export the same DDPC_TOKEN on every node before launching")
        if args.node_rank is None:
            parser.error(f"argument --node-rank: required with --nnodes {args.nnodes}: give each "
                         f"node its index, 0 on the node at --master-addr (torchrun's c10d "
                         f"rendezvous numbers the nodes itself; ddpc's does not)")
    bad = _settings.bad_values(os.environ)
    if bad:
        parser.error("\n".join(text for _, text in bad) + "\n(every rank would refuse "
                     + ("it" if len(bad) == 1 else "them") + " in init_process_group: fix or "
                     "unset " + ", ".join(name for name, _ in bad) + ")")
    try:
        plan = plan_devices(args.gpus, args.nproc_per_node)
    except ValueError as e:
        parser.error(f"argument --gpus: {e}" if args.gpus is not None else str(e))
    for flag, named in (("--local-ranks-filter", args.local_ranks_filter or ()),
                        ("--redirects", args.redirects if isinstance(args.redirects, dict)
                         else ()),
                        ("--tee", args.tee if isinstance(args.tee, dict) else ())):
        beyond = sorted(r for r in named if r >= plan.nproc)
        if beyond:
            parser.error(f"argument {flag}: local rank {beyond[0]} is not on this node, which "
                         f"runs local ranks 0..{plan.nproc - 1}")
    wants_files = any(v for spec in (args.redirects, args.tee) if spec is not None
                      for v in (spec.values() if isinstance(spec, dict) else [spec]))
    filters = {stream: needles for stream, needles in
               (("stdout", args.duplicate_stdout_filters),
                ("stderr", args.duplicate_stderr_filters)) if needles}
    if (wants_files or filters) and args.log_dir is None:
        args.log_dir = tempfile.mkdtemp(prefix="ddpc-logs-")
        flags = "--redirects/--tee" if wants_files else "--duplicate-*-filters"
        print(f"ddpc.launch: {flags} without --log-dir: each rank's output goes to "
              f"{args.log_dir}", file=sys.stderr, flush=True)
    elif args.log_dir is not None:
        # Last, so that a launch refused above leaves no directory behind.
        try:
            run_dir = run_log_dir(args.log_dir)
        except OSError as e:
            parser.error(f"argument --log-dir: cannot create a directory for this run in "
                         f"{args.log_dir!r}: {e.strerror or e}")
        if run_dir != args.log_dir:
            print(f"ddpc.launch: --log-dir {args.log_dir} holds an earlier run's logs: this "
                  f"run's go to {run_dir}", file=sys.stderr, flush=True)
            args.log_dir = run_dir
    master_port = args.master_port
    if master_port is None and args.nnodes > 1:
        master_port = DEFAULT_MASTER_PORT
    run_id = args.run_id or (uuid.uuid4().hex if args.nnodes == 1 else "none")
    return LaunchConfig(target=target, plan=plan, nnodes=args.nnodes, node_rank=args.node_rank,
                        master_addr=args.master_addr or "127.0.0.1", master_port=master_port,
                        max_restarts=args.max_restarts, timeout_kill=args.timeout_kill,
                        run_id=run_id, token=token, log_dir=args.log_dir,
                        no_python=args.no_python, console_ranks=args.local_ranks_filter,
                        redirects=args.redirects or (), tee=args.tee or (),
                        bind_addr=args.local_addr, filters=filters,
                        extra_signals=tuple(sig for sig in args.signals_to_handle or () if sig
                                            not in (signal.SIGINT, signal.SIGTERM,
                                                    signal.SIGHUP)))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m ddpc.launch` and `ddpc-launch`; returns the exit status."""
    parser = build_parser()
    notes = pet_defaults(parser, os.environ)
    args = parser.parse_args(argv)
    cfg = resolve(parser, args)
    for note in notes:
        print(f"ddpc.launch: note: {note}", file=sys.stderr, flush=True)
    return Launcher(cfg).run()


if __name__ == "__main__":
    sys.exit(main())
