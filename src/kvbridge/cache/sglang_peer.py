"""A decode rank's geometry as sglang 0.5.23's registration carries it
(`build_receiver_registration_message`): buffer addresses and one page's bytes per buffer;
over NIXL also the decode agent, each buffer's page count and memory kind. sglang's prefill
assumes the rest (page size, dtype, head size and count) equal to its own; the
decode rank checked page size and dtype against the group's settings before it registers.
Both ways here: a kvbridge decode's registration toward an SGLang prefill, and an SGLang
decode's read by a kvbridge prefill."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvbridge.cache.spec import KVArgs
from kvbridge.wire.messages import MemoryKind
from kvbridge.wire.native import Registration
from kvbridge.wire.sglang import mooncake, nixl


def sglang_registration_for(
    args: KVArgs, *, host: str, control_port: int, session_id: str
) -> mooncake.KVArgsRegisterInfo:
    """The registration a decode rank sends each SGLang prefill rank it reads from. KV buffers
    pair by position (K of every layer, then V: kvbridge's order is sglang's), so no layer ids
    are sent; no staging ring (sglang stages only on GPUs)."""
    if args.state_buffers:
        raise ValueError("state buffers toward an SGLang prefill are not supported yet")
    return mooncake.KVArgsRegisterInfo(
        room="None",
        endpoint=host,
        dst_port=control_port,
        mooncake_session_id=session_id,
        dst_kv_ptrs=[buffer.ptr for buffer in args.kv_buffers],
        dst_aux_ptrs=[buffer.ptr for buffer in args.aux_buffers],
        dst_state_data_ptrs=[],
        dst_tp_rank=args.attn_tp_rank,
        dst_attn_tp_size=args.attn_tp_size,
        dst_kv_item_len=args.kv_buffers[0].item_len if args.kv_buffers else 0,
        dst_kv_item_lens=[buffer.item_len for buffer in args.kv_buffers],
    )


def sglang_nixl_registration_for(
    args: KVArgs, *, host: str, control_port: int, agent_name: str, agent_metadata: bytes
) -> nixl.KVArgsRegisterInfo:
    """The registration a decode rank sends each SGLang NIXL prefill rank it reads from: its
    NIXL agent (the prefill adds it from the metadata and names it as the metadata does),
    the buffers as for Mooncake, the pages each holds (`dst_num_slots`: sglang prepares its
    descriptors for that many) and their memory kind."""
    if args.state_buffers:
        raise ValueError("state buffers toward an SGLang prefill are not supported yet")
    kind = "VRAM" if args.memory_kind == MemoryKind.VRAM else "DRAM"
    return nixl.KVArgsRegisterInfo(
        room="None",
        endpoint=host,
        dst_port=control_port,
        agent_name=agent_name,
        agent_metadata=agent_metadata,
        dst_kv_ptrs=[buffer.ptr for buffer in args.kv_buffers],
        dst_aux_ptrs=[buffer.ptr for buffer in args.aux_buffers],
        dst_state_data_ptrs=[],
        gpu_id=args.device_id,
        decode_tp_size=args.attn_tp_size,
        decode_tp_rank=args.attn_tp_rank,
        dst_kv_item_len=args.kv_buffers[0].item_len if args.kv_buffers else 0,
        dst_num_slots=min(buffer.length // buffer.item_len for buffer in args.kv_buffers),
        dst_kv_mem_kinds=[kind] * len(args.kv_buffers),
        dst_kv_item_lens=[buffer.item_len for buffer in args.kv_buffers],
    )


def sglang_request_problem(
    args: KVArgs,
    pages: npt.NDArray[np.int32],
    aux_index: int | None,
    state_indices: Sequence[int],
) -> str | None:
    """Why a room's request cannot go to an SGLang prefill as given (None: it can). sglang's
    prefill never learns decode's buffer sizes and checks no index: it writes wherever it is
    told, an aux slot for every request included."""
    if state_indices:
        return "state slots toward an SGLang prefill are not supported yet"
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
    if info.dst_state_data_ptrs or own.state_buffers:
        raise ValueError("state slots toward an SGLang decode are not supported yet")
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
    )
    registration.check()  # a FieldValueError is a ValueError
    return registration
