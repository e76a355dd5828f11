"""Declarative frame layouts: one ordered table per message and profile.

A `Layout` is the single place that says which frame carries which field with which codec and
what a missing frame means. Encoding, decoding, the `inspect` table and the generated protocol
document are all derived from it; no other code indexes frames by position.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Generic, TypeVar

import numpy as np

from kvbridge.wire.codecs import Codec, Constant
from kvbridge.wire.errors import CodecError, WireError, describe_bytes


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


class FieldValueError(ValueError):
    """A message's fields are individually valid but break a rule of the message."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class Message:
    """Base of every wire message dataclass.

    Equality compares fields, with numpy arrays compared by dtype and content, so that
    ``decode(encode(m)) == m`` holds for messages that carry page-index arrays.
    """

    __hash__ = None  # type: ignore[assignment]
    # How the frames this message was decoded from looked (set by `Layout.decode`, not a
    # field): re-encoding it with the same layout gives back exactly those frames.
    _received: Received | None = None

    def check(self) -> None:
        """Raise `FieldValueError` if the fields break a rule of the message."""

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for item in dataclasses.fields(self):  # type: ignore[arg-type]
            mine, theirs = getattr(self, item.name), getattr(other, item.name)
            if isinstance(mine, np.ndarray) or isinstance(theirs, np.ndarray):
                mine_array, theirs_array = np.asarray(mine), np.asarray(theirs)
                if mine_array.dtype != theirs_array.dtype:
                    return False
                if not np.array_equal(mine_array, theirs_array):
                    return False
            elif mine != theirs:
                return False
        return True


M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Field:
    """One frame of a layout.

    ``default`` (or ``default_factory``, or ``default_from``: computed from the fields before
    it, described by ``default_text``) makes the field optional: a missing trailing frame
    takes it, and so does an empty frame when ``empty_is_default`` is set. With
    ``send_default_empty``, the default value is sent as an empty frame (SGLang's empty
    placeholders; the native profile's explicit absence).
    """

    name: str
    codec: Codec[Any]
    doc: str = ""
    default: Any = REQUIRED
    default_factory: Callable[[], Any] | None = None
    default_from: Callable[[Mapping[str, Any]], Any] | None = None
    default_text: str = ""
    empty_is_default: bool = True
    send_default_empty: bool = False
    # The default is sent by leaving the frame out; only for trailing fields (older peers).
    omit_default: bool = False

    # Cached (the field is frozen): every frame of every message asks.
    @cached_property
    def required(self) -> bool:
        return self.default is REQUIRED and self.default_factory is None and not self.default_from

    @cached_property
    def is_constant(self) -> bool:
        return isinstance(self.codec, Constant)

    def default_value(self, earlier: Mapping[str, Any]) -> Any:
        """The default, given the values of the fields before this one."""
        if self.default_from is not None:
            return self.default_from(earlier)
        return self.default_factory() if self.default_factory is not None else self.default

    def describe_default(self) -> str:
        if self.required:
            return "required"
        if self.default_from is not None:
            return self.default_text
        return repr(self.default_value({}))


class Form(enum.Enum):
    """How a frame of a received message carried its field."""

    MISSING = "missing"
    EMPTY = "empty"
    VALUE = "value"


@dataclass(frozen=True)
class Received:
    """The shape of the frames a message was decoded from: each field frame's form and any
    trailing frames the layout does not know (kept where the layout tolerates them).

    The layout is named by (profile, type name), not held, so that messages stay picklable."""

    layout: tuple[str, str]
    forms: tuple[Form, ...]
    extra: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class FrameRow:
    """One line of the `inspect` table."""

    index: int
    field: str
    codec: str
    raw_length: int | None
    value: str
    error: str | None = None


