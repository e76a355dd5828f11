"""KVArgs: geometry derived from arrays, and clear errors for descriptions that cannot be right."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from kv_cache import rank_cache

from kvbridge.cache import BufferSpec, GeometryError, KVArgs, kv_heads_on_rank
from kvbridge.wire import KVLayout


def test_from_numpy_llama_like_rank() -> None:
    cache = rank_cache(
        layer_ids=tuple(range(4)),
        num_pages=10,
        page_size=16,
        total_kv_heads=8,
        head_dim=128,
        attn_tp_size=2,
        aux_slots=5,
        aux_item_bytes=(64,),
    )
    args = cache.args
    assert args.kv_heads == 4
    assert args.dtype == "bfloat16"
    assert args.page_bytes == 16 * 4 * 128 * 2
    assert args.num_pages == 10
    assert len(args.kv_buffers) == 8
    assert args.kv_buffers[0].ptr == cache.kv[0].ctypes.data
    assert args.aux_buffers[0].item_len == 64
    assert args.aux_buffers[0].num_items == 5


def test_heads_replicate_when_tp_exceeds_them() -> None:
    assert kv_heads_on_rank(8, 16) == 1
    assert kv_heads_on_rank(8, 2) == 4


def test_validation_errors_name_the_problem() -> None:
    args = rank_cache().args
    with pytest.raises(GeometryError, match="needs 4 KV buffers"):
        dataclasses.replace(args, kv_buffers=args.kv_buffers[:3])
    short = BufferSpec(args.kv_buffers[0].ptr, args.kv_buffers[0].length, 7)
    with pytest.raises(GeometryError, match="item_len 7 is not one page"):
        dataclasses.replace(args, kv_buffers=(short, *args.kv_buffers[1:]))
    with pytest.raises(GeometryError, match="dtype 'bf16'"):
        dataclasses.replace(args, dtype="bf16")
    with pytest.raises(GeometryError, match="attn_tp_rank 2 is outside attn_tp_size 2"):
        dataclasses.replace(args, attn_tp_rank=2, attn_tp_size=2)
    with pytest.raises(GeometryError, match="layer_ids repeat"):
        dataclasses.replace(args, layer_ids=(1, 1))
    with pytest.raises(GeometryError, match="MLA has one latent head"):
        dataclasses.replace(args, kv_layout=KVLayout.MLA)
    zero = BufferSpec(0, 64, 64)
    with pytest.raises(GeometryError, match="room for at least one item"):
        dataclasses.replace(args, aux_buffers=(zero,))


def test_from_numpy_refuses_wrong_shapes() -> None:
    kv = [np.zeros((4, 2, 3, 8), np.uint16) for _ in range(2)]
    with pytest.raises(GeometryError, match="hold 3 heads, but 8 heads over attention TP 2"):
        KVArgs.from_numpy(kv, kv_layout=KVLayout.MHA, total_kv_heads=8, attn_tp_size=2)
    with pytest.raises(GeometryError, match="not C-contiguous"):
        KVArgs.from_numpy([a[:, ::2] for a in kv], kv_layout=KVLayout.MHA, total_kv_heads=3)
    with pytest.raises(GeometryError, match=r"\[pages, page_size, heads, head_dim\]"):
        KVArgs.from_numpy([np.zeros((4, 8), np.uint16)], kv_layout=KVLayout.MLA, total_kv_heads=1)


class FakeTensor:
    """The part of torch.Tensor's interface that KVArgs.from_torch reads, over a numpy array
    (torch itself is an optional extra the test environment does not install)."""

    class Device:
        def __init__(self, kind: str, index: int | None) -> None:
            self.type, self.index = kind, index

    def __init__(
        self, array: np.ndarray, dtype: str, device: str = "cpu", index: int | None = None
    ):
        self.array = array
        self.dtype = f"torch.{dtype}"
        self.device = FakeTensor.Device(device, index)
        self.shape = array.shape

    def dim(self) -> int:
        return self.array.ndim

    def is_contiguous(self) -> bool:
        return bool(self.array.flags.c_contiguous)

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def numel(self) -> int:
        return self.array.size

    def element_size(self) -> int:
        return 2


def test_from_torch_reads_pointers_sizes_and_device() -> None:
    arrays = [np.zeros((6, 16, 4, 128), np.uint16) for _ in range(4)]
    tensors = [FakeTensor(a, "bfloat16", "cuda", 1) for a in arrays]
    args = KVArgs.from_torch(tensors, kv_layout=KVLayout.MHA, total_kv_heads=8, attn_tp_size=2)
    assert args.dtype == "bfloat16"
    assert args.memory_kind.name == "VRAM"
    assert args.device_id == 1
    assert args.kv_buffers[2].ptr == arrays[2].ctypes.data
    assert args.kv_buffers[0].length == arrays[0].nbytes
    assert args.num_pages == 6
    cpu = KVArgs.from_torch(
        [FakeTensor(a, "bfloat16") for a in arrays],
        kv_layout=KVLayout.MHA,
        total_kv_heads=8,
        attn_tp_size=2,
    )
    assert cpu.memory_kind.name == "DRAM"


def test_from_torch_with_real_tensors() -> None:
    torch = pytest.importorskip("torch", reason="torch is an optional extra")
    tensors = [torch.zeros((4, 16, 2, 64), dtype=torch.bfloat16) for _ in range(2)]
    args = KVArgs.from_torch(tensors, kv_layout=KVLayout.MHA, total_kv_heads=2)
    assert args.kv_buffers[1].ptr == tensors[1].data_ptr()
    assert args.page_bytes == 16 * 2 * 64 * 2


def test_head_major_pages_hold_k_and_v_of_every_head() -> None:
    # vLLM's CPU cache: one tensor per layer, [blocks, heads, block_size, 2 * head_dim].
    layers = [np.zeros((10, 8, 32, 256), np.uint16) for _ in range(3)]
    args = KVArgs.from_numpy(layers, kv_layout=KVLayout.MHA_HEAD_MAJOR, total_kv_heads=8)
    assert (args.page_size, args.kv_heads, args.head_dim) == (32, 8, 128)
    assert args.layer_ids == (0, 1, 2)
    assert args.page_bytes == 8 * 32 * 256 * 2 == args.kv_buffers[0].item_len
    with pytest.raises(GeometryError, match=r"\[pages, heads, page_size, 2 \* head_dim\]"):
        KVArgs.from_numpy(
            [np.zeros((10, 8, 32, 255), np.uint16)],
            kv_layout=KVLayout.MHA_HEAD_MAJOR,
            total_kv_heads=8,
        )
