"""All-reduce bandwidth of ddpc against torch.distributed in the same processes (gloo for the cpu
backend, nccl for nccl), for float32 tensors in place, sizes doubling from --min-bytes to
--max-bytes. Units follow nccl-tests: algbw = bytes / time, busbw = algbw * 2 (n-1) / n.

    python benchmarks/collectives.py --backend cpu --nproc 2
    python benchmarks/collectives.py --backend nccl --nproc 2 --min-bytes 1048576

Each size is timed in rounds of --iters all-reduces (default: about 0.2 s of traffic, 3 to 200),
alternating ddpc and torch; the table shows each one's best round, so a burst of load from other
processes on the machine penalises neither side alone. ratio = torch time / ddpc time (> 1: ddpc
is faster)."""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

ROUNDS = 3


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["cpu", "nccl"], default="cpu")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (default 2)")
    p.add_argument("--min-bytes", type=int, default=4096)
    p.add_argument("--max-bytes", type=int, default=268435456)
    p.add_argument("--iters", type=int, default=0,
                   help="all-reduces per timed round (default: chosen per size)")
    p.add_argument("--json", default="", help="also write the rows to this file")
    a = p.parse_args(argv)
    if a.nproc < 1:
        p.error(f"--nproc must be >= 1, got {a.nproc}")
    if a.min_bytes < 4 or a.max_bytes < a.min_bytes:
        p.error(f"need 4 <= --min-bytes <= --max-bytes, got {a.min_bytes} and {a.max_bytes}")
    if a.iters < 0:
        p.error(f"--iters must be >= 0, got {a.iters}")
    return a


def sizes(lo: int, hi: int) -> List[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s // 4 * 4)
        s *= 2
    return out


def iters_for(nbytes: int, fixed: int) -> int:
    return fixed if fixed else max(3, min(200, int(0.2e9 / nbytes)))


def worker(args: argparse.Namespace) -> None:
    """One rank: initializes ddpc and torch.distributed side by side and times both."""
    import torch
    import torch.distributed as dist

    import ddpc

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    ddpc.init_process_group(backend=args.backend, init_method="file://" + os.environ["BENCH_RDV"],
                            timeout=300)
    dist.init_process_group("gloo" if args.backend == "cpu" else "nccl",
                            init_method=f"tcp://127.0.0.1:{os.environ['BENCH_TORCH_PORT']}",
                            rank=rank, world_size=world)
    dev = torch.device("cpu") if args.backend == "cpu" else torch.device("cuda", local)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def timed(fn, x, n: int) -> float:
        """Seconds per all-reduce over n calls, the slowest rank's view (all ranks agree). The
        rendezvous and the max go through torch on the benchmark's device (NCCL takes no host
        tensors), outside the timed loop."""
        dist.all_reduce(torch.zeros(1, device=dev))
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn(x)
        sync()
        dt = torch.tensor([(time.perf_counter() - t0) / n], dtype=torch.float64, device=dev)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt.item())

    rows: List[Dict] = []
    for nbytes in sizes(args.min_bytes, args.max_bytes):
        n = iters_for(nbytes, args.iters)
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        # Correctness first (a fast wrong answer is no result), then zeros: repeated in-place sums
        # of zeros never overflow and never hit denormals.
        ddpc.all_reduce(x)
        sync()
        assert bool((x == world).all()), f"ddpc all_reduce gave a wrong result at {nbytes} bytes"
        x.zero_()
        ddpc.all_reduce(x)
        dist.all_reduce(x)
        best = {"ddpc": float("inf"), "torch": float("inf")}
        for _ in range(ROUNDS):
            best["ddpc"] = min(best["ddpc"], timed(ddpc.all_reduce, x, n))
            best["torch"] = min(best["torch"], timed(dist.all_reduce, x, n))
        rows.append({"bytes": nbytes, "iters": n, "ddpc_s": best["ddpc"], "torch_s": best["torch"]})
        if rank == 0:
            print_row(rows[-1], world, args.backend)
    dist.destroy_process_group()
    ddpc.destroy_process_group()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "nproc": world, "rows": rows}, f, indent=1)


def fmt_size(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def print_row(r: Dict, world: int, backend: str) -> None:
    bus = 2 * (world - 1) / world
    cells = [f"{fmt_size(r['bytes']):>9}"]
    for key in ("ddpc_s", "torch_s"):
        t = r[key]
        alg = r["bytes"] / t / 1e9
        cells += [f"{t * 1e6:>11.1f}", f"{alg:>7.2f}", f"{alg * bus:>7.2f}"]
    cells.append(f"{r['torch_s'] / r['ddpc_s']:>6.2f}")
    print("  ".join(cells), flush=True)


def header(world: int, backend: str) -> None:
    base = "gloo" if backend == "cpu" else "nccl"
    print(f"all_reduce float32 sum in place, {world} ranks, ddpc backend={backend} vs "
          f"torch.distributed {base}; time in us, algbw/busbw in GB/s; ratio = {base} time / "
          f"ddpc time")
    print("  ".join([f"{'size':>9}", f"{'ddpc time':>11}", f"{'algbw':>7}", f"{'busbw':>7}",
                     f"{base + ' time':>11}", f"{'algbw':>7}", f"{'busbw':>7}", f"{'ratio':>6}"]),
          flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, argv: List[str]) -> int:
    """Starts --nproc copies of this script as ranks; returns the first failing exit code."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    pypath = os.path.join(os.path.dirname(here), "python")
    env["PYTHONPATH"] = pypath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("DDPC_TOKEN", os.urandom(16).hex())
    env.setdefault("OMP_NUM_THREADS", "1")
    header(args.nproc, args.backend)
    with tempfile.TemporaryDirectory() as tmp:
        env.update({"WORLD_SIZE": str(args.nproc), "LOCAL_WORLD_SIZE": str(args.nproc),
                    "BENCH_RDV": os.path.join(tmp, "rdv"), "BENCH_TORCH_PORT": str(free_port()),
                    "BENCH_WORKER": "1"})
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__)] + argv,
                                  env=dict(env, RANK=str(r), LOCAL_RANK=str(r)))
                 for r in range(args.nproc)]
        codes = [p.wait() for p in procs]
    bad = [(r, c) for r, c in enumerate(codes) if c != 0]
    for r, c in bad:
        print(f"rank {r} failed with exit code {c}", file=sys.stderr)
    return bad[0][1] if bad else 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    parsed = parse_args(argv)
    if os.environ.get("BENCH_WORKER") == "1":
        worker(parsed)
    else:
        sys.exit(launch(parsed, argv))
