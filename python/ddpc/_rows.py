"""Embedding rows: the lookup's part of an embedding's gradient, exchanged as the rows it touched.

An embedding's gradient is complete only at the very end of backward (its lookup is the first op
of the forward), so its all-reduce cannot overlap anything: GPT-2's 50304x768 table is 147 MiB in
float32, 0.5 ms over NVLink and 2 ms through host memory, after the last kernel. Yet the lookup
touches only the rows of the tokens in the batch (8192 of 50304 there). When the table is also
used elsewhere (an output head tied to it), that other use's part is dense but complete at the
start of backward.

So wrap_model routes each plain ``torch.nn.Embedding``'s lookup through ``_Rows``: the same
lookup, on a detached weight, so autograd's edge from the lookup to the weight is gone. The
weight's gradient hook then fires as soon as its other uses are done, and its bucket is reduced
while backward runs. ``_Rows``'s backward keeps the gradient of the lookup's output, and the end of
backward (after every bucket) gathers each rank's indices and rows and adds them, divided by the
world size, into the averaged gradient: the same sum, with 1/6 of the traffic for GPT-2.

How much each rank sends must be known on every rank before that all-gather. The counts go
through the rendezvous store: each forward posts this rank's count (a set that does not wait for
the store's reply), and the end of backward reads the others' (set long before). A collective in
the forward would do it too, but its kernel would spin on the GPU of the rank that is ahead,
beside the forward's matrix products, until the other arrives: 11 of 132 SMs on an H200, which
made those products 45% slower (profiled).

On GPUs each rank sorts its indices in the forward and sends its rows in that order; one kernel
per rank (csrc/kernels.cu, ddpc_device_rows_accumulate), in rank order, adds each run of equal
indices: every rank computes the same bits. One C call queues the packing, the all-gather and
those kernels (csrc/rows.c). On the cpu backend, index_put_ adds them.

Every rank must route the same lookups in the same order (the same model and control flow, as
every collective requires). After the first synced step, a route whose weight got no gradient
from another use on some rank is turned off (its bucket would reduce zeros: the dense all-reduce
is then cheaper). DDPC_EMBEDDING_ROWS (mode()) says where routing is on.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, List, Optional

import torch

from ddpc import _C
from ddpc import distributed as dist

__all__ = ["mode", "eligible", "Route", "RouteHook", "Call", "lookup", "exchange"]

_CODE = {getattr(torch, name): code for name, code in dist._DTYPE_CODES.items()}
# Wrappers are made in the same order on every rank: their number names their store keys.
_WRAPPERS = itertools.count()


def mode() -> str:
    """DDPC_EMBEDDING_ROWS: "1" routes embedding lookups, "0" does not, "auto" (the default)
    routes them where ddpc.parallel._rows_by_default(group) says."""
    return _C.setting("DDPC_EMBEDDING_ROWS") or "auto"  # checked: ValueError naming the values


def new_prefix() -> str:
    """The store key prefix of a new wrapper's counts."""
    return f"ddpc/rows/{next(_WRAPPERS)}"


def eligible(m: torch.nn.Module) -> bool:
    """A plain nn.Embedding whose gradient is the usual dense sum of its output's rows (not
    sparse, no max_norm renormalization, no scaling by frequency, which is per batch)."""
    return (type(m) is torch.nn.Embedding and not m.sparse and m.max_norm is None
            and not m.scale_grad_by_freq and m.weight.dim() == 2)


class Route:
    """One routed embedding: its module, its weight's index among the wrapper's parameters, and
    whether it is routed."""

    __slots__ = ("module", "index", "name", "on")

    def __init__(self, module: torch.nn.Module, index: int, name: str) -> None:
        self.module = module
        self.index = index
        self.name = name
        self.on = True


# Store keys per call number in a ring of this many synced forwards: a lookup's count must be
# read (at an end of backward) before its rank has run this many more synced forwards.
RING = 16


