"""Where the host's time goes in a GPT-2 DDP step (benchmarks/ddp_step.py's model), 2 GPUs:
median host milliseconds of forward+loss, backward, optimizer step + zero_grad, and the whole step
after the final device sync, for one GPU alone (on each rank), torch DDP, ddpc, and ddpc with
zero_grad(set_to_none=False) (buckets kept between steps); for ddpc also the host time spent in
its per-step methods, the number of cudaMalloc calls per step, and a cProfile of 5 steps (rank 0,
both ranks run them so the collectives stay matched).

    python benchmarks/host_phases.py             # 2 GPUs
    python benchmarks/host_phases.py --nproc 1   # one GPU: the wrappers' host cost alone

When the backward's host time approaches the step time, the step is bound by the host launching
kernels, and any per-parameter Python work in the wrapper adds to the step directly.
"""

import cProfile, io, os, pstats, sys, time
import torch, torch.nn.functional as F
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ddp_step.py: the model
import ddp_step


def worker(rank, world, ports, out, trace=False):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(ports[0]),
        DDPC_TOKEN="diag",
    )
    import ddpc, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    ddpc.init_process_group(backend="nccl")
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{ports[1]}",
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", rank),
    )
    dev = torch.device("cuda", rank)
    cfg = ddp_step.MODELS["gpt2"]
    res = {}
    for name, wrap, none in [
        ("1 GPU", lambda m: m, True),
        ("torch DDP", lambda m: DDP(m, device_ids=[rank]), True),
        ("ddpc", lambda m: ddpc.wrap_model(m), True),
        ("ddpc keep grads", lambda m: ddpc.wrap_model(m), False),
    ]:
        torch.manual_seed(0)
        with dev:
            m = ddp_step.GPT(cfg["layers"], cfg["width"], cfg["heads"], cfg["vocab"], cfg["seq"])
        model = wrap(m)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        x = torch.randint(0, cfg["vocab"], (8, 1024), device=dev)
        phases = []

        def step():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, cfg["vocab"]), x.view(-1))
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=none)
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            return [1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2), 1e3 * (t4 - t0)]

        for _ in range(5):
            step()
        timers = {}
        if hasattr(model, "_attach_grads"):
            ddp_step.time_methods(
                model, ("_attach_grads", "_arm", "_finalize", "_attach_sink", "_slot_for"), timers)
        st0 = torch.cuda.memory_stats(dev)
        phases = [step() for _ in range(15)]
        st1 = torch.cuda.memory_stats(dev)
        res[name + " mallocs/step"] = [
            (st1.get("num_device_alloc", -1) - st0.get("num_device_alloc", 0)) / 15,
            (st1.get("num_alloc_retries", 0) - st0.get("num_alloc_retries", 0)) / 15,
            st1["reserved_bytes.all.current"] / 2**20,
        ]
        res[name + " ms/step in"] = [
            1e3 * timers.get(m, 0) / 15
            for m in ("_attach_grads", "_arm", "_finalize", "_attach_sink", "_slot_for")
        ]
        med = [sorted(p[k] for p in phases)[len(phases) // 2] for k in range(4)]
        res[name] = med
        if name == "ddpc":
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(5):
                step()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
            if rank == 0:
                res["cprofile"] = s.getvalue()
        if trace:
            # Host time by operator (CUDA runtime calls included) over 3 steps: a call that
            # blocks the host (a synchronize, an allocation) stands out by its self CPU time.
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
            if rank == 0:
                ka = prof.key_averages()
                res["trace " + name] = (
                    ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=48)
                    + "\nby GPU time:\n"
                    + ka.table(sort_by="self_device_time_total", row_limit=25,
                               max_name_column_width=48))
        del model, opt, m
        torch.cuda.empty_cache()
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()
    ddpc.destroy_process_group()


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2,
                    help="ranks, one per GPU (1: the wrappers' host cost with no peer to wait for)")
    ap.add_argument("--trace", action="store_true",
                    help="also print each variant's host time by operator over 3 profiled steps")
    args = ap.parse_args()
    nproc = args.nproc
    if torch.cuda.device_count() < nproc:
        sys.exit(f"--nproc {nproc} needs {nproc} visible GPUs, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = (ddp_step.free_port(), ddp_step.free_port())
    ps = [ctx.Process(target=worker, args=(r, nproc, ports, out, args.trace)) for r in range(nproc)]
    [p.start() for p in ps]
    res = out.get(timeout=300)
    [p.join(60) for p in ps]
    print(
        "host ms (median of 15): forward+loss, backward, opt+zero, total after sync; "
        "mallocs/step: cudaMalloc, retries, reserved MiB; "
        "ms/step in attach_grads, arm, finalize, attach_sink, slot_for"
    )
    for k, v in res.items():
        if k != "cprofile" and not k.startswith("trace "):
            print(f"{k:18s} " + " ".join(f"{x:7.2f}" for x in v))
    print(res["cprofile"][:2500])
    for k, v in res.items():
        if k.startswith("trace "):
            print(f"== {k[6:]}: host time by operator, 3 steps\n{v}")
