"""The KV views vLLM 0.32's own allocator makes (`allocate_kv_cache`, the code every backend's
cache comes from, CUDA's included), described by kvbridge (`vllm_cache`): the attention
layouts vLLM can choose, MLA's latent cache, and a hybrid model's groups sharing memory. The
plain-torch views of tests/helpers/vllm_views.py, which the unit tests move byte by byte (on
a GPU too), must be the same views."""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed here (make test runs this in .venv-vllm)", allow_module_level=True
    )

import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache
from vllm_views import execute, layer_views

from kvbridge.cache import GeometryError
from kvbridge.cache.pairing import pair
from kvbridge.integrations.vllm import KVBridgeConnector
from kvbridge.integrations.vllm_cache import RoomContents
from kvbridge.integrations.vllm_kv_views import REQUIRED_LAYOUT, describe_kv_caches
from kvbridge.integrations.vllm_options import KV_CACHE_LAYOUTS
from kvbridge.integrations.vllm_specs import mamba_state
from kvbridge.wire import KVLayout

LAYERS, BLOCKS = 3, 6


def allocated(spec: Any, layout: KVCacheLayout, layers: int = LAYERS) -> dict[str, torch.Tensor]:
    """What `register_kv_caches` gets for one group of `layers` layers laid out as `layout`."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    page = spec.page_size_bytes
    block_stride = layers * page if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, BLOCKS, layers, layout, fixed_strides=(None, block_stride, None, None, None)
    )
    tensor = KVCacheTensor(
        size=layers * page * BLOCKS,
        layers=names,
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    config = KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        kv_cache_layout=layout.name,
    )
    views: dict[str, torch.Tensor] = allocate_kv_cache(config, torch.device("cpu"), layout)
    for view in views.values():  # distinct bytes to move
        view.view(torch.uint8).copy_(
            torch.randint(0, 256, view.view(torch.uint8).shape, dtype=torch.uint8)
        )
    return views


def test_the_connector_asks_for_head_major_pages_and_leaves_mla_alone() -> None:
    class Model:
        use_mla = False

    class Config:
        model_config = Model()
        kv_transfer_config: Any = None

    assert KVBridgeConnector.get_required_kvcache_layout(Config()) == REQUIRED_LAYOUT == "LBHNC"
    Model.use_mla = True
    assert KVBridgeConnector.get_required_kvcache_layout(Config()) is None
    assert KVCacheLayout[REQUIRED_LAYOUT] == KVCacheLayout.LBHNC
    # Asked for: a layout of the option's (every one of them vLLM's); a bad one is left to
    # the constructor to report.
    Config.kv_transfer_config = SimpleNamespace(kv_connector_extra_config={"kv_cache_layout": ""})
    for layout in KV_CACHE_LAYOUTS:
        Config.kv_transfer_config.kv_connector_extra_config["kv_cache_layout"] = layout
        assert KVBridgeConnector.get_required_kvcache_layout(Config()) == layout
        assert KVCacheLayout[layout].name == layout
    Config.kv_transfer_config.kv_connector_extra_config["kv_cache_layout"] = "LHBNC"
    assert KVBridgeConnector.get_required_kvcache_layout(Config()) is None


@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("use_mla", [False, True])
def test_vllms_block_outermost_caches_move_a_run_of_blocks_in_one_descriptor(
    layout: str, use_mla: bool
) -> None:
    """vLLM's own allocator's cross-layer views: one buffer of whole blocks (every layer's
    page), a run of blocks one descriptor, each layer's blocks arriving byte for byte."""
    spec = (
        MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
        if use_mla
        else FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    )
    src_views, dst_views = (
        allocated(spec, KVCacheLayout[layout]),
        allocated(spec, KVCacheLayout[layout]),
    )

    def describe(views: dict[str, torch.Tensor]) -> Any:
        return describe_kv_caches(
            views,
            use_mla=use_mla,
            total_kv_heads=1 if use_mla else 2,
            attn_tp_rank=0,
            attn_tp_size=1,
            block_size=16,
            num_blocks=BLOCKS,
        ).kv_args

    src, dst = describe(src_views), describe(dst_views)
    assert (src.kv_layout, len(src.kv_buffers)) == (KVLayout.PAGES, 1)
    assert src.kv_buffers[0].item_len == LAYERS * spec.page_size_bytes
    plan = pair(src, dst).plan(src, dst, np.array([1, 2, 3]), 0, [3, 4, 5])
    assert plan.length.tolist() == [3 * LAYERS * spec.page_size_bytes]
    execute(plan, src, dst)
    for name, view in dst_views.items():
        assert torch.equal(
            view[[3, 4, 5]].view(torch.uint8), src_views[name][[1, 2, 3]].view(torch.uint8)
        )


