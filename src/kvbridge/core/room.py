"""What both sides' rooms are made of, pure: no sockets, no threads, no engine.

A room's `KVPoll` status only moves forward (Bootstrapping → WaitingForInput → Transferring →
Success), Failed is sticky and carries a reason (`Failure`). Prefill's view of a room is
`prefill_room.PrefillRoom` (with its lifecycle), decode's `decode_room.DecodeRoom`; the chunks
prefill sends, the write jobs made of them and decode's page lists for them are here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvbridge.wire.messages import FailureKind, KVPoll
from kvbridge.wire.native import TransferRequest

# A decode page index of -1 in a request: decode needs nothing at that position of the
# room's pages (it has those tokens, or its window dropped them), so prefill writes none of
# it.
SKIPPED_PAGE = -1

_ORDER = {
    KVPoll.Bootstrapping: 1,
    KVPoll.WaitingForInput: 2,
    KVPoll.Transferring: 3,
    KVPoll.Success: 4,
}


@dataclass(frozen=True)
class Failure:
    """Why something failed: a kind to count and act on, and the detail for people."""

    kind: FailureKind
    reason: str


@dataclass
class RoomStatus:
    """A room's KVPoll state: monotone, with Failed sticky and Success final."""

    poll: KVPoll = KVPoll.Bootstrapping
    failure_reason: str | None = None
    failure_kind: FailureKind | None = None

    @property
    def finished(self) -> bool:
        return self.poll in (KVPoll.Success, KVPoll.Failed)

    def advance(self, to: KVPoll) -> bool:
        """Move forward to `to`; a step backwards or out of a finished state is ignored."""
        if to == KVPoll.Failed:
            raise ValueError("use fail() to fail a room: a failure needs a reason")
        if self.finished or _ORDER[to] <= _ORDER[self.poll]:
            return False
        self.poll = to
        return True

    def fail(self, kind: FailureKind, reason: str) -> bool:
        """Fail the room with a kind and a reason; a finished room stays as it is."""
        if self.finished:
            return False
        # The kind and reason first: whoever reads Failed without a lock finds them set.
        self.failure_kind = kind
        self.failure_reason = reason
        self.poll = KVPoll.Failed
        return True

    @property
    def outcome(self) -> tuple[str, str]:
        """(state, failure kind) as metrics count a cleared room; the kind is "" unless it
        failed."""
        kind = self.failure_kind or FailureKind.UNKNOWN
        return self.poll.name, str(kind) if self.poll == KVPoll.Failed else ""


class Gate(Protocol):
    """What holds a chunk's writes back until its data is computed (`kvbridge.WriteGate`):
    the writes are planned and set up at once and posted when it opens. Opaque to the core,
    which hands the writes out as any other; the write pipeline waits on it."""

    @property
    def is_open(self) -> bool: ...

    def when_open(self, callback: Callable[[], None]) -> None: ...


@dataclass(frozen=True)
class Chunk:
    """A piece of a room's KV cache that prefill has computed, or (with a `gate`) will have
    computed when the gate opens, and wants sent: its pages, of every layer or (a layer-wise
    write) of the layers at positions `layers[0]..layers[1] - 1` only."""

    src_pages: npt.NDArray[np.int64]
    last: bool
    aux_index: int | None = None
    state_indices: tuple[int, ...] = ()
    layers: tuple[int, int] | None = None
    gate: Gate | None = None
    # Its pages pair with decode's by position (several page lists laid end to end).
    positional: bool = False
    # Where its first page goes among the room's positions; None: right after the chunk
    # before. A chunk sent out of order: one page list streams during the forward, the
    # lists before and after it go once it ended.
    position: int | None = None


def split_chunk(chunk: Chunk, max_pages: int) -> list[Chunk]:
    """The chunk as pieces of at most `max_pages` pages, in order, each a chunk of its own
    (the last piece is the chunk's last, with its aux and state): what a staging buffer can
    gather in one go. A layer range or a gated chunk stays whole (its data is not computed
    when it is handed out: never gathered)."""
    pages = chunk.src_pages
    if chunk.layers is not None or chunk.gate is not None or pages.size <= max_pages:
        return [chunk]
    pieces = []
    for start in range(0, pages.size, max_pages):
        final = start + max_pages >= pages.size
        pieces.append(
            replace(
                chunk,
                src_pages=pages[start : start + max_pages],
                last=chunk.last and final,
                aux_index=chunk.aux_index if final else None,
                state_indices=chunk.state_indices if final else (),
                position=None if chunk.position is None else chunk.position + start,
            )
        )
    return pieces


