"""A cleared room is counted under its outcome and its failure kind, never its free text."""

from __future__ import annotations

import pytest

from kvbridge.core.room import RoomStatus
from kvbridge.metrics import count_finished
from kvbridge.wire import FailureKind, KVPoll


@pytest.mark.parametrize("kind", list(FailureKind))
def test_a_failed_room_counts_under_its_kind(kind: FailureKind) -> None:
    status = RoomStatus()
    status.fail(kind, f"room 1: free text that names {kind.name} and 'silent for' alike")
    counts: dict[tuple[str, str], int] = {}
    count_finished(counts, status)
    count_finished(counts, status)
    assert counts == {("Failed", kind.name.lower()): 2}


def test_a_room_that_did_not_fail_has_no_kind() -> None:
    counts: dict[tuple[str, str], int] = {}
    for poll in (KVPoll.Success, KVPoll.Transferring, KVPoll.Bootstrapping):
        status = RoomStatus()
        if poll != KVPoll.Bootstrapping:
            status.advance(poll)
        count_finished(counts, status)
    assert counts == {("Success", ""): 1, ("Transferring", ""): 1, ("Bootstrapping", ""): 1}
