"""`sglang-mooncake`: SGLang's Mooncake-backend messages, byte for byte.

Layouts follow ``shared/reference/sglang-wire.md`` (registration with the staging ring at
frames 14/15 and DCP at 16/17). Field names are SGLang's, so code written against SGLang's
``KVArgsRegisterInfo.from_zmq`` reads the same here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.wire import codecs as c
from kvbridge.wire.errors import WireError
from kvbridge.wire.layout import Field, Layout
from kvbridge.wire.messages import (
    Abort,
    AbortAck,
    ChunkReady,
    KVPoll,
    StagingRequest,
    StagingResponse,
    StagingRing,
    TransferStatus,
    Watermark,
    check_dcp,
    check_port,
    check_staging,
)
from kvbridge.wire.profile import Profile, require_frames
from kvbridge.wire.sglang import STAGING_FIELDS, ZmqMessage, check_aux_index

PROFILE = "sglang-mooncake"
REGISTRATION_ROOM = "None"


@dataclass(eq=False)
class KVArgsRegisterInfo(ZmqMessage, StagingRing):
    """Decode → prefill, once per peer: where the decode rank's buffers are."""

    room: str
    endpoint: str
    dst_port: int
    mooncake_session_id: str
    dst_kv_ptrs: list[int]
    dst_aux_ptrs: list[int]
    dst_state_data_ptrs: list[list[int]]
    dst_tp_rank: int
    dst_attn_tp_size: int
    dst_kv_item_len: int
    dst_state_item_lens: list[list[int]] = field(default_factory=list)
    dst_state_dim_per_tensor: list[list[int]] = field(default_factory=list)
    dst_kv_layer_ids: list[int] = field(default_factory=list)
    dst_state_layer_ids: list[list[int]] = field(default_factory=list)
    staging_base_ptr: int = 0
    staging_total_size: int = 0
    dst_dcp_size: int = 1
    dst_dcp_rank: int = 0

    def check(self) -> None:
        check_port(self.dst_port, "dst_port")
        check_staging(self.staging_base_ptr, self.staging_total_size)
        check_dcp(self.dst_dcp_size, self.dst_dcp_rank, "dst_dcp_size", "dst_dcp_rank")


KVArgsRegisterInfo.LAYOUT = REGISTER_INFO = Layout(
    PROFILE,
    "KVArgsRegisterInfo",
    KVArgsRegisterInfo,
    (
        Field("room", c.ASCII, "always 'None' for a registration; any ASCII accepted"),
        Field("endpoint", c.ASCII, "decode host IP"),
        Field("dst_port", c.ASCII_UINT, "decode rank's control port"),
        Field("mooncake_session_id", c.ASCII, "decode's Mooncake session 'host:rpc_port'"),
        Field("dst_kv_ptrs", c.POINTERS, "base address of each KV buffer"),
        Field("dst_aux_ptrs", c.POINTERS, "base address of each aux (metadata) buffer"),
        Field("dst_state_data_ptrs", c.POINTER_LISTS, "state buffer addresses; b'' = []"),
        Field("dst_tp_rank", c.ASCII_UINT, "decode TP rank"),
        Field("dst_attn_tp_size", c.ASCII_UINT, "decode attention-TP size"),
        Field("dst_kv_item_len", c.ASCII_UINT, "bytes of one page of one KV buffer"),
        Field("dst_state_item_lens", c.U32_LISTS, default_factory=list),
        Field("dst_state_dim_per_tensor", c.U32_LISTS, default_factory=list),
        Field(
            "dst_kv_layer_ids",
            c.U32_LIST,
            "layer id of each KV buffer; [] = pair buffers by position",
            default_factory=list,
        ),
        Field("dst_state_layer_ids", c.U32_LISTS, default_factory=list),
        *STAGING_FIELDS,
        Field("dst_dcp_size", c.ASCII_UINT, "decode context-parallel size", default=1),
        Field("dst_dcp_rank", c.ASCII_UINT, "decode context-parallel rank", default=0),
    ),
    doc="Registration (decode → prefill, once per peer).",
)


@dataclass(eq=False)
class TransferInfo(ZmqMessage):
    """Decode → prefill, per room and target prefill rank: which pages to fill."""

    room: int
    endpoint: str
    dst_port: int
    mooncake_session_id: str
    dst_kv_indices: npt.NDArray[np.int32]
    dst_aux_index: int | None
    dst_state_indices: list[list[int]]
    required_dst_info_num: int
    decode_prefix_len: int | None = None

    @property
    def is_dummy(self) -> bool:
        """This prefill rank sends nothing for the room and only reports completion."""
        return len(self.dst_kv_indices) == 0 and self.dst_aux_index is None

    def check(self) -> None:
        check_port(self.dst_port, "dst_port")
        check_aux_index(self.dst_kv_indices, self.dst_aux_index)


TransferInfo.LAYOUT = TRANSFER_INFO = Layout(
    PROFILE,
    "TransferInfo",
    TransferInfo,
    (
        Field("room", c.ASCII_UINT),
        Field("endpoint", c.ASCII, "decode host IP"),
        Field("dst_port", c.ASCII_UINT, "decode rank's control port"),
        Field("mooncake_session_id", c.ASCII),
        Field("dst_kv_indices", c.INT32_ARRAY, "destination page indices; b'' for a dummy"),
        Field(
            "dst_aux_index",
            c.ASCII_UINT,
            "aux slot; b'' for a dummy",
            default=None,
            send_default_empty=True,
        ),
        Field("dst_state_indices", c.I32_LISTS, "state slots; b'' = []"),
        Field("required_dst_info_num", c.ASCII_UINT, "transfer requests this prefill rank awaits"),
        Field(
            "decode_prefix_len",
            c.ASCII_UINT,
            "tokens decode already holds; missing = None",
            default=None,
            empty_is_default=False,
            omit_default=True,
        ),
    ),
    doc="Per-request transfer request (decode → prefill). A dummy has frames 4 and 5 empty.",
)

TRANSFER_STATUS = Layout(
    PROFILE,
    "TransferStatus",
    TransferStatus,
    (
        Field("room", c.ASCII_UINT),
        Field("status", c.AsciiEnum(KVPoll)),
        Field("prefill_rank", c.ASCII_UINT),
    ),
    doc="Transfer status (prefill → decode): exactly three ascii integers.",
)


def _tag(tag: bytes) -> Field:
    return Field("tag", c.Constant(tag), f"always {tag.decode()}")


CONTROL_TAGS: dict[bytes, Layout[Any]] = {
    b"ABORT": Layout(
        PROFILE,
        "ABORT",
        Abort,
        (
            _tag(b"ABORT"),
            Field("room", c.ASCII_UINT),
            Field("decode_ip", c.ASCII),
            Field("decode_port", c.ASCII_UINT),
        ),
        doc="Decode aborts a room (decode → prefill).",
    ),
    b"ABORT_ACK": Layout(
        PROFILE,
        "ABORT_ACK",
        AbortAck,
        (_tag(b"ABORT_ACK"), Field("room", c.ASCII_UINT), Field("prefill_rank", c.ASCII_UINT)),
        doc="Prefill confirms an abort (prefill → decode).",
    ),
    b"STAGING_REQ": Layout(
        PROFILE,
        "STAGING_REQ",
        StagingRequest,
        (
            _tag(b"STAGING_REQ"),
            Field("room", c.ASCII_UINT),
            Field("chunk_idx", c.ASCII_UINT),
            Field("chunk_num_pages", c.ASCII_UINT),
            Field("session_id", c.ASCII),
        ),
        doc="Prefill asks for staging-ring space for a chunk (prefill → decode).",
    ),
    b"STAGING_RSP": Layout(
        PROFILE,
        "STAGING_RSP",
        StagingResponse,
        (
            _tag(b"STAGING_RSP"),
            Field("room", c.ASCII_UINT),
            Field("chunk_idx", c.ASCII_UINT),
            Field("offset", c.ASCII_INT, "ring offset; -2 = the chunk can never fit"),
            Field("round", c.ASCII_UINT),
            Field("end", c.ASCII_UINT),
            Field("session_id", c.ASCII),
        ),
        doc="Decode grants ring space (decode → prefill).",
    ),
    b"WATERMARK": Layout(
        PROFILE,
        "WATERMARK",
        Watermark,
        (
            _tag(b"WATERMARK"),
            Field("round", c.ASCII_UINT),
            Field("tail", c.ASCII_UINT),
            Field("session_id", c.ASCII),
        ),
        doc="Decode frees ring space up to tail (decode → prefill).",
    ),
    b"CHUNK_READY": Layout(
        PROFILE,
        "CHUNK_READY",
        ChunkReady,
        (
            _tag(b"CHUNK_READY"),
            Field("room", c.ASCII_UINT),
            Field("chunk_idx", c.ASCII_UINT),
            Field("page_start", c.ASCII_UINT),
            Field("num_pages", c.ASCII_UINT),
            Field("session_id", c.ASCII),
            Field("prefill_rank", c.ASCII_UINT),
        ),
        doc="A staged chunk landed in the ring (prefill → decode).",
    ),
}


class MooncakeProfile(Profile):
    name = PROFILE
    doc = (
        "SGLang's Mooncake-backend messages. Frame 0 is a room id, the registration sentinel "
        "'None', or a control tag: messages are told apart by that tag and by frame count."
    )
    layouts = (REGISTER_INFO, TRANSFER_INFO, TRANSFER_STATUS, *CONTROL_TAGS.values())

    def classify(self, frames: Sequence[bytes]) -> Layout[Any]:
        require_frames(frames, self.name)
        tagged = CONTROL_TAGS.get(bytes(frames[0]))
        if tagged is not None:
            return tagged
        count = len(frames)
        if count == len(TRANSFER_STATUS.fields):
            return TRANSFER_STATUS
        if TRANSFER_INFO.min_frames <= count <= len(TRANSFER_INFO.fields):
            return TRANSFER_INFO
        if REGISTER_INFO.min_frames <= count <= len(REGISTER_INFO.fields):
            return REGISTER_INFO
        raise WireError(
            f"{count} frames and frame 0 {bytes(frames[0])[:16]!r} match no message: a transfer "
            f"status has 3 frames, a TransferInfo {TRANSFER_INFO.min_frames}-"
            f"{len(TRANSFER_INFO.fields)}, a registration {REGISTER_INFO.min_frames}-"
            f"{len(REGISTER_INFO.fields)}, control messages start with a tag "
            f"({', '.join(tag.decode() for tag in CONTROL_TAGS)})",
            profile=self.name,
        )


MOONCAKE = MooncakeProfile()

__all__ = [
    "MOONCAKE",
    "REGISTRATION_ROOM",
    "KVArgsRegisterInfo",
    "TransferInfo",
]
