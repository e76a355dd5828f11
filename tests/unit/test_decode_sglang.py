"""Decode's rules toward SGLang prefill ranks, without sockets: sglang's registration and
requests, no heartbeat, token or lease ever sent to them, statuses accepted from the ranks a
room asked, aborts with a generation the acks must echo, MLA dummies; and the pieces around
them (the rank mapping's refusals, the bootstrap answers, the configuration)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvbridge import DecodeManager, KVArgs, PrefillManager
from kvbridge.cache.sglang_peer import sglang_request_problem
from kvbridge.cache.sglang_route import group_problem, sglang_route
from kvbridge.cache.topology import TopologyError
from kvbridge.config import ManagerConfig
from kvbridge.control.sglang_bootstrap import (
    SGLangPrefillGroup,
    base_url,
    parse_group,
    parse_rank,
)
from kvbridge.core.decode_events import (
    Action,
    Closing,
    DecodeSettings,
    LeasesRenewing,
    PrefillsAnswered,
    Registering,
    RoomAborted,
    RoomOpened,
    WriteAux,
)
from kvbridge.core.decode_protocol import DecodeProtocol
from kvbridge.core.decode_sglang import ABORT_RELEASE_S, SGLangMooncakePeer
from kvbridge.core.protocol import Send, Tick
from kvbridge.wire import FailureKind, KVLayout, KVPoll, TransferStatus
from kvbridge.wire.sglang import common
from kvbridge.wire.sglang.mooncake import KVArgsRegisterInfo, TransferInfo

ENDPOINTS = ("tcp://10.0.0.1:7000", "tcp://10.0.0.2:7000")  # prefill ranks 0 and 1
SESSION = "10.0.0.9:15001"


def protocol() -> DecodeProtocol:
    return DecodeProtocol(
        DecodeSettings(
            rank=0,
            peer_id="decode-0@tcp://10.0.0.9:7100",
            host="10.0.0.9",
            control_port=7100,
            session_token=b"t" * 16,
            heartbeat_interval_s=0.5,
            peer_timeout_s=3.0,
            transfer_timeout_s=100.0,
            engine_notifies=True,  # even so: sglang's writes notify no one
        )
    )


def registration() -> KVArgsRegisterInfo:
    return KVArgsRegisterInfo(
        "None", "10.0.0.9", 7100, SESSION, [4096, 8192], [12288], [], 0, 1, 512
    )


def sends(actions: list[Action]) -> list[Send]:
    return [action for action in actions if isinstance(action, Send)]


def opened(core: DecodeProtocol, prefill_tp: int, layout: KVLayout, room: int = 7) -> list[Send]:
    """Register with the group's ranks the route asks and open `room` into pages 3, 1, 2."""
    way = sglang_route(prefill_tp, 1, 0, 8, layout)
    endpoints = {rank: ENDPOINTS[rank] for rank in way.route.prefill_ranks}
    for endpoint in endpoints.values():
        core.handle(Registering(endpoint, registration(), SGLangMooncakePeer(SESSION)), 0.0)
    event = RoomOpened(
        room,
        way.route,
        way.required,
        endpoints,
        np.array([3, 1, 2], np.int32),
        aux_index=5,
        reporting=way.reporting,
    )
    return sends(core.handle(event, 1.0))


def status(room: int, rank: int, poll: KVPoll) -> TransferStatus:
    return TransferStatus(room=room, status=poll, prefill_rank=rank)  # no token: sglang's


def test_registration_and_requests_are_sglangs_and_no_heartbeat_ever_goes_out() -> None:
    core = protocol()
    registering = Registering(ENDPOINTS[0], registration(), SGLangMooncakePeer(SESSION))
    assert [type(s.message) for s in sends(core.handle(registering, 0.0))] == [KVArgsRegisterInfo]
    [request] = opened(core, 1, KVLayout.MHA)
    message = request.message
    assert isinstance(message, TransferInfo)
    assert (message.room, message.mooncake_session_id, message.dst_aux_index) == (7, SESSION, 5)
    assert message.dst_kv_indices.tolist() == [3, 1, 2]
    assert (message.required_dst_info_num, message.decode_prefix_len) == (1, 0)
    for step in range(40):  # ten seconds: past many heartbeat intervals and the peer timeout
        now = 1.0 + step * 0.25
        assert sends(core.handle(PrefillsAnswered((ENDPOINTS[0],)), now)) == []
        assert sends(core.handle(Tick(()), now)) == []
    assert core.room_status(7).poll == KVPoll.Transferring  # its health answered throughout
    assert sends(core.handle(LeasesRenewing((ENDPOINTS[0],), (7,)), 11.0)) == []


