"""Where a DDP step's time goes on the GPU: profiles a few GPT-2 steps of ddpc (and torch DDP and
one GPU alone for comparison) with torch.profiler and splits each step's GPU time into compute
kernels, NCCL kernels, their overlap, communication left exposed, and idle time.

    python benchmarks/profile_step.py --nproc 2 [--steps 3] [--grad-dtype bf16] [--p2p off]

Rank 0 prints one line per variant (means over the profiled steps, in ms; each step is profiled
alone, GPU activity only): window = first kernel start to last kernel end; compute = union of
non-NCCL kernels; nccl = union of NCCL kernels; exposed = NCCL time with no compute kernel running; idle = window
with no kernel at all.
"""
import argparse
import json
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_step  # noqa: E402  (same folder: the model and the variants)


def union(intervals):
    """Total length of the union of [start, end) intervals, and the merged list."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return sum(e - s for s, e in merged), merged


def intersect_len(a, b):
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            total += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernels_of(trace_path):
    """The trace's kernels in start order, and its slowest CUDA API calls (name, us)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    ks = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"),
                key=lambda e: e["ts"])
    api = sorted(((e["dur"], e["name"]) for e in events if e.get("ph") == "X" and
                  e.get("cat") in ("cuda_runtime", "cuda_driver")), reverse=True)
    return ks, api


