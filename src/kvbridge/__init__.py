"""kvbridge: the KV-cache transfer plane between prefill and decode workers.

The public API is what this module exports (`__all__`): describe a rank's memory (`KVArgs`),
configure it (`ManagerConfig`), make one manager per rank (`PrefillManager`, `DecodeManager`)
and one sender or receiver per request (a room), and read its state (`KVPoll`, `FailureKind`).
The wire layer's encoders and decoders are in `kvbridge.wire`, the vLLM connector in
`kvbridge.integrations.vllm`.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# A library logs, its host decides where that goes: one logger per component under
# "kvbridge" (kvbridge.prefill, .decode, .control, .bootstrap), silent unless configured.
logging.getLogger("kvbridge").addHandler(logging.NullHandler())

# Each public name and the module it lives in. Loaded on first use, so that importing one
# light submodule (kvbridge.wire, say, inside sglang's environment) does not start the
# managers' imports (ZMQ, the engines' registry).
_EXPORTS: dict[str, str] = {
    "BootstrapError": "kvbridge.control.bootstrap",
    "BufferSpec": "kvbridge.cache",
    "DecodeManager": "kvbridge.decode",
    "FailureKind": "kvbridge.wire",
    "GeometryError": "kvbridge.cache",
    "KVArgs": "kvbridge.cache",
    "KVLayout": "kvbridge.wire",
    "KVPoll": "kvbridge.wire",
    "KVReceiver": "kvbridge.decode",
    "KVSender": "kvbridge.prefill",
    "DataParallel": "kvbridge.config",
    "ManagerConfig": "kvbridge.config",
    "PrefillManager": "kvbridge.prefill",
    "TopologyError": "kvbridge.cache.topology",
    "WireError": "kvbridge.wire",
    "WriteGate": "kvbridge.write_gate",
}

# Written out (not derived from _EXPORTS) so that linters and type checkers see it.
__all__ = [
    "BootstrapError",
    "BufferSpec",
    "DataParallel",
    "DecodeManager",
    "FailureKind",
    "GeometryError",
    "KVArgs",
    "KVLayout",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "ManagerConfig",
    "PrefillManager",
    "TopologyError",
    "WireError",
    "WriteGate",
    "__version__",
]

if TYPE_CHECKING:
    from kvbridge.cache import BufferSpec, GeometryError, KVArgs
    from kvbridge.cache.topology import TopologyError
    from kvbridge.config import DataParallel, ManagerConfig
    from kvbridge.control.bootstrap import BootstrapError
    from kvbridge.decode import DecodeManager, KVReceiver
    from kvbridge.prefill import KVSender, PrefillManager
    from kvbridge.wire import FailureKind, KVLayout, KVPoll, WireError
    from kvbridge.write_gate import WriteGate


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvbridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
