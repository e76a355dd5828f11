"""`inspect_frames`: the frame-by-frame view behind `kvbridge inspect`."""

from __future__ import annotations

import pytest

from kvbridge import samples
from kvbridge.wire import inspect_frames
from kvbridge.wire.framefile import load_frames
from kvbridge.wire.native import MAJOR, MINOR, Header


def sample(name: str) -> list[bytes]:
    return load_frames(samples.sample_bytes(name))[0]


@pytest.mark.parametrize(
    ("name", "profile", "type_name"),
    [
        ("native-registration", "kvbridge/1", "Registration"),
        ("sglang-nixl-registration", "sglang-nixl", "KVArgsRegisterInfo"),
        ("sglang-mooncake-registration", "sglang-mooncake", "KVArgsRegisterInfo"),
        ("sglang-mooncake-registration-seed-era", "sglang-mooncake", "KVArgsRegisterInfo"),
        ("sglang-mooncake-transfer-info", "sglang-mooncake", "TransferInfo"),
        ("sglang-nixl-transfer-info", "sglang-nixl", "TransferInfo"),
        ("sglang-nixl-status", "sglang-nixl", "KV_STATUS"),
        ("sglang-mooncake-status", "sglang-mooncake", "TransferStatus"),
        ("sglang-abort", "sglang-mooncake", "ABORT"),
        ("sglang-aux-data", "sglang-mooncake", "AUX_DATA"),
        ("sglang-bootstrap", "sglang-mooncake", "BOOTSTRAP"),
    ],
)
def test_detects_profile_and_type(name: str, profile: str, type_name: str) -> None:
    result = inspect_frames(sample(name))
    assert (result.profile, result.type_name, result.ok) == (profile, type_name, True)
    assert result.message is not None


def test_every_bad_frame_is_reported_not_only_the_first() -> None:
    frames = sample("sglang-mooncake-registration-seed-era")
    frames[2] = b"12a4"
    frames[14] = b"\x00" * 5
    result = inspect_frames(frames)
    assert not result.ok
    assert result.message is None
    bad = {row.index: row.error for row in result.rows if row.error}
    assert set(bad) == {2, 14}
    assert "b'12a4'" in str(bad[2])
    assert [row.index for row in result.rows] == list(range(20))  # 18-19: missing


def test_missing_and_extra_frames_are_shown() -> None:
    frames = sample("sglang-mooncake-registration")[:16]
    result = inspect_frames(frames)
    assert result.ok
    assert result.rows[16].raw_length is None
    assert "missing: default 1" in result.rows[16].value
    assert "shorter than the sglang 0.5.23 layout (20)" in " ".join(result.notes)

    # sglang reads frames by index and ignores later ones: so does kvbridge, and says so.
    newer = inspect_frames([*sample("sglang-mooncake-registration"), b"x"])
    assert newer.ok
    assert (newer.rows[-1].field, newer.rows[-1].index) == ("(unknown, ignored)", 20)
    assert "1 later frame(s), ignored" in " ".join(newer.notes)
    # The native profile refuses them unless a newer minor version says they are fields.
    native = inspect_frames([*sample("native-transfer-request"), b"x"])
    assert not native.ok
    assert native.rows[-1].field == "(unexpected)"


def test_newer_minor_version_frames_are_noted_not_refused() -> None:
    frames = sample("native-transfer-request")
    frames[0] = Header(MAJOR, MINOR + 1, 2, 0).pack()
    result = inspect_frames([*frames, b"future field"])
    assert result.ok
    assert any("ignored" in note for note in result.notes)


def test_native_type_mismatch_and_empty_input() -> None:
    result = inspect_frames(sample("native-transfer-request"), type_name="Registration")
    assert not result.ok
    assert "the header says TransferRequest" in result.errors[0]
    assert not inspect_frames([]).ok
    assert not inspect_frames([b"KVBR"]).ok
