"""Codecs: how one frame's bytes become one field's value and back.

A codec knows nothing of frames, fields or messages; it raises `CodecError` and the layout
that called it names the frame and the field. Every codec has a short `name` (used in the
`inspect` table and the protocol document), a one-line `doc`, and `render` for display.

Byte order: SGLang packs pointers with ``struct.pack("Q", v)``, native byte order, which is
little-endian on every platform it runs on (x86-64, arm64). kvbridge pins little-endian
explicitly so that a big-endian host would still speak the same bytes.
"""

from __future__ import annotations

import enum
import re
import struct
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from kvbridge.wire.address import endpoint_problem, host_problem
from kvbridge.wire.errors import CodecError, describe_bytes

T = TypeVar("T")

_RENDER_ITEMS = 8
U64_MAX = 2**64 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
_INT_RANGES = {
    "Q": (0, U64_MAX),
    "I": (0, 2**32 - 1),
    "i": (-(2**31), 2**31 - 1),
}
_ITEM_SIZES = {"Q": 8, "I": 4, "i": 4}


def _type_name(value: object) -> str:
    return type(value).__name__


def _require_int(value: object, low: int, high: int) -> int:
    # bool is an int subclass; a True where a port belongs is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise CodecError(f"an int in [{low}, {high}]", _type_name(value))
    as_int = int(value)
    if not low <= as_int <= high:
        raise CodecError(f"an int in [{low}, {high}]", str(as_int))
    return as_int


def _render_ints(values: list[int] | npt.NDArray[Any], hex_values: bool = False) -> str:
    count = len(values)
    shown = [int(v) for v in values[:_RENDER_ITEMS]]
    text = ", ".join(hex(v) if hex_values else str(v) for v in shown)
    if count > _RENDER_ITEMS:
        text += f", ... ({count} items)"
    return f"[{text}]"


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates have no UTF-8 form
        raise CodecError("text encodable as UTF-8", repr(text)) from None


class Codec(ABC, Generic[T]):
    """Turns one frame into one value and back."""

    name: str
    doc: str

    @abstractmethod
    def encode(self, value: T) -> bytes: ...

    @abstractmethod
    def decode(self, raw: bytes) -> T: ...

    def render(self, value: T) -> str:
        return repr(value)

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


# --- text and opaque bytes -------------------------------------------------------------------


class AsciiText(Codec[str]):
    name = "ascii"
    doc = "ASCII text"

    def encode(self, value: str) -> bytes:
        if not isinstance(value, str):
            raise CodecError("a str", _type_name(value))
        try:
            return value.encode("ascii")
        except UnicodeEncodeError:
            raise CodecError("ASCII text", repr(value)) from None

    def decode(self, raw: bytes) -> str:
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            raise CodecError("ASCII text", describe_bytes(raw)) from None


