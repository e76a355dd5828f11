"""Inputs for sglang's frame builders, drawn from a seeded random source.

Each case is (kind, inputs): the inputs of the builder of that kind in harness.BUILDERS. They
cover what a deployment varies: staging on and off, pointers with bit 63 set, DCP, MHA (two
KV buffers per layer) and MLA (one), state buffers, dummy ranks, empty page lists, decode
prefix hits, device indices, memory kinds, aborts with and without generations, pp ranks.
"""

from __future__ import annotations

import random
from typing import Any

HIGH_POINTER = 0xFFFF81AB54E01000  # bit 63 set: must survive as an unsigned value


def _pointer(rng: random.Random) -> int:
    base = HIGH_POINTER if rng.random() < 0.5 else 0x7F0000000000
    return base + rng.randrange(0, 1 << 32) * 4096


def _pointers(rng: random.Random, count: int) -> list[int]:
    return [_pointer(rng) for _ in range(count)]


def _nested(rng: random.Random, make: Any, max_groups: int = 3) -> list[list[int]]:
    return [
        [make() for _ in range(rng.randrange(0, 4))]
        for _ in range(rng.randrange(0, max_groups + 1))
    ]


def _kv_args(rng: random.Random) -> dict[str, Any]:
    layers = rng.randrange(0, 6)
    mla = rng.random() < 0.3
    buffers = layers if mla else 2 * layers
    item_len = rng.choice([576 * 2 * 16, 128 * 8 * 2 * 16, 4096, 1])
    item_lens = [item_len] * buffers
    if buffers and rng.random() < 0.3:  # draft buffers of another size
        item_lens[-1] = item_len // 2 or 1
    slots = rng.randrange(1, 2000)
    state_ptrs = _nested(rng, lambda: _pointer(rng))
    return {
        "kv_data_ptrs": _pointers(rng, buffers),
        "aux_data_ptrs": _pointers(rng, rng.randrange(0, 3)),
        "state_data_ptrs": state_ptrs,
        "state_item_lens": [[rng.randrange(1, 1 << 20) for _ in group] for group in state_ptrs],
        "state_data_lens": [[rng.randrange(1, 1 << 30) for _ in group] for group in state_ptrs],
        "state_dim_per_tensor": _nested(rng, lambda: rng.randrange(1, 4096)),
        "state_layer_ids": [[rng.randrange(0, 64) for _ in group] for group in state_ptrs],
        "kv_layer_ids": (
            [i % max(1, layers) for i in range(buffers)] if rng.random() < 0.7 else []
        ),
        "engine_rank": rng.randrange(0, 8),
        "kv_item_lens": item_lens,
        "kv_data_lens": [length * slots for length in item_lens],
        "kv_data_mem_kinds": [rng.choice(["VRAM", "DRAM"]) for _ in range(buffers)],
        "gpu_id": rng.randrange(0, 8),
    }


def _registration(rng: random.Random) -> dict[str, Any]:
    dcp_size = rng.choice([1, 1, 2, 4])
    staged = rng.random() < 0.5
    kv_args = _kv_args(rng)
    return {
        "kv_args": kv_args,
        "attn_tp_size": rng.choice([1, 2, 4, 8]),
        "dcp_size": dcp_size,
        "dcp_rank": rng.randrange(0, dcp_size),
        "staging": (_pointer(rng), rng.randrange(1, 1 << 34)) if staged else None,
        # sglang keeps the slot layer ids only with a registered ring.
        "slot_layer_ids": (
            [rng.randrange(0, 64) for _ in kv_args["kv_data_ptrs"]] if staged else []
        ),
    }


def mooncake_registration(rng: random.Random) -> dict[str, Any]:
    return {**_registration(rng), "session_id": f"10.0.0.{rng.randrange(1, 255)}:15001"}


def nixl_registration(rng: random.Random) -> dict[str, Any]:
    metadata = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    return {
        **_registration(rng),
        "agent_name": f"decode-{rng.randrange(100)}",
        "agent_metadata": metadata.hex(),
    }


def _transfer_info(rng: random.Random) -> dict[str, Any]:
    dummy = rng.random() < 0.25
    pages = rng.choice([0, 1, 7, 64])
    full_hit = not dummy and pages == 0
    return {
        "room": rng.randrange(0, 1 << 63),
        "required_dst_info_num": rng.randrange(1, 9),
        "kv_indices": [rng.randrange(0, 1 << 31) for _ in range(pages)],
        "aux_index": rng.randrange(0, 4096),
        "state_indices": (
            None if rng.random() < 0.3 else [[rng.randrange(-5, 1 << 20)] for _ in range(2)]
        ),
        "decode_prefix_len": (rng.choice([None, 0]) if not full_hit else rng.randrange(1, 1 << 20)),
        "is_dummy": dummy,
        "agent_name": f"decode-{rng.randrange(100)}",
    }


