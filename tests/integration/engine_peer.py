"""One side of a two-process engine test; JSON lines on stdin/stdout with the test.

python engine_peer.py ENGINE target  PAGES OUTFILE        receive, then save the KV arrays
python engine_peer.py ENGINE initiator PAGES SEED         write the planned pages
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from kv_cache import rank_cache

from kvbridge.cache import BufferSpec, plan_kv
from kvbridge.engines import MemoryRegion, create_engine
from kvbridge.engines.mooncake import MooncakeEngine

TIMEOUT_S = 60.0
GEOMETRY = dict(layer_ids=(0, 1, 2), page_size=4, total_kv_heads=2, head_dim=64)


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def listen() -> dict[str, object]:
    return json.loads(sys.stdin.readline())


def main() -> int:
    engine_name, role, pages = sys.argv[1], sys.argv[2], int(sys.argv[3])
    seed = int(sys.argv[4]) if role == "initiator" else None
    cache = rank_cache(num_pages=pages, seed=seed, **GEOMETRY)
    engine = create_engine(engine_name, f"{role}-{os.getpid()}")
    try:
        engine.register(cache.regions())
        say(
            endpoint=engine.endpoint().hex(),
            kv=[[b.ptr, b.length] for b in cache.args.kv_buffers],
            transport=engine.transport,
        )
        if role == "target":
            # Keep polling notifications (NIXL's progress is driven by the target too) until
            # the test says the initiator is done.
            messages: list[bytes] = []
            deadline = time.monotonic() + TIMEOUT_S
            while not select.select([sys.stdin], [], [], 0.001)[0]:
                messages += [message for _, message in engine.notifications()]
                if time.monotonic() > deadline:
                    say(ok=False, error="the test never said the write was done")
                    return 1
            messages += [message for _, message in engine.notifications()]
            np.savez(sys.argv[4], *cache.kv)
            unexpected = [message.hex() for message in messages if message != b"done"]
            say(ok=True, notified=b"done" in messages, unexpected=unexpected)
            return 0
        order = listen()
        peer_kv = order["peer_kv"]
        assert isinstance(peer_kv, list)
        page_bytes = cache.args.page_bytes
        peer_args = dataclasses.replace(
            cache.args, kv_buffers=tuple(BufferSpec(p, n, page_bytes) for p, n in peer_kv)
        )
        peer = engine.connect(
            bytes.fromhex(str(order["peer_endpoint"])),
            [MemoryRegion(p, n) for p, n in peer_kv],
        )
        plan = plan_kv(cache.args, peer_args, order["src_pages"], order["dst_pages"])
        # Engines that move writes on their own threads say when one ended (once per write,
        # however many batches it took); the others never do.
        write_ends: list[float] = []
        heard = threading.Event()
        engine.add_write_end_listener(lambda: (write_ends.append(time.monotonic()), heard.set()))
        started = time.perf_counter()
        engine.write(peer, plan, notify=b"done").wait(TIMEOUT_S)
        seconds = time.perf_counter() - started
        if engine.progresses_on_its_own:
            heard.wait(TIMEOUT_S)  # (the listener runs just after the write's state changed)
        # A write set up and dropped unstarted moves nothing (other pages into the same
        # places: the target's bytes would show it) and leaves no notification.
        other = plan_kv(cache.args, peer_args, order["src_pages"][::-1], order["dst_pages"])
        dropped = engine.prepare_write(peer, other, notify=b"dropped")
        dropped.release()
        dropped.release()
        batch = engine.batch_blocks if isinstance(engine, MooncakeEngine) else None
        say(
            ok=True,
            blocks=len(plan),
            bytes=plan.total_bytes,
            seconds=seconds,
            batch_blocks=batch,
            write_ends=len(write_ends),
        )
        return 0
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
