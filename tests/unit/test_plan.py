"""The planner against a brute-force oracle: plans are executed byte for byte (loopback
memcpy between real numpy buffers) and compared with numpy fancy-indexed copies."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_cache import RankCache, rank_cache

from kvbridge.cache import PlanError, TransferPlan, page_runs, plan_kv, plan_slots
from kvbridge.cache.pairing import pair
from kvbridge.cache.plan import PlanArena
from kvbridge.engines.base import EngineError
from kvbridge.engines.loopback import LoopbackEngine
from kvbridge.wire import KVLayout


def execute(plan: TransferPlan, src: RankCache, dst: RankCache) -> None:
    """Run a plan with the loopback engine, bounds-checked against both caches."""
    sender, receiver = LoopbackEngine(), LoopbackEngine()
    try:
        sender.register(src.regions())
        peer = sender.connect(receiver.endpoint(), dst.regions())
        sender.write(peer, plan).wait(1.0)
    finally:
        sender.close()
        receiver.close()


def expected_after(
    src: RankCache, dst: RankCache, src_pages: np.ndarray, dst_pages: np.ndarray
) -> list[np.ndarray]:
    """The oracle: every destination buffer after the copy, by numpy fancy indexing."""
    dst_position = {layer: i for i, layer in enumerate(dst.args.layer_ids)}
    layers_src, layers_dst = len(src.args.layer_ids), len(dst.args.layer_ids)
    result = [array.copy() for array in dst.kv]
    for part in range(src.args.buffers_per_layer):
        for position, layer in enumerate(src.args.layer_ids):
            source = src.kv[part * layers_src + position]
            target = result[part * layers_dst + dst_position[layer]]
            target[dst_pages] = source[src_pages]
    return result


def pages_with_runs(rng: np.random.Generator, num_pages: int, count: int) -> np.ndarray:
    """`count` distinct pages in a random order that keeps some contiguous runs."""
    chosen = np.sort(rng.choice(num_pages, size=count, replace=False))
    blocks = np.array_split(chosen, max(1, count // 3)) if count else [chosen]
    rng.shuffle(blocks)
    return np.concatenate(blocks) if count else chosen


@settings(max_examples=120, deadline=None)
@given(
    kv_layout=st.sampled_from(list(KVLayout)),
    layers=st.integers(1, 4),
    page_size=st.sampled_from([1, 2, 16]),
    heads=st.integers(1, 4),
    head_dim=st.sampled_from([1, 8, 64]),
    num_pages=st.integers(1, 40),
    data=st.data(),
)
def test_plan_matches_oracle(
    kv_layout: KVLayout,
    layers: int,
    page_size: int,
    heads: int,
    head_dim: int,
    num_pages: int,
    data: st.DataObject,
) -> None:
    heads = heads if kv_layout.head_sliceable else 1
    page_size = 1 if kv_layout == KVLayout.PAGES else page_size
    geometry = dict(
        kv_layout=kv_layout,
        layer_ids=tuple(range(layers)),
        page_size=page_size,
        total_kv_heads=heads,
        head_dim=head_dim,
    )
    src = rank_cache(num_pages=num_pages, seed=data.draw(st.integers(0, 2**32)), **geometry)
    dst_pages_total = data.draw(st.integers(num_pages, num_pages + 20))
    dst = rank_cache(num_pages=dst_pages_total, seed=None, **geometry)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32)))
    count = data.draw(st.integers(0, num_pages))
    src_pages = pages_with_runs(rng, num_pages, count)
    dst_pages = pages_with_runs(rng, dst_pages_total, count)
    expected = expected_after(src, dst, src_pages, dst_pages)

    plan = plan_kv(src.args, dst.args, src_pages, dst_pages)
    runs = len(page_runs(src_pages, dst_pages)[0])
    assert len(plan) == runs * len(src.kv)  # one block per buffer per merged run
    assert plan.total_bytes == count * src.args.page_bytes * len(src.kv)
    execute(plan, src, dst)
    for got, want in zip(dst.kv, expected, strict=True):
        assert np.array_equal(got, want)


@settings(max_examples=40, deadline=None)
@given(chunks=st.integers(1, 6), seed=st.integers(0, 2**32))
def test_chunked_sends_equal_one_send(chunks: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    src = rank_cache(num_pages=30, seed=seed)
    dst = rank_cache(num_pages=50, seed=None)
    src_pages = pages_with_runs(rng, 30, 24)
    dst_pages = pages_with_runs(rng, 50, 24)
    expected = expected_after(src, dst, src_pages, dst_pages)
    bounds = np.sort(rng.choice(np.arange(1, 24), size=chunks - 1, replace=False))
    for src_chunk, dst_chunk in zip(
        np.split(src_pages, bounds), np.split(dst_pages, bounds), strict=True
    ):
        execute(plan_kv(src.args, dst.args, src_chunk, dst_chunk), src, dst)
    for got, want in zip(dst.kv, expected, strict=True):
        assert np.array_equal(got, want)


def runs_by_hand(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs where both sides advance by one, walked page by page."""
    runs: list[tuple[int, int, int]] = []
    for src_page, dst_page in zip(src_pages, dst_pages, strict=True):
        if runs and src_page == runs[-1][0] + runs[-1][2] and dst_page == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src_page, dst_page, 1))
    return runs


