"""ddpc: data-parallel training for a few GPUs, with a C core."""
from ddpc._C import DistributedError, DistributedTimeoutError, PeerError, MismatchError, AuthError  # noqa: F401
