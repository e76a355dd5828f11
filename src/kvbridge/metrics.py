"""Prometheus metrics of a manager, in its own registry, optionally served over HTTP.

Counters that the managers already keep (channel, staging, liveness, room outcomes) are read
at scrape time through a collector, so the hot paths do not touch prometheus objects; the
write path observes two histograms (seconds and blocks per engine write) and a byte counter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from threading import Thread
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvbridge.core.room import RoomStatus

# Engine writes kept for `take_writes` (a host that takes them each step sees a few).
RECENT_WRITES = 65536


def count_finished(counts: dict[tuple[str, str], int], status: RoomStatus) -> None:
    """Count a cleared room under (outcome, failure kind): the one place rooms are tallied.
    The kind is the room's `FailureKind` (a fixed set: free text would explode cardinality)."""
    counts[status.outcome] = counts.get(status.outcome, 0) + 1


@dataclass
class Snapshot:
    """What a manager reports at scrape time."""

    counters: Mapping[str, float] = field(default_factory=dict)
    rooms_by_state: Mapping[str, int] = field(default_factory=dict)
    rooms_finished: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (outcome, kind)
    chunks_written: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (path, reason)


class _SnapshotCollector(Collector):
    def __init__(self, role: str, rank: int, snapshot: Callable[[], Snapshot]) -> None:
        self._labels = {"role": role, "rank": str(rank)}
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        snapshot = self._snapshot()
        names = list(self._labels)
        values = list(self._labels.values())
        for name, value in sorted(snapshot.counters.items()):
            family = CounterMetricFamily(f"kvbridge_{name}", name.replace("_", " "), labels=names)
            family.add_metric(values, value)
            yield family
        rooms = GaugeMetricFamily(
            "kvbridge_rooms", "rooms in flight by KVPoll state", labels=[*names, "state"]
        )
        for state, count in sorted(snapshot.rooms_by_state.items()):
            rooms.add_metric([*values, state], count)
        yield rooms
        finished = CounterMetricFamily(
            "kvbridge_rooms_finished",
            "rooms cleared, by outcome and failure kind",
            labels=[*names, "outcome", "kind"],
        )
        for (outcome, kind), count in sorted(snapshot.rooms_finished.items()):
            finished.add_metric([*values, outcome, kind], count)
        yield finished
        chunks = CounterMetricFamily(
            "kvbridge_chunks_written",
            "chunk writes handed to the engine (prefill), by path (direct, page_rows, ring) "
            "and why it took it",
            labels=[*names, "path", "reason"],
        )
        for (path, reason), count in sorted(snapshot.chunks_written.items()):
            chunks.add_metric([*values, path, reason], count)
        yield chunks


class ManagerMetrics:
    def __init__(self, role: str, rank: int, snapshot: Callable[[], Snapshot]) -> None:
        self.registry = CollectorRegistry()
        labels = {"role": role, "rank": str(rank)}
        self.write_seconds = Histogram(
            "kvbridge_write_seconds",
            "seconds per engine write",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
        self.write_blocks = Histogram(
            "kvbridge_write_blocks",
            "blocks (descriptors) per engine write",
            list(labels),
            buckets=(1, 8, 64, 512, 4096, 32768, 262144, 2097152),
            registry=self.registry,
        ).labels(**labels)
        self.bytes_written = Counter(
            "kvbridge_written_bytes",
            "bytes written through the engine",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
        self.registration_seconds = Gauge(
            "kvbridge_registration_seconds",
            "seconds spent registering this rank's memory with the engine (at start)",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
        self.registered_bytes = Gauge(
            "kvbridge_registered_bytes",
            "bytes of memory registered with the engine",
            list(labels),
            registry=self.registry,
        ).labels(**labels)
        self.registry.register(_SnapshotCollector(role, rank, snapshot))
        # Appended on the transfer thread, taken on the host's (deque ends are thread-safe);
        # None until a host asks (`keep_writes`).
        self._recent_writes: deque[tuple[float, int]] | None = None
        self._server: Any = None
        self._thread: Thread | None = None
        self.port: int | None = None

    def observe_write(self, seconds: float, blocks: int, nbytes: int) -> None:
        self.write_seconds.observe(seconds)
        self.write_blocks.observe(blocks)
        self.bytes_written.inc(nbytes)
        if self._recent_writes is not None:
            self._recent_writes.append((seconds, nbytes))

    def keep_writes(self) -> None:
        """From now on keep each engine write's (seconds, bytes) for `take_writes`: for a host
        that reports them its own way (the vLLM connector, to vLLM's metrics)."""
        if self._recent_writes is None:
            self._recent_writes = deque(maxlen=RECENT_WRITES)

    def take_writes(self) -> list[tuple[float, int]]:
        """The writes kept since the last call (the oldest dropped past `RECENT_WRITES`)."""
        taken: list[tuple[float, int]] = []
        while self._recent_writes:
            taken.append(self._recent_writes.popleft())
        return taken

    def observe_registration(self, seconds: float, nbytes: int) -> None:
        self.registration_seconds.set(seconds)
        self.registered_bytes.set(nbytes)

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on (host, port), 0 for any free port; the bound port."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self._server.server_port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = None
