"""ddpc.wrap_model on 2 real processes (CPU backend): gradients equal single-process training on the
combined batch, unused parameters, no_sync, weight sharing, checkpointing, zero_grad modes,
bf16 reduction, model mismatches, state_dict, autocast + GradScaler, a memory-format change after
wrapping, a backward that raises; plus the reducer's C test, and tests/test_gpu_wrap_model.py's
scenarios run on the cpu backend.

Both ranks run every scenario once (a module-scoped fixture); each test checks one scenario's
results, so a broken feature fails its own test.
"""
import contextlib
import copy
import io
import os
import re
import subprocess
from collections import OrderedDict

import pytest
import torch
from _procs import report_scenarios, scenario_result, spawn_scenarios

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORLD = 2
B = 4  # per-rank batch
SMALL = 500 / 2 ** 20  # bucket_cap_mb of about 500 bytes: several buckets even for tiny models


# ------------------------------------------------------------------ models and data


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.fc2 = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


class Counted(MLP):
    """An MLP with a buffer its forward changes (wrap_model broadcasts rank 0's at each one)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(1, dtype=torch.float64))

    def forward(self, x):
        self.seen += 1
        return super().forward(x)


class Branchy(torch.nn.Module):
    """head_c is never used; head_a / head_b per call."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(6, 8)
        self.head_a = torch.nn.Linear(8, 3)
        self.head_b = torch.nn.Linear(8, 3)
        self.head_c = torch.nn.Linear(8, 3)

    def forward(self, x, branch):
        h = torch.tanh(self.trunk(x))
        return self.head_a(h) if branch == 0 else self.head_b(h)


class TiedLM(torch.nn.Module):
    """The embedding matrix is also the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.mid = torch.nn.Linear(8, 8)

    def forward(self, tokens):
        h = torch.tanh(self.mid(self.emb(tokens)))
        return h @ self.emb.weight.t()


class Checkpointed(torch.nn.Module):
    """`block` runs in two checkpoint segments (its weights are used twice per backward)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = torch.nn.Linear(6, 8)
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.block2 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.head = torch.nn.Linear(8, 3)
        self.use_checkpoint = True

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        h = self.inp(x)
        for blk in (self.block, self.block, self.block2):
            if self.use_checkpoint:
                h = checkpoint(blk, h, use_reentrant=self.reentrant)
            else:
                h = blk(h)
        return self.head(h)


class WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)
        self.bn = torch.nn.BatchNorm1d(3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        return self.bn(self.fc(x)) * self.scale


def batch(step: int, dtype=torch.float64, n: int = WORLD * B):
    """The combined batch of a step (drawn in float64 so every dtype sees the same values)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    return x.to(dtype), torch.randn(n, 3, generator=g, dtype=torch.float64).to(dtype)


def shard(t, rank):
    return t[rank * B:(rank + 1) * B]


def mse(a, b):
    return ((a - b) ** 2).mean()


def make(cls, rank, dtype, *args):
    """Rank 0 builds with seed 0, the others with another seed: wrap_model must copy rank 0's."""
    torch.manual_seed(0 if rank == 0 else 100 + rank)
    return cls(*args).to(dtype)


def reference(cls, dtype, *args):
    torch.manual_seed(0)
    return cls(*args).to(dtype)


def max_diff(m1, m2):
    return max((a.detach() - b.detach()).abs().max().item()
               for a, b in zip(m1.parameters(), m2.parameters()))


def local_grads(module, fn):
    """Gradients of a detached copy of module for the loss fn(copy) (zeros where unused)."""
    c = copy.deepcopy(module)
    for p in c.parameters():
        p.grad = None
    fn(c).backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in c.parameters()]


def averaged_step_error(model, forward, x, y, rank):
    """One synced step of forward (the wrapped model, or something that calls it) on this
    rank's shard of (x, y) after zero_grad: the largest difference between model's gradients
    and the average over ranks of each rank's local gradients."""
    expected = [sum(g) / WORLD for g in zip(*[
        local_grads(model, lambda m, r=r: mse(m(shard(x, r)), shard(y, r)))
        for r in range(WORLD)])]
    model.zero_grad(set_to_none=True)
    mse(forward(shard(x, rank)), shard(y, rank)).backward()
    return max((p.grad - e).abs().max().item() for p, e in zip(model.parameters(), expected))


def make_opt(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


# ------------------------------------------------------------------ scenarios (run on every rank)


def _equivalence_runs(rank):
    """Trains float64 and float32 ddpc models next to float64 / float32 single-process references
    on the combined batch; returns per-step max parameter errors against the float64 reference."""
    import ddpc
    out = {}
    for opt_name in ("sgd", "adam"):
        ref64, ref32 = reference(MLP, torch.float64), reference(MLP, torch.float32)
        o64, o32 = make_opt(opt_name, ref64.parameters()), make_opt(opt_name, ref32.parameters())
        models = {}
        for key, dtype in (("f64", torch.float64), ("f32", torch.float32)):
            model = make(MLP, rank, dtype)
            out[f"{opt_name}_{key}_differs_before"] = max_diff(copy.deepcopy(model).double(),
                                                               ref64)
            # float64: ~500-byte buckets, so several launch while backward runs
            wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL if key == "f64" else 25)
            out[f"{opt_name}_{key}_after_wrap"] = max_diff(
                copy.deepcopy(model).double(), reference(MLP, dtype).double())
            models[key] = (wrapped, make_opt(opt_name, wrapped.parameters()), dtype)
        errs = {"f64": [], "f32": [], "torch32": []}
        for step in range(6):
            for key, (wrapped, opt, dtype) in models.items():
                x, y = batch(step, dtype)
                opt.zero_grad()
                mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
                opt.step()
            for ref, o, dtype in ((ref64, o64, torch.float64), (ref32, o32, torch.float32)):
                x, y = batch(step, dtype)
                o.zero_grad()
                mse(ref(x), y).backward()
                o.step()
            for key, m in (("f64", models["f64"][0]), ("f32", models["f32"][0]), ("torch32", ref32)):
                errs[key].append(max((a.detach().double() - b.detach()).abs().max().item()
                                     for a, b in zip(m.parameters(), ref64.parameters())))
        for key, e in errs.items():
            out[f"{opt_name}_{key}_err"] = e
    return out


def sc_branches(rank):
    import ddpc
    model = make(Branchy, rank, torch.float64)
    wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    errs, head_c = [], []
    for step in range(4):
        x, y = batch(step)
        expected = None
        for r in range(WORLD):
            g = local_grads(model, lambda m, r=r: mse(m(shard(x, r), (r + step) % 2), shard(y, r)))
            expected = g if expected is None else [a + b for a, b in zip(expected, g)]
        expected = [e / WORLD for e in expected]
        opt.zero_grad()
        mse(wrapped(shard(x, rank), (rank + step) % 2), shard(y, rank)).backward()
        errs.append(max((p.grad - e).abs().max().item()
                        for p, e in zip(model.parameters(), expected)))
        head_c.append(max(p.grad.abs().max().item() for p in model.head_c.parameters()))
        opt.step()
    return {"errs": errs, "head_c": head_c}


