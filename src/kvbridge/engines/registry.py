"""The transfer engines kvbridge can drive, one entry each: the one place an engine is named.

Each entry says how the engine is imported (lazily: an engine's library loads only when it is
used or probed), which options it takes, and what a benchmark must do to run it. The CLI's
choices, the benchmark's engine list, the vLLM connector's checks and `create_engine` all
read this table; adding an engine is one module with a `TransferEngine` subclass and a
`probe()` function, plus one entry here.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, cast

from kvbridge.engines.base import EngineError, TransferEngine

DEFAULT_ENGINE = "nixl"


@dataclass(frozen=True)
class EngineOption:
    """One option an engine takes (a string; `choices` empty: any value; `minimum` set: an
    integer of at least that)."""

    name: str
    default: str
    help: str
    choices: tuple[str, ...] = ()
    minimum: int | None = None

    def problem(self, value: str) -> str | None:
        """Why `value` is not accepted, or None."""
        if self.choices and value not in self.choices:
            return f"choose one of {', '.join(self.choices)}"
        if self.minimum is not None and not (
            value.isdigit() and value.isascii() and int(value) >= self.minimum
        ):
            return f"an integer of at least {self.minimum}"
        return None


class _EngineModule(Protocol):
    def probe(self) -> None: ...


@dataclass(frozen=True)
class EngineSpec:
    """An engine: where it lives, its options, how it must be run."""

    name: str
    summary: str
    module: str  # holds the engine class and `probe()` (raises if the engine cannot load)
    class_name: str
    options: tuple[EngineOption, ...] = ()
    # Binds wildcard listeners that no setting restricts: a benchmark runs it in a network
    # namespace of its own so that nothing on the host's interfaces is exposed.
    needs_own_netns: bool = False
    # In one process only (both endpoints in this process): unit tests, never deployments.
    in_process_only: bool = False

    def resolve(self, given: Mapping[str, str] | None) -> dict[str, str]:
        """Every option with its value (given or default); an unknown option or a value not
        among the choices is refused with the engine, the option and what it accepts."""
        known = {option.name: option for option in self.options}
        for name, value in (given or {}).items():
            option = known.get(name)
            if option is None:
                accepted = ", ".join(known) or "none"
                raise EngineError(
                    self.name, "configure", f"no option {name!r} (its options: {accepted})"
                )
            problem = option.problem(value)
            if problem is not None:
                raise EngineError(self.name, "configure", f"option {name}={value!r}: {problem}")
        return {name: (given or {}).get(name, option.default) for name, option in known.items()}

    def engine_class(self) -> type[TransferEngine]:
        return cast(
            type[TransferEngine], getattr(importlib.import_module(self.module), self.class_name)
        )

    def probe(self) -> None:
        """Load the engine's library; raises ImportError, OSError or EngineError if it cannot."""
        cast(_EngineModule, importlib.import_module(self.module)).probe()


_NIXL_OPTIONS = (
    EngineOption(
        "progress_thread",
        "off",
        "NIXL's own progress thread (off: kvbridge polls; on a small host the thread fights "
        "the control threads for cores)",
        ("off", "on"),
    ),
)
_MOONCAKE_OPTIONS = (
    EngineOption("protocol", "tcp", "Mooncake's transport", ("tcp", "rdma")),
    EngineOption(
        "device", "", "RDMA device name(s) for protocol rdma, e.g. mlx5_0 (empty: Mooncake picks)"
    ),
    EngineOption(
        "submit_threads",
        "0",
        "threads that hand batches to Mooncake at once (its calls block until a batch ends); "
        "0: one per 8 CPUs, at least 1 (more compete with Mooncake's own threads on a small "
        "host)",
        minimum=0,
    ),
    EngineOption(
        "batch_blocks",
        "0",
        "blocks per Mooncake batch (0: its per-peer queue limit shared by the submit threads)",
        minimum=0,
    ),
)

REGISTRY: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(
            "nixl",
            "NVIDIA NIXL over UCX (nixl-cu12 or nixl-cu13)",
            "kvbridge.engines.nixl",
            "NixlEngine",
            options=_NIXL_OPTIONS,
        ),
        EngineSpec(
            "mooncake",
            "Mooncake Transfer Engine, P2P handshake (mooncake-transfer-engine)",
            "kvbridge.engines.mooncake",
            "MooncakeEngine",
            options=_MOONCAKE_OPTIONS,
            needs_own_netns=True,
        ),
        EngineSpec(
            "loopback",
            "memcpy between two endpoints of one process (unit tests only)",
            "kvbridge.engines.loopback",
            "LoopbackEngine",
            in_process_only=True,
        ),
    )
}
# Every engine, and those that move bytes between processes (what users choose from).
ENGINES = tuple(REGISTRY)
PROCESS_ENGINES = tuple(name for name, spec in REGISTRY.items() if not spec.in_process_only)


def engine_spec(name: str) -> EngineSpec:
    spec = REGISTRY.get(name)
    if spec is None:
        raise EngineError(name, "create", f"unknown engine; choose one of {', '.join(ENGINES)}")
    return spec


def unavailable_reason(name: str) -> str | None:
    """Why an engine cannot be used here (unknown, not installed, a system library missing),
    or None."""
    try:
        engine_spec(name).probe()
    except (ImportError, OSError, EngineError) as exc:
        return exc.detail if isinstance(exc, EngineError) else str(exc)
    return None


def create_engine(
    name: str,
    endpoint_name: str,
    host: str = "127.0.0.1",
    options: Mapping[str, str] | None = None,
) -> TransferEngine:
    """An engine by name; `endpoint_name` names this endpoint where the engine has names,
    `host` is the address it serves on where the engine needs one (Mooncake), `options` the
    engine's own options (see `REGISTRY`)."""
    spec = engine_spec(name)
    return spec.engine_class().open(endpoint_name, host, spec.resolve(options))
