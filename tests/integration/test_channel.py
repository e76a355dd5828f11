"""The control channel's own thread with real ZMQ sockets: what another thread queues leaves
at once, not at the loop's next poll timeout."""

from __future__ import annotations

import threading
import time

import pytest
from waiting import wait_for

from kvbridge.control import channel as channel_module
from kvbridge.control.channel import ControlChannel
from kvbridge.wire import Heartbeat, Message


def test_a_queued_message_wakes_an_idle_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # With the loop's poll timeout at a minute, only the wake-up can deliver within the wait.
    monkeypatch.setattr(channel_module, "IDLE_POLL_MS", 60_000)
    got: list[Message] = []
    receiver = ControlChannel("127.0.0.1", got.append, name="kvbridge-test-receiver")
    sender = ControlChannel("127.0.0.1", lambda message: None, name="kvbridge-test-sender")
    receiver.start()
    sender.start()
    try:
        time.sleep(0.2)  # both loops are now asleep in their poll
        for sequence in range(1, 4):  # from threads other than the loop, one after another
            beat = Heartbeat("wake-test", sequence, 1000)
            threading.Thread(target=sender.send, args=(receiver.endpoint, beat)).start()
            wait_for(lambda n=sequence: len(got) == n, timeout_s=20)  # type: ignore[misc]
        assert [message.sequence for message in got] == [1, 2, 3]  # type: ignore[attr-defined]
    finally:
        started = time.monotonic()
        sender.close()
        receiver.close()
    assert time.monotonic() - started < 20  # close wakes the loop too (its stop is checked)