def test_an_sglang_prefill_whose_health_stops_answering_fails_its_rooms_in_time() -> None:
    core = protocol()
    opened(core, 1, KVLayout.MHA)
    now, aborts = 1.0, []
    while core.room_status(7).poll == KVPoll.Transferring and now < 10.0:
        aborts = sends(core.handle(Tick(()), now))
        now += 0.25
    room = core.room_status(7)
    assert room.poll == KVPoll.Failed
    assert room.failure_kind == FailureKind.PEER_DEAD
    assert now <= 1.0 + 3.0 + 0.5  # within the peer timeout of its last answer (registration)
    # It may only be hung: it hears the abort, and its ack (or sglang's own release time,
    # with no lease to fence it) frees the pages.
    [abort] = aborts
    assert abort.endpoint == ENDPOINTS[0]
    assert isinstance(abort.message, common.AbortNotification)
    assert abort.message.generation is not None
    assert not core.pages_safe(7, now + ABORT_RELEASE_S - 1.0)
    assert core.pages_safe(7, now + ABORT_RELEASE_S)


def test_one_writers_failure_stops_the_others_writing_the_room() -> None:
    core = protocol()
    requests = opened(core, 2, KVLayout.MHA)  # MHA from two prefill ranks: both write
    assert [s.message.is_dummy for s in requests] == [False, False]  # type: ignore[attr-defined]
    aborts = sends(core.handle(status(7, 0, KVPoll.Failed), 2.0))
    assert [a.endpoint for a in aborts] == [ENDPOINTS[1]]  # rank 0 settled by its status
    generation = aborts[0].message.generation  # type: ignore[attr-defined]
    assert not core.pages_safe(7, 2.0)
    core.handle(common.AbortAck(7, 1, generation), 2.5)
    assert core.pages_safe(7, 2.5)


def test_an_abort_before_init_fails_the_room_there_without_a_generation() -> None:
    core = protocol()
    core.handle(Registering(ENDPOINTS[0], registration(), SGLangMooncakePeer(SESSION)), 0.0)
    [abort] = sends(core.handle(RoomAborted(9, "gone", (ENDPOINTS[0],)), 1.0))
    assert isinstance(abort.message, common.AbortNotification)
    assert (abort.message.room, abort.message.generation) == (9, None)


def test_a_status_without_token_counts_only_from_a_rank_the_room_asked() -> None:
    core = protocol()
    opened(core, 1, KVLayout.MHA)
    core.handle(status(7, 1, KVPoll.Success), 2.0)  # rank 1 was not asked
    assert core.stats.ignored == 1
    assert core.room_status(7).poll == KVPoll.Transferring
    core.handle(status(7, 0, KVPoll.Success), 2.0)
    assert core.room_status(7).poll == KVPoll.Success  # no notification awaited
    assert core.pages_safe(7, 2.0)


def test_a_failed_status_fails_the_room_with_sglangs_reason() -> None:
    core = protocol()
    opened(core, 1, KVLayout.MHA)
    core.handle(status(7, 0, KVPoll.Failed), 2.0)
    room = core.room_status(7)
    assert room.poll == KVPoll.Failed
    assert room.failure_reason is not None
    assert "prefill rank 0" in room.failure_reason
    assert core.pages_safe(7, 2.0)  # a failed status: nothing of the room in flight there


