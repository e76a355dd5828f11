"""Managers with real ZMQ sockets and a real bootstrap service in one process, moving bytes
with a real engine (NIXL): the state machine, chunking, slots and the failure paths."""

from __future__ import annotations

import dataclasses
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import numpy.typing as npt
import pytest
import zmq
from kv_cache import RankCache, as_torch, rank_cache
from prometheus_client.parser import text_string_to_metric_families
from real_engine import ENGINE, require_engine
from waiting import wait_for

from kvbridge.cache import TransferPlan
from kvbridge.config import ManagerConfig
from kvbridge.decode import DecodeManager, KVReceiver
from kvbridge.engines import PendingWrite, TransferHandle
from kvbridge.prefill import KVSender, PrefillManager, PrefillStats
from kvbridge.wire import (
    NATIVE,
    Abort,
    FailureKind,
    Heartbeat,
    KVLayout,
    KVPoll,
    Message,
)
from kvbridge.wire.native import NativeProfile

require_engine()
GEOMETRY = dict(
    layer_ids=(0, 1),
    page_size=4,
    total_kv_heads=2,
    head_dim=8,
    aux_slots=4,
    aux_item_bytes=(32,),
    state_slots=3,
    state_item_bytes=(128, 16),
)


@contextmanager
def pair(
    src: RankCache, dst: RankCache, **decode_config: float
) -> Iterator[tuple[PrefillManager, DecodeManager]]:
    prefill = PrefillManager(src.args, ManagerConfig(engine=ENGINE, run_bootstrap=True))
    config = ManagerConfig(engine=ENGINE, bootstrap_url=prefill.bootstrap_url, **decode_config)
    decode = DecodeManager(dst.args, config)
    try:
        yield prefill, decode
    finally:
        decode.close()
        prefill.close()


def finished(*rooms: KVSender | KVReceiver) -> Callable[[], bool]:
    return lambda: all(room.poll() in (KVPoll.Success, KVPoll.Failed) for room in rooms)


def move_from_groups(
    sources: list[RankCache], dst: RankCache, rooms: list[tuple[int, npt.ArrayLike, npt.ArrayLike]]
) -> None:
    """One prefill group (bootstrap service) per source and one decode rank; per group one
    room: (room, source pages, decode pages). Every room must succeed."""
    prefills = [
        PrefillManager(src.args, ManagerConfig(engine=ENGINE, run_bootstrap=True))
        for src in sources
    ]
    decode = DecodeManager(dst.args, ManagerConfig(engine=ENGINE))
    try:
        ends: list[KVSender | KVReceiver] = []
        for prefill, (room, src_pages, dst_pages) in zip(prefills, rooms, strict=True):
            receiver = decode.receiver(room, prefill.bootstrap_url)
            receiver.init(dst_pages)
            sender = prefill.sender(room)
            sender.send(src_pages, last=True)
            ends += [sender, receiver]
        wait_for(finished(*ends))
        assert all(end.poll() == KVPoll.Success for end in ends)
    finally:
        decode.close()
        for prefill in prefills:
            prefill.close()


def test_chunks_aux_and_state_arrive() -> None:
    src, dst = (
        rank_cache(num_pages=32, seed=11, **GEOMETRY),
        rank_cache(num_pages=40, seed=None, **GEOMETRY),
    )
    with pair(src, dst) as (prefill, decode):
        sender, receiver = prefill.sender(3), decode.receiver(3)
        assert receiver.poll() == KVPoll.WaitingForInput
        assert sender.poll() == KVPoll.Bootstrapping
        dst_pages = np.random.default_rng(1).permutation(40)[:12]
        receiver.init(dst_pages, aux_index=2, state_indices=[0])
        src_pages = np.r_[4:8, 20:28]
        sender.send(src_pages[:3])
        sender.send(src_pages[3:9])
        sender.send(src_pages[9:], last=True, aux_index=1, state_indices=[2])
        wait_for(finished(sender, receiver))
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
        assert sender.poll() == KVPoll.Success
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[dst_pages], want[src_pages])
    assert np.array_equal(dst.aux[0][2], src.aux[0][1])
    assert np.array_equal(dst.state[0][0], src.state[0][2])
    assert np.array_equal(dst.state[1][0], src.state[1][2])


