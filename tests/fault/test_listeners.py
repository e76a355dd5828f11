"""Listeners under hostile input, and rendezvous going away: nothing crashes, every bad
message is counted, valid work still goes through."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import zmq
from kv_cache import rank_cache
from real_engine import ENGINE, require_engine
from waiting import wait_for

from kvbridge.config import ManagerConfig
from kvbridge.control.bootstrap import BootstrapServer
from kvbridge.decode import DecodeManager
from kvbridge.prefill import PrefillManager
from kvbridge.wire import NATIVE, KVLayout, KVPoll, Registration

require_engine()
GEOMETRY = dict(layer_ids=(0, 1), page_size=4, total_kv_heads=2, head_dim=8)
GARBAGE = 100_000

THROWER = textwrap.dedent(
    """
    import random, sys, zmq
    context = zmq.Context()
    rng = random.Random(7)
    for endpoint in sys.argv[1:]:
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.connect(endpoint)
        for i in range({count}):
            if i % 4 == 0:  # a valid native header over random fields
                frames = [b"KVBR\\x01\\x00" + bytes([rng.randint(1, 10), 0])]
            else:
                frames = []
            frames += [rng.randbytes(rng.choice((0, 1, 8, 30))) for _ in range(rng.randint(0, 12))]
            push.send_multipart(frames or [b""])
        push.close(linger=60000)
    context.term()
    """
).format(count=GARBAGE)


def test_random_messages_are_counted_and_the_listeners_keep_serving() -> None:
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    prefill = PrefillManager(src.args, ManagerConfig(engine=ENGINE, run_bootstrap=True))
    decode = DecodeManager(
        dst.args, ManagerConfig(engine=ENGINE, bootstrap_url=prefill.bootstrap_url)
    )
    try:
        endpoints = [prefill.channel.endpoint, decode.channel.endpoint]
        subprocess.run([sys.executable, "-c", THROWER, *endpoints], check=True, timeout=300)
        for manager in (prefill, decode):
            stats = manager.channel.stats
            wait_for(lambda stats=stats: stats.received >= GARBAGE, 120)
            # Each was refused (malformed) or, decoding by chance, handled as a stray message.
            assert stats.malformed + stats.handler_errors >= 0.99 * GARBAGE
        assert prefill.healthy
        assert decode.healthy
        sender, receiver = prefill.sender(1), decode.receiver(1)
        receiver.init([2, 3])
        sender.send([4, 5], last=True)
        wait_for(lambda: receiver.poll() == KVPoll.Success, 10)
    finally:
        decode.close()
        prefill.close()


def test_transfers_complete_after_the_bootstrap_service_dies() -> None:
    bootstrap = BootstrapServer().start()
    src, dst = rank_cache(seed=1, **GEOMETRY), rank_cache(seed=None, **GEOMETRY)
    prefill = PrefillManager(src.args, ManagerConfig(engine=ENGINE, bootstrap_url=bootstrap.url))
    decode = DecodeManager(dst.args, ManagerConfig(engine=ENGINE, bootstrap_url=bootstrap.url))
    try:
        receivers = [decode.receiver(room) for room in range(3)]  # rendezvous done
        bootstrap.close()
        for room, receiver in enumerate(receivers):
            receiver.init([room])
            prefill.sender(room).send([room + 4], last=True)
        wait_for(lambda: all(r.poll() == KVPoll.Success for r in receivers), 10)
        later = decode.receiver(9)  # the group is known: no new lookup needed
        later.init([7])
        prefill.sender(9).send([1], last=True)
        wait_for(lambda: later.poll() == KVPoll.Success, 10)
    finally:
        decode.close()
        prefill.close()
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[[0, 1, 2, 7]], want[[4, 5, 6, 1]])


def test_forged_registrations_are_refused_and_nothing_is_written() -> None:
    """A registration whose buffers wrap the address space never reaches the planner."""
    src = rank_cache(seed=1, **GEOMETRY)
    prefill = PrefillManager(src.args, ManagerConfig(engine=ENGINE, run_bootstrap=True))
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    try:
        page = src.args.page_bytes
        honest = Registration(
            peer_id="forger",
            host="127.0.0.1",
            control_port=1,
            engine=ENGINE,
            engine_descriptor=b"loopback-x",
            tp_rank=0,
            attn_tp_size=1,
            dcp_rank=0,
            dcp_size=1,
            kv_layout=KVLayout.MHA,
            total_kv_heads=2,
            head_dim=8,
            dtype="bfloat16",
            page_size=4,
            kv_layer_ids=[0, 1],
            kv_ptrs=[0x1000] * 4,
            kv_item_lens=[page] * 4,
            kv_lengths=[page * 16] * 4,
            aux_ptrs=[],
            aux_item_lens=[],
            aux_lengths=[],
        )
        frames = NATIVE.encode(honest)
        # The encoder refuses a forged one, so swap forged pointers into honest frames.
        index = NATIVE.layout_for(Registration).frame_index("kv_ptrs")
        assert index is not None
        frames[index] = (2**64 - page).to_bytes(8, "little") * 4
        push.connect(prefill.channel.endpoint)
        push.send_multipart(frames)
        wait_for(lambda: prefill.channel.stats.malformed == 1, 10)
        assert "forger" not in prefill.protocol.decode_peers.by_id
        assert prefill.pipeline.stats.blocks_written == 0
    finally:
        push.close(linger=0)
        context.term()
        prefill.close()
