"""`sglang-mooncake`: the messages of sglang 0.5.23's Mooncake backend, byte for byte.

The authority is sglang's own code (``disaggregation/mooncake/conn.py``: the builders
``build_receiver_registration_message`` / ``build_receiver_metadata_message``, the parsers
``KVArgsRegisterInfo.from_zmq`` / ``TransferInfo.from_zmq`` and the listener threads), checked
by tests/sglang_compat against sglang itself. Field names are sglang's. Messages without a tag are
told apart as sglang's threads do: on the prefill side frame 0 ``None`` is a registration and
anything else a TransferInfo; on the decode side anything untagged is a transfer status.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.wire import codecs as c
from kvbridge.wire.layout import Field, FieldValueError, Layout
from kvbridge.wire.messages import (
    KVPoll,
    TransferStatus,
    check_port,
)
from kvbridge.wire.profile import Receiver
from kvbridge.wire.sglang import STAGING_FIELDS, ZmqMessage
from kvbridge.wire.sglang.common import (
    AUX_DATA,
    BOOTSTRAP,
    REGISTRATION_ROOM,
    RELEASE,
    TO_DECODE,
    TO_PREFILL,
    Registration,
    SGLangProfile,
)

PROFILE = "sglang-mooncake"
SEED_ERA = "seed era (staging 14/15, DCP 16/17)"


@dataclass(eq=False)
class KVArgsRegisterInfo(Registration, ZmqMessage):
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
    # sglang's StagingRegisterInfo.slot_layer_ids: the layer of each staging slot (sglang
    # keeps it only when a ring is registered).
    staging_slot_layer_ids: list[int] = field(default_factory=list)
    dst_kv_item_lens: list[int] = field(default_factory=list)


KVArgsRegisterInfo.LAYOUT = REGISTER_INFO = Layout(
    PROFILE,
    "KVArgsRegisterInfo",
    KVArgsRegisterInfo,
    (
        Field("room", c.ASCII, "always 'None': how sglang tells a registration apart"),
        Field("endpoint", c.ASCII, "decode host IP"),
        Field("dst_port", c.ASCII_UINT, "decode rank's control port"),
        Field("mooncake_session_id", c.ASCII, "decode's Mooncake session 'host:rpc_port'"),
        Field("dst_kv_ptrs", c.POINTERS, "base address of each KV buffer"),
        Field("dst_aux_ptrs", c.POINTERS, "base address of each aux (metadata) buffer"),
        Field("dst_state_data_ptrs", c.POINTER_LISTS, "state buffer addresses; b'' = []"),
        Field("dst_tp_rank", c.ASCII_UINT, "decode TP rank (engine rank)"),
        Field("dst_attn_tp_size", c.ASCII_UINT, "decode attention-TP size"),
        Field("dst_kv_item_len", c.ASCII_UINT, "bytes of one page of the first KV buffer"),
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
        Field(
            "staging_slot_layer_ids",
            c.U64_LIST,
            "layer id of each staging slot (Q*); [] = by KV layer ids",
            default_factory=list,
        ),
        Field(
            "dst_kv_item_lens",
            c.U64_LIST,
            "bytes of one page of each KV buffer (Q*)",
            default_factory=list,
        ),
    ),
    doc="Registration (decode → prefill, once per peer); frame 0 is 'None'.",
    tolerates_extra=True,
    releases=((20, RELEASE), (18, SEED_ERA)),
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
    dst_device_kv_indices: npt.NDArray[np.int32] | None = None

    def __post_init__(self) -> None:
        # An empty frame 9 reads as None in sglang; no device indices are sent as None.
        if self.dst_device_kv_indices is not None and len(self.dst_device_kv_indices) == 0:
            self.dst_device_kv_indices = None

    @property
    def is_dummy(self) -> bool:
        """This prefill rank sends nothing for the room and only reports completion: sglang's
        rule, frames 4 and 5 both empty."""
        return len(self.dst_kv_indices) == 0 and self.dst_aux_index is None

    def check(self) -> None:
        check_port(self.dst_port, "dst_port")
        if self.dst_aux_index is None and len(self.dst_kv_indices):
            raise FieldValueError(
                "dst_aux_index",
                "empty while dst_kv_indices is not: only a dummy (no pages) has no aux index",
            )
        if self.is_dummy and self.dst_state_indices:
            raise FieldValueError(
                "dst_state_indices",
                "a dummy (frames 4 and 5 empty) carries none: sglang ignores it",
            )


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
            "tokens decode already holds (sglang sends 0 for none); missing or b'' = None",
            default=None,
            send_default_empty=True,
        ),
        Field(
            "dst_device_kv_indices",
            c.INT32_ARRAY,
            "device page indices of a host-cache destination; missing or b'' = None",
            default=None,
            send_default_empty=True,
        ),
    ),
    doc="Per-request transfer request (decode → prefill). A dummy has frames 4 and 5 empty.",
    tolerates_extra=True,
    releases=((10, RELEASE), (9, SEED_ERA), (8, "before decode_prefix_len")),
)

TRANSFER_STATUS = Layout(
    PROFILE,
    "TransferStatus",
    TransferStatus,
    (
        Field("room", c.ASCII_UINT),
        Field("status", c.AsciiEnum(KVPoll)),
        Field("prefill_rank", c.ASCII_UINT, "prefill unique rank"),
        Field(
            "reason",
            c.UTF8,
            "failure reason; not sent by sglang 0.5.23's Mooncake prefill, read if present",
            default="",
            omit_default=True,
        ),
    ),
    doc="Transfer status (prefill → decode): three ascii integers, no tag.",
    tolerates_extra=True,
    releases=((3, RELEASE), (4, f"{RELEASE} parser (with a reason)")),
)


class MooncakeProfile(SGLangProfile):
    name = PROFILE
    doc = (
        "sglang 0.5.23's Mooncake-backend messages. Frame 0 is a control tag, the "
        "registration sentinel 'None', or a room id: decode → prefill, 'None' is a "
        "registration and a room id a TransferInfo; prefill → decode, an untagged message is "
        "a transfer status."
    )
    # sglang's prefill takes BOOTSTRAP first (its worker recv), then the common tags.
    to_prefill = (BOOTSTRAP, *TO_PREFILL)
    to_decode = (AUX_DATA, *TO_DECODE)
    layouts = (REGISTER_INFO, TRANSFER_INFO, TRANSFER_STATUS, *to_prefill, *to_decode)

    def untagged(self, frames: Sequence[bytes], receiver: Receiver | None) -> Layout[Any]:
        if receiver is Receiver.DECODE:
            return TRANSFER_STATUS
        if REGISTER_INFO.frame_of(frames, "room") == REGISTRATION_ROOM.encode("ascii"):
            return REGISTER_INFO
        if receiver is Receiver.PREFILL:
            return TRANSFER_INFO
        # Either side: a status has at most four frames, a TransferInfo at least eight.
        if len(frames) <= len(TRANSFER_STATUS.fields):
            return TRANSFER_STATUS
        return TRANSFER_INFO


MOONCAKE = MooncakeProfile()

__all__ = [
    "MOONCAKE",
    "REGISTRATION_ROOM",
    "KVArgsRegisterInfo",
    "TransferInfo",
]
