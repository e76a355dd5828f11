"""The `kvbridge` command, run as a real process."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge import samples
from kvbridge.engines import REGISTRY, unavailable_reason
from kvbridge.wire.framefile import dump_binary, load_frames

ROOT = Path(__file__).resolve().parents[2]


def kvbridge(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "kvbridge", *args],
        input=stdin,
        capture_output=True,
        timeout=60,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
        cwd=ROOT,
    )
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
    )


@pytest.mark.parametrize("name", samples.sample_names())
def test_inspect_every_sample(name: str) -> None:
    result = kvbridge("inspect", "--sample", name)
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout


def test_inspect_table_shows_layout_and_values() -> None:
    result = kvbridge("inspect", "--sample", "sglang-mooncake-registration-seed-era")
    assert result.returncode == 0
    out = result.stdout
    assert "sglang-mooncake · KVArgsRegisterInfo" in out
    for text in ("staging_base_ptr", "0x3000", "staging_total_size", "4096", "dst_dcp_rank"):
        assert text in out
    assert "18 frames: the seed era" in out


def test_inspect_hex_arguments_detects_the_message() -> None:
    result = kvbridge("inspect", b"12".hex(), b"4".hex(), b"1".hex())
    assert result.returncode == 0, result.stderr
    assert "TransferStatus" in result.stdout
    assert "Success (4)" in result.stdout


def test_inspect_names_the_bad_frame_and_exits_1(tmp_path: Path) -> None:
    frames, _ = load_frames(samples.sample_bytes("sglang-mooncake-registration"))
    frames[2] = b"12a4"
    frames[14] = struct.pack("<Q", 0x3000)[:5]
    path = tmp_path / "bad.frames"
    path.write_bytes(dump_binary(frames))
    result = kvbridge("inspect", "--file", str(path))
    assert result.returncode == 1
    assert "frame 2 (dst_port)" in result.stdout
    assert "b'12a4'" in result.stdout
    assert "frame 14 (staging_base_ptr)" in result.stdout


def test_inspect_reads_stdin_and_honours_profile_and_type() -> None:
    frames, _ = load_frames(samples.sample_bytes("sglang-nixl-registration"))
    result = kvbridge(
        "inspect",
        "--file",
        "-",
        "--profile",
        "sglang-nixl",
        "--type",
        "KVArgsRegisterInfo",
        stdin=dump_binary(frames),
    )
    assert result.returncode == 0, result.stderr
    assert "b'NixlMsgGuard' stripped" in result.stdout
    assert "24 frames: the sglang 0.5.23 layout" in result.stdout


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("inspect",), "give the frames one way"),
        (("inspect", "zz"), "frame 0: not hex"),
        (("inspect", "--sample", "nope"), "no sample 'nope'"),
        (("inspect", "00", "--profile", "nope"), "Invalid value for '--profile'"),
        (("inspect", "--file", "/nonexistent/frames"), "No such file"),
    ],
)
def test_unusable_input_exits_2_with_a_reason(args: tuple[str, ...], match: str) -> None:
    result = kvbridge(*args)
    assert result.returncode == 2
    assert match in result.stderr


def test_protocol_doc_check() -> None:
    assert kvbridge("protocol-doc", "--check", "docs/PROTOCOL.md").returncode == 0
    generated = kvbridge("protocol-doc")
    assert generated.stdout == (ROOT / "docs" / "PROTOCOL.md").read_text()


def test_protocol_doc_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "PROTOCOL.md"
    stale.write_text("# old\n")
    result = kvbridge("protocol-doc", "--check", str(stale))
    assert result.returncode == 1
    assert "stale" in result.stderr


def test_demo_counts_requests_fits_80_columns_and_prints_json() -> None:
    env = {**os.environ, "COLUMNS": "80"}
    table = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbridge",
            "demo",
            "-n",
            "2",
            "-l",
            "64",
            "--prefill-tp",
            "2",
            "--decode-tp",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert table.returncode == 0, table.stdout + table.stderr
    assert max(len(line) for line in table.stdout.splitlines()) <= 80
    assert "2/2" in table.stdout  # requests, not rooms × decode ranks
    assert "2 requests × 64 tokens" in table.stdout
    one = subprocess.run(
        [sys.executable, "-m", "kvbridge", "demo", "-n", "1", "-l", "64", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert one.returncode == 0, one.stderr
    summary = json.loads(one.stdout)
    assert summary["ok"] is True
    assert (summary["requests"], summary["requests_verified"]) == (1, 1)
    assert summary["gbps"] > 0
    assert "1 request × 64 tokens" in one.stderr


def test_demo_layerwise_verifies_both_modes_and_reports_the_tails() -> None:
    env = {**os.environ, "COLUMNS": "80"}
    table = subprocess.run(
        [sys.executable, "-m", "kvbridge", "demo", "--layerwise", "-n", "1", "-l", "64"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert table.returncode == 0, table.stdout + table.stderr
    assert max(len(line) for line in table.stdout.splitlines()) <= 80
    assert "2/2" in table.stdout  # both modes of the request, every byte
    found = subprocess.run(
        [
            *(sys.executable, "-m", "kvbridge", "demo", "--layerwise", "-n", "2", "-l", "64"),
            *("--model", "qwen2.5-7b", "--layer-ms", "1", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert found.returncode == 0, found.stderr
    summary = json.loads(found.stdout)
    assert (summary["ok"], summary["verified"], summary["layers"]) == (True, 4, 28)
    assert len(summary["tail_ms_all"]) == len(summary["whole_request_ms_all"]) == 2
    assert summary["tail_ratio"] == pytest.approx(
        summary["tail_ms"] / (summary["whole_request_ms"] / 28)
    )
    refused = kvbridge("demo", "--layerwise", "--prefill-tp", "2")
    assert refused.returncode == 2
    assert "TP 1 → 1" in refused.stderr


def test_engines_lists_every_engine_with_its_options_and_availability() -> None:
    done = kvbridge("engines")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for name in REGISTRY:
        (line,) = [line for line in lines if line.startswith(f"{name}: ")]
        assert line.endswith("— available") == (unavailable_reason(name) is None), line
    assert "  protocol=tcp|rdma (default 'tcp'): Mooncake's transport" in lines
