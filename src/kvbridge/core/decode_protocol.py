"""Decode's protocol, pure: every rule of a decode rank, with no sockets, threads or clock reads.

`DecodeManager` feeds it events — a control message arrived, the scheduler opened, aborted or
cleared a room, a staged chunk was scattered, a tick (with the engine's notifications) — each
with the time, and executes the actions it returns, in order: send a message, scatter a
staged chunk, forget a prefill rank's bootstrap group, wake whoever waits on rooms. Every room
rule lives here: when a room succeeds or fails, when its pages are safe (no prefill rank can
still write into them), who is asked to abort, who gets ring space and when it is reclaimed.
Dispatch is one table keyed by event type, wire messages included.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbridge.cache.topology import Source
from kvbridge.core.decode_room import DecodeRoom
from kvbridge.core.liveness import Liveness
from kvbridge.core.protocol import DueQueue, ProtocolCore, RankStats, RoomsChanged, Send, Tick
from kvbridge.core.room import RoomStatus
from kvbridge.staging.ring import Allocation, StagingRing
from kvbridge.wire import (
    STAGING_NEVER_FITS,
    Abort,
    AbortAck,
    ChunkReady,
    FailureKind,
    Heartbeat,
    KVPoll,
    Registration,
    RoomLease,
    StagingRequest,
    StagingResponse,
    TransferRequest,
    TransferStatus,
)
from kvbridge.wire.address import tcp_endpoint
from kvbridge.wire.notifications import parse_notification

log = logging.getLogger("kvbridge.decode")
# Slack on top of a dead prefill rank's write lease before its rooms' pages count as safe:
# its last check of the lease and the write step after it, clock rates.
FENCE_MARGIN_S = 0.5
# How often a tick also looks at every room's deadline and every peer's silence; the ticks in
# between (every millisecond while rooms transfer) only take the engine's notifications.
SWEEP_INTERVAL_S = 0.01


# --- actions: what the manager executes ----------------------------------------------------


@dataclass(frozen=True)
class ScatterChunk:
    """Copy a staged chunk from the ring into the room's pages, then report `ChunkScattered`."""

    ready: ChunkReady
    allocation: Allocation
    dst_pages: npt.NDArray[np.int64]
    source: Source


@dataclass(frozen=True)
class ForgetPrefill:
    """A prefill rank was declared dead: drop every cached bootstrap group it was in (a
    restarted rank has a new endpoint, and the next room looks its group up again)."""

    endpoint: str


Action = Send | ScatterChunk | ForgetPrefill | RoomsChanged


# --- local events: what the scheduler, the scatter thread and the clock report -------------


@dataclass(frozen=True)
class Registering:
    """A receiver needs this prefill rank: register with it, once."""

    endpoint: str
    registration: Registration


@dataclass(frozen=True)
class RoomOpened:
    """`KVReceiver.init`: the room's state, and its requests by prefill control endpoint."""

    state: DecodeRoom
    requests: tuple[tuple[str, TransferRequest], ...]


@dataclass(frozen=True)
class LeasesRenewing:
    """Decode's scheduler still means to ask for these rooms of a prefill group (requests in
    its queue): renew their request deadlines on the group's ranks this rank talks to."""

    endpoints: tuple[str, ...]
    rooms: tuple[int, ...]


@dataclass(frozen=True)
class RoomAborted:
    """The scheduler gave up on a room (`status`: its receiver's); `endpoints`: where to send
    the abort if the room never reached `init` (no state here yet)."""

    room: int
    status: RoomStatus
    reason: str
    endpoints: tuple[str, ...]


@dataclass(frozen=True)
class RoomCleared:
    """The scheduler's one cleanup of a room: counted under its outcome and forgotten."""

    room: int
    status: RoomStatus


@dataclass(frozen=True)
class ChunkScattered:
    """A `ScatterChunk` ended (`failed`: it raised): its ring space is free again."""

    ready: ChunkReady
    allocation: Allocation
    failed: bool = False


@dataclass(frozen=True)
class Closing:
    """The rank is closing: rooms whose pages a prefill rank may still write into fail and
    their writers are asked to stop."""


