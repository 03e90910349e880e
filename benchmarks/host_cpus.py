"""How steady this host's CPUs are, and whether two busy processes slow each other: for each CPU
a of --rows, a fixed piece of pure Python (ddpc.doctor.python_probe_ms, the kind of work a
training step's host side does) is timed on a alone, then again while a second process spins the
same work on CPU b, for every other CPU b. Each row prints a's time alone and, per b, the time
with b busy over the time alone; --repeats runs the whole table again, to show whether a pattern
holds. The hypervisor's steal time over the run (/proc/stat) is printed at the end.

    python benchmarks/host_cpus.py [--rows 0 3] [--repeats 2] [--reps 9]

On a machine of its own, every ratio is about 1.00, except for the CPU that shares a core with a
(SMT). On the shared virtual machines of the GPU hosts (session 16), the same work took 1.44 ms
on one vCPU in one table and 2.44 ms in the next, and a second busy process made it up to 2x
slower on some vCPUs and not at all on others, in a pattern that did not repeat: so two ranks'
Python slows by an amount that the ranks cannot choose or predict.
"""
import argparse
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from ddpc.doctor import host_load, python_probe_ms, read_cpu_times  # noqa: E402


def _timed(cpu: int, reps: int, q, bar) -> None:
    os.sched_setaffinity(0, {cpu})
    python_probe_ms()  # (warm)
    bar.wait()
    ts = sorted(python_probe_ms() for _ in range(reps))
    q.put(ts[len(ts) // 2])


def _spin(cpu: int, stop, bar) -> None:
    os.sched_setaffinity(0, {cpu})
    bar.wait()
    while not stop.is_set():
        python_probe_ms()


def measure(ctx, a: int, b, reps: int) -> float:
    """Median ms of the probe on CPU a, with CPU b spinning the same work (b None: alone)."""
    q, stop = ctx.Queue(), ctx.Event()
    bar = ctx.Barrier(1 if b is None else 2)
    procs = [ctx.Process(target=_timed, args=(a, reps, q, bar))]
    if b is not None:
        procs.append(ctx.Process(target=_spin, args=(b, stop, bar)))
    for p in procs:
        p.start()
    try:
        return q.get(timeout=60)
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[0, 3],
                    help="the CPUs to time (default 0 3)")
    ap.add_argument("--repeats", type=int, default=2, help="tables (default 2)")
    ap.add_argument("--reps", type=int, default=9, help="probe runs per measurement (default 9)")
    args = ap.parse_args()
    mine = sorted(os.sched_getaffinity(0))
    bad = [a for a in args.rows if a not in mine]
    if bad:
        ap.error(f"--rows: CPU {bad[0]} is not one this process may run on ({mine})")
    if args.repeats < 1 or args.reps < 1:
        ap.error("--repeats and --reps must be 1 or more")
    ctx = mp.get_context("fork")
    t0, stat0 = time.monotonic(), read_cpu_times()
    print(f"{len(mine)} CPUs; probe: {python_probe_ms():.2f} ms here; ratios: time with the CPU "
          f"of that column busy / time alone")
    print(" " * 32 + " ".join(f"{b:>4d}" for b in mine))
    for rep in range(args.repeats):
        for a in args.rows:
            alone = min(measure(ctx, a, None, args.reps) for _ in range(3))
            cells = ["   -" if b == a else f"{measure(ctx, a, b, args.reps) / alone:4.2f}"
                     for b in mine]
            print(f"table {rep} cpu {a:3d} alone {alone:6.2f} ms " + " ".join(cells), flush=True)
    stat1 = read_cpu_times()
    if stat0 and stat1:
        busy, steal = host_load(stat0, stat1, 0.0, os.cpu_count() or 1)
        print(f"over {time.monotonic() - t0:.0f} s: {busy:.1f} of {os.cpu_count()} CPUs busy on "
              f"average (this benchmark's two processes included), {steal:.1%} of CPU time stolen "
              f"by the hypervisor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
