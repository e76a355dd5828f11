"""Codecs: exact bytes, edge values, and the errors they raise."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvbridge.wire import KVPoll
from kvbridge.wire import codecs as c
from kvbridge.wire.errors import CodecError


@pytest.mark.parametrize(
    ("codec", "value", "raw"),
    [
        (c.ASCII_UINT, 0, b"0"),
        (c.ASCII_UINT, 2**64 - 1, b"18446744073709551615"),
        (c.ASCII_INT, -2, b"-2"),
        (c.ASCII, "None", b"None"),
        (c.UTF8, "décodé", "décodé".encode()),
        (c.POINTER, 0xFFFF81AB54E01000, struct.pack("<Q", 0xFFFF81AB54E01000)),
        (c.U16, 17000, struct.pack("<H", 17000)),
        (c.I64, -2, struct.pack("<q", -2)),
        (c.POINTERS, [1, 2**64 - 1], struct.pack("<2Q", 1, 2**64 - 1)),
        (c.U32_LIST, [], b""),
        (c.POINTER_LISTS, [], b""),
        (c.POINTER_LISTS, [[]], struct.pack("<2I", 1, 0)),
        (c.I32_LISTS, [[-1], [2, 3]], struct.pack("<3I", 2, 4, 8) + struct.pack("<3i", -1, 2, 3)),
        (c.BOOL, True, b"\x01"),
        (c.EnumU8(KVPoll), KVPoll.Transferring, b"\x03"),
        (c.AsciiEnum(KVPoll), KVPoll.Success, b"4"),
        (c.STRING_SET, frozenset({"staging", "dcp"}), b"dcp,staging"),
        (c.STRING_SET, frozenset(), b""),
        (c.Constant(b"ABORT"), b"ABORT", b"ABORT"),
    ],
)
def test_exact_bytes(codec: c.Codec[object], value: object, raw: bytes) -> None:
    assert codec.encode(value) == raw
    assert codec.decode(raw) == value


def test_int32_array_is_zero_copy_and_exact() -> None:
    indices = np.arange(-3, 100_000, dtype=np.int32)
    raw = c.INT32_ARRAY.encode(indices)
    assert raw == indices.tobytes()
    decoded = c.INT32_ARRAY.decode(raw)
    assert decoded.dtype == np.int32
    assert np.array_equal(decoded, indices)
    assert (
        c.INT32_ARRAY.encode(np.array([1, 2], dtype=np.int64))
        == np.array([1, 2], np.int32).tobytes()
    )
    assert c.INT32_ARRAY.encode([]) == b""


@pytest.mark.parametrize(
    ("codec", "raw", "match"),
    [
        (c.ASCII_UINT, b"", "got an empty frame"),
        (c.ASCII_UINT, b"-1", "unsigned ascii decimal"),
        (c.ASCII_UINT, b" 12", "unsigned ascii decimal"),
        (c.ASCII_UINT, b"1_000", "unsigned ascii decimal"),
        (c.ASCII_UINT, b"18446744073709551616", r"in \[0, 18446744073709551615\]"),
        (c.ASCII_UINT, b"\xff", "unsigned ascii decimal"),
        (c.ASCII, b"\xff", "ASCII text"),
        (c.UTF8, b"\xff\xfe", "UTF-8"),
        (c.POINTER, b"\x00" * 7, "exactly 8 bytes"),
        (c.POINTERS, b"\x00" * 9, "multiple of 8 bytes"),
        (c.INT32_ARRAY, b"\x00" * 5, "multiple of 4 bytes"),
        (c.POINTER_LISTS, b"\x01\x00", "header of at least 4 bytes"),
        (c.POINTER_LISTS, struct.pack("<I", 0), "counts 0 lists"),
        (c.POINTER_LISTS, struct.pack("<2I", 5, 8), "truncated nested list"),
        (c.POINTER_LISTS, struct.pack("<2I", 1, 8) + b"\x00" * 4, "truncated or extended"),
        (c.POINTER_LISTS, struct.pack("<2I", 1, 8) + b"\x00" * 9, "truncated or extended"),
        (c.POINTER_LISTS, struct.pack("<2I", 1, 4) + b"\x00" * 4, "multiple of 8 bytes"),
        (c.BOOL, b"\x02", "0x00 or 0x01"),
        (c.EnumU8(KVPoll), b"\x07", "KVPoll value"),
        (c.STRING_SET, b"b,a", "sorted, unique"),
        (c.Constant(b"ABORT"), b"ABORTED", "b'ABORT'"),
    ],
)
def test_decode_errors(codec: c.Codec[object], raw: bytes, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        codec.decode(raw)


@pytest.mark.parametrize(
    ("codec", "value"),
    [
        (c.ASCII_UINT, -1),
        (c.ASCII_UINT, True),
        (c.ASCII_UINT, "12"),
        (c.ASCII, "é"),
        (c.UTF8, "\ud800"),
        (c.U16, 65536),
        (c.POINTERS, [2**64]),
        (c.POINTERS, "abc"),
        (c.INT32_ARRAY, np.array([2**31], dtype=np.int64)),
        (c.INT32_ARRAY, np.zeros((2, 2), dtype=np.int32)),
        (c.STRING_SET, frozenset({"a,b"})),
        (c.EnumU8(KVPoll), 3),
        (c.BYTES, "text"),
    ],
)
def test_encode_errors(codec: c.Codec[object], value: object) -> None:
    with pytest.raises(CodecError):
        codec.encode(value)


def test_render_truncates_long_values() -> None:
    assert c.INT32_ARRAY.render(np.arange(100, dtype=np.int32)).endswith("... (100 items)]")
    assert c.POINTERS.render([0x1000]) == "[0x1000]"
    assert c.EnumU8(KVPoll).render(KVPoll.Failed) == "Failed (0)"
