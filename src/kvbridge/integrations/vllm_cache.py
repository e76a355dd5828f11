"""vLLM's KV cache as kvbridge moves it: its per-layer tensors described as `KVArgs`, and which
blocks of each KV cache group move for a request. Pure: no vLLM import, no sockets; tensors are
read only for their shape, strides, dtype and address.

vLLM 0.32 hands a connector one 4-D view per layer, ``[blocks, heads, block_size, content]``
with a head's K and V side by side in `content`, laid out in memory by the model's one KV
cache layout: LBHNC ("HND", each block ``[head][token][content]``: CPU attention always, and
what this connector asks of the CUDA backends), LBNHC ("NHD", each block
``[token][head][content]``) or a block-outermost one (BL*, several layers' pages interleaved).
MLA's latent cache is ``[blocks, 1, block_size, 576]``. With the hybrid KV cache manager, the
layers of different KV cache groups share memory (layer k of every group views the same
bytes) and each group has its own block ids; a Mamba layer's view is raw bytes
``[blocks, 1, 1, state bytes]`` whose blocks are one page apart.
"""

from __future__ import annotations

import enum
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.cache.spec import (
    DTYPE_SIZES,
    BufferSpec,
    GeometryError,
    KVArgs,
    kv_heads_on_rank,
)
from kvbridge.wire.messages import KVLayout, MemoryKind

# The KV cache layout the connector asks vLLM for (`get_required_kvcache_layout`): every
# attention backend of vLLM 0.32's CPU build and the CUDA ones that declare layouts accept it.
REQUIRED_LAYOUT = "LBHNC"
# vLLM's null block: a placeholder in a group's block list (a sliding window's dropped
# blocks, an aligned Mamba group's unused positions), never data.
NULL_BLOCK = 0


def layer_index(name: str) -> int:
    """The layer number in a vLLM layer name ("model.layers.12.self_attn.attn" → 12): its
    first number, as vLLM's `extract_layer_index` reads it."""
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    if not numbers:
        raise GeometryError(f"vLLM layer {name!r} has no layer number in its name")
    return int(numbers[0])


@dataclass(frozen=True)
class VLLMCache:
    """One worker's KV cache described for kvbridge: its geometry, and how many kvbridge pages
    one vLLM block is (an attention kernel may split a block into smaller kernel blocks)."""

    kv_args: KVArgs
    pages_per_block: int = 1

    def pages_of(self, blocks: Sequence[int]) -> tuple[int, ...]:
        """kvbridge's pages for these vLLM blocks, in order."""
        per = self.pages_per_block
        return tuple(block * per + part for block in blocks for part in range(per))


def _byte_strides(tensor: Any) -> tuple[int, ...]:
    size = int(tensor.element_size())
    return tuple(int(stride) * size for stride in tensor.stride())


def _dtype(tensor: Any) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise GeometryError(f"vLLM KV cache dtype {name} is not one kvbridge moves")
    return name


def _buffer(tensor: Any) -> BufferSpec:
    """A layer's blocks as one buffer: ``blocks`` pages, `stride(0)` apart."""
    page = _byte_strides(tensor)[0]
    return BufferSpec(int(tensor.data_ptr()), int(tensor.shape[0]) * page, page)


def _attention_layout(tensor: Any, use_mla: bool) -> tuple[KVLayout, int]:
    """The kvbridge layout of an attention layer's ``[blocks, heads, block_size, content]``
    view, and its `head_dim` (a head's bytes in one token row, in elements)."""
    _, heads, tokens, content = (int(n) for n in tensor.shape)
    size = int(tensor.element_size())
    b, h, n, c = _byte_strides(tensor)
    row = content * size
    if c != size or b != heads * tokens * row:
        raise GeometryError(
            f"vLLM KV tensor of shape {tuple(tensor.shape)} with byte strides {(b, h, n, c)} "
            f"is not one block after another (a block-outermost layout such as BLHNC?); "
            f"kvbridge moves the {REQUIRED_LAYOUT} and LBNHC layouts: unset "
            "VLLM_KV_CACHE_LAYOUT"
        )
    if use_mla:
        if heads != 1:
            raise GeometryError(f"an MLA cache holds one latent head, this one {heads}")
        return KVLayout.MLA, content
    # With one head the two layouts hold the same bytes; vLLM's strides still say which.
    if h == tokens * row and n == row:  # LBHNC ("HND")
        if content % 2:
            raise GeometryError(
                f"vLLM KV content of {content} elements does not split into K and V halves"
            )
        return KVLayout.MHA_HEAD_MAJOR, content // 2
    if n == heads * row and (h == row or heads == 1):  # LBNHC ("NHD")
        return KVLayout.MHA_KV_PACKED, content
    raise GeometryError(
        f"vLLM KV tensor of shape {tuple(tensor.shape)} has byte strides {(b, h, n, c)}: "
        f"neither {REQUIRED_LAYOUT} nor LBNHC"
    )


