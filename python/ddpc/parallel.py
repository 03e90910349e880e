"""wrap_model: data-parallel training of a torch.nn.Module on the C gradient reducer.

Gradients live in flat buckets (each ``param.grad`` is a view into one); a hook per parameter tells
the reducer (csrc/reducer.c) when its gradient is complete, and the reducer all-reduces each full
bucket while backward continues. The end of backward zeroes what never arrived (unused
parameters), reduces the rest and waits, so every rank's optimizer sees the same averaged
gradients. A bucket whose gradients were all set to None (zero_grad(set_to_none=True)) is freed
at the next forward and allocated again when its first gradient arrives, so, as in single-process
training, gradient memory does not sit beside the activations. With a reduced-precision wire
(grad_dtype=torch.bfloat16) a freshly computed gradient is not copied into its bucket at all: the
C hook casts it from where autograd left it into its slot of the bucket's wire buffer, and the end
of backward writes the averaged values back into it, so its float32 bucket never needs memory.
See DESIGN.md, "One step of DDP".
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

from ddpc import _C
from ddpc import _rows
from ddpc import distributed as dist

__all__ = ["DistributedModel", "DistributedDataParallel", "wrap_model", "unwrap"]

FIRST_BUCKET_BYTES = 1 << 20
# Parameters and buffers are broadcast in pieces of at most this size (staging memory).
BROADCAST_CHUNK_BYTES = 16 << 20

_CODE_OF_DTYPE = {getattr(torch, name): code for name, code in dist._DTYPE_CODES.items()}
_DTYPE_OF_CODE = {code: dtype for dtype, code in _CODE_OF_DTYPE.items()}
_GRAD_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# How many tensors share a storage (torch's own count; absent from some builds: then released
# buckets are dropped and rebuilt instead of parked).
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _parking_probe() -> Tuple[int, int]:
    """(refs, uses): what sys.getrefcount reports for a tensor held by one list alone, read the
    way _release_bucket reads it, and what torch counts as users of a storage with one tensor on
    it, read the same way (both differ between interpreter and torch versions). (0, 0) when
    parking cannot be made safe with this torch: no use count, or a tensor held only from C++
    (here: saved by autograd for backward) does not show in its Python reference count, so an
    old gradient kept alive that way would not be seen."""
    if _storage_use_count is None:
        return 0, 0
    probe = [torch.ones(2)]
    refs = sys.getrefcount(probe[0])
    st = probe[0].untyped_storage()
    uses = _storage_use_count(st._cdata)
    del st
    leaf = torch.ones(2, requires_grad=True)
    out = leaf * probe[0]  # mul saves probe[0] for the gradient of leaf
    seen = sys.getrefcount(probe[0]) > refs
    del out
    return (refs, uses) if seen else (0, 0)


_LISTED_REFS, _ONE_TENSOR_USES = _parking_probe()


def _shape_str(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _describe(module: torch.nn.Module) -> List[Tuple[str, str]]:
    """(name, "shape dtype[ frozen]") for every parameter, in registration order."""
    out = []
    for name, p in module.named_parameters():
        spec = f"{_shape_str(p.shape)} {str(p.dtype).replace('torch.', '')}"
        out.append((name, spec + ("" if p.requires_grad else " (frozen)")))
    return out


def _first_difference(a: List[Tuple[str, str]], b: List[Tuple[str, str]], ra: int,
                      rb: int) -> str:
    names_a = {n: s for n, s in a}
    names_b = {n: s for n, s in b}
    for k in range(max(len(a), len(b))):
        if k < len(a) and k < len(b) and a[k] == b[k]:
            continue
        if k < len(a) and a[k][0] not in names_b:
            return f"parameter '{a[k][0]}': rank {ra} has shape {a[k][1]} but rank {rb} has no " \
                   f"such parameter"
        if k < len(b) and b[k][0] not in names_a:
            return f"parameter '{b[k][0]}': rank {rb} has shape {b[k][1]} but rank {ra} has no " \
                   f"such parameter"
        name = a[k][0]
        fa, fb = names_a[name].endswith(" (frozen)"), names_b[name].endswith(" (frozen)")
        if fa != fb and names_a[name].replace(" (frozen)", "") == \
                names_b[name].replace(" (frozen)", ""):
            frozen, trained = (ra, rb) if fa else (rb, ra)
            return f"parameter '{name}' is frozen (requires_grad=False) on rank {frozen} but " \
                   f"trained on rank {trained}: freeze the same parameters on every rank, " \
                   f"before wrap_model"
        if names_a[name] != names_b[name]:
            return f"parameter '{name}': rank {ra} has shape {names_a[name]} but rank {rb} has " \
                   f"{names_b[name]}"
        return f"parameter '{name}' is registered at position {k} on rank {ra} but at another " \
               f"position on rank {rb} (parameters must be created in the same order)"
    return f"ranks {ra} and {rb} describe their parameters differently"


def _slot_strides(p: torch.Tensor) -> Tuple[int, ...]:
    """The strides of parameter p's gradient slot: p's own when p is dense and non-overlapping
    (channels_last, a transposed weight), as torch DDP's bucket views: a fused optimizer reads a
    parameter and its gradient as flat memory, element by element, so their layouts must agree.
    Otherwise row-major."""
    order = sorted((st, n) for st, n in zip(p.stride(), p.shape) if n != 1)
    step = 1
    for st, n in order:
        if st != step:
            return _contiguous_strides(p.shape)
        step *= n
    return tuple(p.stride())


def _contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _comm_device(group: Any) -> torch.device:
    """Where the group's collectives read and write: the GPU this rank is bound to (nccl), or the
    host. The binding comes from init_process_group rather than torch's current device, which
    differs when torch was imported after it or the caller switched devices since."""
    if group.backend != "nccl":
        return torch.device("cpu")
    st = dist._state
    if st is not None and group is st.group and st.device_index is not None:
        return torch.device("cuda", st.device_index)
    return torch.device("cuda", torch.cuda.current_device())


def _on(device: torch.device) -> Any:
    """Makes `device` current for the block when it is a GPU: the collectives' device-side waits,
    and the kernels the reducer launches, go to the current device's stream."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _all_gather_bytes(data: bytes, group: Any, device: torch.device) -> List[bytes]:
    """Every rank's byte string, in rank order (two all-gathers: lengths, then padded bytes)."""
    world = group.world_size
    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(lengths, n, group=group)
    lengths_l = lengths.cpu().tolist()
    width = max(lengths_l)
    mine = torch.zeros(width, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    out = torch.empty(world * width, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(out, mine, group=group)
    rows = out.view(world, width).cpu()
    return [bytes(rows[r, :lengths_l[r]].tolist()) for r in range(world)]


def _env_number(name: str) -> str:
    """An environment variable that holds a number, as every rank should compare it ("0.50" and
    ".5" alike; unset or empty is 0; anything else as it is)."""
    v = os.environ.get(name) or "0"
    try:
        return f"{float(v):.12g}"
    except ValueError:
        return v


def _env_word(name: str, default: str) -> str:
    """A setting that takes words (a flag, a choice) as the C core reads it, which every rank
    should compare: a flag as 1 or 0 (true, yes, on...), a choice in lower case, the default when
    unset. A value the setting refuses is compared as it is (the reducer refuses it later, with
    its own message, on the rank that has it)."""
    try:
        v = _C.setting(name)
    except ValueError:
        return os.environ.get(name, "")
    if v is None:
        return default
    return ("1" if v else "0") if isinstance(v, bool) else str(v)


def _verify_same_model(module: torch.nn.Module, group: Any, device: torch.device,
                       local_problem: Optional[Exception],
                       settings: Sequence[Tuple[str, str]] = ()) -> None:
    """Raises on every rank when any rank cannot wrap its model: local_problem on the rank that
    has it, MismatchError when the ranks' parameters differ in names, shapes, dtypes or
    requires_grad (naming the first differing parameter and two ranks), or when the ranks'
    wrap_model settings that the collectives depend on differ (`settings`, (name, value) pairs:
    different bucket sizes would pair collectives of different lengths). One all-gather of a
    digest when all is well, so no rank is left waiting in a later collective."""
    desc = _describe(module)
    # (settings first, after a NUL that no parameter name holds)
    text = ("\n".join(f"{n}={v}" for n, v in settings) + "\0" +
            "\n".join(f"{n}\t{s}" for n, s in desc)).encode()
    record = bytearray(hashlib.sha256(text).digest()) + bytearray([local_problem is not None])
    width = len(record)
    world = group.world_size
    gathered = torch.empty(world * width, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(gathered, torch.frombuffer(record, dtype=torch.uint8).to(device),
                                group=group)
    rows = gathered.view(world, width).cpu()
    failed = [r for r in range(world) if rows[r, -1].item()]
    if local_problem is not None:
        raise local_problem
    if failed:
        raise _C.DistributedError(
            f"wrap_model: rank {failed[0]} could not wrap its model (its own error says why); "
            f"rank {group.rank} stops too")
    bad = [r for r in range(world) if not torch.equal(rows[r, :-1], rows[0, :-1])]
    if not bad:
        return
    texts = [t.decode().split("\0", 1) for t in _all_gather_bytes(text, group, device)]
    if texts[0][0] != texts[bad[0]][0]:
        mine, theirs = texts[0][0].split("\n"), texts[bad[0]][0].split("\n")
        which = next((k for k in range(min(len(mine), len(theirs))) if mine[k] != theirs[k]), 0)
        what = mine[which].split("=", 1)[0]
        fix = (f"set the same {what}" if what.startswith("DDPC_") else
               "register the same communication hook" if what == "register_comm_hook" else
               f"pass the same {what}")
        raise _C.MismatchError(
            f"wrap_model: the ranks wrapped their models with different settings: rank 0 has "
            f"{mine[which]} but rank {bad[0]} has {theirs[which]}. Every rank must {fix} (their "
            f"buckets and collectives must pair up) (seen on rank {group.rank})")
    parsed = [[tuple(line.split("\t", 1)) for line in t[1].split("\n") if line]
              for t in texts]
    what = _first_difference(parsed[0], parsed[bad[0]], 0, bad[0])
    raise _C.MismatchError(
        f"wrap_model: the ranks built different models: {what}. Every rank must construct the "
        f"same model (same parameter names, shapes, dtypes and requires_grad) before wrap_model "
        f"(seen on rank {group.rank})")


def _broadcast_flat(tensors: Sequence[torch.Tensor], group: Any,
                    device: torch.device, src: int = 0) -> List[Any]:
    """Copies rank src's values into `tensors` on every rank, whatever their dtype and device.

    Tensors travel as bytes, packed into chunks of at most BROADCAST_CHUNK_BYTES staged on the
    group's `device` (so host tensors work with nccl, and no full-size copy of the model is ever
    made); a tensor alone in its chunk that already lies contiguous on `device` is broadcast in
    place. The chunks depend on the tensors' sizes only, so every rank posts the same collectives.
    Returns their Work handles, already waited for: on GPU the current stream waits, the host does
    not. Dropping a handle whose collective is still running waits on the host, so a caller that
    must not block keeps them until its next step."""
    chunks: List[List[torch.Tensor]] = []
    used = BROADCAST_CHUNK_BYTES
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not nbytes:
            continue
        # 16-byte slots, so each one can be viewed as its tensor's dtype again
        slot = (nbytes + 15) // 16 * 16
        if used + slot > BROADCAST_CHUNK_BYTES:
            chunks.append([])
            used = 0
        chunks[-1].append(t)
        used += slot
    works, unpack = [], []
    with torch.no_grad():
        for ts in chunks:
            first = ts[0]
            if len(ts) == 1 and first.device == device and first.is_contiguous():
                works.append(dist.broadcast(first.reshape(-1).view(torch.uint8), src=src,
                                            group=group, async_op=True))
                continue
            offsets, total = [], 0
            for t in ts:
                offsets.append(total)
                total += (t.numel() * t.element_size() + 15) // 16 * 16
            total = offsets[-1] + ts[-1].numel() * ts[-1].element_size()
            flat = torch.empty(total, dtype=torch.uint8, device=device)
            slots = [flat[o:o + t.numel() * t.element_size()] for o, t in zip(offsets, ts)]
            if group.rank == src:
                for s, t in zip(slots, ts):
                    s.copy_(t.detach().reshape(-1).view(torch.uint8))
            works.append(dist.broadcast(flat, src=src, group=group, async_op=True))
            if group.rank != src:
                unpack.extend(zip(slots, ts))
        for w in works:
            w.wait()
        for s, t in unpack:
            t.copy_(s.view(t.dtype).view(t.shape))
    return works


class _Sink(torch.autograd.Function):
    """Identity on the forward outputs. Its backward runs in the outer backward pass (never in a
    reentrant checkpoint's inner one), where it queues the end-of-backward reduction."""

    @staticmethod
    def forward(ctx: Any, owner: Any, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.owner = owner
        # An output the loss ignores (a pooler_output) gets None, not zeros: zeros would flow
        # back into the parameters that made only it, and count them as used.
        ctx.set_materialize_grads(False)
        # detach(): the same memory without a copy, and unlike returning the inputs as-is, not a
        # view, so the caller may still modify the outputs in place.
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Any, ...]:
        model = ctx.owner()
        if model is not None:
            model._queue_finalize(rearm=True)
        return (None,) + grads


def _unfrozen_hook(ref: Any, name: str) -> Any:
    def hook(p: torch.Tensor) -> None:
        model = ref()
        if model is not None and model._active:  # (a synced backward of this wrapper)
            raise RuntimeError(
                f"parameter '{name}' was frozen (requires_grad=False) when the model was "
                f"wrapped, so ddpc does not average its gradient, and it now gets one: it "
                f"would train on each rank's own data. Wrap again after unfreezing, on every "
                f"rank: model = ddpc.wrap_model(ddpc.unwrap(model))")
    return hook


class _JoinState:
    """What join() holds while its block runs."""

    def __init__(self, seeds: torch.Tensor, divide_initial: bool, throw: bool) -> None:
        self.seeds = seeds          # [[1, 0], [1, 1]] on the device: a forward's counts
        self.divide_initial = divide_initial
        self.throw = throw
        self.counts: Optional[torch.Tensor] = None  # the last synced forward's, when dividing


class DistributedModel(torch.nn.Module):
    """A module whose gradients are averaged across ranks during backward. Made by wrap_model;
    attribute access falls through to the wrapped module, and state_dict / load_state_dict use
    the wrapped module's own keys."""

    def __init__(self, module: torch.nn.Module, bucket_cap_bytes: int, broadcast_buffers: bool,
                 grad_dtype: Optional[torch.dtype], group: Any,
                 find_unused_parameters: bool = False) -> None:
        super().__init__()
        self._fwd_stream = 0
        self._host_ns = {"forward": 0, "end_of_backward": 0, "steps": 0}  # host_times()
        self.module = module
        self._group = group
        self._world = group.world_size
        self._device = _comm_device(group)
        self._cap_bytes = bucket_cap_bytes
        self._broadcast_buffers = broadcast_buffers
        self._grad_dtype = grad_dtype
        self._comm_hook: Optional[str] = None  # register_comm_hook's, by name
        # torch DDP's flag: a parameter no rank used in a step keeps grad None (one more small
        # all-reduce per step); without it, such a parameter gets a zero gradient
        self._find_unused = find_unused_parameters
        self._none_at_forward: set = set()  # (only with it) gradients None as the step began
        self._warned_unused = False
        self._default_cap = False  # set by wrap_model when bucket_cap_mb was None
        self._join: Optional[_JoinState] = None  # inside join()
        self._require_sync = True
        self._active = False           # a synced step is prepared and not yet finalized
        self._finalize_queued = False
        self._synced_forward = False   # the last forward with autograd on was outside no_sync
        self._rebuild_pending = True   # the first synced step observes the gradient order
        self._layout_stale = False     # _order / _late changed since the buckets were built
        # torch DDP's rule for buffers: a forward broadcasts rank 0's when the forward before it
        # ran with autograd on and outside no_sync (so also the first eval forward after
        # training: BatchNorm statistics agree), and the first forward does
        self._sync_buffers_next = True
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        with _on(self._device):
            _verify_same_model(module, group, self._device, self._check_params(), [
                ("bucket_cap_mb", f"{bucket_cap_bytes / (1 << 20):.12g}"),  # (to the byte)
                ("grad_dtype", str(grad_dtype).replace("torch.", "")),
                ("broadcast_buffers", str(broadcast_buffers)),
                ("find_unused_parameters", str(find_unused_parameters)),
                ("DDPC_TAIL_BUCKET_MB", _env_number("DDPC_TAIL_BUCKET_MB")),
                ("DDPC_NCCL_WINDOW_MB", _env_number("DDPC_NCCL_WINDOW_MB")),
                # (both decide how many collectives the last bucket takes with overlap)
                ("DDPC_CAST_BACK", _env_word("DDPC_CAST_BACK", "end")),
                ("DDPC_COMM_CASTS", _env_word("DDPC_COMM_CASTS", "0")),
                ("DDPC_EMBEDDING_ROWS", _env_word("DDPC_EMBEDDING_ROWS", "auto"))])
            if self._world > 1:
                _broadcast_flat([p.data for p in module.parameters()] + list(module.buffers()),
                                group, self._device)
        self._buffer_works: List[Any] = []  # the last forward's buffer broadcasts
        # The modules, listed once: module.buffers() walks them through named_modules() at
        # each forward, about 90 us for GPT-2's 89 modules, none of which has a buffer. Their
        # buffers are read at each forward, so one registered or replaced later is broadcast
        # too, as torch DDP does.
        self._modules_list = list(module.modules())
        n = len(self._params)
        self._order = list(range(n - 1, -1, -1))
        self._late = [1] * n   # nothing launches early until the order is known
        self._reducer: Any = None
        # Per bucket: its flat tensor, or None while released (all its gradients were None).
        self._buckets: List[Optional[torch.Tensor]] = []
        # Per parameter: its slot in its bucket, None while the bucket is released.
        self._views: List[Optional[torch.Tensor]] = []
        # DDPC_NCCL_WINDOW_MB: one NCCL symmetric window, made at the first build, holds the
        # wires of the buckets before the last (_place_windows); 0: not made or not available.
        self._window_cap = float(_C.setting("DDPC_NCCL_WINDOW_MB") or 0)
        self._window, self._window_bytes = None, 0
        self._window_at: List[Optional[int]] = []
        self._build_buckets()
        self._is_cuda = [p.device.type == "cuda" for p in self._params]
        # The hooks are C callables (one per parameter, sharing this state): a gradient already
        # in its slot during a synced backward is marked ready without running Python; other
        # cases call the Python slow path, which holds the wrapper only weakly (the parameters
        # keep their hooks alive, and the wrapper keeps the parameters).
        self._grad_hooks = _C.GradHooks(self._make_slow_hook(weakref.ref(self)), list(self._names))
        self._grad_hooks.params = self._params
        if self._device.type == "cuda":
            # The hooks copy and mark gradients on the stream autograd runs each one on (the
            # current stream inside the hook), read through this call.
            self._grad_hooks.current_stream = getattr(torch._C, "_cuda_getCurrentRawStream",
                                                      None)
            self._grad_hooks.device = self._device.index
        self._grad_hooks.need_wire = self._make_need_wire(weakref.ref(self))
        self._grad_hooks.need_memory = self._make_need_memory(weakref.ref(self))
        self._sync_hooks()
        handles = [p.register_post_accumulate_grad_hook(_C.GradHook(self._grad_hooks, i))
                   for i, p in enumerate(self._params)]
        handles += self._route_embeddings()
        self._routed = frozenset(r.index for r in self._routes)
        # Parameters frozen at the wrap are not reduced: one unfrozen later would train on each
        # rank's own gradient. A hook on each (it runs only if one gets a gradient) says so.
        reduced = {id(p) for p in self._params}
        seen = set()
        for name, p in module.named_parameters():
            if id(p) not in reduced and id(p) not in seen and p.is_leaf:
                seen.add(id(p))
                p.requires_grad_(True)  # (torch takes hooks only on tensors that require grad)
                try:
                    handles.append(p.register_post_accumulate_grad_hook(
                        _unfrozen_hook(weakref.ref(self), name)))
                finally:
                    p.requires_grad_(False)
        # Once the wrapper is gone, its module trains alone again, without dead hooks.
        weakref.finalize(self, _remove_hooks, handles)
        self._register_load_state_dict_pre_hook(_nested_load_hook, with_module=True)

    # ------------------------------------------------------------------ setup

    def _route_embeddings(self) -> List[Any]:
        """Routes the lookups of every eligible nn.Embedding whose weight is reduced here
        (ddpc/_rows.py says why); returns the forward hooks' handles."""
        self._routes: List[_rows.Route] = []
        self._routing = False     # True only while a synced forward runs the module
        # Routed lookups whose gradients the next end of backward exchanges, in order (the same
        # on every rank): every synced forward's since the last end of backward, and those that
        # got a gradient again (a second backward through the same graph).
        self._calls: List[_rows.Call] = []
        self._rows_step = 0       # synced forwards that routed lookups (the same on every rank)
        self._anchor = torch.zeros((), requires_grad=True)
        # (the counts go through the store of the default group; another group's ranks reduce
        # their embeddings densely)
        mode = _rows.mode()
        # ("1" routes at one rank too: nothing to exchange with, but the same path runs, which
        # is how one GPU tests and measures it)
        if mode == "0" or (mode == "auto" and not _rows_by_default(self._group)) \
                or self._group is not dist._default_group():
            return []
        index = {id(p): i for i, p in enumerate(self._params)}
        handles = []
        for name, m in self.module.named_modules():
            if not _rows.eligible(m) or id(m.weight) not in index:
                continue
            self._routes.append(_rows.Route(m, index[id(m.weight)], name or "(the module)"))
            handles.append(m.register_forward_hook(
                _rows.RouteHook(weakref.ref(self), len(self._routes) - 1)))
        if self._routes:
            self._rows_store = dist.get_store()
            self._rows_prefix = _rows.new_prefix()
        return handles

    def _routed_lookup(self, r: int, args: Any) -> Any:
        """The forward hook of routed embedding r (_rows.RouteHook): the routed lookup during a
        synced forward of this wrapper, else None (the module's own output stands)."""
        if not self._routing or self._join is not None:
            return None  # (inside join(), the ranks that ran out of inputs look nothing up)
        route = self._routes[r]
        if not route.on or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            return None
        if route.module.weight._backward_hooks:
            # A hook on the weight's gradient (weight.register_hook(lambda g: g * mask), to train
            # some rows only) must see the lookups' gradient too: the routed rows would be added
            # after every hook ran. This call stays a plain lookup.
            return None
        return _rows.lookup(route, args[0], self._anchor, self._rows_store, self._rows_prefix,
                            self._group.rank, self._rows_step, self._calls)

    def _check_params(self) -> Optional[Exception]:
        """The first problem that keeps this rank's parameters out of the reducer, or None."""
        reduced = {id(p) for p in self._params}
        for name, m in self.module.named_modules():
            w = getattr(m, "weight", None)
            if getattr(m, "sparse", False) is True and id(w) in reduced:
                return ValueError(f"wrap_model: module '{name or '(the module)'}' "
                                  f"({type(m).__name__}) has sparse=True: its gradient is a "
                                  f"sparse tensor, which ddpc's buckets cannot hold; construct "
                                  f"it with sparse=False")
        nccl = self._group.backend == "nccl"
        for name, p in zip(self._names, self._params):
            if p.device.type == "meta":
                return ValueError(f"wrap_model: parameter '{name}' is on the meta device: it has "
                                  f"a shape but no values yet. Materialize the model first, e.g. "
                                  f"model.to_empty(device=ddpc.device()) and then load or "
                                  f"initialize its weights (load_state_dict, or each module's "
                                  f"reset_parameters()), and wrap it after that")
            if p.dtype not in _GRAD_DTYPES:
                return TypeError(f"wrap_model: parameter '{name}' has dtype {p.dtype}; trainable "
                                 f"parameters must be float32, float64, float16 or bfloat16")
            if p.layout != torch.strided:
                return TypeError(f"wrap_model: parameter '{name}' has layout {p.layout}; only "
                                 f"dense parameters are supported")
            if nccl and p.device != self._device:
                return ValueError(f"wrap_model: parameter '{name}' is on {p.device} but this "
                                  f"rank's process group communicates on {self._device}: move "
                                  f"the model to ddpc.device() before wrapping it")
            if not nccl and p.device.type != "cpu":
                return ValueError(f"wrap_model: parameter '{name}' is on {p.device} but the "
                                  f"process group uses the cpu backend: call "
                                  f"init_process_group(backend='nccl') for GPU models")
        return None

    def _build_buckets(self) -> None:
        """(Re)creates the reducer for self._order / self._late and moves every existing gradient
        into its new slot. Buckets none of whose parameters holds a gradient start released.
        When no parameter holds a gradient (the usual case after zero_grad()), the old buckets go
        first, so that two sets of gradient buffers never exist at once."""
        params = self._params
        old = self.__dict__.get("_shapes")
        if old is not None:  # (a rebuild: the gradients move into new slots of the old sizes)
            for i, p in enumerate(params):
                if tuple(p.shape) != old[i]:
                    raise self._resized_error(i)
        self._layout_stale = False
        if self._reducer is not None and all(p.grad is None for p in params):
            self._reducer.close()
            self._reducer, self._buckets, self._views, self._wires = None, [], [], []
            self._parked = []
            self._sync_hooks()
        devices = [p.device.index if p.device.type == "cuda" else -1 for p in params]
        comm = _CODE_OF_DTYPE[self._grad_dtype] if self._grad_dtype is not None else -1
        reducer = _C.Reducer(self._group, [p.numel() for p in params],
                             [_CODE_OF_DTYPE[p.dtype] for p in params], devices,
                             self._order, self._late, min(FIRST_BUCKET_BYTES, self._cap_bytes),
                             self._cap_bytes, comm)
        specs, wires = [], []
        for b in range(reducer.num_buckets):
            code, dev, count, comm_code = reducer.bucket_info(b)
            device = torch.device("cpu") if dev < 0 else torch.device("cuda", dev)
            specs.append((count, _DTYPE_OF_CODE[code], device))
            # A bucket reduced in another dtype gets its wire buffer when its first gradient of
            # a step arrives, and gives it back at the end of the step (_need_wire,
            # _drop_wires): at the start of backward, where memory peaks, only the buckets
            # already complete hold one.
            wires.append(_DTYPE_OF_CODE[comm_code] if comm_code >= 0 else None)
        offsets, bucket_of = [], []
        self._shapes = [tuple(p.shape) for p in params]
        self._strides = [_slot_strides(p) for p in params]
        # (for the C hooks: None for a row-major slot, else its strides; a gradient that lies
        # otherwise than its slot takes the Python path, which copies it element by element)
        self._hook_strides = [None if st == _contiguous_strides(p.shape) else st
                              for st, p in zip(self._strides, params)]
        members: List[List[int]] = [[] for _ in specs]
        for i in range(len(params)):
            b, off = reducer.param_slot(i)
            offsets.append(off)
            bucket_of.append(b)
            members[b].append(i)
        old = self._reducer
        self._reducer, self._bucket_specs, self._wire_dtypes = reducer, specs, wires
        self._wires = [None] * len(specs)
        self._offsets, self._bucket_of, self._members = offsets, bucket_of, members
        # (each bucket's first parameter, as built: a forward checks that it was not converted)
        self._bucket_kinds = [(params[m[0]], params[m[0]].dtype, params[m[0]].device)
                              for m in members if m]
        self._buckets = [None] * len(specs)
        self._place_windows(reducer, specs, wires)
        self._parked = [False] * len(specs)
        self._bucket_ptrs = [0] * len(specs)
        self._views = [None] * len(params)
        for b, idx in enumerate(members):
            grads = [params[i].grad for i in idx]
            if all(g is None for g in grads):
                reducer.release_bucket(b)
                continue
            self._allocate_bucket(b)
            with torch.no_grad():
                for i, g in zip(idx, grads):
                    if g is not None:
                        self._views[i].copy_(g)
            for i in idx:
                params[i].grad = self._views[i]
        self._sync_hooks()
        if old is not None:
            old.close()

    def _place_windows(self, reducer: Any, specs: List[Any], wires: List[Any]) -> None:
        """With DDPC_NCCL_WINDOW_MB, the wires of the buckets before the last one lie in an NCCL
        symmetric window, in bucket order while they fit: NCCL reduces them with its symmetric
        kernels, which read the peer's memory directly and so take less of the memory
        bandwidth the backward's kernels share. The last bucket (complete only at the end of
        backward) keeps an ordinary wire: alone, NCCL's ring kernels are faster for large
        messages. Those kernels only sum, so the reducer sums these buckets and divides on the
        way back. The window is made once, at the first build (every rank builds the same
        buckets: a collective), holding what that build's buckets want up to the cap."""
        self._window_at = [None] * len(specs)
        if not self._window_cap or self._device.type != "cuda" or self._world < 2 \
                or self._group.backend != "nccl":
            return
        want = {b: -(-specs[b][0] * wires[b].itemsize // 4096) * 4096
                for b in range(len(specs) - 1) if wires[b] is not None}
        if self._window is None:
            cap, size = int(self._window_cap * (1 << 20)), 0
            for need in want.values():  # (the buckets that fit, in order)
                if size + need > cap:
                    break
                size += need
            self._window = 0
            if want and size == 0:
                first = next(iter(want.values()))
                warnings.warn(f"ddpc: DDPC_NCCL_WINDOW_MB={self._window_cap:g} holds none of "
                              f"the buckets (the first needs {first / (1 << 20):.1f} MiB); they "
                              f"are reduced as without it", stacklevel=3)
            if size > 0:
                with _on(self._device):
                    ptr, why = self._group.window_alloc(size)
                if ptr:
                    self._window, self._window_bytes = ptr, size
                else:
                    warnings.warn(f"ddpc: DDPC_NCCL_WINDOW_MB is set, but {why}; the buckets "
                                  f"are reduced as without it", stacklevel=3)
        used = 0
        for b, size in want.items():
            if self._window and used + size <= self._window_bytes:
                self._window_at[b] = self._window + used
                reducer.set_bucket_summed(b, True)
                used += size

    def _allocate_bucket(self, b: int, grad: Optional[torch.Tensor] = None,
                         zero: bool = True) -> None:
        """Gives released bucket b memory: `grad` itself when given (the bucket's only
        parameter's freshly computed gradient, adopted without a copy), else zeros, or
        uninitialized memory when zero is False (every slot will be written or zeroed before it
        is read). A parked bucket gets its storage back, under the views it kept; otherwise the
        views are made. Leaves param.grad alone."""
        count, dtype, device = self._bucket_specs[b]
        if grad is None and self._parked[b]:
            buf = self._buckets[b]
            buf.untyped_storage().resize_(count * buf.element_size())
            if zero:
                buf.zero_()
            self._reducer.set_bucket_memory(b, buf.data_ptr(), buf)
            self._parked[b] = False
            self._bucket_ptrs[b] = buf.data_ptr()
            return
        if grad is not None:
            buf = grad  # (not a view of it: that would hold it from C++, see _release_bucket)
        elif zero:
            buf = torch.zeros(count, dtype=dtype, device=device)
        else:
            buf = torch.empty(count, dtype=dtype, device=device)
        self._reducer.set_bucket_memory(b, buf.data_ptr(), buf)
        self._parked[b] = False
        self._buckets[b] = buf
        self._bucket_ptrs[b] = buf.data_ptr()
        if grad is not None:
            self._views[self._members[b][0]] = grad
            return
        # One dispatch per view (as_strided with precomputed strides). Made once per bucket:
        # a released bucket is parked (its storage shrunk to nothing under the same views)
        # whenever nothing outside the wrapper holds its memory.
        shapes, strides, offsets = self._shapes, self._strides, self._offsets
        for i in self._members[b]:
            self._views[i] = buf.as_strided(shapes[i], strides[i], offsets[i])

    def _need_wire(self, b: int) -> None:
        """Gives bucket b its wire buffer for this step, if it is reduced in another dtype and
        has none. Uninitialized: every slot is written before the collective reads it (the
        padding between slots is never read back)."""
        dtype = self._wire_dtypes[b]
        if dtype is None or self._wires[b] is not None:
            return
        if self._window_at[b] is not None:
            self._reducer.set_bucket_wire(b, self._window_at[b], None)
            self._wires[b] = self._window_at[b]  # (an address: nothing to give back)
            return
        count, _, device = self._bucket_specs[b]
        wire = torch.empty(count, dtype=dtype, device=device)
        self._reducer.set_bucket_wire(b, wire.data_ptr(), wire)
        self._wires[b] = wire

    def _attach_flushed(self) -> None:
        """Points .grad at the slots of the parameters whose gradients the reducer has copied
        there since the last call: it copies a bucket's in one batch when the bucket launches,
        and until then each stays on the gradient autograd made (the C hooks do the same)."""
        for j in self._reducer.take_flushed():
            self._params[j].grad = self._views[j]

    def _drop_wires(self) -> None:
        """After the step's finalize: the wire buffers go back to the allocator. Their last
        readers (the casts back) are queued on the stream that finalize ran on (current here),
        behind its wait for the collectives (with DDPC_COMM_CASTS=1, on the communication
        stream behind each collective, which that stream waits for). A wire made on another
        stream (a gradient hook's side stream) is recorded as used by this one, so the allocator
        does not hand its memory out on its own stream before these casts are done."""
        stream = torch.cuda.current_stream(self._device) if self._device.type == "cuda" else None
        for b, wire in enumerate(self._wires):
            if wire is not None:
                if stream is not None and isinstance(wire, torch.Tensor):
                    wire.record_stream(stream)
                self._reducer.set_bucket_wire(b, 0, None)
                self._wires[b] = None

    def _release_bucket(self, b: int) -> None:
        """Frees bucket b (its parameters' gradients are all None). When the bucket and its
        views are the only holders of its memory, it is parked: its storage shrinks to nothing
        (back to the allocator) and the tensor and views stay, to get memory again at the next
        backward without being made anew. Otherwise (the caller still holds an old gradient, or
        a tensor made from one) the wrapper lets go of them and makes new ones when needed."""
        if self._parked[b] or self._buckets[b] is None:
            return  # released already
        self._reducer.release_bucket(b)
        buf = self._buckets[b]
        members, views = self._members[b], self._views
        # Nobody else may hold a view, or another tensor on the storage. A view's references:
        # our list's (_LISTED_REFS); an adopted gradient, which is the bucket too, also _buckets'
        # and `buf`. Torch's count of the storage's users: the bucket and one per view (the same
        # tensor when adopted), read as _ONE_TENSOR_USES is for one tensor.
        adopted = buf is not None and buf is views[members[0]]
        refs = _LISTED_REFS + (2 if adopted else 0)
        if (buf is not None and _LISTED_REFS and
                all(sys.getrefcount(views[i]) == refs for i in members)):
            st = buf.untyped_storage()
            owners = 1 if adopted else 1 + len(members)
            # (memory from NumPy or DLPack, which an adopted gradient may hold, cannot resize)
            if st.resizable() and _storage_use_count(st._cdata) == owners - 1 + _ONE_TENSOR_USES:
                st.resize_(0)
                self._parked[b] = True
                self._bucket_ptrs[b] = 0
                return
        self._buckets[b] = None
        for i in members:
            views[i] = None

    def _adoptable(self, i: int, g: torch.Tensor) -> bool:
        """Can gradient g become parameter i's released bucket as it is? When i is alone in the
        bucket and g is a plain dense tensor filling its own memory exactly, that saves a second
        copy of a large gradient at the moment memory peaks (a tied embedding's gradient arrives
        at the start of backward, beside all the activations)."""
        b = self._bucket_of[i]
        count, dtype, device = self._bucket_specs[b]
        return (len(self._members[b]) == 1 and g.dtype == dtype and g.device == device and
                not g.requires_grad and g.layout == torch.strided and g.is_contiguous() and
                g.storage_offset() == 0 and
                g.untyped_storage().nbytes() == count * g.element_size())

    def _slot_for(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """Parameter i's view, allocating its released bucket first (adopting g if it can).
        The new bucket is not zeroed: each gradient that arrives is copied into its slot (by the
        C hook, for all but this first one), and the slots of parameters that get none are
        zeroed by the reducer at the end of a synced backward, or by the next forward's
        _attach_grads after a no_sync one. That is one write per gradient, where zeroed slots
        that autograd accumulates into cost a memset, and a read and a write more."""
        b = self._bucket_of[i]
        if self._views[i] is None or self._parked[b]:
            if self._adoptable(i, g):
                self._allocate_bucket(b, g)
            else:
                self._allocate_bucket(b, zero=False)
        return self._views[i]

    def _sync_hooks(self, fast: bool = False) -> None:
        """Tells the C hooks the current reducer, views and stream, and whether a synced
        backward with its end queued is running (only then may they mark gradients ready on
        their own)."""
        h = self.__dict__.get("_grad_hooks")  # (getattr would fall through to the module)
        if h is None:
            return
        h.reducer = self._reducer
        h.views = self._views
        h.strides = self._hook_strides
        h.stream = self._fwd_stream
        h.fast = fast

    @staticmethod
    def _make_need_wire(ref: Any) -> Any:
        def need_wire(i: int) -> None:
            model = ref()
            if model is not None:
                model._need_wire(model._bucket_of[i])
        return need_wire

    @staticmethod
    def _make_need_memory(ref: Any) -> Any:
        def need_memory(i: int, g: torch.Tensor) -> None:
            model = ref()
            if model is not None:
                model._slot_for(i, g)
        return need_memory

    @staticmethod
    def _make_slow_hook(ref: Any) -> Any:
        def hook(p: torch.Tensor, i: int) -> None:
            model = ref()
            if model is None:
                return
            if p.grad is None:
                # Autograd runs the hook with no gradient where only undefined ones reached the
                # parameter (it made only an output the loss ignored): unused, as if not called.
                return
            view = model._views[i]
            if p.grad.layout != torch.strided:
                raise TypeError(f"parameter '{model._names[i]}' got a gradient of layout "
                                f"{p.grad.layout}: ddpc reduces dense gradients only "
                                f"(nn.Embedding and F.embedding need sparse=False)")
            if p.grad is not view:
                # The gradient was created outside its slot (grad was None or replaced after the
                # forward, or create_graph=True accumulated out of place): move it in, giving its
                # bucket memory first when the bucket was released at the forward.
                if view is None or model._parked[model._bucket_of[i]]:
                    view = model._slot_for(i, p.grad)
                if p.grad is not view:
                    with torch.no_grad():
                        view.copy_(p.grad)
                    p.grad = view
            if model._synced_forward:
                if not model._finalize_queued:
                    # The sink on the outputs queues the end of backward before any gradient
                    # of the outputs' graph is ready; this covers a backward that does not pass
                    # through it (a loss made from something other than the outputs). After the
                    # step's end, such a backward is not this wrapper's (ddpc.unwrap(model)(x)
                    # .backward(), a probe on one rank): it stays local, as with torch DDP.
                    model._queue_finalize()
                if not model._finalize_queued:
                    return
                # The stream autograd runs this gradient's hook on (as the C hooks do): the
                # copy above ran there too.
                stream = dist._raw_stream(model._device.index) if model._is_cuda[i] else 0
                model._need_wire(model._bucket_of[i])
                try:
                    model._reducer.mark_ready(i, stream)
                except ValueError as e:
                    raise ValueError(f"parameter '{model._names[i]}': {e}") from None
                model._attach_flushed()
        return hook

    # ------------------------------------------------------------------ one step

    def _attach_grads(self) -> None:
        """Prepares the gradients for a backward (no collective may be in flight). A bucket
        whose gradients are all None is released: the memory comes back when its first gradient
        arrives. Other gradients become their bucket views again (after a user assignment, or
        zero_grad(set_to_none=True) on part of a bucket), zeroed where None."""
        # The usual cases (every gradient None, or every one in its slot) are found in C; the
        # loop below runs when some gradient needs moving or zeroing.
        slow, released, changed = _C.scan_grads(self._params, self._views, self._bucket_of,
                                                len(self._members), self._shapes)
        if changed >= 0:
            raise self._resized_error(changed)
        if not slow:
            if self._find_unused:
                self._none_at_forward = {i for b in released for i in self._members[b]}
            for b in released:
                self._release_bucket(b)
            return
        nones: Dict[int, List[int]] = {}
        for i, p in enumerate(self._params):
            g = p.grad
            view = self._views[i]
            if g is view:  # in its slot, or None in a released bucket
                continue
            if g is None:
                nones.setdefault(self._bucket_of[i], []).append(i)
                continue
            if view is None or self._parked[self._bucket_of[i]]:
                self._allocate_bucket(self._bucket_of[i])
                view = self._views[i]
            with torch.no_grad():
                view.copy_(g)
            p.grad = view
        g = view = None  # no reference of the loop may keep a bucket from being parked
        if self._find_unused:
            self._none_at_forward = {i for idx in nones.values() for i in idx}
        for b, idx in nones.items():
            if len(idx) == len(self._members[b]):
                self._release_bucket(b)
                continue
            with torch.no_grad():
                for i in idx:
                    self._views[i].zero_()
            for i in idx:
                if self._params[i].requires_grad:  # (frozen since the wrap: stays None)
                    self._params[i].grad = self._views[i]

    def _resized_error(self, i: int) -> ValueError:
        return ValueError(
            f"parameter '{self._names[i]}' has shape {tuple(self._params[i].shape)}, but had "
            f"{self._shapes[i]} when the model was wrapped: its size changed after wrap_model "
            f"(resize_token_embeddings, or .data replaced), so its gradient no longer fits its "
            f"place in the buckets. Resize before wrapping, or wrap again after resizing on "
            f"every rank: model = ddpc.wrap_model(ddpc.unwrap(model))")

    def _arm(self) -> None:
        # Reset before prepare(), which raises when the previous backward never finished.
        self._active = False
        self._finalize_queued = False
        self._fwd_stream = self._stream()
        self._sync_hooks()
        self._reducer.prepare()
        self._active = True

    def _queue_finalize(self, rearm: bool = False) -> None:
        """Queues the end-of-backward reduction of an armed step. rearm (from the sink on the
        outputs): another backward through a synced forward's outputs (retain_graph) is
        averaged too; a backward that does not pass through them (a gradient hook's call) is
        not, once the step has ended."""
        if self._finalize_queued:
            return
        if not self._active:
            if not (rearm and self._synced_forward):
                return
            self._arm()
        self._finalize_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        self._grad_hooks.fast = True

    def _stream(self) -> int:
        if self._device.type == "cuda":
            return dist._raw_stream(self._device.index)
        return 0

    def _finalize(self) -> None:
        """End of backward: keeps the gradients of parameters that got none this step but hold an
        accumulated one (no_sync), zeroes the others, reduces everything and waits."""
        t0 = time.perf_counter_ns()
        self._active = False
        self._finalize_queued = False
        self._grad_hooks.fast = False
        # Autograd may run this on any of its threads, whose current device may differ.
        with _on(self._device):
            self._finalize_on_device()
        self._host_ns["end_of_backward"] += time.perf_counter_ns() - t0
        self._host_ns["steps"] += 1

    def _finalize_on_device(self) -> None:
        reducer = self._reducer
        stream = self._stream()
        for b in range(len(self._wires)):
            self._need_wire(b)  # (a bucket none of whose gradients arrived on this rank)
        unready = reducer.unready()
        if self._rebuild_pending:
            self._unready_at_end = set(unready)
        routed = self._routed  # (their gradients come as rows, after this)
        # Unused this step: no gradient arrived, and none was there when the step's forward
        # began (a gradient accumulated under no_sync counts as a use, as in torch DDP).
        unused = [i for i in unready if i not in routed and (
            i in self._none_at_forward if self._find_unused else
            self._params[i].grad is None and self._params[i].requires_grad)]
        for b in sorted({self._bucket_of[i] for i in unready}):
            if self._buckets[b] is None or self._parked[b]:
                # Some gradients of this bucket never arrived on this rank, but every rank
                # reduces every bucket: zeros, for the ranks that did use these parameters.
                # (A bucket whose gradients all went to the wire from where autograd left them
                # needs no memory.)
                self._allocate_bucket(b)
        for i in unready:
            p, view = self._params[i], self._views[i]
            g = p.grad
            if g is None:
                # Unused this step: the reducer zeroes the slot. A parameter frozen since the wrap
                # keeps grad None, as it would without ddpc (optimizers skip it).
                if p.requires_grad:
                    p.grad = view
                continue
            if g is not view:
                with torch.no_grad():
                    view.copy_(g)
                p.grad = view
            reducer.mark_ready(i, stream)
        reducer.finalize(stream)
        self._attach_flushed()
        if self._calls:
            # (in the order of the forward's lookups: the same on every rank)
            _rows.exchange(self._calls, self._params, self._group, self._rows_store,
                           self._rows_prefix, self._grad_dtype, stream)
        dense_unready = [i for i in unready if i not in routed]
        if dense_unready:
            self._check_not_replaced(dense_unready)
        if self._find_unused:
            self._drop_unused_everywhere(unused)
        elif unused and not self._warned_unused and self._join is None:
            self._warned_unused = True
            names = ", ".join(f"'{self._names[i]}'" for i in unused[:3])
            more = ", ..." if len(unused) > 3 else ""
            warnings.warn(
                f"wrap_model: {len(unused)} parameter(s) ({names}{more}) "
                f"got no gradient in this backward on rank {self._group.rank}. This rank gave "
                f"zeros for them; one that no rank used ends with a zero gradient, which an "
                f"optimizer with momentum or weight decay still applies. Pass "
                f"find_unused_parameters=True (as torch DDP needs when parameters go unused) "
                f"to leave the gradient of a parameter that no rank used as None; freeze "
                f"parameters before wrap_model, not after", RuntimeWarning, stacklevel=2)
        self._drop_wires()
        j = self._join
        if j is not None and j.counts is not None:
            # join(divide_by_initial_world_size=False): the average over the ranks that ran
            # this step, not over all of them (the others gave zeros); on the device, no wait
            counts, j.counts = j.counts, None
            grads = [p.grad for p in self._params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self._world / counts[0].to(torch.float64))
        if self._rebuild_pending:
            self._rebuild_pending = False
            self._plan_layout_from_observed_order()

    def _check_not_replaced(self, unready: List[int]) -> None:
        """A parameter that got no gradient may have been replaced in the module since the wrap
        (module.weight = nn.Parameter(...)): the new one's gradient would never be averaged."""
        current = {id(p) for p in self.module.parameters()}
        gone = [self._names[i] for i in unready if id(self._params[i]) not in current]
        if gone:
            raise RuntimeError(
                f"parameter(s) {', '.join(repr(n) for n in gone[:3])} of the wrapped module were "
                f"replaced after wrap_model (e.g. module.weight = nn.Parameter(...)): ddpc still "
                f"reduces the old ones, so the new ones' gradients are not averaged. Change "
                f"parameters in place (with torch.no_grad(): p.copy_(...)), or wrap again on "
                f"every rank: model = ddpc.wrap_model(ddpc.unwrap(model))")

    def _drop_unused_everywhere(self, unused: List[int]) -> None:
        """find_unused_parameters=True: the parameters that no rank used this step get grad None
        again (their zeros were reduced with the rest), as torch DDP leaves them, so optimizers
        skip them. Every rank takes part in the flags' all-reduce; only a rank with unused
        parameters of its own reads the result (on GPU, a wait for the step's collectives)."""
        flags = torch.zeros(len(self._params), dtype=torch.uint8, device=self._device)
        if unused:
            flags[torch.tensor(unused, dtype=torch.int64, device=self._device)] = 1
        if self._world > 1:
            dist.all_reduce(flags, op="min", group=self._group)
        if not unused:
            return  # (an unused-everywhere parameter is unused here too)
        everywhere = flags.nonzero().flatten().tolist()
        for i in everywhere:
            self._params[i].grad = None

    def _plan_layout_from_observed_order(self) -> None:
        """After the first synced step: buckets in rank 0's gradient-ready order; parameters
        whose gradient arrived more than once on any rank go in buckets launched at the end."""
        order, counts = self._reducer.observed_order()
        n = len(self._params)
        # Per route: did its weight's gradient arrive during backward on this rank (from a use
        # other than the routed lookups)?
        dense = [0 if r.index in self._unready_at_end else 1 for r in self._routes]
        if self._world > 1:
            k = 2 * n + len(dense)
            mine = torch.tensor(order + counts + dense, dtype=torch.int32, device=self._device)
            every = torch.empty(self._world * k, dtype=torch.int32, device=self._device)
            dist.all_gather_into_tensor(every, mine, group=self._group)
            every = every.view(self._world, k).cpu()
            order = every[0, :n].tolist()
            counts = every[:, n:2 * n].max(dim=0).values.tolist()
            dense = every[:, 2 * n:].min(dim=0).values.tolist()
        seen = [i for i in order if i >= 0]
        seen_set = set(seen)
        self._order = seen + [i for i in range(n - 1, -1, -1) if i not in seen_set]
        self._late = [1 if c > 1 else 0 for c in counts]
        for r, d in zip(self._routes, dense):
            # A weight that got no gradient from another use on some rank: its bucket would
            # all-reduce zeros (or what no_sync accumulated) and then the rows; the dense
            # all-reduce alone is cheaper.
            r.on = d == 1
        # Applied by the next forward, like torch DDP: this step's averaged gradients still sit in
        # the old buckets for optimizer.step(), and after zero_grad() nothing needs carrying over.
        self._layout_stale = True

    def _current_buffers(self) -> List[torch.Tensor]:
        """The buffers of the modules wrap_model found, each once, in module.buffers()'s order
        (the same on every rank)."""
        out: List[torch.Tensor] = []
        seen = set()
        for m in self._modules_list:
            if m._buffers:
                for b in m._buffers.values():
                    if b is not None and id(b) not in seen:
                        seen.add(id(b))
                        out.append(b)
        return out

    def _sync_buffers(self) -> None:
        """Broadcasts rank 0's buffers when torch DDP would at this forward (see
        _sync_buffers_next)."""
        if not (self._sync_buffers_next and self._broadcast_buffers and self._world > 1):
            return
        buffers = self._current_buffers()
        if buffers:
            # The previous step's handles go only now, when their collectives are long done:
            # dropping a running one would make the host wait for the GPU.
            try:
                with _on(self._device):
                    self._buffer_works = _broadcast_flat(buffers, self._group, self._device)
            except (_C.MismatchError, _C.DistributedTimeoutError) as e:
                raise type(e)(
                    f"{e}\n(that broadcast is this wrapped model's forward sending rank 0's "
                    f"buffers, as torch DDP does before the first forward after training: every "
                    f"rank must run that forward. To evaluate on one rank only, call "
                    f"ddpc.unwrap(model) there)") from None

    def _attach_sink(self, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            # The usual output (a loss, logits): no pytree walk, which costs more host time
            # than the sink itself at the start of a forward-bound step.
            if not output.requires_grad:
                return output
            return _Sink.apply(weakref.ref(self), output)[0]
        leaves, spec = pytree.tree_flatten(output)
        idx = [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not idx:
            return output
        outs = _Sink.apply(weakref.ref(self), *[leaves[k] for k in idx])
        for k, t in zip(idx, outs):
            leaves[k] = t
        return pytree.tree_unflatten(leaves, spec)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module. Broadcasts buffers from rank 0 (broadcast_buffers=True) when
        the forward before this one ran with autograd on outside no_sync(), as torch DDP: also
        an evaluation forward after training, so every rank must run it. When autograd is on,
        points every param.grad at its bucket (or frees buckets whose gradients are all None)
        and, outside no_sync(), arms the reducer so the next backward averages gradients across
        ranks. Under torch.compile(model) only the module's own forward is traced: the
        wrapper's work around it runs as it does without compile."""
        grad_on = self._before_forward()
        try:
            output = self.module(*inputs, **kwargs)
        finally:
            self._routing = False
        return self._after_forward(output, grad_on)

    @torch.compiler.disable
    def _before_forward(self) -> bool:
        """forward's work before the module's forward; returns whether autograd is on."""
        t0 = time.perf_counter_ns()
        grad_on = torch.is_grad_enabled()
        if grad_on:
            if self._group.destroyed:
                raise RuntimeError(
                    "this model's process group was destroyed (destroy_process_group): to train "
                    "it data-parallel again, call ddpc.init_process_group() and wrap it anew "
                    "(ddpc.wrap_model(ddpc.unwrap(model))); to run it alone, use "
                    "ddpc.unwrap(model)")
            for p, dtype, device in self._bucket_kinds:
                if p.dtype is not dtype or p.device != device:
                    # The module inside was converted or moved (ddpc.unwrap(model).half()), not
                    # the wrapper: rebuild as the wrapper's own .half() / .to() does.
                    self._rebuild_after_conversion()
                    break
            if self._layout_stale:
                self._build_buckets()
            if self._join is not None:
                self._join_notify()
            self._sync_buffers()
            self._synced_forward = self._require_sync
            self._grad_hooks.fast = False
            if self._require_sync:
                # prepare() first: it waits for the collectives of an unfinished step, which may
                # still use memory that _attach_grads releases.
                self._arm()
                self._attach_grads()
            else:
                if self._active:
                    # A synced step is unfinished (its backward raised, or never ran): its
                    # collectives may still write into the buckets that _attach_grads zeroes or
                    # frees. prepare() waits for them, and raises when that step's gradients
                    # were lost, as the next synced forward would.
                    self._active = False
                    self._reducer.prepare()
                self._attach_grads()
        elif self._join is None and not self._group.destroyed:
            # (inside join(), only forwards with autograd on communicate; after
            # destroy_process_group, an evaluation runs on its own)
            self._sync_buffers()
        self._sync_buffers_next = grad_on and self._require_sync
        if grad_on and self._require_sync and self._routes:
            self._rows_step += 1
            self._calls[:] = _rows.prune(self._calls, self._rows_step)
            self._routing = True
        self._host_ns["forward"] += time.perf_counter_ns() - t0
        return grad_on

    @torch.compiler.disable
    def _after_forward(self, output: Any, grad_on: bool) -> Any:
        t2 = time.perf_counter_ns()
        if grad_on and self._require_sync:
            output = self._attach_sink(output)
        self._host_ns["forward"] += time.perf_counter_ns() - t2
        return output

    def host_times(self, reset: bool = True) -> Dict[str, float]:
        """Where this wrapper's own host time went since the last reset (or since it was made),
        in milliseconds, for finding what slows a step down: "forward" (the work around the
        module's forward), "hooks" (the per-parameter gradient hooks, all of it) with "hook_calls"
        and, inside it, "wire" (giving buckets their bf16/fp16 wire buffers), "memory" (giving
        released buckets memory again), "attach" (pointing .grad at the slots gradients were
        copied into), "python" (the Python path: no_sync, and what the C path leaves to it),
        "mark" (queueing each gradient's copy or cast) and "launch" (queueing each bucket's
        collective; also counted in "hooks" or "end_of_backward", where it ran), and
        "end_of_backward" (the reduction queued at the end of backward, its launches included),
        with "steps" (synced backward passes finished). Totals; divide by "steps" for a step's
        share."""
        h = self._grad_hooks
        mark, launch = (self._reducer.host_times(reset) if self._reducer is not None
                        else (0.0, 0.0))
        out = {"steps": float(self._host_ns["steps"]),
               "forward": self._host_ns["forward"] * 1e-6, "hooks": h.hook_ns * 1e-6,
               "hook_calls": float(h.calls), "wire": h.wire_ns * 1e-6,
               "memory": h.memory_ns * 1e-6, "attach": h.attach_ns * 1e-6,
               "python": h.slow_ns * 1e-6, "mark": mark,
               "launch": launch, "end_of_backward": self._host_ns["end_of_backward"] * 1e-6}
        if reset:
            h.hook_ns = h.wire_ns = h.memory_ns = h.attach_ns = h.slow_ns = h.calls = 0
            self._host_ns = dict.fromkeys(self._host_ns, 0)
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes of forwards run inside this context add to the
        local gradients without communicating; the first synced backward after it averages the
        accumulated sums."""
        old = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = old


    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """torch DDP's register_comm_hook, for torch's own all-reduce hooks (from
        torch.distributed.algorithms.ddp_comm_hooks.default_hooks): allreduce_hook changes
        nothing, fp16_compress_hook and bf16_compress_hook (or fp16_compress_wrapper /
        bf16_compress_wrapper of allreduce_hook) reduce the gradients in that dtype, as
        wrap_model(grad_dtype=...) does. Other hooks raise NotImplementedError (ddpc calls no
        Python hook). state must be None or this model's process group. As in torch, every rank
        registers the same hook, once, before a step or between steps (not between a forward and
        its backward); the ranks compare their hooks (MismatchError when they differ)."""
        dtype, name = _comm_hook_dtype(hook)
        if state is not None and state is not self._group:
            raise ValueError(f"register_comm_hook: state must be None or this model's process "
                             f"group (the hook's all-reduce goes over that group), got "
                             f"{type(state).__name__}")
        if self._comm_hook is not None:
            raise RuntimeError(f"register_comm_hook can only be called once ({self._comm_hook} "
                               f"is registered already), as with torch DDP")
        if self._active:
            raise RuntimeError("register_comm_hook: a forward ran and its backward has not ended: "
                               "register the hook before the first forward, or between steps")
        if self._grad_dtype is not None and dtype != self._grad_dtype:
            raise ValueError(f"register_comm_hook: {name} reduces gradients in "
                             f"{str(dtype or 'their own dtype').replace('torch.', '')}, but the "
                             f"model was wrapped with grad_dtype="
                             f"{str(self._grad_dtype).replace('torch.', '')}: pass one of them")
        with _on(self._device):
            # (a collective: every rank must register, and register the same hook)
            _verify_same_model(self.module, self._group, self._device, None,
                               [("register_comm_hook", name)])
            self._comm_hook = name
            if dtype is not None and dtype != self._grad_dtype:
                self._grad_dtype = dtype
                if self._default_cap:
                    # (the default for a 16-bit grad_dtype, as wrap_model would have chosen)
                    self._cap_bytes = int(default_bucket_cap_mb(self._group, dtype) * (1 << 20))
                self._build_buckets()


    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Iterator[None]:
        """torch DDP's join(), for uneven inputs: ranks whose data runs out before the others'
        leave the block and then stand in for the steps the others still take (their buffer
        broadcasts, and their gradient all-reduces with zeros), so nobody waits for collectives
        that never come. When every rank has left, all of them take the parameters and buffers
        of the last rank to leave (the highest such rank), as torch does.

            with model.join():
                for x, y in my_loader:          # ranks may have different numbers of batches
                    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()

        Every rank enters the block; inside it, each forward with autograd on counts as one
        step (one forward per backward, as in torch), with one small all-reduce to tell the
        ranks that left. divide_by_initial_world_size: gradients are averaged over all ranks
        (True, torch's default: the ranks that left give zeros) or over those still taking
        steps (False). throw_on_early_termination: as soon as one rank runs out, every rank
        raises RuntimeError instead (the host waits for that count at each forward). enable=False
        runs the block as it is. Inside the block embedding lookups are not routed
        (DDPC_EMBEDDING_ROWS): their gradients are all-reduced whole."""
        for name, value in (("divide_by_initial_world_size", divide_by_initial_world_size),
                            ("enable", enable),
                            ("throw_on_early_termination", throw_on_early_termination)):
            if not isinstance(value, bool):
                raise TypeError(f"join: {name} must be a bool, got {type(value).__name__}")
        if self._join is not None:
            raise RuntimeError("join: this model is inside join() already (join blocks do not "
                               "nest)")
        if not enable or self._world == 1:
            yield
            return
        with _on(self._device):
            seeds = torch.tensor([[1, 0], [1, 1]], dtype=torch.int32).to(self._device)
        self._join = _JoinState(seeds, divide_by_initial_world_size, throw_on_early_termination)
        try:
            yield
        except BaseException:
            self._join = None
            raise
        try:
            self._join_shadow()
        finally:
            self._join = None

    def _join_notify(self) -> None:
        """Inside join(), at each forward with autograd on: counts this rank as taking a step
        (and whether its backward is synced), in one all-reduce that _join_shadow's pairs with
        on the ranks that left. The host waits for it only with throw_on_early_termination."""
        j = self._join
        with _on(self._device):
            counts = j.seeds[int(self._require_sync)].clone()
            dist.all_reduce(counts, group=self._group)
            if self._require_sync and not j.divide_initial:
                j.counts = counts  # (_finalize_on_device divides by counts[0] / world)
            if j.throw:
                running = int(counts[0].item())
                if running < self._world:
                    raise RuntimeError(
                        f"join: {self._world - running} of {self._world} ranks ran out of "
                        f"inputs, and throw_on_early_termination=True: every rank stops (seen "
                        f"on rank {self._group.rank})")

    def _join_shadow(self) -> None:
        """This rank left join()'s block: until every rank has, stands in for each step the
        others take (see join), then takes the last rank's parameters and buffers."""
        j, g, dev = self._join, self._group, self._device
        first = last = True
        with _on(dev):
            while True:
                counts = torch.zeros(2, dtype=torch.int32, device=dev)
                dist.all_reduce(counts, group=g)
                running, synced = counts.tolist()
                if running == 0:
                    last = first
                    break
                if j.throw:
                    raise RuntimeError(
                        f"join: rank {g.rank} ran out of inputs while {running} of {g.world_size} "
                        f"ranks had more, and throw_on_early_termination=True: every rank stops")
                first = False
                self._shadow_step(synced > 0)
            src = torch.tensor([g.rank if last else -1], dtype=torch.int32, device=dev)
            dist.all_reduce(src, op=dist.ReduceOp.MAX, group=g)
            _broadcast_flat([p.data for p in self.module.parameters()] +
                            list(self.module.buffers()), g, dev, src=int(src.item()))

    def _shadow_step(self, synced: bool) -> None:
        """One step of the ranks still inside join(), on a rank that left it: what their forward
        and backward communicate, this rank's gradients being zeros."""
        if self._layout_stale:
            self._build_buckets()
        self._sync_buffers()
        self._sync_buffers_next = synced
        if not synced:
            return
        if self._routes:
            # (the forward's count of routed steps, which keys their exchanges, stays the same)
            self._rows_step += 1
            self._calls[:] = _rows.prune(self._calls, self._rows_step)
        for p in self._params:
            p.grad = None  # this rank's part: zeros (an unused parameter's)
        self._synced_forward = True
        self._grad_hooks.fast = False
        self._arm()
        self._attach_grads()
        self._finalize()

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag: False makes the next backward accumulate locally, as inside
        no_sync() (which sets it for its block)."""
        return self._require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"require_backward_grad_sync must be a bool, got "
                            f"{type(value).__name__}")
        self._require_sync = value

    # ------------------------------------------------------------------ module protocol

    def __deepcopy__(self, memo: Dict[int, Any]) -> Any:
        raise TypeError(
            "copy.deepcopy of a ddpc-wrapped model: copy ddpc.unwrap(model) instead (an EMA or "
            "evaluation copy, e.g. torch.optim.swa_utils.AveragedModel(ddpc.unwrap(model)), "
            "needs no communication); to train the copy data-parallel, wrap_model it on every "
            "rank")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a ddpc-wrapped model cannot be pickled (it holds a process group and gradient "
            "buckets): save ddpc.unwrap(model).state_dict() (or pickle / torch.save "
            "ddpc.unwrap(model)); model.state_dict() has the same keys")

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules")
            if name == "module" or modules is None or "module" not in modules:
                raise
            return getattr(modules["module"], name)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's state_dict, with its own keys (no "module." prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loads into the wrapped module (keys as its own state_dict gives them). A checkpoint
        saved from torch DDP (every key starting with "module.") loads too: the prefix is
        dropped."""
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace the parameters the "
                             "reducer tracks: load with assign=False, or load into the module "
                             "before wrap_model")
        if isinstance(state_dict, Mapping) and state_dict and \
                all(isinstance(k, str) and k.startswith("module.") for k in state_dict) and \
                not any(k.startswith("module.") for k in self.module.state_dict()):
            stripped: Any = OrderedDict((k[len("module."):], v) for k, v in state_dict.items())
            meta = getattr(state_dict, "_metadata", None)
            if meta is not None:
                stripped._metadata = OrderedDict(
                    (k[len("module."):] if k.startswith("module.") else
                     "" if k == "module" else k, v) for k, v in meta.items())
            state_dict = stripped
        return self.module.load_state_dict(state_dict, strict=strict)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        before = [(p.dtype, p.device) for p in self._params]
        result = super()._apply(fn, recurse)
        after = [(p.dtype, p.device) for p in self._params]
        if before != after or self._slots_moved():
            # .to()/.half() moved parameters or their gradients out of the buckets, or
            # .to(memory_format=...) / share_memory() gave the gradients (bucket views, changed
            # in place through .data) other memory than the reducer's: start over.
            self._rebuild_after_conversion()
        return result

    def _rebuild_after_conversion(self) -> None:
        problem = self._check_params()
        if problem is not None:
            raise problem
        self._build_buckets()
        self._is_cuda = [p.device.type == "cuda" for p in self._params]

    def _slots_moved(self) -> bool:
        """Does some gradient, or some bucket view, no longer lie where the reducer reads?"""
        for i, (p, v) in enumerate(zip(self._params, self._views)):
            g = p.grad
            if v is None:
                if g is not None:
                    return True
                continue
            if g is not None and g.data_ptr() != v.data_ptr():
                return True
            b = self._bucket_of[i]
            if self._parked[b]:
                if g is not None:
                    return True
                continue
            # (an empty tensor reports data_ptr() 0 wherever it lies)
            if v.numel() and \
                    v.data_ptr() != self._bucket_ptrs[b] + self._offsets[i] * v.element_size():
                return True
        return False


def _remove_hooks(handles: List[Any]) -> None:
    for h in handles:
        h.remove()


def _nested_load_hook(module: DistributedModel, state_dict: Dict[str, Any], prefix: str,
                      *args: Any) -> None:
    """When a DistributedModel is a child of another module, its state_dict() entries carry no
    "module." part; put it back so the parent's load_state_dict finds them."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


def _comm_hook_dtype(hook: Any) -> Tuple[Optional[torch.dtype], str]:
    """The grad_dtype that one of torch DDP's communication hooks amounts to, and the hook's name.
    ddpc's reducer communicates in C and calls no Python hook, so only torch's own all-reduce
    hooks have an equivalent; any other raises NotImplementedError saying what to use."""
    if not callable(hook):
        raise TypeError(f"register_comm_hook: hook must be a function (torch's "
                        f"default_hooks.fp16_compress_hook, for example), got "
                        f"{type(hook).__name__}")
    name = getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or repr(hook)
    try:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    except ImportError:  # (a torch built without distributed support has none of them)
        dh = None
    if dh is not None:
        known = {dh.allreduce_hook: None, dh.fp16_compress_hook: torch.float16,
                 dh.bf16_compress_hook: torch.bfloat16}
        for fn, dtype in known.items():
            if hook is fn:
                return dtype, fn.__name__
        # fp16_compress_wrapper(allreduce_hook) / bf16_compress_wrapper(allreduce_hook): the
        # wrapper's closure holds the hook it wraps.
        for wrapper, dtype in (("fp16_compress_wrapper", torch.float16),
                               ("bf16_compress_wrapper", torch.bfloat16)):
            if getattr(hook, "__module__", None) == dh.__name__ and \
                    str(name).startswith(wrapper + ".<locals>."):
                inner = [c.cell_contents for c in (getattr(hook, "__closure__", None) or ())]
                if inner == [dh.allreduce_hook]:
                    return dtype, f"{wrapper}(allreduce_hook)"
                name = f"{wrapper}({', '.join(getattr(f, '__name__', repr(f)) for f in inner)})"
    raise NotImplementedError(
        f"register_comm_hook: {name} has no ddpc equivalent. ddpc's reducer runs the gradient "
        f"communication in C and calls no Python hook; it takes torch's allreduce_hook (the "
        f"default), fp16_compress_hook and bf16_compress_hook (also as fp16_compress_wrapper or "
        f"bf16_compress_wrapper of allreduce_hook), which are wrap_model(grad_dtype=None, "
        f"torch.float16, torch.bfloat16). For another hook (PowerSGD, your own), wrap the model "
        f"with torch's DistributedDataParallel instead")


def _check_ddp_keywords(device_ids: Any, output_device: Any, dim: int,
                        flags: Dict[str, Any]) -> None:
    """torch DDP's keywords that wrap_model accepts for a drop-in switch: the devices must be this
    rank's own (ddpc binds each rank to its GPU), dim must be 0, and the flags must be bools.
    gradient_as_bucket_view and static_graph change nothing: ddpc keeps gradients in the buckets
    and learns the order itself (find_unused_parameters is wrap_model's)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"wrap_model: {name} must be a bool, got {type(value).__name__}")
    if dim != 0:
        raise ValueError(f"wrap_model: dim={dim}: ddpc splits nothing itself (each rank feeds its "
                         f"own batch, as DDP with one device per process does); leave dim at 0")
    own = dist.device()
    for name, devices in (("device_ids", device_ids), ("output_device", output_device)):
        if devices is None:
            continue
        items = list(devices) if isinstance(devices, (list, tuple)) else [devices]
        for d in items:
            dev = torch.device("cuda", d) if isinstance(d, int) and not isinstance(d, bool) \
                else torch.device(d)
            if own.type == "cuda" and dev.type == "cuda" and dev.index is None:
                dev = own
            if dev != own or len(items) != 1:
                raise ValueError(f"wrap_model: {name}={devices!r}, but this rank works on {own} "
                                 f"(ddpc binds each rank to one GPU, from LOCAL_RANK): pass "
                                 f"[ddpc.device()] or leave {name} out")


# The bucket size when the caller gives none. 25 MiB is torch DDP's. Where the GPUs reach each other
# directly (NCCL with P2P: the one-shot path is on), 100 MiB stepped GPT-2 (163M parameters) on
# 2 H200s 0.03-0.05 faster in paired scaling than 25 in three runs with float32 gradients and
# 0.01-0.04 with bf16 (benchmarks/README.md, session 10): fewer buckets, fewer launches and less
# hook work per step. Through host memory (NCCL_P2P_DISABLE=1) it was no faster. The cap counts
# the gradients' own bytes; gradients reduced in a 16-bit grad_dtype get twice the cap there, so
# that their collectives carry the same 100 MiB: 200 was faster than 100 for bf16 in all three
# paired runs of sessions 10 and 11 (+0.008 to +0.018), where float32 gained nothing from 200.
DEFAULT_BUCKET_CAP_MB = 25.0
DIRECT_BUCKET_CAP_MB = 100.0


def _direct(group: Any) -> bool:
    """Do the group's GPUs reach each other directly (NCCL with P2P: NVLink or PCIe)?"""
    return (group.backend == "nccl" and group.world_size > 1 and group.fast_max_bytes > 0
            and group.staged_min_bytes == 0)


def _rows_by_default(group: Any) -> bool:
    """Where DDPC_EMBEDDING_ROWS=auto routes embedding lookups (ddpc/_rows.py): GPUs that do not
    reach each other directly (NCCL through host memory). Measured (session 13 in
    benchmarks/README.md): there, +1-3 points of scaling for GPT-2 on 2 H200s, where the dense
    all-reduce at the end takes 2-5 ms. Over NVLink nothing (it takes 0.3-0.5 ms, and routing's
    own host work about as much); on the cpu backend (a 2-core VM) +0.01 with float32 gradients
    and -0.06 with bf16."""
    return group.backend == "nccl" and group.world_size > 1 and not _direct(group)


def default_bucket_cap_mb(group: Any, grad_dtype: Optional[torch.dtype] = None) -> float:
    """What wrap_model uses when bucket_cap_mb is None, for this group and grad_dtype."""
    if _direct(group):
        return DIRECT_BUCKET_CAP_MB * (2 if grad_dtype in (torch.bfloat16, torch.float16)
                                       else 1)
    return DEFAULT_BUCKET_CAP_MB


def wrap_model(module: torch.nn.Module, *, bucket_cap_mb: Optional[float] = None,
               broadcast_buffers: bool = True, grad_dtype: Optional[torch.dtype] = None,
               group: Any = None, device_ids: Any = None, output_device: Any = None,
               dim: int = 0, process_group: Any = None, find_unused_parameters: bool = False,
               gradient_as_bucket_view: bool = True, static_graph: bool = False,
               check_reduction: bool = False) -> DistributedModel:
    """Makes module data-parallel: gradients are averaged across the ranks of `group` (default:
    the group of init_process_group) during every backward.

    Call it on every rank, after moving the model to ddpc.device() and freezing what stays frozen
    (parameters with requires_grad=False are not reduced). It verifies that every rank has the
    same parameters (names, shapes, dtypes; ddpc.MismatchError names the first difference) and
    copies rank 0's parameters and buffers to the others.

    bucket_cap_mb: size of the gradient buckets reduced while backward runs (the first holds at
    most 1 MiB, so communication starts early). None: 100 MiB where the GPUs reach each other
    directly (NVLink or PCIe P2P; fewer, larger buckets measured faster over NVLink), 200 there
    with a 16-bit grad_dtype (the same 100 MiB per collective), else 25 (torch DDP's default);
    ddpc.parallel.default_bucket_cap_mb(group, grad_dtype) says which.
    broadcast_buffers: copy rank 0's buffers (e.g. BatchNorm statistics) to every rank before a
    forward when the forward before it ran with autograd on, outside no_sync() (so also before
    the first evaluation forward after training: run it on every rank, or evaluate
    ddpc.unwrap(model) on one), as torch DDP; those of the submodules the module had when
    wrapped, including buffers registered or replaced since.
    grad_dtype: torch.bfloat16 or torch.float16 to reduce gradients in that dtype (half the
    traffic of float32; gradients are cast back afterwards); None reduces in the parameters' dtype.

    After backward, each param.grad is a view into a bucket. Buckets whose gradients are all None
    at a forward (zero_grad(set_to_none=True)) are freed until backward needs them, so peak memory
    stays close to single-process training; with set_to_none=False they persist. Parameters
    unused in a step on some ranks get a gradient of zero from those ranks. A parameter that no
    rank used keeps grad None with find_unused_parameters=True (as torch DDP; one more small
    all-reduce per step); without it, it gets a zero gradient (a warning says so once), which
    an optimizer with momentum or weight decay still applies. Use model.no_sync() for gradient
    accumulation, ddpc.unwrap(model) for the original module.

    torch DDP's keywords are accepted, so `DistributedDataParallel(model, device_ids=[rank])`
    carries over (ddpc.DistributedDataParallel is this function): device_ids and output_device
    must name this rank's device, process_group is `group`, find_unused_parameters is as above,
    and gradient_as_bucket_view, static_graph and check_reduction change nothing.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"wrap_model: module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, DistributedModel):
        raise ValueError("wrap_model: this module is already wrapped (pass ddpc.unwrap(model) to "
                         "wrap it again)")
    if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool)
                                      or not isinstance(bucket_cap_mb, (int, float))):
        raise TypeError(f"wrap_model: bucket_cap_mb must be a number of MiB or None, got "
                        f"{type(bucket_cap_mb).__name__}")
    if bucket_cap_mb is not None and not (0 < bucket_cap_mb < float("inf")
                                          and 1 <= bucket_cap_mb * (1 << 20) <= 1 << 60):
        raise ValueError(f"wrap_model: bucket_cap_mb must be a number of MiB from 2**-20 (one "
                         f"byte) to 2**40, got {bucket_cap_mb}")
    if not isinstance(broadcast_buffers, bool):
        raise TypeError(f"wrap_model: broadcast_buffers must be a bool, got "
                        f"{type(broadcast_buffers).__name__}")
    if grad_dtype is not None and grad_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"wrap_model: grad_dtype must be None, torch.bfloat16 or torch.float16, "
                         f"got {grad_dtype}")
    _check_ddp_keywords(device_ids, output_device, dim, {
        "find_unused_parameters": find_unused_parameters,
        "gradient_as_bucket_view": gradient_as_bucket_view, "static_graph": static_graph,
        "check_reduction": check_reduction})
    if group is not None and process_group is not None and group is not process_group:
        raise ValueError("wrap_model: group and process_group name different groups: pass one")
    if process_group is not None and group is None:
        group = process_group
    g = group if group is not None else dist._default_group()
    if not isinstance(g, _C.Group):
        raise TypeError(f"wrap_model: group must be a process group (ddpc._C.Group) or None for "
                        f"the default one, got {type(g).__name__}")
    default_cap = bucket_cap_mb is None
    if default_cap:
        bucket_cap_mb = default_bucket_cap_mb(g, grad_dtype)
    try:
        model = DistributedModel(module, int(bucket_cap_mb * (1 << 20)), broadcast_buffers,
                                 grad_dtype, g, find_unused_parameters)
    except _C.DistributedError as e:
        if str(e).startswith("wrap_model"):
            raise
        # (a collective of its checks failed: most often another rank is not in wrap_model)
        raise type(e)(f"wrap_model (its collectives compare the ranks' models and copy rank 0's "
                      f"values: every rank must call it at the same point): {e}"
                      ).with_traceback(e.__traceback__) from None
    model._default_cap = default_cap  # (register_comm_hook picks the default for its dtype)
    return model


def DistributedDataParallel(module: torch.nn.Module, device_ids: Any = None,  # noqa: N802
                            output_device: Any = None, dim: int = 0,
                            broadcast_buffers: bool = True, process_group: Any = None,
                            bucket_cap_mb: Optional[float] = None,
                            find_unused_parameters: bool = False,
                            check_reduction: bool = False, gradient_as_bucket_view: bool = False,
                            static_graph: bool = False, **kwargs: Any) -> DistributedModel:
    """torch.nn.parallel.DistributedDataParallel's name and positional order, for a one-line
    switch: `from ddpc import DistributedDataParallel as DDP`. It is wrap_model (see there); it
    returns a ddpc.DistributedModel, not an instance of this name. Other wrap_model keywords
    (grad_dtype, group) pass through."""
    unknown = set(kwargs) - {"grad_dtype", "group"}
    if unknown:
        raise TypeError(f"DistributedDataParallel: unsupported keyword(s) {sorted(unknown)}: "
                        f"ddpc takes DDP's documented arguments plus grad_dtype and group")
    return wrap_model(module, device_ids=device_ids, output_device=output_device, dim=dim,
                      broadcast_buffers=broadcast_buffers, process_group=process_group,
                      bucket_cap_mb=bucket_cap_mb, find_unused_parameters=find_unused_parameters,
                      check_reduction=check_reduction,
                      gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
                      **kwargs)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module given to wrap_model (model itself when it is not wrapped)."""
    return model.module if isinstance(model, DistributedModel) else model
