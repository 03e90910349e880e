"""Collectives of the cpu backend with real processes (2 and 3 ranks on 127.0.0.1), over both
transports (shared memory and DDPC_CPU_TRANSPORT=tcp): every collective, dtype and op against a
NumPy reference; NumPy arrays, torch tensors and a __dlpack__ host object; async work; and the
failures: mismatched calls, a rank that never arrives, a rank killed mid-collective.

Each job runs this file as a script in N processes (`python test_collectives.py SCENARIO`) that
rendezvous through init_method=file://; many checks share one job to keep the file fast."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any, Dict, List

import numpy as np
import pytest

from _procs import finish_all, start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.abspath(__file__)

NP_DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8", "int8"]
OPS = ["sum", "avg", "min", "max", "prod"]
# Above the shared-memory slot (1 MiB = 262144 float32) and the TCP ring piece, and odd, so the
# chunk loops and uneven ring segments are exercised.
BIG = 655_361


# ------------------------------------------------------------------------- reference data


def values(rank: int, n: int, op: str, dtype: str, salt: int = 0) -> np.ndarray:
    """Rank `rank`'s input: small integers, so sums and products of up to 3 ranks are exact in
    every dtype (float16 and bfloat16 included) and the reference needs no tolerance."""
    rng = np.random.default_rng(1000 * rank + 7 * n + salt)
    if op == "prod":
        v = rng.choice([1, 2] if dtype == "uint8" else [-2, -1, 1, 2], n)
    else:
        v = rng.integers(0, 17, n) if dtype == "uint8" else rng.integers(-8, 9, n)
    return v.astype(np.int64)


def reference(stack: np.ndarray, op: str, dtype: str, world: int) -> np.ndarray:
    """The reduction over ranks (axis 0) of int64 data, as the collective computes it in dtype:
    integer sums/products wrap like the dtype (integer AVG is refused: see int_avg_refused)."""
    if op == "sum":
        r = stack.sum(axis=0)
    elif op == "prod":
        r = stack.prod(axis=0)
    elif op == "min":
        r = stack.min(axis=0)
    elif op == "max":
        r = stack.max(axis=0)
    else:
        s = stack.sum(axis=0)
        if np.dtype(dtype).kind in "iu":
            return (np.sign(s) * (np.abs(s) // world)).astype(dtype)
        return (s / world).astype(dtype)
    return r.astype(dtype)


def int_avg_refused(call: Any, what: str) -> None:
    """AVG of integers is refused on every rank (it would round down, and overflow in small
    dtypes), with what to do instead."""
    try:
        call()
    except ValueError as e:
        assert "op=AVG of" in str(e) and "use op=SUM and divide in floating point" in str(e), e
        return
    raise AssertionError(f"{what}: AVG of integers was not refused")


def assert_same(got: np.ndarray, want: np.ndarray, what: str, op: str = "sum") -> None:
    got = np.asarray(got)
    if op == "avg" and got.dtype.kind == "f":
        # Sum then divide: exact sums, one rounding of the quotient (float16: 2^-11 relative).
        rtol = {"float16": 1e-3, "float32": 1e-6, "float64": 1e-12}[got.dtype.name]
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                                   atol=0, err_msg=what)
    else:
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (f"{what}: {bad.size} of {got.size} elements differ, first at "
                               f"{bad[0]}: got {got.flat[bad[0]]}, want {want.flat[bad[0]]}")


# ------------------------------------------------------------------------- worker side


class HostArray:
    """A foreign host array that only speaks DLPack."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __dlpack__(self, **kwargs):  # noqa: ANN003 - DLPack protocol keywords
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def init(timeout: float = 30.0, path: str = "") -> None:
    import ddpc
    ddpc.init_process_group(backend="cpu", init_method="file://" + (path or os.environ["RDV"]),
                            timeout=timeout)


def torch_checks(rank: int, world: int) -> int:
    """torch tensors (bfloat16 among them: NumPy has none) and torch's ReduceOp. Only one job
    runs these: importing torch costs seconds per process."""
    import ddpc
    import torch
    checks = 0

    def stack(n: int, op: str, dtype: str) -> np.ndarray:
        return np.stack([values(r, n, op, dtype) for r in range(world)])

    for tdt in (torch.bfloat16, torch.float16, torch.float32, torch.int64):
        name = str(tdt).replace("torch.", "")
        for op in OPS:
            for n in (5, 70_001):
                if op == "avg" and not tdt.is_floating_point:
                    int_avg_refused(lambda: ddpc.all_reduce(
                        torch.ones(n, dtype=tdt), op=op), f"torch {name}")
                    continue
                ref = reference(stack(n, op, "float64" if name == "bfloat16" else name), op,
                                "float64" if name == "bfloat16" else name, world)
                t = torch.tensor(values(rank, n, op, name), dtype=tdt)
                ddpc.all_reduce(t, op=op)
                want = torch.tensor(ref).to(tdt)
                if op == "avg" and tdt.is_floating_point:
                    torch.testing.assert_close(t, want, rtol=1e-2 if name == "bfloat16" else 1e-3,
                                               atol=0, msg=f"torch {name} avg")
                else:
                    assert torch.equal(t, want), f"torch {name} {op} n={n}"
                checks += 1

    x = values(rank, 64, "min", "float64").astype(np.float64)
    ddpc.all_reduce(x, op=torch.distributed.ReduceOp.MIN)
    assert_same(x, reference(stack(64, "min", "float64"), "min", "float64", world), "torch op")
    t = torch.tensor(values(rank, 10, "sum", "float32"), dtype=torch.bfloat16)
    ddpc.broadcast(t, src=world - 1)
    assert torch.equal(t, torch.tensor(values(world - 1, 10, "sum", "float32"),
                                       dtype=torch.bfloat16)), "broadcast torch bf16"
    tin = torch.tensor(values(rank, 9, "sum", "float32"), dtype=torch.bfloat16)
    tout = torch.empty(world * 9, dtype=torch.bfloat16)
    ddpc.all_gather_into_tensor(tout, tin)
    assert torch.equal(tout, torch.cat([torch.tensor(values(r, 9, "sum", "float32"),
                                                     dtype=torch.bfloat16)
                                        for r in range(world)])), "all_gather torch"
    t = torch.full((6,), float(rank + 1))
    ddpc.reduce(t, dst=1, op="sum")
    assert t.tolist() == ([float(sum(range(1, world + 1)))] * 6 if rank == 1
                          else [float(rank + 1)] * 6), f"reduce torch: {t.tolist()}"
    return checks + 4


