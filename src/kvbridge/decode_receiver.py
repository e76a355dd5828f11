"""`KVReceiver`: one room on the decode side, and `PrefillWay`, how its requests go.

Until `init` the receiver keeps the room's status (looking its prefill group up, or why it
could not); from `init` until `clear` the decode protocol does, and the receiver reads it
there; `clear` hands the last status back to the receiver. Toward an SGLang prefill group with
data parallelism whose DP rank for the room is asked of its bootstrap service, the receiver
stays `Bootstrapping` until the answer (on the manager's query thread); an `init` before it is
kept and carried out then.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvbridge.cache.sglang_peer import sglang_request_problem
from kvbridge.cache.topology import DecodeRoute, TopologyError
from kvbridge.control.bootstrap import BootstrapError
from kvbridge.core.decode_events import RoomOpened
from kvbridge.core.room import RoomStatus
from kvbridge.wire import FailureKind, KVPoll

if TYPE_CHECKING:
    from kvbridge.decode import DecodeManager


@dataclass(frozen=True)
class PrefillWay:
    """How this rank's rooms toward one prefill group go: the route (sources and dummies),
    per prefill rank the requests it counts on and its control endpoint (registered with),
    and the ranks whose status ends a room (None: every rank asked)."""

    route: DecodeRoute
    required: dict[int, int]
    endpoints: dict[int, str]
    reporting: frozenset[int] | None = None


@dataclass(frozen=True)
class _Init:
    pages: npt.NDArray[np.int32]
    aux_index: int | None
    state_indices: tuple[int, ...]
    decode_prefix_len: int | None


class KVReceiver:
    """One room on the decode side: give it the destination pages, poll its state.

    `prefill_dp_rank`: the data-parallel rank of an SGLang prefill group that took the room,
    where the caller knows it (sglang's `disagg_prefill_dp_rank`); otherwise it is decided as
    sglang's decode decides it (`SGLangPrefillGroup.dp_rank_of`)."""

    def __init__(
        self,
        manager: DecodeManager,
        room: int,
        bootstrap_url: str | None,
        prefill_dp_rank: int | None = None,
    ) -> None:
        self.manager = manager
        self.room = room
        self._status = RoomStatus()
        self._open = False  # from init() to clear(): the status lives in the protocol
        self._way: PrefillWay | None = None
        self._url = bootstrap_url
        self._waiting_init: _Init | None = None  # an init() before the DP rank was known
        self._resolving = threading.Lock()  # the DP rank's answer against the scheduler's calls
        self._cleared = False  # clear() before the DP rank was known: the answer is dropped
        if bootstrap_url is None:
            self._status.fail(FailureKind.BOOTSTRAP, "no bootstrap URL for this room")
            return
        try:
            dp_rank = manager.prefill_dp_rank(bootstrap_url, room, prefill_dp_rank)
        except BootstrapError as exc:
            self._status.fail(FailureKind.BOOTSTRAP, str(exc))
            return
        except (TopologyError, ValueError) as exc:
            self._status.fail(FailureKind.INCOMPATIBLE, str(exc))
            return
        if dp_rank is None:
            manager.ask_prefill_dp_rank(bootstrap_url, room, self._take_dp_rank)
            return
        self._find_way(bootstrap_url, dp_rank)

    def _find_way(self, url: str, dp_rank: int) -> None:
        way = self._way_to(url, dp_rank)
        if isinstance(way, PrefillWay):
            self._way = way
            self._status.advance(KVPoll.WaitingForInput)
        else:
            self._status.fail(*way)

    def _way_to(self, url: str, dp_rank: int) -> PrefillWay | tuple[FailureKind, str]:
        """The way to DP rank `dp_rank` of the group behind `url`, or why there is none."""
        try:
            return self.manager.route_to(url, dp_rank)
        except BootstrapError as exc:
            return FailureKind.BOOTSTRAP, str(exc)
        except TopologyError as exc:
            return FailureKind.INCOMPATIBLE, str(exc)

    def _take_dp_rank(self, dp_rank: int | None, problem: str | None) -> None:
        """The bootstrap service's answer (on the manager's query thread). The way is found
        outside the lock (a group looked up again blocks): the scheduler's calls go on."""
        url = self._url
        if self._status.finished or self._cleared:
            return  # aborted or cleared while it was asked (checked again below)
        way: PrefillWay | tuple[FailureKind, str]
        if dp_rank is None or url is None:
            way = FailureKind.BOOTSTRAP, f"room {self.room}: {problem}"
        else:
            try:
                way = self._way_to(url, dp_rank)
            except Exception as exc:  # the room fails with why; the query thread goes on
                way = FailureKind.INTERNAL, f"room {self.room}: {type(exc).__name__}: {exc}"
        with self._resolving:
            if self._status.finished or self._cleared:
                return  # aborted or cleared while it was asked
            if not isinstance(way, PrefillWay):
                self._status.fail(*way)
                return
            self._way = way
            self._status.advance(KVPoll.WaitingForInput)
            waiting, self._waiting_init = self._waiting_init, None
            if waiting is None:
                return
            try:
                self._open_room(waiting)
            except Exception as exc:
                self._status.fail(
                    FailureKind.INTERNAL, f"room {self.room}: {type(exc).__name__}: {exc}"
                )

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
        pages = np.asarray(kv_pages, dtype=np.int32).ravel()
        asked = _Init(pages, aux_index, tuple(state_indices), decode_prefix_len)
        with self._resolving:
            if self._status.finished or self._open or self._waiting_init is not None:
                return
            if self._way is None:  # its prefill DP rank is still being asked
                self._waiting_init = asked
                return
            self._open_room(asked)

    def _open_room(self, asked: _Init) -> None:
        way = self._way
        if self._status.finished or way is None:
            return
        if self.manager.config.sglang_peers:  # an SGLang prefill checks no index of ours
            args = self.manager.kv_args
            problem = sglang_request_problem(
                args, asked.pages, asked.aux_index, asked.state_indices
            )
            if problem is not None:
                self._status.fail(FailureKind.INCOMPATIBLE, f"room {self.room}: {problem}")
                self.manager.abort_room(self.room, problem, list(way.endpoints.values()))
                return
        opened = RoomOpened(
            room=self.room,
            route=way.route,
            required=dict(way.required),
            endpoints=dict(way.endpoints),
            pages=asked.pages,
            aux_index=asked.aux_index,
            state_indices=asked.state_indices,
            decode_prefix_len=asked.decode_prefix_len,
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
    # below need no lock (`poll` of a room still waiting hands the engine's notifications to
    # the protocol, under the manager's lock).
    def poll(self) -> KVPoll:
        poll = self._current().poll
        if self._open and poll in (KVPoll.WaitingForInput, KVPoll.Transferring):
            self.manager.collect_notifications()  # the last write's may be in
            poll = self._current().poll
        return poll

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
        with self._resolving:
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
        with self._resolving:
            if not self._open:
                self._cleared = True  # a DP rank answered from now on opens nothing
                self._waiting_init = None
                return
            last = self.manager.clear_room(self.room)
            if last is not None:
                self._status = last
            self._open = False
