"""`sglang-nixl`: the messages of sglang 0.5.23's NIXL backend, byte for byte.

The authority is sglang's own code (``disaggregation/nixl/conn.py``), checked by tests/sglang_compat
against sglang itself. The registration and the TransferInfo start with the guard frame
``b"NixlMsgGuard"``; their layouts number frames after it, as sglang's ``from_zmq`` does (the
profile adds and strips the guard; ``from_zmq``/``to_zmq`` take and give the frames after
it). Every other message is a tagged control message without the guard, transfer status
included (``KV_STATUS``). Fields 5-7 of `TransferInfo` come in a different order than in the
Mooncake profile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.wire import codecs as c
from kvbridge.wire.errors import WireError
from kvbridge.wire.layout import Field, FieldValueError, Layout
from kvbridge.wire.messages import (
    KVPoll,
    TransferStatus,
    check_port,
)
from kvbridge.wire.profile import Receiver
from kvbridge.wire.sglang import STAGING_FIELDS, ZmqMessage
from kvbridge.wire.sglang.common import (
    REGISTRATION_ROOM,
    RELEASE,
    TO_DECODE,
    TO_PREFILL,
    Registration,
    SGLangProfile,
    tagged_layout,
)

PROFILE = "sglang-nixl"
GUARD = b"NixlMsgGuard"
SEED_ERA = "seed era (staging 14/15)"
# sglang's KV_MEM_KINDS; a registration without frame 17 means VRAM for every buffer.
KV_MEM_KINDS = frozenset({"DRAM", "VRAM"})


def _every_buffer(earlier: Mapping[str, Any], value: Any) -> list[Any]:
    # `inspect` goes on past a frame that failed to decode: then there is nothing to repeat.
    if value is None:
        return []
    return [value] * len(earlier.get("dst_kv_ptrs", ()))


@dataclass(eq=False)
class KVArgsRegisterInfo(Registration, ZmqMessage):
    """Decode → prefill, once per peer: the decode agent and where its buffers are.

    `dst_kv_mem_kinds` and `dst_kv_item_lens` left empty take sglang's defaults: VRAM and
    `dst_kv_item_len` for every KV buffer."""

    room: str
    endpoint: str
    dst_port: int
    agent_name: str
    agent_metadata: bytes
    dst_kv_ptrs: list[int]
    dst_aux_ptrs: list[int]
    dst_state_data_ptrs: list[list[int]]
    gpu_id: int
    decode_tp_size: int
    decode_tp_rank: int
    dst_kv_item_len: int
    dst_state_item_lens: list[list[int]] = field(default_factory=list)
    dst_state_dim_per_tensor: list[list[int]] = field(default_factory=list)
    staging_base_ptr: int = 0
    staging_total_size: int = 0
    dst_num_slots: int | None = None
    dst_kv_mem_kinds: list[str] = field(default_factory=list)
    dst_kv_item_lens: list[int] = field(default_factory=list)
    dst_state_layer_ids: list[list[int]] = field(default_factory=list)
    dst_kv_layer_ids: list[int] = field(default_factory=list)
    dst_dcp_size: int = 1
    dst_dcp_rank: int = 0
    dst_state_data_lens: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.dst_kv_mem_kinds:
            self.dst_kv_mem_kinds = ["VRAM"] * len(self.dst_kv_ptrs)
        if not self.dst_kv_item_lens:
            self.dst_kv_item_lens = [self.dst_kv_item_len] * len(self.dst_kv_ptrs)

    def check(self) -> None:
        super().check()
        count = len(self.dst_kv_ptrs)
        for name in ("dst_kv_mem_kinds", "dst_kv_item_lens"):
            if len(getattr(self, name)) != count:
                raise FieldValueError(
                    name, f"one per KV buffer: {count} expected, {len(getattr(self, name))} given"
                )


KVArgsRegisterInfo.LAYOUT = REGISTER_INFO = Layout(
    PROFILE,
    "KVArgsRegisterInfo",
    KVArgsRegisterInfo,
    (
        Field("room", c.ASCII, "always 'None': how sglang tells a registration apart"),
        Field("endpoint", c.ASCII, "decode host IP"),
        Field("dst_port", c.ASCII_UINT, "decode rank's control port"),
        Field("agent_name", c.ASCII, "decode's NIXL agent name"),
        Field("agent_metadata", c.BYTES, "opaque NIXL agent metadata"),
        Field("dst_kv_ptrs", c.POINTERS),
        Field("dst_aux_ptrs", c.POINTERS),
        Field("dst_state_data_ptrs", c.POINTER_LISTS, "b'' = []"),
        Field("gpu_id", c.ASCII_UINT),
        Field("decode_tp_size", c.ASCII_UINT, "decode attention-TP size"),
        Field("decode_tp_rank", c.ASCII_UINT, "decode engine rank"),
        Field("dst_kv_item_len", c.ASCII_UINT, "bytes of one page of the first KV buffer"),
        Field("dst_state_item_lens", c.U32_LISTS, default_factory=list),
        Field("dst_state_dim_per_tensor", c.U32_LISTS, default_factory=list),
        *STAGING_FIELDS,
        Field(
            "dst_num_slots",
            c.ASCII_UINT,
            "pages every KV buffer can address; missing or b'' = None",
            default=None,
            send_default_empty=True,
        ),
        Field(
            "dst_kv_mem_kinds",
            c.AsciiNames(KV_MEM_KINDS),
            "memory kind of each KV buffer",
            default_from=lambda earlier: _every_buffer(earlier, "VRAM"),
            default_text="'VRAM' for every KV buffer",
        ),
        Field(
            "dst_kv_item_lens",
            c.U64_LIST,
            "bytes of one page of each KV buffer (Q*)",
            default_from=lambda earlier: _every_buffer(earlier, earlier.get("dst_kv_item_len")),
            default_text="dst_kv_item_len for every KV buffer",
        ),
        Field("dst_state_layer_ids", c.U32_LISTS, default_factory=list),
        Field(
            "dst_kv_layer_ids", c.U32_LIST, "[] = pair buffers by position", default_factory=list
        ),
        Field("dst_dcp_size", c.ASCII_UINT, "decode context-parallel size", default=1),
        Field("dst_dcp_rank", c.ASCII_UINT, "decode context-parallel rank", default=0),
        Field("dst_state_data_lens", c.U64_LISTS, default_factory=list),
    ),
    doc="Registration (decode → prefill, once per peer), after the guard frame.",
    tolerates_extra=True,
    releases=((24, RELEASE), (16, SEED_ERA)),
    prefix=(GUARD,),
)


@dataclass(eq=False)
class TransferInfo(ZmqMessage):
    """Decode → prefill, per room and target prefill rank: which pages to fill."""

    room: int
    endpoint: str
    dst_port: int
    agent_name: str
    dst_kv_indices: npt.NDArray[np.int32]
    dst_aux_index: int
    required_dst_info_num: int
    dst_state_indices: list[list[int]] = field(default_factory=list)
    decode_prefix_len: int | None = None
    # Frame 9, sglang's explicit dummy flag; None = not sent (older peers), inferred instead.
    dummy_rank: bool | None = None

    @property
    def is_dummy(self) -> bool:
        """sglang's rule: the explicit flag if sent; otherwise no pages and no decode prefix
        (empty pages with a prefix > 0 is a full decode-side cache hit, not a dummy)."""
        if self.dummy_rank is not None:
            return self.dummy_rank
        return len(self.dst_kv_indices) == 0 and not self.decode_prefix_len

    def check(self) -> None:
        check_port(self.dst_port, "dst_port")


TransferInfo.LAYOUT = TRANSFER_INFO = Layout(
    PROFILE,
    "TransferInfo",
    TransferInfo,
    (
        Field("room", c.ASCII_UINT),
        Field("endpoint", c.ASCII, "decode host IP"),
        Field("dst_port", c.ASCII_UINT),
        Field("agent_name", c.ASCII),
        Field("dst_kv_indices", c.INT32_ARRAY, "destination page indices; b'' for a dummy"),
        Field("dst_aux_index", c.ASCII_UINT, "aux slot (sent by dummies too)"),
        Field("required_dst_info_num", c.ASCII_UINT),
        Field(
            "dst_state_indices",
            c.I32_LISTS,
            "state slots; missing or b'' = []",
            default_factory=list,
        ),
        Field(
            "decode_prefix_len",
            c.ASCII_UINT,
            "tokens decode already holds (sglang sends 0 for none); missing or b'' = None",
            default=None,
            send_default_empty=True,
        ),
        Field(
            "dummy_rank",
            c.ASCII_BOOL,
            "1 = this rank only reports completion; missing or b'' = inferred",
            default=None,
            send_default_empty=True,
        ),
    ),
    doc="Per-request transfer request (decode → prefill), after the guard frame.",
    tolerates_extra=True,
    releases=((10, RELEASE), (9, SEED_ERA)),
    prefix=(GUARD,),
)

KV_STATUS = tagged_layout(
    "KV_STATUS",
    TransferStatus,
    (
        Field("room", c.ASCII_UINT),
        Field("status", c.AsciiEnum(KVPoll)),
        Field("prefill_rank", c.ASCII_UINT, "prefill unique rank"),
        Field("reason", c.UTF8, "failure reason; b'' = none", default="", send_default_empty=True),
    ),
    "Transfer status (prefill → decode).",
    profile=PROFILE,
)


class NixlProfile(SGLangProfile):
    name = PROFILE
    doc = (
        f"sglang 0.5.23's NIXL-backend messages. The registration and the TransferInfo start "
        f"with the guard frame {GUARD!r} and are numbered after it; every other message starts "
        "with its tag, transfer status included (KV_STATUS)."
    )
    to_prefill = TO_PREFILL
    to_decode = (*TO_DECODE, KV_STATUS)
    layouts = (REGISTER_INFO, TRANSFER_INFO, *to_prefill, *to_decode)

    def missing_prefix(self, frames: Sequence[bytes]) -> tuple[bytes, ...]:
        if not len(frames) or not isinstance(frames[0], (bytes, bytearray, memoryview)):
            return ()
        first = bytes(frames[0])
        return () if first == GUARD or first in self.tags(None) else (GUARD,)

    def untagged(self, frames: Sequence[bytes], receiver: Receiver | None) -> Layout[Any]:
        if not REGISTER_INFO.has_prefix(frames) or receiver is Receiver.DECODE:
            known = ", ".join(tag.decode() for tag in self.tags(receiver))
            raise WireError(
                f"frame 0 is neither the guard {GUARD!r} nor a tag ({known})",
                profile=self.name,
                frame_index=0,
            )
        if REGISTER_INFO.frame_of(frames, "room") == REGISTRATION_ROOM.encode("ascii"):
            return REGISTER_INFO
        return TRANSFER_INFO


NIXL = NixlProfile()

__all__ = ["GUARD", "NIXL", "KVArgsRegisterInfo", "TransferInfo"]
