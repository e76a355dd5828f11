"""A prefill rank's write jobs, pure: each job's record from the moment its chunk is queued
until it ended — queued per decode peer (a heap, oldest room first, so that rooms toward one
peer complete in the order they arrived instead of all together at the end), handed out up
to `writes_in_flight` per peer, gathered into this rank's staging buffer (its ring of space
shared by the chunks while they move) and written straight into decode's pages or into ring
space decode grants (a staging ask, with its deadline), or sent token by token when staging
never fits. What a job's end means for its room is `PrefillRooms.job_ended`."""

from __future__ import annotations

import heapq
import logging
from collections import Counter, deque
from collections.abc import Iterator

from kvbridge.cache.pairing import PathReason, WritePath
from kvbridge.core.prefill_events import (
    Action,
    JobKey,
    PageRows,
    PrefillSettings,
    PrefillStats,
    RingSpace,
    StagedChunk,
    Write,
    WriteEnded,
)
from kvbridge.core.prefill_peers import DecodePeer, Ignore, PrefillPeers
from kvbridge.core.prefill_room import PrefillRoom
from kvbridge.core.prefill_rooms import PrefillRooms
from kvbridge.core.protocol import DueQueue, Send
from kvbridge.core.room import ChunkJob, Failure
from kvbridge.core.write_jobs import AwaitedStaging, JobTable, WriteJob
from kvbridge.core.write_paths import chunk_path, gathering, path_of
from kvbridge.staging.ring import StagingRing
from kvbridge.wire import ChunkReady, FailureKind, StagingRequest, StagingResponse
from kvbridge.wire.notifications import COMPLETING_NOTIFICATIONS, notification_for

log = logging.getLogger("kvbridge.prefill")

# Chunks gathered into this rank's staging buffer start on this boundary.
RING_ALIGNMENT = 64


