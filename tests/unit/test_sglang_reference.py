"""The SGLang profiles decode the layouts of shared/reference/sglang-wire.md as documented."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvbridge.wire import MOONCAKE, KVPoll, StagingResponse, TransferStatus, WireError
from kvbridge.wire.sglang import mooncake, nixl


def Q(value: int) -> bytes:
    return struct.pack("Q", value)


# The SGLang unit test's registration message, verbatim from the reference.
REFERENCE_REGISTRATION = [
    b"room", b"127.0.0.1", b"1234", b"session", Q(0x1000), Q(0x2000), b"", b"0", b"1", b"128",
    b"", b"", b"", b"", Q(0x3000), b"4096", b"4", b"2",
]  # fmt: skip


def test_reference_registration_decodes_to_documented_values() -> None:
    info = mooncake.KVArgsRegisterInfo.from_zmq(REFERENCE_REGISTRATION)
    assert info.room == "room"
    assert info.endpoint == "127.0.0.1"
    assert info.dst_port == 1234
    assert info.mooncake_session_id == "session"
    assert info.dst_kv_ptrs == [0x1000]
    assert info.dst_aux_ptrs == [0x2000]
    assert info.dst_state_data_ptrs == []
    assert (info.dst_tp_rank, info.dst_attn_tp_size, info.dst_kv_item_len) == (0, 1, 128)
    assert info.dst_kv_layer_ids == []
    assert info.staging_base_ptr == 0x3000
    assert info.staging_total_size == 4096
    assert info.staging_registered
    assert (info.dst_dcp_size, info.dst_dcp_rank) == (4, 2)
    assert info.to_zmq() == REFERENCE_REGISTRATION


def test_frames_14_15_are_empty_placeholders_without_staging() -> None:
    frames = [*REFERENCE_REGISTRATION[:14], b"", b"", b"1", b"0"]
    info = mooncake.KVArgsRegisterInfo.from_zmq(frames)
    assert (info.staging_base_ptr, info.staging_total_size) == (0, 0)
    assert not info.staging_registered
    assert info.to_zmq() == frames


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (16, (0x3000, 4096, 1, 0)),  # older peer without DCP frames
        (14, (0, 0, 1, 0)),  # older peer without staging frames
        (10, (0, 0, 1, 0)),  # only the required frames
    ],
)
def test_missing_trailing_frames_take_defaults(count: int, expected: tuple[int, ...]) -> None:
    info = mooncake.KVArgsRegisterInfo.from_zmq(REFERENCE_REGISTRATION[:count])
    got = (info.staging_base_ptr, info.staging_total_size, info.dst_dcp_size, info.dst_dcp_rank)
    assert got == expected
    assert info.dst_state_item_lens == info.dst_state_layer_ids == []


def test_missing_required_frame_is_named() -> None:
    with pytest.raises(WireError, match=r"frame 9 \(dst_kv_item_len\): missing required frame"):
        mooncake.KVArgsRegisterInfo.from_zmq(REFERENCE_REGISTRATION[:9])


def test_pointer_with_bit_63_set_survives() -> None:
    pointer = 0xFFFF81AB54E01000
    frames = list(REFERENCE_REGISTRATION)
    frames[4] = Q(pointer) + Q(pointer + 4096)
    frames[14] = Q(pointer)
    info = mooncake.KVArgsRegisterInfo.from_zmq(frames)
    assert info.dst_kv_ptrs == [pointer, pointer + 4096]
    assert info.staging_base_ptr == pointer
    assert info.to_zmq() == frames

    nixl_info = nixl.KVArgsRegisterInfo(
        room="None", endpoint="h", dst_port=1, agent_name="a", agent_metadata=b"\x00",
        dst_kv_ptrs=[pointer], dst_aux_ptrs=[], dst_state_data_ptrs=[[pointer]], gpu_id=0,
        decode_tp_size=1, decode_tp_rank=0, dst_kv_item_len=1,
        staging_base_ptr=pointer, staging_total_size=1,
    )  # fmt: skip
    decoded = nixl.KVArgsRegisterInfo.from_zmq(nixl_info.to_zmq())
    assert decoded.dst_kv_ptrs == [pointer]
    assert decoded.dst_state_data_ptrs == [[pointer]]
    assert decoded.staging_base_ptr == pointer


def test_staging_pointer_without_size_is_rejected() -> None:
    frames = list(REFERENCE_REGISTRATION)
    frames[15] = b""
    with pytest.raises(WireError, match=r"frame 15 \(staging_total_size\)") as caught:
        mooncake.KVArgsRegisterInfo.from_zmq(frames)
    assert "0x3000" in str(caught.value)
    frames[15] = b"0"
    with pytest.raises(WireError, match="staging ring needs a size"):
        mooncake.KVArgsRegisterInfo.from_zmq(frames)


def test_staging_size_without_pointer_counts_as_registered() -> None:
    frames = list(REFERENCE_REGISTRATION)
    frames[14] = b""
    assert mooncake.KVArgsRegisterInfo.from_zmq(frames).staging_registered


def test_staging_pointer_of_wrong_length_is_refused() -> None:
    frames = list(REFERENCE_REGISTRATION)
    frames[14] = Q(0x3000)[:5]
    with pytest.raises(WireError, match=r"frame 14 \(staging_base_ptr\): expected exactly 8 bytes"):
        mooncake.KVArgsRegisterInfo.from_zmq(frames)


def test_nested_list_frames() -> None:
    frames = list(REFERENCE_REGISTRATION)
    frames[6] = struct.pack("<3I", 2, 8, 16) + struct.pack("<3Q", 1, 2, 3)
    frames[10] = struct.pack("<2I", 1, 0)  # [[]]
    info = mooncake.KVArgsRegisterInfo.from_zmq(frames)
    assert info.dst_state_data_ptrs == [[1], [2, 3]]
    assert info.dst_state_item_lens == [[]]
    assert info.to_zmq() == frames


def _mooncake_transfer_info(kv: bytes, aux: bytes, *extra: bytes) -> list[bytes]:
    return [b"7", b"10.0.0.2", b"17000", b"10.0.0.2:15000", kv, aux, b"", b"2", *extra]


def test_mooncake_transfer_info_real_and_dummy() -> None:
    indices = np.array([5, 9, 11], dtype=np.int32)
    real = mooncake.TransferInfo.from_zmq(_mooncake_transfer_info(indices.tobytes(), b"3"))
    assert real.room == 7
    assert real.dst_kv_indices.tolist() == [5, 9, 11]
    assert real.dst_aux_index == 3
    assert real.required_dst_info_num == 2
    assert real.decode_prefix_len is None
    assert not real.is_dummy

    dummy = mooncake.TransferInfo.from_zmq(_mooncake_transfer_info(b"", b""))
    assert dummy.is_dummy
    assert dummy.dst_aux_index is None
    assert len(dummy.dst_kv_indices) == 0
    assert dummy.to_zmq() == _mooncake_transfer_info(b"", b"")

    with_prefix = mooncake.TransferInfo.from_zmq(_mooncake_transfer_info(b"", b"4", b"128"))
    assert with_prefix.decode_prefix_len == 128
    assert not with_prefix.is_dummy  # an aux index means a real (cache-hit) request


def test_mooncake_pages_without_aux_index_are_refused() -> None:
    frames = _mooncake_transfer_info(np.array([1], dtype=np.int32).tobytes(), b"")
    with pytest.raises(WireError, match=r"frame 5 \(dst_aux_index\)"):
        mooncake.TransferInfo.from_zmq(frames)


def test_mooncake_decode_prefix_len_empty_frame_is_refused() -> None:
    with pytest.raises(WireError, match=r"frame 8 \(decode_prefix_len\).*empty frame"):
        mooncake.TransferInfo.from_zmq(_mooncake_transfer_info(b"", b"", b""))


def _nixl_transfer_info(kv: bytes, aux: bytes, *extra: bytes) -> list[bytes]:
    # Note the order: 5 aux index, 6 required_dst_info_num, 7 state indices, 8 prefix.
    return [b"7", b"10.0.0.2", b"17000", b"agent-d0", kv, aux, b"2", *extra]


def test_nixl_transfer_info_field_order_and_dummy_rules() -> None:
    indices = np.array([5, 9], dtype=np.int32).tobytes()
    real = nixl.TransferInfo.from_zmq(_nixl_transfer_info(indices, b"3"))
    assert real.dst_kv_indices.tolist() == [5, 9]
    assert real.dst_aux_index == 3
    assert real.required_dst_info_num == 2
    assert real.dst_state_indices == []
    assert real.decode_prefix_len is None
    assert not real.is_dummy

    dummy = nixl.TransferInfo.from_zmq(_nixl_transfer_info(b"", b""))
    assert dummy.is_dummy
    assert dummy.to_zmq() == _nixl_transfer_info(b"", b"")

    # Empty pages but a decode prefix > 0: a full decode-side cache hit, not a dummy.
    cache_hit = nixl.TransferInfo.from_zmq(_nixl_transfer_info(b"", b"3", b"", b"512"))
    assert cache_hit.decode_prefix_len == 512
    assert not cache_hit.is_dummy
    assert cache_hit.to_zmq() == _nixl_transfer_info(b"", b"3", b"", b"512")

    zero_prefix = nixl.TransferInfo.from_zmq(_nixl_transfer_info(b"", b"", b"", b"0"))
    assert zero_prefix.is_dummy


def test_nixl_guard_helpers() -> None:
    frames = _nixl_transfer_info(b"", b"")
    guarded = nixl.add_guard(frames)
    assert guarded[0] == b"NixlMsgGuard"
    assert nixl.strip_guard(guarded) == frames
    with pytest.raises(WireError, match=r"frame 0 \(guard\)"):
        nixl.strip_guard(frames)
    assert nixl.NIXL.decode_guarded(guarded) == nixl.TransferInfo.from_zmq(frames)


def test_transfer_status() -> None:
    status = MOONCAKE.decode([b"12", b"4", b"1"])
    assert status == TransferStatus(room=12, status=KVPoll.Success, prefill_rank=1)
    assert MOONCAKE.encode(status) == [b"12", b"4", b"1"]


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([b"12", b"4"], "match no message"),
        ([b"12", b"4", b"1", b"0"], "match no message"),
        ([b"12", b"four", b"1"], r"frame 1 \(status\)"),
        ([b"12", b"9", b"1"], r"frame 1 \(status\): expected a KVPoll value, got 9"),
        ([b"-1", b"4", b"1"], r"frame 0 \(room\)"),
    ],
)
def test_malformed_transfer_status(frames: list[bytes], match: str) -> None:
    with pytest.raises(WireError, match=match):
        MOONCAKE.decode(frames, "TransferStatus" if len(frames) == 3 else None)


def test_control_messages_are_told_apart_by_tag() -> None:
    frames = [b"STAGING_RSP", b"7", b"0", b"-2", b"3", b"0", b"10.0.0.2:15000"]
    response = MOONCAKE.decode(frames)
    assert isinstance(response, StagingResponse)
    assert response.never_fits
    assert MOONCAKE.encode(response) == frames


def test_reason_cannot_travel_in_the_sglang_status() -> None:
    status = TransferStatus(room=1, status=KVPoll.Failed, prefill_rank=0, reason="engine error")
    with pytest.raises(WireError, match="no frame for reason"):
        MOONCAKE.encode(status)
