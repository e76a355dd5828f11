"""Decode's staging ring, pure: ring space granted to prefill ranks for their staged chunks
(or the answer that a chunk can never fit), requests queued while the ring is full, the
scatter of each chunk that landed, and space reclaimed from writers that can no longer write.
`DecodeProtocol` dispatches the ring's messages here."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from kvbridge.core.decode_events import (
    Action,
    ChunkScattered,
    DecodeSettings,
    DecodeStats,
    ScatterChunk,
)
from kvbridge.core.decode_room import DecodeRoom
from kvbridge.core.protocol import RoomsChanged, Send
from kvbridge.staging.ring import Allocation, StagingRing
from kvbridge.wire import (
    STAGING_NEVER_FITS,
    ChunkReady,
    FailureKind,
    StagingRequest,
    StagingResponse,
)

log = logging.getLogger("kvbridge.decode")


class DecodeRing:
    """The ring of one decode rank (`ring` None: it has none, and every chunk is sent token by
    token). `registered`: the prefill endpoints this rank registered with; `rooms`: its rooms
    (both the protocol's own, shared)."""

    def __init__(
        self,
        settings: DecodeSettings,
        stats: DecodeStats,
        registered: set[str],
        rooms: dict[int, DecodeRoom],
        ignore: Callable[..., list[Any]],
    ) -> None:
        self.settings = settings
        self.stats = stats
        self.registered = registered
        self.rooms = rooms
        self._ignore = ignore
        self.ring = StagingRing(settings.staging_bytes) if settings.staging_bytes else None
        self._staged: dict[tuple[int, int, int], Allocation] = {}  # (rank, room, chunk)
        self._waiting: deque[StagingRequest] = deque()  # no ring space yet

    def on_staging_request(self, request: StagingRequest, now: float) -> list[Action]:
        """Grant ring space for a chunk, queue the request while the ring is full, or answer
        that it can never fit (prefill then sends that chunk token by token)."""
        if request.session_id not in self.registered:
            return self._ignore("StagingRequest from unknown prefill %s", request.session_id)
        if self.ring is None or not self.ring.fits_ever(request.nbytes):
            return [self._answer(request, None)]
        allocation = self.ring.allocate(request.nbytes)
        if allocation is None:
            self._waiting.append(request)
            return []
        self._staged[(request.prefill_rank, request.room, request.chunk_idx)] = allocation
        return [self._answer(request, allocation)]

    def _answer(self, request: StagingRequest, allocation: Allocation | None) -> Send:
        response = StagingResponse(
            room=request.room,
            chunk_idx=request.chunk_idx,
            offset=allocation.offset if allocation else STAGING_NEVER_FITS,
            round=allocation.round if allocation else 0,
            end=allocation.end if allocation else 0,
            session_id=self.settings.peer_id,
        )
        return Send(request.session_id, response)

    def on_chunk_ready(self, ready: ChunkReady, now: float) -> list[Action]:
        """A staged chunk landed: scatter it (elsewhere, so that ring requests keep being
        answered), holding the room's success until it is in the pages."""
        if ready.session_id not in self.registered:
            return self._ignore("ChunkReady from unknown prefill %s", ready.session_id)
        allocation = self._staged.pop((ready.prefill_rank, ready.room, ready.chunk_idx), None)
        if allocation is None:
            self.stats.unexpected_chunks += 1
            self.stats.ignored += 1
            log.warning(
                "chunk %d of room %d from prefill rank %d has no ring space here",
                ready.chunk_idx,
                ready.room,
                ready.prefill_rank,
            )
            return []
        state = self.rooms.get(ready.room)
        source = state.sources.get(ready.prefill_rank) if state is not None else None
        if state is None or source is None or state.status.finished:
            return self._free_ring(ready, allocation)  # nothing to scatter it into
        state.chunk_arrived()
        return [ScatterChunk(ready, allocation, state.dst_pages, source)]

    def scatter_wanted(self, room: int) -> bool:
        """Whether a staged chunk of the room should still go into its pages (a room that
        ended meanwhile takes none: its pages may be about to go back)."""
        state = self.rooms.get(room)
        return state is not None and not state.status.finished

    def on_chunk_scattered(self, done: ChunkScattered, now: float) -> list[Action]:
        state = self.rooms.get(done.ready.room)
        if state is not None:  # its chunk_arrived() was counted when the scatter was asked for
            if done.failed:
                reason = f"room {state.room}: scatter of a staged chunk failed"
                state.status.fail(FailureKind.INTERNAL, reason)
            state.chunk_scattered()
        return self._free_ring(done.ready, done.allocation)

    def _free_ring(self, ready: ChunkReady, allocation: Allocation) -> list[Action]:
        """Free a chunk's ring space and grant it to requests waiting for space. (No
        `Watermark` goes back: this rank grants space explicitly, so a prefill rank never
        needs to know the ring's tail; sglang's own decode sends one.)"""
        assert self.ring is not None
        self.ring.free(allocation)
        actions: list[Action] = [RoomsChanged()]
        while self._waiting:
            granted = self.ring.allocate(self._waiting[0].nbytes)
            if granted is None:
                break
            waiting = self._waiting.popleft()
            self._staged[(waiting.prefill_rank, waiting.room, waiting.chunk_idx)] = granted
            actions.append(self._answer(waiting, granted))
        return actions

    def reclaim(self, writers: set[tuple[int, int]]) -> None:
        """Free ring space granted for chunks that will never arrive: those of the (prefill
        rank, room) pairs in `writers`, which can no longer write them."""
        if self.ring is None:
            return
        stale = [key for key in self._staged if (key[0], key[1]) in writers]
        for key in stale:
            self.ring.free(self._staged.pop(key))
        # Requests still waiting for space would be granted to a writer that is gone.
        waiting = len(self._waiting)
        self._waiting = deque(
            request
            for request in self._waiting
            if (request.prefill_rank, request.room) not in writers
        )
        if stale or waiting != len(self._waiting):
            log.info(
                "reclaimed ring space of %d chunk(s) that will not arrive, dropped %d "
                "waiting request(s)",
                len(stale),
                waiting - len(self._waiting),
            )
