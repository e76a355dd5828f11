"""Safe abort and authentication across real processes with a real engine (NIXL): the prefill
rank runs in a child process (prefill_peer.py), the decode rank in the test."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from kv_cache import rank_cache
from prometheus_client.parser import text_string_to_metric_families
from real_engine import require_engine
from waiting import wait_for

from kvbridge.cache.peer import registration_for
from kvbridge.config import ManagerConfig
from kvbridge.decode import DecodeManager
from kvbridge.wire import NATIVE, Heartbeat, KVPoll
from kvbridge.wire.native import VERSION

PEER = Path(__file__).with_name("prefill_peer.py")
GEOMETRY = dict(layer_ids=(0, 1), page_size=4, total_kv_heads=2, head_dim=16)
SEED = 5  # prefill_peer.py's cache
require_engine()


class Peer:
    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(PEER), *args], stdout=subprocess.PIPE, text=True
        )

    def expect(self, key: str) -> dict[str, Any]:
        """The next line of the child's output that has `key`."""
        assert self.process.stdout is not None
        while True:
            line = self.process.stdout.readline()
            assert line, f"prefill peer exited ({self.process.poll()}) before saying {key!r}"
            said: dict[str, Any] = json.loads(line)
            if key in said:
                return said


@pytest.fixture
def peer() -> Iterator[Callable[..., Peer]]:
    started: list[Peer] = []

    def start(*args: str) -> Peer:
        started.append(Peer(*args))
        return started[-1]

    yield start
    for each in started:
        each.process.kill()
        each.process.communicate()


def test_abort_during_an_in_flight_write_holds_the_pages_until_prefill_drains(
    peer: Callable[..., Peer],
) -> None:
    prefill = peer("gated")
    url = prefill.expect("bootstrap")["bootstrap"]
    source = rank_cache(num_pages=16, seed=SEED, **GEOMETRY)  # the child's data, regenerated
    target = rank_cache(num_pages=16, seed=None, **GEOMETRY)
    decode = DecodeManager(target.args, ManagerConfig(engine="nixl", bootstrap_url=url))
    try:
        aborted = decode.receiver(1)
        aborted.init([4, 5])
        prefill.expect("writing")  # the write is in flight in the prefill process
        aborted.abort("the user cancelled")
        assert aborted.poll() == KVPoll.Failed
        time.sleep(0.5)
        assert not aborted.pages_safe  # a write into pages 4-5 may still land
        prefill.process.send_signal(signal.SIGUSR1)  # the aborted write lands now …
        wait_for(lambda: aborted.pages_safe)  # … and only after it, prefill confirms
        said = prefill.expect("room")
        assert (said["room"], said["poll"]) == (1, "Failed")
        assert "aborted by decode: the user cancelled" in said["reason"]
        aborted.clear()
        reused = decode.receiver(2)  # the next request gets the same pages
        reused.init([4, 5])
        wait_for(lambda: reused.poll() in (KVPoll.Success, KVPoll.Failed))
        assert reused.poll() == KVPoll.Success, reused.failure_reason
        assert prefill.expect("room") == {"room": 2, "poll": "Success", "reason": None}
        for got, want in zip(target.kv, source.kv, strict=True):
            assert np.array_equal(got[[4, 5]], want[[6, 7]])  # room 2's bytes, nothing else
        reused.clear()
        assert decode.open_rooms == 0
    finally:
        decode.close()


def unauthenticated_count(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as page:
        text = page.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvbridge_channel_unauthenticated_total":
                return float(sample.value)
    raise AssertionError("no unauthenticated counter in the metrics")


def test_with_a_secret_forged_and_replayed_messages_are_refused(
    peer: Callable[..., Peer],
) -> None:
    secret = b"a shared secret"
    prefill = peer("secret", secret.decode())
    said = prefill.expect("bootstrap")
    target = rank_cache(num_pages=16, seed=None, **GEOMETRY)
    # An intruder registers its own memory as a decode peer: no tag, so refused unread.
    intruder = rank_cache(num_pages=16, seed=None, **GEOMETRY)
    forged = registration_for(
        intruder.args,
        peer_id="intruder",
        host="127.0.0.1",
        control_port=1,
        engine="nixl",
        engine_descriptor=b"not an agent",
    )
    signed = NATIVE.encode(Heartbeat("decode-0@tcp://127.0.0.1:1", 1, 1000), secret=secret)
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    try:
        push.connect(said["control"])
        push.send_multipart(NATIVE.encode(forged))
        push.send_multipart(signed)
        push.send_multipart(signed)  # the same bytes again: a replay
        wait_for(lambda: unauthenticated_count(said["metrics"]) == 2)
    finally:
        push.close(linger=0)
        context.term()
    # Writing to the bootstrap service needs the token.
    put = urllib.request.Request(
        f"{said['bootstrap']}/prefill",
        method="PUT",
        data=json.dumps(
            {
                "rank": 0,
                "attn_tp_size": 1,
                "host": "127.0.0.1",
                "port": 1,
                "engine": "nixl",
                "version": VERSION,
            }
        ).encode(),
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(put, timeout=5)
    assert refused.value.code == 401
    refused.value.close()
    # The real decode rank, with the secret, gets room 6's bytes; the intruder got nothing.
    config = ManagerConfig(engine="nixl", bootstrap_url=said["bootstrap"], secret=secret)
    decode = DecodeManager(target.args, config)
    try:
        receiver = decode.receiver(6)
        receiver.init([0, 1])
        wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed))
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
        receiver.clear()
        assert decode.open_rooms == 0
    finally:
        decode.close()
    assert prefill.expect("room") == {"room": 6, "poll": "Success", "reason": None}
    source = rank_cache(num_pages=16, seed=SEED, **GEOMETRY)
    for got, want in zip(target.kv, source.kv, strict=True):
        assert np.array_equal(got[[0, 1]], want[[2, 3]])
    assert not any(page.any() for page in intruder.kv)
