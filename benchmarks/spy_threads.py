"""Summarizes a py-spy raw profile (`py-spy record --native --threads --idle --format raw`) by
thread: per process, the threads that match --thread (default: autograd's device threads, the
ones that run backward on a GPU), their samples split into busy and idle, and the functions
those samples were in (inclusive: each function once per sample) and ended in (self).

    py-spy record -s -n -t -i -r 250 -f raw -o ddpc.txt -- python benchmarks/ddp_step.py ...
    python benchmarks/spy_threads.py ddpc.txt bare.txt.gz --top 40

Compares files side by side: each column is a file's count of the matched threads' busy
samples, per process on average (time in that function, at the sampling rate), so two runs of
the same steps can be read together; --share gives percentages of each file's busy samples.
"""
import argparse
import collections
import gzip
import re
import sys

# A sample: the chain of processes down to the sampled one (with -s; none with -p), its thread, the frames
# from the outermost, and how many times it was seen.
LINE = re.compile(r'^((?:process \d+:".*?";)*)thread \(([0-9a-fx]+)\)(?:: ([^;]*))?;(.*) (\d+)$')
PID = re.compile(r'process (\d+):')
# Where an idle thread sits: waiting for work or for a lock, not running.
IDLE = ("pthread_cond_wait", "pthread_cond_timedwait", "__futex_abstimed_wait", "futex_wait",
        "epoll_wait", "poll (libc", "nanosleep", "sem_wait", "ReadyQueue::pop")
ADDR = re.compile(r"^0x[0-9a-f]+ ")


def clean(frame: str) -> str:
    """A frame without its address and argument list, so that the same function from two
    samples reads the same."""
    if ADDR.match(frame):  # no symbol: only its library is known
        return f"(unnamed) [{frame.partition(' (')[2].rstrip(')')}]"
    name, _, where = frame.partition(" (")
    name = re.sub(r"\(.*\)", "()", name) if len(name) < 300 else name[:120] + "..."
    lib = where.rstrip(")")
    lib = re.sub(r":\d+$", "", lib)  # python line numbers
    return f"{name} [{lib}]" if lib else name


def load(path: str, want: str):
    """{pid: {"busy": n, "idle": n, "incl": Counter, "self": Counter}} for matched threads."""
    out = {}
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for line in f:
            m = LINE.match(line.rstrip("\n"))
            if not m:
                continue
            chain, _tid, tname, stack, count = m.groups()
            pid = (PID.findall(chain) or ["-"])[-1]  # (-p: one process, no chain)
            frames = stack.split(";")
            if want not in (tname or "") and not any(want in fr for fr in frames):
                continue
            n = int(count)
            d = out.setdefault(pid, {"busy": 0, "idle": 0, "incl": collections.Counter(),
                                     "self": collections.Counter()})
            leaf = frames[-1]
            if any(k in fr for k in IDLE for fr in frames[-6:]):
                d["idle"] += n
                d["self"]["(idle) " + clean(leaf)] += n
                continue
            d["busy"] += n
            for fr in set(clean(fr) for fr in frames):
                d["incl"][fr] += n
            d["self"][clean(leaf)] += n
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--thread", default="thread_init",
                    help="a frame every matched thread's stack holds (default: thread_init, "
                         "autograd's device threads)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--grep", default="", help="only functions whose name holds this")
    ap.add_argument("--share", action="store_true", help="percent of busy samples, not counts")
    args = ap.parse_args()
    runs = [load(p, args.thread) for p in args.files]
    for path, run in zip(args.files, runs):
        for pid, d in sorted(run.items()):
            total = d["busy"] + d["idle"]
            print(f"{path} pid {pid}: {total} samples, {d['busy']} busy "
                  f"({100.0 * d['busy'] / max(total, 1):.0f}%), {d['idle']} idle")
    for kind in ("incl", "self"):
        share = []
        for run in runs:
            s = collections.Counter()
            for d in run.values():
                for fr, n in d[kind].items():
                    s[fr] += (100.0 * n / max(d["busy"], 1) if args.share else n) / len(run)
            share.append(s)
        keys = collections.Counter()
        for s in share:
            for fr, v in s.items():
                if args.grep in fr:
                    keys[fr] = max(keys[fr], v)
        busy = [sum(d["busy"] for d in run.values()) / max(len(run), 1) for run in runs]
        print(f"\n{'inclusive' if kind == 'incl' else 'self'}: "
              f"{'% of busy samples' if args.share else 'busy samples'} per process, mean "
              f"({' | '.join(f'{p}: {b:.0f}' for p, b in zip(args.files, busy))})")
        for fr, _ in keys.most_common(args.top):
            cells = " ".join(f"{s.get(fr, 0.0):7.1f}" for s in share)
            print(f"{cells}  {fr[:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
