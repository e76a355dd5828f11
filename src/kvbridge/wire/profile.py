"""A profile: the set of layouts one kind of peer speaks, and how to tell its messages apart."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbridge.wire.errors import WireError
from kvbridge.wire.layout import FrameRow, Layout, Message


class Receiver(str, enum.Enum):
    """The side whose listener thread receives a message (SGLang dispatches per side)."""

    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class Inspection:
    """What `inspect` found in a frame list: the table, the errors, the message if valid."""

    profile: str
    type_name: str | None
    rows: list[FrameRow]
    errors: list[str]
    message: Message | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


class Profile(ABC):
    """The layouts of one wire dialect."""

    name: str
    doc: str
    layouts: tuple[Layout[Any], ...]

    def speaks(self, message_type: type[Message]) -> bool:
        """Whether this profile has a layout for the message type."""
        return any(layout.message_type is message_type for layout in self.layouts)

    def layout_for(self, message_type: type[Message]) -> Layout[Any]:
        for layout in self.layouts:
            if layout.message_type is message_type:
                return layout
        raise WireError(f"{message_type.__name__} has no layout in this profile", profile=self.name)

    def layout_named(self, type_name: str) -> Layout[Any]:
        for layout in self.layouts:
            if type_name in (layout.type_name, layout.message_type.__name__):
                return layout
        known = ", ".join(layout.type_name for layout in self.layouts)
        raise WireError(f"unknown message type {type_name!r} (known: {known})", profile=self.name)

    @abstractmethod
    def classify(self, frames: Sequence[bytes]) -> Layout[Any]:
        """The layout these frames claim to be; `WireError` if they fit none."""

    # One interface for every profile, so that callers never special-case one: `secret` is
    # the shared secret (a profile without an auth-tag frame refuses to encode or decode
    # with one), `receiver` the side whose listener to follow (profiles that dispatch by
    # side; others ignore it).

    @abstractmethod
    def encode(self, message: Message, *, secret: bytes | None = None) -> list[bytes]:
        """The frames to send for a message."""

    @abstractmethod
    def decode(
        self,
        frames: Sequence[bytes],
        type_name: str | None = None,
        *,
        secret: bytes | None = None,
        receiver: Receiver | None = None,
    ) -> Message:
        """The message the frames carry; `WireError` naming the frame and field if none."""

    @abstractmethod
    def inspect(
        self,
        frames: Sequence[bytes],
        type_name: str | None = None,
        *,
        secret: bytes | None = None,
        receiver: Receiver | None = None,
    ) -> Inspection:
        """Frame by frame, for display: never raises for bad input."""

    def refuse_secret(self, secret: bytes | None) -> None:
        """A profile with no frame for an auth tag cannot honour a shared secret."""
        if secret is not None:
            raise WireError(
                "a shared secret is configured but this profile has no frame for an auth tag",
                profile=self.name,
            )


def require_frames(frames: Sequence[bytes], profile: str) -> None:
    """A frame list must be a non-empty sequence of bytes before anything looks at it."""
    if isinstance(frames, (bytes, bytearray, str)):
        raise WireError("expected a list of frames, got a single bytes object", profile=profile)
    if len(frames) == 0:
        raise WireError(
            "expected at least one frame, got an empty message", profile=profile, frame_index=0
        )
    for index, frame in enumerate(frames):
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            raise WireError(
                f"expected bytes, got {type(frame).__name__}", profile=profile, frame_index=index
            )
