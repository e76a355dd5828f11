"""Frame lists in files, for `kvbridge inspect` and bundled samples.

Two formats, told apart by their first bytes:
- JSON: ``{"frames": ["<hex>", ...], "profile": ..., "description": ...}`` or a bare list of
  hex strings; easy to write by hand or paste from a log.
- binary: ``KVFRAMES\\n``, a little-endian uint32 frame count, then per frame a uint32 length
  and the bytes; what a capture tool writes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

BINARY_MAGIC = b"KVFRAMES\n"
_U32 = struct.Struct("<I")


class FrameFileError(ValueError):
    """A frames file or hex frame could not be read."""


def parse_hex_frame(text: str, position: int) -> bytes:
    cleaned = text.strip()
    if cleaned.lower().startswith("0x"):
        cleaned = cleaned[2:]
    cleaned = cleaned.replace(" ", "").replace(":", "")
    if len(cleaned) % 2:
        raise FrameFileError(
            f"frame {position}: {text[:40]!r} has an odd number of hex digits ({len(cleaned)}): "
            "each byte is two digits"
        )
    try:
        return bytes.fromhex(cleaned)
    except ValueError:
        raise FrameFileError(f"frame {position}: not hex: {text[:40]!r}") from None


def load_frames(data: bytes) -> tuple[list[bytes], dict[str, Any]]:
    """Frames and metadata (profile, type, description: whatever the JSON form carries)."""
    if not data.strip():
        raise FrameFileError("the frames file is empty")
    if data.startswith(BINARY_MAGIC):
        return _load_binary(data), {}
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameFileError(
            f"neither a binary frames file (starting {BINARY_MAGIC!r}) nor JSON: {exc}"
        ) from None
    metadata: dict[str, Any] = {}
    if isinstance(document, dict):
        metadata = {key: value for key, value in document.items() if key != "frames"}
        document = document.get("frames")
    if not isinstance(document, list) or not all(isinstance(item, str) for item in document):
        raise FrameFileError('JSON frames must be a list of hex strings (or {"frames": [...]})')
    return [parse_hex_frame(item, position) for position, item in enumerate(document)], metadata


def _load_binary(data: bytes) -> list[bytes]:
    offset = len(BINARY_MAGIC)
    if len(data) < offset + _U32.size:
        raise FrameFileError("binary frames file ends before its frame count")
    (count,) = _U32.unpack_from(data, offset)
    offset += _U32.size
    frames = []
    for position in range(count):
        if len(data) < offset + _U32.size:
            raise FrameFileError(f"binary frames file ends before the length of frame {position}")
        (length,) = _U32.unpack_from(data, offset)
        offset += _U32.size
        if len(data) < offset + length:
            raise FrameFileError(
                f"frame {position} declares {length} bytes, {len(data) - offset} remain"
            )
        frames.append(data[offset : offset + length])
        offset += length
    if offset != len(data):
        raise FrameFileError(f"{len(data) - offset} bytes after the last of {count} frames")
    return frames


def dump_binary(frames: Sequence[bytes]) -> bytes:
    parts = [BINARY_MAGIC, _U32.pack(len(frames))]
    for frame in frames:
        parts += [_U32.pack(len(frame)), bytes(frame)]
    return b"".join(parts)


def dump_json(frames: Sequence[bytes], **metadata: Any) -> str:
    return json.dumps({**metadata, "frames": [bytes(f).hex() for f in frames]}, indent=2) + "\n"
