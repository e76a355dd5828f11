"""vLLM's KV cache as kvbridge moves it: which blocks of each KV cache group move for a
request, as kvbridge's pages and state slots (`VLLMCache`; `describe_kv_caches` in
`vllm_kv_views` builds it from vLLM's per-layer tensors). Pure: no vLLM import, no sockets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from kvbridge.cache.spec import KVArgs
from kvbridge.core.room import SKIPPED_PAGE
from kvbridge.integrations.vllm_blocks import NULL_BLOCK


@dataclass(frozen=True)
class RoomContents:
    """What a request's room moves on one side: KV pages (decode's: paired with prefill's
    pages after the first `prefix_tokens` tokens, SKIPPED_PAGE where it needs nothing) and
    state slots. Every KV cache group's blocks, group after group."""

    pages: list[int]
    slots: list[int]
    prefix_tokens: int = 0
    # Prefill: several groups' pages laid end to end (they pair with decode's page for page).
    positional: bool = False

    @property
    def empty(self) -> bool:
        return not self.pages and not self.slots


@dataclass(frozen=True)
class VLLMCache:
    """One worker's KV cache described for kvbridge: its geometry, and how many kvbridge pages
    one vLLM block is (an attention kernel may split a block into smaller kernel blocks)."""

    kv_args: KVArgs
    pages_per_block: int = 1
    # A state group's block moves as a state slot (one page of every state buffer), beside
    # the attention geometry; False: as a whole opaque page.
    state_slots: bool = False
    # Each attention layer's position in `kv_args.layer_ids` (its buffer's), by vLLM layer
    # name: every layer whose KV lives in the buffer (one per KV cache group that shares it,
    # and KV-sharing layers); empty: opaque pages.
    layer_positions: Mapping[str, int] = field(default_factory=dict)

    def pages_of(self, blocks: Sequence[int]) -> tuple[int, ...]:
        """kvbridge's pages for these vLLM blocks, in order."""
        per = self.pages_per_block
        return tuple(block * per + part for block in blocks for part in range(per))

    def _slots(self, group: int, state_groups: AbstractSet[int]) -> bool:
        """Whether the group's blocks move as state slots (else as KV pages)."""
        return self.state_slots and group in state_groups

    def send_contents(
        self, blocks: Sequence[Sequence[int]], state_groups: AbstractSet[int]
    ) -> RoomContents:
        """Prefill: what a request's room moves, per KV cache group its blocks that move
        (`state_groups`: those that keep a recurrent state)."""
        pages: list[int] = []
        slots: list[int] = []
        page_groups = 0
        for group, ids in enumerate(blocks):
            if self._slots(group, state_groups):
                slots += ids
                continue
            page_groups += 1
            for block in ids:  # vLLM's null block: a position no longer held, never data
                held = block != NULL_BLOCK
                pages += self.pages_of((block,)) if held else [SKIPPED_PAGE] * self.pages_per_block
        return RoomContents(pages, slots, positional=page_groups > 1)

    def load_contents(
        self,
        blocks: Sequence[Sequence[int]],
        skips: Sequence[int],
        sent: Sequence[int],
        state_groups: AbstractSet[int],
    ) -> RoomContents:
        """Decode: what it asks of a request's room. Per KV cache group: the blocks it fills,
        how many of the blocks prefill sends for the group come before them (`skips`) and
        how many prefill sends (`sent`, in blocks of the same size where another group
        follows). Positions decode needs nothing at are SKIPPED_PAGE; the leading ones
        become the prefix."""
        per = self.pages_per_block
        pages: list[int] = []
        slots: list[int] = []
        last_kv = max(
            (g for g in range(len(blocks)) if not self._slots(g, state_groups)), default=-1
        )
        for group, (ids, skip, count) in enumerate(zip(blocks, skips, sent, strict=True)):
            if self._slots(group, state_groups):
                slots += ids
                continue
            pages += [SKIPPED_PAGE] * (skip * per) + list(self.pages_of(ids))
            if group != last_kv:  # the positions prefill sends past decode's blocks
                pages += [SKIPPED_PAGE] * (max(0, count - skip - len(ids)) * per)
        prefix = next((i for i, page in enumerate(pages) if page != SKIPPED_PAGE), len(pages))
        return RoomContents(pages[prefix:], slots, prefix * self.kv_args.page_size)