@settings(max_examples=300, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), max_size=24),
    shift=st.integers(0, 2),
)
def test_page_runs_are_the_maximal_runs(pairs: list[tuple[int, int]], shift: int) -> None:
    # Small page numbers (repeats, steps back, steps by one) with a running offset: runs,
    # breaks on either side alone, and repeated pages all occur.
    src_pages = [src + shift * i for i, (src, _) in enumerate(pairs)]
    dst_pages = [dst + shift * i for i, (_, dst) in enumerate(pairs)]
    src_starts, dst_starts, lengths = page_runs(
        np.array(src_pages, dtype=np.int64), np.array(dst_pages, dtype=np.int64)
    )
    assert src_starts.dtype == dst_starts.dtype == lengths.dtype == np.int64
    got = list(zip(src_starts.tolist(), dst_starts.tolist(), lengths.tolist(), strict=True))
    assert got == runs_by_hand(src_pages, dst_pages)


def test_contiguous_pages_merge_into_one_block_per_buffer() -> None:
    src = rank_cache(num_pages=64)
    dst = rank_cache(num_pages=64, seed=None)
    plan = plan_kv(src.args, dst.args, np.arange(8, 40), np.arange(20, 52))
    assert len(plan) == len(src.kv)
    assert set(plan.length.tolist()) == {32 * src.args.page_bytes}


def test_layers_pair_by_id_not_by_position() -> None:
    # A pipeline stage holding layers 4-5 writes into a decode rank holding layers 0-7.
    src = rank_cache(layer_ids=(4, 5), num_pages=8, seed=3)
    dst = rank_cache(layer_ids=tuple(range(8)), num_pages=8, seed=None)
    pages = np.arange(8)
    execute(plan_kv(src.args, dst.args, pages, pages), src, dst)
    assert np.array_equal(dst.kv[4], src.kv[0])  # K of layer 4
    assert np.array_equal(dst.kv[8 + 5], src.kv[3])  # V of layer 5
    assert not dst.kv[0].any()
    with pytest.raises(PlanError, match=r"no KV buffers for layers \[4, 5\]"):
        plan_kv(src.args, rank_cache(layer_ids=(0, 1), seed=None).args, pages, pages)


def test_aux_and_state_slots() -> None:
    slots = dict(aux_slots=4, aux_item_bytes=(64, 8), state_slots=3, state_item_bytes=(4096,))
    src = rank_cache(seed=5, **slots)
    dst = rank_cache(seed=None, **slots)
    execute(plan_slots(src.args.aux_buffers, dst.args.aux_buffers, 1, 3, "aux"), src, dst)
    execute(plan_slots(src.args.state_buffers, dst.args.state_buffers, 2, 0, "state"), src, dst)
    assert np.array_equal(dst.aux[0][3], src.aux[0][1])
    assert np.array_equal(dst.aux[1][3], src.aux[1][1])
    assert not dst.aux[0][:3].any()
    assert np.array_equal(dst.state[0][0], src.state[0][2])
    with pytest.raises(PlanError, match="destination slot 4 out of range"):
        plan_slots(src.args.aux_buffers, dst.args.aux_buffers, 0, 4, "aux")
    with pytest.raises(PlanError, match="2 local aux buffers but the peer registered 0"):
        plan_slots(src.args.aux_buffers, (), 0, 0, "aux")


