"""Decode's protocol core without sockets or threads: every rule, and random event sequences
that never report a room's pages safe while a prefill rank could still write into them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.cache.topology import DecodeRoute, HeadRange, Source
from kvbridge.core.decode_events import (
    Action,
    ChunkScattered,
    Closing,
    DecodeSettings,
    ForgetPrefill,
    LeasesRenewing,
    Registering,
    RoomAborted,
    RoomCleared,
    RoomOpened,
    ScatterChunk,
)
from kvbridge.core.decode_protocol import FENCE_MARGIN_S, DecodeProtocol
from kvbridge.core.decode_room import DecodeRoom
from kvbridge.core.protocol import DueQueue, RoomsChanged, Send, Tick
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
    TransferStatus,
)
from kvbridge.wire.notifications import notification_for

TOKEN = b"t" * 16
ENDPOINTS = ("tcp://10.0.0.1:7000", "tcp://10.0.0.2:7000")  # prefill ranks 0 and 1
LEASE_S = 3.0
RING = 4096


def sends(actions: list[Action]) -> list[Send]:
    """The messages among the actions."""
    return [action for action in actions if isinstance(action, Send)]


def protocol(staging_bytes: int | None = RING, notifying: bool = True) -> DecodeProtocol:
    return DecodeProtocol(
        DecodeSettings(
            rank=0,
            peer_id="decode-0@tcp://10.0.0.9:7100",
            host="10.0.0.9",
            control_port=7100,
            session_token=TOKEN,
            heartbeat_interval_s=0.5,
            peer_timeout_s=LEASE_S,
            staging_bytes=staging_bytes,
            transfer_timeout_s=100.0,
            engine_notifies=notifying,
        )
    )


def registration() -> Registration:
    return Registration(
        "decode-0@tcp://10.0.0.9:7100",
        "10.0.0.9",
        7100,
        "nixl",
        b"agent",
        0,
        1,
        0,
        1,
        1,
        2,
        8,
        "bfloat16",
        4,
        [0],
        [4096, 8192],
        [64, 64],
        [640, 640],
        [],
        [],
        [],
    )


def register_all(decode: DecodeProtocol, now: float = 0.0) -> None:
    for endpoint in ENDPOINTS:
        assert sends(decode.handle(Registering(endpoint, registration()), now))
        assert decode.handle(Registering(endpoint, registration()), now) == []  # once


def source(rank: int) -> Source:
    return Source(rank, HeadRange(rank, 1), 0, rank)


def open_room(
    decode: DecodeProtocol, room: int, now: float = 0.0
) -> tuple[DecodeRoom, list[Action]]:
    """A room toward prefill ranks 0 and 1, each a source of one head; deadline now + 100."""
    opened = RoomOpened(
        room,
        DecodeRoute(0, (source(0), source(1)), ()),
        {0: 1, 1: 1},
        {0: ENDPOINTS[0], 1: ENDPOINTS[1]},
        np.arange(4, dtype=np.int32),
        aux_index=0,
    )
    actions = decode.handle(opened, now)
    return decode.rooms[room], actions


def status(room: int, rank: int, poll: KVPoll, kind: FailureKind | None = None) -> TransferStatus:
    reason = "it broke" if poll == KVPoll.Failed else ""
    return TransferStatus(room, poll, rank, reason, TOKEN, kind)


def test_a_room_succeeds_when_every_rank_reported_and_its_notification_arrived() -> None:
    decode = protocol()
    register_all(decode)
    state, actions = open_room(decode, 1)
    assert [action.endpoint for action in sends(actions)] == list(ENDPOINTS)
    assert state.status.poll == KVPoll.Transferring
    decode.handle(status(1, 0, KVPoll.Success), 0.1)
    decode.handle(status(1, 1, KVPoll.Success), 0.1)
    assert state.status.poll == KVPoll.Transferring  # the data is not known to be in place
    decode.handle(Tick((notification_for(1, 0), notification_for(1, 1), b"other")), 0.2)
    assert state.status.poll == KVPoll.Success
    assert decode.pages_safe(1, 0.2)
    decode.handle(RoomCleared(1), 0.3)
    assert decode.stats.rooms_finished == {("Success", ""): 1}
    assert decode.pages_safe(1, 0.3) is None


def test_complete_notifications_succeed_a_room_without_statuses() -> None:
    decode = protocol()
    register_all(decode)
    state, _ = open_room(decode, 1)
    decode.handle(Tick((notification_for(1, 0, complete=True),)), 0.1)
    assert state.status.poll == KVPoll.Transferring  # rank 1 has not said anything
    actions = decode.handle(Tick((notification_for(1, 1, complete=True),)), 0.2)
    assert state.status.poll == KVPoll.Success
    assert any(isinstance(action, RoomsChanged) for action in actions)
    assert decode.pages_safe(1, 0.2)
    # A status that follows anyway (a peer that sends one regardless) changes nothing.
    decode.handle(status(1, 0, KVPoll.Failed), 0.3)
    assert state.status.poll == KVPoll.Success


def test_messages_without_this_ranks_token_or_from_strangers_are_ignored() -> None:
    decode = protocol()
    register_all(decode)
    state, _ = open_room(decode, 1)
    forged = TransferStatus(1, KVPoll.Failed, 0, "forged", b"x" * 16)
    assert decode.handle(forged, 0.1) == []
    assert decode.handle(AbortAck(1, 0, b""), 0.1) == []
    stranger = Heartbeat("tcp://6.6.6.6:1", 1, 1000, None, TOKEN)
    assert decode.handle(stranger, 0.1) == []
    assert state.status.poll == KVPoll.Transferring
    assert decode.stats.ignored == 3


def test_a_heartbeat_is_answered_at_once_with_its_sequence() -> None:
    decode = protocol()
    register_all(decode)
    (pong,) = sends(decode.handle(Heartbeat(ENDPOINTS[0], 7, 3000, None, TOKEN), 0.1))
    assert pong.endpoint == ENDPOINTS[0]
    assert isinstance(pong.message, Heartbeat)
    assert pong.message.sender_id == "tcp://10.0.0.9:7100"  # this rank's control endpoint
    assert (pong.message.ack_sequence, pong.message.lease_ms) == (7, 3000)


def test_a_failure_carries_prefills_kind_and_the_pages_wait_for_every_rank() -> None:
    decode = protocol()
    register_all(decode)
    state, _ = open_room(decode, 1)
    decode.handle(status(1, 0, KVPoll.Failed, FailureKind.ENGINE), 0.1)
    assert (state.status.poll, state.status.failure_kind) == (KVPoll.Failed, FailureKind.ENGINE)
    assert not decode.pages_safe(1, 0.1)  # rank 1 may still write
    decode.handle(status(1, 1, KVPoll.Success), 0.2)
    assert decode.pages_safe(1, 0.2)


def test_an_abort_asks_only_the_ranks_that_may_still_write_and_their_acks_settle_it() -> None:
    decode = protocol()
    register_all(decode)
    state, _ = open_room(decode, 1)
    decode.handle(status(1, 0, KVPoll.Success), 0.1)
    actions = decode.handle(RoomAborted(1, "client gone"), 0.2)
    assert [(send.endpoint, type(send.message)) for send in sends(actions)] == [
        (ENDPOINTS[1], Abort)
    ]
    assert state.status.failure_kind == FailureKind.ABORTED
    assert not decode.pages_safe(1, 0.2)
    assert decode.handle(RoomAborted(1, "again"), 0.2) == []  # once
    decode.handle(AbortAck(1, 1, TOKEN), 0.3)
    assert decode.pages_safe(1, 0.3)


def test_an_abort_before_init_goes_to_the_given_endpoints() -> None:
    decode = protocol()
    actions = decode.handle(RoomAborted(5, "early", (ENDPOINTS[1], ENDPOINTS[1])), 0.0)
    assert [send.endpoint for send in sends(actions)] == [ENDPOINTS[1]]
    assert 5 not in decode.rooms  # its receiver failed it


def test_a_silent_rank_fails_its_rooms_and_its_pages_are_safe_once_its_lease_ran_out() -> None:
    decode = protocol()
    register_all(decode)
    state, _ = open_room(decode, 1)
    decode.handle(Heartbeat(ENDPOINTS[1], 1, 3000, None, TOKEN), 2.0)  # rank 1 is alive
    decode.handle(status(1, 1, KVPoll.Success), 2.0)
    actions = decode.handle(Tick(), LEASE_S + 0.1)  # rank 0 silent since 0 (watched then)
    assert ForgetPrefill(ENDPOINTS[0]) in actions
    assert RoomsChanged() in actions
    assert (state.status.poll, state.status.failure_kind) == (KVPoll.Failed, FailureKind.PEER_DEAD)
    assert not decode.registered(ENDPOINTS[0])
    fenced_at = 0.0 + LEASE_S + FENCE_MARGIN_S
    assert not decode.pages_safe(1, fenced_at - 0.01)  # a hung rank may still write
    assert decode.pages_safe(1, fenced_at)


def test_the_deadline_fails_the_room_and_asks_for_aborts() -> None:
    decode = protocol()
    register_all(decode)
    state, _ = open_room(decode, 1)
    for endpoint in ENDPOINTS:  # both ranks alive, neither reports
        decode.handle(Heartbeat(endpoint, 1, 3000, None, TOKEN), 99.0)
    actions = decode.handle(Tick(), 100.5)
    assert state.status.failure_kind == FailureKind.TIMEOUT
    assert {send.endpoint for send in sends(actions) if isinstance(send.message, Abort)} == set(
        ENDPOINTS
    )


def test_a_room_opened_again_under_its_number_keeps_its_own_deadline() -> None:
    """Deadlines are kept by when they fall due; the entry of a room that was cleared must
    not fail a later room under the same number before that room's own deadline."""
    decode = protocol()
    register_all(decode)
    first, _ = open_room(decode, 1)  # deadline 100
    first.status.fail(FailureKind.ABORTED, "the scheduler gave up")
    decode.handle(RoomCleared(1), 1.0)
    second, _ = open_room(decode, 1, now=50.0)  # deadline 150
    for second_now in (99.0, 101.0, 149.0):  # both ranks alive all along
        for endpoint in ENDPOINTS:
            decode.handle(Heartbeat(endpoint, int(second_now), 3000, None, TOKEN), second_now)
        decode.handle(Tick(), second_now + 0.5)
    assert second.status.failure_kind is None
    decode.handle(Tick(), 150.5)
    assert second.status.failure_kind == FailureKind.TIMEOUT


