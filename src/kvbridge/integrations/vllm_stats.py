"""What kvbridge's vLLM connector reports to vLLM each interval, pure: the data of its
`KVConnectorStats` (vLLM moves it from the workers and the scheduler to its stat loggers, sums
it over workers and intervals) — how it is recorded, merged and summed up for vLLM's log line.
`vllm_metrics` turns it into Prometheus metrics on vLLM's /metrics. No vLLM import.

The data is one flat dict: a number per counter (summed), a list per observation (joined), and
the scheduler's gauges (the latest reading wins).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge.wire.messages import FailureKind

# Per-request seconds from a load's start to its KV in place (decode, each worker).
LOAD_SECONDS = "load_seconds"
# Per engine write on prefill: its seconds and bytes.
WRITE_SECONDS = "write_seconds"
WRITE_BYTES = "write_bytes"
OBSERVATIONS = (LOAD_SECONDS, WRITE_SECONDS, WRITE_BYTES)
# Requests whose KV is moving on this instance, from the scheduler: prefill's sends decode
# has not finished, decode's loads not in place.
SENDS_IN_FLIGHT = "sends_in_flight"
LOADS_IN_FLIGHT = "loads_in_flight"
GAUGES = (SENDS_IN_FLIGHT, LOADS_IN_FLIGHT)
# Rooms that failed, "failed:<side>:<FailureKind name>" (side: send or load).
FAILED = "failed"


def failed_key(side: str, kind: FailureKind) -> str:
    return f"{FAILED}:{side}:{kind.name}"


def parse_failed(key: str) -> tuple[str, str] | None:
    """(side, kind) of a failure key; None for any other key."""
    parts = key.split(":")
    return (parts[1], parts[2]) if len(parts) == 3 and parts[0] == FAILED else None


@dataclass
class ConnectorCounters:
    """What one worker's connector moved, since it started (kvbridge's own managers keep the
    transfer-level metrics)."""

    requests_sent: int = 0
    sends_failed: int = 0
    pages_sent: int = 0
    requests_loaded: int = 0
    loads_failed: int = 0
    loads_aborted: int = 0
    pages_loaded: int = 0
    rooms_released: int = 0
    # Prefill blocks freed because no decode asked for them within their lease.
    sends_expired: int = 0
    # Prefill, decode first: layer ranges written during the forward (the rest went whole).
    layer_writes: int = 0

    def since(self, earlier: ConnectorCounters) -> dict[str, int]:
        """What changed since `earlier`, the counters that moved only."""
        now, then = dataclasses.asdict(self), dataclasses.asdict(earlier)
        return {name: now[name] - then[name] for name in now if now[name] != then[name]}


@dataclass
class Interval:
    """What one worker observed since it last reported, beyond its counters (filled on the
    engine's step thread)."""

    observations: dict[str, list[float]] = field(
        default_factory=lambda: {name: [] for name in OBSERVATIONS}
    )
    failures: dict[str, int] = field(default_factory=dict)

    def observe(self, name: str, value: float) -> None:
        self.observations[name].append(value)

    def fail(self, side: str, kind: FailureKind | None) -> None:
        key = failed_key(side, kind if kind is not None else FailureKind.UNKNOWN)
        self.failures[key] = self.failures.get(key, 0) + 1

    def take(self) -> dict[str, Any]:
        """The interval's data (observed lists that are not empty, failures), and a new one."""
        data: dict[str, Any] = {k: v for k, v in self.observations.items() if v}
        data.update(self.failures)
        self.observations = {name: [] for name in OBSERVATIONS}
        self.failures = {}
        return data


def merge(into: dict[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """`other`'s data added to `into`'s: lists joined, gauges replaced, numbers summed."""
    for key, value in other.items():
        if isinstance(value, list):
            into[key] = [*into.get(key, []), *value]
        elif key in GAUGES:
            into[key] = value
        else:
            into[key] = into.get(key, 0) + value
    return into


def summary(data: Mapping[str, Any]) -> dict[str, int | float]:
    """An interval's data for vLLM's "KV Transfer metrics" log line: counters and failures as
    they are, each observation as its count, mean and 90th percentile, gauges as read."""
    line: dict[str, int | float] = {}
    for key, value in data.items():
        if not isinstance(value, list):
            line[key] = value
        elif value:
            ordered = sorted(value)
            scale, unit = (1000.0, "_ms") if key.endswith("_seconds") else (1.0, "")
            name = key.removesuffix("_seconds")
            line[f"{name}_count"] = len(value)
            line[f"{name}_avg{unit}"] = round(scale * sum(value) / len(value), 3)
            line[f"{name}_p90{unit}"] = round(scale * ordered[int(0.9 * (len(value) - 1))], 3)
    return line
