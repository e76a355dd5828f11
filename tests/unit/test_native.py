"""The native kvbridge/1 profile: header, versions, explicit presence, auth tag."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.wire import (
    NATIVE,
    Abort,
    FailureKind,
    Field,
    Heartbeat,
    KVLayout,
    KVPoll,
    Layout,
    Registration,
    TransferRequest,
    TransferStatus,
    WireError,
    decode_frames,
    encode_frames,
)
from kvbridge.wire import codecs as c
from kvbridge.wire.auth import TAG_SIZE, ReplayGuard, make_tag
from kvbridge.wire.native import HEADER, MAGIC, MAJOR, MINOR, Header


def registration(**changes: object) -> Registration:
    fields: dict[str, object] = dict(
        peer_id="decode-0",
        host="127.0.0.1",
        control_port=17000,
        engine="nixl",
        engine_descriptor=b"md",
        tp_rank=0,
        attn_tp_size=1,
        dcp_rank=0,
        dcp_size=1,
        kv_layout=KVLayout.MHA,
        total_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        page_size=16,
        kv_layer_ids=[0, 1],
        kv_ptrs=[0x1000, 0x2000, 0x3000, 0x4000],
        kv_item_lens=[4096] * 4,
        kv_lengths=[4096 * 4] * 4,
        aux_ptrs=[0x5000],
        aux_item_lens=[64],
        aux_lengths=[256],
    )
    fields.update(changes)
    return Registration(**fields)  # type: ignore[arg-type]


def request(**changes: object) -> TransferRequest:
    fields: dict[str, object] = dict(
        room=9,
        peer_id="decode-0",
        is_dummy=False,
        dst_kv_indices=np.array([1, 2, 3], dtype=np.int32),
        dst_aux_index=0,
        dst_state_indices=[],
        required_dst_info_num=1,
        decode_prefix_len=None,
    )
    fields.update(changes)
    return TransferRequest(**fields)  # type: ignore[arg-type]


def test_header_layout() -> None:
    frames = NATIVE.encode(Heartbeat(sender_id="p0", sequence=1, lease_ms=2000))
    assert frames[0] == MAGIC + bytes([MAJOR, MINOR, 10, 0])
    assert len(frames[0]) == HEADER.size == 8


def test_zero_is_a_real_value_and_absence_is_an_empty_frame() -> None:
    present = NATIVE.encode(request(dst_aux_index=0, decode_prefix_len=0))
    absent = NATIVE.encode(request(decode_prefix_len=None))
    assert present[5] == (0).to_bytes(8, "little")
    assert present[8] == (0).to_bytes(8, "little")
    assert absent[8] == b""
    assert NATIVE.decode(present).decode_prefix_len == 0  # type: ignore[attr-defined]
    assert NATIVE.decode(absent).decode_prefix_len is None  # type: ignore[attr-defined]


def test_dummy_is_explicit() -> None:
    dummy = request(is_dummy=True, dst_kv_indices=np.array([], np.int32), dst_aux_index=None)
    assert NATIVE.decode(NATIVE.encode(dummy)) == dummy
    with pytest.raises(WireError, match=r"frame 3 \(is_dummy\)"):
        NATIVE.encode(request(is_dummy=True))
    # A real request may come without an aux slot (a decode rank without aux buffers).
    without_aux = request(dst_aux_index=None)
    assert NATIVE.decode(NATIVE.encode(without_aux)) == without_aux


def test_major_version_mismatch_names_both_versions() -> None:
    frames = NATIVE.encode(registration())
    frames[0] = Header(2, 3, 1, 0).pack()
    with pytest.raises(WireError) as caught:
        NATIVE.decode(frames)
    message = str(caught.value)
    assert "kvbridge/2.3" in message
    assert f"kvbridge/{MAJOR}.{MINOR}" in message
    assert "frame 0 (header.major)" in message


@pytest.mark.parametrize(
    ("header", "field"),
    [
        (b"KVBX\x01\x00\x01\x00", "header.magic"),
        (b"KVBR\x01\x00\x01", "header.size"),
        (b"KVBR\x01\x00\xee\x00", "header.type"),
        (b"KVBR\x01\x00\x01\x80", "header.flags"),
    ],
)
def test_bad_header_is_named(header: bytes, field: str) -> None:
    frames = NATIVE.encode(registration())
    frames[0] = header
    with pytest.raises(WireError, match=rf"frame 0 \({field}\)"):
        NATIVE.decode(frames)


def test_newer_minor_may_append_frames_older_minor_may_not() -> None:
    frames = NATIVE.encode(registration())
    frames[0] = Header(MAJOR, MINOR + 1, 1, 0).pack()
    assert NATIVE.decode([*frames, b"a new field"]) == registration()
    frames[0] = Header(MAJOR, MINOR, 1, 0).pack()
    with pytest.raises(WireError, match="expected at most 33 frames, got 34"):
        NATIVE.decode([*frames, b"a new field"])


def test_a_1_0_peer_without_the_1_1_frames_still_decodes() -> None:
    """1.1 appended session tokens and heartbeat acks; a 1.0 peer's messages lack them."""
    frames = NATIVE.encode(registration())
    frames[0] = Header(MAJOR, 0, 1, 0).pack()
    assert NATIVE.decode(frames[:-2]) == registration()
    beat = NATIVE.encode(Heartbeat("tcp://127.0.0.1:1", 3, 1000))
    beat[0] = Header(MAJOR, 0, beat[0][6], 0).pack()
    assert NATIVE.decode(beat[:-2]) == Heartbeat("tcp://127.0.0.1:1", 3, 1000)


