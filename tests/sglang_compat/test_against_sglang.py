"""kvbridge's SGLang profiles against sglang 0.5.23 itself, both directions.

Runs in sglang's own environment (`make test` builds it with scripts/sglang-env.sh and runs
this folder there); in kvbridge's environment, where sglang is not installed, it is skipped
and tests/unit/test_sglang_goldens.py checks the committed goldens instead.

- sglang's builders → kvbridge: over many generated inputs, kvbridge decodes sglang's frames
  to what sglang's own parser reads, gives them back byte for byte, and builds the same
  frames from the same values.
- kvbridge → sglang's parsers: every message kvbridge can encode in an SGLang profile is read
  by sglang's own parsing code as kvbridge meant it.
- Older peers: every shorter shape sglang accepts decodes in both to the same values.
- The committed goldens are still what sglang produces.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "sglang is not installed here: make test runs this folder in .venv-sglang",
        allow_module_level=True,
    )

import cases
import harness
import make_goldens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang_views import GOLDENS, KINDS, expected_message, sglang_view
from wire_strategies import messages_of

from kvbridge.wire import Layout, Message, WireError
from kvbridge.wire.messages import StagingRequest, StagingResponse
from kvbridge.wire.sglang import common, mooncake, nixl

SEEDS = range(100, 120)  # 20 × 12 = 240 generated messages of every kind

# The kind (harness name) of each SGLang layout, for kvbridge → sglang.
LAYOUT_KINDS: list[tuple[Layout[Any], str]] = [
    (mooncake.REGISTER_INFO, "mooncake-registration"),
    (mooncake.TRANSFER_INFO, "mooncake-transfer-info"),
    (mooncake.TRANSFER_STATUS, "mooncake-status"),
    (nixl.REGISTER_INFO, "nixl-registration"),
    (nixl.TRANSFER_INFO, "nixl-transfer-info"),
    (nixl.KV_STATUS, "nixl-status"),
    (common.ABORT, "abort"),
    (common.ABORT_ACK, "abort-ack"),
    (common.CHUNK_READY, "chunk-ready"),
    (common.AUX_DATA, "aux-data"),
    (common.STAGING_REQ, "staging-req"),
    (common.STAGING_RSP, "staging-rsp"),
    (common.WATERMARK, "watermark"),
    (common.BOOTSTRAP, "bootstrap"),
]


def test_every_layout_is_compared() -> None:
    layouts = {
        id(layout) for profile in (mooncake.MOONCAKE, nixl.NIXL) for layout in profile.layouts
    }
    assert layouts == {id(layout) for layout, _ in LAYOUT_KINDS}


def test_committed_goldens_are_what_sglang_makes() -> None:
    assert GOLDENS.read_text() == make_goldens.render(make_goldens.goldens()), (
        "tests/goldens/sglang-0.5.23.json is stale: run "
        ".venv-sglang/bin/python tests/sglang_compat/make_goldens.py"
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_sglang_builders_to_kvbridge(seed: int) -> None:
    for kind, inputs in cases.draw(seed, per_kind=12):
        profile, receiver = KINDS[kind]
        for frames in harness.build(kind, inputs):
            parsed = harness.PARSERS[kind](frames, inputs)
            message = profile.decode(frames, receiver=receiver)
            assert sglang_view(kind, message, inputs) == parsed, (kind, inputs)
            assert profile.encode(message) == frames, (kind, inputs)
            assert profile.encode(expected_message(kind, inputs, parsed)) == frames, kind


def _sendable(kind: str, message: Message) -> Message:
    """Values a real peer sends and the stand-in listener can answer: its bootstrap entries
    are pp 0-3, and sglang grows a list up to a STAGING_REQ's or STAGING_RSP's chunk index
    (a forged index of 2**60 would exhaust its memory)."""
    if isinstance(message, StagingRequest) and message.requester_pp_rank is not None:
        message.requester_pp_rank %= 4
    if isinstance(message, (StagingRequest, StagingResponse)):
        message.chunk_idx %= 4096
    return message


@pytest.mark.parametrize(("layout", "kind"), LAYOUT_KINDS, ids=[kind for _, kind in LAYOUT_KINDS])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_kvbridge_frames_to_sglang_parsers(
    layout: Layout[Any], kind: str, data: st.DataObject
) -> None:
    profile, _ = KINDS[kind]
    message = _sendable(kind, data.draw(messages_of(layout)))
    frames = profile.encode(message)
    hint = {
        "room": getattr(message, "room", None),
        "session_id": getattr(message, "session_id", None),
    }
    assert harness.PARSERS[kind](frames, hint) == sglang_view(kind, message, hint)


OLDER_SHAPES = [
    "mooncake-registration",
    "mooncake-transfer-info",
    "nixl-registration",
    "nixl-transfer-info",
    "abort",
    "abort-ack",
    "staging-req",
    "watermark",
    "chunk-ready",
    "nixl-status",
    "mooncake-status",
]


@pytest.mark.parametrize("kind", OLDER_SHAPES)
def test_shorter_messages_of_older_peers_read_the_same_in_both(kind: str) -> None:
    profile, receiver = KINDS[kind]
    for _, inputs in [case for case in cases.draw(7, per_kind=8) if case[0] == kind]:
        frames = harness.build(kind, inputs)[0]
        layout = profile.split(frames, None, receiver)[0]
        prefix = len(layout.prefix)
        for count in range(prefix + layout.min_frames, len(frames)):
            shorter = frames[:count]
            try:
                parsed = harness.PARSERS[kind](shorter, inputs)
            except (IndexError, ValueError):
                continue  # sglang cannot read this shape either
            staged = kind.endswith("registration") and inputs["staging"] is not None
            if staged and count == prefix + 15:
                # Frames 14 and 15 came in one release; the pointer alone is a ring without a
                # size, which sglang would accept and never be able to write to.
                with pytest.raises(WireError, match="a staging ring needs a size"):
                    profile.decode(shorter, receiver=receiver)
                continue
            message = profile.decode(shorter, receiver=receiver)
            assert sglang_view(kind, message, inputs) == parsed, (kind, count)
            assert profile.encode(message) == shorter
