"""Planning time for a 128k-token request at page_size 1 (Llama-3-8B rank geometry).

    .venv/bin/python benchmarks/plan_128k.py

Destination pages as a decode allocator hands them out: fully contiguous, in runs of 16, and
fully scattered (worst case: one block per page per buffer). Each plan is timed in fresh
memory (the first request of its size) and in the memory a prefill rank reuses from one plan
to the next (`PlanArena`: a serving rank's steady state, and what the target is about).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from kvbridge.cache import BufferSpec, KVArgs, TransferPlan, plan_kv
from kvbridge.cache.plan import FRESH, PlanArena, PlanMemory
from kvbridge.wire import KVLayout
from kvbridge_tools.bench_results import save

TOKENS = 128 * 1024
LAYERS = 32
HEADS, HEAD_DIM = 8, 128


def rank(base: int, pages: int) -> KVArgs:
    page_bytes = HEADS * HEAD_DIM * 2
    return KVArgs(
        kv_layout=KVLayout.MHA,
        layer_ids=tuple(range(LAYERS)),
        total_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype="bfloat16",
        page_size=1,
        kv_buffers=tuple(
            BufferSpec(base + i * pages * page_bytes, pages * page_bytes, page_bytes)
            for i in range(2 * LAYERS)
        ),
    )


def destination_patterns() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    pool = 2 * TOKENS
    runs = rng.permutation(pool // 16)[: TOKENS // 16]
    return {
        "contiguous": np.arange(TOKENS, dtype=np.int32),
        "runs of 16": (runs[:, None] * 16 + np.arange(16)).ravel().astype(np.int32),
        "scattered": rng.permutation(pool)[:TOKENS].astype(np.int32),
    }


TARGET_MS = 20.0  # scattered pages, in reused memory (issue 16)


def plan_128k(
    dst_pages: np.ndarray, repeats: int = 7, reuse: bool = True
) -> tuple[float, TransferPlan]:
    """Median planning time in ms, and the plan: in memory reused from plan to plan (as a
    prefill rank does), or in fresh memory each time."""
    src, dst = rank(0x7F0000000000, TOKENS), rank(0x7E0000000000, 2 * TOKENS)
    src_pages = np.arange(TOKENS, dtype=np.int32)
    arena = PlanArena()
    memory: PlanMemory = arena if reuse else FRESH
    times = []
    plan = TransferPlan.empty()
    for _ in range(repeats):
        started = time.perf_counter()
        plan = plan_kv(src, dst, src_pages, dst_pages, memory)
        times.append((time.perf_counter() - started) * 1e3)
        arena.give_back(plan)  # its write ended
    return statistics.median(times), plan


def main() -> None:
    print(
        f"{'destination pages':20} {'fresh ms':>9} {'reused ms':>10} {'blocks':>10} "
        f"{'GiB planned':>12}"
    )
    scattered_ms = 0.0
    rows: list[dict[str, object]] = []
    for name, pages in destination_patterns().items():
        fresh_ms, plan = plan_128k(pages, reuse=False)
        reused_ms, _ = plan_128k(pages)
        if name == "scattered":
            scattered_ms = reused_ms
        print(
            f"{name:20} {fresh_ms:9.1f} {reused_ms:10.1f} {len(plan):10d} "
            f"{plan.total_bytes / 2**30:12.2f}"
        )
        rows.append(
            {
                "destination_pages": name,
                "fresh_ms": round(fresh_ms, 2),
                "reused_ms": round(reused_ms, 2),
                "blocks": len(plan),
                "gib": round(plan.total_bytes / 2**30, 2),
            }
        )
    met = "met" if scattered_ms < TARGET_MS else "NOT met"
    print(f"scattered, reused memory: {scattered_ms:.1f} ms (target < {TARGET_MS:g} ms: {met})")
    document = {"tokens": TOKENS, "target_ms": TARGET_MS, "rows": rows}
    print(f"wrote {save('plan_128k', document)}")


if __name__ == "__main__":
    main()
