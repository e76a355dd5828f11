"""A peer killed with SIGKILL mid-transfer: the survivor fails exactly the affected rooms,
with the reason, within the liveness interval, and keeps serving everyone else."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from kv_cache import rank_cache
from real_engine import require_engine

from kvbridge.config import ManagerConfig
from kvbridge.control.bootstrap import BootstrapServer
from kvbridge.decode import DecodeManager
from kvbridge.prefill import PrefillManager
from kvbridge.wire import FailureKind, KVPoll

RANK = Path(__file__).with_name("rank.py")
GEOMETRY = dict(layer_ids=(0, 1), page_size=4, total_kv_heads=2, head_dim=16)
TIMEOUT_S = 3.0  # ManagerConfig.peer_timeout_s
require_engine()


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    children: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        child = subprocess.Popen(
            [sys.executable, str(RANK), *args], stdout=subprocess.PIPE, text=True
        )
        children.append(child)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        return child

    yield start
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait()


def wait_until(condition: Callable[[], bool], timeout_s: float) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "not reached in time"
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.mark.parametrize("role", ["prefill", "prefill-layers"])  # mid-chunk, or mid-forward
def test_killed_prefill_fails_its_rooms_on_decode(
    spawn: Callable[..., subprocess.Popen[str]], role: str
) -> None:
    dying, healthy = BootstrapServer().start(), BootstrapServer().start()
    target = rank_cache(num_pages=32, seed=None, **GEOMETRY)  # keeps the memory alive
    decode = DecodeManager(target.args, ManagerConfig(engine="nixl", bootstrap_url=dying.url))
    source = rank_cache(num_pages=32, seed=9, **GEOMETRY)
    survivor = PrefillManager(source.args, ManagerConfig(engine="nixl", bootstrap_url=healthy.url))
    try:
        victim = spawn(role, dying.url, "0", "1", "2")
        doomed = [decode.receiver(room) for room in (0, 1, 2)]
        for room, receiver in enumerate(doomed):
            receiver.init([room, room + 8])
        time.sleep(0.5)  # the requests reach the victim, its first chunks are written
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        fine = decode.receiver(10, healthy.url)
        fine.init([20, 21])
        survivor.sender(10).send([3, 4], last=True)
        wait_until(lambda: all(r.poll() == KVPoll.Failed for r in doomed), TIMEOUT_S + 5)
        assert time.monotonic() - killed_at < TIMEOUT_S + 2
        for receiver in doomed:
            assert "silent for" in str(receiver.failure_reason)
            assert receiver.failure_kind == FailureKind.PEER_DEAD
        wait_until(lambda: fine.poll() == KVPoll.Success, 10)
        for got, want in zip(target.kv, source.kv, strict=True):
            assert np.array_equal(got[[20, 21]], want[[3, 4]])
        for room in (*doomed, fine):
            room.clear()
        assert decode.open_rooms == 0  # the dead peer's rooms went through the one cleanup path
    finally:
        decode.close()
        survivor.close()
        dying.close()
        healthy.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_killed_decode_fails_its_rooms_on_prefill(
    spawn: Callable[..., subprocess.Popen[str]], layerwise: bool
) -> None:
    bootstrap = BootstrapServer().start()
    source = rank_cache(num_pages=32, seed=9, **GEOMETRY)
    prefill = PrefillManager(source.args, ManagerConfig(engine="nixl", bootstrap_url=bootstrap.url))
    target = rank_cache(num_pages=32, seed=None, **GEOMETRY)  # keeps the memory alive
    other = DecodeManager(target.args, ManagerConfig(engine="nixl", bootstrap_url=bootstrap.url))
    try:
        doomed = [prefill.sender(room) for room in (0, 1, 2)]
        victim = spawn("decode", bootstrap.url, "0", "1", "2")
        for room, sender in enumerate(doomed):
            # Not the last chunk (layer-wise: its first layer only): the rooms stay in flight.
            sender.send([2 * room], layers=range(0, 1) if layerwise else None)
        # Every room's first chunk (or layer) has been written (one page of 4 or 2 buffers) …
        wait_until(lambda: prefill.pipeline.stats.blocks_written >= (6 if layerwise else 12), 10)
        victim.send_signal(signal.SIGKILL)  # … and the decode side dies mid-room
        killed_at = time.monotonic()
        wait_until(lambda: all(s.poll() == KVPoll.Failed for s in doomed), TIMEOUT_S + 5)
        assert time.monotonic() - killed_at < TIMEOUT_S + 2
        for sender in doomed:
            assert "silent for" in str(sender.failure_reason)
            assert sender.failure_kind == FailureKind.PEER_DEAD
        # The worker thread keeps serving the other decode peer.
        receiver, sender = other.receiver(7), prefill.sender(7)
        receiver.init([1, 2])
        sender.send([5, 6], last=True)
        wait_until(lambda: receiver.poll() == KVPoll.Success, 10)
        assert prefill.healthy
        wait_until(lambda: sender.poll() == KVPoll.Success, 10)
        for room in (*doomed, sender):
            room.clear()
        receiver.clear()
        assert prefill.open_rooms == other.open_rooms == 0
    finally:
        other.close()
        prefill.close()
        bootstrap.close()
