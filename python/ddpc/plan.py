"""python -m ddpc.plan: will a model's training fit on these GPUs? The memory each GPU needs for
the model's states (weights, gradients, the reducer's buffers, the optimizer's state) for one GPU
alone, torch DDP, ddpc, ddpc with bf16 gradients and ddpc with ZeroRedundancyOptimizer, against
what each GPU has free: before anything is allocated.

    python -m ddpc.plan --params 1.5B --nproc 2
    python -m ddpc.plan --model mypkg.models:build --nproc 2 --autocast
    python -m ddpc.plan --model mypkg.models:build --batch mypkg.models:example_batch

Activations depend on the batch, the sequence length and checkpointing. Without --batch they are
not counted, and the table says what is left for them. With --batch, one forward runs on the meta
device (no memory) and the tensors autograd saves for backward are counted, and then its
backward is walked for the peak; checkpointed blocks (torch.utils.checkpoint, either kind) run
again where their backward would run them, and what that holds is counted then.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import math
import os
import re
import sys
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence, Tuple

GIB = float(1 << 30)

# Optimizer state per parameter, in multiples of the parameter's own size.
OPTIMIZERS = {"adamw": 2, "adam": 2, "adamw-amsgrad": 3, "sgd-momentum": 1, "sgd": 0}
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclasses.dataclass
class Row:
    """One way of training: bytes per GPU of each part of the model's states."""
    name: str
    weights: float
    grads: float
    reducer: float     # gradient buffers beyond .grad (torch DDP's bucket copies, bf16 wires)
    optimizer: float
    autocast: float    # the 16-bit copies of the weights autocast keeps during a forward
    note: str = ""
    activations: float = 0.0  # with --batch: Activations.peak

    @property
    def states(self) -> float:
        return self.weights + self.grads + self.reducer + self.optimizer + self.autocast

    @property
    def total(self) -> float:
        """The most held at once: the states after backward, or at the start of backward the
        activations instead of the gradients (None after zero_grad(); the wires not made yet)."""
        if not self.activations:
            return self.states
        wire = self.reducer if self.name.startswith("ddpc grad_dtype") else 0.0
        return max(self.states, self.states - self.grads - wire + self.activations)


