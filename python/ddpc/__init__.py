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
    gather_object,
    device,
    get_backend,
    get_local_rank,
    get_local_world_size,
    get_rank,
    get_store,
    get_world_size,
    init_process_group,
    is_available,
    is_initialized,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
)

__version__ = "0.1.0"

_LAZY = {"wrap_model": "parallel", "unwrap": "parallel", "DistributedModel": "parallel",
         "DistributedDataParallel": "parallel",
         "DistributedSampler": "sampler", "notebook_launcher": "notebook",
         "WorkerError": "notebook", "comm_trace": "trace", "CommTrace": "trace"}


def __getattr__(name):
    # These may import torch or cloudpickle; loading them on first use keeps `import ddpc` light
    # and torch-free for NumPy users.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module("ddpc." + _LAZY[name]), name)
    raise AttributeError(f"module 'ddpc' has no attribute {name!r}")
