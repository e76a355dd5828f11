"""The SGLang profiles' rules beyond what the goldens of sglang 0.5.23 show: older and newer
peers' shapes, sglang's dispatch per receiving side, and what is refused (with the frame and
field named) because sglang would misread it or no sender writes it."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from kvbridge.wire import (
    MOONCAKE,
    NIXL,
    KVPoll,
    Receiver,
    StagingResponse,
    TransferStatus,
    WireError,
    decode_frames,
    inspect_frames,
)
from kvbridge.wire.messages import ChunkReady, StagingRequest
from kvbridge.wire.sglang import common, mooncake, nixl


def Q(value: int) -> bytes:
    return struct.pack("<Q", value)


# The seed-era Mooncake registration (18 frames: staging at 14/15, DCP at 16/17).
SEED_ERA = [
    b"None",
    b"127.0.0.1",
    b"1234",
    b"session",
    Q(0x1000),
    Q(0x2000),
    b"",
    b"0",
    b"1",
    b"128",
    b"",
    b"",
    b"",
    b"",
    Q(0x3000),
    b"4096",
    b"4",
    b"2",
]


def test_seed_era_registration_decodes_with_sglangs_defaults_and_round_trips() -> None:
    info = mooncake.KVArgsRegisterInfo.from_zmq(SEED_ERA)
    assert (info.staging_base_ptr, info.staging_total_size) == (0x3000, 4096)
    assert (info.dst_dcp_size, info.dst_dcp_rank) == (4, 2)
    assert info.staging_slot_layer_ids == info.dst_kv_item_lens == []
    assert info.to_zmq() == SEED_ERA  # 18 frames back, not the 20 of 0.5.23
    assert "seed era" in " ".join(inspect_frames(SEED_ERA).notes)
    # Built from scratch, the same values take the 0.5.23 layout: 20 frames.
    fresh = dataclasses.replace(info)
    assert fresh.to_zmq() == [*SEED_ERA, b"", b""]


@pytest.mark.parametrize(
    ("count", "expected"),
    [(16, (0x3000, 4096, 1, 0)), (14, (0, 0, 1, 0)), (10, (0, 0, 1, 0))],
)
def test_shorter_registrations_take_defaults(count: int, expected: tuple[int, ...]) -> None:
    frames = SEED_ERA[:count]
    info = mooncake.KVArgsRegisterInfo.from_zmq(frames)
    got = (info.staging_base_ptr, info.staging_total_size, info.dst_dcp_size, info.dst_dcp_rank)
    assert got == expected
    assert info.to_zmq() == frames


def test_later_frames_of_a_newer_peer_are_ignored_and_kept() -> None:
    frames = [*SEED_ERA, b"", b"", b"frame of a later release"]
    info = MOONCAKE.decode(frames)
    assert isinstance(info, mooncake.KVArgsRegisterInfo)
    assert MOONCAKE.encode(info) == frames
    result = inspect_frames(frames)
    assert result.ok
    assert result.rows[-1].field == "(unknown, ignored)"


def test_empty_missing_and_explicit_defaults_round_trip_exactly() -> None:
    explicit = [*SEED_ERA[:14], Q(0), b"0", b"1", b"0", b"", b""]
    info = mooncake.KVArgsRegisterInfo.from_zmq(explicit)
    assert not info.staging_registered
    assert info.to_zmq() == explicit
    info.dst_dcp_size, info.dst_dcp_rank = 2, 1  # a changed field is encoded anew
    assert info.to_zmq()[16:18] == [b"2", b"1"]


def test_a_registration_is_room_none_as_sglang_dispatches_it() -> None:
    frames = [b"room", *SEED_ERA[1:]]
    with pytest.raises(WireError, match=r"frame 0 \(room\): a registration's room is 'None'"):
        mooncake.KVArgsRegisterInfo.from_zmq(frames)
    # Sent to prefill, sglang reads it as a TransferInfo (whose room must be a number).
    with pytest.raises(WireError, match=r"TransferInfo: frame 0 \(room\)"):
        MOONCAKE.decode(frames, receiver=Receiver.PREFILL)


def test_pointers_with_bit_63_set_survive_both_registrations() -> None:
    pointer = 0xFFFF81AB54E01000
    frames = list(SEED_ERA)
    frames[4] = Q(pointer) + Q(pointer + 4096)
    frames[14] = Q(pointer)
    info = mooncake.KVArgsRegisterInfo.from_zmq(frames)
    assert info.dst_kv_ptrs == [pointer, pointer + 4096]
    assert info.staging_base_ptr == pointer
    assert info.to_zmq() == frames
    nixl_info = nixl.KVArgsRegisterInfo(
        room="None",
        endpoint="h",
        dst_port=1,
        agent_name="a",
        agent_metadata=b"\x00",
        dst_kv_ptrs=[pointer],
        dst_aux_ptrs=[],
        dst_state_data_ptrs=[[pointer]],
        gpu_id=0,
        decode_tp_size=1,
        decode_tp_rank=0,
        dst_kv_item_len=1,
        staging_base_ptr=pointer,
        staging_total_size=1,
    )
    assert nixl_info.dst_kv_mem_kinds == ["VRAM"]
    assert nixl_info.dst_kv_item_lens == [1]
    decoded = NIXL.decode(NIXL.encode(nixl_info))
    assert decoded == nixl_info


def test_staging_rules() -> None:
    frames = list(SEED_ERA)
    frames[15] = b""
    with pytest.raises(WireError, match=r"frame 15 \(staging_total_size\)") as caught:
        mooncake.KVArgsRegisterInfo.from_zmq(frames)
    assert "0x3000" in str(caught.value)
    frames[14], frames[15] = b"", b"4096"  # a size without an address still counts
    assert mooncake.KVArgsRegisterInfo.from_zmq(frames).staging_registered
    # sglang reads a pointer frame of another length as 0; no sender writes one: refused.
    frames[14] = Q(0x3000)[:5]
    with pytest.raises(WireError, match=r"frame 14 \(staging_base_ptr\): expected exactly 8"):
        mooncake.KVArgsRegisterInfo.from_zmq(frames)


def test_only_canonical_ascii_integers() -> None:
    frames = list(SEED_ERA)
    frames[2] = b"01234"
    with pytest.raises(WireError, match=r"frame 2 \(dst_port\).*str\(int\)"):
        mooncake.KVArgsRegisterInfo.from_zmq(frames)


def _mooncake_transfer_info(kv: bytes, aux: bytes, *rest: bytes) -> list[bytes]:
    return [b"7", b"10.0.0.2", b"17000", b"10.0.0.2:15000", kv, aux, b"", b"2", *rest]


def test_mooncake_transfer_info_shapes() -> None:
    pages = np.array([5, 9, 11], dtype=np.int32).tobytes()
    real = mooncake.TransferInfo.from_zmq(_mooncake_transfer_info(pages, b"3", b"0", b""))
    assert (real.dst_aux_index, real.decode_prefix_len, real.is_dummy) == (3, 0, False)
    assert real.dst_device_kv_indices is None
    dummy = _mooncake_transfer_info(b"", b"", b"0", b"")
    assert mooncake.TransferInfo.from_zmq(dummy).is_dummy
    hit = mooncake.TransferInfo.from_zmq(_mooncake_transfer_info(b"", b"4", b"128", b""))
    assert (hit.is_dummy, hit.decode_prefix_len) == (False, 128)
    older = _mooncake_transfer_info(pages, b"3")  # 8 frames: no prefix, no device indices
    assert mooncake.TransferInfo.from_zmq(older).to_zmq() == older


def test_mooncake_transfer_info_refusals() -> None:
    pages = np.array([1], dtype=np.int32).tobytes()
    with pytest.raises(WireError, match=r"frame 5 \(dst_aux_index\)"):
        mooncake.TransferInfo.from_zmq(_mooncake_transfer_info(pages, b""))
    frames = _mooncake_transfer_info(b"", b"")
    frames[6] = struct.pack("<2I", 1, 4) + struct.pack("<i", 3)
    with pytest.raises(WireError, match=r"frame 6 \(dst_state_indices\): a dummy"):
        mooncake.TransferInfo.from_zmq(frames)


def _nixl_transfer_info(kv: bytes, aux: bytes, *rest: bytes) -> list[bytes]:
    # The order differs from Mooncake's: 5 aux index, 6 required_dst_info_num, 7 states.
    return [b"NixlMsgGuard", b"7", b"10.0.0.2", b"17000", b"agent-d0", kv, aux, b"2", *rest]


def test_nixl_dummy_flag_and_sglangs_inference() -> None:
    flagged = NIXL.decode(_nixl_transfer_info(b"", b"3", b"", b"512", b"1"))
    assert isinstance(flagged, nixl.TransferInfo)
    assert flagged.is_dummy  # the explicit frame 9 wins over the prefix rule
    inferred_hit = NIXL.decode(_nixl_transfer_info(b"", b"3", b"", b"512"))
    assert not inferred_hit.is_dummy  # empty pages, prefix > 0: a decode-side cache hit
    assert NIXL.decode(_nixl_transfer_info(b"", b"3", b"", b"0")).is_dummy
    frames = _nixl_transfer_info(b"", b"3")
    assert NIXL.encode(NIXL.decode(frames)) == frames


def test_nixl_transfer_info_needs_an_aux_index_and_its_guard() -> None:
    # sglang's int(msg[5]) raises on an empty frame (and kills its bootstrap thread).
    with pytest.raises(WireError, match=r"frame 5 \(dst_aux_index\): .*empty frame"):
        NIXL.decode(_nixl_transfer_info(b"", b""))
    with pytest.raises(WireError, match="frame 0 is neither the guard"):
        NIXL.decode(_nixl_transfer_info(b"", b"3")[1:])


def test_nixl_registration_item_lens_must_match_the_buffers() -> None:
    info = nixl.KVArgsRegisterInfo(
        room="None",
        endpoint="h",
        dst_port=1,
        agent_name="a",
        agent_metadata=b"",
        dst_kv_ptrs=[0x1000, 0x2000],
        dst_aux_ptrs=[],
        dst_state_data_ptrs=[],
        gpu_id=0,
        decode_tp_size=1,
        decode_tp_rank=0,
        dst_kv_item_len=64,
    )
    frames = NIXL.encode(info)
    assert frames[18:20] == [b"VRAM,VRAM", Q(64) + Q(64)]
    frames[19] = Q(64)
    with pytest.raises(WireError, match=r"frame 18 \(dst_kv_item_lens\): one per KV buffer"):
        NIXL.decode(frames)
    frames[18], frames[19] = b"", b""  # absent: sglang's defaults, and back as sent
    decoded = NIXL.decode(frames)
    assert decoded == info
    assert NIXL.encode(decoded) == frames
    frames[18] = b"VRAM,HBM"
    with pytest.raises(WireError, match=r"frame 17 \(dst_kv_mem_kinds\)"):
        NIXL.decode(frames)


def test_transfer_status_in_both_backends() -> None:
    status = TransferStatus(room=12, status=KVPoll.Failed, prefill_rank=1, reason="engine: rc -1")
    assert MOONCAKE.encode(status) == [b"12", b"0", b"1", b"engine: rc -1"]
    assert MOONCAKE.encode(TransferStatus(12, KVPoll.Success, 1)) == [b"12", b"4", b"1"]
    assert NIXL.encode(status) == [b"KV_STATUS", b"12", b"0", b"1", b"engine: rc -1"]
    assert NIXL.encode(TransferStatus(12, KVPoll.Success, 1))[-1] == b""
    assert decode_frames([b"KV_STATUS", b"12", b"4", b"1", b""]).status is KVPoll.Success


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([b"12", b"4"], r"frame 2 \(prefill_rank\): missing"),
        ([b"12", b"four", b"1"], r"frame 1 \(status\)"),
        ([b"12", b"9", b"1"], r"frame 1 \(status\): expected a KVPoll value, got 9"),
        ([b"-1", b"4", b"1"], r"frame 0 \(room\)"),
    ],
)
def test_malformed_transfer_status(frames: list[bytes], match: str) -> None:
    with pytest.raises(WireError, match=match):
        MOONCAKE.decode(frames, receiver=Receiver.DECODE)


def test_dispatch_follows_the_receiving_sides_listener() -> None:
    ready = [b"CHUNK_READY", b"1", b"0", b"0", b"4", b"w", b"0"]
    assert isinstance(MOONCAKE.decode(ready, receiver=Receiver.DECODE), ChunkReady)
    with pytest.raises(WireError, match="CHUNK_READY goes to decode, not to prefill"):
        MOONCAKE.decode(ready, receiver=Receiver.PREFILL)
    # Untagged: a status to decode, a TransferInfo to prefill.
    with pytest.raises(WireError, match=r"TransferInfo: frame 3 .*missing required frame"):
        MOONCAKE.decode([b"12", b"4", b"1"], receiver=Receiver.PREFILL)
    assert isinstance(NIXL.decode(ready), ChunkReady)  # the control tags need no guard


def test_abort_generations_and_their_acks() -> None:
    abort = MOONCAKE.decode([b"ABORT", b"9", b"10.0.0.2", b"17000", b"3"])
    assert isinstance(abort, common.AbortNotification)
    assert (abort.ack_address, abort.generation) == (("10.0.0.2", 17000), 3)
    ack = common.AbortAck.answering(abort, prefill_rank=2)
    assert MOONCAKE.encode(ack) == [b"ABORT_ACK", b"9", b"2", b"3"]
    bare = MOONCAKE.decode([b"ABORT", b"9"])
    assert isinstance(bare, common.AbortNotification)
    assert bare.ack_address is None
    legacy = MOONCAKE.decode([b"ABORT_ACK", b"9"])
    assert legacy == common.AbortAck(9)
    with pytest.raises(WireError, match=r"frame 3 \(decode_port\): a generation needs"):
        MOONCAKE.encode(common.AbortNotification(9, generation=4))


def test_staging_messages() -> None:
    never = [b"STAGING_RSP", b"7", b"0", b"-2", b"0", b"-1", b"10.0.0.2:15000"]
    response = MOONCAKE.decode(never)
    assert isinstance(response, StagingResponse)
    assert response.never_fits
    assert MOONCAKE.encode(response) == never
    request = MOONCAKE.decode([b"STAGING_REQ", b"7", b"1", b"16", b"agent", b"2"])
    assert isinstance(request, StagingRequest)
    assert request.requester_pp_rank == 2
    assert MOONCAKE.decode([b"STAGING_REQ", b"7", b"1", b"16", b"agent"]).requester_pp_rank is None


def test_aux_data_length_must_match() -> None:
    frames = [b"AUX_DATA", b"1", b"0", b"3", struct.pack(">I", 5), b"1234"]
    with pytest.raises(WireError, match=r"frame 4 \(data_length\): says 5 bytes but data has 4"):
        MOONCAKE.decode(frames)
    frames[4] = struct.pack(">I", 4)
    assert MOONCAKE.decode(frames) == common.AuxData.of(1, 0, 3, b"1234")
