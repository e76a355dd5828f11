"""Prefill's write pipeline: the writes and engine connections prefill's protocol hands out,
carried through the engine in the order it handed them out.

Three threads. The preparing thread (`kvbridge.write_preparer`) connects the engine to new
decode peers, waits for a write lease, gathers a staged chunk into the staging buffer, plans
each write and sets the next engine transfer up (descriptors) while the current one moves.
The engine thread posts the set-up transfers in order (setting one up itself when the
preparing thread has not got to it), merging prepared writes to one peer that wait together
into one transfer (a gated one when its gate opens: `kvbridge.write_gate`), and polls every
transfer in flight, the lease checked before each post and each poll round of an engine that
moves writes only when polled. The reporting thread tells the host each write that ended.

The engine calls themselves are `kvbridge.write_transfers.EngineTransfers`. What the pipeline
needs of its manager is `PipelineHost`; the engine and the clock are given, so that tests drive
it with a fake engine and a fake clock.

The lock rule: every field belongs to one of the threads (said where it is made), except the
prepared writes and the next set-up transfer (`kvbridge.write_slot.NextTransfer`, under its
own lock). The channel's thread reads two things without a lock, each a hint whose wrong
answer costs one short wait (`idle`, `posting`); the host's `lease_problem` is safe without
the manager's lock (a lease only grows).
"""

from __future__ import annotations

import logging
import queue
import sys
import threading

from kvbridge.cache import KVArgs
from kvbridge.core.prefill_events import Connect, Write
from kvbridge.core.waits import WINDOW_S, EngineWaits
from kvbridge.engines import EngineTimeout, TransferEngine
from kvbridge.staging.buffer import StagingBuffer
from kvbridge.write_preparer import WAKE, Preparer, Wake
from kvbridge.write_slot import NextTransfer
from kvbridge.write_transfers import (
    Clock,
    Ended,
    EngineTransfers,
    PipelineHost,
    Posted,
    Starting,
    SystemClock,
    WriteObserver,
    WriteStats,
)

log = logging.getLogger("kvbridge.prefill")

# How long the engine thread sleeps between polls of a write in flight. A polling loop that
# never sleeps keeps the GIL: the process's other threads (the control channel sending
# statuses, vLLM's engine step) then wait up to Python's 5 ms switch interval for each turn.
# Measured in vLLM (8 × 1k-token loads): time until decode's KV is in place 35-50 ms → 23-33 ms.
WRITE_POLL_S = 0.0001
# With an engine that moves writes on its own threads and says when one ended, the engine
# thread sleeps until then instead, looking at the writes' deadlines at least this often.
WRITE_WAIT_S = 0.01


