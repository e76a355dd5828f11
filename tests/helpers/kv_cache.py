"""Numpy-backed KV caches for tests: real memory, real addresses, known contents."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvbridge.cache import KVArgs
from kvbridge.cache.peer import memory_regions
from kvbridge.cache.regions import MemoryRegion
from kvbridge.wire import KVLayout


@dataclass
class RankCache:
    """One rank's KV, aux and state arrays and the `KVArgs` describing them."""

    kv: list[np.ndarray]
    aux: list[np.ndarray]
    state: list[np.ndarray]
    args: KVArgs

    def regions(self) -> list[MemoryRegion]:
        return memory_regions(self.args)


def rank_cache(
    *,
    kv_layout: KVLayout = KVLayout.MHA,
    layer_ids: tuple[int, ...] = (0, 1),
    num_pages: int = 16,
    page_size: int = 4,
    total_kv_heads: int = 2,
    head_dim: int = 8,
    attn_tp_rank: int = 0,
    attn_tp_size: int = 1,
    aux_slots: int = 0,
    aux_item_bytes: tuple[int, ...] = (),
    state_slots: int = 0,
    state_item_bytes: tuple[int, ...] = (),
    state_dims: tuple[int, ...] = (),
    seed: int | None = 0,
) -> RankCache:
    """Random contents when `seed` is given, zeros otherwise (a destination)."""
    rng = np.random.default_rng(seed)
    heads = max(1, total_kv_heads // attn_tp_size) if kv_layout.head_sliceable else total_kv_heads
    per_layer = kv_layout.buffers_per_layer
    # vLLM's CPU cache: [pages, heads, page_size, K and V of head_dim each].
    page_shape = (
        (heads, page_size, 2 * head_dim)
        if kv_layout == KVLayout.MHA_HEAD_MAJOR
        else (page_size, heads, head_dim)
    )

    def array(shape: tuple[int, ...], dtype: type) -> np.ndarray:
        if seed is None:
            return np.zeros(shape, dtype=dtype)
        return rng.integers(0, 2**16 if dtype is np.uint16 else 256, size=shape, dtype=dtype)

    kv = [array((num_pages, *page_shape), np.uint16) for _ in range(per_layer * len(layer_ids))]
    aux = [array((aux_slots, size), np.uint8) for size in aux_item_bytes]
    state = [array((state_slots, size), np.uint8) for size in state_item_bytes]
    args = KVArgs.from_numpy(
        kv,
        kv_layout=kv_layout,
        layer_ids=layer_ids,
        total_kv_heads=total_kv_heads,
        attn_tp_rank=attn_tp_rank,
        attn_tp_size=attn_tp_size,
        aux=aux,
        state=state,
        state_dims=state_dims,
    )
    return RankCache(kv, aux, state, args)


def as_torch(cache: RankCache) -> RankCache:
    """The same cache described through torch tensors that share its memory (`KVArgs` from
    `from_torch`, so torch staging kernels can run on it); needs torch."""
    import dataclasses

    import torch

    tensors = [torch.from_numpy(array).view(torch.bfloat16) for array in cache.kv]
    args = cache.args
    torch_args = KVArgs.from_torch(
        tensors,
        kv_layout=args.kv_layout,
        layer_ids=args.layer_ids,
        total_kv_heads=args.total_kv_heads,
        attn_tp_rank=args.attn_tp_rank,
        attn_tp_size=args.attn_tp_size,
    )
    # Aux and state stay as the numpy arrays describe them.
    args = dataclasses.replace(
        torch_args,
        aux_buffers=args.aux_buffers,
        state_buffers=args.state_buffers,
        state_dims=args.state_dims,
    )
    return RankCache(cache.kv, cache.aux, cache.state, args)
