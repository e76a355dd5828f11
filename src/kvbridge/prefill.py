"""Prefill side: `PrefillManager` (one per prefill rank) and `KVSender` (one per room).

Decode ranks register their memory once (a native `Registration`), then send one
`TransferRequest` per room. The scheduler calls `KVSender.send()` with each chunk of pages it
has computed (chunked prefill; the last chunk carries the aux slot and state slots). A worker
thread plans each chunk and writes it through the engine; when the last chunk has landed, the
room's outcome goes to every destination as a `TransferStatus`, with the reason on failure.

Threads: the control channel's thread owns the sockets and handles incoming messages; one
worker thread owns every engine call. They meet in the room objects (under one lock) and the
worker's queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np
import numpy.typing as npt

from kvbridge.cache import GeometryError, KVArgs, PlanError, TransferPlan, plan_slots
from kvbridge.cache.peer import kv_args_of, memory_regions
from kvbridge.cache.plan import Pairing, pair, plan_state_slices, token_rows
from kvbridge.config import ManagerConfig
from kvbridge.control.bootstrap import (
    BootstrapServer,
    LeaseRenewer,
    PrefillRank,
    register_prefill,
)
from kvbridge.control.channel import ControlChannel
from kvbridge.core.liveness import Liveness
from kvbridge.core.room import Chunk, ChunkJob, Failure, PrefillRoom, notification_for
from kvbridge.engines import EngineError, WriteFenced, create_engine
from kvbridge.metrics import ManagerMetrics, Snapshot, count_finished
from kvbridge.staging import staged_size
from kvbridge.staging.buffer import StagingBuffer, StagingUnavailable, open_staging
from kvbridge.wire import (
    Abort,
    AbortAck,
    ChunkReady,
    FailureKind,
    Heartbeat,
    KVPoll,
    Message,
    Registration,
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
# How long the worker sleeps between polls of a write in flight. A polling loop that never
# sleeps keeps the GIL: the process's other threads (the control channel sending statuses,
# vLLM's engine step) then wait up to Python's 5 ms switch interval for each turn. Measured in
# vLLM (8 × 1k-token loads): time until decode's KV is in place 35-50 ms → 23-33 ms.
WRITE_POLL_S = 0.0001


class StagingTimeout(RuntimeError):
    """Decode gave no ring space for a staged chunk in time."""


@dataclass(frozen=True)
class _Connect:
    peer_id: str


@dataclass(frozen=True)
class _WriteChunk:
    room: int
    jobs: list[ChunkJob]


def _kind_of(exc: Exception) -> FailureKind:
    """The failure kind of what the write path raised."""
    if isinstance(exc, WriteFenced):  # the lease ran out: decode was not heard from
        return FailureKind.PEER_DEAD
    if isinstance(exc, EngineError):
        return FailureKind.ENGINE
    if isinstance(exc, StagingTimeout):
        return FailureKind.TIMEOUT
    if isinstance(exc, PlanError):
        return FailureKind.INCOMPATIBLE
    return FailureKind.INTERNAL


def _sender_of(message: Message) -> str | None:
    """The decode peer a message comes from, where the message says."""
    if isinstance(message, (Registration, TransferRequest)):
        return message.peer_id
    if isinstance(message, (Heartbeat, StagingResponse, Watermark)):
        return message.sender_id if isinstance(message, Heartbeat) else message.session_id
    return None


@dataclass
class PrefillStats:
    peers_declared_dead: int = 0
    rooms_started: int = 0
    rooms_finished: dict[tuple[str, str], int] = field(default_factory=dict)
    staged_chunks: int = 0
    staging_fallbacks: int = 0
    watermarks: int = 0
    # Where the worker's time goes (seconds): waiting for ring space, gathering, planning,
    # writing.
    blocks_written: int = 0
    staging_wait_s: float = 0.0
    plan_s: float = 0.0
    gather_s: float = 0.0
    write_s: float = 0.0


@dataclass
class _DecodePeer:
    registration: Registration
    endpoint: str
    kv_args: KVArgs | None = None
    pairing: Pairing | None = None
    engine_peer: str | None = None
    error: Failure | None = None
    # Until when (monotonic) this rank may write to the peer: set from decode's echo of one of
    # this rank's heartbeats, counted from when that heartbeat was sent; 0: never granted.
    lease_until: float = 0.0

    @property
    def token(self) -> bytes:
        return self.registration.session_token


class PrefillManager:
    def __init__(self, kv_args: KVArgs, config: ManagerConfig) -> None:
        if config.bootstrap_url is None and not config.run_bootstrap:
            raise ValueError("a prefill manager needs bootstrap_url or run_bootstrap")
        self.kv_args = kv_args
        self.config = config
        self.rank = kv_args.attn_tp_rank
        self.engine = create_engine(
            config.engine, f"prefill-{self.rank}-{uuid.uuid4().hex[:8]}", config.host,
            config.engine_options,
        )  # fmt: skip
        self.engine.register(memory_regions(kv_args))
        self.stats = PrefillStats()
        config.warn_if_exposed(log, "prefill")
        # The local staging buffer: the worker gathers one chunk at a time into it.
        self._staging: StagingBuffer | None = None
        if config.staging:
            try:
                self._staging = open_staging(kv_args, config.staging_bytes, config.staging_kernels)
            except StagingUnavailable as exc:
                log.warning("staging path off, chunks go token by token: %s", exc)
            else:
                self.engine.register([self._staging.region])
        self._staging_answers: dict[tuple[str, int, int], StagingResponse] = {}
        self._staging_awaited: set[tuple[str, int, int]] = set()
        self._staging_answered = threading.Condition()
        self._lock = threading.Lock()
        # Set whenever a room may have ended or its pages come free: what an owner waiting for
        # that waits on (a vLLM engine step with nothing to compute); may be set spuriously.
        self.activity = threading.Event()
        self._rooms: dict[int, PrefillRoom] = {}
        # Rooms created by a request with no sender yet, oldest first (a dict keeps the order).
        self._unclaimed: dict[int, None] = {}
        self._finished: deque[int] = deque(maxlen=FINISHED_ROOMS_KEPT)
        self._finished_set: set[int] = set()
        self._peers: dict[str, _DecodePeer] = {}
        self._jobs: queue.SimpleQueue[_Connect | _WriteChunk | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._run_worker, name="kvbridge-prefill-worker")
        self._worker.daemon = True
        self._liveness = Liveness(config.heartbeat_interval_s, config.peer_timeout_s)
        self._heartbeats = 0
        self._beats_sent: OrderedDict[int, float] = OrderedDict()  # sequence → when sent
        self.channel = ControlChannel(
            config.host, self._on_message, self._on_tick, name="kvbridge-prefill",
            secret=config.secret,
        )  # fmt: skip
        self.written_plans: list[tuple[str, TransferPlan]] = []
        self.bootstrap: BootstrapServer | None = None
        self._lease: LeaseRenewer | None = None
        self.metrics = ManagerMetrics("prefill", self.rank, self._metrics_snapshot)
        self._worker.start()
        self.channel.start()
        try:
            if config.metrics_port is not None:
                self.metrics.serve(config.host, config.metrics_port)
            if config.run_bootstrap:
                self.bootstrap = BootstrapServer(
                    config.host, config.bootstrap_port, secret=config.secret
                ).start()
            self.bootstrap_url = self.bootstrap.url if self.bootstrap else str(config.bootstrap_url)
            rank = PrefillRank(
                self.rank, kv_args.attn_tp_size, config.host, self.channel.port, config.engine
            )
            lease_s = register_prefill(
                self.bootstrap_url, rank, timeout_s=config.bootstrap_timeout_s,
                secret=config.secret, wait_out_conflicts=True,
            )  # fmt: skip
            self._lease = LeaseRenewer(self.bootstrap_url, rank, lease_s, config.secret)
        except BaseException:
            self.close()  # no thread, socket or registration left behind
            raise

    # --- scheduler side ------------------------------------------------------------------

    def sender(self, room: int) -> KVSender:
        return KVSender(self, room)

    def _room(self, room: int, create: bool, claim: bool = False) -> PrefillRoom | None:
        """The room's state; created on first use unless it already ended here. `claim`: the
        scheduler's sender owns it (a room only a request created is unclaimed)."""
        state = self._rooms.get(room)
        if state is None and create and room not in self._finished_set:
            state = self._rooms[room] = PrefillRoom(
                room, created_at=time.monotonic(), page_size=self.kv_args.page_size
            )
            self.stats.rooms_started += 1
            self._unclaimed[room] = None
        if state is not None and claim:
            state.claimed = True
            self._unclaimed.pop(room, None)
        return state

    def _ignore(self, why: str, *args: object) -> None:
        """A well-formed message this rank does not act on: counted, logged at DEBUG."""
        self.channel.stats.ignored += 1
        log.debug("ignored: " + why, *args)

    def _metrics_snapshot(self) -> Snapshot:
        with self._lock:
            rooms = Counter(state.status.poll.name for state in self._rooms.values())
            finished = dict(self.stats.rooms_finished)
        counters = {
            **{f"channel_{k}": v for k, v in asdict(self.channel.stats).items()},
            "peers_declared_dead": self.stats.peers_declared_dead,
            "heartbeats_missed": self._liveness.missed_heartbeats,
            "rooms_started": self.stats.rooms_started,
            "staged_chunks": self.stats.staged_chunks,
            "staging_fallbacks": self.stats.staging_fallbacks,
            "blocks_written": self.stats.blocks_written,
        }
        return Snapshot(counters, dict(rooms), finished)

    def _clear(self, room: int) -> None:
        """The one cleanup path of a room (idempotent)."""
        with self._lock:
            self._clear_locked(room)

    def _clear_locked(self, room: int) -> None:
        state = self._rooms.pop(room, None)
        if state is None:
            return
        status = state.status
        count_finished(self.stats.rooms_finished, status)
        log.debug("room %d: cleared (%s)", room, status.failure_reason or status.poll.name)
        self._unclaimed.pop(room, None)
        if len(self._finished) == self._finished.maxlen:
            self._finished_set.discard(self._finished[0])
        self._finished.append(room)
        self._finished_set.add(room)

    # --- control thread --------------------------------------------------------------------

    def _on_message(self, message: Message) -> None:
        sender = _sender_of(message)
        if sender is not None:
            with self._lock:
                known = sender in self._peers
            if known:
                self._liveness.seen(sender, time.monotonic())
        if isinstance(message, Heartbeat):
            self._on_heartbeat(message)
            return
        if isinstance(message, Registration):
            self._on_registration(message)
        elif isinstance(message, TransferRequest):
            self._on_request(message)
        elif isinstance(message, StagingResponse):
            with self._staging_answered:
                key = (message.session_id, message.room, message.chunk_idx)
                awaited = key in self._staging_awaited
                if awaited:  # an answer nobody waits for is never kept
                    self._staging_answers[key] = message
                    self._staging_answered.notify_all()
            if not awaited:
                self._ignore("staging answer for room %d chunk %d that nobody awaits",
                             message.room, message.chunk_idx)  # fmt: skip
        elif isinstance(message, Watermark):
            self.stats.watermarks += 1
        elif isinstance(message, Abort):
            self._on_abort(message)
        else:
            log.warning("unexpected %s on a prefill rank, ignored", type(message).__name__)

    def _room_for_peer_locked(self, room: int, peer: _DecodePeer) -> PrefillRoom | None:
        """The room a decode peer's message is about, created if new (within the cap of rooms
        that no sender claimed); None, after telling the peer why, if there is none."""
        state = self._rooms.get(room)
        if state is not None:
            return state
        if room in self._finished_set:
            reason = f"room {room} already ended on prefill rank {self.rank}"
        elif len(self._unclaimed) >= MAX_UNCLAIMED_ROOMS:
            reason = (f"prefill rank {self.rank} holds {MAX_UNCLAIMED_ROOMS} rooms that no "
                      "scheduler started; refused")  # fmt: skip
        else:
            return self._room(room, create=True)
        failed = TransferStatus(
            room, KVPoll.Failed, self.rank, reason, peer.token, FailureKind.REFUSED
        )
        self.channel.send(peer.endpoint, failed)
        self._ignore("%s", reason)
        return None

    def _peer_at(self, endpoint: str) -> _DecodePeer | None:
        """The registered decode peer whose control endpoint this is."""
        return next((peer for peer in self._peers.values() if peer.endpoint == endpoint), None)

    def _token_at(self, endpoint: str) -> bytes:
        peer = self._peer_at(endpoint)
        return peer.token if peer is not None else b""

    def _on_request(self, message: TransferRequest) -> None:
        with self._lock:
            peer = self._peers.get(message.peer_id)
            if peer is None:  # creates nothing: anyone can send a request
                self._ignore("request for room %d from unregistered decode %s",
                             message.room, message.peer_id[:100])  # fmt: skip
                return
            state = self._room_for_peer_locked(message.room, peer)
            if state is None:
                return
            if state.status.finished:
                # A room id is used once: a second request for an ended room gets the answer
                # at once rather than silence until decode's deadline.
                ended = state.status.failure_reason or f"it ended ({state.status.poll})"
                reason = f"room {message.room} already ended on prefill rank {self.rank}: {ended}"
                failed = TransferStatus(
                    message.room, KVPoll.Failed, self.rank, reason, peer.token,
                    FailureKind.REFUSED,
                )  # fmt: skip
                self.channel.send(peer.endpoint, failed)
                return
            if peer.error:
                failure = Failure(peer.error.kind, f"room {message.room}: {peer.error.reason}")
                self._fail_locked(state, failure, message.peer_id)
                return
            dst = peer.kv_args
            problem = state.prefix_problem(message, dst.page_size * dst.dcp_size if dst else 1)
            if problem is not None:
                self._fail_locked(state, Failure(FailureKind.INCOMPATIBLE, problem),
                                  message.peer_id)  # fmt: skip
                return
            state.on_request(message)
            self._schedule_locked(state)
        log.debug("room %d: %s from decode %s, %d page(s)", message.room,
                  "dummy request" if message.is_dummy else "request", message.peer_id,
                  len(message.dst_kv_indices))  # fmt: skip

    def _on_abort(self, message: Abort) -> None:
        endpoint = tcp_endpoint(message.decode_ip, message.decode_port)
        with self._lock:
            state = self._rooms.get(message.room)
            # Only a decode peer of this room (or, before its request, any registered peer)
            # may end it.
            askers = {self._peers[p].endpoint for p in state.requests} if state else set()
            peer = self._peer_at(endpoint)
            if peer is None or (askers and endpoint not in askers):
                self._ignore("abort of room %d from %s, not a decode peer of it",
                             message.room, endpoint)  # fmt: skip
                return
            if state is None:  # aborted before its request (or its sender): it starts failed
                state = self._room_for_peer_locked(message.room, peer)
            if state is None or state.status.poll == KVPoll.Success:
                # Nothing of this room can be in flight: confirm at once.
                self.channel.send(endpoint, AbortAck(message.room, self.rank, peer.token))
                return
            state.pending_acks.add(endpoint)
            why = message.reason or "no reason given"
            reason = f"room {message.room}: aborted by decode: {why}"
            self._fail_locked(state, Failure(FailureKind.ABORTED, reason))

    def _on_heartbeat(self, message: Heartbeat) -> None:
        """Decode's heartbeat echoes the last of ours it heard: the write lease runs from when
        that one was sent (a heartbeat read late, after a stall, extends nothing)."""
        with self._lock:
            peer = self._peers.get(message.sender_id)
        sent = self._beats_sent.get(message.ack_sequence) if message.ack_sequence else None
        if peer is None or sent is None:
            return
        peer.lease_until = max(peer.lease_until, sent + message.lease_ms / 1000)

    def _send_heartbeats(self, now: float, peers: list[_DecodePeer]) -> None:
        self._heartbeats += 1
        self._beats_sent[self._heartbeats] = now
        while len(self._beats_sent) > MAX_BEATS_REMEMBERED:
            self._beats_sent.popitem(last=False)
        lease_ms = int(self.config.peer_timeout_s * 1000)
        for peer in peers:
            beat = Heartbeat(self.channel.endpoint, self._heartbeats, lease_ms,
                             session_token=peer.token)  # fmt: skip
            self.channel.send(peer.endpoint, beat)

    def _lease_problem(self, peer_id: str, peer: _DecodePeer) -> str | None:
        """Why this rank may not write to the peer now (its lease ran out), or None."""
        now = time.monotonic()
        if now < peer.lease_until:
            return None
        if not peer.lease_until:
            return f"decode {peer_id} has not answered a heartbeat (no write lease)"
        return (
            f"the write lease on decode {peer_id} ran out {now - peer.lease_until:.1f} s ago "
            "(not heard from it): this rank stopped writing to it"
        )

    def _await_lease(self, peer_id: str, peer: _DecodePeer) -> str | None:
        """Wait (up to one peer timeout) for a valid write lease: a peer that just registered,
        or registered again after a partition, answers a heartbeat within a round trip. Why
        there is none, or None."""
        deadline = time.monotonic() + self.config.peer_timeout_s
        while (why := self._lease_problem(peer_id, peer)) is not None:
            if time.monotonic() >= deadline:
                return why
            time.sleep(0.002)
        return None

    def _on_tick(self) -> bool:
        """Heartbeats to every decode peer; rooms of peers that fell silent fail."""
        now = time.monotonic()
        with self._lock:
            peers = list(self._peers.values())
            in_flight = any(not state.status.finished for state in self._rooms.values())
        if self._liveness.heartbeat_due(now):
            self._send_heartbeats(now, peers)
        timeout_s = self.config.request_timeout_s
        with self._lock:
            for state in self._rooms.values():
                if state.request_overdue(now, timeout_s):
                    got, wanted = len(state.requests), state.required_requests or "any"
                    reason = (f"room {state.room}: {got} of {wanted} transfer request(s) from "
                              f"decode in {timeout_s:g} s")  # fmt: skip
                    self._fail_locked(state, Failure(FailureKind.TIMEOUT, reason))
            # Rooms that decode asked for and the scheduler never started: nobody will clear
            # them, so they fail (decode hears why) and leave the table.
            while self._unclaimed:
                room = next(iter(self._unclaimed))
                if not self._rooms[room].claim_overdue(now, timeout_s):
                    break
                reason = (f"room {room}: prefill rank {self.rank} was not given this room "
                          f"within {timeout_s:g} s of decode's request")  # fmt: skip
                self._fail_locked(self._rooms[room], Failure(FailureKind.TIMEOUT, reason))
                self._clear_locked(room)
        for peer_id, silent_s in self._liveness.expired(now):
            self.stats.peers_declared_dead += 1
            reason = (
                f"decode {peer_id} silent for {silent_s:.1f} s (peer timeout "
                f"{self.config.peer_timeout_s:g} s)"
            )
            with self._lock:
                affected = [
                    state
                    for state in self._rooms.values()
                    if peer_id in state.requests and not state.status.finished
                ]
                for state in affected:
                    failure = Failure(FailureKind.PEER_DEAD, f"room {state.room}: {reason}")
                    self._fail_locked(state, failure)
            if affected:
                log.warning("%s: %d room(s) failed", reason, len(affected))
            else:
                log.info("%s", reason)
        return in_flight

    def _on_registration(self, registration: Registration) -> None:
        endpoint = tcp_endpoint(registration.host, registration.control_port)
        with self._lock:
            known = self._peers.get(registration.peer_id)
            twin = next((other for other in self._peers.values()
                         if other.registration.engine_descriptor
                         == registration.engine_descriptor), None)  # fmt: skip
            full = known is None and len(self._peers) >= MAX_DECODE_PEERS
        if known is not None:
            # A decode rank registers once; its peer id names one process. A different
            # registration under a known id is someone else's; the same one again means decode
            # forgot this rank (it declared it dead): a heartbeat now renews the write lease.
            if known.registration != registration:
                self._ignore("a changed registration for known decode %s", registration.peer_id)
            else:
                self._send_heartbeats(time.monotonic(), [known])
            return
        if twin is not None or full:
            self._ignore("registration of %s: %s", registration.peer_id[:100],
                         "engine endpoint already registered by " + twin.registration.peer_id
                         if twin else f"{MAX_DECODE_PEERS} decode peers already")  # fmt: skip
            return
        peer = _DecodePeer(registration, endpoint)
        try:
            peer.kv_args = kv_args_of(registration)
            peer.pairing = pair(self.kv_args, peer.kv_args)
        except (GeometryError, PlanError) as exc:
            reason = f"decode {registration.peer_id} cannot be served: {exc}"
            peer.error = Failure(FailureKind.INCOMPATIBLE, reason)
            log.error("%s", reason)
        if registration.engine != self.config.engine:
            peer.error = Failure(
                FailureKind.INCOMPATIBLE,
                f"decode {registration.peer_id} uses engine {registration.engine}, this prefill "
                f"rank {self.config.engine}",
            )
        with self._lock:
            self._peers[registration.peer_id] = peer
        self._liveness.seen(registration.peer_id, time.monotonic())
        self._send_heartbeats(time.monotonic(), [peer])  # its echo grants the first lease
        if peer.error is None:
            self._jobs.put(_Connect(registration.peer_id))

    def _schedule_locked(self, state: PrefillRoom) -> None:
        try:
            jobs = state.next_jobs()
        except ValueError as exc:
            self._fail_locked(state, Failure(FailureKind.INTERNAL, str(exc)))
            return
        if jobs:
            self._jobs.put(_WriteChunk(state.room, jobs))
        elif state.status.poll == KVPoll.Success:
            self._report_locked(state)

    def _report_locked(self, state: PrefillRoom, also_peer: str | None = None) -> None:
        """Tell every destination of the room (and `also_peer`) how it ended."""
        peers = set(state.requests) | ({also_peer} if also_peer else set())
        for peer_id in sorted(peers):
            peer = self._peers.get(peer_id)
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
            self.channel.send(peer.endpoint, status)

    def _fail_locked(
        self, state: PrefillRoom, failure: Failure, peer_id: str | None = None
    ) -> None:
        """Fail the room; tell its destinations (and acknowledge aborts) once no write of it
        is in flight — at once if idle, else when the worker finishes the write."""
        if state.status.fail(failure.kind, failure.reason):
            log.warning("room %d failed (%s): %s", state.room, failure.kind, failure.reason)
            self.activity.set()
        if peer_id is not None and peer_id not in state.requests:
            self._report_locked(state, also_peer=peer_id)  # a peer this room never wrote to
        if not state.in_flight:
            self._settle_locked(state)

    def _settle_locked(self, state: PrefillRoom) -> None:
        """A failed room with nothing in flight: report it once, acknowledge every abort."""
        if not state.failure_reported:
            state.failure_reported = True
            self._report_locked(state)
        for endpoint in sorted(state.pending_acks):
            self.channel.send(endpoint, AbortAck(state.room, self.rank, self._token_at(endpoint)))
        state.pending_acks.clear()

    # --- worker thread: every engine call --------------------------------------------------

    def _run_worker(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            if isinstance(item, _Connect):
                self._connect(item.peer_id)
            else:
                self._write_chunk(item.room, item.jobs)

    def _connect(self, peer_id: str) -> None:
        with self._lock:
            peer = self._peers[peer_id]
        assert peer.kv_args is not None
        try:
            peer.engine_peer = self.engine.connect(
                peer.registration.engine_descriptor, memory_regions(peer.kv_args)
            )
        except EngineError as exc:
            peer.error = Failure(FailureKind.ENGINE, f"cannot connect to decode {peer_id}: {exc}")
            log.error("%s", peer.error.reason)

    def _stage(self, job: ChunkJob, peer: _DecodePeer) -> tuple[TransferPlan, ChunkReady] | None:
        """Gather the chunk's head slices into the staging buffer and plan the one write to
        decode's ring; None to fall back to the per-token path (no local buffer, a chunk too
        big for either side, or decode says it can never fit)."""
        pairing, peer_args = peer.pairing, peer.kv_args
        assert pairing is not None
        assert pairing.source is not None
        assert peer_args is not None
        if self._staging is None or peer_args.staging_buffer is None:
            self.stats.staging_fallbacks += 1
            return None
        source = pairing.source
        token_start = job.page_offset * self.kv_args.page_size
        src_rows, _ = token_rows(
            job.src_pages, self.kv_args.page_size, token_start,
            np.asarray(job.dst_pages, dtype=np.int64), peer_args.page_size,
            peer_args.dcp_size, peer_args.dcp_rank,
        )  # fmt: skip
        head_bytes = self.kv_args.head_dim * self.kv_args.dtype_size
        width = source.heads.count * head_bytes
        nbytes = staged_size(len(self.kv_args.kv_buffers), src_rows.size, width)
        if nbytes == 0 or nbytes > self._staging.length or nbytes > peer_args.staging_buffer.length:
            self.stats.staging_fallbacks += 1
            return None
        request = StagingRequest(
            room=job.room, chunk_idx=job.chunk_idx, chunk_num_pages=job.src_pages.size,
            session_id=self.channel.endpoint, prefill_rank=self.rank, nbytes=nbytes,
        )  # fmt: skip
        started = time.perf_counter()
        with self._staging_answered:
            self._staging_awaited.add((job.peer_id, job.room, job.chunk_idx))
        self.channel.send(peer.endpoint, request)
        answer = self._await_staging(job.peer_id, job.room, job.chunk_idx)
        self.stats.staging_wait_s += time.perf_counter() - started
        if answer.never_fits:
            self.stats.staging_fallbacks += 1
            return None
        started = time.perf_counter()
        self._staging.gather(src_rows, source.src_head_offset * head_bytes, width)
        self.stats.gather_s += time.perf_counter() - started
        plan = TransferPlan(
            np.array([self._staging.ptr], dtype=np.uint64),
            np.array([peer_args.staging_buffer.ptr + answer.offset], dtype=np.uint64),
            np.array([nbytes], dtype=np.uint64),
        )
        ready = ChunkReady(
            room=job.room, chunk_idx=job.chunk_idx, page_start=job.page_offset,
            num_pages=job.src_pages.size, session_id=self.channel.endpoint,
            prefill_rank=self.rank, token_start=token_start,
            token_count=job.src_pages.size * self.kv_args.page_size,
        )  # fmt: skip
        self.stats.staged_chunks += 1
        return plan, ready

    def _await_staging(self, peer_id: str, room: int, chunk_idx: int) -> StagingResponse:
        key = (peer_id, room, chunk_idx)
        with self._staging_answered:
            try:
                if not self._staging_answered.wait_for(
                    lambda: key in self._staging_answers, timeout=self.config.staging_timeout_s
                ):
                    raise StagingTimeout(
                        f"decode {peer_id} gave no staging space for chunk {chunk_idx} in "
                        f"{self.config.staging_timeout_s:g} s"
                    )
                return self._staging_answers.pop(key)
            finally:
                self._staging_awaited.discard(key)

    def _plan(
        self, job: ChunkJob, peer_args: KVArgs, pairing: Pairing, kv_plan: TransferPlan | None
    ) -> TransferPlan:
        """The chunk's KV blocks (already staged, or planned here) plus, with the last chunk,
        the aux and state slots."""
        if kv_plan is None:
            kv_plan = pairing.plan(
                self.kv_args, peer_args, job.src_pages, job.page_offset, job.dst_pages
            )
        plans = [kv_plan]
        if job.last and job.src_aux_index is not None and job.dst_aux_index is not None:
            plans.append(
                plan_slots(
                    self.kv_args.aux_buffers,
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
            equal_tp = self.kv_args.attn_tp_size == peer_args.attn_tp_size
            slots = zip(job.src_state_indices, job.dst_state_indices, strict=True)
            for src_slot, dst_slot in slots:
                if equal_tp:  # whole slots
                    state = self.kv_args.state_buffers
                    plans.append(
                        plan_slots(state, peer_args.state_buffers, src_slot, dst_slot, "state")
                    )
                else:  # this rank's shard of each slot
                    plans.append(plan_state_slices(self.kv_args, peer_args, src_slot, dst_slot))
        return TransferPlan.concat(*plans)

    def _write_chunk(self, room: int, jobs: list[ChunkJob]) -> None:
        try:
            self._chunk_ended(room, jobs, self._write_jobs(room, jobs))
        finally:
            self.activity.set()  # written or failed: the room's pages may be free now

    def _chunk_ended(self, room: int, jobs: list[ChunkJob], failure: Failure | None) -> None:
        with self._lock:
            state = self._rooms.get(room)
            if state is None:
                return
            state.in_flight = False
            if failure is not None:
                state.status.fail(failure.kind, failure.reason)
            if state.status.poll == KVPoll.Failed:
                self._settle_locked(state)  # now nothing of this room is in flight
                return
            state.chunk_written(jobs[0].last)
            self._schedule_locked(state)

    def _write_jobs(self, room: int, jobs: list[ChunkJob]) -> Failure | None:
        """Write a chunk to each destination; the failure reason, if any."""
        try:
            for job in jobs:
                with self._lock:
                    peer = self._peers[job.peer_id]
                    state = self._rooms.get(room)
                if state is None or state.status.finished:
                    return None  # aborted or cleared meanwhile: write nothing more
                if peer.engine_peer is None or peer.kv_args is None or peer.pairing is None:
                    missing = peer.error.reason if peer.error else "not connected"
                    raise EngineError(self.engine.name, "write", missing)
                why = self._await_lease(job.peer_id, peer)
                if why is not None:
                    raise WriteFenced(self.engine.name, "write", why)
                # Engines that move a write on only when polled stop at the fence; others
                # finish or time out what they were given (decode waits that out).
                fence = (
                    partial(self._lease_problem, job.peer_id, peer)
                    if not self.engine.progresses_on_its_own
                    else None
                )
                staged = self._stage(job, peer) if peer.pairing.stageable else None
                kv_plan = staged[0] if staged else None
                started = time.perf_counter()
                plan = self._plan(job, peer.kv_args, peer.pairing, kv_plan)
                self.stats.plan_s += time.perf_counter() - started
                notify = notification_for(room, self.rank) if job.last else b""
                why = self._lease_problem(job.peer_id, peer)
                if why is not None:
                    raise WriteFenced(self.engine.name, "write", why)
                if len(plan):
                    started = time.perf_counter()
                    handle = self.engine.write(peer.engine_peer, plan, notify)
                    handle.wait(self.config.write_timeout_s, WRITE_POLL_S, fence=fence)
                    elapsed = time.perf_counter() - started
                    self.stats.write_s += elapsed
                    self.stats.blocks_written += len(plan)
                    self.metrics.observe_write(elapsed, len(plan), plan.total_bytes)
                    log.debug("room %d: %d block(s), %d bytes to %s in %.2f ms%s", room,
                              len(plan), plan.total_bytes, job.peer_id, elapsed * 1e3,
                              " (last chunk)" if job.last else "")  # fmt: skip
                    if self.config.keep_plans:
                        self.written_plans.append((peer.engine_peer, plan))
                elif notify and self.engine.delivers_notifications:
                    self.engine.notify(peer.engine_peer, notify)
                if staged:
                    self.channel.send(peer.endpoint, staged[1])
        except (EngineError, PlanError, StagingTimeout, ValueError) as exc:
            log.warning("room %d: %s", room, exc)
            return Failure(_kind_of(exc), f"room {room}: {exc}")
        return None

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def open_rooms(self) -> int:
        """Rooms in the table: in flight, or ended and not yet cleared by their owner."""
        with self._lock:
            return len(self._rooms)

    @property
    def healthy(self) -> bool:
        return self.channel.alive and self._worker.is_alive()

    def close(self) -> None:
        if self._lease is not None:  # withdrawn first: a restarted rank can register at once
            self._lease.close()
        self._jobs.put(None)
        self._worker.join(timeout=10.0)
        self.channel.close()
        self.engine.close()
        self.metrics.close()
        if self.bootstrap is not None:
            self.bootstrap.close()


class KVSender:
    """One room on the prefill side: hand it pages as they are computed, poll its state."""

    def __init__(self, manager: PrefillManager, room: int) -> None:
        self.manager = manager
        self.room = room
        with manager._lock:
            state = manager._room(room, create=True, claim=True)
        if state is None:
            raise ValueError(f"room {room} already ended on this prefill rank")

    def send(
        self,
        kv_pages: npt.ArrayLike,
        *,
        last: bool = False,
        aux_index: int | None = None,
        state_indices: Sequence[int] = (),
    ) -> None:
        """Queue the next chunk of this room's pages (in order); `last` ends the room and
        carries the aux slot and the state slots."""
        pages = np.asarray(kv_pages, dtype=np.int64).ravel()
        with self.manager._lock:
            state = self.manager._rooms.get(self.room)
            if state is None or state.status.finished:
                return
            state.add_chunk(Chunk(pages, last, aux_index, tuple(state_indices)))
            self.manager._schedule_locked(state)

    def poll(self) -> KVPoll:
        with self.manager._lock:
            state = self.manager._rooms.get(self.room)
            return state.status.poll if state is not None else KVPoll.Failed

    @property
    def failure_reason(self) -> str | None:
        with self.manager._lock:
            state = self.manager._rooms.get(self.room)
            return state.status.failure_reason if state is not None else "room cleared"

    @property
    def failure_kind(self) -> FailureKind | None:
        """Why the room failed, as a kind; None unless it failed."""
        with self.manager._lock:
            state = self.manager._rooms.get(self.room)
            return state.status.failure_kind if state is not None else FailureKind.UNKNOWN

    @property
    def pages_free(self) -> bool:
        """Whether the room's pages can go back to the allocator: the room ended and no write
        of it is in flight (an engine may read them until then)."""
        with self.manager._lock:
            state = self.manager._rooms.get(self.room)
            if state is None:
                return True
            return state.status.poll == KVPoll.Success or (
                state.status.poll == KVPoll.Failed and not state.in_flight
            )

    def abort(self, reason: str) -> None:
        with self.manager._lock:
            state = self.manager._rooms.get(self.room)
            if state is not None:
                failure = Failure(FailureKind.ABORTED, f"aborted by prefill: {reason}")
                self.manager._fail_locked(state, failure)

    def clear(self) -> None:
        self.manager._clear(self.room)
