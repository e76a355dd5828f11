"""Data parallelism beside SGLang 0.5.23: a room's DP rank in an SGLang prefill group, decided
as sglang's decode decides it (`_resolve_prefill_dp_rank`), sglang's `/query_dp_ranks` answers
checked, and kvbridge's bootstrap serving an instance of several DP ranks and their rooms."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

import numpy as np
import pytest

from kvbridge import DataParallel, DecodeManager, KVArgs, KVLayout, ManagerConfig
from kvbridge.control import sglang_dp
from kvbridge.control.bootstrap import Reply
from kvbridge.control.sglang_bootstrap import SGLangPrefillGroup, parse_group
from kvbridge.control.sglang_dp import (
    ROOM_ENTRY_S,
    RoomDPRanks,
    parse_dp_ranks,
)
from kvbridge.control.sglang_routes import SGLangBootstrapService, SGLangPrefillRank

GROUP = {
    "attn_tp_size": 2,
    "attn_cp_size": 1,
    "dp_size": 4,
    "pp_size": 1,
    "page_size": 16,
    "kv_cache_dtype": "auto",
    "follow_bootstrap_room": False,
}


def group(dp_size: int, follow: bool) -> SGLangPrefillGroup:
    endpoints = tuple(
        tuple(f"tcp://10.0.0.{dp}:{7000 + rank}" for rank in range(2)) for dp in range(dp_size)
    )
    return SGLangPrefillGroup("h:1", 2, 16, "auto", endpoints, follow)


def test_a_rooms_dp_rank_is_given_the_only_one_its_modulo_or_asked() -> None:
    assert group(1, False).dp_rank_of(13) == 0  # one DP rank: nothing to ask
    assert group(4, True).dp_rank_of(13) == 1  # sglang's default: room modulo DP size
    assert group(4, False).dp_rank_of(13) is None  # round robin and the like: ask
    assert group(4, False).dp_rank_of(13, given=3) == 3  # the router said (disagg_prefill_dp_rank)
    assert group(4, True).dp_rank_of(13, given=2) == 2  # given beats the modulo, as in sglang
    assert group(4, True).dp_rank_of(13, force_query=True) is None  # sglang's mixed routing
    with pytest.raises(ValueError, match="DP rank 4: the SGLang group at h:1 has 4"):
        group(4, True).dp_rank_of(13, given=4)
    assert group(2, True).every_endpoint == (
        "tcp://10.0.0.0:7000",
        "tcp://10.0.0.0:7001",
        "tcp://10.0.0.1:7000",
        "tcp://10.0.0.1:7001",
    )


def test_a_groups_dp_settings_are_read_and_checked() -> None:
    settings = parse_group("h:1", GROUP)
    assert (settings["dp_size"], settings["follow_bootstrap_room"]) == (4, False)
    # sglang's server answers follow_bootstrap_room always; an answer without it follows.
    assert parse_group("h:1", {k: v for k, v in GROUP.items() if k != "follow_bootstrap_room"})[
        "follow_bootstrap_room"
    ]
    for broken in ({"dp_size": 0}, {"dp_size": 5000}, {"dp_size": True}):
        with pytest.raises(ValueError, match="dp_size"):
            parse_group("h:1", {**GROUP, **broken})
    with pytest.raises(ValueError, match="follow_bootstrap_room must be a bool"):
        parse_group("h:1", {**GROUP, "follow_bootstrap_room": "yes"})
    with pytest.raises(ValueError, match="attn_cp_size 2"):
        parse_group("h:1", {**GROUP, "attn_cp_size": 2})


@pytest.mark.parametrize(
    ("answer", "found"),
    [
        ({}, {}),  # none registered yet: asked again
        ({"7": 1}, {7: 1}),
        ({"7": 1, "8": 3, "99": 0}, {7: 1, 8: 3}),  # a room not asked for is not taken
    ],
)
def test_query_answers_name_the_rooms_asked(answer: dict[str, int], found: dict[int, int]) -> None:
    assert parse_dp_ranks(answer, [7, 8], 4) == found


@pytest.mark.parametrize("rank", [4, -1, "1", True])
def test_a_rank_outside_the_group_fails_that_room_alone(rank: Any) -> None:
    assert parse_dp_ranks({"7": rank, "8": 2}, [7, 8], 4) == {
        7: f"named DP rank {rank!r} for it, of a group of 4",
        8: 2,
    }


def test_an_answer_that_is_not_sglangs_is_refused_whole() -> None:
    with pytest.raises(ValueError, match="JSON object"):
        parse_dp_ranks([7, 1], [7], 4)


def rank_document(dp: int, tp: int = 0, follow: bool = False, **changes: object) -> bytes:
    rank = SGLangPrefillRank(tp, 1, "10.0.0.1", 7000 + 10 * dp + tp, 16, "auto", dp, 2, follow)
    return json.dumps({**rank.document(), **changes}).encode()


def ask(
    service: SGLangBootstrapService,
    path: str,
    method: str = "GET",
    body: Any = b"",
    now: float = 0.0,
) -> Reply:
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    return service.handle(method, path, {}, body, "10.0.0.9", now)


QUERY = "/route?prefill_dp_rank={}&prefill_cp_rank={}&target_tp_rank={}&target_pp_rank={}"


def test_the_bootstrap_serves_an_instance_of_two_dp_ranks_and_their_rooms() -> None:
    service = SGLangBootstrapService()
    assert ask(service, "/route", "PUT", rank_document(0)).status == HTTPStatus.OK
    assert ask(service, QUERY.format(-1, -1, -1, -1)).status == HTTPStatus.SERVICE_UNAVAILABLE
    # A DP rank of another instance (following rooms, the first does not): refused.
    assert ask(service, "/route", "PUT", rank_document(1, follow=True)).status == 409
    assert ask(service, "/route", "PUT", rank_document(2)).status == HTTPStatus.BAD_REQUEST
    assert ask(service, "/route", "PUT", rank_document(1)).status == HTTPStatus.OK
    info = ask(service, QUERY.format(-1, -1, -1, -1)).document
    assert (info["dp_size"], info["follow_bootstrap_room"]) == (2, False)
    assert ask(service, QUERY.format(1, 0, 0, 0)).document == {
        "rank_ip": "10.0.0.1",
        "rank_port": 7010,
    }
    assert ask(service, QUERY.format(2, 0, 0, 0)).status == HTTPStatus.NOT_FOUND
    # Rooms: registered by the rank that took them, asked in a batch by decode.
    for room, dp in ((7, 1), (8, 0)):
        body = {"bootstrap_room": room, "dp_rank": dp}
        assert ask(service, "/register_dp_rank", "POST", body).status == HTTPStatus.OK
    answer = ask(service, "/query_dp_ranks", "POST", {"bootstrap_rooms": [7, 8, 9]})
    assert answer.document == {"7": 1, "8": 0}
    # Kept as long as sglang keeps them.
    later = ask(service, "/query_dp_ranks", "POST", {"bootstrap_rooms": [7]}, ROOM_ENTRY_S + 1)
    assert later.document == {}
    assert ask(service, "/query_dp_ranks").status == HTTPStatus.METHOD_NOT_ALLOWED


@pytest.mark.parametrize(
    ("route", "body", "problem"),
    [
        ("/register_dp_rank", b"{", "Expecting"),
        ("/register_dp_rank", [1], "JSON object"),
        ("/register_dp_rank", {"bootstrap_room": 7}, "dp_rank must be"),
        ("/register_dp_rank", {"bootstrap_room": -7, "dp_rank": 0}, "bootstrap_room must be"),
        ("/register_dp_rank", {"bootstrap_room": 2**64, "dp_rank": 0}, "bootstrap_room must"),
        ("/register_dp_rank", {"bootstrap_room": 10**4000, "dp_rank": 0}, "bootstrap_room"),
        ("/register_dp_rank", {"bootstrap_room": 7, "dp_rank": True}, "dp_rank must be"),
        ("/register_dp_rank", {"bootstrap_room": 7, "dp_rank": 2}, "from 0 to 1, got 2"),
        ("/query_dp_ranks", {"bootstrap_rooms": 7}, "a list"),
        ("/query_dp_ranks", {"bootstrap_rooms": ["7"]}, "must be an integer"),
    ],
)
def test_room_bodies_sglang_would_not_send_get_a_400(route: str, body: Any, problem: str) -> None:
    service = SGLangBootstrapService()
    for dp in range(2):  # an instance of two DP ranks: rank 2 is outside it
        assert ask(service, "/route", "PUT", rank_document(dp)).status == HTTPStatus.OK
    reply = ask(service, route, "POST", body)
    assert reply.status == HTTPStatus.BAD_REQUEST
    assert problem in reply.document["error"]


def test_sglangs_switch_for_mixed_routing_is_read_as_sglang_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for value, on in (("1", True), ("true", True), ("0", False), ("false", False), ("", False)):
        monkeypatch.setenv(sglang_dp.FORCE_QUERY_VARIABLE, value)
        assert sglang_dp.force_query() is on


def test_a_flood_of_rooms_keeps_only_the_newest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_dp, "MAX_ROOM_ENTRIES", 3)
    table = RoomDPRanks()
    for room in range(5):
        body = json.dumps({"bootstrap_room": room, "dp_rank": 0}).encode()
        table.handle("/register_dp_rank", body, 0.0, 1)
    assert len(table) == 3
    answer = table.handle("/query_dp_ranks", b'{"bootstrap_rooms": [0, 1, 2, 3, 4]}', 0.0, 1)
    assert answer.document == {"2": 0, "3": 0, "4": 0}


def test_data_parallel_settings_that_cannot_work_are_refused_at_start() -> None:
    with pytest.raises(ValueError, match="data_parallel rank 2 of 2"):
        DataParallel(2, 2)
    with pytest.raises(ValueError, match="SGLang prefill instance's"):
        ManagerConfig(engine="mooncake", data_parallel=DataParallel(0, 2), secret=None)
    assert not DataParallel(0, 2).registers_rooms(force_query=False)  # follows rooms
    assert DataParallel(0, 2).registers_rooms(force_query=True)  # sglang's mixed routing
    assert DataParallel(1, 2, follow_bootstrap_room=False).registers_rooms(force_query=False)
    assert not DataParallel().registers_rooms(force_query=True)  # one DP rank: nothing to ask
    # Following rooms, a room whose number names another DP rank is sglang's conflict.
    assert DataParallel(1, 2).room_problem(7, force_query=False) is None
    conflict = DataParallel(1, 2).room_problem(8, force_query=False)
    assert "bootstrap room 8 implies DP rank 0" in str(conflict)
    assert DataParallel(1, 2).room_problem(8, force_query=True) is None
    assert DataParallel(1, 2, follow_bootstrap_room=False).room_problem(8, False) is None
    config = ManagerConfig(
        engine="mooncake", peer_protocol="sglang", data_parallel=DataParallel(1, 2), secret=None
    )
    args = KVArgs.from_numpy(
        [np.zeros((4, 16, 8, 128), np.uint16)] * 2, kv_layout=KVLayout.MHA, total_kv_heads=8
    )
    with pytest.raises(ValueError, match="places a prefill rank"):
        DecodeManager(args, config)
