"""Transfer engines behind one interface: NIXL (default), Mooncake, loopback (tests only).

Which engines exist, their options and how they load: `kvbridge.engines.registry`.
"""

from __future__ import annotations

from kvbridge.cache.regions import MemoryRegion, RegionMap
from kvbridge.engines.base import (
    EngineError,
    EngineTimeout,
    PendingWrite,
    TransferEngine,
    TransferHandle,
    TransferState,
    WriteFenced,
)
from kvbridge.engines.registry import (
    DEFAULT_ENGINE,
    ENGINES,
    PROCESS_ENGINES,
    REGISTRY,
    EngineOption,
    EngineSpec,
    create_engine,
    engine_spec,
    unavailable_reason,
)

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "PROCESS_ENGINES",
    "REGISTRY",
    "EngineError",
    "EngineOption",
    "EngineSpec",
    "EngineTimeout",
    "MemoryRegion",
    "PendingWrite",
    "RegionMap",
    "TransferEngine",
    "TransferHandle",
    "TransferState",
    "WriteFenced",
    "create_engine",
    "engine_spec",
    "unavailable_reason",
]
