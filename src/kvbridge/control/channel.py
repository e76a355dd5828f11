"""The control channel: one PULL socket for this rank, PUSH sockets to peers, one owner thread.

ZMQ sockets are not thread-safe, so every socket operation happens on the channel's own
thread; other threads hand it messages through a queue and wake it through a pipe that its
poller watches, so a message leaves at once rather than at the loop's next poll timeout (up
to `IDLE_POLL_MS`: on the request path, decode's transfer request and prefill's status
would each wait for it). Incoming messages are decoded (native
profile) and given to the manager's handler on that thread; a malformed message or a failing
handler is logged and counted, and the listener keeps serving.

A rank whose peers are SGLang's (`foreign`: an SGLang profile) reads and sends that profile's
frames only, reading them as its own side's listener in sglang does; a kvbridge message is
never sent from it (one foreign frame list stops an sglang prefill rank's listener thread for
good): it is refused and counted.

Nothing a peer sends can stop the loop: a destination that is not a control endpoint is
refused before ZMQ sees it, sockets to peers are a bounded cache (least recently used closed
first, idle ones closed after `PEER_IDLE_S`), and a ZMQ error on one message (a full context,
no file descriptors) is counted and survived. Only a loop that keeps failing on its own gives
up; `failure` then says why, and the manager reports itself unhealthy.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import zmq

from kvbridge.control.capture import FrameCapture
from kvbridge.wire import NATIVE, Message, Receiver, WireError
from kvbridge.wire.address import endpoint_problem, tcp_endpoint
from kvbridge.wire.auth import ReplayGuard
from kvbridge.wire.sglang.common import SGLangProfile

log = logging.getLogger("kvbridge.control")

# How long the loop waits for input when it has nothing else to do, and when the manager
# says transfers are in flight (engines that need the target to poll get polled this often).
IDLE_POLL_MS = 20
BUSY_POLL_MS = 1
MAX_RECEIVE_BATCH = 256
# Sockets to peers kept open at once (ZMQ's context allows 1023 sockets in all), and how long
# an unused one stays open: peers that restart or go away leave no socket behind.
MAX_PEER_SOCKETS = 128
PEER_IDLE_S = 60.0
# Loop iterations in a row that fail outside any one message before the channel gives up.
MAX_LOOP_FAILURES = 100
CLOSE_TIMEOUT_S = 5.0
# How long, at close, messages already decided (a room's status, an abort's ack) may take to
# leave: a rank that closes right after its rooms succeeded still tells decode so, and a peer
# that is gone costs the close no more than this (`Context.term` waits for it).
CLOSE_LINGER_MS = 500
# The largest frame a peer may send (ZMQ_MAXMSGSIZE, checked per frame): ZMQ disconnects a peer
# whose frame is larger as soon as its length arrives, before holding any of it (a single 512
# MiB frame from a peer that never registered grew a rank by 512 MiB before it was dropped as
# malformed). The largest frame kvbridge sends is a transfer request's page indices, 4 bytes
# each: this is 16M pages.
MAX_FRAME_BYTES = 64 << 20


@dataclass
class ChannelStats:
    received: int = 0
    sent: int = 0
    malformed: int = 0
    unauthenticated: int = 0
    handler_errors: int = 0
    send_failures: int = 0
    # Destinations refused before any socket was made (not tcp://host:port).
    bad_endpoints: int = 0
    # Peer sockets closed because the cache was full, or idle.
    sockets_evicted: int = 0
    # ZMQ errors survived (no file descriptor, context full, ...), in the loop or per message.
    zmq_errors: int = 0
    # kvbridge messages not sent by a rank whose peers speak SGLang.
    refused_native: int = 0
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
        max_frame_bytes: int = MAX_FRAME_BYTES,
        foreign: tuple[SGLangProfile, Receiver] | None = None,
    ) -> None:
        """`on_tick` runs every loop iteration on the channel thread and says whether work is
        in flight (the loop then polls at `BUSY_POLL_MS`). Frames over `max_frame_bytes` are
        refused both ways: a peer that sends one is disconnected, and one of ours is dropped
        with an error before it leaves. `foreign`: the SGLang profile this rank's peers speak
        and which side's listener this rank is in it."""
        self._context = zmq.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self._max_frame_bytes = max_frame_bytes
        self.port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.host = host
        self.endpoint = tcp_endpoint(host, self.port)
        self._on_message = on_message
        self._on_tick = on_tick
        self._secret = secret
        self._guard = ReplayGuard() if secret else None
        self._foreign = foreign
        self._capture = FrameCapture.from_environment(
            f"{name}-{self.port}",
            foreign[0].name if foreign else None,
            foreign[1] if foreign else None,
        )
        self._outgoing: queue.SimpleQueue[tuple[str, Message]] = queue.SimpleQueue()
        # send() writes a byte here when the loop may be asleep in its poll; the loop clears
        # `_wake_pending` before it drains the queue, so no queued message waits for a timeout.
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_pending = False
        self._wake_lock = threading.Lock()  # no write to a pipe that close() let go
        # Set by the loop after a flush that sent something (`sending_now` waits for it).
        self._sent = threading.Event()
        # endpoint → (socket, last use), least recently used first
        self._push: OrderedDict[str, tuple[zmq.Socket[bytes], float]] = OrderedDict()
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
        self._wake()

    @contextlib.contextmanager
    def sending_now(self, wait_s: float) -> Iterator[None]:
        """Messages queued inside the block leave before the caller goes on (it waits up to
        `wait_s` for the loop to send them). The loop needs the GIL to send, and a thread that
        runs Python without blocking (a scheduler opening a batch of rooms) keeps it from the
        loop for up to the switch interval; waiting hands it over. (Not on the loop's own
        thread, which sends them when its handler returns.)"""
        if threading.current_thread() is self._thread:
            yield
            return
        self._sent.clear()
        yield
        if not self._sent.is_set() and not self._outgoing.empty():
            self._sent.wait(wait_s)

    def _wake(self) -> None:
        """Make the loop's poll return now (any thread)."""
        if self._wake_pending:
            return
        with self._wake_lock:
            if self._wake_pending or self._wake_write < 0:
                return
            self._wake_pending = True
            with contextlib.suppress(BlockingIOError):  # full: the loop will wake anyway
                os.write(self._wake_write, b"\0")

    def _drain_wake(self) -> None:
        self._wake_pending = False
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_read, 4096):
                pass

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        busy = False
        failures_in_a_row = 0
        try:
            while not self._stop.is_set():
                try:
                    events = dict(poller.poll(BUSY_POLL_MS if busy else IDLE_POLL_MS))
                    if self._pull in events:
                        self._receive()
                    if self._wake_read in events:
                        self._drain_wake()
                    self._flush()
                    self._close_idle(time.monotonic())
                    failures_in_a_row = 0
                except zmq.ZMQError as exc:
                    self.stats.zmq_errors += 1
                    failures_in_a_row += 1
                    if failures_in_a_row >= MAX_LOOP_FAILURES:
                        raise
                    log.warning("control loop: %s; it keeps serving", exc)
                    time.sleep(IDLE_POLL_MS / 1000)
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
            self._last_flush()
            self._pull.close(linger=0)
            self._close_wake()

    def _last_flush(self) -> None:
        """Send what is queued and let the peer sockets linger for it (`CLOSE_LINGER_MS`)."""
        if self.failure is None:  # a loop that broke on ZMQ sends nothing more
            try:
                self._flush()
            except Exception:
                log.exception("could not send the last queued control messages")
        for socket, _ in self._push.values():
            socket.close(linger=CLOSE_LINGER_MS if self.failure is None else 0)
        self._push.clear()

    def _receive(self) -> None:
        for _ in range(MAX_RECEIVE_BATCH):
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self.stats.zmq_errors += 1
                log.warning("receive failed: %s", exc)
                return
            self.stats.received += 1
            if self._capture is not None:
                self._capture.write("received", "", frames)
            try:
                message = self._decode(frames)
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

    def _decode(self, frames: list[bytes]) -> Message:
        if self._foreign is None:
            return NATIVE.decode(frames, secret=self._secret, guard=self._guard)
        profile, receiver = self._foreign
        return profile.decode(frames, receiver=receiver)

    def _encode(self, endpoint: str, message: Message) -> list[bytes] | None:
        """The message's frames; None: it must not leave (a kvbridge message from a rank whose
        peers speak SGLang)."""
        if self._foreign is None:
            return NATIVE.encode(message, secret=self._secret)
        if self._foreign[0].speaks(type(message)):  # sglang's own, or a status it shares
            return self._foreign[0].encode(message)
        self.stats.refused_native += 1
        log.error(
            "not sending %s to %s: this rank's peers speak SGLang", type(message).__name__, endpoint
        )
        return None

    def _flush(self) -> None:
        sent = self.stats.sent
        while True:
            try:
                endpoint, message = self._outgoing.get_nowait()
            except queue.Empty:
                if self.stats.sent != sent:
                    self._sent.set()
                return
            kind = type(message).__name__
            problem = endpoint_problem(endpoint)
            if problem is not None:
                self.stats.bad_endpoints += 1
                log.warning("dropped %s to a bad endpoint: %s", kind, problem)
                continue
            try:
                encoded = self._encode(endpoint, message)
                if encoded is None:
                    continue
                frames = encoded
                largest = max(len(frame) for frame in frames)
                if largest > self._max_frame_bytes:
                    self.stats.send_failures += 1
                    log.error(
                        "dropped %s to %s: a frame of %d bytes, over the %d a peer "
                        "accepts (MAX_FRAME_BYTES)",
                        kind,
                        endpoint,
                        largest,
                        self._max_frame_bytes,
                    )
                    continue
                self._socket_to(endpoint).send_multipart(frames, zmq.NOBLOCK)
                self.stats.sent += 1
                if self._capture is not None:
                    self._capture.write("sent", endpoint, frames)
            except zmq.Again:
                self.stats.send_failures += 1
                log.error("peer %s is not accepting control messages; dropped %s", endpoint, kind)
            except zmq.ZMQError as exc:
                self.stats.send_failures += 1
                self.stats.zmq_errors += 1
                log.error("could not send %s to %s: %s", kind, endpoint, exc)
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._evict(len(self._push) // 2 or 1)  # give descriptors back
            except WireError:
                self.stats.send_failures += 1
                log.exception("could not encode %s for %s", kind, endpoint)

    def _socket_to(self, endpoint: str) -> zmq.Socket[bytes]:
        """The PUSH socket to a peer, from the cache or new (the cache stays bounded)."""
        now = time.monotonic()
        cached = self._push.pop(endpoint, None)
        if cached is not None:
            self._push[endpoint] = (cached[0], now)
            return cached[0]
        if len(self._push) >= MAX_PEER_SOCKETS:
            self._evict(len(self._push) - MAX_PEER_SOCKETS + 1)
        socket = self._context.socket(zmq.PUSH)
        try:
            socket.setsockopt(zmq.LINGER, 1000)
            socket.connect(endpoint)
        except BaseException:
            socket.close(linger=0)
            raise
        self._push[endpoint] = (socket, now)
        return socket

    def _evict(self, count: int) -> None:
        for _ in range(min(count, len(self._push))):
            endpoint, (socket, _) = self._push.popitem(last=False)
            socket.close(linger=0)
            self.stats.sockets_evicted += 1
            log.debug("closed the control socket to %s", endpoint)

    def _close_idle(self, now: float) -> None:
        while self._push:
            _, (_, last_used) = next(iter(self._push.items()))
            if now - last_used < PEER_IDLE_S:
                return
            self._evict(1)

    def _close_wake(self) -> None:
        with self._wake_lock:
            for descriptor in (self._wake_read, self._wake_write):
                if descriptor >= 0:
                    os.close(descriptor)
            self._wake_read = self._wake_write = -1

    @property
    def peer_sockets(self) -> int:
        return len(self._push)

    def close(self) -> None:
        """Stop the loop and release every socket, in bounded time (what was queued first
        leaves, `CLOSE_LINGER_MS` at most): a loop that does not stop is left to die with the
        process rather than hanging here (`Context.term` waits for every socket, and the
        loop's sockets are only its own to close)."""
        self._stop.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=CLOSE_TIMEOUT_S)
        elif self._thread.ident is None:  # never started
            self._pull.close(linger=0)
            self._close_wake()
        if self._thread.is_alive():
            log.error("control channel did not stop within %g s; left running", CLOSE_TIMEOUT_S)
            return
        self._context.term()
