"""The other process of the cross-process wire tests.

python zmq_peer.py send ENDPOINT   encode each message read from stdin (a pickled list of
                                   (profile, message)) and PUSH its frames to ENDPOINT
python zmq_peer.py receive         bind a PULL socket on loopback, print its port, decode as
                                   many messages as stdin lists and compare them; print a
                                   JSON report, exit 1 on any mismatch
"""

from __future__ import annotations

import json
import pickle
import sys

import zmq

from kvbridge.wire import WireError, decode_frames, encode_frames

TIMEOUT_MS = 20_000


def send(endpoint: str, corpus: list) -> int:
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, TIMEOUT_MS)
    socket.connect(endpoint)
    for profile, message in corpus:
        socket.send_multipart(encode_frames(message, profile))
    socket.close()  # lingers until every message is handed to the peer
    context.term()
    return 0


def receive(corpus: list) -> int:
    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    mismatches = []
    for index, (profile, expected) in enumerate(corpus):
        if not socket.poll(TIMEOUT_MS):
            mismatches.append(f"message {index}: nothing received in {TIMEOUT_MS} ms")
            break
        frames = socket.recv_multipart()
        try:
            decoded = decode_frames(frames)
        except WireError as exc:
            mismatches.append(f"message {index} ({profile}): {exc}")
            continue
        if decoded != expected:
            mismatches.append(f"message {index} ({profile}): {decoded!r} != {expected!r}")
    socket.close(linger=0)
    context.term()
    print(json.dumps({"received": len(corpus), "mismatches": mismatches}), flush=True)
    return 1 if mismatches else 0


if __name__ == "__main__":
    messages = pickle.load(sys.stdin.buffer)
    if sys.argv[1] == "send":
        sys.exit(send(sys.argv[2], messages))
    sys.exit(receive(messages))
