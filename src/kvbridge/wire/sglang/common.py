"""The control messages of SGLang's backend-independent PD code, one table each.

sglang 0.5.23 builds and parses these in ``disaggregation/common/conn.py`` and
``common/staging_handler.py`` for every backend; both SGLang profiles use these layouts. Each
starts with an ASCII tag in frame 0, which is how SGLang's listener threads tell messages
apart. SGLang reads frames by index and treats a missing trailing frame as absent, so shorter
messages from older peers decode here with the same defaults, and trailing frames of a newer
peer are ignored (and kept, so `to_zmq` gives back the frames received).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.wire import codecs as c
from kvbridge.wire.errors import WireError, describe_bytes
from kvbridge.wire.layout import Field, FieldValueError, Layout, Message
from kvbridge.wire.messages import (
    CarriesStagingRing,
    ChunkReady,
    StagingRequest,
    StagingResponse,
    Watermark,
    check_dcp,
    check_port,
    check_staging,
)
from kvbridge.wire.profile import Inspection, Profile, Receiver, require_frames
from kvbridge.wire.sglang import ZmqMessage

PROFILE = "sglang"
RELEASE = "sglang 0.5.23"
# Frame 0 of a registration: sglang's prefill thread reads any other value as a room id.
REGISTRATION_ROOM = "None"


class Registration(CarriesStagingRing):
    """What both backends' registrations share, and their rules."""

    room: str
    dst_port: int
    dst_dcp_size: int
    dst_dcp_rank: int

    def check(self) -> None:
        if self.room != REGISTRATION_ROOM:
            raise FieldValueError(
                "room",
                f"a registration's room is {REGISTRATION_ROOM!r}, got {self.room!r}: sglang reads "
                "any other value as a TransferInfo's room",
            )
        check_port(self.dst_port, "dst_port")
        check_staging(self.staging_base_ptr, self.staging_total_size)
        check_dcp(self.dst_dcp_size, self.dst_dcp_rank, "dst_dcp_size", "dst_dcp_rank")


def tag(value: bytes) -> Field:
    return Field("tag", c.Constant(value), f"always {value.decode()}")


def tagged_layout(
    type_name: str,
    message_type: type[Any],
    fields: tuple[Field, ...],
    doc: str,
    releases: tuple[tuple[int, str], ...] = (),
    profile: str = PROFILE,
) -> Layout[Any]:
    """A layout whose frame 0 is the ASCII tag `type_name`, in SGLang's tolerant reading."""
    return Layout(
        profile,
        type_name,
        message_type,
        (tag(type_name.encode("ascii")), *fields),
        doc,
        tolerates_extra=True,
        releases=releases or ((len(fields) + 1, RELEASE),),
    )


def optional(name: str, codec: c.Codec[Any], doc: str) -> Field:
    """A trailing frame SGLang reads only when present (``len(msg) > i``): missing = None.
    An empty frame is None too, except for text, where it is the empty string."""
    text = isinstance(codec, c.AsciiText)
    return Field(
        name,
        codec,
        f"{doc}; missing{'' if text else ' or empty'} = None",
        default=None,
        omit_default=True,
        empty_is_default=not text,
    )


@dataclass(eq=False)
class AbortNotification(ZmqMessage):
    """Decode → prefill: decode gave up on a room (SGLang's ``AbortNotification``).

    Without an address SGLang's prefill marks the room failed and acknowledges nothing; with a
    generation it acknowledges once no write of the room is in flight (ABORT_ACK).
    """

    room: int
    decode_ip: str | None = None
    decode_port: int | None = None
    generation: int | None = None

    def check(self) -> None:
        if self.decode_port is not None:
            check_port(self.decode_port, "decode_port")
        if self.decode_port is not None and self.decode_ip is None:
            raise FieldValueError("decode_ip", "decode_port is set but decode_ip is not")
        if self.generation is not None and self.decode_port is None:
            raise FieldValueError(
                "decode_port", "a generation needs the decode address its ABORT_ACK goes to"
            )

    @property
    def ack_address(self) -> tuple[str, int] | None:
        """Where the ABORT_ACK goes; SGLang reads the address only when both frames came."""
        if self.decode_ip is None or self.decode_port is None:
            return None
        return self.decode_ip, self.decode_port


