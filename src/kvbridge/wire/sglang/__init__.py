"""Byte-compatible SGLang PD-disaggregation profiles (`sglang-mooncake`, `sglang-nixl`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from kvbridge.wire import codecs as c
from kvbridge.wire.layout import Field, Layout, Message

# Frames 14 and 15 of both SGLang registrations: the decode staging ring as two explicit
# scalars, sent as empty placeholders when decode has no ring.
STAGING_FIELDS = (
    Field(
        "staging_base_ptr",
        c.POINTER,
        "decode staging ring address; empty placeholder when there is no ring",
        default=0,
        send_default_empty=True,
    ),
    Field(
        "staging_total_size",
        c.ASCII_UINT,
        "decode staging ring bytes; empty placeholder when there is no ring",
        default=0,
        send_default_empty=True,
    ),
)


class ZmqMessage(Message):
    """SGLang's ``from_zmq``/``to_zmq`` spelling over the message's one layout."""

    LAYOUT: ClassVar[Layout[Any]]

    @classmethod
    def from_zmq(cls, frames: Sequence[bytes]) -> Any:
        return cls.LAYOUT.decode(frames)

    def to_zmq(self) -> list[bytes]:
        return self.LAYOUT.encode(self)
