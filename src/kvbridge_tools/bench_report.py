"""Write `docs/benchmarks.md`'s figures from `bench-results/` (the last step of `make bench`).

The page is prose with regions between `<!-- results: NAME ... -->` and `<!-- end results -->`;
each region is rewritten from `bench-results/NAME.json` (its tables under a line saying when,
at which commit, on which host and by which command they were measured), `targets` from e2e.py,
hetero.py and plan_128k.py's results. A region whose results are not all there keeps what it
had, so a partial run rewrites what it measured and nothing else. Plots the page links to
(`](NAME.png)`) are copied beside it from `bench-results/NAME.png` with their results.

    python -m kvbridge_tools.bench_report [--results bench-results] [--page docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvbridge_tools import bench_tables, vllm_tables
from kvbridge_tools.bench_results import RESULTS, load
from kvbridge_tools.bench_tables import Document, Renderer

RENDERERS: dict[str, Renderer] = {
    "plan_128k": bench_tables.plan_128k,
    "wire_codec": bench_tables.wire_codec,
    "registration": bench_tables.registration,
    "nixl_notify": bench_tables.nixl_notify,
    "busy_host": bench_tables.busy_host,
    "layerwise": bench_tables.layerwise,
    "e2e": bench_tables.e2e,
    "hetero": bench_tables.hetero,
    "sglang_mooncake": bench_tables.sglang_pairs,
    "sglang_nixl": bench_tables.sglang_pairs,
    "bench": bench_tables.matrix,
}
VLLM_PD_NAME = re.compile(r"vllm(-(mla|sliding|mamba))?(-full)?")
VLLM_SERVE_NAME = re.compile(r"vllm-serve(-full)?")
TARGETS = "targets"
REGION = re.compile(
    r"(?P<open><!-- results: (?P<names>[\w\- ]+?) -->\n)"
    r"(?P<body>.*?)(?P<close><!-- end results -->)",
    re.DOTALL,
)
MARKER = re.compile(r"<!-- (results: [^>]*|end results) -->")


def renderer_for(name: str) -> Renderer:
    """The renderer of `NAME.json`; KeyError naming it when there is none."""
    if name in RENDERERS:
        return RENDERERS[name]
    if VLLM_SERVE_NAME.fullmatch(name):
        return vllm_tables.vllm_serve
    if VLLM_PD_NAME.fullmatch(name):
        return vllm_tables.vllm_pd
    raise KeyError(f"no table for results {name!r}")


def needs(name: str) -> tuple[str, ...]:
    """The results files a region name is made from."""
    return bench_tables.TARGETS_NEED if name == TARGETS else (name,)


def render(name: str, documents: dict[str, Document]) -> list[str]:
    if name == TARGETS:
        stamps = [bench_tables.stamp(documents[need]) for need in bench_tables.TARGETS_NEED]
        return [*bench_tables.targets(documents), "", *stamps]
    document = documents[name]
    notes = [f"*{note}*" for note in document.get("notes", [])]
    return [bench_tables.stamp(document), *notes, "", *renderer_for(name)(document)]


@dataclass
class Outcome:
    page: str
    written: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # "NAME: why"


def check_markers(page: str) -> list[list[str]]:
    """Each region's names, in order; ValueError for markers that do not pair up or name
    results without a table."""
    regions = [match["names"].split() for match in REGION.finditer(page)]
    if len(MARKER.findall(page)) != 2 * len(regions):
        raise ValueError("a '<!-- results: ... -->' marker without its '<!-- end results -->'")
    for names in regions:
        for name in names:
            if name != TARGETS:
                renderer_for(name)
    return regions


def rewrite(page: str, documents: Callable[[str], Document | None]) -> Outcome:
    """`page` with every region whose results `documents` has rewritten from them."""
    check_markers(page)
    outcome = Outcome(page)

    def region(match: re.Match[str]) -> str:
        names = match["names"].split()
        wanted = {need for name in names for need in needs(name)}
        try:
            found = {need: documents(need) for need in sorted(wanted)}
        except ValueError as exc:  # a results file that is not one: its region stays
            outcome.kept.append(f"{' '.join(names)}: {exc}")
            return match[0]
        missing = sorted(need for need, document in found.items() if document is None)
        if missing:
            outcome.kept.append(f"{' '.join(names)}: no {', '.join(missing)} results")
            return match[0]
        have = {need: document for need, document in found.items() if document is not None}
        body: list[str] = []
        for name in names:
            body += [*render(name, have), ""]
        outcome.written.append(" ".join(names))
        return match["open"] + "\n".join(body) + match["close"]

    outcome.page = REGION.sub(region, page)
    return outcome


def copy_plots(outcome: Outcome, results: Path, folder: Path) -> list[str]:
    """The plots the page links to whose results were just written (`NAME.png` beside
    `NAME.json`), copied from `results` into `folder`."""
    written = {name for names in outcome.written for name in names.split()}
    copied = []
    for plot in sorted(set(re.findall(r"\]\(([\w\-]+)\.png\)", outcome.page)) & written):
        if (results / f"{plot}.png").is_file():
            shutil.copyfile(results / f"{plot}.png", folder / f"{plot}.png")
            copied.append(f"{plot}.png")
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--page", type=Path, default=Path("docs") / "benchmarks.md")
    options = parser.parse_args(argv)

    def documents(name: str) -> Document | None:
        path = options.results / f"{name}.json"
        return load(path) if path.is_file() else None

    try:
        outcome = rewrite(options.page.read_text(), documents)
    except (ValueError, KeyError) as exc:
        print(f"{options.page}: {exc}", file=sys.stderr)
        return 2
    options.page.write_text(outcome.page)
    plots = copy_plots(outcome, options.results, options.page.parent)
    print(f"{options.page}: rewrote {', '.join(outcome.written) or 'nothing'}")
    for line in outcome.kept:
        print(f"  kept as it was: {line}")
    if plots:
        print(f"  plots copied: {', '.join(plots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
