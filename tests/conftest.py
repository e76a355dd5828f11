"""Suite-wide checks."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest


def _kvbridge_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvbridge") and t.is_alive()}


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every manager, channel, worker and service a test starts is gone when it ends."""
    before = _kvbridge_threads()
    yield
    deadline = time.monotonic() + 5
    while (leaked := _kvbridge_threads() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not leaked, f"threads left running: {sorted(t.name for t in leaked)}"
