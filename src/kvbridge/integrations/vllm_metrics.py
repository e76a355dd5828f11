"""kvbridge's transfer metrics in vLLM: the connector's `KVConnectorStats` (the interval data
of `vllm_stats`, moved by vLLM from workers and scheduler to its stat loggers) and the
Prometheus metrics vLLM serves on its own /metrics, named and labelled like NixlConnector's
(``vllm:nixl_*``): ``vllm:kvbridge_*`` with vLLM's labels (model_name, engine), plus `side`
(send: prefill, load: decode) and `kind` (a `FailureKind`) where they apply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
)

from kvbridge.integrations.vllm_stats import (
    GAUGES,
    LOAD_SECONDS,
    LOADS_IN_FLIGHT,
    SENDS_IN_FLIGHT,
    WRITE_BYTES,
    WRITE_SECONDS,
    merge,
    parse_failed,
    summary,
)
from kvbridge.wire.messages import FailureKind

SECONDS_BUCKETS = [
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
]
BYTES_BUCKETS = [float(2 ** (10 + i)) for i in range(1, 25, 2)]  # 2 KiB to 8 GiB, as NIXL's
# Counters of the connector's interval data, by metric and side.
COUNTERS = {
    "requests_sent": ("requests_transferred", "send"),
    "requests_loaded": ("requests_transferred", "load"),
    "pages_sent": ("pages_transferred", "send"),
    "pages_loaded": ("pages_transferred", "load"),
    "sends_expired": ("num_kv_expired_reqs", None),
    "loads_aborted": ("num_aborted_loads", None),
}


@dataclass
class KVBridgeStats(KVConnectorStats):  # type: ignore[misc]
    """The connector's data over one interval (`vllm_stats`), summed over workers."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVBridgeStats:
        merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return summary(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values()) and not any(key in self.data for key in GAUGES)


class KVBridgePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetric]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        histogram, counter, gauge = self._histogram_cls, self._counter_cls, self._gauge_cls
        self._histograms = {
            LOAD_SECONDS: histogram(
                name="vllm:kvbridge_load_time_seconds",
                documentation="Seconds from the start of a request's KV load to its KV in "
                "place, per decode worker.",
                buckets=SECONDS_BUCKETS,
                labelnames=labelnames,
            ),
            WRITE_SECONDS: histogram(
                name="vllm:kvbridge_xfer_time_seconds",
                documentation="Seconds per transfer-engine write of KV pages (prefill).",
                buckets=SECONDS_BUCKETS,
                labelnames=labelnames,
            ),
            WRITE_BYTES: histogram(
                name="vllm:kvbridge_bytes_transferred",
                documentation="Bytes per transfer-engine write of KV pages (prefill).",
                buckets=BYTES_BUCKETS,
                labelnames=labelnames,
            ),
        }
        by_side = [*labelnames, "side"]
        self._counters = {
            "requests_transferred": counter(
                name="vllm:kvbridge_requests_transferred",
                documentation="Requests whose KV moved, per worker (side: send, load).",
                labelnames=by_side,
            ),
            "pages_transferred": counter(
                name="vllm:kvbridge_pages_transferred",
                documentation="KV blocks moved, per worker (side: send, load).",
                labelnames=by_side,
            ),
            "num_kv_expired_reqs": counter(
                name="vllm:kvbridge_num_kv_expired_reqs",
                documentation="Requests whose blocks prefill freed because no decode "
                "claimed them within their lease.",
                labelnames=labelnames,
            ),
            "num_aborted_loads": counter(
                name="vllm:kvbridge_num_aborted_loads",
                documentation="Loads given up because the request ended on decode.",
                labelnames=labelnames,
            ),
        }
        self._failed = counter(
            name="vllm:kvbridge_num_failed_transfers",
            documentation="Rooms (a request's transfer on one worker) that failed, by side and "
            "kvbridge FailureKind.",
            labelnames=[*labelnames, "side", "kind"],
        )
        self._in_flight = gauge(
            name="vllm:kvbridge_requests_in_flight",
            documentation="Requests whose KV is moving (side: send, load).",
            labelnames=by_side,
            multiprocess_mode="mostrecent",
        )
        # Every failure series from the start, at 0: a dashboard's rate() needs them.
        for values in per_engine_labelvalues.values():
            for side in ("send", "load"):
                for kind in FailureKind:
                    self._failed.labels(*values, side, kind.name)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if key in self._histograms:
                child = self._histograms[key].labels(*engine)
                for item in value:
                    child.observe(item)
            elif key in COUNTERS:
                name, side = COUNTERS[key]
                labels = [*engine, side] if side is not None else engine
                self._counters[name].labels(*labels).inc(value)
            elif key in (SENDS_IN_FLIGHT, LOADS_IN_FLIGHT):
                side = "send" if key == SENDS_IN_FLIGHT else "load"
                self._in_flight.labels(*engine, side).set(value)
            elif (failed := parse_failed(key)) is not None:
                self._failed.labels(*engine, *failed).inc(value)
