"""When a NIXL write that carries a notification ends: at the target's next progress.

    .venv/bin/python benchmarks/nixl_notify.py [--rounds 4] [--blocks-per-write 64 256]

Two processes, one NIXL agent each (UCX; over CMA on one host). The initiator writes 256 MiB
into the target's memory in writes of `--blocks-per-write` scattered 32 KiB blocks, one write
at a time (the next is posted when the last one ended), with and without a notification,
while the target polls its notifications every 0.1, 1 or 3 ms. A write with a notification
ends, on the initiator's side, only once the target's worker progresses again, so one write
at a time runs at the target's polling pace; without a notification the target's pace does
not matter. This is why a prefill rank keeps several writes in flight toward a peer (with NIXL
over CMA the copy runs inside the post call: the next write can start while the last one
waits for decode's poll) and why decode polls every millisecond while rooms transfer.
Writes bench-results/nixl_notify.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvbridge.cache.plan import TransferPlan
from kvbridge.cache.regions import MemoryRegion
from kvbridge_tools.bench import engine_unavailable
from kvbridge_tools.bench_results import save

TOTAL_BYTES = 256 << 20
BLOCK_BYTES = 32 << 10  # a page of 16 tokens of Llama-3-8B's K or V on one rank
POLL_INTERVALS_S = (0.0001, 0.001, 0.003)


def run_target(conn: Connection) -> None:
    """Register the destination, then poll notifications at each pace the initiator sets
    (acknowledged once set), until it says stop (None)."""
    from kvbridge.engines.nixl import NixlEngine

    destination = np.ones(TOTAL_BYTES, np.uint8)  # touched: no page faults in the copies
    engine = NixlEngine("nixl-notify-target")
    region = MemoryRegion(destination.ctypes.data, TOTAL_BYTES)
    engine.register([region])
    conn.send((engine.endpoint(), region.ptr))
    while (interval_s := conn.recv()) is not None:
        conn.send("polling")
        while not conn.poll():
            engine.notifications()
            time.sleep(interval_s)
    engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per case")
    parser.add_argument("--blocks-per-write", type=int, nargs="+", default=[64, 256])
    args = parser.parse_args()
    unavailable = engine_unavailable("nixl")
    if unavailable:
        print(f"nixl: skipped ({unavailable})")
        return
    from kvbridge.engines.nixl import NixlEngine

    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    target = context.Process(target=run_target, args=(there,), daemon=True)
    target.start()
    target_endpoint, target_ptr = here.recv()
    source = np.full(TOTAL_BYTES, 7, np.uint8)
    engine = NixlEngine("nixl-notify-initiator")
    local = MemoryRegion(source.ctypes.data, TOTAL_BYTES)
    engine.register([local])
    peer = engine.connect(target_endpoint, [MemoryRegion(target_ptr, TOTAL_BYTES)])
    blocks = TOTAL_BYTES // BLOCK_BYTES
    scattered = np.random.default_rng(0).permutation(blocks).astype(np.uint64)
    src = np.arange(blocks, dtype=np.uint64) * BLOCK_BYTES + np.uint64(local.ptr)
    dst = scattered * BLOCK_BYTES + np.uint64(target_ptr)

    def one_at_a_time(per_write: int, notify: bytes) -> float:
        """GB/s of the whole region in writes of `per_write` blocks, each waited for."""
        lengths = np.full(per_write, BLOCK_BYTES, np.uint64)
        plans = [
            TransferPlan(src[i : i + per_write], dst[i : i + per_write], lengths)
            for i in range(0, blocks, per_write)
        ]
        started = time.perf_counter()
        for plan in plans:
            handle = engine.write(peer, plan, notify)
            while not handle.check(started, 30.0):
                pass
        return TOTAL_BYTES / (time.perf_counter() - started) / 1e9

    cases = [(per_write, notify) for per_write in args.blocks_per_write for notify in (b"", b"n")]
    results: list[dict[str, Any]] = []
    for interval_s in POLL_INTERVALS_S:
        here.send(interval_s)
        here.recv()
        one_at_a_time(cases[0][0], b"")  # the connection and the first use of every page
        measured: dict[tuple[int, bytes], list[float]] = {case: [] for case in cases}
        for round_index in range(args.rounds):
            for case in cases if round_index % 2 == 0 else cases[::-1]:
                measured[case].append(one_at_a_time(*case))
        for (per_write, notify), gbps in measured.items():
            row = {
                "target_poll_ms": interval_s * 1e3,
                "blocks_per_write": per_write,
                "notification": bool(notify),
                "gbps_median": statistics.median(gbps),
                "gbps": gbps,
            }
            results.append(row)
            print(
                f"target polls every {interval_s * 1e3:4.1f} ms, writes of {per_write:4d} "
                f"blocks ({per_write * BLOCK_BYTES >> 20} MiB), "
                f"{'with' if notify else 'without'} a notification: "
                f"{row['gbps_median']:.2f} GB/s (median of {len(gbps)})",
                flush=True,
            )
    here.send(None)
    target.join(timeout=30)
    engine.close()
    print(f"wrote {save('nixl_notify', {'block_bytes': BLOCK_BYTES, 'rows': results})}")


if __name__ == "__main__":
    main()
