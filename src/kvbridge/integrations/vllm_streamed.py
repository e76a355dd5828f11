"""Prefill's scheduler side, decode first: the requests whose KV streams into the room the
proxy chose while the forward computes it, and which of their blocks each step completes
(`StreamSpec`, for the workers to write layer by layer). Pure: reads vLLM's request objects,
imports nothing from vLLM."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from kvbridge.integrations.vllm_blocks import blocks_to_stream
from kvbridge.integrations.vllm_requests import ROOM_KEY, STREAM_KEY, StreamSpec


def streamed_room(params: Any) -> int | None:
    """The room a decode-first request's parameters name for prefill (None: not one)."""
    if not isinstance(params, dict) or params.get(STREAM_KEY) is not True:
        return None
    room = params.get(ROOM_KEY)
    if not isinstance(room, int) or isinstance(room, bool) or room < 0:
        return None
    return room


@dataclass
class Streamed:
    """A request streamed into its room, and its blocks sent so far."""

    request: Any
    room: int
    sent: int = 0
    final: bool = False  # the step that ends its prompt was streamed


class StreamBook:
    """The streamed requests of a prefill instance whose one full-attention group has blocks
    of `block_size` tokens."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._streamed: dict[str, Streamed] = {}

    @property
    def active(self) -> bool:
        return bool(self._streamed)

    def opened(self, request: Any) -> None:
        room = streamed_room(request.kv_transfer_params)
        if room is not None:
            self._streamed[request.request_id] = Streamed(request, room)

    def step(
        self, scheduled: Mapping[str, int], block_ids_of: Callable[[str], Sequence[Sequence[int]]]
    ) -> list[StreamSpec]:
        """The blocks each streamed request's forward completes in this step (`scheduled`:
        tokens per request); a request is done with the step that ends its prompt."""
        specs = []
        for request_id, streamed in self._streamed.items():
            count = scheduled.get(request_id, 0)
            if streamed.final or not count:
                continue
            request = streamed.request
            computed = request.num_computed_tokens + count
            final = computed >= request.num_prompt_tokens
            ids = block_ids_of(request_id)[0]
            blocks, streamed.sent = blocks_to_stream(
                ids, streamed.sent, computed, final, self.block_size
            )
            streamed.final = final
            specs.append(StreamSpec(request_id, streamed.room, blocks, final))
        return specs

    def preempted(self, request_ids: AbstractSet[str]) -> list[str]:
        """Streamed requests vLLM preempted (their blocks freed, the prompt to be computed
        again elsewhere): their rooms fail, decode computes or fails as its policy says."""
        stopped = []
        for request_id in request_ids:
            streamed = self._streamed.get(request_id)
            if streamed is not None and not streamed.final:
                streamed.final = True  # nothing more is streamed into the failed room
                stopped.append(request_id)
        return stopped

    def ended(self, request_id: str) -> Streamed | None:
        """The request's stream, forgotten here (None: it was not streamed)."""
        return self._streamed.pop(request_id, None)
