"""Prefill's protocol, pure: every rule of a prefill rank, with no sockets, threads or clock reads.

`PrefillManager` feeds it events — a control message arrived, the scheduler opened a room,
queued a chunk, aborted or cleared a room, the engine connected to a peer or ended a write, a
tick — each with the time, and executes the actions it returns, in order: send a message,
connect the engine to a decode peer, write one job, wake whoever waits on rooms.

The rules that live here: which decode peers are admitted (caps, duplicates, pairing), which
rooms a request may create, which writes go out when (several per decode peer, up to
`writes_in_flight`; the oldest room first, so that rooms toward one peer complete in the order
they arrived instead of all together at the end), the staging flow (gather a chunk's head
slices into this rank's staging buffer, then write them straight into decode's pages when this
rank alone holds the decode rank's heads and those pages are big enough blocks
(`Pairing.direct`), else into ring space decode grants; per-token blocks when it never fits),
the write lease (a decode peer's echo of a heartbeat lets this rank write to it for one peer
timeout from when that heartbeat was sent), the deadlines, and the safe-abort rule: a failed
room is reported to its destinations, and aborts are acknowledged, only once no write of it is
in flight, because decode may reuse the pages as soon as it hears.

They live in four parts, each readable alone: the decode peers, their heartbeats and leases
(`prefill_peers`), the rooms and how they end (`prefill_rooms`, with each room's phase in
`prefill_room`), the write jobs (`write_scheduler`); this class dispatches events to them.
The events and actions themselves are `prefill_events`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvbridge.core.prefill_events import (
    Action,
    ChunkSubmitted,
    Connected,
    PrefillSettings,
    PrefillStats,
    SenderAborted,
    SenderCleared,
    SenderOpened,
    WriteEnded,
)
from kvbridge.core.prefill_peers import DecodePeer, PrefillPeers
from kvbridge.core.prefill_room import PrefillRoom
from kvbridge.core.prefill_rooms import PrefillRooms
from kvbridge.core.prefill_sglang import SGLangDecodeMessages
from kvbridge.core.protocol import ProtocolCore, RoomsChanged, Send, Tick
from kvbridge.core.room import Failure, Unpaired
from kvbridge.core.write_jobs import JobTable
from kvbridge.core.write_scheduler import WriteScheduler
from kvbridge.wire import (
    Abort,
    AbortAck,
    FailureKind,
    Heartbeat,
    KVPoll,
    Message,
    Registration,
    RoomLease,
    StagingResponse,
    TransferRequest,
)
from kvbridge.wire.address import tcp_endpoint

log = logging.getLogger("kvbridge.prefill")


class PrefillProtocol(ProtocolCore):
    """Every rule of a prefill rank, behind one handler table: its decode peers
    (`decode_peers`), its rooms and how they end (`room_table`), its write jobs (`jobs`) and
    their scheduling (`writes`)."""

    role = "prefill"
    stats: PrefillStats

    def __init__(self, settings: PrefillSettings) -> None:
        self.settings = settings
        self.rank = settings.rank
        self.stats = PrefillStats()
        self.decode_peers = PrefillPeers(settings, self.ignore)
        self.liveness = self.decode_peers.liveness
        self.jobs = JobTable()
        self.room_table = PrefillRooms(
            settings, self.stats, self.decode_peers, self.ignore, self.jobs
        )
        self.rooms: dict[int, PrefillRoom] = self.room_table.by_id
        self.writes = WriteScheduler(
            settings, self.stats, self.decode_peers, self.room_table, self.jobs, self.ignore
        )
        peers = self.decode_peers
        super().__init__(
            {
                Registration: peers.on_registration,
                TransferRequest: self.on_request,
                Abort: self._on_abort,
                Heartbeat: peers.on_heartbeat,
                RoomLease: self._on_room_lease,
                StagingResponse: self.writes.on_staging_response,
                SenderOpened: self._on_sender_opened,
                ChunkSubmitted: self._on_chunk_submitted,
                SenderAborted: self._on_sender_aborted,
                SenderCleared: self._on_sender_cleared,
                Connected: peers.on_connected,
                WriteEnded: self.writes.on_write_ended,
                Tick: self._on_tick,
            }
        )
        if settings.sglang_peers:
            self._handlers.update(SGLangDecodeMessages(self).handlers())

    def handle(self, event: object, now: float) -> list[Any]:
        """The actions an event calls for, in the order they must be executed; a message
        from a registered decode peer is also a sign of life."""
        self.decode_peers.heard(event, now)
        return super().handle(event, now)

    # --- queries ---------------------------------------------------------------------------

    def chunks_written(self) -> dict[tuple[str, str], int]:
        return {
            (path.value, reason.value): count
            for (path, reason), count in self.stats.chunks_written.items()
        }

    def lease_problem(self, peer_id: str, now: float) -> str | None:
        """Why this rank may not write to the peer now, or None (`PrefillPeers`); safe
        without the manager's lock."""
        return self.decode_peers.lease_problem(peer_id, now)

    def pages_safe(self, room: int) -> bool:
        """Whether the room's pages can go back to the allocator: the room ended and no write
        of it is in flight (an engine may read them until then)."""
        return self.room_table.pages_safe(room)

    # --- helpers ---------------------------------------------------------------------------

    def _schedule(self, state: PrefillRoom, now: float) -> list[Action]:
        """Queue the jobs of the room's chunks that can start; report success if it came."""
        was = state.status.poll
        try:
            jobs = state.next_jobs(self.writes.piece_pages_for(state))
        except Unpaired as exc:  # decode needs a page this rank cannot pair with it
            return self.room_table.fail(state, Failure(FailureKind.INCOMPATIBLE, str(exc)))
        except ValueError as exc:
            return self.room_table.fail(state, Failure(FailureKind.INTERNAL, str(exc)))
        self.writes.queue(state, jobs)
        state.maybe_succeed(self.jobs.open_in(state.room))
        actions: list[Action] = [RoomsChanged()] if state.status.poll != was else []
        if state.status.poll == KVPoll.Success and was != KVPoll.Success:
            actions += self.room_table.report(state)  # nothing to write (dummy requests only)
        return actions + self.writes.dispatch(now)

    # --- messages from decode peers --------------------------------------------------------

    def on_request(self, message: TransferRequest, now: float) -> list[Action]:
        peer = self.decode_peers.get(message.peer_id)
        if peer is None:  # creates nothing: anyone can send a request
            return self.ignore(
                "request for room %d from unregistered decode %s",
                message.room,
                message.peer_id[:100],
            )
        state, actions = self.room_table.for_peer(message.room, peer, now)
        if state is None:
            return actions
        if state.phase.draining:
            state.late_askers.add(peer.registration.peer_id)  # told once nothing is in flight
            return []
        if state.status.finished:
            # A room id is used once: a second request for an ended room gets the answer at
            # once rather than silence until decode's deadline.
            ended = state.status.failure_reason or f"it ended ({state.status.poll})"
            reason = f"room {message.room} already ended on prefill rank {self.rank}: {ended}"
            peers = self.decode_peers
            return [peers.status_to(peer, message.room, KVPoll.Failed, reason, FailureKind.REFUSED)]
        if peer.error:
            failure = Failure(peer.error.kind, f"room {message.room}: {peer.error.reason}")
            return self.room_table.fail(state, failure, message.peer_id)
        dst = peer.kv_args
        sizes = (dst.page_size, dst.dcp_size) if dst is not None else (1, 1)
        problem = state.request_problem(message, *sizes)
        if problem is not None:
            failure = Failure(FailureKind.INCOMPATIBLE, problem)
            return self.room_table.fail(state, failure, message.peer_id)
        state.on_request(message, aligned=state.aligns_with(*sizes))
        log.debug(
            "room %d: %s from decode %s, %d page(s)",
            message.room,
            "dummy request" if message.is_dummy else "request",
            message.peer_id,
            len(message.dst_kv_indices),
        )
        return self.decode_peers.renew_lease(peer, now) + self._schedule(state, now)

    def _on_abort(self, message: Abort, now: float) -> list[Action]:
        endpoint = tcp_endpoint(message.decode_ip, message.decode_port)
        return self.abort_by_decode(
            message.room,
            endpoint,
            message.reason,
            lambda peer: AbortAck(message.room, self.rank, peer.token),
            now,
        )

    def abort_by_decode(
        self,
        room: int,
        endpoint: str,
        why: str,
        ack_for: Callable[[DecodePeer], Message | None],
        now: float,
    ) -> list[Action]:
        """A decode peer at `endpoint` aborts the room: it fails, and the ack `ack_for` the
        peer gives (None: it is owed none) goes out once nothing of the room is in flight."""
        state = self.rooms.get(room)
        # Only a decode peer of this room (or, before its request, any registered peer) may
        # end it.
        peers = self.decode_peers.by_id
        askers = {peers[p].endpoint for p in state.requests} if state else set()
        peer = self.decode_peers.at(endpoint)
        if peer is None or (askers and endpoint not in askers):
            return self.ignore("abort of room %d from %s, not a decode peer of it", room, endpoint)
        actions: list[Action] = []
        if state is None:  # aborted before its request (or its sender): it starts failed
            state, actions = self.room_table.for_peer(room, peer, now)
        ack = ack_for(peer)
        if state is None or state.status.poll == KVPoll.Success:
            # Nothing of this room can be in flight: confirm at once.
            return [*actions, Send(endpoint, ack)] if ack is not None else actions
        if ack is not None:
            state.pending_acks[endpoint] = ack
        reason = f"room {room}: aborted by decode: {why or 'no reason given'}"
        return self.room_table.fail(state, Failure(FailureKind.ABORTED, reason))

    def _on_room_lease(self, message: RoomLease, now: float) -> list[Action]:
        """Decode will still ask for these rooms, or (decode first) still waits for rooms
        it asked for that no sender claimed yet: their deadlines start again. Only from a
        registered decode peer, and only for rooms no request reached or no sender claimed
        (once both did, liveness keeps the room alive)."""
        if self.decode_peers.at(message.sender_id) is None:
            return self.ignore(
                "room lease from %s, not a registered decode peer", message.sender_id
            )
        for room in message.rooms:
            state = self.rooms.get(room)
            if state is None or state.status.finished:
                continue
            if not state.requests or not state.claimed:
                self.room_table.renew(state, now)
                self.stats.leases_renewed += 1
        return []

    # --- the scheduler's rooms -------------------------------------------------------------

    def _on_sender_opened(self, event: SenderOpened, now: float) -> list[Action]:
        self.room_table.claim(event.room, now)
        return []

    def _on_chunk_submitted(self, event: ChunkSubmitted, now: float) -> list[Action]:
        state = self.rooms.get(event.room)
        if state is None or state.status.finished:
            return []
        state.add_chunk(event.chunk)  # ValueError after the last chunk: the caller's mistake
        return self._schedule(state, now)

    def _on_sender_aborted(self, event: SenderAborted, now: float) -> list[Action]:
        state = self.rooms.get(event.room)
        if state is None:
            return []
        reason = event.reason
        if event.kind == FailureKind.ABORTED:
            reason = f"aborted by prefill: {reason}"
        failure = Failure(event.kind, reason)
        return self.room_table.fail(state, failure)

    def _on_sender_cleared(self, event: SenderCleared, now: float) -> list[Action]:
        return self.room_table.clear(event.room)

    # --- time --------------------------------------------------------------------------------

    def _on_tick(self, tick: Tick, now: float) -> list[Action]:
        """Heartbeats to every decode peer; deadlines; rooms of peers that fell silent fail."""
        actions = self.decode_peers.on_tick(now)
        actions += self.room_table.on_tick(now)
        actions += self.writes.on_tick(now)
        if actions:
            actions += self.writes.dispatch(now)
        for peer_id, silent_s in self.liveness.expired(now):
            actions += self._peer_dead(peer_id, silent_s)
        return actions

    def _peer_dead(self, peer_id: str, silent_s: float) -> list[Action]:
        self.stats.peers_declared_dead += 1
        reason = self.liveness.silence(f"decode {peer_id}", silent_s)
        affected = [
            state
            for state in self.rooms.values()
            if peer_id in state.requests and not state.status.finished
        ]
        actions: list[Action] = []
        for state in affected:
            failure = Failure(FailureKind.PEER_DEAD, f"room {state.room}: {reason}")
            actions += self.room_table.fail(state, failure)
        actions += self.writes.peer_dead(peer_id)
        if affected:
            log.warning("%s: %d room(s) failed", reason, len(affected))
        else:
            log.info("%s", reason)
        return actions
