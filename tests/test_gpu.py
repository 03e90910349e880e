"""GPU tests of the nccl backend and the CUDA kernels (marker `gpu`; run on a machine with >= 2
GPUs: `python -m pytest -m gpu tests/test_gpu.py`). Each multi-rank test starts 2 real processes
(spawn), one per GPU, through the public API (ddpc.init_process_group(backend="nccl")), and
checks results against references computed on the host."""
import hashlib
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

import pytest

from ddpc import _C

import _cbuild
from _procs import free_port, thread_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "tests", "c", "bin")

pytestmark = pytest.mark.gpu


def _gpu_count() -> int:
    return _C.cuda_device_count() if _C.cuda_built() else 0


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


needs_1 = pytest.mark.skipif(_gpu_count() < 1, reason="needs a CUDA build of ddpc and a GPU")
needs_1_torch = pytest.mark.skipif(
    _gpu_count() < 1 or not _torch_cuda(),
    reason="needs a CUDA build of ddpc, a GPU and torch with CUDA")
# DDPC_SHARE_GPUS=1 lets the 2-rank tests run on one GPU (both ranks on GPU 0, NCCL through its
# network transport): each rank's results, errors and timeouts, though not the speed of two.
# The tests about two distinct GPUs need two (needs_2_gpus).
SHARING = os.environ.get("DDPC_SHARE_GPUS") == "1"
needs_2 = pytest.mark.skipif(
    not (_gpu_count() >= 2 or (SHARING and _gpu_count() >= 1)) or not _torch_cuda(),
    reason="needs a CUDA build of ddpc, 2 visible GPUs (or 1 with DDPC_SHARE_GPUS=1) and torch "
           "with CUDA")
needs_2_gpus = pytest.mark.skipif(
    _gpu_count() < 2 or not _torch_cuda(),
    reason="needs a CUDA build of ddpc, 2 visible GPUs and torch with CUDA")

DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8"]
FLOATS = {"float32", "float64", "float16", "bfloat16"}
TOKEN = "ddpc-gpu-test-token"


# ------------------------------------------------------------------------- process harness


def _entry(target: Callable, rank: int, world: int, port: int, timeout: float,
           kwargs: Dict[str, Any], results: Any) -> None:
    """Runs in each spawned rank: joins the group the way a user script does, runs target."""
    out: Dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), DDPC_TOKEN=TOKEN)
        import torch
        import ddpc
        ddpc.init_process_group(backend="nccl", timeout=timeout)
        out.update(target(rank, world, ddpc, torch, results=results, **kwargs) or {})
        ddpc.destroy_process_group()
    except BaseException:
        out["error"] = traceback.format_exc()
    results.put(out)


def _run_ranks(target: Callable, world: int = 2, timeout: float = 60.0, wait: float = 240.0,
               expect: Optional[List[int]] = None, on_message: Optional[Callable] = None,
               **kwargs: Any) -> Dict[int, Dict[str, Any]]:
    """Starts `world` ranks running target; returns {rank: result}. Ranks in `expect` (default:
    all) must report; on_message(msg) sees messages that are not final results."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(target, r, world, port, timeout, kwargs, results))
             for r in range(world)]
    for p in procs:
        p.start()
    want = set(range(world) if expect is None else expect)
    got: Dict[int, Dict[str, Any]] = {}
    deadline = time.monotonic() + wait
    try:
        while not want <= set(got) and time.monotonic() < deadline:
            try:
                msg = results.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            if msg.get("final", True):
                got[msg["rank"]] = msg
            elif on_message is not None:
                on_message(msg)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    missing = want - set(got)
    assert not missing, f"rank(s) {sorted(missing)} gave no result within {wait:.0f} s " \
                        f"(exit codes {[p.exitcode for p in procs]})"
    failed = [r for r in sorted(want) if "error" in got[r]]
    # every failing rank's traceback: the first rank to fail is often not rank 0
    assert not failed, "\n".join(f"rank {r} failed:\n{got[r]['error']}" for r in failed)
    return got


# ------------------------------------------------------------------------- references


def _input(torch: Any, dtype: str, rank: int, n: int) -> Any:
    """Rank `rank`'s input: every rank can make every other rank's, so references are local.
    Integers stay in 0..10 so that sums and products of 2 ranks fit int8."""
    g = torch.Generator().manual_seed(1000 + 17 * rank + DTYPES.index(dtype))
    if dtype in FLOATS:
        x = torch.randn(n, generator=g, dtype=torch.float64)
    else:
        x = torch.randint(0, 11, (n,), generator=g, dtype=torch.int64)
    return x.to(getattr(torch, dtype))


def _reduce(torch: Any, xs: List[Any], op: str, in_dtype: bool) -> Any:
    """The reduction over ranks: in float64/int64 (in_dtype False), or step by step in the
    inputs' own dtype on the host (in_dtype True: what a low-precision device computes)."""
    wide = xs if in_dtype else [x.to(torch.float64 if x.is_floating_point() else torch.int64)
                                for x in xs]
    acc = wide[0].clone()
    for x in wide[1:]:
        if op in ("sum", "avg"):
            acc = acc + x
        elif op == "prod":
            acc = acc * x
        elif op == "min":
            acc = torch.minimum(acc, x)
        elif op == "max":
            acc = torch.maximum(acc, x)
    if op == "avg":
        acc = acc / len(xs) if acc.is_floating_point() else torch.div(acc, len(xs),
                                                                      rounding_mode="floor")
    return acc


def _all_reduce_checked(ddpc: Any, torch: Any, dev: Any, xs: List[Any], rank: int, op: str,
                        what: str) -> List[str]:
    """all_reduce of this rank's input xs[rank] on dev, compared with the reference over xs, and
    every rank holding bitwise the same result (reduced in rank order everywhere): the failures
    (None where all is well)."""
    t = xs[rank].to(dev)
    ddpc.all_reduce(t, op=op)
    out = [_compare(torch, t, xs, op, what)]
    n = t.numel()
    every = torch.empty(len(xs) * n, dtype=t.dtype, device=dev)
    ddpc.all_gather_into_tensor(every, t)
    if any(not torch.equal(every[:n], every[r * n:(r + 1) * n]) for r in range(1, len(xs))):
        out.append(f"{what}: ranks hold different bits")
    return out


def _compare(torch: Any, got: Any, xs: List[Any], op: str, what: str) -> Optional[str]:
    """None when got matches the reduction of xs. Integers: exactly. Floats: the error against
    float64 may be at most twice the error of the same reduction done in the dtype on the host."""
    got = got.cpu()
    if not got.is_floating_point():
        want = _reduce(torch, xs, op, False).to(got.dtype)
        if torch.equal(got, want):
            return None
        bad = (got != want).nonzero()[0].item()
        return f"{what}: element {bad} is {got[bad].item()}, expected {want[bad].item()}"
    ref = _reduce(torch, xs, op, False)
    own = _reduce(torch, xs, op, True).to(torch.float64)
    err = (got.to(torch.float64) - ref).abs().max().item()
    allowed = 2 * (own - ref).abs().max().item()
    if err <= allowed:
        return None
    return f"{what}: max error {err:.3g} against float64, allowed {allowed:.3g}"


# ------------------------------------------------------------------------- rank programs