@pytest.mark.parametrize(
    ("layout", "expected"),
    [("LBHNC", KVLayout.MHA_HEAD_MAJOR), ("LBNHC", KVLayout.MHA_KV_PACKED)],
)
def test_vllms_attention_views_are_the_ones_the_unit_tests_move(
    layout: str, expected: KVLayout
) -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    views = allocated(spec, KVCacheLayout[layout])
    ours = layer_views(LAYERS, BLOCKS, 2, 16, 16, torch.bfloat16, layout)
    for theirs, mine in zip(views.values(), ours.values(), strict=True):
        assert (theirs.shape, theirs.stride(), theirs.dtype) == (
            mine.shape,
            mine.stride(),
            mine.dtype,
        )
    cache = describe_kv_caches(
        views, use_mla=False, total_kv_heads=4, attn_tp_rank=1, attn_tp_size=2, block_size=16
    )
    assert cache.kv_args.kv_layout == expected
    assert (cache.kv_args.kv_heads, cache.kv_args.page_size) == (2, 16)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_blocks_of_vllms_views_move_between_tp_sizes(layout: str) -> None:
    """Prefill at TP 1 (4 heads), decode rank 1 of TP 2 (heads 2 and 3): decode's view of the
    moved blocks equals prefill's heads 2 and 3."""
    whole = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=8, dtype=torch.bfloat16)
    half = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    src_views = allocated(whole, KVCacheLayout[layout])
    dst_views = allocated(half, KVCacheLayout[layout])
    src = describe_kv_caches(
        src_views, use_mla=False, total_kv_heads=4, attn_tp_rank=0, attn_tp_size=1, block_size=16
    ).kv_args
    dst = describe_kv_caches(
        dst_views, use_mla=False, total_kv_heads=4, attn_tp_rank=1, attn_tp_size=2, block_size=16
    ).kv_args
    execute(pair(src, dst).plan(src, dst, np.array([4, 1]), 0, [0, 5]), src, dst)
    for name, view in dst_views.items():
        assert torch.equal(
            view[[0, 5]].view(torch.uint8),
            src_views[name][[4, 1], 2:4].contiguous().view(torch.uint8),
        )


def test_mla_latent_and_a_layout_with_heads_outside_blocks() -> None:
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    views = allocated(mla, KVCacheLayout.LBNHC)
    cache = describe_kv_caches(
        views, use_mla=True, total_kv_heads=1, attn_tp_rank=0, attn_tp_size=2, block_size=16
    )
    assert (cache.kv_args.kv_layout, cache.kv_args.head_dim) == (KVLayout.MLA, 576)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    with pytest.raises(GeometryError, match="heads outside blocks, as in LHBNC"):
        describe_kv_caches(
            allocated(spec, KVCacheLayout.LHBNC),
            use_mla=False,
            total_kv_heads=2,
            attn_tp_rank=0,
            attn_tp_size=1,
            block_size=16,
        )


def test_a_hybrid_models_state_pages_are_state_slots_beside_its_attention() -> None:
    """Two groups over shared memory, as vLLM allocates a hybrid model: attention layers and
    Mamba-2 layers (raw bytes, their page padded to the attention page). The attention keeps
    its geometry; the Mamba pages are state slots whose parts follow vLLM's own Mamba-2 state
    shapes (conv state then SSM state, as `MambaBase.bind_kv_cache` unpacks a page)."""
    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    page = attention.page_size_bytes
    conv_shape, ssm_shape = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1,
        intermediate_size=8,
        n_groups=1,
        num_heads=2,
        head_dim=4,
        state_size=8,
        conv_kernel=4,
    )
    mamba = MambaSpec(
        shapes=(conv_shape, ssm_shape),
        dtypes=(torch.bfloat16, torch.float32),
        block_size=16,
        page_size_padded=page,
    )
    attention_names = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
    mamba_names = ["model.layers.0.mixer", "model.layers.2.mixer"]
    tensors, groups = [], []
    for spec, names in ((attention, attention_names), (mamba, mamba_names)):
        layer_stride, block_stride, *_ = compute_layout_strides(
            spec, BLOCKS, 2, KVCacheLayout.LBHNC, fixed_strides=(None, page, None, None, None)
        )
        tensors.append(
            KVCacheTensor(
                size=2 * page * BLOCKS,
                layers=names,
                layer_stride=layer_stride,
                block_stride=block_stride,
            )
        )
        groups.append(KVCacheGroupSpec(names, spec))
    config = KVCacheConfig(
        num_blocks=BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=groups, kv_cache_layout="LBHNC"
    )
    views = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    state = mamba_state(config, SimpleNamespace(mamba_n_groups=1), tp_size=1)
    assert state is not None
    # A group count the shapes do not hold: whole slots only (equal TP), not a failed start.
    assert mamba_state(config, SimpleNamespace(mamba_n_groups=3), tp_size=1) is None
    assert mamba_state(config, SimpleNamespace(), tp_size=1) is None
    cache = describe_kv_caches(
        views,
        use_mla=False,
        total_kv_heads=2,
        attn_tp_rank=0,
        attn_tp_size=1,
        block_size=16,
        state_layers=frozenset(mamba_names),
        mamba=state,
    )
    args = cache.kv_args
    assert (args.kv_layout, args.layer_ids) == (KVLayout.MHA_HEAD_MAJOR, (1, 3))
    assert [buffer.item_len for buffer in args.state_buffers] == [page, page]
    assert [b.ptr for b in args.state_buffers] == [b.ptr for b in args.kv_buffers]  # shared
    conv_bytes = math.prod(conv_shape) * 2
    (*conv, ssm) = args.state_parts[0]
    assert sum(part.nbytes for part in conv) == conv_bytes
    assert (ssm.offset, ssm.nbytes) == (conv_bytes, math.prod(ssm_shape) * 4)
    assert cache.send_contents([[3], [4]], {0}) == RoomContents([4], [3])


