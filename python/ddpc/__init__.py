"""ddpc: data-parallel training for a few GPUs, with a C core.

    import ddpc
    ddpc.init_process_group()
    model = ddpc.wrap_model(MyModel().to(ddpc.device()))
    sampler = ddpc.DistributedSampler(dataset)

Start the ranks with ``python -m ddpc.launch --nproc-per-node N train.py``.
"""
from ddpc._C import (  # noqa: F401
    AuthError,
    DistributedError,
    DistributedTimeoutError,
    MismatchError,
    PeerError,
)
from ddpc.distributed import (  # noqa: F401
    GroupMember,
    ReduceOp,
    Work,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object_list,
    destroy_process_group,
    device,
    gather,
    gather_object,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_local_rank,
    get_local_world_size,
    get_rank,
    get_store,
    get_world_size,
    init_process_group,
    is_available,
    is_gloo_available,
    is_initialized,
    is_nccl_available,
    is_torchelastic_launched,
    monitored_barrier,
    new_group,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    scatter_object_list,
)
from ddpc.distributed import GroupMember as group  # noqa: F401  (torch's dist.group.WORLD)

__version__ = "0.1.0"

_LAZY = {"wrap_model": "parallel", "unwrap": "parallel", "DistributedModel": "parallel",
         "DistributedDataParallel": "parallel",
         "DistributedSampler": "sampler", "notebook_launcher": "notebook",
         "WorkerError": "notebook", "comm_trace": "trace", "CommTrace": "trace",
         "ZeroRedundancyOptimizer": "zero"}


def __getattr__(name):
    # These may import torch or cloudpickle; loading them on first use keeps `import ddpc` light
    # and torch-free for NumPy users.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module("ddpc." + _LAZY[name]), name)
    if name in _NOT_IN_DDPC:
        why = f"torch.distributed's {name} is not part of ddpc ({_NOT_IN_DDPC[name]})"
        if _importing_from():
            # `from ddpc import send`: Python would replace an AttributeError's text with its
            # bare "cannot import name"; an ImportError passes through with ours.
            raise ImportError(f"cannot import name {name!r} from 'ddpc': {why}", name="ddpc")
        raise AttributeError(f"module 'ddpc' has no attribute {name!r}: {why}")
    raise AttributeError(f"module 'ddpc' has no attribute {name!r}")


def _importing_from():
    """Is the caller of module __getattr__ a `from ddpc import ...` statement?"""
    import sys
    try:
        frame = sys._getframe(2)
        import opcode
        return frame.f_code.co_code[frame.f_lasti] == opcode.opmap["IMPORT_FROM"]
    except (ValueError, AttributeError, IndexError, KeyError):
        return False


# torch.distributed names a script may use that ddpc does not have, and what to do instead.
_P2P = "ddpc has collectives, not point-to-point messages: all_gather or broadcast instead"
_NOT_IN_DDPC = dict.fromkeys(
    ("send", "recv", "isend", "irecv", "batch_isend_irecv", "P2POp", "send_object_list",
     "recv_object_list"), _P2P)
_NOT_IN_DDPC.update(dict.fromkeys(
    ("all_to_all", "all_to_all_single"),
    "data parallelism needs no all-to-all: all_gather, then each rank takes its part"))
_NOT_IN_DDPC.update(dict.fromkeys(
    ("new_subgroups", "new_subgroups_by_enumeration", "split_group"),
    "every ddpc group spans every rank: new_group() makes another such group"))
_NOT_IN_DDPC["all_reduce_coalesced"] = "all_reduce each tensor, or one flat tensor of them all"
_NOT_IN_DDPC["all_gather_coalesced"] = "all_gather each tensor"
