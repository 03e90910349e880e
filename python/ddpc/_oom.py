"""Out-of-memory failures of a rank: what the rank knew when it happened, and what the launcher
tells the user about it.

A CUDA out-of-memory error says which device ran out and how full it was, but not the things a
multi-GPU job gets wrong: that the failing rank allocated on another rank's GPU (a fixed
"cuda:0" in the script), that other processes hold memory on the GPU, or that data parallelism
keeps a whole copy of the model on every rank. The worker records the facts as it fails
(`facts`, in its error report); the launcher and notebook_launcher turn them into a paragraph of
their failure summary (`explain`).
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable, Sequence

_GIB = float(1 << 30)
# torch >= 2.1: "GPU 0 has a total capacity of 79.10 GiB of which ..."; older: "(GPU 0; 79.10 GiB
# total capacity; ...)". The index is the device's within this process (CUDA_VISIBLE_DEVICES).
_GPU_IN_MESSAGE = re.compile(r"GPU (\d+) has a total capacity|\(GPU (\d+);")


def is_cuda_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (torch.cuda.OutOfMemoryError), or an error carrying its message
    (a RuntimeError from an extension, or an exception that wrapped it)."""
    return type(exc).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(exc)


def _bound_index() -> int | None:
    """The GPU this rank works on: ddpc's binding when the script initialized ddpc, else
    LOCAL_RANK (what ddpc would bind)."""
    dist = sys.modules.get("ddpc.distributed")
    state = getattr(dist, "_state", None) if dist is not None else None
    index = getattr(state, "device_index", None)
    if index is not None:
        return int(index)
    local = os.environ.get("LOCAL_RANK")
    return int(local) if local and local.isdigit() else None


def facts(exc: BaseException) -> dict[str, Any] | None:
    """What this rank knows about a CUDA out-of-memory error, for its error report; None for any
    other exception. Never raises: the user's exception is what matters."""
    if not is_cuda_oom(exc):
        return None
    out: dict[str, Any] = {"kind": "cuda"}
    m = _GPU_IN_MESSAGE.search(str(exc))
    if m:
        out["failed_device"] = int(m.group(1) or m.group(2))
    bound = _bound_index()
    if bound is not None:
        out["bound_device"] = bound
    out["visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    torch = sys.modules.get("torch")  # only a torch the script imported: none is loaded here
    dev = out.get("failed_device", bound)
    if torch is None or dev is None:
        return out
    try:
        cuda = torch.cuda
        if not cuda.is_available():
            return out
        count = cuda.device_count()
        if bound is not None and bound >= count:
            out.pop("bound_device")  # more local ranks than GPUs: LOCAL_RANK names none
        if dev >= count:
            return out
        out["allocated"] = int(cuda.memory_allocated(dev))
        out["reserved"] = int(cuda.memory_reserved(dev))
        out["peak_allocated"] = int(cuda.max_memory_allocated(dev))
        free, total = cuda.mem_get_info(dev)
        out["free"], out["total"] = int(free), int(total)
    except Exception:  # noqa: BLE001 - a broken context must not hide the user's error
        pass
    return out


def _gib(n: Any) -> str:
    return f"{n / _GIB:.1f} GiB"


def explain(report: dict[str, Any], rank: int,
            physical: Callable[[int], Any] | None = None,
            others_on: Callable[[Any], Sequence[int]] | None = None) -> list[str]:
    """The lines of a failure summary that explain rank `rank`'s out-of-memory error, from its
    error report; [] when the report is not one. physical(i) gives the GpuInfo of visible device
    i (or None); others_on(info) the pids of processes outside this job that hold memory on it."""
    mem = report.get("memory")
    if not isinstance(mem, dict) or mem.get("kind") != "cuda":
        return []
    lines = []
    failed, bound = mem.get("failed_device"), mem.get("bound_device")
    dev = failed if failed is not None else bound
    info = physical(dev) if physical is not None and dev is not None else None
    where = f"cuda:{dev}" if dev is not None else "its GPU"
    if info is not None:
        where += f" (physical GPU {info.index}, {info.bus_id})"
    lines.append(f"rank {rank} ran out of GPU memory on {where}.")
    if failed is not None and bound is not None and failed != bound:
        lines.append(f"That is not its own GPU: rank {rank} works on cuda:{bound}, so something "
                     f"in the script puts tensors on a fixed device (\"cuda:{failed}\", \"cuda\" "
                     f"or .cuda() before ddpc.init_process_group binds the rank to its GPU, or a "
                     f"checkpoint loaded with map_location there) and several ranks crowd one "
                     f"GPU. Use ddpc.device() (or LOCAL_RANK) for every device in the script, "
                     f"and torch.load(..., map_location=ddpc.device()).")
        return lines
    if "allocated" in mem:
        held = (f"This process held {_gib(mem['allocated'])} in tensors (peak "
                f"{_gib(mem['peak_allocated'])}), {_gib(mem['reserved'])} reserved by PyTorch's "
                f"caching allocator")
        if "total" in mem:
            held += f"; the GPU had {_gib(mem['free'])} free of {_gib(mem['total'])}"
        lines.append(held + ".")
        unused = mem["reserved"] - mem["allocated"]
        if "total" in mem and unused > max(2 * _GIB, 0.15 * mem["total"]):
            lines.append(f"{_gib(unused)} of that was reserved but not in use (fragmentation): "
                         f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True often recovers it.")
    if info is not None and others_on is not None:
        pids = list(others_on(info))
        if pids:
            lines.append(f"Other processes hold memory on physical GPU {info.index}: pid "
                         f"{', '.join(map(str, pids))}. Stop them, or pick free GPUs with "
                         f"--gpus auto (python -m ddpc.doctor shows who holds what).")
    lines.append("Data parallelism splits the batch, not the model: every rank holds the whole "
                 "model, its gradients and the optimizer state, so a model that barely fits one "
                 "GPU does not fit better on several. Lower the per-rank batch size "
                 "(accumulate with model.no_sync() to keep the global batch), use bf16 autocast, "
                 "or recompute activations with torch.utils.checkpoint.")
    return lines
