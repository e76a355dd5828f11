"""A prefill rank's rooms, pure: the table (a room is created on first use, within the cap of
rooms no scheduler claimed, and never again once it ended), the request and claim deadlines,
and how a room ends — failure, settling (the safe-abort rule: a failed room is reported to its
destinations, and aborts are acknowledged, only once nothing of it is out), the scheduler's
cleanup and forgetting. Each room's phase moves only through `prefill_room.TRANSITIONS`."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator

from kvbridge.core.prefill_events import Action, PrefillSettings, PrefillStats
from kvbridge.core.prefill_peers import DecodePeer, Ignore, PrefillPeers
from kvbridge.core.prefill_room import Phase, PrefillRoom, Step
from kvbridge.core.protocol import DueQueue, RoomsChanged, Send
from kvbridge.core.room import Failure
from kvbridge.core.write_jobs import JobTable
from kvbridge.wire import FailureKind, KVPoll

log = logging.getLogger("kvbridge.prefill")
# Rooms that ended are remembered this long (by count) so late messages never re-create them.
FINISHED_ROOMS_KEPT = 65536
# Without a secret anyone who reaches the port can send requests: rooms that requests create
# before the scheduler claims them are capped.
MAX_UNCLAIMED_ROOMS = 16384


class PrefillRooms:
    """The rooms of one prefill rank; what each has open or in flight is read from the write
    jobs' table (`jobs`), where a settled or forgotten room's queued jobs are dropped."""

    def __init__(
        self,
        settings: PrefillSettings,
        stats: PrefillStats,
        peers: PrefillPeers,
        ignore: Ignore,
        jobs: JobTable,
    ) -> None:
        self.settings = settings
        self.stats = stats
        self.peers = peers
        self._ignore = ignore
        self.jobs = jobs
        self.by_id: dict[int, PrefillRoom] = {}
        # Rooms created by a request with no sender yet, oldest first (a dict keeps the order;
        # a renewed one goes last).
        self._unclaimed: dict[int, None] = {}
        # Rooms by when their request timeout runs out ((room, sequence): the same number may
        # name a later room).
        self._request_due: DueQueue[tuple[int, int]] = DueQueue()
        self._finished: deque[int] = deque(maxlen=FINISHED_ROOMS_KEPT)
        self._finished_set: set[int] = set()
        self._sequence = 0  # rooms created so far: each room's place in the arrival order

    @property
    def rank(self) -> int:
        return self.settings.rank

    def get(self, room: int) -> PrefillRoom | None:
        return self.by_id.get(room)

    def pages_safe(self, room: int) -> bool:
        """Whether the room's pages can go back to the allocator: the room ended and no write
        of it is in flight (an engine may read them until then)."""
        state = self.by_id.get(room)
        return state is None or state.pages_safe

    def open(self, room: int, now: float) -> PrefillRoom | None:
        """The room's state; created on first use unless it already ended here."""
        state = self.by_id.get(room)
        if state is None and room not in self._finished_set:
            self._sequence += 1
            state = self.by_id[room] = PrefillRoom(
                room,
                created_at=now,
                page_size=self.settings.kv_args.page_size,
                sequence=self._sequence,
                num_layers=self.settings.kv_args.num_layers,
            )
            self.stats.rooms_started += 1
            self._unclaimed[room] = None
            self._request_due.push(now + self.settings.request_timeout_s, (room, self._sequence))
            self._request_due.compact(len(self.by_id), self._request_entries)
        return state

    def renew(self, state: PrefillRoom, now: float) -> None:
        """Decode will still ask for the room (before its request), or still waits for it
        (after its request, which no sender claimed yet): its deadline starts again."""
        state.renewed_at = now
        if state.room in self._unclaimed:  # last in line now: the line stays by deadline
            del self._unclaimed[state.room]
            self._unclaimed[state.room] = None

    def claim(self, room: int, now: float) -> None:
        """The scheduler made a sender for the room (created if new)."""
        state = self.open(room, now)
        if state is not None:
            state.claimed = True
            self._unclaimed.pop(room, None)

    def for_peer(
        self, room: int, peer: DecodePeer, now: float
    ) -> tuple[PrefillRoom | None, list[Action]]:
        """The room a decode peer's message is about, created if new (within the cap of rooms
        that no sender claimed); None, with the message telling the peer why, if there is
        none."""
        state = self.by_id.get(room)
        if state is not None:
            return state, []
        if room in self._finished_set:
            reason = f"room {room} already ended on prefill rank {self.rank}"
        elif len(self._unclaimed) >= MAX_UNCLAIMED_ROOMS:
            reason = (
                f"prefill rank {self.rank} holds {MAX_UNCLAIMED_ROOMS} rooms that no "
                "scheduler started; refused"
            )
        else:
            return self.open(room, now), []
        self._ignore("%s", reason)
        return None, [self.peers.status_to(peer, room, KVPoll.Failed, reason, FailureKind.REFUSED)]

    def report(self, state: PrefillRoom, also_peer: str | None = None) -> list[Action]:
        """Tell every destination of the room (and `also_peer`) how it ended."""
        peers = set(state.requests) | state.late_askers | ({also_peer} if also_peer else set())
        actions: list[Action] = []
        told = state.completed_by_notification if state.status.poll == KVPoll.Success else set()
        for peer_id in sorted(peers - told):
            peer = self.peers.get(peer_id)
            if peer is None or self._silent_dummy(state, peer_id):
                continue
            status = state.status
            reason = status.failure_reason or ""
            actions.append(
                self.peers.status_to(peer, state.room, status.poll, reason, status.failure_kind)
            )
        return actions

    def _silent_dummy(self, state: PrefillRoom, peer_id: str) -> bool:
        """An SGLang decode hears nothing from a rank it sent a dummy request (its MLA
        dummies): a status from one could end the room there before the writer's."""
        request = state.requests.get(peer_id)
        return self.settings.sglang_peers and request is not None and request.is_dummy

    def fail(
        self, state: PrefillRoom, failure: Failure, peer_id: str | None = None
    ) -> list[Action]:
        """Fail the room; tell its destinations (and acknowledge aborts) once nothing of it
        is out — at once if idle, else when its last write ends or decode answers its last
        staging request (decode frees ring space granted to a room when it hears the room
        failed). Its queued jobs are dropped when their turn comes."""
        actions: list[Action] = []
        if state.fail(failure):
            log.warning("room %d failed (%s): %s", state.room, failure.kind, failure.reason)
            actions.append(RoomsChanged())
        if peer_id is not None and peer_id not in state.requests:
            actions += self.report(state, also_peer=peer_id)  # a peer it never wrote to
        if state.status.poll != KVPoll.Failed:
            return actions  # it had succeeded: nothing to settle, success was reported
        if not self.jobs.in_flight(state.room):
            actions += self.settle(state)
        return actions

    def settle(self, state: PrefillRoom) -> list[Action]:
        """A failed room with nothing out: report it once, acknowledge every abort."""
        self.jobs.drop_queued(state.room)
        actions: list[Action] = []
        if state.phase.draining:  # not told yet
            actions += self.report(state)
        state.step(Step.DRAINED)
        actions += [Send(endpoint, ack) for endpoint, ack in sorted(state.pending_acks.items())]
        state.pending_acks.clear()
        return [*actions, RoomsChanged()]

    def job_ended(self, room: int, handed_out: bool) -> list[Action]:
        """One of the room's jobs ended (`handed_out`: it had been, else it was dropped
        before): a failed room with nothing out any more settles (and goes, if cleared), and a
        room whose last job ended reports success."""
        state = self.by_id.get(room)
        if state is None:  # cleared meanwhile
            return [RoomsChanged()]
        was = state.status.poll
        state.maybe_succeed(self.jobs.open_in(room))
        if state.status.poll == KVPoll.Failed and not self.jobs.in_flight(room):
            settled = self.settle(state) if handed_out else []
            if state.phase is Phase.FORGOTTEN:  # it was cleared while draining
                self.forget(state)
            return settled
        actions: list[Action] = []
        if state.status.poll == KVPoll.Success and was != KVPoll.Success:
            actions += self.report(state)
        return [*actions, RoomsChanged()] if handed_out else actions

    def clear(self, room: int) -> list[Action]:
        """The one cleanup path of a room (idempotent). A room cleared before it ended fails
        (its destinations hear so); one with a write still out stays, answering who asks
        about it, until that write ended."""
        state = self.by_id.get(room)
        if state is None:
            return []
        actions: list[Action] = []
        if not state.status.finished:
            reason = f"room {room}: cleared by prefill's scheduler before it ended"
            actions += self.fail(state, Failure(FailureKind.ABORTED, reason))
        if state.step(Step.CLEAR) is Phase.FORGOTTEN:
            self.forget(state)
        return actions

    def forget(self, state: PrefillRoom) -> None:
        room = state.room
        del self.by_id[room]
        status = state.status
        self.stats.count_finished(status)
        log.debug("room %d: cleared (%s)", room, status.failure_reason or status.poll.name)
        self._unclaimed.pop(room, None)
        self.jobs.drop_queued(room)
        if len(self._finished) == self._finished.maxlen:
            self._finished_set.discard(self._finished[0])
        self._finished.append(room)
        self._finished_set.add(room)

    def on_tick(self, now: float) -> list[Action]:
        """Rooms whose decode requests are overdue fail; so do rooms decode asked for that no
        scheduler claimed in time (nobody would clear them: they leave the table too)."""
        timeout_s = self.settings.request_timeout_s
        actions: list[Action] = []
        still_open: list[tuple[float, tuple[int, int]]] = []
        for due, (room, sequence) in self._request_due.pop_due(now):
            state = self.by_id.get(room)
            if state is None or state.sequence != sequence or state.status.finished:
                continue  # gone, or ended: nothing to wait for
            if state.request_overdue(now, timeout_s):
                got, wanted = len(state.requests), state.required_requests or "any"
                renewed = " since decode's last lease renewal" if state.renewed_at else ""
                reason = (
                    f"room {state.room}: {got} of {wanted} transfer request(s) from "
                    f"decode in {timeout_s:g} s{renewed}"
                )
                actions += self.fail(state, Failure(FailureKind.TIMEOUT, reason))
            elif not state.ready:  # decode renewed its lease: due again when that runs out
                still_open.append((state.request_deadline(timeout_s), (room, sequence)))
            else:  # it has its requests; a later one may still ask for more: looked at again
                still_open.append((due, (room, sequence)))
        for due, room_key in still_open:
            self._request_due.push(due, room_key)
        while self._unclaimed:
            room = next(iter(self._unclaimed))
            if not self.by_id[room].claim_overdue(now, timeout_s):
                break
            since = "last lease renewal" if self.by_id[room].renewed_at else "request"
            reason = (
                f"room {room}: prefill rank {self.rank} was not given this room "
                f"within {timeout_s:g} s of decode's {since}"
            )
            actions += self.fail(self.by_id[room], Failure(FailureKind.TIMEOUT, reason))
            actions += self.clear(room)
        return actions

    def _request_entries(self) -> Iterator[tuple[float, tuple[int, int]]]:
        timeout_s = self.settings.request_timeout_s
        for state in self.by_id.values():
            if not state.status.finished:
                yield state.request_deadline(timeout_s), (state.room, state.sequence)
