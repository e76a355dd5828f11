"""Where every benchmark leaves its results: `bench-results/NAME.json`, each document stamped
with what was measured where (`measured`: when, at which commit, on which host, by which
command), so that `docs/benchmarks.md` can be written from them (`kvbridge_tools.bench_report`)
and say how each figure was made."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RESULTS = Path("bench-results")


def git(*arguments: str) -> str:
    here = Path(__file__).resolve().parent
    return subprocess.run(
        ["git", *arguments], cwd=here, capture_output=True, text=True, check=True
    ).stdout.strip()


def commit() -> str:
    """The commit the working tree is at, with `+changes` when it differs from it; `unknown`
    outside a git checkout."""
    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if changed else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host() -> str:
    """The machine in a few words: cores, CPU, memory."""
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return f"{os.cpu_count()} cores, {cpu_model()}"
    return f"{os.cpu_count()} cores, {cpu_model()}, {memory_gib:.0f} GiB"


def provenance(argv: list[str] | None = None) -> dict[str, str]:
    arguments = list(sys.argv if argv is None else argv)
    if arguments:
        arguments[0] = (
            os.path.relpath(arguments[0]) if os.path.isabs(arguments[0]) else arguments[0]
        )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit(),
        "host": host(),
        "command": shlex.join(arguments),
    }


def save(name: str, document: Mapping[str, Any], folder: Path = RESULTS) -> Path:
    """Write `document` as `folder/NAME.json` with its provenance; the path written. A
    document's `notes` (a list of sentences: what a reader of its figures must know about the
    run) are shown under its stamp in docs/benchmarks.md."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    stamped = {"measured": provenance(), **document}
    path.write_text(json.dumps(stamped, indent=1) + "\n")
    return path


def load(path: Path) -> dict[str, Any]:
    """A results document; ValueError naming the file when it is not one `save` wrote."""
    try:
        document = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a results document ({exc})") from exc
    if not isinstance(document, dict) or not isinstance(document.get("measured"), dict):
        raise ValueError(
            f"{path}: no 'measured' stamp (written by an older benchmark): run it again"
        )
    return document
