"""The one exception the wire layer raises."""

from __future__ import annotations


class CodecError(ValueError):
    """A codec could not turn bytes into a value (or back).

    Raised by codecs, which know nothing of frames or fields; the layout that called the codec
    turns it into a `WireError` naming the frame and the field.
    """

    def __init__(self, expected: str, got: str) -> None:
        super().__init__(f"expected {expected}, got {got}")
        self.expected = expected
        self.got = got


class WireError(ValueError):
    """A message could not be encoded or decoded.

    The message names the profile, the message type, the frame index and the field, and says
    what was expected versus what was received, e.g.
    ``sglang-mooncake KVArgsRegisterInfo: frame 2 (dst_port): expected an unsigned ascii
    decimal integer, got b'12a4'``.
    """

    def __init__(
        self,
        reason: str,
        *,
        profile: str | None = None,
        message_type: str | None = None,
        frame_index: int | None = None,
        field: str | None = None,
    ) -> None:
        self.reason = reason
        self.profile = profile
        self.message_type = message_type
        self.frame_index = frame_index
        self.field = field
        where = " ".join(part for part in (profile, message_type) if part)
        location = ""
        if frame_index is not None:
            location = f"frame {frame_index}"
            if field:
                location += f" ({field})"
        elif field:
            location = f"field {field}"
        prefix = ": ".join(part for part in (where, location) if part)
        super().__init__(f"{prefix}: {reason}" if prefix else reason)


def describe_bytes(raw: bytes, limit: int = 24) -> str:
    """A short, printable rendering of received bytes for error messages."""
    if len(raw) <= limit:
        return repr(raw)
    return f"{raw[:limit]!r}... ({len(raw)} bytes)"
