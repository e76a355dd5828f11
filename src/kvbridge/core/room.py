"""Per-room state, pure: no sockets, no threads, no engine.

Each side keeps one object per room. Its `KVPoll` state only moves forward (Bootstrapping →
WaitingForInput → Transferring → Success), Failed is sticky and carries a reason, and the
object says what the manager should do next; the managers own the locks and the I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvbridge.cache.topology import Source
from kvbridge.wire.messages import FailureKind, KVPoll
from kvbridge.wire.native import TransferRequest

# A decode page index of -1 in a request: decode needs nothing at that position of the
# room's pages (it has those tokens, or its window dropped them), so prefill writes none of
# it. It needs prefill ranks of native 1.4 or later: an older one refuses it on its
# page-by-page paths but misplaces pages on its gathered ones (the vLLM connector sends it
# only to prefill instances whose parameters say they are new enough).
SKIPPED_PAGE = -1

_ORDER = {
    KVPoll.Bootstrapping: 1,
    KVPoll.WaitingForInput: 2,
    KVPoll.Transferring: 3,
    KVPoll.Success: 4,
}


@dataclass(frozen=True)
class Failure:
    """Why something failed: a kind to count and act on, and the detail for people."""

    kind: FailureKind
    reason: str


@dataclass
class RoomStatus:
    """A room's KVPoll state: monotone, with Failed sticky and Success final."""

    poll: KVPoll = KVPoll.Bootstrapping
    failure_reason: str | None = None
    failure_kind: FailureKind | None = None

    @property
    def finished(self) -> bool:
        return self.poll in (KVPoll.Success, KVPoll.Failed)

    def advance(self, to: KVPoll) -> bool:
        """Move forward to `to`; a step backwards or out of a finished state is ignored."""
        if to == KVPoll.Failed:
            raise ValueError("use fail() to fail a room: a failure needs a reason")
        if self.finished or _ORDER[to] <= _ORDER[self.poll]:
            return False
        self.poll = to
        return True

    def fail(self, kind: FailureKind, reason: str) -> bool:
        """Fail the room with a kind and a reason; a finished room stays as it is."""
        if self.finished:
            return False
        # The kind and reason first: whoever reads Failed without a lock finds them set.
        self.failure_kind = kind
        self.failure_reason = reason
        self.poll = KVPoll.Failed
        return True

    @property
    def outcome(self) -> tuple[str, str]:
        """(state, failure kind) as metrics count a cleared room; the kind is "" unless it
        failed."""
        kind = self.failure_kind or FailureKind.UNKNOWN
        return self.poll.name, str(kind) if self.poll == KVPoll.Failed else ""


@dataclass(frozen=True)
class Chunk:
    """A piece of a room's KV cache that prefill has computed and wants sent."""

    src_pages: npt.NDArray[np.int64]
    last: bool
    aux_index: int | None = None
    state_indices: tuple[int, ...] = ()


@dataclass(frozen=True)
class ChunkJob:
    """What to write for one chunk to one decode rank: the chunk's local pages that decode
    needs, the place of the first among decode's pages, and all of the decode rank's pages
    for the room (the planner maps tokens, which may differ in page size, heads and DCP
    layout)."""

    room: int
    peer_id: str
    chunk_idx: int
    src_pages: npt.NDArray[np.int64]
    page_offset: int
    dst_pages: npt.NDArray[np.int32]
    last: bool
    src_aux_index: int | None
    dst_aux_index: int | None
    src_state_indices: tuple[int, ...]
    dst_state_indices: tuple[int, ...]


@dataclass(frozen=True)
class Destination:
    """Where one decode rank's request puts the room's pages: the positions after its
    prefix go, in order, to decode's pages `positions` (SKIPPED_PAGE: nowhere). Writes name
    decode's pages by their place in `pages`, the positions that go somewhere, so that a
    chunk's pages stay one run on both sides."""

    positions: npt.NDArray[np.int32]
    pages: npt.NDArray[np.int32]
    # Per position, how many before it go somewhere (one more entry: all of them).
    kept_before: npt.NDArray[np.int64]

    @staticmethod
    def of(request: TransferRequest) -> Destination:
        positions = np.asarray(request.dst_kv_indices, dtype=np.int32)
        kept = positions != SKIPPED_PAGE
        before = np.concatenate(([0], np.cumsum(kept, dtype=np.int64)))
        return Destination(positions, positions[kept], before)

    @property
    def has_gaps(self) -> bool:
        return self.pages.size != self.positions.size

    def place(self, start: int, count: int) -> tuple[npt.NDArray[np.bool_], int]:
        """For `count` pages from position `start`: which go somewhere (positions past
        decode's list go nowhere), and the place of the first of them in `pages`."""
        end = min(start + count, self.positions.size)
        kept = np.zeros(count, dtype=bool)
        if end > start:
            kept[: end - start] = self.positions[start:end] != SKIPPED_PAGE
        return kept, int(self.kept_before[min(start, self.positions.size)])


