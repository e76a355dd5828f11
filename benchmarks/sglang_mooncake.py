"""sglang 0.5.23's own transfer layer on the Mooncake engine (or NIXL), on the demo's workload.

    .venv-sglang/bin/python benchmarks/sglang_mooncake.py [--requests N --tokens L]
        [--prefill sglang|kvbridge] [--decode sglang|kvbridge] [--engine mooncake|nixl]
    (run inside a network namespace of its own: Mooncake binds wildcard listeners;
    benchmarks/e2e.py does that)
    .venv/bin/python benchmarks/sglang_mooncake.py --compare 3 [--engine nixl]   (make bench)

`--decode kvbridge` puts a kvbridge `DecodeManager` (`peer_protocol="sglang"`) where sglang's
decode was, `--prefill kvbridge` a kvbridge `PrefillManager` where sglang's prefill was, on
identical work; `--compare ROUNDS` runs sglang → sglang, sglang → kvbridge and kvbridge →
sglang, the order turning from round to round, and writes bench-results/sglang_ENGINE.json.

A prefill and a decode process drive sglang's real `MooncakeKVManager`, `MooncakeKVSender`,
`MooncakeKVReceiver` and `MooncakeKVBootstrapServer`, built as sglang's schedulers build them
(`prefill.py::_init_kv_manager`; ../shared/reference/sglang-cpu.md) but without a model: the
KV cache is the demo's (Llama-3-8B: 32 layers of K and V, 8 heads × 128, bf16, pages of 16
tokens), prefill's pages hold known contents, decode's pages are scattered, and decode checks
every byte it received. Each request goes in two chunks, as the demo sends it; all requests
are issued at once. As in the demo, an untimed warm-up batch first moves every request once
into the same pages (rooms R..2R-1), so that Mooncake's connections and the first write into
every page are paid before the clock starts; decode's pages are then zeroed again (they stay
resident) and the timed batch (rooms 0..R-1) must write every byte anew. Both sides' memory is
written once when it is made, as sglang's pools are (`torch.zeros`): a page first touched
inside a transfer costs the kernel's fault and zeroing. Prints one JSON line: GB/s (decimal)
from the first receiver's metadata to the last room's success, and the per-request latencies.
Environment as sglang is run on these machines: SGLANG_HOST_IP=127.0.0.1,
MOONCAKE_PROTOCOL=tcp, MC_FORCE_TCP=1, and Mooncake's per-peer queue limits raised as sglang
deployments raise them (as kvbridge does). sglang's thread pool and queue settings change
nothing here: one decode rank's chunks all go to one queue and one worker, one batch in flight.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "sglang_compat"))
sys.path.insert(0, str(ROOT / "src"))  # kvbridge's decode, in sglang's environment
from sglang_side import (  # noqa: E402
    BACKENDS,
    Geometry,
    aux_content,
    sglang_kv_args,
    sglang_role,
)

from kvbridge.wire import KVPoll  # noqa: E402

GEOMETRY = Geometry()  # Llama-3-8B: 32 layers of K and V, 8 heads × 128, pages of 16 tokens
BOOTSTRAP_PORT = 18998
# How often the driver polls sglang's senders and receivers (a scheduler's step, about).
POLL_S = float(os.environ.get("POLL_S", "0.005"))


# kvbridge's KVPoll has sglang's values: it reads sglang's receivers' polls too.
FINISHED = (KVPoll.Success, KVPoll.Failed)
OpenRoom = Callable[[int, np.ndarray, int], Any]


def _wait(polls: list[Any], timeout_s: float) -> dict[int, float]:
    """Poll until every object reports Success or Failed; when each ended."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(ended) < len(polls) and time.monotonic() < deadline:
        for index, item in enumerate(polls):
            if index not in ended and item.poll() in FINISHED:
                ended[index] = time.perf_counter()
        time.sleep(POLL_S)
    return ended


def sglang_senders(
    requests: int, pages: int, engine: str
) -> tuple[Any, Any, Callable[[int], Any], Any]:
    """sglang's own prefill: its bootstrap server, manager and senders, as its prefill
    scheduler drives them."""
    sglang = sglang_role("prefill", BOOTSTRAP_PORT, engine)  # first: makes sglang importable
    kind = sglang["class"]
    buffers, aux = GEOMETRY.buffers(pages, requests)
    bootstrap = kind("BOOTSTRAP_SERVER")(host="127.0.0.1", port=BOOTSTRAP_PORT)
    manager = kind("MANAGER")(
        sglang_kv_args(kind, GEOMETRY, buffers, aux), sglang["mode"], sglang["server_args"], False
    )
    address = f"127.0.0.1:{BOOTSTRAP_PORT}"

    def sender(room: int) -> Any:
        return kind("SENDER")(mgr=manager, bootstrap_addr=address, bootstrap_room=room)

    return buffers, aux, sender, bootstrap


