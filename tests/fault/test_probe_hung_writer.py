"""Issue 11, finding 2: a writer that is hung rather than dead must not write into pages
decode has handed back.

The prefill rank runs in a child process (prefill_peer.py slow) and is stopped with SIGSTOP
mid-transfer. Decode declares it dead, fails its rooms and reports the pages safe only once the
write lease it last granted has run out; the test then hands the pages back (fills them with a
marker) and resumes the child with SIGCONT. The child finds its lease gone and stops writing:
every marker byte is still there and no room ends in Success. Forged statuses and acks (no
token) do not make pages safe either.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from kv_cache import rank_cache
from real_engine import require_engine
from waiting import wait_for

from kvbridge.config import ManagerConfig
from kvbridge.decode import DecodeManager
from kvbridge.wire import NATIVE, AbortAck, KVPoll, TransferStatus

require_engine()
PEER = Path(__file__).with_name("prefill_peer.py")
GEOMETRY = dict(layer_ids=(0, 1), page_size=4, total_kv_heads=2, head_dim=16)
ROOMS = (10, 11, 12, 13)
CHUNKS = 40
MARKER = 0xAB


def said(process: subprocess.Popen[str], key: str) -> dict[str, Any]:
    assert process.stdout is not None
    while True:
        line = process.stdout.readline()
        assert line, f"prefill peer exited ({process.poll()}) before saying {key!r}"
        message: dict[str, Any] = json.loads(line)
        if key in message:
            return message


@pytest.mark.parametrize("mode", ["slow", "slow-layers"])  # whole chunks, or layer by layer
def test_a_stopped_writer_cannot_write_into_pages_decode_handed_back(mode: str) -> None:
    child = subprocess.Popen(
        [sys.executable, str(PEER), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    dst = rank_cache(num_pages=len(ROOMS) * CHUNKS, seed=None, **GEOMETRY)
    config = ManagerConfig(
        engine="nixl",
        bootstrap_url=said(child, "bootstrap")["bootstrap"],
        heartbeat_interval_s=0.1,
        peer_timeout_s=1.0,
        transfer_timeout_s=60,
    )
    decode = DecodeManager(dst.args, config)
    try:
        pages = {room: np.arange(i * CHUNKS, (i + 1) * CHUNKS) for i, room in enumerate(ROOMS)}
        receivers = {room: decode.receiver(room) for room in ROOMS}
        for room, receiver in receivers.items():
            receiver.init(pages[room])
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        said(child, "sending")
        time.sleep(0.4)  # a few chunks in
        child.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        # Forged confirmations (no token) change nothing.
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.connect(decode.channel.endpoint)
        for room in ROOMS:
            push.send_multipart(NATIVE.encode(AbortAck(room, 0)))
            push.send_multipart(NATIVE.encode(TransferStatus(room, KVPoll.Failed, 0, "forged")))
        push.close(linger=1000)
        context.term()
        wait_for(lambda: all(r.poll() == KVPoll.Failed for r in receivers.values()), 10)
        failed_s = time.monotonic() - stopped
        assert not any(r.pages_safe for r in receivers.values())  # the lease still runs
        assert all("silent for" in str(r.failure_reason) for r in receivers.values())
        wait_for(lambda: all(r.pages_safe for r in receivers.values()), 10)
        safe_s = time.monotonic() - stopped
        print(
            f"stopped writer: rooms failed after {failed_s:.2f} s, pages safe after {safe_s:.2f} s"
        )
        for buffer in dst.kv:  # hand the pages back: a marker in every byte
            buffer[...] = MARKER
        child.send_signal(signal.SIGCONT)
        results = [said(child, "room") for _ in ROOMS]
        time.sleep(1.0)  # anything still in flight would have landed by now
        assert all(result["poll"] == "Failed" for result in results), results
        for buffer in dst.kv:
            assert (buffer == MARKER).all(), "a write landed in pages decode handed back"
        for receiver in receivers.values():
            receiver.clear()
        assert decode.open_rooms == 0
    finally:
        child.kill()
        child.communicate()
        decode.close()
