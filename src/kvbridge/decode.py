"""Decode side: `DecodeManager` (one per decode rank) and `KVReceiver` (one per room).

A receiver finds its prefill group through the bootstrap service, registers this rank's
memory with the prefill rank it pairs with (once per peer), and sends one `TransferRequest`
per room when the scheduler calls `init()` with the destination pages. The room succeeds when
every expected prefill rank reported success (and, with an engine that notifies, its last
write's notification arrived); it fails with the reason a prefill rank gave, or when its
deadline passes.

Threads: the control channel's thread owns the sockets, handles statuses, polls the engine's
notifications (NIXL needs the target to drive progress) and checks deadlines.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvbridge.cache import KVArgs
from kvbridge.cache.peer import memory_regions, registration_for
from kvbridge.cache.topology import DecodeRoute, TopologyError, topology
from kvbridge.config import ManagerConfig
from kvbridge.control.bootstrap import BootstrapError, PrefillRank, lookup_prefill_group
from kvbridge.control.channel import ControlChannel
from kvbridge.engines import create_engine
from kvbridge.room import DecodeRoom, RoomStatus, parse_notification
from kvbridge.wire import Abort, KVPoll, Message, TransferRequest, TransferStatus

log = logging.getLogger("kvbridge.decode")


class DecodeManager:
    def __init__(self, kv_args: KVArgs, config: ManagerConfig) -> None:
        self.kv_args = kv_args
        self.config = config
        self.rank = kv_args.attn_tp_rank
        self.engine = create_engine(config.engine, f"decode-{self.rank}-{uuid.uuid4().hex[:8]}")
        self.engine.register(memory_regions(kv_args))
        self._lock = threading.Lock()
        self._rooms: dict[int, DecodeRoom] = {}
        self._groups: dict[str, list[PrefillRank]] = {}
        self._registered: set[str] = set()
        self.channel = ControlChannel(
            config.host, self._on_message, self._on_tick, name="kvbridge-decode"
        )
        self.peer_id = f"decode-{self.rank}@{self.channel.endpoint}"
        self.channel.start()

    def receiver(self, room: int, bootstrap_url: str | None = None) -> KVReceiver:
        return KVReceiver(self, room, bootstrap_url or self.config.bootstrap_url)

    def prefill_group(self, url: str) -> list[PrefillRank]:
        """The prefill ranks behind a bootstrap URL (looked up once, then cached)."""
        with self._lock:
            group = self._groups.get(url)
        if group is None:
            group = lookup_prefill_group(url, self.config.bootstrap_timeout_s)
            with self._lock:
                self._groups[url] = group
        return group

    def _ensure_registered(self, target: PrefillRank) -> str:
        """Send this rank's registration to a prefill rank once; its control endpoint."""
        endpoint = f"tcp://{target.host}:{target.port}"
        with self._lock:
            if endpoint in self._registered:
                return endpoint
            self._registered.add(endpoint)
        registration = registration_for(
            self.kv_args,
            peer_id=self.peer_id,
            host=self.channel.host,
            control_port=self.channel.port,
            engine=self.config.engine,
            engine_descriptor=self.engine.endpoint(),
        )
        self.channel.send(endpoint, registration)
        return endpoint

    # --- control thread --------------------------------------------------------------------

    def _on_message(self, message: Message) -> None:
        if not isinstance(message, TransferStatus):
            log.warning("unexpected %s on a decode rank, ignored", type(message).__name__)
            return
        with self._lock:
            state = self._rooms.get(message.room)
            if state is None:
                log.info("status for unknown or cleared room %d, ignored", message.room)
                return
            state.on_status(message.prefill_rank, message.status, message.reason)

    def _on_tick(self) -> bool:
        notifications = self.engine.notifications()
        now = time.monotonic()
        with self._lock:
            for _, message in notifications:
                parsed = parse_notification(message)
                if parsed is None:
                    continue
                room, prefill_rank = parsed
                state = self._rooms.get(room)
                if state is not None:
                    state.on_notification(prefill_rank)
            busy = False
            for state in self._rooms.values():
                state.check_deadline(now)
                busy = busy or state.status.poll == KVPoll.Transferring
            return busy

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self.channel.alive

    def close(self) -> None:
        self.channel.close()
        self.engine.close()


