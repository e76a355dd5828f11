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
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.cache import GeometryError, KVArgs, PlanError, TransferPlan, plan_slots
from kvbridge.cache.peer import kv_args_of
from kvbridge.cache.plan import (
    FRESH,
    Pairing,
    PlanArena,
    PlanMemory,
    pair,
    plan_gathered,
    plan_state_slices,
    token_rows,
)
from kvbridge.core.liveness import Liveness
from kvbridge.core.protocol import DueQueue, ProtocolCore, RankStats, RoomsChanged, Send, Tick
from kvbridge.core.room import (
    COMPLETING_NOTIFICATIONS,
    Chunk,
    ChunkJob,
    Failure,
    PrefillRoom,
    notification_for,
)
from kvbridge.staging.kernels import staged_size
from kvbridge.staging.ring import Allocation, StagingRing
from kvbridge.wire import (
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
    Watermark,
)
from kvbridge.wire.address import tcp_endpoint

log = logging.getLogger("kvbridge.prefill")
# Rooms that ended are remembered this long (by count) so late messages never re-create them.
FINISHED_ROOMS_KEPT = 65536
# Heartbeat send times kept for decode's echoes (heartbeats are 0.5 s apart by default).
MAX_BEATS_REMEMBERED = 64
# Without a secret anyone who reaches the port can send requests: rooms that requests create
# before the scheduler claims them, and registered decode peers, are capped.
MAX_UNCLAIMED_ROOMS = 16384
MAX_DECODE_PEERS = 1024
# Chunks gathered into this rank's staging buffer start on this boundary.
RING_ALIGNMENT = 64


# --- actions: what the manager executes ----------------------------------------------------


@dataclass(frozen=True)
class Connect:
    """Connect the engine to a decode peer; report `Connected`."""

    peer_id: str
    descriptor: bytes
    peer_args: KVArgs


@dataclass(frozen=True)
class RingSpace:
    """Where a gathered chunk goes in decode's staging ring (one block), and the message that
    tells decode it landed (sent once the write ended; decode then scatters it)."""

    ptr: int
    ready: ChunkReady


@dataclass(frozen=True)
class PageRows:
    """A gathered chunk goes straight into decode's pages, at these token rows."""

    rows: npt.NDArray[np.int64]


@dataclass(frozen=True)
class StagedChunk:
    """A chunk gathered into this rank's staging buffer at `local_offset` — bytes
    ``[column, column + width)`` of its token rows in every KV buffer, buffer-major — and
    written from there to `destination`."""

    src_rows: npt.NDArray[np.int64]
    column: int
    width: int
    nbytes: int
    local_offset: int
    destination: RingSpace | PageRows


@dataclass(frozen=True)
class Write:
    """Write one job: plan it (or gather it, when staged), write it to the peer with the
    notification if any, and report `WriteEnded` with this action."""

    room: int
    job: ChunkJob
    peer_args: KVArgs
    pairing: Pairing
    notify: bytes
    staged: StagedChunk | None = None
    # The room's last write to a peer that takes complete notifications: that form of its
    # notification, allowed when the room's chunks still out when it was handed out
    # (`complete_with`) go in the same transfer (`transfer_notification`).
    notify_complete: bytes = b""
    complete_with: frozenset[int] = frozenset()


def transfer_notification(writes: Sequence[Write]) -> tuple[bytes, Write | None]:
    """The notification of one transfer made of `writes` (in order; a transfer ends with the
    first write that carries one), and the write whose room that notification completes
    for the peer, if it does: every write of the room to that peer then either ended, and
    succeeded, before this one was handed out, or travels in this transfer — NIXL sends a
    notification only once its transfer's writes (and, flushing the endpoint, every earlier
    one) completed, and a transfer fails whole."""
    notifying = next((write for write in writes if write.notify), None)
    if notifying is None:
        return b"", None
    if notifying.notify_complete:
        travelling = {write.job.chunk_idx for write in writes if write.room == notifying.room}
        if notifying.complete_with <= travelling:
            return notifying.notify_complete, notifying
    return notifying.notify, None


Action = Send | Connect | Write | RoomsChanged


# --- local events ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SenderOpened:
    """The scheduler made a KVSender: the room is claimed (created if new)."""

    room: int


@dataclass(frozen=True)
class ChunkSubmitted:
    room: int
    chunk: Chunk


@dataclass(frozen=True)
class SenderAborted:
    room: int
    reason: str


@dataclass(frozen=True)
class SenderCleared:
    """The scheduler's one cleanup of a room."""

    room: int


@dataclass(frozen=True)
class Connected:
    """A `Connect` ended; `error` is why it failed, or None."""

    peer_id: str
    error: str | None = None


@dataclass(frozen=True)
class WriteEnded:
    """A `Write` ended (or was never started: its room had ended); `failure` is why it
    failed, or None."""

    write: Write
    failure: Failure | None = None
    # It went with a complete notification (`transfer_notification`): decode heard of the
    # room's success from that, and is sent no status for it.
    completed: bool = False


