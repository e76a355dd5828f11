"""The transfer-engine interface kvbridge drives, and what every engine shares.

An engine registers memory, describes its endpoint for the peer (agent metadata, session
id), connects to a peer's endpoint, and writes a `TransferPlan` to a peer asynchronously,
returning a handle that is polled or waited on with a deadline. Every failure is an
`EngineError` carrying the engine's own message.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvbridge.cache.plan import TransferPlan
from kvbridge.cache.regions import MemoryRegion, RegionMap


def rdma_device_present() -> bool:
    """Whether this host has an RDMA device (engines fall back to TCP without one)."""
    folder = Path("/sys/class/infiniband")
    return folder.is_dir() and any(folder.iterdir())


class EngineError(RuntimeError):
    """A transfer engine refused or failed an operation; the message is the engine's own."""

    def __init__(self, engine: str, operation: str, detail: str) -> None:
        super().__init__(f"{engine}: {operation} failed: {detail}")
        self.engine = engine
        self.operation = operation
        self.detail = detail


class EngineTimeout(EngineError):
    """A write did not complete before its deadline."""


class WriteFenced(EngineError):
    """A write was stopped because the writer may no longer write (its lease ran out)."""


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class ClosedEngine:
    """Stands in for an engine library's object once it is destroyed at close (which is what
    releases its sockets): any later use is an EngineError, not a crash in native code."""

    def __init__(self, engine: str) -> None:
        self._engine = engine

    def __getattr__(self, operation: str) -> Any:
        raise EngineError(self._engine, operation, "the engine is closed")


class TransferHandle(ABC):
    """One asynchronous write; poll it, or wait for it with a deadline."""

    engine: str
    error: str | None = None

    @abstractmethod
    def poll(self) -> TransferState:
        """Advance and report the write's state without blocking."""

    def release(self) -> None:  # noqa: B027 - engines without per-write resources
        """Give the engine's resources for this write back (idempotent)."""

    def check(self, started: float, timeout_s: float, fenced: str | None = None) -> bool:
        """One step of `wait` (never blocks): True once the write is done; `EngineError` if
        it failed, `EngineTimeout` once `timeout_s` passed since `started` (monotonic).
        `fenced`, why the writer may no longer write, stops the write before the poll (which
        is what moves it on, for engines that progress only when polled), releases it, and
        raises `WriteFenced`."""
        if fenced is not None:
            self.release()
            raise WriteFenced(self.engine, "write", fenced)
        state = self.poll()
        if state is TransferState.DONE:
            return True
        if state is TransferState.FAILED:
            raise EngineError(self.engine, "write", self.error or "unknown engine error")
        if time.monotonic() - started >= timeout_s:
            self.release()
            raise EngineTimeout(self.engine, "write", f"not complete after {timeout_s:g} s")
        return False

    def wait(
        self,
        timeout_s: float,
        poll_interval_s: float = 0.0,
        fence: Callable[[], str | None] | None = None,
    ) -> None:
        """Block until the write is done (`check` until it says so, raising what it raises);
        `fence()` is asked before every poll."""
        started = time.monotonic()
        while not self.check(started, timeout_s, fence() if fence is not None else None):
            # Even 0 sleeps: a loop that never lets go of the GIL starves this process's other
            # threads (control channel, the serving engine) for Python's switch interval.
            time.sleep(poll_interval_s)


class PendingWrite:
    """A write checked and set up for the engine but not started: `start()` posts it, or
    `release()` drops it. Splitting the two lets a writer do its bookkeeping between them:
    some engines move the whole write inside the post call (NIXL over CMA copies there), so
    whatever runs after `start()` waits for the copy."""

    def __init__(
        self,
        start: Callable[[], TransferHandle],
        release: Callable[[], None] | None = None,
        start_notifying: Callable[[bytes], TransferHandle] | None = None,
    ) -> None:
        self._start: Callable[[], TransferHandle] | None = start
        self._release = release
        self._start_notifying = start_notifying

    @property
    def renotifiable(self) -> bool:
        """Whether `start` can send another notification than the one it was set up with."""
        return self._start_notifying is not None

    def start(self, notify: bytes | None = None) -> TransferHandle:
        """Post the write (once); with `notify` (where `renotifiable`), that notification in
        place of the one it was set up with."""
        if self._start is None:
            raise RuntimeError("this write was started or released already")
        start, self._start = self._start, None
        if notify is None:
            return start()
        if self._start_notifying is None:
            raise RuntimeError("this write's notification is fixed")
        return self._start_notifying(notify)

    def release(self) -> None:
        """Drop the write without starting it (idempotent; nothing once started)."""
        if self._start is not None:
            self._start = None
            if self._release is not None:
                self._release()


