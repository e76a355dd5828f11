"""Registered memory: the bounds rule over a whole plan, and each block's device."""

from __future__ import annotations

import numpy as np

from kvbridge.cache.regions import MemoryRegion, RegionMap
from kvbridge.wire import MemoryKind


def test_blocks_outside_registered_memory_are_found_at_once() -> None:
    regions = RegionMap([MemoryRegion(1000, 100), MemoryRegion(1100, 50), MemoryRegion(5000, 10)])
    addresses = np.array([1000, 1140, 1149, 5000, 999, 2**64 - 1], dtype=np.uint64)
    lengths = np.array([150, 10, 2, 10, 1, 1], dtype=np.uint64)
    # Adjacent regions merge; a block may not run past the end or start before the start.
    assert regions.outside(addresses, lengths).tolist() == [2, 4, 5]
    assert RegionMap().outside(addresses[:2], lengths[:2]).tolist() == [0, 1]


def test_each_block_carries_the_device_of_its_region() -> None:
    vram = MemoryKind.VRAM
    regions = RegionMap(
        [MemoryRegion(9000, 100, vram, 3), MemoryRegion(1000, 100, vram, 1),
         MemoryRegion(1100, 100, vram, 2)]
    )  # fmt: skip
    addresses = np.array([1000, 1099, 1100, 1199, 9050], dtype=np.uint64)
    assert regions.device_ids(addresses).tolist() == [1, 1, 2, 2, 3]
    regions.remove([MemoryRegion(1100, 100, vram, 2)])
    assert regions.device_ids(np.array([9000], dtype=np.uint64)).tolist() == [3]
    assert RegionMap().device_ids(np.array([5], dtype=np.uint64)).tolist() == [0]
