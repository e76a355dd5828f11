"""Decode side: `DecodeManager` (one per decode rank) and `KVReceiver` (one per room).

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

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbridge.cache import BufferSpec, KVArgs
from kvbridge.cache.peer import memory_regions, registration_for
from kvbridge.cache.sglang_peer import (
    sglang_nixl_registration_for,
    sglang_registration_for,
    sglang_request_problem,
)
from kvbridge.cache.sglang_route import group_problem, sglang_rank_problem, sglang_route
from kvbridge.cache.topology import DecodeRoute, TopologyError, topology
from kvbridge.config import ManagerConfig
from kvbridge.control.bootstrap import BootstrapError, PrefillRank, lookup_prefill_group
from kvbridge.control.sglang_bootstrap import (
    HealthPoller,
    SGLangPrefillGroup,
    lookup_sglang_group,
)
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
)
from kvbridge.core.decode_protocol import FENCE_MARGIN_S, DecodeProtocol
from kvbridge.core.decode_sglang import SGLangMooncakePeer, SGLangNixlPeer
from kvbridge.core.protocol import Tick
from kvbridge.core.room import RoomStatus
from kvbridge.decode_scatter import ScatterThread
from kvbridge.runtime import RankManager, RankRuntime
from kvbridge.wire import FailureKind, KVPoll, Message
from kvbridge.wire.address import tcp_endpoint
from kvbridge.wire.notifications import COMPLETING_NOTIFICATIONS

log = logging.getLogger("kvbridge.decode")

# How long the scheduler's thread waits, after it opened a room while none was transferring,
# for the control channel's thread to send that room's requests. A scheduler opening a batch
# of rooms runs Python without blocking (32 rooms: about 1 ms here), and the channel's thread,
# which needs the GIL to send, got it only after the whole batch: every prefill rank then
# heard of the first room that much later.
FIRST_SEND_WAIT_S = 0.002


@dataclass(frozen=True)
class PrefillWay:
    """How this rank's rooms toward one prefill group go: the route (sources and dummies),
    per prefill rank the requests it counts on and its control endpoint (registered with),
    and the ranks whose status ends a room (None: every rank asked)."""

    route: DecodeRoute
    required: dict[int, int]
    endpoints: dict[int, str]
    reporting: frozenset[int] | None = None


class DecodeManager(RankManager):
    def __init__(self, kv_args: KVArgs, config: ManagerConfig) -> None:
        problem = sglang_rank_problem(kv_args) if config.sglang_peers else None
        if problem is not None:
            raise ValueError(problem)
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
            )
        )
        self.stats: DecodeStats = self.protocol.stats
        self._lock = self.runtime.lock
        self._groups: dict[str, list[PrefillRank]] = {}  # bootstrap URL → its prefill ranks
        self._sglang_groups: dict[str, SGLangPrefillGroup] = {}  # by SGLang bootstrap address
        # A room's last write notifies this rank; its complete form (`COMPLETING_NOTIFICATIONS`)
        # spares prefill a success status per room, and the room half a round trip. Not with
        # a secret: an engine's notifications are not authenticated, statuses are.
        self._capabilities = (
            frozenset({COMPLETING_NOTIFICATIONS})
            if self.engine.delivers_notifications and not config.secret
            else frozenset()
        )
        self._poll_often = False
        self._scatters = ScatterThread(self.kv_args, self.runtime, self.protocol, self.stats)
        self.runtime.watch(self._scatters.thread)
        self._health: HealthPoller | None = None
        if config.sglang_peers:
            self._health = HealthPoller(
                self._known_sglang_groups,
                lambda endpoints: self._handle(PrefillsAnswered(endpoints)),
                config.heartbeat_interval_s,
            )
            self.runtime.watch(self._health.thread)
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

    def _counters(self) -> dict[str, float]:
        return {
            "scattered_chunks": self.stats.scattered_chunks,
            "unexpected_chunks": self.stats.unexpected_chunks,
        }

    # --- scheduler side ------------------------------------------------------------------

    def receiver(self, room: int, bootstrap_url: str | None = None) -> KVReceiver:
        return KVReceiver(self, room, bootstrap_url or self.config.bootstrap_url)

    def route_to(self, url: str) -> PrefillWay:
        """How this rank's rooms toward the prefill group behind `url` go: its route (sources
        and dummies), per prefill rank the requests it needs and its control endpoint, this
        rank registered with each. Looks the group up once (blocking, up to
        bootstrap_timeout_s); BootstrapError or TopologyError say why there is no route."""
        if self.config.sglang_peers:
            return self._sglang_way(url)
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

    def _sglang_way(self, address: str) -> PrefillWay:
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
            rank: self._register_sglang(group.endpoints[rank]) for rank in way.route.prefill_ranks
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
        for address in [a for a, g in self._sglang_groups.items() if endpoint in g.endpoints]:
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
        about two peer timeouts."""
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


