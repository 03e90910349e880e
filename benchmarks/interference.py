"""How much an all-reduce that runs beside GPT-2's backward slows that backward down, by what
moves the bytes: NCCL's kernels on ordinary buffers, NCCL's symmetric-memory kernels (a buffer
from ncclMemAlloc registered as a window, NCCL 2.27 or newer), or the copy engines.

    python benchmarks/interference.py [--chunks 4] [--chunk-mib 80] [--steps 25]

It answers one question about DDP over NVLink: what does it cost the backward's kernels to
all-reduce a step's gradients beside them? The gradients are stood in for by --chunks buffers of
--chunk-mib MiB of bf16, all-reduced one after another on a side stream that starts with the
backward; a sleep kernel (one thread, no memory traffic) after each spreads them over it. The
data is random and the results are not used.

Part 1, two processes with one GPU each (as DDP runs): nothing beside the backward, NCCL on a
torch buffer, NCCL on a symmetric window.
Part 2, one process with both GPUs: GPU 0 runs the backward; beside it GPU 0 and GPU 1 all-reduce
either through NCCL (one communicator per GPU, grouped calls) or through peer copies on the copy
engines with one add kernel per GPU (each GPU pushes the half the other owns, adds the half it
received, and pushes its reduced half back).

For each engine it prints one chunk's all-reduce time alone, the backward's GPU time (median over
--steps steps, interleaved), and the backward's extra time as a share of the engine's own time
for all chunks ("cost"): 1.0 means the backward lost as much time as the all-reduces take alone.
NCCL is called through ctypes on the libnccl.so.2 that torch loaded.
"""
from __future__ import annotations

import argparse
import ctypes as C
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_step  # noqa: E402  (same folder: the model)

NCCL_BF16, NCCL_SUM = 9, 0
NCCL_WIN_COLL_SYMMETRIC = 1
SLEEP_CYCLES = 3_000_000  # about 1.5 ms on an H200


class UniqueId(C.Structure):
    _fields_ = [("internal", C.c_char * 128)]


def load_nccl() -> C.CDLL:
    lib = C.CDLL("libnccl.so.2")
    lib.ncclGetErrorString.restype = C.c_char_p
    return lib


def check(lib: C.CDLL, r: int, what: str) -> None:
    if r != 0:
        raise RuntimeError(f"{what} failed: NCCL error {r}: {lib.ncclGetErrorString(r).decode()}")


def nccl_version(lib: C.CDLL) -> int:
    v = C.c_int()
    check(lib, lib.ncclGetVersion(C.byref(v)), "ncclGetVersion")
    return v.value


def all_reduce(lib: C.CDLL, t: torch.Tensor, comm: C.c_void_p, stream: torch.cuda.Stream) -> None:
    p = C.c_void_p(t.data_ptr())
    check(lib, lib.ncclAllReduce(p, p, C.c_size_t(t.numel()), NCCL_BF16, NCCL_SUM, comm,
                                 C.c_void_p(stream.cuda_stream)), "ncclAllReduce")


