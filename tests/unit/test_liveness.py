"""Liveness bookkeeping: heartbeats on schedule, silent peers reported once, revival."""

from __future__ import annotations

from kvbridge.core.liveness import Liveness


def test_silent_peers_are_reported_once_and_may_come_back() -> None:
    liveness = Liveness(interval_s=0.5, timeout_s=3.0)
    assert liveness.heartbeat_due(0.0)
    assert not liveness.heartbeat_due(0.2)
    assert liveness.heartbeat_due(0.6)
    liveness.watch("a", 0.0)
    liveness.watch("b", 0.0)
    liveness.seen("b", 2.5)
    assert liveness.expired(3.1) == [("a", 3.1)]
    assert liveness.expired(4.0) == []  # reported once
    assert not liveness.alive("a")
    assert [peer for peer, _ in liveness.expired(6.0)] == ["b"]
    assert liveness.seen("a", 6.5)  # back after a healed partition
    assert liveness.alive("a")
    liveness.forget("b")
    assert liveness.peers == ["a"]


def test_late_heartbeats_count_the_intervals_missed() -> None:
    liveness = Liveness(interval_s=0.5, timeout_s=3.0)
    liveness.watch("a", 0.0)
    liveness.seen("a", 2.0)  # first sign of life after watching: nothing was due yet
    assert liveness.missed_heartbeats == 0
    liveness.seen("a", 2.5)
    liveness.seen("a", 3.4)  # within two intervals: jitter, not a miss
    assert liveness.missed_heartbeats == 0
    liveness.seen("a", 5.0)  # 1.6 s of silence: three intervals, one of them expected
    assert liveness.missed_heartbeats == 2
    liveness.forget("a")
    liveness.seen("a", 9.0)  # a new acquaintance starts clean
    assert liveness.missed_heartbeats == 2