def scenario_all() -> Dict:
    """Every collective x dtype x op against the reference; array kinds; async; op spellings."""
    import ddpc
    init()
    rank, world = ddpc.get_rank(), ddpc.get_world_size()
    checks = 0
    g = ddpc.distributed._default_group()
    want_transport = os.environ.get("DDPC_CPU_TRANSPORT", "auto")
    if want_transport != "auto":
        assert g.transport == want_transport, (g.transport, want_transport)

    def stack(n: int, op: str, dtype: str, salt: int = 0) -> np.ndarray:
        return np.stack([values(r, n, op, dtype, salt) for r in range(world)])

    # all_reduce: every NumPy dtype x op, small and crossing chunk boundaries.
    for dtype in NP_DTYPES:
        for op in OPS:
            sizes = [1, 7, 4099] + ([BIG] if dtype == "float32" or op == "sum" else [])
            for n in sizes:
                x = values(rank, n, op, dtype).astype(dtype)
                if op == "avg" and np.dtype(dtype).kind in "iu":
                    int_avg_refused(lambda: ddpc.all_reduce(x, op=op), f"all_reduce {dtype}")
                    checks += 1
                    continue
                ddpc.all_reduce(x, op=op)
                assert_same(x, reference(stack(n, op, dtype), op, dtype, world),
                            f"all_reduce {dtype} {op} n={n}", op)
                checks += 1
    # Integer sums wrap like the dtype (as NumPy's do).
    x = np.full(33, 100, dtype=np.int8)
    ddpc.all_reduce(x)
    assert_same(x, np.full(33, 100 * world, dtype=np.int64).astype(np.int8), "int8 wraps")
    checks += 1

    # A host object that only has __dlpack__: the result lands in the memory it exports.
    base = values(rank, 1001, "sum", "float32").astype(np.float32)
    ddpc.all_reduce(HostArray(base))
    assert_same(base, reference(stack(1001, "sum", "float32"), "sum", "float32", world), "dlpack")
    checks += 1

    # Op spellings: strings and ddpc.ReduceOp.
    for spelled, op in ((ddpc.ReduceOp.SUM, "sum"), ("MAX", "max"), (ddpc.ReduceOp.PRODUCT, "prod"),
                        ("mean", "avg")):
        x = values(rank, 64, op, "float64").astype(np.float64)
        ddpc.all_reduce(x, op=spelled)
        assert_same(x, reference(stack(64, op, "float64"), op, "float64", world), str(spelled), op)
        checks += 1

    # broadcast from every source, all dtypes, small and large.
    for src in range(world):
        for dtype in NP_DTYPES:
            for n in (3, BIG if dtype == "float64" else 999):
                x = values(rank, n, "sum", dtype).astype(dtype)
                ddpc.broadcast(x, src=src)
                assert_same(x, values(src, n, "sum", dtype).astype(dtype),
                            f"broadcast {dtype} src={src} n={n}")
                checks += 1

    # reduce: only dst gets the result; the others keep their values.
    for dst in range(world):
        for op in ("sum", "max", "avg"):
            x = values(rank, 1001, op, "float64").astype(np.float64)
            before = x.copy()
            ddpc.reduce(x, dst=dst, op=op)
            if rank == dst:
                assert_same(x, reference(stack(1001, op, "float64"), op, "float64", world),
                            f"reduce {op} dst={dst}", op)
            else:
                assert_same(x, before, f"reduce {op} dst={dst}: non-dst rank {rank} changed")
            checks += 1

    try:  # an array that only speaks DLPack cannot be copied: every rank refuses it
        ddpc.reduce(HostArray(np.zeros(3, dtype=np.float32)), dst=0)
        raise AssertionError("reduce of a DLPack-only array did not raise")
    except TypeError as e:
        assert "HostArray cannot be copied here" in str(e), e
    checks += 1

    # all_gather (tensor and list forms).
    for dtype in ("float32", "int8", "float16", "int64"):
        for n in (1, 5, 300_001 if dtype == "int8" else 70_001):
            mine = values(rank, n, "sum", dtype).astype(dtype)
            out = np.empty(world * n, dtype=dtype)
            ddpc.all_gather_into_tensor(out, mine)
            want = np.concatenate([values(r, n, "sum", dtype).astype(dtype) for r in range(world)])
            assert_same(out, want, f"all_gather_into_tensor {dtype} n={n}")
            checks += 1
    outs = [np.zeros((2, 3), dtype=np.float32) for _ in range(world)]
    ddpc.all_gather(outs, values(rank, 6, "sum", "float32").astype(np.float32).reshape(2, 3))
    for r in range(world):
        assert_same(outs[r].ravel(), values(r, 6, "sum", "float32").astype(np.float32),
                    "all_gather list")

    # reduce_scatter (tensor and list forms).
    for dtype in ("float32", "float64", "int32", "float16"):
        for op in OPS:
            for n in (1, 3, 200_003 if op == "sum" else 4_001):
                inp = values(rank, world * n, op, dtype, salt=1).astype(dtype)
                out = np.empty(n, dtype=dtype)
                if op == "avg" and dtype == "int32":
                    int_avg_refused(lambda: ddpc.reduce_scatter_tensor(out, inp, op=op),
                                    "reduce_scatter int32")
                    continue
                ddpc.reduce_scatter_tensor(out, inp, op=op)
                full = reference(stack(world * n, op, dtype, salt=1), op, dtype, world)
                assert_same(out, full[rank * n:(rank + 1) * n],
                            f"reduce_scatter {dtype} {op} n={n}", op)
                checks += 1
    pieces = [values(rank, 4, "sum", "int64", salt=10 + q) for q in range(world)]
    out = np.empty(4, dtype=np.int64)
    ddpc.reduce_scatter(out, pieces, op="sum")
    want = sum(values(r, 4, "sum", "int64", salt=10 + rank) for r in range(world))
    assert_same(out, want, "reduce_scatter list")
    # In place: the output is this rank's block of the input.
    inp = values(rank, world * 50_001, "sum", "float32", salt=2).astype(np.float32)
    ddpc.reduce_scatter_tensor(inp[rank * 50_001:(rank + 1) * 50_001], inp)
    full = reference(stack(world * 50_001, "sum", "float32", salt=2), "sum", "float32", world)
    assert_same(inp[rank * 50_001:(rank + 1) * 50_001], full[rank * 50_001:(rank + 1) * 50_001],
                "reduce_scatter in place")

    # Async: works complete in order; a posted collective really runs in the background (rank 0
    # checks that its work is still pending while rank 1 has provably not joined yet).
    arrays = [values(rank, 20_000 + i, "sum", "float32").astype(np.float32) for i in range(6)]
    works = [ddpc.all_reduce(a, async_op=True) for a in arrays]
    for i, (w, a) in enumerate(zip(works, arrays)):
        assert w.wait() is True
        assert w.is_completed()
        assert_same(a, reference(stack(20_000 + i, "sum", "float32"), "sum", "float32", world),
                    f"async {i}")
    store = ddpc.get_store()
    x = values(rank, BIG, "sum", "float32").astype(np.float32)
    if rank == 0:
        w = ddpc.all_reduce(x, async_op=True)
        pending = w.is_completed()
        store.set("cpu-test/go", b"1")
        assert not pending, "all_reduce completed before rank 1 joined"
        w.wait()
    else:
        store.get("cpu-test/go", 30.0)
        ddpc.all_reduce(x)
    assert_same(x, reference(stack(BIG, "sum", "float32"), "sum", "float32", world), "overlap")
    w = ddpc.barrier(async_op=True)
    w.wait()
    assert w.is_completed()
    ddpc.barrier()
    if os.environ.get("WITH_TORCH") == "1":
        checks += torch_checks(rank, world)
    transport = g.transport
    # after all of them: the cpu backend issues every collective on its caller's thread
    assert g.deferred_count == 0, g.deferred_count
    ddpc.destroy_process_group()
    return {"checks": checks, "transport": transport}


def scenario_single() -> Dict:
    """world_size 1: every collective is a local copy (or nothing)."""
    import ddpc
    init()
    x = np.arange(10, dtype=np.float32)
    ddpc.all_reduce(x, op="avg")
    assert_same(x, np.arange(10, dtype=np.float32), "single all_reduce")
    out = np.zeros(10, dtype=np.float32)
    ddpc.all_gather_into_tensor(out, x)
    assert_same(out, x, "single all_gather")
    out2 = np.zeros(10, dtype=np.float32)
    ddpc.reduce_scatter_tensor(out2, x)
    assert_same(out2, x, "single reduce_scatter")
    ddpc.broadcast(x, src=0)
    ddpc.barrier()
    ddpc.all_reduce(x, async_op=True).wait()
    transport = ddpc.distributed._default_group().transport
    ddpc.destroy_process_group()
    return {"transport": transport}


def scenario_objects() -> Dict:
    """all_gather_object and broadcast_object_list: objects of rank-dependent type and size,
    from every src; an unpicklable object and a list of the wrong length raise clearly."""
    import threading
    import ddpc
    init()
    rank, world = ddpc.get_rank(), ddpc.get_world_size()
    mine = {"rank": rank, "text": "x" * (1000 * rank), "arr": np.arange(rank + 1)} if rank else None
    got = [object()] * world
    ddpc.all_gather_object(got, mine)
    assert got[0] is None
    for r in range(1, world):
        assert got[r]["rank"] == r and got[r]["text"] == "x" * (1000 * r)
        assert got[r]["arr"].tolist() == list(range(r + 1))
    for src in range(world):
        objs = [f"from {rank}", {"n": rank}, [rank] * 3] if rank == src else [None, None, None]
        ddpc.broadcast_object_list(objs, src=src)
        assert objs == [f"from {src}", {"n": src}, [src] * 3], (src, objs)
    for dst in range(world):
        out = [None] * world if rank == dst else None
        ddpc.gather_object(("g", rank), out, dst=dst)
        if rank == dst:
            assert out == [("g", r) for r in range(world)], out
    errors = {}
    # Rank 1's object cannot be pickled: every rank raises, none waits for the others.
    try:
        ddpc.all_gather_object([None] * world, threading.Lock() if rank == 1 else rank)
    except (TypeError, ddpc.DistributedError) as e:
        errors["unpicklable"] = f"{type(e).__name__}: {e}"
    # The last rank passes a shorter list: it raises, the others get the objects.
    objs = [rank, rank] if rank == world - 1 else [rank, rank, rank]
    try:
        ddpc.broadcast_object_list(objs, src=0)
    except ValueError as e:
        errors["length"] = str(e)
    if rank != world - 1:
        assert objs == [0, 0, 0], objs
    try:  # dst (rank 0) without a list: it raises, the others go on
        ddpc.gather_object(rank, None, dst=0)
    except ValueError as e:
        errors["gather"] = str(e)
    for bad, exc in [(lambda: ddpc.all_gather_object([None], 1), ValueError),
                     (lambda: ddpc.broadcast_object_list([1], src=world), ValueError),
                     (lambda: ddpc.broadcast_object_list((1,), src=0), TypeError)]:
        try:
            bad()
            raise AssertionError("no error")
        except exc as e:
            errors.setdefault("args", []).append(str(e))
    ddpc.barrier()
    ddpc.destroy_process_group()
    return {"errors": errors}


