"""Markdown for each benchmark's results document (`bench-results/NAME.json`): the tables of
`docs/benchmarks.md`, each under a line saying when, where and by what it was measured."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from kvbridge_tools.bench import CellResult, markdown

Document = dict[str, Any]
Renderer = Callable[[Document], list[str]]


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def stamp(document: Document) -> str:
    measured = document["measured"]
    return (
        f"*Measured {measured['date']} at `{measured['commit']}` on {measured['host']}: "
        f"`{measured['command']}`.*"
    )


def met(holds: bool) -> str:
    return "met" if holds else "**NOT met**"


def tokens(count: int) -> str:
    return f"{count // 1024}k" if count >= 1024 and count % 1024 == 0 else str(count)


def plan_128k(document: Document) -> list[str]:
    rows = document["rows"]
    lines = table(
        ("destination pages", "fresh memory ms", "reused memory ms", "blocks", "GiB planned"),
        (
            (r["destination_pages"], r["fresh_ms"], r["reused_ms"], r["blocks"], r["gib"])
            for r in rows
        ),
    )
    scattered = next(r["reused_ms"] for r in rows if r["destination_pages"] == "scattered")
    target = document["target_ms"]
    return [
        *lines,
        "",
        f"Scattered pages in reused memory: {scattered} ms "
        f"(target < {target:g} ms: {met(scattered < target)}).",
    ]


def wire_codec(document: Document) -> list[str]:
    return table(
        ("message", "encode µs", "decode µs", "bytes"),
        ((r["message"], r["encode_us"], r["decode_us"], r["bytes"]) for r in document["rows"]),
    )


def registration(document: Document) -> list[str]:
    rows = document["rows"]
    lines = table(
        ("engine", "GiB", "regions", "register s", "deregister s", "engine start s"),
        (
            (
                r["engine"],
                r["gib"],
                r["regions"],
                r["register_s"],
                r["deregister_s"],
                r["engine_start_s"],
            )
            for r in rows
        ),
    )
    if not any(r["rdma_device"] for r in rows):
        lines += ["", "No RDMA device: the engines register without pinning pages."]
    return lines


def nixl_notify(document: Document) -> list[str]:
    """One row per poll interval and write size: GB/s without and with a notification."""
    cells = {
        (r["target_poll_ms"], r["blocks_per_write"], r["notification"]): r["gbps_median"]
        for r in document["rows"]
    }
    block_bytes = document["block_bytes"]
    keys = sorted({(poll, blocks) for poll, blocks, _ in cells})
    runs = len(document["rows"][0]["gbps"]) if document["rows"] else 0
    return [
        *table(
            ("target polls every", "write", "GB/s without a notification", "GB/s with one"),
            (
                (
                    f"{poll:g} ms",
                    f"{blocks} blocks ({blocks * block_bytes >> 20} MiB)",
                    f"{cells.get((poll, blocks, False), 0):.2f}",
                    f"{cells.get((poll, blocks, True), 0):.2f}",
                )
                for poll, blocks in keys
            ),
        ),
        "",
        f"Medians of {runs} rounds.",
    ]


def busy_host(document: Document) -> list[str]:
    return table(
        (
            "requests × tokens",
            "prefill process",
            "kvbridge GB/s",
            "raw GB/s (best way)",
            "ratio",
            "p50 ms",
        ),
        (
            (
                f"{r['requests']} × {r['tokens']}",
                r["load"],
                f"{r['kvbridge_gbps']:.2f}",
                f"{r['raw_gbps'][r['raw_best']]:.2f} ({r['raw_best']})",
                f"{r['ratio']:.3f}",
                f"{r['p50_ms']:.0f}",
            )
            for r in document["rows"]
        ),
    )


def layerwise(document: Document) -> list[str]:
    target = document["target"]
    return table(
        (
            "model",
            "layers",
            "tokens",
            "layer ms",
            "whole-request ms",
            "layer-wise tail ms",
            f"tail ratio (target ≤ {target:g})",
        ),
        (
            (
                r["model"],
                r["layers"],
                r["tokens"],
                f"{r['layer_ms']:g}",
                f"{r['whole_request_ms']:.1f}",
                f"{r['tail_ms']:.2f}",
                f"{r['tail_ratio']:.2f} {'met' if r['tail_ratio'] <= target else 'MISSED'}",
            )
            for r in document["rows"]
        ),
    )


def e2e(document: Document) -> list[str]:
    rows = document["rows"]
    lines = table(
        (
            "engine",
            "workload",
            "transport",
            "GB",
            "kvbridge GB/s",
            "raw GB/s (best way)",
            "ratio (range, runs)",
            "target",
            "p50 / p99 ms",
        ),
        (
            (
                r["workload"]["engine"],
                r["workload"]["name"],
                r["transport"],
                f"{r['bytes'] / 1e9:.2f}",
                f"{r['kvbridge_gbps']}{setting(document, r)}",
                f"{r['raw_gbps'][r['raw_best']]} ({r['raw_best']})",
                f"{r['ratio']} ({span(r['ratio_range'])}, {r['runs']})",
                f"≥ {r['workload']['target']}: {met(r['ratio'] >= r['workload']['target'])}",
                f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f}",
            )
            for r in rows
        ),
    )
    lines.append("")
    target = document["latency_target"]
    for r in at_once(rows):
        lines.append(
            f"- {r['workload']['engine']} {r['workload']['name']}, {r['workload']['requests']} "
            f"requests at once: median latency {r['p50_ms']:.0f} ms = {r['p50_of_wall']} × the "
            f"batch's {r['wall_ms']:.0f} ms (target ≤ {target}: {met(r['p50_of_wall'] <= target)})"
        )
    ratio = sglang_ratio(document)
    if ratio is not None:
        sglang = document["sglang_mooncake"]
        lines.append(
            f"- sglang 0.5.23's own layer on Mooncake, the same workload: {sglang['gbps']} GB/s "
            f"({sglang['verified']}/{sglang['requests']} requests verified); kvbridge {ratio}× it "
            f"(target ≥ {document['sglang_target']}: {met(ratio >= document['sglang_target'])})"
        )
    return lines


def setting(document: Document, row: Document) -> str:
    """kvbridge's engine setting where it is not its defaults (Mooncake's two submit threads)."""
    chosen = row.get("kvbridge_setting")
    return "" if chosen in (None, document.get("kvbridge_defaults")) else f" ({chosen})"


def at_once(rows: list[Document]) -> list[Document]:
    """The rows whose 32 requests start together on one host: the latency target's."""
    return [r for r in rows if r["workload"]["requests"] == 32 and not r["workload"]["two_hosts"]]


