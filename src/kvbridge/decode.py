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
        self._target: PrefillRank | None = None
        self._endpoint: str | None = None
        if bootstrap_url is None:
            self._status.fail("no bootstrap URL for this room")
            return
        try:
            group = manager.prefill_group(bootstrap_url)
        except BootstrapError as exc:
            self._status.fail(str(exc))
            return
        size = group[0].attn_tp_size
        if size != manager.kv_args.attn_tp_size:
            self._status.fail(
                f"prefill attention TP {size} differs from decode's "
                f"{manager.kv_args.attn_tp_size}: not supported by this version"
            )
            return
        self._target = group[manager.rank]
        self._endpoint = manager._ensure_registered(self._target)
        self._status.advance(KVPoll.WaitingForInput)

    def init(
        self,
        kv_pages: npt.ArrayLike,
        aux_index: int | None = None,
        state_indices: Sequence[int] = (),
        decode_prefix_len: int | None = None,
    ) -> None:
        """Ask the prefill rank to fill these pages (and aux slot, state slots)."""
        if self._status.finished or self._target is None or self._endpoint is None:
            return
        pages = np.asarray(kv_pages, dtype=np.int32).ravel()
        request = TransferRequest(
            room=self.room,
            peer_id=self.manager.peer_id,
            is_dummy=False,
            dst_kv_indices=pages,
            dst_aux_index=aux_index,
            dst_state_indices=[list(state_indices)] if state_indices else [],
            required_dst_info_num=1,
            decode_prefix_len=decode_prefix_len,
        )
        state = DecodeRoom(
            room=self.room,
            expected_ranks=frozenset({self._target.rank}),
            needs_notification=self.manager.engine.delivers_notifications,
            deadline=time.monotonic() + self.manager.config.transfer_timeout_s,
        )
        state.status.advance(KVPoll.Transferring)
        with self.manager._lock:
            self.manager._rooms[self.room] = state
        self._status = state.status
        self.manager.channel.send(self._endpoint, request)

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
        if failed and self._endpoint is not None:
            decode_ip = self.manager.channel.host
            message = Abort(self.room, decode_ip, self.manager.channel.port, reason)
            self.manager.channel.send(self._endpoint, message)

    def clear(self) -> None:
        """The one cleanup path of the room on this side (idempotent)."""
        with self.manager._lock:
            self.manager._rooms.pop(self.room, None)
