"""Byte-compatible SGLang PD-disaggregation profiles (`sglang-mooncake`, `sglang-nixl`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from kvbridge.wire.layout import Layout, Message


class ZmqMessage(Message):
    """SGLang's ``from_zmq``/``to_zmq`` spelling over the message's one layout."""

    LAYOUT: ClassVar[Layout[Any]]

    @classmethod
    def from_zmq(cls, frames: Sequence[bytes]) -> Any:
        return cls.LAYOUT.decode(frames)

    def to_zmq(self) -> list[bytes]:
        return self.LAYOUT.encode(self)
