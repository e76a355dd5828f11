"""`kvbridge bench` as a real process: the smoke preset through a real engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from real_engine import ENGINE, require_engine

ROOT = Path(__file__).resolve().parents[2]
require_engine()


def bench(output: Path, columns: int, *extra: str) -> subprocess.CompletedProcess[str]:
    """`kvbridge bench --preset smoke` on the test engine, in a terminal `columns` wide."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbridge",
            "bench",
            "--preset",
            "smoke",
            "--engine",
            ENGINE,
            "--output",
            str(output),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={"COLUMNS": str(columns), "PATH": "/usr/bin:/bin"},
    )


def test_bench_measures_each_cell_and_writes_json_and_plots(tmp_path: Path) -> None:
    result = bench(tmp_path, 250)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kvbridge bench (smoke)" in result.stdout
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["preset"] == "smoke"
    rows = document["cells"]
    assert [(r["cell"]["prefill_tp"], r["cell"]["decode_tp"]) for r in rows] == [(1, 1), (2, 4)]
    for row in rows:
        assert row["error"] is None
        assert row["skipped"] is None
        assert row["kvbridge_gbps"] > 0
        assert row["raw_gbps"] > 0
        assert row["ratio"] == round(row["kvbridge_gbps"] / row["raw_gbps"], 3)
        assert row["bytes"] >= row["requests"] * 128 * 128 * 1024  # 128 KiB per token
        assert row["descriptors_per_request"] > 0
        assert len(row["latencies_ms"]) == row["requests"] * row["cell"]["decode_tp"]
        assert row["p50_ms"] <= row["p99_ms"]
        assert row["plan_ms_per_request"] > 0
        assert row["control_cpu_ms_per_request"] > 0
    equal, staged = rows
    # Equal TP at page 16: one block per page and buffer (8 pages × 64 buffers), plus the
    # aux and state slots. TP 2→4: each decode rank's heads come from one prefill rank,
    # gathered and written into its pages by the page (4 decode ranks × 8 × 64 at most), not
    # a block per token and head slice (4 × 128 × 64).
    assert equal["descriptors_per_request"] >= 8 * 64
    assert staged["descriptors_per_request"] <= 4 * (8 * 64 + 2)
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "bench.md").read_text().splitlines()
    assert table[0].startswith("| engine | model | tokens |")
    assert len(table) == 2 + len(rows)


def test_bench_fits_80_columns_and_prints_json_to_stdout(tmp_path: Path) -> None:
    narrow = bench(tmp_path, 80)
    assert narrow.returncode == 0, narrow.stdout + narrow.stderr
    lines = narrow.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in narrow.stdout  # no cell cut short
    assert any("1→1" in line and "llama3-8b" in line for line in lines)
    as_json = bench(tmp_path, 80, "--json")
    assert as_json.returncode == 0, as_json.stderr
    document = json.loads(as_json.stdout)  # stdout is the document and nothing else
    assert [row["cell"]["decode_tp"] for row in document["cells"]] == [1, 4]