def kvbridge_senders(
    requests: int, pages: int, engine: str
) -> tuple[Any, Any, Callable[[int], Any], Any]:
    """kvbridge's prefill with `peer_protocol="sglang"`, its bootstrap serving sglang's
    decode."""
    from kvbridge import KVArgs, KVLayout, ManagerConfig, PrefillManager

    buffers, aux = GEOMETRY.buffers(pages, requests)
    args = KVArgs.from_numpy(
        buffers, kv_layout=KVLayout.MHA, total_kv_heads=GEOMETRY.heads, aux=[aux]
    )
    config = ManagerConfig(
        engine=engine,
        peer_protocol="sglang",
        run_bootstrap=True,
        bootstrap_port=BOOTSTRAP_PORT,
        request_timeout_s=600.0,
        secret=None,
    )
    manager = PrefillManager(args, config)
    return buffers, aux, manager.sender, manager


PREFILL_LAYERS = {"sglang": sglang_senders, "kvbridge": kvbridge_senders}


def run_prefill(
    requests: int,
    pages_per_request: int,
    ready: Any,
    results: Any,
    layer: str = "sglang",
    engine: str = "mooncake",
) -> None:
    buffers, aux, new_sender, keep = PREFILL_LAYERS[layer](
        requests, requests * pages_per_request, engine
    )
    for room in range(requests):
        pages = slice(room * pages_per_request, (room + 1) * pages_per_request)
        for index, buffer in enumerate(buffers):
            buffer[pages] = GEOMETRY.content(room, index, pages_per_request)
        aux[room] = aux_content(room)
    ready.set()
    # Rooms 0..R-1 are the timed batch, R..2R-1 the warm-up; room r sends slot r % R.
    senders = [new_sender(room) for room in range(2 * requests)]
    started: set[int] = set()
    deadline = time.monotonic() + 600
    while len(started) < len(senders) and time.monotonic() < deadline:
        for room, sender in enumerate(senders):
            if room not in started and sender.poll() == KVPoll.WaitingForInput:
                started.add(room)
                slot = room % requests
                pages = np.arange(
                    slot * pages_per_request, (slot + 1) * pages_per_request, dtype=np.int32
                )
                send_chunks(sender, layer, pages, pages_per_request, slot)
        time.sleep(POLL_S)
    ended = _wait(senders, 600)
    outcome = {room: str(sender.poll()) for room, sender in enumerate(senders)}
    results.put({"role": "prefill", "ended": len(ended), "outcome": outcome})
    time.sleep(3)  # decode reads the last statuses before the sockets go
    if layer == "kvbridge":
        keep.close()
    # sglang's NIXL listener thread is not a daemon: nothing else ends this process.
    results.close()
    results.join_thread()
    os._exit(0)


def send_chunks(sender: Any, layer: str, pages: np.ndarray, count: int, slot: int) -> None:
    """The demo's two chunks, in each layer's own calls (sglang: `init` with the page count
    and aux slot, then `send` per chunk; kvbridge: the last chunk carries the aux slot)."""
    chunks = np.array_split(pages, 2)
    if layer == "sglang":
        sender.init(count, aux_index=slot)
        for chunk in chunks:
            sender.send(chunk)
        return
    sender.send(chunks[0])
    sender.send(chunks[1], last=True, aux_index=slot)


def sglang_receivers(
    requests: int, pages: int, ready: Any, engine: str
) -> tuple[Any, Any, OpenRoom]:
    """sglang's own decode: its manager and receivers, as its decode scheduler drives them."""
    sglang = sglang_role("decode", BOOTSTRAP_PORT, engine)
    kind = sglang["class"]
    buffers, aux = GEOMETRY.buffers(pages, requests)
    manager = kind("MANAGER")(
        sglang_kv_args(kind, GEOMETRY, buffers, aux), sglang["mode"], sglang["server_args"], False
    )
    ready.wait(120)
    address = f"127.0.0.1:{BOOTSTRAP_PORT}"
    deadline = time.monotonic() + 60
    while not manager.try_ensure_parallel_info(address) and time.monotonic() < deadline:
        time.sleep(0.05)

    def open_room(room: int, dst_pages: np.ndarray, slot: int) -> Any:
        receiver = kind("RECEIVER")(mgr=manager, bootstrap_addr=address, bootstrap_room=room)
        receiver.init(0)
        receiver.send_metadata(dst_pages, aux_index=slot)
        return receiver

    return buffers, aux, open_room


