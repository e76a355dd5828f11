"""Every control message a rank sends and receives, written as a frames file that
`kvbridge inspect --file` reads: set `KVBRIDGE_CAPTURE_DIR` to a directory before the managers
start (a debugging aid: each message is one small file, written on the channel's thread).

A file is the frames file's JSON form, with what inspect needs to read the frames as the
listener did: the profile (an SGLang profile for a rank whose peers are sglang's, else
detected) and, for SGLang frames, which side's listener received them.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from pathlib import Path

from kvbridge.wire import Receiver

CAPTURE_VARIABLE = "KVBRIDGE_CAPTURE_DIR"

log = logging.getLogger("kvbridge.control")


class FrameCapture:
    """Writes `NNNNNN-<direction>.json` files into a directory of its own per channel."""

    def __init__(self, directory: Path, profile: str | None, receiver: Receiver | None) -> None:
        self.directory = directory
        self._profile, self._receiver = profile, receiver
        self._sequence = itertools.count(1)
        directory.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def from_environment(
        channel: str, profile: str | None, receiver: Receiver | None
    ) -> FrameCapture | None:
        """A capture into `$KVBRIDGE_CAPTURE_DIR/<channel>`, or None when it is not set."""
        root = os.environ.get(CAPTURE_VARIABLE)
        if not root:
            return None
        capture = FrameCapture(Path(root) / channel, profile, receiver)
        log.warning("capturing every control message into %s", capture.directory)
        return capture

    def write(self, direction: str, endpoint: str, frames: list[bytes]) -> None:
        """One message; `direction` is "sent" or "received". A message sent is read as the
        other side's listener reads it."""
        received = direction == "received"
        document: dict[str, object] = {
            "frames": [frame.hex() for frame in frames],
            "description": f"{direction} {'from' if received else 'to'} {endpoint or 'a peer'}",
        }
        if self._profile is not None:
            document["profile"] = self._profile
        if self._receiver is not None:
            other = Receiver.DECODE if self._receiver is Receiver.PREFILL else Receiver.PREFILL
            document["receiver"] = (self._receiver if received else other).value
        path = self.directory / f"{next(self._sequence):06d}-{direction}.json"
        try:
            path.write_text(json.dumps(document))
        except OSError as exc:  # a full disk must not stop the channel
            log.warning("capture of a control message failed: %s", exc)
