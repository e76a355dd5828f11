"""kvbridge's decode and sglang 0.5.23's real prefill, live, over Mooncake TCP.

    PYTHONPATH=src .venv-sglang/bin/python tests/sglang_compat/live_sglang_prefill.py '{"rooms": 4}'

(run inside a network namespace of its own: Mooncake binds wildcard listeners;
tests/sglang_compat/test_live_peers.py does that). A child process runs sglang's own
bootstrap server, `MooncakeKVManager` and `MooncakeKVSender`s as its prefill scheduler drives
them, each room's pages holding known contents; this process runs a kvbridge `DecodeManager`
with `peer_protocol="sglang"`, opens the rooms into scattered pages of a cache whose other
pages hold a sentinel, and checks every byte. Prints one JSON line: each room's outcome on both
sides, what was verified, the decode channel's counters.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_side import (
    ENVIRONMENT,
    POLL_S,
    SENTINEL,
    Geometry,
    LiveRooms,
    aux_content,
    channel_counters,
    sglang_kv_args,
    sglang_role,
)


@dataclass(frozen=True)
class Scenario(LiveRooms):
    abort_rooms: list[int] = field(default_factory=list)  # decode aborts these after init
    # sglang's prefill is killed (SIGKILL) once decode opened every room, before it sends any
    kill_prefill: bool = False
    decode_tp: int = 1  # kvbridge decode ranks (sglang's prefill has one)
    bootstrap_port: int = 18999
    # sglang's prefill sends each room's aux slot over ZMQ (SGLANG_MOONCAKE_SEND_AUX_TCP)
    aux_over_zmq: bool = False

    def server_args(self) -> dict[str, Any]:
        """sglang's prefill with DP attention: `prefill_dp` schedulers (processes), each an
        attention-DP rank of TP 1."""
        if self.prefill_dp == 1:
            return {}
        balance = "follow_bootstrap_room" if self.follow_bootstrap_room else "round_robin"
        return {
            "tp_size": self.prefill_dp,
            "dp_size": self.prefill_dp,
            "enable_dp_attention": True,
            "load_balance_method": balance,
        }


def wait_healthy(address: str, timeout_s: float = 30.0) -> None:
    from kvbridge.control.sglang_bootstrap import healthy

    deadline = time.monotonic() + timeout_s
    while not healthy(address, 1.0) and time.monotonic() < deadline:
        time.sleep(0.05)


def run_prefill(scenario: Scenario, ready: Any, results: Any, dp_rank: int = 0) -> None:
    """sglang's prefill (its DP rank `dp_rank`): its bootstrap server (on DP rank 0), manager
    and one sender per room it takes."""
    if scenario.aux_over_zmq:
        os.environ["SGLANG_MOONCAKE_SEND_AUX_TCP"] = "1"
    sglang = sglang_role(
        "prefill", scenario.bootstrap_port, scenario.backend, dp_rank, **scenario.server_args()
    )
    from sglang.srt.disaggregation.base.conn import KVPoll

    kind, geometry, per_room = sglang["class"], scenario.geometry, scenario.pages_per_room
    kv, aux = geometry.buffers(scenario.rooms * per_room, scenario.rooms)
    mamba = scenario.state
    state = mamba.buffers(scenario.rooms, 1) if mamba else None
    for room in range(scenario.rooms):
        for index, buffer in enumerate(kv):
            buffer[room * per_room : (room + 1) * per_room] = geometry.content(
                room, index, per_room
            )
        aux[room] = aux_content(room)
        for index, array in enumerate(state or []):
            array[room] = mamba.content(room, index) if mamba else 0
    bootstrap = (  # one per instance: with DP rank 0 here
        kind("BOOTSTRAP_SERVER")(host="127.0.0.1", port=scenario.bootstrap_port)
        if dp_rank == 0
        else None
    )
    wait_healthy(f"127.0.0.1:{scenario.bootstrap_port}")  # before the manager registers there
    manager = kind("MANAGER")(
        sglang_kv_args(kind, geometry, kv, aux, state),
        sglang["mode"],
        sglang["server_args"],
        False,
    )
    address = f"127.0.0.1:{scenario.bootstrap_port}"
    ready.set()
    # Its rooms' senders (each registers its room's DP rank where sglang asks it to).
    senders = {
        room: kind("SENDER")(mgr=manager, bootstrap_addr=address, bootstrap_room=room)
        for room in range(scenario.rooms)
        if scenario.dp_rank_of(room) == dp_rank
    }
    started: set[int] = set()
    ended: dict[int, str] = {}
    deadline = time.monotonic() + scenario.timeout_s
    while len(ended) < len(senders) and time.monotonic() < deadline:
        for room, sender in senders.items():
            poll = sender.poll()
            if scenario.kill_prefill:
                continue  # it waits to be killed, holding every room
            if room not in started and poll == KVPoll.WaitingForInput:
                started.add(room)
                sender.init(per_room, aux_index=room)
                pages = np.arange(room * per_room, (room + 1) * per_room, dtype=np.int32)
                for chunk in np.array_split(pages, scenario.chunks):
                    # sglang's sender keeps the state slot for the room's last chunk
                    sender.send(chunk, state_indices=[[room]] if state else None)
            elif poll in (KVPoll.Success, KVPoll.Failed) and room not in ended:
                ended[room] = "Success" if poll == KVPoll.Success else "Failed"
        time.sleep(POLL_S)
    results.put({room: ended.get(room, "unfinished") for room in senders})
    time.sleep(2)  # decode reads the last statuses and acks before the sockets go
    del bootstrap
    # sglang's NIXL listener thread is not a daemon: nothing else ends this process.
    results.close()
    results.join_thread()
    os._exit(0)


def run_decode(scenario: Scenario, kill_prefill: Callable[[], None]) -> dict[str, Any]:
    """`decode_tp` kvbridge decode ranks in this process, each asked for every room (as every
    decode TP rank runs every request), each holding its share of the heads."""
    from kvbridge import DecodeManager, KVArgs, KVLayout, KVPoll, ManagerConfig
    from kvbridge.control.capture import CAPTURE_VARIABLE

    if scenario.capture_dir:
        os.environ[CAPTURE_VARIABLE] = scenario.capture_dir

    geometry, per_room, tp = scenario.geometry, scenario.pages_per_room, scenario.decode_tp
    pool = 2 * scenario.rooms * per_room  # half of the pages are never asked for
    heads = geometry.heads // tp
    ranks = [
        Geometry(geometry.layers, heads, geometry.head_dim, geometry.page).buffers(
            pool, scenario.rooms
        )
        for _ in range(tp)
    ]
    mamba = scenario.state
    slots = 2 * scenario.rooms  # half of the state slots are never asked for either
    states = [mamba.buffers(slots, tp) if mamba else [] for _ in range(tp)]
    config = ManagerConfig(
        engine=scenario.backend,
        peer_protocol="sglang",
        bootstrap_url=f"127.0.0.1:{scenario.bootstrap_port}",
        bootstrap_timeout_s=scenario.timeout_s,
        transfer_timeout_s=scenario.timeout_s,
        write_timeout_s=2.0,
        secret=None,
    )
    managers = []
    for rank, (kv, aux) in enumerate(ranks):
        for array in kv:
            array.fill(SENTINEL)
        args = KVArgs.from_numpy(
            kv,
            kv_layout=KVLayout.MHA,
            total_kv_heads=geometry.heads,
            attn_tp_rank=rank,
            attn_tp_size=tp,
            aux=[aux],
            state=states[rank],
            state_dims=mamba.dims(tp) if mamba else (),
        )
        managers.append(DecodeManager(args, config))
    scattered = np.random.default_rng(0).permutation(pool).astype(np.int32)
    pages_of = {
        room: scattered[room * per_room : (room + 1) * per_room] for room in range(scenario.rooms)
    }
    receivers: dict[int, list[Any]] = {}
    try:
        for room in range(scenario.rooms):
            receivers[room] = [manager.receiver(room) for manager in managers]
            for receiver in receivers[room]:
                receiver.init(
                    pages_of[room],
                    aux_index=room,
                    state_indices=[slots - 1 - room] if mamba else (),
                )
                if room in scenario.abort_rooms:
                    receiver.abort("the scheduler gave up on it")
        killed_at = time.monotonic()
        if scenario.kill_prefill:
            kill_prefill()
        every = [receiver for rank_receivers in receivers.values() for receiver in rank_receivers]
        ended_after: dict[int, float] = {}
        deadline = time.monotonic() + scenario.timeout_s
        while time.monotonic() < deadline:
            for room, rank_receivers in receivers.items():
                failed = any(r.poll() == KVPoll.Failed for r in rank_receivers)
                if room not in ended_after and failed:
                    ended_after[room] = time.monotonic() - killed_at
            if all(
                r.poll() in (KVPoll.Success, KVPoll.Failed)
                and (r.pages_safe or scenario.kill_prefill)  # a killed writer never acknowledges
                for r in every
            ):
                break
            time.sleep(POLL_S)
        outcome: dict[str, Any] = {}
        verified = 0
        for room, rank_receivers in receivers.items():
            first = rank_receivers[0]
            polls = {r.poll().name for r in rank_receivers}
            outcome[str(room)] = {
                "poll": polls.pop() if len(polls) == 1 else "mixed",
                "reason": first.failure_reason,
                "pages_safe": all(r.pages_safe for r in rank_receivers),
                "kind": first.failure_kind.name if first.failure_kind else None,
                "failed_after_s": ended_after.get(room),
            }
            if outcome[str(room)]["poll"] != "Success":
                continue
            same = all(
                np.array_equal(
                    buffer[pages_of[room]],
                    geometry.content(room, index, per_room)[
                        :, :, rank * heads : (rank + 1) * heads
                    ],
                )
                and bool((aux[room] == aux_content(room)).all())
                for rank, (kv, aux) in enumerate(ranks)
                for index, buffer in enumerate(kv)
            )
            state_same = all(
                np.array_equal(array[slots - 1 - room], mamba.shard(room, index, rank, tp))
                for rank in range(tp)
                for index, array in enumerate(states[rank])
                if mamba
            )
            verified += int(same and state_same)
        asked = np.concatenate(list(pages_of.values()))
        untouched = np.setdiff1d(np.arange(pool), asked)
        sentinel_kept = all(
            bool((buffer[untouched] == SENTINEL).all()) for kv, _ in ranks for buffer in kv
        ) and all(
            bool((array[: slots - scenario.rooms] == SENTINEL).all())
            for rank_state in states
            for array in rank_state
        )
        for receiver in every:
            receiver.clear()
        return {
            "decode": outcome,
            "verified": verified,
            "sentinel_kept": sentinel_kept,
            "channel": channel_counters(managers),
            "ignored": sum(manager.stats.ignored for manager in managers),
        }
    finally:
        for manager in managers:
            manager.close()


def main() -> None:
    scenario = Scenario(**json.loads(sys.argv[1] if len(sys.argv) > 1 else "{}"))
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    readies = [context.Event() for _ in range(scenario.prefill_dp)]
    prefills = [
        context.Process(target=run_prefill, args=(scenario, ready, results, dp_rank))
        for dp_rank, ready in enumerate(readies)
    ]
    for prefill in prefills:
        prefill.start()
    try:
        if not all(ready.wait(120) for ready in readies):
            raise SystemExit("sglang's prefill did not start")
        report = run_decode(scenario, prefills[0].kill)
        try:
            wait_s = 1 if scenario.kill_prefill else scenario.timeout_s + 30
            report["prefill"] = {}
            for _ in prefills:
                report["prefill"].update(results.get(timeout=wait_s))
        except queue.Empty:
            report["prefill"] = "no report"

    finally:
        for prefill in prefills:
            prefill.join(timeout=30)
            if prefill.is_alive():
                prefill.kill()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
