"""`kvbridge/1`: the native profile spoken between kvbridge peers.

Frame 0 is a fixed 8-byte header (magic, major/minor version, message type, flags); the
message's fields follow, one frame each, as fixed-width little-endian integers, UTF-8 text,
packed integer arrays or opaque bytes. An optional field that is absent is an empty frame, so
0 is always a real value. With the `FLAG_TAG` flag the last frame is an authentication tag
(`kvbridge.wire.auth`): a 16-byte nonce, the sender's clock in nanoseconds and an HMAC-SHA256
over all frames before it (each preceded by its length as a little-endian uint32), the nonce
and the timestamp; receivers with the secret also refuse stale timestamps and replayed nonces.

Compatibility: the ranks of one deployment speak one version, major and minor: a prefill rank's
bootstrap registration names it, and the bootstrap service and decode's look-up refuse a rank
of another version, naming both, before any message is exchanged. A different major version
in a message header is refused naming both too. Frames stay readable across minor versions of
one major version, so that `kvbridge inspect` reads any capture: a newer minor version's extra
trailing frames are ignored, an older one's missing trailing optional frames take their
defaults.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.wire import codecs as c
from kvbridge.wire.auth import ReplayGuard, check_tag, make_tag
from kvbridge.wire.errors import WireError, describe_bytes
from kvbridge.wire.layout import Field, FieldValueError, FrameRow, Layout, Message
from kvbridge.wire.messages import (
    Abort,
    AbortAck,
    CarriesStagingRing,
    ChunkReady,
    FailureKind,
    Heartbeat,
    KVLayout,
    KVPoll,
    MemoryKind,
    RoomLease,
    StagingRequest,
    StagingResponse,
    TransferStatus,
    Watermark,
    check_dcp,
    check_port,
    check_staging,
)
from kvbridge.wire.profile import Inspection, Profile, Receiver, require_frames

PROFILE = "kvbridge/1"
MAGIC = b"KVBR"
MAJOR = 1
MINOR = 6
# What both ends of a kvbridge deployment must speak alike: the bootstrap service and decode's
# look-up refuse a prefill rank of another version, naming both.
VERSION = f"kvbridge/{MAJOR}.{MINOR}"
FLAG_TAG = 0x01
KNOWN_FLAGS = FLAG_TAG

# The header frame, as a table: (name, struct format, meaning).
HEADER_FIELDS = (
    ("magic", "4s", f"always {MAGIC!r}"),
    ("major", "B", f"major version, {MAJOR}"),
    ("minor", "B", f"minor version, {MINOR}"),
    ("type", "B", "message type code (table below)"),
    ("flags", "B", f"bit 0 ({FLAG_TAG:#x}): the last frame is an auth tag (nonce, time, HMAC)"),
)
HEADER = struct.Struct("<" + "".join(fmt for _, fmt, _ in HEADER_FIELDS))


@dataclass(frozen=True)
class Header:
    major: int
    minor: int
    type_code: int
    flags: int

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, self.major, self.minor, self.type_code, self.flags)


# --- messages that only the native profile has ---------------------------------------------


@dataclass(eq=False)
class Registration(Message, CarriesStagingRing):
    """Decode → prefill, once per peer: everything a prefill rank needs to plan transfers."""

    peer_id: str
    host: str
    control_port: int
    engine: str
    engine_descriptor: bytes
    tp_rank: int
    attn_tp_size: int
    dcp_rank: int
    dcp_size: int
    kv_layout: KVLayout
    total_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    kv_layer_ids: list[int]
    kv_ptrs: list[int]
    kv_item_lens: list[int]
    kv_lengths: list[int]
    aux_ptrs: list[int]
    aux_item_lens: list[int]
    aux_lengths: list[int]
    state_ptrs: list[list[int]] = field(default_factory=list)
    state_item_lens: list[list[int]] = field(default_factory=list)
    state_lengths: list[list[int]] = field(default_factory=list)
    state_dim_per_tensor: list[list[int]] = field(default_factory=list)
    state_layer_ids: list[list[int]] = field(default_factory=list)
    staging_base_ptr: int = 0
    staging_total_size: int = 0
    memory_kind: MemoryKind = MemoryKind.DRAM
    device_id: int = 0
    capabilities: frozenset[str] = frozenset()
    # Random bytes of the decode rank: prefill echoes them in statuses, acks and heartbeats.
    session_token: bytes = b""
    # Per state buffer (all groups, in order), its slot's TP-sharded parts: (offset, units,
    # unit bytes, units model-wide) after one another; empty: `state_dim_per_tensor` says.
    state_parts: list[list[int]] = field(default_factory=list)

    def check(self) -> None:
        check_port(self.control_port, "control_port")
        check_staging(self.staging_base_ptr, self.staging_total_size)
        if self.staging_base_ptr + self.staging_total_size > 2**64:
            raise FieldValueError("staging_total_size", "the staging ring wraps the address space")
        check_dcp(self.dcp_size, self.dcp_rank, "dcp_size", "dcp_rank")
        for name in ("attn_tp_size", "total_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise FieldValueError(name, f"must be at least 1, got {getattr(self, name)}")
        if self.tp_rank >= self.attn_tp_size:
            raise FieldValueError(
                "tp_rank", f"must be below attn_tp_size {self.attn_tp_size}, got {self.tp_rank}"
            )
        _check_buffers("kv", self.kv_ptrs, self.kv_item_lens, self.kv_lengths)
        _check_buffers("aux", self.aux_ptrs, self.aux_item_lens, self.aux_lengths)
        if not len(self.state_ptrs) == len(self.state_item_lens) == len(self.state_lengths):
            raise FieldValueError(
                "state_item_lens",
                f"one list per state group: {len(self.state_ptrs)} pointer lists, "
                f"{len(self.state_item_lens)} item-length lists, {len(self.state_lengths)} "
                "length lists",
            )
        for ptrs, item_lens, lengths in zip(
            self.state_ptrs, self.state_item_lens, self.state_lengths, strict=True
        ):
            _check_buffers("state", ptrs, item_lens, lengths)
        if any(len(parts) % 4 for parts in self.state_parts):
            raise FieldValueError(
                "state_parts",
                "each state buffer's parts are (offset, units, unit bytes, "
                "units model-wide) quadruples",
            )
        buffers_per_layer = self.kv_layout.buffers_per_layer
        if len(self.kv_ptrs) != buffers_per_layer * len(self.kv_layer_ids):
            raise FieldValueError(
                "kv_ptrs",
                f"{self.kv_layout.name} has {buffers_per_layer} buffer(s) per layer: "
                f"{len(self.kv_layer_ids)} layers need {buffers_per_layer * len(self.kv_layer_ids)}"
                f" pointers, got {len(self.kv_ptrs)}",
            )


def _check_buffers(kind: str, ptrs: list[int], item_lens: list[int], lengths: list[int]) -> None:
    """Each buffer has an item length and a total length, holds at least one item, and lies
    inside the address space (a forged size must not wrap around it)."""
    for name, values in ((f"{kind}_item_lens", item_lens), (f"{kind}_lengths", lengths)):
        if len(values) != len(ptrs):
            raise FieldValueError(
                name, f"one per {kind} buffer: {len(ptrs)} buffers, {len(values)} values"
            )
    for index, (ptr, length) in enumerate(zip(ptrs, lengths, strict=True)):
        if ptr == 0 or ptr + length > 2**64:
            raise FieldValueError(
                f"{kind}_lengths",
                f"{kind} buffer {index}: {length} bytes at {ptr:#x} is not a valid region",
            )
    for index, (item_len, length) in enumerate(zip(item_lens, lengths, strict=True)):
        if item_len == 0 or length < item_len:
            raise FieldValueError(
                f"{kind}_lengths",
                f"{kind} buffer {index}: {length} bytes cannot hold one item of {item_len} bytes",
            )


@dataclass(eq=False)
class TransferRequest(Message):
    """Decode → prefill, per room and target prefill rank: which pages to fill."""

    room: int
    peer_id: str
    is_dummy: bool
    dst_kv_indices: npt.NDArray[np.int32]
    dst_aux_index: int | None
    dst_state_indices: list[list[int]]
    required_dst_info_num: int
    decode_prefix_len: int | None = None

    def check(self) -> None:
        if self.is_dummy and (len(self.dst_kv_indices) or self.dst_aux_index is not None):
            raise FieldValueError(
                "is_dummy", "a dummy request carries no page indices and no aux index"
            )


def _session_token(doc: str) -> Field:
    """Decode's registration token (native 1.1): absent (empty) from 1.0 peers."""
    return Field("session_token", c.BYTES, doc, default=b"")


