"""10,000 rooms through one prefill/decode pair, 64 in flight: all succeed, and the per-room
tables return to empty."""

from __future__ import annotations

import time

import numpy as np
import pytest
from kv_cache import rank_cache

from kvbridge.config import ManagerConfig
from kvbridge.decode import DecodeManager, KVReceiver
from kvbridge.engines import unavailable_reason
from kvbridge.prefill import FINISHED_ROOMS_KEPT, KVSender, PrefillManager
from kvbridge.wire import KVPoll

GEOMETRY = dict(layer_ids=(0, 1), page_size=4, total_kv_heads=2, head_dim=8)
ROOMS, IN_FLIGHT = 10_000, 64


def test_ten_thousand_rooms() -> None:
    reason = unavailable_reason("nixl")
    if reason is not None:
        pytest.skip(f"nixl cannot be used here: {reason}")
    src = rank_cache(num_pages=64, seed=1, **GEOMETRY)
    dst = rank_cache(num_pages=2 * IN_FLIGHT, seed=None, **GEOMETRY)
    prefill = PrefillManager(src.args, ManagerConfig(engine="nixl", run_bootstrap=True))
    decode = DecodeManager(
        dst.args, ManagerConfig(engine="nixl", bootstrap_url=prefill.bootstrap_url)
    )
    active: dict[int, tuple[KVSender, KVReceiver]] = {}
    next_room = done = 0
    deadline = time.monotonic() + 600
    try:
        while done < ROOMS:
            assert time.monotonic() < deadline, f"only {done} rooms in 600 s"
            while len(active) < IN_FLIGHT and next_room < ROOMS:
                room, slot = next_room, next_room % IN_FLIGHT
                receiver = decode.receiver(room)
                receiver.init([2 * slot, 2 * slot + 1])
                sender = prefill.sender(room)
                sender.send([room % 32, room % 32 + 32], last=True)
                active[room] = (sender, receiver)
                next_room += 1
            for room, (sender, receiver) in list(active.items()):
                if receiver.poll() == KVPoll.Success and sender.poll() == KVPoll.Success:
                    sender.clear()
                    receiver.clear()
                    del active[room]
                    done += 1
                else:
                    assert KVPoll.Failed not in (sender.poll(), receiver.poll()), (
                        sender.failure_reason or receiver.failure_reason
                    )
            time.sleep(0.0005)
        assert prefill.open_rooms == decode.open_rooms == 0
        # The finished-room memory is bounded, its set in step with its queue (no leak).
        remembered = min(ROOMS, FINISHED_ROOMS_KEPT)
        rooms = prefill.protocol.room_table
        assert len(rooms._finished_set) == len(rooms._finished) == remembered
        last = ROOMS - 1
        slot = last % IN_FLIGHT
        for got, want in zip(dst.kv, src.kv, strict=True):
            assert np.array_equal(got[[2 * slot, 2 * slot + 1]], want[[last % 32, last % 32 + 32]])
    finally:
        decode.close()
        prefill.close()