def test_the_due_queue_yields_what_fell_due_and_stays_as_large_as_its_table() -> None:
    queue: DueQueue[int] = DueQueue()
    for key, due in enumerate([5.0, 1.0, 3.0, 9.0]):
        queue.push(due, key)
    assert list(queue.pop_due(4.0)) == [(1.0, 1), (3.0, 2)]  # soonest first, taken out
    assert list(queue.pop_due(4.0)) == []
    for key in range(1000):  # entries of keys that ended meanwhile pile up...
        queue.push(10.0 + key, key)
        queue.compact(live=2, entries=lambda: [(5.0, 0), (9.0, 3)])
    assert len(queue) <= 2 * 2 + 64 + 1  # ...until the live ones are all that is kept
    assert next(queue.pop_due(100.0)) == (5.0, 0)


def test_closing_fails_unsafe_rooms_and_aborts_them() -> None:
    decode = protocol()
    register_all(decode)
    state, _ = open_room(decode, 1)
    actions = decode.handle(Closing(), 0.1)
    assert state.status.failure_kind == FailureKind.ABORTED
    assert len([s for s in sends(actions) if isinstance(s.message, Abort)]) == 2
    assert decode.unsafe_rooms(0.1) == [1]


def staging_request(room: int, rank: int, chunk: int, nbytes: int) -> StagingRequest:
    return StagingRequest(room, chunk, 1, ENDPOINTS[rank], rank, nbytes)