def scenario_mismatch() -> Dict:
    """Three kinds of disagreement, each in a fresh group: every rank must raise MismatchError
    naming both ranks' calls."""
    import ddpc
    rank = int(os.environ["RANK"])
    messages = []
    cases = [
        lambda: ddpc.all_reduce(np.zeros(1024 if rank == 0 else 512, dtype=np.float32)),
        lambda: ddpc.all_reduce(np.zeros(64, dtype=np.float32 if rank == 0 else np.float64)),
        lambda: ddpc.all_reduce(np.zeros(64, dtype=np.int32), op="sum" if rank == 0 else "max"),
        lambda: (ddpc.broadcast(np.zeros(8), src=0) if rank == 0 else ddpc.barrier()),
    ]
    for i, case in enumerate(cases):
        init(path=f"{os.environ['RDV']}.{i}")
        ddpc.all_reduce(np.ones(4, dtype=np.float32))  # a good one first: #1
        try:
            case()
        except ddpc.MismatchError as e:
            messages.append(str(e))
        else:
            raise AssertionError(f"case {i}: no MismatchError on rank {rank}")
        # The group is aborted: later calls fail at once instead of hanging.
        t0 = time.monotonic()
        with pytest.raises(ddpc.DistributedError):
            ddpc.all_reduce(np.ones(4, dtype=np.float32))
        assert time.monotonic() - t0 < 10
        ddpc.destroy_process_group()
    return {"messages": messages}


def scenario_timeout() -> Dict:
    """Rank 1 never calls the collective: rank 0 times out naming it."""
    import ddpc
    init(timeout=1.5)
    rank = ddpc.get_rank()
    ddpc.all_reduce(np.ones(4, dtype=np.float32))
    msg, kind, elapsed = "", "", 0.0
    if rank == 0:
        t0 = time.monotonic()
        try:
            ddpc.all_reduce(np.ones(100, dtype=np.float32))
        except ddpc.DistributedTimeoutError as e:
            msg, kind = str(e), "timeout"
            assert isinstance(e, TimeoutError)
        elapsed = time.monotonic() - t0
        # Leave before rank 1 arrives: it must still be told the reason (the timeout), not just
        # that rank 0 is gone.
        ddpc.distributed._default_group().destroy()
        ddpc.get_store().set("cpu-test/timed-out", b"1")
    else:
        ddpc.get_store().get("cpu-test/timed-out", 30.0)
        # Arriving late: the group was aborted by rank 0, so this fails at once with its reason.
        try:
            ddpc.all_reduce(np.ones(100, dtype=np.float32))
        except ddpc.DistributedError as e:
            msg, kind = str(e), type(e).__name__
    ddpc.destroy_process_group()
    return {"message": msg, "kind": kind, "elapsed": elapsed}


def scenario_killed() -> Dict:
    """Rank 1 dies (SIGKILL) in the middle of an all_reduce; rank 0 must raise PeerError long
    before its 60 s timeout."""
    import ddpc
    init(timeout=60.0)
    rank = ddpc.get_rank()
    x = np.ones(BIG, dtype=np.float32)
    ddpc.all_reduce(x)
    if rank == 1:
        ddpc.all_reduce(x, async_op=True)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            ddpc.all_reduce(x)
    except ddpc.PeerError as e:
        return {"message": str(e), "elapsed": time.monotonic() - t0}
    raise AssertionError("no PeerError although rank 1 was killed")


def scenario_torch_names() -> Dict:
    """torch.distributed's gather, scatter, scatter_object_list, monitored_barrier and a second
    group from new_group (another timeout, gloo by name), against references; their bad
    arguments raise on the rank that passed them while the others go on."""
    import ddpc
    init()
    rank, world = ddpc.get_rank(), ddpc.get_world_size()
    errors: Dict[str, str] = {}
    assert ddpc.group.WORLD is ddpc.distributed._default_group()
    assert ddpc.get_global_rank(ddpc.group.WORLD, world - 1) == world - 1
    for dst in range(world):
        mine = np.arange(5, dtype=np.float64) + 10 * rank
        out = [np.zeros(5) for _ in range(world)] if rank == dst else None
        ddpc.gather(mine, out, dst=dst)
        if rank == dst:
            for r in range(world):
                assert_same(out[r], np.arange(5, dtype=np.float64) + 10 * r, f"gather from {r}")
    for src in range(world):
        got = np.full((2, 3), -1, dtype=np.int32)
        parts = ([np.full((2, 3), 100 * src + r, dtype=np.int32) for r in range(world)]
                 if rank == src else None)
        ddpc.scatter(got, parts, src=src)
        assert_same(got, np.full((2, 3), 100 * src + rank, dtype=np.int32), f"scatter {src}")
        box = [None]
        ddpc.scatter_object_list(box, [{"to": r, "from": src} for r in range(world)]
                                 if rank == src else None, src=src)
        assert box == [{"to": rank, "from": src}], box
    # Bad lists, on one rank each: it raises after taking part; the others get their data.
    got = np.zeros(4, dtype=np.float32)
    try:
        ddpc.gather(got, [np.zeros(3, dtype=np.float32)] * world if rank == 0 else None)
    except ValueError as e:
        errors["gather"] = str(e)
    try:
        ddpc.scatter(got, [np.zeros(4, dtype=np.float32)] * world if rank in (0, world - 1)
                     else None, src=0)  # (the last rank is not src: it passes none)
    except ValueError as e:
        errors["scatter"] = str(e)
    # src's own list is bad: every rank raises (the others used to take memory src never
    # filled), tensors and objects alike
    for key, call in (("scatter_src", lambda: ddpc.scatter(
            got, [np.zeros(4, dtype=np.float32)] if rank == 1 else None, src=1)),
                      ("scatter_object_src", lambda: ddpc.scatter_object_list(
                          [None], None, src=1))):
        try:
            call()
        except (ValueError, ddpc.DistributedError) as e:
            errors[key] = f"{type(e).__name__}: {e}"
    # A second group: every rank, another timeout; collectives on it and on the default one
    # interleave.
    side = ddpc.new_group(backend="gloo", timeout=5.0)
    x = np.full(3, rank + 1.0)
    ddpc.all_reduce(x, group=side)
    y = np.ones(2)
    ddpc.all_reduce(y)
    ddpc.all_reduce(x, group=side)
    assert_same(x, np.full(3, world * sum(range(1, world + 1)), dtype=np.float64), "new_group")
    assert_same(y, np.full(2, float(world)), "default group beside it")
    assert ddpc.get_backend(side) == "cpu"
    for bad in (lambda: ddpc.new_group(ranks=[0]), lambda: ddpc.new_group(ranks="x"),
                lambda: ddpc.new_group(backend="nccl"), lambda: ddpc.all_reduce(x, group=1)):
        try:
            bad()
            raise AssertionError("no error")
        except (NotImplementedError, TypeError, ValueError) as e:
            errors.setdefault("new_group", []).append(f"{type(e).__name__}: {e}")
    ddpc.monitored_barrier(timeout=10)
    t0 = time.monotonic()
    if rank != world - 1:  # the last rank is late: the others time out naming it
        try:
            ddpc.monitored_barrier(timeout=1.0)
        except ddpc.DistributedTimeoutError as e:
            errors["monitored"] = str(e)
    elapsed = time.monotonic() - t0
    ddpc.barrier(group=side)
    ddpc.destroy_process_group(side)
    try:
        ddpc.all_reduce(x, group=side)
    except ValueError as e:
        errors["destroyed"] = str(e)
    ddpc.all_reduce(y)  # the default group goes on
    # new_group on rank 0 alone: it times out saying that every rank must call new_group
    if rank == 0:
        try:
            ddpc.new_group(timeout=1.0)
        except ddpc.DistributedError as e:
            errors["lonely"] = f"{type(e).__name__}: {e}"
        ddpc.get_store().set("cpu-test/lonely-done", b"1")
    else:
        ddpc.get_store().get("cpu-test/lonely-done", 60.0)
    ddpc.all_reduce(y)
    ddpc.destroy_process_group()
    return {"errors": errors, "elapsed": elapsed}