class _Cuda:
    """A device buffer for torch.as_tensor (__cuda_array_interface__), as int16 (bf16 has no
    typestr); .view(torch.bfloat16) afterwards."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = dict(shape=(n,), typestr="<i2", data=(ptr, False),
                                             version=3)


def make_model(dev: torch.device):
    cfg = ddp_step.MODELS["gpt2"]
    torch.manual_seed(0)
    with dev:
        model = ddp_step.GPT(cfg["layers"], cfg["width"], cfg["heads"], cfg["vocab"], cfg["seq"])
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), device=dev)
    return model, x


def backward_times(model, x, modes: dict, side: list, steps: int) -> dict:
    """GPU time of the backward (ms) per mode: modes maps a name to None (nothing beside) or to
    fn(i) that queues chunk i's all-reduce on the side streams (side[0] on the backward's GPU)."""
    times = {m: [] for m in modes}
    for it in range(3 + steps):
        for name, fn in modes.items():
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = torch.nn.functional.cross_entropy(
                logits.float().view(-1, logits.shape[-1]), x.view(-1))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if fn is not None:
                for s in side:
                    s.wait_event(start)
                for i in range(fn.chunks):
                    fn(i)
                    for s in side:
                        with torch.cuda.device(s.device), torch.cuda.stream(s):
                            torch.cuda._sleep(SLEEP_CYCLES)
            loss.backward()
            end.record()
            for s in side:
                s.synchronize()
            torch.cuda.synchronize()
            if it >= 3:
                times[name].append(start.elapsed_time(end))
    return {m: statistics.median(v) for m, v in times.items()}


def time_alone(fn, streams: list, iters: int = 10) -> float:
    """ms per call of fn(i) (chunks in turn), timed on streams[0]."""
    for i in range(3):
        fn(i % fn.chunks)
    for s in streams:
        s.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(streams[0])
    for i in range(iters):
        fn(i % fn.chunks)
    b.record(streams[0])
    for s in streams:
        s.synchronize()
    return a.elapsed_time(b) / iters


def two_processes(rank: int, args: argparse.Namespace, id_path: str, results) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    lib = load_nccl()
    version = nccl_version(lib)
    uid = UniqueId()
    if rank == 0:
        check(lib, lib.ncclGetUniqueId(C.byref(uid)), "ncclGetUniqueId")
        with open(id_path + ".tmp", "wb") as f:
            f.write(bytes(uid))
        os.rename(id_path + ".tmp", id_path)
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(id_path):
            if time.monotonic() > deadline:
                raise RuntimeError("rank 0 never wrote the NCCL id")
            time.sleep(0.01)
        with open(id_path, "rb") as f:
            uid = UniqueId.from_buffer_copy(f.read())
    comm = C.c_void_p()
    check(lib, lib.ncclCommInitRank(C.byref(comm), 2, uid, rank), "ncclCommInitRank")
    n = args.chunks * args.chunk_elems
    plain = torch.randn(n, device=dev).to(torch.bfloat16)
    buffers = {"NCCL": plain}
    win = C.c_void_p()
    sym_ptr = C.c_void_p()
    skipped = None
    if version < 22700 or not hasattr(lib, "ncclCommWindowRegister"):
        skipped = f"NCCL {version} has no symmetric windows (2.27 or newer)"
    else:
        check(lib, lib.ncclMemAlloc(C.byref(sym_ptr), C.c_size_t(n * 2)), "ncclMemAlloc")
        sym = torch.as_tensor(_Cuda(sym_ptr.value, n), device=dev).view(torch.bfloat16)
        sym.copy_(plain)
        check(lib, lib.ncclCommWindowRegister(comm, sym_ptr, C.c_size_t(n * 2), C.byref(win),
                                              NCCL_WIN_COLL_SYMMETRIC), "ncclCommWindowRegister")
        buffers["NCCL, symmetric window"] = sym
    side = torch.cuda.Stream()

    def engine(buf):
        def fn(i: int) -> None:
            all_reduce(lib, buf[i * args.chunk_elems:(i + 1) * args.chunk_elems], comm, side)
        fn.chunks = args.chunks
        return fn

    engines = {name: engine(buf) for name, buf in buffers.items()}
    alone = {name: time_alone(fn, [side]) for name, fn in engines.items()}
    model, x = make_model(dev)
    bwd = backward_times(model, x, {"nothing": None, **engines}, [side], args.steps)
    torch.cuda.synchronize()
    results[rank] = dict(version=version, alone=alone, backward=bwd, skipped=skipped)
    if win.value:
        check(lib, lib.ncclCommWindowDeregister(comm, win), "ncclCommWindowDeregister")
    buffers = engines = sym = None
    if sym_ptr.value:
        check(lib, lib.ncclMemFree(sym_ptr), "ncclMemFree")
    check(lib, lib.ncclCommDestroy(comm), "ncclCommDestroy")


def one_process(args: argparse.Namespace) -> dict:
    lib = load_nccl()
    comms = (C.c_void_p * 2)()
    check(lib, lib.ncclCommInitAll(comms, 2, (C.c_int * 2)(0, 1)), "ncclCommInitAll")
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    for a, b in ((0, 1), (1, 0)):
        if not torch.cuda.can_device_access_peer(a, b):
            raise RuntimeError(f"GPU {a} cannot reach GPU {b} directly: part 2 needs P2P")
    n, half = args.chunk_elems, args.chunk_elems // 2
    buf = [torch.randn(args.chunks * n, device=d).to(torch.bfloat16) for d in devs]
    scratch = [torch.zeros(half, dtype=torch.bfloat16, device=d) for d in devs]
    side = [torch.cuda.Stream(device=d) for d in devs]
    # (the first copy between the two devices enables peer access both ways)
    buf[1][:1].copy_(buf[0][:1])
    buf[0][:1].copy_(buf[1][:1])
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)

    def nccl_fn(i: int) -> None:
        check(lib, lib.ncclGroupStart(), "ncclGroupStart")
        for r in range(2):
            all_reduce(lib, buf[r][i * n:(i + 1) * n], comms[r], side[r])
        check(lib, lib.ncclGroupEnd(), "ncclGroupEnd")

    def copy_fn(i: int) -> None:
        t = [buf[r][i * n:(i + 1) * n] for r in range(2)]
        own = [slice(0, half), slice(half, n)]  # GPU r reduces own[r]
        # torch orders a copy between devices after both devices' current streams and makes
        # both wait for it: the side streams are made current on both devices.
        with torch.cuda.stream(side[0]), torch.cuda.stream(side[1]):
            with torch.cuda.device(0):
                scratch[1].copy_(t[0][own[1]], non_blocking=True)
            with torch.cuda.device(1):
                scratch[0].copy_(t[1][own[0]], non_blocking=True)
            for r in range(2):
                with torch.cuda.device(r):
                    t[r][own[r]].add_(scratch[r])
            with torch.cuda.device(0):
                t[1][own[0]].copy_(t[0][own[0]], non_blocking=True)
            with torch.cuda.device(1):
                t[0][own[1]].copy_(t[1][own[1]], non_blocking=True)

    nccl_fn.chunks = copy_fn.chunks = args.chunks
    engines = {"NCCL": nccl_fn, "copy engines + add": copy_fn}
    alone = {name: time_alone(fn, side) for name, fn in engines.items()}
    torch.cuda.set_device(0)
    model, x = make_model(devs[0])
    bwd = backward_times(model, x, {"nothing": None, **engines}, side, args.steps)
    for r in range(2):
        check(lib, lib.ncclCommDestroy(comms[r]), "ncclCommDestroy")
    return dict(alone=alone, backward=bwd)


def report(title: str, res: dict, chunks: int) -> None:
    print(title)
    base = res["backward"]["nothing"]
    print(f"  {'beside the backward':28s} {'one chunk alone ms':>18s} {'backward ms':>12s} "
          f"{'extra ms':>9s} {'cost':>6s}")
    print(f"  {'nothing':28s} {'':>18s} {base:12.3f}")
    for name, one in res["alone"].items():
        b = res["backward"][name]
        print(f"  {name:28s} {one:18.3f} {b:12.3f} {b - base:9.3f} "
              f"{(b - base) / (one * chunks):6.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-mib", type=float, default=80.0,
                    help="MiB of bf16 per all-reduce (default 80: 4 x 80 MiB is about GPT-2's "
                         "gradients in bf16)")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--part", choices=["1", "2", "both"], default="both")
    args = ap.parse_args()
    if args.chunks < 1 or args.chunk_mib <= 0 or args.steps < 1:
        ap.error("--chunks, --chunk-mib and --steps must be positive")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("interference.py needs 2 CUDA GPUs; this machine has "
              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}", file=sys.stderr)
        return 2
    args.chunk_elems = int(args.chunk_mib * (1 << 20)) // 4 * 2  # bf16, even
    print(f"GPT-2 backward (bf16 autocast, 8 x 1024 tokens) on {torch.cuda.get_device_name(0)}; "
          f"beside it {args.chunks} all-reduces of {args.chunk_mib:g} MiB of bf16, spread by "
          f"sleeps; median of {args.steps} steps; torch {torch.__version__}")
    if args.part in ("1", "both"):
        with tempfile.TemporaryDirectory() as tmp, mp.Manager() as man:
            results = man.dict()
            mp.spawn(two_processes, args=(args, os.path.join(tmp, "nccl_id"), results), nprocs=2)
            res = {r: results[r] for r in range(2)}
        print(f"NCCL {res[0]['version']}")
        for r in range(2):
            report(f"part 1, two processes: rank {r} (GPU {r})", res[r], args.chunks)
        if res[0]["skipped"]:
            print(f"  (symmetric window skipped: {res[0]['skipped']})")
    if args.part in ("2", "both"):
        report("part 2, one process: GPU 0's backward, GPU 1 only communicating",
               one_process(args), args.chunks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
