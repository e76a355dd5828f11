"""Decode's loads on one worker of kvbridge's vLLM connector: per request its room (one per
prefill pipeline stage; every KV cache group's blocks move in it), opened off the engine's
step, polled until its pages are safe, counted, and its failure kept for vLLM; and the
releases (rooms that only tell prefill decode needs nothing). `vllm_worker.WorkerSide` owns
the `Loads` and lends it the decode manager, the KV cache and the thread pool it opens rooms
on. No vLLM import."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from kvbridge.cache.topology import TopologyError
from kvbridge.control.bootstrap import BootstrapError
from kvbridge.decode import DecodeManager, KVReceiver
from kvbridge.integrations.vllm_blocks import LoadPlanError
from kvbridge.integrations.vllm_cache import RoomContents, VLLMCache
from kvbridge.integrations.vllm_requests import RemotePrefill, stage_room
from kvbridge.integrations.vllm_stats import LOAD_SECONDS, ConnectorCounters, Interval
from kvbridge.integrations.vllm_steps import LoadSpec
from kvbridge.wire.messages import FailureKind, KVPoll

log = logging.getLogger("kvbridge.vllm")


@dataclass
class _Room:
    """A decode-side room being opened off the engine's step (the first room toward a prefill
    instance looks its bootstrap service up, which may take up to bootstrap_timeout_s), then
    in flight. No pages: a release (decode tells prefill it needs nothing)."""

    opening: Future[KVReceiver]
    pages: int = 0
    # Why this room is given up (sent to prefill once it is open); None: it goes on.
    abort_reason: str | None = None
    abort_sent: bool = False

    def give_up(self, reason: str) -> None:
        if self.abort_reason is None:
            self.abort_reason = reason

    @property
    def settled(self) -> bool:
        """Opened (or failed to) and no prefill write can land in its pages any more."""
        receiver = self.receiver()
        return self.opening.done() and (receiver is None or receiver.pages_safe)

    def receiver(self) -> KVReceiver | None:
        """The receiver once opened; None while opening (or if opening raised)."""
        if not self.opening.done() or self.opening.exception() is not None:
            return None
        return self.opening.result()


@dataclass
class _Load:
    """One request's load: its room at each prefill pipeline stage."""

    rooms: list[_Room]
    blocks: tuple[int, ...]  # every block it fills, for vLLM's failed-block report
    client_aborted: bool = False  # the request ended on decode while loading
    started: float = 0.0  # time.monotonic() as it started

    def give_up(self, reason: str) -> None:
        for room in self.rooms:
            room.give_up(reason)

    def send_aborts(self) -> None:
        for room in self.rooms:
            receiver = room.receiver()
            if room.abort_reason is not None and not room.abort_sent and receiver is not None:
                room.abort_sent = True
                receiver.abort(room.abort_reason)

    def clear(self) -> None:
        for room in self.rooms:
            if (receiver := room.receiver()) is not None:
                receiver.clear()


def _failure_kind(error: BaseException | None) -> FailureKind:
    """The kind of a room that could not even be opened."""
    if isinstance(error, BootstrapError):
        return FailureKind.BOOTSTRAP
    if isinstance(error, LoadPlanError | ValueError):
        return FailureKind.INCOMPATIBLE
    return FailureKind.INTERNAL


def _renew_leases(decode: DecodeManager, url: str, rooms: list[int]) -> None:
    """On the pool: nothing may escape unseen (a future nobody reads swallows it)."""
    try:
        decode.renew_leases(url, rooms)
    except (BootstrapError, TopologyError) as exc:  # the load itself will fail with it
        log.warning("leases of %d room(s) at %s not renewed: %s", len(rooms), url, exc)
    except Exception:
        log.exception("leases of %d room(s) at %s not renewed", len(rooms), url)


def _open_room(
    decode: DecodeManager, url: str, room: int, contents: RoomContents | None
) -> KVReceiver:
    """Look the prefill instance up, send the request for these (KV pages, state slots) (on
    the opener pool, or inline once the instance is known)."""
    receiver = decode.receiver(room, url)
    if contents is not None:
        receiver.init(
            contents.pages, state_indices=contents.slots, decode_prefix_len=contents.prefix_tokens
        )
    return receiver