SCENARIOS = {"all": scenario_all, "objects": scenario_objects, "single": scenario_single,
             "mismatch": scenario_mismatch, "timeout": scenario_timeout, "killed": scenario_killed,
             "torch_names": scenario_torch_names}


# ------------------------------------------------------------------------- test side


def scenario_groups_in_opposite_order() -> Dict:
    """Rank 0 all-reduces on a group from new_group while the others all-reduce on the default
    group: each times out naming the collective and the group the other rank waits in, and the
    timeout to raise (new_group's or init_process_group's)."""
    import ddpc
    init(timeout=2.0)
    side = ddpc.new_group(timeout=2.0)
    x = np.ones(4)
    try:
        ddpc.all_reduce(x, group=side if ddpc.get_rank() == 0 else None)
    except ddpc.DistributedTimeoutError as e:
        return {"error": str(e)}
    return {"error": None}


SCENARIOS["groups_in_opposite_order"] = scenario_groups_in_opposite_order


def scenario_caught_timeout_then_busy() -> Dict:
    """Rank 1 times out in a side group, catches it and is busy; rank 0 comes to the default
    group later and times out: rank 1 is not said to wait in the side group any more."""
    import ddpc
    init(timeout=2.0)
    side = ddpc.new_group(timeout=1.0)
    out: Dict = {}
    if ddpc.get_rank() == 1:
        try:
            ddpc.all_reduce(np.ones(2), group=side)
        except ddpc.DistributedTimeoutError:
            pass
        time.sleep(9)
    else:
        time.sleep(4)  # (rank 1 timed out and published where it waited meanwhile)
        try:
            ddpc.all_reduce(np.ones(2))
        except ddpc.DistributedTimeoutError as e:
            out["error"] = str(e)
    return out


SCENARIOS["caught_timeout_then_busy"] = scenario_caught_timeout_then_busy


def scenario_work_status() -> Dict:
    """Work.is_success: True after a collective that worked, False after one that failed (its
    wait raised); AVG of integers is refused on every rank, and the group goes on."""
    import ddpc
    init(timeout=10.0)
    rank = ddpc.get_rank()
    out: Dict = {"avg": []}
    for x in (np.array([200, 100], dtype=np.uint8), np.array([1, 2], dtype=np.int64)):
        try:
            ddpc.all_reduce(x, op=ddpc.ReduceOp.AVG)
        except ValueError as e:
            out["avg"].append(str(e))
    parts = np.zeros(1, dtype=np.int32)
    try:
        ddpc.reduce_scatter_tensor(parts, np.ones(ddpc.get_world_size(), dtype=np.int32),
                                   op=ddpc.ReduceOp.AVG)
    except ValueError as e:
        out["avg"].append(str(e))
    good = ddpc.all_reduce(np.ones(3), async_op=True)
    good.wait()
    out["good"] = [good.is_completed(), good.is_success()]
    bad = ddpc.all_reduce(np.ones(3 + rank), async_op=True)  # counts differ: a MismatchError
    try:
        bad.wait()
    except ddpc.MismatchError:
        out["bad"] = [bad.is_completed(), bad.is_success()]
    return out


SCENARIOS["work_status"] = scenario_work_status


def scenario_layouts_and_dtypes() -> Dict:
    """What gloo takes and ddpc used to refuse or get wrong: strided (non-contiguous) tensors,
    bool and complex tensors, a NumPy integer as src, a requires_grad output; and async
    gathers whose outputs must be written once they are said to be complete."""
    import ddpc
    import torch
    init(timeout=10.0)
    rank, world = ddpc.get_rank(), ddpc.get_world_size()
    out: Dict = {}
    # Strided tensors: a transposed one, a channels_last one, a step-sliced array, all in place
    t = (torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank).t()
    ddpc.all_reduce(t)
    out["transposed"] = [t.tolist(), t.stride()]
    cl = torch.full((1, 2, 2, 2), rank + 1.0).contiguous(memory_format=torch.channels_last)
    ddpc.all_reduce(cl, async_op=True).wait()
    out["channels_last"] = [cl.sum().item(), cl.is_contiguous(memory_format=torch.channels_last)]
    base = np.zeros(8)
    base[::2] = rank + 1
    ddpc.all_reduce(base[::2])
    out["step_sliced"] = base.tolist()
    wide = torch.zeros(world * 2, 3)
    ddpc.all_gather_into_tensor(wide[:, 1], torch.full((2,), float(rank)))
    out["gather_into_column"] = wide[:, 1].tolist() + [wide[:, 0].abs().sum().item()]
    rs = torch.zeros(2, 4)
    ddpc.reduce_scatter_tensor(rs[:, 1], torch.arange(2.0 * world) + rank)
    out["reduce_scatter_column"] = rs.tolist()
    bc = torch.zeros(3, 2)
    if rank == 0:
        bc[:, 0] = torch.tensor([7.0, 8.0, 9.0])
    ddpc.broadcast(bc[:, 0], src=np.int64(0))
    out["broadcast_column"] = bc.tolist()
    try:
        ddpc.all_reduce(torch.zeros(1).expand(4))
    except ValueError as e:
        out["expanded"] = str(e)
    # bool: SUM is any, PRODUCT all (as torch's NCCL backend); AVG refused
    flags = torch.tensor([rank == 0, True, False])
    anyof, allof = flags.clone(), flags.clone()
    ddpc.all_reduce(anyof)
    ddpc.all_reduce(allof, op=ddpc.ReduceOp.PRODUCT)
    out["bool"] = [anyof.tolist(), allof.tolist(), anyof.dtype == torch.bool]
    try:
        ddpc.all_reduce(flags.clone(), op=ddpc.ReduceOp.AVG)
    except ValueError as e:
        out["bool_avg"] = str(e)
    gathered = [torch.zeros(3, dtype=torch.bool) for _ in range(world)]
    ddpc.all_gather(gathered, flags)
    out["bool_gather"] = [g.tolist() for g in gathered]
    # complex: SUM and AVG part by part; no order
    z = torch.tensor([1 + 2j, rank * 1j], dtype=torch.complex64)
    zs, za = z.clone(), z.clone()
    ddpc.all_reduce(zs)
    ddpc.all_reduce(za, op="avg")
    out["complex"] = [[[v.real, v.imag] for v in zs.tolist()],
                      [[v.real, v.imag] for v in za.tolist()]]
    for key, call in (("complex_max", lambda: ddpc.all_reduce(z.clone(), op="max")),
                      ("complex_conj", lambda: ddpc.all_reduce(z.clone().conj()))):
        try:
            call()
        except ValueError as e:
            out[key] = str(e)
    zb = z.to(torch.complex128) if rank == 1 else torch.zeros(2, dtype=torch.complex128)
    ddpc.broadcast(zb, src=1)
    out["complex_broadcast"] = [[v.real, v.imag] for v in zb.tolist()]
    # scatter into a leaf that requires grad: written as data, as gloo does
    leaf = torch.zeros(2, requires_grad=True)
    parts = [torch.full((2,), float(r)) for r in range(world)] if rank == 0 else None
    ddpc.scatter(leaf, parts, src=0)
    out["scatter_leaf"] = [leaf.tolist(), leaf.requires_grad]
    # Async gathers: complete means written, and so does any later collective's return
    outs = [torch.zeros(1) for _ in range(world)]
    w = ddpc.all_gather(outs, torch.full((1,), rank + 1.0), async_op=True)
    while not w.is_completed():
        time.sleep(0.001)
    out["polled"] = [o.item() for o in outs] + [w.is_success()]
    outs2 = [torch.zeros(1) for _ in range(world)]
    ddpc.all_gather(outs2, torch.full((1,), rank + 5.0), async_op=True)  # (never waited for)
    ddpc.barrier()
    out["after_barrier"] = [o.item() for o in outs2]
    try:
        ddpc.new_group([0, 0])
    except ValueError as e:
        out["new_group"] = str(e)
    return out


SCENARIOS["layouts_and_dtypes"] = scenario_layouts_and_dtypes