def describe_kv_caches(
    kv_caches: Mapping[str, Any],
    *,
    use_mla: bool,
    total_kv_heads: int,
    attn_tp_rank: int,
    attn_tp_size: int,
    block_size: int,
    state_layers: frozenset[str] = frozenset(),
    num_blocks: int | None = None,
) -> VLLMCache:
    """vLLM's per-layer KV tensors (`register_kv_caches`) as `KVArgs`.

    Layers that view the same memory (the hybrid manager's groups, KV-sharing layers) are one
    buffer, named by their lowest layer number. A model whose layers all have one attention
    geometry keeps it (head slices between TP sizes, token rows between block sizes where the
    layout allows); one with Mamba state (`state_layers`) or attention of several geometries
    moves opaque pages, whole, between equal TP sizes.
    """
    if not kv_caches:
        raise GeometryError("vLLM registered no KV caches")
    by_address: dict[int, list[tuple[int, str, Any]]] = {}
    for name, tensor in kv_caches.items():
        if tensor.dim() != 4:
            raise GeometryError(
                f"vLLM layer {name}: a KV tensor of shape {tuple(tensor.shape)}; vLLM 0.32 "
                "gives [blocks, heads, block_size, content]"
            )
        by_address.setdefault(int(tensor.data_ptr()), []).append((layer_index(name), name, tensor))
    slots = sorted(
        (sorted(shared, key=lambda view: view[0]) for shared in by_address.values()),
        key=lambda shared: shared[0][0],
    )
    layer_ids = tuple(views[0][0] for views in slots)
    keepalive = tuple(tensor for views in slots for _, _, tensor in views)
    first = slots[0][0][2]
    on_gpu = first.device.type == "cuda"

    buffers = sorted((_buffer(views[0][2]) for views in slots), key=lambda buffer: buffer.ptr)
    for low, high in itertools.pairwise(buffers):
        if low.end > high.ptr:  # a block-outermost layout interleaves the layers' pages
            raise GeometryError(
                "vLLM's KV buffers overlap (layers' pages interleaved, as in a block-outermost "
                f"layout such as BLHNC): kvbridge moves the {REQUIRED_LAYOUT} and LBNHC layouts"
            )

    def kv_args(layout: KVLayout, heads: int, head_dim: int, dtype: str, page_size: int) -> KVArgs:
        return KVArgs(
            kv_layout=layout, layer_ids=layer_ids, total_kv_heads=heads, head_dim=head_dim,
            dtype=dtype, page_size=page_size,
            kv_buffers=tuple(_buffer(views[0][2]) for views in slots),
            attn_tp_rank=attn_tp_rank, attn_tp_size=attn_tp_size,
            memory_kind=MemoryKind.VRAM if on_gpu else MemoryKind.DRAM,
            device_id=int(first.device.index or 0) if on_gpu else 0, keepalive=keepalive,
        )  # fmt: skip

    views = [view for views in slots for view in views]
    geometries = {
        (tuple(tensor.shape), tensor.stride(), str(tensor.dtype)) for _, _, tensor in views
    }
    if not state_layers.intersection(kv_caches) and len(geometries) == 1:
        layout, head_dim = _attention_layout(first, use_mla)
        _, heads, tokens, _ = (int(n) for n in first.shape)
        if block_size % tokens:
            raise GeometryError(f"vLLM blocks of {block_size} tokens in kernel blocks of {tokens}")
        mla = layout == KVLayout.MLA
        expected = 1 if mla else kv_heads_on_rank(total_kv_heads, attn_tp_size)
        if heads != expected:
            raise GeometryError(
                f"vLLM's KV tensors hold {heads} heads, but {total_kv_heads} KV heads over "
                f"attention TP {attn_tp_size} gives {expected} per rank"
            )
        args = kv_args(layout, 1 if mla else total_kv_heads, head_dim, _dtype(first), tokens)
        return VLLMCache(args, block_size // tokens)
    pages = {_byte_strides(tensor)[0] for _, _, tensor in views}
    counts = {int(tensor.shape[0]) for _, _, tensor in views}
    if len(pages) != 1 or len(counts) != 1:
        raise GeometryError(
            "vLLM's KV cache groups share memory in pages of different sizes "
            f"({sorted(pages)} B) or counts ({sorted(counts)}): kvbridge moves a hybrid "
            "model's pages whole, one page per block of every group"
        )
    page = pages.pop()
    if num_blocks is not None and counts != {num_blocks}:
        raise GeometryError(
            f"vLLM splits its {num_blocks} blocks into {sorted(counts)} kernel blocks: "
            "kvbridge moves a hybrid model's pages whole, one page a block"
        )
    for _, name, tensor in views:
        if name not in state_layers:
            _attention_layout(tensor, use_mla)  # one block after another, or refused
        used = math.prod(int(n) for n in tensor.shape[1:]) * int(tensor.element_size())
        if used > page:
            raise GeometryError(f"vLLM layer {name}: a block of {used} B in a page of {page} B")
    return VLLMCache(kv_args(KVLayout.PAGES, 1, page, "uint8", 1), 1)


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


def blocks_to_send(groups: Sequence[Group], block_ids: Sequence[Sequence[int]],
                   num_tokens: int) -> list[GroupBlocks]:  # fmt: skip
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
    for index, (group, ids, (first, count)) in enumerate(zip(groups, block_ids, sent,
                                                             strict=True)):  # fmt: skip
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
