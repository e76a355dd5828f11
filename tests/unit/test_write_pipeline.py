"""Prefill's write pipeline with a fake engine (writes end when the test says so) and a fake
clock: the order writes go out in, what merges into one transfer, and the write lease as a
fence before a post and, on an engine that moves writes only when polled, in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from kv_cache import RankCache, rank_cache

from kvbridge.cache import TransferPlan
from kvbridge.cache.pairing import pair
from kvbridge.cache.peer import memory_regions
from kvbridge.cache.regions import MemoryRegion
from kvbridge.core.prefill_events import Connect, Write
from kvbridge.core.room import ChunkJob
from kvbridge.engines import (
    EngineError,
    EngineTimeout,
    PendingWrite,
    TransferEngine,
    TransferHandle,
    WriteFenced,
)
from kvbridge.engines.base import TransferState
from kvbridge.wire.notifications import notification_for
from kvbridge.write_gate import WriteGate
from kvbridge.write_pipeline import WritePipeline
from kvbridge.write_transfers import MAX_MERGED_WRITES

PEER = "decode-0"
WAIT_S = 10.0


class FakeClock:
    """Time moves only when the test says so; sleeps give the other threads a turn."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now

    def thread_time(self) -> float:
        return 0.0

    def sleep(self, seconds: float) -> None:
        time.sleep(0.0005)


class FakeHandle(TransferHandle):
    def __init__(self, engine: FakeEngine, notify: bytes, blocks: int) -> None:
        self.engine = "fake"
        self.notify = notify
        self.blocks = blocks
        self.state = TransferState.PENDING
        self.released = False
        self.polls = 0
        self._clock = engine.clock

    def poll(self) -> TransferState:
        self.polls += 1
        return self.state

    def release(self) -> None:
        self.released = True

    def check(self, started: float, timeout_s: float, fenced: str | None = None) -> bool:
        if fenced is not None:
            self.release()
            raise WriteFenced(self.engine, "write", fenced)
        state = self.poll()
        if state is TransferState.FAILED:
            raise EngineError(self.engine, "write", "it broke")
        return state is TransferState.DONE


class FakeEngine(TransferEngine):
    """Checks bounds like every engine, moves nothing: each posted write waits until the
    test ends it (`finish`)."""

    name = "fake"

    def __init__(self, clock: FakeClock, polled: bool = True) -> None:
        super().__init__()
        self.clock = clock
        self.progresses_on_its_own = not polled
        self.posted: list[FakeHandle] = []
        self.posted_changed = threading.Condition()
        self.set_ups = 0  # writes set up (`prepare_write`), posted or not

    @classmethod
    def open(cls, endpoint_name: str, host: str, options: object) -> FakeEngine:  # type: ignore[override]
        raise NotImplementedError

    @property
    def transport(self) -> str:
        return "fake"

    def endpoint(self) -> bytes:
        return b"fake"

    def _register(self, regions: Sequence[MemoryRegion]) -> None:
        pass

    def _deregister(self, regions: Sequence[MemoryRegion]) -> None:
        pass

    def _connect(self, peer_endpoint: bytes) -> str:
        return peer_endpoint.decode()

    def _prepare_write(self, peer: str, plan: TransferPlan, notify: bytes) -> PendingWrite:
        self.set_ups += 1
        return super()._prepare_write(peer, plan, notify)

    def _write(self, peer: str, plan: TransferPlan, notify: bytes) -> TransferHandle:
        handle = FakeHandle(self, notify, len(plan))
        with self.posted_changed:
            self.posted.append(handle)
            self.posted_changed.notify_all()
        return handle

    def wait_posted(self, count: int) -> list[FakeHandle]:
        with self.posted_changed:
            assert self.posted_changed.wait_for(lambda: len(self.posted) >= count, WAIT_S)
            return list(self.posted)

    def finish(self, handle: FakeHandle, state: TransferState = TransferState.DONE) -> None:
        handle.state = state
        self._write_ended()


class Host:
    """What the manager answers: rooms go on, leases as the test sets them."""

    def __init__(self) -> None:
        self.leases: dict[str, str | None] = {}
        self.ended: list[tuple[Write, Exception | None, bool]] = []
        self.connects: list[tuple[str, str | None]] = []
        self.written: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.changed = threading.Condition()
        self.rooms_ended: set[int] = set()
        self.alone: bool = True  # every other write of a room ended (`completes_room`)

    def room_going(self, room: int) -> bool:
        assert self.gate.wait(WAIT_S)
        return room not in self.rooms_ended

    def completes_room(self, write: Write) -> bool:
        return write.room not in self.rooms_ended and self.alone

    def lease_problem(self, peer_id: str) -> str | None:
        return self.leases.get(peer_id)

    def write_ended(self, write: Write, failure: Exception | None, completed: bool) -> None:
        with self.changed:
            self.ended.append((write, failure, completed))
            self.changed.notify_all()

    def connected(self, peer_id: str, error: str | None) -> None:
        self.connects.append((peer_id, error))

    def observe_write(self, seconds: float, blocks: int, nbytes: int) -> None:
        self.written.append(blocks)

    def wait_ended(self, count: int) -> list[tuple[Write, Exception | None, bool]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.ended) >= count, WAIT_S), self.ended
            return list(self.ended)


LOCAL = rank_cache(seed=1, page_size=4, total_kv_heads=2, head_dim=8)
REMOTE = rank_cache(seed=None, page_size=4, total_kv_heads=2, head_dim=8)


def write(
    room: int,
    chunk: int,
    last: bool,
    cache: RankCache = REMOTE,
    gate: WriteGate | None = None,
    complete_with: frozenset[int] = frozenset(),
) -> Write:
    job = ChunkJob(
        room=room,
        peer_id=PEER,
        chunk_idx=chunk,
        src_pages=np.array([2 * chunk, 2 * chunk + 1]),
        page_offset=2 * chunk,
        dst_pages=np.arange(8, dtype=np.int32),
        last=last,
        src_aux_index=None,
        dst_aux_index=None,
        src_state_indices=(),
        dst_state_indices=(),
        gate=gate,
    )
    notify = notification_for(room, 0) if last else b""
    complete = notification_for(room, 0, complete=True) if last and complete_with else b""
    pairing = pair(LOCAL.args, cache.args)
    return Write(room, job, cache.args, pairing, notify, None, complete, complete_with)


@pytest.fixture
def rig(request: pytest.FixtureRequest) -> Iterator[tuple[WritePipeline, FakeEngine, Host]]:
    clock = FakeClock()
    engine = FakeEngine(clock, polled=getattr(request, "param", True))
    engine.register(memory_regions(LOCAL.args))
    host = Host()
    pipeline = WritePipeline(
        engine, LOCAL.args, None, host, write_timeout_s=60.0, lease_wait_s=0.0, clock=clock
    )
    pipeline.submit(Connect(PEER, PEER.encode(), REMOTE.args))
    try:
        yield pipeline, engine, host
    finally:
        pipeline.close()
        pipeline.close()  # again: nothing
        assert not any(thread.is_alive() for thread in pipeline.threads)


def test_writes_go_out_in_order_and_a_rooms_chunks_merge_up_to_its_notification(
    rig: tuple[WritePipeline, FakeEngine, Host],
) -> None:
    pipeline, engine, host = rig
    host.gate.clear()  # everything is queued before the first write is prepared
    writes = [write(1, 0, False), write(1, 1, True), write(2, 0, False), write(2, 1, True)]
    for item in writes:
        pipeline.submit(item)
    host.gate.set()
    first, _ = engine.wait_posted(2)  # room 2 set up while room 1 moves
    assert host.connects == [(PEER, None)]
    assert first.notify == notification_for(1, 0)  # rooms 1's two chunks, one transfer
    engine.finish(first)
    assert [w.room for w, _, _ in host.wait_ended(2)] == [1, 1]
    second = engine.wait_posted(2)[1]
    assert second.notify == notification_for(2, 0)
    engine.finish(second)
    ended = host.wait_ended(4)
    assert [w for w, _, _ in ended] == writes  # in the order handed out
    assert all(failure is None for _, failure, _ in ended)
    assert host.written == [first.blocks, second.blocks]
    assert pipeline.stats.blocks_written == first.blocks + second.blocks
    assert pipeline.idle


def test_merging_stops_at_the_cap_of_writes(rig: tuple[WritePipeline, FakeEngine, Host]) -> None:
    pipeline, engine, host = rig
    host.gate.clear()
    chunks = MAX_MERGED_WRITES + 2
    for chunk in range(chunks):
        pipeline.submit(write(1, chunk % 4, chunk == chunks - 1))
    host.gate.set()
    first = engine.wait_posted(1)[0]
    engine.finish(first)
    assert len(host.wait_ended(MAX_MERGED_WRITES)) == MAX_MERGED_WRITES
    engine.finish(engine.wait_posted(2)[1])
    assert len(host.wait_ended(chunks)) == chunks


def test_no_lease_no_post(rig: tuple[WritePipeline, FakeEngine, Host]) -> None:
    pipeline, engine, host = rig
    host.leases[PEER] = "decode decode-0 has not answered a heartbeat (no write lease)"
    pipeline.submit(write(1, 0, True))
    ((_, failure, _),) = host.wait_ended(1)
    assert isinstance(failure, WriteFenced)
    assert "no write lease" in str(failure)
    assert engine.posted == []


def test_a_lease_lost_in_flight_stops_a_write_the_engine_moves_only_when_polled(
    rig: tuple[WritePipeline, FakeEngine, Host],
) -> None:
    pipeline, engine, host = rig
    pipeline.submit(write(1, 0, True))
    (handle,) = engine.wait_posted(1)
    host.leases[PEER] = "the write lease on decode decode-0 ran out"
    ((_, failure, _),) = host.wait_ended(1)
    assert isinstance(failure, WriteFenced)
    assert handle.released


@pytest.mark.parametrize("rig", [False], indirect=True)
def test_an_engine_that_moves_writes_itself_is_not_fenced_in_flight(
    rig: tuple[WritePipeline, FakeEngine, Host],
) -> None:
    pipeline, engine, host = rig
    pipeline.submit(write(1, 0, True))
    (handle,) = engine.wait_posted(1)
    host.leases[PEER] = "the write lease on decode decode-0 ran out"
    time.sleep(0.05)  # the engine thread looks again (woken at most every WRITE_WAIT_S)
    assert host.ended == []  # decode waits out its write timeout
    assert not handle.released
    engine.finish(handle)
    ((_, failure, _),) = host.wait_ended(1)
    assert failure is None


def test_a_failed_write_and_one_to_a_peer_never_connected_are_reported(
    rig: tuple[WritePipeline, FakeEngine, Host],
) -> None:
    pipeline, engine, host = rig
    pipeline.submit(write(1, 0, True))
    engine.finish(engine.wait_posted(1)[0], TransferState.FAILED)
    ((_, failure, _),) = host.wait_ended(1)
    assert isinstance(failure, EngineError)
    assert "it broke" in str(failure)
    stranger = write(2, 0, True)
    stranger = Write(
        2,
        ChunkJob(**{**stranger.job.__dict__, "peer_id": "nobody"}),
        stranger.peer_args,
        stranger.pairing,
        stranger.notify,
    )
    pipeline.submit(stranger)
    (_, (_, failure, _)) = host.wait_ended(2)
    assert isinstance(failure, EngineError)
    assert "not connected" in str(failure)


