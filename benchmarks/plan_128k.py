"""Planning time for a 128k-token request at page_size 1 (Llama-3-8B rank geometry).

    .venv/bin/python benchmarks/plan_128k.py

Destination pages as a decode allocator hands them out: fully contiguous, in runs of 16, and
fully scattered (worst case: one block per page per buffer).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from kvbridge.cache import BufferSpec, KVArgs, TransferPlan, plan_kv
from kvbridge.wire import KVLayout

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


def plan_128k(dst_pages: np.ndarray, repeats: int = 5) -> tuple[float, TransferPlan]:
    """Median planning time in ms, and the plan."""
    src, dst = rank(0x7F0000000000, TOKENS), rank(0x7E0000000000, 2 * TOKENS)
    src_pages = np.arange(TOKENS, dtype=np.int32)
    times = []
    plan = TransferPlan.empty()
    for _ in range(repeats):
        started = time.perf_counter()
        plan = plan_kv(src, dst, src_pages, dst_pages)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), plan


def main() -> None:
    print(f"{'destination pages':20} {'plan ms':>9} {'blocks':>10} {'GiB planned':>12}")
    for name, pages in destination_patterns().items():
        milliseconds, plan = plan_128k(pages)
        print(f"{name:20} {milliseconds:9.1f} {len(plan):10d} {plan.total_bytes / 2**30:12.2f}")


if __name__ == "__main__":
    main()
