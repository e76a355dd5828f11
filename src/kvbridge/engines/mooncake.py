"""Mooncake Transfer Engine in P2P-handshake mode (no metadata server).

Mooncake's TCP transport queues a bounded number of transfers (blocks) per peer, 1024 by
default, and fails a batch beyond it ("TCP lane queue-full rejection"). kvbridge raises the
limits as sglang deployments do (`RAISED_QUEUE_LIMIT`, unless the environment sets them) and
sizes its batches to them: a write is split into batches of at most `batch_blocks` blocks
(default: the limit shared by the submit threads), so what is in flight toward a peer never
exceeds it. Its synchronous batch call blocks until the batch ends, so batches run on
`submit_threads` worker threads per engine (several writes move at once, as sglang's transfer
queues do); a handle's `poll` only reads the state they leave, and never blocks. A write ends
only when all its batches ended: nothing of a failed write can land later.

Mooncake always binds wildcard listeners (no setting restricts them). It needs the system
library libibverbs even for TCP.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.cache.plan import TransferPlan
from kvbridge.cache.regions import MemoryRegion
from kvbridge.engines.base import (
    ClosedEngine,
    EngineError,
    TransferEngine,
    TransferHandle,
    TransferState,
    rdma_device_present,
)

NAME = "mooncake"
# Mooncake's per-peer limits of its TCP transport (transfers queued, admissions pending), their
# default, and what kvbridge sets them to unless the environment already does.
QUEUE_LIMIT_VARIABLES = (
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER",
)
MOONCAKE_QUEUE_LIMIT = 1024
RAISED_QUEUE_LIMIT = 65535
INSTALL_HINT = (
    "Mooncake needs libibverbs even for TCP: apt-get install -y libibverbs1 libnl-3-200 "
    "libnl-route-3-200, then pip install mooncake-transfer-engine-non-cuda (CPU-only hosts) or "
    "mooncake-transfer-engine"
)


def _import_mooncake() -> Any:
    # Mooncake logs through glog at INFO to stderr; keep warnings and errors only. Its glog
    # build ignores GLOG_minloglevel; MC_LOG_LEVEL (upper case) is what it reads, at load.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    for variable in QUEUE_LIMIT_VARIABLES:
        os.environ.setdefault(variable, str(RAISED_QUEUE_LIMIT))
    try:
        from mooncake import engine  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError as exc:
        raise EngineError(NAME, "import", f"{exc}. {INSTALL_HINT}") from None
    return engine


def probe() -> None:
    """Load Mooncake; raises EngineError if it cannot (not installed, libibverbs missing)."""
    _import_mooncake()


def queue_limit() -> int:
    """Blocks Mooncake's TCP transport takes in flight per peer in this process: the lower of
    its two limits, as the environment sets them (Mooncake's default where unset)."""
    limits = []
    for variable in QUEUE_LIMIT_VARIABLES:
        value = os.environ.get(variable, str(MOONCAKE_QUEUE_LIMIT))
        if not value.strip().isdigit():
            raise EngineError(NAME, "configure", f"{variable}={value!r} is not a number")
        limits.append(int(value))
    return min(limits)


def default_submit_threads() -> int:
    """One submit thread per 8 CPUs, at least one, at most four. Each batch in flight keeps
    Mooncake's own lane threads busy: on a 2-CPU host, one submit thread moved the demo's
    blocks at 0.64 GB/s and two at 0.42-0.62 (measured 2026-12-02)."""
    return max(1, min(4, (os.cpu_count() or 1) // 8))


@dataclass(eq=False)
class _MooncakeHandle(TransferHandle):
    session: str
    batches_left: int
    engine: str = NAME
    state: TransferState = TransferState.PENDING
    error: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def poll(self) -> TransferState:
        return self.state

    def batch_ended(self, error: str | None) -> bool:
        """One batch ended; the write ends with its last batch (failed if any failed).
        Whether the write ended with it."""
        with self._lock:
            self.error = self.error or error
            self.batches_left -= 1
            if not self.batches_left:
                self.state = TransferState.FAILED if self.error else TransferState.DONE
            return not self.batches_left


@dataclass(frozen=True)
class _Batch:
    handle: _MooncakeHandle
    plan: TransferPlan


class MooncakeEngine(TransferEngine):
    progresses_on_its_own = True  # its worker threads move a posted batch
    name = NAME

    def __init__(
        self,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        submit_threads: int = 1,
        batch_blocks: int = 0,
    ) -> None:
        super().__init__()
        module = _import_mooncake()
        limit = queue_limit()
        self.batch_blocks = batch_blocks or max(1, limit // submit_threads)
        if protocol == "tcp" and self.batch_blocks * submit_threads > limit:
            raise EngineError(
                NAME,
                "configure",
                f"{submit_threads} submit thread(s) × batches of {self.batch_blocks} blocks "
                f"exceed Mooncake's TCP queue of {limit} blocks per peer "
                f"({' and '.join(QUEUE_LIMIT_VARIABLES)}): raise them or lower batch_blocks",
            )
        # Mooncake says only rc -1, for a peer gone and a queue overrun alike: both are named.
        self._limit_note = (
            f": the peer gone, or more than Mooncake's TCP transport takes ({limit} blocks per "
            f"peer, {QUEUE_LIMIT_VARIABLES[0]}; {submit_threads} batch(es) of at most "
            f"{self.batch_blocks} are in flight)"
            if protocol == "tcp"
            else ""
        )
        self._engine = module.TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise EngineError(NAME, "initialize", f"rc {rc} for {host} over {protocol}")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        # Asking for RDMA without an RDMA card returns 0 and silently uses TCP.
        self._transport = protocol if protocol == "tcp" or rdma_device_present() else "tcp"
        self._work: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._workers = [
            threading.Thread(target=self._run, name=f"kvbridge-mooncake-{index}", daemon=True)
            for index in range(submit_threads)
        ]
        for worker in self._workers:
            worker.start()
        self._closed = False

    @classmethod
    def open(cls, endpoint_name: str, host: str, options: Mapping[str, str]) -> MooncakeEngine:
        threads = int(options["submit_threads"]) or default_submit_threads()
        return cls(
            host,
            protocol=options["protocol"],
            device=options["device"],
            submit_threads=threads,
            batch_blocks=int(options["batch_blocks"]),
        )

    @property
    def transport(self) -> str:
        return self._transport

    def endpoint(self) -> bytes:
        return self.session_id.encode()

    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        for region in regions:
            rc = self._engine.register_memory(region.ptr, region.length)
            if rc != 0:
                raise EngineError(NAME, "register memory", f"rc {rc} for {region}")

    def _deregister(self, regions: Sequence[MemoryRegion]) -> None:
        for region in regions:
            rc = self._engine.unregister_memory(region.ptr)
            if rc != 0:
                raise EngineError(NAME, "deregister memory", f"rc {rc} for {region}")

    def _connect(self, peer_endpoint: bytes) -> str:
        # P2P handshake happens on the first write; the session id is the peer's address.
        return peer_endpoint.decode()

    def _write(self, peer: str, plan: TransferPlan, notify: bytes) -> TransferHandle:
        if self._closed:
            raise EngineError(NAME, "write", "engine is closed")
        batches = plan.split(self.batch_blocks)
        handle = _MooncakeHandle(peer, len(batches))
        if not batches:
            handle.state = TransferState.DONE
        for batch in batches:
            self._work.put(_Batch(handle, batch))
        return handle

    def _run(self) -> None:
        while (batch := self._work.get()) is not None:
            handle = batch.handle
            # After an earlier batch of this write failed, the rest only count down.
            error = self._move(batch) if handle.error is None else None
            if handle.batch_ended(error):
                self._write_ended()

    def _move(self, batch: _Batch) -> str | None:
        """One batch through Mooncake (blocking); why it failed, or None."""
        handle = batch.handle
        try:
            # The synchronous call opens the peer's segment and checks that it could; the
            # asynchronous submit followed by a status query crashed inside Mooncake (SIGSEGV)
            # when the peer had become unreachable.
            rc = self._engine.batch_transfer_sync_write(
                handle.session,
                batch.plan.src.tolist(),
                batch.plan.dst.tolist(),
                batch.plan.length.tolist(),
            )
        except Exception as exc:  # anything Mooncake raises ends this write, not the worker
            return exc.detail if isinstance(exc, EngineError) else str(exc)
        if rc != 0:
            return (
                f"a batch of {len(batch.plan)} block(s) to {handle.session} failed "
                f"(rc {rc}){self._limit_note}"
            )
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._workers:
            self._work.put(None)
        for worker in self._workers:
            worker.join(timeout=5.0)
        for region in self.local_memory.regions:
            self._engine.unregister_memory(region.ptr)
        if not any(worker.is_alive() for worker in self._workers):
            # Destroying the engine closes its listeners; a worker stuck in a batch keeps it.
            self._engine = ClosedEngine(NAME)
