"""Decode side: `DecodeManager` (one per decode rank) and `KVReceiver` (one per room).

A receiver finds its prefill group through the bootstrap service, registers this rank's
memory with the prefill rank it pairs with (once per peer), and sends one `TransferRequest`
per room when the scheduler calls `init()` with the destination pages. The room succeeds when
every expected prefill rank reported success (and, with an engine that notifies, its last
write's notification arrived); it fails with the reason a prefill rank gave, or when its
deadline passes.

Threads: the control channel's thread owns the sockets, handles statuses, polls the engine's
notifications (NIXL needs the target to drive progress) and checks deadlines.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np
import numpy.typing as npt

from kvbridge.cache import BufferSpec, KVArgs
from kvbridge.cache.peer import memory_regions, registration_for
from kvbridge.cache.plan import dst_token_rows
from kvbridge.cache.topology import DecodeRoute, TopologyError, topology
from kvbridge.config import ManagerConfig
from kvbridge.control.bootstrap import BootstrapError, PrefillRank, lookup_prefill_group
from kvbridge.control.channel import ControlChannel
from kvbridge.engines import create_engine
from kvbridge.liveness import Liveness
from kvbridge.metrics import ManagerMetrics, Snapshot, count_finished
from kvbridge.room import DecodeRoom, RoomStatus, parse_notification
from kvbridge.staging import Allocation, StagingRing
from kvbridge.staging.buffer import StagingBuffer, StagingUnavailable, open_staging
from kvbridge.wire import (
    STAGING_NEVER_FITS,
    Abort,
    AbortAck,
    ChunkReady,
    FailureKind,
    Heartbeat,
    KVPoll,
    Message,
    StagingRequest,
    StagingResponse,
    TransferRequest,
    TransferStatus,
    Watermark,
)
from kvbridge.wire.address import tcp_endpoint

log = logging.getLogger("kvbridge.decode")
# Slack on top of a dead prefill rank's write lease before its rooms' pages count as safe:
# its last check of the lease and the write step after it, clock rates.
FENCE_MARGIN_S = 0.5


def _in_pairs(pairs: set[tuple[int, int]], rank: int, room: int) -> bool:
    return (rank, room) in pairs


@dataclass
class DecodeStats:
    peers_declared_dead: int = 0
    rooms_started: int = 0
    rooms_finished: dict[tuple[str, str], int] = field(default_factory=dict)
    scattered_chunks: int = 0
    unexpected_chunks: int = 0
    scatter_s: float = 0.0


class DecodeManager:
    def __init__(self, kv_args: KVArgs, config: ManagerConfig) -> None:
        self.kv_args = kv_args
        self.config = config
        self.rank = kv_args.attn_tp_rank
        self.engine = create_engine(
            config.engine, f"decode-{self.rank}-{uuid.uuid4().hex[:8]}", config.host,
            config.engine_options,
        )  # fmt: skip
        self.stats = DecodeStats()
        config.warn_if_exposed(log, "decode")
        # The staging ring prefill writes staged chunks into (heterogeneous TP).
        self._ring: StagingRing | None = None
        self._ring_buffer: StagingBuffer | None = None
        if config.staging:
            try:
                self._ring_buffer = open_staging(
                    kv_args, config.staging_bytes, config.staging_kernels
                )
            except StagingUnavailable as exc:
                log.warning("no staging ring, prefill sends token by token: %s", exc)
            else:
                ring = BufferSpec(self._ring_buffer.ptr, self._ring_buffer.length, 1)
                kv_args = dataclasses.replace(kv_args, staging_buffer=ring)
                self.kv_args = kv_args
                self._ring = StagingRing(config.staging_bytes)
        # Ring bookkeeping, shared by the channel thread (grants) and the scatter thread.
        self._ring_lock = threading.Lock()
        self._staged: dict[tuple[int, int, int], Allocation] = {}  # (rank, room, chunk)
        self._waiting: deque[StagingRequest] = deque()  # no ring space yet
        self._scatters: queue.SimpleQueue[tuple[ChunkReady, Allocation] | None] = (
            queue.SimpleQueue()
        )
        self._scatter_thread = threading.Thread(
            target=self._run_scatters, name="kvbridge-decode-scatter", daemon=True
        )
        self._scatter_thread.start()
        self.engine.register(memory_regions(kv_args))
        self._lock = threading.Lock()
        # Set whenever a room may have ended or its pages become safe: what an owner waiting
        # for that waits on (a vLLM engine step with nothing to compute); may be set spuriously.
        self.activity = threading.Event()
        self._rooms: dict[int, DecodeRoom] = {}
        self._groups: dict[str, list[PrefillRank]] = {}
        self._registered: set[str] = set()
        self._liveness = Liveness(config.heartbeat_interval_s, config.peer_timeout_s)
        self._heartbeats = 0
        # Sent in this rank's registrations; prefill echoes it, and statuses, acks and
        # heartbeats without it are not from a prefill rank this rank registered with.
        self._session_token = os.urandom(16)
        self._heard_sequence: dict[str, int] = {}  # prefill endpoint → last heartbeat heard
        self.channel = ControlChannel(
            config.host, self._on_message, self._on_tick, name="kvbridge-decode",
            secret=config.secret,
        )  # fmt: skip
        self.peer_id = f"decode-{self.rank}@{self.channel.endpoint}"
        self.metrics = ManagerMetrics("decode", self.rank, self._metrics_snapshot)
        self.channel.start()
        if config.metrics_port is not None:
            try:
                self.metrics.serve(config.host, config.metrics_port)
            except BaseException:
                self.close()
                raise

    def _metrics_snapshot(self) -> Snapshot:
        with self._lock:
            rooms = Counter(state.status.poll.name for state in self._rooms.values())
            finished = dict(self.stats.rooms_finished)
        counters = {
            **{f"channel_{k}": v for k, v in asdict(self.channel.stats).items()},
            "peers_declared_dead": self.stats.peers_declared_dead,
            "heartbeats_missed": self._liveness.missed_heartbeats,
            "rooms_started": self.stats.rooms_started,
            "scattered_chunks": self.stats.scattered_chunks,
            "unexpected_chunks": self.stats.unexpected_chunks,
        }
        return Snapshot(counters, dict(rooms), finished)

    def receiver(self, room: int, bootstrap_url: str | None = None) -> KVReceiver:
        return KVReceiver(self, room, bootstrap_url or self.config.bootstrap_url)

    def knows_prefill(self, url: str) -> bool:
        """Whether the prefill group behind `url` is cached: opening a room toward it then
        makes no blocking lookup."""
        with self._lock:
            return url in self._groups

    def prefill_group(self, url: str) -> list[PrefillRank]:
        """The prefill ranks behind a bootstrap URL (looked up once, then cached)."""
        with self._lock:
            group = self._groups.get(url)
        if group is None:
            group = lookup_prefill_group(url, self.config.bootstrap_timeout_s, self.config.secret)
            with self._lock:
                self._groups[url] = group
        return group

    def _ensure_registered(self, target: PrefillRank) -> str:
        """Send this rank's registration to a prefill rank once; its control endpoint."""
        endpoint = tcp_endpoint(target.host, target.port)
        with self._lock:
            if endpoint in self._registered:
                return endpoint
            self._registered.add(endpoint)
        self._liveness.watch(endpoint, time.monotonic())
        registration = registration_for(
            self.kv_args,
            peer_id=self.peer_id,
            host=self.channel.host,
            control_port=self.channel.port,
            engine=self.config.engine,
            engine_descriptor=self.engine.endpoint(),
            session_token=self._session_token,
        )
        self.channel.send(endpoint, registration)
        return endpoint

    # --- control thread --------------------------------------------------------------------

    def _ignore(self, why: str, *args: object) -> None:
        """A well-formed message this rank does not act on: counted, logged at DEBUG."""
        self.channel.stats.ignored += 1
        log.debug("ignored: " + why, *args)

    def _lease_ms(self) -> int:
        return int(self.config.peer_timeout_s * 1000)

    def _on_heartbeat(self, message: Heartbeat) -> None:
        endpoint = message.sender_id
        with self._lock:
            known = endpoint in self._registered
        if not known:  # only prefill ranks this rank registered with are watched
            self._ignore("heartbeat from unknown prefill %s", endpoint[:100])
            return
        if message.session_token != self._session_token:
            self._ignore("heartbeat from %s without this rank's token", endpoint)
            return
        if self._liveness.seen(endpoint, time.monotonic()):
            log.info("prefill %s is heard from again", endpoint)
        # Answer at once: the echo is what extends the prefill rank's write lease.
        self._heard_sequence[endpoint] = message.sequence
        pong = Heartbeat(self.peer_id, self._heartbeats, self._lease_ms(), message.sequence)
        self.channel.send(endpoint, pong)

    def _on_message(self, message: Message) -> None:
        if isinstance(message, Heartbeat):
            self._on_heartbeat(message)
            return
        if isinstance(message, (AbortAck, TransferStatus)) and (
            message.session_token != self._session_token
        ):  # only the prefill rank asked to write a room can end it or confirm its drain
            self._ignore("%s for room %d without this rank's token", type(message).__name__,
                         message.room)  # fmt: skip
            return
        if isinstance(message, AbortAck):
            with self._lock:
                state = self._rooms.get(message.room)
                if state is not None:
                    state.on_abort_ack(message.prefill_rank)
                    self.activity.set()
            if state is None:
                self._ignore("abort ack for unknown room %d", message.room)
            return
        if isinstance(message, (StagingRequest, ChunkReady)):
            with self._lock:
                known = message.session_id in self._registered
            if not known:
                self._ignore("%s from unknown prefill %s", type(message).__name__,
                             message.session_id)  # fmt: skip
            elif isinstance(message, StagingRequest):
                self._allocate(message)
            else:
                self._scatter(message)
        elif isinstance(message, TransferStatus):
            if message.status == KVPoll.Failed:
                # Prefill reports a failure only once nothing of the room is in flight: ring
                # space it was granted for chunks it never wrote is free again.
                self._reclaim(lambda rank, room: (rank, room) == (message.prefill_rank,
                                                                  message.room))  # fmt: skip
            with self._lock:
                state = self._rooms.get(message.room)
                if state is not None:
                    state.on_status(message.prefill_rank, message.status, message.reason,
                                    message.failure_kind)  # fmt: skip
                    self.activity.set()
            if state is None:
                self._ignore("status for unknown or cleared room %d", message.room)
        else:
            log.warning("unexpected %s on a decode rank, ignored", type(message).__name__)

    # --- staging ring (channel thread) -------------------------------------------------------

    def _allocate(self, request: StagingRequest) -> None:
        """Grant ring space for a chunk, queue the request while the ring is full, or answer
        that it can never fit (prefill then sends that chunk token by token)."""
        if self._ring is None or not self._ring.fits_ever(request.nbytes):
            self._answer(request, None)
            return
        with self._ring_lock:
            allocation = self._ring.allocate(request.nbytes)
            if allocation is None:
                self._waiting.append(request)
                return
            self._staged[(request.prefill_rank, request.room, request.chunk_idx)] = allocation
        self._answer(request, allocation)

    def _answer(self, request: StagingRequest, allocation: Allocation | None) -> None:
        response = StagingResponse(
            room=request.room,
            chunk_idx=request.chunk_idx,
            offset=allocation.offset if allocation else STAGING_NEVER_FITS,
            round=allocation.round if allocation else 0,
            end=allocation.end if allocation else 0,
            session_id=self.peer_id,
        )
        self.channel.send(request.session_id, response)

    def _scatter(self, ready: ChunkReady) -> None:
        """A staged chunk landed: hand it to the scatter thread (so this thread keeps
        answering ring requests), holding the room's success until it is in the pages."""
        key = (ready.prefill_rank, ready.room, ready.chunk_idx)
        with self._ring_lock:
            allocation = self._staged.pop(key, None)
        if allocation is None:
            self.stats.unexpected_chunks += 1
            self.channel.stats.ignored += 1
            log.warning("chunk %d of room %d from prefill rank %d has no ring space here",
                        ready.chunk_idx, ready.room, ready.prefill_rank)  # fmt: skip
            return
        with self._lock:
            state = self._rooms.get(ready.room)
            if state is not None:
                state.chunk_arrived()
        self._scatters.put((ready, allocation))

    def _reclaim(self, owned: Callable[[int, int], bool]) -> None:
        """Free ring space granted for chunks that will never arrive: `owned(rank, room)`
        picks the grants of a prefill rank that can no longer write them."""
        if self._ring is None:
            return
        with self._ring_lock:
            stale = [key for key in self._staged if owned(key[0], key[1])]
            for key in stale:
                self._ring.free(self._staged.pop(key))
        if stale:
            log.info("reclaimed ring space of %d chunk(s) that will not arrive", len(stale))

    def _run_scatters(self) -> None:
        while True:
            item = self._scatters.get()
            if item is None:
                return
            ready, allocation = item
            try:
                self._scatter_chunk(ready, allocation)
            except Exception:  # a broken chunk fails its room, never this thread
                log.exception("scatter of room %d chunk %d failed", ready.room, ready.chunk_idx)
                with self._lock:
                    state = self._rooms.get(ready.room)
                    if state is not None:
                        reason = f"room {ready.room}: scatter of a staged chunk failed"
                        state.status.fail(FailureKind.INTERNAL, reason)
            self._release(ready, allocation)

    def _scatter_chunk(self, ready: ChunkReady, allocation: Allocation) -> None:
        assert self._ring_buffer is not None
        with self._lock:
            state = self._rooms.get(ready.room)
        source = state.sources.get(ready.prefill_rank) if state is not None else None
        if state is None or source is None or state.status.finished:
            return
        args = self.kv_args
        rows = dst_token_rows(
            ready.token_start, ready.token_count, state.dst_pages, args.page_size,
            args.dcp_size, args.dcp_rank,
        )  # fmt: skip
        head_bytes = args.head_dim * args.dtype_size
        started = time.perf_counter()
        self._ring_buffer.scatter(
            allocation.offset, allocation.end, rows, source.dst_head_offset * head_bytes,
            source.heads.count * head_bytes,
        )  # fmt: skip
        self.stats.scattered_chunks += 1
        self.stats.scatter_s += time.perf_counter() - started

    def _release(self, ready: ChunkReady, allocation: Allocation) -> None:
        """Free the chunk's ring space, tell its writer the watermark, grant waiting space."""
        with self._lock:
            state = self._rooms.get(ready.room)
            if state is not None:
                state.chunk_scattered()
        self.activity.set()
        assert self._ring is not None
        grants = []
        with self._ring_lock:
            self._ring.free(allocation)
            round_, tail = self._ring.watermark
            while self._waiting:
                granted = self._ring.allocate(self._waiting[0].nbytes)
                if granted is None:
                    break
                waiting = self._waiting.popleft()
                self._staged[(waiting.prefill_rank, waiting.room, waiting.chunk_idx)] = granted
                grants.append((waiting, granted))
        self.channel.send(ready.session_id, Watermark(round_, tail, self.peer_id))
        for waiting, granted in grants:
            self._answer(waiting, granted)

    def _check_liveness(self, now: float) -> None:
        """Heartbeats to every prefill rank registered with; rooms waiting on a prefill rank
        that fell silent fail with the reason."""
        if self._liveness.heartbeat_due(now):
            self._heartbeats += 1
            for endpoint in self._liveness.peers:
                beat = Heartbeat(self.peer_id, self._heartbeats, self._lease_ms(),
                                 self._heard_sequence.get(endpoint))  # fmt: skip
                self.channel.send(endpoint, beat)
        for endpoint, silent_s in self._liveness.expired(now):
            self.stats.peers_declared_dead += 1
            reason = (
                f"prefill {endpoint} silent for {silent_s:.1f} s (peer timeout "
                f"{self.config.peer_timeout_s:g} s)"
            )
            # The last write lease this rank granted it started before it was last heard; a
            # rank that is only hung fences itself when that lease runs out (or, with an
            # engine that moves writes on its own threads, when its last write times out).
            fenced_at = now - silent_s + self._lease_ms() / 1000 + FENCE_MARGIN_S
            if self.engine.progresses_on_its_own:
                fenced_at += self.config.write_timeout_s
            with self._lock:
                affected = [state for state in self._rooms.values()
                            if state.waits_on(endpoint)]  # fmt: skip
                dead: set[tuple[int, int]] = set()  # (prefill rank, room)
                for state in self._rooms.values():
                    for rank, known in state.endpoints.items():
                        if known == endpoint:  # it writes no more: settled, failed if needed
                            state.on_rank_dead(rank, f"room {state.room}: {reason}", fenced_at)
                            dead.add((rank, state.room))
            self._reclaim(partial(_in_pairs, dead))
            self._forget_prefill(endpoint)
            if affected:
                log.warning("%s: %d room(s) failed", reason, len(affected))
                self.activity.set()

    def _forget_prefill(self, endpoint: str) -> None:
        """A prefill rank was declared dead: forget it and every cached group it was in, so
        the next room looks its group up again (a restarted rank has a new endpoint) and
        registers anew."""
        self._liveness.forget(endpoint)
        self._heard_sequence.pop(endpoint, None)
        with self._lock:
            self._registered.discard(endpoint)
            stale = [
                url
                for url, group in self._groups.items()
                if any(tcp_endpoint(rank.host, rank.port) == endpoint for rank in group)
            ]
            for url in stale:
                del self._groups[url]

    def _on_tick(self) -> bool:
        notifications = self.engine.notifications()
        now = time.monotonic()
        self._check_liveness(now)
        with self._lock:
            for _, message in notifications:
                parsed = parse_notification(message)
                if parsed is None:
                    continue
                room, prefill_rank = parsed
                state = self._rooms.get(room)
                if state is not None:
                    state.on_notification(prefill_rank)
            busy = False
            expired = []
            for state in self._rooms.values():
                if state.check_deadline(now):
                    expired.append(state)
                busy = busy or state.status.poll == KVPoll.Transferring
        for state in expired:  # stop the prefill ranks that may still write, and hear them
            self._abort_unsettled(state, state.status.failure_reason or "deadline")
        if notifications or expired:
            self.activity.set()
        return busy

    def _abort_unsettled(self, state: DecodeRoom, reason: str) -> None:
        """Ask every prefill rank that may still write into the room's pages to stop and
        confirm (its AbortAck settles it); the pages are safe once all have."""
        message = Abort(state.room, self.channel.host, self.channel.port, reason)
        with self._lock:
            endpoints = {state.endpoints[rank] for rank in state.unsettled()}
        for endpoint in sorted(endpoints):
            self.channel.send(endpoint, message)

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def open_rooms(self) -> int:
        """Rooms in the table: in flight, or ended and not yet cleared by their owner."""
        with self._lock:
            return len(self._rooms)

    @property
    def healthy(self) -> bool:
        return self.channel.alive and self._scatter_thread.is_alive()

    def close(self) -> None:
        """Stop: rooms that a prefill rank may still write into are aborted first, and their
        writers heard (or declared dead and fenced) before the memory is deregistered, within
        about two peer timeouts."""
        with self._lock:
            now = time.monotonic()
            unsafe = [state for state in self._rooms.values() if not state.pages_safe(now)]
            for state in unsafe:
                reason = f"room {state.room}: decode rank {self.rank} is closing"
                state.status.fail(FailureKind.ABORTED, reason)
        for state in unsafe:
            self._abort_unsettled(state, "decode rank closing")
        deadline = time.monotonic() + 2 * self.config.peer_timeout_s + FENCE_MARGIN_S
        while unsafe and self.channel.alive and time.monotonic() < deadline:
            time.sleep(0.01)
            with self._lock:
                unsafe = [state for state in unsafe if not state.pages_safe(time.monotonic())]
        if unsafe:
            log.warning("closing with %d room(s) whose writers were not heard from", len(unsafe))
        self._scatters.put(None)
        self._scatter_thread.join(timeout=10.0)
        self.channel.close()
        self.engine.close()
        self.metrics.close()


