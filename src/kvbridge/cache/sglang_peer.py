"""A decode rank's geometry as sglang 0.5.23's registration carries it
(`build_receiver_registration_message`): buffer addresses and one page's bytes per buffer;
over NIXL also the decode agent, each buffer's page count and memory kind. sglang's prefill
assumes the rest (page size, dtype, head size and count) equal to its own; the
decode rank checked page size and dtype against the group's settings before it registers.
Both ways here: a kvbridge decode's registration toward an SGLang prefill, and an SGLang
decode's read by a kvbridge prefill."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from kvbridge.cache.spec import KVArgs, StatePart
from kvbridge.cache.topology import rank_heads
from kvbridge.wire.messages import MemoryKind
from kvbridge.wire.native import Registration
from kvbridge.wire.sglang import mooncake, nixl


def sglang_registration_for(
    args: KVArgs, *, host: str, control_port: int, session_id: str
) -> mooncake.KVArgsRegisterInfo:
    """The registration a decode rank sends each SGLang prefill rank it reads from. KV buffers
    pair by position (K of every layer, then V: kvbridge's order is sglang's), so no layer ids
    are sent; state buffers are one Mamba component, paired by position too; no staging ring
    (sglang stages only on GPUs)."""
    return mooncake.KVArgsRegisterInfo(
        room="None",
        endpoint=host,
        dst_port=control_port,
        mooncake_session_id=session_id,
        dst_kv_ptrs=[buffer.ptr for buffer in args.kv_buffers],
        dst_aux_ptrs=[buffer.ptr for buffer in args.aux_buffers],
        dst_state_data_ptrs=_state_component(args, "ptr"),
        dst_tp_rank=args.attn_tp_rank,
        dst_attn_tp_size=args.attn_tp_size,
        dst_kv_item_len=args.kv_buffers[0].item_len if args.kv_buffers else 0,
        dst_state_item_lens=_state_component(args, "item_len"),
        dst_state_dim_per_tensor=_state_dims(args),
        dst_kv_item_lens=[buffer.item_len for buffer in args.kv_buffers],
    )


def sglang_nixl_registration_for(
    args: KVArgs, *, host: str, control_port: int, agent_name: str, agent_metadata: bytes
) -> nixl.KVArgsRegisterInfo:
    """The registration a decode rank sends each SGLang NIXL prefill rank it reads from: its
    NIXL agent (the prefill adds it from the metadata and names it as the metadata does),
    the buffers as for Mooncake, the pages each holds (`dst_num_slots`: sglang prepares its
    descriptors for that many) and their memory kind; state as for Mooncake, with each
    buffer's size."""
    kind = "VRAM" if args.memory_kind == MemoryKind.VRAM else "DRAM"
    return nixl.KVArgsRegisterInfo(
        room="None",
        endpoint=host,
        dst_port=control_port,
        agent_name=agent_name,
        agent_metadata=agent_metadata,
        dst_kv_ptrs=[buffer.ptr for buffer in args.kv_buffers],
        dst_aux_ptrs=[buffer.ptr for buffer in args.aux_buffers],
        dst_state_data_ptrs=_state_component(args, "ptr"),
        gpu_id=args.device_id,
        decode_tp_size=args.attn_tp_size,
        decode_tp_rank=args.attn_tp_rank,
        dst_kv_item_len=args.kv_buffers[0].item_len if args.kv_buffers else 0,
        dst_num_slots=min(buffer.length // buffer.item_len for buffer in args.kv_buffers),
        dst_kv_mem_kinds=[kind] * len(args.kv_buffers),
        dst_kv_item_lens=[buffer.item_len for buffer in args.kv_buffers],
        dst_state_item_lens=_state_component(args, "item_len"),
        dst_state_dim_per_tensor=_state_dims(args),
        dst_state_data_lens=_state_component(args, "length"),
    )


def _state_component(args: KVArgs, attribute: str) -> list[list[int]]:
    """One attribute of every state buffer, as sglang's one Mamba component (none: no list)."""
    if not args.state_buffers:
        return []
    return [[getattr(buffer, attribute) for buffer in args.state_buffers]]


def _state_dims(args: KVArgs) -> list[list[int]]:
    """Each state buffer's local TP-sharded size as sglang publishes it
    (`state_dim_per_tensor`): the units of a slot's parts, which sglang's prefill slices by its
    own sub-blocks (a GDN conv state's q/k/v); empty where the rank gave none."""
    layouts = args.state_layouts
    if layouts is None:
        return []
    return [[sum(part.units for part in parts) for parts in layouts]]


def sglang_request_problem(
    args: KVArgs,
    pages: npt.NDArray[np.int32],
    aux_index: int | None,
    state_indices: Sequence[int],
) -> str | None:
    """Why a room's request cannot go to an SGLang prefill as given (None: it can). sglang's
    prefill never learns decode's buffer sizes and checks no index: it writes wherever it is
    told, an aux slot for every request included, and its Mamba state into one slot."""
    if state_indices or args.state_buffers:
        slots = min((buffer.num_items for buffer in args.state_buffers), default=0)
        if len(state_indices) != 1 or not 0 <= state_indices[0] < slots:
            return (
                f"one state slot in 0..{slots - 1} is needed: an SGLang prefill writes its "
                "Mamba state into one slot per room"
                if slots
                else "state slots given, but this rank has no state buffers"
            )
    held = min(buffer.length // buffer.item_len for buffer in args.kv_buffers)
    if pages.size and (int(pages.min()) < 0 or int(pages.max()) >= held):
        return (
            f"page indices must be in 0..{held - 1} toward an SGLang prefill (it checks none, "
            "and has no skipped page)"
        )
    if args.aux_buffers:
        slots = min(buffer.length // buffer.item_len for buffer in args.aux_buffers)
        if aux_index is None or not 0 <= aux_index < slots:
            return f"an aux slot in 0..{slots - 1} is needed: an SGLang prefill writes one per room"
    return None


# sglang's registration carries no buffer sizes: a decode buffer counts as holding any page an
# int32 index names (sglang's prefill checks no index either; the engine refuses an address
# outside what decode registered with it).
UNKNOWN_ITEMS = 2**31


def decode_registration_from_sglang(
    info: mooncake.KVArgsRegisterInfo | nixl.KVArgsRegisterInfo, own: KVArgs, engine: str
) -> Registration:
    """An SGLang decode rank's registration as a kvbridge one, its geometry filled in as
    sglang's prefill fills it: page size, dtype, head size and count equal to this rank's
    (decode checked page size and dtype against the group at its bootstrap); aux slots of
    this rank's sizes. ValueError where the registration cannot be served (it says
    something this rank does not move)."""
    if info.dst_dcp_size != 1:
        raise ValueError(f"decode context parallelism ({info.dst_dcp_size}) is not supported")
    kv_item_lens = info.dst_kv_item_lens or [info.dst_kv_item_len] * len(info.dst_kv_ptrs)
    held = [UNKNOWN_ITEMS] * len(kv_item_lens)
    if isinstance(info, nixl.KVArgsRegisterInfo):
        peer_id, descriptor = info.agent_name, info.agent_metadata
        tp_rank, tp_size = info.decode_tp_rank, info.decode_tp_size
        kinds = set(info.dst_kv_mem_kinds or ["VRAM"])  # sglang's default: VRAM
        if kinds != {"DRAM"}:
            raise ValueError(
                f"KV in {'/'.join(sorted(kinds))} memory: toward an SGLang NIXL decode only "
                "host memory (DRAM) is served yet"
            )
        if info.dst_num_slots:  # NIXL says how many pages each buffer holds
            held = [info.dst_num_slots] * len(kv_item_lens)
    else:
        peer_id, descriptor = info.mooncake_session_id, info.mooncake_session_id.encode()
        tp_rank, tp_size = info.dst_tp_rank, info.dst_attn_tp_size
    aux_item_lens = [buffer.item_len for buffer in own.aux_buffers][: len(info.dst_aux_ptrs)]
    state = _peer_state(info, own, tp_rank, tp_size)
    registration = Registration(
        peer_id=peer_id,
        host=info.endpoint,
        control_port=info.dst_port,
        engine=engine,
        engine_descriptor=descriptor,
        tp_rank=tp_rank,
        attn_tp_size=tp_size,
        dcp_rank=0,
        dcp_size=1,
        kv_layout=own.kv_layout,
        total_kv_heads=own.total_kv_heads,
        head_dim=own.head_dim,
        dtype=own.dtype,
        page_size=own.page_size,
        kv_layer_ids=list(info.dst_kv_layer_ids or own.layer_ids),
        kv_ptrs=list(info.dst_kv_ptrs),
        kv_item_lens=kv_item_lens,
        kv_lengths=[item_len * pages for item_len, pages in zip(kv_item_lens, held, strict=True)],
        aux_ptrs=list(info.dst_aux_ptrs[: len(aux_item_lens)]),
        aux_item_lens=aux_item_lens,
        aux_lengths=[item_len * UNKNOWN_ITEMS for item_len in aux_item_lens],
        state_ptrs=state.ptrs,
        state_item_lens=state.item_lens,
        state_lengths=state.lengths,
        state_dim_per_tensor=state.dims,
        state_parts=state.parts,
    )
    registration.check()  # a FieldValueError is a ValueError
    return registration


@dataclass(frozen=True)
class PeerState:
    """A peer's state buffers as the native registration's fields carry them."""

    ptrs: list[list[int]] = field(default_factory=list)
    item_lens: list[list[int]] = field(default_factory=list)
    lengths: list[list[int]] = field(default_factory=list)
    dims: list[list[int]] = field(default_factory=list)
    parts: list[list[int]] = field(default_factory=list)


def _peer_state(
    info: mooncake.KVArgsRegisterInfo | nixl.KVArgsRegisterInfo,
    own: KVArgs,
    tp_rank: int,
    tp_size: int,
) -> PeerState:
    """An SGLang decode rank's state buffers as the native registration's fields: its one
    Mamba component, buffer for buffer beside this rank's (sglang pairs them by position), its
    slot sizes and sliced sizes as it published them. A slot of several parts (this rank's
    `state_parts`) is cut by the decode rank's TP as this rank's is, each part keeping its
    model-wide units, checked against the sliced size the decode rank published."""
    components = info.dst_state_data_ptrs
    if len(components) > 1:
        raise ValueError(
            f"{len(components)} state components (sglang's SWA, DSA and other state pools): "
            "kvbridge moves one, a Mamba state"
        )
    ptrs = components[0] if components else []
    if len(ptrs) != len(own.state_buffers):
        raise ValueError(
            f"the SGLang decode registered {len(ptrs)} state buffers, this rank moves "
            f"{len(own.state_buffers)} (a model with another state, or none?)"
        )
    if not ptrs:
        return PeerState()
    if isinstance(info, nixl.KVArgsRegisterInfo):
        raise ValueError(
            "sglang's NIXL decode registers its state buffers as GPU memory: toward it only "
            "host memory is served yet"
        )
    item_lens = (info.dst_state_item_lens or [[b.item_len for b in own.state_buffers]])[0]
    lengths = [item_len * UNKNOWN_ITEMS for item_len in item_lens]  # Mooncake sends no sizes
    dims = info.dst_state_dim_per_tensor[0] if info.dst_state_dim_per_tensor else []
    state = PeerState([list(ptrs)], [list(item_lens)], [list(lengths)])
    if not own.state_parts:
        return replace(state, dims=[list(dims)] if dims else [])
    parts = [_parts_on_rank(own_parts, tp_rank, tp_size) for own_parts in own.state_parts]
    for index, (rank_parts, dim) in enumerate(zip(parts, dims, strict=False)):
        if sum(part.units for part in rank_parts) != dim:
            raise ValueError(
                f"state buffer {index}: the SGLang decode rank holds {dim} units of its slot, "
                f"this rank's parts cut by TP {tp_size} give "
                f"{sum(part.units for part in rank_parts)}"
            )
    return replace(state, parts=[[n for part in cut for n in part.flat()] for cut in parts])


def _parts_on_rank(parts: tuple[StatePart, ...], rank: int, tp_size: int) -> list[StatePart]:
    """A slot's parts as attention-TP rank `rank` of `tp_size` holds them."""
    cut, offset = [], 0
    for part in parts:
        units = rank_heads(rank, tp_size, part.total_units).count
        cut.append(StatePart(offset, units, part.unit_bytes, part.total_units))
        offset += units * part.unit_bytes
    return cut
