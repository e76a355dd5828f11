"""Issue 11, finding 1: one message must not kill a control channel.

An attacker process sends what killed main's channels from outside: a heartbeat whose sender
is not an address, an abort whose return address is a wildcard, a registration whose host is
`*`, thousands of distinct return endpoints; the bootstrap is offered a host of `*`. The
channels keep serving, every such message is counted, a real room still moves its bytes, and
`close()` returns promptly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from kv_cache import rank_cache
from real_engine import ENGINE, require_engine
from waiting import wait_for

from kvbridge.config import ManagerConfig
from kvbridge.control import channel as channel_module
from kvbridge.control.channel import ControlChannel
from kvbridge.decode import DecodeManager
from kvbridge.prefill import PrefillManager
from kvbridge.wire import Heartbeat, KVPoll, TransferRequest
from kvbridge.wire.native import VERSION

require_engine()
GEOMETRY = dict(layer_ids=(0, 1), page_size=4, total_kv_heads=2, head_dim=8)
ENDPOINTS = 1200  # more than ZMQ's 1023 sockets per context

ATTACKER = textwrap.dedent(
    """
    import sys, zmq
    import numpy as np
    from kvbridge.wire import NATIVE, Abort, Heartbeat, KVLayout, Registration, TransferRequest

    prefill, decode, decode_host, decode_port = sys.argv[1:5]
    context = zmq.Context()

    def send(endpoint, frames):
        push = context.socket(zmq.PUSH)
        push.connect(endpoint)
        push.send_multipart(frames)
        push.close(linger=5000)

    def swap(frames, old, new):  # a text frame the encoder would refuse, put in by hand
        return [new if frame == old else frame for frame in frames]

    send(decode, NATIVE.encode(Heartbeat("not a zmq address", 1, 3000)))
    abort = NATIVE.encode(Abort(7, "127.0.0.9", 5555, "probe"))
    send(prefill, swap(abort, b"127.0.0.9", b"*"))
    registration = NATIVE.encode(Registration(
        peer_id="intruder", host="127.0.0.9", control_port=5555, engine="nixl",
        engine_descriptor=b"x", tp_rank=0, attn_tp_size=1, dcp_rank=0, dcp_size=1,
        kv_layout=KVLayout.MHA, total_kv_heads=2, head_dim=8, dtype="uint8", page_size=4,
        kv_layer_ids=[0], kv_ptrs=[4096, 8192], kv_item_lens=[64, 64], kv_lengths=[64, 64],
        aux_ptrs=[], aux_item_lens=[], aux_lengths=[]))
    send(prefill, swap(registration, b"127.0.0.9", b"*"))
    # Aborts and requests from thousands of return endpoints, none of them a peer.
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(prefill)
    for index in range({endpoints}):
        push.send_multipart(NATIVE.encode(Abort(index, "127.0.0.1", 20000 + index, "probe")))
        push.send_multipart(NATIVE.encode(TransferRequest(
            index, f"forged-{{index}}", False, np.arange(2, dtype=np.int32), None, [], 1)))
    push.close(linger=60000)
    context.term()
    """
).format(endpoints=ENDPOINTS)


def test_hostile_messages_are_counted_and_both_channels_keep_serving() -> None:
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    config = ManagerConfig(engine=ENGINE, run_bootstrap=True, transfer_timeout_s=20)
    prefill = PrefillManager(src.args, config)
    decode = DecodeManager(
        dst.args, ManagerConfig(engine=ENGINE, bootstrap_url=prefill.bootstrap_url)
    )
    try:
        # A first room, so that decode knows its prefill peer.
        sender, receiver = prefill.sender(1), decode.receiver(1)
        receiver.init([2, 3])
        sender.send([4, 5], last=True)
        wait_for(lambda: receiver.poll() == KVPoll.Success, 10)
        receiver.clear()
        sender.clear()
        before = prefill.channel.stats.received
        subprocess.run(
            [
                sys.executable,
                "-c",
                ATTACKER,
                prefill.channel.endpoint,
                decode.channel.endpoint,
                decode.channel.host,
                str(decode.channel.port),
            ],
            check=True,
            timeout=120,
        )
        wait_for(lambda: prefill.channel.stats.received >= before + 2 + 2 * ENDPOINTS, 60)
        wait_for(lambda: decode.stats.ignored >= 1, 10)
        # The wildcard abort and registration are malformed (frame and field named, dropped);
        # the forged aborts and requests come from no peer: ignored, counted, no room made.
        assert prefill.channel.stats.malformed >= 2
        assert prefill.stats.ignored >= 2 * ENDPOINTS
        assert prefill.open_rooms == 0
        # The bootstrap refuses a wildcard host with 400 and stays complete.
        body = json.dumps(
            {
                "rank": 0,
                "attn_tp_size": 1,
                "host": "*",
                "port": 5555,
                "engine": ENGINE,
                "version": VERSION,
            }
        ).encode()
        put = urllib.request.Request(f"{prefill.bootstrap_url}/prefill", body, method="PUT")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(put, timeout=5)
        assert refused.value.code == 400
        assert "host" in refused.value.read().decode()
        assert prefill.healthy
        assert decode.healthy
        # Real work still goes through, both ways (heartbeats, deadlines, statuses).
        sender, receiver = prefill.sender(2), decode.receiver(2)
        receiver.init([6, 7])
        sender.send([8, 9], last=True)
        wait_for(lambda: receiver.poll() == KVPoll.Success, 10)
        np.testing.assert_array_equal(dst.kv[0][[6, 7]], src.kv[0][[8, 9]])
        receiver.clear()
        sender.clear()
    finally:
        started = time.monotonic()
        decode.close()
        prefill.close()
        assert time.monotonic() - started < 15


def test_a_channel_sending_to_more_peers_than_zmq_has_sockets_keeps_serving() -> None:
    """Decode restarts over time (or forged return addresses) leave many endpoints: the
    channel keeps a bounded socket cache instead of running out of ZMQ sockets."""
    got: list[object] = []
    channel = ControlChannel("127.0.0.1", got.append, name="kvbridge-probe")
    channel.start()
    peer = ControlChannel("127.0.0.1", got.append, name="kvbridge-probe-peer")
    peer.start()
    try:
        for index in range(ENDPOINTS):
            channel.send(f"tcp://127.0.0.1:{20000 + index}", Heartbeat("probe", index, 1000))
        channel.send("tcp://*:5555", Heartbeat("probe", 0, 1000))
        channel.send(peer.endpoint, Heartbeat("probe", 1, 1000))
        wait_for(lambda: len(got) == 1, 30)
        assert channel.alive
        assert channel.failure is None
        assert channel.peer_sockets <= channel_module.MAX_PEER_SOCKETS
        assert channel.stats.sockets_evicted >= ENDPOINTS - channel_module.MAX_PEER_SOCKETS
        assert channel.stats.bad_endpoints == 1
    finally:
        started = time.monotonic()
        channel.close()
        peer.close()
        assert time.monotonic() - started < 10


def test_rooms_that_no_scheduler_claims_expire_and_decode_hears_why() -> None:
    """Requests from a registered peer (trusted without a secret) for rooms the scheduler
    never starts leave nothing behind after `request_timeout_s`."""
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    prefill = PrefillManager(
        src.args, ManagerConfig(engine=ENGINE, run_bootstrap=True, request_timeout_s=1.0)
    )
    decode = DecodeManager(
        dst.args, ManagerConfig(engine=ENGINE, bootstrap_url=prefill.bootstrap_url)
    )
    try:
        receivers = [decode.receiver(room) for room in range(100, 150)]
        for receiver in receivers:
            receiver.init([1])
        wait_for(lambda: prefill.open_rooms == 50, 10)
        wait_for(lambda: all(r.poll() == KVPoll.Failed for r in receivers), 10)
        assert prefill.open_rooms == 0
        assert "was not given this room within 1 s" in str(receivers[0].failure_reason)
        for receiver in receivers:
            receiver.clear()
    finally:
        decode.close()
        prefill.close()


OVERSIZED = textwrap.dedent(
    """
    import sys, zmq
    from kvbridge.wire import NATIVE, Heartbeat

    endpoint, frame_bytes = sys.argv[1], int(sys.argv[2])
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.connect(endpoint)
    # A message the channel would decode and drop as malformed — if it ever held it whole.
    push.send_multipart([*NATIVE.encode(Heartbeat("tcp://127.0.0.1:5555", 1, 1000)),
                         b"\\0" * frame_bytes])
    push.close(linger=10000)
    context.term()
    """
)


FRAME_LIMIT = 1 << 20


@dataclass
class LimitedPair:
    """A channel that accepts and sends frames of at most `FRAME_LIMIT`, a peer at the default
    limit, and what both received."""

    channel: ControlChannel
    peer: ControlChannel
    got: list[Any]


@pytest.fixture
def limited_pair() -> Iterator[LimitedPair]:
    got: list[Any] = []
    channel = ControlChannel(
        "127.0.0.1", got.append, name="kvbridge-probe", max_frame_bytes=FRAME_LIMIT
    )
    channel.start()
    peer = ControlChannel("127.0.0.1", got.append, name="kvbridge-probe-peer")
    peer.start()
    try:
        yield LimitedPair(channel, peer, got)
    finally:
        channel.close()
        peer.close()


def test_a_frame_over_the_limit_is_refused_before_it_is_held_and_the_channel_serves_on(
    limited_pair: LimitedPair,
) -> None:
    """A peer that can reach the port sends one frame far over `max_frame_bytes`: ZMQ drops the
    connection when the frame's length arrives, so the channel never receives (allocates) it;
    the channel keeps serving others. With no limit the same frame arrives whole (received,
    then dropped as malformed) — what a frame of many GB would do to a rank's memory."""
    channel, peer, got = limited_pair.channel, limited_pair.peer, limited_pair.got
    subprocess.run(
        [sys.executable, "-c", OVERSIZED, channel.endpoint, str(64 * FRAME_LIMIT)],
        check=True,
        timeout=60,
    )
    peer.send(channel.endpoint, Heartbeat(peer.endpoint, 2, 1000))
    wait_for(lambda: len(got) == 1, 10)
    assert channel.stats.received == 1  # the heartbeat; the oversized message never came
    assert channel.stats.malformed == 0
    assert channel.alive


def test_a_message_with_a_frame_over_the_limit_is_dropped_with_an_error_before_it_leaves(
    limited_pair: LimitedPair, caplog: pytest.LogCaptureFixture
) -> None:
    """Ours too: a peer would disconnect us for it, and the room would only time out."""
    channel, peer, got = limited_pair.channel, limited_pair.peer, limited_pair.got
    pages = np.arange(FRAME_LIMIT // 4 + 1, dtype=np.int32)  # one index over the limit
    channel.send(peer.endpoint, TransferRequest(1, "big", False, pages, None, [], 1))
    channel.send(peer.endpoint, TransferRequest(2, "fits", False, pages[:-1], None, [], 1))
    wait_for(lambda: len(got) == 1, 10)
    assert [message.room for message in got] == [2]
    assert channel.stats.send_failures == 1
    assert "MAX_FRAME_BYTES" in caplog.text
