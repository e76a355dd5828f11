"""The engine calls of prefill's write pipeline (`kvbridge.write_pipeline`), one transfer at a
time: connect to a decode peer, gather and plan a write, set prepared writes to one peer up as
one engine transfer, post it under a valid write lease, poll what is in flight (the lease as a
fence for an engine that moves writes only when polled), and give plan memory back. What it
needs of its manager is `PipelineHost`; the engine and the clock are given (tests fake both).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvbridge.cache import KVArgs, TransferPlan
from kvbridge.cache.peer import memory_regions
from kvbridge.cache.plan import PlanArena
from kvbridge.core.prefill_events import Connect, Write, transfer_notification
from kvbridge.engines import (
    EngineError,
    EngineTimeout,
    PendingWrite,
    TransferEngine,
    TransferHandle,
    WriteFenced,
)
from kvbridge.staging.buffer import StagingBuffer
from kvbridge.write_plan import plan_write

log = logging.getLogger("kvbridge.prefill")

# Told (room, engine peer, plan) of each write that ended, on the engine thread.
WriteObserver = Callable[[int, str, TransferPlan], None]
# Prepared writes to one peer that wait together are posted as one engine transfer (the
# engine's per-transfer cost and this process's per-write work are paid once for them), at
# most this many writes and blocks; a transfer carries at most one notification.
MAX_MERGED_WRITES = 8
MAX_MERGED_BLOCKS = 1 << 16


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def perf_counter(self) -> float: ...
    def thread_time(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The process's clocks."""

    monotonic = staticmethod(time.monotonic)
    perf_counter = staticmethod(time.perf_counter)
    thread_time = staticmethod(time.thread_time)
    sleep = staticmethod(time.sleep)


class PipelineHost(Protocol):
    """What the pipeline asks of prefill's manager."""

    def room_going(self, room: int) -> bool:
        """Whether the room has not ended (a write of an ended room is not written)."""

    def lease_problem(self, peer_id: str) -> str | None:
        """Why this rank may not write to the peer now, or None; safe without the lock."""

    def write_ended(self, write: Write, failure: Exception | None, completed: bool) -> None:
        """A write ended: written (`completed`: its notification completed its room for
        the peer), or failed with `failure`."""

    def completes_room(self, write: Write) -> bool:
        """Whether the room is going and every other write of it to the write's peer ended,
        written: `write`'s complete notification would now complete the room there."""

    def connected(self, peer_id: str, error: str | None) -> None:
        """A `Connect` ended (`error`: why it failed)."""

    def observe_write(self, seconds: float, blocks: int, nbytes: int) -> None:
        """A transfer was written: for the metrics."""


@dataclass
class WriteStats:
    """Where the pipeline's time goes (seconds) and what it wrote; written by its threads
    only, read by anyone (counters: a read may lag)."""

    blocks_written: int = 0
    plan_s: float = 0.0
    gather_s: float = 0.0
    write_s: float = 0.0


@dataclass
class Prepared:
    """A write with its blocks planned (and its chunk gathered), ready for the engine."""

    write: Write
    plan: TransferPlan


@dataclass
class Starting:
    """Prepared writes to one peer as one engine transfer, set up and about to be posted."""

    writes: list[Prepared]
    plan: TransferPlan
    engine_peer: str
    pending: PendingWrite
    completing: Write | None  # the write whose room its notification completes, if any

    @property
    def held(self) -> bool:
        """Whether it waits for its data: a gated write whose gate is closed."""
        gate = self.writes[0].write.job.gate
        return gate is not None and not gate.is_open


# Writes that ended, each with what failed it (None: written) and whether it went with a
# complete notification (`transfer_notification`), for the reporting thread.
Ended = list[tuple[Write, Exception | None, bool]]


@dataclass
class Posted:
    """Prepared writes to one peer that the engine is moving as one transfer (`plan`: theirs
    together)."""

    writes: list[Prepared]
    plan: TransferPlan
    engine_peer: str
    handle: TransferHandle
    started: float  # monotonic, when it was posted
    completing: Write | None