@pytest.mark.parametrize(
    ("src_pages", "dst_pages", "match"),
    [
        ([0, 16], [0, 1], r"source page indices must lie in \[0, 16\)"),
        ([0, 1], [-1, 1], "destination page indices"),
        ([0, 1, 2], [0, 1], "3 source pages but 2 destination pages"),
        ([[0]], [[0]], "1-D integer array"),
    ],
)
def test_bad_pages_are_refused(src_pages: list[int], dst_pages: list[int], match: str) -> None:
    src, dst = rank_cache(), rank_cache(seed=None)
    with pytest.raises(PlanError, match=match):
        plan_kv(src.args, dst.args, np.array(src_pages), np.array(dst_pages))


def test_incompatible_geometry_is_refused() -> None:
    with pytest.raises(PlanError, match="page_size differs"):
        plan_kv(rank_cache().args, rank_cache(page_size=8).args, [0], [0])
    with pytest.raises(PlanError, match="KV heads per rank differ"):
        plan_kv(rank_cache().args, rank_cache(attn_tp_size=2).args, [0], [0])
    mla = rank_cache(kv_layout=KVLayout.MLA, total_kv_heads=1)
    with pytest.raises(PlanError, match="KV layouts differ"):
        plan_kv(rank_cache(total_kv_heads=1).args, mla.args, [0], [0])


def test_writes_outside_registered_memory_are_refused() -> None:
    src, dst = rank_cache(), rank_cache(seed=None)
    plan = plan_kv(src.args, dst.args, [0], [0])
    stray = TransferPlan(
        plan.src, plan.dst + np.uint64(dst.args.kv_buffers[-1].length * 64), plan.length
    )
    with pytest.raises(EngineError, match="outside peer destination registered memory"):
        execute(stray, src, dst)
    overrun = TransferPlan(plan.src, plan.dst, plan.length * np.uint64(10**6))
    with pytest.raises(EngineError, match="outside local source registered memory"):
        execute(overrun, src, dst)


def test_a_write_in_two_steps_moves_only_once_started() -> None:
    """`prepare_write` checks and sets up; nothing moves before `start()`, a dropped write
    never moves, and neither step can be taken twice."""
    src, dst = rank_cache(), rank_cache(seed=None)
    before = [array.copy() for array in dst.kv]
    sender, receiver = LoopbackEngine(), LoopbackEngine()
    try:
        sender.register(src.regions())
        peer = sender.connect(receiver.endpoint(), dst.regions())
        plan = plan_kv(src.args, dst.args, [0, 1], [3, 2])
        dropped = sender.prepare_write(peer, plan)
        dropped.release()
        dropped.release()  # idempotent
        with pytest.raises(RuntimeError, match="started or released already"):
            dropped.start()
        assert all(np.array_equal(a, b) for a, b in zip(dst.kv, before, strict=True))
        expected = expected_after(src, dst, np.array([0, 1]), np.array([3, 2]))
        pending = sender.prepare_write(peer, plan)
        assert all(np.array_equal(a, b) for a, b in zip(dst.kv, before, strict=True))
        pending.start().wait(1.0)
        assert all(np.array_equal(a, b) for a, b in zip(dst.kv, expected, strict=True))
        with pytest.raises(RuntimeError, match="started or released already"):
            pending.start()
        pending.release()  # nothing once started
        stray = TransferPlan(plan.src, plan.dst, plan.length * np.uint64(10**6))
        with pytest.raises(EngineError, match="outside local source registered memory"):
            sender.prepare_write(peer, stray)  # refused before anything is set up
    finally:
        sender.close()
        receiver.close()


def test_head_major_pages_move_whole_or_by_head_slices() -> None:
    head_major = {"kv_layout": KVLayout.MHA_HEAD_MAJOR, "total_kv_heads": 4}
    src = rank_cache(**head_major)
    assert pair(src.args, rank_cache(seed=None, **head_major).args).whole_pages
    sliced = pair(src.args, rank_cache(seed=None, attn_tp_size=2, **head_major).args)
    assert not sliced.whole_pages
    assert not sliced.stageable  # no staging ring: one block a page and layer
    with pytest.raises(PlanError, match="KV layouts differ"):
        pair(src.args, rank_cache(seed=None, total_kv_heads=4).args)


