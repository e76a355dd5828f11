"""Frames files: the JSON and binary forms read by `kvbridge inspect`."""

from __future__ import annotations

import pytest

from kvbridge import samples
from kvbridge.wire import decode_frames
from kvbridge.wire.framefile import (
    FrameFileError,
    dump_binary,
    dump_json,
    load_frames,
    parse_hex_frame,
)

FRAMES = [b"", b"\x00\xff", b"None", bytes(range(256))]


def test_binary_and_json_round_trip() -> None:
    assert load_frames(dump_binary(FRAMES)) == (FRAMES, {})
    frames, metadata = load_frames(dump_json(FRAMES, profile="sglang-nixl").encode())
    assert frames == FRAMES
    assert metadata == {"profile": "sglang-nixl"}
    assert load_frames(b'["00ff", ""]') == ([b"\x00\xff", b""], {})


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"KVFRAMES\n\x01", "before its frame count"),
        (b"KVFRAMES\n\x01\x00\x00\x00", "before the length of frame 0"),
        (b"KVFRAMES\n\x01\x00\x00\x00\x05\x00\x00\x00ab", "frame 0 declares 5 bytes, 2 remain"),
        (b"KVFRAMES\n\x00\x00\x00\x00x", "1 bytes after the last of 0 frames"),
        (b"\xff\xfe", "neither a binary frames file"),
        (b'{"frames": "00"}', "list of hex strings"),
        (b'["0g"]', "frame 0: not hex"),
    ],
)
def test_bad_files(data: bytes, match: str) -> None:
    with pytest.raises(FrameFileError, match=match):
        load_frames(data)


def test_hex_frames_accept_common_spellings() -> None:
    assert parse_hex_frame("0x00ff", 0) == b"\x00\xff"
    assert parse_hex_frame("00:ff", 0) == b"\x00\xff"
    assert parse_hex_frame("", 0) == b""


def test_every_bundled_sample_is_a_valid_message() -> None:
    names = samples.sample_names()
    assert len(names) >= 5
    for name in names:
        frames, metadata = load_frames(samples.sample_bytes(name))
        assert metadata["description"]
        decode_frames(frames, metadata["profile"])
