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

from kvbridge.core.decode_events import (
    Action,
    ChunkScattered,
    Closing,
    DecodeSettings,
    DecodeStats,
    ForgetPrefill,
    LeasesRenewing,
    PrefillsAnswered,
    Registering,
    RoomAborted,
    RoomCleared,
    RoomOpened,
)
from kvbridge.core.decode_heartbeats import DecodeHeartbeats
from kvbridge.core.decode_requests import opened_room, room_requests
from kvbridge.core.decode_ring import DecodeRing
from kvbridge.core.decode_room import DecodeRoom
from kvbridge.core.decode_sglang import ABORT_RELEASE_S, SGLangPeers
from kvbridge.core.liveness import Liveness
from kvbridge.core.protocol import DueQueue, ProtocolCore, RoomsChanged, Send, Tick
from kvbridge.core.room import RoomStatus
from kvbridge.wire import (
    Abort,
    AbortAck,
    ChunkReady,
    FailureKind,
    Heartbeat,
    KVPoll,
    RoomLease,
    StagingRequest,
    TransferStatus,
)
from kvbridge.wire.notifications import parse_notification
from kvbridge.wire.sglang import common as sglang_common
from kvbridge.wire.sglang.common import AbortNotification

log = logging.getLogger("kvbridge.decode")
# Slack on top of a dead prefill rank's write lease before its rooms' pages count as safe:
# its last check of the lease and the write step after it, clock rates.
FENCE_MARGIN_S = 0.5
# How often a tick also looks at every room's deadline and every peer's silence; the ticks in
# between (every millisecond while rooms transfer) only take the engine's notifications.
SWEEP_INTERVAL_S = 0.01