def scenario_settled_by_another_thread() -> Dict:
    """Thread A polls an async all_gather's is_completed() and reads its list at once; thread
    B runs small synchronous all-reduces on a second group, each of which finishes the ended
    async collectives: A must never see True before the list is filled (B's copy, 16 MiB per
    entry, takes milliseconds)."""
    import threading
    import ddpc
    import torch
    init(timeout=60.0)
    rank, world = ddpc.get_rank(), ddpc.get_world_size()
    side = ddpc.new_group()
    n = 1 << 22

    def hammer() -> None:
        x = torch.zeros(1)
        for _ in range(20000):
            ddpc.all_reduce(x, group=side)
    tb = threading.Thread(target=hammer)
    tb.start()
    early = []
    t = torch.full((n,), rank + 1.0)
    for it in range(40):
        got = [torch.zeros(n) for _ in range(world)]
        w = ddpc.all_gather(got, t, async_op=True)
        while not w.is_completed():
            pass
        last = [e[-1].item() for e in got]
        if last != [r + 1.0 for r in range(world)]:
            early.append((it, last))
    tb.join()
    return {"early": early}


SCENARIOS["settled_by_another_thread"] = scenario_settled_by_another_thread


def scenario_destroy_unwaited() -> Dict:
    """Async collectives never waited for are finished by destroy_process_group (their arrays
    get the results; they used to be dropped), and one that fails there is a warning."""
    import gc
    import warnings
    import weakref
    import ddpc
    init(timeout=10.0)
    rank, world = ddpc.get_rank(), ddpc.get_world_size()
    # Dropped handles of in-place collectives keep nothing alive once the collectives end.
    refs = []
    for _ in range(300):
        a = np.ones(1 << 12)
        refs.append(weakref.ref(a))
        ddpc.all_reduce(a, async_op=True)
        del a
    ddpc.barrier()
    ddpc.all_reduce(np.ones(1), async_op=True)  # (dropping one still running reaps the ended)
    gc.collect()
    alive = sum(r() is not None for r in refs)
    x = np.ones(4)
    ddpc.all_reduce(x, async_op=True)
    parts = [np.zeros(2) for _ in range(world)]
    ddpc.all_gather(parts, np.full(2, rank + 1.0), async_op=True)
    side = ddpc.new_group()
    y = np.full(3, rank + 1.0)
    ddpc.all_reduce(y, group=side, async_op=True)
    ddpc.destroy_process_group(side)
    other = ddpc.new_group()
    waited = ddpc.all_reduce(np.ones(2 + rank), group=other, async_op=True)  # counts differ
    try:
        waited.wait()  # (failed and waited for: destroy says nothing more about it)
    except ddpc.DistributedError:
        pass
    z = np.ones(3 + rank)  # counts differ: it fails, as destroy finishes it
    held = ddpc.all_reduce(z, async_op=True)  # (held, never waited for: destroy says it failed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddpc.destroy_process_group()
    del held
    return {"alive": alive, "x": x.tolist(), "parts": [p.tolist() for p in parts], "y": y.tolist(),
            "warnings": [str(w.message) for w in caught]}


SCENARIOS["destroy_unwaited"] = scenario_destroy_unwaited


def scenario_named_mismatch() -> Dict:
    """A mismatch inside a collective made of others names the call the user made: rank 0
    scatters while rank 1 all-gathers objects; then, on a second group, rank 0 wraps a model
    while rank 1 all-reduces."""
    import ddpc
    import torch
    init(timeout=10.0)
    rank = ddpc.get_rank()
    side = ddpc.new_group()
    out: Dict = {}
    try:
        if rank == 0:
            ddpc.scatter(np.zeros(2), [np.ones(2), np.ones(2)], src=0)
        else:
            ddpc.all_gather_object([None, None], "hello")
    except ddpc.MismatchError as e:
        out["first"] = str(e)
    try:
        if rank == 0:
            ddpc.wrap_model(torch.nn.Linear(2, 1), group=side)
        else:
            ddpc.all_reduce(np.ones(3), group=side)
    except ddpc.MismatchError as e:
        out["second"] = str(e)
    # Each rank names itself as dst: reduce and gather refuse (every rank used to get a result)
    for key, call in (("reduce", lambda g: ddpc.reduce(np.ones(4), dst=rank, group=g)),
                      ("gather", lambda g: ddpc.gather(np.ones(2), [np.zeros(2)] * 2,
                                                       dst=rank, group=g))):
        try:
            call(ddpc.new_group())
        except ddpc.MismatchError as e:
            out[key] = str(e)
    try:
        ddpc.gather_object(rank, [None, None], dst=rank, group=ddpc.new_group())
    except ddpc.MismatchError as e:
        out["gather_object"] = str(e)
    return out


SCENARIOS["named_mismatch"] = scenario_named_mismatch


def scenario_bitwise() -> Dict:
    """BAND, BOR and BXOR (gloo's bitwise reductions) of every integer dtype over the whole
    range of its bits, by ddpc's and torch's names, in all_reduce and reduce_scatter, and of
    bool tensors; float elements refused on every rank, naming the op and the dtype."""
    import ddpc
    import torch
    import torch.distributed as tdist
    init()
    rank, world = ddpc.get_rank(), ddpc.get_world_size()
    fold = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}

    def bits(r: int, n: int, dtype: str, salt: int) -> np.ndarray:
        rng = np.random.default_rng(100 * r + salt)
        return rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype)

    checks = 0
    for i, dtype in enumerate(["int8", "uint8", "int32", "int64"]):
        for j, op in enumerate(["band", "bor", "bxor"]):
            for n in (1, 4099, BIG):
                salt = 1000 * i + 10 * j + n
                every = np.stack([bits(r, n, dtype, salt) for r in range(world)])
                want = fold[op].reduce(every, axis=0)
                x = every[rank].copy()
                spelled = [op, getattr(ddpc.ReduceOp, op.upper()),
                           getattr(tdist.ReduceOp, op.upper())][n % 3]
                ddpc.all_reduce(x, op=spelled)
                assert_same(x, want, f"all_reduce {dtype} {op} n={n} ({spelled!r})")
                t = torch.from_numpy(every[rank].copy())
                ddpc.all_reduce(t, op=getattr(tdist.ReduceOp, op.upper()))
                assert_same(t.numpy(), want, f"torch all_reduce {dtype} {op} n={n}")
                checks += 2
        # reduce_scatter: this rank's block of the folded inputs
        op = ["band", "bor", "bxor"][i % 3]
        every = np.stack([bits(r, 5 * world, dtype, 7 + i) for r in range(world)])
        out = np.zeros(5, dtype=dtype)
        ddpc.reduce_scatter_tensor(out, every[rank].copy(), op=op)
        assert_same(out, fold[op].reduce(every, axis=0)[5 * rank:5 * (rank + 1)],
                    f"reduce_scatter {dtype} {op}")
        checks += 1
    # bool tensors: all (BAND), any (BOR), odd number of True (BXOR)
    truth = np.stack([np.random.default_rng(50 + r).integers(0, 2, 257).astype(bool)
                      for r in range(world)])
    for op, want in (("band", truth.all(0)), ("bor", truth.any(0)),
                     ("bxor", truth.sum(0) % 2 == 1)):
        t = torch.from_numpy(truth[rank].copy())
        ddpc.all_reduce(t, op=op)
        assert t.dtype == torch.bool and np.array_equal(t.numpy(), want), (op, t)
        checks += 1
    refused = []
    for dtype in ("float32", "float64", "float16"):
        try:
            ddpc.all_reduce(np.ones(3, dtype=dtype), op="bxor")
            refused.append(f"{dtype}: no error")
        except ValueError as e:
            refused.append(str(e))
    # the group goes on after the refusals
    x = np.full(3, 1 << rank, dtype=np.int32)
    ddpc.all_reduce(x, op="bor")
    assert_same(x, np.full(3, (1 << world) - 1, dtype=np.int32), "bor after refusals")
    ddpc.destroy_process_group()
    return {"checks": checks + 1, "refused": refused}


SCENARIOS["bitwise"] = scenario_bitwise