@dataclass
class PrefillRoom:
    """Prefill's view of a room: the decode request(s), the chunks to send, the progress."""

    room: int
    created_at: float = 0.0  # monotonic seconds, for the request deadline
    # When decode last said it will still ask (a RoomLease): the deadline runs from then.
    renewed_at: float = 0.0
    # Tokens per page on this rank: a request's decode_prefix_len (tokens decode already has)
    # skips this rank's pages that hold only those tokens.
    page_size: int = 1
    status: RoomStatus = field(default_factory=RoomStatus)
    requests: dict[str, TransferRequest] = field(default_factory=dict)
    destinations: dict[str, Destination] = field(default_factory=dict)
    # Whether the scheduler made a KVSender for the room; a room that only a request created
    # belongs to nobody until then, and is dropped if nobody claims it in time.
    claimed: bool = False
    required_requests: int | None = None
    # Arrival order among this rank's rooms: writes go out oldest room first.
    sequence: int = 0
    pending: deque[Chunk] = field(default_factory=deque)
    pages_sent: int = 0
    chunks_sent: int = 0
    last_queued: bool = False
    # Write jobs made from chunks and not ended yet, and how many of them were handed out
    # (to the engine, or waiting for decode's ring space): bytes may still land while any is.
    jobs_open: int = 0
    jobs_out: int = 0
    # The scheduler cleared it while a write was still out: it goes once that one ended.
    cleared: bool = False
    # A failed room tells its destinations (and acknowledges aborts) only once no write of
    # it is in flight: decode may reuse the pages as soon as it hears.
    failure_reported: bool = False
    pending_acks: set[str] = field(default_factory=set)
    # Decode peers that asked about the room after it failed, while a write of it was still
    # in flight: they hear how it ended with its destinations, once nothing is in flight.
    late_askers: set[str] = field(default_factory=set)
    # Decode peers whose last write went with a complete notification: that was their
    # success report.
    completed_by_notification: set[str] = field(default_factory=set)

    def request_deadline(self, timeout_s: float) -> float:
        """When decode's request(s) are due: `timeout_s` after the room began, or after
        decode last renewed its lease."""
        return max(self.created_at, self.renewed_at) + timeout_s

    def request_overdue(self, now: float, timeout_s: float) -> bool:
        """Still waiting for decode's request(s) past their deadline."""
        return (
            not self.status.finished and not self.ready and now > self.request_deadline(timeout_s)
        )

    def claim_overdue(self, now: float, timeout_s: float) -> bool:
        """Created by a request, and no sender claimed it within `timeout_s`."""
        return not self.claimed and now - self.created_at > timeout_s

    def request_problem(
        self, request: TransferRequest, dst_page_size: int, dst_dcp_size: int = 1
    ) -> str | None:
        """Why this rank cannot serve the request's pages, if it cannot: decode's prefix must
        end on a page boundary of this rank and of the decode rank (its page size times its
        DCP size, as sglang requires), or tokens would shift; skipped positions
        (SKIPPED_PAGE) need pages of one size on both sides, no DCP."""
        dst_page_tokens = dst_page_size * dst_dcp_size
        prefix = request.decode_prefix_len or 0
        for where, page in (("this prefill rank's", self.page_size), ("decode's", dst_page_tokens)):
            if prefix < 0 or prefix % page:
                return (
                    f"room {self.room}: decode_prefix_len {prefix} does not end on one of "
                    f"{where} pages of {page} tokens"
                )
        pages = np.asarray(request.dst_kv_indices)
        if pages.size and pages.min() < SKIPPED_PAGE:
            return f"room {self.room}: decode page index {pages.min()} (only -1 skips a page)"
        gaps = pages.size and pages.min() == SKIPPED_PAGE
        if gaps and (dst_page_size != self.page_size or dst_dcp_size != 1):
            return (
                f"room {self.room}: decode skips pages inside the room (page index -1), which "
                f"needs pages of one size on both sides and no DCP: this prefill rank's pages "
                f"hold {self.page_size} tokens, decode's {dst_page_size} (DCP {dst_dcp_size})"
            )
        return None

    def on_request(self, request: TransferRequest) -> None:
        if self.status.finished:
            return
        self.requests[request.peer_id] = request
        self.destinations[request.peer_id] = Destination.of(request)
        self.required_requests = request.required_dst_info_num
        if self.ready:
            self.status.advance(KVPoll.WaitingForInput)

    @property
    def ready(self) -> bool:
        """Every decode rank this room writes to has sent its request."""
        return self.required_requests is not None and len(self.requests) >= self.required_requests

    def add_chunk(self, chunk: Chunk) -> None:
        if self.last_queued:
            raise ValueError(f"room {self.room}: send() after the last chunk")
        self.pending.append(chunk)
        self.last_queued = chunk.last

    @property
    def in_flight(self) -> bool:
        """Whether a write job of the room is out: the engine may still read its pages or
        land bytes in decode's."""
        return self.jobs_out > 0

    def next_jobs(self) -> list[ChunkJob]:
        """Write jobs (one per destination) for every chunk queued so far, once the requests
        are in; [] if nothing can start. Chunks keep their order in `chunk_idx`; several
        may be in flight at once, and the room succeeds when the last one's jobs all ended."""
        jobs: list[ChunkJob] = []
        while not self.status.finished and self.pending and self.ready:
            jobs += self._jobs_for(self.pending.popleft())
        self.jobs_open += len(jobs)
        self._maybe_done()
        return jobs

    def _jobs_for(self, chunk: Chunk) -> list[ChunkJob]:
        jobs = []
        for peer_id, request in self.requests.items():
            if request.is_dummy:
                continue
            # Pages before decode's prefix are not sent; the request's pages begin at the
            # prefix, so positions count from there.
            skip = (request.decode_prefix_len or 0) // self.page_size
            cut = min(chunk.src_pages.size, max(0, skip - self.pages_sent))
            src_pages = chunk.src_pages[cut:]
            destination = self.destinations[peer_id]
            start = max(0, self.pages_sent - skip)
            if destination.has_gaps:  # only the positions decode fills, in a row
                kept, start = destination.place(start, src_pages.size)
                src_pages = src_pages[kept]
            if src_pages.size == 0 and not chunk.last:
                continue
            jobs.append(
                ChunkJob(
                    room=self.room,
                    peer_id=peer_id,
                    chunk_idx=self.chunks_sent,
                    src_pages=src_pages,
                    page_offset=start,
                    dst_pages=destination.pages,
                    last=chunk.last,
                    src_aux_index=chunk.aux_index if chunk.last else None,
                    dst_aux_index=request.dst_aux_index if chunk.last else None,
                    src_state_indices=chunk.state_indices if chunk.last else (),
                    dst_state_indices=(
                        tuple(index for group in request.dst_state_indices for index in group)
                        if chunk.last
                        else ()
                    ),
                )
            )
        self.pages_sent += chunk.src_pages.size
        self.chunks_sent += 1
        self.status.advance(KVPoll.Transferring)
        return jobs

    def job_handed_out(self) -> None:
        self.jobs_out += 1

    def job_ended(self, handed_out: bool) -> None:
        """One of the room's jobs ended (written, failed, or dropped before it was handed
        out: `handed_out` False)."""
        self.jobs_open -= 1
        if handed_out:
            self.jobs_out -= 1
        self._maybe_done()

    def _maybe_done(self) -> None:
        """Success once the last chunk is queued and every job made from the chunks ended."""
        if self.last_queued and not self.pending and self.ready and not self.jobs_open:
            self.status.advance(KVPoll.Success)


