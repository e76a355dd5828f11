"""Regenerate the bundled sample messages in src/kvbridge/samples/ (after a layout change).

.venv/bin/python scripts/make_samples.py
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from kvbridge.samples import sample_folder
from kvbridge.wire import NATIVE, KVLayout, Registration, TransferRequest
from kvbridge.wire.framefile import dump_json
from kvbridge.wire.sglang import mooncake, nixl

DECODE_IP = "10.0.0.7"
SESSION = "10.0.0.7:15001"


def pointer(value: int) -> bytes:
    return struct.pack("Q", value)


def write(name: str, frames: list[bytes], profile: str, description: str) -> None:
    path = sample_folder() / f"{name}.json"
    path.write_text(dump_json(frames, profile=profile, description=description))


def main() -> None:
    # The SGLang unit test's registration message, from shared/reference/sglang-wire.md.
    reference = [
        b"room", b"127.0.0.1", b"1234", b"session", pointer(0x1000), pointer(0x2000), b"",
        b"0", b"1", b"128", b"", b"", b"", b"", pointer(0x3000), b"4096", b"4", b"2",
    ]  # fmt: skip
    write(
        "sglang-mooncake-registration",
        reference,
        "sglang-mooncake",
        "SGLang's unit-test registration: staging ring 0x3000/4096 bytes, DCP 4, rank 2",
    )
    request: dict[str, Any] = dict(
        room=42, endpoint=DECODE_IP, dst_port=17001, mooncake_session_id=SESSION,
        dst_state_indices=[], required_dst_info_num=2,
    )  # fmt: skip
    real = mooncake.TransferInfo(
        **request,
        dst_kv_indices=np.arange(100, 164, dtype=np.int32),
        dst_aux_index=3,
        decode_prefix_len=0,
    )
    write(
        "sglang-mooncake-transfer-info",
        real.to_zmq(),
        "sglang-mooncake",
        "Mooncake TransferInfo for room 42: 64 destination pages, aux slot 3",
    )
    dummy = mooncake.TransferInfo(
        **request, dst_kv_indices=np.array([], dtype=np.int32), dst_aux_index=None
    )
    write(
        "sglang-mooncake-dummy-transfer-info",
        dummy.to_zmq(),
        "sglang-mooncake",
        "Mooncake dummy TransferInfo (frames 4 and 5 empty): this prefill rank only reports "
        "completion",
    )
    nixl_registration = nixl.KVArgsRegisterInfo(
        room="None", endpoint=DECODE_IP, dst_port=17001, agent_name="decode-0",
        agent_metadata=b"\x00NIXL-agent-metadata\xff",
        dst_kv_ptrs=[0xFFFF81AB54E01000 + i * 0x100000 for i in range(4)],
        dst_aux_ptrs=[0x7F0000000000], dst_state_data_ptrs=[], gpu_id=0, decode_tp_size=4,
        decode_tp_rank=1, dst_kv_item_len=4096, staging_base_ptr=0x7F1000000000,
        staging_total_size=64 << 20,
    )  # fmt: skip
    write(
        "sglang-nixl-registration",
        nixl.add_guard(nixl_registration.to_zmq()),
        "sglang-nixl",
        "NIXL registration with its guard frame; pointers with bit 63 set; a 64 MiB staging ring",
    )
    layers, page_bytes = 32, 16 * 4 * 128 * 2
    registration = Registration(
        peer_id="decode-0/tp1", host=DECODE_IP, control_port=17001, engine="nixl",
        engine_descriptor=b"\x00agent-metadata", tp_rank=1, attn_tp_size=2, dcp_rank=0,
        dcp_size=1, kv_layout=KVLayout.MHA, total_kv_heads=8, head_dim=128, dtype="bfloat16",
        page_size=16, kv_layer_ids=list(range(layers)),
        kv_ptrs=[0x7F0000000000 + i * (1 << 30) for i in range(2 * layers)],
        kv_item_lens=[page_bytes] * (2 * layers), kv_lengths=[page_bytes * 4096] * (2 * layers),
        aux_ptrs=[0x7E0000000000], aux_item_lens=[64], aux_lengths=[64 * 4096],
        staging_base_ptr=0x7D0000000000, staging_total_size=256 << 20,
        capabilities=frozenset({"staging", "dcp"}),
    )  # fmt: skip
    write(
        "native-registration",
        NATIVE.encode(registration),
        "kvbridge/1",
        "kvbridge/1 registration of a Llama-3-8B-like decode rank (TP 2, 32 layers, page 16)",
    )
    transfer = TransferRequest(
        room=42, peer_id="decode-0/tp1", is_dummy=False,
        dst_kv_indices=np.arange(0, 512, 2, dtype=np.int32), dst_aux_index=7,
        dst_state_indices=[], required_dst_info_num=1, decode_prefix_len=0,
    )  # fmt: skip
    write(
        "native-transfer-request",
        NATIVE.encode(transfer),
        "kvbridge/1",
        "kvbridge/1 transfer request for room 42: 256 pages, aux slot 7, decode prefix 0 "
        "(present, not absent)",
    )


if __name__ == "__main__":
    main()