def threads_report(trace_path, top=6):
    """Text: per host thread that made CUDA API calls in the step (at least 5), how many, over
    what span, how much of it inside the calls, and the calls that took the most time. The thread
    that runs the backward (autograd's device thread) shows what a wrapper adds to it: more calls,
    and a longer span for the same calls (host work between them, such as gradient hooks)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    by_tid = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            by_tid.setdefault(e.get("tid"), []).append(e)
    lines = []
    for tid, evs in sorted(by_tid.items(), key=lambda kv: -len(kv[1])):
        if len(evs) < 5:
            continue
        span = max(e["ts"] + e["dur"] for e in evs) - min(e["ts"] for e in evs)
        inside = sum(e["dur"] for e in evs)
        names = {}
        for e in evs:
            n, d = names.get(e["name"], (0, 0.0))
            names[e["name"]] = (n + 1, d + e["dur"])
        head = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
        lines.append(f"  thread {tid}: {len(evs)} calls over {span / 1000:.2f} ms, "
                     f"{inside / 1000:.2f} ms inside them; " + ", ".join(
                         f"{n} {c}x {d / 1000:.2f}" for n, (c, d) in head))
    return "\n".join(lines)


def analyse(ks):
    """The split of one step's GPU time (us), from that step's kernels."""
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in ks if "nccl" in e["name"].lower()]
    comp = [(e["ts"], e["ts"] + e["dur"]) for e in ks if "nccl" not in e["name"].lower()]
    t_n, m_n = union(nccl)
    t_c, m_c = union(comp)
    t_all, _ = union(nccl + comp)
    window = max(e["ts"] + e["dur"] for e in ks) - min(e["ts"] for e in ks)
    overlap = intersect_len(m_n, m_c)
    return dict(window=window, compute=t_c, nccl=t_n, overlap=overlap, exposed=t_n - overlap,
                idle=window - t_all)


def tail_report(ks):
    """Text describing one step's GPU timeline: when backward compute ends, the NCCL kernels
    (relative to the step's first kernel), where the optimizer starts, and the longest idle gaps
    with the kernels around them."""
    t0 = ks[0]["ts"]
    lines = []
    opt = next((e["ts"] for e in ks if "adam" in e["name"].lower()), None)
    comp = [e for e in ks if "nccl" not in e["name"].lower()]
    nccl = [e for e in ks if "nccl" in e["name"].lower()]
    if opt is not None:
        bwd_end = max(e["ts"] + e["dur"] for e in comp if e["ts"] < opt)
        opt_end = max(e["ts"] + e["dur"] for e in comp if "adam" in e["name"].lower())
        lines.append(f"backward compute ends {bwd_end - t0:.0f} us; optimizer {opt - t0:.0f} "
                     f"(+{opt - bwd_end:.0f}) to {opt_end - t0:.0f} us; step ends "
                     f"{max(e['ts'] + e['dur'] for e in ks) - t0:.0f} us")
    if nccl:
        lines.append(f"{len(nccl)} NCCL kernels (start+duration us): " + " ".join(
            f"{e['ts'] - t0:.0f}+{e['dur']:.0f}" for e in nccl))
    gaps = []
    end, prev = ks[0]["ts"] + ks[0]["dur"], ks[0]
    for e in ks[1:]:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end - t0, prev["name"][:40], e["name"][:40]))
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    gaps.sort(reverse=True)
    lines.append(f"idle {sum(g[0] for g in gaps):.0f} us in {len(gaps)} gaps; longest:")
    lines += [f"  {g[0]:6.0f} us at {g[1]:6.0f}: after {g[2]} / before {g[3]}" for g in gaps[:6]]
    return "\n".join(lines)


def worker(rank, world, port, torch_port, args, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      DDPC_TOKEN="profile-step")
    import ddpc
    import torch.distributed as dist
    ddpc.init_process_group(backend="nccl")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    device = torch.device("cuda", rank)
    cfg = ddp_step.MODELS["gpt2"]
    from torch.nn.parallel import DistributedDataParallel as DDP
    gd = torch.bfloat16 if args.grad_dtype == "bf16" else None
    variants = [("1 GPU", None),
                ("torch DDP", lambda m: DDP(m, device_ids=[rank])),
                ("ddpc", lambda m: ddpc.wrap_model(m, grad_dtype=gd))]
    results = {}
    for name, wrap in variants:
        single = wrap is None
        if single and rank != 0:
            dist.barrier()
            continue
        v = ddp_step.Variant(name, (lambda m: m) if single else wrap, single=single)
        bargs = argparse.Namespace(warmup=3)
        v.build(cfg, bargs, device, rank)
        rows, tail = [], ""
        # One profiler session per step, recording GPU activity only: host-side tracing slows
        # the host enough to starve the GPU, which would measure the profiler, not the step.
        for k in range(args.steps):
            path = os.path.join(tempfile.gettempdir(),
                                f"prof_{rank}_{name.replace(' ', '_')}_{k}.json")
            with torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                v.step(timed=True)
            prof.export_chrome_trace(path)
            ks, api = kernels_of(path)
            rows.append(analyse(ks))
            tail = tail_report(ks) + "\nslowest CUDA API calls (us): " + ", ".join(
                f"{name} {dur:.0f}" for dur, name in api[:8])
            if args.threads:
                tail += "\nCUDA API calls by host thread (ms):\n" + threads_report(path)
        mean = {key: sum(r[key] for r in rows) / len(rows) / 1000.0 for key in rows[0]}
        results[name] = dict(mean, step_ms=sum(v.times) / len(v.times), tail=tail)
        del v
        torch.cuda.empty_cache()
        if single:
            dist.barrier()
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()
    ddpc.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--grad-dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--p2p", choices=["on", "off"], default="on")
    p.add_argument("--timeline", action="store_true",
                   help="also print the last step's timeline: NCCL kernels, tail, idle gaps")
    p.add_argument("--threads", action="store_true",
                   help="with --timeline: also the last step's CUDA API calls by host thread "
                        "(how many, their span, the time inside them, the costliest calls)")
    args = p.parse_args()
    if args.p2p == "off":
        os.environ["NCCL_P2P_DISABLE"] = "1"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    # Every rank must see the same two ports: draw them once.
    ports = (ddp_step.free_port(), ddp_step.free_port())
    procs = [ctx.Process(target=worker, args=(r, args.nproc, ports[0], ports[1], args, out))
             for r in range(args.nproc)]
    for pr in procs:
        pr.start()
    res = out.get(timeout=600)
    for pr in procs:
        pr.join(timeout=60)
    print(f"GPT-2 step on {args.nproc} GPUs, grad dtype {args.grad_dtype}, P2P {args.p2p}; "
          f"ms per step (means over {args.steps} profiled steps, rank 0)")
    print(f"{'variant':12} {'step':>7} {'window':>7} {'compute':>8} {'nccl':>7} {'overlap':>8} "
          f"{'exposed':>8} {'idle':>7}")
    for name, r in res.items():
        print(f"{name:12} {r['step_ms']:7.2f} {r['window']:7.2f} {r['compute']:8.2f} "
              f"{r['nccl']:7.2f} {r['overlap']:8.2f} {r['exposed']:8.2f} {r['idle']:7.2f}")
    if args.timeline:
        for name, r in res.items():
            print(f"\n{name}, last profiled step (rank 0):\n{r['tail']}")


if __name__ == "__main__":
    main()