def sc_unused(rank):
    """find_unused_parameters=True, as torch DDP: a parameter that no rank used keeps grad None
    (so optimizers skip it), one that some rank used gets the average, and a gradient
    accumulated under no_sync counts as a use. Without the flag: zeros, and one warning."""
    import warnings
    import ddpc
    model = make(Branchy, rank, torch.float64)
    wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL, find_unused_parameters=True)
    names = [n for n, _ in model.named_parameters()]
    out = {"none": [], "errs": []}

    def expect(x, y, branch_of, accumulated=None):
        per_rank = [local_grads(model, lambda m, r=r: mse(m(shard(x, r), branch_of(r)),
                                                           shard(y, r))) for r in range(WORLD)]
        exp = [sum(g) / WORLD for g in zip(*per_rank)]
        return exp if accumulated is None else [e + a for e, a in zip(exp, accumulated)]

    def check(exp):
        out["none"].append(sorted(n for n, p in zip(names, model.parameters()) if p.grad is None))
        out["errs"].append(max((p.grad - e).abs().max().item()
                               for p, e in zip(model.parameters(), exp) if p.grad is not None))

    # every rank on head_a; then rank r on head r (both heads used somewhere)
    for step, branch_of in enumerate([lambda r: 0, lambda r: r]):
        x, y = batch(300 + step)
        exp = expect(x, y, branch_of)
        model.zero_grad(set_to_none=True)
        mse(wrapped(shard(x, rank), branch_of(rank)), shard(y, rank)).backward()
        check(exp)
    # head_b accumulated under no_sync, then a synced step on head_a: head_b is used
    x, y = batch(310)
    model.zero_grad(set_to_none=True)
    acc = [sum(g) / WORLD for g in zip(*[  # (averaged at the synced step, with the rest)
        local_grads(model, lambda m, r=r: mse(m(shard(x, r), 1), shard(y, r)))
        for r in range(WORLD)])]
    with wrapped.no_sync():
        mse(wrapped(shard(x, rank), 1), shard(y, rank)).backward()
    x2, y2 = batch(311)
    exp = expect(x2, y2, lambda r: 0, acc)
    mse(wrapped(shard(x2, rank), 0), shard(y2, rank)).backward()
    check(exp)
    # zero_grad(set_to_none=False): a gradient made None by the flag stays None (torch's zero_grad
    # leaves None alone), the others are zeros that the step overwrites
    model.zero_grad(set_to_none=False)
    x, y = batch(312)
    exp = expect(x, y, lambda r: 0)
    mse(wrapped(shard(x, rank), 0), shard(y, rank)).backward()
    check(exp)
    # without the flag: zeros for unused parameters, and a warning that says what to do, once
    plain = ddpc.wrap_model(make(Branchy, rank, torch.float64), bucket_cap_mb=SMALL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            x, y = batch(320 + step)
            mse(plain(shard(x, rank), 0), shard(y, rank)).backward()
    out["plain_zero"] = all(p.grad is not None and not p.grad.any()
                            for p in ddpc.unwrap(plain).head_c.parameters())
    out["warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
    # frozen after the wrap (torch DDP raises at the next forward): grad None, as without ddpc,
    # so AdamW leaves it alone (its zero gradient used to be decayed and pushed by momentum)
    fm = make(Branchy, rank, torch.float64)
    fw = ddpc.wrap_model(fm, bucket_cap_mb=SMALL)
    opt = torch.optim.AdamW(fm.parameters(), lr=0.1, weight_decay=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            if step == 1:
                fm.trunk.requires_grad_(False)
                before = [p.detach().clone() for p in fm.trunk.parameters()]
            x, y = batch(330 + step)
            opt.zero_grad()
            mse(fw(shard(x, rank), 0), shard(y, rank)).backward()
            opt.step()
    out["frozen_none"] = all(p.grad is None for p in fm.trunk.parameters())
    out["frozen_moved"] = max((p - b).abs().max().item()
                              for p, b in zip(fm.trunk.parameters(), before))
    out["frozen_warned"] = any("trunk" in str(w.message) for w in caught)
    # frozen at the wrap and unfrozen later (torch DDP trains it unaveraged, silently): the
    # synced backward that gives it a gradient says so; wrapped again, it is averaged
    um = make(MLP, rank, torch.float64)
    um.fc1.requires_grad_(False)
    uw = ddpc.wrap_model(um, bucket_cap_mb=SMALL)
    x, y = batch(340)
    mse(uw(shard(x, rank)), shard(y, rank)).backward()
    um.fc1.requires_grad_(True)
    x, y = batch(341)
    try:
        mse(uw(shard(x, rank)), shard(y, rank)).backward()
        out["unfrozen"] = None
    except RuntimeError as e:
        out["unfrozen"] = str(e)
    uw = ddpc.wrap_model(ddpc.unwrap(uw), bucket_cap_mb=SMALL)
    out["rewrapped_err"] = averaged_step_error(um, uw, *batch(342), rank)
    # An output the loss ignores (a Hugging Face model's pooler_output): its parameters are
    # unused, as under torch DDP. They got zero gradients (the sink on the outputs handed
    # autograd zeros for the ignored output), so AdamW decayed them, with no warning.
    class Pooled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(6, 16)
            self.pooler = torch.nn.Linear(16, 2)

        def forward(self, x):
            h = torch.tanh(self.body(x))
            return {"last_hidden_state": h, "pooler_output": self.pooler(h)}

    for flag in (True, False):
        pm = make(Pooled, rank, torch.float64)
        pw = ddpc.wrap_model(pm, bucket_cap_mb=SMALL, find_unused_parameters=flag)
        x, _ = batch(350)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pw(shard(x, rank))["last_hidden_state"].square().mean().backward()
        out[f"pooler_{flag}"] = [None if p.grad is None else p.grad.abs().max().item()
                                 for p in pm.pooler.parameters()]
        out[f"pooler_warned_{flag}"] = any("pooler.weight" in str(w.message) for w in caught)
    return out


def sc_buffer_rule(rank):
    """Buffers are broadcast from rank 0 before a forward when the forward before it ran with
    autograd on outside no_sync (and before the first), as torch DDP decides it: so the first
    evaluation forward after training sees rank 0's BatchNorm statistics on every rank."""
    import ddpc

    class Buf(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 3)
            self.register_buffer("b", torch.zeros(2))

        def forward(self, x):
            return self.lin(x)

    model = Buf().double()
    wrapped = ddpc.wrap_model(model)
    x, _ = batch(400)
    seen = []
    for step, mode in enumerate(["grad", "no_grad", "no_grad", "grad", "no_sync", "grad",
                                 "no_grad"]):
        model.b.fill_(10.0 * rank + step)
        if mode == "no_grad":
            with torch.no_grad():
                wrapped(x)
        elif mode == "no_sync":
            with wrapped.no_sync():
                wrapped(x).sum().backward()
        else:
            wrapped(x).sum().backward()
        seen.append(model.b[0].item() == step)  # rank 0's value: broadcast before this forward
    # An evaluation forward through the wrapper on rank 0 alone: its broadcast of the buffers
    # meets rank 1's next collective, and rank 0's error says where the broadcast came from.
    # (In a group of its own, which the mismatch aborts, beside the default one.)
    side = ddpc.new_group(timeout=20)
    w2 = ddpc.wrap_model(Buf().double(), group=side)
    w2(x).sum().backward()
    error = None
    try:
        if rank == 0:
            with torch.no_grad():
                w2(x)
        else:
            ddpc.barrier(group=side)
    except ddpc.DistributedError as e:
        error = f"{type(e).__name__}: {e}"
    ddpc.destroy_process_group(side)
    ddpc.barrier()  # the default group goes on
    return {"synced": seen, "error": error}


def sc_compile(rank):
    """torch.compile of the wrapped model: the module's forward is compiled (one graph), the
    wrapper's work runs around it, and gradients are averaged as without compile (the sink's
    backward used to call the model itself, with no inputs). Also the copies: deepcopy and
    pickling say to copy the unwrapped module."""
    import pickle
    from torch._dynamo.utils import counters
    import ddpc
    model = make(MLP, rank, torch.float64)
    wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
    compiled = torch.compile(wrapped, backend="aot_eager")
    counters.clear()
    errs = [averaged_step_error(model, compiled, *batch(500 + step), rank) for step in range(3)]
    out = {"errs": errs, "graphs": counters["stats"]["unique_graphs"], "copies": []}
    for copier in (copy.deepcopy, pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
        try:
            copier(wrapped)
            out["copies"].append(None)
        except TypeError as e:
            out["copies"].append(str(e))
    return out


def sc_changed_after_wrap(rank):
    """The module inside converted after the wrap (ddpc.unwrap(model).double()): the buckets are
    rebuilt as for the wrapper's own .double() (the end of backward used to fail inside torch).
    A parameter replaced after the wrap is named (its new gradient was silently not averaged)."""
    import ddpc
    model = make(MLP, rank, torch.float32)
    wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
    x, y = batch(600)
    mse(wrapped(shard(x, rank).float()), shard(y, rank).float()).backward()
    model.double()
    errs = [averaged_step_error(model, wrapped, *batch(601 + step), rank) for step in range(2)]
    dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})
    first = next(n for n, _ in model.named_parameters())
    mod_name, attr = first.rsplit(".", 1)
    owner = model.get_submodule(mod_name)
    setattr(owner, attr, torch.nn.Parameter(getattr(owner, attr).detach().clone()))
    x, y = batch(603)
    try:
        mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
        replaced = None
    except RuntimeError as e:
        replaced = str(e)
    out = {"errs": errs, "dtypes": dtypes, "replaced": replaced, "first": first}
    # Resized after the wrap, as Hugging Face's resize_token_embeddings does it (.data = a larger
    # tensor, the same Parameter), with gradients held as bucket views and with none: the next
    # forward names the parameter and says to wrap again, which then averages. (It failed inside
    # torch at backward; a shrunk one made the gradient copy read past its end.)
    resized = []
    # after 1 step (caught as the layout learnt in it is built) and after 2 (caught by the scan
    # of the gradients at the forward)
    for steps, set_to_none in ((1, False), (2, True), (2, False)):
        model = make(MLP, rank, torch.float64)
        wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
        for _ in range(steps):
            mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
        model.zero_grad(set_to_none=set_to_none)
        with torch.no_grad():
            model.out.weight.data = torch.cat([model.out.weight, model.out.weight[:1]])
            model.out.bias.data = model.out.bias[:2].clone()
        try:
            wrapped(shard(x, rank))
            resized.append(None)
        except ValueError as e:
            resized.append(str(e))
    model.out.weight.data = model.out.weight[:3].clone()
    model.out.bias.data = torch.cat([model.out.bias, model.out.bias[:1]])
    out["resized"] = resized
    model.out = torch.nn.Linear(16, 4).double()  # a wider head, on every rank alike
    wrapped = ddpc.wrap_model(ddpc.unwrap(wrapped), bucket_cap_mb=SMALL)
    wide = lambda t: torch.cat([t, t[:, :1]], 1)  # noqa: E731
    out["rewrapped_err"] = averaged_step_error(model, lambda t: wrapped(t), x, wide(y), rank)
    return out


def sc_fresh_slots(rank):
    """After zero_grad(set_to_none=True) a bucket gets uninitialized memory at its first
    gradient (each gradient is copied into its slot). With memory that held NaN just before,
    a parameter this step does not use (head_c, and head_a or head_b) must still end with exact
    zeros, the others with the average; also through backward(create_graph=True), whose
    gradients require grad and take the Python path."""
    import ddpc
    model = make(Branchy, rank, torch.float64)
    wrapped = ddpc.wrap_model(model)  # one bucket: used and unused parameters share it
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    n = sum(p.numel() for p in model.parameters())
    out = {"errs": [], "unused": [], "nbuckets": len(wrapped._buckets)}
    for step in range(4):
        x, y = batch(70 + step)
        branch = step % 2
        expected = None
        for r in range(WORLD):
            g = local_grads(model, lambda m, r=r: mse(m(shard(x, r), branch), shard(y, r)))
            expected = g if expected is None else [a + b for a, b in zip(expected, g)]
        expected = [e / WORLD for e in expected]
        opt.zero_grad(set_to_none=True)
        loss = mse(wrapped(shard(x, rank), branch), shard(y, rank))
        junk = torch.full((n,), float("nan"), dtype=torch.float64)  # freed: its memory is
        del junk                                                   # handed out next
        loss.backward(create_graph=step >= 2)
        out["errs"].append(max((p.grad.detach() - e).abs().max().item()
                               for p, e in zip(model.parameters(), expected)))
        idle = [model.head_c, model.head_b if branch == 0 else model.head_a]
        out["unused"].append(max(p.grad.abs().max().item() for m in idle
                                 for p in m.parameters()))
        opt.step()
    return out


def sc_no_sync(rank):
    import ddpc
    model = make(Branchy, rank, torch.float64)
    wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    out = {"local_errs": [], "errs": []}
    for rnd in range(3):
        x, y = batch(10 + rnd, n=3 * WORLD * B)
        micro = [(x[k * WORLD * B:(k + 1) * WORLD * B], y[k * WORLD * B:(k + 1) * WORLD * B])
                 for k in range(3)]
        # micro-batches 0 and 1 use head_b under no_sync; the synced micro-batch 2 uses head_a, so
        # head_b's accumulated gradient must survive the synced step although it got none there.
        branches = [1, 1, 0]

        def loss_of(m, r, k):
            return mse(m(shard(micro[k][0], r), branches[k]), shard(micro[k][1], r))

        expected = None
        for r in range(WORLD):
            for k in range(3):
                g = local_grads(model, lambda m: loss_of(m, r, k))
                expected = g if expected is None else [a + b for a, b in zip(expected, g)]
        expected = [e / WORLD for e in expected]
        mine0 = local_grads(model, lambda m: loss_of(m, rank, 0))
        opt.zero_grad()
        if rnd == 1:
            # torch DDP's attribute, which some trainers set instead of entering no_sync()
            wrapped.require_backward_grad_sync = False
        out.setdefault("flags", []).append(wrapped.require_backward_grad_sync)
        with wrapped.no_sync() if rnd != 1 else contextlib.nullcontext():
            out["flags"].append(wrapped.require_backward_grad_sync)
            loss_of(wrapped, rank, 0).backward()
            # No end-of-backward pass inside no_sync: as in single-process training, a gradient
            # that never arrived may still be None (when its whole bucket stayed released).
            out["local_errs"].append(max(
                ((p.grad if p.grad is not None else torch.zeros_like(p)) - e).abs().max().item()
                for p, e in zip(model.parameters(), mine0)))
            loss_of(wrapped, rank, 1).backward()
        wrapped.require_backward_grad_sync = True
        loss_of(wrapped, rank, 2).backward()
        out["errs"].append(max((p.grad - e).abs().max().item()
                               for p, e in zip(model.parameters(), expected)))
        opt.step()
    return out


def sc_weight_sharing(rank):
    import ddpc
    model = make(TiedLM, rank, torch.float64)
    ref = reference(TiedLM, torch.float64)
    wrapped = ddpc.wrap_model(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    errs = []
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        tok = torch.randint(0, 11, (WORLD * B, 5), generator=g)
        tgt = torch.randint(0, 11, (WORLD * B, 5), generator=g)

        def loss(m, t, y):
            return torch.nn.functional.cross_entropy(m(t).reshape(-1, 11), y.reshape(-1))

        opt.zero_grad()
        loss(wrapped, shard(tok, rank), shard(tgt, rank)).backward()
        opt.step()
        ropt.zero_grad()
        loss(ref, tok, tgt).backward()
        ropt.step()
        errs.append(max_diff(model, ref))
    return {"errs": errs, "nparams": len(list(model.parameters()))}


def sc_checkpoint(rank):
    import ddpc
    out = {}
    for reentrant in (True, False):
        model = make(Checkpointed, rank, torch.float64, reentrant)
        ref = reference(Checkpointed, torch.float64, reentrant)
        ref.use_checkpoint = False
        # one bucket per parameter: a bucket launched before its weight's second gradient
        # arrived would be wrong (and is reported as an error)
        wrapped = ddpc.wrap_model(model, bucket_cap_mb=1e-5)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        errs = []
        for step in range(5):
            x, y = batch(20 + step)
            opt.zero_grad()
            mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
            opt.step()
            ropt.zero_grad()
            mse(ref(x), y).backward()
            ropt.step()
            errs.append(max_diff(model, ref))
        names = wrapped._names
        out[f"reentrant={reentrant}"] = {
            "errs": errs, "late": sorted(n for n, lt in zip(names, wrapped._late) if lt)}
    return out


class TwiceCheckpointed(torch.nn.Module):
    """A block used in two reentrant checkpoint segments: each of its parameters gets two
    gradients in one backward. Between them, `between` runs (a tensor hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 256)
        self.block = torch.nn.Linear(256, 256)
        self.out = torch.nn.Linear(256, 3)

    def forward(self, x, between=None):
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(self.block, self.inp(x), use_reentrant=True)
        if between is not None:
            h.register_hook(between)
        return self.out(checkpoint(self.block, h, use_reentrant=True))


def sc_stream_switch(rank):
    """A parameter whose second gradient of the step comes on another stream than its first
    (the hooks' stream changed between two checkpoint segments, as it does on a GPU when the
    segments run on different streams): its first gradient's copy, queued at the switch, must not
    be read again once the newer one replaced it. Errors against the exact average, per step."""
    import ddpc
    model = make(TwiceCheckpointed, rank, torch.float64)
    ref = reference(TwiceCheckpointed, torch.float64)
    wrapped = ddpc.wrap_model(model)
    errs = []

    def switch(g):
        wrapped._grad_hooks.stream = 7  # (on the host the stream only tells batches apart)

    for step in range(3):
        x, y = batch(60 + step)
        for p in model.parameters():
            p.grad = None
        wrapped._grad_hooks.stream = 0
        mse(wrapped(shard(x, rank), switch), shard(y, rank)).backward()
        expected = None
        for r in range(WORLD):
            g = local_grads(ref, lambda m, r=r: mse(m(shard(x, r)), shard(y, r)))
            expected = g if expected is None else [a + b for a, b in zip(expected, g)]
        errs.append(max((p.grad - e / WORLD).abs().max().item()
                        for p, e in zip(model.parameters(), expected)))
    return {"errs": errs}


def _bucket_ranges(wrapped):
    return [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in wrapped._buckets]


def sc_zero_grad(rank):
    import ddpc
    model = make(MLP, rank, torch.float64)
    wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    modes = ["none", "zero", "none_after_forward", "zero", "none", "none_after_forward"]
    out = {"errs": [], "views": [], "modes": modes}
    for step, mode in enumerate(modes):
        x, y = batch(30 + step)
        expected = None
        for r in range(WORLD):
            g = local_grads(model, lambda m, r=r: mse(m(shard(x, r)), shard(y, r)))
            expected = g if expected is None else [a + b for a, b in zip(expected, g)]
        expected = [e / WORLD for e in expected]
        if mode == "none":
            opt.zero_grad(set_to_none=True)
        elif mode == "zero":
            opt.zero_grad(set_to_none=False)
        loss = mse(wrapped(shard(x, rank)), shard(y, rank))
        if mode == "none_after_forward":
            opt.zero_grad(set_to_none=True)
        loss.backward()
        ranges = _bucket_ranges(wrapped)
        out["views"].append(all(
            p.grad is not None and any(lo <= p.grad.data_ptr() and
                                       p.grad.data_ptr() + p.grad.numel() * 8 <= hi
                                       for lo, hi in ranges)
            for p in model.parameters()))
        out["errs"].append(max((p.grad - e).abs().max().item()
                               for p, e in zip(model.parameters(), expected)))
        opt.step()
    return out


def sc_host_times(rank):
    """DistributedModel.host_times(): what three synced steps and one no_sync step cost the
    wrapper on the host, then what is left after the reset."""
    import ddpc
    model = make(MLP, rank, torch.float64)
    wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
    wrapped.host_times()  # (construction is not a step)
    for step in range(3):
        x, y = batch(90 + step)
        for p in model.parameters():
            p.grad = None
        mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
    synced = wrapped.host_times(reset=False)
    with wrapped.no_sync():
        x, y = batch(93)
        mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
    return {"synced": synced, "after_no_sync": wrapped.host_times(), "reset": wrapped.host_times(),
            "nparams": len(list(model.parameters()))}


def sc_retain_graph(rank):
    """Two backward passes through one forward's graph: both are averaged."""
    import ddpc
    model = make(MLP, rank, torch.float64)
    wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
    errs = []
    for step in range(3):
        x, y = batch(70 + step)
        expected = None
        for r in range(WORLD):
            g = local_grads(model, lambda m, r=r: 3 * mse(m(shard(x, r)), shard(y, r)))
            expected = g if expected is None else [a + b for a, b in zip(expected, g)]
        expected = [e / WORLD for e in expected]
        for p in model.parameters():
            p.grad = None
        loss = mse(wrapped(shard(x, rank)), shard(y, rank))
        loss.backward(retain_graph=True)
        (2 * loss).backward()
        errs.append(max((p.grad - e).abs().max().item()
                        for p, e in zip(model.parameters(), expected)))
    # After the step, a backward through the unwrapped module on rank 0 alone (a gradient-norm
    # probe) stays local, as with torch DDP: it used to start an all-reduce, which then paired
    # with rank 1's next step and averaged the wrong steps' gradients with no error.
    probe_err = None
    if rank == 0:
        x, y = batch(80)
        want = local_grads(model, lambda m: mse(m(x), y))
        for p in model.parameters():
            p.grad = None
        mse(ddpc.unwrap(wrapped)(x), y).backward()
        probe_err = max((p.grad - w).abs().max().item() for p, w in zip(model.parameters(), want))
    after = [averaged_step_error(model, wrapped, *batch(90 + step), rank) for step in range(2)]
    return {"errs": errs, "probe_err": probe_err, "after_probe": after}


def sc_bf16(rank):
    import ddpc
    model = make(MLP, rank, torch.float32)
    wrapped = ddpc.wrap_model(model, grad_dtype=torch.bfloat16)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    worst, max_err, where = [], [], []
    # Steps 0-2 as usual (gradients set to None: each goes to the wire from where autograd left
    # it, and the float32 buckets never get memory), 3-4 with gradients kept and zeroed in place
    # (they live in their bucket slots and go to the wire from there).
    for step in range(5):
        x, y = batch(40 + step, torch.float32)
        per_rank = [local_grads(model, lambda m, r=r: mse(m(shard(x, r)), shard(y, r)))
                    for r in range(WORLD)]
        opt.zero_grad(set_to_none=step < 3)
        mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
        views = [v for v in wrapped._views if v is not None]
        in_slots = [any(p.grad is v for v in views) for p in model.parameters()]
        memory = [b is not None and not wrapped._parked[k] for k, b in enumerate(wrapped._buckets)]
        where.append((all(in_slots), not any(in_slots), any(memory)))
        ratio, err = 0.0, 0.0
        for k, p in enumerate(model.parameters()):
            exact = sum(g[k].double() for g in per_rank) / WORLD
            scale = sum(g[k].double().abs() for g in per_rank) / WORLD
            e = (p.grad.double() - exact).abs()
            # bf16 keeps 8 significant bits: a rounding errs by at most 2**-8 of its value. The
            # casts (halved by the average), the rounded sum (halved) and the division add up
            # to at most 3 * 2**-8 * scale, below the 2**-6 * scale allowed here.
            ratio = max(ratio, (e / (2.0 ** -6 * scale + 1e-30)).max().item())
            err = max(err, e.max().item())
        worst.append(ratio)
        max_err.append(err)
        opt.step()
    return {"ratio": worst, "err": max_err, "where": where}


def sc_mismatch(rank):
    import ddpc

    class Net(torch.nn.Module):
        def __init__(self, n_in, extra=False):
            super().__init__()
            self.fc = torch.nn.Linear(n_in, 10)
            if extra:
                self.extra = torch.nn.Linear(2, 2)

    out = {}
    frozen = Net(4)
    frozen.fc.bias.requires_grad_(rank == 0)
    for case, model, kwargs in (
            ("shape", Net(4 if rank == 0 else 5), {}),
            ("frozen", frozen, {}),
            ("extra", Net(4, extra=rank == 1), {}),
            # settings the collectives depend on: different bucket layouts would pair
            # collectives of different lengths
            ("cap", Net(4), {"bucket_cap_mb": 25 if rank == 0 else 0.5}),
            ("dtype", Net(4), {"grad_dtype": torch.bfloat16} if rank == 1 else {}),
            ("buffers", Net(4), {"broadcast_buffers": rank == 0}),
            ("tail", Net(4), {}), ("comm_casts", Net(4), {}), ("same_words", Net(4), {})):
        env = {  # (read by the reducer as it assigns the buckets and queues the collectives)
            "tail": {"DDPC_TAIL_BUCKET_MB": str(rank)},
            "comm_casts": {"DDPC_COMM_CASTS": str(rank)},
            # the same settings in other words: no mismatch
            "same_words": ({"DDPC_CAST_BACK": "Overlap", "DDPC_COMM_CASTS": "true"} if rank == 0
                           else {"DDPC_CAST_BACK": "overlap", "DDPC_COMM_CASTS": "1"}),
        }.get(case, {})
        os.environ.update(env)
        try:
            ddpc.wrap_model(model, **kwargs)
            out[case] = None
        except ddpc.MismatchError as e:
            out[case] = str(e)
        finally:
            for k in env:
                del os.environ[k]
    ok = ddpc.wrap_model(Net(4))  # the group is still usable
    out["after"] = len(ok._params)
    return out


def sc_state_dict(rank):
    import ddpc
    model = make(WithBuffer, rank, torch.float32)
    if rank == 1:
        model.scale.fill_(5.0)
    wrapped = ddpc.wrap_model(model)
    out = {"keys_equal": list(wrapped.state_dict().keys()) == list(model.state_dict().keys()),
           "no_prefix": not any(k.startswith("module.") for k in wrapped.state_dict()),
           "attr": wrapped.fc is model.fc and wrapped.bn is model.bn,
           "unwrap": ddpc.unwrap(wrapped) is model and ddpc.unwrap(model) is model}
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["fc.bias"].fill_(0.25)
    wrapped.load_state_dict(sd)
    out["loaded"] = bool((model.fc.bias == 0.25).all())
    outer = torch.nn.ModuleDict({"m": wrapped})
    osd = outer.state_dict()
    out["nested_keys"] = sorted(osd) == sorted("m." + k for k in model.state_dict())
    osd["m.fc.bias"].fill_(0.5)
    outer.load_state_dict(osd)
    out["nested_loaded"] = bool((model.fc.bias == 0.5).all())
    # buffers: rank 1's scale was 5; the wrap and every forward copy rank 0's
    model.scale.fill_(1.0 + rank)
    x, _ = batch(50, torch.float32)
    wrapped(shard(x, rank)).sum().backward()
    out["scale"] = model.scale.tolist()
    # a buffer replaced by assignment, and one registered after the wrap, follow rank 0 too
    model.scale = torch.full((3,), 7.0 + rank)
    model.fc.register_buffer("late", torch.full((2,), float(rank)))
    wrapped(shard(x, rank)).sum().backward()
    out["replaced"] = model.scale.tolist()
    out["late"] = model.fc.late.tolist()
    return out


class SmallConv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3)
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3)))


