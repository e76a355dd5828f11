"""The vLLM connector's request parameters, pure: what travels in vLLM's ``kv_transfer_params``
from a prefill output to a decode request (RemotePrefill, checked as it is read) and what a PD
proxy adds on the way. What the scheduler side tells the workers is in `vllm_steps`. No vLLM
import, no sockets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kvbridge.integrations.vllm_options import OptionsError
from kvbridge.wire.native import VERSION

T = TypeVar("T")

# Keys kvbridge adds to vLLM's kv_transfer_params (the rest are vLLM's PD keys).
BOOTSTRAP_KEY = "kvbridge_bootstrap_url"
STAGES_KEY = "kvbridge_stage_urls"
ROOM_KEY = "kvbridge_room"
# The protocol version the prefill instance speaks: decode refuses another, naming both.
VERSION_KEY = "kvbridge_version"
BLOCKS_KEY = "kvbridge_blocks"
BLOCK_SIZES_KEY = "kvbridge_block_sizes"
# Prefill's lease on the blocks, in seconds: decode renews it while the request waits (0 or
# absent: no renewals).
LEASE_KEY = "kvbridge_lease_s"
# Decode first (a proxy sends the request to both instances at once): on prefill's request,
# stream its KV into this room layer by layer as the forward computes it; on decode's, load
# from the room before prefill answered (no blocks or token count known yet).
STREAM_KEY = "kvbridge_stream"
DECODE_FIRST_KEY = "kvbridge_decode_first"
# Decode first: the lease decode renews on the room, every third of it, while its request
# waits in its queue and while its load waits for prefill (prefill's scheduler may not have
# reached the request). Prefill's own request_timeout_s is not known to decode here: renewing
# every second keeps the room for any of it above that.
DECODE_FIRST_LEASE_S = 3.0


@dataclass(frozen=True)
class RemotePrefill:
    """What a decode instance needs to load a request's KV from the prefill instance: it
    travels in vLLM's ``kv_transfer_params``, from the prefill output to the decode request.
    The request's room (every KV cache group's blocks move in it, group after group); per
    group the blocks prefill holds for it (first block position, count) and its block size.
    Per pipeline stage of the prefill instance: its bootstrap service (`bootstrap_url` is the
    first stage's); a stage's room is `stage_room(room, stage)`."""

    bootstrap_url: str
    room: int
    num_tokens: int
    engine_id: str
    request_id: str
    blocks: tuple[tuple[int, int], ...] = ((0, 0),)
    block_sizes: tuple[int, ...] = (0,)
    stage_urls: tuple[str, ...] = ()
    lease_s: float = 0.0  # 0: prefill takes no lease renewals
    # Asked for before prefill answered (`DECODE_FIRST_KEY`): `num_tokens` and `blocks` are
    # decode's own guess, the whole prompt in one group (`decode_first_load`).
    decode_first: bool = False

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
            ROOM_KEY: self.room,
            BLOCKS_KEY: [list(pair) for pair in self.blocks],
            BLOCK_SIZES_KEY: list(self.block_sizes),
            STAGES_KEY: list(self.stages),
            LEASE_KEY: self.lease_s,
            VERSION_KEY: VERSION,
        }

    @staticmethod
    def from_params(params: Mapping[str, Any] | None) -> RemotePrefill | None:
        """The remote prefill a request's parameters name; None if they name none (a request
        for another connector, or a plain one). Malformed kvbridge keys raise OptionsError."""
        if not isinstance(params, Mapping) or BOOTSTRAP_KEY not in params:
            return None
        version = params.get(VERSION_KEY)
        if version != VERSION:
            speaks = f"speaks {version!r}" if version is not None else "names no version"
            raise OptionsError(
                f"kv_transfer_params: the prefill instance {speaks}, this decode instance "
                f"{VERSION}: run one kvbridge release on both"
            )
        url = _url(BOOTSTRAP_KEY, params.get(BOOTSTRAP_KEY))
        stages = _listed(params, STAGES_KEY, _url) if STAGES_KEY in params else [url]
        if not stages or stages[0] != url:
            raise OptionsError(
                f"kv_transfer_params.{STAGES_KEY}: {stages!r} does not begin with {BOOTSTRAP_KEY}"
            )
        room = _count(params, ROOM_KEY, params.get(ROOM_KEY))
        if params.get(DECODE_FIRST_KEY) is True:
            return RemotePrefill(
                url,
                room,
                0,
                str(params.get("remote_engine_id", "")),
                str(params.get("remote_request_id", "")),
                (),
                (),
                tuple(stages) if len(stages) > 1 else (),
                _lease(params),
                decode_first=True,
            )
        tokens = _count(params, "remote_num_tokens", params.get("remote_num_tokens"))
        blocks = _listed(params, BLOCKS_KEY, _block_range)
        sizes = _listed(params, BLOCK_SIZES_KEY, lambda key, v: _count(params, key, v))
        if len(blocks) != len(sizes) or not blocks:
            raise OptionsError(
                f"kv_transfer_params: {BLOCKS_KEY} and {BLOCK_SIZES_KEY} need one entry per KV "
                f"cache group, got {len(blocks)} and {len(sizes)}"
            )
        return RemotePrefill(
            url,
            room,
            tokens,
            str(params.get("remote_engine_id", "")),
            str(params.get("remote_request_id", "")),
            tuple(blocks),
            tuple(sizes),
            tuple(stages) if len(stages) > 1 else (),
            _lease(params),
        )


def _lease(params: Mapping[str, Any]) -> float:
    lease = params.get(LEASE_KEY, 0.0)  # absent: no renewals
    if not isinstance(lease, int | float) or isinstance(lease, bool) or not lease >= 0:
        raise OptionsError(f"kv_transfer_params.{LEASE_KEY}: {lease!r} is not seconds ≥ 0")
    return float(lease)


def stage_room(room: int, stage: int) -> int:
    """A pipeline stage's room for a request's room (stage 0: the room itself)."""
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
    not streamed, asking prefill to keep the KV for a remote decode (a minimum of more
    tokens than that is decode's alone: vLLM refuses min_tokens above max_tokens)."""
    dropped = {"stream_options", "min_tokens"}
    request = {key: value for key, value in body.items() if key not in dropped}
    request.update(kv_transfer_params=dict(PREFILL_PARAMS), max_tokens=1, stream=False)
    if "max_completion_tokens" in request:
        request["max_completion_tokens"] = 1
    return request