class Utf8Text(Codec[str]):
    name = "utf8"
    doc = "UTF-8 text"

    def encode(self, value: str) -> bytes:
        if not isinstance(value, str):
            raise CodecError("a str", _type_name(value))
        return _utf8(value)

    def decode(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CodecError("UTF-8 text", describe_bytes(raw)) from None


class _CheckedText(Utf8Text):
    """UTF-8 text that must pass a rule of `kvbridge.wire.address` (checked both ways)."""

    expected: str

    def encode(self, value: str) -> bytes:
        raw = super().encode(value)
        self._check(value)
        return raw

    def decode(self, raw: bytes) -> str:
        value = super().decode(raw)
        self._check(value)
        return value

    def _check(self, value: str) -> None:
        problem = self.problem(value)
        if problem is not None:
            raise CodecError(self.expected, problem)

    @abstractmethod
    def problem(self, value: str) -> str | None: ...


class HostText(_CheckedText):
    name = "host"
    doc = "UTF-8 text: an IPv4/IPv6 address or a host name (no wildcard)"
    expected = "an IP address or a host name"

    def problem(self, value: str) -> str | None:
        return host_problem(value)


class EndpointText(_CheckedText):
    name = "endpoint"
    doc = "UTF-8 text: a control endpoint, tcp://host:port"
    expected = "tcp://host:port"

    def problem(self, value: str) -> str | None:
        return endpoint_problem(value)


class OpaqueBytes(Codec[bytes]):
    name = "bytes"
    doc = "opaque bytes, passed through unchanged"

    def encode(self, value: bytes) -> bytes:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise CodecError("bytes", _type_name(value))
        return bytes(value)

    def decode(self, raw: bytes) -> bytes:
        return bytes(raw)

    def render(self, value: bytes) -> str:
        return describe_bytes(value, limit=32)


class Constant(Codec[bytes]):
    """A frame whose bytes are fixed, such as the tag that names a control message."""

    def __init__(self, value: bytes) -> None:
        self.value = value
        self.name = "const"
        self.doc = "fixed bytes (a message tag), given in the field's row"

    def encode(self, value: bytes) -> bytes:
        return self.value

    def decode(self, raw: bytes) -> bytes:
        if raw != self.value:
            raise CodecError(repr(self.value), describe_bytes(raw))
        return self.value


# --- ascii integers (SGLang profiles) ------------------------------------------------------

# As Python's str(int) writes them: no leading zeros, no "+", no "-0", no spaces. Python's int()
# (SGLang's parser) would take more, but no sender writes it, and only canonical digits give
# back the same bytes when re-encoded.
_UNSIGNED_DECIMAL = re.compile(rb"0|[1-9][0-9]{0,19}")
_SIGNED_DECIMAL = re.compile(rb"0|-?[1-9][0-9]{0,19}")


class AsciiInt(Codec[int]):
    """A decimal integer as ASCII, e.g. ``b"1234"``: digits as ``str(int)`` writes them."""

    def __init__(self, signed: bool = False) -> None:
        self.signed = signed
        self.low, self.high = (I64_MIN, I64_MAX) if signed else (0, U64_MAX)
        self.name = "ascii int" if signed else "ascii uint"
        self.doc = ("signed" if signed else "unsigned") + " decimal integer as ASCII"
        self._pattern = _SIGNED_DECIMAL if signed else _UNSIGNED_DECIMAL

    def encode(self, value: int) -> bytes:
        return str(_require_int(value, self.low, self.high)).encode("ascii")

    def decode(self, raw: bytes) -> int:
        expected = (
            f"{'a signed' if self.signed else 'an unsigned'} ascii decimal integer "
            "(digits as str(int) writes them)"
        )
        if not self._pattern.fullmatch(raw):
            got = "an empty frame" if not raw else describe_bytes(raw)
            raise CodecError(expected, got)
        value = int(raw)
        if not self.low <= value <= self.high:
            raise CodecError(f"{expected} in [{self.low}, {self.high}]", raw.decode())
        return value


# --- fixed-width little-endian scalars -----------------------------------------------------


class FixedInt(Codec[int]):
    """One little-endian integer of fixed width (SGLang's ``Q``; the native profile's ints)."""

    _NAMES: ClassVar[dict[str, str]] = {
        "<Q": "u64",
        "<q": "i64",
        "<I": "u32",
        "<i": "i32",
        "<H": "u16",
        "<B": "u8",
        ">I": "u32be",
    }

    def __init__(self, fmt: str, hex_render: bool = False) -> None:
        self._struct = struct.Struct(fmt)
        self.size = self._struct.size
        bits = self.size * 8
        signed = fmt[1].islower()
        self.low = -(2 ** (bits - 1)) if signed else 0
        self.high = 2 ** (bits - 1) - 1 if signed else 2**bits - 1
        self.name = self._NAMES[fmt]
        order = "big-endian" if fmt[0] == ">" else "little-endian"
        self.doc = f"{'signed' if signed else 'unsigned'} {bits}-bit {order} integer"
        self.hex_render = hex_render

    def encode(self, value: int) -> bytes:
        return self._struct.pack(_require_int(value, self.low, self.high))

    def decode(self, raw: bytes) -> int:
        if len(raw) != self.size:
            raise CodecError(f"exactly {self.size} bytes ({self.name})", f"{len(raw)} bytes")
        return int(self._struct.unpack(raw)[0])

    def render(self, value: int) -> str:
        return hex(value) if self.hex_render else str(value)


class Pointer(FixedInt):
    """An unsigned 64-bit address (``struct.pack("Q", ptr)``); bit 63 may be set."""

    def __init__(self) -> None:
        super().__init__("<Q", hex_render=True)
        self.name = "Q"
        self.doc = "one unsigned 64-bit address, little-endian, exactly 8 bytes"


class AsciiBool(Codec[bool]):
    """A flag as the ASCII digit ``0`` or ``1`` (SGLang's ``str(int(flag))``)."""

    name = "ascii bool"
    doc = "b'0' or b'1'"

    def encode(self, value: bool) -> bytes:
        if not isinstance(value, bool):
            raise CodecError("a bool", _type_name(value))
        return b"1" if value else b"0"

    def decode(self, raw: bytes) -> bool:
        if raw not in (b"0", b"1"):
            raise CodecError("b'0' or b'1'", describe_bytes(raw))
        return raw == b"1"


class AsciiNames(Codec[list[str]]):
    """Names from a fixed set joined by commas, in order, e.g. ``b"VRAM,DRAM"``."""

    def __init__(self, allowed: frozenset[str]) -> None:
        self.allowed = allowed
        self.name = "ascii names"
        self.doc = f"comma-separated names, each one of {', '.join(sorted(allowed))}"

    def encode(self, value: list[str]) -> bytes:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise CodecError("a list of names", _type_name(value))
        for item in value:
            if item not in self.allowed:
                raise CodecError(f"one of {', '.join(sorted(self.allowed))}", repr(item))
        return ",".join(value).encode("ascii")

    def decode(self, raw: bytes) -> list[str]:
        if not raw:
            return []
        try:
            items = raw.decode("ascii").split(",")
        except UnicodeDecodeError:
            raise CodecError("ASCII names", describe_bytes(raw)) from None
        unknown = sorted(set(items) - self.allowed)
        if unknown:
            raise CodecError(f"names from {', '.join(sorted(self.allowed))}", repr(unknown))
        return items


class Bool(Codec[bool]):
    name = "bool"
    doc = "one byte, 0 or 1"

    def encode(self, value: bool) -> bytes:
        if not isinstance(value, bool):
            raise CodecError("a bool", _type_name(value))
        return b"\x01" if value else b"\x00"

    def decode(self, raw: bytes) -> bool:
        if raw not in (b"\x00", b"\x01"):
            raise CodecError("one byte 0x00 or 0x01", describe_bytes(raw))
        return raw == b"\x01"


E = TypeVar("E", bound=enum.IntEnum)


class EnumU8(Codec[E]):
    """An `IntEnum` member as one unsigned byte."""

    def __init__(self, enum_type: type[E]) -> None:
        self.enum_type = enum_type
        self.name = f"u8 {enum_type.__name__}"
        members = ", ".join(f"{m.name}={m.value}" for m in enum_type)
        self.doc = f"one byte: {members}"

    def encode(self, value: E) -> bytes:
        if not isinstance(value, self.enum_type):
            raise CodecError(f"a {self.enum_type.__name__}", repr(value))
        return bytes([value.value])

    def decode(self, raw: bytes) -> E:
        if len(raw) != 1:
            raise CodecError(f"one byte ({self.enum_type.__name__})", f"{len(raw)} bytes")
        try:
            return self.enum_type(raw[0])
        except ValueError:
            raise CodecError(f"a {self.enum_type.__name__} value", str(raw[0])) from None

    def render(self, value: E) -> str:
        return f"{value.name} ({value.value})"


class AsciiEnum(Codec[E]):
    """An `IntEnum` member as its ASCII decimal value (SGLang's KVPoll status frame)."""

    def __init__(self, enum_type: type[E]) -> None:
        self.enum_type = enum_type
        self._digits = AsciiInt()
        self.name = f"ascii {enum_type.__name__}"
        members = ", ".join(f"{m.name}={m.value}" for m in enum_type)
        self.doc = f"ascii decimal: {members}"

    def encode(self, value: E) -> bytes:
        if not isinstance(value, self.enum_type):
            raise CodecError(f"a {self.enum_type.__name__}", repr(value))
        return self._digits.encode(value.value)

    def decode(self, raw: bytes) -> E:
        number = self._digits.decode(raw)
        try:
            return self.enum_type(number)
        except ValueError:
            raise CodecError(f"a {self.enum_type.__name__} value", str(number)) from None

    def render(self, value: E) -> str:
        return f"{value.name} ({value.value})"


# --- integer sequences -----------------------------------------------------------------------


class PackedInts(Codec[list[int]]):
    """Concatenated little-endian integers (SGLang's ``Q*`` and ``I*``) as a list of ints."""

    def __init__(self, fmt: str, hex_render: bool = False) -> None:
        self.fmt = fmt
        self.item_size = _ITEM_SIZES[fmt]
        self.low, self.high = _INT_RANGES[fmt]
        self.name = f"{fmt}*"
        kind = {"Q": "unsigned 64-bit", "I": "unsigned 32-bit", "i": "signed 32-bit"}[fmt]
        self.doc = f"concatenated {kind} little-endian integers; empty frame = empty list"
        self.hex_render = hex_render

    def encode(self, value: list[int]) -> bytes:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise CodecError("a list of ints", _type_name(value))
        checked = [_require_int(v, self.low, self.high) for v in value]
        return struct.pack(f"<{len(checked)}{self.fmt}", *checked)

    def decode(self, raw: bytes) -> list[int]:
        count, remainder = divmod(len(raw), self.item_size)
        if remainder:
            raise CodecError(
                f"a multiple of {self.item_size} bytes ({self.name})", f"{len(raw)} bytes"
            )
        return list(struct.unpack(f"<{count}{self.fmt}", raw))

    def render(self, value: list[int]) -> str:
        return _render_ints(value, self.hex_render)


class Int32Array(Codec[npt.NDArray[np.int32]]):
    """A numpy ``int32`` array's bytes (page indices): decoded zero-copy, never as a list."""

    dtype = np.dtype("<i4")
    name = "int32[]"
    doc = "numpy int32 array, little-endian, .tobytes(); empty frame = empty array"

    def encode(self, value: npt.NDArray[np.int32]) -> bytes:
        array = np.asarray(value)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise CodecError("a 1-D integer array", f"{array.dtype} array of shape {array.shape}")
        if array.dtype != self.dtype:
            if array.size and (array.min() < -(2**31) or array.max() > 2**31 - 1):
                raise CodecError("int32 values", f"values in [{array.min()}, {array.max()}]")
            array = array.astype(self.dtype)
        return array.tobytes()

    def decode(self, raw: bytes) -> npt.NDArray[np.int32]:
        if len(raw) % 4:
            raise CodecError("a multiple of 4 bytes (int32[])", f"{len(raw)} bytes")
        return np.frombuffer(raw, dtype=self.dtype)

    def render(self, value: npt.NDArray[np.int32]) -> str:
        return _render_ints(value)


class NestedIntLists(Codec[list[list[int]]]):
    """A list of integer lists (SGLang's ``lists(fmt)``).

    Empty outer list: an empty frame. Otherwise a little-endian uint32 header of ``n + 1``
    words (``n``, then each inner list's byte length), then each inner list packed with
    ``fmt``. ``[[]]`` is the header ``[1, 0]`` and no payload.
    """

    def __init__(self, fmt: str, hex_render: bool = False) -> None:
        self.inner = PackedInts(fmt, hex_render)
        self.name = f"lists({fmt})"
        self.doc = (
            f"list of {fmt} lists: uint32 header [n, byte length of each], then the lists; "
            "empty frame = []"
        )

    def encode(self, value: list[list[int]]) -> bytes:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise CodecError("a list of int lists", _type_name(value))
        if len(value) == 0:
            return b""
        payloads = [self.inner.encode(inner) for inner in value]
        header = struct.pack(f"<{len(payloads) + 1}I", len(payloads), *map(len, payloads))
        return header + b"".join(payloads)

    def decode(self, raw: bytes) -> list[list[int]]:
        if not raw:
            return []
        if len(raw) < 4:
            raise CodecError(f"a {self.name} header of at least 4 bytes", f"{len(raw)} bytes")
        (count,) = struct.unpack_from("<I", raw)
        header_size = 4 * (count + 1)
        if count == 0 or header_size > len(raw):
            raise CodecError(
                f"a {self.name} header of {count} + 1 uint32 words within the frame",
                f"a truncated nested list of {len(raw)} bytes"
                if count
                else "a header that counts 0 lists (an empty list is an empty frame)",
            )
        lengths = struct.unpack_from(f"<{count}I", raw, 4)
        if sum(lengths) != len(raw) - header_size:
            raise CodecError(
                f"{sum(lengths)} payload bytes after the header (as it declares)",
                f"{len(raw) - header_size} bytes (a truncated or extended nested list)",
            )
        result = []
        offset = header_size
        for length in lengths:
            result.append(self.inner.decode(raw[offset : offset + length]))
            offset += length
        return result

    def render(self, value: list[list[int]]) -> str:
        inner = ", ".join(self.inner.render(v) for v in value[:_RENDER_ITEMS])
        more = f", ... ({len(value)} lists)" if len(value) > _RENDER_ITEMS else ""
        return f"[{inner}{more}]"


class StringSet(Codec[frozenset[str]]):
    """A set of short names (capabilities), sorted and joined by commas, UTF-8."""

    name = "strset"
    doc = "set of names, sorted, comma-separated UTF-8; empty frame = empty set"

    def encode(self, value: frozenset[str]) -> bytes:
        if not isinstance(value, (set, frozenset)):
            raise CodecError("a set of str", _type_name(value))
        for item in value:
            if not isinstance(item, str) or not item or "," in item:
                raise CodecError("non-empty names without commas", repr(item))
        return _utf8(",".join(sorted(value)))

    def decode(self, raw: bytes) -> frozenset[str]:
        if not raw:
            return frozenset()
        try:
            items = raw.decode("utf-8").split(",")
        except UnicodeDecodeError:
            raise CodecError("UTF-8 names", describe_bytes(raw)) from None
        if "" in items or items != sorted(set(items)):
            raise CodecError("sorted, unique, non-empty names", describe_bytes(raw))
        return frozenset(items)

    def render(self, value: frozenset[str]) -> str:
        return "{" + ", ".join(sorted(value)) + "}"


# Shared instances: codecs are stateless, layouts use these.
ASCII = AsciiText()
ASCII_UINT = AsciiInt()
ASCII_INT = AsciiInt(signed=True)
UTF8 = Utf8Text()
HOST = HostText()
ENDPOINT = EndpointText()
BYTES = OpaqueBytes()
POINTER = Pointer()
POINTERS = PackedInts("Q", hex_render=True)
U64_LIST = PackedInts("Q")
U32_LIST = PackedInts("I")
INT32_ARRAY = Int32Array()
POINTER_LISTS = NestedIntLists("Q", hex_render=True)
U64_LISTS = NestedIntLists("Q")
U32_LISTS = NestedIntLists("I")
I32_LISTS = NestedIntLists("i")
U8 = FixedInt("<B")
U16 = FixedInt("<H")
U32 = FixedInt("<I")
U64 = FixedInt("<Q")
U64_ADDRESS = FixedInt("<Q", hex_render=True)
U32_BE = FixedInt(">I")
ASCII_BOOL = AsciiBool()
I64 = FixedInt("<q")
BOOL = Bool()
STRING_SET = StringSet()
