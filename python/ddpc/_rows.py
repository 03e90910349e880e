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
backward (after every bucket) gathers each rank's (index, row) pairs and adds them, divided by the
world size, into the averaged gradient: the same sum, reduced with 1/6 of the traffic for GPT-2.

Every rank must route the same lookups in the same order (the same model and control flow, as
every collective requires). Ranks may look up different numbers of tokens: each forward exchanges
its count, and the end of backward pads to the largest. After the first synced step, a route whose
weight got no gradient from another use on some rank is turned off (its bucket would reduce zeros:
the dense all-reduce is then cheaper). DDPC_EMBEDDING_ROWS=0 turns routing off.
"""
from __future__ import annotations

import time
from typing import Any, List, Optional

import torch

from ddpc import _C
from ddpc import distributed as dist

_CODE = {getattr(torch, name): code for name, code in dist._DTYPE_CODES.items()}

__all__ = ["eligible", "Route", "Call", "lookup", "exchange"]


def enabled() -> bool:
    """DDPC_EMBEDDING_ROWS: 1 (default) routes embedding lookups, 0 does not."""
    import os
    v = (os.environ.get("DDPC_EMBEDDING_ROWS") or "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"DDPC_EMBEDDING_ROWS={v!r}: set it to 1 (exchange embedding lookups' "
                         f"gradients as rows, the default) or 0 (reduce them densely)")
    return v == "1"


def eligible(m: torch.nn.Module) -> bool:
    """A plain nn.Embedding whose gradient is the usual dense sum of its output's rows (not
    sparse, no max_norm renormalization, no scaling by frequency, which is per batch)."""
    return (type(m) is torch.nn.Embedding and not m.sparse and m.max_norm is None
            and not m.scale_grad_by_freq and m.weight.dim() == 2)


class Route:
    """One routed embedding: its module, its weight's index among the wrapper's parameters, and
    whether it is routed."""

    __slots__ = ("module", "index", "name", "on", "cap")

    def __init__(self, module: torch.nn.Module, index: int, name: str) -> None:
        self.module = module
        self.index = index
        self.name = name
        self.on = True
        # Indices per rank that a forward's exchange has room for: the most any rank looked up
        # in one call so far (0 before the first synced step ends). The same on every rank.
        self.cap = 0


class Call:
    """One routed lookup: its indices, the exchange started in the forward (every rank's count,
    and on GPUs its indices, sorted), and (once _Rows's backward ran) the gradient of its
    output."""

    __slots__ = ("route", "idx", "n", "cap", "gathered", "work", "host", "event", "sorted_ids",
                 "perm", "grad")

    def __init__(self, route: Route, idx: torch.Tensor) -> None:
        self.route = route
        self.idx = idx
        self.n = idx.numel()
        self.cap = route.cap      # room per rank in this call's exchange of indices
        self.gathered: Optional[torch.Tensor] = None  # world x (1 + cap): count, then indices
        self.work: Any = None
        self.host: Optional[torch.Tensor] = None  # on GPUs: the counts, in pinned memory
        self.event: Any = None                     # ... ready (and the sort done) after this
        self.sorted_ids: Optional[torch.Tensor] = None
        self.perm: Optional[torch.Tensor] = None
        self.grad: Optional[torch.Tensor] = None


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
        ctx.call.grad = grad
        return None, None, None, None, None


def lookup(route: Route, idx: torch.Tensor, anchor: torch.Tensor, group: Any,
           calls: List[Call], side: Optional[Any]) -> torch.Tensor:
    """The routed lookup for one call of route's embedding in a synced forward, where the host
    has time to spare: starts an all-gather of this rank's count of indices and, when they fit in
    route.cap, the indices themselves (padded with -1), and appends the call to `calls`. On GPUs
    the side stream `side` then waits for it, copies the counts to pinned host memory (the end of
    backward reads them there without waiting for anything queued since) and sorts every rank's
    indices, for the accumulation at the end of backward."""
    m = route.module
    call = Call(route, idx)
    if side is None:
        call.cap = 0  # (on the cpu backend the indices go with the rows)
    world, cap, n = group.world_size, call.cap, call.n
    send = torch.full((1 + cap,), -1, dtype=torch.int64, device=idx.device)
    send[0] = n
    if 0 < n <= cap:
        send[1:1 + n].copy_(idx.reshape(-1))
    call.gathered = torch.empty((world, 1 + cap), dtype=torch.int64, device=idx.device)
    call.work = dist.all_gather_into_tensor(call.gathered, send, group=group, async_op=True)
    if side is not None:
        call.host = torch.empty(world, dtype=torch.int64, pin_memory=True)
        call.event = torch.cuda.Event()
        with torch.cuda.stream(side):
            call.work.wait()  # (the side stream waits for the collective)
            call.host.copy_(call.gathered[:, 0], non_blocking=True)
            if cap:
                # A stable sort: equal indices keep rank order, then position order.
                call.sorted_ids, call.perm = torch.sort(call.gathered[:, 1:].reshape(-1),
                                                        stable=True)
            call.event.record(side)
        call.gathered.record_stream(side)
    calls.append(call)
    return _Rows.apply(anchor, idx, m.weight.detach(), m.padding_idx, call)


def _host_counts(call: Call, rank: int) -> List[int]:
    """Every rank's count of indices for this call, on the host. On GPUs, polled (so Ctrl-C
    gets through) until the copy behind the collective is done, raising the collective's
    DistributedError if it failed; on the cpu backend, the collective's wait."""
    if call.event is None:
        call.work._work.wait()
        counts = call.gathered[:, 0].tolist()
    else:
        while not call.event.query():
            if call.work.is_completed():
                call.work._work.wait()  # raises if it failed; the copy is then moments away
            time.sleep(20e-6)
        counts = call.host.tolist()
    if counts[rank] != call.n or any(not 0 <= c < (1 << 40) for c in counts):
        raise dist.DistributedError(
            f"wrap_model: the ranks' counts of indices looked up in embedding "
            f"'{call.route.name}' came back as {counts} (this rank looked up {call.n}): the "
            f"ranks' lookups are out of step (every rank must call the same embeddings in the "
            f"same order in a synced forward), or the process group failed")
    return counts