class WritePipeline:
    """One prefill rank's writes through its engine: `submit` each `Write` and `Connect` in
    the order the protocol handed them out; `close` stops the threads (what is in flight is
    released). `lease_wait_s`: how long a write waits for a lease (a peer that just
    registered, or registered again after a partition, answers a heartbeat within a round
    trip)."""

    def __init__(
        self,
        engine: TransferEngine,
        kv_args: KVArgs,
        staging: StagingBuffer | None,
        host: PipelineHost,
        write_timeout_s: float,
        lease_wait_s: float,
        clock: Clock | None = None,
        name: str = "prefill",
        who: str = "prefill rank",
    ) -> None:
        self.engine = engine
        self._host = host
        self._clock: Clock = clock or SystemClock()
        self._who = who  # named in its warnings
        self._write_timeout_s = write_timeout_s
        self.transfers = EngineTransfers(
            engine, kv_args, staging, host, write_timeout_s, self._clock, self._before_post
        )
        self.stats: WriteStats = self.transfers.stats
        # Time the engine thread spent in engine calls, and off a CPU in them (engine thread).
        self.engine_waits = EngineWaits()
        self._to_engine: queue.SimpleQueue[Wake | None] = queue.SimpleQueue()
        self._to_report: queue.SimpleQueue[Ended | None] = queue.SimpleQueue()
        engine.add_write_end_listener(self._wake_engine_thread)
        self._closed = False
        self._slot = NextTransfer(self.transfers, self._to_report.put, self._wake_engine_thread)
        self._preparer = Preparer(
            self.transfers,
            host,
            self._slot,
            lease_wait_s,
            self._clock,
            self._wake_engine_thread,
            lambda: self._to_engine.put(None),
        )
        self._to_prepare = self._preparer.inbox
        # Transfers the engine thread has posted and not yet seen end (engine thread), and set
        # when a copy starts (the channel's thread may wait for the first copy of a burst).
        self._transfers_out = 0
        self.posting = threading.Event()
        self.threads = [
            threading.Thread(
                target=self._preparer.run, name=f"kvbridge-{name}-prepare", daemon=True
            ),
            threading.Thread(target=self._run_engine, name=f"kvbridge-{name}-engine", daemon=True),
            threading.Thread(
                target=self._run_reporter, name=f"kvbridge-{name}-report", daemon=True
            ),
        ]
        for thread in self.threads:
            thread.start()

    # --- the manager's side ----------------------------------------------------------------

    def submit(self, item: Write | Connect) -> None:
        """A write or a connect, in the order the protocol handed them out."""
        self._to_prepare.put(item)

    @property
    def idle(self) -> bool:
        """Whether nothing is on its way to the engine or moving (read without the locks that
        guard these: a wrong answer costs the caller at most one short wait)."""
        return self._transfers_out == 0 and self._slot.empty and self._to_prepare.empty()

    def observe_writes(self, observer: WriteObserver) -> None:
        """Tell `observer` the plan of every write that ends from now on. An observed plan's
        memory is never reused."""
        self.transfers.observers.append(observer)

    def close(self) -> None:
        """Stop the threads (idempotent): the preparing thread stops the engine thread, and
        that the reporting one; transfers still in flight are released."""
        self._to_prepare.put(None)
        for thread in self.threads:
            thread.join(timeout=10.0)
        if not self._closed:
            self._closed = True
            self.engine.remove_write_end_listener(self._wake_engine_thread)

    # --- engine thread: post and poll ---------------------------------------------------------

    def _run_engine(self) -> None:
        posted: list[Posted] = []
        clock = self._clock
        held: Starting | None = None  # the next transfer, waiting for its gate
        # The held transfer looked at last, since when it is held, and when its room was
        # last asked about.
        looked_at: Starting | None = None
        held_since = room_looked_at = 0.0
        while True:
            # Block only when nothing is in flight (a held write's room is looked at again
            # every WRITE_WAIT_S: one that ended drops it); else take what arrived.
            items: list[Wake | None] = []
            if held and not posted:
                self._wait_for_engine()  # (what woke it stays on the queue: taken below)
            elif not posted:
                items.append(self._to_engine.get())
            while True:
                try:
                    items.append(self._to_engine.get_nowait())
                except queue.Empty:
                    break
            if None in items:
                self._close_engine_loop(posted)
                return
            wall_started, cpu_started = clock.perf_counter(), clock.thread_time()
            posted, ended = self.transfers.progress(posted)
            if ended:
                self._to_report.put(ended)
            starting, held = self._slot.take()  # (held: its data is not computed yet)
            # A held transfer's room is looked at when it becomes held (a room that ended
            # drops its held writes one after another without a wait each), after a quiet
            # wait, and every WRITE_WAIT_S while others move.
            now = clock.monotonic()
            waited = not items and not posted
            if held is not None and held is not looked_at:
                looked_at, held_since, waited = held, now, True
            if held is not None and (waited or now - room_looked_at >= WRITE_WAIT_S):
                room_looked_at = now
                if self._drop_held(held, now - held_since):
                    held = None
                    continue  # the next one may go now
            if starting is not None:
                # The preparing thread sets the one after up while this one moves (NIXL over
                # CMA copies inside the post call, without the GIL); with none prepared it
                # has nothing to do (one it adds later, it sets up itself), and waking it
                # would only delay this post.
                if not self._slot.empty:
                    self._to_prepare.put(WAKE)
                moving, failed = self.transfers.start(starting)
                if moving is not None:
                    posted.append(moving)
                if failed:
                    self._to_report.put(failed)
            self._transfers_out = len(posted)
            self._note_waits(wall_started, cpu_started)
            if posted and starting is None and not ended:
                if self.engine.progresses_on_its_own:
                    self._wait_for_engine()
                else:
                    clock.sleep(WRITE_POLL_S)

    def _drop_held(self, held: Starting, held_s: float) -> bool:
        """The held transfer dropped if its room ended meanwhile (aborted or failed: a gate
        that never opens holds nothing back then), its writes reported unwritten; or failed
        if its gate stayed closed longer than a write may take (a forward that stopped
        without opening it: the writes behind it go on). Not if another thread took it."""
        failure: Exception | None = None
        if self._host.room_going(held.writes[0].write.room):
            if held_s < self._write_timeout_s:
                return False
            failure = EngineTimeout(
                self.engine.name,
                "write",
                f"its data was not computed within {self._write_timeout_s:g} s (the gate it "
                "was handed over with stayed closed)",
            )
        if not self._slot.take_held(held):
            return False
        held.pending.release()
        self.transfers.release(held.writes, held.plan)
        self._to_report.put([(prepared.write, failure, False) for prepared in held.writes])
        self._to_prepare.put(WAKE)
        return True

    def _before_post(self) -> None:
        self._transfers_out += 1  # (before the post call: over CMA the copy is inside it)
        if not self.posting.is_set():
            self.posting.set()  # (the channel's thread may wait for this copy to start)

    def _wake_engine_thread(self) -> None:
        """A write ended (called on the engine's own thread)."""
        self._to_engine.put(WAKE)

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

    def _close_engine_loop(self, posted: list[Posted]) -> None:
        """Closing: nothing more moves."""
        for left in posted:
            left.handle.release()
        self._slot.close()
        self._to_report.put(None)

    def _note_waits(self, wall_started: float, cpu_started: float) -> None:
        """Count a stretch of engine calls (polls, set-up, post) and the part of it spent off
        a CPU; warn when that was most of the last window (`kvbridge.core.waits`)."""
        clock = self._clock
        wall_s = clock.perf_counter() - wall_started
        off_cpu = clock.thread_time() - cpu_started
        share = self.engine_waits.add(wall_s, off_cpu, clock.monotonic())
        if share is not None:
            log.warning(
                "%s: %.0f%% of the engine thread's last %.2f s in engine calls went to waiting "
                "for the GIL or a CPU, not to moving data: another thread of this process keeps "
                "the GIL (one that never blocks holds it for the switch interval, %.1f ms now: "
                "sys.setswitchinterval), or the host's CPUs are all busy",
                self._who,
                share * 100,
                WINDOW_S,
                sys.getswitchinterval() * 1e3,
            )

    # --- reporting thread: ended writes to the host ------------------------------------------

    def _run_reporter(self) -> None:
        while (ended := self._to_report.get()) is not None:
            for write, failure, completed in ended:
                self._host.write_ended(write, failure, completed)
