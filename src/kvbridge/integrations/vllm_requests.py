"""The vLLM connector's request parameters and per-step metadata, pure: what travels in vLLM's
``kv_transfer_params`` from a prefill output to a decode request (RemotePrefill, checked as it
is read), what a PD proxy adds on the way, and what the scheduler side tells the workers in a
step. No vLLM import, no sockets.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

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


@dataclass(frozen=True)
class SendSpec:
    """Prefill: a finished request whose blocks decode will ask for, in one room: per KV
    cache group, its blocks that move. `streamed`: its room was opened by the worker while
    the forward ran (`StreamSpec`); the send takes it over, failing it with `streamed` as the
    reason if the request did not finish its prompt."""

    request_id: str
    room: int
    blocks: tuple[tuple[int, ...], ...]
    streamed: bool = False
    aborted: str = ""

    def encode(self) -> bytes:
        """As the scheduler side hands it to a worker (`vllm_handoff`)."""
        fields = {
            "request_id": self.request_id,
            "room": self.room,
            "blocks": [list(group) for group in self.blocks],
            "streamed": self.streamed,
            "aborted": self.aborted,
        }
        return json.dumps(fields, separators=(",", ":")).encode()

    @staticmethod
    def decode(data: bytes) -> SendSpec:
        """The send `encode` made; OptionsError says what is malformed."""
        try:
            fields = json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise OptionsError(f"a send is not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise OptionsError("a send is not a JSON object")
        request_id = fields.get("request_id")
        if not isinstance(request_id, str):
            raise OptionsError("a send needs a request_id, a string")
        blocks = fields.get("blocks")
        if not isinstance(blocks, list) or not all(isinstance(group, list) for group in blocks):
            raise OptionsError(f"send {request_id}: blocks is not a list of lists")
        room = fields.get("room")
        numbers = [room, *(block for group in blocks for block in group)]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
            raise OptionsError(f"send {request_id}: room and blocks must be integers ≥ 0")
        assert isinstance(room, int)
        streamed, aborted = fields.get("streamed", False), fields.get("aborted", "")
        if not isinstance(streamed, bool) or not isinstance(aborted, str):
            raise OptionsError(f"send {request_id}: streamed must be a bool, aborted a string")
        blocks_of = tuple(tuple(group) for group in blocks)
        return SendSpec(request_id, room, blocks_of, streamed, aborted)


@dataclass(frozen=True)
class RestRun:
    """Blocks that go after a streamed request's final forward, per KV cache group (the
    streamed group's none), laid out from block position `position` of the room's pages
    (None: one group of pages, in order)."""

    position: int | None
    blocks: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class StreamSpec:
    """Prefill, decode first: the blocks of a request this step completes (of its streamed
    KV cache group, the first full-attention one, which each of its layers fills), written
    into `room` layer by layer as the forward computes them; `final`: this step computes the
    prompt's end. `rest`, with the final step: what goes after the forward as the room's
    last chunks (sliding windows, a recurrent state's block, other groups). `position`:
    where `blocks` begin among the room's block positions when it holds several groups of
    pages, laid end to end (None: one group, in order)."""

    request_id: str
    room: int
    blocks: tuple[int, ...]
    final: bool
    rest: tuple[RestRun, ...] = ()
    position: int | None = None


class StreamAbort(NamedTuple):
    """Prefill, decode first: a streamed request's room fails, and why. It names the room:
    a worker that has streamed nothing of the request yet (its first step was the one that
    failed) fails the room all the same, rather than when the request ends."""

    room: int
    reason: str


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
    """What the scheduler side tells the workers in one step (vLLM pickles it across);
    prefill's sends go at once instead (`vllm_handoff`)."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    # Decode requests that ended while their load was in flight (a client went away).
    aborts: list[str] = dataclasses.field(default_factory=list)
    # Rooms a decode instance will never ask for (a full local prefix hit, or a request that
    # ended before it was scheduled): prefill can free their blocks now.
    releases: list[RemotePrefill] = dataclasses.field(default_factory=list)
    # Rooms of requests still waiting in decode's queue: their lease on prefill is renewed.
    renewals: list[RemotePrefill] = dataclasses.field(default_factory=list)
    # Nothing is computed in this step: the worker may wait a little for transfers.
    idle: bool = False
    # Prefill, decode first: the blocks this step's forward completes, streamed by layer, and
    # the streamed requests whose rooms fail (vLLM preempted them, or they cannot be sent).
    streams: list[StreamSpec] = dataclasses.field(default_factory=list)
    stream_aborts: dict[str, StreamAbort] = dataclasses.field(default_factory=dict)


def tokens_to_load(remote: RemotePrefill, num_prompt_tokens: int, num_computed: int) -> int:
    """How many tokens decode loads: the prompt tokens prefill computed beyond the ones this
    instance already has in its own prefix cache."""
    return max(0, min(remote.num_tokens, num_prompt_tokens) - num_computed)