def test_a_1_2_peer_without_state_parts_still_decodes() -> None:
    """1.3 appended the state parts (a slot's TP-sharded runs); a 1.2 peer's registration
    lacks them and reads as one without parts."""
    frames = NATIVE.encode(registration())
    frames[0] = Header(MAJOR, 2, 1, 0).pack()
    assert NATIVE.decode(frames[:-1]) == registration()


def test_registration_rules() -> None:
    with pytest.raises(WireError, match=r"frame 28 \(staging_total_size\)"):
        NATIVE.encode(registration(staging_base_ptr=0x7000, staging_total_size=0))
    assert registration(staging_total_size=4096).staging_registered
    assert not registration().staging_registered
    with pytest.raises(WireError, match=r"frame 16 \(kv_ptrs\).*MHA has 2 buffer"):
        NATIVE.encode(
            registration(kv_ptrs=[0x1000, 0x2000], kv_item_lens=[1, 1], kv_lengths=[1, 1])
        )
    mla = registration(
        kv_layout=KVLayout.MLA, kv_ptrs=[1, 2], kv_item_lens=[576, 576], kv_lengths=[576, 576]
    )
    assert NATIVE.decode(NATIVE.encode(mla)) == mla
    with pytest.raises(WireError, match=r"frame 8 \(dcp_rank\)"):
        NATIVE.encode(registration(dcp_rank=2, dcp_size=2))
    with pytest.raises(WireError, match=r"frame 6 \(tp_rank\)"):
        NATIVE.encode(registration(tp_rank=1, attn_tp_size=1))
    with pytest.raises(WireError, match=r"frame 17 \(kv_item_lens\)"):
        NATIVE.encode(registration(kv_item_lens=[1]))
    with pytest.raises(WireError, match=r"frame 18 \(kv_lengths\).*cannot hold one item"):
        NATIVE.encode(registration(kv_lengths=[4096, 4096, 4096, 100]))


def test_encode_refuses_out_of_range_values_naming_the_field() -> None:
    with pytest.raises(WireError, match=r"frame 3 \(control_port\): a TCP port is at most"):
        NATIVE.encode(registration(control_port=70000))
    with pytest.raises(WireError, match=r"frame 3 \(control_port\): cannot encode.*got str"):
        NATIVE.encode(registration(control_port="17000"))
    with pytest.raises(WireError, match=r"frame 1 \(room\)"):
        NATIVE.encode(request(room=-1))
    with pytest.raises(WireError, match=r"frame 2 \(peer_id\)"):
        NATIVE.encode(request(peer_id="\ud800"))


