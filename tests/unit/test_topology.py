"""Heterogeneous parallelism against an oracle, over the grid of the issue.

A global KV tensor [K/V, layers, tokens, H, head_dim] is sharded over the prefill ranks
(heads replicated where TP exceeds them) into randomly placed pages; every decode rank (and
DCP rank) receives its part through the planned blocks; the decode caches, un-sharded, must
equal the global tensor byte for byte. All caches live in one numpy arena, and a plan is
executed with vectorized byte indexing over it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest

from kvbridge.cache import BufferSpec, KVArgs, PlanError, TransferPlan, plan_kv
from kvbridge.cache.pairing import pair
from kvbridge.cache.plan import (
    check_state_slicing,
    plan_gathered,
    plan_state_slices,
    plan_tokens,
    token_rows,
)
from kvbridge.cache.topology import Source, TopologyError, rank_heads, topology
from kvbridge.staging import kernels
from kvbridge.wire import KVLayout

LAYERS, HEAD_DIM, TOKENS = 2, 4, 37


class Arena:
    """One byte array that every cache of a case is carved from."""

    def __init__(self, size: int) -> None:
        self.bytes = np.zeros(size, dtype=np.uint8)
        self.base = int(self.bytes.ctypes.data)
        self.used = 0

    def array(self, shape: tuple[int, ...]) -> np.ndarray:
        count = math.prod(shape) * 2
        view = self.bytes[self.used : self.used + count].view(np.uint16).reshape(shape)
        self.used += count
        return view

    def execute(self, plan: TransferPlan) -> None:
        if not len(plan):
            return
        lengths = plan.length.astype(np.int64)
        within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        src = np.repeat(plan.src.astype(np.int64) - self.base, lengths) + within
        dst = np.repeat(plan.dst.astype(np.int64) - self.base, lengths) + within
        self.bytes[dst] = self.bytes[src]


@dataclass
class Rank:
    kv: list[np.ndarray]  # [pages, page_size, heads, head_dim], K of each layer then V
    args: KVArgs


def make_rank(
    arena: Arena,
    layout: KVLayout,
    heads_here: int,
    total: int,
    tp_rank: int,
    tp: int,
    pages: int,
    page_size: int,
) -> Rank:
    per_layer = layout.buffers_per_layer
    kv = [arena.array((pages, page_size, heads_here, HEAD_DIM)) for _ in range(per_layer * LAYERS)]
    args = KVArgs(
        kv_layout=layout,
        layer_ids=tuple(range(LAYERS)),
        total_kv_heads=total,
        head_dim=HEAD_DIM,
        dtype="bfloat16",
        page_size=page_size,
        kv_buffers=tuple(BufferSpec(a.ctypes.data, a.nbytes, a.nbytes // pages) for a in kv),
        attn_tp_rank=tp_rank,
        attn_tp_size=tp,
    )
    return Rank(kv, args)


Case = tuple[KVLayout, int, int, int, int, int, bool]
CASES: list[Case] = [
    (layout, pt, dt, heads, page_size, dcp, chunked)
    for layout in (KVLayout.MHA, KVLayout.MLA)
    for pt, dt in itertools.product((1, 2, 4, 8), repeat=2)
    for heads in ((1, 2, 8, 32) if layout == KVLayout.MHA else (1,))
    for page_size in (1, 16)
    for dcp in (1, 2, 4)
    for chunked in (False, True)
] + [
    # vLLM's LBNHC pages: one buffer per layer, a head's K and V side by side in a token row
    # (HEAD_DIM stands for both): the token planner's head slices, page sizes and DCP.
    (KVLayout.MHA_KV_PACKED, pt, dt, heads, page_size, dcp, chunked)
    for pt, dt in itertools.product((1, 2, 4, 8), repeat=2)
    for heads in (2, 8)
    for page_size in (1, 16)
    for dcp in (1, 2)
    for chunked in (False, True)
]


def case_id(case: Case) -> str:
    layout, pt, dt, heads, page_size, dcp, chunked = case
    return (
        f"{layout.name}-P{pt}-D{dt}-H{heads}-ps{page_size}-dcp{dcp}{'-chunked' if chunked else ''}"  # type: ignore[union-attr]
    )


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_grid_against_the_global_tensor(
    case: tuple[KVLayout, int, int, int, int, int, bool],
) -> None:
    layout, pt, dt, heads, page_size, dcp, chunked = case
    rng = np.random.default_rng(abs(hash(case_id(case))) % 2**32)
    parts = layout.buffers_per_layer
    truth = rng.integers(0, 2**16, size=(parts, LAYERS, TOKENS, heads, HEAD_DIM), dtype=np.uint16)
    src_pages_needed = math.ceil(TOKENS / page_size)
    local_tokens = [len(range(r, TOKENS, dcp)) for r in range(dcp)]
    arena = Arena(
        3
        * (pt + 2 * dt * dcp)
        * parts
        * LAYERS
        * (src_pages_needed + 8)
        * page_size
        * heads
        * HEAD_DIM
        + 4096
    )

    def heads_of(rank: int, tp: int) -> tuple[int, int]:
        if layout == KVLayout.MLA:
            return 0, heads
        held = rank_heads(rank, tp, heads)
        return held.start, held.count

    prefill = []
    src_pages = []
    for p in range(pt):
        start, count = heads_of(p, pt)
        rank = make_rank(arena, layout, count, heads, p, pt, src_pages_needed + 3, page_size)
        pages = rng.permutation(src_pages_needed + 3)[:src_pages_needed]
        token_pages, slots = pages[np.arange(TOKENS) // page_size], np.arange(TOKENS) % page_size
        for index, buffer in enumerate(rank.kv):
            part, layer = divmod(index, LAYERS)
            buffer[token_pages, slots] = truth[part, layer, :, start : start + count]
        prefill.append(rank)
        src_pages.append(pages)

    mapping = topology(pt, dt, heads, layout)
    for prefill_rank in range(pt):  # every prefill rank hears about every room
        assert mapping.required_requests(prefill_rank) >= 1
    for d in range(dt):
        start, count = heads_of(d, dt)
        route = mapping.route(d)
        covered = sorted((s.dst_head_offset, s.heads.count) for s in route.sources)
        if layout == KVLayout.MLA:
            assert len(route.sources) == 1  # no byte sent twice to one decode rank
        assert sum(c for _, c in covered) == count  # every head exactly once
        for r in range(dcp):
            pages_needed = math.ceil(local_tokens[r] / page_size)
            rank = make_rank(arena, layout, count, heads, d, dt, pages_needed + 5, page_size)
            dst_pages = rng.permutation(pages_needed + 5)[:pages_needed]
            for source in route.sources:
                pages = src_pages[source.prefill_rank]
                bounds = [0, 1, pages.size] if chunked and pages.size > 1 else [0, pages.size]
                for low, high in itertools.pairwise(bounds):
                    plan = plan_tokens(
                        prefill[source.prefill_rank].args,
                        rank.args,
                        source,
                        pages[low:high],
                        low * page_size,
                        dst_pages,
                        dcp_size=dcp,
                        dcp_rank=r,
                    )
                    arena.execute(plan)
            ranks = [rank]
            direct = pair(prefill[route.sources[0].prefill_rank].args, rank.args).direct
            if direct:  # the same again, gathered and written straight into decode's pages
                only = route.sources[0]
                ranks.append(
                    gathered_into(
                        arena,
                        prefill,
                        src_pages,
                        layout,
                        only,
                        count,
                        heads,
                        d,
                        dt,
                        dst_pages,
                        chunked,
                        dcp,
                        r,
                    )
                )
            tokens = np.arange(r, TOKENS, dcp)
            local = np.arange(tokens.size)
            for received in ranks:
                for index, buffer in enumerate(received.kv):
                    part, layer = divmod(index, LAYERS)
                    got = buffer[dst_pages[local // page_size], local % page_size]
                    expected = truth[part, layer, tokens, start : start + count]
                    assert np.array_equal(got, expected), f"decode {d} dcp {r} buffer {index}"


def gathered_into(
    arena: Arena,
    prefill: list[Rank],
    src_pages: list[np.ndarray],
    layout: KVLayout,
    source: Source,
    count: int,
    heads: int,
    d: int,
    dt: int,
    dst_pages: np.ndarray,
    chunked: bool,
    dcp: int,
    dcp_rank: int,
) -> Rank:
    """A decode rank fed by one prefill rank alone, filled the way a prefill rank does it
    then: each chunk's head slice gathered into a staging buffer, written by `plan_gathered`."""
    src = prefill[source.prefill_rank]
    page_size = src.args.page_size
    rank = make_rank(arena, layout, count, heads, d, dt, dst_pages.max() + 1, page_size)
    rank.args = dataclasses.replace(rank.args, dcp_size=dcp, dcp_rank=dcp_rank)
    views = [kernels.buffer_rows(b, src.args.token_bytes) for b in src.args.kv_buffers]
    pages = src_pages[source.prefill_rank]
    staging = arena.array((len(views) * pages.size * page_size * count * HEAD_DIM,))
    staging = staging.view(np.uint8)
    bounds = [0, 1, pages.size] if chunked and pages.size > 1 else [0, pages.size]
    column, width = source.columns(src.args.head_bytes, "src")
    for low, high in itertools.pairwise(bounds):
        src_rows, dst_rows = token_rows(
            pages[low:high], page_size, low * page_size, dst_pages, page_size, dcp, dcp_rank
        )
        kernels.gather(views, src_rows, column, width, staging)
        arena.execute(plan_gathered(src.args, rank.args, source, staging.ctypes.data, dst_rows))
    return rank