def one_host_mooncake(rows: list[Document]) -> Document | None:
    """The Mooncake row on one host, which sglang's own layer is held against."""
    return next(
        (
            r
            for r in rows
            if r["workload"]["engine"] == "mooncake" and not r["workload"]["two_hosts"]
        ),
        None,
    )


def sglang_ratio(document: Document) -> float | None:
    sglang, mooncake = document.get("sglang_mooncake"), one_host_mooncake(document["rows"])
    if not sglang or mooncake is None or not sglang["gbps"]:
        return None
    return round(float(mooncake["kvbridge_gbps"]) / float(sglang["gbps"]), 3)


def hetero(document: Document) -> list[str]:
    return table(
        (
            "TP pair",
            "staging GB/s",
            "per-token GB/s",
            "equal-TP GB/s",
            "staging / per-token",
            "staging / equal TP (range, staged runs)",
            "blocks per request (staging, per-token, equal)",
        ),
        (
            (
                r["pair"].replace("->", " → "),
                r["staging_gbps"],
                r["per_token_gbps"],
                r["equal_tp_gbps"],
                f"{r['staging_vs_per_token']}×",
                f"{r['staging_vs_equal_tp']}× ({span(r['staging_vs_equal_tp_range'])}, "
                f"{r['rounds']})",
                ", ".join(
                    str(r["blocks_per_request"][k]) for k in ("staging", "per_token", "equal_tp")
                ),
            )
            for r in document["rows"]
        ),
    )


