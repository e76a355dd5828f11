"""Gather and scatter of the staging path on torch tensors — CUDA (on a stream of their own)
or CPU — moving exactly the bytes `kernels.py` moves with numpy: a staged chunk is, for each
KV buffer in order, the chunk's tokens' head slice, ``[buffers, tokens, width]`` bytes.

The KV buffers are viewed as ``[rows, token_bytes]`` uint8 tensors (one row per token slot),
`rows` is an int64 tensor of token rows on the buffers' device, `out`/`staged` a flat uint8
tensor there. On a GPU the copies are ordered after the work already queued on the caller's
current stream (which produced the KV), and finished before returning: the engine reads the
staging buffer (or decode reads its pages) right after. Both copy in the widest integer words
the slice allows; on a GPU one Triton launch covers every buffer (`triton_kernels`), else (CPU
tensors, no Triton) one torch indexed copy per buffer.

Imported only where torch is in use; kvbridge itself does not depend on torch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch  # type: ignore[import-not-found,unused-ignore]

from kvbridge.staging.kernels import staged_size

log = logging.getLogger(__name__)
Tensor = Any  # torch.Tensor; kept loose so that the module type-checks without torch's stubs


def byte_rows(buffer: Tensor, token_bytes: int) -> Tensor:
    """A contiguous KV tensor (any dtype) as ``[rows, token_bytes]`` bytes, sharing memory."""
    return buffer.view(torch.uint8).view(-1, token_bytes)


def _word_type(tensors: Sequence[Tensor], *byte_counts: int) -> Any:
    """The widest integer type whose size divides every byte count and every tensor's row
    length and offset: an index copy then moves 8-byte words rather than single bytes (on CPU
    tensors torch's byte-wise scatter is about 3× slower; on a GPU the per-buffer copies are
    bound by their launches either way, and the Triton kernel loads wider words)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if all(count % size == 0 for count in byte_counts) and all(
            tensor.shape[-1] % size == 0 and tensor.storage_offset() % size == 0
            for tensor in tensors
        ):
            return dtype
    return torch.uint8


def side_stream(device: Any) -> Any:
    """A CUDA stream of its own for a GPU device's staging copies; None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call,unused-ignore]


@contextlib.contextmanager
def _ordered(device: Any, stream: Any) -> Iterator[None]:
    """Run the block on `stream` (CUDA tensors), after the caller's queued work, and wait
    for it at the end; CPU tensors run in place. The tensors' GPU is made the current one:
    Triton launches on the current device, whichever the tensors are on."""
    if device.type != "cuda":
        yield
        return
    side = stream if stream is not None else side_stream(device)
    with torch.cuda.device(device):
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            yield
        side.synchronize()


def _one_launch_kernels(device: Any, views: Sequence[Tensor], rows: Tensor) -> Any:
    """`triton_kernels` where they can run these buffers (a GPU, Triton installed and working,
    every buffer contiguous with rows of one length, int64 row indices); else None."""
    if device.type != "cuda" or rows.dtype != torch.int64 or not rows.is_contiguous():
        return None
    if len({view.shape[-1] for view in views}) != 1 or not all(v.is_contiguous() for v in views):
        return None
    return prepare(device)


@functools.cache
def prepare(device: Any) -> Any:
    """On a GPU, compile the one-launch kernels now (at registration, not at a request's first
    chunk) and return them; None where they cannot run: CPU tensors, no Triton, or Triton
    failing (then, logged once, the torch kernels do the copies)."""
    if device.type != "cuda":
        return None
    try:
        from kvbridge.staging import triton_kernels
    except ImportError:
        return None
    try:
        with torch.cuda.device(device):
            triton_kernels.warm_up(device)
    except Exception as exc:  # Triton's compilers raise many kinds; any means "do not use it"
        log.warning(
            "staging on %s: one-launch Triton kernels unusable (%s: %s); one torch copy "
            "per KV buffer instead",
            device,
            type(exc).__name__,
            exc,
        )
        return None
    return triton_kernels


def _copy(
    gathering: bool,
    views: Sequence[Tensor],
    rows: Tensor,
    column: int,
    width: int,
    staged_bytes: Tensor,
    stream: Any,
    one_launch: bool,
) -> int:
    """The gather (into `staged_bytes`) or the scatter (out of it), in the widest words the
    slice allows: one Triton launch for all buffers where it can run, else one torch indexed
    copy per buffer."""
    size = staged_size(len(views), int(rows.numel()), width)
    staged = staged_bytes[:size].view(len(views), int(rows.numel()), width)
    word = _word_type([*views, staged], column, width)
    start, stop = column // word.itemsize, (column + width) // word.itemsize
    staged, words = staged.view(word), [view.view(word) for view in views]
    device = staged_bytes.device
    one_launch_kernels = _one_launch_kernels(device, views, rows) if one_launch else None
    with _ordered(device, stream):
        if one_launch_kernels is not None and gathering:
            one_launch_kernels.gather(words, rows, start, stop - start, staged)
        elif one_launch_kernels is not None:
            one_launch_kernels.scatter(staged, words, rows, start, stop - start)
        elif gathering:
            for index, view in enumerate(words):
                torch.index_select(view[:, start:stop], 0, rows, out=staged[index])
        else:
            for index, view in enumerate(words):
                view[:, start:stop].index_copy_(0, rows, staged[index])
    return size


def gather(
    views: Sequence[Tensor],
    rows: Tensor,
    column: int,
    width: int,
    out: Tensor,
    stream: Any = None,
    one_launch: bool = True,
) -> int:
    """Copy bytes ``[column, column + width)`` of the given token rows of every buffer into
    `out`, buffer-major; returns the bytes staged. `one_launch=False` keeps to the torch
    kernels on a GPU (to compare them)."""
    return _copy(True, views, rows, column, width, out, stream, one_launch)


def scatter(
    staged_bytes: Tensor,
    views: Sequence[Tensor],
    rows: Tensor,
    column: int,
    width: int,
    stream: Any = None,
    one_launch: bool = True,
) -> None:
    """The inverse of `gather`: staged bytes into the token rows of every buffer."""
    _copy(False, views, rows, column, width, staged_bytes, stream, one_launch)
