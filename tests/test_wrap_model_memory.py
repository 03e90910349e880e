"""wrap_model's memory habits, on 2 real processes (cpu backend): parameters and buffers are
broadcast in bounded chunks (never a full-size copy of the model; any dtype, layout and shape),
the bucket layout learnt in the first step replaces the old buckets without keeping both, and
buckets whose gradients were set to None are freed at the forward and come back one by one as
backward produces gradients (adopting a lone parameter's gradient without a copy).
"""
import copy
import gc
import os
import weakref

import pytest
import torch
from _procs import report_scenarios, scenario_result, spawn_scenarios

WORLD = 2
CHUNK = 256  # bytes: forces many chunks on a small model


class Odd(torch.nn.Module):
    """Parameters larger and smaller than a chunk, and buffers of awkward kinds."""

    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(40, 30)         # 4800 bytes of weight: alone in its chunk
        self.small = torch.nn.Linear(3, 2)         # several small ones share a chunk
        self.frozen = torch.nn.Parameter(torch.randn(5), requires_grad=False)
        self.register_buffer("count", torch.tensor(7))                   # 0-dim int64
        self.register_buffer("mask", torch.rand(6) > 0.5)                # bool
        self.register_buffer("t", torch.randn(8, 4).t())                 # not contiguous
        self.register_buffer("empty", torch.zeros(0))

    def forward(self, x):
        return self.small(self.big(x)[:, :3]) * self.frozen[:2]


def sc_broadcast(rank):
    import ddpc
    from ddpc import parallel
    parallel.BROADCAST_CHUNK_BYTES = CHUNK
    sizes = []
    real = parallel.dist.broadcast

    def spy(tensor, *args, **kwargs):
        sizes.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    parallel.dist.broadcast = spy
    torch.manual_seed(rank)  # every rank starts different
    model = Odd()
    ddpc.wrap_model(model)
    parallel.dist.broadcast = real
    torch.manual_seed(0)
    want = Odd()
    same = {name: torch.equal(a, b) for (name, a), (_, b) in
            zip(list(model.named_parameters()) + list(model.named_buffers()),
                list(want.named_parameters()) + list(want.named_buffers()))}
    return {"same": same, "sizes": sizes,
            "total": sum(t.numel() * t.element_size()
                         for t in list(want.parameters()) + list(want.buffers()))}


def sc_rebuild(rank):
    import ddpc
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    wrapped = ddpc.wrap_model(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    out = {}
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 6, generator=g)
        # Gradients zeroed in place keep their buckets, so only the rebuild replaces them.
        opt.zero_grad(set_to_none=False)
        before = [weakref.ref(b) for b in wrapped._buckets if b is not None]
        out[f"had_{step}"] = len(before)
        wrapped(x).square().mean().backward()
        gc.collect()
        out[f"released_{step}"] = all(r() is None for r in before)
        out[f"views_{step}"] = all(
            any(b.data_ptr() <= p.grad.data_ptr() < b.data_ptr() + b.numel() * 4
                for b in wrapped._buckets) for p in model.parameters())
        opt.step()
    return out


SMALL = 500 / 2 ** 20  # bucket_cap_mb of about 500 bytes: several buckets


