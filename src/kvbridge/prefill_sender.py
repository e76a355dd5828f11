"""`KVSender`: one room on the prefill side. The scheduler hands it each chunk of pages (or
layer range of one) as the forward computes it, and polls the room's state; the
`PrefillManager` behind it does the rest."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvbridge.core.room import SKIPPED_PAGE, Chunk, Gate
from kvbridge.wire import FailureKind, KVPoll

if TYPE_CHECKING:
    from kvbridge.prefill import PrefillManager


class KVSender:
    """One room on the prefill side: hand it pages as they are computed, poll its state."""

    def __init__(self, manager: PrefillManager, room: int) -> None:
        self.manager = manager
        self.room = room
        if manager.open_room(room) is None:
            raise ValueError(f"room {room} already ended on this prefill rank")

    def send(
        self,
        kv_pages: npt.ArrayLike,
        *,
        last: bool = False,
        aux_index: int | None = None,
        state_indices: Sequence[int] = (),
        layers: range | None = None,
        gate: Gate | None = None,
        positional: bool = False,
        position: int | None = None,
    ) -> None:
        """Queue the next chunk of this room's pages (after the last one queued, unless it
        names its `position`); `last` ends the room and
        carries the aux slot and the state slots. A page index -1 (`SKIPPED_PAGE`) is a
        position this rank does not hold (a sliding window dropped it): nothing is written
        there, and the room fails (incompatible) if decode needs that position.
        `positional`: the pages pair with decode's page for page, not by tokens (several
        page lists laid end to end, such as a model's KV cache groups): a decode rank whose
        pages hold another number of tokens fails the room rather than shift the lists.
        `position` (positional then): where the chunk's first page goes among the room's
        positions, for a chunk sent out of order (one list streamed during the forward, the
        others after it); None: after the furthest page queued. Each position goes once, and
        none is left out by the last chunk (ValueError otherwise).

        Layer-wise: `layers` (positions in `KVArgs.layer_ids`, a step-1 range) sends only
        those layers of the pages, written while the forward computes the next ones; a
        chunk's ranges follow one another from layer 0 to the last on the same pages, and
        `last` goes with the last chunk's last range. ValueError for a send out of order.

        `gate`: the chunk's data is not computed yet; its writes are set up now and go once
        `gate.open()` is called (`kvbridge.write_gate`): hand a forward's layers over before
        it starts, open each gate as its layer is done, and only the copy is left after it."""
        pages = np.asarray(kv_pages, dtype=np.int64).ravel()
        if pages.size and pages.min() < SKIPPED_PAGE:
            raise ValueError(f"page index {pages.min()} (only -1 marks a page not held)")
        if layers is not None and (layers.step != 1 or not layers):
            raise ValueError(f"layers must be a non-empty step-1 range, got {layers}")
        if position is not None:
            position = page_position(position)
        span = None if layers is None else (layers.start, layers.stop)
        chunk = Chunk(
            pages,
            last,
            aux_index,
            tuple(state_indices),
            span,
            gate,
            positional or position is not None,
            position,
        )
        self.manager.queue_chunk(self.room, chunk)

    # A status's failure kind and reason are set before its state reads Failed: the reads
    # below need no lock.
    def poll(self) -> KVPoll:
        status = self.manager.room_status(self.room)
        return status.poll if status is not None else KVPoll.Failed

    @property
    def failure_reason(self) -> str | None:
        status = self.manager.room_status(self.room)
        return status.failure_reason if status is not None else "room cleared"

    @property
    def failure_kind(self) -> FailureKind | None:
        """Why the room failed, as a kind; None unless it failed."""
        status = self.manager.room_status(self.room)
        return status.failure_kind if status is not None else FailureKind.UNKNOWN

    @property
    def pages_safe(self) -> bool:
        """Whether the room's pages can go back to the allocator: the room ended and no write
        of it is in flight (an engine may read them until then)."""
        return self.manager.pages_safe(self.room)

    @property
    def asked(self) -> bool:
        """Whether a decode request for the room arrived (a room that failed unasked expired:
        no decode claimed its pages in time)."""
        state = self.manager.protocol.rooms.get(self.room)  # a dict read: no lock needed
        return state is not None and bool(state.requests)

    def abort(self, reason: str) -> None:
        self.manager.abort_room(self.room, reason)

    def clear(self) -> None:
        self.manager.clear_room(self.room)


def page_position(position: int) -> int:
    """A chunk's position as an int; ValueError for anything but a whole number ≥ 0."""
    try:
        at = operator.index(position)  # (a float or a string from a caller without types)
    except TypeError:
        at = -1
    if at < 0:
        raise ValueError(f"a chunk's position is a page position (an int ≥ 0), not {position!r}")
    return at