AbortNotification.LAYOUT = ABORT = tagged_layout(
    "ABORT",
    AbortNotification,
    (
        Field("room", c.ASCII_UINT, "bootstrap room"),
        optional("decode_ip", c.ASCII, "decode rank's host, for the ABORT_ACK"),
        optional("decode_port", c.ASCII_UINT, "decode rank's control port"),
        optional("generation", c.ASCII_UINT, "decode's abort generation, echoed in ABORT_ACK"),
    ),
    "Decode aborts a room (decode → prefill). 2, 4 or 5 frames.",
    releases=(
        (5, RELEASE),
        (4, f"{RELEASE} without a generation (decode not armed)"),
        (2, f"{RELEASE} without an address"),
    ),
)


@dataclass(eq=False)
class AbortAck(ZmqMessage):
    """Prefill → decode: no write of the room is in flight from this rank (SGLang's
    ``AbortAck``). A default SGLang decode (deferred KV release) counts only acks that carry
    the generation of its ABORT; the 2-frame form is what a prefill without deferred release
    sends."""

    room: int
    prefill_rank: int | None = None
    generation: int | None = None

    def check(self) -> None:
        if self.generation is not None and self.prefill_rank is None:
            raise FieldValueError("prefill_rank", "a generation needs the acknowledging rank")

    @classmethod
    def answering(cls, abort: AbortNotification, prefill_rank: int) -> AbortAck:
        """The ack SGLang's decode counts for this abort: its generation echoed."""
        return cls(abort.room, prefill_rank, abort.generation)


AbortAck.LAYOUT = ABORT_ACK = tagged_layout(
    "ABORT_ACK",
    AbortAck,
    (
        Field("room", c.ASCII_UINT, "bootstrap room"),
        optional("prefill_rank", c.ASCII_UINT, "acknowledging prefill rank (unique rank id)"),
        optional("generation", c.ASCII_UINT, "the ABORT's generation"),
    ),
    "Prefill confirms an abort drained (prefill → decode). 4 frames; 2 from a prefill "
    "without deferred release.",
    releases=(
        (4, RELEASE),
        (3, f"{RELEASE} without a generation (a deferred-release decode ignores it)"),
        (2, f"{RELEASE} prefill without deferred release"),
    ),
)

STAGING_REQ = tagged_layout(
    "STAGING_REQ",
    StagingRequest,
    (
        Field("room", c.ASCII_UINT),
        Field("chunk_idx", c.ASCII_UINT),
        Field("chunk_num_pages", c.ASCII_UINT),
        Field("session_id", c.ASCII, "the prefill session (Mooncake) or agent (NIXL)"),
        optional("requester_pp_rank", c.ASCII_UINT, "asking rank's pipeline stage"),
    ),
    "Prefill asks for staging-ring space for a chunk (prefill → decode).",
    releases=((6, f"{RELEASE} (with pp rank)"), (5, f"{RELEASE} (without pp rank)")),
)

STAGING_RSP = tagged_layout(
    "STAGING_RSP",
    StagingResponse,
    (
        Field("room", c.ASCII_UINT),
        Field("chunk_idx", c.ASCII_UINT),
        Field("offset", c.ASCII_INT, "ring offset; -2 = the chunk can never fit"),
        Field("round", c.ASCII_UINT),
        Field("end", c.ASCII_INT, "end offset; -1 with a never-fits reply"),
        Field("session_id", c.ASCII),
    ),
    "Decode grants ring space (decode → prefill).",
)

WATERMARK = tagged_layout(
    "WATERMARK",
    Watermark,
    (
        Field("round", c.ASCII_UINT),
        Field("tail", c.ASCII_UINT),
        Field("session_id", c.ASCII, "prefill session; missing = ''", default=""),
    ),
    "Decode frees ring space up to tail (decode → prefill).",
)

