"""`kvbridge bench`: the benchmark matrix — engines × model shapes × request lengths × page
sizes × TP pairs — each cell a full demo run (separate processes, a real engine, every byte
verified) followed, in the same processes, by the raw engine replaying the identical
(src, dst, len) blocks.

Per cell: kvbridge GB/s and per-request latency (p50/p99), raw engine GB/s and the ratio,
descriptors (blocks) per request, planning time and control-plane CPU time per request. Cells
are sized to the machine's memory; a cell that cannot fit even one request is skipped with the
reason. Mooncake binds wildcard listeners, so its cells run in a private network namespace
(root only; otherwise they are skipped with that reason).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvbridge.config import ManagerConfig
from kvbridge.engines import PROCESS_ENGINES, engine_spec, unavailable_reason
from kvbridge.wire import KVLayout
from kvbridge_tools.bench_results import provenance
from kvbridge_tools.demo import (
    DemoConfig,
    DemoResult,
    available_memory,
    chunk_paths_text,
    run_demo,
)

ENGINES = PROCESS_ENGINES
TP_PAIRS = ((1, 1), (2, 4), (4, 2))


@dataclass(frozen=True)
class Preset:
    """The axes of a matrix; every combination is a cell."""

    models: tuple[str, ...]
    tokens: tuple[int, ...]
    page_sizes: tuple[int, ...]
    tp_pairs: tuple[tuple[int, int], ...]
    # KV bytes one cell moves: requests are scaled to it, within [min_requests, max_requests]
    # and what the memory budget fits (at least one request, or the cell is skipped).
    cell_bytes: int
    min_requests: int
    max_requests: int
    # Keep the quick preset quick: page sizes and TP pairs other than the first of each are
    # measured only for this model at this request length (None: everywhere).
    sweep_model: str | None = None
    sweep_tokens: int | None = None


PRESETS = {
    # Seconds: the bench itself works here (one short cell per TP pair).
    "smoke": Preset(
        models=("llama3-8b",),
        tokens=(128,),
        page_sizes=(16,),
        tp_pairs=((1, 1), (2, 4)),
        cell_bytes=32 << 20,
        min_requests=2,
        max_requests=4,
    ),
    # About a minute per engine on a 2-core host: every shape at three lengths (page 16,
    # equal TP), plus the other page sizes and TP pairs of the MHA shape at 1k tokens.
    "quick": Preset(
        models=("llama3-8b", "qwen2.5-7b", "deepseek-v3"),
        tokens=(128, 1024, 8192),
        page_sizes=(16, 1, 64),
        tp_pairs=TP_PAIRS,
        cell_bytes=256 << 20,
        min_requests=4,
        max_requests=32,
        sweep_model="llama3-8b",
        sweep_tokens=1024,
    ),
    "full": Preset(
        models=("llama3-8b", "qwen2.5-7b", "deepseek-v3"),
        tokens=(128, 1024, 8192, 32768),
        page_sizes=(1, 16, 64),
        tp_pairs=TP_PAIRS,
        cell_bytes=1 << 30,
        min_requests=8,
        max_requests=64,
    ),
}


@dataclass(frozen=True)
class Cell:
    engine: str
    model: str
    tokens: int
    page_size: int
    prefill_tp: int
    decode_tp: int
    write_path: str = "auto"  # ManagerConfig.write_path
    cross_layer: bool = False  # DemoConfig.cross_layer: one buffer of whole blocks

    @property
    def label(self) -> str:
        path = "" if self.write_path == "auto" else f" {self.write_path}"
        layout = " cross-layer" if self.cross_layer else ""
        return (
            f"{self.engine} {self.model} {self.tokens} tok page {self.page_size} "
            f"TP {self.prefill_tp}→{self.decode_tp}{path}{layout}"
        )


@dataclass
class CellResult:
    cell: Cell
    requests: int = 0
    skipped: str | None = None
    error: str | None = None
    transport: str = ""
    bytes: int = 0
    kvbridge_gbps: float = 0.0
    raw_gbps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    descriptors_per_request: float = 0.0
    plan_ms_per_request: float = 0.0
    control_cpu_ms_per_request: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    chunks: dict[str, int] = field(default_factory=dict)  # chunk writes by "path (reason)"

    @property
    def ratio(self) -> float | None:
        return self.kvbridge_gbps / self.raw_gbps if self.raw_gbps else None

    def as_json(self) -> dict[str, Any]:
        row = asdict(self)
        row["ratio"] = None if self.ratio is None else round(self.ratio, 3)
        return row

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> CellResult:
        """The result `as_json` wrote (its derived `ratio` dropped)."""
        fields = {key: value for key, value in row.items() if key not in ("cell", "ratio")}
        return cls(cell=Cell(**row["cell"]), **fields)


def cells(
    preset: Preset, engines: tuple[str, ...], write_path: str = "auto", cross_layer: bool = False
) -> list[Cell]:
    """The preset's cells in run order: engine, model, length, then page size and TP pair;
    cross-layer, only those of equal TP (it moves whole blocks)."""
    found = []
    for engine in engines:
        for model in preset.models:
            for tokens in preset.tokens:
                for page_size in preset.page_sizes:
                    for prefill_tp, decode_tp in preset.tp_pairs:
                        default = (page_size, (prefill_tp, decode_tp)) == (
                            preset.page_sizes[0],
                            preset.tp_pairs[0],
                        )
                        swept = preset.sweep_model in (None, model) and preset.sweep_tokens in (
                            None,
                            tokens,
                        )
                        if not (default or swept) or (cross_layer and prefill_tp != decode_tp):
                            continue
                        found.append(
                            Cell(
                                engine,
                                model,
                                tokens,
                                page_size,
                                prefill_tp,
                                decode_tp,
                                write_path,
                                cross_layer,
                            )
                        )
    return found


def memory_budget() -> int:
    """Bytes of KV a cell may allocate across all its processes: a quarter of what the
    machine has available (prefill and decode copies, the decode pool's slack, staging)."""
    return available_memory() // 4


def demo_config(
    cell: Cell, preset: Preset, budget: int, log_level: int = logging.WARNING
) -> DemoConfig | str:
    """The demo run of a cell, with requests scaled to the preset and the memory budget; or
    why the cell cannot run on this machine."""
    config = DemoConfig(
        model=cell.model,
        tokens=cell.tokens,
        page_size=cell.page_size,
        prefill_tp=cell.prefill_tp,
        decode_tp=cell.decode_tp,
        requests=1,
        measure_raw=True,
        decode_pool_factor=1.0,
        timeout_s=600.0,
        log_level=log_level,
        transfer=ManagerConfig(engine=cell.engine, write_path=cell.write_path),
        cross_layer=cell.cross_layer,
    )
    per_request = cell.tokens * config.shape.bytes_per_token()  # one full copy of the cache
    # Both groups hold a copy; a replicated (MLA) cache is held by every rank.
    copies = 2 if config.shape.kv_layout == KVLayout.MHA else cell.prefill_tp + cell.decode_tp
    if per_request * copies > budget:
        return (
            f"one request needs {per_request * copies / 2**30:.1f} GiB, "
            f"over this machine's budget of {budget / 2**30:.1f} GiB"
        )
    fits = budget // (per_request * copies)
    wanted = max(preset.min_requests, preset.cell_bytes // per_request)
    requests = int(min(wanted, fits, preset.max_requests))
    return replace(config, requests=requests)


def summarize(cell: Cell, result: DemoResult) -> CellResult:
    config = result.config
    row = CellResult(cell, requests=config.requests)
    failed = [r for r in result.reports if not r.ok]
    if failed:
        row.error = "; ".join(
            f"{r.role} {r.rank}: {r.error or r.failed_rooms or r.mismatched_rooms}" for r in failed
        )
        return row
    prefill = [r for r in result.reports if r.role == "prefill"]
    row.transport = sorted({r.transport for r in result.reports if r.transport})[0]
    row.bytes = result.total_bytes
    row.kvbridge_gbps = round(result.gbps, 3)
    row.raw_gbps = round(result.raw_gbps, 3)
    row.p50_ms = round(result.latency_ms(0.5), 2)
    row.p99_ms = round(result.latency_ms(0.99), 2)
    row.latencies_ms = [round(v, 2) for r in result.decode_reports for v in r.latencies_ms]
    row.chunks = result.chunk_paths
    requests = config.requests
    row.descriptors_per_request = round(sum(r.blocks_written for r in prefill) / requests, 1)
    plan_s = sum(r.timings.get("plan_s", 0.0) for r in prefill)
    row.plan_ms_per_request = round(plan_s * 1e3 / requests, 3)
    control_s = sum(r.timings.get("control_cpu_s", 0.0) for r in result.reports)
    row.control_cpu_ms_per_request = round(control_s * 1e3 / requests, 3)
    return row


def run_cell(
    cell: Cell, preset: Preset, budget: int, log_level: int = logging.WARNING
) -> CellResult:
    """One cell, in this process's network namespace."""
    config = demo_config(cell, preset, budget, log_level)
    if isinstance(config, str):
        return CellResult(cell, skipped=config)
    return summarize(cell, run_demo(config))


def private_netns_unavailable() -> str | None:
    """Why `json_in_private_netns` cannot run here, or None."""
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("ip", "unshare")):
        return "a private network namespace needs root, iproute2's `ip` and util-linux's `unshare`"
    return None


def json_in_private_netns(arguments: list[str], python: str = sys.executable) -> Any:
    """Run `python ARGUMENTS` in a network namespace of its own (loopback up; root only) and
    return the JSON on its last line of output: how Mooncake, which binds wildcard
    listeners, is measured without touching the host's network. The namespace has no name
    (`unshare --net`): it ends with the last process in it, so a run that is killed leaves
    none behind (named ones, deleted in a `finally`, outlived a SIGTERM)."""
    command = [
        "unshare",
        "--net",
        "--",
        "sh",
        "-c",
        'ip link set lo up && exec "$@"',
        "kvbridge-private-netns",
        python,
        *arguments,
    ]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def _run_in_private_netns(cell: Cell, preset_name: str, budget: int, log_level: int) -> CellResult:
    spec = {"cell": asdict(cell), "preset": preset_name, "budget": budget, "log_level": log_level}
    try:
        row = json_in_private_netns(["-m", "kvbridge_tools.bench", json.dumps(spec)])
    except subprocess.CalledProcessError as exc:
        return CellResult(cell, error=f"the cell's process failed: {exc.stderr[-500:]}")
    row.pop("ratio")
    return CellResult(**{**row, "cell": cell})


def raw_baseline(runs: Sequence[Mapping[str, float]]) -> tuple[dict[str, float], str]:
    """Each raw way's median GB/s over repeated runs (each run: way → GB/s), and the way
    with the best median: the baseline that each run's kvbridge figure is held against."""
    medians = {way: statistics.median(run[way] for run in runs) for way in runs[0]}
    return medians, max(medians, key=lambda way: medians[way])


def engine_unavailable(engine: str) -> str | None:
    """Why an engine cannot be benchmarked here (one that binds wildcard listeners, as
    Mooncake does, also needs a private netns)."""
    reason = unavailable_reason(engine)
    needs_netns = engine_spec(engine).needs_own_netns
    if reason is None and needs_netns:
        missing = private_netns_unavailable()
        if missing is not None:
            reason = f"its wildcard listeners need a private network namespace: {missing}"
    return reason


def run_matrix(
    preset_name: str,
    engines: tuple[str, ...],
    on_cell: Callable[[CellResult], None] = lambda row: None,
    log_level: int = logging.WARNING,
    write_path: str = "auto",
    cross_layer: bool = False,
) -> Iterator[CellResult]:
    preset, budget = PRESETS[preset_name], memory_budget()
    unavailable = {engine: engine_unavailable(engine) for engine in engines}
    for cell in cells(preset, engines, write_path, cross_layer):
        reason = unavailable[cell.engine]
        if reason is not None:
            row = CellResult(cell, skipped=f"{cell.engine}: {reason}")
        elif engine_spec(cell.engine).needs_own_netns:
            row = _run_in_private_netns(cell, preset_name, budget, log_level)
        else:
            row = run_cell(cell, preset, budget, log_level)
        on_cell(row)
        yield row


# Box plots need enough samples to mean something; fewer are drawn as the samples themselves.
MIN_BOX_SAMPLES = 5


def plot(rows: list[CellResult], path: Path) -> None:
    """Three rows of panels: throughput against request length per model (equal TP, page 16
    or the preset's first page size; the raw engine beside it), each such cell's per-request
    latencies, and every measured cell (all page sizes and TP pairs) side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    every = [r for r in rows if r.kvbridge_gbps]
    if not every:
        return
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    equal = [r for r in every if r.cell.prefill_tp == r.cell.decode_tp]
    page = (
        16
        if any(r.cell.page_size == 16 for r in equal)
        else (equal[0].cell.page_size if equal else 0)
    )
    measured = [r for r in equal if r.cell.page_size == page]
    models = sorted({r.cell.model for r in measured}) or ["-"]
    figure = plt.figure(figsize=(max(10, 5 * len(models)), 13))
    grid = figure.add_gridspec(3, len(models), height_ratios=(1, 1, 1.2))
    for column, model in enumerate(models):
        top = figure.add_subplot(grid[0, column])
        lengths_seen: set[int] = set()
        for engine in sorted({r.cell.engine for r in measured}):
            line = sorted(
                (r for r in measured if r.cell.model == model and r.cell.engine == engine),
                key=lambda r: r.cell.tokens,
            )
            if not line:
                continue
            lengths = [r.cell.tokens for r in line]
            lengths_seen.update(lengths)
            drawn = top.plot(
                lengths, [r.kvbridge_gbps for r in line], "o-", label=f"kvbridge ({engine})"
            )
            top.plot(
                lengths,
                [r.raw_gbps for r in line],
                "s--",
                color=drawn[0].get_color(),
                alpha=0.6,
                label=f"raw {engine}, same blocks",
            )
        top.set_xscale("log", base=2)
        top.xaxis.set_major_locator(FixedLocator(sorted(lengths_seen)))
        top.xaxis.set_minor_locator(NullLocator())
        top.xaxis.set_major_formatter(plain)
        top.set_ylim(bottom=0)
        top.set_xlabel("tokens per request")
        top.set_ylabel("GB/s (10^9 B/s)")
        top.set_title(f"{model}, page {page}, equal TP")
        top.grid(True, alpha=0.3)
        if lengths_seen:
            top.legend(fontsize=8)
        middle = figure.add_subplot(grid[1, column])
        cells_drawn = sorted(
            (r for r in measured if r.cell.model == model and r.latencies_ms),
            key=lambda r: (r.cell.engine, r.cell.tokens),
        )
        for position, row in enumerate(cells_drawn, start=1):
            if len(row.latencies_ms) >= MIN_BOX_SAMPLES:
                middle.boxplot([row.latencies_ms], positions=[position], widths=0.5)
            else:  # too few for a distribution: the samples themselves
                middle.plot(
                    [position] * len(row.latencies_ms),
                    row.latencies_ms,
                    "o",
                    color="tab:blue",
                    alpha=0.7,
                )
        middle.set_xticks(range(1, len(cells_drawn) + 1))
        middle.set_xticklabels(
            [f"{r.cell.engine}\n{r.cell.tokens}\n({len(r.latencies_ms)} req)" for r in cells_drawn],
            fontsize=8,
        )
        samples = [value for r in cells_drawn for value in r.latencies_ms]
        if samples and max(samples) > 20 * min(samples):  # spans decades: log, plain numbers
            middle.set_yscale("log")
            middle.yaxis.set_major_formatter(plain)
            middle.yaxis.set_minor_formatter(
                FuncFormatter(lambda value, _: f"{value:g}" if f"{value:.0e}"[0] in "25" else "")
            )
        else:
            middle.set_ylim(bottom=0, top=max(samples, default=1) * 1.1)
        middle.set_ylabel("per-request latency, ms")
        middle.set_title(f"{model}: latency per request (boxes from {MIN_BOX_SAMPLES}+)")
        middle.grid(True, alpha=0.3)
    bottom = figure.add_subplot(grid[2, :])
    labels = [
        f"{r.cell.engine} {r.cell.model} {r.cell.tokens}t p{r.cell.page_size} "
        f"{r.cell.prefill_tp}→{r.cell.decode_tp}"
        for r in every
    ]
    positions = range(len(every))
    bottom.bar(
        [p - 0.2 for p in positions], [r.kvbridge_gbps for r in every], 0.4, label="kvbridge"
    )
    bottom.bar(
        [p + 0.2 for p in positions],
        [r.raw_gbps for r in every],
        0.4,
        alpha=0.6,
        label="raw engine, same blocks",
    )
    bottom.set_xticks(list(positions))
    bottom.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    bottom.set_ylabel("GB/s (10^9 B/s)")
    bottom.set_title("every cell: engine, model, tokens, page size, TP prefill→decode")
    bottom.grid(True, axis="y", alpha=0.3)
    bottom.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def default_engines(preset_name: str) -> tuple[str, ...]:
    """The full matrix covers every installed engine; the smaller presets the default one
    (NIXL), so that they stay short (Mooncake over TCP moves ~0.3 GB/s on a CPU host)."""
    installed = tuple(engine for engine in ENGINES if unavailable_reason(engine) is None)
    return installed if preset_name == "full" else installed[:1]


def bench_document(rows: list[CellResult], preset_name: str) -> dict[str, Any]:
    """The results as one JSON-ready document (bench.json, `kvbridge bench --json`)."""
    return {
        "measured": provenance(),
        "preset": preset_name,
        "machine": {"cpus": os.cpu_count(), "memory_budget_bytes": memory_budget()},
        "cells": [row.as_json() for row in rows],
    }


def write_json(rows: list[CellResult], preset_name: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(bench_document(rows, preset_name), indent=1) + "\n")


MARKDOWN_COLUMNS = (
    "engine",
    "model",
    "tokens",
    "page",
    "TP",
    "requests",
    "kvbridge GB/s",
    "raw GB/s",
    "ratio",
    "p50 / p99 ms",
    "descriptors / request",
    "plan ms / request",
    "control CPU ms / request",
    "chunks by path",
)


def markdown(rows: list[CellResult]) -> str:
    """The results as a Markdown table (what the README shows)."""
    lines = ["| " + " | ".join(MARKDOWN_COLUMNS) + " |", "|" + "---|" * len(MARKDOWN_COLUMNS)]
    for row in rows:
        cell = row.cell
        head = [
            cell.engine,
            f"{cell.model} (cross-layer)" if cell.cross_layer else cell.model,
            str(cell.tokens),
            str(cell.page_size),
            f"{cell.prefill_tp}→{cell.decode_tp}",
        ]
        if row.skipped or row.error:
            rest = [f"skipped: {row.skipped}" if row.skipped else f"failed: {row.error}"]
            rest += [""] * (len(MARKDOWN_COLUMNS) - len(head) - 1)
        else:
            rest = [
                str(row.requests),
                f"{row.kvbridge_gbps:.2f}",
                f"{row.raw_gbps:.2f}",
                f"{row.ratio:.2f}" if row.ratio is not None else "-",
                f"{row.p50_ms:.0f} / {row.p99_ms:.0f}",
                f"{row.descriptors_per_request:g}",
                f"{row.plan_ms_per_request:.2f}",
                f"{row.control_cpu_ms_per_request:.1f}",
                chunk_paths_text(row.chunks) if row.chunks else "-",
            ]
        lines.append("| " + " | ".join(head + rest) + " |")
    return "\n".join(lines) + "\n"


def _main() -> None:
    """`python -m kvbridge_tools.bench CELL_JSON`: one cell, its row as JSON on the last line (how
    Mooncake cells run inside their network namespace)."""
    spec = json.loads(sys.argv[1])
    cell = Cell(**spec["cell"])
    row = run_cell(cell, PRESETS[spec["preset"]], spec["budget"], spec["log_level"])
    print(json.dumps(row.as_json()))


if __name__ == "__main__":
    _main()
