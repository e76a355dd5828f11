"""The write pipeline's preparing thread (`kvbridge.write_pipeline`): it connects the engine to
new decode peers, waits for a write lease, gathers a staged chunk into the staging buffer,
plans each write and sets the next engine transfer up (`kvbridge.write_slot`) while the current
one moves, in the order the protocol handed them out.
"""

from __future__ import annotations

import queue
from collections.abc import Callable

from kvbridge.cache import PlanError
from kvbridge.core.prefill_events import Connect, Write
from kvbridge.engines import EngineError, WriteFenced
from kvbridge.write_slot import NextTransfer
from kvbridge.write_transfers import Clock, EngineTransfers, PipelineHost, Prepared

# How often the preparing thread looks for a write lease it waits for.
LEASE_POLL_S = 0.002


class Wake:
    """Put on a thread's queue to make it look again (the set-up transfer slot changed)."""


WAKE = Wake()


class Preparer:
    """Takes `Write`s and `Connect`s (and wakes) from `inbox` until None; `wake_engine`
    tells the engine thread that a transfer is set up, `stop_engine` that nothing more comes.
    `lease_wait_s`: how long a write waits for a lease (a peer that just registered, or
    registered again after a partition, answers a heartbeat within a round trip)."""

    def __init__(
        self,
        transfers: EngineTransfers,
        host: PipelineHost,
        slot: NextTransfer,
        lease_wait_s: float,
        clock: Clock,
        wake_engine: Callable[[], None],
        stop_engine: Callable[[], None],
    ) -> None:
        self.inbox: queue.SimpleQueue[Write | Connect | Wake | None] = queue.SimpleQueue()
        self._transfers = transfers
        self._host = host
        self._slot = slot
        self._lease_wait_s = lease_wait_s
        self._clock = clock
        self._wake_engine = wake_engine
        self._stop_engine = stop_engine

    def run(self) -> None:
        inbox = self.inbox
        while (item := inbox.get()) is not None:
            if isinstance(item, Connect):
                self._transfers.connect(item)
            elif isinstance(item, Write):
                try:
                    prepared = self._prepare(item)
                except (EngineError, PlanError, ValueError) as exc:
                    self._host.write_ended(item, exc, False)
                    prepared = None
                else:
                    if prepared is None:  # its room ended meanwhile: nothing was written
                        self._host.write_ended(item, None, False)
                if prepared is not None:
                    self._slot.add(prepared)
                    if not prepared.write.notify and not inbox.empty():
                        continue  # the room's next chunk may go in the same transfer
            if self._slot.set_up():  # an engine thread idle in its queue is woken for it
                self._wake_engine()
        self._stop_engine()

    def _await_lease(self, peer_id: str) -> str | None:
        """Wait (up to `lease_wait_s`) for a valid write lease; why there is none, or None."""
        deadline = self._clock.monotonic() + self._lease_wait_s
        while (why := self._host.lease_problem(peer_id)) is not None:
            if self._clock.monotonic() >= deadline:
                return why
            self._clock.sleep(LEASE_POLL_S)
        return None

    def _prepare(self, write: Write) -> Prepared | None:
        """The write's blocks; None if its room ended meanwhile."""
        if not self._host.room_going(write.room):
            return None
        why = self._await_lease(write.job.peer_id)
        if why is not None:
            raise WriteFenced(self._transfers.engine.name, "write", why)
        return self._transfers.plan(write)
