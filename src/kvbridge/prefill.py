"""Prefill side: `PrefillManager` (one per prefill rank) and `KVSender` (one per room).

Decode ranks register their memory once (a native `Registration`), then send one
`TransferRequest` per room. The scheduler calls `KVSender.send()` with each chunk of pages it
has computed (chunked prefill; the last chunk carries the aux slot and state slots). Each
chunk is written through the engine, job by job; when the last chunk has landed, the room's
outcome goes to every destination as a `TransferStatus`, with the reason on failure.

Every rule lives in `kvbridge.core.prefill_protocol.PrefillProtocol`; this module turns what
happens (messages, ticks, the scheduler's calls, engine writes) into its events and executes
the actions it returns. Threads: the control channel's thread owns the sockets and handles
incoming messages and ticks; a preparing thread connects the engine to new peers, waits for
the write lease, gathers staged chunks, plans each write and sets up the next engine transfer
(descriptors, `initialize_xfer`) while the current one moves; the engine thread posts the set-up
transfers in the order the protocol handed their writes out (setting one up itself when the
preparing thread has not got to it) and polls every one in flight (the lease is checked before
each post and poll); a reporting thread tells the protocol each write that ended. Several writes
are out at once, so the next one is planned and set up while the current one moves.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbridge.cache import KVArgs, PlanError, TransferPlan
from kvbridge.cache.peer import memory_regions
from kvbridge.cache.plan import PlanArena
from kvbridge.config import ManagerConfig
from kvbridge.control.bootstrap import (
    BootstrapServer,
    LeaseRenewer,
    PrefillRank,
    register_prefill,
)
from kvbridge.core.prefill_events import (
    ChunkSubmitted,
    Connect,
    Connected,
    PrefillSettings,
    PrefillStats,
    SenderAborted,
    SenderCleared,
    SenderOpened,
    Write,
    WriteEnded,
    transfer_notification,
)
from kvbridge.core.prefill_protocol import PrefillProtocol
from kvbridge.core.prefill_rooms import FINISHED_ROOMS_KEPT, MAX_UNCLAIMED_ROOMS
from kvbridge.core.protocol import Tick
from kvbridge.core.room import Chunk, Failure, RoomStatus
from kvbridge.core.waits import WINDOW_S, EngineWaits
from kvbridge.engines import EngineError, EngineTimeout, PendingWrite, TransferHandle, WriteFenced
from kvbridge.runtime import RankManager, RankRuntime
from kvbridge.wire import FailureKind, KVPoll, Message
from kvbridge.write_plan import plan_write

log = logging.getLogger("kvbridge.prefill")

# Told (room, engine peer, plan) of each write that ended, on the engine thread.
WriteObserver = Callable[[int, str, TransferPlan], None]
# How long the worker sleeps between polls of a write in flight. A polling loop that never
# sleeps keeps the GIL: the process's other threads (the control channel sending statuses,
# vLLM's engine step) then wait up to Python's 5 ms switch interval for each turn. Measured in
# vLLM (8 × 1k-token loads): time until decode's KV is in place 35-50 ms → 23-33 ms.
WRITE_POLL_S = 0.0001
# With an engine that moves writes on its own threads and says when one ended, the worker
# sleeps until then instead, looking at the writes' deadlines at least this often.
WRITE_WAIT_S = 0.01
# Prepared writes to one peer that wait together are posted as one engine transfer (the
# engine's per-transfer cost and this process's per-write work are paid once for them), at
# most this many writes and blocks; a transfer carries at most one notification.
MAX_MERGED_WRITES = 8
MAX_MERGED_BLOCKS = 1 << 16
# How long the control channel's thread waits, after a message gave an idle engine a write,
# for that write's copy to start before it handles the next message. A burst of requests
# (a decode batch asking for its rooms at once: tens of messages, ms of Python) otherwise
# keeps the GIL from the preparing and engine threads until it is all handled, and the first
# copy starts only after it.
FIRST_POST_WAIT_S = 0.002

__all__ = ["FINISHED_ROOMS_KEPT", "MAX_UNCLAIMED_ROOMS", "KVSender", "PrefillManager"]


@dataclass
class _Prepared:
    """A write with its blocks planned (and its chunk gathered), ready for the engine."""

    write: Write
    plan: TransferPlan


@dataclass
class _Starting:
    """Prepared writes to one peer as one engine transfer, set up and about to be posted."""

    writes: list[_Prepared]
    plan: TransferPlan
    engine_peer: str
    pending: PendingWrite
    completing: Write | None  # the write whose room its notification completes, if any


# Writes that ended, each with what failed it (None: written) and whether it went with a
# complete notification (`transfer_notification`), for the reporting thread.
_Ended = list[tuple[Write, Exception | None, bool]]


@dataclass
class _Posted:
    """Prepared writes to one peer that the engine is moving as one transfer (`plan`: theirs
    together)."""

    writes: list[_Prepared]
    plan: TransferPlan
    engine_peer: str
    handle: TransferHandle
    started: float  # monotonic, when it was posted
    completing: Write | None


class _Wake:
    """Put on a thread's queue to make it look again (the set-up transfer slot changed)."""


