"""Declarative frame layouts: one ordered table per message and profile.

A `Layout` is the single place that says which frame carries which field with which codec and
what a missing frame means. Encoding, decoding, the `inspect` table and the generated protocol
document are all derived from it; no other code indexes frames by position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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

    ``default`` (or ``default_factory``) makes the field optional: a missing trailing frame
    takes it, and so does an empty frame when ``empty_is_default`` is set. With
    ``send_default_empty``, the default value is sent as an empty frame (SGLang's empty
    placeholders; the native profile's explicit absence).
    """

    name: str
    codec: Codec[Any]
    doc: str = ""
    default: Any = REQUIRED
    default_factory: Callable[[], Any] | None = None
    empty_is_default: bool = True
    send_default_empty: bool = False
    # The default is sent by leaving the frame out; only for trailing fields (older peers).
    omit_default: bool = False

    @property
    def required(self) -> bool:
        return self.default is REQUIRED and self.default_factory is None

    @property
    def is_constant(self) -> bool:
        return isinstance(self.codec, Constant)

    def default_value(self) -> Any:
        return self.default_factory() if self.default_factory is not None else self.default

    def describe_default(self) -> str:
        if self.required:
            return "required"
        return repr(self.default_value())


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
        if type(message) is not self.message_type:
            raise WireError(
                f"expected a {self.message_type.__name__}, got {type(message).__name__}",
                profile=self.profile,
                message_type=self.type_name,
            )
        carried = {item.name for item in self.fields}
        for attribute in dataclasses.fields(message):  # type: ignore[arg-type]
            if attribute.name in carried:
                continue
            default = (
                attribute.default_factory()
                if attribute.default_factory is not dataclasses.MISSING
                else attribute.default
            )
            if getattr(message, attribute.name) != default:
                raise self._error(
                    f"this profile has no frame for {attribute.name}; it must stay {default!r}",
                    None,
                    attribute.name,
                )
        frames = []
        omitted = 0  # trailing frames left out because they carry their default
        for position, item in enumerate(self.fields):
            value = None if item.is_constant else getattr(message, item.name)
            if item.omit_default and _is_default(value, item):
                omitted += 1
                continue
            if omitted:
                # A field after an omitted one is sent, so the omitted frames must be too.
                for skipped in self.fields[position - omitted : position]:
                    frames.append(self._encode_field(skipped, getattr(message, skipped.name)))
                omitted = 0
            frames.append(self._encode_field(item, value))
        # After the codecs, which have checked each value's type and range.
        self._check(message)
        return frames

    def _encode_field(self, item: Field, value: Any) -> bytes:
        if item.send_default_empty and _is_default(value, item):
            return b""
        try:
            return item.codec.encode(value)
        except CodecError as exc:
            raise self._error(f"cannot encode: {exc}", self.fields.index(item), item.name) from None

    # --- decode ----------------------------------------------------------------------------

    def decode(self, frames: Sequence[bytes], *, allow_extra: bool = False) -> M:
        """Decode the field frames (the frames after `first_frame`).

        ``allow_extra`` accepts and ignores trailing frames beyond the layout (a newer minor
        version of the native profile); otherwise they are an error.
        """
        if len(frames) > len(self.fields) and not allow_extra:
            raise self._error(
                f"expected at most {len(self.fields)} frames, got {len(frames)}",
                len(self.fields),
                None,
            )
        values: dict[str, Any] = {}
        for position, item in enumerate(self.fields):
            value = self._decode_field(position, item, frames)
            if not item.is_constant:
                values[item.name] = value
        message = self.message_type(**values)
        self._check(message)
        return message

    def _decode_field(self, position: int, item: Field, frames: Sequence[bytes]) -> Any:
        if position >= len(frames):
            if item.required:
                raise self._error(
                    f"missing required frame: expected at least {self.min_frames} frames, "
                    f"got {len(frames)}",
                    position,
                    item.name,
                )
            return item.default_value()
        raw = frames[position]
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise self._error(f"expected bytes, got {type(raw).__name__}", position, item.name)
        raw = bytes(raw)
        if not raw and item.empty_is_default and not item.required:
            return item.default_value()
        try:
            return item.codec.decode(raw)
        except CodecError as exc:
            raise self._error(str(exc), position, item.name) from None

    # --- inspect ---------------------------------------------------------------------------

    def inspect(
        self, frames: Sequence[bytes], *, allow_extra: bool = False
    ) -> tuple[list[FrameRow], list[str]]:
        """Decode frame by frame without stopping at the first error.

        Returns a row per field (and per unexpected extra frame) and the list of errors; an
        empty error list means `decode` accepts these frames.
        """
        rows: list[FrameRow] = []
        errors: list[str] = []
        values: dict[str, Any] = {}
        for position, item in enumerate(self.fields):
            index = self.first_frame + position
            raw_length = len(frames[position]) if position < len(frames) else None
            try:
                value = self._decode_field(position, item, frames)
            except WireError as exc:
                rows.append(FrameRow(index, item.name, item.codec.name, raw_length, "", str(exc)))
                errors.append(str(exc))
                continue
            if not item.is_constant:
                values[item.name] = value
            if raw_length is None:
                shown = f"(missing: default {item.codec.render(value)})"
            elif raw_length == 0 and not item.required and item.empty_is_default:
                shown = f"(empty: default {item.codec.render(value)})"
            else:
                shown = item.codec.render(value)
            rows.append(FrameRow(index, item.name, item.codec.name, raw_length, shown))
        extra_positions = range(len(self.fields), 0 if allow_extra else len(frames))
        for position in extra_positions:
            error = self._error(
                f"expected at most {len(self.fields)} frames, got {len(frames)}", position, None
            )
            rows.append(
                FrameRow(
                    self.first_frame + position,
                    "(unexpected)",
                    "",
                    len(frames[position]),
                    describe_bytes(bytes(frames[position])),
                    str(error),
                )
            )
            errors.append(str(error))
        if not errors:
            try:
                self._check(self.message_type(**values))
            except WireError as exc:
                errors.append(str(exc))
        return rows, errors


def _is_default(value: Any, item: Field) -> bool:
    default = item.default_value()
    if value is None or default is None:
        return value is default
    if isinstance(value, np.ndarray):
        return False
    return bool(value == default) and type(value) is type(default)