@dataclass(frozen=True)
class PrefillSettings:
    kv_args: KVArgs
    endpoint: str  # this rank's control endpoint (decode answers staging requests there)
    engine: str
    heartbeat_interval_s: float
    peer_timeout_s: float
    request_timeout_s: float
    staging_timeout_s: float
    staging_bytes: int | None = None  # the local staging buffer's size; None: none
    # Write jobs handed out per decode peer at once (to the engine, or waiting for ring
    # space): the next ones are planned and gathered while earlier ones move.
    writes_in_flight: int = 4
    # The engine delivers a write's notification to the peer (NIXL): a room's last write
    # to a decode peer that registered `COMPLETING_NOTIFICATIONS` may then report its success.
    engine_notifies: bool = False

    @property
    def rank(self) -> int:
        return self.kv_args.attn_tp_rank


@dataclass
class DecodePeer:
    registration: Registration
    endpoint: str
    kv_args: KVArgs | None = None
    pairing: Pairing | None = None
    connected: bool = False
    error: Failure | None = None
    # Until when (monotonic) this rank may write to the peer: set from decode's echo of one of
    # this rank's heartbeats, counted from when that heartbeat was sent; 0: never granted.
    lease_until: float = 0.0
    # When this rank last sent the peer a heartbeat out of schedule to renew a lease that ran
    # out (at most one per heartbeat interval).
    renewal_sent_at: float = float("-inf")

    @property
    def token(self) -> bytes:
        return self.registration.session_token


JobKey = tuple[int, int, str]  # room, chunk index, decode peer id


@dataclass(frozen=True)
class _AwaitedStaging:
    request: StagingRequest
    asked_at: float
    src_rows: npt.NDArray[np.int64]
    column: int
    width: int


@dataclass
class _Job:
    """A write job from the moment its chunk is queued until it ended: queued (waiting for
    its turn), then handed out — waiting for decode's ring space (`staging`), or with the
    manager (`write`)."""

    job: ChunkJob
    handed_out: bool = False
    staging: _AwaitedStaging | None = None
    write: Write | None = None
    local: Allocation | None = None  # its space in this rank's staging buffer

    @property
    def key(self) -> JobKey:
        return self.job.room, self.job.chunk_idx, self.job.peer_id


@dataclass
class PrefillStats(RankStats):
    staged_chunks: int = 0
    leases_renewed: int = 0  # rooms whose request deadline a decode lease started again
    staging_fallbacks: int = 0
    # Kept by the manager's worker: where its time goes (seconds) and what it wrote.
    blocks_written: int = 0
    staging_wait_s: float = 0.0
    plan_s: float = 0.0
    gather_s: float = 0.0
    write_s: float = 0.0