def _echoed_token() -> Field:
    return _session_token("decode's registration token, echoed (1.1; empty from 1.0 peers)")


def _optional(name: str, codec: c.Codec[Any], doc: str = "") -> Field:
    """An optional scalar: None is sent as an empty frame, so 0 stays a real value."""
    return Field(name, codec, doc, default=None, send_default_empty=True)


# Message type codes are part of the protocol: never renumber, only append.
_LAYOUT_ROWS: tuple[tuple[int, type[Message], str, tuple[Field, ...]], ...] = (
    (
        1,
        Registration,
        "Decode → prefill, once per peer.",
        (
            Field("peer_id", c.UTF8, "decode rank's unique name"),
            Field("host", c.HOST, "decode control host"),
            Field("control_port", c.U16),
            Field("engine", c.UTF8, "transfer engine name: nixl, mooncake, loopback"),
            Field("engine_descriptor", c.BYTES, "agent metadata / session id for the engine"),
            Field("tp_rank", c.U32, "attention-TP rank"),
            Field("attn_tp_size", c.U32),
            Field("dcp_rank", c.U32),
            Field("dcp_size", c.U32),
            Field("kv_layout", c.EnumU8(KVLayout)),
            Field("total_kv_heads", c.U32, "KV heads of the whole model"),
            Field("head_dim", c.U32),
            Field("dtype", c.UTF8, "element type, e.g. bfloat16"),
            Field("page_size", c.U32, "tokens per page"),
            Field("kv_layer_ids", c.U32_LIST),
            Field(
                "kv_ptrs", c.POINTERS, "KV buffers (MHA: K of every layer, then V of every layer)"
            ),
            Field("kv_item_lens", c.PackedInts("Q"), "bytes per page of each KV buffer"),
            Field("kv_lengths", c.PackedInts("Q"), "bytes of each KV buffer"),
            Field("aux_ptrs", c.POINTERS),
            Field("aux_item_lens", c.PackedInts("Q"), "bytes per slot of each aux buffer"),
            Field("aux_lengths", c.PackedInts("Q")),
            Field("state_ptrs", c.POINTER_LISTS, "state buffers, grouped"),
            Field("state_item_lens", c.NestedIntLists("Q"), "bytes per slot, per group"),
            Field("state_lengths", c.NestedIntLists("Q")),
            Field("state_dim_per_tensor", c.U32_LISTS),
            Field("state_layer_ids", c.U32_LISTS),
            Field("staging_base_ptr", c.U64_ADDRESS, "0 with size 0: no staging ring"),
            Field("staging_total_size", c.U64),
            Field("memory_kind", c.EnumU8(MemoryKind)),
            Field("device_id", c.U32),
            Field(
                "capabilities",
                c.STRING_SET,
                "what else this rank understands: completing-notifications (a room's last "
                "write may notify in the complete form instead of a success status)",
            ),
            _session_token("random bytes prefill echoes back (1.1)"),
            Field(
                "state_parts",
                c.U64_LISTS,
                "per state buffer, its slot's TP-sharded parts as (offset, units, unit bytes, "
                "units model-wide) quadruples (1.3; absent: state_dim_per_tensor)",
                default_factory=list,
            ),
        ),
    ),
    (
        2,
        TransferRequest,
        "Decode → prefill, per room and target prefill rank.",
        (
            Field("room", c.U64),
            Field("peer_id", c.UTF8, "the registration's peer_id"),
            Field("is_dummy", c.BOOL, "this rank sends nothing, only reports completion"),
            Field(
                "dst_kv_indices",
                c.INT32_ARRAY,
                "decode's pages for the room's pages after the prefix; -1: none, decode needs "
                "nothing at that position (1.4: only to prefill ranks of 1.4 or later)",
            ),
            _optional("dst_aux_index", c.U64, "absent for a dummy"),
            Field("dst_state_indices", c.I32_LISTS),
            Field("required_dst_info_num", c.U32),
            _optional("decode_prefix_len", c.U64),
        ),
    ),
    (
        3,
        TransferStatus,
        "Prefill → decode: a room's state from one prefill rank.",
        (
            Field("room", c.U64),
            Field("status", c.EnumU8(KVPoll)),
            Field("prefill_rank", c.U32),
            Field("reason", c.UTF8, "why the room failed; empty otherwise"),
            _echoed_token(),
            _optional(
                "failure_kind",
                c.EnumU8(FailureKind),
                "why it failed, as a kind (1.2; absent: not failed, or a 1.1 peer)",
            ),
        ),
    ),
    (
        4,
        Abort,
        "Decode → prefill: decode gave up on a room.",
        (
            Field("room", c.U64),
            Field("decode_ip", c.HOST),
            Field("decode_port", c.U16),
            Field("reason", c.UTF8),
        ),
    ),
    (
        5,
        AbortAck,
        "Prefill → decode: no write of the room is in flight from this rank.",
        (
            Field("room", c.U64),
            Field("prefill_rank", c.U32),
            _echoed_token(),
        ),
    ),
    (
        6,
        StagingRequest,
        "Prefill → decode: ask for ring space for a chunk.",
        (
            Field("room", c.U64),
            Field("chunk_idx", c.U32),
            Field("chunk_num_pages", c.U32),
            Field("session_id", c.ENDPOINT, "prefill's control endpoint (answers go there)"),
            Field("prefill_rank", c.U32),
            Field("nbytes", c.U64, "bytes of the staged chunk"),
        ),
    ),
    (
        7,
        StagingResponse,
        "Decode → prefill: ring space granted, or -2: never fits.",
        (
            Field("room", c.U64),
            Field("chunk_idx", c.U32),
            Field("offset", c.I64),
            Field("round", c.U64),
            Field("end", c.U64),
            Field("session_id", c.UTF8),
        ),
    ),
    (
        8,
        Watermark,
        "Decode → prefill: ring space up to tail is free again.",
        (Field("round", c.U64), Field("tail", c.U64), Field("session_id", c.UTF8)),
    ),
    (
        9,
        ChunkReady,
        "Prefill → decode: a staged chunk landed in the ring.",
        (
            Field("room", c.U64),
            Field("chunk_idx", c.U32),
            Field("page_start", c.U64),
            Field("num_pages", c.U32),
            Field("session_id", c.ENDPOINT, "prefill's control endpoint (watermarks go there)"),
            Field("prefill_rank", c.U32),
            Field(
                "token_start",
                c.U64,
                "the chunk's first token in decode's pages for the room (after decode's prefix; "
                "positions decode skips with -1 left out)",
            ),
            Field("token_count", c.U64, "tokens of the chunk (prefill pages × page size)"),
        ),
    ),
    (
        10,
        Heartbeat,
        "Either way: the sender is alive for lease_ms more.",
        (
            Field(
                "sender_id",
                c.UTF8,
                "the sender's control endpoint",
            ),
            Field("sequence", c.U64),
            Field("lease_ms", c.U32),
            _optional("ack_sequence", c.U64, "last sequence heard from the receiver (1.1)"),
            _echoed_token(),
        ),
    ),
    (
        11,
        RoomLease,
        "Decode → prefill (1.5): decode will still ask for these rooms; their request "
        "deadlines start again.",
        (
            Field("sender_id", c.ENDPOINT, "decode's control endpoint, registered here"),
            Field("rooms", c.U64_LIST, "rooms no request of decode's reached yet"),
        ),
    ),
)

