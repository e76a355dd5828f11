"""Prefill's sends, from the scheduler side to the workers the moment a request finishes.

Step metadata reaches the workers only with the next engine step, and nothing guarantees
one: vLLM's offline `LLM` loop steps while it has outputs to wait for, so after a prefill
batch's last output no step comes, and that request's blocks would never reach kvbridge (its
decode would wait out `transfer_timeout_s`). So the scheduler side hands each send to every
worker of its instance over a socket of the worker's (`SendInbox`), named in the worker's
handshake with vLLM together with a token that only the instance's scheduler learns: a
message is two frames, the token (checked before anything is parsed) and the send; one
without the token is dropped, and the listener never dies from what it receives.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
from collections.abc import Callable

import zmq

from kvbridge.integrations.vllm_options import OptionsError
from kvbridge.integrations.vllm_steps import SendSpec
from kvbridge.wire.address import tcp_endpoint

log = logging.getLogger("kvbridge.vllm")

POLL_MS = 100  # how often the inbox thread looks at its stop flag
# A send names a request's blocks: a million blocks are a few MiB of JSON.
MAX_MESSAGE_BYTES = 16 << 20
# Sends queued for a worker that does not take them (a burst, or a worker gone): past this
# many a send fails and its blocks are freed.
MAX_QUEUED_SENDS = 65536


class SendInbox:
    """A worker's end: a PULL socket on `host` and a thread that gives each authentic send
    to `on_send` (called on that thread)."""

    def __init__(self, host: str, on_send: Callable[[SendSpec], None]) -> None:
        self.token = secrets.token_hex(16)
        self._on_send = on_send
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.address = tcp_endpoint(host, self._socket.bind_to_random_port(f"tcp://{host}"))
        self.refused = 0  # messages dropped: malformed or without the token
        self.failure: str | None = None  # why the inbox stopped, if it did on its own
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvbridge-vllm-sends", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(POLL_MS, zmq.POLLIN):
                    self._take(self._socket.recv_multipart(copy=True))
        except zmq.ZMQError as exc:  # the socket was closed under us, or the context broke
            if not self._stop.is_set():
                self.failure = f"kvbridge's send inbox stopped: {exc}"
                log.error("%s", self.failure)
        finally:
            self._socket.close(linger=0)

    def _take(self, frames: list[bytes]) -> None:
        """One message: the token frame first (checked before anything is parsed), then the
        send; nothing in it stops the loop."""
        if len(frames) != 2 or not hmac.compare_digest(frames[0], self.token.encode()):
            self.refused += 1
            log.warning("send inbox: a message without this instance's token dropped")
            return
        try:
            send = SendSpec.decode(frames[1])
        except OptionsError as exc:
            self.refused += 1
            log.warning("send inbox: message dropped: %s", exc)
            return
        try:
            self._on_send(send)
        except Exception:  # the worker's failure to start one send stops no other
            log.exception("request %s: starting its send failed", send.request_id)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1 + POLL_MS / 1000)
        self._context.term()


class SendOutbox:
    """The scheduler's end: a PUSH socket to each worker's inbox (used on the scheduler's
    thread only)."""

    def __init__(self) -> None:
        self._context = zmq.Context()
        self._workers: dict[tuple[int, int], tuple[zmq.Socket[bytes], str]] = {}

    @property
    def workers(self) -> int:
        return len(self._workers)

    def connect(self, worker: tuple[int, int], address: str, token: str) -> None:
        """Send to the worker of this (pipeline stage, TP rank) from now on."""
        if worker in self._workers:
            self._workers[worker][0].close(linger=0)
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, MAX_QUEUED_SENDS)
        socket.connect(address)
        self._workers[worker] = (socket, token)

    def send(self, send: SendSpec) -> str | None:
        """Hand a send to every worker, or to none: why it could not reach them all, else
        None (a worker that got it while another did not would open a room over blocks that
        vLLM frees)."""
        if not self._workers:
            return "no worker of this instance named its send inbox"
        data = send.encode()
        for worker, (socket, _) in self._workers.items():
            if not socket.poll(0, zmq.POLLOUT):  # a full queue: a worker that takes no sends
                return f"worker (stage, rank) {worker} takes no sends ({MAX_QUEUED_SENDS} queued)"
        for worker, (socket, token) in self._workers.items():
            try:
                socket.send_multipart([token.encode(), data], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.error(
                    "worker (stage, rank) %s: a send for request %s lost: %s",
                    worker,
                    send.request_id,
                    exc,
                )
        return None

    def close(self) -> None:
        for socket, _ in self._workers.values():
            socket.close(linger=0)
        self._workers.clear()
        self._context.term()
