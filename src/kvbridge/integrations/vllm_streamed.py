"""Prefill's scheduler side, decode first: the requests whose KV streams into the room the
proxy chose while the forward computes it, and which of their blocks each step completes
(`StreamSpec`, for the workers to write layer by layer). Pure: reads vLLM's request objects,
imports nothing from vLLM."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvbridge.integrations.vllm_blocks import (
    Group,
    GroupKind,
    blocks_to_send,
    blocks_to_stream,
    decode_first_layout,
    from_position_zero,
)
from kvbridge.integrations.vllm_requests import ROOM_KEY, STREAM_KEY
from kvbridge.integrations.vllm_steps import RestRun, StreamAbort, StreamSpec

log = logging.getLogger("kvbridge.vllm")


def streamed_room(params: Any) -> int | None:
    """The room a decode-first request's parameters name for prefill (None: not one)."""
    if not isinstance(params, dict) or params.get(STREAM_KEY) is not True:
        return None
    room = params.get(ROOM_KEY)
    if not isinstance(room, int) or isinstance(room, bool) or room < 0:
        return None
    return room


class Placed(NamedTuple):
    """Where a room's groups of pages go, in blocks: the streamed group's first block, and
    the first of the groups after it."""

    streamed: int
    after: int


@dataclass
class Streamed:
    """A request streamed into its room, and its blocks sent so far."""

    request: Any
    room: int
    sent: int = 0
    final: bool = False  # the step that ends its prompt was streamed


class StreamBook:
    """The streamed requests of a prefill instance whose KV cache group `group` (full
    attention) streams, beside `groups`' others (sliding windows, recurrent states, further
    full-attention groups), which go after the final forward."""

    def __init__(self, groups: Sequence[Group], group: int) -> None:
        self.groups = tuple(groups)
        self.group = group
        # Several groups of pages: the room's pages are laid end to end, group by group.
        self._positional = sum(g.kind != GroupKind.STATE for g in self.groups) > 1
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
    ) -> tuple[list[StreamSpec], dict[str, StreamAbort]]:
        """The blocks each streamed request's forward completes in this step (`scheduled`:
        tokens per request), and the requests whose rooms fail instead (their blocks are not
        what decode planned); a request is done with the step that ends its prompt."""
        specs: list[StreamSpec] = []
        stopped: dict[str, StreamAbort] = {}
        for request_id, streamed in self._streamed.items():
            count = scheduled.get(request_id, 0)
            if streamed.final or not count:
                continue
            request = streamed.request
            computed = request.num_computed_tokens + count
            final = computed >= request.num_prompt_tokens
            block_ids = block_ids_of(request_id)
            ids = block_ids[self.group]
            size = self.groups[self.group].block_size
            placed = self._placed(request.num_prompt_tokens)
            position = None if placed is None else placed.streamed + streamed.sent
            blocks, streamed.sent = blocks_to_stream(ids, streamed.sent, computed, final, size)
            streamed.final = final
            rest: tuple[RestRun, ...] = ()
            if final and len(self.groups) > 1:
                try:
                    rest = self._rest(block_ids, computed, placed)
                except ValueError as exc:  # not what decode planned: its room fails
                    log.error("request %s: not streamed: %s", request_id, exc)
                    why = f"its blocks are not what decode planned: {exc}"
                    stopped[request_id] = StreamAbort(streamed.room, why)
                    continue
            specs.append(StreamSpec(request_id, streamed.room, blocks, final, rest, position))
        return specs, stopped

    def _placed(self, tokens: int) -> Placed | None:
        """Where the streamed group's blocks begin among the room's block positions, and
        where the groups after it begin (decode first lays every group of pages out end to
        end: `decode_first_layout`); None: one group of pages, its chunks in order."""
        if not self._positional:
            return None
        layout = decode_first_layout(self.groups, tokens)
        counts = [
            count if group.kind != GroupKind.STATE else 0
            for group, (_, count) in zip(self.groups, layout, strict=True)
        ]
        before = sum(counts[: self.group])
        return Placed(before, before + counts[self.group])

    def _rest(
        self, block_ids: Sequence[Sequence[int]], tokens: int, placed: Placed | None
    ) -> tuple[RestRun, ...]:
        """What goes after the forward: what a finished request sends, laid out as decode
        planned it (`from_position_zero`), less the streamed group's blocks — with several
        groups of pages, the groups before the streamed one from position 0 and those after
        it from theirs."""
        laid_out = from_position_zero(
            self.groups, blocks_to_send(self.groups, block_ids, tokens), tokens
        )
        if placed is None:
            others = tuple(() if g == self.group else blocks for g, blocks in enumerate(laid_out))
            return (RestRun(None, others),)
        before = tuple(blocks if g < self.group else () for g, blocks in enumerate(laid_out))
        after = tuple(blocks if g > self.group else () for g, blocks in enumerate(laid_out))
        return RestRun(0, before), RestRun(placed.after, after)

    def preempted(self, request_ids: AbstractSet[str]) -> dict[str, StreamAbort]:
        """Streamed requests vLLM preempted (their blocks freed, the prompt to be computed
        again elsewhere), with why their rooms fail: decode computes or fails as its policy
        says."""
        stopped = {}
        for request_id in request_ids:
            streamed = self._streamed.get(request_id)
            if streamed is not None and not streamed.final:
                streamed.final = True  # nothing more is streamed into the failed room
                stopped[request_id] = StreamAbort(
                    streamed.room, "vLLM preempted the prefill request"
                )
        return stopped

    def ended(self, request_id: str) -> Streamed | None:
        """The request's stream, forgotten here (None: it was not streamed)."""
        return self._streamed.pop(request_id, None)