def test_an_abort_carries_a_generation_and_only_its_ack_settles_the_rank() -> None:
    core = protocol()
    opened(core, 1, KVLayout.MHA)
    [abort] = sends(core.handle(RoomAborted(7, "scheduler"), 2.0))
    message = abort.message
    assert isinstance(message, common.AbortNotification)
    assert (message.room, message.decode_ip, message.decode_port) == (7, "10.0.0.9", 7100)
    assert message.generation is not None
    assert not core.pages_safe(7, 2.0)
    core.handle(common.AbortAck(7, 0, message.generation + 1), 2.1)  # another abort's
    core.handle(common.AbortAck(7, 0, None), 2.1)  # a legacy ack: sglang's decode ignores it
    assert core.stats.ignored == 2
    assert not core.pages_safe(7, 2.2)
    core.handle(common.AbortAck.answering(message, 0), 2.3)
    assert core.pages_safe(7, 2.3)


def test_mla_from_two_prefill_ranks_asks_a_dummy_and_waits_for_the_writer_alone() -> None:
    core = protocol()
    writer, dummy = opened(core, 2, KVLayout.MLA)
    assert isinstance(writer.message, TransferInfo)
    assert isinstance(dummy.message, TransferInfo)
    assert (writer.endpoint, dummy.endpoint) == ENDPOINTS
    assert not writer.message.is_dummy
    assert dummy.message.is_dummy
    core.handle(status(7, 0, KVPoll.Success), 2.0)
    assert core.room_status(7).poll == KVPoll.Success


def test_closing_aborts_toward_the_dummies_too_as_sglangs_decode_does() -> None:
    core = protocol()
    opened(core, 2, KVLayout.MLA)
    aborts = sends(core.handle(Closing(), 2.0))
    assert sorted(a.endpoint for a in aborts) == list(ENDPOINTS)
    assert {type(a.message) for a in aborts} == {common.AbortNotification}
    generation = aborts[0].message.generation  # type: ignore[attr-defined]
    core.handle(common.AbortAck(7, 0, generation), 2.1)
    assert core.pages_safe(7, 2.1)  # the dummy writes nothing: the writer's ack is enough


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "layout", "problem"),
    [
        (2, 3, KVLayout.MHA, "divide each other"),
        (1, 1, KVLayout.PAGES, "not PAGES"),
    ],
)
def test_rank_mappings_sglang_cannot_make_are_refused(
    prefill_tp: int, decode_tp: int, layout: KVLayout, problem: str
) -> None:
    with pytest.raises(TopologyError, match=problem):
        sglang_route(prefill_tp, decode_tp, 0, 8, layout)


def test_bootstrap_answers_are_checked() -> None:
    group = {
        "attn_tp_size": 2,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": 16,
        "kv_cache_dtype": "bfloat16",
        "follow_bootstrap_room": True,
    }
    assert parse_group("h:1", group)["attn_tp_size"] == 2
    with pytest.raises(ValueError, match="pp_size 2"):
        parse_group("h:1", {**group, "pp_size": 2})
    with pytest.raises(ValueError, match="page_size"):
        parse_group("h:1", {**group, "page_size": "16"})
    assert parse_rank({"rank_ip": "10.0.0.1", "rank_port": 7000}) == "tcp://10.0.0.1:7000"
    with pytest.raises(ValueError, match="rank_port"):
        parse_rank({"rank_ip": "10.0.0.1", "rank_port": 70000})
    assert base_url("10.0.0.1:8998") == "http://10.0.0.1:8998"
    assert base_url("http://h:1/") == "http://h:1"


def test_configurations_that_cannot_talk_to_sglang_are_refused_at_start() -> None:
    with pytest.raises(ValueError, match="no secret"):
        ManagerConfig(engine="mooncake", peer_protocol="sglang", secret=b"s")
    with pytest.raises(ValueError, match="not 'loopback'"):
        ManagerConfig(engine="loopback", peer_protocol="sglang", secret=None)
    with pytest.raises(ValueError, match="peer_protocol"):
        ManagerConfig(peer_protocol="vllm")
    assert ManagerConfig(engine="mooncake", peer_protocol="sglang", secret=None).sglang_peers
    assert ManagerConfig(engine="nixl", peer_protocol="sglang", secret=None).sglang_peers


def aux_protocol(host_memory: bool = True) -> DecodeProtocol:
    """A rank with one aux buffer of 8 slots of 64 bytes."""
    return DecodeProtocol(
        dataclasses.replace(
            protocol().settings, aux_geometry=((64, 8),), aux_in_host_memory=host_memory
        )
    )


