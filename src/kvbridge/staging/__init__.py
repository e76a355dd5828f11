"""The staging path for heterogeneous TP: the decode ring allocator and gather/scatter."""

from kvbridge.staging.kernels import buffer_rows, gather, host_bytes, scatter, staged_size
from kvbridge.staging.ring import Allocation, RingError, StagingRing

__all__ = [
    "Allocation",
    "RingError",
    "StagingRing",
    "buffer_rows",
    "gather",
    "host_bytes",
    "scatter",
    "staged_size",
]
