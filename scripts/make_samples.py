"""Regenerate the bundled sample messages in src/kvbridge/samples/ (after a layout change).

.venv/bin/python scripts/make_samples.py
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kvbridge.samples import sample_folder
from kvbridge.wire import NATIVE, KVLayout, Registration, TransferRequest
from kvbridge.wire.framefile import dump_json

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "helpers"))
from sglang_views import GOLDENS

DECODE_IP = "10.0.0.7"


def pointer(value: int) -> bytes:
    return struct.pack("Q", value)


def write(name: str, frames: list[bytes], profile: str, description: str) -> None:
    path = sample_folder() / f"{name}.json"
    path.write_text(dump_json(frames, profile=profile, description=description))


# One sample per message kind sglang 0.5.23 sends: frames its own builders produced, taken
# from the goldens (tests/goldens/sglang-0.5.23.json, made by tests/sglang_compat/make_goldens.py).
SGLANG_SAMPLES = {
    "mooncake-registration": ("sglang-mooncake", "registration (20 frames)", "staging"),
    "mooncake-transfer-info": ("sglang-mooncake", "TransferInfo (10 frames)", "pages"),
    "mooncake-status": ("sglang-mooncake", "transfer status (3 frames, no tag)", None),
    "nixl-registration": ("sglang-nixl", "registration (guard + 24 frames)", None),
    "nixl-transfer-info": ("sglang-nixl", "TransferInfo (guard + 10 frames)", "pages"),
    "nixl-status": ("sglang-nixl", "KV_STATUS", None),
    "abort": ("sglang-mooncake", "ABORT with a generation (both backends)", "generation"),
    "abort-ack": ("sglang-mooncake", "ABORT_ACK with a generation (both backends)", "generation"),
    "legacy-abort-ack": (
        "sglang-mooncake",
        "2-frame ABORT_ACK of a prefill without deferred release",
        None,
    ),
    "chunk-ready": ("sglang-mooncake", "CHUNK_READY (both backends)", None),
    "aux-data": ("sglang-mooncake", "AUX_DATA (Mooncake)", None),
    "staging-req": ("sglang-mooncake", "STAGING_REQ with a pp rank (both backends)", "pp"),
    "staging-rsp": ("sglang-mooncake", "STAGING_RSP 'never fits' (both backends)", "never"),
    "watermark": ("sglang-mooncake", "WATERMARK (both backends)", None),
    "bootstrap": ("sglang-mooncake", "BOOTSTRAP (Mooncake, prefill_complete policy)", None),
}


def _wanted(record: dict[str, Any], want: str | None) -> bool:
    inputs = record["inputs"]
    return {
        None: True,
        "staging": bool(inputs.get("staging")),
        "pages": bool(inputs.get("kv_indices")) and not inputs.get("is_dummy"),
        "generation": inputs.get("generation") is not None,
        "pp": inputs.get("pp_rank") is not None,
        "never": bool(inputs.get("never_fits")),
    }[want]


def sglang_samples() -> None:
    messages = json.loads(GOLDENS.read_text())["messages"]
    for kind, (profile, what, want) in SGLANG_SAMPLES.items():
        record = next(r for r in messages if r["kind"] == kind and _wanted(r, want))
        frames = [bytes.fromhex(frame) for frame in record["frames"]]
        write(f"sglang-{kind}", frames, profile, f"sglang 0.5.23's own {what}")
    # The seed-era registration (18 frames, before frames 18-19), as older peers send it.
    seed_era = [
        b"None",
        b"127.0.0.1",
        b"1234",
        b"session",
        pointer(0x1000),
        pointer(0x2000),
        b"",
        b"0",
        b"1",
        b"128",
        b"",
        b"",
        b"",
        b"",
        pointer(0x3000),
        b"4096",
        b"4",
        b"2",
    ]
    write(
        "sglang-mooncake-registration-seed-era",
        seed_era,
        "sglang-mooncake",
        "seed-era Mooncake registration (18 frames): staging ring 0x3000/4096, DCP 4, rank 2",
    )


def main() -> None:
    for stale in sample_folder().glob("sglang-*.json"):
        stale.unlink()
    sglang_samples()
    layers, page_bytes = 32, 16 * 4 * 128 * 2
    registration = Registration(
        peer_id="decode-0/tp1",
        host=DECODE_IP,
        control_port=17001,
        engine="nixl",
        engine_descriptor=b"\x00agent-metadata",
        tp_rank=1,
        attn_tp_size=2,
        dcp_rank=0,
        dcp_size=1,
        kv_layout=KVLayout.MHA,
        total_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        page_size=16,
        kv_layer_ids=list(range(layers)),
        kv_ptrs=[0x7F0000000000 + i * (1 << 30) for i in range(2 * layers)],
        kv_item_lens=[page_bytes] * (2 * layers),
        kv_lengths=[page_bytes * 4096] * (2 * layers),
        aux_ptrs=[0x7E0000000000],
        aux_item_lens=[64],
        aux_lengths=[64 * 4096],
        staging_base_ptr=0x7D0000000000,
        staging_total_size=256 << 20,
        capabilities=frozenset({"staging", "dcp"}),
    )
    write(
        "native-registration",
        NATIVE.encode(registration),
        "kvbridge/1",
        "kvbridge/1 registration of a Llama-3-8B-like decode rank (TP 2, 32 layers, page 16)",
    )
    transfer = TransferRequest(
        room=42,
        peer_id="decode-0/tp1",
        is_dummy=False,
        dst_kv_indices=np.arange(0, 512, 2, dtype=np.int32),
        dst_aux_index=7,
        dst_state_indices=[],
        required_dst_info_num=1,
        decode_prefix_len=0,
    )
    write(
        "native-transfer-request",
        NATIVE.encode(transfer),
        "kvbridge/1",
        "kvbridge/1 transfer request for room 42: 256 pages, aux slot 7, decode prefix 0 "
        "(present, not absent)",
    )


if __name__ == "__main__":
    main()
