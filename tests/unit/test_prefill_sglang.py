"""Prefill's rules toward SGLang decode ranks, without sockets: sglang's registration read with
this rank's own geometry, its requests written, no heartbeat or lease ever asked of it, no
status to a dummy request, aborts acknowledged with their generation only once nothing is in
flight; and the bootstrap routes an SGLang decode asks (their answers as sglang's server gives
them: tests/sglang_compat holds them against sglang's own classes)."""

from __future__ import annotations

import dataclasses
import json
from http import HTTPStatus

import numpy as np
import pytest
from kv_cache import rank_cache

from kvbridge.cache import KVArgs
from kvbridge.cache.peer import registration_for
from kvbridge.cache.sglang_peer import (
    UNKNOWN_ITEMS,
    decode_registration_from_sglang,
    sglang_nixl_registration_for,
    sglang_registration_for,
)
from kvbridge.cache.sglang_route import sglang_dtype_name, sglang_rank_problem
from kvbridge.cache.spec import StatePart
from kvbridge.control.sglang_routes import SGLangBootstrapService, SGLangPrefillRank, server_info
from kvbridge.core.prefill_events import (
    Action,
    ChunkSubmitted,
    Connect,
    Connected,
    PrefillSettings,
    SenderOpened,
    Write,
    WriteEnded,
)
from kvbridge.core.prefill_protocol import PrefillProtocol
from kvbridge.core.prefill_sglang import request_of
from kvbridge.core.protocol import Send, Tick
from kvbridge.core.room import Chunk
from kvbridge.wire import KVLayout, KVPoll, TransferStatus
from kvbridge.wire.sglang import common, nixl
from kvbridge.wire.sglang.mooncake import KVArgsRegisterInfo, TransferInfo

SESSION = "10.0.0.2:15001"  # the decode rank's Mooncake session
DECODE = "tcp://10.0.0.2:7100"
GEOMETRY = dict(layer_ids=(0, 1), page_size=4, total_kv_heads=2, head_dim=8, aux_slots=4)


def local(rank: int = 0, tp: int = 1, layout: KVLayout = KVLayout.MHA) -> KVArgs:
    heads = {"total_kv_heads": 1} if layout == KVLayout.MLA else {}
    return rank_cache(
        seed=1,
        attn_tp_rank=rank,
        attn_tp_size=tp,
        kv_layout=layout,
        aux_item_bytes=(64,),
        **{**GEOMETRY, **heads},
    ).args


def protocol(args: KVArgs | None = None) -> PrefillProtocol:
    return PrefillProtocol(
        PrefillSettings(
            kv_args=args or local(),
            endpoint="tcp://10.0.0.1:7000",
            engine="mooncake",
            heartbeat_interval_s=0.5,
            peer_timeout_s=3.0,
            request_timeout_s=30.0,
            staging_timeout_s=5.0,
            sglang_peers=True,
        )
    )


def registration(args: KVArgs | None = None, tp_rank: int = 0, tp: int = 1) -> KVArgsRegisterInfo:
    """What sglang's decode sends: addresses and one page's bytes per buffer."""
    args = args or rank_cache(seed=None, aux_item_bytes=(64,), **GEOMETRY).args
    return KVArgsRegisterInfo(
        "None",
        "10.0.0.2",
        7100,
        SESSION,
        [buffer.ptr for buffer in args.kv_buffers],
        [buffer.ptr for buffer in args.aux_buffers],
        [],
        tp_rank,
        tp,
        args.kv_buffers[0].item_len,
        dst_kv_item_lens=[buffer.item_len for buffer in args.kv_buffers],
    )


def info(room: int, pages: list[int], aux: int | None = 2, required: int = 1) -> TransferInfo:
    return TransferInfo(
        room, "10.0.0.2", 7100, SESSION, np.array(pages, np.int32), aux, [], required, 0
    )


def sent(actions: list[Action]) -> list[object]:
    return [action.message for action in actions if isinstance(action, Send)]