def merged(ready: deque[Prepared]) -> list[Prepared]:
    """The writes at the head of `ready` that go as one transfer: in order, to one peer,
    within `MAX_MERGED_WRITES` and `MAX_MERGED_BLOCKS`, and ending with the first one that
    carries a notification (the room it completes does not wait for the next room's
    chunks). A gated write (`kvbridge.write_gate`) goes alone: it waits for its own gate."""
    group = [ready.popleft()]
    peer_id = group[0].write.job.peer_id
    blocks = len(group[0].plan)
    if group[0].write.job.gate is not None:
        return group
    while ready and len(group) < MAX_MERGED_WRITES and not group[-1].write.notify:
        following = ready[0]
        if following.write.job.peer_id != peer_id or following.write.job.gate is not None:
            break
        if blocks + len(following.plan) > MAX_MERGED_BLOCKS:
            break
        group.append(ready.popleft())
        blocks += len(following.plan)
    return group


class EngineTransfers:
    """One prefill rank's engine calls. `connect` runs on the preparing thread, `plan` and
    `set_up` on whichever thread sets the next transfer up (under the pipeline's lock),
    `start` and `progress` on the engine thread; `before_post` is called right before each
    post."""

    def __init__(
        self,
        engine: TransferEngine,
        kv_args: KVArgs,
        staging: StagingBuffer | None,
        host: PipelineHost,
        write_timeout_s: float,
        clock: Clock,
        before_post: Callable[[], None],
    ) -> None:
        self.engine = engine
        self.kv_args = kv_args
        self._staging = staging
        self._host = host
        self._write_timeout_s = write_timeout_s
        self._clock = clock
        self.before_post = before_post
        self.stats = WriteStats()
        # decode peer id → the engine's peer, and why a connect failed (written by the
        # preparing thread before the connect's end reaches the protocol, which hands out the
        # peer's writes only after it).
        self._engine_peers: dict[str, str] = {}
        self._connect_errors: dict[str, str] = {}
        # Told (room, engine peer, plan) of every write that ended (benchmarks replay them).
        self.observers: list[WriteObserver] = []
        # Address arrays of large plans, reused once their write ended (not while observed).
        self._plan_memory = PlanArena()

    def connect(self, connect: Connect) -> None:
        try:
            engine_peer = self.engine.connect(connect.descriptor, memory_regions(connect.peer_args))
        except EngineError as exc:
            self._connect_errors[connect.peer_id] = str(exc)
            self._host.connected(connect.peer_id, str(exc))
            return
        self._engine_peers[connect.peer_id] = engine_peer
        self._host.connected(connect.peer_id, None)

    def plan(self, write: Write) -> Prepared:
        """The write's blocks, its chunk gathered into the staging buffer first when staged."""
        staging_ptr = 0
        clock = self._clock
        if write.staged is not None:
            assert self._staging is not None
            staged = write.staged
            started = clock.perf_counter()
            self._staging.gather(staged.src_rows, staged.column, staged.width, staged.local_offset)
            self.stats.gather_s += clock.perf_counter() - started
            staging_ptr = self._staging.ptr
        started = clock.perf_counter()
        plan = plan_write(self.kv_args, write, staging_ptr, self._plan_memory)
        self.stats.plan_s += clock.perf_counter() - started
        return Prepared(write, plan)

    def set_up(self, group: list[Prepared], ended: Ended) -> Starting | None:
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
                return Starting(group, plan, engine_peer, pending, completing)
            why = self._host.lease_problem(peer_id)
            if why is not None:
                raise WriteFenced(self.engine.name, "write", why)
            plain = completing.notify if completing is not None else notify
            if plain and self.engine.delivers_notifications:
                self.engine.notify(engine_peer, plain)  # alone it completes nothing
        except (EngineError, ValueError) as exc:
            failure = exc
        self.release(group, plan)
        ended += [(write, failure, False) for write in writes]
        return None

    def start(self, starting: Starting) -> tuple[Posted | None, Ended]:
        """Post a set-up transfer under a valid write lease (asked at the last moment): the
        posted transfer, or none and its writes, failed."""
        peer_id = starting.writes[0].write.job.peer_id
        try:
            why = self._host.lease_problem(peer_id)
            if why is not None:
                starting.pending.release()
                raise WriteFenced(self.engine.name, "write", why)
            notify = self._complete_now(starting)
            started = self._clock.monotonic()
            self.before_post()  # (over CMA the copy is inside the post call)
            handle = starting.pending.start(notify)
        except EngineError as exc:
            self.release(starting.writes, starting.plan)
            return None, [(prepared.write, exc, False) for prepared in starting.writes]
        posted = Posted(
            starting.writes,
            starting.plan,
            starting.engine_peer,
            handle,
            started,
            starting.completing,
        )
        return posted, []

    def _complete_now(self, starting: Starting) -> bytes | None:
        """The complete notification, for a transfer whose room's other writes were still
        out when it was handed out and have all ended, written, since (a gated last layer,
        handed out before the forward with the others: `kvbridge.write_gate`); None: the one
        it was set up with. The transfer then completes the room (`completing`)."""
        last = starting.writes[-1].write
        if (
            last.job.gate is None  # (handed out when the data was there: it knew then)
            or starting.completing is not None
            or len(starting.writes) > 1
            or not last.notify_complete
            or not starting.pending.renotifiable
            or not self._host.completes_room(last)
        ):
            return None
        starting.completing = last
        return last.notify_complete

    def release(self, group: list[Prepared], plan: TransferPlan, reuse: bool = True) -> None:
        """These plans are done with: their memory may serve the next ones (unless a
        benchmark keeps them). A write that timed out may still be read by an engine that
        moves writes on its own: its memory is only forgotten, never reused."""
        plans = [prepared.plan for prepared in group] + ([plan] if len(group) > 1 else [])
        for done in plans:
            if reuse and not self.observers:
                self._plan_memory.give_back(done)
            else:
                self._plan_memory.forget(done)

    def progress(self, posted: list[Posted]) -> tuple[list[Posted], Ended]:
        """Poll every transfer in flight once: those still moving, and the writes of those
        that ended (to be reported)."""
        # Engines that move a write on only when polled stop at the fence (the lease, asked
        # once per peer per round); others finish or time out what they were given (decode
        # waits that out).
        fenced = not self.engine.progresses_on_its_own
        peers = {item.writes[0].write.job.peer_id for item in posted}
        leases = {peer: self._host.lease_problem(peer) for peer in peers} if fenced else {}
        still: list[Posted] = []
        ended: Ended = []
        for item in posted:
            peer_id = item.writes[0].write.job.peer_id
            try:
                done = item.handle.check(item.started, self._write_timeout_s, leases.get(peer_id))
            except EngineError as exc:
                self.release(item.writes, item.plan, reuse=not isinstance(exc, EngineTimeout))
                ended += [(prepared.write, exc, False) for prepared in item.writes]
                continue
            if not done:
                still.append(item)
                continue
            elapsed = self._clock.monotonic() - item.started
            blocks = sum(len(prepared.plan) for prepared in item.writes)
            nbytes = sum(prepared.plan.total_bytes for prepared in item.writes)
            self.stats.write_s += elapsed
            self.stats.blocks_written += blocks
            self._host.observe_write(elapsed, blocks, nbytes)
            log.debug(
                "room(s) %s: %d block(s), %d bytes to %s in %.2f ms",
                ", ".join(str(p.write.room) for p in item.writes),
                blocks,
                nbytes,
                peer_id,
                elapsed * 1e3,
            )
            self.release(item.writes, item.plan)
            for prepared in item.writes:
                for observer in self.observers:
                    observer(prepared.write.room, item.engine_peer, prepared.plan)
                ended.append((prepared.write, None, prepared.write is item.completing))
        return still, ended
