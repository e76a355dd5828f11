"""kvbridge and the raw engine inside a prefill process whose Python never waits.

    .venv/bin/python benchmarks/busy_host.py [--repeats 1]

A serving engine hosts kvbridge in its own process, next to a scheduler loop that runs Python
most of the time. kvbridge's threads (and the raw replay's) then share the GIL with it: each
NIXL call that releases the GIL (`initialize_xfer`, `transfer`, `check_xfer_state`) and each
handoff between kvbridge's threads waits to take it back, up to the interpreter's switch
interval (5 ms by default) when the other thread never blocks. This runs the demo (NIXL, one
host, a warm-up batch, the raw replays around the timed batch) with the prefill process idle,
with a pure-Python busy loop in it (the worst case of such a scheduler), and with that loop
and a 0.2 ms switch interval, at 32 × 128 and 8 × 2048 tokens. Informational: no target.
Writes bench-results/busy_host.json.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any

from kvbridge import ManagerConfig
from kvbridge_tools.bench import engine_unavailable, raw_baseline
from kvbridge_tools.bench_results import save

WORKLOADS = ((32, 128), (8, 2048))  # (requests, tokens)


@dataclass(frozen=True)
class HostLoad:
    name: str
    busy_loop: bool
    switch_interval_s: float | None


LOADS = (
    HostLoad("idle", busy_loop=False, switch_interval_s=None),
    HostLoad("busy loop", busy_loop=True, switch_interval_s=None),
    HostLoad("busy loop, switch 0.2 ms", busy_loop=True, switch_interval_s=0.0002),
)


def measure(requests: int, tokens: int, load: HostLoad, repeats: int) -> dict[str, Any]:
    """Medians over `repeats` demo runs: kvbridge's GB/s, each raw way's (around the timed
    batch), the best raw way, kvbridge against it, and the median request's latency."""
    from kvbridge_tools.demo import DemoConfig, run_demo

    runs = []
    for _ in range(repeats):
        config = DemoConfig(
            requests=requests,
            tokens=tokens,
            measure_raw=True,
            warmup=True,
            decode_pool_factor=1.0,
            timeout_s=600.0,
            prefill_busy_loop=load.busy_loop,
            prefill_switch_interval_s=load.switch_interval_s,
            transfer=ManagerConfig(engine="nixl"),
        )
        result = run_demo(config)
        if not result.ok:
            raise SystemExit(
                f"{requests} × {tokens}, {load.name}: the run failed: "
                f"{[r for r in result.reports if not r.ok]}"
            )
        runs.append((result.gbps, result.raw_strategy_gbps(), result.latency_ms(0.5)))
    raw, best = raw_baseline([run[1] for run in runs])
    return {
        "requests": requests,
        "tokens": tokens,
        "load": load.name,
        "runs": repeats,
        "kvbridge_gbps": round(statistics.median(run[0] for run in runs), 3),
        "raw_gbps": {way: round(gbps, 3) for way, gbps in raw.items()},
        "raw_best": best,
        "ratio": round(statistics.median(run[0] / run[1][best] for run in runs), 3),
        "p50_ms": round(statistics.median(run[2] for run in runs), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs per cell (median)")
    args = parser.parse_args()
    unavailable = engine_unavailable("nixl")
    if unavailable:
        print(f"nixl: skipped ({unavailable})")
        return
    rows = []
    print(
        "requests × tokens | prefill process | kvbridge GB/s | raw GB/s (best way) | ratio | p50 ms"
    )
    print("--- | --- | --- | --- | --- | ---")
    for requests, tokens in WORKLOADS:
        for load in LOADS:
            row = measure(requests, tokens, load, args.repeats)
            rows.append(row)
            best = row["raw_best"]
            print(
                f"{requests} × {tokens} | {load.name} | {row['kvbridge_gbps']:.2f} | "
                f"{row['raw_gbps'][best]:.2f} ({best}) | {row['ratio']:.3f} | "
                f"{row['p50_ms']:.0f}",
                flush=True,
            )
    print(f"wrote {save('busy_host', {'rows': rows})}")


if __name__ == "__main__":
    main()