def _w_collectives(rank: int, world: int, ddpc: Any, torch: Any, results: Any) -> Dict[str, Any]:
    """Every collective and dtype on CUDA tensors of this rank's GPU."""
    failures: List[str] = []
    dev = ddpc.device()
    n = 4099
    for dtype in DTYPES:
        xs = [_input(torch, dtype, r, n) for r in range(world)]
        ops = ["sum", "avg", "min", "max", "prod"]
        for op in ops:
            t = xs[rank].to(dev)
            if op == "avg" and dtype not in FLOATS:  # refused: it would round down
                try:
                    ddpc.all_reduce(t, op=op)
                    failures.append(f"all_reduce avg {dtype}: not refused")
                except ValueError as e:
                    if "op=AVG of" not in str(e):
                        failures.append(f"all_reduce avg {dtype}: {e}")
                continue
            ddpc.all_reduce(t, op=op)
            failures.append(_compare(torch, t, xs, op, f"all_reduce {op} {dtype}"))
        t = xs[rank].to(dev)
        src = world - 1
        ddpc.broadcast(t, src=src)
        if not torch.equal(t.cpu(), xs[src]):
            failures.append(f"broadcast {dtype}: rank {rank} does not hold rank {src}'s tensor")
        out = torch.empty(world * n, dtype=xs[0].dtype, device=dev)
        ddpc.all_gather_into_tensor(out, xs[rank].to(dev))
        if not torch.equal(out.cpu(), torch.cat(xs)):
            failures.append(f"all_gather_into_tensor {dtype}: wrong result")
        big = [torch.cat([_input(torch, dtype, r + 5 * k, n) for k in range(world)])
               for r in range(world)]
        part = torch.empty(n, dtype=xs[0].dtype, device=dev)
        ddpc.reduce_scatter_tensor(part, big[rank].to(dev), op="sum")
        mine = [b[rank * n:(rank + 1) * n] for b in big]
        failures.append(_compare(torch, part, mine, "sum", f"reduce_scatter_tensor {dtype}"))
    # Zero elements: nothing moves, nothing hangs, and the next collective still lines up.
    empty = torch.empty(0, device=dev)
    ddpc.all_reduce(empty)
    one = torch.full((1,), float(rank + 1), device=dev)
    ddpc.all_reduce(one)
    if one.item() != sum(range(1, world + 1)):
        failures.append(f"all_reduce after a zero-element one gave {one.item()}")
    # Strided tensors (through a contiguous copy), bool (SUM is any) and complex (SUM) on GPU,
    # and an async all_gather's outputs written when is_completed() says so.
    t = (torch.arange(6.0, device=dev).reshape(2, 3) + rank).t()
    ddpc.all_reduce(t)
    want_t = (torch.arange(6.0, device=dev).reshape(2, 3) * world + sum(range(world))).t()
    if not torch.equal(t, want_t):
        failures.append(f"all_reduce of a transposed tensor gave {t.tolist()}")
    flags = torch.tensor([rank == 0, False], device=dev)
    ddpc.all_reduce(flags)
    if flags.tolist() != [True, False]:
        failures.append(f"all_reduce of bool gave {flags.tolist()}")
    z = torch.tensor([1 + 2j], dtype=torch.complex64, device=dev)
    ddpc.all_reduce(z)
    if z.tolist() != [complex(world, 2 * world)]:
        failures.append(f"all_reduce of complex64 gave {z.tolist()}")
    outs = [torch.zeros(2, device=dev) for _ in range(world)]
    w = ddpc.all_gather(outs, torch.full((2,), rank + 1.0, device=dev), async_op=True)
    while not w.is_completed():
        time.sleep(0.001)
    torch.cuda.current_stream(dev).synchronize()
    if [o.tolist() for o in outs] != [[r + 1.0] * 2 for r in range(world)]:
        failures.append(f"async all_gather, completed, gave {[o.tolist() for o in outs]}")
    # An input overlapping the output off this rank's slot, and an output overlapping the input
    # off this rank's block: NCCL leaves those undefined, so ddpc goes through a copy.
    n = 1000
    buf = torch.zeros(world * n + 1, device=dev)
    inp = buf[1:n + 1]
    inp.copy_(torch.arange(n, device=dev) * (rank + 1.0))
    ddpc.all_gather_into_tensor(buf[:world * n], inp)
    want = torch.cat([torch.arange(n, device=dev) * (r + 1.0) for r in range(world)])
    if not torch.equal(buf[:world * n], want):
        failures.append("all_gather_into_tensor with its input overlapping the output off its "
                        "slot gave wrong values")
    buf = torch.arange(world * n + 1, device=dev, dtype=torch.float32) + rank
    mine = torch.arange(world * n + 1, device=dev, dtype=torch.float32)[rank * n:(rank + 1) * n]
    want = sum(mine + r for r in range(world))
    ddpc.reduce_scatter_tensor(buf[1:n + 1], buf[:world * n])
    if not torch.equal(buf[1:n + 1], want):
        failures.append("reduce_scatter_tensor with its output overlapping the input off its "
                        "block gave wrong values")
    # A barrier holds every rank until the last arrives.
    if rank == world - 1:
        time.sleep(1.0)
    t0 = time.monotonic()
    ddpc.barrier()
    waited = time.monotonic() - t0
    if rank == 0 and world > 1 and waited < 0.7:
        failures.append(f"barrier returned after {waited:.2f} s on rank 0 while rank {world - 1} "
                        "slept 1 s")
    return {"failures": [f for f in failures if f]}


def _w_streams(rank: int, world: int, ddpc: Any, torch: Any, results: Any) -> Dict[str, Any]:
    """Stream ordering: the collective starts after the work queued on the caller's stream, and
    Work.wait() makes the current stream wait for it, with no host synchronization."""
    failures: List[str] = []
    dev = ddpc.device()
    n = 64 * 1024 * 1024 // 4
    side = torch.cuda.Stream(device=dev)
    x = torch.zeros(n, device=dev)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)    # ~0.5 s of GPU time before x gets its value
        x.fill_(float(rank + 1))
        work = ddpc.all_reduce(x, async_op=True)
    # The host did not wait for any of that.
    if work.is_completed():
        failures.append("all_reduce was already complete while its input was still being written")
    work.wait()                              # the default stream now waits for the collective
    y = x.clone()                            # runs on the default stream, after the wait
    total = float(sum(range(1, world + 1)))
    if not torch.all(y == total).item():
        failures.append(f"after wait() the result holds {y.unique()[:5].tolist()}, expected "
                        f"{total}: the collective ran before its input was written, or the "
                        "stream did not wait for it")
    # The watchdog completes the work on the host side too, without any call into ddpc.
    deadline = time.monotonic() + 10
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not work.is_completed():
        failures.append("is_completed() stayed False for 10 s after the collective finished")
    # Many back-to-back async collectives, waited for in one go, stay in order.
    ts = [torch.full((1000,), float(i + rank), device=dev) for i in range(50)]
    works = [ddpc.all_reduce(t, async_op=True) for t in ts]
    for w in works:
        w.wait()
    for i, t in enumerate(ts):
        want = sum(float(i + r) for r in range(world))
        if not torch.all(t == want).item():
            failures.append(f"async all_reduce {i} of 50 holds {t[0].item()}, expected {want}")
            break
    # An async all_gather into a list, settled by another thread whose current stream is busy
    # (its copies into the list queue behind a long kernel there): wait() on this thread must
    # make this stream wait for those copies too.
    import threading
    n = 16 << 20
    got = [torch.zeros(n, device=dev) for _ in range(world)]
    w = ddpc.all_gather(got, torch.full((n,), rank + 1.0, device=dev), async_op=True)
    side = torch.cuda.Stream(device=dev)

    def settle() -> None:
        with torch.cuda.stream(side):
            a = torch.randn(4096, 4096, device=dev)
            for _ in range(20):
                a = a @ a / 64.0  # (tens of ms on the side stream, before the copies)
            while not w.is_completed():
                time.sleep(0.001)
    t = threading.Thread(target=settle)
    t.start()
    t.join()
    w.wait()
    firsts = [g[0].item() for g in got] + [g[-1].item() for g in got]
    if firsts != [r + 1.0 for r in range(world)] * 2:
        failures.append(f"an all_gather settled by another thread's stream read {firsts} after "
                        f"wait(): this stream did not wait for the copies")
    return {"failures": failures}


def _w_hold(rank: int, world: int, ddpc: Any, torch: Any, results: Any, go: Any) -> Dict[str, Any]:
    """Joins, runs a collective, reports its pid, and stays alive until the parent looked."""
    t = torch.ones(1024, device=ddpc.device())
    ddpc.all_reduce(t)
    torch.cuda.synchronize()
    results.put({"rank": rank, "pid": os.getpid(), "final": False})
    go.wait(120)
    return {}


