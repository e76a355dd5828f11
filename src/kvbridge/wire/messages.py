"""Control messages shared by the native and the SGLang profiles, and wire rules.

Each message is a dataclass of explicit scalar fields; how it becomes frames is a `Layout` in
each profile (`kvbridge.wire.native`, `kvbridge.wire.sglang.mooncake`). A field that one
profile has no frame for keeps its default there (encoding refuses any other value).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvbridge.wire.layout import FieldValueError, Message


class KVPoll(enum.IntEnum):
    """A room's transfer state, numbered as SGLang numbers it on the wire."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4

    # Printed by name ("Failed", not "0"); the wire carries the number.
    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)


class FailureKind(enum.IntEnum):
    """Why a room failed, as a small fixed set: metrics count by it, the native status message
    carries it with the free-text reason, and a caller can act on it without parsing text."""

    # A peer reported a failure without a kind (a kvbridge/1.1 peer, the SGLang profiles).
    UNKNOWN = 0
    # Either side gave up on the room (the scheduler, a client disconnect, a shutdown).
    ABORTED = 1
    # The peer fell silent for longer than the peer timeout, or its write lease ran out.
    PEER_DEAD = 2
    # A deadline passed: the request, the transfer, the claim of a room, a staging answer.
    TIMEOUT = 3
    # The transfer engine failed to connect, register or write.
    ENGINE = 4
    # The two ranks cannot be paired: cache geometry, layouts, engines, a request's prefix.
    INCOMPATIBLE = 5
    # The room was refused: it ended already, or a cap on rooms was reached.
    REFUSED = 6
    # The prefill group could not be found through the bootstrap service.
    BOOTSTRAP = 7
    # A bug on this side (an operation raised where it should not).
    INTERNAL = 8

    def __str__(self) -> str:
        return self.name.lower()

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class KVLayout(enum.IntEnum):
    """How a rank stores KV.

    MHA: a K buffer and a V buffer per layer, each page ``[token][head][dim]`` (SGLang). MLA:
    one latent buffer per layer. MHA_HEAD_MAJOR: one buffer per layer, each page
    ``[head][K, V][token][dim]`` (vLLM's LBHNC layout, "HND": its CPU attention and what the
    connector asks of its CUDA backends): a head's tokens are contiguous within a page, so
    pages move whole or by head slices (different TP sizes), between equal page sizes.
    MHA_KV_PACKED: one buffer per layer, each page ``[token][head][K dim, V dim]`` (vLLM's
    LBNHC layout, "NHD"): token rows as in MHA, with `head_dim` counting a head's K and V
    together. PAGES: one buffer per memory slot, its pages opaque (vLLM's hybrid KV cache,
    where attention KV and Mamba state share pages): pages move whole between equal TP
    sizes; `page_size` is 1 and a page is one "head" of `head_dim` bytes.
    """

    MHA = 1
    MLA = 2
    MHA_HEAD_MAJOR = 3
    MHA_KV_PACKED = 4
    PAGES = 5

    @property
    def buffers_per_layer(self) -> int:
        return 2 if self == KVLayout.MHA else 1

    @property
    def kv_in_page(self) -> int:
        """How many of K and V one page of a buffer holds."""
        return 2 if self == KVLayout.MHA_HEAD_MAJOR else 1

    @property
    def replicated(self) -> bool:
        """Every attention-TP rank holds the same bytes (MLA's latent): no head split."""
        return self == KVLayout.MLA

    @property
    def head_sliceable(self) -> bool:
        """Pages may move by head slices (different TP sizes)."""
        return self not in (KVLayout.MLA, KVLayout.PAGES)

    @property
    def token_major(self) -> bool:
        """Pages are token rows, so tokens map between different page sizes and DCP."""
        return self in (KVLayout.MHA, KVLayout.MLA, KVLayout.MHA_KV_PACKED)


class MemoryKind(enum.IntEnum):
    """Where registered buffers live (NIXL's segment types)."""

    DRAM = 1
    VRAM = 2


# STAGING_RSP offset meaning "this chunk can never fit in the ring" (fall back to per-token).
STAGING_NEVER_FITS = -2

MAX_PORT = 65535


def staging_registered(staging_base_ptr: int, staging_total_size: int) -> bool:
    """Whether a peer registered a staging ring: the one rule every profile uses."""
    return staging_base_ptr != 0 or staging_total_size != 0


def check_staging(staging_base_ptr: int, staging_total_size: int) -> None:
    """Refuse a ring with an address but no size: it could never be written to."""
    if staging_base_ptr != 0 and staging_total_size == 0:
        raise FieldValueError(
            "staging_total_size",
            f"staging_base_ptr is {staging_base_ptr:#x} but staging_total_size is 0: a staging "
            "ring needs a size (send both as 0 when there is no ring)",
        )