def run_job(scenario: str, world: int, tmp_path, transport: str = "auto",
            timeout: float = 120.0, expect_dead: tuple = (),
            with_torch: bool = False) -> List[Dict]:
    """Runs SCENARIO in `world` processes; returns each rank's JSON result (None for ranks in
    expect_dead, which must die by SIGKILL)."""
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.path.join(ROOT, "python"), "WORLD_SIZE": str(world),
                "RDV": str(tmp_path / f"rdv-{scenario}-{world}-{transport}"),
                "DDPC_CPU_TRANSPORT": transport, "DDPC_TOKEN": "test-token",
                "DDPC_QUIET_TOKEN_WARNING": "1", "OMP_NUM_THREADS": "1",
                "WITH_TORCH": "1" if with_torch else "0"})
    procs = [start([sys.executable, HERE, scenario], dict(env, RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world)]
    outs = finish_all(procs, timeout)
    results = []
    for r, (rc, out, err) in enumerate(outs):
        if r in expect_dead:
            assert rc == -signal.SIGKILL, f"rank {r} should have been killed, rc={rc}\n{err}"
            results.append(None)
            continue
        assert rc == 0, (f"rank {r} of {scenario} (world {world}, {transport}) failed, "
                         f"rc={rc}:\n{err}")
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert line, f"rank {r} printed no result:\n{out}\n{err}"
        results.append(json.loads(line[-1][len("RESULT "):]))
    return results


@pytest.mark.parametrize("world,transport,with_torch",
                         [(2, "shm", True), (2, "tcp", False), (3, "auto", False),
                          (3, "tcp", False)])
def test_all_collectives(world, transport, with_torch, tmp_path):
    results = run_job("all", world, tmp_path, transport, with_torch=with_torch)
    for r in results:
        assert r["transport"] == ("shm" if transport == "auto" else transport)
        assert r["checks"] > 200


@pytest.mark.parametrize("world", [2, 3])
def test_object_collectives(world, tmp_path):
    results = run_job("objects", world, tmp_path)
    for r, res in enumerate(results):
        e = res["errors"]
        if r == 1:
            assert e["unpicklable"].startswith("TypeError: all_gather_object: rank 1's object "
                                               "cannot be pickled"), e
        else:
            assert e["unpicklable"] == ("DistributedError: all_gather_object: rank 1's object "
                                        f"cannot be pickled (that rank's error says why); rank "
                                        f"{r} stops too"), e
        if r == world - 1:
            assert e["length"] == (f"broadcast_object_list: rank 0 sent 3 objects but rank {r}'s "
                                   f"object_list has 2: every rank must pass a list of the same "
                                   f"length"), e
        else:
            assert "length" not in e, e
        if r == 0:
            assert e["gather"].startswith("gather_object: rank 0 (dst) must pass "
                                          "object_gather_list"), e
        else:
            assert "gather" not in e, e
        assert "world_size=" in e["args"][0] and "is not a rank" in e["args"][1]
        assert "must be a list" in e["args"][2]


@pytest.mark.parametrize("world", [2, 3])
def test_torch_distributed_names(world, tmp_path):
    results = run_job("torch_names", world, tmp_path)
    for r, res in enumerate(results):
        e = res["errors"]
        if r == 0:
            assert e["gather"] == ("gather: gather_list[0] holds 3 x float32 but tensor is 4 x "
                                   "float32: every entry must have tensor's dtype and number of "
                                   "elements"), e
        else:
            assert "gather" not in e, e
        if r == world - 1:
            assert e["scatter"] == (f"scatter: rank {r} is not src=0, so it passes no "
                                    f"scatter_list (torch's rule), got {world} entries"), e
            assert "monitored" not in e, e
        else:
            assert "scatter" not in e, e
            assert e["monitored"].startswith(f"monitored_barrier #2: rank(s) {world - 1} did not "
                                             f"reach it within 1 s (rank {r} waited)"), e
            assert 0.9 < res["elapsed"] < 8, res
        if r == 1:
            assert e["scatter_src"] == (f"ValueError: scatter: scatter_list must be a list of "
                                        f"world_size={world} tensors, got list of length 1"), e
            assert e["scatter_object_src"].startswith(
                "ValueError: scatter_object_list: rank 1 (src) must pass "
                "scatter_object_input_list"), e
        else:
            assert e["scatter_src"] == (f"DistributedError: scatter: rank 1 (src) refused its "
                                        f"scatter_list (that rank's error says why); rank {r} "
                                        f"got nothing"), e
            assert e["scatter_object_src"] == (
                f"DistributedError: scatter_object_list: rank 1 (src) refused its "
                f"scatter_object_input_list (that rank's error says why); rank {r} got "
                f"nothing"), e
        if r == 0:
            assert e["lonely"].startswith("DistributedTimeoutError: new_group (the group #2 this "
                                          "rank made): creating the cpu process group"), e
            assert e["lonely"].endswith("(did they call new_group too, or fail before it?)\n"
                                        "(every rank must call new_group, the same number of "
                                        "times and in the same order)"), e
        ng = e["new_group"]
        assert ng[0].startswith("NotImplementedError: new_group(ranks=[0]): a group of some of "
                                f"the {world} ranks is not supported"), ng
        assert ng[1].startswith("TypeError: new_group: ranks must be a list of int ranks"), ng
        assert ng[2].startswith("ValueError: new_group(backend='nccl'): this process is bound "
                                "to no GPU"), ng
        assert ng[3] == ("TypeError: group must be None (the default group) or a group from "
                         "new_group(), got int"), ng
        assert e["destroyed"] == "the process group was destroyed", e


def test_groups_used_in_opposite_orders_time_out_naming_the_other_group(tmp_path):
    results = run_job("groups_in_opposite_order", 2, tmp_path)
    assert results[0]["error"] == (
        "all_reduce #1 timed out after 2s on rank 0: rank 1 never arrived (it is waiting in "
        "collective #1 of the default group: every rank must use the groups in the same order). "
        "If the job is only slow, raise timeout= in new_group; otherwise look at the log of the "
        "rank that did not arrive"), results
    assert results[1]["error"] == (
        "all_reduce #1 timed out after 2s on rank 1: rank 0 never arrived (it is waiting in "
        "collective #1 of the group of new_group call #1: every rank must use the groups in the "
        "same order). If the job is only slow, raise timeout= in init_process_group; otherwise "
        "look at the log of the rank that did not arrive"), results


def test_a_rank_that_caught_a_timeout_is_not_said_to_wait_there_still(tmp_path):
    r0, _ = run_job("caught_timeout_then_busy", 2, tmp_path)
    assert "rank 1 never arrived (it is not in any collective: busy, hung or stopped)" in \
        r0["error"], r0


@pytest.mark.parametrize("world,transport", [(2, "shm"), (3, "tcp")])
def test_bitwise_reductions_of_integers_and_bools(world, transport, tmp_path):
    for res in run_job("bitwise", world, tmp_path, transport, with_torch=True):
        assert res["checks"] == 4 * 3 * 3 * 2 + 4 + 3 + 1, res
        assert res["refused"] == [
            f"all_reduce: op=bxor works on the bits of integer and bool elements, not {dt} "
            f"ones: pass an integer or bool tensor (a float's bits can be viewed as one: "
            f"x.view(torch.int32))" for dt in ("float32", "float64", "float16")], res


def test_work_is_success_after_a_failure_and_avg_of_integers_is_refused(tmp_path):
    for res in run_job("work_status", 2, tmp_path):
        assert res["good"] == [True, True] and res["bad"] == [True, False], res
        assert res["avg"] == [
            f"all_reduce: op=AVG of {dt} elements would round the average down (and may "
            f"overflow): use op=SUM and divide in floating point, or pass a floating-point tensor"
            for dt in ("uint8", "int64")] + [
            "reduce_scatter: op=AVG of int32 elements would round the average down (and may "
            "overflow): use op=SUM and divide in floating point, or pass a floating-point "
            "tensor"], res


def test_strided_bool_and_complex_tensors_and_async_outputs(tmp_path):
    for rank, r in enumerate(run_job("layouts_and_dtypes", 2, tmp_path, with_torch=True)):
        assert r["transposed"] == [[[10.0, 16.0], [12.0, 18.0], [14.0, 20.0]], [1, 3]], r
        assert r["channels_last"] == [24.0, True], r
        assert r["step_sliced"] == [3.0, 0.0] * 4, r
        assert r["gather_into_column"] == [0.0, 0.0, 1.0, 1.0, 0.0], r
        assert r["reduce_scatter_column"] == [[0, 1 + 4 * rank, 0, 0], [0, 3 + 4 * rank, 0, 0]], r
        assert r["broadcast_column"] == [[7.0, 0.0], [8.0, 0.0], [9.0, 0.0]], r
        assert r["expanded"].startswith("the output (shape (4,), strides (0,)) has elements that "
                                        "share memory (an expand() view)"), r
        assert r["bool"] == [[True, True, False], [False, True, False], True], r
        assert r["bool_avg"].startswith("all_reduce: op=AVG of bool elements has no bool "
                                        "result"), r
        assert r["bool_gather"] == [[True, True, False], [False, True, False]], r
        assert r["complex"] == [[[2.0, 4.0], [0.0, 1.0]], [[1.0, 2.0], [0.0, 0.5]]], r
        assert r["complex_broadcast"] == [[1.0, 2.0], [0.0, 1.0]], r
        assert r["complex_max"] == ("all_reduce: op=MAX is not defined for complex numbers: use "
                                    "SUM or AVG"), r
        assert r["complex_conj"].startswith("all_reduce: tensor is a conjugate view"), r
        assert r["scatter_leaf"] == [[float(rank)] * 2, True], r
        assert r["polled"] == [1.0, 2.0, True], r
        assert r["after_barrier"] == [5.0, 6.0], r
        assert r["new_group"] == ("new_group(ranks=[0, 0]): rank 0 is named twice (the ranks "
                                  "are 0..1, each named once)"), r


def test_is_completed_waits_for_the_copy_another_thread_makes(tmp_path):
    for r in run_job("settled_by_another_thread", 2, tmp_path, with_torch=True):
        assert r["early"] == [], r


def test_destroy_finishes_async_collectives_nobody_waited_for(tmp_path):
    for res in run_job("destroy_unwaited", 2, tmp_path):
        assert res["alive"] == 0, res  # (dropped handles of ended collectives hold nothing)
        assert res["x"] == [2.0] * 4 and res["parts"] == [[1.0, 1.0], [2.0, 2.0]], res
        assert res["y"] == [3.0] * 3, res
        assert len(res["warnings"]) == 1, res
        assert res["warnings"][0].startswith(
            "destroy_process_group: collective #305, started with async_op=True and never waited "
            "for, failed while the group was being destroyed: all_reduce #305"), res


def test_a_mismatch_names_the_call_the_user_made(tmp_path):
    r0, r1 = run_job("named_mismatch", 2, tmp_path, with_torch=True)
    # (a rank may learn of it from the other's abort: "rank 0 aborted the group: ...")
    assert r0["first"].startswith("scatter: ") and "rank 0 called broadcast(" in r0["first"], r0
    assert r1["first"].startswith("all_gather_object: ") and \
        "rank 0 called broadcast(" in r1["first"], r1
    assert r0["second"].startswith("wrap_model (its collectives compare the ranks' models and "
                                   "copy rank 0's values: every rank must call it at the same "
                                   "point): "), r0
    assert "rank 0 called all_gather(" in r0["second"], r0
    assert "rank 0 called all_gather(" in r1["second"], r1
    for r in (r0, r1):  # (one may learn it from the other's abort: "rank 0 aborted the group")
        assert r["reduce"].startswith("reduce: ") and (
            "all_reduce #1: rank 0 called all_reduce(count=4, dtype=float64, op=sum) but rank 1 "
            "called all_reduce(count=4, dtype=float64, op=sum, for dst=1).") in r["reduce"], r
        assert r["gather"].startswith("gather: ") and (
            "all_gather #1: rank 0 called all_gather(count=2, dtype=float64) but rank 1 called "
            "all_gather(count=2, dtype=float64, for dst=1).") in r["gather"], r
        assert r["gather_object"] == ("gather_object: the ranks disagree on dst (rank(s) 0 "
                                      "passed dst=0; rank(s) 1 passed dst=1): pass the same dst "
                                      "on every rank"), r


def test_outputs_of_another_kind_than_the_input_are_named(world_one):
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^all_gather: tensor_list\[0\] is a numpy\.ndarray but "
                                        r"tensor is a torch\.Tensor: pass entries of tensor's kind"):
        world_one.all_gather([np.zeros(2, dtype=np.float32)], torch.zeros(2))
    with pytest.raises(ValueError, match=r"^gather: gather_list\[0\] is a numpy\.ndarray but "
                                         r"tensor is a torch\.Tensor"):
        world_one.gather(torch.zeros(2), [np.zeros(2, dtype=np.float32)], dst=0)
    got = [torch.zeros(2)]
    world_one.all_gather(got, torch.nn.Parameter(torch.ones(2)))  # (a Parameter is a Tensor)
    assert got[0].tolist() == [1.0, 1.0]


