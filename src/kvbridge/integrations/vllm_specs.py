"""vLLM's KV cache specs as the connector moves them: which KV cache groups take part and
how (`transfer_groups`), and a Mamba-2 layer's state layout (`mamba_state`). Imports vLLM;
what it returns is pure (`vllm_blocks`, `vllm_cache`)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvbridge.cache.spec import GeometryError
from kvbridge.integrations.vllm_blocks import Group, GroupKind
from kvbridge.integrations.vllm_kv_views import MambaState

log = logging.getLogger("kvbridge.vllm")

# Where Hugging Face configs of Mamba-2 hybrids keep the B/C group count (Granite-4-hybrid,
# Bamba and Falcon-H1; Mamba-2 and Nemotron-H; Zamba2).
N_GROUPS_NAMES = ("mamba_n_groups", "n_groups", "mamba_ngroups")


def transfer_groups(
    kv_cache_config: Any, block_size: int
) -> tuple[tuple[Group, ...], frozenset[str]]:
    """The KV cache groups that take part in transfers, as kvbridge moves them, and the names
    of the layers that hold a recurrent state; a kind of group kvbridge cannot move is
    refused here, when vLLM starts."""
    if kv_cache_config is None:
        return (Group(GroupKind.FULL, block_size),), frozenset()
    groups, state_layers = [], set()
    for group in kv_cache_config.transfer_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            groups.append(Group(GroupKind.SLIDING, spec.block_size))
        elif isinstance(spec, MambaSpec):
            groups.append(Group(GroupKind.STATE, spec.block_size, spec.num_speculative_blocks))
            state_layers.update(group.layer_names)
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            groups.append(Group(GroupKind.FULL, spec.block_size))
        else:
            raise RuntimeError(
                f"kvbridge moves full-attention, MLA, sliding-window and Mamba/linear-attention "
                f"KV cache groups; this model's layers {group.layer_names[:3]}... are "
                f"{type(spec).__name__}"
            )
    return tuple(groups), frozenset(state_layers)


def streamed_layers(kv_cache_config: Any, group: int | None) -> frozenset[str] | None:
    """The names of the layers of the KV cache group that streams during the forward
    (`stream_group`): empty when none does, None when vLLM gave no KV cache config (one
    group: every attention layer)."""
    if group is None:
        return frozenset()
    if kv_cache_config is None:
        return None
    return frozenset(kv_cache_config.transfer_groups[group].layer_names)


def attention_block_size(groups: tuple[Group, ...]) -> int:
    """Tokens in a block of the attention groups (they share one geometry where kvbridge
    keeps it); a state group's block size is the hybrid manager's bookkeeping, not a page."""
    return next((g.block_size for g in groups if g.kind != GroupKind.STATE), groups[0].block_size)


def mamba_state(kv_cache_config: Any, hf_config: Any, tp_size: int) -> MambaState | None:
    """The Mamba-2 state layout of this model's state groups, this rank's shapes; None where
    there is none, or it is not one kvbridge splits between TP sizes (other state kinds,
    layers of several specs, no group count in the config): the state then moves whole,
    between equal TP sizes only."""
    if kv_cache_config is None:
        return None
    specs = {
        group.kv_cache_spec
        for group in kv_cache_config.transfer_groups
        if isinstance(group.kv_cache_spec, MambaSpec)
    }
    names = [name for name in N_GROUPS_NAMES if isinstance(getattr(hf_config, name, None), int)]
    if len(specs) != 1 or not names:
        return None
    spec = specs.pop()
    mamba2 = spec.mamba_type == MambaAttentionBackendEnum.MAMBA2
    if not mamba2 or [len(shape) for shape in spec.shapes] != [2, 3]:
        return None
    (rows, dim), (heads, head_dim, state) = (map(int, shape) for shape in spec.shapes)
    sizes = [torch.empty((), dtype=dtype).element_size() for dtype in spec.dtypes]
    n_groups = int(getattr(hf_config, names[0]))
    found = MambaState(
        (rows, dim),
        (heads, head_dim, state),
        sizes[0],
        sizes[1],
        n_groups,
        dim_first=is_conv_state_dim_first(),
    )
    try:
        found.parts(0, tp_size)
    except GeometryError as exc:  # whole slots still move between equal TP sizes
        log.warning(
            "kvbridge: this model's Mamba-2 state moves between equal TP sizes only: %s", exc
        )
        return None
    return found
