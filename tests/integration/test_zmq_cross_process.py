"""A message encoded in one process and sent over a real ZMQ PUSH socket decodes, field for
field, in another process's PULL socket: both ways, every layout of every profile."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import wire_strategies
import zmq

from kvbridge import samples
from kvbridge.wire import Message, decode_frames, detect_profile, encode_frames
from kvbridge.wire.framefile import load_frames
from kvbridge.wire.sglang import common

# Control messages both SGLang backends send byte for byte alike: either profile reads them.
SHARED = {layout.message_type for layout in (*common.TO_PREFILL, *common.TO_DECODE)}

PEER = Path(__file__).with_name("zmq_peer.py")
SGLANG = {"sglang-mooncake", "sglang-nixl"}
TIMEOUT_S = 60
PER_LAYOUT = 6


@pytest.fixture(scope="module")
def corpus() -> list[tuple[str, Message]]:
    messages = []
    for name in samples.sample_names():
        frames, metadata = load_frames(samples.sample_bytes(name))
        messages.append((metadata["profile"], decode_frames(frames)))
    return messages + wire_strategies.corpus(PER_LAYOUT)


@contextmanager
def peer(corpus: list[tuple[str, Message]], *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """The other process, given the corpus on stdin; killed if the test leaves it running."""
    child = subprocess.Popen(
        [sys.executable, str(PEER), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdin is not None
        child.stdin.write(pickle.dumps(corpus))
        child.stdin.close()
        yield child
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


@contextmanager
def zmq_socket(kind: int) -> Iterator[zmq.Socket[bytes]]:
    context = zmq.Context()
    socket = context.socket(kind)
    try:
        yield socket
    finally:
        socket.close(linger=0)
        context.term()


def test_child_encodes_parent_decodes(corpus: list[tuple[str, Message]]) -> None:
    with zmq_socket(zmq.PULL) as socket:
        port = socket.bind_to_random_port("tcp://127.0.0.1")
        with peer(corpus, "send", f"tcp://127.0.0.1:{port}") as child:
            for index, (profile, expected) in enumerate(corpus):
                assert socket.poll(TIMEOUT_S * 1000), f"message {index} never arrived"
                frames = socket.recv_multipart()
                detected = detect_profile(frames).name
                assert detected == profile or (
                    type(expected) in SHARED and {detected, profile} <= SGLANG
                )
                assert decode_frames(frames) == expected, f"message {index} ({profile})"
            assert child.wait(TIMEOUT_S) == 0


def test_parent_encodes_child_decodes(corpus: list[tuple[str, Message]]) -> None:
    with peer(corpus, "receive") as child, zmq_socket(zmq.PUSH) as socket:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        socket.connect(f"tcp://127.0.0.1:{port}")
        for profile, message in corpus:
            assert socket.poll(TIMEOUT_S * 1000, zmq.POLLOUT)
            socket.send_multipart(encode_frames(message, profile))
        returncode = child.wait(TIMEOUT_S)  # it prints one short line: no pipe stall
        report = json.loads(child.stdout.read().splitlines()[-1])
        assert report == {"received": len(corpus), "mismatches": []}
        assert returncode == 0
