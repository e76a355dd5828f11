"""docs/PROTOCOL.md is generated from the layouts and must not be stale."""

from __future__ import annotations

from pathlib import Path

from kvbridge.wire import PROFILES
from kvbridge.wire.protocol_doc import render_protocol

DOC = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"


def test_committed_protocol_document_is_current() -> None:
    assert DOC.read_text() == render_protocol(), "docs/PROTOCOL.md is stale: run `make docs`"


def test_document_covers_every_field_of_every_layout() -> None:
    document = render_protocol()
    for profile in PROFILES.values():
        assert f"`{profile.name}`" in document
        for layout in profile.layouts:
            assert f"### {layout.type_name}" in document
            for item in layout.fields:
                assert f"`{item.name}`" in document
