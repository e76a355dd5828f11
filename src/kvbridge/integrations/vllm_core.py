"""The vLLM connector's pure part: its options, the request parameters it exchanges through
vLLM's PD flow and the per-step metadata (`vllm_cache`: vLLM's KV tensors as `KVArgs`, which
blocks move). No vLLM import, no sockets: `kvbridge.integrations.vllm` is the shell that vLLM
loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from kvbridge.config import DEFAULT_STAGING_BYTES, ManagerConfig
from kvbridge.engines import DEFAULT_ENGINE, PROCESS_ENGINES, EngineError, engine_spec
from kvbridge.wire.auth import secret_from_env

T = TypeVar("T")

# The vLLM releases whose connector API this integration follows.
SUPPORTED_VLLM = "0.32"
# Keys kvbridge adds to vLLM's kv_transfer_params (the rest are vLLM's PD keys).
BOOTSTRAP_KEY = "kvbridge_bootstrap_url"
STAGES_KEY = "kvbridge_stage_urls"
ROOMS_KEY = "kvbridge_rooms"
BLOCKS_KEY = "kvbridge_blocks"
BLOCK_SIZES_KEY = "kvbridge_block_sizes"


class OptionsError(ValueError):
    """A kv_connector_extra_config that kvbridge cannot use; the message names the key."""


def check_vllm_version(version: str) -> None:
    """Refuse, at start-up, a vLLM whose connector API this release does not follow."""
    release = ".".join(version.split("+")[0].split(".")[:2])
    if release != SUPPORTED_VLLM:
        raise RuntimeError(
            f"kvbridge's vLLM connector follows vLLM {SUPPORTED_VLLM}.x; this is vLLM {version}"
        )


@dataclass(frozen=True)
class ConnectorOptions:
    """kvbridge's options inside vLLM, from ``kv_connector_extra_config``.

    engine: transfer engine (nixl, mooncake). engine_options: the engine's own options, e.g.
        {"protocol": "rdma", "device": "mlx5_0"} for Mooncake (kvbridge.engines.REGISTRY lists
        them). host: address kvbridge binds and advertises.
    bootstrap_port: the prefill instance's bootstrap service (0: a free port; with TP > 1
        every rank must know it, so set it). bootstrap_timeout_s: how long decode tries to
        reach a prefill instance's bootstrap service before the load fails. metrics_port:
        kvbridge's Prometheus metrics (0: a free port; unset: none). request_timeout_s: how
        long prefill keeps a finished request's blocks for a decode instance that has not
        asked for them. transfer_timeout_s: how long decode waits for a transfer.
        peer_timeout_s / heartbeat_interval_s: liveness (a silent peer is declared dead after
        peer_timeout_s). staging / staging_bytes: the staging ring for different TP sizes.
        idle_poll_s: how long an engine step with nothing to compute waits for a transfer to
        end while transfers are pending (it returns as soon as one ends), so that a waiting
        instance does not spin a core. idle_batch_s: in such a step, once some loads ended,
        how long at most they may wait for the other loads in flight so that all start
        computing in one step (each time loads end, the wait is decided anew from a recent
        compute step, the share of loads still in flight and the pace of the ends so far — see
        StepTimes.batch_window; all of it never runs past idle_batch_s after the first end; 0:
        report each load at once).
    """

    engine: str = DEFAULT_ENGINE
    engine_options: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    bootstrap_port: int = 0
    bootstrap_timeout_s: float = 5.0
    metrics_port: int | None = None
    request_timeout_s: float = 480.0
    transfer_timeout_s: float = 120.0
    peer_timeout_s: float = 3.0
    heartbeat_interval_s: float = 0.5
    staging: bool = True
    staging_bytes: int = DEFAULT_STAGING_BYTES
    idle_poll_s: float = 0.005
    idle_batch_s: float = 1.0
    secret: str | None = field(default=None, repr=False)

    @staticmethod
    def from_extra_config(extra: Mapping[str, Any] | None) -> ConnectorOptions:
        known = {option.name: option for option in fields(ConnectorOptions)}
        given = dict(extra or {})
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise OptionsError(
                f"kv_connector_extra_config: unknown option(s) {', '.join(unknown)}; kvbridge "
                f"knows {', '.join(known)}"
            )
        values: dict[str, Any] = {}
        for name, value in given.items():
            values[name] = _option_value(name, known[name].type, value)
        options = ConnectorOptions(**values)
        if options.engine not in PROCESS_ENGINES:
            raise OptionsError(
                f"kv_connector_extra_config.engine: {options.engine!r} is not a transfer engine "
                f"between processes; choose {' or '.join(PROCESS_ENGINES)}"
            )
        try:
            engine_spec(options.engine).resolve(options.engine_options)
        except EngineError as exc:
            raise OptionsError(f"kv_connector_extra_config.engine_options: {exc}") from None
        return options

    def manager_config(self, *, run_bootstrap: bool, bootstrap_url: str | None) -> ManagerConfig:
        return ManagerConfig(
            engine=self.engine,
            engine_options=self.engine_options,
            host=self.host,
            bootstrap_url=bootstrap_url,
            run_bootstrap=run_bootstrap,
            bootstrap_port=self.bootstrap_port,
            bootstrap_timeout_s=self.bootstrap_timeout_s,
            transfer_timeout_s=self.transfer_timeout_s,
            request_timeout_s=self.request_timeout_s,
            staging=self.staging,
            staging_bytes=self.staging_bytes,
            heartbeat_interval_s=self.heartbeat_interval_s,
            peer_timeout_s=self.peer_timeout_s,
            metrics_port=self.metrics_port,
            secret=self.secret.encode() if self.secret else secret_from_env(),
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
    if expected.startswith("dict"):
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


@dataclass(frozen=True)
class RemotePrefill:
    """What a decode instance needs to load a request's KV from the prefill instance: it
    travels in vLLM's ``kv_transfer_params``, from the prefill output to the decode request.
    Per KV cache group: its room (None: the group sends nothing), the blocks prefill holds
    for it (first block position, count) and its block size. Per pipeline stage of the
    prefill instance: its bootstrap service (`bootstrap_url` is the first stage's); a stage's
    room for a group is `stage_room(room, stage)`."""

    bootstrap_url: str
    rooms: tuple[int | None, ...]
    num_tokens: int
    engine_id: str
    request_id: str
    blocks: tuple[tuple[int, int], ...] = ((0, 0),)
    block_sizes: tuple[int, ...] = (0,)
    stage_urls: tuple[str, ...] = ()

    @property
    def stages(self) -> tuple[str, ...]:
        """Each pipeline stage's bootstrap URL."""
        return self.stage_urls or (self.bootstrap_url,)

    def to_params(self) -> dict[str, Any]:
        host, _, port = self.bootstrap_url.removeprefix("http://").rpartition(":")
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_host": host,
            "remote_port": int(port),
            "remote_num_tokens": self.num_tokens,
            BOOTSTRAP_KEY: self.bootstrap_url,
            ROOMS_KEY: list(self.rooms),
            BLOCKS_KEY: [list(pair) for pair in self.blocks],
            BLOCK_SIZES_KEY: list(self.block_sizes),
            STAGES_KEY: list(self.stages),
        }

    @staticmethod
    def from_params(params: Mapping[str, Any] | None) -> RemotePrefill | None:
        """The remote prefill a request's parameters name; None if they name none (a request
        for another connector, or a plain one). Malformed kvbridge keys raise OptionsError."""
        if not isinstance(params, Mapping) or BOOTSTRAP_KEY not in params:
            return None
        url = _url(BOOTSTRAP_KEY, params.get(BOOTSTRAP_KEY))
        stages = _listed(params, STAGES_KEY, _url) if STAGES_KEY in params else [url]
        if not stages or stages[0] != url:
            raise OptionsError(f"kv_transfer_params.{STAGES_KEY}: {stages!r} does not begin "
                               f"with {BOOTSTRAP_KEY}")  # fmt: skip
        tokens = _count(params, "remote_num_tokens", params.get("remote_num_tokens"))
        rooms = _listed(params, ROOMS_KEY, lambda key, v: None if v is None else _count(
            params, key, v))  # fmt: skip
        blocks = _listed(params, BLOCKS_KEY, _block_range)
        sizes = _listed(params, BLOCK_SIZES_KEY, lambda key, v: _count(params, key, v))
        if not len(rooms) == len(blocks) == len(sizes) or not rooms:
            raise OptionsError(
                f"kv_transfer_params: {ROOMS_KEY}, {BLOCKS_KEY} and {BLOCK_SIZES_KEY} need one "
                f"entry per KV cache group, got {len(rooms)}, {len(blocks)}, {len(sizes)}"
            )
        return RemotePrefill(
            url, tuple(rooms), tokens, str(params.get("remote_engine_id", "")),
            str(params.get("remote_request_id", "")), tuple(blocks), tuple(sizes),
            tuple(stages) if len(stages) > 1 else (),
        )  # fmt: skip


