"""Gather and scatter kernels of the staging path, on CPU memory (numpy).

A staged chunk is, for each KV buffer in order, the chunk's tokens' head slice:
``[buffers, tokens, width]`` bytes, contiguous. Prefill gathers it from its pages into a local
staging buffer and writes it to the decode ring in one transfer; decode scatters it into its
pages. Both sides index tokens as rows of a buffer viewed as ``[rows, token_bytes]``, with the
rows `token_rows` gives (the same mapping the per-token planner uses).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvbridge.cache.spec import BufferSpec

Bytes = npt.NDArray[np.uint8]


def host_bytes(ptr: int, length: int) -> Bytes:
    """A uint8 view of host memory at an address (memory the caller registered and owns)."""
    view: Bytes = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(ptr))
    return view


def buffer_rows(buffer: BufferSpec, token_bytes: int) -> Bytes:
    """A KV buffer as ``[rows, token_bytes]``: one row per token slot."""
    return host_bytes(buffer.ptr, buffer.length).reshape(-1, token_bytes)


def staged_size(buffers: int, tokens: int, width: int) -> int:
    return buffers * tokens * width


def gather(
    views: Sequence[Bytes], rows: npt.NDArray[np.int64], column: int, width: int, out: Bytes
) -> int:
    """Copy bytes ``[column, column + width)`` of the given token rows of every buffer into
    `out`, buffer-major; returns the bytes staged."""
    size = staged_size(len(views), rows.size, width)
    staged = out[:size].reshape(len(views), rows.size, width)
    for index, view in enumerate(views):
        # Plain fancy indexing: np.take with `out` buffers everything (an order slower).
        staged[index] = view[rows, column : column + width]
    return size


def scatter(
    staged_bytes: Bytes,
    views: Sequence[Bytes],
    rows: npt.NDArray[np.int64],
    column: int,
    width: int,
) -> None:
    """The inverse of `gather`: staged bytes into the token rows of every buffer."""
    size = staged_size(len(views), rows.size, width)
    staged = staged_bytes[:size].reshape(len(views), rows.size, width)
    for index, view in enumerate(views):
        view[rows, column : column + width] = staged[index]
