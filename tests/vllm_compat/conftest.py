"""A failed vLLM test reports what its servers and proxies logged while it ran: the lines
that say what went wrong (errors, tracebacks, kvbridge's own), so that a failure on a machine
nobody can log in to (CI) explains itself. And the model and plain run the connector tests
share."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import LOGS, MAX_TOKENS, PROMPTS, SHARED_PREFIX, Instance, make_model

TOLD = re.compile(r"ERROR|Error|Traceback|kvbridge|KV load|failed|Failed|\b[45]\d\d\b")
NOISE = re.compile(r"DeprecationWarning|FutureWarning|warnings\.warn|non-default args")
LINES_PER_LOG = 30
STARTS = pytest.StashKey[dict[Path, int]]()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _told_since(path: Path, offset: int) -> list[str]:
    try:
        with path.open("rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except OSError as exc:
        return [f"(unreadable: {exc})"]
    told = [line for line in text.splitlines() if TOLD.search(line) and not NOISE.search(line)]
    return told[-LINES_PER_LOG:]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[STARTS] = {path: _size(path) for path in LOGS}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if not report.failed:
        return
    starts = item.stash.get(STARTS, {})
    parts = []
    for path in dict.fromkeys(LOGS):  # servers of the module's fixtures too
        told = _told_since(path, starts.get(path, 0))
        if told:
            parts.append(f"--- {path} ({len(told)} lines)\n" + "\n".join(told))
    if parts:
        report.sections.append(("what the servers logged", "\n".join(parts)))


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random-weight Llama the connector tests run."""
    return make_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, ...], Any]:
    """Greedy tokens of a plain single-instance vLLM run, per prompt."""
    plain = Instance(model, None, tmp_path_factory.mktemp("logs") / "plain.log")
    try:
        prompts = [*PROMPTS, SHARED_PREFIX]
        outputs = plain.generate(prompts, MAX_TOKENS)["outputs"]
    finally:
        plain.close()
    return {tuple(p): output["tokens"] for p, output in zip(prompts, outputs, strict=True)}
