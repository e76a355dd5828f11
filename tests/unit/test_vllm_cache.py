"""vLLM's KV caches as kvbridge describes them (`vllm_cache`), held against the bytes: views
laid out as vLLM 0.32 lays them (tests/helpers/vllm_views.py; against vLLM's own allocator in
tests/vllm_compat/test_vllm_layouts.py), planned between two instances, executed byte by
byte, and decode's logical tensor compared with prefill's. CUDA cases run where a GPU is."""

from __future__ import annotations

import importlib.util
import itertools
from typing import Any

import numpy as np
import pytest
from kv_cache import rank_cache

from kvbridge.cache import GeometryError, PlanError
from kvbridge.cache.pairing import pair
from kvbridge.cache.plan import plan_slots, plan_state_slices
from kvbridge.cache.topology import rank_heads, topology
from kvbridge.core.room import Destination, Unpaired
from kvbridge.integrations.vllm_blocks import (
    NULL_BLOCK,
    Group,
    GroupBlocks,
    GroupKind,
    LoadPlanError,
    blocks_to_load,
    blocks_to_send,
    decode_first_layout,
    from_position_zero,
    state_block,
)
from kvbridge.integrations.vllm_cache import RoomContents, VLLMCache
from kvbridge.integrations.vllm_kv_views import MambaState, describe_kv_caches, layer_index
from kvbridge.wire import KVLayout, TransferRequest

torch_missing = importlib.util.find_spec("torch") is None
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            torch_missing or not __import__("torch").cuda.is_available(),
            reason="no CUDA device here",
        ),
    ),
]
needs_torch = pytest.mark.skipif(torch_missing, reason="torch is not installed")
LAYERS, BLOCKS, HEAD_SIZE = 3, 12, 8


def test_one_room_moves_every_group_and_decode_skips_what_it_has() -> None:
    # vLLM blocks of 16 tokens in kernel blocks (kvbridge pages) of 8: two pages a block.
    args = rank_cache(
        num_pages=64,
        seed=None,
        layer_ids=(0,),
        page_size=8,
        total_kv_heads=1,
        head_dim=4,
        state_slots=4,
        state_item_bytes=(16,),
    ).args
    cache = VLLMCache(args, pages_per_block=2, state_slots=True)
    # Prefill: the groups' blocks one after another; a state group's block is a slot.
    sent = cache.send_contents([[5], [7, 8], [9]], {0})
    assert sent == RoomContents([14, 15, 16, 17, 18, 19], [5], positional=True)
    assert cache.send_contents([[1], [7]], set()) == RoomContents([2, 3, 14, 15], [], 0, True)
    assert not cache.send_contents([[1], [7]], {1}).positional  # one group of pages
    # Decode pairs its blocks with prefill's positions: a group's blocks before decode's
    # (skips) and past them (prefill sends more) are skipped; leading ones are the prefix.
    load = cache.load_contents([[5], [20], [30]], [0, 1, 0], [1, 2, 1], {0})
    assert load == RoomContents([40, 41, 60, 61], [5], prefix_tokens=16)
    load = cache.load_contents([[5], [20], [30]], [0, 0, 1], [1, 3, 2], {0})
    assert load == RoomContents([40, 41, -1, -1, -1, -1, -1, -1, 60, 61], [5])
    # The last group's positions past decode's blocks are not marked (decode's last block is
    # prefill's last: blocks_to_load).
    assert cache.load_contents([[20]], [0], [3], set()) == RoomContents([40, 41], [])


