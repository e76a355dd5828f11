"""What sglang 0.5.23 makes of a kvbridge message, in the plain form tests/sglang_compat/harness.py
gives sglang's own parse results; and the kvbridge message for a case's builder inputs.

Shared by the golden test of the default suite (tests/unit/test_sglang_goldens.py) and the
live comparison inside sglang's environment (tests/sglang_compat/).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.wire import KVPoll, Message, Receiver, TransferStatus
from kvbridge.wire.messages import ChunkReady, StagingRequest, StagingResponse, Watermark
from kvbridge.wire.sglang import common, mooncake, nixl
from kvbridge.wire.sglang.common import SGLangProfile

GOLDENS = Path(__file__).parents[1] / "goldens" / "sglang-0.5.23.json"
LOCAL_IP = "10.0.0.7"  # the harness's decode host and port
RANK_PORT = 17001
SESSION = "10.0.0.7:15001"

# kind → (profile, the side whose sglang listener receives it)
KINDS: dict[str, tuple[SGLangProfile, Receiver]] = {
    "mooncake-registration": (mooncake.MOONCAKE, Receiver.PREFILL),
    "mooncake-transfer-info": (mooncake.MOONCAKE, Receiver.PREFILL),
    "mooncake-status": (mooncake.MOONCAKE, Receiver.DECODE),
    "nixl-registration": (nixl.NIXL, Receiver.PREFILL),
    "nixl-transfer-info": (nixl.NIXL, Receiver.PREFILL),
    "nixl-status": (nixl.NIXL, Receiver.DECODE),
    "abort": (mooncake.MOONCAKE, Receiver.PREFILL),
    "abort-ack": (mooncake.MOONCAKE, Receiver.DECODE),
    "legacy-abort-ack": (mooncake.MOONCAKE, Receiver.DECODE),
    "chunk-ready": (mooncake.MOONCAKE, Receiver.DECODE),
    "aux-data": (mooncake.MOONCAKE, Receiver.DECODE),
    "staging-req": (mooncake.MOONCAKE, Receiver.DECODE),
    "staging-rsp": (mooncake.MOONCAKE, Receiver.PREFILL),
    "watermark": (mooncake.MOONCAKE, Receiver.PREFILL),
    "bootstrap": (mooncake.MOONCAKE, Receiver.PREFILL),
}


def plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return [int(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value


def fields_of(message: Message, *skip: str) -> dict[str, Any]:
    return {
        item.name: plain(getattr(message, item.name))
        for item in dataclasses.fields(message)  # type: ignore[arg-type]
        if item.name not in skip
    }


def sglang_view(kind: str, message: Message, hint: dict[str, Any]) -> Any:
    """What sglang's parser of this kind should return for the frames of `message`."""
    if isinstance(message, mooncake.KVArgsRegisterInfo):
        view = fields_of(message, "staging_slot_layer_ids")
        view["staging"] = (
            {
                "base_ptr": message.staging_base_ptr,
                "total_size": message.staging_total_size,
                "slot_layer_ids": message.staging_slot_layer_ids,
            }
            if message.staging_registered
            else None
        )
        return view
    if isinstance(message, mooncake.TransferInfo):
        return fields_of(message) | {"is_dummy": message.is_dummy, "staging": None}
    if isinstance(message, nixl.KVArgsRegisterInfo):
        return fields_of(message)
    if isinstance(message, nixl.TransferInfo):
        return fields_of(message, "dummy_rank") | {"is_dummy": message.is_dummy, "staging": None}
    if isinstance(message, TransferStatus):
        return {
            "room": message.room,
            "status": int(message.status),
            "prefill_rank": message.prefill_rank,
            "reason": message.reason or None,
        }
    if isinstance(message, common.AbortNotification):
        address = message.ack_address
        return {
            "room": message.room,
            "decode_ip": address and address[0],
            "decode_port": address and address[1],
            "generation": message.generation if address else None,
        }
    if isinstance(message, common.AbortAck):
        return None if message.prefill_rank is None else fields_of(message)
    if isinstance(message, ChunkReady):
        return {
            "room": message.room,
            "chunk_idx": message.chunk_idx,
            "page_start": message.page_start,
            "num_pages": message.num_pages,
            "writer_id": message.session_id,
        }
    if isinstance(message, common.AuxData):
        return {
            "buffer_index": message.buffer_index,
            "aux_index": message.aux_index,
            "data": message.data.hex(),
        }
    if isinstance(message, StagingRequest):
        pp = message.requester_pp_rank
        return {
            "room": message.room,
            "chunk_idx": message.chunk_idx,
            "chunk_num_pages": message.chunk_num_pages,
            "session_id": message.session_id,
            "answered_pp_ranks": [0, 1, 2, 3] if pp is None else [pp],
        }
    if isinstance(message, StagingResponse):
        if (message.room, message.session_id) != (hint["room"], hint["session_id"]):
            return None
        return fields_of(message)
    if isinstance(message, Watermark):
        # sglang keeps a watermark only above the (0, 0) it starts from.
        if (message.round, message.tail) == (0, 0):
            return {}
        return {message.session_id: [message.round, message.tail]}
    if isinstance(message, common.Bootstrap):
        return {"room": message.room, "endpoint": [message.decode_ip, message.decode_port]}
    raise TypeError(f"no sglang view of {type(message).__name__}")


