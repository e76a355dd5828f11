"""Where a room's chunks go among its page positions: one after another, or, for a chunk that
names its position (one page list streamed during the forward, the lists around it after),
out of order — each position once, and none left out by the time the last chunk is queued.
Pure: checked as each chunk is queued, so that a mistake is the sender's error, not stale
KV on decode."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PagePlacement:
    """The page positions a room's queued chunks cover."""

    end: int = 0  # past the furthest position queued
    covered: int = 0  # positions queued
    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, stop) of each chunk

    def place(self, room: int, position: int | None, size: int, last: bool) -> None:
        """Queue a chunk of `size` pages at `position` (None: after the furthest so far);
        `last`: the room's last. ValueError, nothing queued, if a position was queued
        before, or if the last chunk leaves a position before the furthest one unsent
        (decode would find what its pages held before)."""
        at = self.end if position is None else position
        stop = at + size
        if position is not None and size:
            clash = next(((a, b) for a, b in self.spans if at < b and a < stop), None)
            if clash is not None:
                raise ValueError(
                    f"room {room}: pages for positions {at}..{stop - 1} sent, but positions "
                    f"{clash[0]}..{clash[1] - 1} were sent before"
                )
        spans = [*self.spans, (at, stop)] if size else self.spans
        covered, end = self.covered + size, max(self.end, stop)
        if last and covered != end:
            reached = 0
            for start, span_stop in sorted(spans):
                if start > reached:
                    break
                reached = max(reached, span_stop)
            raise ValueError(
                f"room {room}: the last chunk sent, but no chunk sent the pages for position "
                f"{reached} (of {end} positions)"
            )
        self.spans, self.covered, self.end = spans, covered, end
