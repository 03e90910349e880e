"""DistributedSampler: seconds for iter(sampler) on a dataset of --n indices (default 100M), that
is until the DataLoader can draw its first index, for ddpc and torch.utils.data.DistributedSampler
in the same process; then the seconds to drain the rank's indices as Python ints (iter included).

    python benchmarks/sampler.py                      # 100M, replicas 1 and 8
    python benchmarks/sampler.py --n 10000000 --no-torch

ddpc generates the rank's indices in C (Sanders' bucketed Fisher-Yates on up to 8 threads,
DDPC_SAMPLER_THREADS to change) into one int64 buffer; torch permutes with randperm and builds a
Python list of every index. Each variant runs --repeat times, alternating; the table shows the
first run (fresh memory) and the best. ratio = torch best / ddpc best (> 1: ddpc is faster).
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import time
from typing import Callable, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from ddpc.sampler import DistributedSampler  # noqa: E402


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def secs(t: Optional[float]) -> str:
    return "-" if t is None else f"{t:.3f}s"


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: List[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100_000_000, help="dataset length")
    p.add_argument("--replicas", default="1,8", help="comma-separated world sizes")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    p.add_argument("--no-drain", action="store_true", help="skip draining the Python ints")
    a = p.parse_args(argv)
    if a.n < 1 or a.repeat < 1:
        p.error("--n and --repeat must be >= 1")
    torch_sampler = None
    if not a.no_torch:
        from torch.utils.data import DistributedSampler as torch_sampler
    print(f"n={a.n:,} cpus={len(os.sched_getaffinity(0))} "
          f"DDPC_SAMPLER_THREADS={os.environ.get('DDPC_SAMPLER_THREADS', 'default')}")
    print(f"{'replicas':>8} {'indices':>12} {'ddpc first':>11} {'ddpc best':>10} "
          f"{'torch first':>12} {'torch best':>11} {'ratio':>6} {'drain ddpc':>11} "
          f"{'drain torch':>12}")
    for world in (int(x) for x in a.replicas.split(",")):
        ours = DistributedSampler(Sized(a.n), world, 0, seed=0)
        theirs = torch_sampler(Sized(a.n), world, 0, seed=0) if torch_sampler else None
        t_ours: List[float] = []
        t_theirs: List[float] = []
        for _ in range(a.repeat):
            t_ours.append(timed(lambda: iter(ours)))
            if theirs is not None:
                t_theirs.append(timed(lambda: iter(theirs)))
        drain = lambda s: collections.deque(iter(s), maxlen=0)  # noqa: E731
        d_ours = timed(lambda: drain(ours)) if not a.no_drain else None
        d_theirs = timed(lambda: drain(theirs)) if theirs is not None and not a.no_drain else None
        tb = min(t_theirs) if t_theirs else None
        print(f"{world:>8} {len(ours):>12,} {secs(t_ours[0]):>11} {secs(min(t_ours)):>10} "
              f"{secs(t_theirs[0] if t_theirs else None):>12} {secs(tb):>11} "
              f"{(f'{tb / min(t_ours):.1f}' if tb else '-'):>6} {secs(d_ours):>11} "
              f"{secs(d_theirs):>12}")


if __name__ == "__main__":
    main(sys.argv[1:])
