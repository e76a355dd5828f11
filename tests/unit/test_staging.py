"""The staging ring (allocation, wrap-around, watermark safety, oversize) and the numpy
gather/scatter kernels against the per-token planner."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_cache import rank_cache

from kvbridge.cache.plan import plan_tokens, token_rows
from kvbridge.cache.topology import topology
from kvbridge.engines.loopback import LoopbackEngine
from kvbridge.staging import RingError, StagingRing, buffer_rows, gather, host_bytes, scatter
from kvbridge.staging.buffer import HostStaging, StagingUnavailable, open_staging
from kvbridge.staging.kernels import whole_pages
from kvbridge.wire import KVLayout, MemoryKind


def test_allocation_wraps_to_the_next_round_and_waits_for_frees() -> None:
    ring = StagingRing(1024)
    first, second = ring.allocate(400), ring.allocate(400)
    assert first is not None
    assert second is not None
    assert (first.offset, first.round, second.offset) == (0, 0, 448)
    assert ring.allocate(400) is None  # 176 bytes left at the end, the start is in use
    ring.free(first)
    assert ring.watermark == (0, 448)
    third = ring.allocate(400)  # does not straddle the end: next round, offset 0
    assert third is not None
    assert (third.offset, third.round, third.end) == (0, 1, 400)
    ring.free(second)
    ring.free(third)
    assert ring.watermark == (1, 448)
    assert ring.in_use == 0


def test_frees_out_of_order_hold_the_watermark_at_the_oldest() -> None:
    ring = StagingRing(4096)
    regions = [ring.allocate(1000) for _ in range(3)]
    assert all(region is not None for region in regions)
    ring.free(regions[1])  # type: ignore[arg-type]
    assert ring.watermark == (0, 0)
    ring.free(regions[0])  # type: ignore[arg-type]
    assert ring.watermark == (0, 2048)  # past both freed regions (1024 each, aligned)
    with pytest.raises(RingError, match="no live region at 0"):
        ring.free(regions[0])  # type: ignore[arg-type]


def test_oversize_never_fits() -> None:
    ring = StagingRing(1024)
    assert not ring.fits_ever(1025)
    with pytest.raises(RingError, match="can never fit"):
        ring.allocate(1025)
    with pytest.raises(RingError, match="multiple"):
        StagingRing(1000)


@settings(max_examples=200, deadline=None)
@given(
    ring_kib=st.integers(1, 16),
    steps=st.lists(st.tuples(st.booleans(), st.integers(1, 6000), st.integers(0, 99)), max_size=80),
)
def test_a_writer_never_overwrites_what_decode_has_not_scattered(
    ring_kib: int, steps: list[tuple[bool, int, int]]
) -> None:
    ring = StagingRing(ring_kib * 1024)
    live: list[tuple[int, int, object]] = []
    for allocate, size, pick in steps:
        if allocate and ring.fits_ever(size):
            region = ring.allocate(size)
            if region is None:
                assert live  # only a full ring refuses
                continue
            assert region.offset >= 0
            assert region.end <= ring.ring_size
            for offset, end, _ in live:  # no byte shared with a region not yet freed
                assert region.end <= offset or end <= region.offset
            live.append((region.offset, region.end, region))
        elif live:
            offset, end, region = live.pop(pick % len(live))
            ring.free(region)  # type: ignore[arg-type]


@pytest.mark.parametrize(("pt", "dt", "prefill_rank", "decode_rank"), [(2, 4, 0, 1), (4, 2, 3, 1)])
def test_gather_then_scatter_equals_the_per_token_plan(
    pt: int, dt: int, prefill_rank: int, decode_rank: int
) -> None:
    geometry = dict(layer_ids=(0, 1, 2), page_size=4, total_kv_heads=8, head_dim=16)
    src = rank_cache(num_pages=12, attn_tp_size=pt, seed=prefill_rank, **geometry)
    by_staging = rank_cache(num_pages=20, attn_tp_size=dt, seed=None, **geometry)
    by_tokens = rank_cache(num_pages=20, attn_tp_size=dt, seed=None, **geometry)
    (source,) = [
        s
        for s in topology(pt, dt, 8, KVLayout.MHA).route(decode_rank).sources
        if s.prefill_rank == prefill_rank
    ]
    src_pages = np.array([7, 2, 9])
    dst_pages = np.array([11, 3, 15, 0, 6])
    token_start = 4  # the chunk is the room's second page onwards

    src_rows, dst_rows = token_rows(src_pages, 4, token_start, dst_pages, 4)
    head_bytes = 16 * 2
    width = source.heads.count * head_bytes
    staging = np.zeros(3 * 2 * src_rows.size * width, dtype=np.uint8)
    src_views = [buffer_rows(b, src.args.token_bytes) for b in src.args.kv_buffers]
    dst_views = [buffer_rows(b, by_staging.args.token_bytes) for b in by_staging.args.kv_buffers]
    size = gather(src_views, src_rows, source.src_head_offset * head_bytes, width, staging)
    ring = staging.copy()  # the one transfer into decode's ring
    scatter(ring[:size], dst_views, dst_rows, source.dst_head_offset * head_bytes, width)

    sender, receiver = LoopbackEngine(), LoopbackEngine()
    sender.register(src.regions())
    peer = sender.connect(receiver.endpoint(), by_tokens.regions())
    plan = plan_tokens(src.args, by_tokens.args, source, src_pages, token_start, dst_pages)
    sender.write(peer, plan).wait(1.0)
    for staged, planned in zip(by_staging.kv, by_tokens.kv, strict=True):
        assert planned.any()
        assert np.array_equal(staged, planned)


@st.composite
def chunk_rows(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """Token rows of a chunk in a cache of 8 pages: whole pages, pages cut short or entered
    part-way, and single rows, in any order, each row once (as a chunk's are); with the page
    size."""
    page_size = draw(st.sampled_from([1, 2, 4]))
    # Runs of consecutive rows from any row: whole pages when they start on one and are a
    # page long, else runs that cross pages or stop short.
    runs = draw(
        st.lists(
            st.tuples(
                st.integers(0, 8 * page_size - 1),
                st.sampled_from([1, page_size, page_size + 1, 2 * page_size]),
            ),
            max_size=10,
        )
    )
    rows = [row for first, count in runs for row in range(first, min(8 * page_size, first + count))]
    return np.array(list(dict.fromkeys(rows)), dtype=np.int64), page_size


@settings(max_examples=300, deadline=None)
@given(chunk_rows(), st.sampled_from([(0, 12), (0, 12), (0, 5), (4, 8), (7, 1)]))
def test_gather_and_scatter_by_page_move_what_they_move_row_by_row(
    drawn: tuple[np.ndarray, int], row_slice: tuple[int, int]
) -> None:
    rows, page_size = drawn
    (column, width), token_bytes = row_slice, 12
    rng = np.random.default_rng(rows.size)
    views = [rng.integers(1, 255, (8 * page_size, token_bytes), dtype=np.uint8) for _ in range(3)]
    size = 3 * rows.size * width
    by_row, by_page = np.zeros(size + 4, np.uint8), np.zeros(size + 4, np.uint8)
    assert gather(views, rows, column, width, by_row) == size
    assert gather(views, rows, column, width, by_page, page_size) == size
    assert np.array_equal(by_page, by_row)
    staged = rng.integers(1, 255, size, dtype=np.uint8)
    landed_by_row = [np.zeros_like(view) for view in views]
    landed_by_page = [np.zeros_like(view) for view in views]
    scatter(staged, landed_by_row, rows, column, width)
    scatter(staged, landed_by_page, rows, column, width, page_size)
    for got, want in zip(landed_by_page, landed_by_row, strict=True):
        assert np.array_equal(got, want)


def test_whole_pages_counts_the_leading_aligned_pages() -> None:
    rows = np.array([8, 9, 10, 11, 0, 1, 2, 3, 5, 6, 7, 12], dtype=np.int64)
    assert whole_pages(rows, 4, 16) == 8  # pages 2 and 0, then a page entered part-way
    assert whole_pages(rows[8:], 4, 16) == 0
    assert whole_pages(np.arange(2, 10, dtype=np.int64), 4, 16) == 0  # a page long, not on one
    assert whole_pages(np.arange(16, dtype=np.int64), 4, 16) == 16
    assert whole_pages(np.arange(16, dtype=np.int64), 4, 18) == 0  # not whole pages of rows
    assert whole_pages(np.arange(4, dtype=np.int64), 1, 16) == 0  # by row anyway


def test_open_staging_picks_the_kernels_for_the_memory_or_says_why_not() -> None:
    host = rank_cache(num_pages=4, seed=None)
    assert isinstance(open_staging(host.args, 4096, "auto"), HostStaging)
    assert isinstance(open_staging(host.args, 4096, "numpy"), HostStaging)
    gpu = dataclasses.replace(host.args, memory_kind=MemoryKind.VRAM)  # raw pointers only
    with pytest.raises(StagingUnavailable, match="need the cache's tensors"):
        open_staging(gpu, 4096, "auto")
    with pytest.raises(StagingUnavailable, match="numpy staging kernels cannot reach GPU"):
        open_staging(gpu, 4096, "numpy")
    with pytest.raises(StagingUnavailable, match="need the cache's tensors"):
        open_staging(host.args, 4096, "torch")
    with pytest.raises(StagingUnavailable, match="one of auto, numpy, torch"):
        open_staging(host.args, 4096, "cuda")


def test_host_staging_gathers_and_scatters_through_its_own_buffer() -> None:
    src = rank_cache(num_pages=4, seed=5)
    dst = rank_cache(num_pages=4, seed=None)
    rows = np.array([4, 5, 6, 7, 12], dtype=np.int64)  # page 1 and the first token of page 3
    width = src.args.token_bytes
    gathered, landed = open_staging(src.args, 4096, "numpy"), open_staging(dst.args, 4096, "auto")
    size = gathered.gather(rows, 0, width)
    assert size == len(src.kv) * rows.size * width
    host_bytes(landed.ptr, size)[:] = host_bytes(gathered.ptr, size)  # what the engine does
    landed.scatter(0, size, rows, 0, width)
    for got, want in zip(dst.kv, src.kv, strict=True):
        flat_got, flat_want = got.reshape(16, -1), want.reshape(16, -1)
        assert np.array_equal(flat_got[rows], flat_want[rows])
        assert not np.delete(flat_got, rows, axis=0).any()