CHUNK_READY = tagged_layout(
    "CHUNK_READY",
    ChunkReady,
    (
        Field("room", c.ASCII_UINT),
        Field("chunk_idx", c.ASCII_UINT),
        Field("page_start", c.ASCII_UINT, "first page of the chunk, after decode's prefix"),
        Field("num_pages", c.ASCII_UINT),
        Field("session_id", c.ASCII, "writer id: the prefill session or agent"),
        Field(
            "prefill_rank",
            c.ASCII_UINT,
            "prefill unique rank (sent, not read by sglang 0.5.23); missing = 0",
            default=0,
        ),
    ),
    "A staged chunk landed in the ring (prefill → decode).",
)


@dataclass(eq=False)
class AuxData(ZmqMessage):
    """Prefill → decode (Mooncake): a request's aux (metadata) buffer sent over ZMQ instead of
    the transfer engine."""

    room: int
    buffer_index: int
    aux_index: int
    data_length: int
    data: bytes

    @classmethod
    def of(cls, room: int, buffer_index: int, aux_index: int, data: bytes) -> AuxData:
        return cls(room, buffer_index, aux_index, len(data), data)

    def check(self) -> None:
        if self.data_length != len(self.data):
            raise FieldValueError(
                "data_length", f"says {self.data_length} bytes but data has {len(self.data)}"
            )


AuxData.LAYOUT = AUX_DATA = tagged_layout(
    "AUX_DATA",
    AuxData,
    (
        Field("room", c.ASCII_UINT),
        Field("buffer_index", c.ASCII_UINT, "which aux buffer"),
        Field("aux_index", c.ASCII_UINT, "slot in that buffer"),
        Field("data_length", c.U32_BE, "length of data, struct '>I'"),
        Field("data", c.BYTES, "the slot's bytes"),
    ),
    "Aux data over ZMQ (prefill → decode, Mooncake).",
)


@dataclass(eq=False)
class Bootstrap(ZmqMessage):
    """Decode → prefill: where to report that a room is ready, with the decode allocation
    policy ``prefill_complete`` (SGLang's deferred bootstrap)."""

    room: int
    decode_ip: str
    decode_port: int

    def check(self) -> None:
        check_port(self.decode_port, "decode_port")


Bootstrap.LAYOUT = BOOTSTRAP = tagged_layout(
    "BOOTSTRAP",
    Bootstrap,
    (
        Field("room", c.ASCII_UINT),
        Field("decode_ip", c.ASCII, "decode rank's host"),
        Field("decode_port", c.ASCII_UINT, "decode rank's control port"),
    ),
    "Decode registers a room's status endpoint (decode → prefill, Mooncake, decode "
    "allocation policy prefill_complete).",
)

# What both backends' listeners dispatch by tag, per receiving side, in SGLang's order.
TO_PREFILL: tuple[Layout[Any], ...] = (WATERMARK, STAGING_RSP, ABORT)
TO_DECODE: tuple[Layout[Any], ...] = (CHUNK_READY, STAGING_REQ, ABORT_ACK)


