"""Layer-wise writes with real managers, sockets and a real engine (NIXL): a chunk handed over
layer range by layer range lands range by range in decode's pages, the room completes only
when every layer of every chunk landed, different TP sizes included, and an abort between
layers stops the rest."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from kv_cache import RankCache, rank_cache
from real_engine import ENGINE, require_engine
from waiting import wait_for

from kvbridge.config import ManagerConfig
from kvbridge.decode import DecodeManager
from kvbridge.prefill import PrefillManager
from kvbridge.wire import KVPoll
from kvbridge.write_gate import WriteGate

require_engine()
LAYERS = 4
GEOMETRY = dict(
    layer_ids=tuple(range(LAYERS)),
    page_size=4,
    total_kv_heads=2,
    head_dim=8,
    aux_slots=2,
    aux_item_bytes=(32,),
    state_slots=2,
    state_item_bytes=(64,),
)


@contextmanager
def managers(src: RankCache, dst: RankCache) -> Iterator[tuple[PrefillManager, DecodeManager]]:
    """A prefill rank serving its bootstrap and a decode rank of it, closed after."""
    prefill = PrefillManager(src.args, ManagerConfig(engine=ENGINE, run_bootstrap=True))
    decode = DecodeManager(
        dst.args, ManagerConfig(engine=ENGINE, bootstrap_url=prefill.bootstrap_url)
    )
    try:
        yield prefill, decode
    finally:
        decode.close()
        prefill.close()


def kv_index(layer: int, part: int = 0) -> int:
    """The KV buffer of a layer position: K of every layer, then V."""
    return part * LAYERS + layer


def test_each_layer_range_lands_as_it_is_sent_and_the_room_waits_for_the_last() -> None:
    src = rank_cache(num_pages=16, seed=5, **GEOMETRY)
    dst = rank_cache(num_pages=16, seed=None, **GEOMETRY)
    with managers(src, dst) as (prefill, decode):
        receiver, sender = decode.receiver(1), prefill.sender(1)
        dst_pages = np.array([9, 2, 14, 5, 0])
        receiver.init(dst_pages, aux_index=1, state_indices=[0])
        first, second = np.array([3, 4, 5]), np.array([10, 11])

        def landed(pages: np.ndarray, dst_at: np.ndarray, layer: int) -> bool:
            return all(
                np.array_equal(
                    dst.kv[kv_index(layer, part)][dst_at], src.kv[kv_index(layer, part)][pages]
                )
                for part in (0, 1)
            )

        sender.send(first, layers=range(0, 1))
        wait_for(lambda: landed(first, dst_pages[:3], 0))
        # Layer 0 of the first chunk is in place; nothing of the next layers yet, no success.
        assert not dst.kv[kv_index(1)][dst_pages].any()
        assert receiver.poll() == KVPoll.Transferring
        sender.send(first, layers=range(1, 4))
        wait_for(lambda: all(landed(first, dst_pages[:3], layer) for layer in range(LAYERS)))
        sender.send(second, layers=range(0, 2))
        sender.send(second, layers=range(2, 3))
        assert receiver.poll() == KVPoll.Transferring
        sender.send(second, layers=range(3, 4), last=True, aux_index=0, state_indices=[1])
        wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed))
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
        wait_for(lambda: sender.poll() == KVPoll.Success)
    pages = np.concatenate([first, second])
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[dst_pages], want[pages])
    assert np.array_equal(dst.aux[0][1], src.aux[0][0])
    assert np.array_equal(dst.state[0][0], src.state[0][1])


def test_a_page_list_streamed_at_its_place_and_the_lists_around_it_after_land_in_order() -> None:
    """Several page lists laid end to end (a sliding-window hybrid's KV cache groups): the
    middle one goes layer by layer behind gates first, at its position; the ones before and
    after it go whole once the forward ended, each at its own."""
    src = rank_cache(num_pages=16, seed=7, **GEOMETRY)
    dst = rank_cache(num_pages=16, seed=None, **GEOMETRY)
    with managers(src, dst) as (prefill, decode):
        receiver, sender = decode.receiver(1), prefill.sender(1)
        dst_pages = np.array([9, 2, 14, 5, 0, 7])
        receiver.init(dst_pages, aux_index=1, state_indices=[0])
        before, streamed, after = np.array([3, 4]), np.array([10, 11]), np.array([12, 6])
        gates = [WriteGate() for _ in range(LAYERS)]
        for layer, gate in enumerate(gates):
            sender.send(streamed, layers=range(layer, layer + 1), gate=gate, position=2)
        for gate in gates:
            gate.open()
        wait_for(
            lambda: np.array_equal(
                dst.kv[kv_index(3, 1)][[14, 5]], src.kv[kv_index(3, 1)][streamed]
            )
        )
        assert receiver.poll() == KVPoll.Transferring
        sender.send(before, position=0)
        sender.send(after, last=True, aux_index=0, state_indices=[1], position=4)
        wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed))
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
    pages = np.concatenate([before, streamed, after])
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[dst_pages], want[pages])
    assert np.array_equal(dst.state[0][0], src.state[0][1])


def test_two_prefill_ranks_write_their_heads_layer_by_layer_into_one_decode_rank() -> None:
    geometry = dict(layer_ids=tuple(range(LAYERS)), page_size=4, total_kv_heads=4, head_dim=8)
    sources = [
        rank_cache(num_pages=8, seed=21 + rank, attn_tp_rank=rank, attn_tp_size=2, **geometry)
        for rank in range(2)
    ]
    dst = rank_cache(num_pages=8, seed=None, **geometry)
    first = PrefillManager(sources[0].args, ManagerConfig(engine=ENGINE, run_bootstrap=True))
    url = first.bootstrap_url
    second = PrefillManager(sources[1].args, ManagerConfig(engine=ENGINE, bootstrap_url=url))
    decode = DecodeManager(dst.args, ManagerConfig(engine=ENGINE, bootstrap_url=url))
    dst_pages, src_pages = np.array([6, 1, 3]), np.array([0, 2, 5])
    try:
        receiver = decode.receiver(4)
        receiver.init(dst_pages)
        senders = [manager.sender(4) for manager in (first, second)]
        for start in range(LAYERS):
            for sender in senders:
                sender.send(src_pages, layers=range(start, start + 1), last=start == LAYERS - 1)
        wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed))
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
    finally:
        decode.close()
        first.close()
        second.close()
    for rank, source in enumerate(sources):
        for got, want in zip(dst.kv, source.kv, strict=True):  # heads 2·rank, 2·rank + 1
            assert np.array_equal(got[dst_pages][:, :, 2 * rank : 2 * rank + 2], want[src_pages])


def test_an_abort_between_layers_ends_the_room_and_the_rest_is_never_written() -> None:
    src = rank_cache(num_pages=8, seed=7, **GEOMETRY)
    dst = rank_cache(num_pages=8, seed=None, **GEOMETRY)
    with managers(src, dst) as (prefill, decode):
        receiver, sender = decode.receiver(2), prefill.sender(2)
        receiver.init([4, 5])
        sender.send([0, 1], layers=range(0, 2))
        wait_for(lambda: np.array_equal(dst.kv[kv_index(1)][[4, 5]], src.kv[kv_index(1)][[0, 1]]))
        receiver.abort("the user went away")
        wait_for(lambda: sender.poll() == KVPoll.Failed)
        assert "the user went away" in str(sender.failure_reason)
        sender.send([0, 1], layers=range(2, 4), last=True)  # too late: nothing is written
        wait_for(lambda: receiver.pages_safe)
        assert receiver.poll() == KVPoll.Failed
    assert not dst.kv[kv_index(2)][[4, 5]].any()
    assert not dst.kv[kv_index(3, part=1)][[4, 5]].any()


def test_gated_layers_go_as_their_gates_open_and_the_last_completes_the_room_by_itself() -> None:
    """Every layer handed over before the forward, each behind its gate: nothing is written
    before a gate opens, each layer lands once its gate opened, and the last layer's write
    (handed out while the others were still out) completes the room with its notification."""
    src = rank_cache(num_pages=8, seed=9, **GEOMETRY)
    dst = rank_cache(num_pages=8, seed=None, **GEOMETRY)
    src_pages, dst_pages = np.array([2, 3, 6]), np.array([7, 0, 4])

    def landed(layer: int) -> bool:
        return all(
            np.array_equal(
                dst.kv[kv_index(layer, part)][dst_pages], src.kv[kv_index(layer, part)][src_pages]
            )
            for part in (0, 1)
        )

    with managers(src, dst) as (prefill, decode):
        receiver, sender = decode.receiver(3), prefill.sender(3)
        receiver.init(dst_pages, aux_index=0)
        gates = [WriteGate() for _ in range(LAYERS)]
        for layer, gate in enumerate(gates):
            last = layer == LAYERS - 1
            sender.send(
                src_pages,
                layers=range(layer, layer + 1),
                last=last,
                aux_index=1 if last else None,
                gate=gate,
            )
        time.sleep(0.2)  # set up and held: nothing moves
        assert not any(array[dst_pages].any() for array in dst.kv)
        assert receiver.poll() in (KVPoll.WaitingForInput, KVPoll.Transferring)
        gates[0].open()
        wait_for(lambda: landed(0))
        time.sleep(0.1)
        assert not dst.kv[kv_index(1)][dst_pages].any()
        for gate in gates[1:-1]:
            gate.open()
        # Their ends reported: the last layer's post finds nothing else of the room out.
        wait_for(lambda: prefill.protocol.jobs.open_in(3) == 1)
        gates[-1].open()
        wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed))
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
        wait_for(lambda: sender.poll() == KVPoll.Success)
        assert prefill.protocol.rooms[3].completed_by_notification == {decode.peer_id}
    assert all(landed(layer) for layer in range(LAYERS))
    assert np.array_equal(dst.aux[0][0], src.aux[0][1])


def test_an_abort_while_layers_wait_behind_their_gates_drops_them_unwritten() -> None:
    """A prefill stopped mid-forward: its room is aborted with layers set up behind gates that
    never open. They are dropped, nothing of them lands, both sides' pages are safe, and the
    next room's writes (queued behind them) go."""
    src = rank_cache(num_pages=8, seed=11, **GEOMETRY)
    dst = rank_cache(num_pages=8, seed=None, **GEOMETRY)
    with managers(src, dst) as (prefill, decode):
        receiver, sender = decode.receiver(5), prefill.sender(5)
        receiver.init([1, 2])
        gates = [WriteGate() for _ in range(LAYERS)]
        for layer, gate in enumerate(gates):
            sender.send([0, 1], layers=range(layer, layer + 1), last=layer == LAYERS - 1, gate=gate)
        gates[0].open()
        wait_for(lambda: np.array_equal(dst.kv[kv_index(0)][[1, 2]], src.kv[kv_index(0)][[0, 1]]))
        next_receiver, next_sender = decode.receiver(6), prefill.sender(6)
        next_receiver.init([5])
        next_sender.send([4], last=True)  # behind the held layers
        sender.abort("the forward stopped")
        wait_for(lambda: sender.pages_safe and receiver.pages_safe)
        assert receiver.poll() == KVPoll.Failed
        wait_for(lambda: next_receiver.poll() in (KVPoll.Success, KVPoll.Failed))
        assert next_receiver.poll() == KVPoll.Success, next_receiver.failure_reason
        for gate in gates[1:]:
            gate.open()  # too late: nothing was kept to write
        time.sleep(0.1)
    for layer in range(1, LAYERS):
        assert not dst.kv[kv_index(layer)][[1, 2]].any()
        assert not dst.kv[kv_index(layer, part=1)][[1, 2]].any()
    assert np.array_equal(dst.kv[kv_index(2)][5], src.kv[kv_index(2)][4])