def test_ring_space_is_granted_queued_and_refused_and_freed_after_the_scatter() -> None:
    decode = protocol()
    register_all(decode)
    state, _ = open_room(decode, 1)
    (grant,) = sends(decode.handle(staging_request(1, 0, 0, 3000), 0.1))
    assert isinstance(grant.message, StagingResponse)
    assert grant.message.offset == 0
    assert decode.handle(staging_request(1, 1, 0, 3000), 0.1) == []  # full: it waits
    (never,) = sends(decode.handle(staging_request(1, 1, 1, RING + 1), 0.1))
    assert isinstance(never.message, StagingResponse)
    assert never.message.offset == STAGING_NEVER_FITS
    ready = ChunkReady(1, 0, 0, 1, ENDPOINTS[0], 0, 0, 4)
    (scatter,) = decode.handle(ready, 0.2)
    assert isinstance(scatter, ScatterChunk)
    assert scatter.source == source(0)
    decode.handle(status(1, 0, KVPoll.Success), 0.2)
    decode.handle(Tick((notification_for(1, 0),)), 0.2)
    assert not decode.pages_safe(1, 0.2)  # the staged chunk is not in the pages yet
    actions = decode.handle(ChunkScattered(ready, scatter.allocation), 0.3)
    (granted,) = sends(actions)  # the space freed goes to the request that waited for it
    assert (granted.endpoint, getattr(granted.message, "offset", None)) == (ENDPOINTS[1], 0)
    assert state.unscattered == 0


