"""Process groups, device binding and collectives on any array (torch tensors, NumPy arrays,
CuPy arrays, anything with ``__dlpack__`` or ``__cuda_array_interface__``).

Names and semantics follow ``torch.distributed``: a torchrun script moves to ddpc by changing
imports. The work itself happens in the C core (``ddpc._C``); this module reads the environment,
checks arguments and turns arrays into (pointer, count, dtype, device, stream).
"""
from __future__ import annotations

import atexit
import datetime
import enum
import functools
import gc
import hashlib
import operator
import os
import socket
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ddpc import _C

DEFAULT_TIMEOUT_S = 600.0

# NCCL connects its peers when a communicator is created rather than at each first collective, so
# a collective never blocks the host on a missing peer (its kernel waits on the GPU instead, where
# the watchdog's deadline reaches it). NCCL reads this once per process, so set it before any
# communicator (ddpc's or torch's) exists; an explicit user setting wins. (ddpc.launch does not
# pass ddpc's own default on to the ranks: _NCCL_RUNTIME_CONNECT_IS_OURS.)
_NCCL_RUNTIME_CONNECT_IS_OURS = "NCCL_RUNTIME_CONNECT" not in os.environ
os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
DEFAULT_MASTER_PORT = 29500

# Collective codes, as in csrc/ddpc.h (ddpc_coll).
_ALLREDUCE, _BROADCAST, _ALLGATHER, _REDUCE_SCATTER, _BARRIER = range(5)

# dtype name -> code of csrc/ddpc.h (ddpc_dtype).
_DTYPE_CODES = {
    "float32": 0, "float64": 1, "float16": 2, "bfloat16": 3,
    "int32": 4, "int64": 5, "uint8": 6, "int8": 7,
}
# dtypes the core has no code of its own for, carried as one it has: (that dtype, its elements
# per element, what it is). Moving data needs nothing more; reductions are mapped or refused by
# _op_for (complex: SUM and AVG on the real and imaginary parts; bool: as torch's NCCL does).
_CARRIED = {"bool": ("uint8", 1, "bool"), "complex64": ("float32", 2, "complex"),
            "complex128": ("float64", 2, "complex")}
# __array_interface__ / __cuda_array_interface__ typestr (without byte order) -> dtype name.
_TYPESTR = {"f4": "float32", "f8": "float64", "f2": "float16", "i4": "int32", "i8": "int64",
            "u1": "uint8", "i1": "int8", "V2": "bfloat16", "b1": "bool", "c8": "complex64",
            "c16": "complex128"}


class ReduceOp(enum.IntEnum):
    """Reduction operations, with torch.distributed's names (``ddpc.ReduceOp.SUM``)."""

    SUM = 0
    AVG = 1
    MIN = 2
    MAX = 3
    PRODUCT = 4
    PROD = 4
    BAND = 5  # bitwise, of integer and bool elements (the cpu backend; NCCL has none)
    BOR = 6
    BXOR = 7


_OP_NAMES = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "mean": ReduceOp.AVG,
             "min": ReduceOp.MIN, "max": ReduceOp.MAX, "prod": ReduceOp.PRODUCT,
             "product": ReduceOp.PRODUCT, "band": ReduceOp.BAND, "bor": ReduceOp.BOR,
             "bxor": ReduceOp.BXOR}


def _reduce_op(op: Any) -> int:
    if isinstance(op, str):
        code = _OP_NAMES.get(op.lower())
        if code is None:
            raise ValueError(f"op={op!r} is not a reduction: use one of "
                             f"{sorted(set(_OP_NAMES))} or ddpc.ReduceOp.SUM/AVG/MIN/MAX/PRODUCT/"
                             f"BAND/BOR/BXOR")
        return int(code)
    if isinstance(op, ReduceOp):
        return int(op)
    # torch.distributed.ReduceOp members, so torch-style code keeps working after the import swap.
    name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
    if isinstance(name, str) and name.lower() in _OP_NAMES:
        return int(_OP_NAMES[name.lower()])
    if type(op).__module__.startswith("torch") and isinstance(getattr(op, "name", None), str):
        raise ValueError(f"op {op.name} (from torch.distributed.ReduceOp) is not supported by "
                         f"ddpc: use SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR or BXOR")
    raise TypeError(f"op must be a str or ddpc.ReduceOp, got {type(op).__name__} {op!r}")


# ------------------------------------------------------------------------- group state


class _State:
    """Everything init_process_group creates, for destroy_process_group to release."""

    def __init__(self) -> None:
        self.server: Optional[_C.StoreServer] = None
        self.store: Optional[_C.Store] = None
        self.group: Optional[_C.Group] = None
        self.rank = -1
        self.world_size = -1
        self.local_rank = -1
        self.local_world_size = -1
        self.backend = ""
        self.device_index: Optional[int] = None  # CUDA ordinal this process is bound to
        self.timeout = DEFAULT_TIMEOUT_S
        self.master = ("", 0)
        self.groups_made = 0  # by new_group: each gets its own store prefix
        self.subgroups: List[Any] = []  # new_group's groups, destroyed with this one
        self.monitored = 0  # monitored_barrier calls so far (their store keys)
        self.file_written: Optional[Tuple[str, str]] = None  # rank 0's file:// rendezvous file
        self.made_by_notebook_launcher = False  # (fn calling init again gets this group)
        self.pid = os.getpid()  # the process whose groups these are (not a fork's child)


_state: Optional[_State] = None


def _reap_dropped(phase: str, info: Dict[str, Any]) -> None:
    """gc's callback: the arrays of dropped collectives that have finished are let go (the C core
    keeps a dropped GPU collective's arrays until it is done, and else looks again only at the
    group's next collective), so `del model, opt; gc.collect()` frees what the last step's
    collectives used, as torch's watchdog does. Not in a forked child (a DataLoader worker):
    the groups' threads and CUDA context are not there."""
    st = _state
    if phase != "start" or st is None or st.pid != os.getpid():
        return
    for g in (st.group, *st.subgroups):
        if g is not None:
            g.reap()


gc.callbacks.append(_reap_dropped)


def _env_int(*names: str) -> Optional[int]:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return None


_INT32_LIMIT = 1 << 31


def _port_number(value: str, what: str) -> int:
    """A TCP port from the environment or an init_method, with a message that says what to set."""
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"{what}={value!r} is not a TCP port: use a number from 1 to 65535 (a "
                         f"free port on the master; 0 picks one, for a single process)")
    return port


def _rank_arg(name: str, value: Any, least: int) -> int:
    """init_process_group's rank / world_size argument: an int >= least, or -1 / None for the
    environment's."""
    if value is None:
        return -1
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"init_process_group: {name} must be an int (or -1 to read "
                        f"{name.upper()} from the environment), got {type(value).__name__} "
                        f"{value!r}")
    value = operator.index(value)
    if value != -1 and not least <= value < _INT32_LIMIT:
        raise ValueError(f"init_process_group: {name}={value} is not valid: pass {name} >= "
                         f"{least}, or -1 (the default) to read {name.upper()} from the "
                         f"environment")
    return value


# Where a rank and the world size are read from when not passed: torchrun, Open MPI, MPICH /
# Intel MPI, SLURM; the first one set wins.
_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
_WORLD_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")


