"""Which blocks of each of vLLM's KV cache groups move for a request: prefill's side
(`blocks_to_send`) and decode's (`blocks_to_load`). Pure: block ids in, block ids out.

A full-attention group moves every block of the prompt decode lacks, a sliding-window group
the blocks its window still holds, a recurrent-state (Mamba, linear attention) group its one
state block.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

# vLLM's null block: a placeholder in a group's block list (a sliding window's dropped
# blocks, an aligned Mamba group's unused positions), never data.
NULL_BLOCK = 0


class GroupKind(enum.Enum):
    """What a KV cache group keeps for a request, and so which of its blocks move."""

    FULL = "full"  # attention over every token: a block per block_size tokens
    SLIDING = "sliding"  # attention over a window: the blocks still in it
    STATE = "state"  # a recurrent (Mamba, linear attention) state: one block holds it


@dataclass(frozen=True)
class Group:
    """One KV cache group as the connector sees it. `spec_blocks`: a state group's
    speculative scratch blocks after its state block."""

    kind: GroupKind
    block_size: int
    spec_blocks: int = 0


def state_block(blocks: Sequence[int], spec_blocks: int) -> int | None:
    """The block holding a state group's running state: the last one before the
    speculative scratch blocks (vLLM keeps it at position 0 without prefix caching, at the
    last computed block's position with it)."""
    kept = list(blocks)
    if not kept:
        return None
    scratch = min(spec_blocks, len(kept) - 1)
    if scratch:
        kept = kept[:-scratch]
    return kept[-1] if kept[-1] != NULL_BLOCK else None


@dataclass(frozen=True)
class GroupBlocks:
    """A request's blocks of one group that move: from block position `first` on (a state
    group: position 0 is the state)."""

    first: int
    blocks: tuple[int, ...]


def blocks_to_send(
    groups: Sequence[Group], block_ids: Sequence[Sequence[int]], num_tokens: int
) -> list[GroupBlocks]:
    """Prefill: per group, the blocks of a finished request that decode may need: every block
    of its `num_tokens` (full attention), the ones still in the window (sliding), the state
    block (state)."""
    if len(block_ids) != len(groups):
        raise ValueError(f"{len(block_ids)} block lists for {len(groups)} KV cache groups")
    sent = []
    for group, ids in zip(groups, block_ids, strict=True):
        if group.kind == GroupKind.STATE:
            block = state_block(ids, group.spec_blocks)
            sent.append(GroupBlocks(0, (block,) if block is not None else ()))
            continue
        held = list(ids[: math.ceil(num_tokens / group.block_size)])
        first = 0
        while first < len(held) and held[first] == NULL_BLOCK:
            first += 1
        if NULL_BLOCK in held[first:]:
            raise ValueError(f"a {group.kind.value} group's blocks have a gap: {held}")
        sent.append(GroupBlocks(first, tuple(held[first:])))
    return sent


def decode_first_layout(groups: Sequence[Group], num_tokens: int) -> tuple[tuple[int, int], ...]:
    """Decode first: per group, the block positions a room holds as (first, count), known to
    both sides before prefill computes: every block of the `num_tokens` from position 0
    (attention groups; a sliding window's dropped blocks are marked, `from_position_zero`),
    the state block (state groups)."""
    return tuple(
        (0, 1) if group.kind == GroupKind.STATE else (0, math.ceil(num_tokens / group.block_size))
        for group in groups
    )


def from_position_zero(
    groups: Sequence[Group], sent: Sequence[GroupBlocks], num_tokens: int
) -> tuple[tuple[int, ...], ...]:
    """Prefill, decode first: the blocks that move laid out as `decode_first_layout` says,
    NULL_BLOCK at the positions this instance no longer holds (decode needs nothing there,
    or the room fails: kvbridge never writes a null block). ValueError where a group holds
    another count of blocks than decode expects (the groups after it would shift)."""
    laid_out = []
    layout = decode_first_layout(groups, num_tokens)
    for index, (group, moving, (_, count)) in enumerate(zip(groups, sent, layout, strict=True)):
        blocks = moving.blocks
        if group.kind != GroupKind.STATE:
            blocks = (NULL_BLOCK,) * moving.first + blocks
        if len(blocks) != count:
            raise ValueError(
                f"group {index} ({group.kind.value}) holds {len(blocks)} block(s) of {num_tokens} "
                f"tokens, decode first lays out {count}"
            )
        laid_out.append(blocks)
    return tuple(laid_out)


@dataclass(frozen=True)
class GroupLoad:
    """Decode: the blocks one group loads, and how many of the blocks prefill sends for it
    come before them (decode has those already, or needs them no more)."""

    blocks: tuple[int, ...]
    skip: int


class LoadPlanError(ValueError):
    """Decode needs blocks prefill does not have: the load cannot be right."""


def blocks_to_load(
    groups: Sequence[Group],
    block_ids: Sequence[Sequence[int]],
    prefix_tokens: int,
    num_tokens: int,
    sent: Sequence[tuple[int, int]],
    same_block_size: bool = True,
) -> list[GroupLoad]:
    """Decode: per group, the request's blocks that tokens ``[prefix_tokens, prefix_tokens +
    num_tokens)`` fill, paired with what prefill sends (`sent`: per group the position of
    its first block and how many). Positions decode does not need (its own prefix cache,
    blocks out of the window: null) are skipped; a position prefill does not hold is a
    `LoadPlanError`. Prefill's blocks may hold another number of tokens than decode's
    (`same_block_size` False) for one full-attention group only: kvbridge then maps tokens,
    and the skip counts decode's blocks."""
    if not len(block_ids) == len(groups) == len(sent):
        raise LoadPlanError(
            f"{len(block_ids)} block lists and {len(sent)} from prefill for {len(groups)} "
            "KV cache groups: prefill and decode run different models or settings"
        )
    end = prefix_tokens + num_tokens
    loads = []
    for index, (group, ids, (first, count)) in enumerate(zip(groups, block_ids, sent, strict=True)):
        if group.kind == GroupKind.STATE:
            block = state_block(ids, group.spec_blocks)
            if block is None or count != 1:
                raise LoadPlanError(f"group {index}: no state block on both sides")
            loads.append(GroupLoad((block,), 0))
            continue
        if prefix_tokens % group.block_size:
            raise LoadPlanError(
                f"group {index}: a prefix of {prefix_tokens} tokens is not whole blocks of "
                f"{group.block_size}"
            )
        low, high = prefix_tokens // group.block_size, math.ceil(end / group.block_size)
        if high > len(ids):
            raise LoadPlanError(f"group {index}: {end} tokens need {high} blocks, has {len(ids)}")
        positions = [j for j in range(low, high) if ids[j] != NULL_BLOCK]
        if not positions:
            loads.append(GroupLoad((), 0))
            continue
        start = positions[0]
        if positions != list(range(start, high)):
            raise LoadPlanError(f"group {index}: the blocks to load have a gap")
        if not same_block_size:
            if group.kind != GroupKind.FULL or first:
                raise LoadPlanError(f"group {index}: block sizes differ")
            loads.append(GroupLoad(tuple(ids[start:high]), start))
            continue
        if start < first or high > first + count:
            raise LoadPlanError(
                f"group {index} ({group.kind.value}): decode needs blocks {start}-{high - 1}, "
                f"prefill holds {first}-{first + count - 1}"
            )
        loads.append(GroupLoad(tuple(ids[start:high]), start - first))
    return loads


def blocks_to_stream(
    block_ids: Sequence[int], sent: int, computed: int, final: bool, block_size: int
) -> tuple[tuple[int, ...], int]:
    """Decode first: the blocks of a full-attention group that a step completes, once
    `computed` tokens are in after it (`sent` blocks went before), and the count sent after
    it. A block the step fills only in part waits for the step that completes it (the
    prompt's last one goes with the final step), so every block goes once, whole."""
    complete = math.ceil(computed / block_size) if final else computed // block_size
    complete = min(complete, len(block_ids))
    return tuple(block_ids[sent:complete]), max(sent, complete)
