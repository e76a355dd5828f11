"""vLLM's per-layer KV cache tensors described as kvbridge's `KVArgs` (a `VLLMCache`). Pure: no
vLLM import, no sockets; tensors are read only for their shape, strides, dtype and address.

vLLM 0.32 hands a connector one 4-D view per layer, ``[blocks, heads, block_size, content]``
with a head's K and V side by side in `content`, laid out in memory by the model's one KV
cache layout: LBHNC ("HND", each block ``[head][token][content]``: CPU attention always, and
what this connector asks of the CUDA backends), LBNHC ("NHD", each block
``[token][head][content]``) or a block-outermost one (BLHNC, BLNHC, BHLNC: every layer's page
of a block side by side, one block after another — vLLM's cross-layer layout, asked for with
the connector's `kv_cache_layout` option or VLLM_KV_CACHE_LAYOUT). A block-outermost cache
moves as opaque pages of every layer, one per block: a run of blocks is one descriptor
across all layers. MLA's latent cache is ``[blocks, 1, block_size, 576]``. With the hybrid
KV cache manager, the layers of different KV cache groups share memory (layer k of every
group views the same bytes) and each group has its own block ids; a Mamba layer's view is raw
bytes ``[blocks, 1, 1, state bytes]`` whose blocks are one page apart.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from kvbridge.cache.spec import (
    DTYPE_SIZES,
    BufferSpec,
    GeometryError,
    KVArgs,
    StatePart,
    kv_heads_on_rank,
)
from kvbridge.cache.topology import TopologyError, rank_heads
from kvbridge.integrations.vllm_cache import VLLMCache
from kvbridge.wire.messages import KVLayout, MemoryKind

# The KV cache layout the connector asks vLLM for (`get_required_kvcache_layout`): every
# attention backend of vLLM 0.32's CPU build and the CUDA ones that declare layouts accept it.
REQUIRED_LAYOUT = "LBHNC"


def layer_index(name: str) -> int:
    """The layer number in a vLLM layer name ("model.layers.12.self_attn.attn" → 12): its
    first number, as vLLM's `extract_layer_index` reads it."""
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    if not numbers:
        raise GeometryError(f"vLLM layer {name!r} has no layer number in its name")
    return int(numbers[0])


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
            "is not one block after another (heads outside blocks, as in LHBNC?): kvbridge "
            f"moves {REQUIRED_LAYOUT}, LBNHC and the block-outermost layouts: unset "
            "VLLM_KV_CACHE_LAYOUT or choose one of those"
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


@dataclass(frozen=True)
class MambaState:
    """A Mamba-2 layer's state in its page, as vLLM 0.32 lays it out (`MambaSpec` shapes, this
    rank's): the conv state, ``(kernel - 1, conv dim)`` (vLLM's default "SD") or ``(conv dim,
    kernel - 1)`` ("DS", `dim_first`), its conv dim ``[x | B | C]`` with x by head and B, C
    by group; then the SSM state ``(heads, head dim, state size)``. `n_groups` is the
    model's: vLLM gives every rank a copy of the one group when TP exceeds it."""

    conv_shape: tuple[int, int]
    ssm_shape: tuple[int, int, int]
    conv_item_bytes: int
    ssm_item_bytes: int
    n_groups: int
    dim_first: bool = False

    def parts(self, tp_rank: int, tp_size: int) -> tuple[StatePart, ...]:
        """The runs of the page that TP shards, in order, on this rank."""
        heads, head_dim, state = self.ssm_shape
        rows, conv_dim = reversed(self.conv_shape) if self.dim_first else self.conv_shape
        try:
            groups = rank_heads(tp_rank, tp_size, self.n_groups).count
        except TopologyError as exc:
            raise GeometryError(f"Mamba-2 B/C groups: {exc}") from None
        if conv_dim != heads * head_dim + 2 * groups * state:
            raise GeometryError(
                f"a Mamba-2 conv state of {conv_dim} channels is not x ({heads} heads × "
                f"{head_dim}) and B, C ({groups} groups × {state}) on this rank"
            )
        x = (heads, head_dim, heads * tp_size)  # (units, elements a unit, units model-wide)
        b_or_c = (groups, state, self.n_groups)
        if self.dim_first:  # x's channels, then B's, then C's, each `rows` elements
            conv = [(units, size * rows, total) for units, size, total in (x, b_or_c, b_or_c)]
        else:  # `rows` rows, each x, B and C
            conv = [x, b_or_c, b_or_c] * rows
        runs = [(units, size * self.conv_item_bytes, total) for units, size, total in conv]
        runs.append((heads, head_dim * state * self.ssm_item_bytes, heads * tp_size))
        offsets = itertools.accumulate((units * size for units, size, _ in runs), initial=0)
        return tuple(StatePart(offset, *run) for offset, run in zip(offsets, runs, strict=False))


