"""A decode rank's geometry as sglang 0.5.23's Mooncake registration carries it
(`build_receiver_registration_message`): buffer addresses and one page's bytes per buffer.
sglang's prefill assumes the rest (page size, dtype, head size and count) equal to its own; the
decode rank checked page size and dtype against the group's settings before it registers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvbridge.cache.spec import KVArgs
from kvbridge.wire.sglang.mooncake import KVArgsRegisterInfo


def sglang_registration_for(
    args: KVArgs, *, host: str, control_port: int, session_id: str
) -> KVArgsRegisterInfo:
    """The registration a decode rank sends each SGLang prefill rank it reads from. KV buffers
    pair by position (K of every layer, then V: kvbridge's order is sglang's), so no layer ids
    are sent; no staging ring (sglang stages only on GPUs)."""
    if args.state_buffers:
        raise ValueError("state buffers toward an SGLang prefill are not supported yet")
    return KVArgsRegisterInfo(
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