def stage_room(room: int, stage: int) -> int:
    """A pipeline stage's room for a group's room (stage 0: the room itself)."""
    return room ^ stage


def _url(key: str, value: object) -> str:
    if not isinstance(value, str) or not value.startswith("http://"):
        raise OptionsError(f"kv_transfer_params.{key}: {value!r} is not an http URL")
    return value


def _count(params: Mapping[str, Any], key: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise OptionsError(f"kv_transfer_params.{key}: {value!r} is not an integer ≥ 0")
    return value


def _block_range(key: str, value: object) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2):
        raise OptionsError(f"kv_transfer_params.{key}: {value!r} is not [first, count]")
    return _count({}, key, value[0]), _count({}, key, value[1])


def _listed(params: Mapping[str, Any], key: str, item: Callable[[str, Any], T]) -> list[T]:
    values = params.get(key)
    if not isinstance(values, list):
        raise OptionsError(f"kv_transfer_params.{key}: {values!r} is not a list")
    return [item(f"{key}[{index}]", value) for index, value in enumerate(values)]


# What a PD proxy adds to a request for the prefill instance (vLLM's PD flow).
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI completion or chat request, as a PD proxy sends it to prefill: one token,
    not streamed, asking prefill to keep the KV for a remote decode."""
    request = {key: value for key, value in body.items() if key != "stream_options"}
    request.update(kv_transfer_params=dict(PREFILL_PARAMS), max_tokens=1, stream=False)
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    return request


def decode_request(body: Mapping[str, Any], prefill_answer: Mapping[str, Any]) -> dict[str, Any]:
    """The same request for decode, with the kv_transfer_params of prefill's answer."""
    params = prefill_answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise OptionsError(
            "the prefill instance answered without kv_transfer_params: is it running with a "
            "KV connector and kv_role kv_producer or kv_both?"
        )
    return {**body, "kv_transfer_params": params}