def kvbridge_receivers(
    requests: int, pages: int, ready: Any, engine: str
) -> tuple[Any, Any, OpenRoom]:
    """kvbridge's decode with `peer_protocol="sglang"`, asking sglang's prefill."""
    from kvbridge import DecodeManager, KVArgs, KVLayout, ManagerConfig

    buffers, aux = GEOMETRY.buffers(pages, requests)
    args = KVArgs.from_numpy(
        buffers, kv_layout=KVLayout.MHA, total_kv_heads=GEOMETRY.heads, aux=[aux]
    )
    ready.wait(120)
    config = ManagerConfig(
        engine=engine,
        peer_protocol="sglang",
        bootstrap_url=f"127.0.0.1:{BOOTSTRAP_PORT}",
        bootstrap_timeout_s=60.0,
        secret=None,
    )
    manager = DecodeManager(args, config)
    manager.sglang_group(config.bootstrap_url or "")  # looked up before the clock, as sglang's

    def open_room(room: int, dst_pages: np.ndarray, slot: int) -> Any:
        receiver = manager.receiver(room)
        receiver.init(dst_pages, aux_index=slot)
        return receiver

    return buffers, aux, open_room


DECODE_LAYERS = {"sglang": sglang_receivers, "kvbridge": kvbridge_receivers}


def run_decode(
    requests: int,
    pages_per_request: int,
    ready: Any,
    results: Any,
    layer: str = "sglang",
    engine: str = "mooncake",
) -> None:
    pool = requests * pages_per_request
    buffers, aux, open_room = DECODE_LAYERS[layer](requests, pool, ready, engine)
    scattered = np.random.default_rng(0).permutation(pool).astype(np.int32)

    def pages_of(slot: int) -> np.ndarray:
        return scattered[slot * pages_per_request : (slot + 1) * pages_per_request]

    def batch(rooms: range) -> tuple[list[Any], float, list[float], dict[int, float]]:
        """Receive `rooms` (room r into slot r % R): receivers, start, send times, ends."""
        started = time.perf_counter()
        receivers, sent_at = [], []
        for slot, room in enumerate(rooms):
            sent_at.append(time.perf_counter())
            receivers.append(open_room(room, pages_of(slot), slot))
        return receivers, started, sent_at, _wait(receivers, 600)

    def verified(receivers: list[Any]) -> int:
        count = 0
        for slot, receiver in enumerate(receivers):
            if receiver.poll() != KVPoll.Success:
                continue
            same = all(
                np.array_equal(
                    buffer[pages_of(slot)], GEOMETRY.content(slot, index, pages_per_request)
                )
                for index, buffer in enumerate(buffers)
            )
            count += int(same and bool((aux[slot] == aux_content(slot)).all()))
        return count

    warmup, _, _, _ = batch(range(requests, 2 * requests))
    warmup_verified = verified(warmup)
    for array in (*buffers, aux):
        array.fill(0)  # the timed batch must write every byte again
    receivers, started, sent_at, ended = batch(range(requests))
    seconds = max(ended.values(), default=started) - started
    nbytes = requests * pages_per_request * GEOMETRY.page_bytes * len(buffers)
    results.put(
        {
            "role": "decode",
            "seconds": seconds,
            "bytes": nbytes,
            "verified": verified(receivers),
            "warmup_verified": warmup_verified,
            "latencies_ms": sorted((ended[room] - sent_at[room]) * 1e3 for room in ended),
        }
    )


SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


# prefill → decode pairs; the first is sglang's own, each other is held against it.
PAIRS = (("sglang", "sglang"), ("sglang", "kvbridge"), ("kvbridge", "sglang"))


def label(prefill: str, decode: str) -> str:
    return f"{prefill} → {decode}"