def estimate(params: Iterable[Tuple[int, int, bool]], world_size: int,
             optimizer: str = "adamw", autocast: bool = False,
             activations: float = 0.0) -> List[Row]:
    """Rows for params given as (numel, bytes per element, trainable) over world_size GPUs.
    Gradients and optimizer state follow the parameters' own dtype, as torch's do; bf16
    gradients in ddpc add a 2-byte wire per float32 element, held while the step's buckets are
    reduced (at most all of them at once); autocast's weight copies are 2 bytes per element."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} is not known here: use one of "
                         f"{', '.join(OPTIMIZERS)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    weights = grads = wire = copies = 0.0
    for numel, size, trainable in params:
        weights += numel * size
        copies += numel * 2 if size > 2 else 0
        if trainable:
            grads += numel * size
            wire += numel * 2 if size > 2 else 0
    opt = grads * OPTIMIZERS[optimizer]
    cast = copies if autocast else 0.0
    shard = f"the optimizer state of 1/{world_size} of the parameters"
    rows = [
        Row("one GPU alone", weights, grads, 0.0, opt, cast),
        Row("torch DDP", weights, grads, grads, opt, cast,
            "reducer: its bucket copies of the gradients (gradient_as_bucket_view=False, the "
            "default)"),
        Row("ddpc", weights, grads, 0.0, opt, cast, "the gradients live in the buckets"),
        Row("ddpc grad_dtype=bf16", weights, grads, wire, opt, cast,
            "reducer: the bf16 wires, at most this, at the end of backward (when the "
            "activations are gone)"),
        Row("ddpc + ZeroRedundancyOptimizer", weights, grads, 0.0, opt / world_size, cast,
            "optimizer: " + shard),
    ]
    for r in rows:
        r.activations = activations
    return rows


def _loss_of(out: Any) -> Any:
    """The loss a forward's output stands for: its .loss (a Hugging Face model given labels),
    else the sum of the first tensor in it."""
    import torch
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    stack = [out]
    while stack:
        x = stack.pop(0)
        if isinstance(x, torch.Tensor):
            return x.float().sum()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif hasattr(x, "values") and callable(x.values):
            stack.extend(x.values())
    raise ValueError(f"the forward returned {type(out).__name__}, with no tensor in it")


def _fused_attention(original: Any, autocast: Any = None) -> Any:
    """F.scaled_dot_product_attention as a GPU runs it, for a forward on the meta device: there
    it would take the math path, which saves every (query, key) score matrix for backward,
    where CUDA's fused kernels (flash, memory-efficient) save only the inputs, the output and
    one number per query row. The memory-efficient kernel's meta version stands in. With
    `autocast` (a dtype), float32 inputs are cast to it first, as CUDA autocast does."""
    import torch

    def attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None,
                  enable_gqa: bool = False) -> Any:
        if query.device.type != "meta" or query.dim() != 4:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if autocast is not None and torch.is_autocast_enabled("cuda"):
            low = torch.get_autocast_dtype("cuda")
            query, key, value = (t.to(low) if t.dtype == torch.float32 else t
                                 for t in (query, key, value))
            if attn_mask is not None and attn_mask.dtype == torch.float32:
                attn_mask = attn_mask.to(low)
        if enable_gqa and key.shape[1] != query.shape[1]:
            groups = query.shape[1] // key.shape[1]
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device)
        if bias is not None:
            bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, dropout_p, is_causal, scale=scale)[0]
    return attention


# CUDA autocast's op lists (torch's autocast_mode.cpp and its docs' "Autocast Op Reference"), by
# the name of the Python-level function or method a model calls: those that run in the 16-bit
# dtype, those that run in float32, and those that run in the widest dtype among their inputs.
_AUTOCAST_LOW = frozenset(
    "linear matmul __matmul__ __rmatmul__ mm mv bmm baddbmm addmm addmv addr addbmm einsum "
    "chain_matmul multi_dot linalg_multi_dot linalg_vecdot conv1d conv2d conv3d conv_tbc "
    "conv_transpose1d conv_transpose2d conv_transpose3d prelu lstm_cell gru_cell rnn_tanh_cell "
    "rnn_relu_cell scaled_dot_product_attention".split())
_AUTOCAST_FP32 = frozenset(
    "__pow__ __rpow__ __rdiv__ __rtruediv__ pow acos asin cosh sinh tan erfinv exp expm1 log "
    "log10 log2 log1p reciprocal rsqrt softplus layer_norm group_norm norm normalize "
    "frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss cosine_embedding_loss "
    "nll_loss hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss "
    "margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss "
    "multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm "
    "logsumexp softmax softmin log_softmax cumprod cumsum prod sum".split())
_AUTOCAST_PROMOTE = frozenset(
    "addcdiv addcmul atan2 bilinear cross dot grid_sample index_put scatter_add tensordot cat "
    "stack".split())


def _meta_autocast(dtype: Any, weight_copies: list) -> Any:
    """A mode that runs a forward on the meta device as CUDA autocast would (the meta device
    has no autocast of its own): the float32 inputs of its 16-bit ops cast to `dtype`, of its
    float32 ops to float32, of its promoting ops to their widest. A parameter's cast is made once
    per forward (autocast caches those); each cast of a parameter or of a view of one goes into
    the list `weight_copies`: plan counts those as autocast's weight copies, not as
    activations."""
    import torch
    from torch.overrides import TorchFunctionMode

    class MetaAutocast(TorchFunctionMode):
        # CUDA autocast's own switch is turned on for the forward (it does nothing to meta
        # tensors): the model's `torch.autocast("cuda", enabled=False)` blocks turn it off, and
        # its `torch.autocast("cuda", dtype=...)` blocks set the dtype, as on a GPU; each op
        # reads them.
        def __init__(self) -> None:
            super().__init__()
            self.cache: dict = {}
            self.saved: Any = None

        def __enter__(self) -> Any:
            self.saved = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", dtype)
            return super().__enter__()

        def __exit__(self, *exc: Any) -> Any:
            torch.set_autocast_enabled("cuda", self.saved[0])
            torch.set_autocast_dtype("cuda", self.saved[1])
            return super().__exit__(*exc)

        def cast(self, x: Any, to: Any) -> Any:
            if isinstance(x, (list, tuple)):
                return type(x)(self.cast(v, to) for v in x)
            if not (isinstance(x, torch.Tensor) and x.is_floating_point()
                    and x.dtype != torch.float64 and x.dtype != to):
                return x
            leaf = x.is_leaf and x.requires_grad
            if leaf and (id(x), to) in self.cache:
                return self.cache[(id(x), to)][1]
            y = x.to(to)
            base = x if x._base is None else x._base
            if isinstance(base, torch.nn.Parameter):
                weight_copies.append(y)
            if leaf:
                self.cache[(id(x), to)] = (x, y)  # (x kept alive: its id stays its own)
            return y

        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if not torch.is_autocast_enabled("cuda"):
                return func(*args, **kwargs)
            name = getattr(func, "__name__", "")
            if name == "cross_entropy":
                return cross_entropy(func, args, kwargs)
            to = None
            if name in _AUTOCAST_LOW:
                to = torch.get_autocast_dtype("cuda")
            elif name in _AUTOCAST_FP32 and "dtype" not in kwargs:
                to = torch.float32
            elif name in _AUTOCAST_PROMOTE:
                flat = [a for v in list(args) + list(kwargs.values())
                        for a in (v if isinstance(v, (list, tuple)) else [v])
                        if isinstance(a, torch.Tensor) and a.is_floating_point()]
                if len({a.dtype for a in flat}) > 1:
                    to = torch.promote_types(*{a.dtype for a in flat}) if len(flat) == 2 else \
                        max((a.dtype for a in flat), key=lambda d: torch.finfo(d).bits)
            if to is not None:
                args = tuple(self.cast(a, to) for a in args)
                kwargs = {k: self.cast(v, to) for k, v in kwargs.items()}
            return func(*args, **kwargs)

    def cross_entropy(func: Any, args: Any, kwargs: dict) -> Any:
        # CUDA autocast has no rule for cross_entropy itself; it runs as its parts: log_softmax
        # in the logits' own dtype (its result is saved), then nll_loss, a float32 op, on a
        # float32 copy of that (saved too). (Measured on an H200: bf16 logits save 6 bytes per
        # element there, not the 4 of a float32 log_softmax.)
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce",
                 "reduction", "label_smoothing")
        given = dict(zip(names, args), **kwargs)
        x, target = given.get("input"), given.get("target")
        if not (isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16)
                and isinstance(target, torch.Tensor) and not target.is_floating_point()
                and not given.get("label_smoothing")):
            return func(*args, **kwargs)
        lsm = torch.log_softmax(x, 1 if x.dim() > 1 else 0)
        rest = {k: given[k] for k in ("weight", "ignore_index", "reduction") if k in given}
        if isinstance(rest.get("weight"), torch.Tensor):
            rest["weight"] = rest["weight"].float()
        return torch.nn.functional.nll_loss(lsm.float(), target, **rest)
    return MetaAutocast()


def activation_bytes(model: Any, batch: Any, autocast: Any = None) -> "Activations":
    """Activations(bytes autograd saves for backward, the largest of them, the peak of backward)
    for one forward of `model` (on the meta device) on the input that `batch` returns (a function, or `pkg.module:function`;
    called on the meta device: a tensor, a tuple of positional inputs, or a dict of keyword
    inputs). Attention (F.scaled_dot_product_attention) is counted as CUDA's fused kernels save
    it. The parameters and buffers are not counted (they are weights); the output and the loss
    are. With `autocast` (torch.bfloat16 or torch.float16) the forward runs as under CUDA
    autocast to that dtype; its casts of the weights are not counted either (plan's autocast
    column holds them)."""
    import torch
    spec = batch if isinstance(batch, str) else getattr(batch, "__name__", "batch")
    factory = batch if callable(batch) else _factory(
        batch, "--batch", "returns one forward's input for one GPU (a tensor, a tuple of "
                          "inputs, or a dict of keyword inputs)")
    try:
        with torch.device("meta"):
            batch = factory()
    except Exception as e:  # noqa: BLE001 - the user's factory
        raise ValueError(f"--batch {spec!r}: it raised {type(e).__name__}: {e} (it is called "
                         f"with no arguments, on the meta device)") from None
    def key(t: Any) -> Tuple[Any, int]:
        try:
            st = t.untyped_storage()
            return st._cdata, st.nbytes()
        except (RuntimeError, NotImplementedError, AttributeError):
            return id(t), t.numel() * t.element_size()

    weights = {key(t)[0] for t in list(model.parameters()) + list(model.buffers())}
    saved: dict = {}
    copies: list = []  # autocast's casts of the weights
    modes: list = []   # the autocast mode, while it is on

    @contextlib.contextmanager
    def as_on_gpu() -> Any:
        """Attention counted as CUDA's fused kernels save it, and autocast's casts if asked
        (its casts of the weights go into `copies`): for the forward, and for the backward's
        runs of checkpointed segments."""
        functional = torch.nn.functional
        original = functional.scaled_dot_product_attention
        functional.scaled_dot_product_attention = _fused_attention(original, autocast)
        try:
            with contextlib.ExitStack() as stack:
                if autocast is not None:
                    modes.append(stack.enter_context(_meta_autocast(autocast, copies)))
                yield
        finally:
            functional.scaled_dot_product_attention = original

    def saving_into(into: dict) -> Any:
        """What autograd saves goes into `into` ({storage: bytes}), the weights left out."""
        def pack(t: Any) -> Any:
            k, n = key(t)
            if k not in weights:
                into[k] = n
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def recompute(fn: Any) -> Tuple[int, int]:
        """For a reentrant checkpoint's node (torch.utils.checkpoint with use_reentrant=True,
        which saves only its inputs in the forward): its forward again, as its backward runs it,
        and the peak of that segment's own backward. Returns (that peak, without the gradient
        into the segment and the inputs, which the caller holds already; the bytes of the
        gradients of the parameters inside, which stay after it)."""
        inputs = list(fn.inputs)
        for i, idx in enumerate(fn.tensor_indices):
            inputs[idx] = fn.saved_tensors[i]
        args = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
                for x in inputs]
        inner: dict = {}
        # (autocast casts the weights again there: the forward's casts, made without grad, were
        # let go when its autocast region ended; those new casts are counted with the segment)
        before = {key(t)[0] for t in copies}
        cache = modes[-1].cache if modes else None
        if modes:
            modes[-1].cache = {}
        try:
            with saving_into(inner), torch.enable_grad():
                out = fn.run_function(*args)
        finally:
            if modes:
                modes[-1].cache = cache
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(o, torch.Tensor) and o.grad_fn is not None]
        own = {key(a)[0] for a in args if isinstance(a, torch.Tensor)}
        for k in before | own:
            inner.pop(k, None)
        if not outs:
            return sum(inner.values()), 0
        kept = set()
        for o in outs:  # (held until their backward, as the outer output is)
            k, n = key(o)
            inner[k] = n
            kept.add(k)
        root = outs[0].sum() if len(outs) == 1 else torch.stack([o.sum() for o in outs]).sum()
        made: list = []
        # (the segment's inputs are held by the caller: not counted again)
        peak = _backward_peak(root, inner, kept, key, recompute, made, weights | own,
                              [t for t in copies if key(t)[0] in before])
        stays = sum(math.prod(v.shape) * v.dtype.itemsize for v in made
                    if key(v)[0] not in own)
        into = sum(math.prod(o.shape) * o.dtype.itemsize for o in outs)
        return max(peak - into, sum(inner.values())), stays

    if isinstance(batch, dict):
        args, kwargs = (), batch
    elif isinstance(batch, (tuple, list)):
        args, kwargs = tuple(batch), {}
    else:
        args, kwargs = (batch,), {}
    with as_on_gpu():
        try:
            with saving_into(saved):
                out = model(*args, **kwargs)
                loss = _loss_of(out)
        except Exception as e:  # noqa: BLE001 - the user's model, on the meta device
            raise ValueError(f"--batch {spec!r}: the forward on the meta device raised "
                             f"{type(e).__name__}: {e}") from None
        peak = _peak_of(loss, out, saved, weights, copies, key, recompute, spec)
    return Activations(sum(saved.values()), max(saved.values(), default=0), peak)


def _peak_of(loss: Any, out: Any, saved: dict, weights: set, copies: list, key: Any,
             recompute: Any, spec: str) -> int:
    """activation_bytes' peak of backward: the output and the loss are counted (the caller
    holds them) and the weights and autocast's copies of them are not."""
    import torch
    # The output (held by the caller until backward) and the loss count too.
    held = list(out) if isinstance(out, (tuple, list)) else [getattr(out, "logits", out)]
    kept = set()
    for t in held + [loss]:
        if isinstance(t, torch.Tensor):
            k, n = key(t)
            if k not in weights:
                saved[k] = n
                kept.add(k)
    for k in weights | {key(t)[0] for t in copies}:
        saved.pop(k, None)
    try:
        return _backward_peak(loss, saved, kept, key, recompute, None, weights, copies)
    except Exception as e:  # noqa: BLE001 - the user's checkpointed segments, run again
        raise ValueError(f"--batch {spec!r}: running a checkpointed part of the model again on "
                         f"the meta device (as its backward does) raised {type(e).__name__}: "
                         f"{e}") from None


