"""Decode's view of a room, pure: which prefill ranks must report, who has, and when its
pages are safe to hand back."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvbridge.cache.topology import Source
from kvbridge.core.room import RoomStatus
from kvbridge.wire.messages import FailureKind, KVPoll


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
    # The generation of the room's last abort toward SGLang prefill ranks: their ABORT_ACKs
    # echo it, and only such acks settle a rank.
    abort_generation: int | None = None
    aux_index: int | None = None  # the aux slot the room asked for

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
