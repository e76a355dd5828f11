"""A prefill rank in its own process with a real engine (NIXL), for the abort and
authentication fault tests; JSON lines on stdout.

    python prefill_peer.py gated             → {"bootstrap": url}
        Its engine posts writes only after SIGUSR1 (a write held in flight). Room 1 sends
        pages [0, 1]; when room 1 has ended, room 2 sends pages [6, 7].
        → {"writing": 1}  {"room": 1, "poll": ..., "reason": ...}  {"room": 2, "poll": ...}
    python prefill_peer.py slow              → {"bootstrap": url}
        Heartbeats every 0.1 s, peer timeout 1 s. After a line on stdin, rooms 10-13 each
        send 40 one-page chunks, 50 ms apart (a transfer that takes seconds).
        → {"sending": 1}  {"room": 10, "poll": ..., "reason": ...} ... (rooms 10-13)
    python prefill_peer.py secret SECRET     → {"bootstrap": url, "control": endpoint,
                                                 "metrics": port}
        Room 6 sends pages [2, 3].            → {"room": 6, "poll": ..., "reason": ...}
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from kv_cache import rank_cache

import kvbridge.runtime
from kvbridge.cache import TransferPlan
from kvbridge.config import ManagerConfig
from kvbridge.engines import PendingWrite, TransferHandle, TransferState
from kvbridge.engines.nixl import NixlEngine
from kvbridge.prefill import KVSender, PrefillManager
from kvbridge.wire import KVPoll

GEOMETRY = dict(layer_ids=(0, 1), page_size=4, total_kv_heads=2, head_dim=16)
SEED = 5
SLOW_ROOMS = (10, 11, 12, 13)
SLOW_CHUNKS = 40


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


class GatedNixl(NixlEngine):
    """NIXL, except that a write is posted to it only once the gate opens."""

    gate = threading.Event()

    def _prepare_write(self, peer: str, plan: TransferPlan, notify: bytes) -> PendingWrite:
        return PendingWrite(lambda: self._held(peer, plan, notify))

    def _held(self, peer: str, plan: TransferPlan, notify: bytes) -> TransferHandle:
        say(writing=1)
        engine = self

        class Held(TransferHandle):
            engine = "nixl"
            posted: TransferHandle | None = None

            def poll(self) -> TransferState:
                if not engine.gate.is_set():
                    return TransferState.PENDING
                if self.posted is None:
                    self.posted = NixlEngine._prepare_write(engine, peer, plan, notify).start()
                state = self.posted.poll()
                self.error = self.posted.error
                return state

            def release(self) -> None:
                if self.posted is not None:
                    self.posted.release()

        return Held()


def finish(sender: KVSender, room: int) -> None:
    while sender.poll() not in (KVPoll.Success, KVPoll.Failed):
        time.sleep(0.01)
    say(room=room, poll=sender.poll().name, reason=sender.failure_reason)


def main() -> None:
    mode = sys.argv[1]
    cache = rank_cache(num_pages=16, seed=SEED, **GEOMETRY)
    if mode == "gated":
        kvbridge.runtime.create_engine = lambda name, endpoint, host, options: GatedNixl(endpoint)
        signal.signal(signal.SIGUSR1, lambda signum, frame: GatedNixl.gate.set())
        prefill = PrefillManager(cache.args, ManagerConfig(engine="nixl", run_bootstrap=True))
        say(bootstrap=prefill.bootstrap_url)
        first = prefill.sender(1)
        first.send([0, 1], last=True)
        finish(first, 1)
        second = prefill.sender(2)
        second.send([6, 7], last=True)
        finish(second, 2)
    elif mode in ("slow", "slow-layers"):
        config = ManagerConfig(
            engine="nixl", run_bootstrap=True, heartbeat_interval_s=0.1, peer_timeout_s=1.0
        )
        prefill = PrefillManager(cache.args, config)
        say(bootstrap=prefill.bootstrap_url)
        sys.stdin.readline()
        senders = {room: prefill.sender(room) for room in SLOW_ROOMS}
        say(sending=1)
        for chunk in range(SLOW_CHUNKS):
            last = chunk == SLOW_CHUNKS - 1
            for sender in senders.values():
                if mode == "slow":
                    sender.send([chunk % 16], last=last)
                else:  # layer by layer, as a forward pass computes them
                    sender.send([chunk % 16], layers=range(0, 1))
                    sender.send([chunk % 16], layers=range(1, 2), last=last)
            time.sleep(0.05)
        for room, sender in senders.items():
            finish(sender, room)
    else:
        secret = sys.argv[2].encode()
        config = ManagerConfig(engine="nixl", run_bootstrap=True, secret=secret, metrics_port=0)
        prefill = PrefillManager(cache.args, config)
        assert prefill.metrics.port is not None
        say(
            bootstrap=prefill.bootstrap_url,
            control=prefill.channel.endpoint,
            metrics=prefill.metrics.port,
        )
        sender = prefill.sender(6)
        sender.send([2, 3], last=True)
        finish(sender, 6)
    time.sleep(3600)  # stay reachable until the test ends the process


if __name__ == "__main__":
    main()
