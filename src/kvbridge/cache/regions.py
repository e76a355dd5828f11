"""Registered memory and the bounds rule: every block of a write lies inside memory that its
side registered, checked for a whole plan at once before an engine is called."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbridge.wire.messages import MemoryKind


@dataclass(frozen=True)
class MemoryRegion:
    ptr: int
    length: int
    memory_kind: MemoryKind = MemoryKind.DRAM
    device_id: int = 0

    @property
    def end(self) -> int:
        return self.ptr + self.length


class RegionMap:
    """Sorted, merged registered ranges for vectorized containment checks."""

    def __init__(self, regions: Iterable[MemoryRegion] = ()) -> None:
        self._regions: list[MemoryRegion] = []
        self._starts = np.empty(0, np.uint64)
        self._ends = np.empty(0, np.uint64)
        self.add(regions)

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        return tuple(self._regions)

    def add(self, regions: Iterable[MemoryRegion]) -> None:
        self._regions.extend(regions)
        self._rebuild()

    def remove(self, regions: Iterable[MemoryRegion]) -> None:
        gone = set(regions)
        self._regions = [region for region in self._regions if region not in gone]
        self._rebuild()

    def _rebuild(self) -> None:
        by_start = sorted(self._regions, key=lambda region: region.ptr)
        self._region_starts = np.array([r.ptr for r in by_start], dtype=np.uint64).reshape(-1)
        self._region_devices = np.array([r.device_id for r in by_start], dtype=np.uint64)
        spans = sorted((region.ptr, region.end) for region in self._regions)
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        # A first, empty span at 0 (it holds no block): every address then falls after some
        # span's start, and the check below needs no case for "before every region".
        self._starts = np.array([0] + [span[0] for span in merged], dtype=np.uint64)
        self._ends = np.array([0] + [span[1] for span in merged], dtype=np.uint64)
        devices = {region.device_id for region in self._regions}
        self.uniform_device: int | None = devices.pop() if len(devices) == 1 else None

    def outside(
        self, addresses: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64]
    ) -> npt.NDArray[np.intp]:
        """Indices of blocks not wholly inside one registered range."""
        # Checked for every write: few numpy calls on the whole plan. The end of the span
        # that starts at or before each block; `ends - addresses` may wrap where the block
        # starts past that end, which the first test already refuses (no addition that could
        # overflow 2**64).
        ends = self._ends[np.searchsorted(self._starts, addresses, side="right") - 1]
        return np.flatnonzero((addresses >= ends) | (lengths > ends - addresses))

    def device_ids(self, addresses: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        """The device id of the registered region that holds each address (the GPU of a VRAM
        region, 0 for DRAM); check `outside` first: an address in no region gets its
        neighbour's."""
        if not self._regions:
            return np.zeros(addresses.size, np.uint64)
        slot = np.searchsorted(self._region_starts, addresses, side="right").astype(np.intp) - 1
        return self._region_devices[np.maximum(slot, 0)]