class PrefillProtocol(ProtocolCore):
    role = "prefill"
    stats: PrefillStats

    def __init__(self, settings: PrefillSettings) -> None:
        self.settings = settings
        self.rank = settings.rank
        self.stats = PrefillStats()
        self.rooms: dict[int, PrefillRoom] = {}
        # Rooms created by a request with no sender yet, oldest first (a dict keeps the order).
        self._unclaimed: dict[int, None] = {}
        # Rooms by when their request timeout runs out ((room, sequence): the same number may
        # name a later room), and staging asks by when theirs does (by when asked).
        self._request_due: DueQueue[tuple[int, int]] = DueQueue()
        self._staging_due: DueQueue[tuple[float, JobKey]] = DueQueue()
        self._finished: deque[int] = deque(maxlen=FINISHED_ROOMS_KEPT)
        self._finished_set: set[int] = set()
        self.peers: dict[str, DecodePeer] = {}
        self._peer_by_endpoint: dict[str, str] = {}
        self._jobs: dict[JobKey, _Job] = {}
        self._jobs_of_room: dict[int, set[JobKey]] = {}
        # Per decode peer, the queued jobs by (room arrival, chunk, room): a heap, oldest first.
        self._queued: dict[str, list[tuple[int, int, int]]] = {}
        self._out: Counter[str] = Counter()  # jobs handed out, per decode peer
        self._sequence = 0  # rooms created so far: each room's place in the arrival order
        # This rank's staging buffer, shared by the chunks gathered into it while they move.
        usable = (settings.staging_bytes or 0) // RING_ALIGNMENT * RING_ALIGNMENT
        self._local = StagingRing(usable, RING_ALIGNMENT) if usable else None
        self.liveness = Liveness(settings.heartbeat_interval_s, settings.peer_timeout_s)
        self._heartbeats = 0
        self._beats_sent: OrderedDict[int, float] = OrderedDict()  # sequence → when sent
        super().__init__(
            {
                Registration: self._on_registration,
                TransferRequest: self._on_request,
                Abort: self._on_abort,
                Heartbeat: self._on_heartbeat,
                RoomLease: self._on_room_lease,
                StagingResponse: self._on_staging_response,
                Watermark: self._on_watermark,
                SenderOpened: self._on_sender_opened,
                ChunkSubmitted: self._on_chunk_submitted,
                SenderAborted: self._on_sender_aborted,
                SenderCleared: self._on_sender_cleared,
                Connected: self._on_connected,
                WriteEnded: self._on_write_ended,
                Tick: self._on_tick,
            }
        )

    def handle(self, event: object, now: float) -> list[Any]:
        """The actions an event calls for, in the order they must be executed; a message
        from a registered decode peer is also a sign of life."""
        self._heard(event, now)
        return super().handle(event, now)

    # --- queries ---------------------------------------------------------------------------

    def lease_problem(self, peer_id: str, now: float) -> str | None:
        """Why this rank may not write to the peer now (its lease ran out), or None. A plain
        read, safe without the manager's lock: a peer's record is only replaced whole (a new
        registration) and its `lease_until` only grows."""
        peer = self.peers.get(peer_id)
        if peer is not None and now < peer.lease_until:
            return None
        if peer is None or not peer.lease_until:
            return f"decode {peer_id} has not answered a heartbeat (no write lease)"
        return (
            f"the write lease on decode {peer_id} ran out {now - peer.lease_until:.1f} s ago "
            "(not heard from it): this rank stopped writing to it"
        )

    def pages_safe(self, room: int) -> bool:
        """Whether the room's pages can go back to the allocator: the room ended and no write
        of it is in flight (an engine may read them until then)."""
        state = self.rooms.get(room)
        if state is None:
            return True
        return state.status.poll == KVPoll.Success or (
            state.status.poll == KVPoll.Failed and not state.in_flight
        )

    # --- helpers ---------------------------------------------------------------------------

    def _heard(self, event: object, now: float) -> None:
        """Any message from a registered decode peer is a sign of life."""
        sender: str | None = None
        if isinstance(event, (Registration, TransferRequest)):
            sender = event.peer_id
        elif isinstance(event, Heartbeat):
            sender = self._beat_sender(event)
        elif isinstance(event, (StagingResponse, Watermark)):
            sender = event.session_id
        elif isinstance(event, RoomLease):
            sender = self._peer_by_endpoint.get(event.sender_id)
        if sender is not None and sender in self.peers:
            self.liveness.seen(sender, now)

    def _room(self, room: int, now: float) -> PrefillRoom | None:
        """The room's state; created on first use unless it already ended here."""
        state = self.rooms.get(room)
        if state is None and room not in self._finished_set:
            self._sequence += 1
            state = self.rooms[room] = PrefillRoom(
                room,
                created_at=now,
                page_size=self.settings.kv_args.page_size,
                sequence=self._sequence,
            )
            self.stats.rooms_started += 1
            self._unclaimed[room] = None
            self._request_due.push(now + self.settings.request_timeout_s, (room, self._sequence))
            self._request_due.compact(len(self.rooms), self._request_entries)
        return state

    def _room_for_peer(
        self, room: int, peer: DecodePeer, now: float
    ) -> tuple[PrefillRoom | None, list[Action]]:
        """The room a decode peer's message is about, created if new (within the cap of rooms
        that no sender claimed); None, with the message telling the peer why, if there is
        none."""
        state = self.rooms.get(room)
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
            return self._room(room, now), []
        failed = TransferStatus(
            room, KVPoll.Failed, self.rank, reason, peer.token, FailureKind.REFUSED
        )
        self._ignore("%s", reason)
        return None, [Send(peer.endpoint, failed)]

    def _report(self, state: PrefillRoom, also_peer: str | None = None) -> list[Action]:
        """Tell every destination of the room (and `also_peer`) how it ended."""
        peers = set(state.requests) | state.late_askers | ({also_peer} if also_peer else set())
        actions: list[Action] = []
        told = state.completed_by_notification if state.status.poll == KVPoll.Success else set()
        for peer_id in sorted(peers - told):
            peer = self.peers.get(peer_id)
            if peer is None:
                continue
            status = TransferStatus(
                room=state.room,
                status=state.status.poll,
                prefill_rank=self.rank,
                reason=state.status.failure_reason or "",
                session_token=peer.token,
                failure_kind=state.status.failure_kind,
            )
            actions.append(Send(peer.endpoint, status))
        return actions

    def _fail(
        self, state: PrefillRoom, failure: Failure, peer_id: str | None = None
    ) -> list[Action]:
        """Fail the room; tell its destinations (and acknowledge aborts) once nothing of it
        is out — at once if idle, else when its last write ends or decode answers its last
        staging request (decode frees ring space granted to a room when it hears the room
        failed). Its queued jobs are dropped when their turn comes."""
        actions: list[Action] = []
        if state.status.fail(failure.kind, failure.reason):
            log.warning("room %d failed (%s): %s", state.room, failure.kind, failure.reason)
            actions.append(RoomsChanged())
        if peer_id is not None and peer_id not in state.requests:
            actions += self._report(state, also_peer=peer_id)  # a peer it never wrote to
        if state.status.poll != KVPoll.Failed:
            return actions  # it had succeeded: nothing to settle, success was reported
        if not state.in_flight:
            actions += self._settle(state)
        return actions

    def _settle(self, state: PrefillRoom) -> list[Action]:
        """A failed room with nothing out: report it once, acknowledge every abort."""
        self._drop_queued(state.room)
        actions: list[Action] = []
        if not state.failure_reported:
            state.failure_reported = True
            actions += self._report(state)
        for endpoint in sorted(state.pending_acks):
            peer = self._peer_at(endpoint)
            token = peer.token if peer is not None else b""
            actions.append(Send(endpoint, AbortAck(state.room, self.rank, token)))
        state.pending_acks.clear()
        return [*actions, RoomsChanged()]

    def _peer_at(self, endpoint: str) -> DecodePeer | None:
        peer_id = self._peer_by_endpoint.get(endpoint)
        return self.peers.get(peer_id) if peer_id is not None else None

    def _clear(self, room: int) -> list[Action]:
        """The one cleanup path of a room (idempotent). A room cleared before it ended fails
        (its destinations hear so); one with a write still out stays, answering who asks
        about it, until that write ended."""
        state = self.rooms.get(room)
        if state is None:
            return []
        actions: list[Action] = []
        if not state.status.finished:
            reason = f"room {room}: cleared by prefill's scheduler before it ended"
            actions += self._fail(state, Failure(FailureKind.ABORTED, reason))
        if state.in_flight:
            state.cleared = True
            return actions
        self._forget(state)
        return actions

    def _forget(self, state: PrefillRoom) -> None:
        room = state.room
        del self.rooms[room]
        status = state.status
        self.stats.count_finished(status)
        log.debug("room %d: cleared (%s)", room, status.failure_reason or status.poll.name)
        self._unclaimed.pop(room, None)
        self._drop_queued(room)
        if len(self._finished) == self._finished.maxlen:
            self._finished_set.discard(self._finished[0])
        self._finished.append(room)
        self._finished_set.add(room)

    # --- write jobs: queued per decode peer, handed out oldest room first ----------------------

    def _schedule(self, state: PrefillRoom, now: float) -> list[Action]:
        """Queue the jobs of the room's chunks that can start; report success if it came."""
        was = state.status.poll
        try:
            jobs = state.next_jobs()
        except ValueError as exc:
            return self._fail(state, Failure(FailureKind.INTERNAL, str(exc)))
        for job in jobs:
            entry = _Job(job)
            self._jobs[entry.key] = entry
            self._jobs_of_room.setdefault(job.room, set()).add(entry.key)
            heapq.heappush(
                self._queued.setdefault(job.peer_id, []), (state.sequence, job.chunk_idx, job.room)
            )
        actions: list[Action] = [RoomsChanged()] if state.status.poll != was else []
        if state.status.poll == KVPoll.Success and was != KVPoll.Success:
            actions += self._report(state)  # nothing to write (dummy requests only)
        return actions + self._dispatch(now)

    def _dispatch(self, now: float) -> list[Action]:
        """Hand out queued jobs, oldest room first, while a peer has fewer than
        `writes_in_flight` out (and a gathered chunk has room in the staging buffer)."""
        actions: list[Action] = []
        window = self.settings.writes_in_flight
        for peer_id in list(self._queued):
            queued = self._queued[peer_id]
            while queued and self._out[peer_id] < window:
                _, chunk_idx, room = queued[0]
                entry = self._jobs.get((room, chunk_idx, peer_id))
                state = self.rooms.get(room)
                if entry is None or state is None or state.status.finished:
                    heapq.heappop(queued)  # its room ended: nothing of it starts
                    if entry is not None:
                        actions += self._job_ended(entry)
                    continue
                started = self._start(state, entry, now)
                if started is None:
                    break  # no room in the staging buffer until a gathered chunk moved
                heapq.heappop(queued)
                actions += started
            if not queued:
                del self._queued[peer_id]
        return actions

    def _drop_queued(self, room: int) -> None:
        """Forget a room's jobs that were never handed out (their heap entries are skipped
        when their turn comes)."""
        for key in list(self._jobs_of_room.get(room, ())):
            if not self._jobs[key].handed_out:
                self._forget_job(key)

    def _forget_job(self, key: JobKey) -> _Job | None:
        entry = self._jobs.pop(key, None)
        keys = self._jobs_of_room.get(key[0])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._jobs_of_room[key[0]]
        return entry

    def _hand_out(self, state: PrefillRoom, entry: _Job) -> None:
        entry.handed_out = True
        state.job_handed_out()
        self._out[entry.job.peer_id] += 1

    def _job_ended(self, entry: _Job) -> list[Action]:
        """A job ended (written, failed, its staging answered for a room that failed, or
        dropped before it was handed out): its resources go back; a room with nothing out
        any more settles, and a room whose last job ended reports success."""
        if self._forget_job(entry.key) is None:
            return []  # dropped with its failed room already
        if entry.local is not None:
            assert self._local is not None
            self._local.free(entry.local)
        if entry.handed_out:
            self._out[entry.job.peer_id] -= 1
        state = self.rooms.get(entry.job.room)
        if state is None:  # cleared meanwhile
            return [RoomsChanged()]
        was = state.status.poll
        state.job_ended(entry.handed_out)
        if state.status.poll == KVPoll.Failed and not state.in_flight:
            settled = self._settle(state) if entry.handed_out else []
            if state.cleared:
                self._forget(state)
            return settled
        actions: list[Action] = []
        if state.status.poll == KVPoll.Success and was != KVPoll.Success:
            actions += self._report(state)
        return [*actions, RoomsChanged()] if entry.handed_out else actions

    def _start(self, state: PrefillRoom, entry: _Job, now: float) -> list[Action] | None:
        """Hand the job out: a write, or a request for ring space. None when it must wait
        for room in this rank's staging buffer."""
        job = entry.job
        peer = self.peers.get(job.peer_id)
        if peer is None or peer.error is not None or peer.kv_args is None or peer.pairing is None:
            why = peer.error.reason if peer is not None and peer.error else "not connected"
            failure = Failure(FailureKind.ENGINE, f"room {state.room}: {why}")
            return [*self._fail(state, failure), *self._job_ended(entry)]
        if not peer.pairing.stageable:
            self._hand_out(state, entry)
            return [self._write(entry, peer, None)]
        gather = self._gather_for(job, peer)
        if gather is None:  # nothing to gather, or too big for a staging buffer
            self._hand_out(state, entry)
            return [self._write(entry, peer, None)]
        src_rows, dst_rows, column, width, nbytes = gather
        assert self._local is not None
        entry.local = self._local.allocate(nbytes)
        if entry.local is None:
            return None
        self._hand_out(state, entry)
        if peer.pairing.direct:
            staged = StagedChunk(
                src_rows, column, width, nbytes, entry.local.offset, PageRows(dst_rows)
            )
            self.stats.staged_chunks += 1
            return [self._write(entry, peer, staged)]
        request = StagingRequest(
            room=job.room,
            chunk_idx=job.chunk_idx,
            chunk_num_pages=job.src_pages.size,
            session_id=self.settings.endpoint,
            prefill_rank=self.rank,
            nbytes=nbytes,
        )
        entry.staging = _AwaitedStaging(request, now, src_rows, column, width)
        self._staging_due.push(now + self.settings.staging_timeout_s, (now, entry.key))
        self._staging_due.compact(len(self._jobs), self._staging_entries)
        return [Send(peer.endpoint, request)]

    def _write(self, entry: _Job, peer: DecodePeer, staged: StagedChunk | None) -> Write:
        assert peer.kv_args is not None
        assert peer.pairing is not None
        job = entry.job
        notify = notification_for(job.room, self.rank) if job.last else b""
        notify_complete, complete_with = b"", frozenset[int]()
        if (
            job.last
            and not peer.pairing.through_ring
            and COMPLETING_NOTIFICATIONS in peer.registration.capabilities
            and self.settings.engine_notifies
        ):
            notify_complete = notification_for(job.room, self.rank, complete=True)
            complete_with = frozenset(
                chunk_idx
                for room, chunk_idx, peer_id in self._jobs_of_room.get(job.room, ())
                if peer_id == job.peer_id
                and chunk_idx != job.chunk_idx
                and self._jobs[(room, chunk_idx, peer_id)].handed_out
            )
        entry.write = Write(
            job.room,
            job,
            peer.kv_args,
            peer.pairing,
            notify,
            staged,
            notify_complete,
            complete_with,
        )
        return entry.write

    def _gather_for(
        self, job: ChunkJob, peer: DecodePeer
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int, int, int] | None:
        """What gathering the chunk's head slices takes — (source rows, decode's rows, first
        byte, width, bytes) — or None to send it token by token: no staging buffer here (or,
        through the ring, on decode), or the chunk does not fit one."""
        local, peer_args, pairing = self.settings.kv_args, peer.kv_args, peer.pairing
        assert peer_args is not None
        assert pairing is not None
        assert pairing.source is not None
        ring = peer_args.staging_buffer
        if self._local is None or (not pairing.direct and ring is None):
            self.stats.staging_fallbacks += 1
            return None
        token_start = job.page_offset * local.page_size
        src_rows, dst_rows = token_rows(
            job.src_pages,
            local.page_size,
            token_start,
            np.asarray(job.dst_pages, dtype=np.int64),
            peer_args.page_size,
            peer_args.dcp_size,
            peer_args.dcp_rank,
        )
        column, width = pairing.source.columns(local.head_bytes, "src")
        nbytes = staged_size(len(local.kv_buffers), src_rows.size, width)
        too_big = not self._local.fits_ever(nbytes) or (
            not pairing.direct and ring is not None and nbytes > ring.length
        )
        if nbytes == 0 or too_big:
            self.stats.staging_fallbacks += 1
            return None
        return src_rows, dst_rows, column, width, nbytes

    def _on_staging_response(self, answer: StagingResponse, now: float) -> list[Action]:
        entry = self._jobs.get((answer.room, answer.chunk_idx, answer.session_id))
        awaited = entry.staging if entry is not None else None
        if entry is None or awaited is None:  # an answer nobody waits for is never kept
            return self._ignore(
                "staging answer for room %d chunk %d that nobody awaits",
                answer.room,
                answer.chunk_idx,
            )
        entry.staging = None
        self.stats.staging_wait_s += now - awaited.asked_at
        state = self.rooms.get(answer.room)
        if state is None or state.status.finished:
            # It failed meanwhile; decode frees the grant on hearing it.
            return self._job_ended(entry) + self._dispatch(now)
        job, peer = entry.job, self.peers[entry.job.peer_id]
        if answer.never_fits:
            self.stats.staging_fallbacks += 1
            if entry.local is not None and self._local is not None:
                self._local.free(entry.local)
                entry.local = None
            return [self._write(entry, peer, None)]
        assert peer.kv_args is not None
        assert peer.kv_args.staging_buffer is not None
        assert entry.local is not None
        local = self.settings.kv_args
        ready = ChunkReady(
            room=job.room,
            chunk_idx=job.chunk_idx,
            page_start=job.page_offset,
            num_pages=job.src_pages.size,
            session_id=self.settings.endpoint,
            prefill_rank=self.rank,
            token_start=job.page_offset * local.page_size,
            token_count=job.src_pages.size * local.page_size,
        )
        staged = StagedChunk(
            awaited.src_rows,
            awaited.column,
            awaited.width,
            awaited.request.nbytes,
            entry.local.offset,
            RingSpace(peer.kv_args.staging_buffer.ptr + answer.offset, ready),
        )
        self.stats.staged_chunks += 1
        return [self._write(entry, peer, staged)]

    def _on_write_ended(self, ended: WriteEnded, now: float) -> list[Action]:
        job = ended.write.job
        entry = self._jobs.get((job.room, job.chunk_idx, job.peer_id))
        if entry is None or entry.write is not ended.write:
            return []  # not a write this rank handed out
        entry.write = None
        state = self.rooms.get(job.room)
        actions: list[Action] = []
        if state is not None and ended.failure is not None:
            state.status.fail(ended.failure.kind, ended.failure.reason)
        elif state is not None and ended.completed:
            state.completed_by_notification.add(job.peer_id)
        staged = ended.write.staged
        peer = self.peers.get(job.peer_id)
        if (
            state is not None
            and not state.status.finished
            and staged is not None
            and isinstance(staged.destination, RingSpace)
            and peer is not None
        ):  # it landed in the ring: decode may scatter it
            actions.append(Send(peer.endpoint, staged.destination.ready))
        return actions + self._job_ended(entry) + self._dispatch(now)

    # --- messages from decode peers --------------------------------------------------------

    def _on_registration(self, registration: Registration, now: float) -> list[Action]:
        known = self.peers.get(registration.peer_id)
        twin = next(
            (
                other
                for other in self.peers.values()
                if other.registration.engine_descriptor == registration.engine_descriptor
            ),
            None,
        )
        if known is not None:
            # A decode rank registers once; its peer id names one process. A different
            # registration under a known id is someone else's; the same one again means decode
            # forgot this rank (it declared it dead): a heartbeat now renews the write lease.
            if known.registration != registration:
                return self._ignore(
                    "a changed registration for known decode %s", registration.peer_id
                )
            return self._heartbeats_to([known], now)
        if twin is not None or len(self.peers) >= MAX_DECODE_PEERS:
            return self._ignore(
                "registration of %s: %s",
                registration.peer_id[:100],
                "engine endpoint already registered by " + twin.registration.peer_id
                if twin
                else f"{MAX_DECODE_PEERS} decode peers already",
            )
        endpoint = tcp_endpoint(registration.host, registration.control_port)
        peer = DecodePeer(registration, endpoint)
        try:
            peer.kv_args = kv_args_of(registration)
            peer.pairing = pair(self.settings.kv_args, peer.kv_args)
        except (GeometryError, PlanError) as exc:
            reason = f"decode {registration.peer_id} cannot be served: {exc}"
            peer.error = Failure(FailureKind.INCOMPATIBLE, reason)
            log.error("%s", reason)
        if registration.engine != self.settings.engine:
            peer.error = Failure(
                FailureKind.INCOMPATIBLE,
                f"decode {registration.peer_id} uses engine {registration.engine}, this prefill "
                f"rank {self.settings.engine}",
            )
        self.peers[registration.peer_id] = peer
        self._peer_by_endpoint[endpoint] = registration.peer_id
        self.liveness.seen(registration.peer_id, now)
        actions = self._heartbeats_to([peer], now)  # its echo grants the first lease
        if peer.error is None and peer.kv_args is not None:
            actions.append(
                Connect(registration.peer_id, registration.engine_descriptor, peer.kv_args)
            )
        return actions

    def _on_connected(self, event: Connected, now: float) -> list[Action]:
        peer = self.peers.get(event.peer_id)
        if peer is None:
            return []
        if event.error is None:
            peer.connected = True
            return []
        reason = f"cannot connect to decode {event.peer_id}: {event.error}"
        peer.error = Failure(FailureKind.ENGINE, reason)
        log.error("%s", reason)
        return []

    def _on_request(self, message: TransferRequest, now: float) -> list[Action]:
        peer = self.peers.get(message.peer_id)
        if peer is None:  # creates nothing: anyone can send a request
            return self._ignore(
                "request for room %d from unregistered decode %s",
                message.room,
                message.peer_id[:100],
            )
        state, actions = self._room_for_peer(message.room, peer, now)
        if state is None:
            return actions
        if state.status.finished and state.in_flight:
            state.late_askers.add(peer.registration.peer_id)  # told once nothing is in flight
            return []
        if state.status.finished:
            # A room id is used once: a second request for an ended room gets the answer at
            # once rather than silence until decode's deadline.
            ended = state.status.failure_reason or f"it ended ({state.status.poll})"
            reason = f"room {message.room} already ended on prefill rank {self.rank}: {ended}"
            failed = TransferStatus(
                message.room, KVPoll.Failed, self.rank, reason, peer.token, FailureKind.REFUSED
            )
            return [Send(peer.endpoint, failed)]
        if peer.error:
            failure = Failure(peer.error.kind, f"room {message.room}: {peer.error.reason}")
            return self._fail(state, failure, message.peer_id)
        dst = peer.kv_args
        sizes = (dst.page_size, dst.dcp_size) if dst is not None else (1, 1)
        problem = state.request_problem(message, *sizes)
        if problem is not None:
            return self._fail(state, Failure(FailureKind.INCOMPATIBLE, problem), message.peer_id)
        state.on_request(message)
        log.debug(
            "room %d: %s from decode %s, %d page(s)",
            message.room,
            "dummy request" if message.is_dummy else "request",
            message.peer_id,
            len(message.dst_kv_indices),
        )
        return self._renew_lease(peer, now) + self._schedule(state, now)

    def _renew_lease(self, peer: DecodePeer, now: float) -> list[Action]:
        """A heartbeat now, out of schedule, to a peer that asks for a write while the lease
        on it ran out (this rank or the peer stalled, or the link did): its echo renews the
        lease within a round trip, where the next scheduled heartbeat could be an interval
        away and the write waits for it. At most one per heartbeat interval."""
        if not peer.lease_until or now < peer.lease_until:
            return []  # never granted (registration's heartbeat is on its way), or valid
        if now - peer.renewal_sent_at < self.settings.heartbeat_interval_s:
            return []
        peer.renewal_sent_at = now
        return self._heartbeats_to([peer], now)

    def _on_abort(self, message: Abort, now: float) -> list[Action]:
        endpoint = tcp_endpoint(message.decode_ip, message.decode_port)
        state = self.rooms.get(message.room)
        # Only a decode peer of this room (or, before its request, any registered peer) may
        # end it.
        askers = {self.peers[p].endpoint for p in state.requests} if state else set()
        peer = self._peer_at(endpoint)
        if peer is None or (askers and endpoint not in askers):
            return self._ignore(
                "abort of room %d from %s, not a decode peer of it", message.room, endpoint
            )
        actions: list[Action] = []
        if state is None:  # aborted before its request (or its sender): it starts failed
            state, actions = self._room_for_peer(message.room, peer, now)
        if state is None or state.status.poll == KVPoll.Success:
            # Nothing of this room can be in flight: confirm at once.
            return [*actions, Send(endpoint, AbortAck(message.room, self.rank, peer.token))]
        state.pending_acks.add(endpoint)
        why = message.reason or "no reason given"
        reason = f"room {message.room}: aborted by decode: {why}"
        return self._fail(state, Failure(FailureKind.ABORTED, reason))

    def _beat_sender(self, message: Heartbeat) -> str | None:
        """The decode peer a heartbeat is from: its sender_id is the sender's control
        endpoint (a kvbridge/1.1 decode rank sent its peer id instead)."""
        peer_id = self._peer_by_endpoint.get(message.sender_id, message.sender_id)
        return peer_id if peer_id in self.peers else None

    def _on_heartbeat(self, message: Heartbeat, now: float) -> list[Action]:
        """Decode's heartbeat echoes the last of ours it heard: the write lease runs from when
        that one was sent (a heartbeat read late, after a stall, extends nothing)."""
        peer_id = self._beat_sender(message)
        peer = self.peers.get(peer_id) if peer_id is not None else None
        sent = self._beats_sent.get(message.ack_sequence) if message.ack_sequence else None
        if peer is not None and sent is not None:
            peer.lease_until = max(peer.lease_until, sent + message.lease_ms / 1000)
        return []

    def _on_room_lease(self, message: RoomLease, now: float) -> list[Action]:
        """Decode will still ask for these rooms: their request deadlines start again. Only
        from a registered decode peer, and only for rooms no request reached yet (a lease
        keeps nothing alive once decode asked: liveness does)."""
        if self._peer_at(message.sender_id) is None:
            return self._ignore(
                "room lease from %s, not a registered decode peer", message.sender_id
            )
        for room in message.rooms:
            state = self.rooms.get(room)
            if state is not None and not state.status.finished and not state.requests:
                state.renewed_at = now
                self.stats.leases_renewed += 1
        return []

    def _on_watermark(self, message: Watermark, now: float) -> list[Action]:
        # kvbridge decode ranks before native 1.2 sent one after each scatter; it carries
        # nothing this side needs (ring space is granted explicitly), only a sign of life.
        return []

    def _heartbeats_to(self, peers: Sequence[DecodePeer], now: float) -> list[Action]:
        self._heartbeats += 1
        self._beats_sent[self._heartbeats] = now
        while len(self._beats_sent) > MAX_BEATS_REMEMBERED:
            self._beats_sent.popitem(last=False)
        lease_ms = int(self.settings.peer_timeout_s * 1000)
        endpoint, sequence = self.settings.endpoint, self._heartbeats
        beats = [
            (peer, Heartbeat(endpoint, sequence, lease_ms, session_token=peer.token))
            for peer in peers
        ]
        return [Send(peer.endpoint, beat) for peer, beat in beats]

    # --- the scheduler's rooms -------------------------------------------------------------

    def _on_sender_opened(self, event: SenderOpened, now: float) -> list[Action]:
        state = self._room(event.room, now)
        if state is not None:
            state.claimed = True
            self._unclaimed.pop(event.room, None)
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
        return self._fail(
            state, Failure(FailureKind.ABORTED, f"aborted by prefill: {event.reason}")
        )

    def _on_sender_cleared(self, event: SenderCleared, now: float) -> list[Action]:
        return self._clear(event.room)

    # --- time --------------------------------------------------------------------------------

    def _on_tick(self, tick: Tick, now: float) -> list[Action]:
        """Heartbeats to every decode peer; deadlines; rooms of peers that fell silent fail."""
        settings = self.settings
        actions: list[Action] = []
        if self.liveness.heartbeat_due(now):
            actions += self._heartbeats_to(list(self.peers.values()), now)
        timeout_s = settings.request_timeout_s
        still_open: list[tuple[float, tuple[int, int]]] = []
        for due, (room, sequence) in self._request_due.pop_due(now):
            state = self.rooms.get(room)
            if state is None or state.sequence != sequence or state.status.finished:
                continue  # gone, or ended: nothing to wait for
            if state.request_overdue(now, timeout_s):
                got, wanted = len(state.requests), state.required_requests or "any"
                renewed = " since decode's last lease renewal" if state.renewed_at else ""
                reason = (
                    f"room {state.room}: {got} of {wanted} transfer request(s) from "
                    f"decode in {timeout_s:g} s{renewed}"
                )
                actions += self._fail(state, Failure(FailureKind.TIMEOUT, reason))
            elif not state.ready:  # decode renewed its lease: due again when that runs out
                still_open.append((state.request_deadline(timeout_s), (room, sequence)))
            else:  # it has its requests; a later one may still ask for more: looked at again
                still_open.append((due, (room, sequence)))
        for due, room_key in still_open:
            self._request_due.push(due, room_key)
        # Rooms that decode asked for and the scheduler never started: nobody will clear them,
        # so they fail (decode hears why) and leave the table.
        while self._unclaimed:
            room = next(iter(self._unclaimed))
            if not self.rooms[room].claim_overdue(now, timeout_s):
                break
            reason = (
                f"room {room}: prefill rank {self.rank} was not given this room "
                f"within {timeout_s:g} s of decode's request"
            )
            actions += self._fail(self.rooms[room], Failure(FailureKind.TIMEOUT, reason))
            actions += self._clear(room)
        for _, (asked_at, key) in self._staging_due.pop_due(now):
            entry = self._jobs.get(key)
            if entry is None or entry.staging is None or entry.staging.asked_at != asked_at:
                continue  # answered, ended, or asked again since
            entry.staging = None
            job = entry.job
            reason = (
                f"room {job.room}: decode {job.peer_id} gave no staging space for chunk "
                f"{job.chunk_idx} in {settings.staging_timeout_s:g} s"
            )
            waiting_room = self.rooms.get(job.room)
            if waiting_room is not None:
                actions += self._fail(waiting_room, Failure(FailureKind.TIMEOUT, reason))
            actions += self._job_ended(entry)
        if actions:
            actions += self._dispatch(now)
        for peer_id, silent_s in self.liveness.expired(now):
            actions += self._peer_dead(peer_id, silent_s)
        return actions

    def _request_entries(self) -> Iterator[tuple[float, tuple[int, int]]]:
        timeout_s = self.settings.request_timeout_s
        for state in self.rooms.values():
            if not state.status.finished:
                yield state.request_deadline(timeout_s), (state.room, state.sequence)

    def _staging_entries(self) -> Iterator[tuple[float, tuple[float, JobKey]]]:
        timeout_s = self.settings.staging_timeout_s
        for key, entry in self._jobs.items():
            if entry.staging is not None:
                yield entry.staging.asked_at + timeout_s, (entry.staging.asked_at, key)

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
            actions += self._fail(state, failure)
        awaiting = [
            entry
            for entry in self._jobs.values()
            if entry.staging is not None and entry.job.peer_id == peer_id
        ]
        for entry in awaiting:
            entry.staging = None  # it will never answer
            actions += self._job_ended(entry)
        if affected:
            log.warning("%s: %d room(s) failed", reason, len(affected))
        else:
            log.info("%s", reason)
        return actions