@pytest.mark.parametrize("prefill_window_first", [0, 1, 2, 3])
def test_decode_first_pairs_a_sliding_windows_blocks_by_position_or_refuses(
    prefill_window_first: int,
) -> None:
    """Decode first, full attention and a sliding window (blocks of 4 tokens, 14 tokens):
    both sides lay the room out from position 0; prefill marks the window blocks it dropped
    (its window moved with its chunks), decode skips the ones before its own window. Every
    page decode needs comes from the block at its position, or the room is refused: never
    a null block's bytes."""
    groups, tokens = (Group(GroupKind.FULL, 4), Group(GroupKind.SLIDING, 4)), 14
    args = rank_cache(
        num_pages=64, seed=None, layer_ids=(0,), page_size=4, total_kv_heads=1, head_dim=4
    ).args
    cache = VLLMCache(args)
    prefill_ids = (
        [10, 11, 12, 13],
        [0] * prefill_window_first + [20, 21, 22, 23][prefill_window_first:],
    )
    sent = blocks_to_send(groups, prefill_ids, tokens)
    moving = from_position_zero(groups, sent, tokens)
    src = np.array(cache.send_contents(moving, set()).pages)
    decode_window_first = 2  # decode's window: its last two blocks
    decode_ids = ([30, 31, 32, 33], [0, 0, 42, 43])
    layout = decode_first_layout(groups, tokens)
    loads = blocks_to_load(groups, decode_ids, 0, tokens, layout)
    contents = cache.load_contents(
        [load.blocks for load in loads],
        [load.skip for load in loads],
        [c for _, c in layout],
        set(),
    )
    request = TransferRequest(1, "d", False, np.array(contents.pages, np.int32), 0, [], 1)
    destination = Destination.of(request, aligned=True)
    if prefill_window_first > decode_window_first:
        with pytest.raises(Unpaired, match="position 6 of its pages"):
            destination.pair(0, src)
        return
    pages, first = destination.pair(0, src)
    assert first == 0
    assert dict(zip(destination.pages.tolist(), pages.tolist(), strict=True)) == {
        30: 10,
        31: 11,
        32: 12,
        33: 13,
        42: 22,
        43: 23,
    }


def test_layer_numbers_come_from_vllm_layer_names() -> None:
    assert layer_index("model.layers.12.self_attn.attn") == 12
    assert layer_index("layers.0.attn") == 0
    assert layer_index("model.layers.1.self_attn.0.attn") == 1  # the first, as vLLM reads it
    with pytest.raises(GeometryError, match="no layer number"):
        layer_index("lm_head")


@needs_torch
def test_every_attention_layer_is_placed_at_its_buffers_position() -> None:
    """KV cache groups that share memory (a sliding-window group and a full one, as vLLM's
    hybrid manager lays them out): one buffer per shared view, and each layer of every group
    placed at it, so that a layer-wise write can wait for the group it streams."""
    import torch
    from vllm_views import layer_views

    views = layer_views(2, BLOCKS, 2, 4, 2 * HEAD_SIZE, torch.bfloat16, "LBHNC")
    first, second = views.values()
    shared = {
        "model.layers.0.attn": first,  # sliding
        "model.layers.1.attn": first,  # full
        "model.layers.2.attn": second,
        "model.layers.3.attn": second,
    }
    cache = describe_kv_caches(
        shared, use_mla=False, total_kv_heads=2, attn_tp_rank=0, attn_tp_size=1, block_size=4
    )
    assert cache.kv_args.layer_ids == (0, 2)
    assert cache.layer_positions == {
        "model.layers.0.attn": 0,
        "model.layers.1.attn": 0,
        "model.layers.2.attn": 1,
        "model.layers.3.attn": 1,
    }


