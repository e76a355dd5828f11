"""vLLM 0.32's per-layer KV views built with plain torch (no vLLM), and a byte-level executor
of transfer plans over torch tensors (CPU or CUDA): the oracle for `vllm_cache`'s
descriptions. tests/vllm_compat/test_vllm_layouts.py checks the same against the views vLLM's
own allocator makes."""

from __future__ import annotations

from typing import Any

import torch

from kvbridge.cache.plan import TransferPlan
from kvbridge.cache.spec import KVArgs

# vLLM's KVCacheLayout values: the logical axes [L, B, H, N, C] in memory order.
LAYOUTS = {
    "LBNHC": (0, 1, 3, 2, 4),
    "LBHNC": (0, 1, 2, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def layer_views(
    layers: int,
    blocks: int,
    heads: int,
    tokens: int,
    content: int,
    dtype: torch.dtype,
    layout: str,
    device: str = "cpu",
    first_layer: int = 0,
) -> dict[str, torch.Tensor]:
    """What `register_kv_caches` gets for one KV cache group: per layer a
    ``[blocks, heads, tokens, content]`` view of one int8 allocation, laid out as `layout`
    (vLLM's `create_kv_cache_views`), filled with distinct random bytes."""
    order = LAYOUTS[layout]
    size = torch.empty((), dtype=dtype).element_size()
    logical = (layers, blocks, heads, tokens, content * size)
    raw = torch.randint(
        -128,
        128,
        (layers * blocks * heads * tokens * content * size,),
        dtype=torch.int8,
        device=device,
    )
    physical = raw.view(*[logical[axis] for axis in order])
    pool = physical.permute(*[order.index(axis) for axis in range(5)])
    return {
        f"model.layers.{first_layer + layer}.self_attn.attn": pool[layer].view(dtype)
        for layer in range(layers)
    }


def execute(plan: TransferPlan, src: KVArgs, dst: KVArgs) -> None:
    """Copy every block of `plan` from `src`'s registered memory to `dst`'s, through torch
    byte views of the tensors both keep alive (so CUDA memory works too)."""
    src_memory, dst_memory = _memory(src), _memory(dst)
    for src_addr, dst_addr, length in zip(
        plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True
    ):
        source = _slice(src_memory, int(src_addr), int(length))
        _slice(dst_memory, int(dst_addr), int(length)).copy_(source)


def _memory(args: KVArgs) -> list[tuple[int, torch.Tensor]]:
    """Each allocation behind `args`, as (address, flat uint8 tensor)."""
    seen: dict[int, torch.Tensor] = {}
    for tensor in args.keepalive:
        storage = tensor.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        seen[storage.data_ptr()] = flat
    return sorted(seen.items())


def _slice(memory: list[tuple[int, Any]], address: int, length: int) -> torch.Tensor:
    for base, flat in memory:
        if base <= address and address + length <= base + flat.numel():
            return flat[address - base : address - base + length]
    raise AssertionError(f"block at {address:#x} (+{length}) is outside registered memory")
