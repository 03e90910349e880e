"""Host time of a routed embedding lookup's pieces (python/ddpc/_rows.py), one rank, GPT-2's
shape (8x1024 tokens, a 50304x768 table): where the forward's extra host time with embedding rows
goes. Each piece runs `--iters` times back to back; the GPU is synchronized only around each
batch, so the times are the host's (launches, Python), as in a training step.

    python benchmarks/rows_host.py [--device cuda] [--iters 200]
"""
import argparse
import os
import socket
import statistics
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
    print(f"host us per call, median of 5 batches of {args.iters}, {dev}, torch {torch.__version__}")
    for name, fn in pieces:
        with torch.enable_grad():
            print(f"  {name:<48s} {timed(fn, args.iters, dev):8.1f}")
    ddpc.destroy_process_group()


if __name__ == "__main__":
    main()
