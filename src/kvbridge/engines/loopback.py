"""In-process loopback engine: both endpoints in one process, plain memcpy.

For unit tests only, never a product default: it proves plans and bookkeeping, not transfer.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvbridge.cache.plan import TransferPlan
from kvbridge.cache.regions import MemoryRegion
from kvbridge.engines.base import EngineError, TransferEngine, TransferHandle, TransferState


def probe() -> None:
    """Always available: plain memcpy through ctypes."""


class _DoneHandle(TransferHandle):
    engine = "loopback"

    def poll(self) -> TransferState:
        return TransferState.DONE


class LoopbackEngine(TransferEngine):
    name = "loopback"
    _endpoints: ClassVar[dict[bytes, LoopbackEngine]] = {}
    _counter = itertools.count()

    def __init__(self) -> None:
        super().__init__()
        self._endpoint = f"loopback-{next(self._counter)}".encode()
        self._endpoints[self._endpoint] = self
        self._notifications: list[tuple[str, bytes]] = []

    @classmethod
    def open(cls, endpoint_name: str, host: str, options: Mapping[str, str]) -> LoopbackEngine:
        return cls()

    @property
    def transport(self) -> str:
        return "memcpy"

    def endpoint(self) -> bytes:
        return self._endpoint

    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        pass

    def _deregister(self, regions: Sequence[MemoryRegion]) -> None:
        pass

    def _connect(self, peer_endpoint: bytes) -> str:
        if peer_endpoint not in self._endpoints:
            raise EngineError(self.name, "connect", f"no loopback endpoint {peer_endpoint!r}")
        return peer_endpoint.decode()

    def _write(self, peer: str, plan: TransferPlan, notify: bytes) -> TransferHandle:
        blocks = zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True)
        for src, dst, length in blocks:
            ctypes.memmove(dst, src, length)
        if notify:
            self.notify(peer, notify)
        return _DoneHandle()

    delivers_notifications = True

    def notify(self, peer: str, message: bytes) -> None:
        self._endpoints[peer.encode()]._notifications.append((self._endpoint.decode(), message))

    def notifications(self) -> list[tuple[str, bytes]]:
        delivered, self._notifications = self._notifications, []
        return delivered

    def close(self) -> None:
        self._endpoints.pop(self._endpoint, None)
