"""KV-cache geometry of one rank: which buffers hold what, and how big a page is.

Pure: pointers are plain integers. `KVArgs.from_numpy` and `KVArgs.from_torch` build one from
arrays the way a serving engine integrates; nothing here touches memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.cache.topology import TopologyError, rank_heads
from kvbridge.wire.messages import KVLayout, MemoryKind

# Bytes per element of the dtypes KV caches use, by the names torch and numpy give them.
DTYPE_SIZES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class GeometryError(ValueError):
    """A KV-cache description that cannot be right: the message says which part and why."""


@dataclass(frozen=True)
class BufferSpec:
    """One registered buffer: its address, its size, and the bytes of one item in it (a page
    of one layer's K or V, an aux slot, a state slot)."""

    ptr: int
    length: int
    item_len: int

    @property
    def num_items(self) -> int:
        return self.length // self.item_len

    @property
    def end(self) -> int:
        return self.ptr + self.length


@dataclass(frozen=True)
class StatePart:
    """A run of a state slot's bytes that TP shards on its own: `units` units of `unit_bytes`
    at byte `offset` of the slot, this rank's share (as `rank_heads` deals KV heads, replicas
    included) of `total_units` model-wide. A Mamba-2 conv state holds three (x, B, C: B and C
    replicate when TP exceeds their groups), its SSM state one (heads)."""

    offset: int
    units: int
    unit_bytes: int
    total_units: int

    @property
    def nbytes(self) -> int:
        return self.units * self.unit_bytes

    def flat(self) -> tuple[int, int, int, int]:
        """As the native registration carries it."""
        return (self.offset, self.units, self.unit_bytes, self.total_units)


def kv_heads_on_rank(total_kv_heads: int, attn_tp_size: int) -> int:
    """KV heads one attention-TP rank holds; heads replicate when TP exceeds them."""
    return max(1, total_kv_heads // attn_tp_size)


def _rank_heads(kv_layout: KVLayout, total_kv_heads: int, attn_tp_size: int) -> int:
    # MLA's latent is identical on every rank: no head split; opaque pages are per rank.
    if not kv_layout.head_sliceable:
        return total_kv_heads
    return kv_heads_on_rank(total_kv_heads, attn_tp_size)


def _check_array_heads(
    heads: int, kv_layout: KVLayout, total_kv_heads: int, attn_tp_size: int
) -> None:
    expected = _rank_heads(kv_layout, total_kv_heads, attn_tp_size)
    if heads != expected:
        raise GeometryError(
            f"KV arrays hold {heads} heads, but {total_kv_heads} heads over attention TP "
            f"{attn_tp_size} gives {expected} per rank"
        )


@dataclass(frozen=True)
class KVArgs:
    """One rank's KV cache, aux (metadata) and state buffers, and their geometry.

    ``kv_buffers`` follows SGLang's order: MHA has the K buffer of every layer (in
    ``layer_ids`` order), then the V buffer of every layer; MLA one latent buffer per layer.
    A KV buffer is ``[page][token][head][dim]``; its ``item_len`` is one page.
    """

    kv_layout: KVLayout
    layer_ids: tuple[int, ...]
    total_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    kv_buffers: tuple[BufferSpec, ...]
    attn_tp_rank: int = 0
    attn_tp_size: int = 1
    aux_buffers: tuple[BufferSpec, ...] = ()
    state_buffers: tuple[BufferSpec, ...] = ()
    memory_kind: MemoryKind = MemoryKind.DRAM
    device_id: int = 0
    # Decode context parallelism: global token i lives on DCP rank i % dcp_size.
    dcp_rank: int = 0
    dcp_size: int = 1
    # Per state buffer, the local size of its TP-sharded dimension, the outermost of a slot
    # (e.g. a Mamba state [heads, head_dim, state]: its heads on this rank). Needed to move
    # state between different TP sizes; empty: state moves only as whole slots at equal TP.
    state_dims: tuple[int, ...] = ()
    # Per state buffer, the parts of a slot and how TP shards each (`StatePart`); overrides
    # `state_dims` (one part of `state_dims[i]` rows) where a slot holds several sharded runs.
    state_parts: tuple[tuple[StatePart, ...], ...] = ()
    # Decode's staging ring (heterogeneous TP): prefill writes staged chunks here.
    staging_buffer: BufferSpec | None = None
    # The torch tensors behind `kv_buffers` (from_torch only): what torch staging kernels run
    # on. Not part of the geometry (never compared, sent or printed).
    kv_tensors: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    # Every array or tensor the buffers point into (from_numpy, from_torch): held here so that
    # registered memory lives as long as this description, whatever the caller keeps.
    keepalive: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    # `layer_range`'s narrowed views, made once each.
    _layer_ranges: dict[tuple[int, int], KVArgs] = field(
        default_factory=dict, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        self.validate()

    # Cached (the fields are frozen): planning asks for these on every write.
    @cached_property
    def kv_heads(self) -> int:
        """KV heads held by this rank."""
        return _rank_heads(self.kv_layout, self.total_kv_heads, self.attn_tp_size)

    @property
    def dtype_size(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @cached_property
    def head_bytes(self) -> int:
        """Bytes of one head of one token (K or V)."""
        return self.head_dim * self.dtype_size

    @cached_property
    def token_bytes(self) -> int:
        """Bytes of one token in one KV buffer (its K and V with MHA_HEAD_MAJOR)."""
        return self.kv_layout.kv_in_page * self.kv_heads * self.head_bytes

    @cached_property
    def page_bytes(self) -> int:
        """Bytes of one page in one KV buffer: every KV buffer's item_len."""
        return self.page_size * self.token_bytes

    @cached_property
    def state_layouts(self) -> tuple[tuple[StatePart, ...], ...] | None:
        """Each state buffer's slot as parts that TP shards; None: no description, so state
        moves only as whole slots between equal TP sizes."""
        if self.state_parts:
            return self.state_parts
        if not self.state_dims:
            return None
        return tuple(
            (StatePart(0, dim, buffer.item_len // dim, dim * self.attn_tp_size),)
            for dim, buffer in zip(self.state_dims, self.state_buffers, strict=True)
        )

    @property
    def buffers_per_layer(self) -> int:
        return self.kv_layout.buffers_per_layer

    @cached_property
    def num_pages(self) -> int:
        """Pages every KV buffer can hold."""
        return min(buffer.num_items for buffer in self.kv_buffers)

    @cached_property
    def kv_ptrs(self) -> npt.NDArray[np.uint64]:
        """Every KV buffer's address, in `kv_buffers` order (read-only)."""
        ptrs = np.array([buffer.ptr for buffer in self.kv_buffers], dtype=np.uint64)
        ptrs.flags.writeable = False
        return ptrs

    @cached_property
    def layer_positions(self) -> dict[int, int]:
        """Each layer id's position in `layer_ids`."""
        return {layer: position for position, layer in enumerate(self.layer_ids)}

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def layer_range(self, start: int, stop: int) -> KVArgs:
        """This rank's KV cache narrowed to the layers at positions `start`..`stop - 1` (a
        layer-wise write plans only those; the rest of the geometry is the same). Cached: a
        forward asks for the same ranges on every request."""
        if not 0 <= start < stop <= self.num_layers:
            raise GeometryError(
                f"layers {start}..{stop - 1} are not a range of this rank's {self.num_layers}"
            )
        key = (start, stop)
        narrowed = self._layer_ranges.get(key)
        if narrowed is None:
            layers = self.num_layers
            spans = [
                slice(part * layers + start, part * layers + stop)
                for part in range(self.buffers_per_layer)
            ]
            narrowed = replace(
                self,
                layer_ids=self.layer_ids[start:stop],
                kv_buffers=tuple(b for span in spans for b in self.kv_buffers[span]),
                kv_tensors=tuple(t for span in spans for t in self.kv_tensors[span]),
                _layer_ranges={},
            )
            self._layer_ranges[key] = narrowed
        return narrowed

    def validate(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise GeometryError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
        for name in ("total_kv_heads", "head_dim", "page_size", "attn_tp_size"):
            if getattr(self, name) < 1:
                raise GeometryError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.dcp_rank < self.dcp_size:
            raise GeometryError(f"dcp_rank {self.dcp_rank} is outside dcp_size {self.dcp_size}")
        if not 0 <= self.attn_tp_rank < self.attn_tp_size:
            raise GeometryError(
                f"attn_tp_rank {self.attn_tp_rank} is outside attn_tp_size {self.attn_tp_size}"
            )
        if self.kv_layout == KVLayout.MLA and self.total_kv_heads != 1:
            raise GeometryError(f"MLA has one latent head, got {self.total_kv_heads} heads")
        if self.kv_layout == KVLayout.PAGES and (self.total_kv_heads, self.page_size) != (1, 1):
            raise GeometryError(
                "PAGES describes a page as one item: total_kv_heads and page_size must be 1, "
                f"got {self.total_kv_heads} and {self.page_size}"
            )
        if self.kv_layout.head_sliceable:
            heads, tp = self.total_kv_heads, self.attn_tp_size
            if (heads % tp if tp <= heads else tp % heads) != 0:
                raise GeometryError(
                    f"{heads} KV heads cannot be split over attention TP {tp}: TP must divide "
                    f"the heads, or be a multiple of them (replicas)"
                )
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise GeometryError(f"layer_ids repeat: {list(self.layer_ids)}")
        expected = self.buffers_per_layer * len(self.layer_ids)
        if len(self.kv_buffers) != expected:
            raise GeometryError(
                f"{self.kv_layout.name} with {len(self.layer_ids)} layers needs {expected} KV "
                f"buffers ({self.buffers_per_layer} per layer), got {len(self.kv_buffers)}"
            )
        kv_pair = " × 2 (K and V)" if self.kv_layout.kv_in_page == 2 else ""
        for index, buffer in enumerate(self.kv_buffers):
            if buffer.item_len != self.page_bytes:
                raise GeometryError(
                    f"KV buffer {index}: item_len {buffer.item_len} is not one page "
                    f"({self.page_size} tokens × {self.kv_heads} heads × {self.head_dim} × "
                    f"{self.dtype_size} B{kv_pair} = {self.page_bytes})"
                )
        if self.state_dims:
            if len(self.state_dims) != len(self.state_buffers):
                raise GeometryError(
                    f"{len(self.state_dims)} state dimensions for {len(self.state_buffers)} "
                    "state buffers"
                )
            for index, (dim, buffer) in enumerate(
                zip(self.state_dims, self.state_buffers, strict=True)
            ):
                if dim < 1 or buffer.item_len % dim:
                    raise GeometryError(
                        f"state buffer {index}: a slot of {buffer.item_len} B does not split "
                        f"into {dim} rows of its sharded dimension"
                    )
        if self.state_parts:
            self._validate_state_parts()
        staging = (self.staging_buffer,) if self.staging_buffer is not None else ()
        for kind, buffers in (
            ("KV", self.kv_buffers),
            ("aux", self.aux_buffers),
            ("state", self.state_buffers),
            ("staging", staging),
        ):
            for index, buffer in enumerate(buffers):
                if buffer.ptr <= 0 or buffer.item_len <= 0 or buffer.length < buffer.item_len:
                    raise GeometryError(
                        f"{kind} buffer {index}: needs a non-zero address and room for at least "
                        f"one item of {buffer.item_len} B, got ptr {buffer.ptr:#x}, length "
                        f"{buffer.length}"
                    )

    def _validate_state_parts(self) -> None:
        if len(self.state_parts) != len(self.state_buffers):
            raise GeometryError(
                f"{len(self.state_parts)} state part lists for {len(self.state_buffers)} state "
                "buffers"
            )
        for index, (parts, buffer) in enumerate(
            zip(self.state_parts, self.state_buffers, strict=True)
        ):
            end = 0
            for part in parts:
                if min(part.units, part.unit_bytes, part.total_units) < 1 or part.offset < end:
                    raise GeometryError(
                        f"state buffer {index}: part {part} is empty or overlaps the one before"
                    )
                try:
                    held = rank_heads(self.attn_tp_rank, self.attn_tp_size, part.total_units)
                except TopologyError as exc:
                    raise GeometryError(f"state buffer {index}: {exc}") from None
                if held.count != part.units:
                    raise GeometryError(
                        f"state buffer {index}: {part.total_units} units over attention TP "
                        f"{self.attn_tp_size} give rank {self.attn_tp_rank} {held.count}, "
                        f"the part holds {part.units}"
                    )
                end = part.offset + part.nbytes
            if end > buffer.item_len:
                raise GeometryError(
                    f"state buffer {index}: parts end at byte {end} of a {buffer.item_len} B slot"
                )

    @staticmethod
    def from_numpy(
        kv: Sequence[npt.NDArray[Any]],
        *,
        kv_layout: KVLayout,
        layer_ids: Sequence[int] | None = None,
        total_kv_heads: int,
        attn_tp_rank: int = 0,
        attn_tp_size: int = 1,
        aux: Sequence[npt.NDArray[Any]] = (),
        state: Sequence[npt.NDArray[Any]] = (),
        state_dims: Sequence[int] = (),
    ) -> KVArgs:
        """From contiguous arrays shaped ``[pages, page_size, heads, head_dim]`` (KV; with
        MHA_HEAD_MAJOR ``[pages, heads, page_size, 2 * head_dim]``) and ``[slots, ...]`` (aux,
        state), in `KVArgs`' buffer order."""
        if not kv:
            raise GeometryError("no KV arrays given")
        first = kv[0]
        page_size, heads, head_dim = _page_shape(kv_layout, tuple(first.shape), "arrays")
        per_layer = kv_layout.buffers_per_layer
        layers = tuple(layer_ids) if layer_ids is not None else tuple(range(len(kv) // per_layer))
        _check_array_heads(heads, kv_layout, total_kv_heads, attn_tp_size)
        return KVArgs(
            kv_layout=kv_layout,
            layer_ids=layers,
            total_kv_heads=total_kv_heads,
            head_dim=head_dim,
            dtype=_numpy_dtype_name(first),
            page_size=page_size,
            kv_buffers=tuple(_numpy_buffer(array, "KV") for array in kv),
            attn_tp_rank=attn_tp_rank,
            attn_tp_size=attn_tp_size,
            aux_buffers=tuple(_numpy_buffer(array, "aux") for array in aux),
            state_buffers=tuple(_numpy_buffer(array, "state") for array in state),
            state_dims=tuple(state_dims),
            keepalive=(*kv, *aux, *state),
        )

    @staticmethod
    def from_torch(
        kv: Sequence[Any],
        *,
        kv_layout: KVLayout,
        layer_ids: Sequence[int] | None = None,
        total_kv_heads: int,
        attn_tp_rank: int = 0,
        attn_tp_size: int = 1,
        aux: Sequence[Any] = (),
        state: Sequence[Any] = (),
        state_dims: Sequence[int] = (),
    ) -> KVArgs:
        """From torch tensors (CPU or CUDA), shaped as for `from_numpy`."""
        if not kv:
            raise GeometryError("no KV tensors given")
        first = kv[0]
        page_size, heads, head_dim = _page_shape(
            kv_layout, tuple(int(n) for n in first.shape), "tensors"
        )
        per_layer = kv_layout.buffers_per_layer
        layers = tuple(layer_ids) if layer_ids is not None else tuple(range(len(kv) // per_layer))
        _check_array_heads(heads, kv_layout, total_kv_heads, attn_tp_size)
        on_gpu = first.device.type == "cuda"
        return KVArgs(
            kv_layout=kv_layout,
            layer_ids=layers,
            total_kv_heads=total_kv_heads,
            head_dim=head_dim,
            dtype=str(first.dtype).removeprefix("torch."),
            page_size=page_size,
            kv_buffers=tuple(_torch_buffer(tensor, "KV") for tensor in kv),
            kv_tensors=tuple(kv),
            keepalive=(*kv, *aux, *state),
            attn_tp_rank=attn_tp_rank,
            attn_tp_size=attn_tp_size,
            aux_buffers=tuple(_torch_buffer(tensor, "aux") for tensor in aux),
            state_buffers=tuple(_torch_buffer(tensor, "state") for tensor in state),
            state_dims=tuple(state_dims),
            memory_kind=MemoryKind.VRAM if on_gpu else MemoryKind.DRAM,
            device_id=int(first.device.index or 0) if on_gpu else 0,
        )


def _page_shape(kv_layout: KVLayout, shape: tuple[int, ...], what: str) -> tuple[int, int, int]:
    """(page_size, heads, head_dim) of a KV array or tensor of this layout."""
    if kv_layout == KVLayout.MHA_HEAD_MAJOR:
        if len(shape) != 4 or shape[3] % 2:
            raise GeometryError(
                f"MHA_HEAD_MAJOR KV {what} are [pages, heads, page_size, 2 * head_dim], got "
                f"shape {shape}"
            )
        return shape[2], shape[1], shape[3] // 2
    if len(shape) != 4:
        raise GeometryError(f"KV {what} are [pages, page_size, heads, head_dim], got shape {shape}")
    return shape[1], shape[2], shape[3]


def _numpy_dtype_name(array: npt.NDArray[Any]) -> str:
    # numpy has no bfloat16: callers keep bf16 caches as uint16/int16 (same bytes).
    if array.dtype in (np.uint16, np.int16):
        return "bfloat16"
    name = str(array.dtype)
    if name not in DTYPE_SIZES:
        raise GeometryError(f"unsupported KV dtype {name}")
    return name


def _numpy_buffer(array: npt.NDArray[Any], kind: str) -> BufferSpec:
    if not array.flags.c_contiguous:
        raise GeometryError(f"{kind} array of shape {array.shape} is not C-contiguous")
    if array.shape[0] == 0:
        raise GeometryError(f"{kind} array of shape {array.shape} has no items")
    return BufferSpec(
        ptr=int(array.ctypes.data), length=array.nbytes, item_len=array.nbytes // array.shape[0]
    )


def _torch_buffer(tensor: Any, kind: str) -> BufferSpec:
    if not tensor.is_contiguous():
        raise GeometryError(f"{kind} tensor of shape {tuple(tensor.shape)} is not contiguous")
    if tensor.shape[0] == 0:
        raise GeometryError(f"{kind} tensor of shape {tuple(tensor.shape)} has no items")
    length = tensor.numel() * tensor.element_size()
    return BufferSpec(ptr=int(tensor.data_ptr()), length=length, item_len=length // tensor.shape[0])
