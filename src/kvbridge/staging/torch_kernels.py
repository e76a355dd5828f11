"""Gather and scatter of the staging path on torch tensors — CUDA (on a stream of their own)
or CPU — moving exactly the bytes `kernels.py` moves with numpy: a staged chunk is, for each
KV buffer in order, the chunk's tokens' head slice, ``[buffers, tokens, width]`` bytes.

The KV buffers are viewed as ``[rows, token_bytes]`` uint8 tensors (one row per token slot),
`rows` is an int64 tensor of token rows on the buffers' device, `out`/`staged` a flat uint8
tensor there. On a GPU the copies are ordered after the work already queued on the caller's
current stream (which produced the KV), and finished before returning: the engine reads the
staging buffer (or decode reads its pages) right after.

Imported only where torch is in use; kvbridge itself does not depend on torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch  # type: ignore[import-not-found,unused-ignore]

from kvbridge.staging.kernels import staged_size

Tensor = Any  # torch.Tensor; kept loose so that the module type-checks without torch's stubs


def byte_rows(buffer: Tensor, token_bytes: int) -> Tensor:
    """A contiguous KV tensor (any dtype) as ``[rows, token_bytes]`` bytes, sharing memory."""
    return buffer.view(torch.uint8).view(-1, token_bytes)


def side_stream(device: Any) -> Any:
    """A CUDA stream of its own for a GPU device's staging copies; None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call,unused-ignore]


@contextlib.contextmanager
def _ordered(device: Any, stream: Any) -> Iterator[None]:
    """Run the block on `stream` (CUDA tensors), after the caller's queued work, and wait
    for it at the end; CPU tensors run in place."""
    if device.type != "cuda":
        yield
        return
    side = stream if stream is not None else side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield
    side.synchronize()


def gather(
    views: Sequence[Tensor],
    rows: Tensor,
    column: int,
    width: int,
    out: Tensor,
    stream: Any = None,
) -> int:
    """Copy bytes ``[column, column + width)`` of the given token rows of every buffer into
    `out`, buffer-major; returns the bytes staged."""
    size = staged_size(len(views), int(rows.numel()), width)
    staged = out[:size].view(len(views), int(rows.numel()), width)
    with _ordered(out.device, stream):
        for index, view in enumerate(views):
            torch.index_select(view[:, column : column + width], 0, rows, out=staged[index])
    return size


def scatter(
    staged_bytes: Tensor,
    views: Sequence[Tensor],
    rows: Tensor,
    column: int,
    width: int,
    stream: Any = None,
) -> None:
    """The inverse of `gather`: staged bytes into the token rows of every buffer."""
    size = staged_size(len(views), int(rows.numel()), width)
    staged = staged_bytes[:size].view(len(views), int(rows.numel()), width)
    with _ordered(staged_bytes.device, stream):
        for index, view in enumerate(views):
            view[:, column : column + width].index_copy_(0, rows, staged[index])