def test_aux_sent_over_zmq_is_copied_into_the_slot_the_room_asked() -> None:
    # SGLANG_MOONCAKE_SEND_AUX_TCP: the slot comes before the status, on the same socket.
    core = aux_protocol()
    opened(core, 1, KVLayout.MHA)
    [write] = core.handle(common.AuxData.of(7, 0, 5, b"x" * 64), 2.0)
    assert write == WriteAux(0, 5, b"x" * 64)
    assert core.room_status(7).poll == KVPoll.Transferring
    # Into another slot, or for a room not open here: nothing is written.
    assert core.handle(common.AuxData.of(7, 0, 4, b"x" * 64), 2.0) == []
    assert core.handle(common.AuxData.of(8, 0, 5, b"x" * 64), 2.0) == []
    assert core.stats.ignored == 2
    core.handle(status(7, 0, KVPoll.Success), 2.1)
    assert core.room_status(7).poll == KVPoll.Success
    assert core.handle(common.AuxData.of(7, 0, 5, b"y" * 64), 2.2) == []  # ended: not again


@pytest.mark.parametrize(
    ("host_memory", "message", "problem"),
    [
        (True, common.AuxData.of(7, 0, 5, b"x" * 63), "of 63 bytes for a slot of 64"),
        (True, common.AuxData.of(7, 1, 5, b"x" * 64), "for aux buffer 1; this rank has 1"),
        (False, common.AuxData.of(7, 0, 5, b"x" * 64), "GPU memory"),
    ],
)
def test_aux_over_zmq_that_cannot_be_taken_fails_the_room_rather_than_leave_it_stale(
    host_memory: bool, message: common.AuxData, problem: str
) -> None:
    core = aux_protocol(host_memory)
    opened(core, 1, KVLayout.MHA)
    actions = core.handle(message, 2.0)
    room = core.room_status(7)
    assert room.poll == KVPoll.Failed
    assert room.failure_kind == FailureKind.INCOMPATIBLE
    assert problem in str(room.failure_reason)
    assert [type(s.message) for s in sends(actions)] == [common.AbortNotification]


def test_a_health_answer_after_a_death_does_not_bring_the_rank_back() -> None:
    core = protocol()
    opened(core, 1, KVLayout.MHA)
    now = 1.0
    while core.room_status(7).poll == KVPoll.Transferring:
        core.handle(Tick(()), now)
        now += 0.25
    dead = core.stats.peers_declared_dead
    core.handle(PrefillsAnswered((ENDPOINTS[0],)), now)  # a health answer racing the death
    for step in range(20):
        core.handle(Tick(()), now + 0.25 * step)
    assert core.stats.peers_declared_dead == dead  # not watched again, not declared twice
    assert not core.registered(ENDPOINTS[0])  # the next room registers again


def kv_args(
    pages: int = 8,
    slots: int = 4,
    dtype: type = np.uint16,
    state_dims: tuple[int, ...] | None = None,
) -> KVArgs:
    """A rank's cache; with `state_dims`, a Mamba state too (one buffer of 8 slots)."""
    kv = [np.zeros((pages, 16, 8, 128), dtype) for _ in range(4)]
    return KVArgs.from_numpy(
        kv,
        kv_layout=KVLayout.MHA,
        total_kv_heads=8,
        aux=[np.zeros((slots, 64), np.uint8)],
        state=[np.zeros((8, 32), np.uint8)] if state_dims is not None else [],
        state_dims=state_dims or (),
    )


@pytest.mark.parametrize(
    ("page_size", "dtype", "problem"),
    [
        (16, "auto", None),  # the model's dtype: bf16 here
        (16, "bf16", None),
        (16, "bfloat16", None),
        (32, "bf16", "pages of 32 tokens"),
        (16, "fp8_e4m3", "holds fp8_e4m3 KV"),
        (16, "mxfp8", "none of"),
    ],
)
def test_the_groups_page_size_and_dtype_must_be_this_ranks(
    page_size: int, dtype: str, problem: str | None
) -> None:
    found = group_problem(group(page_size, dtype), kv_args())
    assert found is None if problem is None else problem in (found or "")