@dataclass(frozen=True)
class SendSpec:
    """Prefill: a finished request whose blocks decode will ask for, one room per KV cache
    group (None: nothing to send for that group)."""

    request_id: str
    rooms: tuple[int | None, ...]
    blocks: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class LoadSpec:
    """Decode: load a request's KV into these blocks, per KV cache group (its blocks after
    the local prefix; `skips`: how many of the blocks prefill sends for the group come
    before them)."""

    request_id: str
    remote: RemotePrefill
    blocks: tuple[tuple[int, ...], ...]
    skips: tuple[int, ...]
    # Why the scheduler could not plan the load (it then fails at once).
    error: str | None = None

    @property
    def num_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.blocks)


@dataclass
class StepMetadata:
    """What the scheduler side tells the workers in one step (vLLM pickles it across)."""

    sends: list[SendSpec] = dataclasses.field(default_factory=list)
    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    # Decode requests that ended while their load was in flight (a client went away).
    aborts: list[str] = dataclasses.field(default_factory=list)
    # Rooms a decode instance will never ask for (a full local prefix hit, or a request that
    # ended before it was scheduled): prefill can free their blocks now.
    releases: list[RemotePrefill] = dataclasses.field(default_factory=list)
    # Nothing is computed in this step: the worker may wait a little for transfers.
    idle: bool = False


@dataclass
class ConnectorCounters:
    """What one worker's connector moved, since it started (kvbridge's own managers keep the
    transfer-level metrics)."""

    requests_sent: int = 0
    sends_failed: int = 0
    pages_sent: int = 0
    requests_loaded: int = 0
    loads_failed: int = 0
    loads_aborted: int = 0
    pages_loaded: int = 0
    rooms_released: int = 0

    def since(self, earlier: ConnectorCounters) -> dict[str, int]:
        """What changed since `earlier`, the counters that moved only."""
        now, then = dataclasses.asdict(self), dataclasses.asdict(earlier)
        return {name: now[name] - then[name] for name in now if now[name] != then[name]}


def tokens_to_load(remote: RemotePrefill, num_prompt_tokens: int, num_computed: int) -> int:
    """How many tokens decode loads: the prompt tokens prefill computed beyond the ones this
    instance already has in its own prefix cache."""
    return max(0, min(remote.num_tokens, num_prompt_tokens) - num_computed)


def cpu_list(text: str) -> set[int]:
    """The CPUs of a Linux CPU list ("0-3,8,10-11")."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus
