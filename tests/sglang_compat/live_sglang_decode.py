"""kvbridge's prefill and sglang 0.5.23's real decode, live, over Mooncake TCP.

    PYTHONPATH=src .venv-sglang/bin/python tests/sglang_compat/live_sglang_decode.py '{"rooms": 4}'

(run inside a network namespace of its own: Mooncake binds wildcard listeners;
tests/sglang_compat/test_live_peers.py does that). This process runs `prefill_tp` kvbridge
`PrefillManager`s with `peer_protocol="sglang"` (rank 0 serves sglang's bootstrap routes),
each room's pages holding known contents, each rank its share of the heads; a child process
runs sglang's own `MooncakeKVManager` and `MooncakeKVReceiver`s as its decode scheduler drives
them, into scattered pages of a cache whose other pages hold a sentinel, and checks every byte
and aux slot. Prints one JSON line: each room's outcome on both sides, what was verified,
the prefill channels' counters.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import sys
import time
from dataclasses import dataclass, field, replace
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
    abort_rooms: list[int] = field(default_factory=list)  # sglang's decode aborts these
    # sglang's decode is killed (SIGKILL) once every room is open, before prefill sends any
    kill_decode: bool = False
    prefill_tp: int = 1  # kvbridge prefill ranks (sglang's decode has one)
    # MLA: one latent "head" per layer buffer, held whole by every prefill rank; sglang's
    # decode asks the first and sends the others dummy requests.
    mla: bool = False
    bootstrap_port: int = 18998

    @property
    def geometry(self) -> Geometry:
        return Geometry(layers=self.layers, heads=1) if self.mla else Geometry(layers=self.layers)


def run_decode(scenario: Scenario, started: Any, results: Any) -> None:
    """sglang's decode: its manager and one receiver per room, checking what lands."""
    sglang = sglang_role("decode", scenario.bootstrap_port, scenario.backend)
    from sglang.srt.disaggregation.base.conn import KVPoll

    kind, geometry, per_room = sglang["class"], scenario.geometry, scenario.pages_per_room
    pool = 2 * scenario.rooms * per_room  # half of the pages are never asked for
    kv, aux = geometry.buffers(pool, scenario.rooms)
    for buffer in kv:
        buffer.fill(SENTINEL)
    mamba = scenario.state
    slots = 2 * scenario.rooms  # half of the state slots are never asked for either
    state = mamba.buffers(slots, 1) if mamba else []
    manager = kind("MANAGER")(
        sglang_kv_args(kind, geometry, kv, aux, state),
        sglang["mode"],
        sglang["server_args"],
        scenario.mla,  # is_mla_backend
    )
    address = f"127.0.0.1:{scenario.bootstrap_port}"
    deadline = time.monotonic() + scenario.timeout_s
    while not manager.try_ensure_parallel_info(address):
        if time.monotonic() > deadline:
            results.put({"error": "no prefill group"})
            return
        time.sleep(0.05)
    scattered = np.random.default_rng(0).permutation(pool).astype(np.int32)
    pages_of = {r: scattered[r * per_room : (r + 1) * per_room] for r in range(scenario.rooms)}
    dp_ranks = sglang_dp_ranks(manager, address, scenario.rooms, deadline)
    if len(dp_ranks) < scenario.rooms:
        results.put({"error": f"DP ranks of rooms {sorted(dp_ranks)} only"})
        return
    receivers = {}
    for room in range(scenario.rooms):
        receiver = kind("RECEIVER")(mgr=manager, bootstrap_addr=address, bootstrap_room=room)
        receiver.init(dp_ranks[room])
        receiver.send_metadata(
            pages_of[room],
            aux_index=room,
            state_indices=[[slots - 1 - room]] if mamba else None,
        )
        if room in scenario.abort_rooms:
            receiver.abort()
        receivers[room] = receiver
    started.set()
    ended: dict[int, str] = {}
    while len(ended) < len(receivers) and time.monotonic() < deadline:
        for room, receiver in receivers.items():
            poll = receiver.poll()
            if room not in ended and poll in (KVPoll.Success, KVPoll.Failed):
                ended[room] = "Success" if poll == KVPoll.Success else "Failed"
        time.sleep(POLL_S)
    acked = {}
    for room in scenario.abort_rooms:  # sglang's deferred release: every asked rank's ack
        needed = len(receivers[room].bootstrap_infos)
        while not manager.is_abort_release_safe(room, needed) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        acked[str(room)] = manager.is_abort_release_safe(room, needed)
    verified = 0
    for room, outcome in ended.items():
        if outcome != "Success":
            continue
        verified += int(
            all(
                np.array_equal(buffer[pages_of[room]], geometry.content(room, index, per_room))
                for index, buffer in enumerate(kv)
            )
            and bool((aux[room] == aux_content(room)).all())
            and all(
                np.array_equal(array[slots - 1 - room], mamba.content(room, index))
                for index, array in enumerate(state)
                if mamba
            )
        )
    asked = np.concatenate(list(pages_of.values()))
    untouched = np.setdiff1d(np.arange(pool), asked)
    results.put(
        {
            "decode": {str(room): ended.get(room, "unfinished") for room in receivers},
            "verified": verified,
            "sentinel_kept": all(bool((buffer[untouched] == SENTINEL).all()) for buffer in kv)
            and all(bool((array[: slots - scenario.rooms] == SENTINEL).all()) for array in state),
            "abort_acked": acked,
        }
    )
    time.sleep(1)  # the last statuses and acks are read before the sockets go