def instance(
    layout: str, heads: int, tp: int, rank: int, tokens: int, device: str, mla: bool = False
):  # type: ignore[no-untyped-def]
    import torch
    from vllm_views import layer_views

    held = 1 if mla else rank_heads(rank, tp, heads).count
    content = 576 if mla else 2 * HEAD_SIZE
    views = layer_views(LAYERS, BLOCKS, held, tokens, content, torch.bfloat16, layout, device)
    cache = describe_kv_caches(
        views,
        use_mla=mla,
        total_kv_heads=1 if mla else heads,
        attn_tp_rank=rank,
        attn_tp_size=tp,
        block_size=tokens,
    )
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
                plan = pairing.plan(
                    src_cache.kv_args, cache.kv_args, np.array(src_blocks), 0, dst_blocks
                )
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
                execute(
                    pairing.plan(src.kv_args, cache.kv_args, np.array([2, 4]), 0, [6, 1]),
                    src.kv_args,
                    cache.kv_args,
                )
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
        pair(src.kv_args, dst.kv_args).plan(src.kv_args, dst.kv_args, np.array([1]), 0, [2])


@needs_torch
def test_kernel_blocks_smaller_than_vllm_blocks_are_pages_of_a_block() -> None:
    views, cache = instance("LBHNC", 4, 1, 0, 16, "cpu")
    cache = describe_kv_caches(
        views, use_mla=False, total_kv_heads=4, attn_tp_rank=0, attn_tp_size=1, block_size=64
    )
    assert cache.pages_per_block == 4
    assert cache.pages_of([2, 0]) == (8, 9, 10, 11, 0, 1, 2, 3)


@needs_torch
def test_unsupported_views_are_refused_with_the_reason() -> None:
    import torch
    from vllm_views import layer_views

    interleaved = layer_views(2, 4, 2, 16, 16, torch.bfloat16, "BLHNC")
    with pytest.raises(GeometryError, match="views hold 4 blocks of its 8"):
        describe_kv_caches(
            interleaved,
            use_mla=False,
            total_kv_heads=2,
            attn_tp_rank=0,
            attn_tp_size=1,
            block_size=16,
            num_blocks=8,
        )
    two_strides = {**interleaved, **layer_views(1, 8, 2, 16, 16, torch.bfloat16, "BLHNC", "cpu", 5)}
    two_strides["model.layers.5.self_attn.attn"] = interleaved["model.layers.0.self_attn.attn"][:2]
    with pytest.raises(GeometryError, match="not as a block-outermost layout"):
        describe_kv_caches(
            two_strides,
            use_mla=False,
            total_kv_heads=2,
            attn_tp_rank=0,
            attn_tp_size=1,
            block_size=16,
        )
    views = layer_views(2, 4, 2, 16, 16, torch.bfloat16, "LBHNC")
    with pytest.raises(GeometryError, match="hold 2 heads, but 8 KV heads over attention TP 2"):
        describe_kv_caches(
            views, use_mla=False, total_kv_heads=8, attn_tp_rank=0, attn_tp_size=2, block_size=16
        )
    with pytest.raises(GeometryError, match="shape"):
        describe_kv_caches(
            {"layers.0.attn": torch.zeros(6, 32)},
            use_mla=False,
            total_kv_heads=1,
            attn_tp_rank=0,
            attn_tp_size=1,
            block_size=16,
        )


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("use_mla", [False, True])
def test_a_block_outermost_cache_moves_every_layer_in_one_descriptor_per_run(
    device: str, layout: str, use_mla: bool
) -> None:
    """vLLM's cross-layer layouts (every layer's page of a block side by side): one buffer
    whose page is a whole block of every layer, so a run of blocks is one descriptor for all
    layers (against one per layer and run laid out layer by layer), and each layer's blocks
    arrive byte for byte."""
    import torch
    from vllm_views import execute, layer_views

    heads, content = (1, 16) if use_mla else (2, 16)
    caches = []
    for _ in range(2):
        views = layer_views(LAYERS, BLOCKS, heads, 16, content, torch.bfloat16, layout, device)
        cache = describe_kv_caches(
            views,
            use_mla=use_mla,
            total_kv_heads=heads,
            attn_tp_rank=0,
            attn_tp_size=1,
            block_size=16,
            num_blocks=BLOCKS,
        )
        caches.append((views, cache))
    (src_views, src), (dst_views, dst) = caches
    args = src.kv_args
    page = heads * 16 * content * 2
    assert (args.kv_layout, len(args.kv_buffers), args.head_dim) == (
        KVLayout.PAGES,
        1,
        LAYERS * page,
    )
    assert args.kv_buffers[0].ptr == min(int(v.data_ptr()) for v in src_views.values())
    assert (src.pages_per_block, src.layer_positions) == (1, {})
    src_blocks, dst_blocks = [4, 5, 6, 9], [0, 1, 2, 7]
    plan = pair(args, dst.kv_args).plan(args, dst.kv_args, np.array(src_blocks), 0, dst_blocks)
    assert plan.length.tolist() == [3 * LAYERS * page, LAYERS * page]
    execute(plan, args, dst.kv_args)
    for name, view in dst_views.items():
        assert torch_equal(view[dst_blocks], src_views[name][src_blocks]), name
    untouched = [b for b in range(BLOCKS) if b not in dst_blocks]
    assert not any(
        view[untouched].view(torch.uint8).eq(src_views[name][untouched].view(torch.uint8)).all()
        for name, view in dst_views.items()
    )
    layer_outer = describe_kv_caches(
        layer_views(LAYERS, BLOCKS, heads, 16, content, torch.bfloat16, "LBHNC", device),
        use_mla=use_mla,
        total_kv_heads=heads,
        attn_tp_rank=0,
        attn_tp_size=1,
        block_size=16,
    ).kv_args
    with pytest.raises(PlanError, match="KV layouts differ"):
        pair(layer_outer, dst.kv_args).plan(
            layer_outer, dst.kv_args, np.array(src_blocks), 0, dst_blocks
        )