class KVReceiver:
    """One room on the decode side: give it the destination pages, poll its state."""

    def __init__(self, manager: DecodeManager, room: int, bootstrap_url: str | None) -> None:
        self.manager = manager
        self.room = room
        self._status = RoomStatus()
        self._route: DecodeRoute | None = None
        self._required: dict[int, int] = {}
        self._endpoints: dict[int, str] = {}
        if bootstrap_url is None:
            self._status.fail("no bootstrap URL for this room")
            return
        args = manager.kv_args
        try:
            group = manager.prefill_group(bootstrap_url)
            mapping = topology(
                group[0].attn_tp_size, args.attn_tp_size, args.total_kv_heads, args.kv_layout
            )
        except (BootstrapError, TopologyError) as exc:
            self._status.fail(str(exc))
            return
        route = mapping.route(args.attn_tp_rank)
        # Only DCP rank 0 of a decode rank sends the dummies (the prefill ranks count so).
        dummies = route.dummies if args.dcp_rank == 0 else ()
        self._route = DecodeRoute(route.decode_rank, route.sources, dummies)
        for prefill_rank in self._route.prefill_ranks:
            self._endpoints[prefill_rank] = manager._ensure_registered(group[prefill_rank])
            self._required[prefill_rank] = mapping.required_requests(prefill_rank, args.dcp_size)
        self._status.advance(KVPoll.WaitingForInput)

    def init(
        self,
        kv_pages: npt.ArrayLike,
        aux_index: int | None = None,
        state_indices: Sequence[int] = (),
        decode_prefix_len: int | None = None,
    ) -> None:
        """Ask the prefill ranks to fill these pages (and aux slot, state slots): one request
        to each prefill rank this decode rank reads heads from, a dummy to the ranks it only
        tells about the room. The first source alone writes the aux and state slots."""
        if self._status.finished or self._route is None:
            return
        pages = np.asarray(kv_pages, dtype=np.int32).ravel()
        first_source = self._route.sources[0].prefill_rank if self._route.sources else None

        def request(prefill_rank: int, dummy: bool) -> TransferRequest:
            first = prefill_rank == first_source
            return TransferRequest(
                room=self.room,
                peer_id=self.manager.peer_id,
                is_dummy=dummy,
                dst_kv_indices=np.empty(0, dtype=np.int32) if dummy else pages,
                dst_aux_index=aux_index if first else None,
                dst_state_indices=[list(state_indices)] if first and state_indices else [],
                required_dst_info_num=self._required[prefill_rank],
                decode_prefix_len=decode_prefix_len,
            )

        requests = [(s.prefill_rank, request(s.prefill_rank, False)) for s in self._route.sources]
        requests += [(rank, request(rank, True)) for rank in self._route.dummies]
        notifying = (
            frozenset(source.prefill_rank for source in self._route.sources)
            if self.manager.engine.delivers_notifications
            else frozenset()
        )
        state = DecodeRoom(
            room=self.room,
            expected_ranks=frozenset(self._route.prefill_ranks),
            notifying_ranks=notifying,
            deadline=time.monotonic() + self.manager.config.transfer_timeout_s,
        )
        state.status.advance(KVPoll.Transferring)
        with self.manager._lock:
            self.manager._rooms[self.room] = state
        self._status = state.status
        for prefill_rank, message in requests:
            self.manager.channel.send(self._endpoints[prefill_rank], message)

    def poll(self) -> KVPoll:
        with self.manager._lock:
            return self._status.poll

    @property
    def failure_reason(self) -> str | None:
        with self.manager._lock:
            return self._status.failure_reason

    def abort(self, reason: str) -> None:
        with self.manager._lock:
            failed = self._status.fail(f"aborted by decode: {reason}")
        if failed:
            decode_ip = self.manager.channel.host
            message = Abort(self.room, decode_ip, self.manager.channel.port, reason)
            for endpoint in self._endpoints.values():
                self.manager.channel.send(endpoint, message)

    def clear(self) -> None:
        """The one cleanup path of the room on this side (idempotent)."""
        with self.manager._lock:
            self.manager._rooms.pop(self.room, None)