def _indices(values: list[int] | None) -> np.ndarray[Any, Any] | None:
    return None if values is None else np.array(values, dtype=np.int32)


def expected_message(kind: str, inputs: dict[str, Any], parsed: Any) -> Message:
    """The kvbridge message for the values sglang's builder was given (`parsed` fills in what
    the builder derives: a registration's item length and slot count, a STAGING_REQ's chunk
    geometry)."""
    if kind in ("mooncake-registration", "nixl-registration"):
        cls = (
            mooncake.KVArgsRegisterInfo if kind.startswith("mooncake") else nixl.KVArgsRegisterInfo
        )
        names = {item.name for item in dataclasses.fields(cls)}
        values = {name: value for name, value in parsed.items() if name in names}
        if kind.startswith("mooncake"):
            staging = parsed["staging"]
            values["staging_slot_layer_ids"] = staging["slot_layer_ids"] if staging else []
        else:
            values["agent_metadata"] = bytes.fromhex(values["agent_metadata"])
        return cls(**values)  # type: ignore[no-any-return]
    if kind == "mooncake-transfer-info":
        dummy = inputs["is_dummy"]
        return mooncake.TransferInfo(
            room=inputs["room"],
            endpoint=LOCAL_IP,
            dst_port=RANK_PORT,
            mooncake_session_id=SESSION,
            dst_kv_indices=_indices([] if dummy else inputs["kv_indices"]),
            dst_aux_index=None if dummy else inputs["aux_index"],
            dst_state_indices=[] if dummy else inputs["state_indices"],
            required_dst_info_num=inputs["required_dst_info_num"],
            decode_prefix_len=inputs["decode_prefix_len"] or 0,
            dst_device_kv_indices=None if dummy else _indices(inputs.get("device_kv_indices")),
        )
    if kind == "nixl-transfer-info":
        dummy = inputs["is_dummy"]
        states = inputs["state_indices"]
        return nixl.TransferInfo(
            room=inputs["room"],
            endpoint=LOCAL_IP,
            dst_port=RANK_PORT,
            agent_name=inputs["agent_name"],
            dst_kv_indices=_indices([] if dummy else inputs["kv_indices"]),
            dst_aux_index=inputs["aux_index"],
            required_dst_info_num=inputs["required_dst_info_num"],
            dst_state_indices=[] if dummy or states is None else states,
            decode_prefix_len=inputs["decode_prefix_len"] or 0,
            dummy_rank=dummy,
        )
    if kind in ("mooncake-status", "nixl-status"):
        return TransferStatus(
            inputs["room"],
            KVPoll(inputs["status"]),
            inputs["prefill_rank"],
            inputs["reason"] or "",
        )
    if kind == "abort":
        return common.AbortNotification(**inputs)
    if kind == "abort-ack":
        return common.AbortAck(**inputs)
    if kind == "legacy-abort-ack":
        return common.AbortAck(inputs["room"])
    if kind == "chunk-ready":
        return ChunkReady(
            inputs["room"],
            inputs["chunk_idx"],
            inputs["page_start"],
            inputs["num_pages"],
            inputs["writer_id"],
            inputs["prefill_rank"],
        )
    if kind == "aux-data":
        return common.AuxData.of(
            inputs["room"],
            inputs["buffer_index"],
            inputs["aux_index"],
            bytes.fromhex(inputs["data"]),
        )
    if kind == "staging-req":
        return StagingRequest(
            parsed["room"],
            parsed["chunk_idx"],
            parsed["chunk_num_pages"],
            parsed["session_id"],
            requester_pp_rank=inputs["pp_rank"],
        )
    if kind == "staging-rsp":
        never = inputs["never_fits"]
        offset, round_ = (-2, 0) if never else (inputs["offset"], inputs["round"])
        return StagingResponse(
            inputs["room"],
            inputs["chunk_idx"],
            offset,
            round_,
            -1 if never else offset + 4096,
            inputs["session_id"],
        )
    if kind == "watermark":
        return Watermark(inputs["round"], inputs["tail"], inputs["session_id"])
    if kind == "bootstrap":
        return common.Bootstrap(inputs["room"], LOCAL_IP, inputs["decode_port"])
    raise KeyError(kind)
