"""ZeroRedundancyOptimizer: torch's optimizer-state sharding (ZeRO stage 1) on ddpc's groups.
Each rank keeps the optimizer state of its share of the parameters only, steps that share, and
then every rank receives each share from its owner, so all replicas stay the same."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ddpc import _C
from ddpc import distributed as dist

# Parameters are sent from their owners in place when they are at least _ALONE_BYTES, and the
# smaller ones together in flat copies of at most _CHUNK_BYTES, with at most _IN_FLIGHT sends
# queued at once: the transient memory is a few small chunks, never a share of the model (which
# would eat what the sharded state saves).
_ALONE_BYTES = 1 << 20
_CHUNK_BYTES = 4 << 20
_IN_FLIGHT = 4


def _to_host(obj: Any) -> Any:
    """obj with every tensor in it moved to the host (its copy; nested dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """torch.distributed.optim.ZeroRedundancyOptimizer on ddpc: wraps `optimizer_class` so that
    each rank holds the optimizer state (AdamW's two moments: 8 bytes per float32 parameter) of
    about 1/world_size of the parameters. Each parameter belongs to one rank, chosen by a greedy
    split by size; `step()` steps this rank's parameters, then every rank receives the others'
    from their owners. Gradients are averaged as before (wrap_model); only the optimizer is
    sharded.

        opt = ddpc.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-5)

    Every rank must build it with the same parameters in the same order (checked: a mismatch
    raises on every rank). `param_groups` holds every parameter, so learning-rate schedulers,
    `zero_grad()` and GradScaler work as with the plain optimizer. Checkpoints:
    `consolidate_state_dict(to=0)` on every rank, then `state_dict()` on rank `to` gives the
    plain optimizer's format (its tensors on the host), which `load_state_dict` (or the plain
    optimizer) takes. An optimizer whose step looks at all parameters at once (a global gradient
    norm inside step) sees only this rank's share, as with torch's. `process_group` is a ddpc
    group (default: the default group); `parameters_as_bucket_view` is accepted and changes
    nothing; `overlap_with_ddp=True` raises NotImplementedError."""

    def __init__(self, params: Any, optimizer_class: type, process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults: Any) -> None:
        del parameters_as_bucket_view
        if not (isinstance(optimizer_class, type) and
                issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"ZeroRedundancyOptimizer: optimizer_class must be a "
                            f"torch.optim.Optimizer subclass such as torch.optim.AdamW, got "
                            f"{optimizer_class!r}")
        if issubclass(optimizer_class, torch.optim.LBFGS):
            raise NotImplementedError(
                "ZeroRedundancyOptimizer(torch.optim.LBFGS): LBFGS's line search looks at every "
                "parameter at once and calls the closure a different number of times on each "
                "rank once the parameters are split; use LBFGS unsharded")
        if overlap_with_ddp:
            raise NotImplementedError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) is not supported: ddpc's reducer "
                "runs no Python hook per bucket to step from; leave it False (the step runs "
                "after backward)")
        self._group = dist._group(process_group)
        self._world = self._group.world_size
        self._rank = self._group.rank
        self._owner: Dict[torch.Tensor, int] = {}
        self._load = [0] * self._world  # bytes of parameters each rank owns so far
        self._local: Optional[torch.optim.Optimizer] = None
        self._consolidated: Optional[Dict[str, Any]] = None
        super().__init__(params, defaults)
        self._check_same_everywhere()
        local_groups = [self._local_group(g) for g in self.param_groups]
        self._local = optimizer_class(local_groups, **defaults)
        # The plain optimizer's hyperparameters (betas, eps, ...) appear in defaults and
        # param_groups too, so a scheduler that looks for them (OneCycleLR's betas) finds them.
        for k, v in self._local.defaults.items():
            self.defaults.setdefault(k, v)
        for mine, local in zip(self.param_groups, self._local.param_groups):
            for k, v in local.items():
                if k != "params":
                    mine.setdefault(k, v)
        self.state = self._local.state

    # ------------------------------------------------------------------ partition

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Adds a group (as the plain optimizer's add_param_group); its parameters are split
        among the ranks like the first ones. Every rank must add the same group."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        # Largest first, each to the rank holding the fewest bytes: the same split on every
        # rank, as every rank sees the same parameters in the same order.
        params = group["params"]
        for i in sorted(range(len(params)),
                        key=lambda i: -params[i].numel() * params[i].element_size()):
            p = params[i]
            if p in self._owner:
                continue  # (the base class refuses a parameter in two groups)
            r = min(range(self._world), key=lambda k: (self._load[k], k))
            self._owner[p] = r
            self._load[r] += p.numel() * p.element_size()
        if self._local is not None:
            try:
                self._check_same_everywhere()
            except _C.MismatchError:
                self.param_groups.pop()  # (not half added: the shard's optimizer never saw it)
                for p in params:
                    self._load[self._owner[p]] -= p.numel() * p.element_size()
                    del self._owner[p]
                raise
            self._local.add_param_group(self._local_group(group))
            for k, v in self._local.param_groups[-1].items():
                if k != "params":
                    group.setdefault(k, v)

    def _local_group(self, group: Dict[str, Any]) -> Dict[str, Any]:
        out = {k: v for k, v in group.items() if k != "params"}
        out["params"] = [p for p in group["params"] if self._owner[p] == self._rank]
        return out

    def _check_same_everywhere(self) -> None:
        """Every rank must list the same parameters (shapes, dtypes, groups) in the same order,
        or the ranks would split them differently and step wrong parameters silently."""
        mine = [[(tuple(p.shape), str(p.dtype)) for p in g["params"]] for g in self.param_groups]
        got: List[Any] = [None] * self._world
        dist.all_gather_object(got, mine, group=self._group)
        for r, theirs in enumerate(got):
            if theirs != mine:
                raise _C.MismatchError(
                    f"ZeroRedundancyOptimizer: rank {self._rank} and rank {r} were given "
                    f"different parameters ({_difference(mine, theirs, self._rank, r)}): build "
                    f"it from the same model on every rank, e.g. ddpc.unwrap(model).parameters()")

    def owner(self, param: torch.Tensor) -> int:
        """The rank that holds param's optimizer state and steps it."""
        return self._owner[param]

    # ------------------------------------------------------------------ step

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Steps this rank's parameters with the wrapped optimizer (after copying this object's
        hyperparameters into it, as a scheduler may have changed them), then gives every rank
        the parameters the others stepped. Returns the closure's loss, if any."""
        for mine, local in zip(self.param_groups, self._local.param_groups):
            for k, v in mine.items():
                if k != "params":
                    local[k] = v
        loss = self._local.step(closure) if closure is not None else self._local.step()
        self._consolidated = None  # (a checkpoint of the state before this step would be stale)
        if self._world > 1:  # (one rank owns everything: nothing to send)
            self._sync_parameters()
        return loss

    def _chunks(self) -> List[Tuple[int, List[torch.Tensor]]]:
        """(owner, parameters) to send: a parameter of _ALONE_BYTES or more alone, smaller ones
        of one dtype and device together up to _CHUNK_BYTES. Parameters that neither require
        grad nor hold one are left out: no step moves them (frozen weights under LoRA). One
        frozen after its gradient was kept (zero_grad(set_to_none=False)) is sent: AdamW still
        moves it (weight decay, momentum). Every rank decides alike, as wrap_model gives every
        rank the same gradients (or None)."""
        by_key: Dict[Tuple[int, torch.dtype, torch.device], List[torch.Tensor]] = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad or p.grad is not None:
                    by_key.setdefault((self._owner[p], p.dtype, p.device), []).append(p)
        chunks: List[Tuple[int, List[torch.Tensor]]] = []
        for (owner, _, _), ps in sorted(by_key.items(), key=lambda kv: (kv[0][0], str(kv[0][1]),
                                                                        str(kv[0][2]))):
            cur: List[torch.Tensor] = []
            size = 0
            for p in ps:
                nbytes = p.numel() * p.element_size()
                if nbytes >= _ALONE_BYTES and p.is_contiguous():
                    chunks.append((owner, [p]))
                    continue
                if cur and size + nbytes > _CHUNK_BYTES:
                    chunks.append((owner, cur))
                    cur, size = [], 0
                cur.append(p)
                size += nbytes
            if cur:
                chunks.append((owner, cur))
        return chunks

    @torch.no_grad()
    def _sync_parameters(self) -> None:
        """Every chunk broadcast from its owner, a few queued at once; a chunk of several
        parameters travels as one flat copy, split back into them on the receiving ranks."""
        pending: List[Tuple[Any, int, List[torch.Tensor], Optional[torch.Tensor]]] = []

        def finish(work: Any, owner: int, ps: List[torch.Tensor],
                   flat: Optional[torch.Tensor]) -> None:
            work.wait()
            if flat is not None and self._rank != owner:
                parts = flat.split([p.numel() for p in ps])
                torch._foreach_copy_(ps, [t.view_as(p) for t, p in zip(parts, ps)])

        for owner, ps in self._chunks():
            flat = None
            if len(ps) > 1 or not ps[0].is_contiguous():
                flat = (torch.cat([p.reshape(-1) for p in ps]) if self._rank == owner else
                        torch.empty(sum(p.numel() for p in ps), dtype=ps[0].dtype,
                                    device=ps[0].device))
            work = dist.broadcast(ps[0] if flat is None else flat, src=owner, group=self._group,
                                  async_op=True)
            pending.append((work, owner, ps, flat))
            if len(pending) >= _IN_FLIGHT:
                finish(*pending.pop(0))
        for item in pending:
            finish(*item)

    # ------------------------------------------------------------------ checkpoints

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collects every rank's share of the optimizer state on rank `to` (on the host), for
        its state_dict(). Every rank must call it."""
        dist._check_rank(self._group, to, "to", "consolidate_state_dict")
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        share = {index[p]: _to_host(s) for p, s in self._local.state.items()}
        got: Optional[List[Any]] = [None] * self._world if self._rank == to else None
        try:
            dist.gather_object(share, got, dst=to, group=self._group)
        except _C.DistributedTimeoutError as e:
            raise _C.DistributedTimeoutError(
                f"ZeroRedundancyOptimizer.consolidate_state_dict(to={to}): {e}\n(every rank "
                f"must call consolidate_state_dict, not only the one that saves)") from None
        self._consolidated = None
        if self._rank == to:
            state: Dict[int, Any] = {}
            for part in got:
                state.update(part)
            self._consolidated = state

    def state_dict(self) -> Dict[str, Any]:
        """The whole optimizer's state in the plain optimizer's format, on the rank that
        consolidate_state_dict(to=...) named; RuntimeError elsewhere, or before it."""
        if self._consolidated is None:
            raise RuntimeError(
                f"ZeroRedundancyOptimizer.state_dict() on rank {self._rank}: the state is sharded "
                f"over the ranks; call consolidate_state_dict(to=R) on every rank first (after "
                f"the last step), then state_dict() on rank R (the rank that saves the "
                f"checkpoint)")
        groups, start = [], 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(d)
        return {"state": dict(self._consolidated), "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a whole optimizer's state (this class's state_dict(), or the plain optimizer's)
        on every rank: each keeps its share, and the hyperparameters."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(groups, list) or len(groups) != len(self.param_groups) or any(
                len(a.get("params", ())) != len(b["params"])
                for a, b in zip(groups, self.param_groups)):
            raise ValueError(
                "ZeroRedundancyOptimizer.load_state_dict: the state dict's param_groups do not "
                "match this optimizer's (group count, or parameters per group): load a state "
                "dict saved from the same model and optimizer setup")
        state = state_dict.get("state", {})
        local_state, local_groups, flat = {}, [], 0
        for saved, mine in zip(groups, self.param_groups):
            ids = []
            for sid, p in zip(saved["params"], mine["params"]):
                if self._owner[p] == self._rank:
                    if sid in state:
                        local_state[flat] = state[sid]
                    ids.append(flat)
                    flat += 1
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
            local_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                                 "params": ids})
        self._local.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self._local.state


def _difference(mine: List[Any], theirs: List[Any], me: int, other: int) -> str:
    """The first difference between two ranks' [[(shape, dtype) per parameter] per group]."""
    if len(mine) != len(theirs):
        return f"{len(mine)} parameter group(s) on rank {me}, {len(theirs)} on rank {other}"
    for g, (a, b) in enumerate(zip(mine, theirs)):
        if len(a) != len(b):
            return (f"group {g} has {len(a)} parameter(s) on rank {me}, {len(b)} on rank "
                    f"{other}")
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return (f"parameter {i} of group {g} is {list(x[0])} {x[1]} on rank {me}, "
                        f"{list(y[0])} {y[1]} on rank {other}")
    return "they differ"