@dataclass
class DecodeRoom:
    """Decode's view of a room: which prefill ranks must report, and who has."""

    room: int
    expected_ranks: frozenset[int]
    # Ranks whose last write carries an engine notification (real sources, on engines that
    # notify): the notification proves the data is in place.
    notifying_ranks: frozenset[int]
    deadline: float
    # The room's pages on this rank and, per prefill rank, the heads it sends (for scattering
    # staged chunks).
    dst_pages: npt.NDArray[np.int64] = field(default_factory=lambda: np.empty(0, np.int64))
    sources: dict[int, Source] = field(default_factory=dict)
    endpoints: dict[int, str] = field(default_factory=dict)  # prefill rank → control endpoint
    status: RoomStatus = field(default_factory=RoomStatus)
    reported: set[int] = field(default_factory=set)
    notified: set[int] = field(default_factory=set)
    # Prefill ranks that can no longer write into the room's pages: they reported how the
    # room ended or acknowledged an abort.
    settled: set[int] = field(default_factory=set)
    # Ranks declared dead, and from when they cannot write either: one that is hung rather
    # than dead stops itself when its write lease runs out, and this waits that out.
    dead_until: dict[int, float] = field(default_factory=dict)
    # Staged chunks that arrived in the ring and are not scattered into pages yet.
    unscattered: int = 0

    def pages_safe(self, now: float) -> bool:
        """Whether the room's pages may be handed back: no prefill rank can still write."""
        if self.status.poll == KVPoll.Success:
            return True
        if self.status.poll != KVPoll.Failed or self.unscattered:
            return False  # in flight, or a staged chunk is still being copied into the pages
        fenced = {rank for rank, until in self.dead_until.items() if now >= until}
        return self.settled | fenced >= self.expected_ranks

    def unsettled(self) -> list[int]:
        """Ranks to ask for an abort: neither settled nor declared dead."""
        return sorted(self.expected_ranks - self.settled - set(self.dead_until))

    def on_abort_ack(self, prefill_rank: int) -> None:
        if prefill_rank in self.expected_ranks:
            self.settled.add(prefill_rank)

    def _rank_done(self, prefill_rank: int) -> bool:
        notified = prefill_rank not in self.notifying_ranks or prefill_rank in self.notified
        return prefill_rank in self.reported and notified

    def on_rank_dead(self, prefill_rank: int, reason: str, fenced_at: float) -> None:
        """A prefill rank was declared dead: it cannot write from `fenced_at` on (its lease
        ran out); the room fails if it still needed something from it."""
        if prefill_rank in self.expected_ranks:
            self.dead_until.setdefault(prefill_rank, fenced_at)
            if not self._rank_done(prefill_rank):
                self.status.fail(FailureKind.PEER_DEAD, reason)

    def on_status(
        self, prefill_rank: int, poll: KVPoll, reason: str, kind: FailureKind | None = None
    ) -> None:
        if prefill_rank not in self.expected_ranks:
            return
        if poll in (KVPoll.Success, KVPoll.Failed):
            self.settled.add(prefill_rank)
        if poll == KVPoll.Failed:
            self.status.fail(
                kind or FailureKind.UNKNOWN,
                f"prefill rank {prefill_rank}: {reason or 'no reason given'}",
            )
        elif poll == KVPoll.Success:
            self.reported.add(prefill_rank)
            self._maybe_done()

    def on_notification(self, prefill_rank: int, complete: bool = False) -> None:
        """The rank's notifying write landed; `complete`: it was the rank's success report
        too (every write of the room to this rank landed with or before it, none failed)."""
        if prefill_rank in self.notifying_ranks:
            self.notified.add(prefill_rank)
            if complete:
                self.settled.add(prefill_rank)
                self.reported.add(prefill_rank)
            self._maybe_done()

    def chunk_arrived(self) -> None:
        self.unscattered += 1

    def chunk_scattered(self) -> None:
        self.unscattered -= 1
        self._maybe_done()

    def _maybe_done(self) -> None:
        # The status says a rank wrote everything (or a complete notification says it);
        # where the engine notifies, the notification says it landed; staged chunks must be
        # in the pages. Success needs all three.
        if (
            self.reported >= self.expected_ranks
            and self.notified >= self.notifying_ranks
            and not self.unscattered
        ):
            self.status.advance(KVPoll.Success)

    def waits_on(self, endpoint: str) -> bool:
        """Whether this unfinished room still needs something from the prefill rank there."""
        if self.status.finished:
            return False
        ranks = [rank for rank, known in self.endpoints.items() if known == endpoint]
        return any(not self._rank_done(rank) for rank in ranks)

    def check_deadline(self, now: float) -> bool:
        """Fail the room if its deadline passed; whether it failed now."""
        if self.status.finished or now <= self.deadline:
            return False
        missing = sorted(self.expected_ranks - self.reported)
        return self.status.fail(
            FailureKind.TIMEOUT,
            f"room {self.room}: transfer not complete before its deadline; no success from "
            f"prefill ranks {missing}",
        )


# A decode rank's registration capability: it takes a "complete" notification as the prefill
# rank's success report for the room, which then sends no success status to it.
COMPLETING_NOTIFICATIONS = "completing-notifications"
_COMPLETE = b"complete"


def notification_for(room: int, prefill_rank: int, complete: bool = False) -> bytes:
    """The notification a prefill rank attaches to a room's last write; `complete`: it also
    says that every write of the room to that decode rank landed (only for decode ranks that
    registered `COMPLETING_NOTIFICATIONS`: others do not parse it)."""
    plain = f"kvbridge:{room}:{prefill_rank}".encode()
    return plain + b":" + _COMPLETE if complete else plain


def parse_notification(message: bytes) -> tuple[int, int, bool] | None:
    """(room, prefill rank, complete) of a kvbridge notification, None for anything else."""
    parts = message.split(b":")
    if len(parts) not in (3, 4) or parts[0] != b"kvbridge":
        return None
    if not parts[1].isdigit() or not parts[2].isdigit():
        return None
    if len(parts) == 4 and parts[3] != _COMPLETE:
        return None
    return int(parts[1]), int(parts[2]), len(parts) == 4