class Loads:
    """Decode's loads and releases in flight, by request, and what ended how."""

    def __init__(self, counters: ConnectorCounters, interval: Interval, opener: Executor) -> None:
        self.counters = counters  # the worker's: loads count into them...
        self._interval = interval  # ...and their durations and failures into this
        self._opener = opener  # opens rooms whose lookup may block (the owner shuts it down)
        self._loads: dict[str, _Load] = {}
        self._releases: list[_Load] = []
        self._failed_blocks: set[int] = set()
        self._failed_requests: set[str] = set()

    @property
    def in_flight(self) -> int:
        """Loads not ended yet."""
        return len(self._loads)

    @property
    def pending(self) -> bool:
        """Whether a load or a release is in flight (decode's activity may end it)."""
        return bool(self._loads or self._releases)

    def start(
        self,
        load: LoadSpec,
        decode: DecodeManager | None,
        cache: VLLMCache | None,
        state_groups: frozenset[int] = frozenset(),
    ) -> None:
        """Open the rooms of a request's load (`state_groups`: the groups whose block is a
        recurrent state); one that cannot load (no decode manager, or the scheduler could
        not plan it) fails at once."""
        blocks = tuple(block for group in load.blocks for block in group)
        if decode is None or cache is None or load.error is not None:
            failed: Future[KVReceiver] = Future()  # fails at once: the blocks count as failed
            failed.set_exception(
                LoadPlanError(load.error or "this instance's kv_role does not consume KV")
            )
            self._loads[load.request_id] = _Load([_Room(failed, len(blocks))], blocks)
            if decode is not None:  # prefill frees its blocks now, not at its deadline
                self.release(load.remote, decode)
            return
        sent = tuple(count for _, count in load.remote.blocks)
        contents = cache.load_contents(load.blocks, load.skips, sent, state_groups)
        # A room per pipeline stage of the prefill instance (each stage writes the layers it
        # holds into decode's pages).
        rooms: list[_Room] = []
        for stage, url in enumerate(load.remote.stages):
            room = stage_room(load.remote.room, stage)
            if not contents.pages and not contents.slots:  # prefill sends nothing of use
                reason = "decode needs no block prefill sends"
                rooms.append(_Room(self._opening(decode, url, room), abort_reason=reason))
            else:
                rooms.append(_Room(self._opening(decode, url, room, contents), len(blocks)))
        self._loads[load.request_id] = _Load(rooms, blocks, started=time.monotonic())

    def abort(self, request_id: str) -> None:
        """The request ended on decode: give its load up, if it is still loading."""
        ongoing = self._loads.get(request_id)
        if ongoing is not None:
            ongoing.client_aborted = True
            ongoing.give_up("the request ended on decode")

    def release(self, remote: RemotePrefill, decode: DecodeManager) -> None:
        """Tell every room of a request's prefill that decode needs nothing from it."""
        rooms = [
            _Room(self._opening(decode, url, room), abort_reason="decode needs no block")
            for url, room in self._stage_rooms(remote)
        ]
        self._releases.append(_Load(rooms, ()))

    def renew(self, remotes: Sequence[RemotePrefill], decode: DecodeManager) -> None:
        """Renew the leases on prefill of these waiting requests' rooms, one message per
        prefill instance (on the pool: the first toward an instance looks it up)."""
        rooms: dict[str, list[int]] = {}
        for remote in remotes:
            for url, room in self._stage_rooms(remote):
                rooms.setdefault(url, []).append(room)
        for url, listed in rooms.items():
            self._opener.submit(_renew_leases, decode, url, listed)

    def send_aborts(self) -> None:
        """Tell prefill of every room given up (once each, once the room is open)."""
        for ongoing in (*self._loads.values(), *self._releases):
            ongoing.send_aborts()

    @staticmethod
    def _stage_rooms(remote: RemotePrefill) -> list[tuple[str, int]]:
        """(bootstrap URL, room) of the request's room at each pipeline stage."""
        return [(url, stage_room(remote.room, stage)) for stage, url in enumerate(remote.stages)]

    def _opening(
        self, decode: DecodeManager, url: str, room: int, contents: RoomContents | None = None
    ) -> Future[KVReceiver]:
        """The room opened here when its prefill instance is known (no blocking lookup: a
        hop to the pool would only add thread hand-offs), else on the pool."""
        if not decode.knows_prefill(url):
            return self._opener.submit(_open_room, decode, url, room, contents)
        opened: Future[KVReceiver] = Future()
        try:
            opened.set_result(_open_room(decode, url, room, contents))
        except Exception as exc:  # the load's failure, as from the pool
            opened.set_exception(exc)
        return opened

    def poll(self) -> set[str]:
        """The requests whose load ended (their pages safe); settled releases are dropped."""
        loaded: set[str] = set()
        for request_id, load in list(self._loads.items()):
            if self._done(request_id, load):
                del self._loads[request_id]
                loaded.add(request_id)
        for release in list(self._releases):
            release.send_aborts()
            if all(room.settled for room in release.rooms):
                release.clear()
                self._releases.remove(release)
                self.counters.rooms_released += 1
        return loaded

    def _done(self, request_id: str, load: _Load) -> bool:
        """Whether the load ended and its pages are safe; counts and logs how it ended. A
        room that failed gives the request's other rooms up."""
        load.send_aborts()
        if not all(room.opening.done() for room in load.rooms):
            return False
        reason: str | None = None
        kind = FailureKind.UNKNOWN
        succeeded = True
        for room in load.rooms:
            if not room.pages:
                continue  # a room decode needs nothing from: it only has to settle
            receiver = room.receiver()
            poll = receiver.poll() if receiver is not None else KVPoll.Failed
            if poll == KVPoll.Failed and reason is None:
                if receiver is None:
                    error = room.opening.exception()
                    reason, kind = repr(error), _failure_kind(error)
                else:
                    reason = f"{receiver.failure_reason} [{receiver.failure_kind}]"
                    kind = receiver.failure_kind or FailureKind.UNKNOWN
            succeeded = succeeded and poll == KVPoll.Success
        if reason is not None:
            load.give_up(f"another pipeline stage's load failed: {reason}")
            load.send_aborts()
        elif not succeeded:
            return False
        if not all(room.settled for room in load.rooms):
            return False
        load.clear()
        if reason is None:
            self.counters.requests_loaded += 1
            self.counters.pages_loaded += len(load.blocks)
            self._interval.observe(LOAD_SECONDS, time.monotonic() - load.started)
        elif load.client_aborted:
            self.counters.loads_aborted += 1
        else:
            log.warning("request %s: KV load failed: %s", request_id, reason)
            self._interval.fail("load", kind)
            self._failed_blocks.update(load.blocks)
            self._failed_requests.add(request_id)
            self.counters.loads_failed += 1
        return True

    def take_failed_blocks(self) -> set[int]:
        """The blocks of the loads that failed since the last call."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def take_failed_requests(self) -> set[str]:
        """The requests whose load failed since the last call."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed
