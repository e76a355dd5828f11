"""vLLM's KV caches as kvbridge describes them (`vllm_cache`), held against the bytes: views
laid out as vLLM 0.32 lays them (tests/helpers/vllm_views.py; against vLLM's own allocator in
tests/vllm_compat/test_vllm_layouts.py), planned between two instances, executed byte by
byte, and decode's logical tensor compared with prefill's. CUDA cases run where a GPU is."""

from __future__ import annotations

import importlib.util
import itertools

import numpy as np
import pytest

from kvbridge.cache import GeometryError, PlanError
from kvbridge.cache.plan import pair
from kvbridge.cache.topology import rank_heads
from kvbridge.integrations.vllm_cache import (
    NULL_BLOCK,
    Group,
    GroupBlocks,
    GroupKind,
    LoadPlanError,
    VLLMCache,
    blocks_to_load,
    blocks_to_send,
    describe_kv_caches,
    layer_index,
    state_block,
)
from kvbridge.wire import KVLayout

torch_missing = importlib.util.find_spec("torch") is None
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(
        torch_missing or not __import__("torch").cuda.is_available(),
        reason="no CUDA device here")),
]  # fmt: skip
needs_torch = pytest.mark.skipif(torch_missing, reason="torch is not installed")
LAYERS, BLOCKS, HEAD_SIZE = 3, 12, 8


def test_layer_numbers_come_from_vllm_layer_names() -> None:
    assert layer_index("model.layers.12.self_attn.attn") == 12
    assert layer_index("layers.0.attn") == 0
    assert layer_index("model.layers.1.self_attn.0.attn") == 1  # the first, as vLLM reads it
    with pytest.raises(GeometryError, match="no layer number"):
        layer_index("lm_head")


def instance(layout: str, heads: int, tp: int, rank: int, tokens: int, device: str,
             mla: bool = False):  # type: ignore[no-untyped-def]  # fmt: skip
    import torch
    from vllm_views import layer_views

    held = 1 if mla else rank_heads(rank, tp, heads).count
    content = 576 if mla else 2 * HEAD_SIZE
    views = layer_views(LAYERS, BLOCKS, held, tokens, content, torch.bfloat16, layout, device)
    cache = describe_kv_caches(views, use_mla=mla, total_kv_heads=1 if mla else heads,
                               attn_tp_rank=rank, attn_tp_size=tp, block_size=tokens)  # fmt: skip
    return views, cache


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("layout", "expected"), [("LBHNC", KVLayout.MHA_HEAD_MAJOR), ("LBNHC", KVLayout.MHA_KV_PACKED)]
)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (1, 2), (2, 1), (2, 4)])
def test_attention_layouts_move_heads_to_where_decode_reads_them(
    device: str, layout: str, expected: KVLayout, prefill_tp: int, decode_tp: int
) -> None:
    """Every decode rank's [block, head, token, K and V] equals prefill's for the same global
    head, across TP sizes (head slices of vLLM's pages)."""
    from vllm_views import execute

    heads, tokens = 4, 16
    prefill = [instance(layout, heads, prefill_tp, r, tokens, device) for r in range(prefill_tp)]
    src_blocks, dst_blocks = [3, 7, 1], [5, 0, 9]
    for d in range(decode_tp):
        views, cache = instance(layout, heads, decode_tp, d, tokens, device)
        assert cache.kv_args.kv_layout == expected
        for _, src_cache in prefill:
            pairing = pair(src_cache.kv_args, cache.kv_args)
            if pairing.source is not None:
                plan = pairing.plan(src_cache.kv_args, cache.kv_args,
                                    np.array(src_blocks), 0, dst_blocks)  # fmt: skip
                execute(plan, src_cache.kv_args, cache.kv_args)
        mine = rank_heads(d, decode_tp, heads)
        for name, view in views.items():
            for head in range(mine.start, mine.stop):
                owner = head * prefill_tp // heads if prefill_tp <= heads else 0
                theirs = rank_heads(owner, prefill_tp, heads)
                source = prefill[owner][0][name][src_blocks, head - theirs.start]
                assert torch_equal(view[dst_blocks, head - mine.start], source), (name, head)


def torch_equal(a: object, b: object) -> bool:
    import torch

    assert isinstance(a, torch.Tensor)
    assert isinstance(b, torch.Tensor)
    # Bytes, not values: random bytes make NaNs, which equal nothing.
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (1, 2), (2, 1)])
def test_mla_latent_moves_from_one_prefill_rank_to_each_decode_rank(
    device: str, prefill_tp: int, decode_tp: int
) -> None:
    from vllm_views import execute

    prefill = [instance("LBNHC", 1, prefill_tp, r, 16, device, mla=True) for r in range(prefill_tp)]
    for d in range(decode_tp):
        views, cache = instance("LBNHC", 1, decode_tp, d, 16, device, mla=True)
        assert cache.kv_args.kv_layout == KVLayout.MLA
        writers = 0
        for views_p, src in prefill:
            pairing = pair(src.kv_args, cache.kv_args)
            if pairing.source is not None:
                writers += 1
                execute(pairing.plan(src.kv_args, cache.kv_args, np.array([2, 4]), 0, [6, 1]),
                        src.kv_args, cache.kv_args)  # fmt: skip
                expected = views_p
        assert writers == 1  # no byte twice
        for name, view in views.items():
            assert torch_equal(view[[6, 1]], expected[name][[2, 4]])


@needs_torch
def test_mla_moves_between_block_sizes_by_token() -> None:
    """MLA's token rows map between vLLM blocks of 16 and 64 tokens (the CPU and a CUDA
    backend's sizes)."""
    import torch
    from vllm_views import execute

    _, src = instance("LBNHC", 1, 1, 0, 16, "cpu", mla=True)
    src_views = src.kv_args.keepalive
    views, dst = instance("LBNHC", 1, 1, 0, 64, "cpu", mla=True)
    pairing = pair(src.kv_args, dst.kv_args)
    assert not pairing.whole_pages
    plan = pairing.plan(src.kv_args, dst.kv_args, np.array([5, 2, 8, 0, 3]), 0, [4, 1])
    execute(plan, src.kv_args, dst.kv_args)
    for layer, view in enumerate(views.values()):
        tokens = torch.cat([src_views[layer][b, 0] for b in (5, 2, 8, 0, 3)])  # 80 tokens
        got = torch.cat([view[b, 0] for b in (4, 1)])[:80]
        assert torch_equal(got, tokens)


@needs_torch
def test_head_major_pages_between_block_sizes_are_refused_naming_both() -> None:
    _, src = instance("LBHNC", 4, 1, 0, 32, "cpu")
    _, dst = instance("LBHNC", 4, 1, 0, 64, "cpu")
    with pytest.raises(PlanError, match="32 → 64 tokens"):
        pair(src.kv_args, dst.kv_args).plan(src.kv_args, dst.kv_args,
                                            np.array([1]), 0, [2])  # fmt: skip


@needs_torch
def test_kernel_blocks_smaller_than_vllm_blocks_are_pages_of_a_block() -> None:
    views, cache = instance("LBHNC", 4, 1, 0, 16, "cpu")
    cache = describe_kv_caches(views, use_mla=False, total_kv_heads=4, attn_tp_rank=0,
                               attn_tp_size=1, block_size=64)  # fmt: skip
    assert cache.pages_per_block == 4
    assert cache.pages_of([2, 0]) == (8, 9, 10, 11, 0, 1, 2, 3)


@needs_torch
def test_unsupported_views_are_refused_with_the_reason() -> None:
    import torch
    from vllm_views import layer_views

    interleaved = layer_views(2, 4, 2, 16, 16, torch.bfloat16, "BLHNC")
    with pytest.raises(GeometryError, match="block-outermost layout"):
        describe_kv_caches(interleaved, use_mla=False, total_kv_heads=2, attn_tp_rank=0,
                           attn_tp_size=1, block_size=16)  # fmt: skip
    views = layer_views(2, 4, 2, 16, 16, torch.bfloat16, "LBHNC")
    with pytest.raises(GeometryError, match="hold 2 heads, but 8 KV heads over attention TP 2"):
        describe_kv_caches(views, use_mla=False, total_kv_heads=8, attn_tp_rank=0,
                           attn_tp_size=2, block_size=16)  # fmt: skip
    with pytest.raises(GeometryError, match="shape"):
        describe_kv_caches({"layers.0.attn": torch.zeros(6, 32)}, use_mla=False,
                           total_kv_heads=1, attn_tp_rank=0, attn_tp_size=1,
                           block_size=16)  # fmt: skip


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_a_hybrid_models_shared_pages_move_whole(device: str) -> None:
    """The hybrid manager's groups view the same memory: an attention layer and a Mamba
    layer (raw bytes, one page apart) per slot. Whole pages move at equal TP; other TP sizes
    are refused with the reason."""
    import torch
    from vllm_views import execute, layer_views

    def hybrid(rank: int, tp: int) -> tuple[dict[str, torch.Tensor], VLLMCache]:
        views = {}
        for slot in range(2):
            one = layer_views(1, BLOCKS, 4, 16, 2 * HEAD_SIZE, torch.bfloat16, "LBHNC", device)
            attention = next(iter(one.values()))
            page = attention.stride(0) * attention.element_size()
            raw = torch.empty(0, dtype=torch.int8, device=device).set_(
                attention.untyped_storage(), attention.storage_offset() * 2, (BLOCKS, 1, 1, 100),
                (page, 100, 100, 1))  # fmt: skip
            views[f"model.layers.{2 * slot}.mixer"] = raw
            views[f"model.layers.{2 * slot + 1}.self_attn.attn"] = attention
        return views, describe_kv_caches(
            views, use_mla=False, total_kv_heads=4, attn_tp_rank=rank, attn_tp_size=tp,
            block_size=16, state_layers=frozenset({"model.layers.0.mixer", "model.layers.2.mixer"}),
        )  # fmt: skip

    src_views, src = hybrid(0, 1)
    dst_views, dst = hybrid(0, 1)
    assert src.kv_args.kv_layout == KVLayout.PAGES
    assert src.kv_args.layer_ids == (0, 2)
    pairing = pair(src.kv_args, dst.kv_args)
    execute(pairing.plan(src.kv_args, dst.kv_args, np.array([1, 5]), 0, [7, 2]),
            src.kv_args, dst.kv_args)  # fmt: skip
    for name, view in dst_views.items():
        assert torch_equal(view[[7, 2]], src_views[name][[1, 5]])
    _, other = hybrid(0, 2)
    with pytest.raises(PlanError, match="equal TP sizes"):
        pair(src.kv_args, other.kv_args)


FULL, SLIDING = Group(GroupKind.FULL, 4), Group(GroupKind.SLIDING, 4)
STATE = Group(GroupKind.STATE, 64, spec_blocks=2)


def test_prefill_sends_its_computed_blocks_the_window_and_the_state() -> None:
    ids = ([10, 11, 12, 13, 14], [0, 0, 21, 22, 23], [30, 31, 32])
    sent = blocks_to_send([FULL, SLIDING, STATE], ids, num_tokens=17)
    assert sent == [GroupBlocks(0, (10, 11, 12, 13, 14)), GroupBlocks(2, (21, 22, 23)),
                    GroupBlocks(0, (30,))]  # fmt: skip
    assert blocks_to_send([FULL], ([10, 11, 12],), num_tokens=5)[0].blocks == (10, 11)
    # Prefix caching's aligned state: nulls before the state, scratch blocks after it.
    assert state_block([0, 0, 41, 42, 43], spec_blocks=2) == 41
    assert state_block([7], spec_blocks=2) == 7
    assert state_block([NULL_BLOCK], spec_blocks=0) is None
    with pytest.raises(ValueError, match="gap"):
        blocks_to_send([SLIDING], ([0, 5, 0, 6],), num_tokens=16)


