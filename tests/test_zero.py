"""ZeroRedundancyOptimizer on 3 real processes (cpu backend): the same parameters as the plain
optimizer, step for step, with each rank holding about a third of its state; schedulers,
parameter groups added later and frozen parameters; checkpoints consolidated on one rank and
loaded back (into it or into the plain optimizer); and the bad inputs, each named."""
import copy
import os
import re

import pytest
import torch
from _procs import report_scenarios, scenario_result, spawn_scenarios

WORLD = 3


class Net(torch.nn.Module):
    """Parameters of uneven sizes, so the split by size has work to do, and a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 8)
        self.head = torch.nn.Linear(8, 3)
        self.frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, ids):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(self.emb(ids)))))).sum(1) * \
            self.frozen.sum()


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 50, (4, 6), generator=g), torch.randn(4, 3, generator=g)


def train(model, opt, steps, rank, start=0, scheduler=None):
    for step in range(start, start + steps):
        ids, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def sc_same_as_plain(rank):
    """AdamW (weight decay, two groups with their own lr, a StepLR) sharded against the plain
    AdamW, both under wrap_model on the same batches."""
    import ddpc
    torch.manual_seed(0)
    base = Net().double()
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    wrapped = [ddpc.wrap_model(m) for m in models]

    def groups(m):
        return [{"params": [m.emb.weight, m.frozen]},
                {"params": [p for n, p in m.named_parameters() if n not in ("emb.weight",
                                                                            "frozen")],
                 "lr": 0.02}]
    zero = ddpc.ZeroRedundancyOptimizer(groups(models[0]), torch.optim.AdamW, lr=0.05,
                                        weight_decay=0.1)
    plain = torch.optim.AdamW(groups(models[1]), lr=0.05, weight_decay=0.1)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (zero, plain)]
    diffs = []
    for step in range(6):
        train(wrapped[0], zero, 1, rank, start=step, scheduler=scheds[0])
        train(wrapped[1], plain, 1, rank, start=step, scheduler=scheds[1])
        diffs.append(max_diff(*models))
    everywhere = [None] * WORLD
    ddpc.all_gather_object(everywhere, [p.tolist() for p in models[0].parameters()])
    owned = sum(p.numel() for p in zero.state)  # (the local state's parameters)
    total = sum(p.numel() for p in models[0].parameters() if p.requires_grad)
    return {"diffs": diffs, "same_on_every_rank": all(e == everywhere[0] for e in everywhere),
            "owned": owned, "total": total, "lr": [g["lr"] for g in zero.param_groups],
            "betas": zero.param_groups[0].get("betas"),
            "frozen_unchanged": bool((models[0].frozen == 1).all())}


def sc_checkpoint(rank):
    """consolidate_state_dict(to=1), state_dict() on rank 1 only; loaded back into a fresh
    sharded optimizer on every rank and into the plain one: training goes on identically."""
    import ddpc
    torch.manual_seed(1)
    model = Net().double()
    wrapped = ddpc.wrap_model(model)
    zero = ddpc.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.03)
    train(wrapped, zero, 3, rank)
    errors = {}
    try:
        zero.state_dict()
    except RuntimeError as e:
        errors["early"] = str(e)
    zero.consolidate_state_dict(to=1)
    sd = None
    if rank == 1:
        sd = zero.state_dict()
        torch.save(sd, os.environ["ZERO_CKPT"])
    else:
        try:
            zero.state_dict()
        except RuntimeError as e:
            errors["elsewhere"] = str(e)
    ddpc.barrier()
    sd = torch.load(os.environ["ZERO_CKPT"])
    on_host = all(t.device.type == "cpu" for s in sd["state"].values() for t in s.values()
                  if isinstance(t, torch.Tensor))
    snapshot = copy.deepcopy(model)
    # (a) the sharded optimizer goes on; (b) a fresh one loads the checkpoint; (c) the plain one
    models = [model, copy.deepcopy(snapshot), copy.deepcopy(snapshot)]
    fresh = ddpc.ZeroRedundancyOptimizer(models[1].parameters(), torch.optim.AdamW, lr=0.5)
    fresh.load_state_dict(sd)
    plain = torch.optim.AdamW(models[2].parameters(), lr=0.5)
    # (its own copy: an optimizer loading a state dict keeps its tensors, which it then steps)
    plain.load_state_dict(torch.load(os.environ["ZERO_CKPT"]))
    opts = [zero, fresh, plain]
    for k in range(3):
        w = wrapped if k == 0 else ddpc.wrap_model(models[k])
        train(w, opts[k], 3, rank, start=3)
    for bad in (lambda: fresh.load_state_dict({"state": {}, "param_groups": []}),
                lambda: zero.consolidate_state_dict(to=WORLD)):
        try:
            bad()
        except ValueError as e:
            errors.setdefault("bad", []).append(str(e))
    return {"errors": errors, "state_entries": len(sd["state"]), "on_host": on_host,
            "lr_loaded": fresh.param_groups[0]["lr"],
            "fresh_vs_going_on": max_diff(models[0], models[1]),
            "plain_vs_going_on": max_diff(models[0], models[2])}


def sc_added_group(rank):
    """add_param_group after construction: the new parameters are split and stepped too."""
    import ddpc
    torch.manual_seed(2)
    models = [Net().double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    zero = ddpc.ZeroRedundancyOptimizer(models[0].a.parameters(), torch.optim.SGD, lr=0.1,
                                        momentum=0.9)
    plain = torch.optim.SGD(models[1].a.parameters(), lr=0.1, momentum=0.9)
    for o, m in ((zero, models[0]), (plain, models[1])):
        o.add_param_group({"params": list(m.b.parameters()) + list(m.head.parameters()),
                           "lr": 0.05})
    owners = sorted({zero.owner(p) for p in models[0].parameters() if p in zero._owner})
    wrapped = [ddpc.wrap_model(m) for m in models]
    for k in range(2):
        train(wrapped[k], (zero, plain)[k], 4, rank)
    return {"diff": max_diff(*models), "owners": owners}


def sc_frozen_later(rank):
    """A layer frozen after two steps, gradients kept (zero_grad(set_to_none=False)): AdamW
    still moves it (weight decay, momentum), and every replica must see that move (it was left
    out of the sends, so the replicas drifted apart silently). Also OneCycleLR, which looks for
    AdamW's betas in the optimizer's defaults."""
    import ddpc
    torch.manual_seed(3)
    models = [Net().double() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    zero = ddpc.ZeroRedundancyOptimizer(models[0].parameters(), torch.optim.AdamW, lr=0.05)
    plain = torch.optim.AdamW(models[1].parameters(), lr=0.05)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10)
              for o in (zero, plain)]
    wrapped = [ddpc.wrap_model(m) for m in models]
    for step in range(5):
        for w, m, o, sc in zip(wrapped, models, (zero, plain), scheds):
            if step == 2:
                m.a.requires_grad_(False)
            ids, y = batch(step, rank)
            o.zero_grad(set_to_none=False)
            torch.nn.functional.mse_loss(w(ids), y).backward()
            o.step()
            sc.step()
    everywhere = [None] * WORLD
    ddpc.all_gather_object(everywhere, [p.tolist() for p in models[0].parameters()])
    errors = []
    try:
        zero.state_dict()  # consolidated before the last steps: stale, so refused
    except RuntimeError as e:
        errors.append(str(e))
    return {"diff": max_diff(*models), "same_on_every_rank": all(e == everywhere[0]
                                                                 for e in everywhere),
            "betas": zero.param_groups[0]["betas"], "errors": errors}


def sc_bad_inputs(rank):
    import ddpc
    errors = []
    model = Net()
    for bad in (lambda: ddpc.ZeroRedundancyOptimizer(model.parameters(), "adamw"),
                lambda: ddpc.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                                     overlap_with_ddp=True),
                # rank 2 leaves a parameter out: every rank raises, none steps wrong parameters
                lambda: ddpc.ZeroRedundancyOptimizer(
                    list(model.parameters())[:-2 if rank == 2 else None], torch.optim.AdamW),
                lambda: ddpc.ZeroRedundancyOptimizer(model.parameters(), torch.optim.LBFGS)):
        try:
            bad()
            errors.append("no error")
        except (TypeError, NotImplementedError, ddpc.MismatchError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    # a group added on one rank with another shape: raised, and not left half added
    zero = ddpc.ZeroRedundancyOptimizer(model.a.parameters(), torch.optim.SGD, lr=0.1)
    try:
        zero.add_param_group({"params": [model.b.weight if rank else model.head.weight]})
        errors.append("no error")
    except ddpc.MismatchError as e:
        errors.append(f"MismatchError: {e}")
    errors.append(len(zero.param_groups))
    return {"errors": errors}


SCENARIOS = [("same", sc_same_as_plain), ("checkpoint", sc_checkpoint),
             ("added_group", sc_added_group), ("frozen_later", sc_frozen_later),
             ("bad", sc_bad_inputs)]


def _worker(rank, port, results, ckpt):
    os.environ["DDPC_TOKEN"] = "test-zero"
    os.environ["ZERO_CKPT"] = ckpt
    torch.set_num_threads(1)
    import ddpc
    import ddpc.zero
    # The weights (2-6 KiB in float64) go alone, in place; the biases together, in flat copies.
    ddpc.zero._ALONE_BYTES = 2048
    ddpc.init_process_group(backend="cpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=30)
    report_scenarios(SCENARIOS, rank, results)
    ddpc.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import functools
    ckpt = str(tmp_path_factory.mktemp("zero") / "opt.pt")
    return spawn_scenarios(functools.partial(_worker, ckpt=ckpt), WORLD, 120)


def test_sharded_adamw_equals_the_plain_one_and_holds_a_share_of_the_state(runs):
    owned = []
    for r in scenario_result(runs, "same"):
        assert max(r["diffs"]) < 1e-12, r["diffs"]
        assert r["same_on_every_rank"]
        assert r["frozen_unchanged"]
        assert r["lr"] == [0.05 * 0.125, 0.02 * 0.125]  # StepLR halved both groups 3 times
        assert r["betas"] == [0.9, 0.999] or r["betas"] == (0.9, 0.999)
        owned.append(r["owned"])
    total = scenario_result(runs, "same")[0]["total"]
    assert sum(owned) == total  # every trained parameter has its state on exactly one rank
    assert max(owned) < 0.5 * total, owned  # the 800-element embedding alone is 37%


def test_checkpoint_consolidated_on_one_rank_loads_into_sharded_and_plain(runs):
    for rank, r in enumerate(scenario_result(runs, "checkpoint")):
        e = r["errors"]
        assert e["early"].startswith(f"ZeroRedundancyOptimizer.state_dict() on rank {rank}: the "
                                     f"state is sharded over the ranks; call "
                                     f"consolidate_state_dict(to=R) on every rank first"), e
        assert ("elsewhere" in e) == (rank != 1), e
        assert r["state_entries"] == 7  # every trained parameter's moments (not the frozen one)
        assert r["on_host"]
        assert r["lr_loaded"] == 0.03  # the checkpoint's hyperparameters, not the new lr=0.5
        assert r["fresh_vs_going_on"] == 0.0, r
        assert r["plain_vs_going_on"] < 1e-12, r
        assert "do not match this optimizer's" in e["bad"][0], e
        assert "to=3 is not a rank of this group" in e["bad"][1], e


def test_a_group_added_later_is_split_and_stepped(runs):
    for r in scenario_result(runs, "added_group"):
        assert r["diff"] < 1e-12, r
        assert r["owners"] == [0, 1, 2]


def test_a_layer_frozen_later_moves_alike_on_every_rank(runs):
    for r in scenario_result(runs, "frozen_later"):
        assert r["same_on_every_rank"], r
        assert r["diff"] < 1e-12, r
        assert tuple(r["betas"]) != (0.9, 0.999)  # OneCycleLR cycles beta1
        assert r["errors"] and "consolidate_state_dict(to=R) on every rank first (after the " \
            "last step)" in r["errors"][0], r


def test_bad_inputs_are_named_on_every_rank(runs):
    for rank, r in enumerate(scenario_result(runs, "bad")):
        e = r["errors"]
        assert e[0].startswith("TypeError: ZeroRedundancyOptimizer: optimizer_class must be a "
                               "torch.optim.Optimizer subclass"), e
        assert e[1].startswith("NotImplementedError: ZeroRedundancyOptimizer(overlap_with_ddp"), e
        assert e[2].startswith(f"MismatchError: ZeroRedundancyOptimizer: rank {rank} and rank "), e
        assert "build it from the same model on every rank" in e[2], e
        # rank 2 left the last two parameters (head's) out
        assert re.search(r"group 0 has (8|6) parameter\(s\) on rank \d, (8|6) on rank \d\)", e[2]), e
        assert e[3].startswith("NotImplementedError: ZeroRedundancyOptimizer(torch.optim.LBFGS)")
        assert e[4].startswith("MismatchError: ZeroRedundancyOptimizer: rank ") and \
            "parameter 0 of group 1 is [" in e[4], e
        assert e[5] == 1, e  # the refused group is not kept
