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
    StagingRequest,
    StagingResponse,
    TransferStatus,
    Watermark,
    staging_registered,
)
from kvbridge.wire.native import MAGIC as NATIVE_MAGIC
from kvbridge.wire.native import NATIVE, Registration, TransferRequest
from kvbridge.wire.profile import Inspection, Profile
from kvbridge.wire.sglang.common import TO_DECODE, TO_PREFILL, Receiver, SGLangProfile
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
    if chosen is NATIVE:
        return NATIVE.inspect(frames, type_name, secret=secret)
    assert isinstance(chosen, SGLangProfile)
    if chosen is NIXL and len(frames) and not _nixl_framed(frames):
        # Captured after the guard was stripped (as sglang's from_zmq sees them).
        result = chosen.inspect([GUARD, *frames], type_name, receiver)
        result.notes.insert(0, f"no guard frame: read as the frames after {GUARD!r}")
        return result
    result = chosen.inspect(frames, type_name, receiver)
    if result.type_name in SHARED_CONTROL_MESSAGES:
        result.notes.append("a control message both SGLang backends send alike (sglang-nixl too)")
    return result


# sglang's backend-independent control messages: the same bytes in both SGLang profiles.
SHARED_CONTROL_MESSAGES = {layout.type_name for layout in (*TO_PREFILL, *TO_DECODE)}


def _nixl_framed(frames: Sequence[bytes]) -> bool:
    first = bytes(frames[0])
    return first == GUARD or first in NIXL.tags(None)


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
    if chosen is NATIVE:
        return NATIVE.decode(frames, secret=secret)
    _refuse_unauthenticated(chosen, secret)
    assert isinstance(chosen, SGLangProfile)
    return chosen.decode(frames, receiver=receiver)


def encode_frames(message: Message, profile: str, secret: bytes | None = None) -> list[bytes]:
    """The frames to send for a message in a profile (NIXL's guarded messages with the guard)."""
    chosen = get_profile(profile)
    if chosen is NATIVE:
        return NATIVE.encode(message, secret=secret)
    _refuse_unauthenticated(chosen, secret)
    return chosen.encode(message)


def _refuse_unauthenticated(profile: Profile, secret: bytes | None) -> None:
    if secret is not None:
        raise WireError(
            "a shared secret is configured but this profile has no frame for an auth tag",
            profile=profile.name,
        )


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
