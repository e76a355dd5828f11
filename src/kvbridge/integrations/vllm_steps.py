"""What the vLLM connector's scheduler side tells its workers, pure: per step (`StepMetadata`:
loads, aborts, releases, renewals, the blocks a decode-first forward streams) and per finished
request (`SendSpec`, handed over at once through `vllm_handoff`). No vLLM import, no sockets.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import NamedTuple

from kvbridge.integrations.vllm_options import OptionsError
from kvbridge.integrations.vllm_requests import RemotePrefill


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