class RouteHook:
    """The forward hook on a routed nn.Embedding: asks the wrapper (held weakly) for the routed
    lookup. A module saved whole (torch.save, pickle) with it keeps an _InertHook instead, which
    leaves the module's output alone: the copy trains as a plain module (wrap it again for
    data parallelism)."""

    __slots__ = ("model", "r")

    def __init__(self, model: Any, r: int) -> None:
        self.model = model  # weakref.ref to the DistributedModel
        self.r = r

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        model = self.model()
        return None if model is None else model._routed_lookup(self.r, args)

    def __reduce__(self) -> Any:
        return (_InertHook, ())


class _InertHook:
    """What a RouteHook becomes in a saved copy of its module: nothing."""

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        return None


class Call:
    """One routed lookup of a synced forward: its indices (sorted, on GPUs, with the order that
    sorts them), its synced forward and its number there, and (once _Rows's backward ran) the
    gradient of its output. `queue` is the wrapper's list of calls to exchange at the next end
    of backward, which holds it while `queued`."""

    __slots__ = ("route", "idx", "n", "step", "number", "sorted_ids", "perm", "grad", "queue",
                 "queued", "dropped")

    def __init__(self, route: Route, idx: torch.Tensor, step: int, number: int,
                 queue: List["Call"]) -> None:
        self.route = route
        self.idx = idx
        self.n = idx.numel()
        self.step = step
        self.number = number
        self.sorted_ids: Optional[torch.Tensor] = None
        self.perm: Optional[torch.Tensor] = None
        self.grad: Optional[torch.Tensor] = None
        self.queue = queue
        self.queued = True
        self.dropped = False


def prune(calls: List[Call], step: int) -> List[Call]:
    """The calls to keep queued when synced forward `step` begins: those of the last RING - 1
    synced forwards (forwards with autograd on whose outputs never reach a backward would
    otherwise pile up). A dropped call's lookup raises if a gradient reaches it later. A queued
    call that holds a gradient here got it from a backward that never reached its end (it
    raised): that gradient is forgotten, as the reducer forgets that step's."""
    keep = []
    for c in calls:
        c.grad = None
        if c.step > step - RING:
            keep.append(c)
        else:
            c.dropped, c.queued = True, False
    return keep


