"""Prefill's view of a room, pure: the decode requests, the chunks to send, the progress, and
the room's lifecycle — one named phase, moved only through `TRANSITIONS`.

A room is OPEN until it succeeds or fails. A failed room tells its destinations, and
acknowledges aborts, only once no write of it is out: decode may reuse the pages as soon as it
hears. So a failure with a write (or a staging ask) still out leaves it FAILED_DRAINING; the
last one ending settles it (FAILED_SETTLED: reported once, aborts acknowledged). The
scheduler's cleanup forgets an ended room, but one still draining stays, answering who asks
about it, as CLEARED_DRAINING until its last write ended. Its pages are safe to reuse once it
SUCCEEDED or FAILED_SETTLED (or is forgotten).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvbridge.core.page_placement import PagePlacement
from kvbridge.core.room import (
    SKIPPED_PAGE,
    Chunk,
    ChunkJob,
    Destination,
    Failure,
    RoomStatus,
    Unpaired,
    split_chunk,
)
from kvbridge.wire.layout import Message
from kvbridge.wire.messages import KVPoll
from kvbridge.wire.native import TransferRequest


class Phase(enum.Enum):
    OPEN = "open"  # requests, chunks and writes go on
    SUCCEEDED = "succeeded"  # every job of every chunk ended, none failed
    FAILED_DRAINING = "failed, draining"  # failed with a write or staging ask still out
    FAILED_SETTLED = "failed, settled"  # nothing out: destinations told, aborts acknowledged
    CLEARED_DRAINING = "cleared, draining"  # cleared by the scheduler with a write still out
    FORGOTTEN = "forgotten"  # out of the table: a late message finds it ended

    @property
    def draining(self) -> bool:
        """Failed with a write still out: nobody is told yet."""
        return self in (Phase.FAILED_DRAINING, Phase.CLEARED_DRAINING)


class Step(enum.Enum):
    SUCCEED = "succeed"  # the last job of the last chunk ended
    FAIL = "fail"  # a failure (later ones keep the first)
    DRAINED = "drained"  # nothing of it is out: settle it
    CLEAR = "clear"  # the scheduler's one cleanup (an open room is failed first)


class LifecycleError(RuntimeError):
    """A step the room's phase does not allow: a bug in the rules, never the peer's doing."""


@dataclass(frozen=True)
class LayerProgress:
    """A chunk handed over layer by layer, not complete yet: its pages and the layers queued."""

    pages: npt.NDArray[np.int64]
    position: int | None
    layers_done: int


TRANSITIONS: dict[tuple[Phase, Step], Phase] = {
    (Phase.OPEN, Step.SUCCEED): Phase.SUCCEEDED,
    (Phase.OPEN, Step.FAIL): Phase.FAILED_DRAINING,
    (Phase.SUCCEEDED, Step.FAIL): Phase.SUCCEEDED,  # success was reported: it stands
    (Phase.SUCCEEDED, Step.CLEAR): Phase.FORGOTTEN,
    (Phase.FAILED_DRAINING, Step.FAIL): Phase.FAILED_DRAINING,
    (Phase.FAILED_DRAINING, Step.DRAINED): Phase.FAILED_SETTLED,
    (Phase.FAILED_DRAINING, Step.CLEAR): Phase.CLEARED_DRAINING,
    (Phase.FAILED_SETTLED, Step.FAIL): Phase.FAILED_SETTLED,  # a later abort: acked at once
    (Phase.FAILED_SETTLED, Step.DRAINED): Phase.FAILED_SETTLED,
    (Phase.FAILED_SETTLED, Step.CLEAR): Phase.FORGOTTEN,
    (Phase.CLEARED_DRAINING, Step.FAIL): Phase.CLEARED_DRAINING,
    (Phase.CLEARED_DRAINING, Step.CLEAR): Phase.CLEARED_DRAINING,
    (Phase.CLEARED_DRAINING, Step.DRAINED): Phase.FORGOTTEN,
}


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
    placement: PagePlacement = field(default_factory=PagePlacement)  # of the queued chunks
    pages_sent: int = 0
    chunks_sent: int = 0  # jobs made per destination: every chunk, every layer range of one
    last_queued: bool = False
    # Layers on this rank; a chunk handed over by layers is complete at the last of them.
    num_layers: int = 1
    # A chunk handed over layer by layer that is not complete yet: its pages, layers so far.
    layer_chunk: LayerProgress | None = None
    phase: Phase = Phase.OPEN
    # The acks owed, by decode endpoint: each abort is acknowledged once the room settles,
    # in its sender's own form (kvbridge's `AbortAck`, or sglang's echoing a generation).
    pending_acks: dict[str, Message] = field(default_factory=dict)
    # Decode peers that asked about the room after it failed, while a write of it was still
    # in flight: they hear how it ended with its destinations, once nothing is in flight.
    late_askers: set[str] = field(default_factory=set)
    # Decode peers whose last write went with a complete notification: that was their
    # success report.
    completed_by_notification: set[str] = field(default_factory=set)
    # Decode peers a chunk of the room went to through their ring: their last write carries
    # no complete notification (decode scatters the chunk first).
    ring_peers: set[str] = field(default_factory=set)

    def step(self, step: Step) -> Phase:
        """Move the room's phase by `TRANSITIONS`; LifecycleError for a step it does not
        allow."""
        to = TRANSITIONS.get((self.phase, step))
        if to is None:
            raise LifecycleError(f"room {self.room}: {step.value} while {self.phase.value}")
        self.phase = to
        return to

    def fail(self, failure: Failure) -> bool:
        """Fail the room (a room that ended stays as it ended); whether it failed now."""
        failed = self.status.fail(failure.kind, failure.reason)
        self.step(Step.FAIL)
        return failed

    @property
    def pages_safe(self) -> bool:
        """Whether the room's pages can go back to the allocator: it ended and no write of it
        is out (an engine may read them until then)."""
        return self.phase in (Phase.SUCCEEDED, Phase.FAILED_SETTLED, Phase.FORGOTTEN)

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
        """Created by a request, and no sender claimed it within `timeout_s` of that or of
        decode's last lease renewal (decode first: the request waits in prefill's queue)."""
        return not self.claimed and now > self.request_deadline(timeout_s)

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
        if gaps and not self.aligns_with(dst_page_size, dst_dcp_size):
            return (
                f"room {self.room}: decode skips pages inside the room (page index -1), which "
                f"needs pages of one size on both sides and no DCP: this prefill rank's pages "
                f"hold {self.page_size} tokens, decode's {dst_page_size} (DCP {dst_dcp_size})"
            )
        return None

    def aligns_with(self, dst_page_size: int, dst_dcp_size: int = 1) -> bool:
        """Whether a decode rank's pages hold the same tokens as this rank's, page for page."""
        return dst_page_size == self.page_size and dst_dcp_size == 1

    def on_request(self, request: TransferRequest, aligned: bool) -> None:
        """Decode's request (`aligned`: `aligns_with` its rank)."""
        if self.status.finished:
            return
        self.requests[request.peer_id] = request
        self.destinations[request.peer_id] = Destination.of(request, aligned)
        self.required_requests = request.required_dst_info_num
        if self.ready:
            self.status.advance(KVPoll.WaitingForInput)

    @property
    def ready(self) -> bool:
        """Every decode rank this room writes to has sent its request."""
        return self.required_requests is not None and len(self.requests) >= self.required_requests

    def add_chunk(self, chunk: Chunk) -> None:
        """Queue a chunk; ValueError for one that breaks the order: after the last chunk,
        layer ranges of a chunk that do not follow one another from the first layer to the
        last, on the same pages, before the next chunk, or pages at positions sent before
        (a last chunk that leaves a position unsent)."""
        if self.last_queued:
            raise ValueError(f"room {self.room}: send() after the last chunk")
        progress = self._layer_progress(chunk)
        # A chunk's pages take their positions with its first layers (its later ones: none).
        first = chunk.layers is None or chunk.layers[0] == 0
        size = chunk.src_pages.size if first else 0
        self.placement.place(self.room, chunk.position if first else None, size, chunk.last)
        self.layer_chunk = progress
        self.pending.append(chunk)
        self.last_queued = chunk.last

    def _layer_progress(self, chunk: Chunk) -> LayerProgress | None:
        """Where a layer-wise chunk stands once this piece of it is queued (None: complete)."""
        ongoing = self.layer_chunk
        if chunk.layers is None:
            if ongoing is not None:
                raise ValueError(
                    f"room {self.room}: layers {ongoing.layers_done}..{self.num_layers - 1} of "
                    "the chunk being sent by layers are still to come before the next chunk"
                )
            return None
        start, stop = chunk.layers
        expected = ongoing.layers_done if ongoing is not None else 0
        if start != expected or not start < stop <= self.num_layers:
            raise ValueError(
                f"room {self.room}: layers {start}..{stop - 1} sent, but the chunk's layers go "
                f"in order from {expected} up to {self.num_layers - 1}"
            )
        if ongoing is not None and not np.array_equal(ongoing.pages, chunk.src_pages):
            raise ValueError(
                f"room {self.room}: the layers of one chunk go with the same pages "
                f"({ongoing.pages.size} pages, then {chunk.src_pages.size})"
            )
        if ongoing is not None and ongoing.position != chunk.position:
            raise ValueError(
                f"room {self.room}: the layers of one chunk go to the same position "
                f"({ongoing.position}, then {chunk.position})"
            )
        if stop == self.num_layers:
            return None
        if chunk.last:
            raise ValueError(
                f"room {self.room}: the last chunk ends with its last layer "
                f"({self.num_layers - 1}), not {stop - 1}"
            )
        return LayerProgress(chunk.src_pages, chunk.position, stop)

    def next_jobs(self, piece_pages: int | None = None) -> list[ChunkJob]:
        """Write jobs (one per destination) for every chunk queued so far, once the requests
        are in; [] if nothing can start. Chunks keep their order in `chunk_idx`; several
        may be in flight at once, and the room succeeds when the last one's jobs all ended
        (`maybe_succeed`). `piece_pages`: a chunk of more pages goes as pieces of that many
        (`split_chunk`), each a chunk of its own."""
        jobs: list[ChunkJob] = []
        while not self.status.finished and self.pending and self.ready:
            chunk = self.pending.popleft()
            for piece in [chunk] if piece_pages is None else split_chunk(chunk, piece_pages):
                jobs += self._jobs_for(piece)
        return jobs

    def _jobs_for(self, chunk: Chunk) -> list[ChunkJob]:
        jobs = []
        at = self.pages_sent if chunk.position is None else chunk.position
        for peer_id, request in self.requests.items():
            if request.is_dummy:
                continue
            # Pages before decode's prefix are not sent; the request's pages begin at the
            # prefix, so positions count from there.
            skip = (request.decode_prefix_len or 0) // self.page_size
            cut = min(chunk.src_pages.size, max(0, skip - at))
            src_pages = chunk.src_pages[cut:]
            destination = self.destinations[peer_id]
            start = max(0, at - skip)
            try:  # only the positions decode fills, in a row
                src_pages, start = destination.pair(start, src_pages, chunk.positional)
            except Unpaired as exc:
                raise Unpaired(f"room {self.room}: {exc}") from None
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
                    layers=chunk.layers,
                    gate=chunk.gate,
                )
            )
        if chunk.layers is None or chunk.layers[1] == self.num_layers:  # the chunk is complete
            self.pages_sent = max(self.pages_sent, at + chunk.src_pages.size)
        self.chunks_sent += 1
        self.status.advance(KVPoll.Transferring)
        return jobs

    def maybe_succeed(self, open_jobs: int) -> None:
        """Success once the last chunk is queued and every job made from the chunks ended
        (`open_jobs`: how many have not, by the write jobs' table)."""
        done = self.last_queued and not self.pending and self.ready and not open_jobs
        if done and self.status.advance(KVPoll.Success):
            self.step(Step.SUCCEED)