def stream_prefill_request(body: Mapping[str, Any], room: int) -> dict[str, Any]:
    """Decode first: the request for prefill, its KV streamed into `room` as it is computed."""
    request = prefill_request(body)
    request["kv_transfer_params"].update({ROOM_KEY: room, STREAM_KEY: True, VERSION_KEY: VERSION})
    return request


def decode_first_request(
    body: Mapping[str, Any], bootstrap_url: str, room: int, engine_id: str = ""
) -> dict[str, Any]:
    """Decode first: the request for decode, sent beside prefill's, loading from `room` of
    the prefill instance whose bootstrap service is `bootstrap_url`."""
    host, _, port = bootstrap_url.removeprefix("http://").rpartition(":")
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": int(port),
        BOOTSTRAP_KEY: bootstrap_url,
        ROOM_KEY: room,
        DECODE_FIRST_KEY: True,
        LEASE_KEY: DECODE_FIRST_LEASE_S,
        VERSION_KEY: VERSION,
    }
    return {**body, "kv_transfer_params": params}


def decode_request(body: Mapping[str, Any], prefill_answer: Mapping[str, Any]) -> dict[str, Any]:
    """The same request for decode, with the kv_transfer_params of prefill's answer."""
    params = prefill_answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise OptionsError(
            "the prefill instance answered without kv_transfer_params: is it running with a "
            "KV connector and kv_role kv_producer or kv_both?"
        )
    return {**body, "kv_transfer_params": params}


def tokens_to_load(remote: RemotePrefill, num_prompt_tokens: int, num_computed: int) -> int:
    """How many tokens decode loads: the prompt tokens prefill computed beyond the ones this
    instance already has in its own prefix cache."""
    return max(0, min(remote.num_tokens, num_prompt_tokens) - num_computed)