@dataclass(frozen=True)
class Layout(Generic[M]):
    """The frame table of one message in one profile."""

    profile: str
    type_name: str
    message_type: type[M]
    fields: tuple[Field, ...]
    doc: str = ""
    # Frames that precede the fields (the native header) and are handled by the profile; only
    # used to number frames in errors, `inspect` and the protocol document.
    first_frame: int = 0
    # Trailing frames beyond the table are accepted, ignored and kept for re-encoding, as
    # SGLang's parsers (which read frames by index) ignore them.
    tolerates_extra: bool = False
    # Frame counts of known releases of this message, for `inspect`: (count, release).
    releases: tuple[tuple[int, str], ...] = ()
    # Frames sent before the field frames and stripped by the profile before decoding (NIXL's
    # guard frame); the fields are numbered after them, as SGLang's from_zmq numbers them.
    prefix: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        attributes = dataclasses.fields(self.message_type)  # type: ignore[arg-type]
        names = {attribute.name for attribute in attributes}
        carried = {item.name for item in self.fields if not item.is_constant}
        for name in carried - names:
            raise TypeError(f"{self.type_name}: {name} is not a field of the message")
        for attribute in attributes:
            # Decoding must be able to build the message from the frames alone.
            no_default = (
                attribute.default is dataclasses.MISSING
                and attribute.default_factory is dataclasses.MISSING
            )
            if no_default and attribute.name not in carried:
                raise TypeError(f"{self.type_name}: required {attribute.name} has no frame")

    @property
    def min_frames(self) -> int:
        """Frames up to the last required one; only trailing optional frames may be missing."""
        required = [position for position, item in enumerate(self.fields) if item.required]
        return required[-1] + 1 if required else 0

    def frame_index(self, field_name: str) -> int | None:
        for position, item in enumerate(self.fields):
            if item.name == field_name:
                return self.first_frame + position
        return None

    def frame_of(self, frames: Sequence[bytes], field_name: str) -> bytes | None:
        """The raw frame of a field in frames as sent (prefix included); None if missing. For
        telling messages apart before decoding them."""
        position = len(self.prefix) + self.fields.index(
            next(item for item in self.fields if item.name == field_name)
        )
        return bytes(frames[position]) if position < len(frames) else None

    def has_prefix(self, frames: Sequence[bytes]) -> bool:
        """Whether frames as sent start with this layout's prefix frames."""
        return [bytes(frame) for frame in frames[: len(self.prefix)]] == list(self.prefix)

    def _error(self, reason: str, position: int | None, field: str | None) -> WireError:
        return WireError(
            reason,
            profile=self.profile,
            message_type=self.type_name,
            frame_index=None if position is None else self.first_frame + position,
            field=field,
        )

    def _check(self, message: M) -> None:
        try:
            message.check()
        except FieldValueError as exc:
            position = self.frame_index(exc.field)
            raise WireError(
                exc.reason,
                profile=self.profile,
                message_type=self.type_name,
                frame_index=position,
                field=exc.field,
            ) from None

    # --- encode ----------------------------------------------------------------------------

    def encode(self, message: M) -> list[bytes]:
        """The frames of a message.

        A message decoded by this layout gives back exactly the frames it came from (missing,
        empty and explicit defaults as received, unknown trailing frames kept); a field changed
        since is encoded by its codec. Otherwise a default is sent as the field says: left out
        (``omit_default``, trailing fields only), as an empty frame (``send_default_empty``),
        or encoded.
        """
        if type(message) is not self.message_type:
            raise WireError(
                f"expected a {self.message_type.__name__}, got {type(message).__name__}",
                profile=self.profile,
                message_type=self.type_name,
            )
        values = {
            attribute.name: getattr(message, attribute.name)
            for attribute in dataclasses.fields(message)  # type: ignore[arg-type]
        }
        carried = {item.name for item in self.fields}
        for attribute in dataclasses.fields(message):  # type: ignore[arg-type]
            if attribute.name in carried:
                continue
            default = (
                attribute.default_factory()
                if attribute.default_factory is not dataclasses.MISSING
                else attribute.default
            )
            if values[attribute.name] != default:
                raise self._error(
                    f"this profile has no frame for {attribute.name}; it must stay {default!r}",
                    None,
                    attribute.name,
                )
        # The message's own rules first (they name the field a peer would misread); a value of
        # the wrong type is left to the codecs, which say what they expected.
        try:
            self._check(message)
            checked = True
        except (TypeError, AttributeError):
            checked = False
        received = message._received
        if received is not None and received.layout != (self.profile, self.type_name):
            received = None
        # None marks a frame that may be left out if nothing after it is sent.
        planned: list[bytes | None] = []
        for position, item in enumerate(self.fields):
            value = None if item.is_constant else values[item.name]
            if item.is_constant or item.required or not _is_default(value, item, values):
                planned.append(self._encode_field(item, value, allow_empty=False))
                continue
            form = received.forms[position] if received is not None else None
            if form is Form.MISSING or (form is None and item.omit_default):
                planned.append(None)
            elif form is Form.EMPTY or (form is None and item.send_default_empty):
                planned.append(b"")
            else:
                planned.append(self._encode_field(item, value, allow_empty=False))
        while planned and planned[-1] is None:
            planned.pop()
        frames = [
            frame if frame is not None else self._encode_field(item, values[item.name])
            for item, frame in zip(self.fields, planned, strict=False)
        ]
        if received is not None and received.extra and self.tolerates_extra:
            if len(frames) < len(self.fields):
                # The unknown frames come after the whole table.
                frames.extend(
                    self._encode_field(item, values[item.name])
                    for item in self.fields[len(frames) :]
                )
            frames.extend(received.extra)
        if not checked:
            self._check(message)
        return frames

    def _encode_field(self, item: Field, value: Any, *, allow_empty: bool = True) -> bytes:
        if allow_empty and item.send_default_empty and _is_default(value, item, None):
            return b""
        try:
            return item.codec.encode(value)
        except CodecError as exc:
            raise self._error(f"cannot encode: {exc}", self.fields.index(item), item.name) from None

    # --- decode ----------------------------------------------------------------------------

    def decode(self, frames: Sequence[bytes], *, allow_extra: bool = False) -> M:
        """Decode the field frames (the frames after `first_frame`).

        ``allow_extra`` accepts and ignores trailing frames beyond the layout (a newer minor
        version of the native profile); otherwise they are an error unless the layout
        tolerates them.
        """
        if len(frames) > len(self.fields) and not (allow_extra or self.tolerates_extra):
            raise self._error(
                f"expected at most {len(self.fields)} frames, got {len(frames)}",
                len(self.fields),
                None,
            )
        values: dict[str, Any] = {}
        forms: list[Form] = []
        for position, item in enumerate(self.fields):
            value = self._decode_field(position, item, frames, values)
            forms.append(_form(frames, position))
            if not item.is_constant:
                values[item.name] = value
        message = self.message_type(**values)
        self._check(message)
        extra = tuple(bytes(frame) for frame in frames[len(self.fields) :])
        message._received = Received((self.profile, self.type_name), tuple(forms), extra)
        return message

    def _decode_field(
        self, position: int, item: Field, frames: Sequence[bytes], earlier: Mapping[str, Any]
    ) -> Any:
        if position >= len(frames):
            if item.required:
                raise self._error(
                    f"missing required frame: expected at least {self.min_frames} frames, "
                    f"got {len(frames)}",
                    position,
                    item.name,
                )
            return item.default_value(earlier)
        raw = frames[position]
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise self._error(f"expected bytes, got {type(raw).__name__}", position, item.name)
        raw = bytes(raw)
        if not raw and item.empty_is_default and not item.required:
            return item.default_value(earlier)
        try:
            return item.codec.decode(raw)
        except CodecError as exc:
            raise self._error(str(exc), position, item.name) from None

    # --- inspect ---------------------------------------------------------------------------

    def inspect(
        self, frames: Sequence[bytes], *, allow_extra: bool = False
    ) -> tuple[list[FrameRow], list[str]]:
        """Decode frame by frame without stopping at the first error.

        Returns a row per field (and per extra frame) and the list of errors; an empty error
        list means `decode` accepts these frames.
        """
        rows: list[FrameRow] = []
        errors: list[str] = []
        values: dict[str, Any] = {}
        for position, item in enumerate(self.fields):
            index = self.first_frame + position
            raw_length = len(frames[position]) if position < len(frames) else None
            try:
                value = self._decode_field(position, item, frames, values)
            except WireError as exc:
                rows.append(FrameRow(index, item.name, item.codec.name, raw_length, "", str(exc)))
                errors.append(str(exc))
                continue
            if not item.is_constant:
                values[item.name] = value
            if raw_length is None:
                shown = f"(missing: default {_render(item, value)})"
            elif raw_length == 0 and not item.required and item.empty_is_default:
                shown = f"(empty: default {_render(item, value)})"
            else:
                shown = _render(item, value)
            rows.append(FrameRow(index, item.name, item.codec.name, raw_length, shown))
        tolerated = allow_extra or self.tolerates_extra
        for position in range(len(self.fields), len(frames)):
            raw = bytes(frames[position])
            error = None
            if not tolerated:
                error = str(
                    self._error(
                        f"expected at most {len(self.fields)} frames, got {len(frames)}",
                        position,
                        None,
                    )
                )
                errors.append(error)
            rows.append(
                FrameRow(
                    self.first_frame + position,
                    "(unknown, ignored)" if tolerated else "(unexpected)",
                    "",
                    len(raw),
                    describe_bytes(raw),
                    error,
                )
            )
        if not errors:
            try:
                self._check(self.message_type(**values))
            except WireError as exc:
                errors.append(str(exc))
        return rows, errors

    def release_note(self, frame_count: int) -> str | None:
        """Which known release layout a message of this many frames is, for `inspect`."""
        if not self.releases:
            return None
        for count, release in self.releases:
            if count == frame_count:
                return f"{frame_count} frames: the {release} layout"
        newest_count, newest = self.releases[0]
        if frame_count > newest_count:
            return (
                f"{frame_count} frames: the {newest} layout and {frame_count - newest_count} "
                f"later frame(s), ignored as {newest.split(' (')[0]} ignores them"
            )
        return (
            f"{frame_count} frames: shorter than the {newest} layout ({newest_count}); frames "
            f"{self.first_frame + frame_count}-{self.first_frame + newest_count - 1} take the "
            "defaults sglang applies"
        )


def _render(item: Field, value: Any) -> str:
    return "None" if value is None else item.codec.render(value)


def _form(frames: Sequence[bytes], position: int) -> Form:
    if position >= len(frames):
        return Form.MISSING
    return Form.EMPTY if len(frames[position]) == 0 else Form.VALUE


def _is_default(value: Any, item: Field, earlier: Mapping[str, Any] | None) -> bool:
    if item.required:
        return False
    if item.default_from is not None:
        if earlier is None:
            return False
        default = item.default_from(earlier)
    else:
        default = item.default_value({})
    if value is None or default is None:
        return value is default
    if isinstance(value, np.ndarray) or isinstance(default, np.ndarray):
        return False
    return bool(value == default) and type(value) is type(default)