def registered(prefill: PrefillProtocol, message: KVArgsRegisterInfo | None = None) -> None:
    actions = prefill.handle(message or registration(), 0.0)
    assert sent(actions) == []  # no heartbeat: sglang's listener would stop at one
    (connect,) = [action for action in actions if isinstance(action, Connect)]
    assert connect.descriptor == SESSION.encode()
    prefill.handle(Connected(SESSION), 0.0)


def test_a_registration_is_read_with_this_ranks_geometry_and_needs_no_lease() -> None:
    own = local()
    decode = rank_cache(seed=None, aux_item_bytes=(64,), **GEOMETRY).args
    read = decode_registration_from_sglang(registration(decode), own, "mooncake")
    assert (read.peer_id, read.engine_descriptor) == (SESSION, SESSION.encode())
    assert read.kv_ptrs == [buffer.ptr for buffer in decode.kv_buffers]
    assert (read.total_kv_heads, read.head_dim, read.dtype, read.page_size) == (
        own.total_kv_heads,
        own.head_dim,
        own.dtype,
        own.page_size,
    )
    assert read.aux_item_lens == [64]
    # sglang says nothing of buffer sizes: any page an int32 index names is in bounds.
    assert read.kv_lengths == [buffer.item_len * UNKNOWN_ITEMS for buffer in decode.kv_buffers]
    prefill = protocol(own)
    registered(prefill)
    assert prefill.lease_problem(SESSION, 1e6) is None
    # Ticks for far longer than a peer timeout: no heartbeat, and the peer is never dead.
    for second in range(1, 100):
        assert sent(prefill.handle(Tick(), float(second))) == []
    assert prefill.stats.peers_declared_dead == 0


def test_a_registration_that_cannot_be_served_is_ignored_with_the_reason() -> None:
    prefill = protocol()
    with_state = registration()
    with_state.dst_state_data_ptrs = [[4096]]
    assert prefill.handle(with_state, 0.0) == []
    assert prefill.stats.ignored == 1
    dcp = registration()
    dcp.dst_dcp_size = 2
    with pytest.raises(ValueError, match="context parallelism"):
        decode_registration_from_sglang(dcp, local(), "mooncake")


def test_a_request_is_written_and_its_success_goes_in_sglangs_status() -> None:
    prefill = protocol()
    registered(prefill)
    prefill.handle(SenderOpened(5), 0.0)
    prefill.handle(info(5, [3, 1]), 0.1)
    assert prefill.rooms[5].status.poll == KVPoll.WaitingForInput
    actions = prefill.handle(ChunkSubmitted(5, Chunk(np.array([0, 1]), True, 2)), 0.2)
    (write,) = [action for action in actions if isinstance(action, Write)]
    assert list(write.job.dst_pages) == [3, 1]
    (status,) = sent(prefill.handle(WriteEnded(write), 0.3))
    assert isinstance(status, TransferStatus)
    assert (status.room, status.status, status.prefill_rank) == (5, KVPoll.Success, 0)


def test_a_dummy_request_hears_nothing() -> None:
    """MLA, prefill TP 2 to decode TP 1: sglang's decode sends rank 1 a dummy request and
    waits only for rank 0's status; a status from rank 1 could end the room there early."""
    prefill = protocol(local(rank=1, tp=2, layout=KVLayout.MLA))
    mla_decode = rank_cache(
        seed=None, kv_layout=KVLayout.MLA, aux_item_bytes=(64,), **{**GEOMETRY, "total_kv_heads": 1}
    )
    registered(prefill, registration(mla_decode.args))
    prefill.handle(SenderOpened(5), 0.0)
    actions = prefill.handle(info(5, [], aux=None), 0.1)
    actions += prefill.handle(ChunkSubmitted(5, Chunk(np.array([0]), True, 2)), 0.2)
    assert prefill.rooms[5].status.poll == KVPoll.Success
    assert not [action for action in actions if isinstance(action, Write)]
    assert sent(actions) == []