class CarriesStagingRing:
    """Mixin for registrations that carry a decode staging ring."""

    staging_base_ptr: int
    staging_total_size: int

    @property
    def staging_registered(self) -> bool:
        return staging_registered(self.staging_base_ptr, self.staging_total_size)


def check_dcp(dcp_size: int, dcp_rank: int, size_field: str, rank_field: str) -> None:
    if dcp_size < 1:
        raise FieldValueError(size_field, f"must be at least 1, got {dcp_size}")
    if dcp_rank >= dcp_size:
        raise FieldValueError(rank_field, f"must be below {size_field} {dcp_size}, got {dcp_rank}")


def check_port(port: int, field: str) -> None:
    if port > MAX_PORT:
        raise FieldValueError(field, f"a TCP port is at most {MAX_PORT}, got {port}")


@dataclass(eq=False)
class TransferStatus(Message):
    """Prefill → decode: how a room's transfer from one prefill rank ended or stands."""

    room: int
    status: KVPoll
    prefill_rank: int
    # Why a room failed; only the native profile has a frame for it.
    reason: str = ""
    # Native profile only: the token the decode rank gave in its registration, echoed so that
    # only the prefill rank it registered with can end its rooms.
    session_token: bytes = b""
    # Native profile only (1.2): the kind of a failure; None when the room did not fail or
    # the peer did not say.
    failure_kind: FailureKind | None = None


@dataclass(eq=False)
class Abort(Message):
    """Decode → prefill: the decode side gave up on a room."""

    room: int
    decode_ip: str
    decode_port: int
    reason: str = ""

    def check(self) -> None:
        check_port(self.decode_port, "decode_port")


@dataclass(eq=False)
class AbortAck(Message):
    """Prefill → decode: no write of this room is in flight any more from this rank."""

    room: int
    prefill_rank: int
    # Native profile only: the decode rank's registration token, echoed (as in TransferStatus).
    session_token: bytes = b""


@dataclass(eq=False)
class StagingRequest(Message):
    """Prefill → decode: ask for ring space for one chunk of a room."""

    room: int
    chunk_idx: int
    chunk_num_pages: int
    session_id: str
    # Native profile only: who asks, and the staged chunk's exact size.
    prefill_rank: int = 0
    nbytes: int = 0
    # SGLang profiles only: the asking prefill rank's pipeline stage (decode answers only the
    # bootstrap entries of that stage); None = not sent.
    requester_pp_rank: int | None = None


@dataclass(eq=False)
class StagingResponse(Message):
    """Decode → prefill: where in the ring the chunk may be written (or that it never fits:
    SGLang then sends offset -2, round 0, end -1)."""

    room: int
    chunk_idx: int
    offset: int
    round: int
    end: int
    session_id: str

    @property
    def never_fits(self) -> bool:
        return self.offset == STAGING_NEVER_FITS


@dataclass(eq=False)
class Watermark(Message):
    """Decode → prefill: ring space up to `tail` of `round` is free again."""

    round: int
    tail: int
    session_id: str


@dataclass(eq=False)
class ChunkReady(Message):
    """Prefill → decode: a chunk landed in the ring and may be scattered into pages."""

    room: int
    chunk_idx: int
    page_start: int
    num_pages: int
    session_id: str
    prefill_rank: int
    # Native profile only: the chunk's tokens, counted in decode's pages for the room (after
    # its prefix, skipped positions left out), which decode maps to its own pages.
    token_start: int = 0
    token_count: int = 0


@dataclass(eq=False)
class RoomLease(Message):
    """Decode → prefill, native profile only (1.5): decode still means to ask for these rooms
    (their requests wait in its scheduler's queue): each one's request deadline on prefill
    starts again. `sender_id` is decode's control endpoint, registered with the prefill rank."""

    sender_id: str
    rooms: list[int]


@dataclass(eq=False)
class Heartbeat(Message):
    """Either way, native profile only: the sender is alive for another `lease_ms`.

    `ack_sequence` is the last sequence the sender heard from the receiver: a prefill rank's
    write lease on a decode peer runs `lease_ms` from when it sent that sequence, so only
    heartbeats decode really answered extend it. Prefill → decode heartbeats carry decode's
    registration token.

    `sender_id` is the sender's control endpoint, either way."""

    sender_id: str
    sequence: int
    lease_ms: int
    ack_sequence: int | None = None
    session_token: bytes = b""