class KVReceiver:
    """One room on the decode side: give it the destination pages, poll its state."""

    def __init__(self, manager: DecodeManager, room: int, bootstrap_url: str | None) -> None:
        self.manager = manager
        self.room = room
        self._status = RoomStatus()
        self._route: DecodeRoute | None = None
        self._required: dict[int, int] = {}
        self._endpoints: dict[int, str] = {}
        if bootstrap_url is None:
            self._status.fail(FailureKind.BOOTSTRAP, "no bootstrap URL for this room")
            return
        args = manager.kv_args
        try:
            group = manager.prefill_group(bootstrap_url)
            mapping = topology(
                group[0].attn_tp_size, args.attn_tp_size, args.total_kv_heads, args.kv_layout
            )
        except BootstrapError as exc:
            self._status.fail(FailureKind.BOOTSTRAP, str(exc))
            return
        except TopologyError as exc:
            self._status.fail(FailureKind.INCOMPATIBLE, str(exc))
            return
        route = mapping.route(args.attn_tp_rank)
        # Only DCP rank 0 of a decode rank sends the dummies (the prefill ranks count so).
        dummies = route.dummies if args.dcp_rank == 0 else ()
        self._route = DecodeRoute(route.decode_rank, route.sources, dummies)
        for prefill_rank in self._route.prefill_ranks:
            self._endpoints[prefill_rank] = manager._ensure_registered(group[prefill_rank])
            self._required[prefill_rank] = mapping.required_requests(prefill_rank, args.dcp_size)
        self._status.advance(KVPoll.WaitingForInput)

    def init(
        self,
        kv_pages: npt.ArrayLike,
        aux_index: int | None = None,
        state_indices: Sequence[int] = (),
        decode_prefix_len: int | None = None,
    ) -> None:
        """Ask the prefill ranks to fill these pages (and aux slot, state slots): one request
        to each prefill rank this decode rank reads heads from, a dummy to the ranks it only
        tells about the room. The first source alone writes the aux and state slots."""
        if self._status.finished or self._route is None:
            return
        pages = np.asarray(kv_pages, dtype=np.int32).ravel()
        first_source = self._route.sources[0].prefill_rank if self._route.sources else None

        def request(prefill_rank: int, dummy: bool) -> TransferRequest:
            # The aux slot comes from the first source; every source sends its shard of the
            # state slots (at equal TP that is one source and the whole slot).
            first = prefill_rank == first_source
            return TransferRequest(
                room=self.room,
                peer_id=self.manager.peer_id,
                is_dummy=dummy,
                dst_kv_indices=np.empty(0, dtype=np.int32) if dummy else pages,
                dst_aux_index=aux_index if first else None,
                dst_state_indices=[list(state_indices)] if state_indices and not dummy else [],
                required_dst_info_num=self._required[prefill_rank],
                decode_prefix_len=decode_prefix_len,
            )

        requests = [(s.prefill_rank, request(s.prefill_rank, False)) for s in self._route.sources]
        requests += [(rank, request(rank, True)) for rank in self._route.dummies]
        notifying = (
            frozenset(source.prefill_rank for source in self._route.sources)
            if self.manager.engine.delivers_notifications
            else frozenset()
        )
        state = DecodeRoom(
            room=self.room,
            expected_ranks=frozenset(self._route.prefill_ranks),
            notifying_ranks=notifying,
            deadline=time.monotonic() + self.manager.config.transfer_timeout_s,
            dst_pages=pages.astype(np.int64),
            sources={source.prefill_rank: source for source in self._route.sources},
            endpoints=dict(self._endpoints),
        )
        state.status.advance(KVPoll.Transferring)
        with self.manager._lock:
            self.manager._rooms[self.room] = state
            self.manager.stats.rooms_started += 1
        self._status = state.status
        for prefill_rank, message in requests:
            self.manager.channel.send(self._endpoints[prefill_rank], message)
        log.debug("room %d: asked prefill rank(s) %s for %d page(s)", self.room,
                  sorted(rank for rank, _ in requests), pages.size)  # fmt: skip

    def poll(self) -> KVPoll:
        with self.manager._lock:
            return self._status.poll

    @property
    def failure_reason(self) -> str | None:
        with self.manager._lock:
            return self._status.failure_reason

    @property
    def failure_kind(self) -> FailureKind | None:
        """Why the room failed, as a kind; None unless it failed."""
        with self.manager._lock:
            return self._status.failure_kind

    def abort(self, reason: str) -> None:
        """Give up on the room: it fails at once; its pages are safe to reuse only when
        `pages_safe` says so (every prefill rank confirmed that nothing is in flight)."""
        with self.manager._lock:
            failed = self._status.fail(FailureKind.ABORTED, f"aborted by decode: {reason}")
            state = self.manager._rooms.get(self.room)
        if failed and state is not None:
            self.manager._abort_unsettled(state, reason)
        elif failed:  # before init(): the prefill ranks hear it now, not at their deadline
            message = Abort(self.room, self.manager.channel.host, self.manager.channel.port,
                            reason)  # fmt: skip
            for endpoint in sorted(set(self._endpoints.values())):
                self.manager.channel.send(endpoint, message)

    @property
    def pages_safe(self) -> bool:
        """Whether the room's pages can be handed back to the allocator: the room succeeded,
        or it failed and no prefill rank can still write into them (each confirmed, reported
        how the room ended, or was declared dead)."""
        with self.manager._lock:
            state = self.manager._rooms.get(self.room)
            if state is None:
                return self._status.finished or self._status.poll != KVPoll.Transferring
            return state.pages_safe(time.monotonic())

    def clear(self) -> None:
        """The one cleanup path of the room on this side (idempotent)."""
        with self.manager._lock:
            if self.manager._rooms.pop(self.room, None) is not None:
                count_finished(self.manager.stats.rooms_finished, self._status)
                log.debug("room %d: cleared (%s)", self.room,
                          self._status.failure_reason or self._status.poll.name)  # fmt: skip