_WAKE = _Wake()


def _merged(ready: deque[_Prepared]) -> list[_Prepared]:
    """The writes at the head of `ready` that go as one transfer: in order, to one peer,
    within `MAX_MERGED_WRITES` and `MAX_MERGED_BLOCKS`, and ending with the first one that
    carries a notification (the room it completes does not wait for the next room's
    chunks)."""
    group = [ready.popleft()]
    peer_id = group[0].write.job.peer_id
    blocks = len(group[0].plan)
    while ready and len(group) < MAX_MERGED_WRITES and not group[-1].write.notify:
        following = ready[0]
        if following.write.job.peer_id != peer_id:
            break
        if blocks + len(following.plan) > MAX_MERGED_BLOCKS:
            break
        group.append(ready.popleft())
        blocks += len(following.plan)
    return group


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
        staging = [self._staging.region] if self._staging is not None else []
        self.runtime.register([*memory_regions(kv_args), *staging])
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
                writes_in_flight=config.writes_in_flight,
                engine_notifies=self.engine.delivers_notifications,
            )
        )
        self.stats: PrefillStats = self.protocol.stats
        self._lock = self.runtime.lock
        # decode peer id → the engine's peer (engine thread)
        self._engine_peers: dict[str, str] = {}
        self._connect_errors: dict[str, str] = {}
        # Time the engine thread spent in engine calls, and off a CPU in them (engine thread).
        self.engine_waits = EngineWaits()
        # Told (room, engine peer, plan) of every write that ended (benchmarks replay them).
        self._write_observers: list[WriteObserver] = []
        # Address arrays of large plans, reused once their write ended (not while observed).
        self._plan_memory = PlanArena()
        self._to_prepare: queue.SimpleQueue[Write | Connect | _Wake | None] = queue.SimpleQueue()
        self._to_engine: queue.SimpleQueue[_Wake | None] = queue.SimpleQueue()
        self.engine.add_write_end_listener(self._wake_engine_thread)
        # Prepared writes in the order the protocol handed them out, and the next transfer set
        # up from them (at most one ahead of the engine, so that what waits together merges):
        # the preparing thread sets it up while the engine copies, the engine thread itself
        # when it needs one before the preparing thread got to it. `_setting_up` guards both.
        self._setting_up = threading.Lock()
        self._ready: deque[_Prepared] = deque()
        self._next: _Starting | None = None
        self._to_report: queue.SimpleQueue[_Ended | None] = queue.SimpleQueue()
        # Transfers the engine thread has posted and not yet seen end (engine thread), the
        # last write handed to the preparing thread (under the lock), and set when a copy
        # starts: what the channel's thread looks at to wait for the first copy of a burst.
        self._transfers_out = 0
        self._last_handed: Write | None = None
        self._posting = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._run_preparer, name="kvbridge-prefill-prepare", daemon=True
            ),
            threading.Thread(target=self._run_engine, name="kvbridge-prefill-engine", daemon=True),
            threading.Thread(
                target=self._run_reporter, name="kvbridge-prefill-report", daemon=True
            ),
        ]
        self.bootstrap: BootstrapServer | None = None
        self._lease: LeaseRenewer | None = None
        for thread in self._threads:
            thread.start()
            self.runtime.watch(thread)
        self._handle = self.runtime.handle
        try:
            self.runtime.start(self.protocol, self._execute_own, self._counters)
            if config.run_bootstrap:
                self.bootstrap = BootstrapServer(
                    config.host, config.bootstrap_port, secret=config.secret
                ).start()
            self.bootstrap_url = self.bootstrap.url if self.bootstrap else str(config.bootstrap_url)
            rank = PrefillRank(
                self.rank, kv_args.attn_tp_size, config.host, self.channel.port, config.engine
            )
            lease_s = register_prefill(
                self.bootstrap_url,
                rank,
                timeout_s=config.bootstrap_timeout_s,
                secret=config.secret,
                wait_out_conflicts=True,
            )
            self._lease = LeaseRenewer(self.bootstrap_url, rank, lease_s, config.secret)
        except BaseException:
            self.close()  # no thread, socket or registration left behind
            raise

    def _counters(self) -> dict[str, float]:
        return {
            "staged_chunks": self.stats.staged_chunks,
            "staging_fallbacks": self.stats.staging_fallbacks,
            "blocks_written": self.stats.blocks_written,
            "engine_call_seconds": self.engine_waits.busy_s,
            "engine_call_wait_seconds": self.engine_waits.waited_s,
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

    def pages_safe(self, room: int) -> bool:
        with self._lock:
            return self.protocol.pages_safe(room)

    def observe_writes(self, observer: WriteObserver) -> None:
        """Tell `observer` the plan of every write that ends from now on (benchmarks replay
        them through the raw engine). An observed plan's memory is never reused, so observe
        before the first write and only where the plans are wanted."""
        self._write_observers.append(observer)

    # --- control thread --------------------------------------------------------------------

    def _on_message(self, message: Message) -> None:
        idle = self._engine_idle()
        if idle:
            self._posting.clear()
        handed = self._last_handed
        self._handle(message)
        write = self._last_handed
        # Only for a write that can go now: one that waits for its lease waits for the answer
        # to a heartbeat, which this thread receives.
        if (
            idle
            and write is not handed
            and write is not None
            and self._lease_problem(write.job.peer_id) is None
        ):
            self._posting.wait(FIRST_POST_WAIT_S)

    def _engine_idle(self) -> bool:
        """Whether nothing is on its way to the engine or moving (read without the locks that
        guard these: a wrong answer costs at most one `FIRST_POST_WAIT_S`)."""
        return (
            self._transfers_out == 0
            and self._next is None
            and not self._ready
            and self._to_prepare.empty()
        )

    def _on_tick(self) -> bool:
        self._handle(Tick())
        # Nothing here needs polling (the engine thread polls the writes; messages wake the
        # channel): ticks at the idle pace keep deadlines and heartbeats.
        return False

    def _execute_own(self, action: object) -> None:
        """The actions only prefill has, engine connects and writes: to the preparing thread,
        in order (a peer is connected before its first write is set up)."""
        if isinstance(action, (Write, Connect)):
            self._to_prepare.put(action)
            if isinstance(action, Write):
                self._last_handed = action

    def _ended(self, write: Write, exc: Exception | None = None, completed: bool = False) -> None:
        """Report a write's end to the protocol, with the failure `exc` says (or, written,
        whether its notification completed the room)."""
        failure = None
        if exc is not None:
            log.warning("room %d: %s", write.room, exc)
            failure = Failure(_kind_of(exc), f"room {write.room}: {exc}")
        self._handle(WriteEnded(write, failure, completed))

    def _lease_problem(self, peer_id: str) -> str | None:
        # Without the lock (`lease_problem` says why that is safe): the engine thread asks
        # before every post and poll round, and waiting there for a control thread's whole
        # event to end held the copies back.
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

    # --- preparing thread: connect, lease, gather, plan, set up -------------------------------

    def _run_preparer(self) -> None:
        while (item := self._to_prepare.get()) is not None:
            if isinstance(item, Connect):
                self._connect(item)
            elif isinstance(item, Write):
                try:
                    prepared = self._prepare(item)
                except (EngineError, PlanError, ValueError) as exc:
                    self._ended(item, exc)
                    prepared = None
                else:
                    if prepared is None:
                        self._ended(item)  # its room ended meanwhile: nothing was written
                if prepared is not None:
                    with self._setting_up:
                        self._ready.append(prepared)
                    if not prepared.write.notify and not self._to_prepare.empty():
                        continue  # the room's next chunk may go in the same transfer
            with self._setting_up:
                set_up = self._next is None and bool(self._ready)
                if set_up:
                    self._next = self._set_up_next()
            if set_up:  # an engine thread idle in its queue is woken for it
                self._to_engine.put(_WAKE)
        self._to_engine.put(None)

    def _prepare(self, write: Write) -> _Prepared | None:
        """The write's blocks (its chunk gathered into the staging buffer first, when
        staged); None if its room ended meanwhile."""
        with self._lock:
            state = self.protocol.rooms.get(write.room)
            if state is None or state.status.finished:
                return None
        why = self._await_lease(write.job.peer_id)
        if why is not None:
            raise WriteFenced(self.engine.name, "write", why)
        staging_ptr = 0
        if write.staged is not None:
            assert self._staging is not None
            staged = write.staged
            started = time.perf_counter()
            self._staging.gather(staged.src_rows, staged.column, staged.width, staged.local_offset)
            self.stats.gather_s += time.perf_counter() - started
            staging_ptr = self._staging.ptr
        started = time.perf_counter()
        plan = plan_write(self.kv_args, write, staging_ptr, self._plan_memory)
        self.stats.plan_s += time.perf_counter() - started
        return _Prepared(write, plan)

    # --- engine thread: post and poll ---------------------------------------------------------

    def _run_engine(self) -> None:
        posted: list[_Posted] = []
        while True:
            # Block only when nothing is in flight; else take what arrived.
            items = [] if posted else [self._to_engine.get()]
            while True:
                try:
                    items.append(self._to_engine.get_nowait())
                except queue.Empty:
                    break
            if None in items:
                self._close_engine_loop(posted)
                return
            wall_started, cpu_started = time.perf_counter(), time.thread_time()
            posted, ended = self._progress(posted)
            if ended:
                self._to_report.put(ended)
            with self._setting_up:
                starting, self._next = self._next, None
                if starting is None and self._ready:
                    starting = self._set_up_next()  # the preparing thread did not get to it
            if starting is not None:
                # The preparing thread sets the one after up while this one moves (NIXL over
                # CMA copies inside the post call, without the GIL).
                self._to_prepare.put(_WAKE)
                posted += self._start(starting)
            self._transfers_out = len(posted)
            self._note_waits(wall_started, cpu_started)
            if posted and starting is None and not ended:
                if self.engine.progresses_on_its_own:
                    self._wait_for_engine()
                else:
                    time.sleep(WRITE_POLL_S)

    def _wake_engine_thread(self) -> None:
        """A write ended (called on the engine's own thread)."""
        self._to_engine.put(_WAKE)

    def _wait_for_engine(self) -> None:
        """Sleep until the engine's threads end a write or new work comes (each puts a wake
        on the engine thread's queue), at most `WRITE_WAIT_S` (write deadlines are checked
        then). Polling every `WRITE_POLL_S` instead took CPU from an engine that moves data on
        its own threads: Mooncake over TCP on two CPUs moved 8 % less beside a thread waking
        every 0.1 ms."""
        try:
            item = self._to_engine.get(timeout=WRITE_WAIT_S)
        except queue.Empty:
            return
        self._to_engine.put(item)  # for the loop's next round (None: close)

    def _close_engine_loop(self, posted: list[_Posted]) -> None:
        """Closing: nothing more moves."""
        for left in posted:
            left.handle.release()
        with self._setting_up:
            if self._next is not None:
                self._next.pending.release()
                self._next = None
        self._to_report.put(None)

    def _note_waits(self, wall_started: float, cpu_started: float) -> None:
        """Count a stretch of engine calls (polls, set-up, post) and the part of it spent off
        a CPU; warn when that was most of the last window (`kvbridge.core.waits`)."""
        wall_s = time.perf_counter() - wall_started
        share = self.engine_waits.add(wall_s, time.thread_time() - cpu_started, time.monotonic())
        if share is not None:
            log.warning(
                "prefill rank %d: %.0f%% of the engine thread's last %.2f s in engine calls went "
                "to waiting for the GIL or a CPU, not to moving data: another thread of this "
                "process keeps the GIL (one that never blocks holds it for the switch interval, "
                "%.1f ms now: sys.setswitchinterval), or the host's CPUs are all busy",
                self.rank,
                share * 100,
                WINDOW_S,
                sys.getswitchinterval() * 1e3,
            )

    # --- reporting thread: ended writes into the protocol ----------------------------------

    def _run_reporter(self) -> None:
        while (ended := self._to_report.get()) is not None:
            for write, exc, completed in ended:
                self._ended(write, exc, completed)

    def _connect(self, connect: Connect) -> None:
        try:
            engine_peer = self.engine.connect(connect.descriptor, memory_regions(connect.peer_args))
        except EngineError as exc:
            self._connect_errors[connect.peer_id] = str(exc)
            self._handle(Connected(connect.peer_id, str(exc)))
            return
        self._engine_peers[connect.peer_id] = engine_peer
        self._handle(Connected(connect.peer_id))

    def _set_up_next(self) -> _Starting | None:
        """The next transfer set up from the prepared writes (under `_setting_up`); writes
        that end before one could be (failed, or nothing to move) are reported."""
        while self._ready:
            ended: _Ended = []
            starting = self._set_up(_merged(self._ready), ended)
            if ended:
                self._to_report.put(ended)
            if starting is not None:
                return starting
        return None

    def _set_up(self, group: list[_Prepared], ended: _Ended) -> _Starting | None:
        """Prepared writes to one peer as one engine transfer, set up to be posted; None if
        they ended already (failed, or nothing to move), added to `ended`."""
        writes = [prepared.write for prepared in group]
        peer_id = writes[0].job.peer_id
        notify, completing = transfer_notification(writes)
        plan = TransferPlan.concat(*(prepared.plan for prepared in group), memory=self._plan_memory)
        failure: Exception | None = None
        try:
            engine_peer = self._engine_peers.get(peer_id)
            if engine_peer is None:
                missing = self._connect_errors.get(peer_id, "not connected")
                raise EngineError(self.engine.name, "write", missing)
            if len(plan):
                pending = self.engine.prepare_write(engine_peer, plan, notify)
                return _Starting(group, plan, engine_peer, pending, completing)
            why = self._lease_problem(peer_id)
            if why is not None:
                raise WriteFenced(self.engine.name, "write", why)
            plain = completing.notify if completing is not None else notify
            if plain and self.engine.delivers_notifications:
                self.engine.notify(engine_peer, plain)  # alone it completes nothing
        except (EngineError, ValueError) as exc:
            failure = exc
        self._release(group, plan)
        ended += [(write, failure, False) for write in writes]
        return None

    def _start(self, starting: _Starting) -> list[_Posted]:
        """Post a set-up transfer under a valid write lease (asked at the last moment): the
        posted transfer, or none (its writes are then reported as failed)."""
        peer_id = starting.writes[0].write.job.peer_id
        try:
            why = self._lease_problem(peer_id)
            if why is not None:
                starting.pending.release()
                raise WriteFenced(self.engine.name, "write", why)
            started = time.monotonic()
            self._transfers_out += 1  # (before the post call: over CMA the copy is inside it)
            if not self._posting.is_set():
                self._posting.set()  # (the channel's thread may wait for this copy to start)
            handle = starting.pending.start()
        except EngineError as exc:
            self._release(starting.writes, starting.plan)
            self._to_report.put([(prepared.write, exc, False) for prepared in starting.writes])
            return []
        return [
            _Posted(
                starting.writes,
                starting.plan,
                starting.engine_peer,
                handle,
                started,
                starting.completing,
            )
        ]

    def _release(self, group: list[_Prepared], plan: TransferPlan, reuse: bool = True) -> None:
        """These plans are done with: their memory may serve the next ones (unless a
        benchmark keeps them). A write that timed out may still be read by an engine that
        moves writes on its own: its memory is only forgotten, never reused."""
        plans = [prepared.plan for prepared in group] + ([plan] if len(group) > 1 else [])
        for done in plans:
            if reuse and not self._write_observers:
                self._plan_memory.give_back(done)
            else:
                self._plan_memory.forget(done)

    def _progress(self, posted: list[_Posted]) -> tuple[list[_Posted], _Ended]:
        """Poll every transfer in flight once: those still moving, and the writes of those
        that ended (to be reported)."""
        # Engines that move a write on only when polled stop at the fence (the lease, asked
        # once per peer per round); others finish or time out what they were given (decode
        # waits that out).
        fenced = not self.engine.progresses_on_its_own
        peers = {item.writes[0].write.job.peer_id for item in posted}
        leases = {peer: self._lease_problem(peer) for peer in peers} if fenced else {}
        still: list[_Posted] = []
        ended: _Ended = []
        for item in posted:
            peer_id = item.writes[0].write.job.peer_id
            try:
                done = item.handle.check(
                    item.started, self.config.write_timeout_s, leases.get(peer_id)
                )
            except EngineError as exc:
                self._release(item.writes, item.plan, reuse=not isinstance(exc, EngineTimeout))
                ended += [(prepared.write, exc, False) for prepared in item.writes]
                continue
            if not done:
                still.append(item)
                continue
            elapsed = time.monotonic() - item.started
            blocks = sum(len(prepared.plan) for prepared in item.writes)
            nbytes = sum(prepared.plan.total_bytes for prepared in item.writes)
            self.stats.write_s += elapsed
            self.stats.blocks_written += blocks
            self.metrics.observe_write(elapsed, blocks, nbytes)
            log.debug(
                "room(s) %s: %d block(s), %d bytes to %s in %.2f ms",
                ", ".join(str(p.write.room) for p in item.writes),
                blocks,
                nbytes,
                peer_id,
                elapsed * 1e3,
            )
            self._release(item.writes, item.plan)
            for prepared in item.writes:
                for observer in self._write_observers:
                    observer(prepared.write.room, item.engine_peer, prepared.plan)
                ended.append((prepared.write, None, prepared.write is item.completing))
        return still, ended

    # --- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        if self._lease is not None:  # withdrawn first: a restarted rank can register at once
            self._lease.close()
        # The preparing thread then stops the engine thread, and that the reporting one.
        self._to_prepare.put(None)
        for thread in self._threads:
            thread.join(timeout=10.0)
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
    def pages_safe(self) -> bool:
        """Whether the room's pages can go back to the allocator: the room ended and no write
        of it is in flight (an engine may read them until then)."""
        return self.manager.pages_safe(self.room)

    @property
    def asked(self) -> bool:
        """Whether a decode request for the room arrived (a room that failed unasked expired:
        no decode claimed its pages in time)."""
        state = self.manager.protocol.rooms.get(self.room)  # a dict read: no lock needed
        return state is not None and bool(state.requests)

    def abort(self, reason: str) -> None:
        self.manager.abort_room(self.room, reason)

    def clear(self) -> None:
        self.manager.clear_room(self.room)