def _w_victim(rank: int, world: int, ddpc: Any, torch: Any, results: Any,
              victim: int, numel: int = 1024, wrap: Any = False) -> Dict[str, Any]:
    """Rank `victim` dies by SIGKILL after the first all-reduce of `numel` floats; the survivor's
    next collective must raise ddpc.DistributedError well within the timeout, naming what
    happened. With 16M floats (64 MiB) and NCCL_P2P_DISABLE=1 that all-reduce takes the staged
    path, whose streams wait on counters in host memory that the dead rank never writes.
    wrap=True: the survivor's next collectives are a wrapped model's gradient buckets, which
    the posting thread issues (deferred posts), then a barrier. "staged" reports the group's
    staged threshold (0: no staged path)."""
    dev = ddpc.device()
    t = torch.ones(numel, device=dev)
    ddpc.all_reduce(t)
    torch.cuda.synchronize()
    staged = ddpc.distributed._require().group.staged_min_bytes
    model = None
    if wrap:
        torch.manual_seed(0)
        model = ddpc.wrap_model(torch.nn.Sequential(
            *[torch.nn.Linear(512, 512) for _ in range(8)]).to(dev), bucket_cap_mb=1,
            grad_dtype=torch.bfloat16 if wrap == "bf16" else None)
    ddpc.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    t0 = time.monotonic()
    try:
        if model is not None:
            model(torch.randn(64, 512, device=dev)).square().mean().backward()
        else:
            ddpc.all_reduce(t)
        ddpc.barrier()
        torch.cuda.synchronize()
    except ddpc.DistributedError as e:
        return {"raised": type(e).__name__, "message": str(e), "after": time.monotonic() - t0,
                "staged": staged}
    return {"raised": None, "after": time.monotonic() - t0, "staged": staged}


def _w_absent(rank: int, world: int, ddpc: Any, torch: Any, results: Any,
              stay: float) -> Dict[str, Any]:
    """Rank 1 stays alive but skips a collective: rank 0 must time out naming rank 1."""
    t = torch.ones(1024, device=ddpc.device())
    ddpc.all_reduce(t)
    ddpc.barrier()
    if rank == 1:
        time.sleep(stay)
        return {}
    t0 = time.monotonic()
    try:
        ddpc.all_reduce(t)
        ddpc.barrier()
    except ddpc.DistributedError as e:
        return {"raised": type(e).__name__, "message": str(e), "after": time.monotonic() - t0,
                "is_timeout": isinstance(e, TimeoutError)}
    return {"raised": None}


