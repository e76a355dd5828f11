"""`sglang-nixl`: SGLang's NIXL-backend messages, byte for byte.

On the wire every message starts with the guard frame ``b"NixlMsgGuard"``; the layouts below
(and ``from_zmq``/``to_zmq``) number frames after it is stripped, as SGLang does. Use
`add_guard`/`strip_guard` at the socket. Note that fields 5-7 of `TransferInfo` come in a
different order than in the Mooncake profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.wire import codecs as c
from kvbridge.wire.errors import WireError, describe_bytes
from kvbridge.wire.layout import Field, Layout, Message
from kvbridge.wire.messages import StagingRing, check_port, check_staging
from kvbridge.wire.profile import Inspection, Profile, require_frames
from kvbridge.wire.sglang import STAGING_FIELDS, ZmqMessage, check_aux_index

PROFILE = "sglang-nixl"
GUARD = b"NixlMsgGuard"


def add_guard(frames: Sequence[bytes]) -> list[bytes]:
    """The frames as sent on the socket: guard first."""
    return [GUARD, *frames]


def strip_guard(frames: Sequence[bytes]) -> list[bytes]:
    """The frames after the guard; `WireError` if the guard is not frame 0."""
    require_frames(frames, PROFILE)
    if bytes(frames[0]) != GUARD:
        raise WireError(
            f"expected the guard frame {GUARD!r}, got {describe_bytes(bytes(frames[0]))}",
            profile=PROFILE,
            frame_index=0,
            field="guard",
        )
    return [bytes(frame) for frame in frames[1:]]


@dataclass(eq=False)
class KVArgsRegisterInfo(ZmqMessage, StagingRing):
    """Decode → prefill, once per peer: the decode agent and where its buffers are."""

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

    def check(self) -> None:
        check_port(self.dst_port, "dst_port")
        check_staging(self.staging_base_ptr, self.staging_total_size)


KVArgsRegisterInfo.LAYOUT = REGISTER_INFO = Layout(
    PROFILE,
    "KVArgsRegisterInfo",
    KVArgsRegisterInfo,
    (
        Field("room", c.ASCII, "always 'None' for a registration"),
        Field("endpoint", c.ASCII, "decode host IP"),
        Field("dst_port", c.ASCII_UINT, "decode rank's control port"),
        Field("agent_name", c.ASCII, "decode's NIXL agent name"),
        Field("agent_metadata", c.BYTES, "opaque NIXL agent metadata"),
        Field("dst_kv_ptrs", c.POINTERS),
        Field("dst_aux_ptrs", c.POINTERS),
        Field("dst_state_data_ptrs", c.POINTER_LISTS, "b'' = []"),
        Field("gpu_id", c.ASCII_UINT),
        Field("decode_tp_size", c.ASCII_UINT),
        Field("decode_tp_rank", c.ASCII_UINT),
        Field("dst_kv_item_len", c.ASCII_UINT),
        Field("dst_state_item_lens", c.U32_LISTS, default_factory=list),
        Field("dst_state_dim_per_tensor", c.U32_LISTS, default_factory=list),
        *STAGING_FIELDS,
    ),
    doc="Registration (decode → prefill, once per peer), after the guard frame.",
)


@dataclass(eq=False)
class TransferInfo(ZmqMessage):
    """Decode → prefill, per room and target prefill rank: which pages to fill."""

    room: int
    endpoint: str
    dst_port: int
    agent_name: str
    dst_kv_indices: npt.NDArray[np.int32]
    dst_aux_index: int | None
    required_dst_info_num: int
    dst_state_indices: list[list[int]] = field(default_factory=list)
    decode_prefix_len: int | None = None

    @property
    def is_dummy(self) -> bool:
        """No pages and no decode prefix; empty pages with a prefix > 0 is a full cache hit."""
        return len(self.dst_kv_indices) == 0 and not (self.decode_prefix_len or 0) > 0

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
        Field("dst_port", c.ASCII_UINT),
        Field("agent_name", c.ASCII),
        Field("dst_kv_indices", c.INT32_ARRAY, "destination page indices"),
        Field(
            "dst_aux_index",
            c.ASCII_UINT,
            "aux slot; b'' for a dummy",
            default=None,
            send_default_empty=True,
        ),
        Field("required_dst_info_num", c.ASCII_UINT),
        Field(
            "dst_state_indices",
            c.I32_LISTS,
            "state slots; missing or b'' = []",
            default_factory=list,
            omit_default=True,
        ),
        Field(
            "decode_prefix_len",
            c.ASCII_UINT,
            "tokens decode already holds; missing = None",
            default=None,
            empty_is_default=False,
            omit_default=True,
        ),
    ),
    doc="Per-request transfer request (decode → prefill), after the guard frame.",
)


class NixlProfile(Profile):
    name = PROFILE
    doc = (
        f"SGLang's NIXL-backend messages. On the socket each starts with the guard frame "
        f"{GUARD!r}; frames are numbered after it. Status travels as NIXL notifications, "
        "not as messages."
    )
    layouts = (REGISTER_INFO, TRANSFER_INFO)

    def classify(self, frames: Sequence[bytes]) -> Layout[Any]:
        require_frames(frames, self.name)
        if len(frames) <= len(TRANSFER_INFO.fields):
            return TRANSFER_INFO
        return REGISTER_INFO

    def encode_guarded(self, message: Message) -> list[bytes]:
        """Frames as sent on the socket, guard first."""
        return add_guard(self.encode(message))

    def decode_guarded(self, frames: Sequence[bytes]) -> Message:
        """Decode frames as received from the socket, guard first."""
        return self.decode(strip_guard(frames))

    def inspect_guarded(self, frames: Sequence[bytes], type_name: str | None = None) -> Inspection:
        try:
            stripped = strip_guard(frames)
        except WireError as exc:
            return Inspection(self.name, None, [], [str(exc)])
        result = self.inspect(stripped, type_name)
        result.notes.append(f"guard frame {GUARD!r} stripped; frames numbered after it")
        return result


NIXL = NixlProfile()

__all__ = ["GUARD", "NIXL", "KVArgsRegisterInfo", "TransferInfo", "add_guard", "strip_guard"]
