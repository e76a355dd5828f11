"""Decode side: `DecodeManager` (one per decode rank) and `KVReceiver` (one per room,
decode_receiver.py).

A receiver finds its prefill group through the bootstrap service, registers this rank's
memory with the prefill rank it pairs with (once per peer), and sends one `TransferRequest`
per room when the scheduler calls `init()` with the destination pages. The room succeeds when
every expected prefill rank reported success (and, with an engine that notifies, its last
write's notification arrived); it fails with the reason a prefill rank gave, or when its
deadline passes.

Every rule lives in `kvbridge.core.decode_protocol.DecodeProtocol`; this module turns what
happens (messages, ticks, the scheduler's calls, scatters) into its events and executes the
actions it returns. Threads: the control channel's thread owns the sockets, handles messages,
polls the engine's notifications (NIXL needs the target to drive progress) and ticks; one
scatter thread copies staged chunks from the ring into pages.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import time
from collections.abc import Sequence

from kvbridge.cache import BufferSpec, KVArgs
from kvbridge.cache.pairing import STAGED_WHOLE_ROWS
from kvbridge.cache.peer import memory_regions, registration_for
from kvbridge.cache.sglang_peer import sglang_nixl_registration_for, sglang_registration_for
from kvbridge.cache.sglang_route import group_problem, sglang_rank_problem, sglang_route
from kvbridge.cache.topology import DecodeRoute, TopologyError, topology
from kvbridge.config import ManagerConfig
from kvbridge.control.bootstrap import PrefillRank, lookup_prefill_group
from kvbridge.control.sglang_bootstrap import (
    HealthPoller,
    SGLangPrefillGroup,
    lookup_sglang_group,
)
from kvbridge.control.sglang_dp import DPRankAnswer, DPRankQueries, force_query
from kvbridge.core.decode_events import (
    Closing,
    DecodeSettings,
    DecodeStats,
    ForgetPrefill,
    LeasesRenewing,
    PrefillsAnswered,
    Registering,
    RoomAborted,
    RoomCleared,
    RoomOpened,
    ScatterChunk,
    WriteAux,
)
from kvbridge.core.decode_protocol import FENCE_MARGIN_S, DecodeProtocol
from kvbridge.core.decode_sglang import SGLangMooncakePeer, SGLangNixlPeer
from kvbridge.core.protocol import Tick
from kvbridge.core.room import RoomStatus
from kvbridge.decode_receiver import KVReceiver, PrefillWay
from kvbridge.decode_scatter import ScatterThread
from kvbridge.engines import EngineError
from kvbridge.runtime import RankManager, RankRuntime
from kvbridge.wire import KVPoll, Message
from kvbridge.wire.address import tcp_endpoint
from kvbridge.wire.messages import MemoryKind
from kvbridge.wire.notifications import COMPLETING_NOTIFICATIONS

log = logging.getLogger("kvbridge.decode")

# How long the scheduler's thread waits, after it opened a room while none was transferring,
# for the control channel's thread to send that room's requests. A scheduler opening a batch
# of rooms runs Python without blocking (32 rooms: about 1 ms here), and the channel's thread,
# which needs the GIL to send, got it only after the whole batch: every prefill rank then
# heard of the first room that much later.
FIRST_SEND_WAIT_S = 0.002
# Receivers' polls take the engine's notifications at most this often: a scheduler polls each
# of its rooms every step, and one engine call serves them all.
NOTIFICATIONS_EVERY_S = 50e-6

__all__ = ["FIRST_SEND_WAIT_S", "DecodeManager", "KVReceiver", "PrefillWay"]


class DecodeManager(RankManager):
    def __init__(self, kv_args: KVArgs, config: ManagerConfig) -> None:
        problem = sglang_rank_problem(kv_args) if config.sglang_peers else None
        if problem is not None:
            raise ValueError(problem)
        if config.data_parallel.size > 1:
            raise ValueError(
                "data_parallel places a prefill rank in its instance; a decode rank of a DP "
                "instance is a rank of its own to its prefill peers (leave data_parallel unset)"
            )
        self.config = config
        self.rank = kv_args.attn_tp_rank
        self.runtime = RankRuntime("decode", kv_args, config, self._on_message, self._on_tick)
        self.engine, self.channel = self.runtime.engine, self.runtime.channel
        self.activity, self.metrics = self.runtime.activity, self.runtime.metrics
        # The staging ring prefill writes staged chunks into (heterogeneous TP), registered
        # with the KV memory.
        ring = self.runtime.staging
        if ring is not None:
            kv_args = dataclasses.replace(
                kv_args, staging_buffer=BufferSpec(ring.ptr, ring.length, 1)
            )
        self.kv_args = kv_args
        self.runtime.register(memory_regions(kv_args))
        self.peer_id = f"decode-{self.rank}@{self.channel.endpoint}"
        self.protocol = DecodeProtocol(
            DecodeSettings(
                rank=self.rank,
                peer_id=self.peer_id,
                host=self.channel.host,
                control_port=self.channel.port,
                # Sent in this rank's registrations; prefill echoes it, and statuses, acks and
                # heartbeats without it are not from a prefill rank this rank registered with.
                session_token=os.urandom(16),
                heartbeat_interval_s=config.heartbeat_interval_s,
                peer_timeout_s=config.peer_timeout_s,
                write_grace_s=config.write_timeout_s if self.engine.progresses_on_its_own else 0,
                staging_bytes=ring.length if ring is not None else None,
                transfer_timeout_s=config.transfer_timeout_s,
                engine_notifies=self.engine.delivers_notifications,
                aux_geometry=tuple((aux.item_len, aux.num_items) for aux in kv_args.aux_buffers),
                aux_in_host_memory=kv_args.memory_kind == MemoryKind.DRAM,
            )
        )
        self.stats: DecodeStats = self.protocol.stats
        self._lock = self.runtime.lock
        self._groups: dict[str, list[PrefillRank]] = {}  # bootstrap URL → its prefill ranks
        self._sglang_groups: dict[str, SGLangPrefillGroup] = {}  # by SGLang bootstrap address
        # A room's last write notifies this rank; its complete form (`COMPLETING_NOTIFICATIONS`)
        # spares prefill a success status per room, and the room half a round trip. Not with
        # a secret: an engine's notifications are not authenticated, statuses are.
        completing = self.engine.delivers_notifications and not config.secret
        self._capabilities = frozenset(
            {STAGED_WHOLE_ROWS, *([COMPLETING_NOTIFICATIONS] if completing else [])}
        )
        self._poll_often = False
        self._notifications_due = 0.0  # (a hint: racing pollers may both collect)
        self._scatters = ScatterThread(self.kv_args, self.runtime, self.protocol, self.stats)
        self.runtime.watch(self._scatters.thread)
        self._health: HealthPoller | None = None
        self._dp_queries: DPRankQueries | None = None
        if config.sglang_peers:
            self._health = HealthPoller(
                self._known_sglang_groups,
                lambda endpoints: self._handle(PrefillsAnswered(endpoints)),
                config.heartbeat_interval_s,
            )
            self.runtime.watch(self._health.thread)
            self._dp_queries = DPRankQueries(config.bootstrap_timeout_s)
            self.runtime.watch(self._dp_queries.thread)
        self._handle = self.runtime.handle
        try:
            self.runtime.start(self.protocol, self._execute_own, self._counters)
        except BaseException:
            self.close()
            raise

    def _execute_own(self, action: object) -> None:
        """The actions only decode has (the runtime sends and wakes)."""
        if isinstance(action, ScatterChunk):
            self._scatters.put(action)
        elif isinstance(action, ForgetPrefill):
            self._forget_groups(action.endpoint)
        elif isinstance(action, WriteAux):
            aux = self.kv_args.aux_buffers[action.buffer_index]
            ctypes.memmove(aux.ptr + action.slot * aux.item_len, action.data, len(action.data))

    def _counters(self) -> dict[str, float]:
        return {
            "scattered_chunks": self.stats.scattered_chunks,
            "unexpected_chunks": self.stats.unexpected_chunks,
        }

    # --- scheduler side ------------------------------------------------------------------

    def receiver(
        self, room: int, bootstrap_url: str | None = None, prefill_dp_rank: int | None = None
    ) -> KVReceiver:
        return KVReceiver(self, room, bootstrap_url or self.config.bootstrap_url, prefill_dp_rank)

    def route_to(self, url: str, dp_rank: int = 0) -> PrefillWay:
        """How this rank's rooms toward the prefill group behind `url` (its data-parallel rank
        `dp_rank`: SGLang groups only) go: its route (sources and dummies), per prefill rank
        the requests it needs and its control endpoint, this rank registered with each. Looks
        the group up once (blocking, up to bootstrap_timeout_s); BootstrapError or
        TopologyError say why there is no route."""
        if self.config.sglang_peers:
            return self._sglang_way(url, dp_rank)
        group = self.prefill_group(url)
        args = self.kv_args
        mapping = topology(
            group[0].attn_tp_size, args.attn_tp_size, args.total_kv_heads, args.kv_layout
        )
        route = mapping.route(args.attn_tp_rank)
        # Only DCP rank 0 of a decode rank sends the dummies (the prefill ranks count so).
        dummies = route.dummies if args.dcp_rank == 0 else ()
        decode_route = DecodeRoute(route.decode_rank, route.sources, dummies)
        required = {
            rank: mapping.required_requests(rank, args.dcp_size)
            for rank in decode_route.prefill_ranks
        }
        endpoints = {
            rank: self.ensure_registered(group[rank]) for rank in decode_route.prefill_ranks
        }
        return PrefillWay(decode_route, required, endpoints)

    def prefill_dp_rank(self, url: str, room: int, given: int | None) -> int | None:
        """The data-parallel rank of the prefill group behind `url` that takes `room`; None:
        its bootstrap service is to be asked (`ask_prefill_dp_rank`). A kvbridge group has
        one. Blocks for the group's lookup the first time."""
        if not self.config.sglang_peers:
            return 0
        return self.sglang_group(url).dp_rank_of(room, given, force_query())

    def ask_prefill_dp_rank(self, url: str, room: int, answer: DPRankAnswer) -> None:
        """Ask the SGLang bootstrap service behind `url` which DP rank took `room`, in the
        background; `answer` hears it (or why not) on the query thread."""
        assert self._dp_queries is not None, "only an SGLang-mode rank asks"
        self._dp_queries.ask(url, room, self.sglang_group(url).dp_size, answer)

    def _sglang_way(self, address: str, dp_rank: int) -> PrefillWay:
        """`route_to` for an SGLang prefill group: sglang's rank mapping, its registration."""
        group = self.sglang_group(address)
        args = self.kv_args
        problem = group_problem(group, args, self.config.engine)
        if problem is not None:
            raise TopologyError(f"{address}: {problem}")
        way = sglang_route(
            group.attn_tp_size,
            args.attn_tp_size,
            args.attn_tp_rank,
            args.total_kv_heads,
            args.kv_layout,
        )
        endpoints = {
            rank: self._register_sglang(group.endpoints[dp_rank][rank])
            for rank in way.route.prefill_ranks
        }
        return PrefillWay(way.route, way.required, endpoints, way.reporting)

    def sglang_group(self, address: str) -> SGLangPrefillGroup:
        """The SGLang prefill group behind a bootstrap address (looked up once, then cached)."""
        with self._lock:
            group = self._sglang_groups.get(address)
        if group is None:
            group = lookup_sglang_group(address, self.config.bootstrap_timeout_s)
            with self._lock:
                self._sglang_groups[address] = group
        return group

    def _known_sglang_groups(self) -> list[SGLangPrefillGroup]:
        with self._lock:
            return list(self._sglang_groups.values())

    def _register_sglang(self, endpoint: str) -> str:
        """Register this rank with an SGLang prefill rank (once), in sglang's frames."""
        with self._lock:
            if self.protocol.registered(endpoint):
                return endpoint
        host, port = self.channel.host, self.channel.port
        if self.config.engine == "nixl":
            agent = self.runtime.endpoint_name  # the name inside the agent's metadata
            nixl_registration = sglang_nixl_registration_for(
                self.kv_args,
                host=host,
                control_port=port,
                agent_name=agent,
                agent_metadata=self.engine.endpoint(),
            )
            self._handle(Registering(endpoint, nixl_registration, SGLangNixlPeer(agent)))
            return endpoint
        session_id = self.engine.endpoint().decode()
        registration = sglang_registration_for(
            self.kv_args, host=host, control_port=port, session_id=session_id
        )
        self._handle(Registering(endpoint, registration, SGLangMooncakePeer(session_id)))
        return endpoint

    def renew_leases(self, url: str, rooms: Sequence[int]) -> None:
        """The scheduler will still ask the prefill group behind `url` for these rooms (its
        requests wait in the queue): their request deadlines there start again. Blocks for
        the group's lookup the first time; BootstrapError or TopologyError if it fails."""
        way = self.route_to(url)
        self._handle(LeasesRenewing(tuple(way.endpoints.values()), tuple(rooms)))

    def knows_prefill(self, url: str) -> bool:
        """Whether the prefill group behind `url` is cached: opening a room toward it then
        makes no blocking lookup."""
        with self._lock:
            return url in self._groups or url in self._sglang_groups

    def prefill_group(self, url: str) -> list[PrefillRank]:
        """The prefill ranks behind a bootstrap URL (looked up once, then cached)."""
        with self._lock:
            group = self._groups.get(url)
        if group is None:
            group = lookup_prefill_group(url, self.config.bootstrap_timeout_s, self.config.secret)
            with self._lock:
                self._groups[url] = group
        return group

    def _forget_groups(self, endpoint: str) -> None:
        """Forget every cached group the prefill rank at `endpoint` was in (under the lock)."""
        stale = [
            url
            for url, group in self._groups.items()
            if any(tcp_endpoint(rank.host, rank.port) == endpoint for rank in group)
        ]
        for url in stale:
            del self._groups[url]
        for address in [a for a, g in self._sglang_groups.items() if endpoint in g.every_endpoint]:
            del self._sglang_groups[address]

    def ensure_registered(self, target: PrefillRank) -> str:
        """Register this rank with a prefill rank (once); its control endpoint."""
        endpoint = tcp_endpoint(target.host, target.port)
        with self._lock:
            if self.protocol.registered(endpoint):
                return endpoint
        registration = registration_for(
            self.kv_args,
            peer_id=self.peer_id,
            host=self.channel.host,
            control_port=self.channel.port,
            engine=self.config.engine,
            engine_descriptor=self.engine.endpoint(),
            capabilities=self._capabilities,
            session_token=self.protocol.settings.session_token,
        )
        self._handle(Registering(endpoint, registration))
        return endpoint

    def open_room(self, opened: RoomOpened) -> None:
        if self.protocol.busy:  # (read without the lock: a wrong answer costs one wait at most)
            self._handle(opened)
            return
        # The first room while none transfers: its requests leave before the scheduler opens
        # the next one (its burst of rooms otherwise keeps them until it blocks).
        with self.channel.sending_now(FIRST_SEND_WAIT_S):
            self._handle(opened)

    def room_status(self, room: int) -> RoomStatus | None:
        """An open room's status (`DecodeProtocol.room_status`: read without the lock)."""
        return self.protocol.room_status(room)

    def collect_notifications(self) -> None:
        """Take the engine's notifications now, not at the channel's next tick (up to
        `BUSY_POLL_MS` away): a receiver polled for a room its last write completed sees
        it at once, as vLLM's connectors read NIXL's notifications when the scheduler asks.
        An engine error here is left to the channel's tick, which reports it."""
        now = time.monotonic()
        if not self.engine.delivers_notifications or now < self._notifications_due:
            return
        self._notifications_due = now + NOTIFICATIONS_EVERY_S
        try:
            notifications = self.engine.notifications()
        except EngineError:
            return
        if notifications:
            self._handle(Tick(tuple(message for _, message in notifications)))

    def abort_room(self, room: int, reason: str, endpoints: Sequence[str] = ()) -> None:
        self._handle(RoomAborted(room, reason, tuple(endpoints)))

    def pages_safe(self, room: int, status: RoomStatus) -> bool:
        """Whether no prefill rank can still write into the room's pages; `status`: the
        receiver's own, for a room not open here."""
        with self._lock:
            safe = self.protocol.pages_safe(room, time.monotonic())
            if safe is None:  # never opened, or cleared: as its last status says
                return status.finished or status.poll != KVPoll.Transferring
            return safe

    def clear_room(self, room: int) -> RoomStatus | None:
        """Forget the room (counted under its outcome); its last status, if it was open."""
        status = self.protocol.room_status(room)
        self._handle(RoomCleared(room))
        return status

    # --- control thread --------------------------------------------------------------------

    def _on_message(self, message: Message) -> None:
        self._handle(message)

    def poll_engine_often(self, on: bool) -> None:
        """Poll the engine at the busy pace even with no room in flight: for something else
        that writes into this rank's memory through the engine (a benchmark's raw replay),
        with an engine that moves data only when the target polls (NIXL over TCP)."""
        self._poll_often = on

    def _on_tick(self) -> bool:
        notifications = self.engine.notifications()
        self._handle(Tick(tuple(message for _, message in notifications)))
        if not self.engine.delivers_notifications:
            # Nothing to poll (statuses arrive as messages, which wake the channel): its
            # threads leave the CPU to the engine's own.
            return False
        if self._poll_often:
            return True
        with self._lock:
            return self.protocol.busy

    # --- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop: rooms that a prefill rank may still write into are aborted first, and their
        writers heard (or declared dead and fenced) before the memory is deregistered, within
        about two peer timeouts. Rooms still waiting for their prefill DP rank fail first:
        none opens from here on."""
        if self._dp_queries is not None:
            self._dp_queries.close()
        self._handle(Closing())
        deadline = time.monotonic() + 2 * self.config.peer_timeout_s + FENCE_MARGIN_S
        while True:
            with self._lock:
                unsafe = len(self.protocol.unsafe_rooms(time.monotonic()))
            if not unsafe or not self.channel.alive or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        if unsafe:
            log.warning("closing with %d room(s) whose writers were not heard from", unsafe)
        self._scatters.close()
        if self._health is not None:
            self._health.close()
        self.runtime.close()