LAYOUTS_BY_CODE: dict[int, Layout[Any]] = {
    code: Layout(PROFILE, message_type.__name__, message_type, fields, doc, first_frame=1)
    for code, message_type, doc, fields in _LAYOUT_ROWS
}
CODES_BY_TYPE: dict[type[Message], int] = {
    layout.message_type: code for code, layout in LAYOUTS_BY_CODE.items()
}


def parse_header(frame: bytes) -> Header:
    """The header of frame 0; `WireError` naming the header field that is wrong."""

    def error(field_name: str, reason: str) -> WireError:
        return WireError(reason, profile=PROFILE, frame_index=0, field=f"header.{field_name}")

    if len(frame) != HEADER.size:
        raise error("size", f"expected exactly {HEADER.size} bytes, got {len(frame)}")
    magic, major, minor, type_code, flags = HEADER.unpack(frame)
    if magic != MAGIC:
        raise error("magic", f"expected {MAGIC!r}, got {describe_bytes(magic)}")
    if major != MAJOR:
        raise error(
            "major",
            f"peer speaks kvbridge/{major}.{minor}, this library speaks kvbridge/{MAJOR}.{MINOR}: "
            "major versions differ",
        )
    if minor <= MINOR and flags & ~KNOWN_FLAGS:
        raise error("flags", f"unknown flag bits {flags & ~KNOWN_FLAGS:#x}")
    if type_code not in LAYOUTS_BY_CODE:
        known = f"{min(LAYOUTS_BY_CODE)}-{max(LAYOUTS_BY_CODE)}"
        raise error(
            "type",
            f"unknown message type {type_code} (kvbridge/{MAJOR}.{MINOR} knows {known}; the "
            f"peer speaks kvbridge/{major}.{minor})",
        )
    return Header(major, minor, type_code, flags)


