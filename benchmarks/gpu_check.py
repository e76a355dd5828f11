"""The GPU check (issue 7): on one GPU machine, in a few minutes, in one run —

- the ceiling: a device-to-device copy through torch (GB/s of bytes moved);
- the staging kernels on the GPU: gather and scatter GB/s on their own stream, one Triton
  launch for all KV buffers and, beside it, one torch copy per buffer (the fallback);
- kvbridge end to end between prefill and decode processes on the same GPU (KV, aux and
  state slots in GPU memory, registered as VRAM), every byte verified: the demo model shape
  at TP 1→1, 2→2, 2→4 and 4→2, and DeepSeek-V3's MLA at 1→1 (issue 46's rows: each against
  the device copy, target ≥ 0.5×); beside each, the raw engine replaying the identical
  blocks, how its chunks went (`write_path` auto: the cost model's choice), and the
  transport the engine reports.

    python benchmarks/gpu_check.py [--memory cuda|torch-cpu] [--requests N --tokens L]

`--memory torch-cpu` runs the same on CPU tensors (how it is checked without a GPU). On the
lent GPU machine, `scripts/gpu-check.sh` runs it with the CUDA tests. Prints a
table and writes bench-results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from kvbridge.staging import torch_kernels
from kvbridge_tools.bench_results import save
from kvbridge_tools.demo import DemoConfig, run_demo


def timed(action: Any, device: torch.device, repeats: int = 5) -> float:
    """Seconds per call, after a warm-up, synchronized on the GPU."""
    action()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        action()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / repeats


def copy_ceiling(device: torch.device, nbytes: int) -> float:
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return nbytes / timed(lambda: target.copy_(source), device) / 1e9


def staging_kernels(device: torch.device, tokens: int, one_launch: bool) -> tuple[float, float]:
    """Gather and scatter GB/s for the demo shape's TP 2→4 head slice (64 buffers, half of a
    rank's 4 heads × 128 dims in bf16 per token), scattered token rows: with one launch for
    all buffers (Triton, where it runs) or one torch copy per buffer."""
    buffers, token_bytes, width = 64, 4 * 128 * 2, 2 * 128 * 2
    views = [
        torch.randint(0, 255, (2 * tokens, token_bytes), dtype=torch.uint8, device=device)
        for _ in range(buffers)
    ]
    rows = torch.randperm(2 * tokens, device=device)[:tokens]
    staged = torch.empty(buffers * tokens * width, dtype=torch.uint8, device=device)
    stream = torch_kernels.side_stream(device)
    gather_s = timed(
        lambda: torch_kernels.gather(views, rows, 0, width, staged, stream, one_launch), device
    )
    scatter_s = timed(
        lambda: torch_kernels.scatter(staged, views, rows, 0, width, stream, one_launch), device
    )
    return staged.numel() / gather_s / 1e9, staged.numel() / scatter_s / 1e9


# (model, prefill TP, decode TP) of each end-to-end row.
TRANSFERS = (
    ("llama3-8b", 1, 1),
    ("llama3-8b", 2, 2),
    ("llama3-8b", 2, 4),
    ("llama3-8b", 4, 2),
    ("deepseek-v3", 1, 1),
)


def transfer(
    memory: str, model: str, prefill_tp: int, decode_tp: int, requests: int, tokens: int
) -> dict[str, Any]:
    config = DemoConfig(
        model=model,
        requests=requests,
        tokens=tokens,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        memory=memory,
        measure_raw=True,
        decode_pool_factor=1.0,
        timeout_s=300.0,
    )
    result = run_demo(config)
    return {
        "model": model,
        "pair": f"{prefill_tp}->{decode_tp}",
        "chunks": result.chunk_paths,
        "verified": result.ok,
        "errors": [
            r.error or r.failed_rooms or r.mismatched_rooms for r in result.reports if not r.ok
        ],
        "kvbridge_gbps": round(result.gbps, 2),
        "raw_gbps": round(result.raw_gbps, 2),
        "staged_chunks": sum(r.staged_chunks for r in result.reports),
        "transport": sorted({r.transport for r in result.reports if r.transport}),
        "p50_ms": round(result.latency_ms(0.5), 1),
        # Where each process's batch went (seconds): gathers, scatters, engine calls, control.
        "timings": {
            f"{r.role}-{r.rank}": {name: round(s, 3) for name, s in r.timings.items()}
            | ({"batch_s": round(r.seconds, 3)} if r.seconds else {})
            for r in sorted(result.reports, key=lambda r: (r.role != "prefill", r.rank))
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memory", choices=("cuda", "torch-cpu"), default="cuda")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    options = parser.parse_args()
    device = torch.device("cuda" if options.memory == "cuda" else "cpu")
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "copy_ceiling_gbps": round(copy_ceiling(device, 1 << 30), 1),
    }
    for one_launch, name in ((True, ""), (False, "_per_buffer")):
        gather_gbps, scatter_gbps = staging_kernels(device, options.tokens, one_launch)
        report[f"gather{name}_gbps"] = round(gather_gbps, 1)
        report[f"scatter{name}_gbps"] = round(scatter_gbps, 1)
    report["transfers"] = [
        transfer(options.memory, model, pt, dt, options.requests, options.tokens)
        for model, pt, dt in TRANSFERS
    ]
    for row in report["transfers"]:
        row["vs_copy"] = round(row["kvbridge_gbps"] / report["copy_ceiling_gbps"], 3)
    per_buffer = f"{report['gather_per_buffer_gbps']}, {report['scatter_per_buffer_gbps']}"
    print(
        f"{report['device']}: device copy {report['copy_ceiling_gbps']} GB/s; staging gather "
        f"{report['gather_gbps']} GB/s, scatter {report['scatter_gbps']} GB/s (one copy per "
        f"buffer: {per_buffer})"
    )
    print(
        "model | TP | verified | kvbridge GB/s | × device copy | raw GB/s | chunks | p50 ms | "
        "transport"
    )
    for row in report["transfers"]:
        transport = ", ".join(row["transport"])
        chunks = ", ".join(f"{path} {n}" for path, n in row["chunks"].items())
        print(
            f"{row['model']} | {row['pair']} | {row['verified']} | {row['kvbridge_gbps']} | "
            f"{row['vs_copy']} | {row['raw_gbps']} | {chunks} | {row['p50_ms']} | {transport}"
        )
        for process, timings in row["timings"].items():
            print(f"  {process}: " + ", ".join(f"{name} {s}" for name, s in timings.items()))
        for error in row["errors"]:
            print(f"  error: {error}")
    save("gpu_check", report)
    raise SystemExit(0 if all(row["verified"] for row in report["transfers"]) else 1)


if __name__ == "__main__":
    main()
