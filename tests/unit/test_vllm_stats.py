"""The vLLM connector's interval data (what vLLM's stat loggers get): recorded per worker,
merged over workers and intervals, summed up for the log line."""

from __future__ import annotations

from kvbridge.integrations.vllm_stats import (
    LOAD_SECONDS,
    LOADS_IN_FLIGHT,
    WRITE_BYTES,
    Interval,
    failed_key,
    merge,
    parse_failed,
    summary,
)
from kvbridge.wire.messages import FailureKind


def test_an_interval_hands_over_what_it_saw_once() -> None:
    interval = Interval()
    interval.observe(LOAD_SECONDS, 0.02)
    interval.fail("load", FailureKind.PEER_DEAD)
    interval.fail("load", FailureKind.PEER_DEAD)
    interval.fail("send", None)
    assert interval.take() == {
        LOAD_SECONDS: [0.02],
        "failed:load:PEER_DEAD": 2,
        "failed:send:UNKNOWN": 1,
    }
    assert interval.take() == {}
    assert parse_failed(failed_key("send", FailureKind.TIMEOUT)) == ("send", "TIMEOUT")
    assert parse_failed("requests_loaded") is None


def test_workers_and_intervals_merge_by_kind_of_value() -> None:
    rank0 = {"requests_loaded": 2, LOAD_SECONDS: [0.01, 0.03], LOADS_IN_FLIGHT: 4}
    rank1 = {"requests_loaded": 2, LOAD_SECONDS: [0.02], "failed:load:TIMEOUT": 1}
    later = {LOADS_IN_FLIGHT: 1, WRITE_BYTES: [4096]}
    merged = merge(merge(dict(rank0), rank1), later)
    assert merged == {
        "requests_loaded": 4,
        LOAD_SECONDS: [0.01, 0.03, 0.02],
        "failed:load:TIMEOUT": 1,
        LOADS_IN_FLIGHT: 1,
        WRITE_BYTES: [4096],  # a gauge's latest reading, not a sum
    }
    line = summary(merged)
    assert line["requests_loaded"] == 4
    assert line["load_count"] == 3
    assert line["load_avg_ms"] == 20.0
    assert line["load_p90_ms"] == 20.0
    assert line["write_bytes_avg"] == 4096