# A Mamba-2 layer of the hybrid tests: 4 heads of dim 2, one B/C group of state size 3, a
# conv kernel of 4 (3 rows of conv state kept).
M_HEADS, M_HEAD_DIM, M_GROUPS, M_STATE, M_ROWS = 4, 2, 1, 3, 3


def mamba_truth(seed: int) -> tuple[Any, Any]:
    """Model-wide conv states ``[blocks, rows, x | B | C]`` (bfloat16) and SSM states
    ``[blocks, heads, head dim, state]`` (float32) of one layer."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    channels = M_HEADS * M_HEAD_DIM + 2 * M_GROUPS * M_STATE
    conv = torch.randn(BLOCKS, M_ROWS, channels, generator=generator).to(torch.bfloat16)
    ssm = torch.randn(BLOCKS, M_HEADS, M_HEAD_DIM, M_STATE, generator=generator)
    return conv, ssm


def mamba_page(conv: Any, ssm: Any, rank: int, tp: int) -> Any:
    """Each block's state bytes on one rank, as vLLM's Mamba-2 mixer shards and packs them."""
    import torch

    heads, groups = rank_heads(rank, tp, M_HEADS), rank_heads(rank, tp, M_GROUPS)
    x = M_HEADS * M_HEAD_DIM
    b, c = x, x + M_GROUPS * M_STATE
    local = torch.cat(
        [
            conv[..., heads.start * M_HEAD_DIM : heads.stop * M_HEAD_DIM],
            conv[..., b + groups.start * M_STATE : b + groups.stop * M_STATE],
            conv[..., c + groups.start * M_STATE : c + groups.stop * M_STATE],
        ],
        dim=-1,
    )
    state = ssm[:, heads.start : heads.stop]
    return torch.cat(
        [
            local.contiguous().view(torch.uint8).flatten(1),
            state.contiguous().view(torch.uint8).flatten(1),
        ],
        dim=1,
    )


@needs_torch
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_a_mamba_hybrids_state_moves_as_slots_beside_its_attention(
    device: str, prefill_tp: int, decode_tp: int
) -> None:
    """The hybrid manager's groups view the same memory: per slot an attention layer and a
    Mamba-2 layer (raw bytes in the same pages). The attention keeps its geometry (head
    slices between TP sizes); a state block moves as a state slot, its conv state's x, B and
    C and its SSM state split as each rank holds them (B and C replicated over TP 2)."""
    import torch
    from vllm_views import execute, layer_views

    conv, ssm = mamba_truth(7)

    def hybrid(rank: int, tp: int, fill: bool) -> tuple[dict[str, torch.Tensor], VLLMCache]:
        views = {}
        page_bytes = mamba_page(conv, ssm, rank, tp)
        for slot in range(2):
            one = layer_views(
                1, BLOCKS, 4 // tp, 16, 2 * HEAD_SIZE, torch.bfloat16, "LBHNC", device
            )
            attention = next(iter(one.values()))
            page = attention.stride(0) * attention.element_size()
            used = page_bytes.shape[1]
            raw = torch.empty(0, dtype=torch.int8, device=device).set_(
                attention.untyped_storage(),
                attention.storage_offset() * 2,
                (BLOCKS, 1, 1, used),
                (page, used, used, 1),
            )
            raw.view(torch.uint8)[:, 0, 0] = page_bytes.to(device) if fill else 0
            views[f"model.layers.{2 * slot}.mixer"] = raw
            views[f"model.layers.{2 * slot + 1}.self_attn.attn"] = attention
        heads = rank_heads(rank, tp, M_HEADS).count
        mamba = MambaState(
            (M_ROWS, heads * M_HEAD_DIM + 2 * M_STATE), (heads, M_HEAD_DIM, M_STATE), 2, 4, M_GROUPS
        )
        return views, describe_kv_caches(
            views,
            use_mla=False,
            total_kv_heads=4,
            attn_tp_rank=rank,
            attn_tp_size=tp,
            block_size=16,
            state_layers=frozenset({"model.layers.0.mixer", "model.layers.2.mixer"}),
            mamba=mamba,
        )

    prefill = [hybrid(rank, prefill_tp, fill=True) for rank in range(prefill_tp)]
    args = prefill[0][1].kv_args
    assert (args.kv_layout, args.layer_ids) == (KVLayout.MHA_HEAD_MAJOR, (1, 3))
    assert prefill[0][1].send_contents([[5], [7, 8]], {0}) == RoomContents([7, 8], [5])
    mapping = topology(prefill_tp, decode_tp, 4, KVLayout.MHA_HEAD_MAJOR)
    for rank in range(decode_tp):
        dst_views, dst = hybrid(rank, decode_tp, fill=False)
        senders = [source.prefill_rank for source in mapping.route(rank).sources]
        for sender in senders:
            src = prefill[sender][1]
            pairing = pair(src.kv_args, dst.kv_args)
            execute(
                pairing.plan(src.kv_args, dst.kv_args, np.array([1, 5]), 0, [7, 2]),
                src.kv_args,
                dst.kv_args,
            )
            plan = (
                plan_slots(src.kv_args.state_buffers, dst.kv_args.state_buffers, 4, 9, "state")
                if prefill_tp == decode_tp
                else plan_state_slices(src.kv_args, dst.kv_args, 4, 9, senders)
            )
            execute(plan, src.kv_args, dst.kv_args)
        expected = mamba_page(conv, ssm, rank, decode_tp)[4]
        heads = rank_heads(rank, decode_tp, 4)
        for name, view in dst_views.items():
            if "mixer" in name:
                assert torch_equal(view.view(torch.uint8)[9, 0, 0], expected)
                assert not view[[0, 3]].any()  # no other slot written
                continue
            for local, head in enumerate(range(heads.start, heads.stop)):
                # every head decode holds, from the prefill rank that holds it
                holder = head * prefill_tp // 4
                offset = head - rank_heads(holder, prefill_tp, 4).start
                assert torch_equal(view[[7, 2], local], prefill[holder][0][name][[1, 5], offset])


def test_a_mamba_state_that_is_not_x_b_and_c_is_refused() -> None:
    wrong = MambaState((M_ROWS, 20), (M_HEADS, M_HEAD_DIM, M_STATE), 2, 4, M_GROUPS)
    with pytest.raises(GeometryError, match="is not x"):
        wrong.parts(0, 1)


FULL, SLIDING = Group(GroupKind.FULL, 4), Group(GroupKind.SLIDING, 4)
STATE = Group(GroupKind.STATE, 64, spec_blocks=2)


def test_prefill_sends_its_computed_blocks_the_window_and_the_state() -> None:
    ids = ([10, 11, 12, 13, 14], [0, 0, 21, 22, 23], [30, 31, 32])
    sent = blocks_to_send([FULL, SLIDING, STATE], ids, num_tokens=17)
    assert sent == [
        GroupBlocks(0, (10, 11, 12, 13, 14)),
        GroupBlocks(2, (21, 22, 23)),
        GroupBlocks(0, (30,)),
    ]
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
    decode_ids = [
        [300 + j for j in range(blocks)],
        [0] * decode_first + [400 + j for j in range(decode_first, blocks)],
    ]
    loads = blocks_to_load(
        [FULL, SLIDING], decode_ids, prefix, count, [(g.first, len(g.blocks)) for g in sent]
    )
    for group, load in zip(sent, loads, strict=True):
        pairs = zip(group.blocks[load.skip :], load.blocks, strict=False)
        for src, dst in pairs:  # the same block position on both sides
            assert src % 100 == dst % 100


@needs_torch
def test_pages_that_are_not_one_block_each_are_refused() -> None:
    """State-only pages laid out block-outermost (each layer's page one page apart within a
    block of every layer) are one buffer of whole blocks; a hybrid's blocks split into kernel
    blocks are not one page a block."""
    import torch

    raw = torch.zeros(4 * 2 * 256, dtype=torch.int8)
    shape = (4, 1, 1, 200)
    interleaved = {
        f"model.layers.{layer}.mixer": raw[layer * 256 :].as_strided(shape, (512, 200, 200, 1))
        for layer in range(2)
    }
    names = frozenset(interleaved)
    block_outermost = describe_kv_caches(
        interleaved,
        use_mla=False,
        total_kv_heads=1,
        attn_tp_rank=0,
        attn_tp_size=1,
        block_size=16,
        state_layers=names,
    ).kv_args
    assert [(b.ptr, b.length, b.item_len) for b in block_outermost.kv_buffers] == [
        (raw.data_ptr(), 4 * 512, 512)
    ]
    short = torch.zeros(1700, dtype=torch.int8)  # the last block's padding is not there
    past_the_end = {
        name: short[layer * 256 :].as_strided((3, 1, 1, 200), (600, 200, 200, 1))
        for layer, name in enumerate(interleaved)
    }
    with pytest.raises(GeometryError, match="3 blocks of 600 B run past its memory"):
        describe_kv_caches(
            past_the_end,
            use_mla=False,
            total_kv_heads=1,
            attn_tp_rank=0,
            attn_tp_size=1,
            block_size=16,
            state_layers=names,
        )
    apart = {
        f"model.layers.{layer}.mixer": raw[layer * 1024 :].as_strided(shape, (256, 200, 200, 1))
        for layer in range(2)
    }
    cache = describe_kv_caches(
        apart,
        use_mla=False,
        total_kv_heads=1,
        attn_tp_rank=0,
        attn_tp_size=1,
        block_size=16,
        state_layers=names,
    )
    assert cache.kv_args.kv_layout == KVLayout.PAGES
    with pytest.raises(GeometryError, match="splits its 2 blocks into \\[4\\] kernel blocks"):
        describe_kv_caches(
            apart,
            use_mla=False,
            total_kv_heads=1,
            attn_tp_rank=0,
            attn_tp_size=1,
            block_size=16,
            state_layers=names,
            num_blocks=2,
        )
