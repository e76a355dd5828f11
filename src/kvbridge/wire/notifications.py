"""The engine notification a prefill rank attaches to a room's last write (the engine
delivers it to decode once the transfer's bytes landed): ``kvbridge:<room>:<prefill rank>``,
with ``:complete`` when it is also the rank's success report for the room."""

from __future__ import annotations

# A decode rank's registration capability: it takes a "complete" notification as the prefill
# rank's success report for the room, which then sends no success status to it.
COMPLETING_NOTIFICATIONS = "completing-notifications"
_COMPLETE = b"complete"


def notification_for(room: int, prefill_rank: int, complete: bool = False) -> bytes:
    """The notification a prefill rank attaches to a room's last write; `complete`: it also
    says that every write of the room to that decode rank landed (only for decode ranks that
    registered `COMPLETING_NOTIFICATIONS`: others do not parse it)."""
    plain = f"kvbridge:{room}:{prefill_rank}".encode()
    return plain + b":" + _COMPLETE if complete else plain


def parse_notification(message: bytes) -> tuple[int, int, bool] | None:
    """(room, prefill rank, complete) of a kvbridge notification, None for anything else."""
    parts = message.split(b":")
    if len(parts) not in (3, 4) or parts[0] != b"kvbridge":
        return None
    if not parts[1].isdigit() or not parts[2].isdigit():
        return None
    if len(parts) == 4 and parts[3] != _COMPLETE:
        return None
    return int(parts[1]), int(parts[2]), len(parts) == 4