class Activations(NamedTuple):
    """What activation_bytes counts, in bytes."""
    saved: int    # what autograd saves for backward, with the output and the loss
    largest: int  # the largest of those
    peak: int     # the most held at once in backward: what is saved and not yet released, the
    #               gradients on their way, and the parameters' gradients made so far


def _backward_peak(loss: Any, saved: dict, kept: set, key: Any, recompute: Any = None,
                   made: Optional[list] = None, weights: Optional[set] = None,
                   copies: Optional[list] = None) -> int:
    """Runs backward from `loss` without computing it: the nodes of its autograd graph in the
    order autograd's engine takes them (the ready one of the highest sequence number first).
    Each node makes its inputs' gradients (their sizes from the graph's metadata) while the
    gradient into it is still held; then that one is freed (a parameter's becomes its .grad and
    stays), and so are the tensors it saved that no node still to run saved too. `saved`
    {storage: bytes} is what is held at the start; what no node names, and `kept` (the output
    and the loss, which the caller holds), stay to the end. A reentrant checkpoint's node runs
    its segment again: recompute(node) gives that segment's own peak, held on top of what is
    live then, and the bytes of its parameters' gradients, which stay. A non-reentrant
    checkpoint's nodes get their saved tensors by running their segment again when asked for
    them: those (neither in `saved` nor `weights`, the storages never counted, nor autocast's
    `copies`) are all held from the first node that uses one of their segment's, each until the
    last node that uses it. `made` (a list) gets the leaf tensors whose gradients the backward
    makes."""
    import heapq

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    root = getattr(loss, "grad_fn", None)
    if root is None:
        return sum(saved.values())
    deps: dict = {}
    seen, stack = {root}, [root]
    while stack:
        fn = stack.pop()
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                deps[nxt] = deps.get(nxt, 0) + 1
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
    refs = dict.fromkeys(saved, 1)  # (the storages no node names: held to the end)
    named = set()
    saved_by = {}
    again: dict = {}  # what non-reentrant checkpoints make again: {storage: bytes}
    # A non-reentrant checkpoint makes its whole segment again at the first request for one of
    # its tensors, and holds all it saves from then: each storage made during a request is
    # noted with the node whose request made it (its frame).
    made_by: dict = {}
    asking: list = [None]

    class Noting(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            ins = {key(a)[0] for a in list(args) + list((kwargs or {}).values())
                   if isinstance(a, torch.Tensor)}
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                # (a new storage, not a view or alias of an input; the last one made at an
                # address is the one alive there now)
                if isinstance(t, torch.Tensor) and key(t)[0] not in ins:
                    made_by[key(t)[0]] = asking[0]
            return out
    # What each request gives back; held to the end, so that no storage made later takes the
    # address, and with it the key, of one of them.
    asked: dict = {}
    # (Outside a backward, torch.utils.checkpoint makes a segment again for every request, each
    # under an id of its own; one id for all of them, as inside one backward: once per segment.)
    task_id = torch._C._current_graph_task_id
    torch._C._current_graph_task_id = lambda: -2 if task_id() == -1 else task_id()
    try:
        for fn in seen:
            asking[0] = fn
            with Noting():
                asked[fn] = _saved_tensors(fn)
    finally:
        torch._C._current_graph_task_id = task_id
    for fn in seen:
        ks = set()
        for t in asked[fn]:
            k, n = key(t)
            if k not in saved and (weights is None or k in weights):
                continue
            if k not in saved:
                again[k] = n
            ks.add(k)
        saved_by[fn] = ks
        named |= ks
    for k in {key(t)[0] for t in copies or ()}:
        again.pop(k, None)
    for fn, ks in saved_by.items():
        ks &= saved.keys() | again.keys()
        for k in ks:
            refs[k] = refs.get(k, 0) + 1
    for k in (named & saved.keys()) - kept:
        refs[k] -= 1
    frames: dict = {}  # {frame: the storages its segment's run holds}
    for k in again:
        frames.setdefault(made_by.get(k, k), set()).add(k)
    frame_of = {k: f for f, ks in frames.items() for k in ks}
    pending = set(again)  # (not live until a node uses one of their frame)

    def grad_bytes(meta: Any) -> int:
        return math.prod(meta.shape) * meta.dtype.itemsize

    slots = {(root, i): grad_bytes(m) for i, m in enumerate(root._input_metadata)}
    live = sum(saved.values()) + sum(slots.values())
    peak = live
    ready = [(-root._sequence_nr(), 0, root)]
    tie = 1
    while ready:
        fn = heapq.heappop(ready)[2]
        if made is not None and type(fn).__name__ == "AccumulateGrad":
            made.append(fn.variable)
        if recompute is not None and type(fn).__name__ == "CheckpointFunctionBackward":
            inside, stays = recompute(fn)
            peak = max(peak, live + inside)
            live += stays
        for k in saved_by.get(fn, ()) & pending:
            for j in frames[frame_of[k]] & pending:
                pending.discard(j)
                live += again[j]
        for nxt, i in fn.next_functions:
            if nxt is not None and (nxt, i) not in slots:
                slots[(nxt, i)] = grad_bytes(nxt._input_metadata[i])
                live += slots[(nxt, i)]
        peak = max(peak, live)
        if type(fn).__name__ != "AccumulateGrad":
            live -= sum(slots.get((fn, i), 0) for i in range(len(fn._input_metadata)))
        for k in saved_by.get(fn, ()):
            refs[k] -= 1
            if refs[k] == 0:
                live -= saved[k] if k in saved else again[k]
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                deps[nxt] -= 1
                if deps[nxt] == 0:
                    heapq.heappush(ready, (-nxt._sequence_nr(), tie, nxt))
                    tie += 1
    return peak


def _saved_tensors(fn: Any) -> List[Any]:
    """The tensors an autograd node saved: its _saved_* attributes (a built-in op's) or its
    saved_tensors (an autograd.Function's)."""
    import torch
    found = []
    names = [n for n in dir(fn) if n.startswith("_saved_")] + ["saved_tensors"]
    for name in names:
        try:
            v = getattr(fn, name, None)
        except (RuntimeError, AttributeError):  # (released, or none of that kind)
            continue
        for t in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(t, torch.Tensor):
                found.append(t)
    return found


def _factory(spec: str, flag: str, does: str) -> Any:
    """The function `pkg.module:function` names (imported from the working directory too)."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"{flag} {spec!r}: expected MODULE:FUNCTION, e.g. mypkg.models:build "
                         f"(a function that {does})")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"{flag} {spec!r}: cannot import {mod_name!r}: {e}") from None
    finally:
        sys.path.pop(0)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{flag} {spec!r}: {mod_name!r} has no function {attr!r}")
    return factory


def module_params(model: Any) -> List[Tuple[int, int, bool]]:
    """(numel, bytes per element, trainable) of each distinct parameter of a torch module."""
    seen, out = set(), []
    for p in model.parameters():
        if id(p) in seen:
            continue  # (tied weights are one tensor)
        seen.add(id(p))
        out.append((p.numel(), p.element_size(), bool(p.requires_grad)))
    return out


def parse_count(text: str) -> int:
    """'1.5B', '350M', '163e6', '7000000' -> a positive parameter count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a parameter count such as 1.5B, 350M or "
                                         f"163e6, got {text!r}")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[
        m.group(2).lower()]
    if not 1 <= value < 1e15:
        raise argparse.ArgumentTypeError(f"expected a parameter count from 1 to below 1e15 (1000T), "
                                         f"got {text!r}")
    return int(round(value))


