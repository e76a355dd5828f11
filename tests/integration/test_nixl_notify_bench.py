"""benchmarks/nixl_notify.py runs against the real NIXL and writes a row per case (its
figures are the benchmark's to print, not this test's to judge)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.engines import unavailable_reason

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "nixl_notify.py"


def test_every_case_is_measured(tmp_path: Path) -> None:
    reason = unavailable_reason("nixl")
    if reason is not None:
        pytest.skip(reason)
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "1", "--blocks-per-write", "64"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "bench-results" / "nixl_notify.json").read_text())["rows"]
    cases = {(row["target_poll_ms"], row["notification"]) for row in rows}
    assert cases == {(ms, notify) for ms in (0.1, 1.0, 3.0) for notify in (False, True)}
    assert all(row["blocks_per_write"] == 64 and row["gbps_median"] > 0 for row in rows)
    assert run.stdout.count("GB/s") == len(rows)
