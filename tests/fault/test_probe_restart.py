"""Issue 11, finding 6: restarts rejoin, and rooms used twice or aborted early end at once.

- A prefill rank closed and started again (new process state, new port) registers at once
  (its old registration was withdrawn), and decode, having declared the old endpoint dead,
  looks the group up again and moves the next room through the new rank.
- A registration that is never renewed (a rank killed without closing) expires with its
  lease, and the next rank 0 gets in.
- A second request for a room that already ended is answered Failed at once, with why.
- An abort before `init()` reaches prefill: its room fails at once instead of waiting out
  `request_timeout_s`.
"""

from __future__ import annotations

import time

import numpy as np
from kv_cache import rank_cache
from real_engine import ENGINE, require_engine
from waiting import wait_for

from kvbridge.config import ManagerConfig
from kvbridge.control.bootstrap import BootstrapServer, PrefillRank, register_prefill
from kvbridge.decode import DecodeManager
from kvbridge.prefill import PrefillManager
from kvbridge.wire import KVPoll

require_engine()
GEOMETRY = dict(layer_ids=(0, 1), page_size=4, total_kv_heads=2, head_dim=8)
FAST = dict(engine=ENGINE, heartbeat_interval_s=0.1, peer_timeout_s=1.0)


def move(prefill: PrefillManager, decode: DecodeManager, room: int) -> None:
    sender, receiver = prefill.sender(room), decode.receiver(room)
    receiver.init([room % 8, room % 8 + 8])
    sender.send([1, 2], last=True)
    wait_for(lambda: receiver.poll() == KVPoll.Success)
    receiver.clear()
    sender.clear()


def test_a_restarted_prefill_rank_rejoins_and_decode_follows_it() -> None:
    bootstrap = BootstrapServer().start()
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    prefill = PrefillManager(src.args, ManagerConfig(bootstrap_url=bootstrap.url, **FAST))
    decode = DecodeManager(dst.args, ManagerConfig(bootstrap_url=bootstrap.url, **FAST))
    try:
        move(prefill, decode, 1)
        prefill.close()
        started = time.monotonic()
        prefill = PrefillManager(src.args, ManagerConfig(bootstrap_url=bootstrap.url, **FAST))
        assert time.monotonic() - started < 5  # no 409, no waiting out a lease
        wait_for(lambda: decode.stats.peers_declared_dead == 1)
        move(prefill, decode, 2)
        np.testing.assert_array_equal(dst.kv[0][[2, 10]], src.kv[0][[1, 2]])
    finally:
        decode.close()
        prefill.close()
        bootstrap.close()


def test_a_registration_nobody_renews_expires_and_the_real_rank_gets_in() -> None:
    bootstrap = BootstrapServer(lease_s=1.0).start()
    src = rank_cache(seed=1, **GEOMETRY)
    try:  # a rank that died without closing (or a bogus first registration)
        register_prefill(bootstrap.url, PrefillRank(0, 1, "127.0.0.1", 9, ENGINE))
        started = time.monotonic()
        prefill = PrefillManager(src.args, ManagerConfig(bootstrap_url=bootstrap.url, **FAST))
        assert 0.5 < time.monotonic() - started < 5
        prefill.close()
    finally:
        bootstrap.close()


def test_a_second_request_for_an_ended_room_fails_at_once() -> None:
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    prefill = PrefillManager(src.args, ManagerConfig(run_bootstrap=True, **FAST))
    decode = DecodeManager(
        dst.args, ManagerConfig(bootstrap_url=prefill.bootstrap_url, transfer_timeout_s=60, **FAST)
    )
    try:
        sender, first = prefill.sender(5), decode.receiver(5)
        first.init([3])
        sender.send([4], last=True)
        wait_for(lambda: first.poll() == KVPoll.Success)
        first.clear()  # decode reuses the id; prefill's sender is not cleared yet
        again = decode.receiver(5)
        again.init([6])
        wait_for(lambda: again.poll() == KVPoll.Failed, 5)
        assert "already ended" in str(again.failure_reason)
        again.clear()
        sender.clear()
    finally:
        decode.close()
        prefill.close()


def test_an_abort_before_init_reaches_prefill_at_once() -> None:
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    prefill = PrefillManager(
        src.args, ManagerConfig(run_bootstrap=True, request_timeout_s=300, **FAST)
    )
    decode = DecodeManager(dst.args, ManagerConfig(bootstrap_url=prefill.bootstrap_url, **FAST))
    try:
        move(prefill, decode, 1)  # decode knows prefill; prefill knows decode
        receiver = decode.receiver(7)
        receiver.abort("the request was cancelled")
        sender = prefill.sender(7)
        sender.send([1], last=True)
        wait_for(lambda: sender.poll() == KVPoll.Failed, 5)
        assert "the request was cancelled" in str(sender.failure_reason)
        sender.clear()
        receiver.clear()
    finally:
        decode.close()
        prefill.close()