def test_an_abort_is_acknowledged_with_its_generation_once_nothing_is_in_flight() -> None:
    prefill = protocol()
    registered(prefill)
    prefill.handle(SenderOpened(5), 0.0)
    prefill.handle(info(5, [3]), 0.1)
    (write,) = [
        action
        for action in prefill.handle(ChunkSubmitted(5, Chunk(np.array([0]), True, 2)), 0.2)
        if isinstance(action, Write)
    ]
    # From no decode peer of the room: ignored.
    stranger = common.AbortNotification(5, "10.6.6.6", 1, 9)
    assert prefill.handle(stranger, 0.3) == []
    assert prefill.rooms[5].status.poll == KVPoll.Transferring
    actions = prefill.handle(common.AbortNotification(5, "10.0.0.2", 7100, 9), 0.3)
    assert prefill.rooms[5].status.poll == KVPoll.Failed
    assert sent(actions) == []  # its write may still land: no ack, no status yet
    (failed, ack) = sent(prefill.handle(WriteEnded(write), 0.4))
    assert isinstance(failed, TransferStatus)
    assert failed.status == KVPoll.Failed
    assert isinstance(ack, common.AbortAck)
    assert (ack.room, ack.prefill_rank, ack.generation) == (5, 0, 9)
    # An idle room acknowledges at once; an abort without a generation is owed no ack.
    prefill.handle(SenderOpened(6), 0.5)
    assert sent(prefill.handle(common.AbortNotification(6, "10.0.0.2", 7100), 0.5)) == []
    assert prefill.rooms[6].status.poll == KVPoll.Failed
    (at_once,) = sent(prefill.handle(common.AbortNotification(7, "10.0.0.2", 7100, 3), 0.6))
    assert isinstance(at_once, common.AbortAck)
    assert at_once.generation == 3


def test_the_dtype_sglang_compares_and_what_cannot_be_served() -> None:
    assert sglang_dtype_name("bfloat16") == "auto"
    assert sglang_dtype_name("float8_e4m3fn") == "fp8_e4m3"
    with pytest.raises(ValueError, match="int8"):
        sglang_dtype_name("int8")
    assert sglang_rank_problem(local()) is None
    hybrid = rank_cache(state_slots=2, state_item_bytes=(8,), **GEOMETRY).args
    assert sglang_rank_problem(hybrid) is None  # a Mamba state moves beside SGLang
    head_major = rank_cache(kv_layout=KVLayout.MHA_HEAD_MAJOR, **GEOMETRY).args
    assert "not MHA_HEAD_MAJOR" in str(sglang_rank_problem(head_major))


def rank(tp_rank: int, tp: int = 2, **changes: object) -> bytes:
    document = SGLangPrefillRank(tp_rank, tp, "10.0.0.1", 7000 + tp_rank, 16, "auto").document()
    return json.dumps({**document, **changes}).encode()


def ask(service: SGLangBootstrapService, path: str, method: str = "GET", body: bytes = b""):  # type: ignore[no-untyped-def]
    return service.handle(method, path, {}, body, "10.0.0.9", 0.0)


QUERY = "/route?prefill_dp_rank={}&prefill_cp_rank={}&target_tp_rank={}&target_pp_rank={}"


def test_the_bootstrap_answers_sglangs_routes() -> None:
    service = SGLangBootstrapService()
    assert ask(service, "/health").status == HTTPStatus.OK  # as sglang's: up means healthy
    assert ask(service, QUERY.format(-1, -1, -1, -1)).status == HTTPStatus.SERVICE_UNAVAILABLE
    assert ask(service, "/route", "PUT", rank(0)).status == HTTPStatus.OK
    assert ask(service, QUERY.format(-1, -1, -1, -1)).status == HTTPStatus.SERVICE_UNAVAILABLE
    # A rank of another group, or one sglang's decode would read otherwise: refused.
    assert ask(service, "/route", "PUT", rank(1, page_size=32)).status == HTTPStatus.CONFLICT
    assert ask(service, "/route", "PUT", rank(1, pp_size=2)).status == HTTPStatus.BAD_REQUEST
    assert ask(service, "/route", "PUT", b"{").status == HTTPStatus.BAD_REQUEST
    assert ask(service, "/route", "PUT", rank(1)).status == HTTPStatus.OK
    group = ask(service, QUERY.format(-1, -1, -1, -1))
    assert group.status == HTTPStatus.OK
    assert group.document == server_info(SGLangPrefillRank(0, 2, "10.0.0.1", 7000, 16, "auto"))
    one = ask(service, QUERY.format(0, 0, 1, 0))
    assert one.document == {"rank_ip": "10.0.0.1", "rank_port": 7001}
    assert ask(service, QUERY.format(0, 0, 2, 0)).status == HTTPStatus.NOT_FOUND
    assert ask(service, QUERY.format(1, 0, 0, 0)).status == HTTPStatus.NOT_FOUND
    assert ask(service, "/route?target_tp_rank=0").status == HTTPStatus.BAD_REQUEST
    assert ask(service, "/prefill").status == HTTPStatus.NOT_FOUND
    assert ask(service, "/route", "DELETE").status == HTTPStatus.METHOD_NOT_ALLOWED


