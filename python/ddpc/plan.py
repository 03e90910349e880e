"""python -m ddpc.plan: will a model's training fit on these GPUs? The memory each GPU needs for
the model's states (weights, gradients, the reducer's buffers, the optimizer's state) for one GPU
alone, torch DDP, ddpc, ddpc with bf16 gradients and ddpc with ZeroRedundancyOptimizer, against
what each GPU has free: before anything is allocated.

    python -m ddpc.plan --params 1.5B --nproc 2
    python -m ddpc.plan --model mypkg.models:build --nproc 2 --autocast

Activations are not counted (they depend on the batch, the sequence length and checkpointing):
the table says what is left for them.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import re
import sys
from typing import Any, Iterable, List, Optional, Sequence, Tuple

GIB = float(1 << 30)

# Optimizer state per parameter, in multiples of the parameter's own size.
OPTIMIZERS = {"adamw": 2, "adam": 2, "adamw-amsgrad": 3, "sgd-momentum": 1, "sgd": 0}
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclasses.dataclass
class Row:
    """One way of training: bytes per GPU of each part of the model's states."""
    name: str
    weights: float
    grads: float
    reducer: float     # gradient buffers beyond .grad (torch DDP's bucket copies, bf16 wires)
    optimizer: float
    autocast: float    # the 16-bit copies of the weights autocast keeps during a forward
    note: str = ""

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.reducer + self.optimizer + self.autocast


def estimate(params: Iterable[Tuple[int, int, bool]], world_size: int,
             optimizer: str = "adamw", autocast: bool = False) -> List[Row]:
    """Rows for params given as (numel, bytes per element, trainable) over world_size GPUs.
    Gradients and optimizer state follow the parameters' own dtype, as torch's do; bf16
    gradients in ddpc add a 2-byte wire per float32 element, held while the step's buckets are
    reduced (at most all of them at once); autocast's weight copies are 2 bytes per element."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} is not known here: use one of "
                         f"{', '.join(OPTIMIZERS)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    weights = grads = wire = copies = 0.0
    for numel, size, trainable in params:
        weights += numel * size
        copies += numel * 2 if size > 2 else 0
        if trainable:
            grads += numel * size
            wire += numel * 2 if size > 2 else 0
    opt = grads * OPTIMIZERS[optimizer]
    cast = copies if autocast else 0.0
    shard = f"the optimizer state of 1/{world_size} of the parameters"
    return [
        Row("one GPU alone", weights, grads, 0.0, opt, cast),
        Row("torch DDP", weights, grads, grads, opt, cast,
            "reducer: its bucket copies of the gradients (gradient_as_bucket_view=False, the "
            "default)"),
        Row("ddpc", weights, grads, 0.0, opt, cast, "the gradients live in the buckets"),
        Row("ddpc grad_dtype=bf16", weights, grads, wire, opt, cast,
            "reducer: the bf16 wires, at most this, at the end of backward (when the "
            "activations are gone)"),
        Row("ddpc + ZeroRedundancyOptimizer", weights, grads, 0.0, opt / world_size, cast,
            "optimizer: " + shard),
    ]


def module_params(model: Any) -> List[Tuple[int, int, bool]]:
    """(numel, bytes per element, trainable) of each distinct parameter of a torch module."""
    seen, out = set(), []
    for p in model.parameters():
        if id(p) in seen:
            continue  # (tied weights are one tensor)
        seen.add(id(p))
        out.append((p.numel(), p.element_size(), bool(p.requires_grad)))
    return out


def parse_count(text: str) -> int:
    """'1.5B', '350M', '163e6', '7000000' -> a positive parameter count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a parameter count such as 1.5B, 350M or "
                                         f"163e6, got {text!r}")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[
        m.group(2).lower()]
    if not 1 <= value < 1e15:
        raise argparse.ArgumentTypeError(f"expected a parameter count from 1 to below 1e15 (1000T), "
                                         f"got {text!r}")
    return int(round(value))