class WriteScheduler:
    """The write jobs of one prefill rank: the one place they are kept."""

    def __init__(
        self,
        settings: PrefillSettings,
        stats: PrefillStats,
        peers: PrefillPeers,
        rooms: PrefillRooms,
        jobs: JobTable,
        ignore: Ignore,
    ) -> None:
        self.settings = settings
        self.stats = stats
        self.peers = peers
        self.rooms = rooms
        self._ignore = ignore
        self.jobs = jobs
        # Per decode peer, the queued jobs by (room arrival, chunk, room): a heap, oldest first.
        self._queued: dict[str, list[tuple[int, int, int]]] = {}
        self._out: Counter[str] = Counter()  # jobs handed out, per decode peer
        # Gated jobs in the order they were queued: each handed out at once, outside the
        # window (it moves only when its gate opens, and the pipeline posts in hand-out
        # order, so the owner's order — a forward's layers, each layer's rooms together —
        # is the order they go in; held in the window, closed gates would hold back the
        # rooms behind them until the forward's end).
        self._gated: deque[JobKey] = deque()
        # Staging asks by when their deadline runs out (by when asked).
        self._staging_due: DueQueue[tuple[float, JobKey]] = DueQueue()
        # This rank's staging buffer, shared by the chunks gathered into it while they move.
        usable = (settings.staging_bytes or 0) // RING_ALIGNMENT * RING_ALIGNMENT
        self._local = StagingRing(usable, RING_ALIGNMENT) if usable else None
        # The most pages of a chunk gathered at once: whole rows of every buffer, half the
        # staging buffer (the next piece is gathered while the engine writes one).
        self._whole_page = len(settings.kv_args.kv_buffers) * settings.kv_args.page_bytes
        pieces = usable // 2 // self._whole_page
        self._piece_pages = pieces or None  # (a page bigger than that: no piece would fit)

    def piece_pages_for(self, state: PrefillRoom) -> int | None:
        """How many pages the room's chunks may hold at most, so that each can be gathered
        (a bigger chunk would go as per-token or per-page blocks): where a decode peer of the
        room gathers chunks, or may (the cost model, for a chunk of that many pages with a
        block per page), and no more than the peer's ring holds; None: chunks go whole."""
        if self._piece_pages is None:
            return None
        local, costs = self.settings.kv_args, self.settings.write_costs
        found: int | None = None
        for peer_id, request in state.requests.items():
            peer = self.peers.get(peer_id)
            pairing = None if peer is None or request.is_dummy else peer.pairing
            if pairing is None or peer is None or peer.kv_args is None:
                continue
            pages = self._piece_pages
            blocks = pages * len(local.kv_buffers)
            gathers = pairing.stageable or (
                pairing.coalescible and costs.coalesces(blocks, blocks, blocks * local.page_bytes)
            )
            ring = peer.kv_args.staging_buffer
            if ring is not None and (pairing.through_ring or pairing.coalescible):
                pages = min(pages, ring.length // self._whole_page)
            if gathers and pages:
                found = pages if found is None else min(found, pages)
        return found

    def queue(self, state: PrefillRoom, jobs: list[ChunkJob]) -> None:
        """Queue a room's jobs behind those of older rooms toward the same peer (a gated
        job: behind every gated job queued before it)."""
        for job in jobs:
            entry = WriteJob(job)
            self.jobs.add(entry)
            if job.gate is not None:
                self._gated.append(entry.key)
                continue
            heapq.heappush(
                self._queued.setdefault(job.peer_id, []), (state.sequence, job.chunk_idx, job.room)
            )

    def dispatch(self, now: float) -> list[Action]:
        """Hand out queued jobs: gated ones at once, in order; the others oldest room first,
        while a peer has fewer than `writes_in_flight` of them out (and a gathered chunk has
        room in the staging buffer)."""
        actions: list[Action] = []
        while self._gated:
            entry = self.jobs.get(self._gated.popleft())
            state = self.rooms.get(entry.job.room) if entry is not None else None
            if entry is not None and state is not None and not state.status.finished:
                actions += self._start(state, entry, now) or []  # (never gathered: not None)
            elif entry is not None:  # its room ended: nothing of it starts
                actions += self.job_ended(entry)
        window = self.settings.writes_in_flight
        for peer_id in list(self._queued):
            queued = self._queued[peer_id]
            while queued and self._out[peer_id] < window:
                _, chunk_idx, room = queued[0]
                entry = self.jobs.get((room, chunk_idx, peer_id))
                state = self.rooms.get(room)
                if entry is None or state is None or state.status.finished:
                    heapq.heappop(queued)  # its room ended: nothing of it starts
                    if entry is not None:
                        actions += self.job_ended(entry)
                    continue
                started = self._start(state, entry, now)
                if started is None:
                    break  # no room in the staging buffer until a gathered chunk moved
                heapq.heappop(queued)
                actions += started
            if not queued:
                del self._queued[peer_id]
        return actions

    def _hand_out(self, state: PrefillRoom, entry: WriteJob) -> None:
        entry.handed_out = True
        if entry.job.gate is None:
            self._out[entry.job.peer_id] += 1

    def job_ended(self, entry: WriteJob) -> list[Action]:
        """A job ended (written, failed, its staging answered for a room that failed, or
        dropped before it was handed out): its resources go back, and its room hears."""
        if self.jobs.forget(entry.key) is None:
            return []  # dropped with its failed room already
        if entry.local is not None:
            assert self._local is not None
            self._local.free(entry.local)
        if entry.handed_out and entry.job.gate is None:
            self._out[entry.job.peer_id] -= 1
        return self.rooms.job_ended(entry.job.room, entry.handed_out)

    def _start(self, state: PrefillRoom, entry: WriteJob, now: float) -> list[Action] | None:
        """Hand the job out: a write, or a request for ring space. None when it must wait
        for room in this rank's staging buffer."""
        job = entry.job
        peer = self.peers.get(job.peer_id)
        if peer is None or peer.error is not None or peer.kv_args is None or peer.pairing is None:
            why = peer.error.reason if peer is not None and peer.error else "not connected"
            failure = Failure(FailureKind.ENGINE, f"room {state.room}: {why}")
            return [*self.rooms.fail(state, failure), *self.job_ended(entry)]
        local, costs = self.settings.kv_args, self.settings.write_costs
        path, entry.reason = chunk_path(peer.pairing, job, local, peer.kv_args, costs)
        if path == WritePath.DIRECT:
            self._hand_out(state, entry)
            return [self._write(entry, peer, None, entry.reason)]
        gather = gathering(local, self._local, job, peer, path)
        if isinstance(gather, PathReason):  # no staging buffer, nothing to gather, too big
            self._hand_out(state, entry)
            return [self._write(entry, peer, None, gather)]
        src_rows, dst_rows, column, width, nbytes = gather
        assert self._local is not None
        entry.local = self._local.allocate(nbytes)
        if entry.local is None:
            return None
        self._hand_out(state, entry)
        if path == WritePath.PAGE_ROWS:
            staged = StagedChunk(
                src_rows, column, width, nbytes, entry.local.offset, PageRows(dst_rows)
            )
            return [self._write(entry, peer, staged, entry.reason)]
        state.ring_peers.add(job.peer_id)
        request = StagingRequest(
            room=job.room,
            chunk_idx=job.chunk_idx,
            chunk_num_pages=job.src_pages.size,
            session_id=self.settings.endpoint,
            prefill_rank=self.settings.rank,
            nbytes=nbytes,
        )
        entry.staging = AwaitedStaging(request, now, src_rows, column, width)
        self._staging_due.push(now + self.settings.staging_timeout_s, (now, entry.key))
        self._staging_due.compact(len(self.jobs), self._staging_entries)
        return [Send(peer.endpoint, request)]

    def _write(
        self, entry: WriteJob, peer: DecodePeer, staged: StagedChunk | None, reason: PathReason
    ) -> Write:
        """The job's write, by the path `staged` says (None: planned blocks), for `reason`."""
        assert peer.kv_args is not None
        assert peer.pairing is not None
        job = entry.job
        path = path_of(staged)
        self.stats.chunk_written(path, reason)
        log.debug(
            "room %d chunk %d to %s: %s (%s), %d pages",
            job.room,
            job.chunk_idx,
            job.peer_id,
            path.value,
            reason.value,
            job.src_pages.size,
        )
        rank = self.settings.rank
        # sglang's decode reads no engine notification (a room ends on its status frames).
        sglang = self.settings.sglang_peers
        notify = notification_for(job.room, rank) if job.last and not sglang else b""
        notify_complete, complete_with = b"", frozenset[int]()
        state = self.rooms.get(job.room)
        if (
            job.last
            and state is not None
            and job.peer_id not in state.ring_peers
            and not self._queued_before(entry)
            and COMPLETING_NOTIFICATIONS in peer.registration.capabilities
            and self.settings.engine_notifies
        ):
            notify_complete = notification_for(job.room, rank, complete=True)
            complete_with = frozenset(
                other.job.chunk_idx
                for other in self.jobs.of(job.room)
                if other.job.peer_id == job.peer_id
                and other.job.chunk_idx != job.chunk_idx
                and other.handed_out
            )
        entry.write = Write(
            job.room,
            job,
            peer.kv_args,
            peer.pairing,
            notify,
            staged,
            notify_complete,
            complete_with,
        )
        return entry.write

    def _queued_before(self, entry: WriteJob) -> bool:
        """Whether another job of the room toward the same peer is not handed out yet (a
        gated last chunk is handed out before the queued chunks ahead of it): then the room's
        last write may not complete it — that job's bytes may land later, or go through
        decode's ring (decode scatters first)."""
        job = entry.job
        return any(
            other is not entry and other.job.peer_id == job.peer_id and not other.handed_out
            for other in self.jobs.of(job.room)
        )

    def on_staging_response(self, answer: StagingResponse, now: float) -> list[Action]:
        entry = self.jobs.get((answer.room, answer.chunk_idx, answer.session_id))
        awaited = entry.staging if entry is not None else None
        if entry is None or awaited is None:  # an answer nobody waits for is never kept
            return self._ignore(
                "staging answer for room %d chunk %d that nobody awaits",
                answer.room,
                answer.chunk_idx,
            )
        entry.staging = None
        self.stats.staging_wait_s += now - awaited.asked_at
        state = self.rooms.get(answer.room)
        if state is None or state.status.finished:
            # It failed meanwhile; decode frees the grant on hearing it.
            return self.job_ended(entry) + self.dispatch(now)
        job, peer = entry.job, self.peers.by_id[entry.job.peer_id]
        if answer.never_fits:
            if entry.local is not None and self._local is not None:
                self._local.free(entry.local)
                entry.local = None
            return [self._write(entry, peer, None, PathReason.NEVER_FITS)]
        assert peer.kv_args is not None
        assert peer.kv_args.staging_buffer is not None
        assert entry.local is not None
        local = self.settings.kv_args
        ready = ChunkReady(
            room=job.room,
            chunk_idx=job.chunk_idx,
            page_start=job.page_offset,
            num_pages=job.src_pages.size,
            session_id=self.settings.endpoint,
            prefill_rank=self.settings.rank,
            token_start=job.page_offset * local.page_size,
            token_count=job.src_pages.size * local.page_size,
        )
        staged = StagedChunk(
            awaited.src_rows,
            awaited.column,
            awaited.width,
            awaited.request.nbytes,
            entry.local.offset,
            RingSpace(peer.kv_args.staging_buffer.ptr + answer.offset, ready),
        )
        assert entry.reason is not None
        return [self._write(entry, peer, staged, entry.reason)]

    def on_write_ended(self, ended: WriteEnded, now: float) -> list[Action]:
        job = ended.write.job
        entry = self.jobs.get((job.room, job.chunk_idx, job.peer_id))
        if entry is None or entry.write is not ended.write:
            return []  # not a write this rank handed out
        entry.write = None
        state = self.rooms.get(job.room)
        actions: list[Action] = []
        if state is not None and ended.failure is not None:
            state.fail(ended.failure)  # told once nothing of it is out (job_ended)
        elif state is not None and ended.completed:
            state.completed_by_notification.add(job.peer_id)
        staged = ended.write.staged
        peer = self.peers.get(job.peer_id)
        if (
            state is not None
            and not state.status.finished
            and staged is not None
            and isinstance(staged.destination, RingSpace)
            and peer is not None
        ):  # it landed in the ring: decode may scatter it
            actions.append(Send(peer.endpoint, staged.destination.ready))
        return actions + self.job_ended(entry) + self.dispatch(now)

    def on_tick(self, now: float) -> list[Action]:
        """Staging asks decode left unanswered past their deadline fail their rooms."""
        actions: list[Action] = []
        for _, (asked_at, key) in self._staging_due.pop_due(now):
            entry = self.jobs.get(key)
            if entry is None or entry.staging is None or entry.staging.asked_at != asked_at:
                continue  # answered, ended, or asked again since
            entry.staging = None
            job = entry.job
            reason = (
                f"room {job.room}: decode {job.peer_id} gave no staging space for chunk "
                f"{job.chunk_idx} in {self.settings.staging_timeout_s:g} s"
            )
            waiting_room = self.rooms.get(job.room)
            if waiting_room is not None:
                actions += self.rooms.fail(waiting_room, Failure(FailureKind.TIMEOUT, reason))
            actions += self.job_ended(entry)
        return actions

    def peer_dead(self, peer_id: str) -> list[Action]:
        """The peer will never answer the staging asks it has."""
        actions: list[Action] = []
        awaiting = [
            entry
            for entry in self.jobs.by_key.values()
            if entry.staging is not None and entry.job.peer_id == peer_id
        ]
        for entry in awaiting:
            entry.staging = None
            actions += self.job_ended(entry)
        return actions

    def _staging_entries(self) -> Iterator[tuple[float, tuple[float, JobKey]]]:
        timeout_s = self.settings.staging_timeout_s
        for key, entry in self.jobs.by_key.items():
            if entry.staging is not None:
                yield entry.staging.asked_at + timeout_s, (entry.staging.asked_at, key)