class DecodeProtocol(ProtocolCore):
    """Every rule of a decode rank, behind one handler table; its staging ring's in
    `staging` (`DecodeRing`)."""

    role = "decode"
    stats: DecodeStats

    def __init__(self, settings: DecodeSettings) -> None:
        self.settings = settings
        self.stats = DecodeStats()
        self.rooms: dict[int, DecodeRoom] = {}
        self.liveness = Liveness(settings.heartbeat_interval_s, settings.peer_timeout_s)
        self._registered: set[str] = set()  # prefill control endpoints
        # The SGLang prefill ranks among them: no heartbeats, tokens or leases; their rules.
        self._sglang = SGLangPeers(settings, self.rooms, self.ignore)
        self._heartbeats = DecodeHeartbeats(settings, self.liveness)
        self.staging = DecodeRing(settings, self.stats, self._registered, self.rooms, self.ignore)
        # Ticks come every millisecond while rooms transfer (the engine's notifications);
        # deadlines and liveness, which look at every room and peer, only every sweep.
        self._next_sweep = 0.0
        self._transferring = False
        self._deadlines: DueQueue[int] = DueQueue()  # rooms by deadline
        super().__init__(
            {
                Heartbeat: self._on_heartbeat,
                AbortAck: self._on_abort_ack,
                sglang_common.AbortAck: self._sglang.on_abort_ack,
                sglang_common.AuxData: self._sglang.on_aux_data,
                TransferStatus: self._on_status,
                StagingRequest: self.staging.on_staging_request,
                ChunkReady: self.staging.on_chunk_ready,
                Registering: self._on_registering,
                PrefillsAnswered: self._on_prefills_answered,
                RoomOpened: self._on_room_opened,
                RoomAborted: self._on_room_aborted,
                LeasesRenewing: self._on_leases_renewing,
                RoomCleared: self._on_room_cleared,
                ChunkScattered: self.staging.on_chunk_scattered,
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

    def scatter_wanted(self, room: int) -> bool:
        """Whether a staged chunk of the room should still go into its pages."""
        return self.staging.scatter_wanted(room)

    def room_status(self, room: int) -> RoomStatus | None:
        """The status of a room opened here and not cleared; None otherwise. A plain read,
        safe without the manager's lock: a status's failure kind and reason are set before it
        reads Failed."""
        state = self.rooms.get(room)
        return state.status if state is not None else None

    @property
    def busy(self) -> bool:
        """Whether a room is transferring (the control loop then polls the engine often): set
        when a room opens, looked at again every sweep."""
        return self._transferring

    # --- messages from prefill ranks -------------------------------------------------------

    def _on_heartbeat(self, message: Heartbeat, now: float) -> list[Action]:
        endpoint = message.sender_id
        if endpoint not in self._registered:  # only prefill ranks this rank registered with
            return self.ignore("heartbeat from unknown prefill %s", endpoint[:100])
        if message.session_token != self.settings.session_token:
            return self.ignore("heartbeat from %s without this rank's token", endpoint)
        if self.liveness.seen(endpoint, now):
            log.info("prefill %s is heard from again", endpoint)
        return [self._heartbeats.answer(message)]

    def _tokened(self, message: AbortAck | TransferStatus) -> bool:
        """Only the prefill rank asked to write a room can end it or confirm its drain. An
        SGLang prefill rank carries no token: its status counts if the room asked it."""
        if message.session_token == self.settings.session_token:
            return True
        state = self.rooms.get(message.room)
        if not message.session_token and self._sglang.asked(state, message.prefill_rank):
            return True
        self.ignore(
            "%s for room %d without this rank's token", type(message).__name__, message.room
        )
        return False

    def _on_abort_ack(self, message: AbortAck, now: float) -> list[Action]:
        if not self._tokened(message):
            return []
        state = self.rooms.get(message.room)
        if state is None:
            return self.ignore("abort ack for unknown room %d", message.room)
        state.on_abort_ack(message.prefill_rank)
        return [RoomsChanged()]

    def _on_status(self, message: TransferStatus, now: float) -> list[Action]:
        if not self._tokened(message):
            return []
        if message.status == KVPoll.Failed:
            # Prefill reports a failure only once nothing of the room is in flight: ring
            # space it was granted for chunks it never wrote is free again.
            self.staging.reclaim({(message.prefill_rank, message.room)})
        state = self.rooms.get(message.room)
        if state is None:
            return self.ignore("status for unknown or cleared room %d", message.room)
        state.on_status(message.prefill_rank, message.status, message.reason, message.failure_kind)
        if message.status == KVPoll.Failed and self._sglang.of_room(state) is not None:
            # An SGLang rank's failure stops no other rank writing the room: decode does.
            return [*self._abort_unsettled(state, message.reason, now), RoomsChanged()]
        return [RoomsChanged()]

    # --- the scheduler's rooms -------------------------------------------------------------

    def _on_registering(self, event: Registering, now: float) -> list[Action]:
        if event.endpoint in self._registered:
            return []
        self._registered.add(event.endpoint)
        if event.sglang is not None:
            self._sglang.by_endpoint[event.endpoint] = event.sglang
        self.liveness.watch(event.endpoint, now)
        return [Send(event.endpoint, event.registration)]

    def _on_prefills_answered(self, event: PrefillsAnswered, now: float) -> list[Action]:
        for endpoint in event.endpoints:
            if endpoint not in self._registered or endpoint not in self._sglang:
                continue  # declared dead since (registered again by the next room)
            if self.liveness.seen(endpoint, now):
                log.info("SGLang prefill %s is heard from again", endpoint)
        return []

    def _on_room_opened(self, event: RoomOpened, now: float) -> list[Action]:
        """Ask the prefill ranks to fill the room's pages (and aux slot, state slots)
        (`room_requests`); the room waits on them (`opened_room`)."""
        sglang = self._sglang.by_endpoint.get(next(iter(event.endpoints.values()), ""))
        requests = room_requests(event, self.settings, sglang)
        state = opened_room(event, self.settings, sglang, now)
        self._transferring = True
        self.rooms[state.room] = state
        self._deadlines.push(state.deadline, state.room)
        self._deadlines.compact(
            len(self.rooms), lambda: ((room.deadline, room.room) for room in self.rooms.values())
        )
        self.stats.rooms_started += 1
        log.debug(
            "room %d: asked prefill rank(s) %s for %d page(s)",
            event.room,
            sorted(rank for rank, _ in requests),
            event.pages.size,
        )
        return [Send(event.endpoints[rank], message) for rank, message in requests]

    def _on_leases_renewing(self, event: LeasesRenewing, now: float) -> list[Action]:
        lease = RoomLease(self.settings.endpoint, list(event.rooms))
        return [
            Send(endpoint, lease)
            for endpoint in event.endpoints
            if endpoint in self._registered and endpoint not in self._sglang
        ]

    def _on_room_aborted(self, event: RoomAborted, now: float) -> list[Action]:
        state = self.rooms.get(event.room)
        if state is not None:
            reason = f"aborted by decode: {event.reason}"
            if not state.status.fail(FailureKind.ABORTED, reason):
                return []  # it had ended already
            return self._abort_unsettled(state, event.reason, now)
        # Before init(): the prefill ranks hear it now, not at their deadline (an SGLang rank
        # an ABORT without generation: it fails the room and acknowledges nothing).
        host, port = self.settings.host, self.settings.control_port
        return [
            Send(
                endpoint,
                AbortNotification(event.room, host, port)
                if endpoint in self._sglang
                else Abort(event.room, host, port, event.reason),
            )
            for endpoint in sorted(set(event.endpoints))
        ]

    def _abort_unsettled(self, state: DecodeRoom, reason: str, now: float) -> list[Action]:
        """Ask every prefill rank that may still write into the room's pages to stop and
        confirm (its AbortAck settles it); the pages are safe once all have. Toward SGLang
        ranks in their words, with a generation (`SGLangPeers.aborts`)."""
        settings = self.settings
        if self._sglang.of_room(state) is not None:
            return [*self._sglang.aborts(state, now)]
        message = Abort(state.room, settings.host, settings.control_port, reason)
        endpoints = {state.endpoints[rank] for rank in state.unsettled()}
        return [Send(endpoint, message) for endpoint in sorted(endpoints)]

    def _on_room_cleared(self, event: RoomCleared, now: float) -> list[Action]:
        state = self.rooms.pop(event.room, None)
        if state is not None:
            status = state.status
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
                reason = state.status.failure_reason or "deadline"
                actions += self._abort_unsettled(state, reason, now)
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
        actions: list[Action] = [*self._heartbeats.due(now, without=self._sglang.by_endpoint)]
        settings = self.settings
        for endpoint, silent_s in self.liveness.expired(now):
            self.stats.peers_declared_dead += 1
            sglang = endpoint in self._sglang
            who = "SGLang prefill (its bootstrap's health check)" if sglang else "prefill"
            reason = self.liveness.silence(f"{who} {endpoint}", silent_s)
            # The last write lease this rank granted it started before it was last heard; a
            # rank that is only hung fences itself when that lease runs out (or, with an
            # engine that moves writes on its own threads, when its last write times out).
            # An SGLang rank has no lease: as long as sglang's own decode waits for its acks.
            lease_s = settings.lease_ms / 1000 - silent_s + FENCE_MARGIN_S + settings.write_grace_s
            fenced_at = now + (ABORT_RELEASE_S if sglang else lease_s)
            affected = [state for state in self.rooms.values() if state.waits_on(endpoint)]
            dead: set[tuple[int, int]] = set()  # (prefill rank, room)
            for state in self.rooms.values():
                for rank, known in state.endpoints.items():
                    if known == endpoint:  # it writes no more: settled, failed if needed
                        state.on_rank_dead(rank, f"room {state.room}: {reason}", fenced_at)
                        dead.add((rank, state.room))
            self.staging.reclaim(dead)
            # An SGLang rank had no lease: it still hears the abort (it may be alive).
            for state in affected if sglang else ():
                actions += self._abort_unsettled(state, reason, now)
            self.liveness.forget(endpoint)
            self._heartbeats.forget(endpoint)
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
            actions += self._abort_unsettled(state, "decode rank closing", now)
        return actions
