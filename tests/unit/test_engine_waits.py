"""`EngineWaits`: the engine thread's time in engine calls and the part spent off a CPU."""

from __future__ import annotations

import pytest

from kvbridge.core.waits import WARN_EVERY_S, WARN_SHARE, WINDOW_S, EngineWaits


def test_totals_count_every_stretch_and_waiting_is_wall_less_cpu() -> None:
    waits = EngineWaits()
    waits.add(0.010, 0.004, now=0.0)
    waits.add(0.002, 0.003, now=0.0)  # CPU clocks may read past the wall one: no negative wait
    assert waits.busy_s == pytest.approx(0.012)
    assert waits.waited_s == pytest.approx(0.006)


def test_a_window_mostly_waiting_warns_once_per_interval() -> None:
    waits = EngineWaits()
    stretch = WINDOW_S / 8  # a power of two: eight of them sum to the window exactly
    shares = [waits.add(stretch, stretch / 8, now=1.0) for _ in range(8)]
    assert shares[:-1] == [None] * 7  # the window is full only with its last stretch
    assert shares[-1] == pytest.approx(7 / 8)
    again = [waits.add(stretch, 0.0, now=1.0 + WARN_EVERY_S / 2) for _ in range(8)]
    assert again == [None] * 8  # a second bad window within the interval: no new warning
    later = [waits.add(stretch, 0.0, now=2.0 + WARN_EVERY_S) for _ in range(8)]
    assert later[-1] == pytest.approx(1.0)


def test_a_window_mostly_on_a_cpu_does_not_warn() -> None:
    waits = EngineWaits()
    below = 1 - WARN_SHARE + 0.05  # the CPU's share: waiting just under the threshold
    shares = [waits.add(WINDOW_S / 4, WINDOW_S / 4 * below, now=0.0) for _ in range(8)]
    assert shares == [None] * 8
    assert waits.busy_s == pytest.approx(2 * WINDOW_S)