def sc_memory_format(rank):
    """.to(memory_format=torch.channels_last) after wrap_model, with gradients held: torch
    re-points each param.grad (a bucket view) at new memory through .data, leaving dtype and
    device alone; the reducer must follow, or it averages memory no gradient lives in."""
    import warnings

    import ddpc
    model = make(SmallConv, rank, torch.float64)
    wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
    errs = []
    for step in range(4):
        g = torch.Generator().manual_seed(80 + step)
        x = torch.randn(WORLD * B, 2, 5, 5, generator=g, dtype=torch.float64)
        y = torch.randn(WORLD * B, 3, generator=g, dtype=torch.float64)
        expected = None
        for r in range(WORLD):
            loc = local_grads(model, lambda m, r=r: mse(m(shard(x, r)), shard(y, r)))
            expected = loc if expected is None else [a + b for a, b in zip(expected, loc)]
        if step == 2:  # after the first step's layout change, which rebuilds the buckets anyway
            with warnings.catch_warnings():
                # torch notes that the (contiguous) bucket views no longer match the layout
                warnings.simplefilter("ignore")
                wrapped.to(memory_format=torch.channels_last)
        for p in model.parameters():
            if p.grad is not None:  # held through the .to() of step 2
                p.grad.zero_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
        errs.append(max((p.grad - e / WORLD).abs().max().item()
                        for p, e in zip(model.parameters(), expected)))
    out = {"errs": errs, "channels_last": model.conv.weight.is_contiguous(
        memory_format=torch.channels_last)}
    # A model in channels_last from the start: each gradient has its parameter's strides, as
    # torch DDP's bucket views do, so a fused optimizer, which reads a parameter and its
    # gradient as flat memory, updates the right elements (it silently did not).
    model = make(SmallConv, rank, torch.float64).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(model)  # (rank 0's after the wrap: compared below)
    wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, fused=True)
    for step in range(3):
        g = torch.Generator().manual_seed(90 + step)
        x = torch.randn(WORLD * B, 2, 5, 5, generator=g, dtype=torch.float64)
        y = torch.randn(WORLD * B, 3, generator=g, dtype=torch.float64)
        opt.zero_grad()
        mse(wrapped(shard(x, rank).contiguous(memory_format=torch.channels_last)),
            shard(y, rank)).backward()
        opt.step()
        ref_opt.zero_grad()
        mse(ref(x.contiguous(memory_format=torch.channels_last)), y).backward()
        ref_opt.step()
        if step == 0:
            wrapped.host_times()  # (reset: the first step rebuilds the buckets in Python)
    out["strides_match"] = all(p.grad.stride() == p.stride() for p in model.parameters())
    out["fused_err"] = max((p - q).abs().max().item()
                           for p, q in zip(model.parameters(), ref.parameters()))
    # The C hooks copy a gradient with its slot's strides as one block; none went the Python
    # way after the first step.
    out["python_path_ms"] = wrapped.host_times()["python"]
    # Cast straight to a bf16 wire from where it lies, the gradient of a channels_last weight
    # averages to the same values as the row-major model's (each element on its own).
    grads = {}
    for fmt in (torch.contiguous_format, torch.channels_last):
        model = make(SmallConv, rank, torch.float32).to(memory_format=fmt)
        wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL, grad_dtype=torch.bfloat16)
        for step in range(3):
            g = torch.Generator().manual_seed(95 + step)
            x = torch.randn(WORLD * B, 2, 5, 5, generator=g)
            y = torch.randn(WORLD * B, 3, generator=g)
            model.zero_grad()
            mse(wrapped(shard(x, rank).contiguous(memory_format=fmt)), shard(y, rank)).backward()
        grads[fmt] = [p.grad.clone() for p in model.parameters()]
    out["bf16_layouts_equal"] = all(torch.equal(a, b) for a, b in zip(*grads.values()))
    return out