def _w_fast(rank: int, world: int, ddpc: Any, torch: Any, results: Any) -> Dict[str, Any]:
    """The one-shot path for small all-reduces: on by default between the GPUs of this host;
    every dtype and op it takes, sizes around its limits (unaligned, exactly the largest, one
    element over, which goes to NCCL), calls alternating between two streams, and calls mixed
    with NCCL collectives still in flight."""
    failures: List[str] = []
    dev = ddpc.device()
    limit = ddpc.distributed._require().group.fast_max_bytes
    if limit <= 0:
        return {"failures": [f"the one-shot path is off on rank {rank} (fast_max_bytes=0)"]}
    for dtype in ["float32", "float64", "float16", "bfloat16", "int32", "int64"]:
        esize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        for n in (1, 3, 8, 4096 + 5, limit // esize, limit // esize + 1):
            xs = [_input(torch, dtype, r, n) for r in range(world)]
            for op in ["sum", "avg", "min", "max", "prod"]:
                if op == "avg" and dtype not in FLOATS:
                    continue
                failures += _all_reduce_checked(ddpc, torch, dev, xs, rank, op,
                                                f"all_reduce {op} {dtype} n={n}")
    side = torch.cuda.Stream(device=dev)
    for i in range(300):
        s = side if i % 3 == 0 else torch.cuda.current_stream(dev)
        with torch.cuda.stream(s):
            t = torch.full((257,), float(i + rank), device=dev)
            ddpc.all_reduce(t)
            want = float(sum(i + r for r in range(world)))
            if not torch.all(t == want).item():
                failures.append(f"call {i} alternating streams holds {t[0].item()}, expected {want}")
                break
    # Ranks whose buffers differ in alignment (rank 1's starts 4 bytes into its storage) split
    # the message the same way: every block covers the same bytes everywhere.
    for n in (1025, 4096 + 7, 65536):
        base = torch.zeros(n + 1, device=dev)
        t = base[rank % 2:rank % 2 + n]
        t.copy_(torch.arange(n, device=dev, dtype=torch.float32) * (rank + 1))
        ddpc.all_reduce(t)
        want = torch.arange(n, device=dev, dtype=torch.float32) * sum(range(1, world + 1))
        if not torch.equal(t, want):
            bad = int((t != want).nonzero()[0])
            failures.append(f"all_reduce of {n} floats with rank-dependent alignment: element "
                            f"{bad} is {t[bad].item()}, expected {want[bad].item()}")
    # A synchronous call on a tensor whose async all_reduce is still in flight runs after it.
    x = torch.full((1 << 16,), float(rank + 1), device=dev)   # 256 KiB: the one-shot size
    w = ddpc.all_reduce(x, async_op=True)                      # async: NCCL
    ddpc.all_reduce(x)
    w.wait()
    want = float(world * sum(range(1, world + 1)))
    if not torch.all(x == want).item():
        failures.append(f"async then sync all_reduce of one tensor gave {x.unique()[:4].tolist()}, "
                        f"expected {want}: the second ran before the first finished")
    big = torch.full((4 << 20,), float(rank + 1), device=dev)
    work = ddpc.all_reduce(big, async_op=True)       # NCCL, on the communication stream
    small = torch.full((1000,), float(rank + 1), device=dev)
    ddpc.all_reduce(small)                            # one-shot, on the current stream
    work.wait()
    total = float(sum(range(1, world + 1)))
    if not (torch.all(big == total).item() and torch.all(small == total).item()):
        failures.append("a one-shot all_reduce beside an NCCL one in flight gave a wrong result")
    return {"failures": [f for f in failures if f]}


def _w_fast_mismatch(rank: int, world: int, ddpc: Any, torch: Any,
                     results: Any) -> Dict[str, Any]:
    """Ranks pass different sizes to the same small all_reduce: both must raise MismatchError
    naming the other rank's size, not hang and not return garbage silently."""
    dev = ddpc.device()
    t = torch.ones(100 + rank, device=dev)
    t0 = time.monotonic()
    try:
        ddpc.all_reduce(t)
        torch.cuda.synchronize()
        time.sleep(0.5)   # the watchdog looks every 100 ms; the next call also checks
        ddpc.all_reduce(torch.ones(4, device=dev))
    except ddpc.DistributedError as e:
        return {"raised": type(e).__name__, "message": str(e), "after": time.monotonic() - t0}
    return {"raised": None}


def _w_staged(rank: int, world: int, ddpc: Any, torch: Any, results: Any) -> Dict[str, Any]:
    """The staged copy-engine path (NCCL_P2P_DISABLE=1 in the environment): float dtypes, sum and
    average, sizes at its threshold, around a chunk boundary and several chunks long with an odd
    tail; every rank ends with the same bits; many calls queued at once reuse the host slots in
    order; a tensor that is a view at an odd offset; an async call then the caller's own work."""
    failures: List[str] = []
    dev = ddpc.device()
    group = ddpc.distributed._require().group
    floor = group.staged_min_bytes
    if floor <= 0:
        return {"failures": [f"the staged path is off on rank {rank} (staged_min_bytes=0)"]}
    # The default largest chunk (it may be smaller when /dev/shm is small: then these sizes
    # still cover several chunks each).
    chunk = int(os.environ.get("DDPC_STAGED_CHUNK_BYTES", str((32 << 20) // world)))
    for dtype in ["float32", "bfloat16", "float16", "float64"]:
        esize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        # At the threshold and just under 4 MiB (split in 4 chunks), one element over a chunk,
        # and several chunks with an odd tail.
        sizes = [floor // esize, (4 << 20) // esize - 3, chunk // esize + 1,
                 3 * chunk // esize + 12345]
        for n in sizes:
            xs = [_input(torch, dtype, r, n) for r in range(world)]
            for op in ["sum", "avg"]:
                failures += _all_reduce_checked(ddpc, torch, dev, xs, rank, op,
                                                f"staged all_reduce {op} {dtype} n={n}")
    # Twenty calls queued without waiting: 5 chunks each, so the 4 host slots turn over many
    # times, and each call must see only its own data.
    n = (5 * chunk) // 4
    ts = [torch.full((n,), float(i * 10 + rank + 1), device=dev) for i in range(20)]
    works = [ddpc.all_reduce(t, async_op=True) for t in ts]
    for w in works:
        w.wait()
    for i, t in enumerate(ts):
        want = float(sum(i * 10 + r + 1 for r in range(world)))
        if not torch.all(t == want).item():
            failures.append(f"queued staged all_reduce {i} of 20 holds {t.unique()[:4].tolist()}, "
                            f"expected {want}")
            break
    # A view 3 elements into its storage: rank-dependent data, the exact sum checked.
    base = torch.zeros(chunk + 3, device=dev)
    v = base[3:]
    v.copy_(torch.arange(chunk, device=dev, dtype=torch.float32) * (rank + 1))
    ddpc.all_reduce(v)
    want = torch.arange(chunk, device=dev, dtype=torch.float32) * sum(range(1, world + 1))
    if not torch.equal(v, want) or base[:3].abs().sum().item() != 0:
        failures.append("staged all_reduce of a view at an odd offset: wrong result or it wrote "
                        "outside the view")
    # The caller's stream resumes after the collective: a kernel queued right after wait() sees
    # the reduced values.
    x = torch.full((3 * chunk // 4,), float(rank + 1), device=dev)
    w = ddpc.all_reduce(x, async_op=True)
    w.wait()
    y = x * 2
    if not torch.all(y == 2.0 * sum(range(1, world + 1))).item():
        failures.append("work queued after wait() on a staged all_reduce saw unreduced data")
    # Collectives are issued by a thread of their own when the staged path is on: a small
    # synchronous all_reduce (one-shot kernel when P2P is on, else NCCL) posted behind an async
    # staged one, then a synchronous one on the same tensor, which must run after the first.
    big = torch.full((chunk // 2,), float(rank + 1), device=dev)
    w = ddpc.all_reduce(big, async_op=True)
    small = torch.full((1000,), float(rank + 1), device=dev)
    ddpc.all_reduce(small)
    ddpc.all_reduce(big)
    w.wait()
    total = float(sum(range(1, world + 1)))
    if not torch.all(small == total).item():
        failures.append(f"small all_reduce behind a staged one holds {small.unique()[:4].tolist()}")
    if not torch.all(big == world * total).item():
        failures.append(f"two all_reduces of one tensor (async, then sync) hold "
                        f"{big.unique()[:4].tolist()}, expected {world * total}")
    return {"failures": [f for f in failures if f]}


# ------------------------------------------------------------------------- tests


def _w_trace(rank: int, world: int, ddpc: Any, torch: Any, results: Any) -> Dict[str, Any]:
    """ddpc.comm_trace on real collectives: one row per collective with its size, dtype and
    path; the five points in order; a GPU sleep between a mark and the next collective shows as
    that much time; wrap_model's buckets show as deferred all-reduces, one per bucket per step;
    rows past the capacity are counted as dropped; and the misuses raise."""
    import math
    failures: List[str] = []
    dev = ddpc.device()
    g = ddpc.distributed._require().group
    try:
        g.trace_stop()
        failures.append("trace_stop with no trace on did not raise")
    except ValueError as e:
        if "no trace is on" not in str(e):
            failures.append(f"trace_stop with no trace on said: {e}")
    small = torch.ones(256, device=dev)                         # 1 KiB: one-shot where it is on
    big = torch.full((16 << 20,), float(rank + 1), device=dev)   # 64 MiB of float32
    half = torch.ones(1 << 20, device=dev, dtype=torch.bfloat16)
    with ddpc.comm_trace() as trace:
        ddpc.all_reduce(small)
        trace.mark("sleep")
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time before the next input is ready
        work = ddpc.all_reduce(big, async_op=True)
        ddpc.broadcast(half, src=0)
        work.wait()
    one_shot = g.fast_max_bytes >= 1024
    want = [("all_reduce", "float32", 256 * 4, "one-shot" if one_shot else "nccl"),
            ("all_reduce", "float32", 64 << 20, "nccl"),
            ("broadcast", "bfloat16", 2 << 20, "nccl")]
    got = [(r.op, r.dtype, r.nbytes, r.path) for r in trace.rows]
    if got != want:
        failures.append(f"trace rows {got}, expected {want}")
    if [m[0] for m in trace.marks] != ["start", "sleep"] or trace.marks[0][1] != 0.0:
        failures.append(f"trace marks {trace.marks}")
    seqs = [r.seq for r in trace.rows]
    if seqs != sorted(seqs) or len(set(seqs)) != len(seqs):
        failures.append(f"trace sequence numbers {seqs} are not increasing")
    for r in trace.rows:
        pts = [r.ready, r.start, r.wire, r.reduced, r.done]
        if any(math.isnan(x) for x in pts) or any(b < a - 1e-3 for a, b in zip(pts, pts[1:])):
            failures.append(f"{r.op} #{r.seq}: points out of order or missing: {pts}")
    if len(trace.rows) == 3 and len(trace.marks) == 2:
        gap = trace.rows[1].ready - trace.marks[1][1]
        if not 20.0 < gap < 5000.0:
            failures.append(f"a GPU sleep of about 100 ms before the all_reduce showed as "
                            f"{gap:.3f} ms between the mark and its ready point")
    if float(big[0]) != float(sum(range(1, world + 1))):
        failures.append(f"the traced all_reduce gave {float(big[0])}")
    # wrap_model: the buckets of two steps, each an all_reduce issued by the posting thread.
    torch.manual_seed(0)
    model = ddpc.wrap_model(torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)).to(dev),
        bucket_cap_mb=1)
    x = torch.randn(64, 512, device=dev)
    model(x).sum().backward()  # the first step's layout is replaced after it: not traced
    model.zero_grad(set_to_none=True)
    with ddpc.comm_trace() as trace:
        for _ in range(2):
            model(x).sum().backward()
            model.zero_grad(set_to_none=True)
    buckets = model._reducer.num_buckets
    reduces = [r for r in trace.rows if r.op == "all_reduce"]
    if len(reduces) != 2 * buckets:
        sizes = [(r.nbytes, r.path) for r in trace.rows]
        failures.append(f"two traced steps gave {len(reduces)} bucket all-reduces, expected "
                        f"{2 * buckets} ({buckets} buckets): {sizes}")
    if world > 1 and not all(r.deferred for r in reduces if r.path == "nccl"):
        failures.append("a bucket's all_reduce was not issued by the posting thread")
    with ddpc.comm_trace(capacity=2) as trace:
        for _ in range(3):
            ddpc.all_reduce(big, async_op=True).wait()
    if len(trace.rows) != 1 or trace.dropped != 2:
        failures.append(f"capacity 2 (its start mark and one row) kept {len(trace.rows)} rows and "
                        f"dropped {trace.dropped}, expected 1 and 2")
    stream = torch.cuda.current_stream(dev).cuda_stream
    try:
        g.trace_mark(stream)
        failures.append("trace_mark with no trace on did not raise")
    except ValueError as e:
        if "no trace is on" not in str(e):
            failures.append(f"trace_mark with no trace on said: {e}")
    # A trace still on when the group goes (destroy_process_group, after this returns) is freed
    # with it; a collective traced just before must not keep that from finishing.
    g.trace_start(16)
    g.trace_mark(stream)
    ddpc.all_reduce(big, async_op=True).wait()
    return {"failures": failures}


def _assert_no_failures(res: Dict[int, Dict[str, Any]]) -> None:
    for r, out in res.items():
        assert not out["failures"], f"rank {r}:\n" + "\n".join(out["failures"])


def _w_objects(rank: int, world: int, ddpc: Any, torch: Any, results: Any) -> Dict[str, Any]:
    """all_gather_object and broadcast_object_list on the nccl backend (through the bound GPU)."""
    got = [None] * world
    ddpc.all_gather_object(got, {"rank": rank, "text": "y" * (5000 * rank)})
    objs = ["a", rank] if rank == 1 else [None, None]
    ddpc.broadcast_object_list(objs, src=1)
    failures = []
    if got != [{"rank": r, "text": "y" * (5000 * r)} for r in range(world)]:
        failures.append(f"all_gather_object gave {[sorted(g) for g in got]}")
    if objs != ["a", 1]:
        failures.append(f"broadcast_object_list gave {objs}")
    return {"failures": failures}


def _same_gradients(torch: Any, a: Any, b: Any, width: int, rank: int,
                    failures: List[str]) -> None:
    """Four steps of two wrappers of the same model on the same batches (this rank's, of
    `width` features), gradients set to None and zeroed in turn: appends to failures every
    gradient of a's that is not b's bit for bit, and a gradient left zero or not finite."""
    dev = next(a.parameters()).device
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
    for step in range(4):
        x = torch.randn(64, width, device=dev, generator=gen)
        for m in (a, b):
            m.zero_grad(set_to_none=step % 2 == 0)
            m(x).square().mean().backward()
        for (name, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
            if not torch.equal(pa.grad, pb.grad):
                d = (pa.grad - pb.grad).abs().max().item()
                failures.append(f"step {step}: {name}'s gradient differs by up to {d:g}")
    if not all(torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0 for p in a.parameters()):
        failures.append("a gradient is zero or not finite")
    torch.cuda.synchronize()


def _w_window(rank: int, world: int, ddpc: Any, torch: Any, results: Any) -> Dict[str, Any]:
    """DDPC_NCCL_WINDOW_MB: the bf16 wires of the buckets before the last lie in an NCCL
    symmetric window, summed there and divided on the way back. Two wrappers of the same model,
    one with a window that holds two of its buckets and one without, fed the same batches: the
    same gradients, bit for bit (with 2 ranks the sum of two bf16 values divided by 2 rounds as
    their average does)."""
    from ddpc import distributed as dist
    failures = []
    g = dist._default_group()
    raised = False
    try:
        g.window_alloc(0)
    except ValueError as e:
        raised = "0 bytes" in str(e)
    if not raised:
        failures.append("window_alloc(0) did not raise a ValueError naming 0 bytes")
    dev = ddpc.device()

    def make():
        torch.manual_seed(0)
        # Layers of 1M parameters: 2 MiB bf16 wires, past the one-shot path's 1 MiB
        return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(5)]).to(dev)
    os.environ["DDPC_NCCL_WINDOW_MB"] = "5"  # room for two of the 2 MiB wires, not all
    try:
        a = ddpc.wrap_model(make(), bucket_cap_mb=4.5, grad_dtype=torch.bfloat16)
    finally:
        del os.environ["DDPC_NCCL_WINDOW_MB"]
    b = ddpc.wrap_model(make(), bucket_cap_mb=4.5, grad_dtype=torch.bfloat16)
    placed = sum(x is not None for x in a._window_at)
    if not 0 < a._window_bytes <= 5 << 20 or placed < 2 or b._window_bytes or any(b._window_at):
        failures.append(f"window {a._window_bytes} bytes holding {placed} buckets of "
                        f"{len(a._window_at)}; the plain wrapper's {b._window_bytes}")
    _same_gradients(torch, a, b, 1024, rank, failures)
    return {"failures": failures}


def _w_overlap(rank: int, world: int, ddpc: Any, torch: Any, results: Any) -> Dict[str, Any]:
    """DDPC_CAST_BACK=overlap: the buckets before the last cast back on ddpc's own stream as the
    last launches, and the last one (10 MiB of bf16 wire) reduced in 4 parts, each cast back as
    it is queued. Against the default casts back, fed the same batches: the same gradients, bit
    for bit (an element's average does not depend on which collective carried it), with
    gradients set to None and zeroed in turn."""
    failures = []
    dev = ddpc.device()

    def make():
        # The first layer's gradients complete last: with buckets of 26 MiB it is the last
        # bucket alone (6.3M parameters, 12.6 MB of bf16 wire), after one or more of the rest.
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6144, 1024),
                                   *[torch.nn.Linear(1024, 1024) for _ in range(3)]).to(dev)
    os.environ["DDPC_CAST_BACK"] = "overlap"
    try:
        a = ddpc.wrap_model(make(), bucket_cap_mb=26, grad_dtype=torch.bfloat16)
    finally:
        del os.environ["DDPC_CAST_BACK"]
    b = ddpc.wrap_model(make(), bucket_cap_mb=26, grad_dtype=torch.bfloat16)
    counts = [a._bucket_specs[k][0] for k in range(len(a._bucket_specs))]
    if len(counts) < 2 or counts[-1] * 2 < (8 << 20):
        failures.append(f"bucket sizes {counts}: no last bucket of 8 MiB of bf16 to split")
    _same_gradients(torch, a, b, 6144, rank, failures)
    return {"failures": failures}


@needs_2
def test_symmetric_window_buckets_match_the_default_wires():
    _assert_no_failures(_run_ranks(_w_window))


@needs_2
def test_object_collectives_on_gpus():
    _assert_no_failures(_run_ranks(_w_objects))


@needs_2
def test_fast_small_all_reduce():
    _assert_no_failures(_run_ranks(_w_fast))


@needs_2
def test_fast_all_reduce_size_mismatch_raises():
    res = _run_ranks(_w_fast_mismatch, timeout=20.0)
    for r, out in res.items():
        other = 1 - r
        assert out["raised"] == "MismatchError", out
        assert f"rank {other} passed {100 + other} elements" in out["message"], out["message"]
        assert out["after"] < 10, out


def _lookup(torch: Any, r: int, num_rows: int, width: int) -> Any:
    """Rank r's routed lookup for _w_rows_exchange: its ids (with repeats, ids past the table,
    the padding row 3) and its output's gradient rows; rank r looks up 900 + 100 * r tokens."""
    g = torch.Generator().manual_seed(100 + r)
    n = 900 + 100 * r
    ids = torch.randint(0, num_rows + 2, (n,), generator=g)
    ids[: n // 3] = torch.randint(0, 6, (n // 3,), generator=g)
    return ids, torch.randn(n, width, generator=g, dtype=torch.float64)


def _w_rows_exchange(rank: int, world: int, ddpc: Any, torch: Any,
                     results: Any) -> Dict[str, Any]:
    """The embedding rows' end of backward in one C call (group.rows_exchange, csrc/rows.c)
    against index_put_ of every rank's rows in float64, for float32 and bf16 wires and a rank
    whose lookup got no gradient; the same bits on every rank; bad sizes raise, naming them."""
    failures: List[str] = []
    from ddpc import _C
    group = ddpc.distributed._default_group()
    dev = ddpc.device()
    num_rows, width, pad = 500, 96, 3
    lookups = [_lookup(torch, r, num_rows, width) for r in range(world)]
    cap = max(ids.numel() for ids, _ in lookups)
    grad0 = torch.randn(num_rows, width, generator=torch.Generator().manual_seed(9),
                        dtype=torch.float64)
    stream = torch.cuda.current_stream(dev).cuda_stream
    codes = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 3}
    digests: List[str] = []
    for wire, no_grad_rank in ((torch.float32, -1), (torch.bfloat16, -1), (torch.float32, 0)):
        ids, rows = lookups[rank]
        sid, perm = torch.sort(ids.to(dev), stable=True)
        src = None if rank == no_grad_rank else rows.to(dev, torch.float32)
        grad = grad0.to(dev, torch.float32)
        buf = torch.empty(world * _C.rows_stride(cap, width, codes[wire]), dtype=torch.uint8,
                          device=dev)
        group.rows_exchange(grad.data_ptr(), 0, num_rows, width, sid.data_ptr(), perm.data_ptr(),
                            ids.numel(), 0 if src is None else src.data_ptr(), 0, codes[wire],
                            cap, buf.data_ptr(), buf.numel(), pad, dev.index, stream,
                            (buf, src, sid, perm))
        # the exact sum, and a bound on float32 accumulation: one rounding per addition of the
        # longest run, per rank's addition and of the result, each at most 2^-24 of the
        # magnitudes involved (the rows rounded to the wire dtype as the reference takes them)
        ref, mag, run = grad0.clone(), grad0.abs(), 0
        for r, (i, w) in enumerate(lookups):
            keep = (i < num_rows) & (i != pad)
            run = max(run, int(torch.bincount(i[keep]).max()))
            if r != no_grad_rank:
                part = w[keep].to(wire).double() / world
                ref.index_put_((i[keep],), part, accumulate=True)
                mag.index_put_((i[keep],), part.abs(), accumulate=True)
        mine = grad.cpu()
        out = mine.double()
        over = ((out - ref).abs() - mag * (run + world + 2) * 2.0 ** -24).max().item()
        case = f"wire {wire}, no gradient on rank {no_grad_rank}"
        if over > 0:
            failures.append(f"{case}: off the exact sum by {over:.3g} more than float32 "
                            f"accumulation allows")
        # the same bits on every rank: compared by the parent (digests) and through an all-gather
        digests.append(hashlib.sha256(mine.numpy().tobytes()).hexdigest()[:16])
        every = [torch.empty_like(grad) for _ in range(world)]
        ddpc.all_gather(every, grad)
        got = [e.cpu() for e in every]
        if not all(torch.equal(e, got[0]) for e in got):
            diff = [int((e != got[0]).sum()) for e in got]
            failures.append(f"{case}: the gathered results differ in their bits: elements "
                            f"unequal to rank 0's per rank {diff} of {mine.numel()}; this rank's "
                            f"own entry equals its result: {torch.equal(got[rank], mine)}; "
                            f"digests of the entries "
                            f"{[hashlib.sha256(e.numpy().tobytes()).hexdigest()[:16] for e in got]}")
    ids, rows = lookups[rank]
    for what, kw, match in (("a buffer one byte short", {"short": 1}, "need"),
                            ("more rows than slots", {"cap": ids.numel() - 1}, "slots")):
        c = kw.get("cap", cap)
        nbytes = world * _C.rows_stride(c, width, 0) - kw.get("short", 0)
        buf = torch.empty(nbytes + 8, dtype=torch.uint8, device=dev)
        try:
            group.rows_exchange(grad0.data_ptr(), 0, num_rows, width, 1, 0, ids.numel(), 0, 0, 0,
                                c, buf.data_ptr(), nbytes, -1, dev.index, stream, buf)
            failures.append(f"{what}: no error")
        except ValueError as e:
            if match not in str(e):
                failures.append(f"{what}: {e}")
    return {"failures": failures, "digests": digests}


# One rank on one GPU runs the same code paths (NCCL communicator, communication stream, events,
# watchdog) as two; it is what a machine with a single GPU can check.
WORLDS = [pytest.param(1, marks=needs_1_torch, id="1gpu"), pytest.param(2, marks=needs_2, id="2gpu")]


def _w_window_memory(rank: int, world: int, ddpc: Any, torch: Any,
                     results: Any) -> Dict[str, Any]:
    """Group.window_alloc on its own: the memory NCCL registers (its registration runs on a
    thread of ddpc's while this one waits) takes an all-reduce like any other (seen through
    __cuda_array_interface__), and a kernel still reading it when the group is destroyed does
    not outlive it (destroy waits for the device before ncclMemFree). First the last rank asks
    for more than its GPU holds: no rank gets a window, every rank's reason names that rank and
    what failed there, and the group goes on."""
    from ddpc import distributed as dist
    failures: List[str] = []
    last = world - 1
    huge = 1 << 40  # 1 TiB
    ptr, why = dist._default_group().window_alloc(huge if rank == last else 4096)
    here = ddpc.device().index  # (not `rank` when ranks share GPUs: DDPC_SHARE_GPUS=1)
    want = (f"ncclMemAlloc of {huge} bytes on cuda:{here} failed" if rank == last else
            f"rank {last} could not allocate its part: ncclMemAlloc of {huge} bytes")
    if ptr or want not in why:
        failures.append(f"a window too large for rank {last}'s GPU gave {ptr:#x} and said: {why}")
    n = 1 << 20
    ptr, why = dist._default_group().window_alloc(4 * n)
    if not ptr:
        return {"failures": [f"no window: {why}"]}

    class Raw:  # the window's bytes as a float32 array
        __cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (ptr, False),
                                    "version": 3}
    t = torch.as_tensor(Raw(), device=ddpc.device())
    t.fill_(float(rank + 1))
    ddpc.all_reduce(t)
    want = world * (world + 1) / 2
    if not torch.all(t == want):
        failures.append(f"all_reduce in the window gave {t.unique().tolist()}, not {want}")
    for _ in range(20):  # queued, unsynchronized, as the group goes
        t.mul_(1.0)
    return {"failures": failures}


def _w_new_group(rank: int, world: int, ddpc: Any, torch: Any, results: Any) -> Dict[str, Any]:
    """new_group beside the nccl default group: a second NCCL communicator and a gloo one, each
    taking its own collectives between the default group's; gather and scatter of GPU tensors;
    the second communicator destroyed before the default one, which goes on."""
    failures: List[str] = []
    dev = ddpc.device()
    nccl2 = ddpc.new_group(timeout=30)
    cpu = ddpc.new_group(backend="gloo")
    x = torch.full((1 << 20,), float(rank + 1), device=dev)  # 4 MiB: NCCL, not the one-shot path
    h = torch.full((5,), float(rank + 1))
    ddpc.all_reduce(x, group=nccl2)
    ddpc.all_reduce(h, group=cpu)
    ddpc.all_reduce(x)
    want = world * world * (world + 1) / 2
    if not torch.all(x == want) or not torch.all(h == world * (world + 1) / 2):
        failures.append(f"all_reduce on the new groups gave {x.unique().tolist()} and "
                        f"{h.unique().tolist()}")
    out = [torch.zeros(3, device=dev) for _ in range(world)] if rank == 0 else None
    ddpc.gather(torch.full((3,), float(rank), device=dev), out, group=nccl2)
    if rank == 0 and [o.tolist() for o in out] != [[float(r)] * 3 for r in range(world)]:
        failures.append(f"gather gave {[o.tolist() for o in out]}")
    got = torch.zeros(2, device=dev)
    ddpc.scatter(got, [torch.full((2,), 7.0 + r, device=dev) for r in range(world)]
                 if rank == 0 else None)
    if got.tolist() != [7.0 + rank] * 2:
        failures.append(f"scatter gave {got.tolist()}")
    if ddpc.get_backend(cpu) != "cpu" or ddpc.get_backend(nccl2) != "nccl":
        failures.append(f"backends {ddpc.get_backend(cpu)}, {ddpc.get_backend(nccl2)}")
    ddpc.destroy_process_group(nccl2)
    ddpc.all_reduce(x)
    if not torch.all(x == want * world):
        failures.append(f"the default group after the second one's destroy gave "
                        f"{x.unique().tolist()}")
    return {"failures": failures}


@pytest.mark.parametrize("world", WORLDS)
def test_new_group_beside_the_nccl_default(world):
    _assert_no_failures(_run_ranks(_w_new_group, world=world))


@pytest.mark.parametrize("world", WORLDS)
def test_window_memory_takes_a_collective_and_outlives_its_readers(world):
    _assert_no_failures(_run_ranks(_w_window_memory, world=world))


@pytest.mark.parametrize("world", WORLDS)
def test_cast_back_overlap_matches_the_default(world):
    _assert_no_failures(_run_ranks(_w_overlap, world=world))


@pytest.mark.parametrize("world", WORLDS)
def test_every_collective_and_dtype(world):
    _assert_no_failures(_run_ranks(_w_collectives, world=world))


@pytest.mark.parametrize("world", WORLDS)
def test_stream_ordering_and_async(world):
    _assert_no_failures(_run_ranks(_w_streams, world=world))


@pytest.mark.parametrize("world", WORLDS)
def test_rows_exchange_against_index_put(world):
    res = _run_ranks(_w_rows_exchange, world=world)
    _assert_no_failures(res)
    digests = {r: out["digests"] for r, out in res.items()}
    assert len({tuple(d) for d in digests.values()}) == 1, (
        f"the ranks' results differ in their bits (sha256 prefixes per case): {digests}")


@pytest.mark.parametrize("world", WORLDS)
def test_comm_trace_times_real_collectives(world):
    _assert_no_failures(_run_ranks(_w_trace, world=world))


def _w_thread_names(rank, world, ddpc, torch, results=None):
    """The names of this process's threads while the nccl group is up (one all-reduce done)."""
    x = torch.ones(4, device="cuda")
    ddpc.all_reduce(x)
    torch.cuda.synchronize()
    return {"names": thread_names()}


@needs_1_torch
def test_ddpc_threads_are_named_on_gpus():
    """top -H, py-spy and gdb name ddpc's threads: the watchdog and the posting thread of the
    NCCL backend, the store server on rank 0."""
    got = _run_ranks(_w_thread_names, world=1)
    assert "error" not in got[0], got[0].get("error")
    names = got[0]["names"]
    for name in ("ddpc-watchdog", "ddpc-poster", "ddpc-store"):
        assert name in names, names


@needs_2_gpus
def test_each_rank_holds_memory_on_its_own_gpu():
    if not shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi is not on PATH")
    from ddpc.doctor import visible_mapping, query_driver
    pids: Dict[int, int] = {}
    seen: Dict[int, set] = {}
    gpus = query_driver().gpus
    visible, _ = visible_mapping(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus)

    def look(msg: Dict[str, Any]) -> None:
        pids[msg["rank"]] = msg["pid"]
        if len(pids) == 2:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30).stdout
            for row in out.strip().splitlines():
                pid, uuid = [c.strip() for c in row.split(",")][:2]
                seen.setdefault(int(pid), set()).add(uuid)
            go.set()

    import multiprocessing as mp
    go = mp.get_context("spawn").Event()
    _run_ranks(_w_hold, on_message=look, go=go)
    if not any(p in seen for p in pids.values()):
        pytest.skip("nvidia-smi does not list this machine's process ids (a container's pid "
                    "namespace): cannot attribute GPU memory to ranks")
    for r, pid in pids.items():
        assert seen.get(pid) == {visible[r].uuid}, (
            f"rank {r} (pid {pid}) holds memory on {sorted(seen.get(pid, []))}, expected only "
            f"GPU {visible[r].index} ({visible[r].uuid})")


@needs_2
@pytest.mark.parametrize("victim", [1, 0])
def test_killed_rank_makes_survivor_raise(victim):
    timeout = 60.0
    survivor = 1 - victim
    res = _run_ranks(_w_victim, timeout=timeout, expect=[survivor], victim=victim)
    out = res[survivor]
    assert out["raised"], f"rank {survivor} did not raise after rank {victim} died"
    # The store reports the death (or its own loss) within a second or two: far sooner than
    # the timeout, which would be the fallback.
    assert out["after"] < timeout / 2, out
    assert f"rank {victim}" in out["message"], out["message"]


@needs_2
@pytest.mark.parametrize("grads", ["float32", "bf16"])
def test_killed_rank_during_backward_makes_survivor_raise(grads):
    """The buckets of a backward are issued by the posting thread: a dead peer still ends the
    survivor's step with an error naming it, not a hang, with float32 gradients and with bf16
    ones (cast into wire buffers around each all-reduce)."""
    timeout = 60.0
    res = _run_ranks(_w_victim, timeout=timeout, expect=[0], victim=1,
                     wrap="bf16" if grads == "bf16" else True)
    out = res[0]
    assert out["raised"], "rank 0 did not raise after rank 1 died"
    assert out["after"] < timeout / 2, out
    assert "rank 1" in out["message"], out["message"]


@needs_2
def test_absent_rank_times_out_and_is_named():
    timeout = 8.0
    res = _run_ranks(_w_absent, timeout=timeout, stay=timeout + 8)
    out = res[0]
    assert out["raised"] == "DistributedTimeoutError" and out["is_timeout"], out
    assert "rank 1 never arrived" in out["message"], out["message"]
    assert timeout - 1 <= out["after"] < timeout + 20, out


def _build_kernel_test() -> str:
    if _cbuild.find_toolchain() is None:
        pytest.skip("needs nvcc, a C compiler and the CUDA headers")
    return _cbuild.build_with_kernels(os.path.join(ROOT, "tests", "c", "test_kernels.c"), BIN,
                                      os.environ.get("DDPC_CUDA_ARCHS", "80;90"), werror=True)


@needs_1
def test_device_kernels():
    exe = _build_kernel_test()
    r = subprocess.run([exe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"test_kernels failed:\n{r.stdout}\n{r.stderr}"
    assert r.stdout.startswith("ok: "), r.stdout


@needs_1_torch
@pytest.mark.parametrize("grad_dtype,rows_dtype", [
    ("float32", "float32"), ("float32", "bfloat16"), ("float32", "float16"),
    ("float64", "float64"), ("bfloat16", "bfloat16"), ("float16", "float32")])
def test_embedding_rows_kernel(grad_dtype, rows_dtype):
    """ddpc's accumulation of embedding rows (the end of backward of python/ddpc/_rows.py)
    against index_put_ in float64: runs of repeated ids, padding ids (-1), the skipped
    padding_idx, ids past the table; every other row untouched; the same bits twice, and with
    the rows already in sorted order and no permutation."""
    import torch
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(3)
    num_rows, width, n = 301, 77, 4000
    gdt, rdt = getattr(torch, grad_dtype), getattr(torch, rows_dtype)
    ids = torch.randint(-1, num_rows + 3, (n,), generator=g)
    ids[:1500] = torch.randint(0, 5, (1500,), generator=g)  # long runs
    skip = 7
    rows = torch.randn(n, width, generator=g, dtype=torch.float64).to(rdt)
    grad0 = torch.randn(num_rows, width, generator=g, dtype=torch.float64).to(gdt)
    sorted_ids, perm = torch.sort(ids, stable=True)
    keep = (ids >= 0) & (ids != skip) & (ids < num_rows)
    scale = 0.5
    ref = grad0.double().clone().index_put_((ids[keep],), rows[keep].double() * scale,
                                            accumulate=True)
    outs = []
    codes = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3}
    stream = torch.cuda.current_stream(dev).cuda_stream
    for identity in (False, True, False):
        # identity: the rows already in sorted order, and no perm (NULL)
        grad = grad0.to(dev)
        sid, pm = sorted_ids.to(dev), perm.to(dev)
        rw = (rows[perm] if identity else rows).to(dev)
        _C.device_rows_accumulate(grad.data_ptr(), codes[grad_dtype], num_rows, width,
                                  sid.data_ptr(), 0 if identity else pm.data_ptr(), n,
                                  rw.data_ptr(), codes[rows_dtype], skip, scale, stream)
        torch.cuda.synchronize(dev)
        outs.append(grad.cpu())
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    out = outs[0].double()
    touched = torch.zeros(num_rows, dtype=torch.bool)
    touched[ids[keep]] = True
    assert torch.equal(out[~touched], grad0.double()[~touched])  # untouched rows: the same bits
    # each row's error: one rounding of the result, and one per addition of its longest run
    # (float accumulation; double for float64), each at most the unit roundoff times the
    # magnitudes involved
    unit = {"float32": 2 ** -24, "float64": 2 ** -53, "float16": 2 ** -11, "bfloat16": 2 ** -8}
    run = int(torch.bincount(ids[keep]).max())
    mag = grad0.double().abs().index_put_((ids[keep],), rows[keep].double().abs() * scale,
                                          accumulate=True)
    bound = mag * (unit[grad_dtype] + (run + 1) * unit["float64" if grad_dtype == "float64"
                                                        else "float32"])
    assert ((out - ref).abs() <= bound).all(), (out - ref).abs().max()
    with pytest.raises(ValueError, match="NULL pointer"):
        _C.device_rows_accumulate(0, 0, num_rows, width, 0, 0, n, 0, 0, -1, 1.0, 0)


@needs_1_torch
def test_embedding_ids_sort_kernel():
    """ddpc's one-launch sort of a lookup's indices (ddpc_device_sort_ids) against
    torch.sort(stable=True), bit for bit, indices and permutation: few and many rows (how many
    key bits it sorts), many repeats, sizes up to its capacity; past it, and without rows, it
    raises."""
    import torch
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(11)
    stream = torch.cuda.current_stream(dev).cuda_stream
    cap = _C.DEVICE_SORT_IDS_MAX
    for num_rows in (1, 7, 50304, 2 ** 31):
        for n in (1, 2, 100, 4097, cap):
            ids = torch.randint(0, min(num_rows, 2 ** 31 - 1), (n,), generator=g)
            ids[: n // 2] = torch.randint(0, min(num_rows, 5), (n // 2,), generator=g)
            ids = ids.to(dev)
            out = torch.full((2 * n,), -7, dtype=torch.int64, device=dev)
            _C.device_sort_ids(ids.data_ptr(), n, num_rows, out.data_ptr(),
                               out.data_ptr() + 8 * n, stream)
            want_ids, want_perm = torch.sort(ids, stable=True)
            assert torch.equal(out[:n], want_ids), (num_rows, n)
            assert torch.equal(out[n:], want_perm), (num_rows, n)
    with pytest.raises(ValueError, match="at most 8192"):
        _C.device_sort_ids(1, cap + 1, 10, 1, 1, stream)
    with pytest.raises(ValueError, match="rows"):
        _C.device_sort_ids(1, 10, 0, 1, 1, stream)


@needs_1_torch
@pytest.mark.parametrize("wire_dtype,src_dtype", [
    ("float32", "float32"), ("bfloat16", "float32"), ("float16", "float32"),
    ("float64", "float64"), ("bfloat16", "bfloat16")])
def test_embedding_rows_pack_kernel(wire_dtype, src_dtype):
    """One rank's part of the rows' all-gather (ddpc_device_rows_pack) against torch: sorted ids
    then -1 past n; rows gathered through the permutation (or in order without one) and cast
    once; zeros without a source; slots past n left alone. Bad arguments raise."""
    import torch
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(5)
    n, cap, width = 1000, 1200, 77
    codes = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3}
    wdt, sdt = getattr(torch, wire_dtype), getattr(torch, src_dtype)
    ids = torch.randint(0, 50, (n,), generator=g)
    sorted_ids, perm = torch.sort(ids, stable=True)
    src = torch.randn(n, width, generator=g, dtype=torch.float64).to(sdt)
    stream = torch.cuda.current_stream(dev).cuda_stream
    sid, pm, sr = sorted_ids.to(dev), perm.to(dev), src.to(dev)
    for case in ("perm", "no_perm", "no_src"):
        ids_out = torch.full((cap,), 12345, dtype=torch.int64, device=dev)
        rows_out = torch.full((cap, width), 7.0, dtype=wdt, device=dev)
        _C.device_rows_pack(ids_out.data_ptr(), rows_out.data_ptr(), codes[wire_dtype], cap,
                            width, sid.data_ptr(), pm.data_ptr() if case == "perm" else 0, n,
                            0 if case == "no_src" else sr.data_ptr(), codes[src_dtype], stream)
        torch.cuda.synchronize(dev)
        got_ids, got_rows = ids_out.cpu(), rows_out.cpu()
        assert torch.equal(got_ids[:n], sorted_ids), case
        assert (got_ids[n:] == -1).all(), case
        want = (torch.zeros(n, width, dtype=wdt) if case == "no_src" else
                (src[perm] if case == "perm" else src).to(wdt))
        assert torch.equal(got_rows[:n], want), case
        assert (got_rows[n:] == 7.0).all(), case  # (never read: left alone)
    with pytest.raises(ValueError, match="do not fit"):
        _C.device_rows_pack(1, 1, 0, 10, width, 1, 0, 11, 1, 0, stream)
    with pytest.raises(ValueError, match="NULL pointer"):
        _C.device_rows_pack(0, 0, 0, cap, width, 0, 0, n, 0, 0, stream)
    with pytest.raises(ValueError, match="only float32"):
        _C.device_rows_pack(1, 1, 5, cap, width, 1, 0, n, 1, 0, stream)


# NCCL_P2P_DISABLE=1 turns the staged path on by default, where a call on a buffer no queued
# collective touches starts without waiting for the calls before it (the 20 queued calls), while
# one on a buffer still in flight (the async-then-sync pair) still waits; "small chunks" forces it
# on with P2P available and 64 KiB chunks (many chunks per call, many slot turns); "serial" turns
# the overlap off (DDPC_STAGED_OVERLAP=0): each call waits for the one before.
STAGED_ENVS = [
    pytest.param({"NCCL_P2P_DISABLE": "1"}, id="without_p2p"),
    pytest.param({"DDPC_STAGED_ALLREDUCE": "1", "DDPC_STAGED_CHUNK_BYTES": "65536",
                  "DDPC_STAGED_MIN_BYTES": "65536"}, id="small_chunks"),
    pytest.param({"NCCL_P2P_DISABLE": "1", "DDPC_STAGED_OVERLAP": "0"}, id="serial"),
]


@needs_2
@pytest.mark.parametrize("env", STAGED_ENVS)
def test_staged_all_reduce(monkeypatch, env):
    monkeypatch.delenv("DDPC_STAGED_ALLREDUCE", raising=False)
    monkeypatch.delenv("DDPC_STAGED_OVERLAP", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _assert_no_failures(_run_ranks(_w_staged))


@needs_2
def test_staged_killed_rank_makes_survivor_raise(monkeypatch):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    timeout = 30.0
    res = _run_ranks(_w_victim, timeout=timeout, expect=[0], victim=1, numel=16 << 20)
    out = res[0]
    assert out["staged"] > 0, "the staged path was not on"
    assert out["raised"], "rank 0 did not raise after rank 1 died"
    assert out["after"] < timeout, out
    assert "rank 1" in out["message"], out["message"]


# A real CUDA out-of-memory error under the launcher: rank OOM_RANK asks for 400 GB, on its own
# GPU or (OOM_DEVICE=cuda:0 on rank 1) on rank 0's, as a script with a fixed device would.
REAL_OOM_SCRIPT = """
import os, time
import torch
import ddpc
ddpc.init_process_group(backend="nccl")
x = torch.ones(1 << 28, device=ddpc.device())  # 1 GiB held while it fails
if ddpc.get_rank() == int(os.environ["OOM_RANK"]):
    dev = os.environ.get("OOM_DEVICE") or ddpc.device()
    torch.empty(400 * 10**9, dtype=torch.uint8, device=dev)
time.sleep(60)
"""


def _launch_on_gpus(tmp_path, text: str, gpus: str, **env_vars: str):
    """Runs script `text` under `python -m ddpc.launch --gpus <gpus>` with this checkout's ddpc
    and env_vars added to the environment; the completed process."""
    script = tmp_path / "script.py"
    script.write_text(text)
    env = dict(os.environ, **env_vars)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(ROOT, "python"), env.get("PYTHONPATH")) if p)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, "-m", "ddpc.launch", "--gpus", gpus, str(script)],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)