def test_a_hybrid_model_laid_out_block_outermost_moves_whole_blocks_of_every_group() -> None:
    """A hybrid model block-outermost, as vLLM allocates it (its groups alias from byte 0 of
    each block): one buffer of whole blocks, whatever group holds a block; the blocks a room
    names for each group arrive byte for byte, in one descriptor per run."""
    attention = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    page = attention.page_size_bytes
    conv_shape, ssm_shape = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1,
        intermediate_size=8,
        n_groups=1,
        num_heads=2,
        head_dim=4,
        state_size=8,
        conv_kernel=4,
    )
    mamba = MambaSpec(
        shapes=(conv_shape, ssm_shape),
        dtypes=(torch.bfloat16, torch.float32),
        block_size=16,
        page_size_padded=page,
    )
    attention_names = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
    mamba_names = ["model.layers.0.mixer", "model.layers.2.mixer"]
    layout = KVCacheLayout.BLHNC

    def instance() -> tuple[dict[str, torch.Tensor], Any]:
        tensors, groups = [], []
        for spec, names in ((attention, attention_names), (mamba, mamba_names)):
            layer_stride, block_stride, *_ = compute_layout_strides(
                spec, BLOCKS, 2, layout, fixed_strides=(None, 2 * page, None, None, None)
            )
            tensors.append(
                KVCacheTensor(
                    size=2 * page * BLOCKS,
                    layers=names,
                    layer_stride=layer_stride,
                    block_stride=block_stride,
                    offset=0,
                )
            )
            groups.append(KVCacheGroupSpec(names, spec))
        config = KVCacheConfig(
            num_blocks=BLOCKS,
            kv_cache_tensors=tensors,
            kv_cache_groups=groups,
            kv_cache_layout=layout.name,
        )
        views = allocate_kv_cache(config, torch.device("cpu"), layout)
        for view in views.values():
            raw = view.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        cache = describe_kv_caches(
            views,
            use_mla=False,
            total_kv_heads=2,
            attn_tp_rank=0,
            attn_tp_size=1,
            block_size=16,
            state_layers=frozenset(mamba_names),
            num_blocks=BLOCKS,
        )
        return views, cache

    (src_views, src), (dst_views, dst) = instance(), instance()
    args = src.kv_args
    assert (args.kv_layout, len(args.kv_buffers), args.kv_buffers[0].item_len) == (
        KVLayout.PAGES,
        1,
        2 * page,
    )
    sent = src.send_contents([[1, 2], [4]], {1})  # attention blocks 1, 2; the state's 4
    loaded = dst.load_contents([[3, 4], [0]], [0, 0], [2, 1], {1})
    assert (sent.pages, loaded.pages) == ([1, 2, 4], [3, 4, 0])
    plan = pair(args, dst.kv_args).plan(args, dst.kv_args, np.array(sent.pages), 0, loaded.pages)
    assert plan.length.tolist() == [2 * 2 * page, 2 * page]
    execute(plan, args, dst.kv_args)
    for names, src_blocks, dst_blocks in (
        (attention_names, [1, 2], [3, 4]),
        (mamba_names, [4], [0]),
    ):
        for name in names:
            assert torch.equal(
                dst_views[name][dst_blocks].view(torch.uint8),
                src_views[name][src_blocks].view(torch.uint8),
            ), name