class _Boom(torch.autograd.Function):
    """Identity whose backward raises: a backward pass that fails half way."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom")


class Fails(MLP):
    def forward(self, x, fail=False):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return self.out(_Boom.apply(h) if fail else h)


def sc_failed_backward(rank):
    """A synced backward that raises after the output layer's bucket was launched, then
    gradient accumulation: the first forward after it, no_sync or not, waits for that
    collective and reports the lost step, so no in-flight reduction writes into the gradients
    accumulated next."""
    import ddpc
    model = make(Fails, rank, torch.float64)
    wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
    out = {}
    for step in range(2):  # the second step runs the observed layout, launching during backward
        x, y = batch(90 + step)
        for p in model.parameters():
            p.grad = None
        mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
    for p in model.parameters():
        p.grad = None
    try:
        mse(wrapped(shard(x, rank), fail=True), shard(y, rank)).backward()
    except RuntimeError as e:
        out["backward"] = str(e)
    for p in model.parameters():
        p.grad = None
    with wrapped.no_sync():
        try:
            wrapped(shard(x, rank))
            out["next_forward"] = None
        except ValueError as e:
            out["next_forward"] = str(e)
        x, y = batch(92)
        mine = local_grads(model, lambda m: mse(m(shard(x, rank)), shard(y, rank)))
        mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
    out["local_err"] = max((p.grad - e).abs().max().item()
                           for p, e in zip(model.parameters(), mine))
    return out


def sc_amp(rank):
    import ddpc
    model = make(MLP, rank, torch.float32)
    wrapped = ddpc.wrap_model(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    norms = []
    for step in range(4):
        x, y = batch(60 + step, torch.float32)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = mse(wrapped(shard(x, rank)), shard(y, rank)).float()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 0.5).item())
        scaler.step(opt)
        scaler.update()
    return {"norms": norms, "params": [p.detach().reshape(-1).tolist() for p in model.parameters()]}


def sc_comm_hook(rank):
    """torch DDP's register_comm_hook with torch's own hooks: the same gradients, bit for bit, as
    wrap_model with the grad_dtype the hook amounts to; other hooks and misuse raise."""
    import ddpc
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    def grads_of(hook, grad_dtype):
        model = make(MLP, rank, torch.float32)
        wrapped = ddpc.wrap_model(model, grad_dtype=grad_dtype, bucket_cap_mb=SMALL)
        if hook is not None:
            wrapped.register_comm_hook(None, hook)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        out = []
        for step in range(3):  # (the second step on the observed bucket order)
            x, y = batch(130 + step, torch.float32)
            opt.zero_grad()
            mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
            out.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        return out

    def same(a, b):
        return all(torch.equal(u, v) for sa, sb in zip(a, b) for u, v in zip(sa, sb))

    plain = grads_of(None, None)
    bf16 = grads_of(None, torch.bfloat16)
    fp16 = grads_of(None, torch.float16)
    out = {"bf16_differs": not same(plain, bf16), "fp16_differs": not same(plain, fp16),
           "allreduce": same(grads_of(dh.allreduce_hook, None), plain),
           "bf16_hook": same(grads_of(dh.bf16_compress_hook, None), bf16),
           "fp16_hook": same(grads_of(dh.fp16_compress_hook, None), fp16),
           "bf16_wrapper": same(grads_of(dh.bf16_compress_wrapper(dh.allreduce_hook), None), bf16),
           "fp16_wrapper": same(grads_of(dh.fp16_compress_wrapper(dh.allreduce_hook), None), fp16),
           "same_dtype": same(grads_of(dh.bf16_compress_hook, torch.bfloat16), bf16)}
    wrapped = ddpc.wrap_model(make(MLP, rank, torch.float32))
    errors = {}
    for name, call in [
            ("powersgd", lambda: wrapped.register_comm_hook(None, psgd.powerSGD_hook)),
            ("wrapped_powersgd", lambda: wrapped.register_comm_hook(
                None, dh.fp16_compress_wrapper(psgd.powerSGD_hook))),
            ("own", lambda: wrapped.register_comm_hook(None, lambda state, bucket: None)),
            ("not_callable", lambda: wrapped.register_comm_hook(None, "fp16")),
            ("state", lambda: wrapped.register_comm_hook(object(), dh.bf16_compress_hook)),
            ("conflict", lambda: ddpc.wrap_model(make(MLP, rank, torch.float32),
                                                 grad_dtype=torch.float16)
             .register_comm_hook(None, dh.bf16_compress_hook))]:
        try:
            call()
            errors[name] = None
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
    x, y = batch(140, torch.float32)
    loss = mse(wrapped(shard(x, rank)), shard(y, rank))
    try:
        wrapped.register_comm_hook(None, dh.bf16_compress_hook)
        errors["mid_step"] = None
    except Exception as e:
        errors["mid_step"] = f"{type(e).__name__}: {e}"
    loss.backward()
    wrapped.register_comm_hook(wrapped._group, dh.bf16_compress_hook)
    try:
        wrapped.register_comm_hook(None, dh.bf16_compress_hook)
        errors["twice"] = None
    except Exception as e:
        errors["twice"] = f"{type(e).__name__}: {e}"
    other = ddpc.wrap_model(make(MLP, rank, torch.float32))
    try:
        other.register_comm_hook(None, dh.bf16_compress_hook if rank == 0 else
                                 dh.fp16_compress_hook)
        errors["mismatch"] = None
    except Exception as e:
        errors["mismatch"] = f"{type(e).__name__}: {e}"
    # the group goes on: a step of the model that registered its hook
    x, y = batch(141, torch.float32)
    mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
    out["errors"] = errors
    return out


def sc_join(rank):
    """join() with uneven inputs: the ranks that run out stand in for the others' steps (buffer
    broadcasts, all-reduces of zeros), and at the end every rank holds the last one's model, the
    same as one process averaging what each step's ranks computed."""
    import ddpc

    def run(cls, batches, divide, accumulate):
        model = make(cls, rank, torch.float64)
        wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        with wrapped.join(divide_by_initial_world_size=divide):
            for k in range(batches[rank]):
                x, y = batch(150 + k)
                opt.zero_grad()
                if accumulate:  # a no_sync forward first, its gradient added to the next one's
                    with wrapped.no_sync():
                        mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
                mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
                opt.step()
        ref = make(MLP, 0, torch.float64)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for k in range(max(batches.values())):
            x, y = batch(150 + k)
            running = [r for r in range(WORLD) if k < batches[r]]
            per_rank = [local_grads(ref, lambda m, r=r: mse(m(shard(x, r)), shard(y, r)))
                        for r in running]
            for i, p in enumerate(ref.parameters()):
                total = sum(g[i] for g in per_rank) * (2 if accumulate else 1)
                p.grad = total / (WORLD if divide else len(running))
            ref_opt.step()
        err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        return err, model

    out = {}
    out["err_divide"], counted = run(Counted, {0: 5, 1: 3}, True, False)
    out["seen"] = counted.seen.item()
    out["err_running"], _ = run(MLP, {0: 2, 1: 4}, False, True)
    out["err_even"], _ = run(MLP, {0: 3, 1: 3}, True, False)
    # embedding lookups routed (DDPC_EMBEDDING_ROWS=1) before and after the block, not inside it
    rows = {}
    for mode in ("1", "0"):
        os.environ["DDPC_EMBEDDING_ROWS"] = mode
        try:
            model = make(TiedLM, rank, torch.float64)
            wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
        finally:
            del os.environ["DDPC_EMBEDDING_ROWS"]
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)

        def step(k):
            tokens = torch.randint(0, 11, (B, 5), generator=torch.Generator().manual_seed(
                200 + 10 * k + rank))
            opt.zero_grad()
            wrapped(tokens).pow(2).mean().backward()
            opt.step()

        for k in range(2):
            step(k)
        with wrapped.join():
            for k in range(2, 4 if rank == 0 else 6):
                step(k)
        step(6)
        rows[mode] = (model, len(wrapped._routes))
    out["rows_routes"] = rows["1"][1]
    out["rows_err"] = max((p - q).abs().max().item()
                          for p, q in zip(rows["1"][0].parameters(), rows["0"][0].parameters()))
    # throw_on_early_termination: rank 1 runs out after 2 batches, rank 0 has 4
    model = make(MLP, rank, torch.float64)
    wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
    steps = 0
    try:
        with wrapped.join(throw_on_early_termination=True):
            for k in range(4 if rank == 0 else 2):
                x, y = batch(160 + k)
                mse(wrapped(shard(x, rank)), shard(y, rank)).backward()
                steps += 1
        out["throw"] = None
    except RuntimeError as e:
        out["throw"] = str(e)
    out["throw_steps"] = steps
    x, y = batch(170)
    for p in model.parameters():
        p.grad = None
    mse(wrapped(shard(x, rank)), shard(y, rank)).backward()  # the group goes on
    mine = local_grads(model, lambda m: mse(m(shard(x, 0)), shard(y, 0)))
    other = local_grads(model, lambda m: mse(m(shard(x, 1)), shard(y, 1)))
    out["after_throw_err"] = max((p.grad - (a + b) / 2).abs().max().item()
                                 for p, a, b in zip(model.parameters(), mine, other))
    errors = {}
    for name, call in [("enable", lambda: wrapped.join(enable="yes").__enter__()),
                       ("divide", lambda: wrapped.join(divide_by_initial_world_size=1)
                        .__enter__())]:
        try:
            call()
            errors[name] = None
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
    with wrapped.join():
        try:
            with wrapped.join():
                pass
            errors["nested"] = None
        except Exception as e:
            errors["nested"] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    return out