def build_on_meta(spec: str) -> Any:
    """Calls the factory `pkg.module:function` with parameters made on torch's meta device
    (shapes and dtypes only, no memory)."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"--model {spec!r}: expected MODULE:FUNCTION, e.g. mypkg.models:build "
                         f"(a function that returns the torch.nn.Module to train)")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--model {spec!r}: cannot import {mod_name!r}: {e}") from None
    finally:
        sys.path.pop(0)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {mod_name!r} has no function {attr!r}")
    import torch
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as e:  # noqa: BLE001 - the user's factory: whatever it raises is reported
        raise ValueError(f"--model {spec!r}: {attr}() raised {type(e).__name__}: {e} (it is "
                         f"called with no arguments, on the meta device: a function that "
                         f"builds the model from its config, not one that loads weights)") \
            from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {spec!r}: {attr}() returned a {type(model).__name__}, not a "
                         f"torch.nn.Module")
    return model


def gpu_free_gib(n: int) -> Tuple[Optional[float], str]:
    """The least free memory among the first n visible GPUs, in GiB, and where it came from;
    (None, why) when nvidia-smi cannot tell."""
    from ddpc import launch
    infos = launch._visible_gpu_infos(n)
    if not infos or any(i is None for i in infos):
        return None, "no GPU found through nvidia-smi"
    least = min(infos, key=lambda i: i.free_mib)
    return least.free_mib / 1024, (f"free now on GPU {least.index} ({least.name}), the least "
                                   f"of the {n} used")


def report(rows: Sequence[Row], gpu_gib: Optional[float], header: str) -> str:
    cols = ("weights", "grads", "reducer", "optimizer", "autocast")
    lines = [header, f"{'GiB per GPU':<32}" + "".join(f"{c:>10}" for c in cols) +
             f"{'total':>9}" + ("   left for activations" if gpu_gib is not None else "")]
    for r in rows:
        line = f"{r.name:<32}" + "".join(f"{getattr(r, c) / GIB:>10.2f}" for c in cols)
        line += f"{r.total / GIB:>9.2f}"
        if gpu_gib is not None:
            left = gpu_gib - r.total / GIB
            line += f"   {left:>8.2f}" + ("" if left > 0 else "  does not fit")
        lines.append(line)
    lines += [f"  {r.name}: {r.note}" for r in rows if r.note]
    if gpu_gib is not None:
        fits = [r for r in rows[1:] if r.total / GIB < gpu_gib]
        if not fits:
            lines.append("verdict: the model's states alone do not fit on one GPU with any of "
                         "these: shard the parameters and gradients too (FSDP, DeepSpeed ZeRO-3), "
                         "train fewer parameters (LoRA, frozen layers), or keep 16-bit weights")
        else:
            best = min(fits, key=lambda r: r.total)
            lines.append(f"verdict: fits with {', '.join(r.name for r in fits)}; most room for "
                         f"activations with {best.name} ({gpu_gib - best.total / GIB:.2f} GiB, "
                         f"before the batch's activations and the CUDA context)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddpc.plan",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=parse_count, metavar="N",
                      help="the number of parameters, e.g. 1.5B, 350M, 163e6 (all trainable)")
    what.add_argument("--model", metavar="MODULE:FUNCTION",
                      help="a function that returns the model; it is called with parameters on "
                           "the meta device, so nothing is allocated (frozen parameters count as "
                           "weights only)")
    ap.add_argument("--dtype", choices=sorted(DTYPE_SIZES), default="float32",
                    help="the parameters' dtype with --params (default float32)")
    ap.add_argument("--nproc", type=int, default=None,
                    help="GPUs to train on (default: those visible, at least 1)")
    ap.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
    ap.add_argument("--autocast", action="store_true",
                    help="count autocast's 16-bit copies of the weights (bf16/fp16 autocast)")
    ap.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                    help="memory per GPU to plan for (default: the least free memory of the GPUs "
                         "used, from nvidia-smi)")
    args = ap.parse_args(argv)
    if args.nproc is not None and args.nproc < 1:
        ap.error(f"argument --nproc: expected at least 1, got {args.nproc}")
    if args.gpu_memory is not None and not (args.gpu_memory > 0 and math.isfinite(args.gpu_memory)):
        ap.error(f"argument --gpu-memory: expected GiB above 0, got {args.gpu_memory}")
    if args.model is not None:
        try:
            model = build_on_meta(args.model)
        except ValueError as e:
            ap.error(str(e))
        params = module_params(model)
        kinds = sorted({s for _, s, _ in params})
        what = (f"{args.model}: {sum(n for n, _, _ in params) / 1e6:.1f}M parameters "
                f"({sum(n for n, _, t in params if t) / 1e6:.1f}M trainable), "
                f"{'/'.join(f'{8 * s}-bit' for s in kinds)}")
    else:
        params = [(args.params, DTYPE_SIZES[args.dtype], True)]
        what = f"{args.params / 1e6:.1f}M parameters, {args.dtype}"
    nproc = args.nproc
    if nproc is None:
        from ddpc import launch
        nproc = max(1, launch.visible_gpu_count())
    if args.gpu_memory is not None:
        gib, source = args.gpu_memory, "as given"
    else:
        gib, source = gpu_free_gib(nproc)
    rows = estimate(params, nproc, args.optimizer, args.autocast)
    header = (f"{what}; {args.optimizer}{', autocast' if args.autocast else ''}; {nproc} GPU(s); "
              + (f"{gib:.2f} GiB per GPU ({source})" if gib is not None else
                 f"GPU memory unknown ({source}): pass --gpu-memory GIB"))
    print(report(rows, gib, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