def mooncake_transfer_info(rng: random.Random) -> dict[str, Any]:
    inputs = _transfer_info(rng)
    if inputs["state_indices"] is None:
        inputs["state_indices"] = []
    if rng.random() < 0.3:
        inputs["device_kv_indices"] = [rng.randrange(0, 1 << 20) for _ in range(3)]
    return inputs


def nixl_transfer_info(rng: random.Random) -> dict[str, Any]:
    return _transfer_info(rng)


def _status(rng: random.Random, reasons: bool) -> dict[str, Any]:
    status = rng.randrange(0, 5)
    reason = rng.choice([None, "", "KV transfer failed", "décodé: timeout"]) if reasons else None
    return {
        "room": rng.randrange(0, 1 << 63),
        "status": status,
        "prefill_rank": rng.randrange(0, 16),
        "reason": reason,
    }


def abort(rng: random.Random) -> dict[str, Any]:
    shape = rng.randrange(3)
    inputs: dict[str, Any] = {"room": rng.randrange(0, 1 << 63)}
    if shape >= 1:
        inputs |= {
            "decode_ip": f"10.0.0.{rng.randrange(1, 255)}",
            "decode_port": rng.randrange(1, 65536),
        }
    if shape == 2:
        inputs["generation"] = rng.randrange(1, 1 << 31)
    return inputs


def abort_ack(rng: random.Random) -> dict[str, Any]:
    inputs: dict[str, Any] = {"room": rng.randrange(0, 1 << 63), "prefill_rank": rng.randrange(16)}
    if rng.random() < 0.7:
        inputs["generation"] = rng.randrange(1, 1 << 31)
    return inputs


def chunk_ready(rng: random.Random) -> dict[str, Any]:
    return {
        "room": rng.randrange(0, 1 << 63),
        "chunk_idx": rng.randrange(64),
        "page_start": rng.randrange(1 << 16),
        "num_pages": rng.randrange(1, 512),
        "writer_id": f"10.0.0.{rng.randrange(1, 255)}:15001",
        "prefill_rank": rng.randrange(16),
    }


def aux_data(rng: random.Random) -> dict[str, Any]:
    data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 96)))
    return {
        "room": rng.randrange(0, 1 << 63),
        "buffer_index": rng.randrange(4),
        "aux_index": rng.randrange(4096),
        "data": data.hex(),
    }


def staging_req(rng: random.Random) -> dict[str, Any]:
    return {
        "room": rng.randrange(0, 1 << 63),
        "session_id": f"decode-{rng.randrange(9)}",
        "total_pages": rng.randrange(1, 40),
        "page_size": 1,
        "chunked_prefill_size": rng.choice([8, 16, 64]),
        "pp_rank": rng.choice([None, 0, 1, 3]),
    }


def staging_rsp(rng: random.Random) -> dict[str, Any]:
    return {
        "room": rng.randrange(0, 1 << 63),
        "chunk_idx": rng.randrange(16),
        "session_id": f"10.0.0.{rng.randrange(1, 255)}:15001",
        "never_fits": rng.random() < 0.3,
        "offset": rng.randrange(1 << 30),
        "round": rng.randrange(64),
    }


def watermark(rng: random.Random) -> dict[str, Any]:
    return {
        "session_id": f"10.0.0.{rng.randrange(1, 255)}:15001",
        "round": rng.randrange(1 << 20),
        "tail": rng.randrange(1 << 34),
    }


def bootstrap(rng: random.Random) -> dict[str, Any]:
    return {"room": rng.randrange(0, 1 << 63), "decode_port": rng.randrange(1, 65536)}


GENERATORS = {
    "mooncake-registration": mooncake_registration,
    "mooncake-transfer-info": mooncake_transfer_info,
    "mooncake-status": lambda rng: _status(rng, reasons=False),
    "nixl-registration": nixl_registration,
    "nixl-transfer-info": nixl_transfer_info,
    "nixl-status": lambda rng: _status(rng, reasons=True),
    "abort": abort,
    "abort-ack": abort_ack,
    "legacy-abort-ack": lambda rng: {"room": rng.randrange(0, 1 << 63)},
    "chunk-ready": chunk_ready,
    "aux-data": aux_data,
    "staging-req": staging_req,
    "staging-rsp": staging_rsp,
    "watermark": watermark,
    "bootstrap": bootstrap,
}


def draw(seed: int, per_kind: int) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    return [(kind, make(rng)) for kind, make in GENERATORS.items() for _ in range(per_kind)]