# A layer's view: (layer number, vLLM's layer name, tensor).
View = tuple[int, str, Any]


def _packed(tensor: Any) -> bool:
    """A block's bytes fill its stride (an attention page not padded to a larger one)."""
    used = math.prod(int(n) for n in tensor.shape[1:]) * int(tensor.element_size())
    return _byte_strides(tensor)[0] == used


def _block_outermost(views: Sequence[View], num_blocks: int | None) -> BufferSpec:
    """The one buffer of a block-outermost cache: every view (layer) a block apart (its
    ``stride(0)``), each layer's page at its own offset within the block, all in one
    allocation. GeometryError where the views are not that (pages of different block strides
    or counts interleaved, or past their memory)."""
    strides = {_byte_strides(tensor)[0] for _, _, tensor in views}
    counts = {int(tensor.shape[0]) for _, _, tensor in views}
    storages = {int(tensor.untyped_storage().data_ptr()) for _, _, tensor in views}
    ends = {
        int(tensor.untyped_storage().data_ptr()) + int(tensor.untyped_storage().nbytes())
        for _, _, tensor in views
    }
    if len(strides) != 1 or len(counts) != 1 or len(storages) != 1:
        raise GeometryError(
            "vLLM's KV buffers overlap, but not as a block-outermost layout (one allocation, "
            f"every layer a block of one stride apart): block strides {sorted(strides)} B, "
            f"block counts {sorted(counts)}, {len(storages)} allocation(s)"
        )
    block, count = strides.pop(), counts.pop()
    if num_blocks is not None and count != num_blocks:
        raise GeometryError(
            f"vLLM's views hold {count} blocks of its {num_blocks} (kernel blocks of another "
            "size?): kvbridge moves a block-outermost cache one whole page a block"
        )
    base = min(int(tensor.data_ptr()) for _, _, tensor in views)
    for _, name, tensor in views:
        used = math.prod(int(n) for n in tensor.shape[1:]) * int(tensor.element_size())
        if int(tensor.data_ptr()) - base + used > block:
            raise GeometryError(
                f"vLLM layer {name}: its page ends past the block of {block} B it starts in"
            )
    if base + count * block > ends.pop():
        raise GeometryError(
            f"vLLM's block-outermost KV cache: {count} blocks of {block} B run past its memory"
        )
    return BufferSpec(base, count * block, block)


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
    mamba: MambaState | None = None,
) -> VLLMCache:
    """vLLM's per-layer KV tensors (`register_kv_caches`) as `KVArgs`.

    Layers that view the same memory (the hybrid manager's groups, KV-sharing layers) are one
    buffer, named by their lowest layer number. Where every attention layer has one geometry
    it is kept (head slices between TP sizes, token rows between block sizes where the layout
    allows), and the pages of the state layers (`state_layers`) are state slots beside it: a
    state group's block moves as a slot, split between TP sizes by `mamba`'s parts. Attention
    of several geometries, or padded to the state's page, moves as opaque pages, whole,
    between equal TP sizes; so does a block-outermost cache, one page per block holding
    every layer's (a run of blocks: one descriptor for all layers).
    """
    if not kv_caches:
        raise GeometryError("vLLM registered no KV caches")
    by_address: dict[int, list[View]] = {}
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
    keepalive = tuple(tensor for views in slots for _, _, tensor in views)
    first = slots[0][0][2]
    on_gpu = first.device.type == "cuda"

    buffers = sorted((_buffer(views[0][2]) for views in slots), key=lambda buffer: buffer.ptr)
    if any(low.end > high.ptr for low, high in itertools.pairwise(buffers)):
        # The layers' pages interleave: a block-outermost layout, every layer's page of a
        # block in one run. It moves as one opaque page per block, whole.
        cross_layer = _block_outermost([view for views in slots for view in views], num_blocks)
        return VLLMCache(
            KVArgs(
                kv_layout=KVLayout.PAGES,
                layer_ids=(slots[0][0][0],),
                total_kv_heads=1,
                head_dim=cross_layer.item_len,
                dtype="uint8",
                page_size=1,
                kv_buffers=(cross_layer,),
                attn_tp_rank=attn_tp_rank,
                attn_tp_size=attn_tp_size,
                memory_kind=MemoryKind.VRAM if on_gpu else MemoryKind.DRAM,
                device_id=int(first.device.index or 0) if on_gpu else 0,
                keepalive=keepalive,
            )
        )

    def kv_args(
        layout: KVLayout,
        heads: int,
        head_dim: int,
        dtype: str,
        page_size: int,
        kv_views: Sequence[View],
        state_views: Sequence[View] = (),
    ) -> KVArgs:
        state_parts = () if mamba is None else (mamba.parts(attn_tp_rank, attn_tp_size),)
        return KVArgs(
            kv_layout=layout,
            layer_ids=tuple(view[0] for view in kv_views),
            total_kv_heads=heads,
            head_dim=head_dim,
            dtype=dtype,
            page_size=page_size,
            kv_buffers=tuple(_buffer(view[2]) for view in kv_views),
            state_buffers=tuple(_buffer(view[2]) for view in state_views),
            state_parts=state_parts * len(state_views) if state_views else (),
            attn_tp_rank=attn_tp_rank,
            attn_tp_size=attn_tp_size,
            memory_kind=MemoryKind.VRAM if on_gpu else MemoryKind.DRAM,
            device_id=int(first.device.index or 0) if on_gpu else 0,
            keepalive=keepalive,
        )

    def one_per_slot(names: AbstractSet[str]) -> list[View]:
        """The lowest-numbered of these layers in each slot that has one."""
        return [
            next(v for v in views if v[1] in names)
            for views in slots
            if any(v[1] in names for v in views)
        ]

    state_names = state_layers.intersection(kv_caches)
    attention = one_per_slot(set(kv_caches) - state_names)
    geometries = {
        (tuple(tensor.shape), tensor.stride(), str(tensor.dtype))
        for views in slots
        for _, name, tensor in views
        if name not in state_names
    }
    if len(geometries) == 1 and (not state_names or _packed(attention[0][2])):
        tensor = attention[0][2]
        layout, head_dim = _attention_layout(tensor, use_mla)
        _, heads, tokens, _ = (int(n) for n in tensor.shape)
        if block_size % tokens:
            raise GeometryError(f"vLLM blocks of {block_size} tokens in kernel blocks of {tokens}")
        mla = layout == KVLayout.MLA
        expected = 1 if mla else kv_heads_on_rank(total_kv_heads, attn_tp_size)
        if heads != expected:
            raise GeometryError(
                f"vLLM's KV tensors hold {heads} heads, but {total_kv_heads} KV heads over "
                f"attention TP {attn_tp_size} gives {expected} per rank"
            )
        args = kv_args(
            layout,
            1 if mla else total_kv_heads,
            head_dim,
            _dtype(tensor),
            tokens,
            attention,
            one_per_slot(state_names),
        )
        with_attention = [views for views in slots if any(v[1] not in state_names for v in views)]
        positions = {
            name: position
            for position, views in enumerate(with_attention)
            for _, name, _ in views
            if name not in state_names
        }
        return VLLMCache(args, block_size // tokens, bool(state_names), positions)
    views = [view for views in slots for view in views]
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
        if name not in state_names:
            _attention_layout(tensor, use_mla)  # one block after another, or refused
        used = math.prod(int(n) for n in tensor.shape[1:]) * int(tensor.element_size())
        if used > page:
            raise GeometryError(f"vLLM layer {name}: a block of {used} B in a page of {page} B")
    whole = [views[0] for views in slots]
    return VLLMCache(kv_args(KVLayout.PAGES, 1, page, "uint8", 1, whole), 1)