def test_gather_and_scatter_of_torch_tensors_keep_shapes_and_work_async(world_one):
    torch = pytest.importorskip("torch")
    x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    out = [torch.zeros(3, 2, dtype=torch.bfloat16)]  # (another shape, the same elements)
    world_one.gather(x, out)
    assert torch.equal(out[0], x.reshape(3, 2))
    got = torch.zeros(2, 3, dtype=torch.bfloat16)
    work = world_one.scatter(got, [x.t().contiguous()], async_op=True)
    work.wait()
    assert torch.equal(got, x.t().reshape(2, 3))
    side = world_one.new_group()
    assert side is not world_one.group.WORLD and world_one.get_backend(side) == "cpu"
    world_one.gather(x, out, group=side, async_op=True).wait()
    assert torch.equal(out[0], x.reshape(3, 2))


def test_names_torch_distributed_has_and_ddpc_does_not_say_what_to_use():
    import ddpc
    with pytest.raises(AttributeError, match=r"torch.distributed's all_to_all_single is not part "
                       r"of ddpc \(data parallelism needs no all-to-all"):
        ddpc.all_to_all_single
    with pytest.raises(AttributeError, match=r"send is not part of ddpc \(ddpc has collectives"):
        ddpc.send
    with pytest.raises(AttributeError, match=r"^module 'ddpc' has no attribute 'nonsense'$"):
        ddpc.nonsense
    # `from ddpc import send` says the same (Python's own text would be "cannot import name")
    with pytest.raises(ImportError, match=r"^cannot import name 'send' from 'ddpc': "
                       r"torch.distributed's send is not part of ddpc \(ddpc has collectives"):
        from ddpc import send  # noqa: F401
    with pytest.raises(ImportError, match=r"^cannot import name 'nonsense' from 'ddpc'"):
        from ddpc import nonsense  # noqa: F401
    assert not hasattr(ddpc, "recv") and getattr(ddpc, "recv", None) is None


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_world_size_one(transport, tmp_path):
    (r,) = run_job("single", 1, tmp_path, transport)
    assert r["transport"] == ("tcp" if transport == "tcp" else "shm")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_mismatch_names_both_ranks(transport, tmp_path):
    results = run_job("mismatch", 2, tmp_path, transport)
    expected = [
        ("rank 0 called all_reduce(count=1024, dtype=float32, op=sum)",
         "rank 1 called all_reduce(count=512, dtype=float32, op=sum)"),
        ("rank 0 called all_reduce(count=64, dtype=float32, op=sum)",
         "rank 1 called all_reduce(count=64, dtype=float64, op=sum)"),
        ("rank 0 called all_reduce(count=64, dtype=int32, op=sum)",
         "rank 1 called all_reduce(count=64, dtype=int32, op=max)"),
        ("rank 0 called broadcast(count=8, dtype=float64, src=0)", "rank 1 called barrier()"),
    ]
    for rank, r in enumerate(results):
        assert len(r["messages"]) == len(expected)
        for msg, (a, b) in zip(r["messages"], expected):
            assert a in msg and b in msg, f"rank {rank}: {msg}"
            assert "#2" in msg, msg


def test_timeout_names_missing_rank(tmp_path):
    r0, r1 = run_job("timeout", 2, tmp_path, "auto")
    assert r0["kind"] == "timeout"
    assert "all_reduce #2 timed out after 1.5s on rank 0" in r0["message"], r0["message"]
    assert "rank 1 never arrived" in r0["message"], r0["message"]
    assert "timeout=" in r0["message"]
    # The late rank is told why the group is gone, with the original reason.
    assert r1["kind"] == "DistributedTimeoutError", r1
    assert "timed out" in r1["message"] and "rank 0" in r1["message"], r1["message"]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_killed_rank_raises_peer_error(transport, tmp_path):
    r0, _ = run_job("killed", 2, tmp_path, transport, expect_dead=(1,))
    assert "rank 1" in r0["message"], r0["message"]
    assert r0["elapsed"] < 20, r0  # the timeout is 60 s


# ------------------------------------------------------------------------- in-process groups
# Two ranks as two threads of this process (the C core releases the GIL while it waits), for
# setup and lifetime cases that need no separate processes.