def span(low_high: Sequence[float]) -> str:
    return f"{low_high[0]}-{low_high[1]}"


def sglang_pairs(document: Document) -> list[str]:
    """sglang → sglang beside sglang → kvbridge and kvbridge → sglang, the order turning."""
    rows = [
        (
            name,
            f"{figures['gbps']:.3f}",
            f"{figures['p50_ms']:.0f} / {figures['p99_ms']:.0f}",
            f"{figures['verified']}/{document['requests']}",
        )
        for name, figures in document["summary"].items()
    ]
    own = next(iter(document["summary"]))
    return [
        f"{document['requests']} requests × {document['tokens']} tokens over "
        f"{document.get('engine', 'mooncake')}, medians of {document['rounds']} rounds each.",
        "",
        *table(("prefill → decode", "GB/s", "p50 / p99 ms", "verified (every run)"), rows),
        "",
        *(
            f"- {name} against {own}: {figures['ratio']}× ({span(figures['range'])}; "
            f"target ≥ 1.0: {met(figures['ratio'] >= 1.0)})"
            for name, figures in document["against_sglang"].items()
        ),
    ]


def matrix(document: Document) -> list[str]:
    rows = [CellResult.from_json(cell) for cell in document["cells"]]
    return [f"Preset `{document['preset']}`.", "", *markdown(rows).splitlines()]


TARGETS_NEED = ("e2e", "hetero", "plan_128k")


def targets(documents: Mapping[str, Document]) -> list[str]:
    """Every target in one table, from e2e.py, hetero.py and plan_128k.py's results."""
    rows: list[tuple[str, str, str]] = []
    e2e_document = documents["e2e"]
    for r in e2e_document["rows"]:
        workload = r["workload"]
        rows.append(
            (
                f"{workload['engine']} {workload['name']} ≥ {workload['target']}× raw",
                str(r["ratio"]),
                met(r["ratio"] >= workload["target"]),
            )
        )
    shares = at_once(e2e_document["rows"])
    if shares:
        highest = max(r["p50_of_wall"] for r in shares)
        limit = e2e_document["latency_target"]
        rows.append(
            (
                f"median request ≤ {limit} of the batch (the highest of {len(shares)} rows)",
                str(highest),
                met(highest <= limit),
            )
        )
    ratio = sglang_ratio(e2e_document)
    if ratio is not None:
        limit = e2e_document["sglang_target"]
        rows.append(
            (f"Mooncake ≥ {limit}× sglang 0.5.23's own layer", str(ratio), met(ratio >= limit))
        )
    hetero_document = documents["hetero"]
    for r in hetero_document["rows"]:
        pair = r["pair"].replace("->", "→")
        limit = hetero_document["per_token_target"]
        rows.append(
            (
                f"staging {pair} ≥ {limit}× per-token",
                str(r["staging_vs_per_token"]),
                met(r["staging_vs_per_token"] >= limit),
            )
        )
        if r["pair"] == "2->4":
            limit = hetero_document["equal_tp_target"]
            rows.append(
                (
                    f"staging {pair} ≥ {limit}× equal TP",
                    str(r["staging_vs_equal_tp"]),
                    met(r["staging_vs_equal_tp"] >= limit),
                )
            )
    plan = documents["plan_128k"]
    scattered = next(r["reused_ms"] for r in plan["rows"] if r["destination_pages"] == "scattered")
    rows.append(
        (
            f"planning 128k tokens < {plan['target_ms']:g} ms",
            f"{scattered} ms",
            met(scattered < plan["target_ms"]),
        )
    )
    return table(("target", "figure", ""), rows)