class TransferEngine(ABC):
    """One endpoint of a transfer engine in this process."""

    name: str

    def __init__(self) -> None:
        self.local_memory = RegionMap()
        self.peer_memory: dict[str, RegionMap] = {}
        self._write_end_listeners: list[Callable[[], None]] = []

    @classmethod
    @abstractmethod
    def open(cls, endpoint_name: str, host: str, options: Mapping[str, str]) -> TransferEngine:
        """A new endpoint: `endpoint_name` where the engine names endpoints, `host` where it
        serves on an address, `options` every option of its registry entry, resolved."""

    @property
    @abstractmethod
    def transport(self) -> str:
        """The transport actually in use (e.g. 'ucx:cma', 'tcp'), not the one asked for."""

    @abstractmethod
    def endpoint(self) -> bytes:
        """What a peer needs to connect to this endpoint."""

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        self._register(regions)
        self.local_memory.add(regions)

    def deregister(self, regions: Sequence[MemoryRegion]) -> None:
        self._deregister(regions)
        self.local_memory.remove(regions)

    def connect(self, peer_endpoint: bytes, peer_memory: Sequence[MemoryRegion]) -> str:
        """Connect to a peer; returns the peer's id for `write`. `peer_memory` is what the
        peer registered (from its registration message): writes outside it are refused."""
        peer = self._connect(peer_endpoint)
        self.peer_memory[peer] = RegionMap(peer_memory)
        return peer

    def write(self, peer: str, plan: TransferPlan, notify: bytes = b"") -> TransferHandle:
        """Start writing the plan's blocks to the peer. Every block must lie inside registered
        memory on both sides: anything else is refused before the engine sees it."""
        return self.prepare_write(peer, plan, notify).start()

    def prepare_write(self, peer: str, plan: TransferPlan, notify: bytes = b"") -> PendingWrite:
        """`write` up to the point of posting (checked, and set up where the engine can do
        that ahead); `start()` on the result posts it. A prefill rank sets the next write up
        on one thread while another posts and polls the current one: engines allow that."""
        if peer not in self.peer_memory:
            raise EngineError(self.name, "write", f"not connected to peer {peer!r}")
        self.check_bounds(peer, plan)
        return self._prepare_write(peer, plan, notify)

    def _prepare_write(self, peer: str, plan: TransferPlan, notify: bytes) -> PendingWrite:
        return PendingWrite(
            lambda: self._write(peer, plan, notify),
            start_notifying=lambda message: self._write(peer, plan, message),
        )

    def check_bounds(self, peer: str, plan: TransferPlan) -> None:
        for side, regions, addresses in (
            ("local source", self.local_memory, plan.src),
            ("peer destination", self.peer_memory[peer], plan.dst),
        ):
            outside = regions.outside(addresses, plan.length)
            if outside.size:
                first = int(outside[0])
                raise EngineError(
                    self.name,
                    "write",
                    f"{outside.size} block(s) outside {side} registered memory, first "
                    f"{int(addresses[first]):#x}+{int(plan.length[first])}",
                )

    delivers_notifications: bool = False
    # Whether a posted write moves on without this process polling it (its own threads): then
    # a writer cannot stop a write in flight, and a target waits out `write_timeout_s` too;
    # such an engine tells its write-end listeners when a write ended.
    progresses_on_its_own: bool = False

    def add_write_end_listener(self, listener: Callable[[], None]) -> None:
        """Have `listener` called, on the engine's own thread, whenever one of this engine's
        writes ends (done or failed): a writer then sleeps until something ended instead of
        polling its handles. Only engines that progress on their own call it; a writer must
        poll the others (polling is what moves them)."""
        self._write_end_listeners.append(listener)

    def remove_write_end_listener(self, listener: Callable[[], None]) -> None:
        self._write_end_listeners.remove(listener)

    def _write_ended(self) -> None:
        """Tell the listeners that a write ended (engines that progress on their own)."""
        for listener in tuple(self._write_end_listeners):
            listener()

    def notify(self, peer: str, message: bytes) -> None:
        """Send a notification to a peer without data (engines that deliver notifications)."""
        raise EngineError(self.name, "notify", "this engine has no notifications")

    def notifications(self) -> list[tuple[str, bytes]]:
        """Notifications delivered by peers' writes since the last call (engines that have
        them); drives the engine's progress where it needs the target to poll."""
        return []

    @abstractmethod
    def _register(self, regions: Sequence[MemoryRegion]) -> None: ...

    @abstractmethod
    def _deregister(self, regions: Sequence[MemoryRegion]) -> None: ...

    @abstractmethod
    def _connect(self, peer_endpoint: bytes) -> str: ...

    @abstractmethod
    def _write(self, peer: str, plan: TransferPlan, notify: bytes) -> TransferHandle: ...

    def close(self) -> None:  # noqa: B027 - optional for engines
        """Release the engine's resources (idempotent)."""