def make_pair(prefix: str, timeout: float = 10.0, **per_rank) -> List:
    """Creates ranks 0 and 1 of a group concurrently; returns [(store, group) or exception]."""
    import threading

    from ddpc import _C
    server = _C.StoreServer("127.0.0.1", 0, "tok")
    out: List = [None, None]

    def make(rank: int) -> None:
        try:
            store = _C.Store("127.0.0.1", server.port, "tok", rank, timeout)
            kw = {k: v[rank] if isinstance(v, tuple) else v for k, v in per_rank.items()}
            out[rank] = (store, _C.Group(store, rank, 2, timeout=timeout, prefix=prefix, **kw))
        except Exception as e:  # noqa: BLE001 - handed to the test to inspect
            out[rank] = e

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    make_pair.server = server  # keep the server alive as long as the groups
    return out


def post_sum(group, x: np.ndarray):
    return group.post(0, 0, x.ctypes.data, x.size, 0, 0, 0, -1, 0, x)


def test_transport_choice_follows_hosts():
    forced = make_pair("forced", transport=1, host_id=("host-a", "host-b"))
    for r in forced:
        assert isinstance(r, ValueError), r
        assert "rank 0 runs on 'host-a' and rank 1 on 'host-b'" in str(r), str(r)
    auto = make_pair("auto", transport=0, host_id=("host-a", "host-b"))
    assert [g.transport for _, g in auto] == ["tcp", "tcp"]
    xs = [np.full(9, r + 1.0, dtype=np.float32) for r in range(2)]
    for w in [post_sum(g, x) for (_, g), x in zip(auto, xs)]:
        w.wait()
    assert all((x == 3).all() for x in xs)
    same = make_pair("same", transport=0, host_id="host-a")
    assert [g.transport for _, g in same] == ["shm", "shm"]
    # The segment is unlinked as soon as both ranks mapped it: nothing to leak.
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("ddpc-same-")]
    for _, g in auto + same:
        g.destroy()


@pytest.mark.parametrize("transport", [1, 2])
def test_abort_and_destroy_fail_peers_fast(transport):
    import ddpc
    (s0, g0), (s1, g1) = make_pair(f"abort{transport}", timeout=30.0, transport=transport)
    x0, x1 = np.ones(10, dtype=np.float32), np.ones(10, dtype=np.float32)
    w = post_sum(g0, x0)
    t0 = time.monotonic()
    g1.abort("the user gave up")
    with pytest.raises(ddpc.PeerError, match="the user gave up"):
        w.wait()
    assert time.monotonic() - t0 < 10  # the timeout is 30 s
    g0.destroy()
    g1.destroy()
    del w  # a work released after its group was destroyed must not touch freed memory
    # Destroying a group while its collective waits for a peer fails that collective at once and
    # tells the peer.
    (s0, g0), (s1, g1) = make_pair(f"destroy{transport}", timeout=30.0, transport=transport)
    w = post_sum(g0, x0)
    t0 = time.monotonic()
    g0.destroy()
    with pytest.raises(ddpc.PeerError, match="destroyed"):
        w.wait()
    with pytest.raises(ddpc.DistributedError):
        post_sum(g1, x1).wait()
    assert time.monotonic() - t0 < 10
    g1.destroy()


if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]]()
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------- argument checks


def test_non_native_byte_order_is_refused(world_one):
    """A big-endian array would be summed as if it were little-endian: wrong numbers, no error."""
    x = np.arange(4, dtype=np.float32).astype(np.dtype(np.float32).newbyteorder())
    with pytest.raises(ValueError, match="byte order"):
        world_one.all_reduce(x)
    out = np.zeros(4, dtype=x.dtype)
    with pytest.raises(ValueError, match="byte order"):
        world_one.all_gather_into_tensor(out, x)


def _unpickling_fails():
    raise ImportError("no module named 'gone'")


class _LoadsBadly:
    def __reduce__(self):
        return (_unpickling_fails, ())


def test_bad_groups_ops_views_outputs_and_objects_are_named(world_one):
    torch = pytest.importorskip("torch")
    x = torch.ones(3)
    with pytest.raises(TypeError, match=r"group must be None \(the default group\) or a group "
                       r"from new_group\(\), got object"):
        world_one.all_reduce(x, group=object())
    world_one.all_reduce(x, group=world_one.distributed._default_group())  # (the default: fine)
    with pytest.raises(ValueError, match=r"op PREMUL_SUM \(from torch.distributed.ReduceOp\) is "
                       r"not supported by ddpc: use SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR or "
                       r"BXOR"):
        world_one.all_reduce(x, op=torch.distributed.ReduceOp.PREMUL_SUM)
    with pytest.raises(ValueError, match=r"all_reduce: op=band works on the bits of integer and "
                       r"bool elements, not float32 ones"):
        world_one.all_reduce(x, op=torch.distributed.ReduceOp.BAND)
    with pytest.raises(ValueError, match=r"op='nand' is not a reduction: use one of \[.*'bxor'"):
        world_one.all_reduce(x, op="nand")
    world_one.all_reduce(x, op=torch.distributed.ReduceOp.MAX)
    neg = torch._neg_view(torch.tensor([1.0, -2.0]))
    with pytest.raises(ValueError, match=r"all_reduce: tensor is a negated view .*pass "
                       r"tensor.resolve_neg\(\) and copy the result back"):
        world_one.all_reduce(neg, op="min")
    fixed = neg.resolve_neg()
    world_one.all_reduce(fixed, op="min")
    assert fixed.tolist() == [-1.0, 2.0]
    with pytest.raises(ValueError, match=r"all_gather: tensor_list\[0\] holds 3 x torch.float64 "
                       r"but tensor is 3 x torch.float32: every entry of tensor_list must have "
                       r"tensor's dtype and number of elements"):
        world_one.all_gather([torch.zeros(3, dtype=torch.float64)], x)
    with pytest.raises(ValueError, match=r"tensor_list\[0\] holds 4 x torch.float32 but tensor "
                       r"is 3 x torch.float32"):
        world_one.all_gather([torch.zeros(4)], x)
    with pytest.raises(ValueError, match=r"tensor_list\[0\] holds 3 x float32 but tensor is 3 "
                       r"x float64"):
        world_one.all_gather([np.zeros(3, np.float32)], np.ones(3))
    out = [torch.zeros(1, 3)]  # (the same number of elements in another shape: torch allows it)
    world_one.all_gather(out, x)
    assert out[0].tolist() == [[1.0, 1.0, 1.0]]
    got = [None]
    with pytest.raises(world_one.DistributedError, match=r"all_gather_object: rank 0 cannot "
                       r"unpickle rank 0's object: ImportError: no module named 'gone' \(is every "
                       r"class it holds importable, at the same version, on this rank\?\)"):
        world_one.all_gather_object(got, _LoadsBadly())
    box = [_LoadsBadly()]
    world_one.broadcast_object_list(box, src=0)  # (src keeps its list: nothing to unpickle)
    frozen = np.arange(3.0)
    frozen.flags.writeable = False
    world_one.broadcast(frozen, src=0)  # src only reads its tensor


def test_sparse_tensor_is_a_type_error(world_one):
    torch = pytest.importorskip("torch")
    s = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,), check_invariants=True)
    with pytest.raises(TypeError, match="dense"):
        world_one.all_reduce(s)


def test_comm_trace_refuses_the_cpu_backend_and_bad_capacities(world_one):
    """The trace reads CUDA events: on the cpu backend it says so, in Python and in the C core."""
    with pytest.raises(ValueError, match="capacity=0"):
        world_one.comm_trace(capacity=0)
    with pytest.raises(ValueError, match="capacity=True"):
        world_one.comm_trace(capacity=True)
    trace = world_one.comm_trace()
    with pytest.raises(ValueError, match="backend is 'cpu'.*backend='nccl'"):
        trace.__enter__()
    with pytest.raises(RuntimeError, match="inside its `with` block"):
        trace.mark("x")
    g = world_one.distributed._default_group()
    for call in (lambda: g.trace_start(4), lambda: g.trace_mark(0), g.trace_stop):
        with pytest.raises(ValueError, match="cpu backend keeps no device "
                           "timeline.*nccl backend"):
            call()
    with pytest.raises(ValueError, match="at least one row"):
        g.trace_start(0)


def test_symmetric_windows_need_the_nccl_backend(world_one):
    """A symmetric window (DDPC_NCCL_WINDOW_MB) is NCCL's: the cpu backend answers with the
    reason and no address, which wrap_model takes as "none"; 0 bytes is a bad argument."""
    g = world_one.distributed._default_group()
    ptr, why = g.window_alloc(1 << 20)
    assert ptr == 0 and "cpu backend has no symmetric windows" in why, (ptr, why)
    with pytest.raises(ValueError, match="0 bytes"):
        g.window_alloc(0)