def exchange(calls: List[Call], params: List[torch.nn.Parameter], group: Any,
             wire_dtype: Optional[torch.dtype], stream: int) -> None:
    """End of a synced backward, after the buckets were reduced and averaged on the current
    stream: adds every rank's lookup gradients, divided by the world size, into the weights'
    averaged gradients, with one all-gather per call. On GPUs, when every rank's indices fit in
    the call's room (the usual case from the second synced step on), they came with the forward's
    all-gather: here only the rows go (in wire_dtype or the weight's dtype), and one kernel adds
    them in the order of the sorted indices. Otherwise the indices go with the rows."""
    world = group.world_size
    for call in calls:
        route = call.route
        p = params[route.index]
        counts = _host_counts(call, group.rank)
        most = max(counts)
        grad, call.grad = call.grad, None
        route.cap = max(route.cap, most)
        if most == 0:
            continue
        wdt = wire_dtype if wire_dtype is not None else p.dtype
        if call.sorted_ids is not None and most <= call.cap and p.grad.is_contiguous():
            _rows_only(call, p, grad, group, wdt, stream)
        else:
            _rows_and_indices(call, p, grad, group, wdt, most)


def _rows_only(call: Call, p: torch.Tensor, grad: Optional[torch.Tensor], group: Any,
               wdt: torch.dtype, stream: int) -> None:
    world, cap, n = group.world_size, call.cap, call.n
    width = p.shape[1]
    send = torch.empty((cap, width), dtype=wdt, device=p.device)
    if n:
        # (rows past n are never read: their indices are -1)
        if grad is None:
            send[:n].zero_()  # this rank's backward did not reach the lookup: it adds nothing
        else:
            send[:n].copy_(grad.reshape(n, width))
    recv = torch.empty((world * cap, width), dtype=wdt, device=p.device)
    dist.all_gather_into_tensor(recv, send, group=group)
    cur = torch.cuda.current_stream(p.device)
    cur.wait_event(call.event)  # the sort on the side stream
    call.sorted_ids.record_stream(cur)
    call.perm.record_stream(cur)
    pad = call.route.module.padding_idx
    _C.device_rows_accumulate(p.grad.data_ptr(), _CODE[p.dtype], p.shape[0], width,
                              call.sorted_ids.data_ptr(), call.perm.data_ptr(), world * cap,
                              recv.data_ptr(), _CODE[wdt], -1 if pad is None else pad,
                              1.0 / world, stream)


def _rows_and_indices(call: Call, p: torch.Tensor, grad: Optional[torch.Tensor], group: Any,
                      wdt: torch.dtype, cap: int) -> None:
    """The first synced step, the cpu backend, or a call whose indices outgrew its room: each
    rank's indices (int64, padded with 0) and rows (padded with zeros) in one all-gather, added
    with index_put_."""
    world, n = group.world_size, call.n
    width = p.shape[1]
    esize = torch.empty((), dtype=wdt).element_size()
    idx_bytes = cap * 8
    row_bytes = cap * width * esize
    stride = idx_bytes + (row_bytes + 7) // 8 * 8
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
    # accumulate=True sums repeated indices in a fixed order (sorted on CUDA), so every rank
    # adds the same values the same way and the weights stay identical across ranks.
    # unsafe=True skips index_put_'s range check, which reads the indices' min and max back
    # to the host: a host sync with the whole backward. The forward's lookups checked them.
    torch._index_put_impl_(p.grad, (every_ids,), values, accumulate=True, unsafe=True)