SCENARIOS = [
    ("equivalence", _equivalence_runs),
    ("branches", sc_branches),
    ("no_sync", sc_no_sync),
    ("weight_sharing", sc_weight_sharing),
    ("checkpoint", sc_checkpoint),
    ("zero_grad", sc_zero_grad),
    ("retain_graph", sc_retain_graph),
    ("bf16", sc_bf16),
    ("mismatch", sc_mismatch),
    ("state_dict", sc_state_dict),
    ("amp", sc_amp),
    ("memory_format", sc_memory_format),
    ("failed_backward", sc_failed_backward),
    ("fresh_slots", sc_fresh_slots),
    ("unused", sc_unused),
    ("buffer_rule", sc_buffer_rule),
    ("compile", sc_compile),
    ("changed_after_wrap", sc_changed_after_wrap),
    ("host_times", sc_host_times),
    ("stream_switch", sc_stream_switch),
    ("comm_hook", sc_comm_hook),
    ("join", sc_join),
]


def _worker(rank, port, results):
    os.environ["DDPC_TOKEN"] = "test-wrap-model"
    torch.set_num_threads(1)
    import ddpc
    ddpc.init_process_group(backend="cpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=30)
    report_scenarios(SCENARIOS, rank, results)
    ddpc.destroy_process_group()


@pytest.fixture(scope="module")
def runs():
    return spawn_scenarios(_worker, WORLD, 150)


def result(runs, name):
    return scenario_result(runs, name)


# ------------------------------------------------------------------ tests


def test_matches_single_process_on_the_combined_batch(runs):
    for rank, r in enumerate(result(runs, "equivalence")):
        for opt in ("sgd", "adam"):
            if rank == 1:
                assert r[f"{opt}_f64_differs_before"] > 1e-3  # so the broadcast had work to do
            assert r[f"{opt}_f64_after_wrap"] == 0.0 and r[f"{opt}_f32_after_wrap"] == 0.0
            assert len(r[f"{opt}_f64_err"]) == 6
            assert max(r[f"{opt}_f64_err"]) < 1e-10, (opt, r[f"{opt}_f64_err"])
            torch_err = max(r[f"{opt}_torch32_err"])
            assert torch_err > 0
            # float32 ddpc is as close to float64 as torch's own float32 run, within 2x
            assert max(r[f"{opt}_f32_err"]) <= 2 * torch_err, (opt, r[f"{opt}_f32_err"], torch_err)


def test_different_branch_per_rank_gives_the_average(runs):
    for r in result(runs, "branches"):
        assert max(r["errs"]) < 1e-12, r["errs"]
        assert max(r["head_c"]) == 0.0


def test_fresh_bucket_memory_ends_with_zeros_for_unused_parameters(runs):
    for r in result(runs, "fresh_slots"):
        assert r["nbuckets"] == 1, r
        assert len(r["errs"]) == 4 and max(r["errs"]) < 1e-12, r["errs"]
        assert r["unused"] == [0.0] * 4, r["unused"]


def test_no_sync_accumulates_locally_then_averages_the_sum(runs):
    outs = result(runs, "no_sync")
    for r in outs:
        assert max(r["local_errs"]) < 1e-12, r["local_errs"]  # not averaged inside no_sync
        assert max(r["errs"]) < 1e-12, r["errs"]
        assert r["flags"] == [True, False, False, False, True, False], r["flags"]


def test_weight_sharing(runs):
    for r in result(runs, "weight_sharing"):
        assert r["nparams"] == 3
        assert max(r["errs"]) < 1e-10, r["errs"]


def test_checkpointing_reentrant_and_not(runs):
    for r in result(runs, "checkpoint"):
        for reentrant in (True, False):
            case = r[f"reentrant={reentrant}"]
            assert max(case["errs"]) < 1e-10, (reentrant, case["errs"])
        # a weight used in two reentrant segments gets two gradients per backward: reduced last
        assert r["reentrant=True"]["late"] == ["block.0.bias", "block.0.weight"]
        assert r["reentrant=False"]["late"] == []


def test_zero_grad_modes_keep_grads_as_bucket_views(runs):
    for r in result(runs, "zero_grad"):
        assert all(r["views"]), list(zip(r["modes"], r["views"]))
        assert max(r["errs"]) < 1e-12, list(zip(r["modes"], r["errs"]))


def test_find_unused_parameters_leaves_unused_gradients_none_as_torch_ddp(runs):
    heads = ["head_b.bias", "head_b.weight", "head_c.bias", "head_c.weight"]
    for r in result(runs, "unused"):
        assert r["none"] == [heads, heads[2:], heads[2:], heads[2:]], r["none"]
        assert len(r["errs"]) == 4 and max(r["errs"]) < 1e-12, r["errs"]
        assert r["plain_zero"]
        assert len(r["warnings"]) == 1, r["warnings"]
        assert ("parameter(s) ('head_b.weight', 'head_b.bias', 'head_c.weight', ...) got no "
                "gradient in this backward on rank") in r["warnings"][0], r["warnings"]
        assert ("Pass find_unused_parameters=True (as torch DDP needs when parameters go "
                "unused)") in r["warnings"][0], r["warnings"]
        assert r["frozen_none"] and r["frozen_moved"] == 0.0 and not r["frozen_warned"], r
        assert r["unfrozen"] is not None and r["unfrozen"].startswith(
            "parameter 'fc1.") and ("was frozen (requires_grad=False) when the model was "
                                    "wrapped, so ddpc does not average its gradient") in \
            r["unfrozen"], r
        assert r["rewrapped_err"] < 1e-12, r
        assert r["pooler_True"] == [None, None], r
        assert r["pooler_False"] == [0.0, 0.0] and r["pooler_warned_False"], r
        assert not r["pooler_warned_True"], r


def test_torch_compile_of_the_wrapped_model_and_copies(runs):
    for r in result(runs, "compile"):
        assert len(r["errs"]) == 3 and max(r["errs"]) < 1e-12, r["errs"]
        assert r["graphs"] >= 1, r
        deep, pickled, saved = r["copies"]
        assert deep.startswith("copy.deepcopy of a ddpc-wrapped model: copy "
                               "ddpc.unwrap(model) instead"), deep
        assert pickled.startswith("a ddpc-wrapped model cannot be pickled"), pickled
        assert saved == pickled


def test_a_module_changed_inside_the_wrapper(runs):
    for r in result(runs, "changed_after_wrap"):
        assert len(r["errs"]) == 2 and max(r["errs"]) < 1e-12, r["errs"]
        assert r["dtypes"] == ["torch.float64"], r
        assert r["replaced"] is not None and r["replaced"].startswith(
            f"parameter(s) '{r['first']}' of the wrapped module were replaced after wrap_model "
            f"(e.g. module.weight = nn.Parameter(...)): ddpc still reduces the old ones"), r
        assert r["resized"] == [
            "parameter 'out.weight' has shape (4, 16), but had (3, 16) when the model was "
            "wrapped: its size changed after wrap_model (resize_token_embeddings, or .data "
            "replaced), so its gradient no longer fits its place in the buckets. Resize before "
            "wrapping, or wrap again after resizing on every rank: model = "
            "ddpc.wrap_model(ddpc.unwrap(model))"] * 3, r["resized"]
        assert r["rewrapped_err"] < 1e-12, r


def test_buffers_are_broadcast_when_torch_ddp_would(runs):
    r0, r1 = result(runs, "buffer_rule")
    assert all(r0["synced"]), r0
    assert r1["synced"] == [True, True, False, False, True, False, True], r1
    assert r0["error"].startswith("MismatchError: ") and r1["error"].startswith("MismatchError"), \
        (r0, r1)
    assert r0["error"].endswith(
        "(that broadcast is this wrapped model's forward sending rank 0's buffers, as torch DDP "
        "does before the first forward after training: every rank must run that forward. To "
        "evaluate on one rank only, call ddpc.unwrap(model) there)"), r0


def test_second_backward_through_the_same_graph_is_averaged_too(runs):
    for rank, r in enumerate(result(runs, "retain_graph")):
        assert max(r["errs"]) < 1e-12, r["errs"]
        # and one through the unwrapped module, on rank 0 only, is not
        if rank == 0:
            assert r["probe_err"] < 1e-12, r
        assert len(r["after_probe"]) == 2 and max(r["after_probe"]) < 1e-12, r


def test_a_second_gradient_on_another_stream_replaces_the_first(runs):
    for r in result(runs, "stream_switch"):
        assert len(r["errs"]) == 3 and max(r["errs"]) < 1e-12, r["errs"]


def test_host_times_account_for_the_wrappers_own_host_work(runs):
    for r in result(runs, "host_times"):
        t, n = r["synced"], r["nparams"]
        assert t["steps"] == 3 and t["hook_calls"] == 3 * n, t
        assert t["forward"] > 0 and t["end_of_backward"] > 0 and t["wire"] == 0, t
        # the parts of the hooks' time are inside it
        assert 0 < t["memory"] + t["attach"] + t["python"] + t["mark"] <= t["hooks"], t
        # queueing copies and collectives happens inside the hooks (or at the end of backward)
        assert 0 < t["mark"] <= t["hooks"] and 0 < t["launch"] <= t["hooks"] + t[
            "end_of_backward"], t
        nosync = r["after_no_sync"]
        assert nosync["steps"] == 3 and nosync["hook_calls"] == 4 * n, nosync
        assert nosync["hooks"] > t["hooks"] and nosync["forward"] > t["forward"], nosync
        assert nosync["python"] > t["python"], nosync  # (a no_sync backward runs Python hooks)
        assert all(v == 0 for v in r["reset"].values()), r["reset"]


def test_bf16_reduction_is_close_to_fp32(runs):
    for r in result(runs, "bf16"):
        assert max(r["ratio"]) <= 1.0, r["ratio"]
        assert max(r["ratio"]) > 0.01  # errors of bf16 size: the wire really was bf16
        # (all in slots, none in slots, any bucket with memory) after each backward
        assert r["where"][:3] == [(False, True, False)] * 3, r["where"]
        assert r["where"][3:] == [(True, False, True)] * 2, r["where"]


def test_gpu_scenarios_pass_on_the_cpu_backend():
    """tests/test_gpu_wrap_model.py's scenarios, checked by that file's own checks, on 2 ranks of
    the cpu backend: among them bf16 gradients with unused parameters (on every rank, on one
    rank) and a gradient on the Python path, mixed in a bucket with gradients cast to the wire."""
    import test_gpu_wrap_model
    got = test_gpu_wrap_model.check_on_cpu(world=2)
    assert set(got) == {0, 1} and all(got[r]["bf16_mixed"][0] == "ok" for r in got), got


def test_torch_comm_hooks_map_to_grad_dtype_and_others_are_refused(runs):
    for rank, r in enumerate(result(runs, "comm_hook")):
        assert r["bf16_differs"] and r["fp16_differs"]  # (so "the same" below means something)
        for k in ("allreduce", "bf16_hook", "fp16_hook", "bf16_wrapper", "fp16_wrapper",
                  "same_dtype"):
            assert r[k], (k, r)
        e = r["errors"]
        assert e["powersgd"].startswith("NotImplementedError: register_comm_hook: powerSGD_hook "
                                        "has no ddpc equivalent"), e["powersgd"]
        assert "torch's DistributedDataParallel instead" in e["powersgd"]
        assert e["wrapped_powersgd"].startswith(
            "NotImplementedError: register_comm_hook: fp16_compress_wrapper(powerSGD_hook) has "
            "no ddpc equivalent"), e["wrapped_powersgd"]
        assert e["own"].startswith("NotImplementedError: register_comm_hook: "), e["own"]
        assert "<lambda> has no ddpc equivalent" in e["own"], e["own"]
        assert e["not_callable"] == ("TypeError: register_comm_hook: hook must be a function "
                                     "(torch's default_hooks.fp16_compress_hook, for example), "
                                     "got str"), e["not_callable"]
        assert e["state"].startswith("ValueError: register_comm_hook: state must be None or this "
                                     "model's process group"), e["state"]
        assert e["conflict"] == ("ValueError: register_comm_hook: bf16_compress_hook reduces "
                                 "gradients in bfloat16, but the model was wrapped with "
                                 "grad_dtype=float16: pass one of them"), e["conflict"]
        assert e["mid_step"].startswith("RuntimeError: register_comm_hook: a forward ran and its "
                                        "backward has not ended"), e["mid_step"]
        assert e["twice"].startswith("RuntimeError: register_comm_hook can only be called once "
                                     "(bf16_compress_hook is registered already)"), e["twice"]
        assert e["mismatch"].startswith("MismatchError: wrap_model: the ranks wrapped their models "
                                        "with different settings: rank 0 has "
                                        "register_comm_hook=bf16_compress_hook but rank 1 has "
                                        "register_comm_hook=fp16_compress_hook. Every rank must "
                                        "register the same communication hook"), e["mismatch"]
        assert e["mismatch"].endswith(f"(seen on rank {rank})"), e["mismatch"]


def test_join_stands_in_for_the_ranks_that_ran_out_of_inputs(runs):
    for rank, r in enumerate(result(runs, "join")):
        for k in ("err_divide", "err_running", "err_even"):
            assert r[k] < 1e-12, (k, r)
        # rank 0 took 5 forwards; rank 1 took 3, then received rank 0's buffer at the 2 more and
        # rank 0's final one when both had left
        assert r["seen"] == 5.0, r
        assert r["rows_routes"] == 1 and r["rows_err"] < 1e-12, r
        assert r["throw"] == (
            "join: 1 of 2 ranks ran out of inputs, and throw_on_early_termination=True: every "
            "rank stops (seen on rank 0)" if rank == 0 else
            "join: rank 1 ran out of inputs while 1 of 2 ranks had more, and "
            "throw_on_early_termination=True: every rank stops"), r["throw"]
        assert r["throw_steps"] == 2, r
        assert r["after_throw_err"] < 1e-12, r
        e = r["errors"]
        assert e["enable"] == "TypeError: join: enable must be a bool, got str", e
        assert e["divide"] == "TypeError: join: divide_by_initial_world_size must be a bool, " \
                              "got int", e
        assert e["nested"] == ("RuntimeError: join: this model is inside join() already (join "
                               "blocks do not nest)"), e


def test_mismatched_models_raise_on_every_rank(runs):
    for r in result(runs, "mismatch"):
        assert ("parameter 'fc.weight': rank 0 has shape (10, 4) float32 but rank 1 has "
                "(10, 5) float32") in r["shape"]
        assert "parameter 'extra.weight': rank 1 has shape (2, 2) float32 but rank 0 has no " \
               "such parameter" in r["extra"]
        assert ("parameter 'fc.bias' is frozen (requires_grad=False) on rank 1 but trained on "
                "rank 0: freeze the same parameters on every rank, before wrap_model"
                in r["frozen"]), r["frozen"]
        assert ("different settings: rank 0 has bucket_cap_mb=25 but rank 1 has "
                "bucket_cap_mb=0.5. Every rank must pass the same") in r["cap"]
        assert "rank 0 has grad_dtype=None but rank 1 has grad_dtype=bfloat16" in r["dtype"]
        assert ("rank 0 has broadcast_buffers=True but rank 1 has broadcast_buffers=False"
                in r["buffers"])
        assert "rank 0 has DDPC_TAIL_BUCKET_MB=0 but rank 1 has DDPC_TAIL_BUCKET_MB=1" in r["tail"]
        assert "rank 0 has DDPC_COMM_CASTS=0 but rank 1 has DDPC_COMM_CASTS=1" in r["comm_casts"]
        assert r["same_words"] is None
        assert r["after"] == 2


def test_state_dict_attributes_and_buffers(runs):
    for r in result(runs, "state_dict"):
        for key in ("keys_equal", "no_prefix", "attr", "unwrap", "loaded", "nested_keys",
                    "nested_loaded"):
            assert r[key], key
        assert r["scale"] == [1.0, 1.0, 1.0]
        assert r["replaced"] == [7.0, 7.0, 7.0]  # rank 0's replacement, on every rank
        assert r["late"] == [0.0, 0.0]  # registered after wrap_model: rank 0's (as torch DDP)


def test_autocast_gradscaler_clip_identical_on_every_rank(runs):
    r0, r1 = result(runs, "amp")
    assert r0["norms"] == r1["norms"]
    assert r0["params"] == r1["params"]
    assert r0["norms"][0] > 0


def test_memory_format_change_after_wrap_still_averages_and_grads_keep_param_strides(runs):
    for r in result(runs, "memory_format"):
        assert r["channels_last"]
        assert max(r["errs"]) < 1e-12, r["errs"]
        assert r["strides_match"], r
        assert r["fused_err"] < 1e-10, r
        assert r["python_path_ms"] == 0.0, r
        assert r["bf16_layouts_equal"], r


def test_forward_after_a_failed_backward_reports_it_even_under_no_sync(runs):
    for r in result(runs, "failed_backward"):
        assert r["backward"] == "boom"
        assert r["next_forward"] is not None and "did not finish" in r["next_forward"], r
        assert r["local_err"] < 1e-12, r


@pytest.mark.parametrize("sanitize", [False, True], ids=["O2", "asan_ubsan"])
def test_reducer_c_unit(sanitize):
    """The reducer's C unit test, also under AddressSanitizer and UndefinedBehaviorSanitizer
    (an overrun of the reducer's per-parameter arrays, or a use after free, fails it)."""
    os.makedirs(os.path.join(HERE, "c", "bin"), exist_ok=True)
    exe = os.path.join(HERE, "c", "bin", "test_reducer" + ("_asan" if sanitize else ""))
    srcs = [os.path.join(HERE, "c", "test_reducer.c")] + [
        os.path.join(ROOT, "csrc", f) for f in ("reducer.c", "common.c", "reduce.c", "settings.c")]
    flags = (["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
              "-fno-sanitize-recover=all"] if sanitize else ["-O2"])
    cc = subprocess.run(["gcc", *flags, "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra",
                         "-Werror", "-I", os.path.join(ROOT, "csrc"), "-pthread", *srcs, "-o",
                         exe, "-lm"], capture_output=True, text=True, timeout=120)
    assert cc.returncode == 0, cc.stderr
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:abort_on_error=0")
    run = subprocess.run([exe], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr + run.stdout
    assert "all checks passed" in run.stdout


# ------------------------------------------------------------------ arguments (one rank)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be a number of MiB from 2**-20 (one "
                                       "byte) to 2**40, got 0"),
    ({"bucket_cap_mb": float("inf")}, ValueError, "bucket_cap_mb must be a number of MiB from"),
    ({"bucket_cap_mb": float("nan")}, ValueError, "bucket_cap_mb must be a number of MiB from"),
    ({"bucket_cap_mb": 1e-12}, ValueError, "to 2**40, got 1e-12"),
    ({"bucket_cap_mb": 2 ** 44 + 1}, ValueError, "to 2**40, got 17592186044417"),
    ({"bucket_cap_mb": "25"}, TypeError, "bucket_cap_mb must be a number of MiB"),
    ({"broadcast_buffers": 1}, TypeError, "broadcast_buffers must be a bool"),
    ({"grad_dtype": torch.float64}, ValueError, "grad_dtype must be None, torch.bfloat16"),
    ({"group": object()}, TypeError, "group must be a process group"),
    ({"device_ids": [1]}, ValueError, "device_ids=[1], but this rank works on cpu"),
    ({"output_device": "cuda:0"}, ValueError, "output_device='cuda:0', but this rank works"),
    ({"dim": 1}, ValueError, "dim=1: ddpc splits nothing itself"),
    ({"find_unused_parameters": "yes"}, TypeError, "find_unused_parameters must be a bool"),
    ({"static_graph": None}, TypeError, "static_graph must be a bool"),
])
def test_bad_arguments_are_named(world_one, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        world_one.wrap_model(torch.nn.Linear(2, 2), **kwargs)


def test_default_bucket_cap_follows_the_group(world_one):
    """bucket_cap_mb=None: torch DDP's 25 MiB on the cpu backend (100 only where GPUs reach each
    other directly, which the GPU tests check)."""
    from ddpc import parallel
    g = world_one.distributed._default_group()
    assert parallel.default_bucket_cap_mb(g) == 25.0
    assert parallel.default_bucket_cap_mb(g, torch.bfloat16) == 25.0
    assert world_one.wrap_model(torch.nn.Linear(2, 2))._cap_bytes == 25 << 20
    assert world_one.wrap_model(torch.nn.Linear(2, 2),
                                grad_dtype=torch.bfloat16)._cap_bytes == 25 << 20
    assert world_one.wrap_model(torch.nn.Linear(2, 2), bucket_cap_mb=None)._cap_bytes == 25 << 20
    assert world_one.wrap_model(torch.nn.Linear(2, 2), bucket_cap_mb=3)._cap_bytes == 3 << 20


def test_tail_buckets_hold_the_last_gradients_and_train_the_same(world_one, monkeypatch):
    """DDPC_TAIL_BUCKET_MB: the gradients that complete last (before a big parameter completed at
    the very end, like a tied embedding) get buckets of their own; the gradients are the same."""
    def run(tail):
        if tail:
            monkeypatch.setenv("DDPC_TAIL_BUCKET_MB", tail)
        else:
            monkeypatch.delenv("DDPC_TAIL_BUCKET_MB", raising=False)
        torch.manual_seed(0)
        # sequence of completion: the last Linear first ... the first Linear, then emb
        net = torch.nn.Sequential(torch.nn.Embedding(256, 64),
                                  *[torch.nn.Linear(64, 64) for _ in range(6)])
        w = world_one.wrap_model(net, bucket_cap_mb=0.05)  # 51.2 KiB: 3 Linears of 16.25
        x = torch.randint(0, 256, (4, 8))
        for _ in range(2):  # (the second runs on the layout the first observed)
            w.zero_grad(set_to_none=True)
            w(x).square().mean().backward()
        return [len(m) for m in w._members], [p.grad.clone() for p in net.parameters()]
    plain, grads = run(None)
    tail, grads_tail = run("0.02")  # 20 KiB: one Linear (16.25 KiB)
    # parameters per bucket: 3 Linears and a bias; the other weight and 2 Linears; the embedding
    assert plain == [7, 5, 1], plain
    # the same, but the first Linear (the last before the embedding) in a bucket of its own
    assert tail == [7, 3, 2, 1], tail
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_tail))


