"""Regenerate tests/goldens/sglang-0.5.23.json from sglang's own builders and parsers.

Run inside sglang's environment (scripts/sglang-env.sh), from the repository root:

    .venv-sglang/bin/python tests/sglang_compat/make_goldens.py

Each golden is one message: the builder inputs, the frames sglang's builder sent (hex) and
what sglang's own parser made of them. The default suite checks kvbridge against them where
sglang cannot be imported (tests/unit/test_sglang_goldens.py); tests/sglang_compat checks that they
still are what sglang produces.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parent / "helpers")]

import cases  # noqa: E402
import harness  # noqa: E402
from sglang_views import GOLDENS  # noqa: E402

SEED = 13
PER_KIND = 12


def goldens() -> dict[str, Any]:
    import sglang

    records = []
    for kind, inputs in cases.draw(SEED, PER_KIND):
        for frames in harness.build(kind, inputs):
            records.append(
                {
                    "kind": kind,
                    "inputs": inputs,
                    "frames": [frame.hex() for frame in frames],
                    "sglang": harness.PARSERS[kind](frames, inputs),
                }
            )
    return {
        "sglang": sglang.__version__,
        "generated_by": "tests/sglang_compat/make_goldens.py",
        "seed": SEED,
        "messages": records,
    }


def render(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    GOLDENS.write_text(render(goldens()))
    print(f"wrote {GOLDENS}")