def test_only_an_unquantized_rank_takes_a_groups_model_dtype() -> None:
    assert group_problem(group(16, "auto"), kv_args(dtype=np.float32)) is None
    assert "model's own dtype" in (group_problem(group(16, "auto"), kv_args(dtype=np.uint8)) or "")


def test_over_nixl_head_slices_between_tp_sizes_are_refused_before_registering() -> None:
    """sglang's NIXL prefill moves head slices between TP sizes only into GPU memory; toward
    host memory its listener would die at the registration."""
    two = group(16, "auto", tp=2)
    assert group_problem(two, kv_args()) is None  # Mooncake: token by token
    assert "only into GPU memory" in (group_problem(two, kv_args(), "nixl") or "")
    assert group_problem(group(16, "auto"), kv_args(), "nixl") is None


def test_a_mamba_state_an_sglang_prefill_cannot_move_is_refused_before_registering() -> None:
    # Between TP sizes sglang slices the state by the sizes decode publishes.
    two = group(16, "auto", tp=2)
    assert "state_dims" in (group_problem(two, kv_args(state_dims=())) or "")
    assert group_problem(two, kv_args(state_dims=(4,))) is None
    # sglang's NIXL backend registers state as GPU memory, on both sides.
    found = group_problem(group(16, "auto"), kv_args(state_dims=()), "nixl")
    assert "GPU memory" in (found or "")


def group(page_size: int, dtype: str, tp: int = 1) -> SGLangPrefillGroup:
    return SGLangPrefillGroup("h:1", tp, page_size, dtype, (tuple(ENDPOINTS[:tp]),))


@pytest.mark.parametrize(
    ("pages", "aux", "state", "problem"),
    [
        ([0, 7], 3, (), None),
        ([0, -1], 3, (), "0..7"),  # SKIPPED_PAGE means nothing to sglang
        ([8], 3, (), "0..7"),
        ([0], None, (), "aux slot"),
        ([0], 4, (), "aux slot"),
        ([0], 0, (1,), "no state buffers"),
    ],
)
def test_requests_an_sglang_prefill_cannot_check_are_refused_here(
    pages: list[int], aux: int | None, state: tuple[int, ...], problem: str | None
) -> None:
    found = sglang_request_problem(kv_args(), np.array(pages, np.int32), aux, state)
    assert found is None if problem is None else problem in (found or "")


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ((7,), None),
        ((), "one state slot in 0..7"),  # sglang's prefill writes one whatever is asked
        ((0, 1), "one state slot"),  # its Mamba state is one slot per room
        ((8,), "one state slot in 0..7"),
    ],
)
def test_a_hybrid_rooms_state_slot_is_checked_here(
    state: tuple[int, ...], problem: str | None
) -> None:
    hybrid = kv_args(state_dims=())
    found = sglang_request_problem(hybrid, np.array([0], np.int32), 0, state)
    assert found is None if problem is None else problem in (found or "")


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ({"decode_allocation_policy": "prefill_complete"}, "decode_allocation_policy"),
        ({"enable_kv_cache_sharding": True}, "shards"),
        ({"kv_layout": "nhd"}, "kv_layout"),
    ],
)
def test_group_settings_sglangs_decode_would_read_otherwise_are_refused(
    setting: dict[str, object], problem: str
) -> None:
    group = {
        "attn_tp_size": 1,
        "attn_cp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "page_size": 16,
        "kv_cache_dtype": "auto",
        "decode_allocation_policy": "early",
        "enable_kv_cache_sharding": False,
    }
    parse_group("h:1", group)
    with pytest.raises(ValueError, match=problem):
        parse_group("h:1", {**group, **setting})


def test_managers_sglang_peers_cannot_serve_are_refused_at_start() -> None:
    config = ManagerConfig(engine="mooncake", peer_protocol="sglang", secret=None)
    head_major = KVArgs.from_numpy(
        [np.zeros((4, 8, 16, 256), np.uint16)],
        kv_layout=KVLayout.MHA_HEAD_MAJOR,
        total_kv_heads=8,
    )
    with pytest.raises(ValueError, match="not MHA_HEAD_MAJOR"):
        DecodeManager(head_major, config)
    with pytest.raises(ValueError, match="not MHA_HEAD_MAJOR"):
        PrefillManager(head_major, dataclasses.replace(config, bootstrap_url="h:1"))
