"""The torch gather/scatter kernels move exactly the bytes of the numpy ones: on CPU tensors
here, on a GPU where one exists (those cases skip elsewhere)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch kernels need torch")

from kvbridge.staging import kernels, torch_kernels  # noqa: E402 - after the torch check

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
    ),
]
BUFFERS, ROWS, TOKEN_BYTES = 6, 40, 64  # e.g. 3 layers × K/V, 4 heads × 8 bf16 dims


def numpy_buffers(seed: int | None) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if seed is None:
        return [np.zeros((ROWS, TOKEN_BYTES), dtype=np.uint8) for _ in range(BUFFERS)]
    return [rng.integers(0, 256, (ROWS, TOKEN_BYTES), dtype=np.uint8) for _ in range(BUFFERS)]


# Head slices whose bytes and offsets allow 8-, 4-, 2- and 1-byte words (the kernels copy the
# widest words that fit).
SLICES = [(0, 64), (16, 32), (48, 16), (4, 12), (6, 2), (5, 3)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("column", "width"), SLICES)
@pytest.mark.parametrize("offset", [0, 3])
def test_gather_matches_numpy(device: str, column: int, width: int, offset: int) -> None:
    source = numpy_buffers(seed=3)
    rows = np.array([5, 6, 7, 31, 2, 39, 0], dtype=np.int64)  # out of order, like pages
    expected = np.zeros(BUFFERS * rows.size * width, dtype=np.uint8)
    size = kernels.gather(source, rows, column, width, expected)

    views = [torch.from_numpy(b).to(device) for b in source]
    ring = torch.zeros(expected.size + 100, dtype=torch.uint8, device=device)  # a larger ring
    out = ring[offset:]  # at an odd offset in the ring, only byte copies line up
    got = torch_kernels.gather(views, torch.from_numpy(rows).to(device), column, width, out)
    assert got == size
    assert np.array_equal(out[:size].cpu().numpy(), expected[:size])
    assert not out[size:].any()
    assert not ring[:offset].any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("column", "width"), SLICES)
@pytest.mark.parametrize("offset", [0, 3])
def test_scatter_matches_numpy_and_touches_nothing_else(
    device: str, column: int, width: int, offset: int
) -> None:
    rows = np.array([10, 3, 4, 5, 38], dtype=np.int64)
    staged = np.random.default_rng(9).integers(0, 256, BUFFERS * rows.size * width, np.uint8)
    expected = numpy_buffers(seed=None)
    kernels.scatter(staged, expected, rows, column, width)

    views = [
        torch.zeros((ROWS, TOKEN_BYTES), dtype=torch.uint8, device=device) for _ in range(BUFFERS)
    ]
    staged_tensor = torch.from_numpy(np.concatenate([np.zeros(offset, np.uint8), staged]))
    staged_tensor = staged_tensor.to(device)[offset:]
    torch_kernels.scatter(staged_tensor, views, torch.from_numpy(rows).to(device), column, width)
    for got, want in zip(views, expected, strict=True):
        assert np.array_equal(got.cpu().numpy(), want)  # the other rows and columns stay zero


@pytest.mark.parametrize("device", DEVICES)
def test_gather_then_scatter_moves_a_head_slice_between_differently_sharded_caches(
    device: str,
) -> None:
    """Prefill holds 4 heads per token, decode 2 (TP 2→4): decode's rows receive heads 2-3."""
    head_bytes = 16
    prefill = [
        torch.randint(0, 256, (ROWS, 4 * head_bytes), dtype=torch.uint8, device=device)
        for _ in range(BUFFERS)
    ]
    decode = [
        torch.zeros((ROWS, 2 * head_bytes), dtype=torch.uint8, device=device)
        for _ in range(BUFFERS)
    ]
    src_rows = torch.tensor([8, 9, 10, 11, 20, 21], device=device)
    dst_rows = torch.tensor([0, 1, 2, 3, 36, 37], device=device)
    ring = torch.empty(1 << 12, dtype=torch.uint8, device=device)
    size = torch_kernels.gather(prefill, src_rows, 2 * head_bytes, 2 * head_bytes, ring)
    torch_kernels.scatter(ring[:size], decode, dst_rows, 0, 2 * head_bytes)
    for source, target in zip(prefill, decode, strict=True):
        assert torch.equal(target[dst_rows], source[src_rows, 2 * head_bytes :])


def test_byte_rows_views_a_bf16_cache_without_copying() -> None:
    cache = torch.randn(5, 4, 2, 8).to(torch.bfloat16)  # [pages, page_size, heads, head_dim]
    rows = torch_kernels.byte_rows(cache, token_bytes=2 * 8 * 2)
    assert rows.shape == (20, 32)
    assert rows.data_ptr() == cache.data_ptr()
    rows[0].zero_()
    assert not cache[0, 0].any()


def test_one_launch_triton_kernels_move_the_torch_kernels_bytes() -> None:
    """The Triton kernels (one launch for all buffers; what a GPU uses) against the torch
    ones, run by Triton's interpreter on CPU tensors where Triton is installed. The `cuda`
    cases above run them compiled on a GPU."""
    pytest.importorskip("triton", reason="the one-launch kernels need Triton")
    check = Path(__file__).parents[1] / "helpers" / "staging_triton_check.py"
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, str(check)], env=environment, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("row ") == 6, result.stdout