def test_a_failed_status_reclaims_the_ring_space_of_chunks_that_will_not_come() -> None:
    decode = protocol()
    register_all(decode)
    open_room(decode, 1)
    decode.handle(staging_request(1, 0, 0, 3000), 0.1)
    assert decode.staging.ring is not None
    assert decode.staging.ring.in_use > 0
    decode.handle(status(1, 0, KVPoll.Failed, FailureKind.ENGINE), 0.2)
    assert decode.staging.ring.in_use == 0


def test_a_chunk_nobody_granted_space_for_is_counted_not_scattered() -> None:
    decode = protocol()
    register_all(decode)
    open_room(decode, 1)
    assert decode.handle(ChunkReady(1, 3, 0, 1, ENDPOINTS[0], 0, 0, 4), 0.1) == []
    assert decode.stats.unexpected_chunks == 1


# --- random event sequences ------------------------------------------------------------------


# A write that a prefill rank began just before its lease ran out lands within this (prefill
# checks its lease before each write step; decode waits FENCE_MARGIN_S for it).
WRITE_STEP_S = FENCE_MARGIN_S / 2


@dataclass
class Model:
    """What could still write where, from the outside: a prefill rank writes into a room's
    pages until it reported how the room ended or acknowledged an abort, or until the last
    write lease this decode rank granted it (at most one lease after it was last heard)
    ran out."""

    last_heard: dict[int, float] = field(default_factory=lambda: {0: 0.0, 1: 0.0})
    settled: set[tuple[int, int]] = field(default_factory=set)  # (room, rank)

    def may_write(self, room: int, rank: int, now: float) -> bool:
        lease_end = self.last_heard[rank] + LEASE_S + WRITE_STEP_S
        return (room, rank) not in self.settled and now < lease_end


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "open",
                "beat",
                "success",
                "failed",
                "ack",
                "abort",
                "tick",
                "notify",
                "stage",
                "ready",
                "scattered",
                "clear",
            ]
        ),
        st.integers(1, 2),  # room
        st.integers(0, 1),  # prefill rank
        # Time passing before the event: mostly little, so that leases are often still running;
        # sometimes past a lease, so that ranks are declared dead.
        st.sampled_from([0.01, 0.01, 0.01, 0.1, 0.1, 0.3, 1.0, LEASE_S + 0.1, 4.0]),
    ),
    max_size=60,
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=EVENTS)
def test_pages_are_never_safe_while_a_write_can_land(
    events: list[tuple[str, int, int, float]],
) -> None:
    decode, model, now = protocol(), Model(), 0.0
    register_all(decode)
    states: dict[int, DecodeRoom] = {}
    scatters: list[ScatterChunk] = []
    chunk = 0
    history: dict[int, list[KVPoll]] = {}
    for kind, room, rank, dt in events:
        now += dt
        actions: list[Action] = []
        state = states.get(room)
        if kind == "open" and room not in decode.rooms:
            state, actions = open_room(decode, room, now)
            states[room] = state
            history[room] = []  # a room id used again is a new room
            model.settled -= {(room, 0), (room, 1)}
        elif kind == "beat" and decode.registered(ENDPOINTS[rank]):
            model.last_heard[rank] = now
            actions = decode.handle(Heartbeat(ENDPOINTS[rank], 1, 3000, None, TOKEN), now)
        elif kind in ("success", "failed") and state is not None:
            # A rank reports a room once, and only after its writes ended.
            if (room, rank) not in model.settled:
                model.settled.add((room, rank))
                poll = KVPoll.Success if kind == "success" else KVPoll.Failed
                actions = decode.handle(status(room, rank, poll, FailureKind.ENGINE), now)
        elif kind == "ack" and state is not None:
            model.settled.add((room, rank))
            actions = decode.handle(AbortAck(room, rank, TOKEN), now)
        elif kind == "abort" and state is not None:
            actions = decode.handle(RoomAborted(room, "random"), now)
        elif kind == "tick":
            actions = decode.handle(Tick(), now)
        elif kind == "notify":
            actions = decode.handle(Tick((notification_for(room, rank),)), now)
        elif kind == "stage" and decode.registered(ENDPOINTS[rank]):
            chunk += 1
            actions = decode.handle(staging_request(room, rank, chunk, 1000), now)
        elif kind == "ready" and state is not None and model.may_write(room, rank, now):
            granted = [key for key in decode.staging._staged if key[:2] == (rank, room)]
            if granted:
                ready = ChunkReady(room, granted[0][2], 0, 1, ENDPOINTS[rank], rank, 0, 4)
                actions = decode.handle(ready, now)
        elif kind == "scattered" and scatters:
            done = scatters.pop(0)
            actions = decode.handle(ChunkScattered(done.ready, done.allocation), now)
        elif kind == "clear" and state is not None and decode.pages_safe(room, now):
            decode.handle(RoomCleared(room), now)
            del states[room]
        scatters += [action for action in actions if isinstance(action, ScatterChunk)]
        for room_id, state in states.items():
            history.setdefault(room_id, []).append(state.status.poll)
            if decode.pages_safe(room_id, now):
                assert not any(model.may_write(room_id, r, now) for r in (0, 1)), (room_id, now)
                assert not any(s.ready.room == room_id for s in scatters)
            if state.status.poll == KVPoll.Success:
                assert state.reported == {0, 1}
                assert state.notified == {0, 1}
        assert decode.staging.ring is not None
        assert 0 <= decode.staging.ring.in_use <= RING
    for polls in history.values():  # a room's state only moves forward; Failed and Success end
        ended = [i for i, poll in enumerate(polls) if poll in (KVPoll.Failed, KVPoll.Success)]
        if ended:
            assert len(set(polls[ended[0] :])) == 1, polls


def test_lease_renewals_go_only_to_prefill_ranks_this_rank_registered_with() -> None:
    decode = protocol()
    decode.handle(Registering(ENDPOINTS[0], registration()), 0.0)
    actions = decode.handle(LeasesRenewing((*ENDPOINTS, "tcp://6.6.6.6:1"), (7, 9)), 1.0)
    (send,) = sends(actions)
    assert send.endpoint == ENDPOINTS[0]
    assert send.message == RoomLease(decode.settings.endpoint, [7, 9])
