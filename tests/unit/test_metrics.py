"""Failure reasons map onto a small, fixed set of metric labels."""

from __future__ import annotations

import pytest

from kvbridge.metrics import failure_kind


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("room 1: aborted by decode: the user cancelled", "aborted"),
        ("room 1: decode d0 silent for 3.2 s (peer timeout 3 s)", "peer_dead"),
        ("room 1: transfer not complete before its deadline; no success from [0]", "timeout"),
        ("room 1: 0 of any transfer request(s) from decode in 300 s", "timeout"),
        ("room 1: nixl: write failed: NIXL_ERR_BACKEND", "engine"),
        ("room 1: head_dim differs: 8 → 16; both sides must run the same model", "geometry"),
        ("something new", "other"),
        (None, "other"),
    ],
)
def test_failure_kinds(reason: str | None, kind: str) -> None:
    assert failure_kind(reason) == kind