def test_plans_in_an_arena_equal_fresh_ones_and_its_memory_is_reused_only_when_given_back() -> None:
    src, dst = rank_cache(num_pages=64, seed=3), rank_cache(num_pages=96, seed=None)
    rng = np.random.default_rng(4)
    src_pages, dst_pages = rng.permutation(64)[:48], rng.permutation(96)[:48]
    arena = PlanArena(keep=2, min_blocks=16)
    fresh = plan_kv(src.args, dst.args, src_pages, dst_pages)
    first = plan_kv(src.args, dst.args, src_pages, dst_pages, arena)
    for field in ("src", "dst", "length"):
        assert np.array_equal(getattr(first, field), getattr(fresh, field))
    assert arena.lent == 1
    second = plan_kv(src.args, dst.args, src_pages[:40], dst_pages[:40], arena)
    assert not np.shares_memory(first.src, second.src)  # the first is still in use
    arena.give_back(first)
    third = plan_kv(src.args, dst.args, src_pages[:40], dst_pages[:40], arena)
    assert np.shares_memory(first.src, third.src)  # reused: big enough and given back
    assert np.array_equal(third.dst, second.dst)
    arena.forget(second)  # something may still read it: never handed out again
    arena.give_back(second)
    assert arena.lent == 1
    small = plan_kv(src.args, dst.args, src_pages[:2], dst_pages[:2], arena)
    assert arena.lent == 1  # under min_blocks: fresh arrays, not tracked
    merged = TransferPlan.concat(third, small, memory=arena)
    assert np.array_equal(merged.src, np.concatenate([third.src, small.src]))
    assert TransferPlan.concat(third) is third


def blocks(plan: TransferPlan) -> set[tuple[int, int, int]]:
    return set(zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True))


@pytest.mark.parametrize(
    ("layout", "src_tp", "dst_tp", "dst_page", "dcp"),
    [
        (KVLayout.MHA, 1, 1, 4, 1),  # whole pages
        (KVLayout.MHA, 2, 1, 4, 1),  # head slices, token by token
        (KVLayout.MHA, 1, 2, 8, 1),  # another page size
        (KVLayout.MHA, 1, 1, 4, 2),  # decode context parallelism
        (KVLayout.MLA, 2, 1, 4, 1),
        (KVLayout.MHA_HEAD_MAJOR, 1, 2, 4, 1),
    ],
)
@settings(max_examples=10, deadline=None)
@given(cuts=st.lists(st.integers(1, 4), min_size=0, max_size=3, unique=True))
def test_layer_ranges_plan_exactly_the_whole_write_between_them(
    layout: KVLayout, src_tp: int, dst_tp: int, dst_page: int, dcp: int, cuts: list[int]
) -> None:
    """A chunk written layer range by layer range moves the same blocks as written whole."""
    heads = 1 if layout == KVLayout.MLA else 4
    geometry = dict(layer_ids=tuple(range(5)), kv_layout=layout, total_kv_heads=heads)
    src = rank_cache(seed=None, num_pages=8, attn_tp_size=src_tp, **geometry).args
    dst = rank_cache(
        seed=None, num_pages=16, attn_tp_size=dst_tp, page_size=dst_page, **geometry
    ).args
    if dcp > 1:
        dst = dataclasses.replace(dst, dcp_size=dcp)
    pairing = pair(src, dst)
    src_pages = np.array([5, 1, 2, 6])
    dst_pages = np.array([3, 9, 0, 12, 7, 4, 11, 8])
    whole = pairing.plan(src, dst, src_pages, 1, dst_pages)
    bounds = [0, *sorted(cuts), 5]
    pieces = [
        pairing.plan(src.layer_range(start, stop), dst, src_pages, 1, dst_pages)
        for start, stop in itertools.pairwise(bounds)
        if start < stop
    ]
    assert sum(len(piece) for piece in pieces) == len(whole)
    assert set().union(*map(blocks, pieces)) == blocks(whole)
