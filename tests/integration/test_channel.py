"""The control channel's own thread with real ZMQ sockets: what another thread queues leaves
at once, not at the loop's next poll timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from waiting import wait_for

from kvbridge.control import channel as channel_module
from kvbridge.control.channel import ControlChannel
from kvbridge.wire import Heartbeat, Message, Receiver
from kvbridge.wire.sglang import common
from kvbridge.wire.sglang.mooncake import MOONCAKE


@contextmanager
def channels(got: list[Message]) -> Iterator[tuple[ControlChannel, ControlChannel]]:
    """A sender and a receiver (whose messages go to `got`), their loops running; closed at
    the end, within 20 s (close wakes a loop too: its stop is checked)."""
    receiver = ControlChannel("127.0.0.1", got.append, name="kvbridge-test-receiver")
    sender = ControlChannel("127.0.0.1", lambda message: None, name="kvbridge-test-sender")
    receiver.start()
    sender.start()
    try:
        yield sender, receiver
    finally:
        started = time.monotonic()
        sender.close()
        receiver.close()
        assert time.monotonic() - started < 20


def test_a_queued_message_wakes_an_idle_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # With the loop's poll timeout at a minute, only the wake-up can deliver within the wait.
    monkeypatch.setattr(channel_module, "IDLE_POLL_MS", 60_000)
    got: list[Message] = []
    with channels(got) as (sender, receiver):
        time.sleep(0.2)  # both loops are now asleep in their poll
        for sequence in range(1, 4):  # from threads other than the loop, one after another
            beat = Heartbeat("wake-test", sequence, 1000)
            threading.Thread(target=sender.send, args=(receiver.endpoint, beat)).start()
            wait_for(lambda n=sequence: len(got) == n, timeout_s=20)  # type: ignore[misc]
        assert [message.sequence for message in got] == [1, 2, 3]  # type: ignore[attr-defined]


def test_sending_now_returns_once_its_messages_left_and_never_waits_for_nothing() -> None:
    got: list[Message] = []
    with channels(got) as (sender, receiver):
        started = time.monotonic()
        with sender.sending_now(60.0):
            pass  # nothing queued: no wait
        with sender.sending_now(60.0):
            sender.send(receiver.endpoint, Heartbeat("now-test", 1, 1000))
        assert sender.stats.sent == 1  # it left before the block's end returned
        assert time.monotonic() - started < 20
        wait_for(lambda: len(got) == 1, timeout_s=20)


def test_a_channel_with_sglang_peers_speaks_sglang_and_never_native() -> None:
    # A decode rank's channel (sglang's decode-side listener rules) and a prefill rank's
    # stand-in that reads sglang's prefill-side frames.
    got: list[Message] = []
    decode = ControlChannel(
        "127.0.0.1",
        lambda message: None,
        name="kvbridge-test-decode",
        foreign=(MOONCAKE, Receiver.DECODE),
    )
    prefill = ControlChannel(
        "127.0.0.1", got.append, name="kvbridge-test-prefill", foreign=(MOONCAKE, Receiver.PREFILL)
    )
    decode.start()
    prefill.start()
    try:
        decode.send(prefill.endpoint, Heartbeat("decode-0", 1, 1000))  # must not reach sglang
        wait_for(lambda: decode.stats.refused_native == 1, timeout_s=20)
        abort = common.AbortNotification(7, "127.0.0.1", decode.port, 3)
        decode.send(prefill.endpoint, abort)
        wait_for(lambda: len(got) == 1, timeout_s=20)
        assert [type(message) for message in got] == [common.AbortNotification]
        assert got[0].generation == 3  # type: ignore[attr-defined]
        assert (decode.stats.sent, prefill.stats.malformed) == (1, 0)
    finally:
        decode.close()
        prefill.close()


def test_what_is_queued_before_close_reaches_the_peer_and_a_gone_one_costs_a_bounded_wait() -> None:
    # A prefill rank closes right after its rooms succeeded: their statuses must still reach
    # decode (sglang's decode would otherwise fail them once the bootstrap server is gone).
    import zmq

    context = zmq.Context()
    peer = context.socket(zmq.PULL)
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    sender = ControlChannel("127.0.0.1", lambda message: None, name="kvbridge-test-closing")
    sender.start()
    for sequence in range(1, 4):
        sender.send(f"tcp://127.0.0.1:{port}", Heartbeat("closing", sequence, 1000))
    sender.close()
    try:
        assert peer.poll(20_000), "nothing queued before close arrived"
        received = [peer.recv_multipart() for _ in range(3) if peer.poll(20_000)]
        assert len(received) == 3
    finally:
        peer.close(linger=0)
        context.term()
    # Nobody listens there: close waits for the message no longer than the linger.
    lonely = ControlChannel("127.0.0.1", lambda message: None, name="kvbridge-test-lonely")
    lonely.start()
    lonely.send(f"tcp://127.0.0.1:{port}", Heartbeat("lonely", 1, 1000))
    wait_for(lambda: lonely.stats.sent == 1, timeout_s=20)
    started = time.monotonic()
    lonely.close()
    assert time.monotonic() - started < channel_module.CLOSE_LINGER_MS / 1000 + 5
