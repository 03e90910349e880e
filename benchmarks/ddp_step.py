"""One DDP training step, ddpc.wrap_model against torch DistributedDataParallel, in the same
spawned processes: ms/step (median after warm-up; the variants take turns, two steps at a time),
the ratio to torch DDP, the peak memory each variant adds to its process (RSS on cpu,
torch.cuda.max_memory_allocated on cuda, measured while it is built and warmed up) and scaling
efficiency (1-process ms / N-process ms at the same per-process batch).

    python benchmarks/ddp_step.py --device cpu --nproc 2 --steps 10
    python benchmarks/ddp_step.py --device cuda --nproc 2 --steps 30 --json ddp.json
    python benchmarks/ddp_step.py --device cuda --nproc 2 --p2p off    # NCCL_P2P_DISABLE=1
    python benchmarks/ddp_step.py --device cuda --nproc 2 --pipelined  # no sync between steps
    python benchmarks/ddp_step.py --device cuda --nproc 2 --trace 2    # every bucket, every rank

Every step is synchronized by default, to time its phases on the host and the GPU; --pipelined
issues rounds of steps back to back instead, as a training loop that does not wait for each step.
--trace runs more steps of each ddpc variant under ddpc.comm_trace afterwards and prints each
gradient bucket's collective on every rank.

The host decides much of a synchronized GPU step, so the tables also say how the host was:
"rounds p25-p75" is how far the paired ratio scattered from round to round (the run's own
noise), "host probe ms" is how long a fixed piece of Python took right before each step (the
slower rank's median: ddpc.doctor's probe), and the env line gives the machine's busy CPUs and
hypervisor steal during the timed steps; a last table gives the CPU time per step of rank 0's
threads, by name (ddpc names its own: ddpc-poster, ddpc-watchdog, ddpc-store, ...).
--cpus "0-7;8-15" runs each rank on its own CPUs.

On 2 H200s the gpt2 run takes about a minute: start and NCCL setup ~15 s, then 5 variants of
3 warm-up + 30 timed steps of roughly 50-100 ms each.
"""
import argparse
import gc
import json
import math
import queue
import resource
import signal
import os
import socket
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
# (the host's steadiness, measured as `python -m ddpc.doctor` does: a fixed piece of Python run
# right before each timed step, and /proc/stat around the timed steps)
from ddpc.doctor import host_load, python_probe_ms, read_cpu_times  # noqa: E402

