"""Liveness bookkeeping: heartbeats on schedule, silent peers reported once, revival."""

from __future__ import annotations

import pytest

from kvbridge.core.liveness import Liveness


def ticking(liveness: Liveness, start: float, end: float) -> list[tuple[str, float]]:
    """What a rank that runs all along sees from `start` to `end`: its sweeps look at the
    peers every 0.1 s (a rank's ticks are 1-100 ms apart)."""
    found: list[tuple[str, float]] = []
    steps = round((end - start) / 0.1)
    for step in range(1, steps + 1):
        found += liveness.expired(end if step == steps else start + step * 0.1)
    return found


def test_silent_peers_are_reported_once_and_may_come_back() -> None:
    liveness = Liveness(interval_s=0.5, timeout_s=3.0)
    assert liveness.heartbeat_due(0.0)
    assert not liveness.heartbeat_due(0.2)
    assert liveness.heartbeat_due(0.6)
    liveness.watch("a", 0.0)
    liveness.watch("b", 0.0)
    liveness.seen("b", 2.5)
    assert ticking(liveness, 0.0, 3.1) == [("a", 3.1)]
    assert ticking(liveness, 3.1, 4.0) == []  # reported once
    assert not liveness.alive("a")
    assert [peer for peer, _ in ticking(liveness, 4.0, 6.0)] == ["b"]
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


def test_a_rank_that_did_not_run_does_not_blame_its_peers() -> None:
    liveness = Liveness(interval_s=0.5, timeout_s=3.0)
    liveness.watch("a", 0.0)
    liveness.watch("b", 0.0)
    assert ticking(liveness, 0.0, 1.0) == []
    # This rank was stopped from 1.0 to 11.0 (SIGSTOP, a paused VM, a long swap): its peers'
    # silence over that time proves nothing. They get the time again, one timeout from the
    # last sign of life, counted without the stall.
    assert liveness.expired(11.0) == []
    liveness.seen("b", 11.2)
    assert ticking(liveness, 11.0, 12.5) == []
    # A peer that truly went silent is declared dead once it has been silent a timeout while
    # this rank ran (1.0 s before the stall, an interval of grace, 1.6 s after it).
    ((peer, silent_s),) = ticking(liveness, 12.5, 13.0)
    assert (peer, silent_s) == ("a", pytest.approx(3.1))
    assert liveness.alive("b")
