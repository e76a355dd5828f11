"""Authentication of native messages: the tag frame, and the guard against replays.

With a shared secret, a native message ends with a tag frame: a 16-byte random nonce, the
sender's clock as nanoseconds (uint64, little-endian), and an HMAC-SHA256 over every frame
before it (each preceded by its length as a uint32) followed by the nonce and the timestamp.
A receiver with the secret refuses a message whose HMAC does not match, whose timestamp is
further than `max_skew_s` from its own clock, or whose nonce it has already accepted within
that window (a replay).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

NONCE_SIZE = 16
_TIMESTAMP = struct.Struct("<Q")
MAC_SIZE = hashlib.sha256().digest_size
TAG_SIZE = NONCE_SIZE + _TIMESTAMP.size + MAC_SIZE
DEFAULT_MAX_SKEW_S = 30.0
SECRET_ENV = "KVBRIDGE_SECRET"


def secret_from_env() -> bytes | None:
    """The shared secret from `KVBRIDGE_SECRET`, if set and non-empty."""
    value = os.environ.get(SECRET_ENV)
    return value.encode() if value else None


def _mac(secret: bytes, frames: Sequence[bytes], nonce: bytes, timestamp: bytes) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for frame in frames:
        mac.update(struct.pack("<I", len(frame)))
        mac.update(frame)
    mac.update(nonce)
    mac.update(timestamp)
    return mac.digest()


def make_tag(secret: bytes, frames: Sequence[bytes], now_ns: int | None = None) -> bytes:
    nonce = os.urandom(NONCE_SIZE)
    timestamp = _TIMESTAMP.pack(time.time_ns() if now_ns is None else now_ns)
    return nonce + timestamp + _mac(secret, frames, nonce, timestamp)


@dataclass(frozen=True)
class TagCheck:
    """What a verified tag says: who may have sent it when, and its nonce."""

    nonce: bytes
    timestamp_ns: int


def check_tag(secret: bytes, frames: Sequence[bytes], tag: bytes) -> TagCheck | str:
    """The verified tag, or why it is refused."""
    if len(tag) != TAG_SIZE:
        return f"expected a {TAG_SIZE}-byte auth tag, got {len(tag)} bytes"
    nonce, timestamp = tag[:NONCE_SIZE], tag[NONCE_SIZE : NONCE_SIZE + _TIMESTAMP.size]
    if not hmac.compare_digest(tag[-MAC_SIZE:], _mac(secret, frames, nonce, timestamp)):
        return "HMAC tag does not match: wrong secret or altered message"
    return TagCheck(nonce, _TIMESTAMP.unpack(timestamp)[0])


class ReplayGuard:
    """Refuses stale messages and nonces seen before, remembering nonces only as long as a
    message carrying them could still be fresh (memory stays bounded by the message rate)."""

    def __init__(
        self,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.max_skew_ns = int(max_skew_s * 1e9)
        self._clock_ns = clock_ns
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce → when it may be forgotten

    def admit(self, check: TagCheck) -> str | None:
        """None if the message is fresh and new (and remember it), else why it is refused."""
        now = self._clock_ns()
        while self._seen and next(iter(self._seen.values())) < now:
            self._seen.popitem(last=False)
        skew = check.timestamp_ns - now
        if abs(skew) > self.max_skew_ns:
            window = self.max_skew_ns / 1e9
            return f"timestamp {skew / 1e9:+.1f} s from this clock (window ±{window:g} s)"
        if check.nonce in self._seen:
            return "nonce already seen: a replayed message"
        self._seen[check.nonce] = now + 2 * self.max_skew_ns
        return None

    def __len__(self) -> int:
        return len(self._seen)