def build_on_meta(spec: str) -> Any:
    """Calls the factory `pkg.module:function` with parameters made on torch's meta device
    (shapes and dtypes only, no memory)."""
    attr = spec.partition(":")[2]
    factory = _factory(spec, "--model", "returns the torch.nn.Module to train")
    import torch
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as e:  # noqa: BLE001 - the user's factory: whatever it raises is reported
        raise ValueError(f"--model {spec!r}: {attr}() raised {type(e).__name__}: {e} (it is "
                         f"called with no arguments, on the meta device: a function that "
                         f"builds the model from its config, not one that loads weights)") \
            from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {spec!r}: {attr}() returned a {type(model).__name__}, not a "
                         f"torch.nn.Module")
    return model


def gpu_free_gib(n: int) -> Tuple[Optional[float], str]:
    """The least free memory among the first n visible GPUs, in GiB, and where it came from;
    (None, why) when nvidia-smi cannot tell."""
    from ddpc import launch
    infos = launch._visible_gpu_infos(n)
    if not infos or any(i is None for i in infos):
        return None, "no GPU found through nvidia-smi"
    least = min(infos, key=lambda i: i.free_mib)
    return least.free_mib / 1024, (f"free now on GPU {least.index} ({least.name}), the least "
                                   f"of the {n} used")


