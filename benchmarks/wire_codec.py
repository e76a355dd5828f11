"""Encode/decode cost of the messages on the per-request path, per profile.

    .venv/bin/python benchmarks/wire_codec.py

Prints microseconds per call (median of repeats) for a transfer request of a 128k-token
request at page size 1 (128k page indices) and a registration of a 61-layer MHA rank.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from kvbridge.wire import NATIVE, KVLayout, Layout, Message, Registration, TransferRequest
from kvbridge.wire.sglang import mooncake, nixl
from kvbridge_tools.bench_results import save

PAGES = 128 * 1024
LAYERS = 61


def per_call_us(function: Callable[[], object], calls: int = 200, repeats: int = 7) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            function()
        samples.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    indices = np.arange(PAGES, dtype=np.int32)
    registration = Registration(
        peer_id="decode-0",
        host="10.0.0.2",
        control_port=17000,
        engine="nixl",
        engine_descriptor=b"md" * 512,
        tp_rank=0,
        attn_tp_size=1,
        dcp_rank=0,
        dcp_size=1,
        kv_layout=KVLayout.MHA,
        total_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        page_size=1,
        kv_layer_ids=list(range(LAYERS)),
        kv_ptrs=[0x7F0000000000 + i * 2**30 for i in range(2 * LAYERS)],
        kv_item_lens=[2048] * (2 * LAYERS),
        kv_lengths=[2048 * 4096] * (2 * LAYERS),
        aux_ptrs=[0x7E0000000000],
        aux_item_lens=[64],
        aux_lengths=[64 * 4096],
    )
    cases: list[tuple[str, Message, Layout[Any] | None]] = [
        ("kvbridge/1 TransferRequest", TransferRequest(7, "d0", False, indices, 3, [], 1), None),
        (
            "sglang-mooncake TransferInfo",
            mooncake.TransferInfo(7, "10.0.0.2", 17000, "10.0.0.2:15000", indices, 3, [], 1),
            mooncake.TransferInfo.LAYOUT,
        ),
        (
            "sglang-nixl TransferInfo",
            nixl.TransferInfo(7, "10.0.0.2", 17000, "agent", indices, 3, 1),
            nixl.TransferInfo.LAYOUT,
        ),
        ("kvbridge/1 Registration", registration, None),
    ]
    print(f"{'message':32} {'encode µs':>10} {'decode µs':>10} {'bytes':>9}")
    rows: list[dict[str, object]] = []
    for name, message, layout in cases:
        encode = NATIVE.encode if layout is None else layout.encode
        decode = NATIVE.decode if layout is None else layout.decode
        frames = encode(message)
        assert decode(frames) == message
        size = sum(len(frame) for frame in frames)
        encode_us = per_call_us(partial(encode, message))
        decode_us = per_call_us(partial(decode, frames))
        print(f"{name:32} {encode_us:10.1f} {decode_us:10.1f} {size:9d}")
        rows.append(
            {
                "message": name,
                "encode_us": round(encode_us, 1),
                "decode_us": round(decode_us, 1),
                "bytes": size,
            }
        )
    print(f"wrote {save('wire_codec', {'pages': PAGES, 'rows': rows})}")


if __name__ == "__main__":
    main()