def test_two_decode_ranks_asking_one_prefill_rank_each_get_their_heads() -> None:
    """Decode TP 2 over prefill TP 1: each decode rank registers and asks with
    required_dst_info_num 2; the room waits for both, then writes each its head."""
    prefill = protocol()
    sessions = ("10.0.0.2:15001", "10.0.0.3:15001")
    for rank, session in enumerate(sessions):
        half = rank_cache(
            seed=None, attn_tp_rank=rank, attn_tp_size=2, aux_item_bytes=(64,), **GEOMETRY
        ).args
        message = registration(half, tp_rank=rank, tp=2)
        message.mooncake_session_id, message.endpoint = session, f"10.0.0.{2 + rank}"
        prefill.handle(message, 0.0)
        prefill.handle(Connected(session), 0.0)
    prefill.handle(SenderOpened(5), 0.0)
    first = info(5, [3], required=2)
    prefill.handle(first, 0.1)
    assert prefill.rooms[5].status.poll != KVPoll.WaitingForInput  # one of two asked
    second = info(5, [6], required=2)
    second.mooncake_session_id, second.endpoint = sessions[1], "10.0.0.3"
    prefill.handle(second, 0.1)
    assert prefill.rooms[5].status.poll == KVPoll.WaitingForInput
    actions = prefill.handle(ChunkSubmitted(5, Chunk(np.array([0]), True, 2)), 0.2)
    written = {write.job.peer_id: write for write in actions if isinstance(write, Write)}
    assert set(written) == set(sessions)
    assert [int(page) for page in written[sessions[1]].job.dst_pages] == [6]
    statuses = [sent(prefill.handle(WriteEnded(write), 0.3)) for write in written.values()]
    assert [len(s) for s in statuses] == [0, 2]  # both told, once the last write ended


def nixl_registration() -> nixl.KVArgsRegisterInfo:
    """What kvbridge's own decode sends an SGLang NIXL prefill: the same reading."""
    decode = rank_cache(seed=None, aux_item_bytes=(64,), **GEOMETRY).args
    return sglang_nixl_registration_for(
        decode, host="10.0.0.2", control_port=7100, agent_name="decode-agent", agent_metadata=b"md"
    )


def test_over_nixl_the_decode_agent_and_its_page_counts_are_read() -> None:
    info = nixl_registration()
    assert info.dst_kv_mem_kinds == ["DRAM"] * len(info.dst_kv_ptrs)
    read = decode_registration_from_sglang(info, local(), "nixl")
    assert (read.peer_id, read.engine_descriptor) == ("decode-agent", b"md")
    # NIXL says how many pages each buffer holds: real bounds, unlike Mooncake's.
    assert read.kv_lengths == [item * 16 for item in read.kv_item_lens]
    in_gpu_memory = nixl_registration()
    in_gpu_memory.dst_kv_mem_kinds = ["VRAM"] * len(info.dst_kv_ptrs)
    with pytest.raises(ValueError, match="VRAM"):
        decode_registration_from_sglang(in_gpu_memory, local(), "nixl")
    # Its requests name the agent; a dummy's aux slot (NIXL sends one) is dropped.
    dummy = nixl.TransferInfo(
        5, "10.0.0.2", 7100, "decode-agent", np.empty(0, np.int32), 3, 1, dummy_rank=True
    )
    request = request_of(dummy)
    assert (request.peer_id, request.is_dummy, request.dst_aux_index) == (
        "decode-agent",
        True,
        None,
    )


