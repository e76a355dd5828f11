"""Waiting for a condition in tests: bounded, so a hang is a failure, never a stuck suite."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0, poll_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"condition not reached in {timeout_s:g} s"
        time.sleep(poll_s)
