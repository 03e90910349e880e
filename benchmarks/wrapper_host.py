"""Host time of ddpc.wrap_model's per-step methods, on the CPU, one rank: a GPT-2-shaped model
(12 blocks, 148 parameters) made tiny so that the wrapper's own Python and C work is visible
next to the compute. Prints the step time and the time per step spent in the forward prologue
(_attach_grads), arming the reducer (_arm), the output sink, the per-bucket gradient path
(_slot_for: a released bucket getting memory back) and the end of backward (_finalize), for
bucket sizes that give many buckets and few. Then a net of 40 small convolutions in both memory
layouts: the gradient hooks' host time per step, and the part of it in the Python path (a
channels_last weight's gradient went there until its slot took its strides in C).

    python benchmarks/wrapper_host.py [--steps 50]

No GPU needed; the numbers say how much host work each step costs the wrapper, which on a GPU
step that waits for kernel launches adds to the step time.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ddp_step  # noqa: E402  (the model)

METHODS = ("_attach_grads", "_arm", "_attach_sink", "_slot_for", "_finalize")


def timed_steps(w, loss, steps: int, reset) -> float:
    """ms per step of `steps` SGD steps of wrapped model w on loss(w), after 5 warm-up steps and
    then reset() (which clears the counters read after)."""
    opt = torch.optim.SGD(w.parameters(), lr=1e-3)

    def step():
        loss(w).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps * 1e3


def measure(ddpc, cap_mb: float, steps: int) -> str:
    torch.manual_seed(0)
    model = ddp_step.GPT(12, 64, 4, 512, 32)
    w = ddpc.wrap_model(model, bucket_cap_mb=cap_mb)
    x = torch.randint(0, 512, (2, 32))
    timers = {}
    ddp_step.time_methods(w, METHODS, timers)
    ms = timed_steps(w, lambda m: m(x).float().logsumexp(-1).mean(), steps, timers.clear)
    per = ", ".join(f"{m} {timers.get(m, 0.0) / steps * 1e3:.3f}" for m in METHODS)
    return (f"bucket_cap_mb={cap_mb:<6g} {len(w._buckets):3d} buckets, {len(w._params)} params: "
            f"step {ms:.2f} ms; ms per step in {per}")


def measure_conv(ddpc, fmt, steps: int) -> str:
    torch.manual_seed(0)
    layers = []
    for _ in range(40):
        layers += [torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()]
    w = ddpc.wrap_model(torch.nn.Sequential(*layers).to(memory_format=fmt))
    x = torch.randn(2, 8, 4, 4).contiguous(memory_format=fmt)
    ms = timed_steps(w, lambda m: m(x).sum(), steps, w.host_times)
    t = w.host_times()
    return (f"40 convs, {str(fmt).split('.')[-1]:<17}: step {ms:.2f} ms; ms per step in the "
            f"gradient hooks {t['hooks'] / steps:.3f}, of it the Python path "
            f"{t['python'] / steps:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ddp_step.free_port()),
                      DDPC_TOKEN="wrapper-host")
    torch.set_num_threads(1)
    import ddpc
    ddpc.init_process_group(backend="cpu")
    for cap in (0.03, 25):
        print(measure(ddpc, cap, args.steps))
    for fmt in (torch.contiguous_format, torch.channels_last):
        print(measure_conv(ddpc, fmt, args.steps))
    ddpc.destroy_process_group()


if __name__ == "__main__":
    main()
