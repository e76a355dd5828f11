"""The disaggregated-generation example, run as users run it: a tensor-parallel prefill group
and decode group in their own processes, the KV cache moved by kvbridge over a real engine;
the tokens must equal a single-process run of the same model and prompts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from real_engine import require_engine

pytest.importorskip("torch", reason="the example needs torch (requirements/examples.txt)")
require_engine()

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "disaggregated_generation.py"


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), (2, 1), (1, 2)])
def test_disaggregated_tokens_equal_a_single_process_run(prefill_tp: int, decode_tp: int) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--prefill-tp",
            str(prefill_tp),
            "--decode-tp",
            str(decode_tp),
            "--prompts",
            "37",
            "5",
            "--new-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.count("identical to the single-process run") == 2
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith(f"TP {prefill_tp}→{decode_tp}: all tokens identical"), summary
