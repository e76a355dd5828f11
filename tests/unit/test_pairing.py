"""The path a prefill rank's chunks take to a decode rank, and why (`pair`'s `write_path`):
every reason a pairing can give, from the layouts, TP pairs, page sizes and rings that lead
to it."""

from __future__ import annotations

import dataclasses

import pytest
from kv_cache import rank_cache

from kvbridge.cache import BufferSpec, KVArgs
from kvbridge.cache.pairing import PathReason, WritePath, pair
from kvbridge.wire import KVLayout

RING = BufferSpec(1 << 20, 1 << 16, 1)
DIRECT, PAGE_ROWS, THROUGH_RING = WritePath.DIRECT, WritePath.PAGE_ROWS, WritePath.RING


def rank(
    layout: KVLayout = KVLayout.MHA,
    tp: tuple[int, int] = (0, 1),
    *,
    heads: int = 4,
    page_size: int = 4,
    layers: tuple[int, ...] = (0, 1),
    ring: bool = False,
) -> KVArgs:
    """A rank's KV (`tp`: its rank and the TP size), head_dim 8 in 2-byte elements."""
    total = 1 if layout in (KVLayout.MLA, KVLayout.PAGES) else heads
    args = rank_cache(
        kv_layout=layout,
        layer_ids=layers,
        num_pages=2,
        page_size=page_size,
        total_kv_heads=total,
        head_dim=8,
        attn_tp_rank=tp[0],
        attn_tp_size=tp[1],
    ).args
    return dataclasses.replace(args, staging_buffer=RING if ring else None)


@pytest.mark.parametrize(
    ("path", "src", "dst", "expected"),
    [
        # auto: equal TP goes as page runs; between TP sizes token rows are gathered.
        ("auto", rank(), rank(ring=True), (DIRECT, PathReason.WHOLE_PAGES)),
        ("auto", rank(KVLayout.MLA, (0, 2)), rank(KVLayout.MLA), (DIRECT, PathReason.WHOLE_PAGES)),
        (
            "auto",
            rank(KVLayout.MHA, (1, 2)),
            rank(ring=True),
            (THROUGH_RING, PathReason.SHARED_ROWS),
        ),
        ("auto", rank(KVLayout.MHA, (1, 2)), rank(), (DIRECT, PathReason.NO_RING)),
        # One source fills decode's rows: page rows or the ring, by cost per chunk.
        ("auto", rank(), rank(tp=(1, 2), ring=True), (THROUGH_RING, PathReason.COST)),
        ("auto", rank(), rank(tp=(1, 2)), (PAGE_ROWS, PathReason.NO_RING)),
        (
            "auto",
            rank(KVLayout.MHA_HEAD_MAJOR),
            rank(KVLayout.MHA_HEAD_MAJOR, (1, 2), ring=True),
            (DIRECT, PathReason.LAYOUT),
        ),
        (
            "auto",
            rank(layers=(0, 1)),
            rank(layers=(0,), tp=(1, 2), ring=True),
            (DIRECT, PathReason.LAYERS_DIFFER),
        ),
        # TP 4 → 2: decode rank 1's heads are prefill ranks 2 and 3's, none of rank 0's.
        ("auto", rank(tp=(0, 4)), rank(tp=(1, 2), ring=True), (DIRECT, PathReason.NO_HEADS)),
        # coalesced: through decode's ring wherever token rows allow, equal TP included.
        ("coalesced", rank(), rank(ring=True), (THROUGH_RING, PathReason.CONFIGURED)),
        (
            "coalesced",
            rank(KVLayout.MLA),
            rank(KVLayout.MLA, ring=True),
            (THROUGH_RING, PathReason.CONFIGURED),
        ),
        (
            "coalesced",
            rank(page_size=64),
            rank(tp=(1, 2), page_size=64, ring=True),
            (THROUGH_RING, PathReason.CONFIGURED),
        ),
        ("coalesced", rank(), rank(), (DIRECT, PathReason.NO_RING)),
        (
            "coalesced",
            rank(KVLayout.MHA_HEAD_MAJOR),
            rank(KVLayout.MHA_HEAD_MAJOR, ring=True),
            (THROUGH_RING, PathReason.CONFIGURED),
        ),
        (  # head slices of head-major pages are not token rows: never gathered
            "coalesced",
            rank(KVLayout.MHA_HEAD_MAJOR),
            rank(KVLayout.MHA_HEAD_MAJOR, (1, 2), ring=True),
            (DIRECT, PathReason.LAYOUT),
        ),
        # direct: never gathered, even where only a ring puts the heads together.
        ("direct", rank(KVLayout.MHA, (1, 2)), rank(ring=True), (DIRECT, PathReason.CONFIGURED)),
    ],
)
def test_a_pairings_path_and_its_reason(
    path: str, src: KVArgs, dst: KVArgs, expected: tuple[WritePath, PathReason]
) -> None:
    pairing = pair(src, dst, path)
    assert (pairing.path, pairing.reason) == expected
    assert pairing.through_ring == (pairing.path == THROUGH_RING)
    assert pairing.rows_or_ring == (expected[1] == PathReason.COST)
    either = "direct or ring" if pairing.coalescible else "page_rows or ring"
    assert pairing.choice == (
        either if pairing.coalescible or pairing.rows_or_ring else expected[0].value
    )


@pytest.mark.parametrize("layout", [KVLayout.MHA_HEAD_MAJOR, KVLayout.PAGES])
def test_whole_rows_of_other_layouts_go_through_the_ring_only_to_a_decode_that_scatters_them(
    layout: KVLayout,
) -> None:
    """An older decode scatters a staged chunk by its heads' columns: half of a head-major
    page's row. Prefill sends it such pages as page runs."""
    src, dst = rank(layout, page_size=1), rank(layout, page_size=1, ring=True)
    assert pair(src, dst, "auto").coalescible
    assert not pair(src, dst, "auto", whole_rows=False).coalescible
    old = pair(src, dst, "coalesced", whole_rows=False)
    assert (old.path, old.reason) == (DIRECT, PathReason.OLD_DECODE)