def plan_write(
    local: KVArgs, write: Write, staging_ptr: int, memory: PlanMemory = FRESH
) -> TransferPlan:
    """A job's blocks: its KV (from the staging buffer when gathered: one block into decode's
    ring, or runs of decode's token rows; else planned over the caches) plus, with the last
    chunk, the aux and state slots. `staging_ptr` is this rank's staging buffer."""
    job, peer_args, staged = write.job, write.peer_args, write.staged
    if staged is not None and isinstance(staged.destination, RingSpace):
        kv_plan = TransferPlan(
            np.array([staging_ptr + staged.local_offset], dtype=np.uint64),
            np.array([staged.destination.ptr], dtype=np.uint64),
            np.array([staged.nbytes], dtype=np.uint64),
        )
    elif staged is not None:
        assert write.pairing.source is not None
        assert isinstance(staged.destination, PageRows)
        gathered_at = staging_ptr + staged.local_offset
        kv_plan = plan_gathered(
            local, peer_args, write.pairing.source, gathered_at, staged.destination.rows, memory
        )
    else:
        kv_plan = write.pairing.plan(
            local, peer_args, job.src_pages, job.page_offset, job.dst_pages, memory
        )
    plans = [kv_plan]
    if job.last and job.src_aux_index is not None and job.dst_aux_index is not None:
        plans.append(
            plan_slots(
                local.aux_buffers,
                peer_args.aux_buffers,
                job.src_aux_index,
                job.dst_aux_index,
                "aux",
            )
        )
    if job.last and job.src_state_indices:
        if len(job.src_state_indices) != len(job.dst_state_indices):
            raise PlanError(
                f"{len(job.src_state_indices)} local state slots but decode gave "
                f"{len(job.dst_state_indices)}"
            )
        equal_tp = local.attn_tp_size == peer_args.attn_tp_size
        route = write.pairing.topology.route(peer_args.attn_tp_rank)
        senders = tuple(source.prefill_rank for source in route.sources)  # not the dummies
        for src_slot, dst_slot in zip(job.src_state_indices, job.dst_state_indices, strict=True):
            if equal_tp:  # whole slots
                plans.append(
                    plan_slots(
                        local.state_buffers, peer_args.state_buffers, src_slot, dst_slot, "state"
                    )
                )
            else:  # this rank's shard of each slot
                plans.append(plan_state_slices(local, peer_args, src_slot, dst_slot, senders))
    if len(plans) == 1:
        return kv_plan
    plan = TransferPlan.concat(*plans, memory=memory)
    if isinstance(memory, PlanArena):
        memory.give_back(kv_plan)  # copied into `plan`
    return plan
