"""Prefill side: `PrefillManager` (one per prefill rank) and `KVSender` (one per room,
prefill_sender.py).

Decode ranks register their memory once (a native `Registration`), then send one
`TransferRequest` per room. The scheduler calls `KVSender.send()` with each chunk of pages it
has computed (chunked prefill; the last chunk carries the aux slot and state slots). Each
chunk is written through the engine, job by job; when the last chunk has landed, the room's
outcome goes to every destination as a `TransferStatus`, with the reason on failure. With
`peer_protocol="sglang"` the decode ranks are sglang's: they register and ask in sglang's
frames, find this group through sglang's bootstrap routes (served by rank 0), and hear
sglang's statuses and abort acks (`kvbridge.core.prefill_sglang`).

Every rule lives in `kvbridge.core.prefill_protocol.PrefillProtocol`; this module turns what
happens (messages, ticks, the scheduler's calls, engine writes) into its events and executes
the actions it returns. The control channel's thread owns the sockets and handles incoming
messages and ticks; the writes and engine connections the protocol hands out go to the write
pipeline (`kvbridge.write_pipeline`: its preparing, engine and reporting threads), which
reports each write's end back as an event.
"""

from __future__ import annotations

import logging
import time

from kvbridge.cache import KVArgs, PlanError
from kvbridge.cache.costs import DEFAULT_COSTS, WriteCosts, load_costs
from kvbridge.cache.peer import memory_regions
from kvbridge.cache.sglang_route import sglang_dtype_name, sglang_rank_problem
from kvbridge.config import ManagerConfig
from kvbridge.control.bootstrap import (
    BootstrapServer,
    LeaseRenewer,
    PrefillRank,
    register_prefill,
)
from kvbridge.control.sglang_dp import force_query, register_dp_rank
from kvbridge.control.sglang_routes import (
    SGLangBootstrapService,
    SGLangPrefillRank,
    register_sglang_prefill,
)
from kvbridge.core.prefill_events import (
    ChunkSubmitted,
    Connect,
    Connected,
    PrefillSettings,
    PrefillStats,
    SenderAborted,
    SenderCleared,
    SenderOpened,
    Write,
    WriteEnded,
)
from kvbridge.core.prefill_protocol import PrefillProtocol
from kvbridge.core.prefill_rooms import FINISHED_ROOMS_KEPT, MAX_UNCLAIMED_ROOMS
from kvbridge.core.protocol import Tick
from kvbridge.core.room import Chunk, Failure, RoomStatus
from kvbridge.engines import EngineError, WriteFenced
from kvbridge.prefill_sender import KVSender
from kvbridge.runtime import RankManager, RankRuntime
from kvbridge.wire import FailureKind, Message
from kvbridge.wire.messages import MemoryKind
from kvbridge.write_pipeline import WritePipeline
from kvbridge.write_transfers import WriteObserver

log = logging.getLogger("kvbridge.prefill")

# How long the control channel's thread waits, after a message gave an idle engine a write,
# for that write's copy to start before it handles the next message. A burst of requests
# (a decode batch asking for its rooms at once: tens of messages, ms of Python) otherwise
# keeps the GIL from the preparing and engine threads until it is all handled, and the first
# copy starts only after it.
FIRST_POST_WAIT_S = 0.002

__all__ = ["FINISHED_ROOMS_KEPT", "MAX_UNCLAIMED_ROOMS", "KVSender", "PrefillManager"]


def _kind_of(exc: Exception) -> FailureKind:
    """The failure kind of what the write path raised."""
    if isinstance(exc, WriteFenced):  # the lease ran out: decode was not heard from
        return FailureKind.PEER_DEAD
    if isinstance(exc, EngineError):
        return FailureKind.ENGINE
    if isinstance(exc, PlanError):
        return FailureKind.INCOMPATIBLE
    return FailureKind.INTERNAL


def write_costs(path: str | None, memory: MemoryKind) -> WriteCosts:
    """The cost figures `write_path` "auto" chooses by: from the calibration file if given
    (ValueError naming what is wrong in it), else the defaults, for this memory kind."""
    costs = load_costs(path) if path is not None else DEFAULT_COSTS
    return costs[memory]


