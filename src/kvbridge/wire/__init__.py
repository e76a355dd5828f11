"""The wire layer: every control message as ZMQ frames and back, one layout per message.

Profiles: `kvbridge/1` (native, `NATIVE`), `sglang-mooncake` (`MOONCAKE`) and `sglang-nixl`
(`NIXL`). Decoding raises only `WireError`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.wire.errors import WireError
from kvbridge.wire.layout import Field, FrameRow, Layout, Message
from kvbridge.wire.messages import (
    STAGING_NEVER_FITS,
    Abort,
    AbortAck,
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
    staging_registered,
)
from kvbridge.wire.native import MAGIC as NATIVE_MAGIC
from kvbridge.wire.native import NATIVE, Registration, TransferRequest
from kvbridge.wire.profile import Inspection, Profile, Receiver
from kvbridge.wire.sglang.mooncake import MOONCAKE
from kvbridge.wire.sglang.nixl import GUARD, NIXL

PROFILES: dict[str, Profile] = {profile.name: profile for profile in (NATIVE, MOONCAKE, NIXL)}


def detect_profile(frames: Sequence[bytes]) -> Profile:
    """The profile a frame list is in, from frame 0: the native magic, the NIXL guard or a
    NIXL-only tag, or else SGLang Mooncake (whose frame 0 is a room id, 'None' or a tag; the
    tags both SGLang backends share decode the same in either profile)."""
    first = bytes(frames[0]) if len(frames) and isinstance(frames[0], bytes) else b""
    if first.startswith(NATIVE_MAGIC):
        return NATIVE
    if first == GUARD or (first in NIXL.tags(None) and first not in MOONCAKE.tags(None)):
        return NIXL
    return MOONCAKE


def inspect_frames(
    frames: Sequence[bytes],
    profile: str | None = None,
    type_name: str | None = None,
    secret: bytes | None = None,
    receiver: Receiver | None = None,
) -> Inspection:
    """Decode frame by frame for display, detecting the profile unless one is given.

    NIXL's guarded messages may come with or without their guard frame.
    """
    chosen = get_profile(profile) if profile else detect_profile(frames)
    return chosen.inspect(frames, type_name, secret=secret, receiver=receiver)


def decode_frames(
    frames: Sequence[bytes],
    profile: str | None = None,
    secret: bytes | None = None,
    receiver: Receiver | None = None,
) -> Message:
    """Decode a message as received from a socket, detecting the profile unless one is given.

    NIXL's registration and TransferInfo come with their guard frame; a native message is
    checked against `secret`. ``receiver`` dispatches as that side's sglang listener does.
    """
    chosen = get_profile(profile) if profile else detect_profile(frames)
    return chosen.decode(frames, secret=secret, receiver=receiver)


def encode_frames(message: Message, profile: str, secret: bytes | None = None) -> list[bytes]:
    """The frames to send for a message in a profile (NIXL's guarded messages with the guard)."""
    return get_profile(profile).encode(message, secret=secret)


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise WireError(f"unknown profile {name!r} (known: {', '.join(PROFILES)})") from None


__all__ = [
    "GUARD",
    "MOONCAKE",
    "NATIVE",
    "NIXL",
    "PROFILES",
    "STAGING_NEVER_FITS",
    "Abort",
    "AbortAck",
    "ChunkReady",
    "FailureKind",
    "Field",
    "FrameRow",
    "Heartbeat",
    "Inspection",
    "KVLayout",
    "KVPoll",
    "Layout",
    "MemoryKind",
    "Message",
    "Profile",
    "Receiver",
    "Registration",
    "RoomLease",
    "StagingRequest",
    "StagingResponse",
    "TransferRequest",
    "TransferStatus",
    "Watermark",
    "WireError",
    "decode_frames",
    "detect_profile",
    "encode_frames",
    "get_profile",
    "inspect_frames",
    "staging_registered",
]