class SGLangProfile(Profile):
    """A profile that tells messages apart as SGLang's listener threads do: by the tag in frame
    0, in each side's order, and for untagged messages by the backend's own rule
    (`untagged`). ``receiver`` says which side's listener to follow; without it both sides'
    tags are known."""

    to_prefill: tuple[Layout[Any], ...]
    to_decode: tuple[Layout[Any], ...]

    @abstractmethod
    def untagged(self, frames: Sequence[bytes], receiver: Receiver | None) -> Layout[Any]:
        """The layout of a message whose frame 0 is no tag of the receiving side."""

    def tags(self, receiver: Receiver | None) -> dict[bytes, Layout[Any]]:
        chosen = {
            None: (*self.to_prefill, *self.to_decode),
            Receiver.PREFILL: self.to_prefill,
            Receiver.DECODE: self.to_decode,
        }[receiver]
        return {layout.type_name.encode("ascii"): layout for layout in chosen}

    def classify(self, frames: Sequence[bytes], receiver: Receiver | None = None) -> Layout[Any]:
        require_frames(frames, self.name)
        first = bytes(frames[0])
        layout = self.tags(receiver).get(first)
        if layout is not None:
            return layout
        if receiver is not None and first in self.tags(None):
            other = "decode" if receiver is Receiver.PREFILL else "prefill"
            raise WireError(
                f"{first.decode()} goes to {other}, not to {receiver.value}",
                profile=self.name,
                message_type=first.decode(),
                frame_index=0,
            )
        return self.untagged(frames, receiver)

    def split(
        self, frames: Sequence[bytes], type_name: str | None, receiver: Receiver | None
    ) -> tuple[Layout[Any], list[bytes]]:
        """The layout and its field frames (after any prefix frames such as NIXL's guard)."""
        layout = self.layout_named(type_name) if type_name else self.classify(frames, receiver)
        prefix = layout.prefix
        if not layout.has_prefix(frames):
            raise WireError(
                f"expected {describe_bytes(prefix[0])} in frame 0, got "
                f"{describe_bytes(bytes(frames[0])) if len(frames) else 'no frame'}",
                profile=self.name,
                message_type=layout.type_name,
                frame_index=0,
                field="guard",
            )
        return layout, [bytes(frame) for frame in frames[len(prefix) :]]

    def encode(self, message: Message, *, secret: bytes | None = None) -> list[bytes]:
        self.refuse_secret(secret)
        layout = self.layout_for(type(message))
        return [*layout.prefix, *layout.encode(message)]

    def decode(
        self,
        frames: Sequence[bytes],
        type_name: str | None = None,
        *,
        secret: bytes | None = None,
        receiver: Receiver | None = None,
    ) -> Message:
        self.refuse_secret(secret)
        layout, body = self.split(frames, type_name, receiver)
        message: Message = layout.decode(body)
        return message

    def missing_prefix(self, frames: Sequence[bytes]) -> tuple[bytes, ...]:
        """Frames a capture may have lost before these (NIXL's guard, stripped before sglang's
        from_zmq sees the rest): inspect reads the frames as if they were there."""
        return ()

    def inspect(
        self,
        frames: Sequence[bytes],
        type_name: str | None = None,
        *,
        secret: bytes | None = None,
        receiver: Receiver | None = None,
    ) -> Inspection:
        """(`secret` is not used: an SGLang message has no tag to verify.)"""
        missing = self.missing_prefix(frames)
        if missing:
            result = self._inspect([*missing, *frames], type_name, receiver)
            result.notes.insert(0, f"no guard frame: read as the frames after {missing[0]!r}")
            return result
        result = self._inspect(frames, type_name, receiver)
        if result.type_name in SHARED_TYPE_NAMES:
            result.notes.append(
                "a control message both SGLang backends send alike (sglang-nixl too)"
            )
        return result

    def _inspect(
        self, frames: Sequence[bytes], type_name: str | None, receiver: Receiver | None
    ) -> Inspection:
        try:
            layout, body = self.split(frames, type_name, receiver)
        except WireError as exc:
            return Inspection(self.name, None, [], [str(exc)])
        rows, errors = layout.inspect(body)
        message = None if errors else layout.decode(body)
        result = Inspection(self.name, layout.type_name, rows, errors, message)
        if layout.prefix:
            result.notes.append(
                f"frame 0 {describe_bytes(layout.prefix[0])} stripped; frames numbered after it, "
                "as sglang's from_zmq numbers them"
            )
        note = layout.release_note(len(body))
        if note:
            result.notes.append(note)
        return result


# sglang's backend-independent control messages: the same bytes in both SGLang profiles.
SHARED_TYPE_NAMES = frozenset(layout.type_name for layout in (*TO_PREFILL, *TO_DECODE))
