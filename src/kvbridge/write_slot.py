"""The write pipeline's next transfer (`kvbridge.write_pipeline`): the prepared writes in the
order the protocol handed them out, and the next engine transfer set up from them, at most one
ahead of the engine so that what waits together merges. The preparing thread sets it up while
the engine copies, the engine thread itself when it needs one before the preparing thread got
to it; a gated transfer (`kvbridge.write_gate`) stays next, held, until its gate opens, and
the engine thread takes it to post or drop it. One lock guards both; nothing here waits for
anything but that lock.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from kvbridge.write_transfers import Ended, EngineTransfers, Prepared, Starting, merged


class NextTransfer:
    """`report` is told the writes that end while a transfer is set up (failed, or nothing to
    move); `gate_opened` is called when a held transfer's gate opens, on the opener's thread
    (at once, on the setting-up thread under the lock, if it was open already): it must not
    wait for anything."""

    def __init__(
        self,
        transfers: EngineTransfers,
        report: Callable[[Ended], None],
        gate_opened: Callable[[], None],
    ) -> None:
        self._transfers = transfers
        self._report = report
        self._gate_opened = gate_opened
        self._lock = threading.Lock()
        self._ready: deque[Prepared] = deque()
        self._next: Starting | None = None

    @property
    def empty(self) -> bool:
        """Whether nothing is prepared or set up (read without the lock: a hint)."""
        return self._next is None and not self._ready

    def add(self, prepared: Prepared) -> None:
        with self._lock:
            self._ready.append(prepared)

    def set_up(self) -> bool:
        """Set the next transfer up, unless one is or nothing is prepared: whether the engine
        thread has something new to look at."""
        with self._lock:
            if self._next is not None or not self._ready:
                return False
            self._next = self._set_up_next()
            return True

    def take(self) -> tuple[Starting | None, Starting | None]:
        """The transfer to post now (set up here if the preparing thread has not got to it),
        or the one held behind its closed gate, which stays next: (to post, held)."""
        with self._lock:
            starting, self._next = self._next, None
            if starting is None and self._ready:
                starting = self._set_up_next()
            if starting is not None and starting.held:
                self._next = starting
                return None, starting
            return starting, None

    def held(self) -> Starting | None:
        """The transfer that is next now, if any (held, or about to be taken)."""
        with self._lock:
            return self._next

    def take_held(self, starting: Starting) -> bool:
        """Take `starting` to drop it, if it is still next (not taken since)."""
        with self._lock:
            if self._next is not starting:
                return False
            self._next = None
            return True

    def close(self) -> None:
        """Give the set-up transfer's engine resources back: nothing more is posted."""
        with self._lock:
            if self._next is not None:
                self._next.pending.release()
                self._next = None

    def _set_up_next(self) -> Starting | None:
        """The next transfer set up from the prepared writes (under the lock)."""
        while self._ready:
            ended: Ended = []
            starting = self._transfers.set_up(merged(self._ready), ended)
            if ended:
                self._report(ended)
            if starting is not None:
                gate = starting.writes[0].write.job.gate
                if gate is not None:  # its opening wakes the engine thread to post it
                    gate.when_open(self._gate_opened)
                return starting
        return None
