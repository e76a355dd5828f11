"""How a serving engine uses kvbridge: one prefill rank and one decode rank, each in its own
process, move the KV cache of a few requests over NIXL, the way a scheduler would drive them.

    python examples/integrate.py                  # both ranks on this host
    python examples/integrate.py --requests 8

Each rank describes its KV memory once (`KVArgs`), makes one manager, and then one sender
(prefill) or receiver (decode) per request, called a room. Exits 1 if any byte differs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge import (
    DecodeManager,
    KVArgs,
    KVLayout,
    KVPoll,
    KVReceiver,
    KVSender,
    ManagerConfig,
    PrefillManager,
)

# A small Llama-like cache: 4 layers, 8 KV heads of 128, pages of 16 tokens.
LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 4, 8, 128, 16
PREFILL_PAGES, DECODE_PAGES, AUX_SLOTS, AUX_BYTES = 64, 96, 16, 64
PAGES_PER_REQUEST = 4
TIMEOUT_S = 30.0


def kv_arrays(pages: int, seed: int | None) -> list[npt.NDArray[np.float16]]:
    """One array per layer for K, then one per layer for V (SGLang's order), each
    [pages, page_size, kv_heads, head_dim]: random contents (prefill) or zeros (decode)."""
    rng = np.random.default_rng(seed)
    shape = (pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    return [
        rng.standard_normal(shape).astype(np.float16)
        if seed is not None
        else np.zeros(shape, np.float16)
        for _ in range(2 * LAYERS)
    ]


def describe(kv: list[npt.NDArray[Any]], aux: npt.NDArray[np.uint8]) -> KVArgs:
    # attn_tp_rank/size: this rank within its attention-TP group (both groups have 1 here).
    # The arrays must stay allocated while the manager runs; KVArgs keeps them referenced.
    return KVArgs.from_numpy(
        kv,
        kv_layout=KVLayout.MHA,
        total_kv_heads=KV_HEADS,
        attn_tp_rank=0,
        attn_tp_size=1,
        aux=[aux],
    )


def wait(room: KVSender | KVReceiver) -> KVPoll:
    """What a scheduler loop does between steps: poll until the room ends (or time runs out)."""
    deadline = time.monotonic() + TIMEOUT_S
    while room.poll() not in (KVPoll.Success, KVPoll.Failed) and time.monotonic() < deadline:
        time.sleep(0.001)
    return room.poll()


def prefill_rank(host: str, url_queue: Any, requests: int) -> None:
    kv, aux = kv_arrays(PREFILL_PAGES, seed=1), np.zeros((AUX_SLOTS, AUX_BYTES), np.uint8)
    # Rank 0 hosts the bootstrap service (port 0: any free one); `host` is what this rank
    # binds and advertises, so it must be an address decode can reach.
    config = ManagerConfig(host=host, run_bootstrap=True, bootstrap_port=0)
    manager = PrefillManager(describe(kv, aux), config)
    url_queue.put(manager.bootstrap_url)
    try:
        senders = {}
        for room in range(requests):
            pages = np.arange(room * PAGES_PER_REQUEST, (room + 1) * PAGES_PER_REQUEST)
            aux[room % AUX_SLOTS] = room  # e.g. the first generated token, for decode
            sender = manager.sender(room)
            sender.send(pages[:2])  # chunked prefill: pages as they are computed
            sender.send(pages[2:], last=True, aux_index=room % AUX_SLOTS)
            senders[room] = sender
        for room, sender in senders.items():
            if wait(sender) != KVPoll.Success:
                print(f"prefill: room {room} failed: {sender.failure_reason}", flush=True)
            sender.clear()  # the room's one cleanup call
    finally:
        manager.close()


def decode_rank(host: str, bootstrap_url: str, requests: int) -> int:
    kv, aux = kv_arrays(DECODE_PAGES, seed=None), np.zeros((AUX_SLOTS, AUX_BYTES), np.uint8)
    manager = DecodeManager(
        describe(kv, aux), ManagerConfig(host=host, bootstrap_url=bootstrap_url)
    )
    expected = kv_arrays(PREFILL_PAGES, seed=1)
    failures = 0
    try:
        receivers, placed = {}, {}
        free_pages = list(np.random.default_rng(7).permutation(DECODE_PAGES))
        for room in range(requests):
            pages = np.array([free_pages.pop() for _ in range(PAGES_PER_REQUEST)])  # scattered
            receiver = manager.receiver(room)  # finds the prefill group, registers once
            receiver.init(pages, aux_index=room % AUX_SLOTS)  # asks prefill to fill them
            receivers[room], placed[room] = receiver, pages
        for room, receiver in receivers.items():
            if wait(receiver) == KVPoll.Success:
                source = np.arange(room * PAGES_PER_REQUEST, (room + 1) * PAGES_PER_REQUEST)
                same = all(
                    np.array_equal(got[placed[room]], want[source])
                    for got, want in zip(kv, expected, strict=True)
                )
                same = same and bool((aux[room % AUX_SLOTS] == room).all())
                print(
                    f"decode: room {room}: {PAGES_PER_REQUEST} pages "
                    f"{'arrived intact' if same else 'DIFFER'}",
                    flush=True,
                )
                failures += not same
            else:
                print(f"decode: room {room} failed: {receiver.failure_reason}", flush=True)
                failures += 1
                while not receiver.pages_safe:  # no write can land in them any more
                    time.sleep(0.01)
            receiver.clear()  # now the pages can go back to the allocator
    finally:
        manager.close()
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address both ranks bind and advertise (this host's, on the "
        "network between them; 127.0.0.1 when both run here)",
    )
    options = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    url_queue = context.Queue()
    prefill = context.Process(target=prefill_rank, args=(options.host, url_queue, options.requests))
    prefill.start()
    try:
        failures = decode_rank(options.host, url_queue.get(timeout=TIMEOUT_S), options.requests)
    finally:
        prefill.join(TIMEOUT_S)
    print(f"{options.requests - failures} of {options.requests} requests moved intact")
    return 1 if failures or prefill.exitcode else 0


if __name__ == "__main__":
    sys.exit(main())