class _Rows(torch.autograd.Function):
    """The embedding lookup of a detached weight; its backward keeps the output's gradient for the
    exchange at the end of backward and gives the weight nothing through autograd. `anchor` is a
    leaf that requires grad, so that the output does (and this backward runs)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor,
                padding_idx: Optional[int], call: Call) -> torch.Tensor:
        ctx.call = call
        return torch.nn.functional.embedding(idx, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        call = ctx.call
        if call.dropped:
            raise RuntimeError(
                f"wrap_model: a gradient reached a lookup of embedding '{call.route.name}' made "
                f"{RING} or more synced forwards ago, whose exchange was dropped: run forwards "
                f"whose outputs you do not backpropagate under torch.no_grad() or no_sync(), or "
                f"set DDPC_EMBEDDING_ROWS=0 on every rank")
        call.grad = grad
        if not call.queued:
            # (a second backward through the same graph: exchanged again at its end)
            call.queue.append(call)
            call.queued = True
        return None, None, None, None, None


def _key(prefix: str, call_number: int, step: int, rank: int) -> str:
    return f"{prefix}/{step % RING}/{call_number}/{rank}"


def lookup(route: Route, idx: torch.Tensor, anchor: torch.Tensor, store: Any, prefix: str,
           rank: int, step: int, calls: List[Call]) -> torch.Tensor:
    """The routed lookup for one call of route's embedding in the synced forward number `step`,
    where the host has time to spare: publishes this rank's count of indices, sorts them (on
    GPUs; queued, the host does not wait), and appends the call to `calls`."""
    m = route.module
    number = sum(1 for c in calls if c.step == step)
    call = Call(route, idx, step, number, calls)
    # (posted: the forward does not wait for the store's reply, which the next store call reads)
    store.set_posted(_key(prefix, call.number, step, rank), f"{step}:{call.n}".encode())
    if idx.is_cuda and call.n:
        # stable: equal indices keep their positions' order, the same on every run. (int64: the
        # exchange reads them so; one launch of ddpc's sort where it fits and idx's device is the
        # current one, which its launch uses; else torch.sort's dozen launches)
        flat = idx.reshape(-1).to(torch.int64).contiguous()
        if call.n <= _C.DEVICE_SORT_IDS_MAX and torch.cuda.current_device() == idx.device.index:
            out = torch.empty(2 * call.n, dtype=torch.int64, device=idx.device)
            call.sorted_ids, call.perm = out[:call.n], out[call.n:]
            _C.device_sort_ids(flat.data_ptr(), call.n, m.weight.shape[0], out.data_ptr(),
                               out.data_ptr() + 8 * call.n,
                               dist._raw_stream(idx.device.index))
        else:
            call.sorted_ids, call.perm = torch.sort(flat, stable=True)
    calls.append(call)
    return _Rows.apply(anchor, idx, m.weight.detach(), m.padding_idx, call)


def _counts(call: Call, store: Any, prefix: str, group: Any) -> List[int]:
    """Every rank's count of indices for this call, from the store: each value is
    "step:count", and one left from RING synced forwards before means its rank has not reached
    this forward yet (it gets until the group's timeout). Ranks found out of step abort the
    group, so that the others' next collectives fail with the same message."""
    counts = []
    deadline = time.monotonic() + group.timeout
    for r in range(group.world_size):
        if r == group.rank:
            counts.append(call.n)
            continue
        counts.append(_count_of(call, r, store, prefix, group, deadline))
    return counts


def _count_of(call: Call, r: int, store: Any, prefix: str, group: Any, deadline: float) -> int:
    key = _key(prefix, call.number, call.step, r)
    where = (f"embedding '{call.route.name}' (lookup {call.number + 1} of synced forward "
             f"{call.step})")
    delay = 20e-6
    while True:
        try:
            raw = store.get(key, max(0.001, deadline - time.monotonic()))
        except _C.DistributedError as e:
            _out_of_step(group, f"wrap_model: rank {group.rank} waited {group.timeout:.0f} s for "
                                f"rank {r}'s count of indices for {where}, which never came "
                                f"({e}): the ranks are out of step{_FIX}")
        try:
            step, count = (int(x) for x in raw.decode().split(":"))
        except ValueError:
            _out_of_step(group, f"wrap_model: store key {key!r} holds {raw!r}, not a count of "
                                f"indices for {where}: something else writes ddpc's keys in "
                                f"this job's store")
        if step == call.step and count >= 0:
            return count
        if step > call.step or count < 0 or time.monotonic() > deadline:
            ahead = (f" ({RING} or more synced forwards without a backward? run forwards whose "
                     f"outputs you do not backpropagate under torch.no_grad() or no_sync())"
                     if step >= call.step + RING else "")
            _out_of_step(group, f"wrap_model: rank {r} reported {count} indices in synced forward "
                                f"{step} for {where}: the ranks are out of step{ahead}{_FIX}")
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


_FIX = (" (with embedding rows, every rank must look up the same embeddings the same number of "
        "times in every synced forward; for a model whose lookups differ between ranks, set "
        "DDPC_EMBEDDING_ROWS=0 on every rank: the tables are then all-reduced densely)")


def _out_of_step(group: Any, msg: str) -> None:
    group.abort(msg)
    raise _C.MismatchError(msg)


def exchange(calls: List[Call], params: List[torch.nn.Parameter], group: Any, store: Any,
             prefix: str, wire_dtype: Optional[torch.dtype], stream: int) -> None:
    """End of a synced backward, after the buckets were reduced and averaged on the current
    stream: adds every rank's lookup gradients, divided by the world size, into the weights'
    averaged gradients, with one all-gather per call of each rank's indices (int64) and rows (in
    wire_dtype or the weight's dtype), padded to the largest count."""
    pending = list(calls)
    del calls[:]
    for call in pending:
        call.queued = False
        p = params[call.route.index]
        cap = max(_counts(call, store, prefix, group))
        grad, call.grad = call.grad, None
        if cap == 0:
            continue
        wdt = wire_dtype if wire_dtype is not None else p.dtype
        if p.is_cuda and p.grad.is_contiguous():
            _exchange_sorted(call, p, grad, group, wdt, cap, stream)
        else:
            _exchange_plain(call, p, grad, group, wdt, cap)


def _layout(cap: int, width: int, wdt: torch.dtype) -> Any:
    """One rank's part of the all-gather: cap int64 indices, then cap rows of wdt, its size
    rounded up to 8 bytes (ddpc_rows_stride, the layout csrc/rows.c uses too)."""
    return cap * 8, cap * width * wdt.itemsize, _C.rows_stride(cap, width, _CODE[wdt])


def _exchange_sorted(call: Call, p: torch.Tensor, grad: Optional[torch.Tensor], group: Any,
                     wdt: torch.dtype, cap: int, stream: int) -> None:
    """GPUs: each rank sends its indices sorted (padded with -1) and its rows in that order; one
    kernel per rank, in rank order, adds each run of equal indices. One C call queues it all
    (packing, the all-gather, the additions: csrc/rows.c); the host does not wait."""
    world, n, width = group.world_size, call.n, p.shape[1]
    buf = torch.empty(world * _layout(cap, width, wdt)[2], dtype=torch.uint8, device=p.device)
    # (None: this rank's backward did not reach the lookup, and it adds nothing)
    src = grad.reshape(n, width).contiguous() if grad is not None and n else None
    ids, perm = (call.sorted_ids, call.perm) if n else (None, None)
    pad = call.route.module.padding_idx
    group.rows_exchange(p.grad.data_ptr(), _CODE[p.dtype], p.shape[0], width,
                        0 if ids is None else ids.data_ptr(),
                        0 if perm is None else perm.data_ptr(), n,
                        0 if src is None else src.data_ptr(),
                        _CODE[wdt if src is None else src.dtype], _CODE[wdt], cap,
                        buf.data_ptr(), buf.numel(), -1 if pad is None else pad, p.device.index,
                        stream, (buf, src, ids, perm))


def _exchange_plain(call: Call, p: torch.Tensor, grad: Optional[torch.Tensor], group: Any,
                    wdt: torch.dtype, cap: int) -> None:
    """The cpu backend: each rank's indices (padded with 0) and rows (padded with zeros) in one
    all-gather, added with index_put_ (accumulate=True sums repeated indices in a fixed order,
    so every rank adds the same values the same way)."""
    world, n, width = group.world_size, call.n, p.shape[1]
    idx_bytes, row_bytes, stride = _layout(cap, width, wdt)
    send = torch.empty(stride, dtype=torch.uint8, device=p.device)
    ids = send[:idx_bytes].view(torch.int64)
    rows = send[idx_bytes:idx_bytes + row_bytes].view(wdt).view(cap, width)
    if grad is None or n == 0:
        # (this rank's backward did not reach the lookup: it adds nothing)
        ids.zero_()
        rows.zero_()
    else:
        flat = call.idx.reshape(-1)
        ids[:n].copy_(flat)
        rows[:n].copy_(grad.reshape(n, width))
        pad = call.route.module.padding_idx
        if pad is not None:
            rows[:n].masked_fill_((flat == pad).unsqueeze(1), 0)
        if n < cap:
            ids[n:].zero_()   # row 0 gets zeros added: no change
            rows[n:].zero_()
    recv = torch.empty(world * stride, dtype=torch.uint8, device=p.device)
    dist.all_gather_into_tensor(recv, send, group=group)
    recv = recv.view(world, stride)
    every_ids = recv[:, :idx_bytes].view(torch.int64).reshape(-1)
    every_rows = recv[:, idx_bytes:idx_bytes + row_bytes].view(wdt).reshape(world * cap, width)
    values = every_rows.to(p.dtype).mul_(1.0 / world)
    # unsafe=True skips index_put_'s range check, which on a GPU would read the indices back to
    # the host (a sync with the whole backward); the forward's lookups checked them.
    torch._index_put_impl_(p.grad, (every_ids,), values, accumulate=True, unsafe=True)