MODELS = {
    # layers, width, heads, vocab, seq, batch per process
    "small": dict(layers=4, width=256, heads=4, vocab=8192, seq=128, batch=8),
    "gpt2": dict(layers=12, width=768, heads=12, vocab=50304, seq=1024, batch=8),
}


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    """GPT-2 shaped: learned positions, pre-norm blocks, output head tied to the embedding."""

    def __init__(self, layers: int, width: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Embedding(seq, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.wte.weight.t()


class GcTimer:
    """Host time spent in Python's garbage collector (gc.callbacks), to tell a phase slowed by a
    collection that happened to fall in it from one slowed by its own work."""

    ns = 0
    _t0 = 0

    @classmethod
    def install(cls) -> None:
        def cb(phase: str, info: dict) -> None:
            if phase == "start":
                cls._t0 = time.perf_counter_ns()
            elif cls._t0:
                cls.ns += time.perf_counter_ns() - cls._t0
                cls._t0 = 0
        gc.callbacks.append(cb)

    @classmethod
    def ms(cls) -> float:
        return cls.ns * 1e-6


_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)


def threads_cpu_ns() -> dict:
    """{thread name: CPU ns so far} over this process's threads, those of one name summed:
    /proc/self/task/*/schedstat (ns), else the clock ticks of .../stat. Threads that ended are
    not counted, so read it around steps, not across a thread's end."""
    out = {}
    tick_ns = 1e9 / os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    ns = int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ns = int((int(fields[11]) + int(fields[12])) * tick_ns)
        except (OSError, ValueError, IndexError):
            continue  # (a thread that ended meanwhile)
        out[name] = out.get(name, 0) + ns
    return out


def thread_usage() -> tuple:
    """This thread's (minor page faults, voluntary, involuntary context switches) so far."""
    if _RUSAGE_THREAD is None:
        return (0, 0, 0)
    r = resource.getrusage(_RUSAGE_THREAD)
    return (r.ru_minflt, r.ru_nvcsw, r.ru_nivcsw)


def current_cpu() -> int:
    """The CPU this thread last ran on (field 39 of /proc/thread-self/stat), -1 if unknown."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


def mib_now(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2 ** 20
    return _status_mib("VmRSS:")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        # "5" resets the peak resident set size (VmHWM) of this process (Linux >= 4.0).
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return _status_mib("VmHWM:")


# What the results depend on besides the code, printed with them and written to the JSON.
ENV_VARS = ("NCCL_P2P_DISABLE", "NCCL_NVLS_ENABLE", "NCCL_ALGO", "NCCL_PROTO", "NCCL_IB_DISABLE",
            "NCCL_SHM_USE_CUDA_MEMCPY", "NCCL_SHM_MEMCPY_MODE", "CUDA_VISIBLE_DEVICES",
            "OMP_NUM_THREADS", "DDPC_NCCL_MIN_CTAS", "DDPC_NCCL_MAX_CTAS", "DDPC_TAIL_BUCKET_MB",
            "DDPC_STAGED_ALLREDUCE", "DDPC_STAGED_OVERLAP", "DDPC_NCCL_POST_THREAD",
            "DDPC_EMBEDDING_ROWS", "DDPC_CAST_BACK", "DDPC_NCCL_WINDOW_MB")


def describe_env(device: torch.device) -> dict:
    import ddpc
    env = {k: os.environ.get(k) for k in ENV_VARS}
    env["torch"] = torch.__version__
    env["cpus"] = f"{len(os.sched_getaffinity(0))} of {os.cpu_count()}"
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        v = torch.cuda.nccl.version()  # a tuple in recent torch, an int code in older ones
        env["torch_nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        env["ddpc_nccl"] = ddpc._C.nccl_version()
    return env


class Variant:
    """One way of training the model: its own model and optimizer, stepped on demand."""

    def __init__(self, name: str, wrap, single: bool = False, env=None, zero=False) -> None:
        self.name, self.wrap, self.single = name, wrap, single
        self.zero = zero  # the AdamW sharded by ddpc.ZeroRedundancyOptimizer
        self.env = env or {}  # environment while the model is wrapped and warmed up
        self.times = []
        self.phases = []  # per timed step: host ms and GPU ms of forward, backward, optimizer,
        # and for ddpc the GPU backward split where its end of backward begins (see _build)
        self._end_ev = None
        self._trace = None  # the ddpc.comm_trace of a traced step (--trace)
        self.traced = []  # per traced step: its marks and buckets (trace_summary)
        self.alloc = [0, 0, 0]  # over the timed steps: cudaMalloc and cudaFree calls, retries
        # over the timed steps, the main thread in the forward: minor page faults, voluntary and
        # involuntary context switches; and steps at whose end it ran on another CPU than at
        # their start (read outside the timed part)
        self.host_ev = [0, 0, 0, 0]
        self.probes = []  # python_probe_ms() before each synchronized timed step
        self.thread_ns = {}  # CPU ns of this process's threads in the timed steps, by name
        self.mem = float("nan")

    def build(self, cfg, args, device, rank) -> None:
        """Creates model and optimizer and runs the warm-up steps; self.mem receives the peak
        memory this variant added on top of what the process held before (MiB)."""
        gc.collect()
        before = mib_now(device)
        peak_reset(device)
        torch.manual_seed(0)
        # Parameters are created on the device directly: initializing GPT-2 on the host takes
        # seconds per variant. The wrapper (DDP, ddpc) is applied outside that context.
        with device:
            model = GPT(cfg["layers"], cfg["width"], cfg["heads"], cfg["vocab"], cfg["seq"])
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            self._build(model, args, device, rank, cfg)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self.mem = peak_mib(device) - before
        # ddpc's symmetric window (DDPC_NCCL_WINDOW_MB) is outside torch's allocator, held from
        # the wrapper's construction on: it counts in full.
        self.mem += getattr(self.model, "_window_bytes", 0) / 2 ** 20
        if hasattr(self.model, "host_times"):
            self.model.host_times()  # (from here on: the timed steps only)

    def _build(self, model, args, device, rank, cfg) -> None:
        # The host time of the model's own forward, inside whatever wraps it: what the wrapper
        # adds around it is the rest of the host forward.
        self._module_ms = 0.0
        module_forward = model.forward

        def timed_forward(*a, **k):
            t = time.perf_counter()
            try:
                return module_forward(*a, **k)
            finally:
                self._module_ms += (time.perf_counter() - t) * 1e3
        model.forward = timed_forward
        self.model = self.wrap(model)
        if device.type == "cuda" and hasattr(self.model, "_finalize_on_device"):
            # An event on the stream backward ran on, where ddpc's end of backward begins: before
            # it, the backward's kernels (with the gradient copies or casts, beside the
            # collectives already running); after it, what the step waits for at the end (the
            # last collectives, and the casts back of bf16 gradients).
            finalize = self.model._finalize_on_device

            def marked_finalize() -> None:
                if self._end_ev is not None:
                    self._end_ev.record()
                if self._trace is not None:
                    self._trace.mark("end")
                finalize()
            self.model._finalize_on_device = marked_finalize
        fused = {"fused": True} if device.type == "cuda" else {}
        if self.zero:
            import ddpc
            self.opt = ddpc.ZeroRedundancyOptimizer(self.model.parameters(), torch.optim.AdamW,
                                                    lr=1e-4, weight_decay=0.1, **fused)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1,
                                         **fused)
        self.gen = torch.Generator().manual_seed(1234 + rank)
        self.cfg, self.device = cfg, device
        for _ in range(args.warmup):
            self.step(timed=False)

    def traced_step(self) -> None:
        """One untimed step inside ddpc.comm_trace, with marks where backward begins, where
        ddpc's end of backward begins, and where backward and the optimizer return."""
        import ddpc
        with ddpc.comm_trace(capacity=256) as trace:
            # The ranks start the step together, as after any step's last all-reduce; the
            # barrier's row comes before the step's mark and is left out.
            ddpc.barrier()
            torch.cuda.synchronize()
            self._trace = trace
            try:
                self.step(timed=False)
            finally:
                self._trace = None
        self.traced.append(trace_summary(trace))

    def _alloc_counts(self):
        if self.device.type != "cuda":
            return (0, 0, 0)
        st = torch.cuda.memory_stats(self.device)
        return (st.get("num_device_alloc", 0), st.get("num_device_free", 0),
                st.get("num_alloc_retries", 0))

    def _count_alloc(self, before) -> None:
        for k, (a, b) in enumerate(zip(self._alloc_counts(), before)):
            self.alloc[k] += a - b

    def batch(self):
        cfg = self.cfg
        shape = (cfg["batch"], cfg["seq"])
        x = torch.randint(0, cfg["vocab"], shape, generator=self.gen).to(self.device)
        y = torch.randint(0, cfg["vocab"], shape, generator=self.gen).to(self.device)
        return x, y

    def run_round(self, k: int) -> None:
        """--pipelined: k timed steps issued back to back, as a training loop that does not
        wait for each step does, with one synchronize after the last; each gets the round's
        mean. The batches are on the device first (a copy from pageable host memory would wait
        for the GPU), and the losses are checked after the round."""
        cuda = self.device.type == "cuda"
        batches = [self.batch() for _ in range(k)]
        if cuda:
            torch.cuda.synchronize()
        before = self._alloc_counts()
        t0 = time.perf_counter()
        losses = [self.step(timed=False, data=b, sync=False) for b in batches]
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / k
        self._count_alloc(before)
        self.times += [ms] * k
        for loss in losses:
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"{self.name}: the loss is {loss.item()}")

    def step(self, timed: bool = True, data=None, sync: bool = True):
        cfg, device = self.cfg, self.device
        x, y = data if data is not None else self.batch()
        cuda = device.type == "cuda"
        before = self._alloc_counts() if timed else None
        self._module_ms = 0.0
        if timed and sync:
            self.probes.append(python_probe_ms())
            cpu_before = threads_cpu_ns()
        if not sync:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                logits = self.model(x)
            loss = F.cross_entropy(logits.float().view(-1, cfg["vocab"]), y.view(-1))
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return loss.detach()
        if cuda:
            torch.cuda.synchronize()
            if self._trace is not None:
                self._trace.mark("step")
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            if hasattr(self.model, "_finalize_on_device"):
                self._end_ev = torch.cuda.Event(enable_timing=True)
        marks, gc_ms, usage = [], [], []
        cpu0 = current_cpu() if timed else -1

        def mark() -> None:
            gc_ms.append(GcTimer.ms())
            usage.append(thread_usage())
            marks.append(time.perf_counter())
            if cuda:
                ev[len(marks) - 1].record()

        mark()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = self.model(x)
        loss = F.cross_entropy(logits.float().view(-1, cfg["vocab"]), y.view(-1))
        mark()
        if self._trace is not None:
            self._trace.mark("backward")
        loss.backward()
        mark()
        if self._trace is not None:
            self._trace.mark("backward returned")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        mark()
        if self._trace is not None:
            self._trace.mark("optimizer returned")
        if cuda:
            torch.cuda.synchronize()
        if timed:
            self.times.append((time.perf_counter() - marks[0]) * 1e3)
            host = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
            gpu = [a.elapsed_time(b) for a, b in zip(ev, ev[1:])] if cuda else [0.0] * 3
            split = [math.nan, math.nan]
            if cuda and self._end_ev is not None:
                split = [ev[1].elapsed_time(self._end_ev), self._end_ev.elapsed_time(ev[2])]
            self.phases.append(host + gpu + split + [self._module_ms, gc_ms[1] - gc_ms[0],
                                                     gc_ms[-1] - gc_ms[0]])
            self._count_alloc(before)
            fwd = [b - a for a, b in zip(usage[0], usage[1])]
            cpu1 = current_cpu()
            self.host_ev = [t + d for t, d in zip(self.host_ev, fwd + [int(cpu0 != cpu1)])]
            for name, ns in threads_cpu_ns().items():
                self.thread_ns[name] = self.thread_ns.get(name, 0) + ns - cpu_before.get(name, 0)
        self._end_ev = None
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"{self.name}: the loss is {loss.item()}")


