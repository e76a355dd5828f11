"""The staging gather and scatter on a GPU in one Triton launch for all KV buffers.

torch has no indexed copy over a list of tensors, so `torch_kernels`' fallback launches one
`index_select`/`index_copy_` per KV buffer: 64 launches per chunk for an 8B model, about 17 µs
each, and an H200 then gathers 19-48 GB/s whatever the chunk's size (2026-12-04). Here one
program reads the buffers' base addresses from a pointer table and each block of programs
copies a tile of token rows × the head slice's words: 0.3-1.8 TB/s on the same chunks.

Imported only where torch runs on a GPU and Triton is installed (it comes with torch's CUDA
wheels); the callers fall back to the torch kernels otherwise.
"""
# Triton reads the kernels' parameter annotations itself; they stay unannotated for mypy.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch  # type: ignore[import-not-found,unused-ignore]
import triton  # type: ignore[import-not-found,import-untyped,unused-ignore]
import triton.language as tl  # type: ignore[import-not-found,import-untyped,unused-ignore]

Tensor = Any  # torch.Tensor

# One program copies BLOCK_ROWS token rows × BLOCK_WIDTH words of one buffer. The
# sizes are fixed and no integer argument or staging address is specialized on, so each word
# type compiles once per process (`warm_up` does it at registration, off the request path):
# a first compile costs 0.7-2.4 s on the H200 machine, and chunk sizes and ring offsets vary.
BLOCK_ROWS, BLOCK_WIDTH = 64, 32
_SIZES_VARY = ["n_rows", "row_words", "start", "width"]


@triton.jit(do_not_specialize=_SIZES_VARY, do_not_specialize_on_alignment=["staged"])
def _copy_kernel(
    table,
    rows,
    staged,
    n_rows,
    row_words,
    start,
    width,
    GATHER: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WIDTH: tl.constexpr,
):
    """A tile of token rows × words of one buffer: cache → staged (GATHER) or back."""
    buffer = tl.program_id(1).to(tl.int64)
    base = tl.load(table + buffer).to(tl.pointer_type(staged.dtype.element_ty))
    ids = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_rows = ids < n_rows
    row = tl.load(rows + ids, mask=in_rows, other=0)
    in_cache = base + row[:, None] * row_words + start
    in_staged = staged + (buffer * n_rows + ids[:, None]) * width
    words = tl.program_id(2) * BLOCK_WIDTH + tl.arange(0, BLOCK_WIDTH)[None, :]
    mask = in_rows[:, None] & (words < width)
    if GATHER:
        tl.store(in_staged + words, tl.load(in_cache + words, mask=mask), mask=mask)
    else:
        tl.store(in_cache + words, tl.load(in_staged + words, mask=mask), mask=mask)


@functools.lru_cache(maxsize=64)
def _table(addresses: tuple[int, ...], device: Any) -> Tensor:
    return torch.tensor(addresses, dtype=torch.int64, device=device)


def pointer_table(views: Sequence[Tensor]) -> Tensor:
    """The buffers' base addresses as an int64 tensor on their device (kept for reuse: the
    same cache's buffers come back with every chunk)."""
    return _table(tuple(int(view.data_ptr()) for view in views), views[0].device)


def _launch(
    gathering: bool, views: Sequence[Tensor], rows: Tensor, start: int, width: int, staged: Tensor
) -> None:
    """`views`: ``[rows, row_words]`` tensors of one word type; `staged`: ``[buffers, rows,
    width]`` of that type, contiguous; `start`, `width`: the slice in words."""
    n_rows = int(rows.numel())
    if n_rows == 0:
        return
    grid = (triton.cdiv(n_rows, BLOCK_ROWS), len(views), triton.cdiv(width, BLOCK_WIDTH))
    _copy_kernel[grid](
        pointer_table(views),
        rows,
        staged,
        n_rows,
        int(views[0].shape[-1]),
        start,
        width,
        GATHER=gathering,
        BLOCK_ROWS=BLOCK_ROWS,
        BLOCK_WIDTH=BLOCK_WIDTH,
    )


def warm_up(device: Any, word: Any = torch.int64) -> None:
    """Compile the kernel both ways for one word type now (a gather and a scatter of scratch
    tensors), not at a request's first chunk."""
    views = [torch.zeros((2, 4), dtype=word, device=device) for _ in range(2)]
    rows = torch.zeros(1, dtype=torch.int64, device=device)
    staged = torch.zeros(4, dtype=word, device=device)
    gather(views, rows, 1, 1, staged)
    scatter(staged, views, rows, 1, 1)


def gather(views: Sequence[Tensor], rows: Tensor, start: int, width: int, staged: Tensor) -> None:
    """Words ``[start, start + width)`` of the given rows of every view into `staged`."""
    _launch(True, views, rows, start, width, staged)


def scatter(staged: Tensor, views: Sequence[Tensor], rows: Tensor, start: int, width: int) -> None:
    """The inverse of `gather`."""
    _launch(False, views, rows, start, width, staged)