@needs_2_gpus
@pytest.mark.parametrize("oom_device", ["", "cuda:0"], ids=["own_gpu", "rank0_gpu"])
def test_launcher_explains_a_real_cuda_oom(tmp_path, oom_device):
    res = _launch_on_gpus(tmp_path, REAL_OOM_SCRIPT, "0,1", OOM_RANK="1", OOM_DEVICE=oom_device)
    assert res.returncode == 1, res.stderr[-3000:]
    summary = " ".join(res.stderr[res.stderr.index("failed first"):].split())
    assert "rank 1 raised torch.OutOfMemoryError: CUDA out of memory" in summary, summary
    if oom_device:
        assert "rank 1 ran out of GPU memory on cuda:0 (physical GPU 0," in summary, summary
        assert "That is not its own GPU: rank 1 works on cuda:1" in summary, summary
    else:
        assert "rank 1 ran out of GPU memory on cuda:1 (physical GPU 1," in summary, summary
        # The 1 GiB it held, and the GPU's own figures from the failing process.
        assert re.search(r"This process held 1\.0 GiB in tensors \(peak 1\.0 GiB\), "
                         r"[\d.]+ GiB reserved by PyTorch's caching allocator; the GPU had "
                         r"[\d.]+ GiB free of [\d.]+ GiB\.", summary), summary
        assert "Data parallelism splits the batch" in summary, summary


@needs_1
def test_launcher_warns_about_a_forced_nccl_protocol_on_gpus(tmp_path):
    res = _launch_on_gpus(tmp_path, "import ddpc\nddpc.init_process_group()\n"
                          "print('backend', ddpc.get_backend())\n", "0", NCCL_PROTO="Simple")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "backend nccl" in res.stdout, res.stdout
    assert "ddpc.launch: warning: NCCL_PROTO=Simple limits the protocols NCCL may pick" in \
        res.stderr, res.stderr[-3000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-m", "gpu"]))
