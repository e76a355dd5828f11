"""kvbridge live beside sglang 0.5.23's real PD transfer layer, over Mooncake TCP: a kvbridge
decode rank receives rooms from sglang's own prefill (`MooncakeKVManager`, its senders and
bootstrap server), every byte checked (live_peer.py runs each scenario in a network namespace
of its own; root only)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "sglang is not installed here (tests/sglang_compat runs in .venv-sglang)",
        allow_module_level=True,
    )

from kvbridge_tools.bench import json_in_private_netns, private_netns_unavailable

SCRIPT = Path(__file__).resolve().parent / "live_peer.py"
pytestmark = pytest.mark.skipif(
    private_netns_unavailable() is not None, reason=str(private_netns_unavailable())
)


def scenario(**spec: Any) -> dict[str, Any]:
    report: dict[str, Any] = json_in_private_netns(
        [str(SCRIPT), json.dumps(spec)], python=sys.executable
    )
    # Nothing kvbridge received was unreadable or ignored, nothing native went to sglang.
    channel = report["channel"]
    assert (channel["malformed"], channel["refused_native"], channel["handler_errors"]) == (0, 0, 0)
    assert report["ignored"] == 0
    assert report["sentinel_kept"], "a page no room asked for was written"
    return report


def test_a_kvbridge_decode_receives_every_byte_from_sglangs_prefill() -> None:
    report = scenario(rooms=6, pages_per_room=8, chunks=2)
    assert {room["poll"] for room in report["decode"].values()} == {"Success"}
    assert report["verified"] == 6
    assert set(report["prefill"].values()) == {"Success"}


def test_two_decode_ranks_each_get_their_heads_from_one_sglang_prefill_rank() -> None:
    # sglang's prefill (TP 1) awaits two requests per room and writes each decode rank its
    # half of the heads, token by token (its send_kvcache_slice): every byte checked per rank.
    report = scenario(rooms=3, decode_tp=2)
    assert {room["poll"] for room in report["decode"].values()} == {"Success"}
    assert report["verified"] == 3
    assert set(report["prefill"].values()) == {"Success"}


def test_rooms_decode_aborts_end_on_both_sides_and_their_pages_come_free() -> None:
    report = scenario(rooms=4, abort_rooms=[1, 2])
    for room in ("1", "2"):
        outcome = report["decode"][room]
        assert outcome["poll"] == "Failed"
        assert outcome["reason"] == "aborted by decode: the scheduler gave up on it"
        # sglang's prefill acknowledged the abort with its generation: nothing in flight.
        assert outcome["pages_safe"]
        assert report["prefill"][room] == "Failed"
    assert report["decode"]["0"]["poll"] == report["decode"]["3"]["poll"] == "Success"
    assert report["verified"] == 2


def test_a_killed_sglang_prefill_fails_its_rooms_within_the_peer_timeout() -> None:
    report = scenario(rooms=3, kill_prefill=True)
    for outcome in report["decode"].values():
        assert outcome["poll"] == "Failed"
        assert outcome["kind"] == "PEER_DEAD"
        assert "SGLang prefill" in outcome["reason"]
        assert "silent for" in outcome["reason"]
        # peer_timeout_s (3 s) after its bootstrap's last health answer.
        assert outcome["failed_after_s"] < 3.0 + 2.0
        # It was told to abort (it may only be hung) and never acknowledged: its pages stay
        # out of use until sglang's own release time (ABORT_RELEASE_S) has passed.
        assert not outcome["pages_safe"]