class NativeProfile(Profile):
    name = PROFILE
    doc = __doc__ or ""
    layouts = tuple(LAYOUTS_BY_CODE.values())

    def classify(self, frames: Sequence[bytes]) -> Layout[Any]:
        require_frames(frames, self.name)
        return LAYOUTS_BY_CODE[parse_header(bytes(frames[0])).type_code]

    def encode(self, message: Message, *, secret: bytes | None = None) -> list[bytes]:
        """With `secret`, the last frame is the auth tag."""
        code = CODES_BY_TYPE.get(type(message))
        if code is None:
            raise WireError(
                f"{type(message).__name__} has no layout in this profile", profile=PROFILE
            )
        flags = FLAG_TAG if secret else 0
        frames = [Header(MAJOR, MINOR, code, flags).pack(), *LAYOUTS_BY_CODE[code].encode(message)]
        if secret:
            frames.append(make_tag(secret, frames))
        return frames

    def _split(
        self, frames: Sequence[bytes], secret: bytes | None, guard: ReplayGuard | None = None
    ) -> tuple[Header, list[bytes], bytes | None]:
        """Header, field frames and the auth tag (if any), after checking the tag (and, with
        a guard, its freshness and nonce)."""
        require_frames(frames, self.name)
        header = parse_header(bytes(frames[0]))
        body = [bytes(frame) for frame in frames[1:]]
        tag = None
        if header.flags & FLAG_TAG:
            if not body:
                raise WireError(
                    "the header announces an auth tag but there is no frame for it",
                    profile=PROFILE,
                    frame_index=1,
                    field="auth_tag",
                )
            tag = body.pop()
            if secret is not None:
                check = check_tag(secret, [bytes(frames[0]), *body], tag)
                if isinstance(check, str):
                    refused: str | None = check
                else:  # (a guard is a sized container: test it against None, not for truth)
                    refused = guard.admit(check) if guard is not None else None
                if refused:
                    raise WireError(
                        refused, profile=PROFILE, frame_index=len(frames) - 1, field="auth_tag"
                    )
        elif secret is not None:
            raise WireError(
                "message is not authenticated but a shared secret is configured",
                profile=PROFILE,
                frame_index=0,
                field="header.flags",
            )
        return header, body, tag

    def decode(
        self,
        frames: Sequence[bytes],
        type_name: str | None = None,
        *,
        secret: bytes | None = None,
        receiver: Receiver | None = None,
        guard: ReplayGuard | None = None,
    ) -> Message:
        """`secret` verifies the auth tag (required then), `guard` refuses stale and replayed
        ones; `receiver` is not used (native messages go either way)."""
        header, body, _ = self._split(frames, secret, guard)
        layout = LAYOUTS_BY_CODE[header.type_code]
        if type_name and type_name != layout.type_name:
            raise WireError(
                f"expected a {type_name}, got a {layout.type_name}",
                profile=PROFILE,
                frame_index=0,
                field="header.type",
            )
        message: Message = layout.decode(body, allow_extra=header.minor > MINOR)
        return message

    def inspect(
        self,
        frames: Sequence[bytes],
        type_name: str | None = None,
        *,
        secret: bytes | None = None,
        receiver: Receiver | None = None,
    ) -> Inspection:
        try:
            header, body, tag = self._split(frames, secret)
        except WireError as exc:
            raw = bytes(frames[0]) if len(frames) and isinstance(frames[0], bytes) else b""
            row = FrameRow(0, "header", "header", len(raw), describe_bytes(raw), str(exc))
            return Inspection(self.name, None, [row], [str(exc)])
        layout = LAYOUTS_BY_CODE[header.type_code]
        if type_name and type_name != layout.type_name:
            error = f"expected a {type_name}, the header says {layout.type_name}"
            row = FrameRow(0, "header", "header", HEADER.size, layout.type_name, error)
            return Inspection(self.name, layout.type_name, [row], [error])
        flags = " +auth tag" if tag is not None else ""
        header_row = FrameRow(
            0,
            "header",
            "header",
            HEADER.size,
            f"kvbridge/{header.major}.{header.minor} {layout.type_name} "
            f"(type {header.type_code}){flags}",
        )
        newer = header.minor > MINOR
        rows, errors = layout.inspect(body, allow_extra=newer)
        notes = []
        if newer and len(body) > len(layout.fields):
            extra = len(body) - len(layout.fields)
            notes.append(f"{extra} frame(s) appended by minor version {header.minor} ignored")
        if tag is not None:
            verified = "verified" if secret is not None else "not verified (no secret given)"
            rows.append(
                FrameRow(len(frames) - 1, "auth_tag", "nonce+time+hmac", len(tag), verified)
            )
        message = None if errors else layout.decode(body, allow_extra=header.minor > MINOR)
        return Inspection(self.name, layout.type_name, [header_row, *rows], errors, message, notes)


NATIVE = NativeProfile()
