"""benchmarks/hetero.py's row: each staged run is held against the mean of the equal-TP runs
just before and after it (they alternate, one more equal run than staged), never against one
neighbour or against the best of them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

HETERO = Path(__file__).resolve().parents[2] / "benchmarks" / "hetero.py"


@pytest.fixture(scope="module")
def hetero() -> Any:
    spec = importlib.util.spec_from_file_location("kvbridge_bench_hetero", HETERO)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_staged_run_is_against_the_equal_runs_around_it(
    hetero: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    # Equal TP drifts 8 → 4 → 6 → 10 GB/s; staged runs 2, 3, 4 in between; per-token 0.5.
    speeds = {
        "equal": iter([8.0, 4.0, 6.0, 10.0]),
        "staged": iter([2.0, 3.0, 4.0]),
        "per-token": iter([0.5, 0.4, 0.6]),
    }

    def fake_run(
        prefill_tp: int, decode_tp: int, staging: bool, requests: int, tokens: int
    ) -> dict[str, Any]:
        kind = "equal" if decode_tp == prefill_tp else "staged" if staging else "per-token"
        order.append(kind)
        blocks = {"equal": 8, "staged": 16, "per-token": 99}[kind]
        return {"gbps": next(speeds[kind]), "blocks_per_request": blocks}

    monkeypatch.setattr(hetero, "run", fake_run)
    row = hetero.measure_pair(2, 4, 3, 3, 16, 1024)
    assert order == [
        "equal",
        "staged",
        "equal",
        "staged",
        "equal",
        "staged",
        "equal",
        "per-token",
        "per-token",
        "per-token",
    ]
    # 2 / 6, 3 / 5, 4 / 8: median 0.5 (against one neighbour it would be 0.25-0.75).
    assert row["staging_vs_equal_tp"] == 0.5
    assert row["staging_vs_equal_tp_range"] == [0.333, 0.6]
    assert row["staging_gbps"] == 3.0
    assert row["equal_tp_gbps"] == 7.0
    assert row["staging_vs_per_token"] == 6.0
    assert row["blocks_per_request"] == {"staging": 16, "per_token": 99, "equal_tp": 8}
    assert row["runs_gbps"]["equal_tp"] == [8.0, 4.0, 6.0, 10.0]