def trace_summary(trace) -> dict:
    """A traced step, in ms after its backward began on this rank: the marks, and per
    collective of the step (the gradient buckets, in posting order) its bytes, path and five
    points."""
    marks = dict(trace.marks)
    t0 = marks["backward"]
    return {"marks": {k: v - t0 for k, v in marks.items() if k != "start"},
            # (an all-gather is an embedding's rows: ddpc/_rows.py)
            "buckets": [(r.nbytes, ("gather/" if "gather" in r.op else "") + r.path,
                         r.ready - t0, r.start - t0, r.wire - t0, r.reduced - t0, r.done - t0)
                        for r in trace.rows
                        if r.ready >= marks["step"]]}


def print_traces(name: str, per_rank: list) -> None:
    """The buckets of a variant's traced steps, medians over the steps, every rank side by side
    (r0/r1/...): when each bucket's gradients were ready, how long it queued (for ddpc's posting
    thread to issue it, then behind the collectives before it on the communication stream), how
    long its collective took, and when it was done;
    then where the end of backward began and backward returned. Each rank's times count from
    its own backward's start; subtracting rank r's `offset` puts its times on rank 0's clock
    (taken from the moment the last collective ended, the same on every rank). Of a bucket's
    `took`, the smallest over the ranks is about its transfer; the rest, on the other ranks,
    is waiting for the last rank to arrive."""
    steps = min(len(t) for t in per_rank)
    if not steps:
        return
    nb = min(len(t[0]["buckets"]) for t in per_rank)

    def med(r, f):
        return statistics.median(f(per_rank[r][s]) for s in range(steps))

    ranks = range(len(per_rank))

    def cell(f, width=6):
        return "/".join(f"{med(r, f):{width}.2f}" for r in ranks)
    last = nb - 1
    offs = [statistics.median(per_rank[r][s]["buckets"][last][5]
                              - per_rank[0][s]["buckets"][last][5] for s in range(steps))
            for r in ranks]
    print(f"trace of {name}: {steps} steps, {nb} collectives a step; ms after backward began "
          f"(rank " + "/".join(str(r) for r in ranks) + "); offset of each rank's clock: "
          + "/".join(f"{o:.2f}" for o in offs))
    print(f"{'#':>4s} {'MiB':>7s} {'path':<13s} {'ready':>20s} {'queued':>20s} {'took':>20s} "
          f"{'done':>20s}")
    for k in range(nb):
        nbytes, path = per_rank[0][0]["buckets"][k][:2]
        print(f"{k:4d} {nbytes / 2**20:7.1f} {path:<13s} "
              f"{cell(lambda t: t['buckets'][k][2]):>20s} "
              f"{cell(lambda t: t['buckets'][k][3] - t['buckets'][k][2]):>20s} "
              f"{cell(lambda t: t['buckets'][k][5] - t['buckets'][k][4]):>20s} "
              f"{cell(lambda t: t['buckets'][k][6]):>20s}")
    for label in ("step", "end", "backward returned", "optimizer returned"):
        if all(label in per_rank[r][0]["marks"] for r in ranks):
            name = "step began" if label == "step" else label
            print(f"     {name:<17s} {cell(lambda t: t['marks'][label]):>20s}")


def worker(rank, args, ports, results):
    try:
        _worker(rank, args, ports, results)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


def parse_cpus(text: str, nproc: int) -> list:
    """--cpus "0-7;16-23": one CPU set per rank, ';' between ranks, each a list of CPUs and
    ranges ("0,2,4-7")."""
    sets = []
    for part in text.split(";"):
        cpus = set()
        for item in part.split(","):
            a, _, b = item.strip().partition("-")
            if not a.isdigit() or (b and not b.isdigit()) or (b and int(b) < int(a)):
                raise ValueError(f"--cpus {text!r}: {item.strip()!r} is not a CPU or a range "
                                 f"such as 4-7")
            cpus.update(range(int(a), int(b or a) + 1))
        sets.append(cpus)
    if len(sets) != nproc:
        raise ValueError(f"--cpus {text!r} gives {len(sets)} CPU sets for {nproc} processes: "
                         f"give one per rank, separated by ';'")
    return sets


