"""Data parallelism beside SGLang through real HTTP: a decode rank asks kvbridge's SGLang
bootstrap (as it would sglang's) which DP rank took a room, in the background, until it is
registered or the bootstrap timeout passed; a prefill DP rank that cannot register a room fails
it at once. (Whole transfers with sglang's real managers: tests/sglang_compat/test_live_peers.py.)
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
from waiting import wait_for

from kvbridge import (
    DataParallel,
    DecodeManager,
    FailureKind,
    KVArgs,
    KVLayout,
    KVPoll,
    ManagerConfig,
    PrefillManager,
)
from kvbridge.control import sglang_dp
from kvbridge.control.bootstrap import BootstrapServer
from kvbridge.control.sglang_dp import DPRankQueries, query_dp_ranks, register_dp_rank
from kvbridge.control.sglang_routes import (
    SGLangBootstrapService,
    SGLangPrefillRank,
    register_sglang_prefill,
)
from kvbridge.engines import unavailable_reason

if unavailable_reason("nixl") is not None:
    pytest.skip(f"NIXL cannot be used here: {unavailable_reason('nixl')}", allow_module_level=True)


@pytest.fixture
def bootstrap() -> Iterator[BootstrapServer]:
    """kvbridge's SGLang bootstrap with an instance of two DP ranks (TP 1) registered, whose
    rooms are spread by round robin."""
    server = BootstrapServer(service=SGLangBootstrapService()).start()
    address = server.url.removeprefix("http://")
    for dp in range(2):
        rank = SGLangPrefillRank(0, 1, "127.0.0.1", 17000 + dp, 16, "auto", dp, 2, False)
        register_sglang_prefill(address, rank, timeout_s=10)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def instance(bootstrap: BootstrapServer) -> str:
    """The bootstrap's `host:port`, as SGLang addresses it."""
    return bootstrap.url.removeprefix("http://")


def test_a_room_is_answered_once_registered_and_an_unregistered_one_fails_with_why(
    instance: str,
) -> None:
    answers: dict[int, tuple[int | None, str | None]] = {}
    told = threading.Event()

    def answer(room: int):  # type: ignore[no-untyped-def]
        def take(rank: int | None, reason: str | None) -> None:
            answers[room] = (rank, reason)
            if len(answers) == 2:
                told.set()

        return take

    queries = DPRankQueries(timeout_s=1.0)
    try:
        queries.ask(instance, 7, 2, answer(7))
        queries.ask(instance, 8, 2, answer(8))
        time.sleep(0.2)  # asked, not registered yet: asked again
        register_dp_rank(instance, 7, 1)
        assert told.wait(10)
    finally:
        queries.close()
    assert answers[7] == (1, None)
    rank, reason = answers[8]
    assert rank is None
    assert f"{instance} named no DP rank for room 8 within 1 s" in str(reason)
    assert "not registered yet" in str(reason)


def test_a_service_that_is_gone_fails_the_room_with_its_error() -> None:
    answers: list[tuple[int | None, str | None]] = []
    queries = DPRankQueries(timeout_s=0.5)
    try:
        queries.ask("127.0.0.1:9", 7, 2, lambda rank, reason: answers.append((rank, reason)))
        wait_for(lambda: answers, timeout_s=10)
    finally:
        queries.close()
    assert answers[0][0] is None
    assert "URLError" in str(answers[0][1])


def decode_args() -> KVArgs:
    return KVArgs.from_numpy(
        [np.zeros((8, 16, 2, 64), np.uint16) for _ in range(4)],
        kv_layout=KVLayout.MHA,
        total_kv_heads=2,
    )


def test_a_receiver_waits_for_its_dp_rank_and_opens_the_room_it_was_given_then(
    instance: str,
) -> None:
    config = ManagerConfig(
        engine="nixl",
        peer_protocol="sglang",
        bootstrap_timeout_s=2.0,
        peer_timeout_s=1.0,  # close gives the room open toward nobody up sooner
        secret=None,
    )
    manager = DecodeManager(decode_args(), config)
    try:
        waiting = manager.receiver(5, instance)
        never = manager.receiver(6, instance)
        given = manager.receiver(9, instance, prefill_dp_rank=0)  # the router said
        assert given.poll() == KVPoll.WaitingForInput
        for receiver in (waiting, never):
            assert receiver.poll() == KVPoll.Bootstrapping
            receiver.init(np.arange(2), aux_index=None)  # kept until the rank is known
        register_dp_rank(instance, 5, 1)
        # Open toward DP rank 1 (nobody listens there: the request waits on its own deadline).
        wait_for(lambda: waiting.poll() == KVPoll.Transferring, timeout_s=10)
        assert manager.protocol.registered("tcp://127.0.0.1:17001")  # DP rank 1's
        assert manager.room_status(5) is not None
        wait_for(lambda: never.poll() == KVPoll.Failed, timeout_s=10)
        assert never.failure_kind == FailureKind.BOOTSTRAP
        assert "named no DP rank for room 6 within 2 s" in str(never.failure_reason)
        assert manager.room_status(6) is None  # never opened
    finally:
        manager.close()