class Lazy(torch.nn.Module):
    """Weights of 768 and 2048 bytes (float64) get a bucket each; each head's bias and weight
    share one. Rank r uses head r only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.mix = torch.nn.Parameter(torch.randn(16, 16) * 0.1)
        self.head_a = torch.nn.Linear(16, 3)
        self.head_b = torch.nn.Linear(16, 3)

    def forward(self, x, branch):
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(h @ self.mix) + h
        return self.head_a(h) if branch == 0 else self.head_b(h)


def _averaged_grads(model, x, y):
    """What every rank must hold: the mean over ranks r of the gradient of rank r's loss (rank r
    takes rows r*4..r*4+3 through head r), zeros for parameters no rank used."""
    total = None
    for r in range(WORLD):
        c = copy.deepcopy(model)
        for p in c.parameters():
            p.grad = None
        (c(x[4 * r:4 * r + 4], r) - y[4 * r:4 * r + 4]).square().mean().backward()
        g = [p.grad if p.grad is not None else torch.zeros_like(p) for p in c.parameters()]
        total = g if total is None else [a + b for a, b in zip(total, g)]
    return [t / WORLD for t in total]


def _holds_memory(t) -> bool:
    return t is not None and t.untyped_storage().nbytes() > 0


def sc_lazy(rank):
    import ddpc
    torch.manual_seed(0)
    model = Lazy().double()
    arrived = {}  # id(param) -> data_ptr of its gradient as autograd made it (before ddpc's hook)
    allocated_at_arrival = []  # buckets holding memory as each gradient is placed (after ddpc)

    def before_ddpc(p):
        arrived.setdefault(id(p), p.grad.data_ptr())

    def after_ddpc(p):
        allocated_at_arrival.append(sum(_holds_memory(b) for b in wrapped._buckets))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(before_ddpc)
    wrapped = ddpc.wrap_model(model, bucket_cap_mb=SMALL)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(after_ddpc)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    names = [n for n, _ in model.named_parameters()]
    out = {"names": names, "steps": []}
    for step in range(3):  # the first step observes the order, the second runs the new layout
        g = torch.Generator().manual_seed(step)
        x = torch.randn(WORLD * 4, 6, generator=g, dtype=torch.float64)
        y = torch.randn(WORLD * 4, 3, generator=g, dtype=torch.float64)
        expected = _averaged_grads(model, x, y)
        gone = [weakref.ref(t) for t in wrapped._buckets + [p.grad for p in model.parameters()]
                if t is not None]
        views_before = [id(v) for v in wrapped._views]
        opt.zero_grad(set_to_none=True)
        loss = (wrapped(x[4 * rank:4 * rank + 4], rank) - y[4 * rank:4 * rank + 4]).square().mean()
        gc.collect()
        # Memory is back with the allocator when a tensor is gone, or (parked) its storage
        # holds nothing.
        rec = {"nbuckets": len(wrapped._buckets), "had": len(gone),
               "freed": all(r() is None or not _holds_memory(r()) for r in gone),
               "released": not any(_holds_memory(b) for b in wrapped._buckets),
               "parked": sum(wrapped._parked),
               "grads_none": all(p.grad is None for p in model.parameters())}
        arrived.clear()
        allocated_at_arrival.clear()
        loss.backward()
        rec["allocated_at_arrival"] = list(allocated_at_arrival)
        ranges = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size())
                  for b in wrapped._buckets]
        rec["views"] = [any(lo <= p.grad.data_ptr() and
                            p.grad.data_ptr() + p.grad.numel() * 8 <= hi for lo, hi in ranges)
                        for p in model.parameters()]
        rec["errs"] = [(p.grad - e).abs().max().item()
                       for p, e in zip(model.parameters(), expected)]
        rec["nonzero"] = [bool(e.abs().max() > 0) for e in expected]
        b_mix = wrapped._bucket_of[names.index("mix")]
        rec["mix_alone"] = len(wrapped._members[b_mix]) == 1
        # adopted: the bucket is the very memory autograd computed the gradient into
        rec["mix_adopted"] = (model.mix.grad.data_ptr() == arrived.get(id(model.mix)) ==
                              wrapped._buckets[b_mix].data_ptr())
        # parked buckets kept their views: the same objects, now over the new memory (the
        # adopted bucket's view is the new gradient itself)
        rec["views_kept"] = sum(id(v) == k for v, k in zip(wrapped._views, views_before))
        rec["adopted"] = sum(len(m) == 1 and wrapped._buckets[b] is wrapped._views[m[0]]
                             for b, m in enumerate(wrapped._members))
        out["steps"].append(rec)
        opt.step()
    # An old gradient still held by the caller keeps its memory and values after the forward
    # that releases its bucket (unlike a bucket resized to nothing under it).
    # The same for a tensor made from one (a slice of a gradient in another bucket of several:
    # another tensor on that bucket's storage, with no reference to the gradient object).
    held = model.fc1.weight.grad
    params = list(model.parameters())
    b_held = wrapped._bucket_of[names.index("fc1.weight")]
    other = next(i for i in range(len(names)) if wrapped._bucket_of[i] != b_held and
                 len(wrapped._members[wrapped._bucket_of[i]]) > 1 and
                 bool(params[i].grad.abs().min() > 0))
    part = params[other].grad.view(-1)[:2]
    values, part_values = held.clone(), part.clone()
    opt.zero_grad(set_to_none=True)
    wrapped(x[4 * rank:4 * rank + 4], rank).sum().backward()
    out["held_intact"] = torch.equal(held, values) and held.data_ptr() != \
        model.fc1.weight.grad.data_ptr()
    out["part_intact"] = torch.equal(part, part_values)
    return out


def sc_rebuild_none(rank):
    """The usual loop (zero_grad(set_to_none=True), bfloat16 reduction): each bucket's wire
    buffer is made when its first gradient of the step arrives and is gone once backward has
    returned (nothing, neither the reducer nor the hooks, keeps it), in the first step, whose
    layout the next forward replaces, and in the steps after it; the gradients go straight to
    the wire, so the float32 buckets never get memory."""
    import ddpc
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    wrapped = ddpc.wrap_model(model, grad_dtype=torch.bfloat16)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    made = []
    real = wrapped._need_wire

    def spy(b):
        real(b)
        w = wrapped._wires[b]
        if w is not None and not any(r() is w for r in made):
            made.append(weakref.ref(w))

    wrapped._need_wire = spy  # (the hooks look the method up on the wrapper at each call)
    out = {"made": [], "buckets": [], "alive": [], "stale": []}
    for step in range(3):
        before = len(made)
        wrapped(x).square().mean().backward()
        out["made"].append(len(made) - before)
        out["buckets"].append(wrapped._reducer.num_buckets)
        out["alive"].append(sum(r() is not None for r in made))
        out["stale"].append(wrapped._layout_stale)
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["bucket_memory"] = any(b is not None and not wrapped._parked[k]
                               for k, b in enumerate(wrapped._buckets))
    out["same_grads"] = all(p.grad is None for p in model.parameters())
    return out


def sc_unused_counts(rank):
    """Parameters of a bucket that never get a gradient stay "unused" in the reducer's record of
    the step, even though their slots were attached (zeroed) when the bucket's first gradient
    arrived: the first-step layout is planned from that record."""
    import ddpc
    torch.manual_seed(0)
    model = Lazy()
    wrapped = ddpc.wrap_model(model, bucket_cap_mb=25)  # one bucket holds every parameter
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    wrapped(x, 0).sum().backward()
    order, counts = wrapped._reducer.observed_order()
    names = wrapped._names
    return {"counts": dict(zip(names, counts)), "seen": sorted(names[i] for i in order if i >= 0),
            "head_b_grads": [float(p.grad.abs().sum()) for p in model.head_b.parameters()]}


class _NumpyGrad(torch.autograd.Function):
    """y = w * x, with a backward that hands autograd a gradient living in NumPy memory (as
    code that computes gradients with NumPy or CuPy does): a storage that cannot be resized."""

    @staticmethod
    def forward(ctx, w, x):
        ctx.save_for_backward(x)
        return w * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return torch.from_numpy((g * x).sum(0).numpy().copy()), None


class NumpyGradModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(5, dtype=torch.float64))

    def forward(self, x):
        return _NumpyGrad.apply(self.w, x)


def sc_unresizable(rank):
    """The only parameter's gradient (its bucket's only one, so adopted as the bucket) lives in
    memory torch cannot resize: the bucket cannot be parked, and training goes on (it did not:
    every forward after the second raised "Trying to resize storage that is not resizable")."""
    import ddpc
    model = NumpyGradModel()
    wrapped = ddpc.wrap_model(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    errs = []
    for step in range(4):
        xs = [torch.randn(3, 5, generator=torch.Generator().manual_seed(10 * step + r),
                          dtype=torch.float64) for r in range(WORLD)]
        want = sum(x.sum(0) for x in xs) / WORLD
        opt.zero_grad(set_to_none=True)
        wrapped(xs[rank]).sum().backward()
        errs.append((model.w.grad - want).abs().max().item())
        opt.step()
    return {"errs": errs, "parked": list(wrapped._parked)}


SCENARIOS = [("broadcast", sc_broadcast), ("rebuild", sc_rebuild), ("lazy", sc_lazy),
             ("rebuild_none", sc_rebuild_none), ("unused_counts", sc_unused_counts),
             ("unresizable", sc_unresizable)]


def _worker(rank, port, results):
    os.environ["DDPC_TOKEN"] = "test-wrap-model-memory"
    torch.set_num_threads(1)
    import ddpc
    ddpc.init_process_group(backend="cpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=30)
    report_scenarios(SCENARIOS, rank, results)
    ddpc.destroy_process_group()


@pytest.fixture(scope="module")
def runs():
    return spawn_scenarios(_worker, WORLD, 90)


def result(runs, name):
    return scenario_result(runs, name)


def test_parameters_and_buffers_arrive_in_bounded_chunks(runs):
    for r in result(runs, "broadcast"):
        assert all(r["same"].values()), r["same"]
        assert r["sizes"] == result(runs, "broadcast")[0]["sizes"]  # same collectives everywhere
        big = 40 * 30 * 4
        assert big in r["sizes"]  # broadcast alone, in place
        assert all(s <= CHUNK for s in r["sizes"] if s != big), r["sizes"]
        assert len(r["sizes"]) > 3
        # every byte once, plus at most 15 bytes of alignment padding per packed tensor
        assert r["total"] <= sum(r["sizes"]) < r["total"] + 15 * 10, (r["sizes"], r["total"])


def test_first_step_rebuild_releases_the_old_buckets(runs):
    for r in result(runs, "rebuild"):
        assert all(r[f"views_{s}"] for s in range(3)), r
        assert r["had_1"] > 0 and r["had_2"] > 0, r
        assert r["released_1"], r  # the layout of step 0 was replaced and freed at step 1
        assert not r["released_2"], r  # and after that the buckets stay


def test_wire_buffers_live_only_while_their_step_runs(runs):
    for r in result(runs, "rebuild_none"):
        assert r["stale"][0], r  # the first step's layout was replaced at the next forward
        assert r["made"] == r["buckets"] and all(n > 0 for n in r["made"]), r  # one per bucket
        assert r["alive"] == [0, 0, 0], r
        assert not r["bucket_memory"], r
        assert r["same_grads"], r  # (zero_grad set them to None)


def test_attached_but_unused_parameters_count_as_unused(runs):
    for r in result(runs, "unused_counts"):
        unused = {n: c for n, c in r["counts"].items() if n.startswith("head_b")}
        assert unused and all(c == 0 for c in unused.values()), r
        assert all(c == 1 for n, c in r["counts"].items() if not n.startswith("head_b")), r
        assert not any(n.startswith("head_b") for n in r["seen"]), r
        assert r["head_b_grads"] == [0.0, 0.0], r  # unused parameters get zero gradients


def test_buckets_of_none_gradients_are_freed_until_backward_needs_them(runs):
    for rank, r in enumerate(result(runs, "lazy")):
        names = r["names"]
        for step, rec in enumerate(r["steps"]):
            where = (rank, step, rec)
            assert rec["nbuckets"] >= 4, where
            # the forward after zero_grad(set_to_none=True) let go of every bucket
            assert rec["released"] and rec["grads_none"], where
            if step > 0:
                assert rec["had"] > 0 and rec["freed"], where
            if step == 2:
                # the layout was rebuilt at step 1; from then on every released bucket is
                # parked, and its views are reused (all but those of buckets that adopted a new
                # gradient, mix's among them)
                assert rec["parked"] == rec["nbuckets"], where
                assert rec["adopted"] >= 1 and \
                    rec["views_kept"] == len(names) - rec["adopted"], where
            # the first gradient found only its own bucket allocated, later ones more
            arrivals = rec["allocated_at_arrival"]
            assert arrivals[0] == 1 and max(arrivals) > 1, where
            # after backward: views into the (new) buckets holding the averaged gradients
            assert all(rec["views"]), where
            assert max(rec["errs"]) < 1e-12, where
            assert rec["mix_alone"] and rec["mix_adopted"], where
        # rank 0 never used head_b (nor rank 1 head_a): its bucket was allocated and zeroed at
        # the end of backward and reduced with the other rank's gradient
        for name in ("head_a.weight", "head_b.weight", "head_a.bias", "head_b.bias"):
            assert r["steps"][-1]["nonzero"][names.index(name)], name
        assert r["held_intact"] and r["part_intact"]


def test_gradient_in_unresizable_memory_is_not_parked(runs):
    for r in result(runs, "unresizable"):
        assert len(r["errs"]) == 4 and max(r["errs"]) < 1e-12, r
        assert r["parked"] == [False], r
