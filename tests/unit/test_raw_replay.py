"""The benchmarks' raw replay waits for an engine that moves writes on its own threads the way
prefill's engine thread does: asleep until a write ended, not polling every 0.1 ms (a polling
thread took 8 % from Mooncake over TCP on two CPUs, and the baseline paid it)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvbridge_tools.demo import _timed_writes

WRITE_S = 0.2


class _Write:
    def __init__(self, engine: SelfMovingEngine) -> None:
        self.engine = engine
        self.done = False
        threading.Timer(WRITE_S, self.end).start()

    def end(self) -> None:
        self.done = True
        for listener in tuple(self.engine.listeners):
            listener()

    def check(self, started: float, timeout_s: float) -> bool:
        self.engine.polls += 1
        return self.done


class SelfMovingEngine:
    """Writes end on a timer thread of their own, which tells the listeners."""

    progresses_on_its_own = True

    def __init__(self) -> None:
        self.listeners: list[Callable[[], None]] = []
        self.polls = 0

    def add_write_end_listener(self, listener: Callable[[], None]) -> None:
        self.listeners.append(listener)

    def remove_write_end_listener(self, listener: Callable[[], None]) -> None:
        self.listeners.remove(listener)

    def write(self, peer: str, plan: object) -> _Write:
        return _Write(self)


def test_the_replay_sleeps_until_a_write_ended() -> None:
    engine = SelfMovingEngine()
    seconds = _timed_writes(engine, [("peer", object())] * 2, 1, timeout_s=10.0)  # type: ignore[list-item]
    assert seconds >= 2 * WRITE_S
    # Polling every 0.1 ms would have looked thousands of times; a look per wake-up (and one
    # per 10 ms, `WRITE_WAIT_S`, while none comes) about 40.
    assert engine.polls <= 100
    assert engine.listeners == []  # taken off again
