"""The control channel: one PULL socket for this rank, PUSH sockets to peers, one owner thread.

ZMQ sockets are not thread-safe, so every socket operation happens on the channel's own
thread; other threads hand it messages through a queue. Incoming messages are decoded (native
profile) and given to the manager's handler on that thread; a malformed message or a failing
handler is logged and counted, and the listener keeps serving.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvbridge.wire import NATIVE, Message, WireError
from kvbridge.wire.auth import ReplayGuard

log = logging.getLogger("kvbridge.control")

# How long the loop waits for input when it has nothing else to do, and when the manager
# says transfers are in flight (engines that need the target to poll get polled this often).
IDLE_POLL_MS = 20
BUSY_POLL_MS = 1
MAX_RECEIVE_BATCH = 256


@dataclass
class ChannelStats:
    received: int = 0
    sent: int = 0
    malformed: int = 0
    unauthenticated: int = 0
    handler_errors: int = 0
    send_failures: int = 0
    # CPU seconds the channel's thread used (receiving, decoding, handling, encoding, sending,
    # ticks): the control plane's cost, kept up to date by the thread itself.
    cpu_seconds: float = 0.0


class ControlChannel:
    def __init__(
        self,
        host: str,
        on_message: Callable[[Message], None],
        on_tick: Callable[[], bool] = lambda: False,
        *,
        name: str = "kvbridge-control",
        secret: bytes | None = None,
    ) -> None:
        """`on_tick` runs every loop iteration on the channel thread and says whether work is
        in flight (the loop then polls at `BUSY_POLL_MS`)."""
        self._context = zmq.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self.port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.endpoint = f"tcp://{host}:{self.port}"
        self._on_message = on_message
        self._on_tick = on_tick
        self._secret = secret
        self._guard = ReplayGuard() if secret else None
        self._outgoing: queue.SimpleQueue[tuple[str, Message]] = queue.SimpleQueue()
        self._push: dict[str, zmq.Socket[bytes]] = {}
        self._stop = threading.Event()
        self.stats = ChannelStats()
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def send(self, endpoint: str, message: Message) -> None:
        """Queue a message for a peer's control endpoint (any thread)."""
        self._outgoing.put((endpoint, message))

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        busy = False
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(BUSY_POLL_MS if busy else IDLE_POLL_MS))
                if self._pull in events:
                    self._receive()
                self._flush()
                try:
                    busy = self._on_tick()
                except Exception:
                    self.stats.handler_errors += 1
                    log.exception("control tick failed; the channel keeps serving")
                self.stats.cpu_seconds = time.thread_time()
        except BaseException as exc:  # the channel itself broke: report, never vanish
            self.failure = exc
            log.exception("control channel stopped")
        finally:
            for socket in (*self._push.values(), self._pull):
                socket.close(linger=0)

    def _receive(self) -> None:
        for _ in range(MAX_RECEIVE_BATCH):
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.stats.received += 1
            try:
                message = NATIVE.decode(frames, secret=self._secret, guard=self._guard)
            except WireError as exc:
                if exc.field in ("auth_tag", "header.flags") and self._secret:
                    self.stats.unauthenticated += 1
                    log.warning("dropped an unauthenticated control message: %s", exc)
                else:
                    self.stats.malformed += 1
                    log.warning("dropped a malformed control message: %s", exc)
                continue
            try:
                self._on_message(message)
            except Exception:
                self.stats.handler_errors += 1
                log.exception("handler failed on %s", type(message).__name__)

    def _flush(self) -> None:
        while True:
            try:
                endpoint, message = self._outgoing.get_nowait()
            except queue.Empty:
                return
            socket = self._push.get(endpoint)
            if socket is None:
                socket = self._context.socket(zmq.PUSH)
                socket.setsockopt(zmq.LINGER, 1000)
                socket.connect(endpoint)
                self._push[endpoint] = socket
            try:
                socket.send_multipart(NATIVE.encode(message, secret=self._secret), zmq.NOBLOCK)
                self.stats.sent += 1
            except zmq.Again:
                self.stats.send_failures += 1
                kind = type(message).__name__
                log.error("peer %s is not accepting control messages; dropped %s", endpoint, kind)
            except WireError:
                self.stats.send_failures += 1
                log.exception("could not encode %s for %s", type(message).__name__, endpoint)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        else:
            self._pull.close(linger=0)
        self._context.term()