def _resolve_ranks(rank: int, world_size: int) -> Tuple[int, int, int, int]:
    """rank, world, local_rank, local_world from the arguments, then torchrun, SLURM or Open MPI."""
    rank = _rank_arg("rank", rank, 0)
    world_size = _rank_arg("world_size", world_size, 1)
    env_rank = _env_int(*_RANK_VARS)
    env_world = _env_int(*_WORLD_VARS)
    env_local = _env_int("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
    env_local_world = _env_int("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                               "SLURM_NTASKS_PER_NODE")
    r = rank if rank >= 0 else env_rank
    w = world_size if world_size >= 1 else env_world
    if r is None or w is None:
        missing = [n for n, v in (("rank (RANK)", r), ("world_size (WORLD_SIZE)", w)) if v is None]
        raise ValueError(
            "init_process_group could not find " + " and ".join(missing) + ": start the script "
            "with `python -m ddpc.launch --nproc-per-node N script.py` (or torchrun/srun/mpirun), "
            "or pass rank= and world_size=")
    def source(passed: bool, arg: str, env_names: Tuple[str, ...]) -> str:
        """Where a value came from, for the message: "init_process_group's rank=" or "the
        environment's RANK=" (the first variable set, as _env_int reads them)."""
        if passed:
            return f"init_process_group's {arg}="
        name = next((n for n in env_names if os.environ.get(n) not in (None, "")), env_names[0])
        return f"the environment's {name}="
    world_from = source(world_size >= 1, "world_size", _WORLD_VARS)
    if not 1 <= w < _INT32_LIMIT:
        raise ValueError(f"{world_from}{w} is not valid: the world size is the number of "
                         f"processes, at least 1")
    if not 0 <= r < w:
        raise ValueError(f"{source(rank >= 0, 'rank', _RANK_VARS)}{r} is not a rank of a world "
                         f"of {w} processes ({world_from}{w}): ranks are 0 to {w - 1}, one per "
                         f"process (ddpc.launch and torchrun set RANK and WORLD_SIZE for each)")
    local = env_local if env_local is not None else r
    local_world = env_local_world if env_local_world is not None else w
    if not 0 <= local < _INT32_LIMIT:
        raise ValueError(f"LOCAL_RANK={local} is not valid: a local rank is >= 0 (the launcher "
                         f"sets it: start with `python -m ddpc.launch` or torchrun)")
    if not 1 <= local_world < _INT32_LIMIT:
        raise ValueError(f"LOCAL_WORLD_SIZE={local_world} is not valid: it must be >= 1")
    return r, w, local, max(local_world, local + 1)


def _timeout_seconds(timeout: Any) -> float:
    if timeout is None:
        seconds = _C.setting("DDPC_TIMEOUT")  # checked: a number from 0.001 to 1e9, or None
        return DEFAULT_TIMEOUT_S if seconds is None else seconds
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"timeout must be seconds (float) or a datetime.timedelta, "
                        f"got {type(timeout).__name__}")
    if not seconds > 0:  # also NaN, whose conversion to milliseconds in C is undefined
        raise ValueError(f"timeout must be positive, got {seconds} s")
    return seconds


def _host_id() -> str:
    """Identifies this machine (and boot): ranks with equal ids can share memory."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


def _job_token(addr: str, port: int, world: int) -> str:
    token = os.environ.get("DDPC_TOKEN", "")
    if token:
        return token
    # Started by torchrun/srun without ddpc.launch: no shared secret exists. Derive one from what
    # every rank knows, and say plainly that the store is then protected by its address only.
    if world > 1 and not _C.setting_flag("DDPC_QUIET_TOKEN_WARNING", False):
        warnings.warn("DDPC_TOKEN is not set: the rendezvous store accepts any client that can "
                      "reach it. Start with `python -m ddpc.launch` (which sets a random token) or "
                      "export the same DDPC_TOKEN on every rank.", RuntimeWarning, stacklevel=3)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "") + os.environ.get("SLURM_JOB_ID", "")
    return hashlib.sha256(f"ddpc:{addr}:{port}:{run_id}".encode()).hexdigest()


def _parse_init_method(init_method: Optional[str]) -> Tuple[str, Any]:
    if init_method is None or init_method == "env://":
        return "env", None
    if not isinstance(init_method, str):
        raise TypeError(f"init_method must be a str such as 'env://', 'tcp://host:port' or "
                        f"'file:///path', got {type(init_method).__name__}")
    if init_method.startswith("tcp://"):
        hostport = init_method[len("tcp://"):].rstrip("/")
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"init_method={init_method!r}: expected 'tcp://host:port'")
        return "tcp", (host.strip("[]"), _port_number(port, "init_method port"))
    if init_method.startswith("file://"):
        path = init_method[len("file://"):]
        if not path:
            raise ValueError(f"init_method={init_method!r}: expected 'file:///absolute/path'")
        return "file", path
    raise ValueError(f"init_method={init_method!r} is not supported: use 'env://', "
                     f"'tcp://host:port' or 'file:///path'")


def _file_rendezvous(st: _State, path: str, rank: int, timeout: float) -> Tuple[str, int, str]:
    """Rank 0 serves the store and writes 'host port token' to path (both kept in st, for
    _release); the others read it."""
    if rank == 0:
        token = os.environ.get("DDPC_TOKEN") or os.urandom(16).hex()
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        server = _C.StoreServer(addr, 0, token)
        line = f"{addr} {server.port} {token}\n"
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(line)
            os.replace(tmp, path)
        except OSError as e:
            server.stop()
            raise ValueError(f"init_method file://{path}: rank 0 cannot write it ({e.strerror}): "
                             f"the folder must exist and be writable, and every rank must see "
                             f"the same path") from None
        st.server, st.file_written = server, (path, line)
        return addr, server.port, token
    # A file can outlive its job (rank 0 killed): one whose store does not answer is taken for
    # stale and read again until rank 0 replaces it.
    deadline = time.monotonic() + timeout
    stale = None
    while True:
        try:
            with open(path) as f:
                text = f.read()
            parts = text.split()
            if len(parts) == 3 and parts[1].isdigit():
                try:
                    probe = _C.Store(parts[0], int(parts[1]), parts[2], -1,
                                     max(0.001, min(2.0, deadline - time.monotonic())))
                except _C.DistributedError:
                    stale = text
                else:
                    probe.close()
                    return parts[0], int(parts[1]), parts[2]
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            what = ("names a store that does not answer (a file left by an earlier run?)"
                    if stale is not None else "was not written by rank 0")
            raise _C.DistributedTimeoutError(
                f"rank {rank}: init_method file://{path} {what} within {timeout:.0f} s: is rank "
                f"0 running, and do all ranks see the same file?")
        time.sleep(0.05)


def _pick_backend(backend: Optional[str]) -> str:
    if backend is None or backend == "auto":
        if _C.cuda_built() and _C.cuda_device_count() > 0:
            try:
                _C.nccl_version()
                return "nccl"
            except _C.DistributedError:
                return "cpu"
        return "cpu"
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str ('cpu', 'nccl' or None), got {type(backend).__name__}")
    b = backend.lower()
    if b == "gloo":
        b = "cpu"
    if b not in ("cpu", "nccl"):
        raise ValueError(f"backend={backend!r} is not supported: use 'cpu' (alias 'gloo'), "
                         f"'nccl', or None to pick nccl when GPUs and NCCL are present")
    return b


def _bind_device(local_rank: int, backend: str, rank: int = 0,
                 local_world: int = 1) -> Optional[int]:
    """Binds this process to GPU local_rank before any other CUDA work (so no process ever creates
    a context on someone else's GPU 0). Returns the ordinal, or None on CPU. With
    DDPC_SHARE_GPUS=1 and more local ranks than GPUs, local rank k binds GPU k modulo their
    count, and NCCL_HOSTID is set to one of this rank's own: NCCL refuses two ranks of one host on
    one GPU ("Duplicate GPU detected"), and takes ranks of different hosts through its network
    transport, which works on one GPU."""
    ndev = _C.cuda_device_count() if _C.cuda_built() else 0
    if ndev == 0:
        if backend == "nccl":
            raise ValueError("backend='nccl' needs CUDA GPUs, but none is visible "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
                             f"CUDA built: {bool(_C.cuda_built())}): use backend='cpu'")
        return None
    share = bool(_C.setting_flag("DDPC_SHARE_GPUS", False))
    ordinal = local_rank
    if local_rank >= ndev:
        if not share:
            if backend == "nccl":
                raise ValueError(
                    f"LOCAL_RANK={local_rank} but only {ndev} GPU(s) are visible "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): start at "
                    f"most {ndev} processes per node, or make more GPUs visible, or set "
                    f"DDPC_SHARE_GPUS=1 to let ranks share GPUs (slow: for running or debugging "
                    f"a multi-GPU job on fewer GPUs)")
            return None
        ordinal = local_rank % ndev
    if share and local_world > ndev and backend == "nccl":
        os.environ["NCCL_HOSTID"] = f"{_host_id()}/ddpc-rank-{rank}"
        if local_rank == 0:
            warnings.warn(f"DDPC_SHARE_GPUS=1: {local_world} ranks share this node's {ndev} "
                          f"GPU(s) (local rank k on GPU k % {ndev}); NCCL moves their data "
                          f"through its network transport and their kernels take turns on each "
                          f"GPU: for running or debugging, not for speed", stacklevel=3)
    _C.cuda_set_device(ordinal)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(ordinal)
    return ordinal


def init_process_group(backend: Optional[str] = None, init_method: Optional[str] = None,
                       rank: int = -1, world_size: int = -1,
                       timeout: Union[float, datetime.timedelta, None] = None,
                       **kwargs: Any) -> None:
    """Joins this process to the default process group.

    backend: "cpu" (shared memory on one host, TCP across hosts; alias "gloo"), "nccl", or None to
    pick "nccl" when this build has CUDA, a GPU is visible and NCCL loads, else "cpu".
    init_method: "env://" (default: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT as torchrun sets them; SLURM_* and OMPI_COMM_WORLD_* are read when those are what
    is set), "tcp://host:port" or "file:///path". rank/world_size override the environment.
    timeout: seconds or a timedelta for every blocking call (default 600 s, or DDPC_TIMEOUT).

    On a GPU machine the process is bound to GPU LOCAL_RANK first. Rank 0 serves the rendezvous
    store; clients prove they know DDPC_TOKEN. Raises ValueError/TypeError for bad arguments and
    ddpc.DistributedError (DistributedTimeoutError, AuthError, ...) when the rendezvous fails.
    """
    global _state
    from ddpc import _worker
    _worker.report_uncaught_exceptions()
    unknown = set(kwargs) - {"store", "group_name", "device_id", "pg_options"}
    if unknown:
        raise TypeError(f"init_process_group() got unexpected keyword argument(s) {sorted(unknown)}")
    if _state is not None:
        # In a notebook_launcher rank the group exists before fn runs; fn written for
        # torch.multiprocessing.spawn calls init itself: the same group again is a no-op.
        if _state.made_by_notebook_launcher:
            if (rank in (-1, _state.rank) and world_size in (-1, _state.world_size)
                    and _pick_backend(backend) == _state.backend):
                return
            raise RuntimeError(
                f"notebook_launcher made this rank's process group (rank {_state.rank} of "
                f"{_state.world_size}, backend {_state.backend!r}) before calling fn, and fn "
                f"called init_process_group(backend={backend!r}, rank={rank}, "
                f"world_size={world_size}), which conflicts with it: remove the call from fn")
        raise RuntimeError("init_process_group was already called in this process: call "
                           "ddpc.destroy_process_group() first to start a new one")
    _C.check_settings()  # a DDPC_* value that is not a setting: ValueError, before anything starts
    timeout_s = _timeout_seconds(timeout)
    backend_name = _pick_backend(backend)
    kind, where = _parse_init_method(init_method)
    r, w, local, local_world = _resolve_ranks(rank, world_size)
    st = _State()
    st.rank, st.world_size, st.local_rank, st.local_world_size = r, w, local, local_world
    st.backend = backend_name
    st.timeout = timeout_s
    st.device_index = _bind_device(local, backend_name, r, local_world)
    if r != 0:
        _await_old_store(r, timeout_s)
    try:
        if kind == "file":
            addr, port, token = _file_rendezvous(st, where, r, timeout_s)
        elif kind == "env" and _torchrun_agent_store():
            addr, port, token = _agent_store_rendezvous(st, r, timeout_s)
        else:
            if kind == "tcp":
                addr, port = where
            else:
                addr = os.environ.get("MASTER_ADDR")
                port_env = os.environ.get("MASTER_PORT") or None  # (empty: not set)
                if w == 1 and not addr:
                    addr = "127.0.0.1"
                if not addr:
                    raise ValueError("MASTER_ADDR is not set: start with `python -m ddpc.launch` "
                                     "or torchrun, or set MASTER_ADDR and MASTER_PORT (or pass "
                                     "init_method='tcp://host:port')")
                if port_env is None and w > 1:
                    raise ValueError("MASTER_PORT is not set: start with `python -m ddpc.launch` "
                                     "or torchrun, or export MASTER_PORT (a free port on "
                                     "MASTER_ADDR)")
                port = _port_number(port_env, "MASTER_PORT") if port_env else 0
                if port == 0 and w > 1:
                    raise ValueError("MASTER_PORT=0 cannot be used with more than one rank: the "
                                     "other ranks must know the port; export a free port")
            token = _job_token(addr, port, w)
            if r == 0:
                st.server = _serve_store(addr, port, token, _multi_node(st))
                port = st.server.port
        st.master = (addr, port)
        st.store = _C.Store(addr, port, token, r, timeout_s)
        _check_world_size(st, timeout_s)
        st.group = _C.Group(st.store, r, w, local_rank=local, local_world_size=local_world,
                            backend=backend_name, timeout=timeout_s, prefix="g0",
                            transport=_cpu_transport(), host_id=_host_id(),
                            bind_addr=_local_addr_towards(addr, _multi_node(st)),
                            device=-1 if st.device_index is None else st.device_index)
    except BaseException as e:
        _publish_init_failure(st, r, e)
        if r == 0 and isinstance(e, _C.PeerError):
            _await_failed_ranks(st)
        _release(st)
        raise
    _state = st


def _publish_init_failure(st: _State, rank: int, e: BaseException) -> None:
    """Tells the job's other ranks, waiting in init_process_group for this one, why it failed
    (ddpc_group_init_failure in csrc/group.c reads these keys, named in csrc/ddpc.h): else they
    would wait out their timeout. Best effort: the store may be what failed."""
    if st.store is None or st.world_size < 2:
        return
    try:
        st.store.set(f"ddpc/failed/{rank}", f"(pid {os.getpid()} on {socket.gethostname()}) "
                                             f"{type(e).__name__}: {e}"[:1100])
        st.store.compare_set("ddpc/first_failed", b"", str(rank).encode())
    except Exception:  # noqa: BLE001 (the original error is the one to raise)
        pass


def _await_failed_ranks(st: _State, limit_s: float = 1.0) -> None:
    """Rank 0, failing in init_process_group because a peer did: its store, which goes with it,
    still tells the ranks that wait in the group's creation why, for up to limit_s (twice their
    slice between looks) or until each has failed too; else some would only learn that the store
    is gone. (Rank 0's own timeout is not waited on: the launcher names it as the cause.)"""
    if st.server is None or st.store is None or st.world_size < 2:
        return
    deadline = time.monotonic() + limit_s
    pending = set(range(1, st.world_size))
    try:
        while pending and time.monotonic() < deadline:
            pending = {r for r in pending if not st.store.check([f"ddpc/failed/{r}"])
                       and not st.store.check([f"ddpc/dead/{r}"])}
            time.sleep(0.02)
    except _C.DistributedError:
        pass


_agent_inits = 0  # init_process_group calls under torchrun's agent store, in this process


def _torchrun_agent_store() -> bool:
    """torchrun's agent serves a store (torch's TCPStore) on MASTER_PORT itself and tells its
    workers so: ddpc's store cannot take that port."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("true", "1")


def _agent_store_rendezvous(st: _State, rank: int, timeout: float) -> Tuple[str, int, str]:
    """Under torchrun: rank 0 serves ddpc's store on a port of its own choosing, with a random
    token, and publishes 'host port token' in torchrun's store (where torch's own workers
    rendezvous too); the other ranks read it there. The key carries torchrun's restart count
    and this process's init count, so no rank reads a store of an earlier attempt or group."""
    global _agent_inits
    _agent_inits += 1
    master = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    agent_port = _port_number(os.environ.get("MASTER_PORT", ""), "MASTER_PORT")
    key = (f"ddpc/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
           f"init_{_agent_inits}")
    try:
        import datetime
        from torch.distributed import TCPStore
    except ImportError as e:
        raise RuntimeError(f"init_process_group: started by torchrun (TORCHELASTIC_USE_AGENT_STORE"
                           f"=True), whose store needs torch.distributed to reach, which cannot "
                           f"be imported ({e}); start the job with `python -m ddpc.launch` "
                           f"instead") from None
    try:
        agent = TCPStore(master, agent_port, is_master=False,  # (timeout=inf: a long one)
                         timeout=datetime.timedelta(seconds=min(timeout, 1e9)))
    except (RuntimeError, ValueError) as e:
        raise _C.DistributedError(
            f"init_process_group: rank {rank} cannot reach torchrun's store at "
            f"{master}:{agent_port} (MASTER_ADDR:MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True): "
            f"{e}") from None
    if rank == 0:
        token = os.environ.get("DDPC_TOKEN") or os.urandom(16).hex()
        addr = _local_addr_towards(master, _multi_node(st))
        st.server = _C.StoreServer(addr, 0, token)
        agent.set(key, f"{addr} {st.server.port} {token}")
        return addr, st.server.port, token
    try:
        addr, port, token = agent.get(key).decode().split()
    except RuntimeError as e:  # (torch's store timeout: DistStoreError, a RuntimeError)
        raise _C.DistributedTimeoutError(
            f"init_process_group: rank {rank} waited {timeout:g} s in torchrun's store for rank "
            f"0's address and it never came ({type(e).__name__}: {str(e).splitlines()[0]}): "
            f"look at rank 0's output; did it call init_process_group?") from None
    return addr, int(port), token


def _serve_store(addr: str, port: int, token: str, multi_node: bool = False) -> Any:
    """Rank 0's store server. When the port is taken by a store of this very job (it accepts
    our token), another process was started as rank 0 too: that is what the error says."""
    try:
        return _C.StoreServer(_server_bind_addr(addr, multi_node), port, token)
    except _C.DistributedError as e:
        if port == 0 or "Address already in use" not in str(e):
            raise
        try:
            _C.Store(addr, port, token, -1, 5.0).close()
        except _C.DistributedError:
            raise e from None  # another program, or another job's store: the bind error says
        raise _C.MismatchError(
            f"init_process_group: rank 0 cannot serve the rendezvous store on {addr}:{port}: a "
            f"process that knows this job's token serves it there already, so two processes "
            f"claim rank 0: two of this job's (give each its own RANK, 0 to WORLD_SIZE-1), or "
            f"another job's started the same way without DDPC_TOKEN (give each job its own "
            f"MASTER_PORT)") from None


def _check_world_size(st: _State, timeout_s: float) -> None:
    """Rank 0 publishes its world size; every other rank compares its own (a rank started with
    another WORLD_SIZE would otherwise wait for ranks that do not exist, until the timeout)."""
    key = "ddpc/init/world_size"
    if st.rank == 0:
        st.store.set(key, str(st.world_size).encode())
        return
    try:
        theirs = int(st.store.get(key, timeout_s))
    except _C.DistributedTimeoutError:
        raise _C.DistributedTimeoutError(
            f"init_process_group: rank {st.rank} reached the rendezvous store at "
            f"{st.master[0]}:{st.master[1]}, but rank 0, which serves it, did not finish its own "
            f"setup within {timeout_s:g} s: look at rank 0's output") from None
    if theirs != st.world_size:
        raise _C.MismatchError(
            f"init_process_group: rank {st.rank} has world_size {st.world_size}, but rank 0 has "
            f"{theirs}: every rank must be started with the same WORLD_SIZE (ddpc.launch and "
            f"torchrun set it for each, as --nnodes times --nproc-per-node, so every node must "
            f"run the same --nproc-per-node; check world_size= or WORLD_SIZE where the ranks are "
            f"started)")


def _cpu_transport() -> int:
    return {"auto": 0, "shm": 1, "tcp": 2}[_C.setting("DDPC_CPU_TRANSPORT") or "auto"]


def _multi_node(st: _State) -> bool:
    """The job has ranks on other nodes (its WORLD_SIZE exceeds this node's LOCAL_WORLD_SIZE)."""
    return st.world_size > st.local_world_size


def _names_loopback(addr: str) -> bool:
    """addr is localhost or a loopback literal: every rank on one host, on purpose."""
    return addr in ("localhost", "::1") or addr.startswith("127.")


def _loopback_name(addr: str) -> Optional[str]:
    """The loopback address a host name (not one _names_loopback knows) resolves to here, else
    None. Debian's /etc/hosts gives a host's own name 127.0.1.1: as MASTER_ADDR of a job that
    spans nodes, that name reaches this host from the others but loopback here."""
    if _names_loopback(addr):
        return None
    try:
        ip = socket.gethostbyname(addr)
    except OSError:
        return None
    return ip if ip.startswith("127.") else None


def _reachable_addr() -> Optional[str]:
    """A non-loopback IPv4 address of this host: the source of its default route (a UDP socket
    connected to an outside address sends nothing), else one its name resolves to; None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # (TEST-NET-1: only the route is looked up)
            ip = s.getsockname()[0]
            if not ip.startswith("127.") and ip != "0.0.0.0":
                return ip
        except OSError:
            pass
    try:
        return next(ip for ip in socket.gethostbyname_ex(socket.getfqdn())[2]
                    if not ip.startswith("127."))
    except (OSError, StopIteration):
        return None


def _server_bind_addr(addr: str, multi_node: bool = False) -> str:
    """The address rank 0 serves on: MASTER_ADDR itself (never all interfaces unless asked), but
    every interface in a multi-node job whose MASTER_ADDR names this host yet resolves to loopback
    here (the other nodes could not connect; clients authenticate with the job's token)."""
    if addr in ("localhost", "127.0.0.1", "::1", "0.0.0.0"):
        return "127.0.0.1" if addr == "localhost" else addr
    loop = _loopback_name(addr) if multi_node else None
    if loop is not None:
        warnings.warn(f"MASTER_ADDR={addr} resolves to {loop} on this host (loopback: /etc/hosts "
                      f"maps the host's own name there), which the job's other nodes cannot "
                      f"reach: rank 0 serves the store on every interface instead. Set "
                      f"MASTER_ADDR to this host's network address to avoid this", stacklevel=4)
        return "0.0.0.0"
    try:
        return socket.gethostbyname(addr)
    except OSError:
        return addr


def _local_addr_towards(addr: str, multi_node: bool = False) -> str:
    """This host's address as seen on the route to the store (for the TCP data transport, and the
    store's address under torchrun). In a multi-node job whose MASTER_ADDR resolves to loopback
    here (see _loopback_name), a non-loopback address of this host: the other nodes' ranks
    connect to it. DDPC_BIND_ADDR overrides both."""
    override = os.environ.get("DDPC_BIND_ADDR")
    if override:
        return override
    try:
        ip = socket.gethostbyname(addr)
    except OSError:
        return "127.0.0.1"
    if ip.startswith("127."):
        if multi_node and not _names_loopback(addr):
            reachable = _reachable_addr()
            if reachable is not None:
                return reachable
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _destroy_subgroups(st: _State) -> None:
    for g in st.subgroups:
        g.destroy()
    st.subgroups.clear()


def _release(st: _State) -> None:
    _destroy_subgroups(st)
    if st.group is not None:
        st.group.destroy()
        st.group = None
    if st.store is not None:
        st.store.close()
        st.store = None
    if st.file_written is not None:
        # Before the store stops: a rank that reads the file after this waits for the next one.
        path, line = st.file_written
        st.file_written = None
        try:
            with open(path) as f:
                mine = f.read() == line
            if mine:
                os.unlink(path)
        except OSError:
            pass
    if st.server is not None:
        st.server.stop()
        st.server = None


# A rank other than 0 keeps its connection to the store of the group it destroyed until rank 0
# stops that store: its next init_process_group waits for that first, so that it cannot join the
# old store in the moment before rank 0 stops it (see _await_old_store).
_old_store: Optional[Any] = None


def _close_old_store() -> None:
    global _old_store
    old, _old_store = _old_store, None
    if old is not None:
        old.close()


atexit.register(_close_old_store)


def _await_old_store(rank: int, timeout: float) -> None:
    """Waits until rank 0 stopped the store of the last destroyed group (the kept connection
    drops), or raises after timeout naming what rank 0 has not done."""
    global _old_store
    old, _old_store = _old_store, None
    if old is None:
        return
    try:
        old.wait(["ddpc/never"], timeout)
    except _C.DistributedTimeoutError:
        raise _C.DistributedTimeoutError(
            f"rank {rank}: init_process_group: the store of the previous process group (served "
            f"by rank 0) is still up after {timeout:.0f} s: rank 0 has not finished "
            f"destroy_process_group(). Call destroy_process_group() on every rank before "
            f"init_process_group() again") from None
    except _C.DistributedError:
        pass  # the connection is gone: rank 0 stopped the old store, as awaited
    finally:
        old.close()


def destroy_process_group(group: Any = None) -> None:
    """Leaves the process group and frees its resources. Rank 0, which serves the store, waits
    (up to 10 s, saying so after 2 s) for the other ranks to leave first so none of them loses
    the store mid-call; not for a rank that exited or was killed without leaving."""
    global _state
    if group is not None and _state is not None and group is not _state.group:
        _finish_unwaited({group})
        group.destroy()
        if group in _state.subgroups:
            _state.subgroups.remove(group)
        return
    global _old_store
    st = _state
    if st is None:
        return
    _finish_unwaited({st.group, *st.subgroups})
    _state = None
    try:
        _destroy_subgroups(st)  # (first: while every rank's store is still there)
        if st.store is not None and st.group is not None and st.world_size > 1:
            st.group.destroy()
            st.group = None
            if st.rank == 0:
                _await_leavers(st)
            else:
                st.store.set(f"ddpc/left/{st.rank}", b"1")
                _close_old_store()
                _old_store, st.store = st.store, None
    except _C.DistributedError:
        pass  # a peer or the store is already gone: nothing left to coordinate with
    finally:
        _release(st)


def _finish_unwaited(groups: set) -> None:
    """Before these groups go: the collectives posted on them end first (an async one nobody
    waited for still lands), and those with a copy into an output list do it. One of those
    that fails is a warning: the group goes anyway."""
    for g in groups:
        try:
            g.wait_idle()
        except (_C.DistributedError, ValueError):
            pass  # (failing or destroyed already: destroying it is what is left to do)
    for w in sorted(set(_unwaited) | set(_held), key=lambda w: w.seq):
        if w._group not in groups or w._done or w._error is not None:
            continue
        _unwaited.discard(w)
        try:
            w.wait()
        except _C.DistributedError as e:
            warnings.warn(f"destroy_process_group: collective #{w.seq}, started with "
                          f"async_op=True and never waited for, failed while the group was "
                          f"being destroyed: {e}", stacklevel=3)


def _await_leavers(st: _State, limit_s: float = 10.0) -> None:
    """Rank 0, which serves the store, waits for the other ranks to leave the group first (up
    to limit_s), so none of them loses the store mid-call. A rank whose connection dropped
    without a goodbye (it exited or was killed) is not waited for."""
    start = time.monotonic()
    pending = set(range(1, st.world_size))
    said = False
    while True:
        pending = {r for r in pending if not st.store.check([f"ddpc/left/{r}"])
                   and not st.store.check([f"ddpc/dead/{r}"])}
        waited = time.monotonic() - start
        if not pending or waited >= limit_s:
            return
        if waited >= 2.0 and not said:
            said = True
            print(f"ddpc: rank 0's destroy_process_group waits up to {limit_s:.0f} s for "
                  f"rank(s) {sorted(pending)} to leave the group first: call "
                  f"destroy_process_group() on every rank", file=sys.stderr, flush=True)
        time.sleep(0.01)


def _require() -> _State:
    if _state is None:
        raise RuntimeError("the default process group is not initialized: call "
                           "ddpc.init_process_group() first (or start with python -m ddpc.launch)")
    return _state


def is_initialized() -> bool:
    """True between init_process_group and destroy_process_group."""
    return _state is not None


def is_available() -> bool:
    return True


def get_rank(group: Any = None) -> int:
    """This process's rank in the default group (0 when not initialized, like single-process)."""
    return _state.rank if _state is not None else 0


def get_world_size(group: Any = None) -> int:
    """Number of ranks (1 when not initialized)."""
    return _state.world_size if _state is not None else 1


def get_local_rank() -> int:
    """This process's rank on its node (LOCAL_RANK)."""
    if _state is not None:
        return _state.local_rank
    return _env_int("LOCAL_RANK") or 0


def get_local_world_size() -> int:
    if _state is not None:
        return _state.local_world_size
    return _env_int("LOCAL_WORLD_SIZE") or 1


def get_backend(group: Any = None) -> str:
    return _group(group).backend


def get_global_rank(group: Any, group_rank: int) -> int:
    """The global rank of group_rank in group: the same number, as every ddpc group spans every
    rank."""
    return _check_rank(_group(group), group_rank, "group_rank", "get_global_rank")


def get_group_rank(group: Any, global_rank: int) -> int:
    """The rank in group of global_rank: the same number (see get_global_rank)."""
    return _check_rank(_group(group), global_rank, "global_rank", "get_group_rank")


def is_nccl_available() -> bool:
    """True when this build has CUDA and NCCL can be loaded (backend 'nccl')."""
    if not _C.cuda_built():
        return False
    try:
        _C.nccl_version()
    except _C.DistributedError:
        return False
    return True


def is_gloo_available() -> bool:
    """True: backend 'gloo' is ddpc's cpu backend, always built."""
    return True


def is_torchelastic_launched() -> bool:
    """True when started by ddpc.launch or torchrun (TORCHELASTIC_RUN_ID is set)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


class _GroupMember:
    """torch.distributed.group / GroupMember: WORLD is the default group (None before
    init_process_group; group=None means it too)."""
    NON_GROUP_MEMBER = -100

    @property
    def WORLD(self) -> Any:  # noqa: N802 - torch's name
        return _state.group if _state is not None else None


GroupMember = _GroupMember()


def new_group(ranks: Optional[Sequence[int]] = None, timeout: Any = None,
              backend: Optional[str] = None, pg_options: Any = None,
              use_local_synchronization: bool = False, group_desc: Optional[str] = None,
              device_id: Any = None) -> Any:
    """A second process group of every rank, e.g. backend='gloo' beside an nccl default group
    for host-memory collectives, or another timeout (torch.distributed.new_group). Every rank
    must call it, in the same order. `ranks` must be None or every rank: ddpc's groups span the
    whole job (NotImplementedError otherwise). Pass it as group= to collectives; it goes with
    destroy_process_group(). pg_options, use_local_synchronization, group_desc and device_id
    are accepted for torch's signature."""
    del pg_options, use_local_synchronization, group_desc, device_id
    st = _require()
    if ranks is not None:
        try:
            members = sorted(operator.index(r) for r in ranks)
        except TypeError:
            raise TypeError(f"new_group: ranks must be a list of int ranks or None, got "
                            f"{ranks!r}") from None
        bad = sorted({r for r in members if not 0 <= r < st.world_size} |
                     {r for r in members if members.count(r) > 1})
        if bad:
            said = ", ".join(f"rank {r} is named twice" if 0 <= r < st.world_size else
                             f"{r} is not a rank" for r in bad)
            raise ValueError(f"new_group(ranks={list(ranks)!r}): {said} (the ranks are "
                             f"0..{st.world_size - 1}, each named once)")
        if members != list(range(st.world_size)):
            raise NotImplementedError(
                f"new_group(ranks={list(ranks)!r}): a group of some of the {st.world_size} ranks "
                f"is not supported; ddpc's groups span every rank. Use new_group() (all ranks), "
                f"or let the other ranks take part with neutral values (zeros for a sum)")
    b = st.backend if backend is None else _pick_backend(backend)
    if b == "nccl" and st.device_index is None:
        raise ValueError("new_group(backend='nccl'): this process is bound to no GPU, as the "
                         "default group uses the cpu backend: call "
                         "init_process_group(backend='nccl') to use NCCL")
    seconds = st.timeout if timeout is None else _timeout_seconds(timeout)
    st.groups_made += 1
    try:
        g = _C.Group(st.store, st.rank, st.world_size, local_rank=st.local_rank,
                     local_world_size=st.local_world_size, backend=b, timeout=seconds,
                     prefix=f"g{st.groups_made}", transport=_cpu_transport(),
                     host_id=_host_id(),
                     bind_addr=_local_addr_towards(st.master[0], _multi_node(st)),
                     device=-1 if b != "nccl" else st.device_index)
    except _C.DistributedTimeoutError as e:
        raise _C.DistributedTimeoutError(
            f"new_group (the group #{st.groups_made} this rank made): {e}\n(every rank must call "
            f"new_group, the same number of times and in the same order)") from None
    st.subgroups.append(g)
    return g


def get_store() -> Any:
    """The rendezvous store client of the default group (set/get/add/wait/check...)."""
    return _require().store


def _default_group() -> Any:
    return _require().group


def device() -> Any:
    """The device this rank owns: torch.device('cuda', i) when bound to a GPU, else cpu. Returns
    a torch.device when torch is importable, else the string 'cuda:i' / 'cpu'."""
    index = _state.device_index if _state is not None else None
    if _state is None and _C.cuda_built() and _C.cuda_device_count() > 0:
        index = min(get_local_rank(), _C.cuda_device_count() - 1)
    name = "cpu" if index is None else f"cuda:{index}"
    try:
        import torch
    except ImportError:
        return name
    return torch.device(name)


# ------------------------------------------------------------------------- arrays -> buffers


class _Buffer:
    __slots__ = ("ptr", "count", "dtype", "device", "stream", "owner", "shape", "kind")

    def __init__(self, ptr: int, count: int, dtype: int, device: int, stream: int, owner: Any,
                 shape: Tuple[int, ...], kind: Optional[str] = None) -> None:
        self.ptr, self.count, self.dtype = ptr, count, dtype
        self.device, self.stream, self.owner, self.shape = device, stream, owner, shape
        self.kind = kind  # "bool" or "complex" for a _CARRIED dtype, else None


def _dtype_entry(name: str, what: str) -> Tuple[int, int, Optional[str]]:
    """(the core's dtype code, its elements per element of `name`, "bool"/"complex"/None)."""
    code = _DTYPE_CODES.get(name)
    if code is not None:
        return code, 1, None
    carried = _CARRIED.get(name)
    if carried is not None:
        return _DTYPE_CODES[carried[0]], carried[1], carried[2]
    raise TypeError(f"{what} has dtype {name}, which ddpc collectives do not support: use one "
                    f"of {', '.join(list(_DTYPE_CODES) + list(_CARRIED))}")


def _op_for(b: "_Buffer", redop: int, what: str) -> int:
    """The reduction to run on b's carried elements: complex numbers add (SUM, AVG) part by part
    and have no order; bools reduce as torch's NCCL backend does (SUM: any, PRODUCT: all), and
    BAND and BOR of bools as MIN and MAX (the same on 0 and 1, and NCCL has those)."""
    if b.kind is None:
        return redop
    name = ReduceOp(redop).name
    if b.kind == "complex":
        if redop in (ReduceOp.SUM, ReduceOp.AVG):
            return redop
        raise ValueError(f"{what}: op={name} is not defined for complex numbers: use SUM or AVG")
    if redop == ReduceOp.AVG:
        raise ValueError(f"{what}: op=AVG of bool elements has no bool result: use SUM or MAX "
                         f"(any rank True), PRODUCT or MIN (every rank True), or pass a floating-"
                         f"point tensor")
    return int({ReduceOp.SUM: ReduceOp.MAX, ReduceOp.PRODUCT: ReduceOp.MIN,
                ReduceOp.BAND: ReduceOp.MIN, ReduceOp.BOR: ReduceOp.MAX}.get(redop, redop))


_ELEMENT_BYTES = {0: 4, 1: 8, 2: 2, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1}  # by the core's dtype code


def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _staged_copy(t: Any) -> Tuple[Any, Any]:
    """(a fresh tensor like torch tensor t, a function that copies it into t)."""
    import torch
    c = torch.empty_like(t, memory_format=torch.contiguous_format)

    def back() -> None:
        with torch.no_grad():
            t.copy_(c)
    return c, back


def _overlaps_off_block(big: "_Buffer", small: "_Buffer", rank: int) -> bool:
    """Whether small's memory overlaps big's anywhere but exactly at this rank's block of big
    (the in-place layout NCCL defines for all_gather and reduce_scatter). The cpu backend stages
    such calls itself; for device memory, the caller stages them."""
    size = _ELEMENT_BYTES[big.dtype]
    b0, b1 = big.ptr, big.ptr + big.count * size
    s0, s1 = small.ptr, small.ptr + small.count * size
    if small.count == 0 or big.count == 0 or s1 <= b0 or b1 <= s0:
        return False
    return s0 != b0 + rank * small.count * size


class _NotContiguous(ValueError):
    """_as_buffer's answer to a strided array: the caller stages it (_buffer_of)."""


def _buffer_of(x: Any, what: str, writable: bool = True) -> Tuple["_Buffer", Any]:
    """(_as_buffer(x), None), or for a strided x, the buffer of a contiguous copy and the
    function that copies the result back (_staged). A contiguous x pays nothing more."""
    try:
        return _as_buffer(x, what, writable), None
    except _NotContiguous:
        c, back = _staged(x, writable)
        return _as_buffer(c, what, writable), back


def _staged(x: Any, writable: bool = True) -> Tuple[Any, Any]:
    """(x, None) for a C-contiguous x; else (a contiguous copy of it, and, when writable, a
    function that copies the result back into x), as gloo takes a strided tensor (a transposed
    or step-sliced one, or a channels_last gradient)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.layout is not torch.strided or x.is_contiguous():
            return x, None
        if writable and any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
            raise ValueError(f"the output (shape {tuple(x.shape)}, strides {x.stride()}) has "
                             f"elements that share memory (an expand() view): pass a tensor of "
                             f"its own, e.g. x.clone()")
        c = x.contiguous()

        def back() -> None:
            with torch.no_grad():
                x.copy_(c)
        return c, back if writable else None
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray) and not x.flags["C_CONTIGUOUS"]:
        if writable and not x.flags["WRITEABLE"]:
            return x, None  # (refused by _numpy_buffer, which says why)
        c = np.ascontiguousarray(x)

        def back_np() -> None:
            x[...] = c
        return c, back_np if writable else None
    return x, None


_TORCH_DTYPE_CODES: dict = {}  # torch.dtype -> code, filled on first use (keeps torch optional)


def _raw_stream(dev: int) -> int:
    """The handle of torch's current CUDA stream on device dev. torch's private
    _cuda_getCurrentRawStream answers in a fraction of a microsecond, where
    torch.cuda.current_stream(dev).cuda_stream builds a Stream object (about 6 us, measured by
    benchmarks/latency.py): that matters on every small collective."""
    global _raw_stream_fn
    fn = _raw_stream_fn
    if fn is None:
        import torch
        fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if fn is None:  # an older or newer torch without it: the public, slower way
            fn = lambda d: torch.cuda.current_stream(d).cuda_stream  # noqa: E731
        _raw_stream_fn = fn
    return fn(dev)


def _current_device() -> int:
    import torch
    return torch.cuda.current_device()


_raw_stream_fn: Any = None


def _torch_buffer(t: Any, what: str) -> _Buffer:
    # This runs on every collective: keep it to attribute reads and dict lookups.
    entry = _TORCH_DTYPE_CODES.get(t.dtype)
    if entry is None:
        entry = _dtype_entry(str(t.dtype).replace("torch.", ""), what)
        _TORCH_DTYPE_CODES[t.dtype] = entry
    dtype, per, kind = entry
    # Layout first: a sparse tensor's is_contiguous() raises instead of answering.
    if t.layout is not sys.modules["torch"].strided:
        raise TypeError(f"{what} must be a dense (strided) tensor, got layout {t.layout}")
    if not t.is_contiguous():
        raise _NotContiguous(f"{what} is not contiguous (shape {tuple(t.shape)}, strides "
                             f"{t.stride()}): pass tensor.contiguous() and copy the result back")
    if t.is_neg():
        # Its memory holds the negated values: MIN would act as MAX, and the result be negated.
        raise ValueError(f"{what} is a negated view (torch.is_neg(): its memory holds -x, as "
                         f"from torch._neg_view or the imaginary part of a conj()): pass "
                         f"tensor.resolve_neg() and copy the result back")
    if kind == "complex" and t.is_conj():
        raise ValueError(f"{what} is a conjugate view (torch.is_conj(): its memory holds the "
                         f"unconjugated values): pass tensor.resolve_conj() and copy the result "
                         f"back")
    dev_t = t.device
    if dev_t.type == "cuda":
        dev = dev_t.index if dev_t.index is not None else _current_device()
        stream = _raw_stream(dev)
    elif dev_t.type == "cpu":
        dev, stream = -1, 0
    else:
        raise TypeError(f"{what} is on device {dev_t}: ddpc works on cpu and cuda tensors")
    return _Buffer(t.data_ptr(), t.numel() * per, dtype, dev, stream, t, (), kind)


def _numpy_buffer(a: Any, what: str, writable: bool) -> _Buffer:
    if not a.flags["C_CONTIGUOUS"]:
        if writable and not a.flags["WRITEABLE"]:
            raise ValueError(f"{what} is read-only, but the collective writes its result into it")
        raise _NotContiguous(f"{what} is not C-contiguous: pass numpy.ascontiguousarray(x) and "
                             f"copy the result back")
    if not a.dtype.isnative:
        raise ValueError(f"{what} has non-native byte order ({a.dtype.str}): the collective would "
                         f"misread its values; pass x.astype(x.dtype.newbyteorder('='))")
    if writable and not a.flags["WRITEABLE"]:
        raise ValueError(f"{what} is read-only, but the collective writes its result into it")
    code, per, kind = _dtype_entry(a.dtype.name, what)
    return _Buffer(a.ctypes.data, a.size * per, code, -1, 0, a, tuple(a.shape), kind)


def _as_buffer(x: Any, what: str, writable: bool = True) -> _Buffer:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _torch_buffer(x, what)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return _numpy_buffer(x, what, writable)
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is not None:
        typestr = cai["typestr"].lstrip("<>|=")
        name = _TYPESTR.get(typestr)
        if name is None:
            raise TypeError(f"{what} has typestr {cai['typestr']}, which ddpc does not support")
        if cai.get("strides") not in (None, ()):
            raise ValueError(f"{what} must be C-contiguous (its __cuda_array_interface__ has "
                             f"strides {cai['strides']})")
        count = 1
        for n in cai["shape"]:
            count *= n
        ptr = cai["data"][0]
        stream = cai.get("stream") or 0
        if stream in (1, 2):  # the legacy / per-thread default stream markers
            stream = 0
        dev = _pointer_device(x)
        code, per, kind = _dtype_entry(name, what)
        return _Buffer(ptr, count * per, code, dev, stream, x, tuple(cai["shape"]), kind)
    if hasattr(x, "__dlpack__"):
        dev_type, dev_id = x.__dlpack_device__() if hasattr(x, "__dlpack_device__") else (1, 0)
        if dev_type == 1:  # kDLCPU
            import numpy
            return _numpy_buffer(numpy.from_dlpack(x), what, writable)
        if torch is not None:
            return _torch_buffer(torch.from_dlpack(x), what)
        raise TypeError(f"{what} lives on DLPack device type {dev_type}: install torch, or pass "
                        f"an object with __cuda_array_interface__")
    raise TypeError(f"{what} must be a torch.Tensor, a numpy.ndarray, or an array with "
                    f"__dlpack__ / __cuda_array_interface__, got {type(x).__name__}")


def _pointer_device(x: Any) -> int:
    dev = getattr(x, "device", None)
    idx = getattr(dev, "id", None)
    if isinstance(idx, int):
        return idx
    return _state.device_index if _state is not None and _state.device_index is not None else 0


# ------------------------------------------------------------------------- collectives


# The Works of async collectives that still have host work to do when they end (a copy into an
# output list: all_gather's, gather's, scatter's), held here even when the caller dropped them,
# until that copy is done: by wait() or is_completed(), by any later collective call once the
# collective has ended, or by destroy_process_group. (One without such a copy needs nothing: the
# C core holds its buffers until it ends, and destroy_process_group waits for the group to be
# idle first.)
_unwaited: set = set()
# The others, while their caller holds them: destroy_process_group says when one failed.
_held: "weakref.WeakSet[Work]" = weakref.WeakSet()


def _settle_ended() -> None:
    """Finishes the async collectives that ended with a copy into an output list still to do
    (all_gather, gather, scatter into a list): called at each collective this process posts,
    and after each synchronous one returns, so their outputs are filled by then, as gloo's
    are, even if nobody waits for them."""
    for old in tuple(_unwaited):  # (a snapshot: other threads may post meanwhile)
        if old._work.is_completed():
            old._settle()


def _track_unwaited(w: "Work") -> None:
    _settle_ended()
    _unwaited.add(w)


class Work:
    """Handle of a collective started with async_op=True (torch.distributed's Work)."""

    def __init__(self, work: Any, finish: Any = None, device_side: bool = False,
                 stream: int = 0, group: Any = None) -> None:
        self._work = work
        self._finish = finish
        self._device_side = device_side
        self._stream = stream
        self._done = False
        self._group = group
        self._error: Optional[BaseException] = None  # what _settle's wait raised, for wait()
        self._copied: Any = None  # on GPU: a CUDA event after finish's copies
        if finish is not None:
            # (finish runs once, under this lock: a thread asking is_completed() or wait() while
            # another thread copies the outputs waits for the copy to end)
            self._finishing = threading.Lock()
            _track_unwaited(self)
        else:
            _held.add(self)

    def _settle(self) -> None:
        """Finishes an ended collective nobody waited for (its copy into the output list); what
        it raises is kept for the caller's own wait(), if any."""
        _unwaited.discard(self)
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - re-raised by wait() for whoever waits
            self._error = e

    def wait(self, timeout: Any = None) -> bool:
        """Waits for the collective. On GPU, makes the current CUDA stream wait for it (no host
        sync), like torch's NCCL work. Raises ddpc.DistributedError if it failed. `timeout` is
        accepted for torch compatibility; the deadline is the group's timeout, set at
        init_process_group."""
        if self._error is not None:
            raise self._error
        _unwaited.discard(self)
        _held.discard(self)
        if self._device_side:
            self._work.wait(_raw_stream(_current_device()), True)
        else:
            self._work.wait()
        if self._finish is not None and not self._done:
            with self._finishing:
                if self._error is not None:
                    raise self._error
                if not self._done:
                    try:
                        self._finish()
                        if self._device_side:  # (the copies, queued on this thread's stream)
                            import torch
                            self._copied = torch.cuda.Event()
                            self._copied.record()
                    except BaseException as e:
                        self._error = e
                        raise
                    finally:
                        self._done = True
        elif self._copied is not None:
            # Another thread made the copies into the outputs, on its own current stream: this
            # thread's stream waits for them too, as for the collective.
            import torch
            torch.cuda.current_stream().wait_event(self._copied)
        return True

    def is_completed(self) -> bool:
        """True once the collective finished (successfully or not), its outputs written;
        never blocks."""
        if not self._work.is_completed():
            return False
        if self._finish is not None and not self._done and self._error is None:
            self._settle()  # (the copy into the output list: done before saying it is done)
        return True

    def is_success(self) -> bool:
        """True once the collective finished without error (False while it runs, or when it
        failed: wait() raises why)."""
        return self.is_completed() and not self._work.failed()

    @property
    def seq(self) -> int:
        return self._work.seq


def _group(group: Any) -> Any:
    st = _require()
    if group is None or group is st.group:
        return st.group
    if isinstance(group, _C.Group):
        return group
    raise TypeError(f"group must be None (the default group) or a group from new_group(), got "
                    f"{type(group).__name__}")


def _run(g: Any, op: int, send: Optional[_Buffer], recv: _Buffer, count: int, redop: int,
         root: int, keep: Any, async_op: bool, finish: Any = None) -> Optional[Work]:
    if send is not None and send.device != recv.device:
        raise ValueError(f"input and output are on different devices ({send.device} and "
                         f"{recv.device}); put both on the same device")
    if recv.device >= 0 and g.backend != "nccl":
        raise ValueError("a CUDA tensor was passed to a process group with backend 'cpu': call "
                         "init_process_group(backend='nccl') or move the tensor to the cpu")
    if recv.device < 0 and g.backend == "nccl":
        raise ValueError("a host (cpu) array was passed to a process group with backend 'nccl': "
                         "move it to ddpc.device(), or use backend='cpu'")
    if _unwaited:
        _settle_ended()
    work = g.post(op, send.ptr if send is not None else 0, recv.ptr, count, recv.dtype, redop,
                  root, recv.device, recv.stream, keep)
    if async_op:
        return Work(work, finish, device_side=recv.device >= 0, stream=recv.stream, group=g)
    # Synchronous: the caller's stream (device) or thread (host) waits right away.
    if recv.device >= 0:
        work.wait(recv.stream, True)
    else:
        work.wait()
    if finish is not None:
        finish()
    if _unwaited:
        _settle_ended()  # (async ones posted before this one, in its group, have ended)
    return None


def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Optional[Work]:
    """Reduces tensor across ranks in place (op: "sum", "avg", "min", "max", "prod" or a
    ddpc.ReduceOp). With async_op=True returns a Work; otherwise returns None when done."""
    return _all_reduce(tensor, op, group, async_op, 0)


def _all_reduce(tensor: Any, op: Any, group: Any, async_op: bool, dst: int) -> Optional[Work]:
    """all_reduce, carrying reduce's dst (0 for a plain all_reduce) to the ranks' comparison of
    their calls (the cpu backend's): ranks that name different dst values raise MismatchError."""
    g = _group(group)
    try:
        b, back = _as_buffer(tensor, "all_reduce: tensor"), None
    except _NotContiguous:
        b, back = _buffer_of(tensor, "all_reduce: tensor")
    redop = _reduce_op(op)
    if b.kind is not None:
        redop = _op_for(b, redop, "all_reduce")
    # Small synchronous all-reduces of device memory: one kernel on the caller's stream, no Work
    # (nccl between the GPUs of one host; the backend says False when it has no such path).
    if not async_op and b.device >= 0 and g.all_reduce_now(b.ptr, b.count, b.dtype, redop,
                                                           b.device, b.stream):
        if back is not None:
            back()
        return None
    return _run(g, _ALLREDUCE, None, b, b.count, redop, dst, b.owner, async_op, back)


def _named(name: str) -> Any:
    """For a collective made of the core's others (scatter is a broadcast, gather_object an
    all_gather, ...): a DistributedError from inside names the call the user made first, e.g.
    "scatter: broadcast #5: rank 0 called broadcast(...) but rank 1 called all_gather(...)". One
    built on another (gather_object on all_gather_object) names only the outer call."""
    _NAMED.add(name)

    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except _C.DistributedError as e:
                text = str(e)
                if text.startswith((name + ":", name + " ")):
                    raise
                inner = next((n for n in _NAMED if text.startswith(n + ": ")), None)
                if inner is not None:
                    text = text[len(inner) + 2:]
                raise type(e)(f"{name}: {text}").with_traceback(e.__traceback__) from None
        return call
    return wrap


_NAMED: set = set()  # the calls _named wraps


@_named("reduce")
def reduce(tensor: Any, dst: int = 0, op: Any = ReduceOp.SUM, group: Any = None,
           async_op: bool = False) -> Optional[Work]:
    """Rank dst's tensor becomes the reduction over ranks, in place; the other ranks' tensors stay
    as they were (torch.distributed.reduce). An all-reduce, of a copy on the other ranks: meant
    for metrics and losses, where the extra copy does not matter. tensor must be a torch tensor
    or a NumPy array (TypeError otherwise, on every rank)."""
    g = _group(group)
    dst = _check_rank(g, dst, "dst", "reduce")
    torch = sys.modules.get("torch")
    is_torch = torch is not None and isinstance(tensor, torch.Tensor)
    if not is_torch and not (type(tensor).__module__ == "numpy" and hasattr(tensor, "copy")):
        # Checked on every rank, dst too, so no rank is left waiting in the all-reduce.
        raise TypeError(f"reduce: the ranks other than dst keep their tensor, so they need a copy "
                        f"of it, and a {type(tensor).__name__} cannot be copied here: pass a "
                        f"torch tensor or a NumPy array, or use all_reduce")
    if g.rank == dst:
        return _all_reduce(tensor, op, group, async_op, dst)
    scratch = tensor.clone() if is_torch else tensor.copy()
    return _all_reduce(scratch, op, group, async_op, dst)


def _check_rank(g: Any, value: Any, name: str, op: str) -> int:
    """A src / dst argument must be an int rank of the group (a NumPy or torch integer too, as
    torch takes): returned as an int."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int rank, got {type(value).__name__}") from None
    if not 0 <= value < g.world_size:
        raise ValueError(f"{op}: {name}={value} is not a rank of this group "
                         f"(0..{g.world_size - 1})")
    return value


def broadcast(tensor: Any, src: int = 0, group: Any = None, async_op: bool = False) -> Optional[Work]:
    """Copies rank src's tensor into every rank's tensor (in place)."""
    g = _group(group)
    src = _check_rank(g, src, "src", "broadcast")
    b, back = _buffer_of(tensor, "broadcast: tensor", writable=g.rank != src)  # (src reads it)
    return _run(g, _BROADCAST, None, b, b.count, 0, src, b.owner, async_op, back)


def _check_world_multiple(op: str, big_name: str, big: _Buffer, small_name: str, small: _Buffer,
                          world: int) -> None:
    """The full-size side of an all_gather / reduce_scatter must hold world_size times the
    per-rank side, in the same dtype."""
    if big.count != small.count * world:
        raise ValueError(f"{op}: {big_name} has {big.count} elements but needs world_size * "
                         f"{small_name} = {world} * {small.count} = {world * small.count}")
    if big.dtype != small.dtype or big.kind != small.kind:
        raise TypeError(f"{op}: input and output dtypes differ")


def all_gather_into_tensor(output_tensor: Any, input_tensor: Any, group: Any = None,
                           async_op: bool = False) -> Optional[Work]:
    """output_tensor (world_size * input.numel() elements) receives every rank's input in rank
    order."""
    g = _group(group)
    inp = _buffer_of(input_tensor, "all_gather: input", writable=False)[0]
    out, back = _buffer_of(output_tensor, "all_gather: output")
    _check_world_multiple("all_gather", "output", out, "input", inp, g.world_size)
    if inp.device >= 0 and _is_torch(inp.owner) and _overlaps_off_block(out, inp, g.rank):
        # (an input overlapping the output off its own slot: from a copy of it)
        inp = _as_buffer(inp.owner.clone(), "all_gather: input", writable=False)
    return _run(g, _ALLGATHER, inp, out, inp.count, 0, 0, (inp.owner, out.owner), async_op,
                back)


def _concat_like(items: Sequence[Any], what: str) -> Tuple[Any, Any]:
    """A fresh flat array holding len(items) equally shaped arrays, and a function to split it."""
    first = items[0]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(first, torch.Tensor):
        for i, t in enumerate(items):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"{what}[{i}] has shape {tuple(t.shape)} {t.dtype} on {t.device} "
                                 f"but {what}[0] has {tuple(first.shape)} {first.dtype} on "
                                 f"{first.device}: all must match")
        flat = torch.empty((len(items),) + tuple(first.shape), dtype=first.dtype,
                           device=first.device)
        return flat, lambda: [flat[i] for i in range(len(items))]
    import numpy as np
    arrays = [np.asarray(a) for a in items]
    for i, a in enumerate(arrays):
        if a.shape != arrays[0].shape or a.dtype != arrays[0].dtype:
            raise ValueError(f"{what}[{i}] has shape {a.shape} {a.dtype} but {what}[0] has "
                             f"{arrays[0].shape} {arrays[0].dtype}: all must match")
    flat = np.empty((len(items),) + arrays[0].shape, dtype=arrays[0].dtype)
    return flat, lambda: [flat[i] for i in range(len(items))]


def _flat_like(x: Any, count: int, what: str) -> Any:
    """A fresh 1-D array of count elements of x's dtype, on x's device (a torch tensor or
    anything NumPy takes)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch.empty(count, dtype=x.dtype, device=x.device)
    import numpy as np
    try:
        return np.empty(count, dtype=np.asarray(x).dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}: pass a torch tensor or a NumPy array, got "
                        f"{type(x).__name__} ({e})") from None


def _numel(x: Any) -> Optional[int]:
    n = getattr(x, "numel", None)
    if callable(n):
        return int(n())
    size = getattr(x, "size", None)
    return size if isinstance(size, int) else None


def _copy_into(dst: Any, src: Any) -> None:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dst, torch.Tensor):
        with torch.no_grad():  # (a collective writes outputs as data, as gloo's does)
            dst.copy_(src)
    else:
        dst[...] = src


def all_gather(tensor_list: List[Any], tensor: Any, group: Any = None,
               async_op: bool = False) -> Optional[Work]:
    """tensor_list[r] receives rank r's tensor (torch.distributed.all_gather)."""
    g = _group(group)
    if not isinstance(tensor_list, (list, tuple)) or len(tensor_list) != g.world_size:
        raise ValueError(f"all_gather: tensor_list must be a list of world_size={g.world_size} "
                         f"arrays, got {type(tensor_list).__name__} of length "
                         f"{len(tensor_list) if hasattr(tensor_list, '__len__') else '?'}")
    flat, split = _concat_like([tensor] * g.world_size, "all_gather: tensor")
    inp = _buffer_of(tensor, "all_gather: tensor", writable=False)[0]
    want = (getattr(tensor, "dtype", None), _numel(tensor))
    for i, dst in enumerate(tensor_list):
        got = (getattr(dst, "dtype", None), _numel(dst))
        if _kind_name(dst) != _kind_name(tensor):
            raise TypeError(f"all_gather: tensor_list[{i}] is a {_kind_name(dst)} but tensor is a "
                            f"{_kind_name(tensor)}: pass entries of tensor's kind "
                            f"(torch.empty_like(tensor) or numpy.empty_like(tensor))")
        if got != want:
            raise ValueError(f"all_gather: tensor_list[{i}] holds {got[1]} x {got[0]} but tensor "
                             f"is {want[1]} x {want[0]}: every entry of tensor_list must have "
                             f"tensor's dtype and number of elements (torch.empty_like(tensor))")
    out = _as_buffer(flat, "all_gather: output")

    def finish() -> None:
        for dst, part in zip(tensor_list, split()):
            _copy_into(dst, part.reshape(dst.shape))

    return _run(g, _ALLGATHER, inp, out, inp.count, 0, 0, (inp.owner, flat), async_op, finish)


def _kind_name(x: Any) -> str:
    """torch.Tensor, numpy.ndarray, or the module and name of another array's type."""
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch.Tensor"
    if np is not None and isinstance(x, np.ndarray):
        return "numpy.ndarray"
    return f"{type(x).__module__.split('.')[0]}.{type(x).__name__}"


def _list_problem(op: str, name: str, items: Any, tensor: Any, g: Any, root: int,
                  root_name: str) -> Optional[str]:
    """Why items cannot be gather's gather_list / scatter's scatter_list for tensor on this
    rank (the root passes world_size tensors like tensor, the others none), or None."""
    world = g.world_size
    if g.rank != root:
        return None if not items else (
            f"{op}: rank {g.rank} is not {root_name}={root}, so it passes no {name} (torch's "
            f"rule), got {len(items)} entries")
    if not isinstance(items, (list, tuple)) or len(items) != world:
        return (f"{op}: {name} must be a list of world_size={world} tensors, got "
                f"{type(items).__name__}"
                + (f" of length {len(items)}" if hasattr(items, "__len__") else ""))
    want = (getattr(tensor, "dtype", None), _numel(tensor))
    for i, t in enumerate(items):
        got = (getattr(t, "dtype", None), _numel(t))
        if _kind_name(t) != _kind_name(tensor):
            return (f"{op}: {name}[{i}] is a {_kind_name(t)} but tensor is a "
                    f"{_kind_name(tensor)}: every entry must be of tensor's kind")
        if got != want:
            return (f"{op}: {name}[{i}] holds {got[1]} x {got[0]} but tensor is {want[1]} x "
                    f"{want[0]}: every entry must have tensor's dtype and number of elements")
    return None


@_named("gather")
def gather(tensor: Any, gather_list: Optional[List[Any]] = None, dst: int = 0,
           group: Any = None, async_op: bool = False) -> Optional[Work]:
    """On rank dst, gather_list[r] receives rank r's tensor; the other ranks pass None
    (torch.distributed.gather). An all-gather into a scratch buffer on every rank: meant for
    metrics and predictions, where world_size copies do not matter."""
    g = _group(group)
    dst = _check_rank(g, dst, "dst", "gather")
    problem = _list_problem("gather", "gather_list", gather_list, tensor, g, dst, "dst")
    flat, split = _concat_like([tensor] * g.world_size, "gather: tensor")
    inp = _buffer_of(tensor, "gather: tensor", writable=False)[0]
    out = _as_buffer(flat, "gather: output")

    def finish() -> None:
        if problem is not None:  # (raised after taking part, so no rank is left waiting)
            raise ValueError(problem)
        if g.rank == dst:
            for t, part in zip(gather_list, split()):
                _copy_into(t, part.reshape(t.shape))

    return _run(g, _ALLGATHER, inp, out, inp.count, 0, dst, (inp.owner, flat), async_op, finish)


@_named("scatter")
def scatter(tensor: Any, scatter_list: Optional[List[Any]] = None, src: int = 0,
            group: Any = None, async_op: bool = False) -> Optional[Work]:
    """Each rank r's tensor receives rank src's scatter_list[r]; the other ranks pass None
    (torch.distributed.scatter). A broadcast of the whole list: meant for small tensors."""
    g = _group(group)
    src = _check_rank(g, src, "src", "scatter")
    problem = _list_problem("scatter", "scatter_list", scatter_list, tensor, g, src, "src")
    # One element more than the parts: src's verdict on its list (1: good), so that a list src
    # refused makes every rank raise instead of taking memory src never filled.
    n = _numel(tensor)
    flat = _flat_like(tensor, g.world_size * n + 1, "scatter: tensor")
    if g.rank == src:
        if problem is None:
            for r, t in enumerate(scatter_list):
                _copy_into(flat[r * n:(r + 1) * n], t.reshape(-1))
        flat[-1] = 1 if problem is None else 0
    b = _as_buffer(flat, "scatter: buffer")

    def finish() -> None:
        if problem is not None:
            raise ValueError(problem)
        if flat[-1] != 1:
            raise _C.DistributedError(f"scatter: rank {src} (src) refused its scatter_list (that "
                                      f"rank's error says why); rank {g.rank} got nothing")
        _copy_into(tensor, flat[g.rank * n:(g.rank + 1) * n].reshape(tensor.shape))

    return _run(g, _BROADCAST, None, b, b.count, 0, src, flat, async_op, finish)


def reduce_scatter_tensor(output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None,
                          async_op: bool = False) -> Optional[Work]:
    """output (n elements) receives this rank's n-element slice of the reduction of every rank's
    input (world_size * n elements)."""
    g = _group(group)
    inp = _buffer_of(input, "reduce_scatter: input", writable=False)[0]
    out, back = _buffer_of(output, "reduce_scatter: output")
    _check_world_multiple("reduce_scatter", "input", inp, "output", out, g.world_size)
    if (out.device >= 0 and back is None and _is_torch(out.owner)
            and _overlaps_off_block(inp, out, g.rank)):
        # (an output overlapping the input off its own block: into a copy, then back)
        output, back = _staged_copy(out.owner)
        out = _as_buffer(output, "reduce_scatter: output")
    redop = _reduce_op(op)
    if inp.kind is not None:
        redop = _op_for(inp, redop, "reduce_scatter")
    return _run(g, _REDUCE_SCATTER, inp, out, out.count, redop, 0, (inp.owner, out.owner),
                async_op, back)


def reduce_scatter(output: Any, input_list: List[Any], op: Any = ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Optional[Work]:
    """output receives the reduction over ranks of input_list[this rank]
    (torch.distributed.reduce_scatter)."""
    g = _group(group)
    if not isinstance(input_list, (list, tuple)) or len(input_list) != g.world_size:
        raise ValueError(f"reduce_scatter: input_list must be a list of world_size="
                         f"{g.world_size} arrays")
    flat, split = _concat_like(list(input_list), "reduce_scatter: input_list")
    for dst, src in zip(split(), input_list):
        _copy_into(dst, src)
    return reduce_scatter_tensor(output, flat, op=op, group=group, async_op=async_op)


# ------------------------------------------------------------------------- picklable objects


def _exchanged(kind: str, arr: Any, group: Any, src: int = 0) -> Any:
    """A 1-D NumPy array all-gathered ("gather": world_size times as long) or broadcast from src
    ("broadcast", in place), through the bound GPU when the group uses nccl."""
    import numpy as np
    g = _group(group)
    if g.backend == "nccl":
        import torch
        dev = device()
        mine = torch.from_numpy(np.ascontiguousarray(arr)).to(dev)
        if kind == "broadcast":
            broadcast(mine, src=src, group=group)
            return mine.cpu().numpy()
        out = torch.empty(g.world_size * mine.numel(), dtype=mine.dtype, device=dev)
        all_gather_into_tensor(out, mine, group=group)
        return out.cpu().numpy()
    if kind == "broadcast":
        broadcast(arr, src=src, group=group)
        return arr
    out = np.empty(g.world_size * arr.size, dtype=arr.dtype)
    all_gather_into_tensor(out, arr, group=group)
    return out


def _pickled(obj: Any, what: str) -> Tuple[bytes, Optional[Exception]]:
    import pickle
    try:
        return pickle.dumps(obj), None
    except Exception as e:  # noqa: BLE001 - any failure to pickle: reported on every rank
        err = TypeError(f"{what} cannot be pickled: {type(e).__name__}: {e}")
        err.__cause__ = e
        return b"", err


def _unpickled(data: bytes, what: str) -> Any:
    import pickle
    try:
        return pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - any failure to unpickle: named, with its cause
        raise _C.DistributedError(f"{what}: {type(e).__name__}: {e} (is every class it holds "
                                  f"importable, at the same version, on this rank?)") from e


@_named("all_gather_object")
def all_gather_object(object_list: List[Any], obj: Any, group: Any = None) -> None:
    """object_list[r] becomes rank r's obj, for any picklable obj
    (torch.distributed.all_gather_object). When a rank's obj cannot be pickled, every rank raises,
    naming it. The objects travel pickled: unpickling runs code, so only the job's own ranks,
    which share its DDPC_TOKEN, may take part."""
    import numpy as np
    g = _group(group)
    world = g.world_size
    if not isinstance(object_list, list) or len(object_list) != world:
        raise ValueError(f"all_gather_object: object_list must be a list of world_size={world} "
                         f"entries (it is filled in), got {type(object_list).__name__} of length "
                         f"{len(object_list) if hasattr(object_list, '__len__') else '?'}")
    data, err = _pickled(obj, f"all_gather_object: rank {g.rank}'s object")
    sizes = _exchanged("gather", np.array([-1 if err else len(data)], dtype=np.int64), group)
    bad = [r for r in range(world) if sizes[r] < 0]
    if err is not None:
        raise err
    if bad:
        raise _C.DistributedError(f"all_gather_object: rank {bad[0]}'s object cannot be pickled "
                                  f"(that rank's error says why); rank {g.rank} stops too")
    width = max(int(sizes.max()), 1)
    mine = np.zeros(width, dtype=np.uint8)
    mine[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    rows = _exchanged("gather", mine, group).reshape(world, width)
    for r in range(world):
        object_list[r] = _unpickled(rows[r, :int(sizes[r])].tobytes(),
                                    f"all_gather_object: rank {g.rank} cannot unpickle rank {r}'s "
                                    f"object")


@_named("gather_object")
def gather_object(obj: Any, object_gather_list: Optional[List[Any]] = None, dst: int = 0,
                  group: Any = None) -> None:
    """On rank dst, object_gather_list[r] becomes rank r's obj; the other ranks pass None
    (torch.distributed.gather_object). Built on all_gather_object: meant for small objects."""
    g = _group(group)
    dst = _check_rank(g, dst, "dst", "gather_object")
    bad = g.rank == dst and (not isinstance(object_gather_list, list) or
                             len(object_gather_list) != g.world_size)
    # Each rank's dst travels with its object, so that ranks naming different dst all say so
    # (each would otherwise take itself, or no one, for dst). A bad list still takes part, so
    # that the other ranks are not left waiting.
    got: List[Any] = [None] * g.world_size
    all_gather_object(got, (dst, None if bad else obj), group)
    dsts = [d for d, _ in got]
    if len(set(dsts)) > 1:
        by = {}
        for r, d in enumerate(dsts):
            by.setdefault(d, []).append(r)
        said = "; ".join(f"rank(s) {', '.join(map(str, rs))} passed dst={d}"
                         for d, rs in by.items())
        raise _C.MismatchError(f"gather_object: the ranks disagree on dst ({said}): pass the "
                               f"same dst on every rank")
    if bad:
        raise ValueError(f"gather_object: rank {dst} (dst) must pass object_gather_list, a list "
                         f"of world_size={g.world_size} entries")
    if g.rank == dst:
        object_gather_list[:] = [o for _, o in got]


@_named("scatter_object_list")
def scatter_object_list(scatter_object_output_list: List[Any],
                        scatter_object_input_list: Optional[List[Any]] = None, src: int = 0,
                        group: Any = None) -> None:
    """scatter_object_output_list[0] becomes rank src's scatter_object_input_list[r] on each rank
    r (torch.distributed.scatter_object_list). Built on broadcast_object_list: every rank
    unpickles the whole list, so meant for small objects."""
    g = _group(group)
    src = _check_rank(g, src, "src", "scatter_object_list")
    problem = None
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        problem = (f"scatter_object_list: scatter_object_output_list must be a list of at "
                   f"least one entry (its first is set), got {scatter_object_output_list!r}")
    # [src's verdict on its list, the list]: a list src refused makes every rank raise
    box: List[Any] = [False, None]
    if g.rank == src:
        items = scatter_object_input_list
        if not isinstance(items, (list, tuple)) or len(items) != g.world_size:
            problem = problem or (f"scatter_object_list: rank {src} (src) must pass "
                                  f"scatter_object_input_list, a list of world_size="
                                  f"{g.world_size} objects")
        else:
            box = [True, list(items)]
    broadcast_object_list(box, src=src, group=group)  # (bad lists too: no rank left waiting)
    if problem is not None:
        raise ValueError(problem)
    if not box[0]:
        raise _C.DistributedError(f"scatter_object_list: rank {src} (src) refused its "
                                  f"scatter_object_input_list (that rank's error says why); "
                                  f"rank {g.rank} got nothing")
    scatter_object_output_list[0] = box[1][g.rank]


@_named("broadcast_object_list")
def broadcast_object_list(object_list: List[Any], src: int = 0, group: Any = None,
                          device: Any = None) -> None:
    """Every rank's object_list becomes rank src's, element by element, for picklable elements
    (torch.distributed.broadcast_object_list; every rank passes a list of the same length).
    `device` is accepted for torch's signature; the bound device is used. The objects travel
    pickled: see all_gather_object."""
    import numpy as np
    del device
    g = _group(group)
    src = _check_rank(g, src, "src", "broadcast_object_list")
    if not isinstance(object_list, list):
        raise TypeError(f"broadcast_object_list: object_list must be a list (it is filled in), "
                        f"got {type(object_list).__name__}")
    err = None
    data = b""
    if g.rank == src:
        data, err = _pickled(list(object_list), f"broadcast_object_list: rank {src}'s list")
    head = _exchanged("broadcast", np.array([-1 if err else len(data), len(object_list)],
                                            dtype=np.int64), group, src)
    if err is not None:
        raise err
    if head[0] < 0:
        raise _C.DistributedError(f"broadcast_object_list: rank {src}'s list cannot be pickled "
                                  f"(that rank's error says why); rank {g.rank} stops too")
    buf = np.zeros(max(int(head[0]), 1), dtype=np.uint8)
    if g.rank == src:
        buf[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    buf = _exchanged("broadcast", buf, group, src)
    if g.rank == src:
        return
    if int(head[1]) != len(object_list):
        raise ValueError(f"broadcast_object_list: rank {src} sent {int(head[1])} objects but "
                         f"rank {g.rank}'s object_list has {len(object_list)}: every rank must "
                         f"pass a list of the same length")
    object_list[:] = _unpickled(buf[:int(head[0])].tobytes(),
                                f"broadcast_object_list: rank {g.rank} cannot unpickle rank "
                                f"{src}'s list")


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Optional[Work]:
    """Blocks until every rank reached the barrier (or the timeout names those that did not)."""
    g = _group(group)
    if _unwaited:
        _settle_ended()
    work = g.post(_BARRIER, 0, 0, 0, 0, 0, 0, -1, 0, None)
    if async_op:
        return Work(work, group=g)
    work.wait()
    if _unwaited:
        _settle_ended()  # (async ones posted before it, in its group, have ended)
    return None


def monitored_barrier(group: Any = None, timeout: Any = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier through the store with its own timeout (default: the group's), which names
    every rank that did not reach it (torch.distributed.monitored_barrier; wait_all_ranks is
    accepted: all of them are always named). Raises DistributedTimeoutError."""
    del wait_all_ranks
    st = _require()
    g = _group(group)
    seconds = st.timeout if timeout is None else _timeout_seconds(timeout)
    st.monitored += 1
    keys = [f"ddpc/monitored_barrier/{st.monitored}/{r}" for r in range(g.world_size)]
    st.store.set(keys[g.rank], b"1")
    try:
        st.store.wait(keys, seconds)
    except _C.DistributedTimeoutError:
        missing = [r for r in range(g.world_size) if not st.store.check([keys[r]])]
        raise _C.DistributedTimeoutError(
            f"monitored_barrier #{st.monitored}: rank(s) {', '.join(map(str, missing))} did not "
            f"reach it within {seconds:g} s (rank {g.rank} waited); their output says where "
            f"they are") from None
