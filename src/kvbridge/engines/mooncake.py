"""Mooncake Transfer Engine in P2P-handshake mode (no metadata server).

Mooncake accepts at most 1024 slices in flight per peer, so a plan is written as batches of
at most `MAX_BLOCKS_IN_FLIGHT` blocks, one after the other. Its batch status call blocks until
the batch ends, so the batches run on one worker thread per engine; a handle's `poll` only
reads the state that thread leaves, and never blocks.

Mooncake always binds wildcard listeners (no setting restricts them). It needs the system
library libibverbs even for TCP.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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
MAX_BLOCKS_IN_FLIGHT = 1024
INSTALL_HINT = (
    "Mooncake needs libibverbs even for TCP: apt-get install -y libibverbs1 libnl-3-200 "
    "libnl-route-3-200, then pip install mooncake-transfer-engine-non-cuda (CPU-only hosts) or "
    "mooncake-transfer-engine"
)


def _import_mooncake() -> Any:
    # Mooncake logs through glog at INFO to stderr; keep warnings and errors only. Its glog
    # build ignores GLOG_minloglevel; MC_LOG_LEVEL (upper case) is what it reads, at load.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake import engine  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError as exc:
        raise EngineError(NAME, "import", f"{exc}. {INSTALL_HINT}") from None
    return engine


def probe() -> None:
    """Load Mooncake; raises EngineError if it cannot (not installed, libibverbs missing)."""
    _import_mooncake()


@dataclass(eq=False)
class _MooncakeHandle(TransferHandle):
    plan: TransferPlan
    session: str
    engine: str = NAME
    state: TransferState = TransferState.PENDING
    error: str | None = None

    def poll(self) -> TransferState:
        return self.state


class MooncakeEngine(TransferEngine):
    progresses_on_its_own = True  # its worker threads move a posted batch
    name = NAME

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device: str = "") -> None:
        super().__init__()
        module = _import_mooncake()
        self._engine = module.TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise EngineError(NAME, "initialize", f"rc {rc} for {host} over {protocol}")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        # Asking for RDMA without an RDMA card returns 0 and silently uses TCP.
        self._transport = protocol if protocol == "tcp" or rdma_device_present() else "tcp"
        self._work: queue.Queue[_MooncakeHandle | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="kvbridge-mooncake", daemon=True)
        self._worker.start()
        self._closed = False

    @classmethod
    def open(cls, endpoint_name: str, host: str, options: Mapping[str, str]) -> MooncakeEngine:
        return cls(host, protocol=options["protocol"], device=options["device"])

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
        handle = _MooncakeHandle(plan, peer)
        self._work.put(handle)
        return handle

    def _run(self) -> None:
        while True:
            handle = self._work.get()
            if handle is None:
                return
            try:
                for batch in handle.plan.split(MAX_BLOCKS_IN_FLIGHT):
                    # The synchronous call opens the peer's segment and checks that it could;
                    # the asynchronous submit followed by a status query crashed inside
                    # Mooncake (SIGSEGV) when the peer had become unreachable.
                    rc = self._engine.batch_transfer_sync_write(
                        handle.session,
                        batch.src.tolist(),
                        batch.dst.tolist(),
                        batch.length.tolist(),
                    )
                    if rc != 0:
                        raise EngineError(NAME, "write", f"batch rc {rc}")
                handle.state = TransferState.DONE
            except Exception as exc:  # anything Mooncake raises ends this write, not the worker
                handle.error = exc.detail if isinstance(exc, EngineError) else str(exc)
                handle.state = TransferState.FAILED

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._work.put(None)
        self._worker.join(timeout=5.0)
        for region in self.local_memory.regions:
            self._engine.unregister_memory(region.ptr)
        if not self._worker.is_alive():
            # Destroying the engine closes its listeners; a worker stuck in a batch keeps it.
            self._engine = ClosedEngine(NAME)
