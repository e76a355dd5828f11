"""Prefill side: `PrefillManager` (one per prefill rank) and `KVSender` (one per room).

Decode ranks register their memory once (a native `Registration`), then send one
`TransferRequest` per room. The scheduler calls `KVSender.send()` with each chunk of pages it
has computed (chunked prefill; the last chunk carries the aux slot and state slots). Each
chunk is written through the engine, job by job; when the last chunk has landed, the room's
outcome goes to every destination as a `TransferStatus`, with the reason on failure.

Every rule lives in `kvbridge.core.prefill_protocol.PrefillProtocol`; this module turns what
happens (messages, ticks, the scheduler's calls, engine writes) into its events and executes
the actions it returns. Threads: the control channel's thread owns the sockets and handles
incoming messages and ticks; one worker thread makes every engine call (connect, gather,
plan, write).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from functools import partial

import numpy as np
import numpy.typing as npt

from kvbridge.cache import KVArgs, PlanError, TransferPlan
from kvbridge.cache.peer import memory_regions
from kvbridge.config import ManagerConfig
from kvbridge.control.bootstrap import (
    BootstrapServer,
    LeaseRenewer,
    PrefillRank,
    register_prefill,
)
from kvbridge.core.prefill_protocol import (
    FINISHED_ROOMS_KEPT,
    MAX_UNCLAIMED_ROOMS,
    ChunkSubmitted,
    Connect,
    Connected,
    PrefillProtocol,
    PrefillSettings,
    PrefillStats,
    SenderAborted,
    SenderCleared,
    SenderOpened,
    Write,
    WriteEnded,
    plan_write,
)
from kvbridge.core.protocol import Tick
from kvbridge.core.room import Chunk, Failure, RoomStatus
from kvbridge.engines import EngineError, WriteFenced
from kvbridge.runtime import RankManager, RankRuntime
from kvbridge.wire import FailureKind, KVPoll, Message

log = logging.getLogger("kvbridge.prefill")
# How long the worker sleeps between polls of a write in flight. A polling loop that never
# sleeps keeps the GIL: the process's other threads (the control channel sending statuses,
# vLLM's engine step) then wait up to Python's 5 ms switch interval for each turn. Measured in
# vLLM (8 × 1k-token loads): time until decode's KV is in place 35-50 ms → 23-33 ms.
WRITE_POLL_S = 0.0001

__all__ = ["FINISHED_ROOMS_KEPT", "MAX_UNCLAIMED_ROOMS", "KVSender", "PrefillManager"]


def _kind_of(exc: Exception) -> FailureKind:
    """The failure kind of what the write path raised."""
    if isinstance(exc, WriteFenced):  # the lease ran out: decode was not heard from
        return FailureKind.PEER_DEAD
    if isinstance(exc, EngineError):
        return FailureKind.ENGINE
    if isinstance(exc, PlanError):
        return FailureKind.INCOMPATIBLE
    return FailureKind.INTERNAL


class PrefillManager(RankManager):
    def __init__(self, kv_args: KVArgs, config: ManagerConfig) -> None:
        if config.bootstrap_url is None and not config.run_bootstrap:
            raise ValueError("a prefill manager needs bootstrap_url or run_bootstrap")
        self.kv_args = kv_args
        self.config = config
        self.rank = kv_args.attn_tp_rank
        self.runtime = RankRuntime("prefill", kv_args, config, self._on_message, self._on_tick)
        self.engine, self.channel = self.runtime.engine, self.runtime.channel
        self.activity, self.metrics = self.runtime.activity, self.runtime.metrics
        # The local staging buffer: the worker gathers one chunk at a time into it.
        self._staging = self.runtime.staging
        self.engine.register(memory_regions(kv_args))
        if self._staging is not None:
            self.engine.register([self._staging.region])
        self.protocol = PrefillProtocol(
            PrefillSettings(
                kv_args=kv_args,
                endpoint=self.channel.endpoint,
                engine=config.engine,
                heartbeat_interval_s=config.heartbeat_interval_s,
                peer_timeout_s=config.peer_timeout_s,
                request_timeout_s=config.request_timeout_s,
                staging_timeout_s=config.staging_timeout_s,
                staging_bytes=self._staging.length if self._staging is not None else None,
            )
        )
        self.stats: PrefillStats = self.protocol.stats
        self._lock = self.runtime.lock
        self._engine_peers: dict[str, str] = {}  # decode peer id → the engine's peer (worker)
        self._connect_errors: dict[str, str] = {}
        self.written_plans: list[tuple[str, TransferPlan]] = []
        self._jobs: queue.SimpleQueue[Connect | Write | None] = queue.SimpleQueue()
        self._worker = threading.Thread(
            target=self._run_worker, name="kvbridge-prefill-worker", daemon=True
        )
        self.bootstrap: BootstrapServer | None = None
        self._lease: LeaseRenewer | None = None
        self._worker.start()
        self.runtime.watch(self._worker)
        self._handle = self.runtime.handle
        try:
            self.runtime.start(self.protocol, self._jobs.put, self._counters)
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

    def _counters(self) -> dict[str, float]:
        return {
            "staged_chunks": self.stats.staged_chunks,
            "staging_fallbacks": self.stats.staging_fallbacks,
            "blocks_written": self.stats.blocks_written,
        }

    # --- scheduler side ------------------------------------------------------------------

    def sender(self, room: int) -> KVSender:
        return KVSender(self, room)

    def open_room(self, room: int) -> RoomStatus | None:
        """Claim a room for a sender (created if new); its status, None if it ended here."""
        self._handle(SenderOpened(room))
        return self.room_status(room)

    def queue_chunk(self, room: int, chunk: Chunk) -> None:
        self._handle(ChunkSubmitted(room, chunk))

    def abort_room(self, room: int, reason: str) -> None:
        self._handle(SenderAborted(room, reason))

    def clear_room(self, room: int) -> None:
        self._handle(SenderCleared(room))

    def room_status(self, room: int) -> RoomStatus | None:
        """The room's status, None once it was cleared (a dict read: no lock needed)."""
        state = self.protocol.rooms.get(room)
        return state.status if state is not None else None

    def room_pages_free(self, room: int) -> bool:
        with self._lock:
            return self.protocol.pages_free(room)

    # --- control thread --------------------------------------------------------------------

    def _on_message(self, message: Message) -> None:
        self._handle(message)

    def _on_tick(self) -> bool:
        self._handle(Tick())
        with self._lock:
            return self.protocol.busy

    # --- worker thread: every engine call --------------------------------------------------

    def _run_worker(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            if isinstance(item, Connect):
                self._connect(item)
            else:
                self._handle(WriteEnded(item.room, self._write(item)))

    def _connect(self, connect: Connect) -> None:
        try:
            engine_peer = self.engine.connect(connect.descriptor, memory_regions(connect.peer_args))
        except EngineError as exc:
            self._connect_errors[connect.peer_id] = str(exc)
            self._handle(Connected(connect.peer_id, str(exc)))
            return
        self._engine_peers[connect.peer_id] = engine_peer
        self._handle(Connected(connect.peer_id))

    def _lease_problem(self, peer_id: str) -> str | None:
        with self._lock:
            return self.protocol.lease_problem(peer_id, time.monotonic())

    def _await_lease(self, peer_id: str) -> str | None:
        """Wait (up to one peer timeout) for a valid write lease: a peer that just registered,
        or registered again after a partition, answers a heartbeat within a round trip. Why
        there is none, or None."""
        deadline = time.monotonic() + self.config.peer_timeout_s
        while (why := self._lease_problem(peer_id)) is not None:
            if time.monotonic() >= deadline:
                return why
            time.sleep(0.002)
        return None

    def _write(self, write: Write) -> Failure | None:
        """Write one job; the failure, if any."""
        room, job = write.room, write.job
        with self._lock:
            state = self.protocol.rooms.get(room)
            if state is None or state.status.finished:
                return None  # aborted or cleared meanwhile: write nothing
        try:
            engine_peer = self._engine_peers.get(job.peer_id)
            if engine_peer is None:
                missing = self._connect_errors.get(job.peer_id, "not connected")
                raise EngineError(self.engine.name, "write", missing)
            why = self._await_lease(job.peer_id)
            if why is not None:
                raise WriteFenced(self.engine.name, "write", why)
            # Engines that move a write on only when polled stop at the fence; others finish or
            # time out what they were given (decode waits that out).
            fence = (
                partial(self._lease_problem, job.peer_id)
                if not self.engine.progresses_on_its_own
                else None
            )
            staging_ptr = 0
            if write.staged is not None:
                assert self._staging is not None
                started = time.perf_counter()
                self._staging.gather(write.staged.src_rows, write.staged.column,
                                     write.staged.width)  # fmt: skip
                self.stats.gather_s += time.perf_counter() - started
                staging_ptr = self._staging.ptr
            started = time.perf_counter()
            plan = plan_write(self.kv_args, write, staging_ptr)
            self.stats.plan_s += time.perf_counter() - started
            why = self._lease_problem(job.peer_id)
            if why is not None:
                raise WriteFenced(self.engine.name, "write", why)
            if len(plan):
                started = time.perf_counter()
                handle = self.engine.write(engine_peer, plan, write.notify)
                handle.wait(self.config.write_timeout_s, WRITE_POLL_S, fence=fence)
                elapsed = time.perf_counter() - started
                self.stats.write_s += elapsed
                self.stats.blocks_written += len(plan)
                self.metrics.observe_write(elapsed, len(plan), plan.total_bytes)
                log.debug("room %d: %d block(s), %d bytes to %s in %.2f ms%s", room, len(plan),
                          plan.total_bytes, job.peer_id, elapsed * 1e3,
                          " (last chunk)" if job.last else "")  # fmt: skip
                if self.config.keep_plans:
                    self.written_plans.append((engine_peer, plan))
            elif write.notify and self.engine.delivers_notifications:
                self.engine.notify(engine_peer, write.notify)
        except (EngineError, PlanError, ValueError) as exc:
            log.warning("room %d: %s", room, exc)
            return Failure(_kind_of(exc), f"room {room}: {exc}")
        return None

    # --- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        if self._lease is not None:  # withdrawn first: a restarted rank can register at once
            self._lease.close()
        self._jobs.put(None)
        self._worker.join(timeout=10.0)
        self.runtime.close()
        if self.bootstrap is not None:
            self.bootstrap.close()


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
    ) -> None:
        """Queue the next chunk of this room's pages (in order); `last` ends the room and
        carries the aux slot and the state slots."""
        pages = np.asarray(kv_pages, dtype=np.int64).ravel()
        self.manager.queue_chunk(self.room, Chunk(pages, last, aux_index, tuple(state_indices)))

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
    def pages_free(self) -> bool:
        """Whether the room's pages can go back to the allocator: the room ended and no write
        of it is in flight (an engine may read them until then)."""
        return self.manager.room_pages_free(self.room)

    def abort(self, reason: str) -> None:
        self.manager.abort_room(self.room, reason)

    def clear(self) -> None:
        self.manager.clear_room(self.room)
