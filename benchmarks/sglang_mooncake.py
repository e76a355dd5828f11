"""sglang 0.5.23's own transfer layer on the Mooncake engine, on the demo's workload.

    .venv-sglang/bin/python benchmarks/sglang_mooncake.py [--requests N --tokens L]
    (run inside a network namespace of its own: Mooncake binds wildcard listeners;
    benchmarks/e2e.py does that)

A prefill and a decode process drive sglang's real `MooncakeKVManager`, `MooncakeKVSender`,
`MooncakeKVReceiver` and `MooncakeKVBootstrapServer`, built as sglang's schedulers build them
(`prefill.py::_init_kv_manager`; ../shared/reference/sglang-cpu.md) but without a model: the
KV cache is the demo's (Llama-3-8B: 32 layers of K and V, 8 heads × 128, bf16, pages of 16
tokens), prefill's pages hold known contents, decode's pages are scattered, and decode checks
every byte it received. Each request goes in two chunks, as the demo sends it; all requests
are issued at once. Prints one JSON line: GB/s (decimal) from the first receiver's metadata to
the last room's success, and the per-request latencies. Environment as sglang is run on these
machines: SGLANG_HOST_IP=127.0.0.1, MOONCAKE_PROTOCOL=tcp, MC_FORCE_TCP=1, and Mooncake's
per-peer queue limits raised as sglang deployments raise them (as kvbridge does).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LAYERS, HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
BOOTSTRAP_PORT = 18998
# How often the driver polls sglang's senders and receivers (a scheduler's step, about).
POLL_S = float(os.environ.get("POLL_S", "0.005"))
ENVIRONMENT = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "MOONCAKE_PROTOCOL": "tcp",
    "MC_FORCE_TCP": "1",
    "MC_LOG_LEVEL": "WARNING",
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
}


def _sglang(role: str) -> dict[str, Any]:
    """Import sglang's PD modules and publish a scheduler's server args for `role`."""
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    sys.path.insert(0, str(ROOT / "tests" / "sglang_compat"))
    from sglang_import import import_sglang

    import_sglang()
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
    )
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path="dummy",
        device="cpu",
        disaggregation_mode=role,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=BOOTSTRAP_PORT,
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    get_parallel().override_permanently(pp_group=None)
    init_mooncake_transfer_engine("127.0.0.1", gpu_id=0, ib_device=None)

    def kind(name: str) -> Any:
        return get_kv_class(TransferBackend.MOONCAKE, getattr(KVClassType, name))

    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    return {"server_args": server_args, "mode": mode, "class": kind}


def _kv_args(kind: Any, pages: int, slots: int) -> tuple[Any, list[np.ndarray], np.ndarray]:
    """sglang's KVArgs for the demo's cache, filled as `_init_kv_manager` fills it."""
    args = kind("KVARGS")()
    buffers = [np.zeros((pages, PAGE, HEADS, HEAD_DIM), np.uint16) for _ in range(2 * LAYERS)]
    aux = np.zeros((slots, 64), np.uint8)
    args.engine_rank, args.pp_rank, args.system_dp_rank, args.rust_http_port = 0, 0, 0, None
    args.kv_cache_dtype_str, args.kv_layout = "bfloat16", None
    args.prefill_start_layer, args.prefill_end_layer = 0, LAYERS
    args.kv_data_ptrs = [b.ctypes.data for b in buffers]
    args.kv_data_lens = [b.nbytes for b in buffers]
    args.kv_item_lens = [b.nbytes // pages for b in buffers]
    args.num_draft_entries, args.kv_layer_ids = 0, []
    args.kv_head_num, args.total_kv_head_num, args.page_size = HEADS, HEADS, PAGE
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = (
        [aux.ctypes.data],
        [aux.nbytes],
        [64],
    )
    args.ib_device, args.gpu_id = None, 0
    # setup_state_kv_args for a pool with no state (Llama): every state list empty.
    for name in (
        "state_types",
        "state_data_ptrs",
        "state_data_lens",
        "state_item_lens",
        "state_dim_per_tensor",
        "state_slice_outer_counts",
        "state_layer_ids",
        "state_conv_shard_groups",
    ):
        setattr(args, name, [])
    args.is_hybrid_mla_backend, args.swa_kv_cache_layout, args.mla_compression_ratios = (
        False,
        None,
        None,
    )
    return args, buffers, aux


def content(room: int, buffer: int, pages: int) -> np.ndarray:
    """A room's pages in one buffer: a function of (room, buffer, position)."""
    words = pages * PAGE * HEADS * HEAD_DIM
    base = np.uint64((room * 1_000_003 + buffer) * 0x100000001B3 % 2**64)
    values = (np.arange(words // 4, dtype=np.uint64) + base) * np.uint64(0x9E3779B97F4A7C15)
    return values.view(np.uint16).reshape(pages, PAGE, HEADS, HEAD_DIM)


def _wait(polls: list[Any], timeout_s: float) -> dict[int, float]:
    """Poll until every object reports Success or Failed; when each ended."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(ended) < len(polls) and time.monotonic() < deadline:
        for index, item in enumerate(polls):
            if index not in ended and item.poll() in (KVPoll.Success, KVPoll.Failed):
                ended[index] = time.perf_counter()
        time.sleep(POLL_S)
    return ended


def run_prefill(requests: int, pages_per_request: int, ready: Any, results: Any) -> None:
    sglang = _sglang("prefill")  # first: it makes sglang importable here
    from sglang.srt.disaggregation.base.conn import KVPoll

    kind = sglang["class"]
    args, buffers, aux = _kv_args(kind, requests * pages_per_request, requests)
    for room in range(requests):
        pages = slice(room * pages_per_request, (room + 1) * pages_per_request)
        for index, buffer in enumerate(buffers):
            buffer[pages] = content(room, index, pages_per_request)
        aux[room] = room % 256
    bootstrap = kind("BOOTSTRAP_SERVER")(host="127.0.0.1", port=BOOTSTRAP_PORT)
    manager = kind("MANAGER")(args, sglang["mode"], sglang["server_args"], False)
    ready.set()
    address = f"127.0.0.1:{BOOTSTRAP_PORT}"
    senders = [
        kind("SENDER")(mgr=manager, bootstrap_addr=address, bootstrap_room=room)
        for room in range(requests)
    ]
    started: set[int] = set()
    deadline = time.monotonic() + 600
    while len(started) < requests and time.monotonic() < deadline:
        for room, sender in enumerate(senders):
            if room not in started and sender.poll() == KVPoll.WaitingForInput:
                started.add(room)
                sender.init(pages_per_request, aux_index=room)
                pages = np.arange(
                    room * pages_per_request, (room + 1) * pages_per_request, dtype=np.int32
                )
                for chunk in np.array_split(pages, 2):  # the demo's two chunks
                    sender.send(chunk)
        time.sleep(POLL_S)
    ended = _wait(senders, 600)
    outcome = {room: str(sender.poll()) for room, sender in enumerate(senders)}
    results.put({"role": "prefill", "ended": len(ended), "outcome": outcome})
    time.sleep(3)  # decode reads the last statuses before the sockets go
    del bootstrap


def run_decode(requests: int, pages_per_request: int, ready: Any, results: Any) -> None:
    sglang = _sglang("decode")
    kind = sglang["class"]
    pool = requests * pages_per_request
    args, buffers, aux = _kv_args(kind, pool, requests)
    manager = kind("MANAGER")(args, sglang["mode"], sglang["server_args"], False)
    ready.wait(120)
    address = f"127.0.0.1:{BOOTSTRAP_PORT}"
    deadline = time.monotonic() + 60
    while not manager.try_ensure_parallel_info(address) and time.monotonic() < deadline:
        time.sleep(0.05)
    scattered = np.random.default_rng(0).permutation(pool).astype(np.int32)
    receivers = [
        kind("RECEIVER")(mgr=manager, bootstrap_addr=address, bootstrap_room=room)
        for room in range(requests)
    ]
    for receiver in receivers:
        receiver.init(0)
    started = time.perf_counter()
    sent_at = []
    for room, receiver in enumerate(receivers):
        sent_at.append(time.perf_counter())
        pages = scattered[room * pages_per_request : (room + 1) * pages_per_request]
        receiver.send_metadata(pages, aux_index=room)
    ended = _wait(receivers, 600)
    seconds = max(ended.values(), default=started) - started
    from sglang.srt.disaggregation.base.conn import KVPoll

    verified = 0
    for room, receiver in enumerate(receivers):
        if receiver.poll() != KVPoll.Success:
            continue
        pages = scattered[room * pages_per_request : (room + 1) * pages_per_request]
        same = all(
            np.array_equal(buffer[pages], content(room, index, pages_per_request))
            for index, buffer in enumerate(buffers)
        )
        verified += int(same and bool((aux[room] == room % 256).all()))
    nbytes = requests * pages_per_request * sum(args.kv_item_lens)
    results.put(
        {
            "role": "decode",
            "seconds": seconds,
            "bytes": nbytes,
            "verified": verified,
            "latencies_ms": sorted((ended[room] - sent_at[room]) * 1e3 for room in ended),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2048)
    options = parser.parse_args()
    pages_per_request = options.tokens // PAGE
    context = multiprocessing.get_context("spawn")
    ready, results = context.Event(), context.Queue()
    processes = [
        context.Process(target=target, args=(options.requests, pages_per_request, ready, results))
        for target in (run_prefill, run_decode)
    ]
    for process in processes:
        process.start()
    reports = {}
    for _ in processes:
        report = results.get(timeout=900)
        reports[report["role"]] = report
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
    decode = reports["decode"]
    latencies = decode["latencies_ms"]
    print(
        json.dumps(
            {
                "layer": "sglang 0.5.23 MooncakeKVManager",
                "requests": options.requests,
                "tokens": options.tokens,
                "bytes": decode["bytes"],
                "verified": decode["verified"],
                "gbps": round(decode["bytes"] / decode["seconds"] / 1e9, 3)
                if decode["seconds"]
                else 0,
                "p50_ms": round(float(np.quantile(latencies, 0.5)), 1) if latencies else None,
                "p99_ms": round(float(np.quantile(latencies, 0.99)), 1) if latencies else None,
                "prefill": reports["prefill"]["ended"],
            }
        )
    )


if __name__ == "__main__":
    main()
