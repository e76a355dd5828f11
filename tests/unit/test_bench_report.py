"""docs/benchmarks.md written from bench-results/: regions rewritten from the results they name,
the prose around them kept byte for byte, missing results keeping a region as it was, and
markers that cannot be rendered refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvbridge_tools import bench_report
from kvbridge_tools.bench import Cell, CellResult
from kvbridge_tools.bench_results import load, save

ROOT = Path(__file__).resolve().parents[2]
MEASURED = {
    "date": "2026-12-05 14:00 UTC",
    "commit": "abc1234",
    "host": "2 cores, a CPU, 23 GiB",
    "command": "benchmarks/x.py",
}


def workload(engine: str, name: str, requests: int, two_hosts: bool, target: float) -> Any:
    return {
        "engine": engine,
        "name": name,
        "requests": requests,
        "two_hosts": two_hosts,
        "target": target,
    }


def e2e_row(engine: str, name: str, requests: int, ratio: float, two_hosts: bool = False) -> Any:
    return {
        "workload": workload(engine, name, requests, two_hosts, 0.95),
        "transport": "cma",
        "bytes": 8.6e9,
        "runs": 3,
        "kvbridge_gbps": 4.1,
        "raw_gbps": {"one write per peer": 4.3},
        "raw_best": "one write per peer",
        "ratio": ratio,
        "ratio_range": [ratio - 0.05, ratio + 0.01],
        "p50_ms": 900.0,
        "p99_ms": 1500.0,
        "wall_ms": 1700.0,
        "p50_of_wall": 0.53,
    }


DOCUMENTS: dict[str, dict[str, Any]] = {
    "plan_128k": {
        "tokens": 131072,
        "target_ms": 20.0,
        "rows": [
            {
                "destination_pages": "scattered",
                "fresh_ms": 27.0,
                "reused_ms": 11.4,
                "blocks": 8388480,
                "gib": 16.0,
            }
        ],
    },
    "wire_codec": {
        "pages": 131072,
        "rows": [
            {
                "message": "kvbridge/1 TransferRequest",
                "encode_us": 25.1,
                "decode_us": 9.8,
                "bytes": 524420,
            }
        ],
    },
    "registration": {
        "rows": [
            {
                "engine": "nixl",
                "gib": 16,
                "regions": 64,
                "register_s": 0.001,
                "deregister_s": 0.0002,
                "engine_start_s": 0.43,
                "rdma_device": False,
            }
        ]
    },
    "nixl_notify": {
        "block_bytes": 32 << 10,
        "rows": [
            {
                "target_poll_ms": 1.0,
                "blocks_per_write": 64,
                "notification": notify,
                "gbps_median": gbps,
                "gbps": [gbps] * 4,
            }
            for notify, gbps in ((False, 5.2), (True, 1.7))
        ],
    },
    "busy_host": {
        "rows": [
            {
                "requests": 32,
                "tokens": 128,
                "load": "idle",
                "runs": 1,
                "kvbridge_gbps": 3.4,
                "raw_gbps": {"per-chunk, 1 in flight": 4.68},
                "raw_best": "per-chunk, 1 in flight",
                "ratio": 0.728,
                "p50_ms": 83.0,
            }
        ]
    },
    "layerwise": {
        "target": 1.5,
        "rows": [
            {
                "model": "Llama-3-8B",
                "layers": 32,
                "tokens": 1024,
                "layer_ms": 4.0,
                "whole_request_ms": 45.9,
                "tail_ms": 2.0,
                "tail_ratio": 1.39,
            },
            {
                "model": "Qwen2.5-7B",
                "layers": 28,
                "tokens": 16384,
                "layer_ms": 64.0,
                "whole_request_ms": 300.0,
                "tail_ms": 20.0,
                "tail_ratio": 1.87,
            },
        ],
    },
    "e2e": {
        "rows": [
            e2e_row("nixl", "32 × 2048", 32, 0.967),
            e2e_row("mooncake", "32 × 2048", 32, 0.91),
            e2e_row("nixl", "two hosts", 8, 0.962, two_hosts=True),
        ],
        "sglang_mooncake": {"gbps": 1.2, "verified": 32, "requests": 32},
        "latency_target": 0.55,
        "sglang_target": 1.0,
    },
    "hetero": {
        "requests": 16,
        "tokens": 1024,
        "per_token_target": 3.0,
        "equal_tp_target": 0.5,
        "rows": [
            {
                "pair": "2->4",
                "staging_gbps": 2.4,
                "per_token_gbps": 0.32,
                "equal_tp_gbps": 4.06,
                "staging_vs_per_token": 7.0,
                "staging_vs_equal_tp": 0.59,
                "staging_vs_equal_tp_range": [0.49, 0.7],
                "rounds": 7,
                "blocks_per_request": {"staging": 16, "per_token": 262152, "equal_tp": 8192},
            }
        ],
    },
    "sglang_mooncake": {
        "requests": 32,
        "tokens": 2048,
        "rounds": 3,
        "summary": {
            "sglang → sglang": {"gbps": 0.75, "p50_ms": 5000.0, "p99_ms": 9000.0, "verified": 32},
            "sglang → kvbridge": {"gbps": 0.78, "p50_ms": 4800.0, "p99_ms": 8800.0, "verified": 32},
            "kvbridge → sglang": {"gbps": 0.8, "p50_ms": 4700.0, "p99_ms": 8700.0, "verified": 32},
        },
        "against_sglang": {
            "sglang → kvbridge": {"ratio": 1.04, "range": [0.98, 1.1]},
            "kvbridge → sglang": {"ratio": 1.07, "range": [1.0, 1.12]},
        },
        "runs": {},
    },
    "sglang_nixl": {
        "engine": "nixl",
        "requests": 32,
        "tokens": 2048,
        "rounds": 3,
        "summary": {
            "sglang → sglang": {"gbps": 5.3, "p50_ms": 870.0, "p99_ms": 1590.0, "verified": 32},
            "sglang → kvbridge": {"gbps": 6.1, "p50_ms": 740.0, "p99_ms": 1390.0, "verified": 32},
            "kvbridge → sglang": {"gbps": 5.6, "p50_ms": 810.0, "p99_ms": 1520.0, "verified": 32},
        },
        "against_sglang": {
            "sglang → kvbridge": {"ratio": 1.18, "range": [1.13, 1.23]},
            "kvbridge → sglang": {"ratio": 1.07, "range": [1.04, 1.1]},
        },
        "runs": {},
    },
    "vllm-mla": {
        "family": "mla",
        "model": "random MLA",
        "rows": [
            {
                "connector": c,
                "tokens": 1024,
                "concurrent": 8,
                "ttft_p50_ms": t,
                "ttft_p99_ms": t * 2,
                "kv_ready_p50_ms": t / 3,
                "kv_ready_p99_ms": t / 2,
            }
            for c, t in (("kvbridge-nixl", 83.0), ("vllm-nixl", 123.0))
        ],
        "vs_nixl_connector": [
            {
                "connector": "kvbridge-nixl",
                "tokens": 1024,
                "concurrent": 8,
                "ttft_p50_vs_nixl": 0.67,
                "ttft_p99_vs_nixl": 0.32,
                "kv_ready_p50_vs_nixl": 0.62,
                "kv_ready_p99_vs_nixl": 0.18,
                "tokens_equal": False,
            }
        ],
        "failures": [],
    },
    "vllm-serve": {
        "model": "random Llama",
        "workload": {"prompts": 16, "input_len": 512, "output_len": 64, "prefix_len": 256},
        "slo": {"ttft_ms": 2000.0, "tpot_ms": 250.0},
        "rows": [
            {
                "connector": c,
                "deployment": "1p1d",
                "rate": rate,
                "ttft_p50_ms": ttft,
                "ttft_p99_ms": ttft * 3,
                "tpot_p50_ms": 20.0,
                "itl_p99_ms": 400.0,
                "e2el_p50_ms": ttft + 1000,
                "request_throughput": 0.8,
                "output_throughput": 50.0,
                "goodput": 0.5,
                "proxy_first_p50_ms": 0.4,
            }
            for c, rate, ttft in (
                ("kvbridge-nixl", float("inf"), 9000.0),
                ("kvbridge-nixl", 0.5, 600.0),
                ("vllm-nixl", 0.5, 6000.0),
            )
        ],
        "vs_best_vllm": [
            {
                "connector": "kvbridge-nixl",
                "deployment": "1p1d",
                "rate": 0.5,
                "best_vllm": "vllm-nixl",
                "ttft_p50_vs_best": 0.1,
                "ttft_p99_vs_best": 0.1,
                "throughput_vs_best": 1.5,
            }
        ],
        "failures": [],
    },
    "bench": {
        "preset": "smoke",
        "cells": [
            CellResult(
                Cell("nixl", "llama3-8b", 128, 16, 1, 1),
                requests=4,
                transport="cma",
                bytes=1 << 20,
                kvbridge_gbps=1.69,
                raw_gbps=2.83,
                p50_ms=132.0,
                p99_ms=158.0,
                descriptors_per_request=514.0,
                plan_ms_per_request=0.93,
                control_cpu_ms_per_request=3.6,
                latencies_ms=[132.0],
            ).as_json()
        ],
    },
}


def stamped(name: str) -> dict[str, Any]:
    # Through JSON, as the report reads them (float("inf") included).
    return dict(json.loads(json.dumps({"measured": MEASURED, **DOCUMENTS[name]})))


def page_of(*regions: str) -> str:
    parts = ["# Benchmarks\n\nProse before.\n"]
    for names in regions:
        parts.append(f"<!-- results: {names} -->\nold figures of {names}\n<!-- end results -->\n")
        parts.append(f"Prose after {names}.\n")
    return "\n".join(parts)


def test_every_results_document_renders_with_its_stamp() -> None:
    for name in DOCUMENTS:
        outcome = bench_report.rewrite(page_of(name), lambda need: stamped(need))
        assert outcome.written == [name]
        assert "Measured 2026-12-05 14:00 UTC at `abc1234`" in outcome.page
        assert f"old figures of {name}" not in outcome.page


def test_every_renderer_is_tried_on_a_document() -> None:
    assert set(bench_report.RENDERERS) <= set(DOCUMENTS)


def test_rows_carry_their_figures_and_targets() -> None:
    page = bench_report.rewrite(page_of("targets", "e2e", "vllm-serve"), stamped).page
    assert "| nixl 32 × 2048 ≥ 0.95× raw | 0.967 | met |" in page
    assert "| mooncake 32 × 2048 ≥ 0.95× raw | 0.91 | **NOT met** |" in page
    assert "| planning 128k tokens < 20 ms | 11.4 ms | met |" in page
    assert "| staging 2→4 ≥ 0.5× equal TP | 0.59 | met |" in page
    # kvbridge on Mooncake 4.1 GB/s over sglang's 1.2:
    assert "| Mooncake ≥ 1.0× sglang 0.5.23's own layer | 3.417 | met |" in page
    assert "| 1P1D | max | kvbridge, NIXL | 9000 |" in page
    assert "- kvbridge, NIXL: TTFT p50 0.10×, p99 0.10×, throughput 1.50×" in page
    sglang = bench_report.rewrite(page_of("sglang_mooncake"), stamped).page
    assert "| sglang → sglang | 0.750 | 5000 / 9000 | 32/32 |" in sglang
    assert "| kvbridge → sglang | 0.800 | 4700 / 8700 | 32/32 |" in sglang
    assert (
        "- sglang → kvbridge against sglang → sglang: 1.04× (0.98-1.1; target ≥ 1.0: met)" in sglang
    )
    assert (
        "- kvbridge → sglang against sglang → sglang: 1.07× (1.0-1.12; target ≥ 1.0: met)" in sglang
    )
    layers = bench_report.rewrite(page_of("layerwise"), stamped).page
    assert "| Llama-3-8B | 32 | 1024 | 4 | 45.9 | 2.00 | 1.39 met |" in layers
    assert "| Qwen2.5-7B | 28 | 16384 | 64 | 300.0 | 20.00 | 1.87 MISSED |" in layers
    nixl = bench_report.rewrite(page_of("sglang_nixl"), stamped).page
    assert "32 requests × 2048 tokens over nixl" in nixl
    assert "| sglang → kvbridge | 6.100 | 740 / 1390 | 32/32 |" in nixl


def test_a_matrix_cell_reads_back_as_it_was_written() -> None:
    cell = DOCUMENTS["bench"]["cells"][0]
    assert CellResult.from_json(cell).as_json() == cell
    page = bench_report.rewrite(page_of("bench"), stamped).page
    assert "| nixl | llama3-8b | 128 | 16 | 1→1 | 4 | 1.69 | 2.83 | 0.60 | 132 / 158 |" in page


def test_prose_outside_regions_is_kept_byte_for_byte() -> None:
    page = page_of("wire_codec", "hetero")
    rewritten = bench_report.rewrite(page, stamped).page
    outside = bench_report.REGION.sub("", page)
    assert bench_report.REGION.sub("", rewritten) == outside


def test_a_region_without_all_its_results_is_kept() -> None:
    def only_plan(name: str) -> dict[str, Any] | None:
        return stamped(name) if name == "plan_128k" else None

    page = page_of("plan_128k", "targets", "e2e")
    outcome = bench_report.rewrite(page, only_plan)
    assert outcome.written == ["plan_128k"]
    assert outcome.kept == ["targets: no e2e, hetero results", "e2e: no e2e results"]
    assert "old figures of targets" in outcome.page
    assert "old figures of e2e" in outcome.page


@pytest.mark.parametrize(
    ("page", "problem"),
    [
        ("<!-- results: e2e -->\nno end\n", "without its"),
        ("<!-- results: no_such_benchmark -->\n<!-- end results -->\n", "no_such_benchmark"),
    ],
)
def test_markers_that_cannot_be_rendered_are_refused(page: str, problem: str) -> None:
    with pytest.raises((ValueError, KeyError), match=problem):
        bench_report.rewrite(page, stamped)


def test_the_benchmarks_page_names_only_results_that_have_a_table() -> None:
    regions = bench_report.check_markers((ROOT / "docs" / "benchmarks.md").read_text())
    assert [names for names in regions if "targets" in names]


def test_results_are_stamped_and_unstamped_ones_refused(tmp_path: Path) -> None:
    path = save("plan_128k", DOCUMENTS["plan_128k"], folder=tmp_path)
    document = load(path)
    assert set(document["measured"]) == {"date", "commit", "host", "command"}
    assert document["rows"] == DOCUMENTS["plan_128k"]["rows"]
    (tmp_path / "old.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="no 'measured' stamp"):
        load(tmp_path / "old.json")


def test_the_command_line_rewrites_the_page_and_copies_its_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results"
    for name in ("wire_codec", "vllm-serve"):
        save(name, DOCUMENTS[name], folder=results)
    (results / "vllm-serve.png").write_bytes(b"png")
    (results / "e2e.json").write_text(json.dumps(DOCUMENTS["e2e"]))  # unstamped: kept
    page = tmp_path / "docs" / "benchmarks.md"
    page.parent.mkdir()
    page.write_text(page_of("wire_codec", "vllm-serve", "e2e") + "![plot](vllm-serve.png)\n")
    assert bench_report.main(["--results", str(results), "--page", str(page)]) == 0
    text = page.read_text()
    assert "| kvbridge/1 TransferRequest | 25.1 | 9.8 | 524420 |" in text
    assert "old figures of e2e" in text
    assert "no 'measured' stamp" in capsys.readouterr().out
    assert (page.parent / "vllm-serve.png").read_bytes() == b"png"