class PrefillManager(RankManager):
    def __init__(self, kv_args: KVArgs, config: ManagerConfig) -> None:
        if config.bootstrap_url is None and not config.run_bootstrap:
            raise ValueError("a prefill manager needs bootstrap_url or run_bootstrap")
        problem = sglang_rank_problem(kv_args) if config.sglang_peers else None
        if problem is not None:
            raise ValueError(problem)
        costs = write_costs(config.write_costs, kv_args.memory_kind)  # (refused before binding)
        self.kv_args = kv_args
        self.config = config
        self.rank = kv_args.attn_tp_rank
        self.runtime = RankRuntime("prefill", kv_args, config, self._on_message, self._on_tick)
        self.engine, self.channel = self.runtime.engine, self.runtime.channel
        self.activity, self.metrics = self.runtime.activity, self.runtime.metrics
        # The local staging buffer: the worker gathers one chunk at a time into it.
        self._staging = self.runtime.staging
        staging = [self._staging.region] if self._staging is not None else []
        self.runtime.register([*memory_regions(kv_args), *staging])
        self.protocol = PrefillProtocol(
            PrefillSettings(
                kv_args=kv_args,
                endpoint=self.channel.endpoint,
                engine=config.engine,
                heartbeat_interval_s=config.heartbeat_interval_s,
                peer_timeout_s=config.peer_timeout_s,
                request_timeout_s=config.request_timeout_s,
                staging_timeout_s=config.staging_timeout_s,
                staging_bytes=self._staging.length if self._staging is not None else None,
                write_path=config.write_path,
                write_costs=costs,
                writes_in_flight=config.writes_in_flight,
                engine_notifies=self.engine.delivers_notifications,
                sglang_peers=config.sglang_peers,
            )
        )
        self.stats: PrefillStats = self.protocol.stats
        self._lock = self.runtime.lock
        # The last write handed to the pipeline (under the lock): the channel's thread looks
        # at it to wait for the first copy of a burst.
        self._last_handed: Write | None = None
        self.pipeline = WritePipeline(
            self.engine,
            kv_args,
            self._staging,
            self,
            write_timeout_s=config.write_timeout_s,
            lease_wait_s=config.peer_timeout_s,
            who=f"prefill rank {self.rank}",
        )
        self.engine_waits = self.pipeline.engine_waits
        self.bootstrap: BootstrapServer | None = None
        self._lease: LeaseRenewer | None = None
        for thread in self.pipeline.threads:
            self.runtime.watch(thread)
        self._handle = self.runtime.handle
        try:
            self.runtime.start(self.protocol, self._execute_own, self._counters)
            if config.run_bootstrap:
                self.bootstrap = BootstrapServer(
                    config.host,
                    config.bootstrap_port,
                    secret=config.secret,
                    service=SGLangBootstrapService() if config.sglang_peers else None,
                ).start()
            self.bootstrap_url = self.bootstrap.url if self.bootstrap else str(config.bootstrap_url)
            self._register(kv_args, config)
        except BaseException:
            self.close()  # no thread, socket or registration left behind
            raise

    def _register(self, kv_args: KVArgs, config: ManagerConfig) -> None:
        """Join the group at its bootstrap service: kvbridge's registration under a lease
        kept renewed, or sglang's (`PUT /route`, no lease, as sglang's ranks register)."""
        if config.sglang_peers:
            dp = config.data_parallel
            sglang_rank = SGLangPrefillRank(
                self.rank,
                kv_args.attn_tp_size,
                config.host,
                self.channel.port,
                kv_args.page_size,
                sglang_dtype_name(kv_args.dtype),
                dp.rank,
                dp.size,
                dp.follow_bootstrap_room,
            )
            register_sglang_prefill(self.bootstrap_url, sglang_rank, config.bootstrap_timeout_s)
            return
        rank = PrefillRank(
            self.rank, kv_args.attn_tp_size, config.host, self.channel.port, config.engine
        )
        lease_s = register_prefill(
            self.bootstrap_url,
            rank,
            timeout_s=config.bootstrap_timeout_s,
            secret=config.secret,
            wait_out_conflicts=True,
        )
        self._lease = LeaseRenewer(self.bootstrap_url, rank, lease_s, config.secret)

    def _counters(self) -> dict[str, float]:
        return {
            "staged_chunks": self.stats.staged_chunks,
            "staging_fallbacks": self.stats.staging_fallbacks,
            "blocks_written": self.pipeline.stats.blocks_written,
            "engine_call_seconds": self.engine_waits.busy_s,
            "engine_call_wait_seconds": self.engine_waits.waited_s,
        }

    # --- scheduler side ------------------------------------------------------------------

    def sender(self, room: int) -> KVSender:
        return KVSender(self, room)

    def open_room(self, room: int) -> RoomStatus | None:
        """Claim a room for a sender (created if new); its status, None if it ended here. A
        DP rank of an SGLang instance that does not follow bootstrap rooms registers the room
        first, as sglang's sender does (decode asks for it there); a room it cannot register
        fails at once, with the reason."""
        dp, forced = self.config.data_parallel, force_query()
        problem = dp.room_problem(room, forced)
        if problem is None and dp.registers_rooms(forced):
            try:
                register_dp_rank(self.bootstrap_url, room, dp.rank)
            except Exception as exc:
                problem = (
                    f"could not register its DP rank at the SGLang bootstrap "
                    f"{self.bootstrap_url}: {type(exc).__name__}: {exc}"[:400]
                )
        self._handle(SenderOpened(room))
        if problem is not None:
            self._handle(SenderAborted(room, f"room {room}: {problem}", FailureKind.BOOTSTRAP))
        return self.room_status(room)

    def queue_chunk(self, room: int, chunk: Chunk) -> None:
        self._handle(ChunkSubmitted(room, chunk))

    def abort_room(self, room: int, reason: str) -> None:
        self._handle(SenderAborted(room, reason))

    def clear_room(self, room: int) -> None:
        self._handle(SenderCleared(room))

    def room_status(self, room: int) -> RoomStatus | None:
        """The room's status, None once it was cleared (a dict read: no lock needed)."""
        state = self.protocol.rooms.get(room)
        return state.status if state is not None else None

    def pages_safe(self, room: int) -> bool:
        with self._lock:
            return self.protocol.pages_safe(room)

    def observe_writes(self, observer: WriteObserver) -> None:
        """Tell `observer` the plan of every write that ends from now on (benchmarks replay
        them through the raw engine). An observed plan's memory is never reused, so observe
        before the first write and only where the plans are wanted."""
        self.pipeline.observe_writes(observer)

    # --- control thread --------------------------------------------------------------------

    def _on_message(self, message: Message) -> None:
        idle = self.pipeline.idle
        if idle:
            self.pipeline.posting.clear()
        handed = self._last_handed
        self._handle(message)
        write = self._last_handed
        # Only for a write that can go now: one that waits for its lease waits for the answer
        # to a heartbeat, which this thread receives; a gated one for its data.
        if (
            idle
            and write is not handed
            and write is not None
            and (write.job.gate is None or write.job.gate.is_open)
            and self.lease_problem(write.job.peer_id) is None
        ):
            self.pipeline.posting.wait(FIRST_POST_WAIT_S)

    def _on_tick(self) -> bool:
        self._handle(Tick())
        # Nothing here needs polling (the engine thread polls the writes; messages wake the
        # channel): ticks at the idle pace keep deadlines and heartbeats.
        return False

    def _execute_own(self, action: object) -> None:
        """The actions only prefill has, engine connects and writes: to the write pipeline, in
        order (a peer is connected before its first write is set up)."""
        if isinstance(action, (Write, Connect)):
            self.pipeline.submit(action)
            if isinstance(action, Write):
                self._last_handed = action

    # --- what the write pipeline asks (`PipelineHost`) ---------------------------------------

    def room_going(self, room: int) -> bool:
        with self._lock:
            state = self.protocol.rooms.get(room)
            return state is not None and not state.status.finished

    def lease_problem(self, peer_id: str) -> str | None:
        # Without the lock (`lease_problem` says why that is safe): the engine thread asks
        # before every post and poll round, and waiting there for a control thread's whole
        # event to end held the copies back.
        return self.protocol.lease_problem(peer_id, time.monotonic())

    def completes_room(self, write: Write) -> bool:
        with self._lock:
            state = self.protocol.rooms.get(write.room)
            going = state is not None and not state.status.finished
            # (a chunk of the room through the peer's ring: decode scatters it first)
            ringed = state is not None and write.job.peer_id in state.ring_peers
            return going and not ringed and self.protocol.jobs.alone_to_peer(write.job)

    def write_ended(self, write: Write, failure: Exception | None, completed: bool) -> None:
        """Report a write's end to the protocol, with the failure (or, written, whether its
        notification completed the room)."""
        reason = None
        if failure is not None:
            log.warning("room %d: %s", write.room, failure)
            reason = Failure(_kind_of(failure), f"room {write.room}: {failure}")
        self._handle(WriteEnded(write, reason, completed))

    def connected(self, peer_id: str, error: str | None) -> None:
        self._handle(Connected(peer_id, error))

    def observe_write(self, seconds: float, blocks: int, nbytes: int) -> None:
        self.metrics.observe_write(seconds, blocks, nbytes)

    # --- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        if self._lease is not None:  # withdrawn first: a restarted rank can register at once
            self._lease.close()
        self.pipeline.close()
        self.runtime.close()
        if self.bootstrap is not None:
            self.bootstrap.close()