def hybrid(rank: int = 0, tp: int = 1, **changes: object) -> KVArgs:
    """A hybrid model's rank: KV and a Mamba state (a conv and an SSM buffer per slot)."""
    return rank_cache(
        seed=None,
        aux_item_bytes=(64,),
        state_slots=4,
        state_item_bytes=(72 // tp, 256 // tp),
        state_dims=(12 // tp, 4 // tp),
        attn_tp_rank=rank,
        attn_tp_size=tp,
        **{**GEOMETRY, **changes},
    ).args


def test_a_mamba_state_is_read_as_the_native_registration_carries_it() -> None:
    """What a kvbridge decode registers with sglang (one Mamba component), a kvbridge prefill
    reads back as kvbridge's own registration of that rank says, but for the sizes, which
    sglang's Mooncake registration does not carry."""
    decode = hybrid(rank=1, tp=2)
    info = sglang_registration_for(decode, host="10.0.0.2", control_port=7100, session_id=SESSION)
    assert info.dst_state_dim_per_tensor == [[6, 2]]
    read = decode_registration_from_sglang(info, hybrid(), "mooncake")
    native = registration_for(
        decode,
        peer_id=SESSION,
        host="10.0.0.2",
        control_port=7100,
        engine="mooncake",
        engine_descriptor=SESSION.encode(),
    )
    for name in ("state_ptrs", "state_item_lens", "state_dim_per_tensor", "tp_rank"):
        assert getattr(read, name) == getattr(native, name), name
    assert read.state_lengths == [[item * UNKNOWN_ITEMS for item in (36, 128)]]


def test_a_state_sglangs_decode_holds_otherwise_is_refused_with_the_reason() -> None:
    own = hybrid()
    info = sglang_registration_for(own, host="10.0.0.2", control_port=7100, session_id=SESSION)
    with pytest.raises(ValueError, match="registered 2 state buffers, this rank moves 0"):
        decode_registration_from_sglang(info, local(), "mooncake")
    two_components = sglang_registration_for(
        own, host="10.0.0.2", control_port=7100, session_id=SESSION
    )
    two_components.dst_state_data_ptrs = [[1, 2], [3]]
    with pytest.raises(ValueError, match="2 state components"):
        decode_registration_from_sglang(two_components, own, "mooncake")
    # sglang's NIXL backend registers state as GPU memory only.
    over_nixl = nixl_registration()
    over_nixl.dst_state_data_ptrs = [[4096, 8192]]
    with pytest.raises(ValueError, match="GPU memory"):
        decode_registration_from_sglang(over_nixl, own, "nixl")


def test_a_slot_of_parts_is_cut_by_the_sglang_decode_ranks_tp() -> None:
    """A Mamba-2 conv slot of three parts (x, B, C): sglang's decode publishes only the units
    it holds; this rank cuts its own parts by the decode's TP and checks the sum."""
    parts = (StatePart(0, 8, 6, 8), StatePart(48, 2, 6, 2), StatePart(60, 2, 6, 2))
    own = dataclasses.replace(
        hybrid(), state_dims=(), state_parts=(parts, (StatePart(0, 4, 64, 4),))
    )
    info = registration()
    info.dst_state_data_ptrs = [[4096, 8192]]
    info.dst_state_item_lens = [[36, 128]]
    info.dst_attn_tp_size, info.dst_tp_rank = 2, 1
    info.dst_state_dim_per_tensor = [[6, 2]]
    read = decode_registration_from_sglang(info, own, "mooncake")
    assert read.state_parts == [[0, 4, 6, 8, 24, 1, 6, 2, 30, 1, 6, 2], [0, 2, 64, 4]]
    info.dst_state_dim_per_tensor = [[5, 2]]
    with pytest.raises(ValueError, match="holds 5 units"):
        decode_registration_from_sglang(info, own, "mooncake")