def report(rows: Sequence[Row], gpu_gib: Optional[float], header: str) -> str:
    acts = any(r.activations for r in rows)
    cols = ("weights", "grads", "reducer", "optimizer", "autocast") + \
        (("activations",) if acts else ())
    left = "   left" if acts else "   left for activations"
    width = {c: 13 if c == "activations" else 10 for c in cols}
    lines = [header, f"{'GiB per GPU':<32}" + "".join(f"{c:>{width[c]}}" for c in cols) +
             f"{'total':>9}" + (left if gpu_gib is not None else "")]
    for r in rows:
        line = f"{r.name:<32}" + "".join(f"{getattr(r, c) / GIB:>{width[c]}.2f}" for c in cols)
        line += f"{r.total / GIB:>9.2f}"
        if gpu_gib is not None:
            left = gpu_gib - r.total / GIB
            line += f"   {left:>8.2f}" + ("" if left > 0 else "  does not fit")
        lines.append(line)
    lines += [f"  {r.name}: {r.note}" for r in rows if r.note]
    if acts:
        lines.append("  activations: what autograd saves for backward in one forward of --batch "
                     "(and the output), plus two gradients the size of the largest of them (into "
                     "and out of its op, in backward); total: the "
                     "more of the states after backward and the start of backward, where these "
                     "stand in for the gradients. Not counted: the CUDA context, cuBLAS's and "
                     "NCCL's workspaces, and the allocator's fragmentation")
    if gpu_gib is None:
        return "\n".join(lines)
    fits = [r for r in rows[1:] if r.total / GIB < gpu_gib]
    best = min(fits, key=lambda r: r.total) if fits else None
    room = f"{gpu_gib - best.total / GIB:.2f} GiB" if best else ""
    if acts and not fits:
        lines.append("verdict: this batch does not fit with any of these: a smaller batch, "
                     "activation checkpointing, bf16 autocast or LoRA lowers the total")
    elif acts:
        lines.append(f"verdict: this batch fits with {', '.join(r.name for r in fits)}; most "
                     f"room left with {best.name} ({room})")
    elif not fits:
        lines.append("verdict: the model's states alone do not fit on one GPU with any of "
                     "these: shard the parameters and gradients too (FSDP, DeepSpeed ZeRO-3), "
                     "train fewer parameters (LoRA, frozen layers), or keep 16-bit weights")
    else:
        lines.append(f"verdict: fits with {', '.join(r.name for r in fits)}; most room for "
                     f"activations with {best.name} ({room}, before the batch's activations "
                     f"and the CUDA context)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddpc.plan",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=parse_count, metavar="N",
                      help="the number of parameters, e.g. 1.5B, 350M, 163e6 (all trainable)")
    what.add_argument("--model", metavar="MODULE:FUNCTION",
                      help="a function that returns the model; it is called with parameters on "
                           "the meta device, so nothing is allocated (frozen parameters count as "
                           "weights only)")
    ap.add_argument("--batch", metavar="MODULE:FUNCTION",
                    help="with --model: a function that returns one forward's input for one GPU "
                         "(a tensor, a tuple of inputs, or a dict of keyword inputs, such as a "
                         "Hugging Face batch with labels), made on the meta device: the "
                         "activations of that batch are counted")
    ap.add_argument("--dtype", choices=sorted(DTYPE_SIZES), default="float32",
                    help="the parameters' dtype with --params (default float32)")
    ap.add_argument("--nproc", type=int, default=None,
                    help="GPUs to train on (default: those visible, at least 1)")
    ap.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
    ap.add_argument("--autocast", action="store_true",
                    help="training under bf16/fp16 autocast: count its 16-bit copies of the "
                         "weights, and with --batch, the activations as autocast saves them")
    ap.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                    help="memory per GPU to plan for (default: the least free memory of the GPUs "
                         "used, from nvidia-smi)")
    args = ap.parse_args(argv)
    if args.nproc is not None and args.nproc < 1:
        ap.error(f"argument --nproc: expected at least 1, got {args.nproc}")
    if args.gpu_memory is not None and not (args.gpu_memory > 0 and math.isfinite(args.gpu_memory)):
        ap.error(f"argument --gpu-memory: expected GiB above 0, got {args.gpu_memory}")
    if args.batch is not None and args.model is None:
        ap.error("argument --batch: needs --model (the batch runs through that model)")
    activations, act_note = 0.0, ""
    if args.model is not None:
        try:
            model = build_on_meta(args.model)
            if args.batch is not None:
                import torch
                saved, largest, peak = activation_bytes(
                    model, args.batch, torch.bfloat16 if args.autocast else None)
                activations = float(peak)
                act_note = (f"; activations of {args.batch}"
                            f"{' under bf16/fp16 autocast' if args.autocast else ''}: "
                            f"{saved / GIB:.2f} GiB saved for backward, the largest "
                            f"{largest / GIB:.2f} GiB")
        except ValueError as e:
            ap.error(str(e))
        params = module_params(model)
        kinds = sorted({s for _, s, _ in params})
        what = (f"{args.model}: {sum(n for n, _, _ in params) / 1e6:.1f}M parameters "
                f"({sum(n for n, _, t in params if t) / 1e6:.1f}M trainable), "
                f"{'/'.join(f'{8 * s}-bit' for s in kinds)}")
    else:
        params = [(args.params, DTYPE_SIZES[args.dtype], True)]
        what = f"{args.params / 1e6:.1f}M parameters, {args.dtype}"
    nproc = args.nproc
    if nproc is None:
        from ddpc import launch
        nproc = max(1, launch.visible_gpu_count())
    if args.gpu_memory is not None:
        gib, source = args.gpu_memory, "as given"
    else:
        gib, source = gpu_free_gib(nproc)
    rows = estimate(params, nproc, args.optimizer, args.autocast, activations)
    header = (f"{what}{act_note}; {args.optimizer}{', autocast' if args.autocast else ''}; {nproc} GPU(s); "
              + (f"{gib:.2f} GiB per GPU ({source})" if gib is not None else
                 f"GPU memory unknown ({source}): pass --gpu-memory GIB"))
    print(report(rows, gib, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
