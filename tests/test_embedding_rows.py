"""Embedding rows (python/ddpc/_rows.py) on 2 real processes (cpu backend, DDPC_EMBEDDING_ROWS=1;
a 3 s timeout):
- a module whose embedding is routed, saved whole (torch.save), loads and trains alone;
- ranks whose lookups are out of step: rank 0 looks the table up twice per forward, rank 1
  once. Rank 0 must raise a MismatchError that names the embedding, the lookup and rank 1,
  within the timeout, and abort the group, so that rank 1's next collective fails with the same
  explanation (or, when its own timeout comes first, with that timeout naming rank 0).
The right results of routing (tied and untied tables, padding, uneven counts, no_sync, bf16,
several forwards and backwards) are checked by tests/test_gpu_wrap_model.py's scenario, which
tests/test_wrap_model.py runs on the cpu backend.
"""
import os
import time

import pytest
import torch
from _procs import spawn_scenarios

TIMEOUT = 3.0


class Twice(torch.nn.Module):
    def __init__(self, lookups: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(13, 4)
        self.lookups = lookups

    def forward(self, tokens):
        h = sum(self.emb(tokens) for _ in range(self.lookups))
        return h @ self.emb.weight.t()


def sc_out_of_step(rank):
    import ddpc
    torch.manual_seed(0)
    wrapped = ddpc.wrap_model(Twice(2 if rank == 0 else 1))
    out = {"routes": len(wrapped._routes)}
    t0 = time.monotonic()
    try:
        loss = wrapped(torch.randint(0, 13, (2, 5))).square().mean()
        loss.backward()
        ddpc.barrier()
        out["error"] = None
    except ddpc.DistributedError as e:
        out["error"] = (type(e).__name__, str(e))
    out["seconds"] = time.monotonic() - t0
    return out


def sc_saved_whole(rank):
    """torch.save of a module whose embedding is routed (the whole module, hooks included), and
    a forward and backward of the loaded copy, outside any wrapper."""
    import io

    import ddpc
    torch.manual_seed(0)
    model = Twice(1)
    wrapped = ddpc.wrap_model(model)
    buf = io.BytesIO()
    torch.save(wrapped.module, buf)
    buf.seek(0)
    copy = torch.load(buf, weights_only=False)
    tokens = torch.randint(0, 13, (2, 5))
    out = copy(tokens)
    out.square().mean().backward()
    return {"routes": len(wrapped._routes), "same": torch.equal(out, model(tokens)),
            "grad": copy.emb.weight.grad is not None and bool(copy.emb.weight.grad.abs().sum())}


def sc_weight_hook(rank):
    """A hook on the embedding weight's gradient (here: train only rows 0-5, a usual way to
    tune new tokens) sees the lookups' gradient too: a routed lookup added its rows after every
    hook ran, so the masked rows moved. Such a call stays a plain lookup; the result matches
    one process training the combined batch."""
    import ddpc
    torch.manual_seed(0)
    model = Twice(1)
    ref = Twice(1)
    wrapped = ddpc.wrap_model(model)
    ref.load_state_dict(model.state_dict())
    mask = torch.zeros(13, 1)
    mask[:6] = 1.0
    for m in (model, ref):
        m.emb.weight.register_hook(lambda g: g * mask)
    before = model.emb.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 13, (4, 5), generator=g)
        opt.zero_grad()
        wrapped(tokens[2 * rank:2 * rank + 2]).square().mean().backward()
        opt.step()
        ref_opt.zero_grad()
        # (the mean over ranks of each rank's mean over its half: the mean over the batch)
        ref(tokens).square().mean().backward()
        ref_opt.step()
    w = model.emb.weight.detach()
    return {"masked_moved": (w[6:] - before[6:]).abs().max().item(),
            "err": (w - ref.emb.weight.detach()).abs().max().item()}


def _worker(rank, port, results):
    os.environ["DDPC_TOKEN"] = "test-embedding-rows"
    os.environ["DDPC_EMBEDDING_ROWS"] = "1"  # (auto routes only nccl through host memory)
    torch.set_num_threads(1)
    import ddpc
    from _procs import report_scenarios
    ddpc.init_process_group(backend="cpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=TIMEOUT)
    # (out_of_step last: it aborts the group)
    report_scenarios([("saved_whole", sc_saved_whole), ("weight_hook", sc_weight_hook),
                      ("out_of_step", sc_out_of_step)], rank, results)


@pytest.fixture(scope="module")
def runs():
    return spawn_scenarios(_worker, 2, 60)


def test_a_routed_module_saved_whole_loads_and_trains_alone(runs):
    for rank in (0, 1):
        status, value = runs[rank]["saved_whole"]
        assert status == "ok", value
        assert value == {"routes": 1, "same": True, "grad": True}, value


def test_a_hook_on_the_weight_sees_the_lookups_gradient(runs):
    for rank in (0, 1):
        status, value = runs[rank]["weight_hook"]
        assert status == "ok", value
        # (the hook masks the weight's whole gradient, the tied projection's part too)
        assert value["masked_moved"] == 0.0, value
        assert value["err"] < 1e-6, value


def test_ranks_out_of_step_raise_and_name_the_lookup(runs):
    outs = []
    for rank in (0, 1):
        status, value = runs[rank]["out_of_step"]
        assert status == "ok", value
        outs.append(value)
    r0, r1 = outs
    assert r0["routes"] == 1 and r1["routes"] == 1
    name, msg = r0["error"]
    assert name == "MismatchError", r0
    assert "rank 0 waited" in msg and "rank 1's count of indices" in msg, msg
    assert "embedding 'emb' (lookup 2 of synced forward 1)" in msg and "out of step" in msg, msg
    assert "set DDPC_EMBEDDING_ROWS=0 on every rank" in msg, msg
    assert r0["seconds"] < TIMEOUT + 5, r0
    # Rank 1 fails within its timeout too: with rank 0's explanation when the abort arrives
    # first, else with its own collective's timeout, which names rank 0 (both take the same 3 s)
    assert r1["error"] is not None, r1
    assert "out of step" in r1["error"][1] or ("rank 0 never arrived" in r1["error"][1]
                                               and r1["error"][0] == "DistributedTimeoutError"), r1
    assert r1["seconds"] < TIMEOUT + 10, r1


def test_prune_forgets_stale_gradients_and_drops_old_lookups():
    """At a synced forward: a queued lookup that holds a gradient got it from a backward that
    raised before its end (forgotten, like the reducer's lost step); lookups RING forwards old
    are dropped, and a gradient reaching one later raises."""
    from ddpc import _rows
    route = _rows.Route(torch.nn.Embedding(5, 2), 0, "emb")
    queue = []
    old = _rows.Call(route, torch.tensor([1, 2]), 1, 0, queue)
    recent = _rows.Call(route, torch.tensor([3]), _rows.RING, 0, queue)
    queue += [old, recent]
    recent.grad = torch.ones(1, 2)
    queue[:] = _rows.prune(queue, _rows.RING + 1)
    assert queue == [recent] and recent.grad is None and recent.queued
    assert old.dropped and not old.queued
    w = torch.zeros(5, 2)
    out = _rows._Rows.apply(torch.zeros((), requires_grad=True), torch.tensor([1, 2]), w, None,
                            old)
    try:
        out.sum().backward()
        raised = None
    except RuntimeError as e:
        raised = str(e)
    assert raised is not None and "made 16 or more synced forwards ago" in raised, raised