@dataclass(frozen=True)
class ChunkJob:
    """What to write for one chunk (or one layer range of it) to one decode rank: the chunk's
    local pages that decode needs, the place of the first among decode's pages, and all of
    the decode rank's pages for the room (the planner maps tokens, which may differ in page
    size, heads and DCP layout). `chunk_idx` numbers the room's jobs toward the decode rank
    (a chunk handed over layer by layer makes one job per range)."""

    room: int
    peer_id: str
    chunk_idx: int
    src_pages: npt.NDArray[np.int64]
    page_offset: int
    dst_pages: npt.NDArray[np.int32]
    last: bool
    src_aux_index: int | None
    dst_aux_index: int | None
    src_state_indices: tuple[int, ...]
    dst_state_indices: tuple[int, ...]
    layers: tuple[int, int] | None = None  # the layer positions it writes; None: every one
    gate: Gate | None = None  # its chunk's: posted once it opens


@dataclass(frozen=True)
class Destination:
    """Where one decode rank's request puts the room's pages: the positions after its
    prefix go, in order, to decode's pages `positions` (SKIPPED_PAGE: nowhere). Writes name
    decode's pages by their place in `pages`, the positions that go somewhere, so that a
    chunk's pages stay one run on both sides. `aligned`: a position is one page on both
    sides (pages of one size, no DCP)."""

    positions: npt.NDArray[np.int32]
    pages: npt.NDArray[np.int32]
    # Per position, how many before it go somewhere (one more entry: all of them).
    kept_before: npt.NDArray[np.int64]
    aligned: bool

    @staticmethod
    def of(request: TransferRequest, aligned: bool) -> Destination:
        positions = np.asarray(request.dst_kv_indices, dtype=np.int32)
        kept = positions != SKIPPED_PAGE
        before = np.concatenate(([0], np.cumsum(kept, dtype=np.int64)))
        return Destination(positions, positions[kept], before, aligned)

    @property
    def has_gaps(self) -> bool:
        return self.pages.size != self.positions.size

    def place(self, start: int, count: int) -> tuple[npt.NDArray[np.bool_], int]:
        """For `count` pages from position `start`: which go somewhere (positions past
        decode's list go nowhere), and the place of the first of them in `pages`."""
        end = min(start + count, self.positions.size)
        kept = np.zeros(count, dtype=bool)
        if end > start:
            kept[: end - start] = self.positions[start:end] != SKIPPED_PAGE
        return kept, int(self.kept_before[min(start, self.positions.size)])

    def pair(
        self, start: int, src_pages: npt.NDArray[np.int64], positional: bool = False
    ) -> tuple[npt.NDArray[np.int64], int]:
        """A chunk's pages from position `start` that go somewhere, and the place of the
        first of them in `pages`. A source page may be SKIPPED_PAGE, a position the prefill
        rank does not hold (a sliding window dropped its block): only where decode needs
        nothing, else `Unpaired`. `positional`: the chunk's pages pair with decode's by
        position, not by tokens (several page lists laid end to end), which, as pages not
        held, needs pages of one size on both sides and no DCP."""
        held = src_pages != SKIPPED_PAGE
        if (positional or not held.all()) and not self.aligned:
            what = (
                "pages that pair with decode's page for page (several page lists laid end to end)"
                if positional
                else "pages this prefill rank does not hold (page index -1)"
            )
            raise Unpaired(f"{what} need pages of one size on both sides and no DCP")
        if not self.has_gaps and held.all():
            return src_pages, start
        kept, first = self.place(start, src_pages.size)
        needed = np.flatnonzero(kept & ~held)
        if needed.size:
            raise Unpaired(
                f"decode needs the page at position {start + int(needed[0])} of its pages, "
                "which this prefill rank does not hold (page index -1: its sliding window "
                "dropped it?)"
            )
        return src_pages[kept], first


class Unpaired(ValueError):
    """Decode needs a page the prefill rank cannot pair with it (one it does not hold, or
    pages of another size where pages pair by position): the room cannot be written."""
