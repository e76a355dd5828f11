"""Markdown for the vLLM benchmarks' results (`benchmarks/vllm_pd.py`, `vllm_serve.py`)."""

from __future__ import annotations

from collections.abc import Iterable

from kvbridge_tools.bench_tables import Document, table, tokens

CONNECTOR_NAMES = {
    "kvbridge-nixl": "kvbridge, NIXL",
    "kvbridge-nixl-stream": "kvbridge, NIXL, decode first (layer-wise)",
    "kvbridge-mooncake": "kvbridge, Mooncake (TCP)",
    "vllm-nixl": "vLLM NixlConnector",
    "vllm-nixl-push": "vLLM NixlPushConnector",
}


def vllm_pd(document: Document) -> list[str]:
    summary = {
        (line["connector"], line["tokens"], line["concurrent"]): line
        for line in document["vs_nixl_connector"]
    }

    def versus(row: Document) -> tuple[str, str, str]:
        line = summary.get((row["connector"], row["tokens"], row["concurrent"]))
        if line is None:
            return ("1", "1", "—") if row["connector"] == "vllm-nixl" else ("—", "—", "—")
        return (
            f"{line['ttft_p50_vs_nixl']:.2f} / {line['ttft_p99_vs_nixl']:.2f}",
            f"{line['kv_ready_p50_vs_nixl']:.2f} / {line['kv_ready_p99_vs_nixl']:.2f}",
            "yes" if line["tokens_equal"] else "no",
        )

    lines = [f"{document['family']}: {document['model']}; ms.", ""]
    lines += table(
        (
            "workload",
            "connector",
            "TTFT p50",
            "TTFT p99",
            "KV in place p50",
            "KV in place p99",
            "× NixlConnector: TTFT p50 / p99",
            "KV in place p50 / p99",
            "tokens equal NixlConnector's",
        ),
        (
            (
                f"{tokens(r['tokens'])} × {r['concurrent']}",
                CONNECTOR_NAMES.get(r["connector"], r["connector"]),
                f"{r['ttft_p50_ms']:.0f}",
                f"{r['ttft_p99_ms']:.0f}",
                f"{r['kv_ready_p50_ms']:.0f}",
                f"{r['kv_ready_p99_ms']:.0f}",
                *versus(r),
            )
            for r in document["rows"]
        ),
    )
    return lines + failures(document)


def vllm_serve(document: Document) -> list[str]:
    workload = document["workload"]
    lines = [
        f"{document['model']}; {workload['prompts']} requests per run of about "
        f"{workload['input_len']} prompt tokens ({workload['prefix_len']} shared), "
        f"{workload['output_len']} output tokens; latencies in ms, goodput at TTFT ≤ "
        f"{document['slo']['ttft_ms']:g} ms and TPOT ≤ {document['slo']['tpot_ms']:g} ms.",
        "",
    ]
    lines += table(
        (
            "deployment",
            "rate (req/s)",
            "connector",
            "TTFT p50",
            "TTFT p99",
            "TPOT p50",
            "ITL p99",
            "E2E p50",
            "req/s",
            "output tok/s",
            "goodput",
        ),
        (
            (
                r["deployment"].upper(),
                "max" if r["rate"] == float("inf") else f"{r['rate']:g}",
                CONNECTOR_NAMES.get(r["connector"], r["connector"]),
                f"{r['ttft_p50_ms']:.0f}",
                f"{r['ttft_p99_ms']:.0f}",
                f"{r['tpot_p50_ms']:.1f}",
                f"{r['itl_p99_ms']:.0f}",
                f"{r['e2el_p50_ms']:.0f}",
                f"{r['request_throughput']:.2f}",
                f"{r['output_throughput']:.1f}",
                f"{r['goodput']:.2f}",
            )
            for r in document["rows"]
        ),
    )
    versus = [line for line in document["vs_best_vllm"] if line["rate"] != float("inf")]
    if versus:
        lines += [
            "",
            "Against the best vLLM connector at the same deployment and rate (the lower TTFT p50):",
        ]
        for connector in sorted({line["connector"] for line in versus}):
            mine = [line for line in versus if line["connector"] == connector]
            lines.append(
                f"- {CONNECTOR_NAMES.get(connector, connector)}: TTFT p50 "
                f"{spread(line['ttft_p50_vs_best'] for line in mine)}×, p99 "
                f"{spread(line['ttft_p99_vs_best'] for line in mine)}×, throughput "
                f"{spread(line['throughput_vs_best'] for line in mine)}×"
            )
    proxy = [r["proxy_first_p50_ms"] for r in document["rows"] if "proxy_first_p50_ms" in r]
    if proxy:
        lines += [
            "",
            f"`kvbridge vllm-proxy`'s own time before the first byte, p50: {spread(proxy)} ms.",
        ]
    return lines + failures(document)


def spread(values: Iterable[float]) -> str:
    ordered = sorted(values)
    low, high = f"{ordered[0]:.2f}", f"{ordered[-1]:.2f}"
    return low if low == high else f"{low}-{high}"


def failures(document: Document) -> list[str]:
    if not document.get("failures"):
        return []
    return ["", "Runs that did not finish:", *(f"- {line}" for line in document["failures"])]