def test_a_gated_write_is_set_up_at_once_and_posted_when_its_gate_opens(
    rig: tuple[WritePipeline, FakeEngine, Host],
) -> None:
    """Gated writes wait, in order, and never merge: the one behind a closed gate (gated or
    not) waits for it."""
    pipeline, engine, host = rig
    gates = [WriteGate(), WriteGate()]
    writes = [write(1, 0, False, gate=gates[0]), write(1, 1, False, gate=gates[1])]
    writes.append(write(1, 2, True))
    for item in writes:
        pipeline.submit(item)
    time.sleep(0.05)
    assert engine.posted == []
    assert engine.set_ups == 1  # the first is set up and held (one transfer ahead at most)
    assert not pipeline.idle
    gates[0].open()
    (first,) = engine.wait_posted(1)
    engine.finish(first)
    assert [w for w, _, _ in host.wait_ended(1)] == writes[:1]  # alone: not merged
    time.sleep(0.05)
    assert len(engine.posted) == 1  # the next gate is closed: nothing behind it goes
    gates[1].open()
    second, third = engine.wait_posted(3)[1:]
    assert third.notify == notification_for(1, 0)  # the ungated last one set up as it was
    for handle in (second, third):
        engine.finish(handle)
    assert [w for w, _, _ in host.wait_ended(3)] == writes
    assert pipeline.idle


def test_a_held_write_whose_room_ended_is_dropped_unwritten_and_the_next_goes(
    rig: tuple[WritePipeline, FakeEngine, Host],
) -> None:
    pipeline, engine, host = rig
    held = [write(1, layer, layer == 2, gate=WriteGate()) for layer in range(3)]
    for item in held:
        pipeline.submit(item)
    behind = write(2, 0, True)
    pipeline.submit(behind)
    time.sleep(0.05)
    host.rooms_ended.add(1)  # aborted mid-forward: its gates never open
    (posted,) = engine.wait_posted(1)
    assert posted.notify == notification_for(2, 0)
    engine.finish(posted)
    ended = host.wait_ended(4)
    assert [w for w, _, _ in ended] == [*held, behind]
    assert all(failure is None and not completed for _, failure, completed in ended)
    assert len(engine.posted) == 1  # nothing of room 1


@pytest.mark.parametrize("alone", [True, False])
def test_a_gated_last_write_completes_its_room_when_the_others_ended_before_its_post(
    rig: tuple[WritePipeline, FakeEngine, Host], alone: bool
) -> None:
    """Handed out with the room's earlier layers still out, its complete notification was not
    allowed then; asked again at the post, it is when they all ended, written."""
    pipeline, engine, host = rig
    host.alone = alone
    gate = WriteGate()
    pipeline.submit(write(1, 3, True, gate=gate, complete_with=frozenset({0, 1, 2})))
    gate.open()
    (handle,) = engine.wait_posted(1)
    engine.finish(handle)
    ((_, failure, completed),) = host.wait_ended(1)
    assert failure is None
    assert completed is alone
    assert handle.notify == notification_for(1, 0, complete=alone)


def test_a_write_gate_opens_once_and_tells_each_waiter() -> None:
    gate, told = WriteGate(), []
    gate.when_open(lambda: told.append("first"))
    assert not gate.is_open
    gate.open()
    gate.open()
    assert gate.is_open
    gate.when_open(lambda: told.append("late"))  # open already: at once
    assert told == ["first", "late"]


def test_a_gate_that_stays_closed_longer_than_a_write_may_take_fails_its_write(
    rig: tuple[WritePipeline, FakeEngine, Host],
) -> None:
    """A forward that stopped without opening its gate and without ending its room: the held
    write fails (its room with it) and the writes behind it go on."""
    pipeline, engine, host = rig
    pipeline.submit(write(1, 0, False, gate=WriteGate()))
    pipeline.submit(write(2, 0, True))
    time.sleep(0.05)
    assert engine.posted == []
    pipeline._clock.now += 61.0  # type: ignore[attr-defined]  # past write_timeout_s (60)
    ((_, failure, _),) = host.wait_ended(1)
    assert isinstance(failure, EngineTimeout)
    assert "stayed closed" in str(failure)
    engine.finish(engine.wait_posted(1)[0])
    assert host.wait_ended(2)[1][1] is None