def test_decode_loads_past_its_prefix_and_pairs_by_position() -> None:
    sent = [(0, 5), (2, 3), (0, 1)]
    ids = ([50, 51, 52, 53, 54], [0, 0, 0, 62, 63], [70, 71, 72])
    loads = blocks_to_load([FULL, SLIDING, STATE], ids, prefix_tokens=8, num_tokens=9, sent=sent)
    assert [(load.blocks, load.skip) for load in loads] == [
        ((52, 53, 54), 2),  # blocks 2-4: prefill's first two are decode's prefix
        ((62, 63), 1),  # decode's window starts a block later than prefill's held blocks
        ((70,), 0),
    ]
    # Blocks prefill let go of (out of its window) cannot be loaded.
    with pytest.raises(LoadPlanError, match=r"decode needs blocks 1-4, prefill holds 2-4"):
        blocks_to_load([SLIDING], ([0, 61, 62, 63, 64],), 0, 17, [(2, 3)])
    with pytest.raises(LoadPlanError, match="not whole blocks"):
        blocks_to_load([FULL], ([1, 2],), 3, 2, [(0, 2)])
    with pytest.raises(LoadPlanError, match="2 block lists and 1 from prefill"):
        blocks_to_load([FULL, FULL], ([1], [2]), 0, 1, [(0, 1)])
    # One full-attention group may have other block sizes there: the skip counts decode's.
    (load,) = blocks_to_load([FULL], ([1, 2, 3, 4],), 8, 8, [(0, 1)], same_block_size=False)
    assert (load.blocks, load.skip) == ((3, 4), 2)
    with pytest.raises(LoadPlanError, match="block sizes differ"):
        blocks_to_load([SLIDING], ([0, 2],), 4, 4, [(1, 1)], same_block_size=False)


@pytest.mark.parametrize(("prefix", "count"), list(itertools.product((0, 4, 8), (1, 5, 9))))
def test_every_token_decode_loads_comes_from_the_block_prefill_computed_it_in(
    prefix: int, count: int
) -> None:
    """Prefill's and decode's blocks paired by `blocks_to_load`'s skip hold the same tokens
    (full attention, a window of 6 tokens, blocks of 4)."""
    total = prefix + count
    blocks = -(-total // 4)
    prefill_ids = [[100 + j for j in range(blocks)]]
    window_first = max(0, (total - 6 + 1) // 4)
    prefill_ids.append([0] * window_first + [200 + j for j in range(window_first, blocks)])
    sent = blocks_to_send([FULL, SLIDING], prefill_ids, total)
    decode_first = max(prefix // 4, window_first)
    decode_ids = [[300 + j for j in range(blocks)],
                  [0] * decode_first + [400 + j for j in range(decode_first, blocks)]]  # fmt: skip
    loads = blocks_to_load([FULL, SLIDING], decode_ids, prefix, count,
                           [(g.first, len(g.blocks)) for g in sent])  # fmt: skip
    for group, load in zip(sent, loads, strict=True):
        pairs = zip(group.blocks[load.skip :], load.blocks, strict=False)
        for src, dst in pairs:  # the same block position on both sides
            assert src % 100 == dst % 100


@needs_torch
def test_pages_that_are_not_one_block_each_are_refused() -> None:
    """State-only pages laid out block-outermost (each layer's page one page apart within a
    block of every layer) would overlap as buffers; a hybrid's blocks split into kernel
    blocks are not one page a block."""
    import torch

    raw = torch.zeros(4 * 2 * 256, dtype=torch.int8)
    shape = (4, 1, 1, 200)
    interleaved = {f"model.layers.{layer}.mixer": raw[layer * 256 :].as_strided(
        shape, (512, 200, 200, 1)) for layer in range(2)}  # fmt: skip
    names = frozenset(interleaved)
    with pytest.raises(GeometryError, match="overlap"):
        describe_kv_caches(interleaved, use_mla=False, total_kv_heads=1, attn_tp_rank=0,
                           attn_tp_size=1, block_size=16, state_layers=names)  # fmt: skip
    apart = {f"model.layers.{layer}.mixer": raw[layer * 1024 :].as_strided(
        shape, (256, 200, 200, 1)) for layer in range(2)}  # fmt: skip
    cache = describe_kv_caches(apart, use_mla=False, total_kv_heads=1, attn_tp_rank=0,
                               attn_tp_size=1, block_size=16, state_layers=names)  # fmt: skip
    assert cache.kv_args.kv_layout == KVLayout.PAGES
    with pytest.raises(GeometryError, match="splits its 2 blocks into \\[4\\] kernel blocks"):
        describe_kv_caches(apart, use_mla=False, total_kv_heads=1, attn_tp_rank=0,
                           attn_tp_size=1, block_size=16, state_layers=names,
                           num_blocks=2)  # fmt: skip