def compare(requests: int, tokens: int, rounds: int, engine: str = "mooncake") -> None:
    """sglang → sglang, sglang → kvbridge and kvbridge → sglang on identical work, the order
    turning from round to round, each run in a network namespace of its own; writes
    bench-results/sglang_mooncake.json."""
    from kvbridge_tools.bench import json_in_private_netns
    from kvbridge_tools.bench_results import save

    runs: dict[str, list[dict[str, Any]]] = {label(*pair): [] for pair in PAIRS}
    for index in range(rounds):
        order = PAIRS[index % len(PAIRS) :] + PAIRS[: index % len(PAIRS)]
        for prefill, decode in order:
            arguments = [
                __file__,
                *("--requests", str(requests), "--tokens", str(tokens), "--engine", engine),
            ]
            row = json_in_private_netns(
                [*arguments, "--prefill", prefill, "--decode", decode], python=str(SGLANG_PYTHON)
            )
            runs[label(prefill, decode)].append(row)
            print(
                f"round {index + 1}, {label(prefill, decode)}: {row['gbps']} GB/s, "
                f"p50 {row['p50_ms']} ms, {row['verified']}/{requests} verified",
                flush=True,
            )
    summary = {
        name: {
            "gbps": statistics.median(row["gbps"] for row in rows),
            "p50_ms": statistics.median(row["p50_ms"] for row in rows),
            "p99_ms": statistics.median(row["p99_ms"] for row in rows),
            "verified": min(row["verified"] for row in rows),
        }
        for name, rows in runs.items()
    }
    own = runs[label(*PAIRS[0])]
    against: dict[str, dict[str, Any]] = {}
    for pair in PAIRS[1:]:
        ratios = [
            ours["gbps"] / theirs["gbps"]
            for ours, theirs in zip(runs[label(*pair)], own, strict=True)
        ]
        against[label(*pair)] = {
            "ratio": round(statistics.median(ratios), 3),
            "range": [round(min(ratios), 3), round(max(ratios), 3)],
        }
        print(
            f"{label(*pair)} against {label(*PAIRS[0])}: {against[label(*pair)]['ratio']}× "
            f"({min(ratios):.3f}-{max(ratios):.3f}, {rounds} rounds)"
        )
    document = {
        "engine": engine,
        "requests": requests,
        "tokens": tokens,
        "rounds": rounds,
        "summary": summary,
        "against_sglang": against,
        "runs": runs,
    }
    print(f"wrote {save(f'sglang_{engine}', document)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument(
        "--engine",
        choices=BACKENDS,
        default="mooncake",
        help="sglang's transfer backend and kvbridge's engine (results: sglang_ENGINE.json)",
    )
    parser.add_argument(
        "--prefill",
        choices=sorted(PREFILL_LAYERS),
        default="sglang",
        help="the prefill side: sglang's own, or kvbridge's with peer_protocol sglang",
    )
    parser.add_argument(
        "--decode",
        choices=sorted(DECODE_LAYERS),
        default="sglang",
        help="the decode side: sglang's own, or kvbridge's with peer_protocol sglang",
    )
    parser.add_argument(
        "--compare",
        type=int,
        metavar="ROUNDS",
        help="run sglang → sglang, sglang → kvbridge and kvbridge → sglang ROUNDS times each, "
        "the order turning (each in a network namespace of its own; run from kvbridge's "
        "environment, as root)",
    )
    options = parser.parse_args()
    if options.compare:
        compare(options.requests, options.tokens, options.compare, options.engine)
        return
    pages_per_request = options.tokens // GEOMETRY.page
    context = multiprocessing.get_context("spawn")
    ready, results = context.Event(), context.Queue()
    processes = [
        context.Process(
            target=run_prefill,
            args=(
                options.requests,
                pages_per_request,
                ready,
                results,
                options.prefill,
                options.engine,
            ),
        ),
        context.Process(
            target=run_decode,
            args=(
                options.requests,
                pages_per_request,
                ready,
                results,
                options.decode,
                options.engine,
            ),
        ),
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
                "layer": f"sglang 0.5.23 over {options.engine}",
                "prefill": options.prefill,
                "decode": options.decode,
                "requests": options.requests,
                "tokens": options.tokens,
                "bytes": decode["bytes"],
                "verified": decode["verified"],
                "warmup_verified": decode["warmup_verified"],
                "gbps": round(decode["bytes"] / decode["seconds"] / 1e9, 3)
                if decode["seconds"]
                else 0,
                "p50_ms": round(float(np.quantile(latencies, 0.5)), 1) if latencies else None,
                "p99_ms": round(float(np.quantile(latencies, 0.99)), 1) if latencies else None,
                "prefill_ended": reports["prefill"]["ended"],
            }
        )
    )


if __name__ == "__main__":
    main()