@dataclass(frozen=True)
class DecodeSettings:
    """What the protocol needs to know about its rank and its configuration."""

    rank: int
    peer_id: str
    host: str  # this rank's control address, named in its aborts
    control_port: int
    session_token: bytes  # sent in registrations; prefill's statuses, acks and beats echo it
    heartbeat_interval_s: float
    peer_timeout_s: float  # also the write lease this rank grants, in its heartbeats
    # How long after its lease a writer that is hung, not dead, may still land a write: its
    # write timeout where the engine moves writes on its own threads, else nothing.
    write_grace_s: float = 0.0
    staging_bytes: int | None = None  # the ring's size; None: no ring

    @property
    def lease_ms(self) -> int:
        return int(self.peer_timeout_s * 1000)

    @property
    def endpoint(self) -> str:
        """This rank's control endpoint: who it is in its heartbeats."""
        return tcp_endpoint(self.host, self.control_port)


@dataclass
class DecodeStats(RankStats):
    unexpected_chunks: int = 0
    # Kept by the manager's scatter thread.
    scattered_chunks: int = 0
    scatter_s: float = 0.0


class DecodeProtocol(ProtocolCore):
    role = "decode"
    stats: DecodeStats

    def __init__(self, settings: DecodeSettings) -> None:
        self.settings = settings
        self.stats = DecodeStats()
        self.rooms: dict[int, DecodeRoom] = {}
        self.liveness = Liveness(settings.heartbeat_interval_s, settings.peer_timeout_s)
        self._registered: set[str] = set()  # prefill control endpoints
        self._heard_sequence: dict[str, int] = {}  # prefill endpoint → last heartbeat heard
        self._heartbeats = 0
        self.ring = StagingRing(settings.staging_bytes) if settings.staging_bytes else None
        self._staged: dict[tuple[int, int, int], Allocation] = {}  # (rank, room, chunk)
        self._waiting: deque[StagingRequest] = deque()  # no ring space yet
        # Ticks come every millisecond while rooms transfer (the engine's notifications);
        # deadlines and liveness, which look at every room and peer, only every sweep.
        self._next_sweep = 0.0
        self._transferring = False
        self._deadlines: DueQueue[int] = DueQueue()  # rooms by deadline
        super().__init__(
            {
                Heartbeat: self._on_heartbeat,
                AbortAck: self._on_abort_ack,
                TransferStatus: self._on_status,
                StagingRequest: self._on_staging_request,
                ChunkReady: self._on_chunk_ready,
                Registering: self._on_registering,
                RoomOpened: self._on_room_opened,
                RoomAborted: self._on_room_aborted,
                LeasesRenewing: self._on_leases_renewing,
                RoomCleared: self._on_room_cleared,
                ChunkScattered: self._on_chunk_scattered,
                Tick: self._on_tick,
                Closing: self._on_closing,
            }
        )

    # --- queries ---------------------------------------------------------------------------

    def registered(self, endpoint: str) -> bool:
        return endpoint in self._registered

    def pages_safe(self, room: int, now: float) -> bool | None:
        """Whether no prefill rank can still write into the room's pages; None: no state."""
        state = self.rooms.get(room)
        return state.pages_safe(now) if state is not None else None

    def unsafe_rooms(self, now: float) -> list[int]:
        return [room for room, state in self.rooms.items() if not state.pages_safe(now)]

    @property
    def busy(self) -> bool:
        """Whether a room is transferring (the control loop then polls the engine often): set
        when a room opens, looked at again every sweep."""
        return self._transferring

    # --- messages from prefill ranks -------------------------------------------------------

    def _on_heartbeat(self, message: Heartbeat, now: float) -> list[Action]:
        endpoint = message.sender_id
        if endpoint not in self._registered:  # only prefill ranks this rank registered with
            return self._ignore("heartbeat from unknown prefill %s", endpoint[:100])
        if message.session_token != self.settings.session_token:
            return self._ignore("heartbeat from %s without this rank's token", endpoint)
        if self.liveness.seen(endpoint, now):
            log.info("prefill %s is heard from again", endpoint)
        # Answered at once: the echo is what extends the prefill rank's write lease.
        self._heard_sequence[endpoint] = message.sequence
        pong = Heartbeat(
            self.settings.endpoint, self._heartbeats, self.settings.lease_ms, message.sequence
        )
        return [Send(endpoint, pong)]

    def _tokened(self, message: AbortAck | TransferStatus) -> bool:
        """Only the prefill rank asked to write a room can end it or confirm its drain."""
        if message.session_token == self.settings.session_token:
            return True
        self._ignore(
            "%s for room %d without this rank's token", type(message).__name__, message.room
        )
        return False

    def _on_abort_ack(self, message: AbortAck, now: float) -> list[Action]:
        if not self._tokened(message):
            return []
        state = self.rooms.get(message.room)
        if state is None:
            return self._ignore("abort ack for unknown room %d", message.room)
        state.on_abort_ack(message.prefill_rank)
        return [RoomsChanged()]

    def _on_status(self, message: TransferStatus, now: float) -> list[Action]:
        if not self._tokened(message):
            return []
        if message.status == KVPoll.Failed:
            # Prefill reports a failure only once nothing of the room is in flight: ring
            # space it was granted for chunks it never wrote is free again.
            self._reclaim({(message.prefill_rank, message.room)})
        state = self.rooms.get(message.room)
        if state is None:
            return self._ignore("status for unknown or cleared room %d", message.room)
        state.on_status(message.prefill_rank, message.status, message.reason, message.failure_kind)
        return [RoomsChanged()]

    # --- the staging ring ------------------------------------------------------------------

    def _on_staging_request(self, request: StagingRequest, now: float) -> list[Action]:
        """Grant ring space for a chunk, queue the request while the ring is full, or answer
        that it can never fit (prefill then sends that chunk token by token)."""
        if request.session_id not in self._registered:
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

    def _on_chunk_ready(self, ready: ChunkReady, now: float) -> list[Action]:
        """A staged chunk landed: scatter it (elsewhere, so that ring requests keep being
        answered), holding the room's success until it is in the pages."""
        if ready.session_id not in self._registered:
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

    def _on_chunk_scattered(self, done: ChunkScattered, now: float) -> list[Action]:
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

    def _reclaim(self, writers: set[tuple[int, int]]) -> None:
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

    # --- the scheduler's rooms -------------------------------------------------------------

    def _on_registering(self, event: Registering, now: float) -> list[Action]:
        if event.endpoint in self._registered:
            return []
        self._registered.add(event.endpoint)
        self.liveness.watch(event.endpoint, now)
        return [Send(event.endpoint, event.registration)]

    def _on_room_opened(self, event: RoomOpened, now: float) -> list[Action]:
        state = event.state
        state.status.advance(KVPoll.Transferring)
        self._transferring = True
        self.rooms[state.room] = state
        self._deadlines.push(state.deadline, state.room)
        self._deadlines.compact(
            len(self.rooms), lambda: ((room.deadline, room.room) for room in self.rooms.values())
        )
        self.stats.rooms_started += 1
        return [Send(endpoint, request) for endpoint, request in event.requests]

    def _on_leases_renewing(self, event: LeasesRenewing, now: float) -> list[Action]:
        lease = RoomLease(self.settings.endpoint, list(event.rooms))
        return [
            Send(endpoint, lease) for endpoint in event.endpoints if endpoint in self._registered
        ]

    def _on_room_aborted(self, event: RoomAborted, now: float) -> list[Action]:
        if not event.status.fail(FailureKind.ABORTED, f"aborted by decode: {event.reason}"):
            return []  # it had ended already
        state = self.rooms.get(event.room)
        if state is not None:
            return self._abort_unsettled(state, event.reason)
        # Before init(): the prefill ranks hear it now, not at their deadline.
        message = self._abort(event.room, event.reason)
        return [Send(endpoint, message) for endpoint in sorted(set(event.endpoints))]

    def _abort(self, room: int, reason: str) -> Abort:
        return Abort(room, self.settings.host, self.settings.control_port, reason)

    def _abort_unsettled(self, state: DecodeRoom, reason: str) -> list[Action]:
        """Ask every prefill rank that may still write into the room's pages to stop and
        confirm (its AbortAck settles it); the pages are safe once all have."""
        message = self._abort(state.room, reason)
        endpoints = {state.endpoints[rank] for rank in state.unsettled()}
        return [Send(endpoint, message) for endpoint in sorted(endpoints)]

    def _on_room_cleared(self, event: RoomCleared, now: float) -> list[Action]:
        if self.rooms.pop(event.room, None) is not None:
            status = event.status
            self.stats.count_finished(status)
            log.debug(
                "room %d: cleared (%s)", event.room, status.failure_reason or status.poll.name
            )
        return []

    # --- time --------------------------------------------------------------------------------

    def _on_tick(self, tick: Tick, now: float) -> list[Action]:
        changed = bool(tick.notifications)
        for message in tick.notifications:
            parsed = parse_notification(message)
            if parsed is None:
                continue
            room, prefill_rank, complete = parsed
            state = self.rooms.get(room)
            if state is not None:
                state.on_notification(prefill_rank, complete)
        if now < self._next_sweep:
            return [RoomsChanged()] if changed else []
        self._next_sweep = now + SWEEP_INTERVAL_S
        actions = self._check_liveness(now)
        for _, room in self._deadlines.pop_due(now):
            # The room now under that number (if any) checks its own deadline: one opened
            # again after a clear has its own entry, and a finished room does nothing.
            state = self.rooms.get(room)
            if state is not None and state.check_deadline(now):
                # Stop the ranks that may still write, and hear them.
                actions += self._abort_unsettled(state, state.status.failure_reason or "deadline")
                changed = True
        # Newest first: rooms end roughly in the order they opened, so a room still
        # transferring is usually found among the last opened, not after every ended one.
        self._transferring = any(
            state.status.poll == KVPoll.Transferring for state in reversed(self.rooms.values())
        )
        return [*actions, RoomsChanged()] if changed else actions

    def _check_liveness(self, now: float) -> list[Action]:
        """Heartbeats to every prefill rank registered with; rooms waiting on a prefill rank
        that fell silent fail with the reason."""
        actions: list[Action] = []
        settings = self.settings
        if self.liveness.heartbeat_due(now):
            self._heartbeats += 1
            for endpoint in self.liveness.peers:
                beat = Heartbeat(
                    settings.endpoint,
                    self._heartbeats,
                    settings.lease_ms,
                    self._heard_sequence.get(endpoint),
                )
                actions.append(Send(endpoint, beat))
        for endpoint, silent_s in self.liveness.expired(now):
            self.stats.peers_declared_dead += 1
            reason = self.liveness.silence(f"prefill {endpoint}", silent_s)
            # The last write lease this rank granted it started before it was last heard; a
            # rank that is only hung fences itself when that lease runs out (or, with an
            # engine that moves writes on its own threads, when its last write times out).
            fenced_at = now - silent_s + settings.lease_ms / 1000 + FENCE_MARGIN_S
            fenced_at += settings.write_grace_s
            affected = [state for state in self.rooms.values() if state.waits_on(endpoint)]
            dead: set[tuple[int, int]] = set()  # (prefill rank, room)
            for state in self.rooms.values():
                for rank, known in state.endpoints.items():
                    if known == endpoint:  # it writes no more: settled, failed if needed
                        state.on_rank_dead(rank, f"room {state.room}: {reason}", fenced_at)
                        dead.add((rank, state.room))
            self._reclaim(dead)
            self.liveness.forget(endpoint)
            self._heard_sequence.pop(endpoint, None)
            self._registered.discard(endpoint)
            actions.append(ForgetPrefill(endpoint))
            if affected:
                log.warning("%s: %d room(s) failed", reason, len(affected))
                actions.append(RoomsChanged())
        return actions

    def _on_closing(self, event: Closing, now: float) -> list[Action]:
        actions: list[Action] = []
        for room in self.unsafe_rooms(now):
            state = self.rooms[room]
            reason = f"room {room}: decode rank {self.settings.rank} is closing"
            state.status.fail(FailureKind.ABORTED, reason)
            actions += self._abort_unsettled(state, "decode rank closing")
        return actions
