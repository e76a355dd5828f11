"""kvbridge against the goldens recorded from sglang 0.5.23's own builders and parsers
(tests/goldens/sglang-0.5.23.json, made by tests/sglang_compat/make_goldens.py;
tests/sglang_compat checks them against sglang itself). For every message kind sglang's PD
code sends:

- kvbridge decodes sglang's frames (dispatched as sglang's listener on the receiving side
  would) to what sglang's own parser read, field for field;
- `to_zmq` of the decoded message gives back sglang's frames byte for byte;
- the same values built into a kvbridge message encode to sglang's frames byte for byte.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from sglang_views import GOLDENS, KINDS, expected_message, sglang_view

from kvbridge.wire import inspect_frames

DATA = json.loads(GOLDENS.read_text())
MESSAGES: list[dict[str, Any]] = DATA["messages"]


def _id(record: dict[str, Any]) -> str:
    return record["kind"]


def test_goldens_cover_every_kind_from_the_right_release() -> None:
    assert DATA["sglang"] == "0.5.23"
    assert set(Counter(record["kind"] for record in MESSAGES)) == set(KINDS)


@pytest.mark.parametrize("record", MESSAGES, ids=_id)
def test_sglang_frames_decode_as_sglang_reads_them(record: dict[str, Any]) -> None:
    profile, receiver = KINDS[record["kind"]]
    frames = [bytes.fromhex(frame) for frame in record["frames"]]
    message = profile.decode(frames, receiver=receiver)
    assert sglang_view(record["kind"], message, record["inputs"]) == record["sglang"]
    assert profile.encode(message) == frames
    assert profile.decode(frames) == message  # the same without knowing the receiving side


@pytest.mark.parametrize("record", MESSAGES, ids=_id)
def test_kvbridge_builds_the_frames_sglang_builds(record: dict[str, Any]) -> None:
    profile, _ = KINDS[record["kind"]]
    message = expected_message(record["kind"], record["inputs"], record["sglang"])
    assert profile.encode(message) == [bytes.fromhex(frame) for frame in record["frames"]]


@pytest.mark.parametrize("record", MESSAGES[::7], ids=_id)
def test_inspect_names_the_profile_and_the_release_layout(record: dict[str, Any]) -> None:
    profile, _ = KINDS[record["kind"]]
    frames = [bytes.fromhex(frame) for frame in record["frames"]]
    result = inspect_frames(frames)
    assert result.ok, result.errors
    assert result.profile == profile.name or record["kind"] in SHARED_KINDS
    assert any("sglang 0.5.23" in note for note in result.notes), result.notes


# Control messages both backends send alike: inspect reads them in the Mooncake profile.
SHARED_KINDS = {
    "abort",
    "abort-ack",
    "legacy-abort-ack",
    "chunk-ready",
    "staging-req",
    "staging-rsp",
    "watermark",
}