HeadMajorCase = tuple[int, int, int, int, bool]
HEAD_MAJOR_CASES: list[HeadMajorCase] = [
    (pt, dt, heads, page_size, chunked)
    for pt, dt in itertools.product((1, 2, 4, 8), repeat=2)
    for heads in (1, 2, 8)
    for page_size in (1, 16)
    for chunked in (False, True)
]


def make_head_major_rank(
    arena: Arena, heads_here: int, total: int, tp_rank: int, tp: int, pages: int, page_size: int
) -> Rank:
    """vLLM's CPU cache: one buffer per layer, pages ``[heads, K/V, page_size, head_dim]``."""
    kv = [arena.array((pages, heads_here, 2 * page_size, HEAD_DIM)) for _ in range(LAYERS)]
    args = KVArgs(
        kv_layout=KVLayout.MHA_HEAD_MAJOR,
        layer_ids=tuple(range(LAYERS)),
        total_kv_heads=total,
        head_dim=HEAD_DIM,
        dtype="bfloat16",
        page_size=page_size,
        kv_buffers=tuple(BufferSpec(a.ctypes.data, a.nbytes, a.nbytes // pages) for a in kv),
        attn_tp_rank=tp_rank,
        attn_tp_size=tp,
    )
    return Rank(kv, args)


def head_major_tokens(buffer: np.ndarray, pages: np.ndarray, page_size: int) -> np.ndarray:
    """A head-major buffer's tokens, in the order of `pages`: [tokens, heads, K/V, head_dim]."""
    count, heads = buffer.shape[0], buffer.shape[1]
    split = buffer.reshape(count, heads, 2, page_size, HEAD_DIM)
    tokens = np.arange(pages.size * page_size)
    return split[pages[tokens // page_size], :, :, tokens % page_size]


def head_major_case_id(case: HeadMajorCase) -> str:
    pt, dt, heads, page_size, chunked = case
    return f"P{pt}-D{dt}-H{heads}-ps{page_size}{'-chunked' if chunked else ''}"


@pytest.mark.parametrize("case", HEAD_MAJOR_CASES, ids=map(head_major_case_id, HEAD_MAJOR_CASES))
def test_head_major_grid_against_the_global_tensor(case: HeadMajorCase) -> None:
    """Different TP sizes over vLLM's CPU layout: head slices of whole pages, planned by the
    same pairing the managers use."""
    pt, dt, heads, page_size, chunked = case
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    truth = rng.integers(0, 2**16, size=(LAYERS, TOKENS, heads, 2, HEAD_DIM), dtype=np.uint16)
    pages_needed = math.ceil(TOKENS / page_size)
    arena = Arena(
        2 * (pt + dt) * LAYERS * (pages_needed + 5) * page_size * heads * 2 * HEAD_DIM + 4096
    )
    prefill, src_pages = [], []
    for p in range(pt):
        held = rank_heads(p, pt, heads)
        rank = make_head_major_rank(arena, held.count, heads, p, pt, pages_needed + 3, page_size)
        pages = rng.permutation(pages_needed + 3)[:pages_needed]
        tokens = np.arange(TOKENS)
        for layer, buffer in enumerate(rank.kv):
            split = buffer.reshape(buffer.shape[0], held.count, 2, page_size, HEAD_DIM)
            split[pages[tokens // page_size], :, :, tokens % page_size] = truth[
                layer, :, held.start : held.stop
            ]
        prefill.append(rank)
        src_pages.append(pages)
    for d in range(dt):
        held = rank_heads(d, dt, heads)
        rank = make_head_major_rank(arena, held.count, heads, d, dt, pages_needed + 5, page_size)
        dst_pages = rng.permutation(pages_needed + 5)[:pages_needed]
        for p in range(pt):
            pairing = pair(prefill[p].args, rank.args)
            if pairing.source is not None:
                assert pairing.whole_pages == (pt == dt or min(pt, dt) >= heads)
            pages = src_pages[p]
            bounds = [0, 1, pages.size] if chunked and pages.size > 1 else [0, pages.size]
            for low, high in itertools.pairwise(bounds):
                plan = pairing.plan(prefill[p].args, rank.args, pages[low:high], low, dst_pages)
                if pairing.source is not None and not pairing.whole_pages:  # a block a page
                    assert len(plan) == LAYERS * (high - low)
                arena.execute(plan)
        for layer, buffer in enumerate(rank.kv):
            got = head_major_tokens(buffer, dst_pages, page_size)[:TOKENS]
            assert np.array_equal(got, truth[layer, :, held.start : held.stop]), f"decode {d}"


def test_head_major_pages_keep_their_tokens_together() -> None:
    arena = Arena(1 << 20)
    src = make_head_major_rank(arena, 4, 8, 0, 2, 8, 16)
    with pytest.raises(PlanError, match="same page size"):
        pair(src.args, make_head_major_rank(arena, 2, 8, 0, 4, 8, 32).args)
    (source,) = topology(2, 4, 8, KVLayout.MHA_HEAD_MAJOR).route(0).sources
    with pytest.raises(PlanError, match="cannot split their tokens"):
        plan_tokens(
            src.args,
            make_head_major_rank(arena, 2, 8, 0, 4, 8, 16).args,
            source,
            np.array([0]),
            0,
            np.array([0]),
        )


def test_equal_layout_merges_to_the_page_runs_of_plan_kv() -> None:
    arena = Arena(1 << 20)
    src = make_rank(arena, KVLayout.MHA, 4, 8, 1, 2, 20, 16)
    dst = make_rank(arena, KVLayout.MHA, 4, 8, 1, 2, 30, 16)
    (source,) = topology(2, 2, 8, KVLayout.MHA).route(1).sources
    src_pages, dst_pages = np.array([3, 4, 5, 9]), np.array([10, 11, 2, 3])
    by_token = plan_tokens(src.args, dst.args, source, src_pages, 0, dst_pages)
    by_page = plan_kv(src.args, dst.args, src_pages, dst_pages)
    for field in ("src", "dst", "length"):
        assert np.array_equal(getattr(by_token, field), getattr(by_page, field))


def test_head_slicing_costs_one_block_per_token_per_buffer() -> None:
    arena = Arena(1 << 20)
    src = make_rank(arena, KVLayout.MHA, 4, 8, 0, 2, 8, 16)  # Pt=2: 4 heads a rank
    dst = make_rank(arena, KVLayout.MHA, 2, 8, 1, 4, 8, 16)  # Dt=4: 2 heads a rank
    (source,) = topology(2, 4, 8, KVLayout.MHA).route(1).sources
    assert (source.prefill_rank, source.src_head_offset, source.heads.count) == (0, 2, 2)
    plan = plan_tokens(src.args, dst.args, source, np.array([0, 1]), 0, np.array([5, 6]))
    assert len(plan) == 2 * LAYERS * 32  # K and V of each layer, 32 tokens


def test_one_source_writes_straight_into_pages_or_through_the_ring() -> None:
    """Pt < Dt: the decode rank's heads all come from one prefill rank. Its gathered rows go
    straight into decode's pages or through its ring, as the cost model says per chunk
    (tests/unit/test_write_costs.py); straight into its pages when decode has no ring."""
    arena = Arena(1 << 22)
    src = make_rank(arena, KVLayout.MHA, 4, 8, 0, 2, 4, 16)  # Pt=2: 4 heads a rank
    ring = BufferSpec(arena.base, 1 << 16, 1)

    def decode_rank(page_size: int, with_ring: bool) -> KVArgs:
        args = make_rank(arena, KVLayout.MHA, 2, 8, 1, 4, 4, page_size).args  # Dt=4: 2 heads
        return dataclasses.replace(args, staging_buffer=ring if with_ring else None)

    for page_size in (16, 64):
        either = pair(src.args, decode_rank(page_size, with_ring=True))
        assert (either.stageable, either.rows_or_ring, either.direct) == (True, True, False)
        only_rows = pair(src.args, decode_rank(page_size, with_ring=False))  # no choice
        assert (only_rows.stageable, only_rows.rows_or_ring, only_rows.direct) == (
            True,
            False,
            True,
        )


@pytest.mark.parametrize(
    ("pt", "dt", "heads", "expected"),
    [
        (4, 8, 2, [0, 1, 0, 1, 2, 3, 2, 3]),  # decode replicas share out prefill replicas…
        (8, 2, 8, [0, 4]),  # …and a decode rank gathers several prefill ranks' heads
    ],
)
def test_replicas_map_by_division(pt: int, dt: int, heads: int, expected: list[int]) -> None:
    mapping = topology(pt, dt, heads, KVLayout.MHA)
    assert [route.sources[0].prefill_rank for route in mapping.routes] == expected


def test_unfed_prefill_ranks_get_dummies() -> None:
    mapping = topology(4, 1, 1, KVLayout.MLA)
    (route,) = mapping.routes
    assert [s.prefill_rank for s in route.sources] == [0]
    assert route.dummies == (1, 2, 3)
    assert [mapping.required_requests(p) for p in range(4)] == [1, 1, 1, 1]
    replicated = topology(8, 2, 2, KVLayout.MHA)  # 4 replicas of each head
    assert sorted(r for route in replicated.routes for r in route.prefill_ranks) == list(range(8))


def test_uneven_heads_are_refused() -> None:
    with pytest.raises(TopologyError, match="do not divide"):
        rank_heads(0, 3, 8)
    with pytest.raises(TopologyError, match="not a multiple"):
        rank_heads(0, 12, 8)


@pytest.mark.parametrize(("pt", "dt"), list(itertools.product((1, 2, 4, 8), repeat=2)))
def test_state_shards_against_the_global_state(pt: int, dt: int) -> None:
    """A per-request state tensor [rows, row_bytes] sharded by rows over TP moves between any
    TP sizes: the route's sources together write exactly the decode rank's rows."""
    total_rows, row_bytes, slots = 8, 12, 3
    rng = np.random.default_rng(pt * 10 + dt)
    truth = rng.integers(0, 256, size=(slots, total_rows, row_bytes), dtype=np.uint8)

    def rank(tp_rank: int, tp: int, fill: bool) -> tuple[KVArgs, np.ndarray, list[np.ndarray]]:
        rows = total_rows // tp
        state = np.zeros((slots, rows, row_bytes), dtype=np.uint8)
        if fill:
            state[:] = truth[:, tp_rank * rows : (tp_rank + 1) * rows]
        kv = [np.zeros((2, 1, 8 // min(tp, 8), 4), np.uint16) for _ in range(2)]
        args = KVArgs.from_numpy(
            kv,
            kv_layout=KVLayout.MHA,
            total_kv_heads=8,
            attn_tp_rank=tp_rank,
            attn_tp_size=tp,
            state=[state],
            state_dims=[rows],
        )
        return args, state, kv  # the arrays stay alive with the args that point into them

    prefill = [rank(p, pt, True) for p in range(pt)]
    mapping = topology(pt, dt, 8, KVLayout.MHA)
    for d in range(dt):
        args, state, _ = rank(d, dt, False)
        for source in mapping.route(d).sources:
            src_args = prefill[source.prefill_rank][0]
            check_state_slicing(src_args, args)
            plan = plan_state_slices(src_args, args, src_slot=2, dst_slot=0)
            for src, dst, length in zip(plan.src, plan.dst, plan.length, strict=True):
                ctypes.memmove(int(dst), int(src), int(length))
        rows = total_rows // dt
        assert np.array_equal(state[0], truth[2, d * rows : (d + 1) * rows])


def test_state_without_its_sharded_dimension_is_refused_at_pairing() -> None:
    state = [np.zeros((2, 64), np.uint8)]
    kv = [np.zeros((2, 1, 4, 4), np.uint16) for _ in range(2)]
    src = KVArgs.from_numpy(
        kv, kv_layout=KVLayout.MHA, total_kv_heads=8, attn_tp_size=2, state=state
    )
    kv_full = [np.zeros((2, 1, 8, 4), np.uint16) for _ in range(2)]
    dst = KVArgs.from_numpy(kv_full, kv_layout=KVLayout.MHA, total_kv_heads=8, state=state)
    with pytest.raises(PlanError, match="without their sharded parts"):
        pair(src, dst)