def test_bad_modules_are_named(world_one):
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got str"):
        world_one.wrap_model("net")
    wrapped = world_one.wrap_model(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already wrapped"):
        world_one.wrap_model(wrapped)
    net = torch.nn.Sequential(torch.nn.Embedding(5, 2, sparse=True), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=re.escape(
            "wrap_model: module '0' (Embedding) has sparse=True: its gradient is a sparse tensor, "
            "which ddpc's buckets cannot hold; construct it with sparse=False")):
        world_one.wrap_model(net)
    net[0].weight.requires_grad_(False)  # (frozen: not reduced, so no problem)
    world_one.wrap_model(net)
    with torch.device("meta"):
        lazy = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=re.escape(
            "wrap_model: parameter '0.weight' is on the meta device: it has a shape but no "
            "values yet. Materialize the model first, e.g. model.to_empty(")):
        world_one.wrap_model(lazy)


def test_a_sparse_gradient_is_named(world_one):
    """A sparse gradient from elsewhere (here F.embedding(sparse=True) on a bare parameter,
    which the module check cannot see) reaches the Python path, which names the parameter
    instead of failing inside a copy."""
    class Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(5, 2))

        def forward(self, idx):
            return torch.nn.functional.embedding(idx, self.weight, sparse=True)

    wrapped = world_one.wrap_model(Table())
    with pytest.raises(TypeError, match=re.escape(
            "parameter 'weight' got a gradient of layout torch.sparse_coo: ddpc reduces dense "
            "gradients only")):
        wrapped(torch.tensor([0, 3])).sum().backward()


