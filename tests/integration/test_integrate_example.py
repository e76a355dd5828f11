"""examples/integrate.py, the integration example the README quotes, run as shipped: a
prefill and a decode process over a real engine, every byte checked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from real_engine import require_engine

require_engine()
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "integrate.py"


def test_the_integration_example_runs_as_shipped() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--requests", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.count("arrived intact") == 3
    assert result.stdout.strip().endswith("3 of 3 requests moved intact")