def test_a_prefill_dp_rank_that_cannot_register_a_room_fails_it_at_once(
    bootstrap: BootstrapServer, instance: str
) -> None:
    config = ManagerConfig(
        engine="nixl",
        peer_protocol="sglang",
        bootstrap_url=instance,
        data_parallel=DataParallel(1, 2, follow_bootstrap_room=False),
        secret=None,
    )
    # DP rank 1 of the instance (its registration replaces the fixture's).
    manager = PrefillManager(decode_args(), config)
    try:
        taken = manager.sender(3)
        assert taken.poll() == KVPoll.Bootstrapping  # registered: decode can find it
        assert query_dp_ranks(instance, [3], 2) == {3: 1}
        bootstrap.close()  # the bootstrap is gone from here on
        lost = manager.sender(4)
        assert lost.poll() == KVPoll.Failed
        assert "room 4: could not register its DP rank" in str(lost.failure_reason)
        assert taken.poll() == KVPoll.Bootstrapping  # the other room goes on
    finally:
        manager.close()


def test_rooms_given_up_or_cleared_while_asked_never_open_and_closing_answers_the_rest(
    instance: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ManagerConfig(
        engine="nixl", peer_protocol="sglang", bootstrap_timeout_s=30, secret=None
    )
    manager = DecodeManager(decode_args(), config)
    closed = False
    try:
        aborted, cleared, broken, left = (manager.receiver(room, instance) for room in (1, 2, 3, 4))
        for receiver in (aborted, cleared, broken, left):
            receiver.init(np.arange(2))
        aborted.abort("the scheduler gave up on it")
        cleared.clear()  # the scheduler freed its pages before the answer
        real_route = manager.route_to

        def failing_route(url: str, dp_rank: int = 0):  # type: ignore[no-untyped-def]
            if dp_rank == 0:
                raise RuntimeError("no way")
            return real_route(url, dp_rank)

        monkeypatch.setattr(manager, "route_to", failing_route)
        for room, dp in ((1, 1), (2, 1), (3, 0)):
            register_dp_rank(instance, room, dp)
        wait_for(lambda: broken.poll() == KVPoll.Failed, timeout_s=10)
        assert broken.failure_kind == FailureKind.INTERNAL
        assert "RuntimeError: no way" in str(broken.failure_reason)
        time.sleep(0.3)  # the answers for rooms 1 and 2 came too
        assert aborted.failure_kind == FailureKind.ABORTED
        assert manager.room_status(1) is None
        assert manager.room_status(2) is None
        assert left.poll() == KVPoll.Bootstrapping  # room 4 was never registered
        manager.close()
        closed = True
        assert left.poll() == KVPoll.Failed
        assert "this decode rank is closing" in str(left.failure_reason)
    finally:
        if not closed:
            manager.close()


def test_more_rooms_than_one_body_holds_are_all_asked(
    instance: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sglang_dp, "MAX_ROOMS_PER_QUERY", 2)
    for room in range(5):
        register_dp_rank(instance, room, room % 2)
    answers: dict[int, int | None] = {}
    queries = DPRankQueries(timeout_s=5.0)
    try:
        for room in range(5):
            queries.ask(instance, room, 2, lambda rank, _, room=room: answers.update({room: rank}))
        wait_for(lambda: len(answers) == 5, timeout_s=10)
    finally:
        queries.close()
    assert answers == {room: room % 2 for room in range(5)}


def test_a_prefill_dp_rank_following_rooms_refuses_a_room_another_rank_owns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = BootstrapServer(service=SGLangBootstrapService()).start()
    instance = server.url.removeprefix("http://")
    rank = SGLangPrefillRank(0, 1, "127.0.0.1", 17000, 16, "auto", 0, 2, True)
    register_sglang_prefill(instance, rank, timeout_s=10)  # DP rank 0, rooms by number
    config = ManagerConfig(
        engine="nixl",
        peer_protocol="sglang",
        bootstrap_url=instance,
        data_parallel=DataParallel(1, 2),  # rooms follow their numbers
        secret=None,
    )
    manager = PrefillManager(decode_args(), config)
    try:
        assert manager.sender(3).poll() == KVPoll.Bootstrapping  # 3 % 2 == 1: its own
        wrong = manager.sender(4)
        assert wrong.poll() == KVPoll.Failed
        assert "bootstrap room 4 implies DP rank 0" in str(wrong.failure_reason)
        # sglang's switch for mixed routing: the room is taken, and registered for decode.
        monkeypatch.setenv(sglang_dp.FORCE_QUERY_VARIABLE, "1")
        assert manager.sender(6).poll() == KVPoll.Bootstrapping
        assert query_dp_ranks(instance, [3, 6], 2) == {6: 1}
    finally:
        manager.close()
        server.close()


def test_a_large_batch_of_rooms_is_answered_and_only_that_route_takes_such_a_body(
    instance: str,
) -> None:
    # sglang's decode asks for every pending room at once: ~9000 rooms of 20 digits.
    rooms = [2**63 + room for room in range(9000)]
    register_dp_rank(instance, rooms[-1], 1)
    assert query_dp_ranks(instance, rooms, 2) == {rooms[-1]: 1}
    with pytest.raises(urllib.error.HTTPError, match="413"):
        query_dp_ranks(instance, [2**63 + room for room in range(20000)], 2)
    big = json.dumps({"bootstrap_room": 1, "dp_rank": 0, "pad": "x" * 8000}).encode()
    request = urllib.request.Request(f"http://{instance}/register_dp_rank", data=big, method="POST")
    with pytest.raises(urllib.error.HTTPError, match="413"):
        urllib.request.urlopen(request, timeout=5)