def sglang_dp_ranks(manager: Any, address: str, rooms: int, deadline: float) -> dict[int, int]:
    """Each room's prefill DP rank, as sglang's decode scheduler resolves it
    (`DecodePreallocQueue._resolve_prefill_dp_rank`, then `query_prefill_dp_ranks` for the
    rest, again while rooms are missing)."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    info = manager.prefill_info_table[address]
    if info.dp_size == 1:
        return dict.fromkeys(range(rooms), 0)
    if info.follow_bootstrap_room:
        return {room: room % info.dp_size for room in range(rooms)}
    found: dict[int, int] = {}
    while len(found) < rooms and time.monotonic() < deadline:
        missing = [room for room in range(rooms) if room not in found]
        answer = CommonKVReceiver.query_prefill_dp_ranks(address, missing)
        found.update({int(room): int(rank) for room, rank in answer.items()})
        time.sleep(POLL_S)
    return found


def run_prefill(scenario: Scenario, decode: Any, started: Any) -> dict[str, Any]:
    """`prefill_tp` kvbridge prefill ranks in this process, each holding its heads of every
    room; sends each room in `chunks` chunks once sglang's decode asked for it."""
    from kvbridge import DataParallel, KVArgs, KVLayout, KVPoll, ManagerConfig, PrefillManager
    from kvbridge.control.capture import CAPTURE_VARIABLE

    if scenario.capture_dir:
        os.environ[CAPTURE_VARIABLE] = scenario.capture_dir

    geometry, per_room, tp = scenario.geometry, scenario.pages_per_room, scenario.prefill_tp
    heads = geometry.heads if scenario.mla else geometry.heads // tp
    mamba = scenario.state
    config = ManagerConfig(
        engine=scenario.backend,
        peer_protocol="sglang",
        bootstrap_timeout_s=scenario.timeout_s,
        request_timeout_s=scenario.timeout_s,
        write_timeout_s=5.0,
        secret=None,
    )
    managers: list[Any] = []
    ranks = [(dp, rank) for dp in range(scenario.prefill_dp) for rank in range(tp)]
    try:
        for dp, rank in ranks:
            rank_geometry = Geometry(geometry.layers, heads, geometry.head_dim, geometry.page)
            kv, aux = rank_geometry.buffers(scenario.rooms * per_room, scenario.rooms)
            for room in range(scenario.rooms):
                for index, buffer in enumerate(kv):
                    whole = geometry.content(room, index, per_room)
                    held = (
                        slice(0, heads) if scenario.mla else slice(rank * heads, (rank + 1) * heads)
                    )
                    buffer[room * per_room : (room + 1) * per_room] = whole[:, :, held]
                aux[room] = aux_content(room)
            state = mamba.buffers(scenario.rooms, tp) if mamba else []
            for room in range(scenario.rooms):
                for index, array in enumerate(state):
                    array[room] = mamba.shard(room, index, rank, tp) if mamba else 0
            args = KVArgs.from_numpy(
                kv,
                kv_layout=KVLayout.MLA if scenario.mla else KVLayout.MHA,
                total_kv_heads=geometry.heads,
                attn_tp_rank=rank,
                attn_tp_size=tp,
                aux=[aux],
                state=state,
                state_dims=mamba.dims(tp) if mamba else (),
            )
            placed = replace(
                config,
                data_parallel=DataParallel(dp, scenario.prefill_dp, scenario.follow_bootstrap_room),
            )
            rank_config = (
                replace(placed, run_bootstrap=True, bootstrap_port=scenario.bootstrap_port)
                if not managers
                else replace(placed, bootstrap_url=managers[0].bootstrap_url)
            )
            managers.append(PrefillManager(args, rank_config))
        decode.start()
        # Each DP rank opens its own rooms (registering them where sglang's decode asks), as
        # its scheduler does when a request arrives, before decode may have asked.
        senders = {
            room: [
                manager.sender(room)
                for (dp, _), manager in zip(ranks, managers, strict=True)
                if dp == scenario.dp_rank_of(room)
            ]
            for room in range(scenario.rooms)
        }
        if not started.wait(scenario.timeout_s + 60):
            raise SystemExit("sglang's decode did not open its rooms")
        killed_at = time.monotonic()
        sent: set[int] = set()
        failed_after: dict[int, float] = {}
        deadline = time.monotonic() + scenario.timeout_s
        while time.monotonic() < deadline:
            every = [sender.poll() for rank_senders in senders.values() for sender in rank_senders]
            if scenario.kill_decode and decode.is_alive():
                if any(poll != KVPoll.WaitingForInput for poll in every):
                    time.sleep(POLL_S)
                    continue  # killed once every request arrived, before any write
                decode.kill()
                killed_at = time.monotonic()
            for room, rank_senders in senders.items():
                polls = [sender.poll() for sender in rank_senders]
                if room not in sent and all(p == KVPoll.WaitingForInput for p in polls):
                    sent.add(room)
                    pages = np.arange(room * per_room, (room + 1) * per_room, dtype=np.int32)
                    chunks = np.array_split(pages, scenario.chunks)
                    for sender in rank_senders:
                        for index, chunk in enumerate(chunks):
                            last = index == len(chunks) - 1
                            sender.send(
                                chunk,
                                last=last,
                                aux_index=room if last else None,
                                state_indices=(room,) if last and mamba else (),
                            )
                if room not in failed_after and KVPoll.Failed in polls:
                    failed_after[room] = time.monotonic() - killed_at
            done = [
                sender.poll() in (KVPoll.Success, KVPoll.Failed)
                for rank_senders in senders.values()
                for sender in rank_senders
            ]
            if all(done):
                break
            time.sleep(POLL_S)
        outcome = {}
        for room, rank_senders in senders.items():
            polls = {sender.poll().name for sender in rank_senders}
            first = rank_senders[0]
            outcome[str(room)] = {
                "poll": polls.pop() if len(polls) == 1 else "mixed",
                "reason": first.failure_reason,
                "failed_after_s": failed_after.get(room),
            }
        for rank_senders in senders.values():
            for sender in rank_senders:
                sender.clear()
    finally:
        for manager in managers:
            manager.close()
    # Counted once closed: a room's status may still be leaving when its sender says Success.
    return {
        "prefill": outcome,
        "channel": channel_counters(managers),
        "sent_by_rank": [manager.channel.stats.sent for manager in managers],
        "ignored": sum(manager.stats.ignored for manager in managers),
    }


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    scenario = Scenario(**json.loads(sys.argv[1] if len(sys.argv) > 1 else "{}"))
    for name, value in ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    context = multiprocessing.get_context("spawn")
    started, results = context.Event(), context.Queue()
    decode = context.Process(target=run_decode, args=(scenario, started, results))
    try:
        report = run_prefill(scenario, decode, started)
        try:
            wait_s = 1 if scenario.kill_decode else scenario.timeout_s + 30
            report.update(results.get(timeout=wait_s))
        except queue.Empty:
            report["decode"] = "no report"
    finally:
        if decode.pid is not None:
            decode.join(timeout=30)
            if decode.is_alive():
                decode.kill()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
