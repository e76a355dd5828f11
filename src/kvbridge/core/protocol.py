"""What both sides' protocol cores share: the actions every manager executes the same way,
the tick, the counters every rank keeps, and dispatch through one handler table."""

from __future__ import annotations

import heapq
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvbridge.core.liveness import Liveness
from kvbridge.core.room import RoomStatus
from kvbridge.wire import Message


@dataclass(frozen=True)
class Send:
    """Send a control message to a peer's endpoint."""

    endpoint: str
    message: Message


@dataclass(frozen=True)
class RoomsChanged:
    """A room may have ended or its pages come free: wake whoever waits for that."""


@dataclass(frozen=True)
class Tick:
    """The control loop's tick, with the engine's notifications since the last one (decode
    polls them; a prefill rank's ticks carry none)."""

    notifications: tuple[bytes, ...] = ()


Key = TypeVar("Key")


class DueQueue(Generic[Key]):
    """Keys by the time they fall due, soonest first (a heap), so that a tick looks only at
    what fell due and not at every room or job in a table. An entry is never taken out early:
    whoever pops a key checks whether it still applies (the room may have ended). Entries of
    keys that ended are dropped by `compact` once they outnumber the live ones."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, Key]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, due: float, key: Key) -> None:
        heapq.heappush(self._heap, (due, key))

    def pop_due(self, now: float) -> Iterator[tuple[float, Key]]:
        """(due, key) of every entry due before `now`, soonest first, each taken out."""
        while self._heap and self._heap[0][0] < now:
            yield heapq.heappop(self._heap)

    def compact(self, live: int, entries: Callable[[], Iterable[tuple[float, Key]]]) -> None:
        """Rebuild from `entries()` (what still applies) when the queue holds more than twice
        `live` entries (plus some slack): amortized, the queue stays as large as the table."""
        if len(self._heap) > 2 * live + 64:
            self._heap = list(entries())
            heapq.heapify(self._heap)


@dataclass
class RankStats:
    """Counters every rank keeps (each side adds its own)."""

    peers_declared_dead: int = 0
    rooms_started: int = 0
    rooms_finished: dict[tuple[str, str], int] = field(default_factory=dict)  # (state, kind)
    ignored: int = 0  # well-formed messages this rank does not act on

    def count_finished(self, status: RoomStatus) -> None:
        """A cleared room, under its outcome and failure kind: the one place rooms are
        tallied."""
        self.rooms_finished[status.outcome] = self.rooms_finished.get(status.outcome, 0) + 1


class ProtocolCore:
    """Dispatch of events (wire messages and local events alike) through one table keyed by
    event type, and the bookkeeping both sides share."""

    role: str
    stats: RankStats
    liveness: Liveness
    rooms: Mapping[int, Any]  # each room's state object, which has a `status`

    def __init__(self, handlers: dict[type, Callable[[Any, float], list[Any]]]) -> None:
        self._handlers = handlers
        self._log = logging.getLogger(f"kvbridge.{self.role}")

    def handle(self, event: object, now: float) -> list[Any]:
        """The actions an event calls for, in the order they must be executed."""
        handler = self._handlers.get(type(event))
        if handler is None:
            self._log.warning(
                "unexpected %s on a %s rank, ignored", type(event).__name__, self.role
            )
            return []
        return handler(event, now)

    def ignore(self, why: str, *args: object) -> list[Any]:
        """A well-formed message this rank does not act on: counted, logged at DEBUG."""
        self.stats.ignored += 1
        self._log.debug("ignored: " + why, *args)
        return []

    def rooms_by_state(self) -> Counter[str]:
        return Counter(state.status.poll.name for state in self.rooms.values())

    def chunks_written(self) -> dict[tuple[str, str], int]:
        """Chunk writes by (path, reason): prefill's; none on decode."""
        return {}
