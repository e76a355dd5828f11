"""The staging ring allocator, pure: decode owns a ring of bytes that prefill writes staged
chunks into; decode frees each chunk once it has scattered it into its pages.

Positions are virtual byte offsets that only grow; the physical offset is the virtual one
modulo the ring size, and the round is how many times the ring was wrapped. An allocation
never straddles the end of the ring (it skips to the start of the next round), and it is
granted only if it ends within one ring size of the oldest region not yet freed: a writer can
therefore never overwrite bytes that decode has not scattered yet. Frees may come out of
order; the tail (the watermark) advances over every freed region at the front.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Allocation:
    """A region of the ring: physical `offset` and `end`, and the `round` it belongs to."""

    start: int  # virtual position
    size: int
    ring_size: int

    @property
    def offset(self) -> int:
        return self.start % self.ring_size

    @property
    def end(self) -> int:
        return self.offset + self.size

    @property
    def round(self) -> int:
        return self.start // self.ring_size


class RingError(ValueError):
    """A request the ring can never satisfy, or a free of something it never gave out."""


class StagingRing:
    def __init__(self, ring_size: int, alignment: int = 64) -> None:
        if ring_size <= 0 or alignment <= 0 or ring_size % alignment:
            raise RingError(f"ring size {ring_size} must be a positive multiple of {alignment}")
        self.ring_size = ring_size
        self.alignment = alignment
        self._head = 0  # next free virtual position
        self._tail = 0  # oldest virtual position still in use
        self._live: deque[list[int]] = deque()  # [start, end, freed] in allocation order

    def fits_ever(self, size: int) -> bool:
        return 0 < size <= self.ring_size

    def allocate(self, size: int) -> Allocation | None:
        """A region of `size` bytes, or None while the ring is too full (retry after a free).
        `RingError` if it can never fit."""
        if not self.fits_ever(size):
            raise RingError(f"{size} bytes can never fit a ring of {self.ring_size}")
        padded = -(-size // self.alignment) * self.alignment
        start = self._head
        if start % self.ring_size + padded > self.ring_size:
            start = (start // self.ring_size + 1) * self.ring_size  # wrap to the next round
        if not self._live:
            self._tail = start  # an empty ring is free everywhere, skipped padding included
        if start + padded - self._tail > self.ring_size:
            return None
        self._live.append([start, start + padded, 0])
        self._head = start + padded
        return Allocation(start, size, self.ring_size)

    def free(self, allocation: Allocation) -> None:
        for region in self._live:
            if region[0] == allocation.start:
                if region[2]:
                    raise RingError(f"region at {allocation.start} freed twice")
                region[2] = 1
                break
        else:
            raise RingError(f"no live region at {allocation.start}")
        while self._live and self._live[0][2]:
            self._live.popleft()
        self._tail = self._live[0][0] if self._live else self._head

    @property
    def watermark(self) -> tuple[int, int]:
        """(round, physical offset) of the tail: everything before it is free again."""
        return self._tail // self.ring_size, self._tail % self.ring_size

    @property
    def in_use(self) -> int:
        """Bytes between the tail and the head (padding included)."""
        return self._head - self._tail