class KVReceiver:
    """One room on the decode side: give it the destination pages, poll its state. Until
    `init` the receiver keeps the room's status (looking its prefill group up, or why it could
    not); from `init` until `clear` the decode protocol does, and the receiver reads it there;
    `clear` hands the last status back to the receiver."""

    def __init__(self, manager: DecodeManager, room: int, bootstrap_url: str | None) -> None:
        self.manager = manager
        self.room = room
        self._status = RoomStatus()
        self._open = False  # from init() to clear(): the status lives in the protocol
        self._way: PrefillWay | None = None
        if bootstrap_url is None:
            self._status.fail(FailureKind.BOOTSTRAP, "no bootstrap URL for this room")
            return
        try:
            self._way = manager.route_to(bootstrap_url)
        except BootstrapError as exc:
            self._status.fail(FailureKind.BOOTSTRAP, str(exc))
            return
        except TopologyError as exc:
            self._status.fail(FailureKind.INCOMPATIBLE, str(exc))
            return
        self._status.advance(KVPoll.WaitingForInput)

    def init(
        self,
        kv_pages: npt.ArrayLike,
        aux_index: int | None = None,
        state_indices: Sequence[int] = (),
        decode_prefix_len: int | None = None,
    ) -> None:
        """Ask the prefill ranks to fill these pages (and aux slot, state slots)
        (`DecodeProtocol` decides what each prefill rank is asked).

        `kv_pages` pairs with the room's pages after the first `decode_prefix_len` tokens;
        SKIPPED_PAGE (-1) where decode needs nothing (pages of one size on both sides)."""
        way = self._way
        if self._status.finished or way is None or self._open:
            return
        pages = np.asarray(kv_pages, dtype=np.int32).ravel()
        if self.manager.config.sglang_peers:  # an SGLang prefill checks no index of ours
            args = self.manager.kv_args
            problem = sglang_request_problem(args, pages, aux_index, state_indices)
            if problem is not None:
                self._status.fail(FailureKind.INCOMPATIBLE, f"room {self.room}: {problem}")
                self.manager.abort_room(self.room, problem, list(way.endpoints.values()))
                return
        opened = RoomOpened(
            room=self.room,
            route=way.route,
            required=dict(way.required),
            endpoints=dict(way.endpoints),
            pages=pages,
            aux_index=aux_index,
            state_indices=tuple(state_indices),
            decode_prefix_len=decode_prefix_len,
            reporting=way.reporting,
        )
        self._open = True
        self.manager.open_room(opened)

    def _current(self) -> RoomStatus:
        if self._open:
            status = self.manager.room_status(self.room)
            if status is not None:
                return status
        return self._status

    # A status's failure kind and reason are set before its state reads Failed: the reads
    # below need no lock.
    def poll(self) -> KVPoll:
        return self._current().poll

    @property
    def failure_reason(self) -> str | None:
        return self._current().failure_reason

    @property
    def failure_kind(self) -> FailureKind | None:
        """Why the room failed, as a kind; None unless it failed."""
        return self._current().failure_kind

    def abort(self, reason: str) -> None:
        """Give up on the room: it fails at once; its pages are safe to reuse only when
        `pages_safe` says so (every prefill rank confirmed that nothing is in flight)."""
        if self._open:
            self.manager.abort_room(self.room, reason)
        elif self._status.fail(FailureKind.ABORTED, f"aborted by decode: {reason}"):
            # Before init(): the prefill ranks hear it now, not at their deadline.
            endpoints = self._way.endpoints.values() if self._way is not None else ()
            self.manager.abort_room(self.room, reason, list(endpoints))

    @property
    def pages_safe(self) -> bool:
        """Whether the room's pages can be handed back to the allocator: the room succeeded,
        or it failed and no prefill rank can still write into them (each confirmed, reported
        how the room ended, or was declared dead)."""
        return self.manager.pages_safe(self.room, self._current())

    def clear(self) -> None:
        """The one cleanup path of the room on this side (idempotent)."""
        if not self._open:
            return
        last = self.manager.clear_room(self.room)
        if last is not None:
            self._status = last
        self._open = False