def _worker(rank, args, ports, results):
    os.environ.setdefault("DDPC_TOKEN", "ddp-step-benchmark")
    if args.cpus:
        os.sched_setaffinity(0, parse_cpus(args.cpus, args.nproc)[rank])
    if args.p2p == "off":
        os.environ["NCCL_P2P_DISABLE"] = "1"
    elif args.p2p == "on":
        os.environ.pop("NCCL_P2P_DISABLE", None)
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpc

    n = args.nproc
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    backend = "nccl" if args.device == "cuda" else "cpu"
    ddpc.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{ports[0]}",
                            rank=rank, world_size=n)
    tdist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                             init_method=f"tcp://127.0.0.1:{ports[1]}", rank=rank, world_size=n,
                             device_id=device if args.device == "cuda" else None)
    cfg = MODELS[args.model]
    ids = [rank] if args.device == "cuda" else None

    def pair(f32: str, bf16: str, env=None, **kw):
        """ddpc with float32 gradients and with bf16 ones, the other wrap_model arguments kw."""
        return [Variant(f32, lambda m: ddpc.wrap_model(m, **kw), env=env),
                Variant(bf16, lambda m: ddpc.wrap_model(m, grad_dtype=torch.bfloat16, **kw),
                        env=env)]

    variants = [
        Variant("1 process (no DDP)", lambda m: m, single=True),
        *([Variant("no DDP, every rank", lambda m: m)] if args.no_ddp_every_rank else []),
        Variant("torch DDP", lambda m: DDP(m, device_ids=ids, bucket_cap_mb=25)),
        Variant("torch DDP bucket_view+static", lambda m: DDP(
            m, device_ids=ids, bucket_cap_mb=25, gradient_as_bucket_view=True,
            static_graph=True)),
        *pair("ddpc", "ddpc grad_dtype=bf16"),
    ]
    if args.embedding_rows:
        # What exchanging the embedding lookups' gradients as rows does (ddpc/_rows.py), forced
        # on and forced off (DDPC_EMBEDDING_ROWS, read by wrap_model; by default it is on only
        # for NCCL through host memory).
        variants += pair("ddpc rows on", "ddpc bf16 rows on", env={"DDPC_EMBEDDING_ROWS": "1"})
        variants += pair("ddpc rows off", "ddpc bf16 rows off",
                         env={"DDPC_EMBEDDING_ROWS": "0"})
    if args.per_gradient:
        # What copying (casting) a bucket's gradients in one launch when it is complete saves:
        # one launch per gradient as it arrives (DDPC_GRAD_BATCH=0, read when a reducer is made,
        # so set while the variant is built and warmed up, which makes its last reducer).
        variants += pair("ddpc per-gradient copies", "ddpc bf16 per-gradient casts",
                         env={"DDPC_GRAD_BATCH": "0"})
    if args.inline_posts:
        # What issuing the buckets' collectives from ddpc's posting thread saves the host path
        # of the backward: issued by the thread that runs the gradient hooks instead
        # (DDPC_NCCL_POST_THREAD=0, read when a reducer is made).
        variants += pair("ddpc inline posts", "ddpc bf16 inline posts",
                         env={"DDPC_NCCL_POST_THREAD": "0"})
    if args.hook_cost:
        # What the hook mechanism alone costs the backward's host thread: the model without DDP
        # on every rank (as "no DDP, every rank"), with a Python post-accumulate-grad hook on
        # every parameter that does nothing.
        def noop_hooks(m):
            for p in m.parameters():
                p.register_post_accumulate_grad_hook(lambda t: None)
            return m
        variants.append(Variant("no DDP, every rank, no-op hooks", noop_hooks))
    if args.zero:
        # What sharding AdamW's moments over the ranks saves in memory (about 1/world of 8 bytes
        # per parameter is held) and costs in time (each rank's share of the parameters is
        # broadcast to the others after the step).
        variants += [Variant("ddpc + ZeRO AdamW", lambda m: ddpc.wrap_model(m), zero=True),
                     Variant("ddpc bf16 + ZeRO AdamW",
                             lambda m: ddpc.wrap_model(m, grad_dtype=torch.bfloat16), zero=True)]
    if args.comm_casts:
        # What casting a bf16 bucket to and from the wire on the communication stream, around
        # its collective, saves: the casts leave the backward's stream and the casts back leave
        # the end of backward (DDPC_COMM_CASTS=1, read when a reducer is made).
        variants.append(Variant("ddpc bf16 casts on comm stream",
                                lambda m: ddpc.wrap_model(m, grad_dtype=torch.bfloat16),
                                env={"DDPC_COMM_CASTS": "1"}))
    if args.early_cast_back:
        # What casting each bf16 bucket back as soon as its all-reduce is done, on a stream of
        # its own, saves the end of backward (DDPC_CAST_BACK=early, read when a reducer is
        # made); with --embedding-rows also with rows on, whose end has no all-reduce of the
        # tied table for the casts back to overlap.
        variants.append(Variant("ddpc bf16 early cast back",
                                lambda m: ddpc.wrap_model(m, grad_dtype=torch.bfloat16),
                                env={"DDPC_CAST_BACK": "early"}))
        if args.embedding_rows:
            variants.append(Variant("ddpc bf16 rows on, early cast back",
                                    lambda m: ddpc.wrap_model(m, grad_dtype=torch.bfloat16),
                                    env={"DDPC_CAST_BACK": "early",
                                         "DDPC_EMBEDDING_ROWS": "1"}))
    if args.overlap_cast_back:
        # What casting the bf16 buckets before the last one back beside the last one's
        # all-reduce, on a stream of their own, saves the end of backward (DDPC_CAST_BACK=overlap,
        # read when a reducer is made): by default they go after it, on the caller's stream.
        for k in range(2 if args.control else 1):
            variants.append(Variant(f"ddpc bf16 overlap cast back{' (control)' if k else ''}",
                                    lambda m: ddpc.wrap_model(m, grad_dtype=torch.bfloat16),
                                    env={"DDPC_CAST_BACK": "overlap"}))
    if args.window_mb:
        # What NCCL's symmetric kernels save the backward: the wires of every bucket but the
        # last in one symmetric window (DDPC_NCCL_WINDOW_MB, read when the wrapper is made).
        for k in range(2 if args.control else 1):
            variants.append(Variant(f"ddpc bf16 window{' (control)' if k else ''}",
                                    lambda m: ddpc.wrap_model(m, grad_dtype=torch.bfloat16),
                                    env={"DDPC_NCCL_WINDOW_MB": f"{args.window_mb:g}"}))
        if args.overlap_cast_back:
            variants.append(Variant("ddpc bf16 overlap cast back, window",
                                    lambda m: ddpc.wrap_model(m, grad_dtype=torch.bfloat16),
                                    env={"DDPC_NCCL_WINDOW_MB": f"{args.window_mb:g}",
                                         "DDPC_CAST_BACK": "overlap"}))
    if args.bf16_via_bucket:
        # What casting fresh gradients straight to the wire saves: each copied into its bucket
        # slot first, as before it.
        def via_bucket(m):
            w = ddpc.wrap_model(m, grad_dtype=torch.bfloat16)
            w._grad_hooks.to_wire = False
            return w
        variants.append(Variant("ddpc bf16 via bucket", via_bucket))
    for cap in args.extra_caps:
        variants += pair(f"ddpc bucket_cap_mb={cap:g}", f"ddpc bf16 bucket_cap_mb={cap:g}",
                         bucket_cap_mb=cap)
    if args.control:
        # The default ddpc wrapper a second time: what two identical variants differ by in this
        # run is its noise, the floor under which a paired difference means nothing.
        variants += pair("ddpc (control)", "ddpc bf16 (control)")
        if args.early_cast_back:
            variants.append(Variant("ddpc bf16 early cast back (control)",
                                    lambda m: ddpc.wrap_model(m, grad_dtype=torch.bfloat16),
                                    env={"DDPC_CAST_BACK": "early"}))
    for tail in args.tail_mb:
        # What buckets of their own for the gradients that complete last save the end of
        # backward (DDPC_TAIL_BUCKET_MB, read as the reducer assigns the buckets), at the default
        # caps and at each of --extra-caps.
        env = {"DDPC_TAIL_BUCKET_MB": f"{tail:g}"}
        variants += pair(f"ddpc tail={tail:g}", f"ddpc bf16 tail={tail:g}", env=env)
        for cap in args.extra_caps:
            variants += pair(f"ddpc bucket_cap_mb={cap:g} tail={tail:g}",
                             f"ddpc bf16 bucket_cap_mb={cap:g} tail={tail:g}", env=env,
                             bucket_cap_mb=cap)
    if args.variants:
        # (";" separates names when one has a comma: "no DDP, every rank"; a whole name alone
        # is taken as it is)
        names = {v.name for v in variants}
        keep = ([args.variants.strip()] if args.variants.strip() in names else
                [k.strip() for k in args.variants.split(";" if ";" in args.variants else ",")
                 if k.strip()])
        unknown = [k for k in keep if not any(v.name == k for v in variants)]
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown}; choose from "
                             f"{[v.name for v in variants]}")
        variants = [v for v in variants if v.name in keep]
    # The single-process baseline runs on rank 0 while the others wait at a barrier.
    for v in variants:
        if not v.single or rank == 0:
            v.build(cfg, args, device, rank)
        if v.single:
            tdist.barrier()
    # Timing in rounds that cycle through the variants, so load from outside this benchmark
    # (other jobs on a shared machine) falls on all of them alike.
    per_round = args.round_steps if args.pipelined else 2
    stat0 = read_cpu_times()
    GcTimer.install()
    if args.gc == "freeze":
        gc.collect()
        gc.freeze()  # what the variants built is never traversed again
    elif args.gc == "off":
        gc.disable()
    for _ in range((args.steps + per_round - 1) // per_round):
        if args.gc == "off":
            gc.collect()  # between rounds, outside every timed step
        for v in variants:
            if not v.single or rank == 0:
                if args.pipelined:
                    v.run_round(per_round)
                else:
                    for _ in range(per_round):
                        v.step()
            if v.single:
                tdist.barrier()
    stat1 = read_cpu_times()
    for v in variants:
        # (every rank traces the same variants in the same order: the steps' collectives pair)
        if (args.trace and args.device == "cuda" and not v.single
                and hasattr(v.model, "_finalize_on_device")):
            for _ in range(args.trace):
                v.traced_step()
    traces = [(v.name, v.traced) for v in variants if v.traced]
    mine = [(v.name, statistics.median(v.times) if v.times else None, v.mem, v.times,
             [statistics.median(col) for col in zip(*v.phases)] if v.phases else None,
             [x / max(len(v.times), 1) for x in v.alloc],
             [x / max(len(v.times), 1) for x in v.host_ev]
             + [statistics.median(v.probes) if v.probes else math.nan])
            for v in variants]
    gathered = [None] * n
    tdist.all_gather_object(gathered, mine)
    rows, allocs, host_ev = [], {}, {}
    # rank 0's threads, CPU ms per timed step, by name (the single-process variant's are rank 0's
    # anyway)
    threads = {v.name: {t: ns * 1e-6 / max(len(v.times), 1) for t, ns in v.thread_ns.items()}
               for v in variants if v.thread_ns}
    for k, v in enumerate(variants):
        allocs[v.name] = (gathered[0][k][5] if v.single else
                          [max(g[k][5][j] for g in gathered) for j in range(3)])
        host_ev[v.name] = (gathered[0][k][6] if v.single else
                           [max(g[k][6][j] for g in gathered) for j in range(5)])
        if v.single:
            name, ms, mem, times, phases, _, _ = gathered[0][k]
        else:
            name, ms, mem = (v.name, max(g[k][1] for g in gathered),
                             max(g[k][2] for g in gathered))
            times = [max(g[k][3][j] for g in gathered) for j in range(len(v.times))]
            phases = ([max(g[k][4][j] for g in gathered) for j in range(len(v.phases[0]))]
                      if v.phases else None)
        # Per round: the mean of its steps (the slowest rank's), for ratios between variants
        # timed minutes apart at most, which drift on a shared machine affects less.
        rounds = [statistics.fmean(times[j:j + per_round])
                  for j in range(0, len(times) - per_round + 1, per_round)]
        rows.append((name, ms, mem, rounds, phases))
    # ddpc's own account of its host time (DistributedModel.host_times), rank 0's, per step.
    wrapper_ms = {}
    for v in variants:
        if not v.single and hasattr(v.model, "host_times"):
            t = v.model.host_times()
            steps = max(t.pop("steps"), 1.0)
            wrapper_ms[v.name] = {k: x / steps for k, x in t.items()}
    every_trace = [None] * n
    tdist.all_gather_object(every_trace, traces)
    traces = [(name, [every_trace[r][k][1] for r in range(n)])
              for k, (name, _) in enumerate(traces)]
    env = describe_env(device)
    if stat0 and stat1:
        # the whole machine during the timed steps (these processes' work included)
        busy, steal = host_load(stat0, stat1, 0.0, os.cpu_count() or 1)
        env["host during the timed steps"] = (f"{busy:.1f} of {os.cpu_count()} CPUs busy, "
                                              f"{steal:.1%} of CPU time stolen by the hypervisor")
    results.put((rank, "ok", (rows, env, wrapper_ms, traces, allocs, host_ev, threads)))
    tdist.destroy_process_group()
    ddpc.destroy_process_group()


def time_methods(obj, names, timers) -> None:
    """Wraps obj's methods `names` so that each call adds its seconds to timers[name]."""
    for name in names:
        orig = getattr(obj, name)

        def timed(*a, _o=orig, _m=name, **k):
            t = time.perf_counter()
            try:
                return _o(*a, **k)
            finally:
                timers[_m] = timers.get(_m, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (cpu 10, cuda 30)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--model", choices=sorted(MODELS), default=None,
                    help="small (cpu default) or gpt2 (cuda default)")
    ap.add_argument("--p2p", choices=["on", "off"], default=None,
                    help="cuda: off sets NCCL_P2P_DISABLE=1, on unsets it (default: inherited)")
    ap.add_argument("--json", default="", help="also write the results to this file")
    ap.add_argument("--variants", default="",
                    help="variant names to run, separated by commas, or by semicolons when a "
                         "name has a comma; one whole name is taken as it is (default: all)")
    ap.add_argument("--extra-caps", type=float, nargs="*", default=[],
                    help="also run ddpc (float32 and bfloat16 gradients) with these "
                         "bucket_cap_mb values")
    ap.add_argument("--control", action="store_true",
                    help="also run the default ddpc variants (float32, bf16) a second time: their "
                         "difference from the first is the run's noise")
    ap.add_argument("--tail-mb", type=float, nargs="*", default=[],
                    help="also run ddpc (float32 and bfloat16 gradients, default caps and each "
                         "--extra-caps) with DDPC_TAIL_BUCKET_MB set to these")
    ap.add_argument("--bf16-via-bucket", action="store_true",
                    help="also run ddpc with bf16 gradients copied into their bucket slots "
                         "before the cast (the path before gradients went straight to the wire)")
    ap.add_argument("--embedding-rows", action="store_true",
                    help="also run ddpc (float32 and bf16 gradients) with the embedding lookups' "
                         "gradients exchanged as rows (DDPC_EMBEDDING_ROWS=1) and with the "
                         "tables all-reduced densely at the end of backward (=0)")
    ap.add_argument("--per-gradient", action="store_true",
                    help="also run ddpc with each gradient copied (cast) into its bucket as it "
                         "arrives, one launch each (DDPC_GRAD_BATCH=0), instead of a bucket's "
                         "in one launch")
    ap.add_argument("--inline-posts", action="store_true",
                    help="also run ddpc (float32 and bf16 gradients) with the buckets' "
                         "collectives issued by the thread that runs the gradient hooks "
                         "(DDPC_NCCL_POST_THREAD=0) instead of ddpc's posting thread")
    ap.add_argument("--hook-cost", action="store_true",
                    help="also time the model without DDP on every rank with a no-op Python "
                         "gradient hook on every parameter: the hook mechanism's own host cost")
    ap.add_argument("--zero", action="store_true",
                    help="also run ddpc with AdamW sharded by ddpc.ZeroRedundancyOptimizer "
                         "(its moments held for about 1/world of the parameters on each rank)")
    ap.add_argument("--comm-casts", action="store_true",
                    help="also run ddpc with bf16 gradients cast to and from the wire on the "
                         "communication stream around each all-reduce (DDPC_COMM_CASTS=1) "
                         "instead of on the caller's stream, back at the end of backward")
    ap.add_argument("--early-cast-back", action="store_true",
                    help="also run ddpc with bf16 gradients cast back as soon as each bucket's "
                         "all-reduce is done, on a stream of their own (DDPC_CAST_BACK=early), "
                         "instead of at the end of backward")
    ap.add_argument("--overlap-cast-back", action="store_true",
                    help="also run ddpc with bf16 gradients whose buckets but the last are cast "
                         "back at the end of backward beside the last one's all-reduce, on a "
                         "stream of their own (DDPC_CAST_BACK=overlap; with --control, twice)")
    ap.add_argument("--window-mb", type=float, default=0,
                    help="also run ddpc with bf16 gradients whose buckets but the last are "
                         "all-reduced in an NCCL symmetric window of at most this many MiB "
                         "(DDPC_NCCL_WINDOW_MB; with --control, twice)")
    ap.add_argument("--no-ddp-every-rank", action="store_true",
                    help="also time the model without DDP on every rank at once: what the ranks "
                         "cost each other on the host, with no communication")
    ap.add_argument("--pipelined", action="store_true",
                    help="time rounds of --round-steps steps issued back to back with one "
                         "synchronize per round, as a training loop that does not wait for each "
                         "step (no phase table then); by default every step is synchronized")
    ap.add_argument("--gc", choices=["on", "freeze", "off"], default="on",
                    help="Python's garbage collector during the timed steps: on (as a training "
                         "script has it), freeze (gc.freeze() once every variant is built), or "
                         "off (collected between rounds, outside the timed steps); the phase "
                         "table's gc columns show the collector's time per step either way")
    ap.add_argument("--round-steps", type=int, default=6,
                    help="--pipelined: steps per round (default 6)")
    ap.add_argument("--trace", type=int, default=0, metavar="STEPS",
                    help="cuda: after the timed steps, run this many more steps of each ddpc "
                         "variant inside ddpc.comm_trace and print when each gradient bucket "
                         "was ready, queued, reduced and done, every rank side by side")
    ap.add_argument("--cpus", default="",
                    help='one CPU set per rank, e.g. "0-7;16-23": each rank (and every thread it '
                         'starts) runs only there; by default the OS places them')
    ap.add_argument("--timeout", type=float, default=200.0,
                    help="seconds before the workers are stopped (default 200)")
    args = ap.parse_args()
    if args.nproc < 1:
        ap.error(f"--nproc must be >= 1, got {args.nproc}")
    if args.round_steps < 1:
        ap.error(f"--round-steps must be 1 or more, got {args.round_steps}")
    if args.trace < 0 or (args.trace and args.device != "cuda"):
        ap.error(f"--trace {args.trace}: give a number of steps, with --device cuda (the trace "
                 f"reads CUDA events)")
    if args.cpus:
        try:
            bad = [c for cpus in parse_cpus(args.cpus, args.nproc) for c in cpus
                   if c not in os.sched_getaffinity(0)]
        except ValueError as e:
            ap.error(str(e))
        if bad:
            ap.error(f"--cpus {args.cpus!r}: CPU {bad[0]} is not one this process may run on "
                     f"({len(os.sched_getaffinity(0))} CPUs)")
    args.steps = args.steps or (30 if args.device == "cuda" else 10)
    args.model = args.model or ("gpt2" if args.device == "cuda" else "small")
    if args.device == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() < args.nproc:
            print(f"--device cuda --nproc {args.nproc} needs {args.nproc} visible GPUs, found "
                  f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}",
                  file=sys.stderr)
            return 2
    import multiprocessing as mp
    t_start = time.monotonic()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=worker, args=(r, args, ports, results)) for r in range(args.nproc)]
    for p in procs:
        p.start()

    def stop(signum, frame):
        # Killed from outside (e.g. `timeout`): take the workers along rather than leave them
        # holding the GPUs.
        for p in procs:
            if p.is_alive():
                p.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    rows, env, failed, reported = None, {}, [], set()
    deadline = time.monotonic() + args.timeout
    # A rank that dies without a traceback (a crash, the OOM killer) must not leave this waiting.
    while len(reported) < args.nproc and not failed:
        try:
            rank, status, value = results.get(timeout=1.0)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in reported]
            if dead or time.monotonic() > deadline:
                why = (f"exited with code {procs[dead[0]].exitcode} without reporting" if dead
                       else f"did not finish within --timeout {args.timeout:.0f} s")
                failed.append((dead[0] if dead else -1, why))
            continue
        reported.add(rank)
        if status != "ok":
            failed.append((rank, value))
        elif rank == 0:
            rows, env, wrapper_ms, traces, allocs, host_ev, threads = value
    for p in procs:
        p.join(timeout=30 if failed else None)
        if p.is_alive():
            p.kill()
            p.join()
    if failed:
        for rank, tb in failed:
            print(f"rank {rank if rank >= 0 else '?'} failed:\n{tb}", file=sys.stderr)
        return 1
    cfg = MODELS[args.model]
    print(f"model {args.model}: {cfg['layers']} layers, width {cfg['width']}, vocab {cfg['vocab']}, "
          f"seq {cfg['seq']}, batch {cfg['batch']} per process; device {args.device}, "
          f"{args.nproc} processes, {args.steps} timed steps after {args.warmup} warm-up"
          + (", bf16 autocast, fused AdamW" if args.device == "cuda" else ", fp32, AdamW")
          + (f"; pipelined: rounds of {args.round_steps} steps, one synchronize each"
             if args.pipelined else "; every step synchronized")
          + ("" if args.gc == "on" else f"; Python's gc {args.gc} during the timed steps"))
    print("env: " + ", ".join(f"{k}={'<unset>' if v is None else v}" for k, v in env.items()))
    mem_name = "+max_memory_allocated" if args.device == "cuda" else "+peak RSS"
    w = max([32] + [len(r[0]) for r in rows])  # (the names' column)
    ref = next((ms for name, ms, *_ in rows if name == "torch DDP"), rows[0][1])
    single = next(((ms, r) for name, ms, _, r, _ in rows if name.startswith("1 process")), None)
    print(f"{'variant':{w}s} {'ms/step':>9s} {'vs torch DDP':>13s} {'scaling eff.':>13s} "
          f"{'paired':>7s} {'rounds p25-p75':>15s} {mem_name + ' MiB':>26s}")
    out_rows = []
    for name, ms, mem, rounds, _ in rows:
        is_single = name.startswith("1 process")
        eff = single[0] / ms if single and not is_single else None
        paired, spread = None, ""
        if single and not is_single and rounds and len(rounds) == len(single[1]):
            ratios = [a / b for a, b in zip(single[1], rounds)]
            paired = statistics.median(ratios)
            if len(ratios) >= 4:  # how much the rounds' ratios scatter: the run's own noise
                q = statistics.quantiles(ratios, n=4)
                spread = f"{q[0]:.3f}-{q[2]:.3f}"
        print(f"{name:{w}s} {ms:9.1f} {ms / ref:13.2f} "
              f"{'' if eff is None else f'{eff:.2f}':>13s} "
              f"{'' if paired is None else f'{paired:.3f}':>7s} {spread:>15s} {mem:26.0f}")
        out_rows.append({"variant": name, "ms_per_step": ms, "vs_torch_ddp": ms / ref,
                         "scaling_efficiency": eff, "paired_efficiency": paired,
                         "round_ms": rounds, "peak_mib_added": mem})
    if args.device == "cuda":
        # Where each variant's step goes: host time between the marks (forward+loss issued,
        # backward returned, optimizer step + zero_grad issued), and GPU time between events
        # recorded at the same marks (a GPU phase includes the GPU's idle time waiting for the
        # host's launches, and for backward the wait for the last all-reduce). For ddpc, the
        # GPU backward in two: up to where its end of backward begins on the stream (the
        # backward's kernels and the gradients' copies or casts, beside the collectives already
        # running), and from there (the wait for the last collectives, the casts back).
        print(f"{'phases, median ms':{w}s} {'host fwd':>9s} {'model':>6s} {'bwd':>6s} {'opt':>6s}"
              f"   {'GPU fwd':>8s} {'bwd':>6s} {'opt':>6s}   {'gc: fwd':>7s} {'step':>6s}"
              f"   {'bwd: to end':>11s} {'end':>6s}")
        for name, _, _, _, ph in rows:
            if ph:
                split = ("" if math.isnan(ph[6]) else f"   {ph[6]:11.2f} {ph[7]:6.2f}")
                print(f"{name:{w}s} {ph[0]:9.2f} {ph[8]:6.2f} {ph[1]:6.2f} {ph[2]:6.2f}   "
                      f"{ph[3]:8.2f} {ph[4]:6.2f} {ph[5]:6.2f}   {ph[9]:7.2f} {ph[10]:6.2f}"
                      f"{split}")
        for r in out_rows:
            ph = next(p for n, _, _, _, p in rows if n == r["variant"])
            r["phases_ms"] = dict(zip(["host_fwd", "host_bwd", "host_opt", "gpu_fwd", "gpu_bwd",
                                       "gpu_opt", "gpu_bwd_to_end", "gpu_bwd_end",
                                       "host_model_fwd", "gc_fwd", "gc_step"],
                                      [None if math.isnan(x) else x for x in ph])) if ph else None
    if wrapper_ms:
        # Inside ddpc's share of the host phases above (rank 0, mean per timed step): the
        # wrapper's forward work; all of its gradient hooks, of which giving buckets their wire
        # buffers, giving released buckets memory, pointing .grad at copied gradients' slots,
        # the Python path, queueing each gradient's copy or cast, and queueing bucket collectives
        # (launch also counts in end-of-backward when it ran there); the end of backward.
        keys = ["forward", "hooks", "hook_calls", "wire", "memory", "attach", "python", "mark",
                "launch", "end_of_backward"]
        print(f"{'ddpc host ms per step (rank 0)':{w}s} " + " ".join(
            f"{k.replace('end_of_backward', 'end_bwd').replace('hook_calls', 'calls'):>8s}"
            for k in keys))
        for name, t in wrapper_ms.items():
            print(f"{name:{w}s} " + " ".join(
                f"{t[k]:8.0f}" if k == "hook_calls" else f"{t[k]:8.2f}" for k in keys))
        for r in out_rows:
            r["ddpc_host_ms"] = wrapper_ms.get(r["variant"])
    if args.device == "cuda":
        # torch's caching allocator during the timed steps, per step (the most of any rank):
        # cudaMalloc and cudaFree calls (each may wait for the device, and takes host time at
        # whatever point of the step needs memory), and allocations that failed and were retried
        # after freeing the cache.
        print(f"{'allocator per step':{w}s} {'cudaMalloc':>11s} {'cudaFree':>9s} "
              f"{'retries':>8s}")
        for name, a in allocs.items():
            print(f"{name:{w}s} {a[0]:11.2f} {a[1]:9.2f} {a[2]:8.2f}")
        for r in out_rows:
            r["allocator_per_step"] = dict(zip(["cuda_malloc", "cuda_free", "retries"],
                                              allocs.get(r["variant"], [0, 0, 0])))
    # What the OS did to the thread that runs the forward (host-bound in synchronized GPU steps):
    # page faults, being switched out, moving to another CPU.
    # "host probe": the median ms of a fixed piece of Python run just before each step (the
    # slower rank's): how fast the host was while this variant ran, whatever the variant does.
    print(f"{'main thread, per step (worst rank)':{w}s} {'fwd: faults':>11s} {'vol cs':>7s} "
          f"{'invol cs':>9s}   {'CPU changed':>11s}   {'host probe ms':>13s}")
    for name, e in host_ev.items():
        print(f"{name:{w}s} {e[0]:11.1f} {e[1]:7.2f} {e[2]:9.2f}   {e[3]:11.2f}   {e[4]:13.2f}")
    for r in out_rows:
        r["main_thread_per_step"] = dict(zip(["fwd_minor_faults", "fwd_voluntary_cs",
                                              "fwd_involuntary_cs", "cpu_changed",
                                              "host_probe_ms"],
                                             host_ev.get(r["variant"], [0, 0, 0, 0, 0])))
    if threads:
        # Which threads of rank 0's process used the CPU in a step, and how much: the ones that
        # used the most in any variant (on a host whose vCPUs slow each other, a thread that
        # spins takes speed from the one that launches the kernels).
        total = {}
        for per in threads.values():
            for t, ms in per.items():
                total[t] = max(total.get(t, 0.0), ms)
        top = sorted(total, key=total.get, reverse=True)[:7]
        print(f"{'CPU ms per step, rank 0 threads':{w}s} " + " ".join(f"{t[:15]:>15s}" for t in top))
        for name, per in threads.items():
            print(f"{name:{w}s} " + " ".join(f"{per.get(t, 0.0):15.2f}" for t in top))
        for r in out_rows:
            r["thread_cpu_ms_per_step"] = threads.get(r["variant"])
    for name, per_rank in traces:
        print_traces(name, per_rank)
    wall = time.monotonic() - t_start
    print(f"({wall:.0f} s in all; ms/step: median over the timed steps, slowest rank; paired: "
          f"median over rounds of the 1-process time / this variant's time in the same round; "
          f"peak MiB: the most memory the variant added while built and warmed up)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "config": cfg, "device": args.device,
                       "nproc": args.nproc, "steps": args.steps, "warmup": args.warmup,
                       "pipelined": args.round_steps if args.pipelined else 0, "gc": args.gc,
                       "p2p_flag": args.p2p, "env": env, "memory_measure": mem_name,
                       "wall_s": wall, "rows": out_rows,
                       # per ddpc variant, per rank, per traced step: trace_summary's marks and
                       # buckets (bytes, path, ready, start, wire, reduced, done; ms)
                       "traces": {name: per_rank for name, per_rank in traces}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
