"""Where the time of one small GPU all_reduce goes: per-call time of ddpc and torch.distributed
(NCCL) for small float32 tensors, split into the host's enqueue time and the parts of ddpc's call
path, so the per-call target (<= 15 us up to 64 KiB) can be checked and explained.

    python benchmarks/latency.py --nproc 2 [--iters 2000]

Rank 0 prints, per size, in us per call:
  ddpc / torch        n calls in a loop, timed between two device syncs (what collectives.py reports)
  ddpc host / torch host   the same loop timed on the host before the final sync: when this is
                      close to the per-call time, the host is the bottleneck, not the GPU
  args                ddpc's Python argument handling alone (dtype, device, stream of the tensor)
  stream              torch.cuda.current_stream(...).cuda_stream alone
"""
import argparse
import os
import sys
import time

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_step import free_port  # noqa: E402  (same folder)


def per_call(fn, n, sync):
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    return (t2 - t0) / n * 1e6, (t1 - t0) / n * 1e6


def worker(rank, world, ports, args, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(ports[0]), DDPC_TOKEN="latency")
    import ddpc
    import ddpc.distributed as dd
    import torch.distributed as dist
    ddpc.init_process_group(backend="nccl")
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank,
                            world_size=world, device_id=dev)

    def sync():
        torch.cuda.synchronize(dev)

    rows = []
    size = 4
    while size <= args.max_bytes:
        x = torch.ones(size // 4, device=dev)
        ddpc.all_reduce(x)
        assert bool((x == world).all()), f"wrong result at {size} bytes"
        x.zero_()
        best = {}
        for _ in range(3):
            for name, fn in (("ddpc", lambda: ddpc.all_reduce(x)),
                             ("torch", lambda: dist.all_reduce(x))):
                dist.barrier()
                t, host = per_call(fn, args.iters, sync)
                if t < best.get(name, (1e9,))[0]:
                    best[name] = (t, host)
        args_us, _ = per_call(lambda: dd._as_buffer(x, "x"), args.iters, sync)
        stream_us, _ = per_call(lambda: torch.cuda.current_stream(dev).cuda_stream, args.iters,
                                sync)
        rows.append((size, best["ddpc"], best["torch"], args_us, stream_us))
        size *= 4
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()
    ddpc.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--max-bytes", type=int, default=1 << 20)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=worker, args=(r, args.nproc, ports, args, out))
             for r in range(args.nproc)]
    for pr in procs:
        pr.start()
    rows = out.get(timeout=300)
    for pr in procs:
        pr.join(timeout=60)
    print(f"all_reduce float32, {args.nproc} ranks, us per call (best of 3 rounds of "
          f"{args.iters}); host = enqueue time per call before the final sync")
    print(f"{'bytes':>8} {'ddpc':>7} {'host':>7} {'torch':>7} {'host':>7} {'args':>6} "
          f"{'stream':>7}")
    for size, d, t, a, s in rows:
        print(f"{size:>8} {d[0]:7.1f} {d[1]:7.1f} {t[0]:7.1f} {t[1]:7.1f} {a:6.1f} {s:7.1f}")
    return 0 if all(pr.exitcode == 0 for pr in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