def test_each_pipeline_stage_writes_its_layers_into_one_decode_rank() -> None:
    """A pipeline-parallel prefill (vLLM's connector): each stage is a prefill group of its
    own (its layers, bootstrap service and room) and one decode rank holding every layer
    opens a room with each stage; every layer arrives from the stage that holds it."""
    from kvbridge.integrations.vllm_requests import stage_room

    geometry = {
        **GEOMETRY,
        "aux_slots": 0,
        "aux_item_bytes": (),
        "state_slots": 0,
        "state_item_bytes": (),
    }
    stages = [
        rank_cache(num_pages=16, seed=20 + s, **{**geometry, "layer_ids": layers})
        for s, layers in enumerate([(0, 1), (2, 3)])
    ]
    dst = rank_cache(num_pages=16, seed=None, **{**geometry, "layer_ids": (0, 1, 2, 3)})
    src_pages, dst_pages = np.array([3, 9, 4]), np.array([7, 0, 12])
    move_from_groups(stages, dst, [(stage_room(41, s), src_pages, dst_pages) for s in (0, 1)])
    # Decode's buffers: K of layers 0-3, then V of layers 0-3; each stage's K then V.
    for index, got in enumerate(dst.kv):
        part, layer = divmod(index, 4)
        want = stages[layer // 2].kv[part * 2 + layer % 2]
        assert np.array_equal(got[dst_pages], want[src_pages]), index


def test_a_rooms_complete_notification_is_its_success_report() -> None:
    src, dst = rank_cache(seed=5, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    with pair(src, dst) as (prefill, decode):
        sender, receiver = prefill.sender(5), decode.receiver(5)
        receiver.init([7, 1, 4], aux_index=3)
        sender.send([2, 3, 0], last=True, aux_index=0)
        wait_for(finished(sender, receiver))
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
        # One transfer carried the whole room: its notification said it all, no status went.
        assert prefill.protocol.rooms[5].completed_by_notification == {decode.peer_id}
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[[7, 1, 4]], want[[2, 3, 0]])
    assert np.array_equal(dst.aux[0][3], src.aux[0][0])


def test_incompatible_geometry_fails_the_room_with_the_reason() -> None:
    src = rank_cache(num_pages=8, seed=1, **GEOMETRY)
    dst = rank_cache(num_pages=8, seed=None, **{**GEOMETRY, "head_dim": 16})
    with pair(src, dst) as (prefill, decode):
        sender, receiver = prefill.sender(1), decode.receiver(1)
        receiver.init([0, 1])
        sender.send([0, 1], last=True)
        wait_for(finished(sender, receiver))
        assert receiver.poll() == KVPoll.Failed
        assert "head_dim differs: 8 → 16" in str(receiver.failure_reason)
        assert "prefill rank 0" in str(receiver.failure_reason)
        # The kind prefill gave travels with the reason.
        assert receiver.failure_kind == FailureKind.INCOMPATIBLE


def test_decode_abort_reaches_prefill() -> None:
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    with pair(src, dst) as (prefill, decode):
        sender, receiver = prefill.sender(5), decode.receiver(5)
        receiver.init([0, 1])
        receiver.abort("request cancelled by the user")
        wait_for(lambda: sender.poll() == KVPoll.Failed)
        assert "request cancelled by the user" in str(sender.failure_reason)
        assert (sender.failure_kind, receiver.failure_kind) == (FailureKind.ABORTED,) * 2
        assert receiver.poll() == KVPoll.Failed
        sender.send([0, 1], last=True)  # too late: nothing is written, nothing raised
        assert sender.poll() == KVPoll.Failed


def test_decode_deadline_names_the_missing_rank() -> None:
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    with pair(src, dst, transfer_timeout_s=0.3) as (_, decode):
        receiver = decode.receiver(9)
        receiver.init([0, 1])  # prefill never sends
        wait_for(finished(receiver))
        assert receiver.poll() == KVPoll.Failed
        assert "deadline" in str(receiver.failure_reason)
        assert "[0]" in str(receiver.failure_reason)
        assert receiver.failure_kind == FailureKind.TIMEOUT


def test_garbage_on_the_control_socket_is_counted_and_survived() -> None:
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    with pair(src, dst) as (prefill, decode):
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.connect(prefill.channel.endpoint)
        for frames in ([b"garbage"], [b"KVBR\x01\x00\x02\x00", b"short"], [b""]):
            push.send_multipart(frames)
        wait_for(lambda: prefill.channel.stats.malformed == 3)
        push.close(linger=0)
        context.term()
        assert prefill.healthy
        sender, receiver = prefill.sender(2), decode.receiver(2)
        receiver.init([3])
        sender.send([5], last=True)
        wait_for(finished(sender, receiver))
        assert receiver.poll() == KVPoll.Success


def test_late_request_for_a_cleared_room_does_not_recreate_it() -> None:
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    with pair(src, dst) as (prefill, decode):
        sender = prefill.sender(4)
        sender.clear()
        sender.clear()  # idempotent
        receiver = decode.receiver(4)
        receiver.init([0])
        wait_for(finished(receiver))  # told at once, not at its deadline
        assert "already ended on prefill rank 0" in str(receiver.failure_reason)
        assert receiver.failure_kind == FailureKind.REFUSED
        assert 4 not in prefill.protocol.rooms
        with pytest.raises(ValueError, match="already ended"):
            prefill.sender(4)


def test_a_page_index_below_minus_one_or_a_chunk_out_of_place_is_refused_at_send() -> None:
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    with pair(src, dst) as (prefill, _):
        sender = prefill.sender(6)
        with pytest.raises(ValueError, match="page index -2 \\(only -1 marks a page not held\\)"):
            sender.send([-2, 3], last=True)
        for position in (-1, 1.5, "2"):
            with pytest.raises(ValueError, match="a chunk's position is a page position"):
                sender.send([3], position=position)  # type: ignore[arg-type]
        sender.send([3], position=1)
        with pytest.raises(ValueError, match=r"positions 1\.\.1 sent, but positions 1\.\.1 were"):
            sender.send([4], position=1)
        with pytest.raises(ValueError, match="no chunk sent the pages for position 0"):
            sender.send([5], last=True)


def test_two_prefill_groups_feed_one_decode_rank() -> None:
    """xPyD: rooms of one decode rank come from different prefill groups (bootstraps)."""
    sources = [rank_cache(num_pages=16, seed=seed, **GEOMETRY) for seed in (21, 22)]
    dst = rank_cache(num_pages=32, seed=None, **GEOMETRY)
    move_from_groups(
        sources,
        dst,
        [(room, np.arange(4, 8), np.arange(room * 8, room * 8 + 4)) for room in (0, 1)],
    )
    for room, src in enumerate(sources):
        for got, want in zip(dst.kv, src.kv, strict=True):
            assert np.array_equal(got[room * 8 : room * 8 + 4], want[4:8])


def move_two_to_one(
    sources: list[RankCache],
    dst: RankCache,
    config: ManagerConfig,
    dst_pages: npt.NDArray[np.int64],
    ring_bytes: int | None = None,
    prefix: int = 0,
) -> list[PrefillStats]:
    """TP 2 → 1: both prefill ranks send room pages 2-3, then 8-10 (the last chunk), into
    decode's `dst_pages` (after `prefix` tokens decode has); the room must succeed. The
    prefill ranks' stats."""
    first = PrefillManager(sources[0].args, dataclasses.replace(config, run_bootstrap=True))
    url = first.bootstrap_url
    second = PrefillManager(sources[1].args, dataclasses.replace(config, bootstrap_url=url))
    decode_config = dataclasses.replace(config, bootstrap_url=url)
    if ring_bytes is not None:
        decode_config = dataclasses.replace(decode_config, staging_bytes=ring_bytes)
    decode = DecodeManager(dst.args, decode_config)
    try:
        receiver = decode.receiver(1)
        receiver.init(dst_pages, decode_prefix_len=prefix)
        senders = [manager.sender(1) for manager in (first, second)]
        for sender in senders:
            sender.send(np.arange(2, 4))
            sender.send(np.arange(8, 11), last=True)
        wait_for(finished(receiver, *senders))
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
        return [first.stats, second.stats]
    finally:
        decode.close()
        first.close()
        second.close()


@pytest.mark.parametrize("kernels", ["numpy", "torch"])
@pytest.mark.parametrize(
    ("ring_bytes", "staged", "fallbacks"), [(1 << 20, 2, 0), (1024, 3, 0), (512, 5, 0)]
)
def test_two_prefill_ranks_into_one_decode_rank_through_the_ring(
    ring_bytes: int, staged: int, fallbacks: int, kernels: str
) -> None:
    """TP 2 → 1: each prefill rank sends its heads; staged through decode's ring, a chunk
    that cannot fit the ring in pieces that do (2 pages of 512 B of whole rows, 1), each
    counted as a chunk staged."""
    geometry = dict(layer_ids=(0, 1), page_size=4, total_kv_heads=4, head_dim=8)
    sources = [
        rank_cache(num_pages=16, seed=31 + rank, attn_tp_rank=rank, attn_tp_size=2, **geometry)
        for rank in range(2)
    ]
    dst = rank_cache(num_pages=24, seed=None, attn_tp_size=1, **geometry)
    if kernels == "torch":  # the same memory, described by torch tensors: torch kernels
        pytest.importorskip("torch", reason="torch staging kernels need torch")
        sources, dst = [as_torch(cache) for cache in sources], as_torch(dst)
    config = ManagerConfig(engine=ENGINE, staging_kernels=kernels)
    dst_pages = np.array([20, 3, 7, 11, 0])
    stats = move_two_to_one(sources, dst, config, dst_pages, ring_bytes)
    assert sum(s.staged_chunks for s in stats) == 2 * staged
    assert sum(s.staging_fallbacks for s in stats) == 2 * fallbacks
    src_pages = np.r_[2:4, 8:11]
    for rank, cache in enumerate(sources):
        for got, want in zip(dst.kv, cache.kv, strict=True):  # heads 2·rank, 2·rank + 1
            assert np.array_equal(got[dst_pages][:, :, 2 * rank : 2 * rank + 2], want[src_pages])


@pytest.mark.parametrize("prefix", [0, 4])
@pytest.mark.parametrize("staging", [True, False])
def test_positions_decode_skips_get_no_write_staged_or_not(staging: bool, prefix: int) -> None:
    """A decode request that skips room pages inside the room (-1: a merged room of several
    KV cache groups, one of which decode partly has), after a prefix or not: the other pages
    arrive in order, the skipped ones are written nowhere, through decode's ring and token
    by token."""
    geometry = dict(layer_ids=(0, 1), page_size=4, total_kv_heads=4, head_dim=8)
    sources = [
        rank_cache(num_pages=16, seed=51 + rank, attn_tp_rank=rank, attn_tp_size=2, **geometry)
        for rank in range(2)
    ]
    dst = rank_cache(num_pages=24, seed=None, attn_tp_size=1, **geometry)
    config = ManagerConfig(engine=ENGINE, staging=staging)
    # Room pages 2, 3, 8, 9, 10; decode needs 2 (unless in its prefix of a page), 8 and 9.
    wanted = [20, -1, 7, 11, -1]
    stats = move_two_to_one(sources, dst, config, np.array(wanted[prefix // 4 :]), None, prefix)
    assert sum(s.staged_chunks for s in stats) == (4 - (prefix > 0) * 2 if staging else 0)
    pairs = {7: 8, 11: 9} if prefix else {20: 2, 7: 8, 11: 9}  # decode page: prefill page
    written = np.zeros(24, dtype=bool)
    written[list(pairs)] = True
    for rank, cache in enumerate(sources):
        for got, want in zip(dst.kv, cache.kv, strict=True):
            heads = slice(2 * rank, 2 * rank + 2)
            assert np.array_equal(got[list(pairs)][:, :, heads], want[list(pairs.values())])
            assert not got[~written].any()  # nothing landed anywhere else


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_head_major_pages_move_by_head_slices_between_tp_sizes(
    prefill_tp: int, decode_tp: int
) -> None:
    """vLLM's CPU cache at different TP sizes: each decode rank gets its heads of every page
    (one block per page and layer, no staging ring), from every prefill rank that holds them."""
    geometry = dict(
        kv_layout=KVLayout.MHA_HEAD_MAJOR,
        layer_ids=(0, 1),
        page_size=4,
        total_kv_heads=4,
        head_dim=8,
    )
    sources = [
        rank_cache(
            num_pages=16, seed=41 + rank, attn_tp_rank=rank, attn_tp_size=prefill_tp, **geometry
        )
        for rank in range(prefill_tp)
    ]
    targets = [
        rank_cache(num_pages=24, seed=None, attn_tp_rank=rank, attn_tp_size=decode_tp, **geometry)
        for rank in range(decode_tp)
    ]
    config = ManagerConfig(engine=ENGINE)
    prefills = [PrefillManager(sources[0].args, dataclasses.replace(config, run_bootstrap=True))]
    url = prefills[0].bootstrap_url
    prefills += [
        PrefillManager(cache.args, dataclasses.replace(config, bootstrap_url=url))
        for cache in sources[1:]
    ]
    decodes = [
        DecodeManager(cache.args, dataclasses.replace(config, bootstrap_url=url))
        for cache in targets
    ]
    dst_pages = np.array([20, 3, 7, 11, 0])
    try:
        receivers = [manager.receiver(5) for manager in decodes]
        for receiver in receivers:
            receiver.init(dst_pages)
        senders = [manager.sender(5) for manager in prefills]
        for sender in senders:
            sender.send(np.arange(2, 4))
            sender.send(np.arange(8, 11), last=True)
        wait_for(finished(*receivers, *senders))
        for receiver in receivers:
            assert receiver.poll() == KVPoll.Success, receiver.failure_reason
        assert sum(m.stats.staged_chunks for m in prefills) == 0
    finally:
        for manager in (*decodes, *prefills):
            manager.close()
    src_pages = np.r_[2:4, 8:11]
    for rank, cache in enumerate(targets):  # [pages, heads, ...]: heads split over the ranks
        heads = 4 // decode_tp
        for layer in (0, 1):
            truth = np.concatenate([source.kv[layer][src_pages] for source in sources], axis=1)
            got = cache.kv[layer][dst_pages]
            assert np.array_equal(got, truth[:, rank * heads : (rank + 1) * heads])


def test_state_shards_move_from_two_prefill_ranks_to_one_decode_rank() -> None:
    """Hybrid state at different TP: each prefill rank writes its rows of the state slot."""
    geometry = dict(layer_ids=(0,), page_size=4, total_kv_heads=4, head_dim=8, state_slots=3)
    sources = [
        rank_cache(
            num_pages=8,
            seed=41 + rank,
            attn_tp_rank=rank,
            attn_tp_size=2,
            state_item_bytes=(32,),
            state_dims=(2,),
            **geometry,
        )
        for rank in range(2)
    ]
    dst = rank_cache(num_pages=8, seed=None, state_item_bytes=(64,), state_dims=(4,), **geometry)
    first = PrefillManager(sources[0].args, ManagerConfig(engine=ENGINE, run_bootstrap=True))
    url = first.bootstrap_url
    second = PrefillManager(sources[1].args, ManagerConfig(engine=ENGINE, bootstrap_url=url))
    decode = DecodeManager(dst.args, ManagerConfig(engine=ENGINE, bootstrap_url=url))
    try:
        receiver = decode.receiver(2)
        receiver.init([5, 6], state_indices=[1])
        senders = [manager.sender(2) for manager in (first, second)]
        for sender in senders:
            sender.send([0, 1], last=True, state_indices=[2])
        wait_for(finished(receiver, *senders))
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
    finally:
        decode.close()
        first.close()
        second.close()
    assert np.array_equal(dst.state[0][1][:32], sources[0].state[0][2])  # rows 0-1
    assert np.array_equal(dst.state[0][1][32:], sources[1].state[0][2])  # rows 2-3


def test_with_a_secret_unauthenticated_and_replayed_messages_are_refused() -> None:
    secret = b"a shared secret"
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    prefill = PrefillManager(
        src.args, ManagerConfig(engine=ENGINE, run_bootstrap=True, secret=secret)
    )
    decode = DecodeManager(
        dst.args,
        ManagerConfig(engine=ENGINE, bootstrap_url=prefill.bootstrap_url, secret=secret),
    )
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    try:
        push.connect(prefill.channel.endpoint)
        forged = Abort(room=6, decode_ip="127.0.0.1", decode_port=1, reason="forged")
        push.send_multipart(NATIVE.encode(forged))  # no tag
        signed = NATIVE.encode(Heartbeat("intruder", 1, 1000), secret=secret)
        push.send_multipart(signed)
        push.send_multipart(signed)  # the same bytes again: a replay
        wait_for(lambda: prefill.channel.stats.unauthenticated == 2)
        sender, receiver = prefill.sender(6), decode.receiver(6)
        receiver.init([0, 1])
        sender.send([2, 3], last=True)
        wait_for(finished(sender, receiver))
        assert receiver.poll() == KVPoll.Success  # the forged abort did nothing
        # An engine's notifications are not authenticated: with a secret, success comes
        # with the (authenticated) status, never from a notification alone.
        assert not prefill.protocol.rooms[6].completed_by_notification
    finally:
        push.close(linger=0)
        context.term()
        decode.close()
        prefill.close()


def test_pages_of_a_finished_room_are_safe() -> None:
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    with pair(src, dst) as (prefill, decode):
        sender, receiver = prefill.sender(3), decode.receiver(3)
        receiver.init([0])
        sender.send([1], last=True)
        wait_for(finished(sender, receiver))
        assert receiver.pages_safe
        idle = decode.receiver(4)
        idle.init([2])  # prefill never sends: abort, the idle prefill confirms at once
        idle.abort("no longer needed")
        wait_for(lambda: idle.pages_safe)


def test_the_next_transfer_is_set_up_while_the_current_one_is_posted() -> None:
    """NIXL over CMA copies inside the post call: the next transfer's set-up (descriptors,
    `initialize_xfer`) must not wait for that copy to end. The first post here is held until
    a second transfer has been set up; set up on the posting thread, it never would be."""
    src, dst = rank_cache(num_pages=16, seed=3, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    with pair(src, dst) as (prefill, decode):
        engine = prefill.engine
        real_prepare = engine.prepare_write
        set_ups: list[str] = []
        second_set_up = threading.Event()
        overlapped: list[bool] = []

        def prepare_write(peer: str, plan: TransferPlan, notify: bytes = b"") -> PendingWrite:
            pending = real_prepare(peer, plan, notify)
            set_ups.append(peer)
            if len(set_ups) == 2:
                second_set_up.set()
            if len(set_ups) > 1:
                return pending

            def held_start() -> TransferHandle:
                overlapped.append(second_set_up.wait(timeout=10))
                return pending.start()

            return PendingWrite(held_start, pending.release)

        engine.prepare_write = prepare_write  # type: ignore[method-assign]
        senders = [prefill.sender(room) for room in (1, 2)]
        receivers = [decode.receiver(room) for room in (1, 2)]
        receivers[0].init([0, 1])
        receivers[1].init([2, 3])
        senders[0].send([5, 6], last=True)
        senders[1].send([9, 12], last=True)
        wait_for(finished(*senders, *receivers))
        assert [room.poll() for room in receivers] == [KVPoll.Success] * 2
        assert overlapped == [True]
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[[0, 1, 2, 3]], want[[5, 6, 9, 12]])


def warm_up(prefill: PrefillManager, decode: DecodeManager) -> None:
    """A first room, 1: prefill's page 1 into decode's page 0."""
    sender, receiver = prefill.sender(1), decode.receiver(1)
    receiver.init([0])
    sender.send([1], last=True)
    wait_for(finished(sender, receiver))
    assert receiver.poll() == KVPoll.Success


def test_a_request_that_gives_an_idle_engine_a_write_waits_for_its_copy_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A burst of requests kept the GIL on the control channel's thread until every one was
    handled, and the first copy started only after them. The handler of a request that gives
    an idle engine its write returns once that write is posted (the wait is long here, so that
    this does not depend on the machine's speed)."""
    src, dst = rank_cache(num_pages=16, seed=4, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    with pair(src, dst) as (prefill, decode):
        warm_up(prefill, decode)  # the peer connected and its write lease in place
        monkeypatch.setattr("kvbridge.prefill.FIRST_POST_WAIT_S", 30.0)
        order: list[str] = []
        real_prepare = prefill.engine.prepare_write

        def prepare_write(peer: str, plan: TransferPlan, notify: bytes = b"") -> PendingWrite:
            pending = real_prepare(peer, plan, notify)

            def start() -> TransferHandle:
                order.append("posted")
                return pending.start()

            return PendingWrite(start, pending.release)

        real_handler = prefill.channel._on_message

        def handler(message: object) -> None:
            real_handler(message)  # type: ignore[arg-type]
            order.append(f"handled {type(message).__name__}")

        prefill.engine.prepare_write = prepare_write  # type: ignore[method-assign]
        prefill.channel._on_message = handler  # type: ignore[method-assign]
        sender, receiver = prefill.sender(2), decode.receiver(2)
        sender.send([5, 6, 7], last=True)  # waits for decode's request
        receiver.init([2, 3, 4])
        wait_for(finished(sender, receiver))
        assert receiver.poll() == KVPoll.Success
        assert order.index("posted") < order.index("handled TransferRequest")
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[[0, 2, 3, 4]], want[[1, 5, 6, 7]])


def test_the_first_room_while_none_transfers_sends_its_request_before_init_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scheduler opening a batch of rooms runs Python without blocking, and the control
    channel's thread sent their requests only after the batch. The first room opened while
    none transfers leaves before `init` returns (the wait is long here, so that this does not
    depend on the machine's speed); rooms opened while one transfers do not wait."""
    src, dst = rank_cache(num_pages=16, seed=6, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    with pair(src, dst) as (prefill, decode):
        warm_up(prefill, decode)  # registered
        wait_for(lambda: not decode.protocol.busy)  # and no room transfers
        monkeypatch.setattr("kvbridge.decode.FIRST_SEND_WAIT_S", 30.0)
        order: list[str] = []

        class RecordingProfile(NativeProfile):
            def encode(self, message: Message, *, secret: bytes | None = None) -> list[bytes]:
                order.append(f"sent {type(message).__name__}")
                return super().encode(message, secret=secret)

        monkeypatch.setattr("kvbridge.control.channel.NATIVE", RecordingProfile())
        senders = [prefill.sender(room) for room in (2, 3)]
        receivers = [decode.receiver(room) for room in (2, 3)]
        started = time.monotonic()
        receivers[0].init([2, 3])
        order.append("first init returned")
        receivers[1].init([4, 5])  # a room transfers now: no wait (30 s here)
        assert time.monotonic() - started < 10
        senders[0].send([5, 6], last=True)
        senders[1].send([7, 8], last=True)
        wait_for(finished(*senders, *receivers))
        assert [receiver.poll() for receiver in receivers] == [KVPoll.Success] * 2
        assert order.index("sent TransferRequest") < order.index("first init returned")
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[[0, 2, 3, 4, 5]], want[[1, 5, 6, 7, 8]])


def test_a_request_whose_write_waits_for_its_lease_does_not_hold_the_control_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A first request may come before decode answered a heartbeat: its write waits for the
    lease, whose answer the control channel's thread receives. That thread must not wait for
    such a write's copy (with this long wait it did, and the room failed without a lease)."""
    monkeypatch.setattr("kvbridge.prefill.FIRST_POST_WAIT_S", 30.0)
    src, dst = rank_cache(num_pages=16, seed=5, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    with pair(src, dst) as (prefill, decode):
        sender, receiver = prefill.sender(3), decode.receiver(3)
        receiver.init([4, 5])
        sender.send([2, 9], last=True)
        wait_for(finished(sender, receiver))
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[[4, 5]], want[[2, 9]])


def ends_wake(activity: threading.Event, ended: Callable[[], bool]) -> None:
    """Wait for `ended` the way vLLM's idle step does: clear, look, wait on the event. The
    end must set the event; one missed would time the wait out."""
    for _ in range(1000):
        activity.clear()
        if ended():
            return
        assert activity.wait(timeout=30), "the room ended without setting the activity event"
    raise AssertionError("woken 1000 times and the room never ended")


def test_the_activity_events_wake_a_waiter_when_rooms_end() -> None:
    src, dst = rank_cache(num_pages=16, seed=2, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    with pair(src, dst) as (prefill, decode):
        sender, receiver = prefill.sender(6), decode.receiver(6)
        receiver.init([5, 1, 7])
        sender.send([0, 9], last=False)
        sender.send([3], last=True)
        ends_wake(decode.activity, lambda: receiver.poll() == KVPoll.Success)
        ends_wake(prefill.activity, lambda: sender.pages_safe)
        aborted = decode.receiver(7)
        aborted.init([2])
        aborted.abort("the request ended on decode")  # prefill's acknowledgement wakes it
        ends_wake(decode.activity, lambda: aborted.pages_safe)


def test_a_prefill_room_without_a_request_fails_at_its_deadline() -> None:
    src = rank_cache(seed=1, **GEOMETRY)
    config = ManagerConfig(engine=ENGINE, run_bootstrap=True, request_timeout_s=0.3)
    prefill = PrefillManager(src.args, config)
    try:
        sender = prefill.sender(8)
        sender.send([0], last=True)  # decode never asks
        wait_for(lambda: sender.poll() == KVPoll.Failed, 5)
        assert "0 of any transfer request(s) from decode in 0.3 s" in str(sender.failure_reason)
        assert sender.failure_kind == FailureKind.TIMEOUT
    finally:
        prefill.close()


def test_a_decode_lease_keeps_a_room_past_its_deadline_until_decode_asks() -> None:
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    prefill = PrefillManager(
        src.args, ManagerConfig(engine=ENGINE, run_bootstrap=True, request_timeout_s=1.0)
    )
    decode = DecodeManager(
        dst.args, ManagerConfig(engine=ENGINE, bootstrap_url=prefill.bootstrap_url)
    )
    try:
        kept, dropped = prefill.sender(8), prefill.sender(9)
        for sender in (kept, dropped):
            sender.send([0, 1], last=True)
        for _ in range(12):  # 2.4 s, two deadlines: decode's request waits in its queue
            decode.renew_leases(prefill.bootstrap_url, [8])
            time.sleep(0.2)
        assert dropped.poll() == KVPoll.Failed
        assert dropped.failure_kind == FailureKind.TIMEOUT
        assert kept.poll() != KVPoll.Failed, kept.failure_reason
        receiver = decode.receiver(8)
        receiver.init([2, 3])
        wait_for(finished(kept, receiver))
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
        for got, want in zip(dst.kv, src.kv, strict=True):
            assert np.array_equal(got[[2, 3]], want[[0, 1]])
        # Once decode stops renewing, the room's deadline runs out a lease later.
        late = prefill.sender(10)
        late.send([0], last=True)
        decode.renew_leases(prefill.bootstrap_url, [10])
        wait_for(lambda: late.poll() == KVPoll.Failed, 5)
        assert "since decode's last lease renewal" in str(late.failure_reason)
    finally:
        decode.close()
        prefill.close()


def test_metrics_are_served_and_scraped() -> None:
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    prefill = PrefillManager(
        src.args, ManagerConfig(engine=ENGINE, run_bootstrap=True, metrics_port=0)
    )
    decode = DecodeManager(
        dst.args,
        ManagerConfig(engine=ENGINE, bootstrap_url=prefill.bootstrap_url, metrics_port=0),
    )
    try:
        for room, pages in ((1, [0, 1]), (2, [2])):
            sender, receiver = prefill.sender(room), decode.receiver(room)
            receiver.init(pages)
            if room == 1:
                sender.send([4, 5], last=True)
                wait_for(finished(sender, receiver))
            else:
                receiver.abort("cancelled")
                wait_for(lambda receiver=receiver: receiver.pages_safe)
            sender.clear()
            receiver.clear()
        scrape = {
            role: urllib.request.urlopen(f"http://127.0.0.1:{m.metrics.port}/metrics", timeout=5)
            .read()
            .decode()
            for role, m in (("prefill", prefill), ("decode", decode))
        }
    finally:
        decode.close()
        prefill.close()
    prefill_metrics, decode_metrics = samples(scrape["prefill"]), samples(scrape["decode"])
    on_prefill = frozenset({"role": "prefill", "rank": "0"}.items())
    on_decode = {"role": "decode", "rank": "0"}
    page_bytes = src.args.page_bytes
    assert prefill_metrics[("kvbridge_written_bytes_total", on_prefill)] == 2 * 4 * page_bytes
    assert prefill_metrics[("kvbridge_write_blocks_count", on_prefill)] == 1
    call_s = prefill_metrics[("kvbridge_engine_call_seconds_total", on_prefill)]
    assert 0 < prefill_metrics[("kvbridge_engine_call_wait_seconds_total", on_prefill)] <= call_s
    success = frozenset({**on_decode, "outcome": "Success", "kind": ""}.items())
    aborted = frozenset({**on_decode, "outcome": "Failed", "kind": "aborted"}.items())
    assert decode_metrics[("kvbridge_rooms_started_total", frozenset(on_decode.items()))] == 2
    assert prefill_metrics[("kvbridge_rooms_started_total", on_prefill)] == 2
    # Its one chunk (two pages, one run) went as page runs: the cost model's choice.
    direct = frozenset({**dict(on_prefill), "path": "direct", "reason": "cost"}.items())
    assert prefill_metrics[("kvbridge_chunks_written_total", direct)] == 1
    assert decode_metrics[("kvbridge_rooms_finished_total", success)] == 1
    assert decode_metrics[("kvbridge_rooms_finished_total", aborted)] == 1
    decode_labels = frozenset(on_decode.items())
    assert decode_metrics[("kvbridge_channel_malformed_total", decode_labels)] == 0
    assert decode_metrics[("kvbridge_heartbeats_missed_total", decode_labels)] == 0
    assert decode_metrics[("kvbridge_channel_received_total", decode_labels)] >= 2


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Prometheus text as {(sample name, labels): value}."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
