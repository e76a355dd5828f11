"""`WriteGate`: a chunk handed over before its data is computed, written once it is.

Layer-wise, prefill's forward computes one layer after another. Handing each layer's write
over only when its layer is done puts the write's whole set-up (the room's bookkeeping, the
plan, the engine's descriptors) after the layer, and for the last layer after the forward,
where it is what decode waits for. With a gate the writes are handed over before the forward
(`KVSender.send(..., gate=g)`): planned and set up at once, then held by the write pipeline
until the owner calls `g.open()` right after the layer is computed; the engine thread posts
it then, and only the copy is left.

One gate may hold any number of writes (every room and decode rank of a batch's layer).
Writes go to the engine in the order they were handed over, gated or not: hand them over in
the order their gates will open (layer by layer, each layer's rooms together), since a write
waits behind a closed gate ahead of it. A room that ends while its writes wait (abort, a
failure) drops them unwritten.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class WriteGate:
    """Closed until `open()`; opening is for good and tells everyone waiting on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = False
        self._waiting: list[Callable[[], None]] = []

    @property
    def is_open(self) -> bool:
        return self._open

    def open(self) -> None:
        """The data is in place: the writes it holds may go (idempotent)."""
        with self._lock:
            if self._open:
                return
            self._open = True
            waiting, self._waiting = self._waiting, []
        for callback in waiting:
            callback()

    def when_open(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the gate opens: now, if it is open (on the opener's thread
        otherwise: it must be quick and must not block)."""
        with self._lock:
            if not self._open:
                self._waiting.append(callback)
                return
        callback()

    def __repr__(self) -> str:
        return f"WriteGate({'open' if self._open else 'closed'})"
