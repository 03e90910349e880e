"""Host time of a routed embedding lookup's pieces (python/ddpc/_rows.py), one rank, GPT-2's
shape (8x1024 tokens, a 50304x768 table): where the forward's extra host time with embedding rows
goes. Each piece runs `--iters` times back to back; the GPU is synchronized only around each
batch, so the times are the host's (launches, Python), as in a training step.

    python benchmarks/rows_host.py [--device cuda] [--iters 200] [--model [--profile]]
"""
import argparse
import gc
import os
import socket
import statistics
import sys
import time

import torch

import ddpc
from ddpc import _rows


def timed(fn, iters, dev):
    """Median host microseconds per call over 5 batches of iters calls."""
    out = []
    for _ in range(5):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        out.append((time.perf_counter() - t) / iters * 1e6)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--model", action="store_true",
                    help="also GPT-2's whole forward and backward with rows on and off")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--size", choices=["gpt2", "small"], default="gpt2",
                    help="with --model: ddp_step.py's model of that name")
    ap.add_argument("--profile", action="store_true",
                    help="with --model: torch.profiler's costliest host calls of the forward")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("DDPC_TOKEN", "rows-host")
    ddpc.init_process_group(backend="nccl" if args.device == "cuda" else "cpu",
                            init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    dev = ddpc.device() if args.device == "cuda" else torch.device("cpu")
    emb = torch.nn.Embedding(50304, 768).to(dev)
    idx = torch.randint(0, 50304, (8, 1024), device=dev)
    store = ddpc.distributed.get_store()
    anchor = torch.zeros((), requires_grad=True)
    route = _rows.Route(emb, 0, "wte")
    calls = []
    step = [0]

    def lookup():
        step[0] += 1
        out = _rows.lookup(route, idx, anchor, store, "rows-host", 0, step[0], calls)
        calls.clear()
        return out

    def rows_apply():
        call = _rows.Call(route, idx, 0, 0, [])
        return _rows._Rows.apply(anchor, idx, emb.weight.detach(), None, call)

    pieces = [
        ("embedding module forward (the lookup itself)", lambda: emb(idx)),
        ("F.embedding on the detached weight", lambda: torch.nn.functional.embedding(
            idx, emb.weight.detach())),
        ("torch.sort(stable=True) of the indices", lambda: torch.sort(idx.reshape(-1),
                                                                      stable=True)),
        ("_Rows.apply (autograd Function)", rows_apply),
        ("store.set_posted of the count", lambda: store.set_posted("rows-host/k", b"1:8192")),
        ("store.set of the count (waits for the reply)", lambda: store.set("rows-host/k",
                                                                             b"1:8192")),
        ("the whole routed lookup (_rows.lookup)", lookup),
    ]
    print(f"host us per call, median of 5 batches of {args.iters}, {dev}, "
          f"torch {torch.__version__}")
    for name, fn in pieces:
        with torch.enable_grad():
            print(f"  {name:<48s} {timed(fn, args.iters, dev):8.1f}")
    if args.model:
        whole_model(args, dev)
    ddpc.destroy_process_group()


def _timed(fn, spent, name):
    """fn, adding its host seconds to spent[name]."""
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
    timed.__wrapped__ = fn
    return timed


class _NoStore:
    """Takes the counts and drops them (one rank reads none back)."""

    def set_posted(self, key, value):
        pass


def whole_model(args, dev):
    """The GPT-2 of ddp_step.py wrapped with rows on and off: each step synchronized, then the
    host's forward (model + loss, bf16 autocast) and backward, median ms; then torch.profiler's
    costliest host calls in three forwards with rows off and on (a wait for the GPU would show
    there)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import ddp_step
    cfg = ddp_step.MODELS[args.size]
    print(f"\n{args.size} forward and backward on the host, {args.steps} synchronized steps, "
          f"median ms")
    profiled = set()
    # (the "without" variants take one piece out of the routed lookup, to attribute its cost:
    # without the sort the exchanged gradient is wrong, so they are for timing only)
    variants = ["off", "on", "on without the sort", "on without the store", "on, gc disabled"]
    real_sort = torch.sort
    for variant in variants * 2:
        mode = "0" if variant == "off" else "1"
        os.environ["DDPC_EMBEDDING_ROWS"] = mode
        torch.manual_seed(0)
        with dev:
            model = ddp_step.GPT(cfg["layers"], cfg["width"], cfg["heads"], cfg["vocab"],
                                 cfg["seq"])
        wrapped = ddpc.wrap_model(model)
        if variant == "on without the sort":
            torch.sort = lambda t, stable=False: (t, torch.arange(t.numel(), device=t.device))
        if variant == "on without the store":
            wrapped._rows_store = _NoStore()
        if variant == "on, gc disabled":
            gc.disable()
        x = torch.randint(0, cfg["vocab"], (8, cfg["seq"]), device=dev)
        fwd, bwd = [], []

        def forward(wrapped=wrapped, x=x):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                logits = wrapped(x)
            return torch.nn.functional.cross_entropy(logits.float().view(-1, cfg["vocab"]),
                                                     x.view(-1))

        # host seconds inside these functions during the timed steps
        spent = {}
        module_forward = model.forward
        model.forward = _timed(module_forward, spent, "model forward")
        originals = [(ddpc.parallel.DistributedModel, "_routed_lookup"), (_rows, "lookup"),
                     (_rows, "exchange"), (ddpc.parallel.DistributedModel, "_attach_sink")]
        for owner, attr in originals:
            setattr(owner, attr, _timed(getattr(owner, attr), spent, attr))
        for k in range(args.steps + 3):
            if k == 3:
                spent.clear()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            loss = forward()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            for p in model.parameters():
                p.grad = None
            if k >= 3:
                fwd.append((t1 - t0) * 1e3)
                bwd.append((t2 - t1) * 1e3)
        torch.sort = real_sort
        gc.enable()
        for owner, attr in originals:
            setattr(owner, attr, getattr(owner, attr).__wrapped__)
        inside = "  ".join(f"{name} {t / args.steps * 1e3:.3f}" for name, t in spent.items())
        q = statistics.quantiles(fwd, n=10)
        print(f"  rows {variant:<22s} forward {statistics.median(fwd):6.2f} (10%-90% "
              f"{q[0]:5.2f}-{q[-1]:5.2f})  backward {statistics.median(bwd):6.2f}")
        print(f"    ms per step inside: {inside}")
        if args.profile and variant in ("on", "off") and variant not in profiled:
            profiled.add(variant)
            from torch.profiler import ProfilerActivity, profile
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda"
                                             else [])
            with profile(activities=acts) as prof:
                for _ in range(3):
                    loss = forward()
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
            print(f"rows {variant}: three forwards")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                            max_name_column_width=48))
        del wrapped, model
    os.environ.pop("DDPC_EMBEDDING_ROWS", None)


if __name__ == "__main__":
    main()
