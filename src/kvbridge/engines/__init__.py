"""Transfer engines behind one interface: NIXL (default), Mooncake, loopback (tests only)."""

from __future__ import annotations

import importlib

from kvbridge.engines.base import (
    EngineError,
    EngineTimeout,
    TransferEngine,
    TransferHandle,
    TransferState,
    WriteFenced,
)
from kvbridge.engines.regions import MemoryRegion, RegionMap

DEFAULT_ENGINE = "nixl"
ENGINES = ("nixl", "mooncake", "loopback")


_MODULES = {
    "nixl": "nixl_cu12._api or nixl_cu13._api",
    "mooncake": "mooncake.engine",
    "loopback": "ctypes",
}


def unavailable_reason(name: str) -> str | None:
    """Why an engine cannot be used here (not installed, a system library missing), or None."""
    if name not in _MODULES:
        return f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}"
    try:
        if name == "nixl":  # through the adapters: either CUDA build, the host's logging kept
            from kvbridge.engines.nixl import _import_nixl

            _import_nixl()
        elif name == "mooncake":  # its log level is set before the library loads
            from kvbridge.engines.mooncake import _import_mooncake

            _import_mooncake()
        else:
            importlib.import_module(_MODULES[name])
    except (ImportError, OSError, EngineError) as exc:
        return exc.detail if isinstance(exc, EngineError) else str(exc)
    return None


def create_engine(name: str, endpoint_name: str, host: str = "127.0.0.1") -> TransferEngine:
    """An engine by name; `endpoint_name` names this endpoint where the engine has names, and
    `host` is the address it serves on where the engine needs one (Mooncake)."""
    if name == "nixl":
        from kvbridge.engines.nixl import NixlEngine

        return NixlEngine(endpoint_name)
    if name == "mooncake":
        from kvbridge.engines.mooncake import MooncakeEngine

        return MooncakeEngine(host)
    if name == "loopback":
        from kvbridge.engines.loopback import LoopbackEngine

        return LoopbackEngine()
    raise EngineError(name, "create", f"unknown engine; choose one of {', '.join(ENGINES)}")


__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "EngineError",
    "EngineTimeout",
    "MemoryRegion",
    "RegionMap",
    "TransferEngine",
    "TransferHandle",
    "TransferState",
    "WriteFenced",
    "create_engine",
    "unavailable_reason",
]