def test_a_torch_ddp_checkpoint_loads(world_one):
    """torch DDP's state_dict keys start with "module."; ddpc's are the module's own. A DDP
    checkpoint loads into a wrapped model (with its metadata, so BatchNorm's version check
    still runs); a key that is really missing is still an error."""
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ddp_style = OrderedDict(("module." + k, v) for k, v in src.state_dict().items())
    ddp_style._metadata = OrderedDict(
        ("module" + ("." + k if k else ""), v) for k, v in src.state_dict()._metadata.items())
    wrapped = world_one.wrap_model(torch.nn.Sequential(torch.nn.Linear(3, 4),
                                                       torch.nn.BatchNorm1d(4)))
    wrapped.load_state_dict(ddp_style)
    for k, v in src.state_dict().items():
        assert torch.equal(wrapped.state_dict()[k], v), k
    del ddp_style["module.0.bias"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "0.bias"'):
        wrapped.load_state_dict(ddp_style)


def test_a_model_whose_group_was_destroyed_says_so(world_one):
    wrapped = world_one.wrap_model(torch.nn.Linear(2, 2))
    wrapped(torch.ones(1, 2)).sum().backward()
    world_one.destroy_process_group()
    with torch.no_grad():
        wrapped(torch.ones(1, 2))  # (nothing to communicate)
    with pytest.raises(RuntimeError, match=re.escape(
            "this model's process group was destroyed (destroy_process_group): to train it "
            "data-parallel again, call ddpc.init_process_group() and wrap it anew")):
        wrapped(torch.ones(1, 2))


def test_torch_ddp_call_carries_over(world_one):
    """DDP's keywords and positional order: the same training as wrap_model's."""
    from ddpc import DistributedDataParallel as DDP
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    ma = world_one.wrap_model(a)
    mb = DDP(b, None, None, 0, True, None, 25, find_unused_parameters=True,
             gradient_as_bucket_view=True, static_graph=True)
    assert isinstance(mb, world_one.DistributedModel) and mb.module is b
    x = torch.randn(4, 3)
    for m in (ma, mb):
        m(x).square().sum().backward()
    assert torch.equal(a.weight.grad, b.weight.grad)
    with pytest.raises(TypeError, match=r"unsupported keyword\(s\) \['mixed_precision'\]"):
        DDP(torch.nn.Linear(2, 2), mixed_precision=None)


def test_embedding_rows_setting_is_checked(world_one, monkeypatch):
    """DDPC_EMBEDDING_ROWS takes 0, 1 or auto; anything else is named with the fix."""
    monkeypatch.setenv("DDPC_EMBEDDING_ROWS", "yes")
    with pytest.raises(ValueError, match=r"DDPC_EMBEDDING_ROWS=yes is not a setting: use auto or "
                                         r"1 or 0, or unset it"):
        world_one.wrap_model(torch.nn.Embedding(5, 3))
    monkeypatch.setenv("DDPC_EMBEDDING_ROWS", "0")
    assert world_one.wrap_model(torch.nn.Embedding(5, 3))._routes == []


@pytest.mark.parametrize("name,bad,takes,oks", [
    ("DDPC_COMM_CASTS", "maybe", r"use 1 or 0 .*, or unset it", ("0", "1", "", "yes", "off")),
    ("DDPC_CAST_BACK", "soon", r"use end or early or overlap, or unset it", ("early", "end", "")),
])
def test_bf16_cast_settings_are_checked(world_one, monkeypatch, name, bad, takes, oks):
    """DDPC_COMM_CASTS and DDPC_CAST_BACK (where a bf16 bucket's casts go): anything but their
    values is refused by wrap_model with the values it takes, instead of meaning the default.
    On the CPU they change nothing (there is no stream to cast on): the gradient is the same."""
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"{name}={bad} is not a setting: {takes}"):
        world_one.wrap_model(torch.nn.Linear(3, 2), grad_dtype=torch.bfloat16)
    for ok in oks:
        monkeypatch.setenv(name, ok)
        m = world_one.wrap_model(torch.nn.Linear(3, 2), grad_dtype=torch.bfloat16)
        m(torch.ones(2, 3)).sum().backward()
        assert torch.equal(m.module.weight.grad, torch.full((2, 3), 2.0))



