"""NVIDIA NIXL (`nixl-cu12`) with the UCX backend: the default engine.

kvbridge owns the progress loop: NIXL's progress thread is off (on a small host it fights the
control threads for cores, ≈17 ms per notification measured here), so the initiator drives
UCX by polling its handles and the target by polling notifications. A write is one NIXL
transfer built from the plan's arrays directly (an N×3 uint64 array), never a Python list of
descriptors; its notification reaches the peer after the data is in place.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.cache.plan import TransferPlan
from kvbridge.cache.regions import MemoryRegion, RegionMap
from kvbridge.engines.base import (
    ClosedEngine,
    EngineError,
    PendingWrite,
    TransferEngine,
    TransferHandle,
    TransferState,
    rdma_device_present,
)
from kvbridge.wire.messages import MemoryKind

NAME = "nixl"
# UCX transport modules that need an RDMA card; loading them where RDMA libraries are installed
# but no card exists can crash the process at exit inside a second copy of libnl.
_RDMA_UCX_MODULES = "^ib,ib_efa,ib_mlx5,ib_mlx5_ext,ib_mlx5_gda,ib_mlx5_gdp"


def _import_nixl() -> Any:
    if not rdma_device_present():
        os.environ.setdefault("UCX_MODULES", _RDMA_UCX_MODULES)
    # The CUDA 12 build (what CPU hosts and CUDA 12 machines install), or the CUDA 13 one.
    for package in ("nixl_cu12", "nixl_cu13"):
        try:
            _disarm_nixl_logging_setup(package)
            api = importlib.import_module(f"{package}._api")
        except ImportError as exc:
            failure = exc
            continue
        _quiet_nixl_logging()
        return api
    raise EngineError(
        NAME,
        "import",
        f"{failure}; install it with: pip install --no-deps nixl-cu12 (or nixl-cu13 with CUDA 13)",
    )


def probe() -> None:
    """Load NIXL (either CUDA build); raises EngineError if it cannot."""
    _import_nixl()


def _disarm_nixl_logging_setup(package: str) -> None:
    """NIXL's first logger calls `logging.config.dictConfig`, which closes every handler of
    the host process (a FileHandler stops writing) and sets `logging.raiseExceptions`; a
    library must not reconfigure its host's logging. Its `logging` module is loaded here first
    and marked as configured, so that the package's import finds it done: NIXL's loggers then
    propagate to whatever the host set up."""
    name = f"{package}.logging"
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return  # not installed: the import below says so
    path = os.path.join(next(iter(spec.submodule_search_locations)), "logging.py")
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None or not os.path.exists(path):
        return
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    module._logging_configured = True  # type: ignore[attr-defined]
    sys.modules[name] = module


def _quiet_nixl_logging() -> None:
    """NIXL would log INFO lines; keep its warnings unless NIXL_LOG_LEVEL asks for more."""
    nixl_logger = logging.getLogger("nixl")
    level = os.environ.get("NIXL_LOG_LEVEL", "").upper()
    levels = {"TRACE": logging.DEBUG, "DEBUG": logging.DEBUG, "INFO": logging.INFO}
    nixl_logger.setLevel(levels.get(level, logging.WARNING))


def _mem_type(kind: MemoryKind) -> str:
    return "VRAM" if kind == MemoryKind.VRAM else "DRAM"


class _NixlHandle(TransferHandle):
    engine = NAME

    def __init__(self, agent: Any, handle: Any) -> None:
        self._agent = agent
        self._handle: Any = handle
        self._state = TransferState.PENDING

    def poll(self) -> TransferState:
        if self._state is not TransferState.PENDING:
            return self._state
        try:
            state = self._agent.check_xfer_state(self._handle)
        except Exception as exc:  # NIXL raises its own exception types
            state, self.error = "ERR", str(exc)
        if state == "DONE":
            self._state = TransferState.DONE
            self.release()
        elif state == "ERR":
            self._state = TransferState.FAILED
            self.error = self.error or "NIXL reported the transfer state ERR"
            self.release()
        return self._state

    def release(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as exc:  # pragma: no cover - NIXL internal failure
                self.error = self.error or f"release failed: {exc}"


class NixlEngine(TransferEngine):
    name = NAME

    def __init__(self, agent_name: str, *, progress_thread: bool = False) -> None:
        super().__init__()
        api = _import_nixl()
        self.agent_name = agent_name
        try:
            # Read-write locking: transfers are set up on one thread while another posts and
            # polls (UCX workers then run in its multi-threaded mode).
            config = api.nixl_agent_config(
                enable_prog_thread=progress_thread,
                backends=["UCX"],
                sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
            )
            self._agent = api.nixl_agent(agent_name, config)
        except Exception as exc:
            raise EngineError(NAME, "create agent", str(exc)) from None
        self._registrations: dict[MemoryRegion, Any] = {}
        self._closed = False
        # Descriptor tables (N × 3: address, length, device) built for each write: NIXL copies
        # them into its own lists, so the same two arrays serve every write (fresh ones of
        # millions of rows would cost page faults on every write).
        self._tables = [np.empty((0, 3), dtype=np.uint64), np.empty((0, 3), dtype=np.uint64)]

    @classmethod
    def open(cls, endpoint_name: str, host: str, options: Mapping[str, str]) -> NixlEngine:
        return cls(endpoint_name, progress_thread=options["progress_thread"] == "on")

    @property
    def transport(self) -> str:
        # UCX picks the transport per pair of endpoints and NIXL does not say which it picked;
        # only an explicit UCX_TLS pins it. Anything else would be a guess shown as a fact.
        pinned = os.environ.get("UCX_TLS")
        return f"ucx (UCX_TLS={pinned})" if pinned else "ucx (transport unknown: UCX_TLS unset)"

    def endpoint(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        for region in regions:
            try:
                descriptors = self._agent.register_memory(
                    [(region.ptr, region.length, region.device_id, "")],
                    _mem_type(region.memory_kind),
                )
            except Exception as exc:
                raise EngineError(NAME, "register memory", str(exc)) from None
            if not descriptors:
                raise EngineError(NAME, "register memory", f"NIXL refused {region}")
            self._registrations[region] = descriptors

    def _deregister(self, regions: Sequence[MemoryRegion]) -> None:
        for region in regions:
            descriptors = self._registrations.pop(region, None)
            if descriptors is not None:
                try:
                    self._agent.deregister_memory(descriptors)
                except Exception as exc:
                    raise EngineError(NAME, "deregister memory", str(exc)) from None

    def _connect(self, peer_endpoint: bytes) -> str:
        try:
            added = self._agent.add_remote_agent(peer_endpoint)
            # NIXL returns the peer's name as bytes; notifications are keyed by str.
            peer = added.decode() if isinstance(added, bytes) else str(added)
            # Connect now rather than inside the first write (measured here: the first write
            # to a peer took 12-22 ms without it, 8-14 ms with it, 2 ms afterwards).
            self._agent.make_connection(peer)
        except Exception as exc:
            raise EngineError(NAME, "add remote agent", str(exc)) from None
        return peer

    def _remove_remote(self, peer: str) -> None:
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as exc:
            raise EngineError(NAME, "remove remote agent", str(exc)) from None

    def _descriptors(
        self, addresses: npt.NDArray[Any], lengths: npt.NDArray[Any], memory: RegionMap, side: int
    ) -> Any:
        regions = memory.regions
        kind = regions[0].memory_kind if regions else MemoryKind.DRAM
        if self._tables[side].shape[0] < addresses.size:
            self._tables[side] = np.empty((addresses.size, 3), dtype=np.uint64)
        table = self._tables[side][: addresses.size]
        table[:, 0] = addresses
        table[:, 1] = lengths
        # Each block's GPU, from its region (one search less where every region is on one).
        uniform = memory.uniform_device
        table[:, 2] = uniform if uniform is not None else memory.device_ids(addresses)
        return self._agent.get_xfer_descs(table, _mem_type(kind))

    def _write(self, peer: str, plan: TransferPlan, notify: bytes) -> TransferHandle:
        return self._prepare_write(peer, plan, notify).start()

    def _prepare_write(self, peer: str, plan: TransferPlan, notify: bytes) -> PendingWrite:
        """The transfer request built (descriptors, `initialize_xfer`); posting it is what
        copies over CMA, inside the call."""
        agent = self._agent
        try:
            local = self._descriptors(plan.src, plan.length, self.local_memory, 0)
            remote = self._descriptors(plan.dst, plan.length, self.peer_memory[peer], 1)
            handle = agent.initialize_xfer("WRITE", local, remote, peer, notify)
        except Exception as exc:
            raise EngineError(NAME, "write", str(exc)) from None

        def start(notify: bytes = b"") -> TransferHandle:
            try:
                state = agent.transfer(handle, notify)  # b"": the one it was set up with
            except Exception as exc:
                with contextlib.suppress(Exception):  # the post's own error is the one to tell
                    agent.release_xfer_handle(handle)
                raise EngineError(NAME, "write", str(exc)) from None
            if state == "ERR":
                agent.release_xfer_handle(handle)
                raise EngineError(NAME, "write", "NIXL refused to post the transfer (state ERR)")
            return _NixlHandle(agent, handle)

        return PendingWrite(start, lambda: agent.release_xfer_handle(handle), start)

    delivers_notifications = True

    def notify(self, peer: str, message: bytes) -> None:
        try:
            self._agent.send_notif(peer, message)
        except Exception as exc:
            raise EngineError(NAME, "notify", str(exc)) from None

    def notifications(self) -> list[tuple[str, bytes]]:
        try:
            delivered = self._agent.get_new_notifs()
        except Exception as exc:
            raise EngineError(NAME, "poll notifications", str(exc)) from None
        return [
            (peer.decode() if isinstance(peer, bytes) else str(peer), bytes(message))
            for peer, messages in delivered.items()
            for message in messages
        ]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for region in list(self._registrations):
            with contextlib.suppress(EngineError):
                self._deregister([region])
        for peer in list(self.peer_memory):
            with contextlib.suppress(EngineError):
                self._remove_remote(peer)
        self.peer_memory.clear()
        # The agent holds UCX workers and their sockets until it is destroyed; handles still
        # referenced elsewhere keep it alive only as long as they live.
        self._agent = ClosedEngine(NAME)
