"""`KVBRIDGE_CAPTURE_DIR`: every control message a channel sends and receives, as a frames file
`kvbridge inspect` reads the way the listener read it (tests/sglang_compat inspects a live
session's capture with the command itself)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvbridge.cli.main import app
from kvbridge.control.capture import CAPTURE_VARIABLE, FrameCapture
from kvbridge.wire import KVPoll, Receiver, TransferStatus
from kvbridge.wire.sglang.mooncake import MOONCAKE


def test_nothing_is_captured_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CAPTURE_VARIABLE, raising=False)
    assert FrameCapture.from_environment("kvbridge-decode-1", None, None) is None


def test_a_captured_status_reads_back_as_the_listener_read_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CAPTURE_VARIABLE, str(tmp_path))
    capture = FrameCapture.from_environment("kvbridge-decode-1", MOONCAKE.name, Receiver.DECODE)
    assert capture is not None
    # sglang's Mooncake status has no tag: only its listener's side tells it from a request.
    frames = MOONCAKE.encode(TransferStatus(7, KVPoll.Success, 1))
    capture.write("received", "", frames)
    capture.write("sent", "tcp://10.0.0.1:7000", frames)
    received, sent = sorted((tmp_path / "kvbridge-decode-1").iterdir())
    document = json.loads(received.read_text())
    assert (document["profile"], document["receiver"]) == ("sglang-mooncake", "decode")
    assert json.loads(sent.read_text())["receiver"] == "prefill"  # the other side's listener
    shown = CliRunner().invoke(app, ["inspect", "--file", str(received)])
    assert shown.exit_code == 0, shown.output
    assert "sglang-mooncake · TransferStatus" in shown.output