def test_symmetric_window_holds_the_buckets_before_the_last_that_fit(monkeypatch):
    """DDPC_NCCL_WINDOW_MB's placement (DistributedModel._place_windows), which only a 2-GPU
    machine reaches for real (tests/test_gpu.py -k window): one window, sized to the buckets
    before the last that fit under the cap in order, each bucket placed at its 4 KiB-aligned
    offset and summed; the same window at a rebuild; a warning, and no window, when the cap
    holds no bucket or a rank cannot make one. The group and reducer here only record calls."""
    import types
    import warnings
    from ddpc import parallel

    class Group:
        backend = "nccl"

        def __init__(self, answer):
            self.answer, self.asked = answer, []

        def window_alloc(self, n):
            self.asked.append(n)
            return self.answer

    class Reducer:
        def __init__(self):
            self.summed = []

        def set_bucket_summed(self, b, on):
            self.summed.append((b, on))

    monkeypatch.setattr(parallel, "_on", lambda device: contextlib.nullcontext())
    cuda = torch.device("cuda", 0)
    specs = [(n, torch.float32, cuda) for n in (1000, 1 << 20, 1 << 20, 1 << 20, 5 << 20)]
    wires = [torch.bfloat16] * 5
    base = 1 << 40

    def model(cap, answer):
        return types.SimpleNamespace(_window_cap=cap, _device=cuda, _world=2,
                                     _group=Group(answer), _window=None, _window_bytes=0)

    m, r = model(5, (base, "")), Reducer()
    parallel.DistributedModel._place_windows(m, r, specs, wires)
    assert m._group.asked == [4096 + (4 << 20)]  # 4 KiB, 2 MiB, 2 MiB; the third 2 MiB no
    assert m._window_at == [base, base + 4096, base + 4096 + (2 << 20), None, None]
    assert r.summed == [(0, True), (1, True), (2, True)]
    r2 = Reducer()
    parallel.DistributedModel._place_windows(m, r2, specs, wires)  # a rebuild: no new window
    assert m._group.asked == [4096 + (4 << 20)] and r2.summed == r.summed
    for cap, answer, says in ((0.001, (base, ""), "holds none of the buckets"),
                              (5, (0, "rank 1 could not allocate its part"), "could not")):
        m, r = model(cap, answer), Reducer()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            parallel.DistributedModel._place_windows(m, r, specs, wires)
        assert any(says in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert m._window_at == [None] * 5 and r.summed == [] and m._window_bytes == 0
    # one rank, or no bf16 wire: nothing asked
    m = model(5, (base, ""))
    m._world = 1
    parallel.DistributedModel._place_windows(m, Reducer(), specs, wires)
    assert m._group.asked == [] and m._window_at == [None] * 5