def test_auth_tag() -> None:
    secret = b"shared secret"
    status = TransferStatus(room=1, status=KVPoll.Failed, prefill_rank=3, reason="engine: rc -1")
    frames = NATIVE.encode(status, secret=secret)
    assert len(frames) == 8  # header, 6 fields, tag
    assert len(frames[-1]) == TAG_SIZE
    assert NATIVE.decode(frames, secret=secret) == status
    # A receiver without a secret still reads the message.
    assert NATIVE.decode(frames) == status
    with pytest.raises(WireError, match="HMAC tag does not match"):
        NATIVE.decode(frames, secret=b"other secret")
    tampered = [*frames]
    tampered[4] = b"engine: rc 0"
    with pytest.raises(WireError, match=r"frame 7 \(auth_tag\)"):
        NATIVE.decode(tampered, secret=secret)
    with pytest.raises(WireError, match="not authenticated"):
        NATIVE.decode(NATIVE.encode(status), secret=secret)
    with pytest.raises(WireError, match="expected a 56-byte auth tag"):
        NATIVE.decode([*frames[:-1], frames[-1][:40]], secret=secret)


def test_replayed_and_stale_messages_are_refused() -> None:
    secret, now = b"s", [10**18]
    guard = ReplayGuard(max_skew_s=30, clock_ns=lambda: now[0])
    heartbeat = Heartbeat(sender_id="p0", sequence=7, lease_ms=2000)
    frames = NATIVE.encode(heartbeat, secret=secret)
    frames[-1] = make_tag(secret, frames[:-1], now_ns=now[0])
    assert NATIVE.decode(frames, secret=secret, guard=guard) == heartbeat
    with pytest.raises(WireError, match="replayed"):
        NATIVE.decode(frames, secret=secret, guard=guard)
    old = [*frames[:-1], make_tag(secret, frames[:-1], now_ns=now[0] - 31 * 10**9)]
    with pytest.raises(WireError, match=r"timestamp -31\.0 s from this clock"):
        NATIVE.decode(old, secret=secret, guard=guard)
    now[0] += 61 * 10**9  # nonces are forgotten once their messages could no longer be fresh
    fresh = [*frames[:-1], make_tag(secret, frames[:-1], now_ns=now[0])]
    assert NATIVE.decode(fresh, secret=secret, guard=guard) == heartbeat
    assert len(guard) == 1


def test_secret_refused_for_profiles_without_a_tag_frame() -> None:
    status = TransferStatus(room=1, status=KVPoll.Success, prefill_rank=0)
    with pytest.raises(WireError, match="no frame for an auth tag"):
        encode_frames(status, "sglang-mooncake", secret=b"s")
    with pytest.raises(WireError, match="no frame for an auth tag"):
        decode_frames([b"1", b"4", b"0"], secret=b"s")


def test_failure_reason_survives_the_trip() -> None:
    status = TransferStatus(room=5, status=KVPoll.Failed, prefill_rank=2, reason="décodé: timeout")
    assert NATIVE.decode(NATIVE.encode(status)) == status


@pytest.mark.parametrize("kind", list(FailureKind))
def test_the_failure_kind_travels_with_the_reason(kind: FailureKind) -> None:
    status = TransferStatus(5, KVPoll.Failed, 2, "room 5: why", b"t" * 16, kind)
    frames = NATIVE.encode(status)
    assert frames[-1] == bytes([kind])
    assert NATIVE.decode(frames).failure_kind is kind
    # A 1.1 peer sends no kind frame: the kind is unknown (None), the rest decodes.
    frames[0] = Header(MAJOR, 1, 3, 0).pack()
    older = NATIVE.decode(frames[:-1])
    assert (older.failure_kind, older.reason) == (None, "room 5: why")


def test_a_kind_the_table_does_not_have_is_refused_by_name() -> None:
    frames = NATIVE.encode(TransferStatus(5, KVPoll.Failed, 2, "why", b"", FailureKind.ENGINE))
    frames[-1] = bytes([200])
    with pytest.raises(WireError, match=r"failure_kind"):
        NATIVE.decode(frames)


def test_a_layout_must_carry_every_required_field() -> None:
    with pytest.raises(TypeError, match="required decode_port has no frame"):
        Layout("test", "Abort", Abort, (Field("room", c.U64), Field("decode_ip", c.UTF8)))
    with pytest.raises(TypeError, match="nope is not a field"):
        Layout("test", "Abort", Abort, (Field("nope", c.U64),))
