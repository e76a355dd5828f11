"""Registered memory: the bounds rule over a whole plan, and each block's device."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.cache.regions import MemoryRegion, RegionMap
from kvbridge.wire import MemoryKind


def test_blocks_outside_registered_memory_are_found_at_once() -> None:
    regions = RegionMap([MemoryRegion(1000, 100), MemoryRegion(1100, 50), MemoryRegion(5000, 10)])
    addresses = np.array([1000, 1140, 1149, 5000, 999, 2**64 - 1], dtype=np.uint64)
    lengths = np.array([150, 10, 2, 10, 1, 1], dtype=np.uint64)
    # Adjacent regions merge; a block may not run past the end or start before the start.
    assert regions.outside(addresses, lengths).tolist() == [2, 4, 5]
    assert RegionMap().outside(addresses[:2], lengths[:2]).tolist() == [0, 1]


TOP = 2**64 - 1
# Addresses near 0, in a small window (so that blocks meet regions often), and near 2**64.
address = st.one_of(st.integers(0, 64), st.integers(900, 1300), st.integers(TOP - 64, TOP))
region = st.builds(MemoryRegion, address, st.integers(0, 200)).filter(lambda r: r.end <= TOP)


@settings(max_examples=300, deadline=None)
@given(st.lists(region, max_size=5), st.lists(st.tuples(address, st.integers(0, 300)), max_size=8))
def test_the_bounds_rule_matches_its_definition(
    regions: list[MemoryRegion], blocks: list[tuple[int, int]]
) -> None:
    """A block is inside when its bytes lie in registered memory with no gap (regions that
    touch or overlap count as one span); found for a whole plan at once, without wrapping
    past 2**64."""
    spans: list[list[int]] = []
    for start, end in sorted((r.ptr, r.end) for r in regions):
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    expected = [
        index
        for index, (start, length) in enumerate(blocks)
        if not any(low <= start < high and start + length <= high for low, high in spans)
    ]
    addresses = np.array([start for start, _ in blocks], dtype=np.uint64)
    lengths = np.array([length for _, length in blocks], dtype=np.uint64)
    assert RegionMap(regions).outside(addresses, lengths).tolist() == expected


def test_each_block_carries_the_device_of_its_region() -> None:
    vram = MemoryKind.VRAM
    regions = RegionMap(
        [
            MemoryRegion(9000, 100, vram, 3),
            MemoryRegion(1000, 100, vram, 1),
            MemoryRegion(1100, 100, vram, 2),
        ]
    )
    addresses = np.array([1000, 1099, 1100, 1199, 9050], dtype=np.uint64)
    assert regions.device_ids(addresses).tolist() == [1, 1, 2, 2, 3]
    assert regions.uniform_device is None  # several devices: each block is looked up
    regions.remove([MemoryRegion(1100, 100, vram, 2)])
    assert regions.device_ids(np.array([9000], dtype=np.uint64)).tolist() == [3]
    assert RegionMap().device_ids(np.array([5], dtype=np.uint64)).tolist() == [0]
    assert (
        RegionMap([MemoryRegion(0, 8, vram, 5), MemoryRegion(64, 8, vram, 5)]).uniform_device == 5
    )
