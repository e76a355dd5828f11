"""The vLLM connector's options, pure: `kv_connector_extra_config` checked into
ConnectorOptions, the vLLM release it follows, the engine-step pacing (`vllm_requests`: the
request parameters and per-step metadata; `vllm_cache`: vLLM's KV tensors as `KVArgs`, which
blocks move). No vLLM import, no sockets: `kvbridge.integrations.vllm` is the shell that vLLM
loads.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvbridge.config import ManagerConfig
from kvbridge.engines import PROCESS_ENGINES, EngineError, engine_spec
from kvbridge.wire.auth import secret_from_env

# The vLLM releases whose connector API this integration follows.
SUPPORTED_VLLM = "0.32"


class OptionsError(ValueError):
    """A kv_connector_extra_config that kvbridge cannot use; the message names the key."""


def check_vllm_version(version: str) -> None:
    """Refuse, at start-up, a vLLM whose connector API this release does not follow."""
    release = ".".join(version.split("+")[0].split(".")[:2])
    if release != SUPPORTED_VLLM:
        raise RuntimeError(
            f"kvbridge's vLLM connector follows vLLM {SUPPORTED_VLLM}.x; this is vLLM {version}"
        )


# ManagerConfig's fields a deployment sets in kv_connector_extra_config (the connector decides
# the rest: who runs the bootstrap service, decode's bootstrap URL per request), and the
# connector's own defaults for some: a serving deployment gives up on an unreachable prefill
# within seconds, and keeps an unclaimed request's blocks for NixlConnector's 30 s lease
# (kv_lease_duration), renewed while decode's request waits in its queue.
MANAGER_OPTIONS = (
    "engine",
    "engine_options",
    "host",
    "bootstrap_port",
    "bootstrap_timeout_s",
    "request_timeout_s",
    "transfer_timeout_s",
    "peer_timeout_s",
    "heartbeat_interval_s",
    "staging",
    "staging_bytes",
    "write_path",
    "write_costs",
    "metrics_port",
    "secret",
)
CONNECTOR_DEFAULTS: dict[str, Any] = {
    "bootstrap_timeout_s": 5.0,
    "request_timeout_s": 30.0,
    "transfer_timeout_s": 120.0,
}


# vLLM's KV cache layouts whose views kvbridge describes (`vllm_kv_views`): layer by layer,
# each block one run (LBHNC, LBNHC), or block-outermost (every layer's page of a block in one).
KV_CACHE_LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC", "BHLNC")


def _connector_manager_config() -> ManagerConfig:
    return ManagerConfig(**CONNECTOR_DEFAULTS)


def rank_bootstrap_port(base: int, dp_rank: int, stages: int = 1, stage: int = 0) -> int:
    """The port of the bootstrap service of one data-parallel rank and pipeline stage of a
    prefill instance whose bootstrap_port is `base`: each serves its own, one after another."""
    return base + dp_rank * stages + stage


@dataclass(frozen=True)
class ConnectorOptions:
    """kvbridge's options inside vLLM, from ``kv_connector_extra_config``.

    manager: the manager's configuration (`ManagerConfig`; its fields in MANAGER_OPTIONS are
        options here, with CONNECTOR_DEFAULTS; `secret` is given as a string). Notably
        request_timeout_s is the lease on a finished request's blocks on prefill: they are
        freed if no decode asks for them within it, and a decode whose request waits in its
        queue renews it every third of it; bootstrap_port must be set with TP > 1 (every rank
        registers there); metrics_port serves kvbridge's own Prometheus metrics per worker.
    idle_poll_s: how long an engine step with nothing to compute waits for a transfer to end
        while transfers are pending (it returns as soon as one ends), so that a waiting
        instance does not spin a core.
    idle_batch_s: in such a step, once some loads ended, how long at most they may wait for
        the other loads in flight so that all start computing in one step (each time loads
        end, the wait is decided anew from a recent compute step, the share of loads still in
        flight and the pace of the ends so far — see StepTimes.batch_window; all of it never
        runs past idle_batch_s after the first end; 0: report each load at once).
    kv_cache_layout: the KV cache layout the connector asks vLLM for (one of
        KV_CACHE_LAYOUTS; None: LBHNC, and for MLA vLLM's own choice). A block-outermost one
        (BLHNC, BLNHC, BHLNC: vLLM's cross-layer layouts) moves a run of blocks as one
        descriptor across every layer, where vLLM's attention backends take it (vLLM keeps
        its own choice, with a warning, where they do not: its CPU build's backends do not);
        both instances need the same one.
    """

    manager: ManagerConfig = field(default_factory=_connector_manager_config)
    idle_poll_s: float = 0.005
    idle_batch_s: float = 1.0
    kv_cache_layout: str | None = None

    @staticmethod
    def from_extra_config(extra: Mapping[str, Any] | None) -> ConnectorOptions:
        own = {
            option.name: option for option in fields(ConnectorOptions) if option.name != "manager"
        }
        of_manager = {
            option.name: option
            for option in fields(ManagerConfig)
            if option.name in MANAGER_OPTIONS
        }
        known = [*of_manager, *own]
        given = dict(extra or {})
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise OptionsError(
                f"kv_connector_extra_config: unknown option(s) {', '.join(unknown)}; kvbridge "
                f"knows {', '.join(known)}"
            )
        manager_values = dict(CONNECTOR_DEFAULTS)
        own_values: dict[str, Any] = {}
        for name, value in given.items():
            if name == "secret":  # a string in JSON, bytes to the manager
                secret = _option_value(name, "str | None", value)
                manager_values[name] = (
                    secret.encode() if isinstance(secret, str) and secret else secret_from_env()
                )
            elif name in of_manager:
                manager_values[name] = _option_value(name, of_manager[name].type, value)
            else:
                own_values[name] = _option_value(name, own[name].type, value)
        try:
            manager = ManagerConfig(**manager_values)
        except (
            ValueError
        ) as exc:  # a combination that cannot work (write_path coalesced, no staging)
            raise OptionsError(f"kv_connector_extra_config: {exc}") from None
        options = ConnectorOptions(manager=manager, **own_values)
        if options.kv_cache_layout not in (None, *KV_CACHE_LAYOUTS):
            raise OptionsError(
                f"kv_connector_extra_config.kv_cache_layout: {options.kv_cache_layout!r} is not "
                f"a layout kvbridge moves; choose {', '.join(KV_CACHE_LAYOUTS)}"
            )
        if options.manager.engine not in PROCESS_ENGINES:
            raise OptionsError(
                f"kv_connector_extra_config.engine: {options.manager.engine!r} is not a transfer "
                f"engine between processes; choose {' or '.join(PROCESS_ENGINES)}"
            )
        try:
            engine_spec(options.manager.engine).resolve(options.manager.engine_options)
        except EngineError as exc:
            raise OptionsError(f"kv_connector_extra_config.engine_options: {exc}") from None
        return options

    def manager_config(self, *, run_bootstrap: bool, bootstrap_url: str | None) -> ManagerConfig:
        return dataclasses.replace(
            self.manager, run_bootstrap=run_bootstrap, bootstrap_url=bootstrap_url
        )


@dataclass
class StepTimes:
    """How long the engine's steps that compute something take (a moving average): the scale
    against which an idle step decides how long finished loads may wait for the others."""

    typical_s: float = 0.0
    weight: float = 0.2

    def record(self, seconds: float) -> None:
        if self.typical_s == 0.0:
            self.typical_s = seconds
        else:
            self.typical_s += self.weight * (seconds - self.typical_s)

    def batch_window(self, cap_s: float, ended: int, in_flight: int, gap_s: float = 0.0) -> float:
        """How long, from now, `ended` finished loads may wait for the `in_flight` ones, given
        the mean time between the ends seen so far (`gap_s`; 0: not known yet).

        A late load that ends t after the early ones start computing waits the rest of that
        step, step - t; waiting t for it costs each early load t. With nothing known about
        when the others end, waiting pays while ended × t < in_flight × (step - t): a window
        of step × in_flight / (ended + in_flight) — most of a step while most loads are still
        coming, little once most are here. Once the ends come at a known pace, the rest are
        due in in_flight × gap; if that is within a step, waiting for all of them beats
        starting now at the median and at the tail alike (the late ones would finish a whole
        step later), so the window covers it with one gap to spare (ends are not evenly
        spaced). At most a step (a load later than that loses nothing: the step has ended when
        it arrives), never more than `cap_s`. Nothing measured yet, or nothing in flight:
        no wait."""
        if ended <= 0 or in_flight <= 0:
            return 0.0
        step = self.typical_s
        window = step * in_flight / (ended + in_flight)
        due = in_flight * gap_s
        if 0 < due <= step:
            window = max(window, min(step, due + gap_s))
        return min(cap_s, window)


def _option_value(name: str, annotation: object, value: object) -> object:
    """An extra-config value checked against the option's type (JSON gives int for floats)."""
    expected = str(annotation)
    if expected.startswith(("dict", "Mapping")):
        ok = isinstance(value, dict) and all(
            isinstance(key, str) and isinstance(item, str) for key, item in value.items()
        )
        if not ok:
            raise OptionsError(
                f"kv_connector_extra_config.{name}: {value!r} is not an object of strings"
            )
        return value
    if "bool" in expected:
        ok = isinstance(value, bool)
    elif "float" in expected:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        value = float(value) if ok else value  # type: ignore[arg-type]
    elif "int" in expected:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        ok = ok or (value is None and "None" in expected)
    else:
        ok = isinstance(value, str) or (value is None and "None" in expected)
    if not ok:
        raise OptionsError(
            f"kv_connector_extra_config.{name}: {value!r} is not a valid {expected}"
            + (" (at least 0)" if "int" in expected or "float" in expected else "")
        )
    return value


def cpu_list(text: str) -> set[int]:
    """The CPUs of a Linux CPU list ("0-3,8,10-11")."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def log_through_vllm() -> None:
    """kvbridge's records in vLLM's log, through vLLM's handlers (its format, stream and
    level), unless the application set up kvbridge's logging itself. Without this they go
    nowhere in vLLM's engine and worker processes."""
    ours, theirs = logging.getLogger("kvbridge"), logging.getLogger("vllm")
    configured = [h for h in ours.handlers if not isinstance(h, logging.NullHandler)]
    if configured or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False
