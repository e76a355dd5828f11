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


def whole_pages(rows: npt.NDArray[np.int64], page_size: int, buffer_rows: int) -> int:
    """How many leading rows are whole pages: `page_size` consecutive rows each, from a
    multiple of `page_size` (0 where a buffer is not a whole number of pages)."""
    if page_size <= 1 or buffer_rows % page_size:
        return 0
    count = rows.size // page_size
    runs = rows[: count * page_size].reshape(count, page_size)
    whole = (runs[:, 0] % page_size == 0) & (
        runs == runs[:, :1] + np.arange(page_size, dtype=rows.dtype)
    ).all(axis=1)
    return int(count if whole.all() else np.argmin(whole)) * page_size


def _paged_rows(
    views: Sequence[Bytes], rows: npt.NDArray[np.int64], width: int, page_size: int
) -> tuple[int, npt.NDArray[np.int64]]:
    """How many leading rows `gather` and `scatter` copy a page at a time, and those pages:
    whole pages (`whole_pages`), when the slice is whole rows. A page is then one contiguous
    block on both sides; numpy copies it at memory speed, where row by row it pays per row (a
    head slice of 512-byte rows into decode's pages, TP 2→4 at page 16: 11-15 GB/s by page,
    6-8 by row here). For part of each row, a page is strided rows either way: no faster."""
    paged = (
        whole_pages(rows, page_size, views[0].shape[0])
        if views and width == views[0].shape[1]
        else 0
    )
    return paged, rows[:paged:page_size] // page_size


def gather(
    views: Sequence[Bytes],
    rows: npt.NDArray[np.int64],
    column: int,
    width: int,
    out: Bytes,
    page_size: int = 1,
) -> int:
    """Copy bytes ``[column, column + width)`` of the given token rows of every buffer into
    `out`, buffer-major; returns the bytes staged. Whole rows that are whole pages of
    `page_size` are copied by page (`_paged_rows`)."""
    size = staged_size(len(views), rows.size, width)
    staged = out[:size].reshape(len(views), rows.size, width)
    paged, pages = _paged_rows(views, rows, width, page_size)
    for index, view in enumerate(views):
        # Plain fancy indexing: np.take with `out` buffers everything (an order slower).
        if paged:
            by_page = view.reshape(-1, page_size, view.shape[1])
            staged[index, :paged].reshape(-1, page_size, width)[:] = by_page[
                pages, :, column : column + width
            ]
        staged[index, paged:] = view[rows[paged:], column : column + width]
    return size


def scatter(
    staged_bytes: Bytes,
    views: Sequence[Bytes],
    rows: npt.NDArray[np.int64],
    column: int,
    width: int,
    page_size: int = 1,
) -> None:
    """The inverse of `gather`: staged bytes into the token rows of every buffer."""
    size = staged_size(len(views), rows.size, width)
    staged = staged_bytes[:size].reshape(len(views), rows.size, width)
    paged, pages = _paged_rows(views, rows, width, page_size)
    for index, view in enumerate(views):
        if paged:
            by_page = view.reshape(-1, page_size, view.shape[1])
            by_page[pages, :, column : column + width] = staged[index, :paged].reshape(
                -1, page_size, width
            )
        view[rows[paged:], column : column + width] = staged[index, paged:]
