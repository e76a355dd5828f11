"""A prefill rank's write jobs, the one place they are kept: each job's record from the
moment its chunk is queued until it ended, by key and by room. What a room has open or out
(in flight) is read from here."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbridge.cache.pairing import PathReason
from kvbridge.core.prefill_events import JobKey, Write
from kvbridge.core.room import ChunkJob
from kvbridge.staging.ring import Allocation
from kvbridge.wire import StagingRequest


@dataclass(frozen=True)
class AwaitedStaging:
    request: StagingRequest
    asked_at: float
    src_rows: npt.NDArray[np.int64]
    column: int
    width: int


@dataclass
class WriteJob:
    """A write job from the moment its chunk is queued until it ended: queued (waiting for
    its turn), then handed out — waiting for decode's ring space (`staging`), or with the
    manager (`write`)."""

    job: ChunkJob
    handed_out: bool = False
    staging: AwaitedStaging | None = None
    write: Write | None = None
    local: Allocation | None = None  # its space in this rank's staging buffer
    reason: PathReason | None = None  # why it takes its path, once handed out

    @property
    def key(self) -> JobKey:
        return self.job.room, self.job.chunk_idx, self.job.peer_id


class JobTable:
    """Write jobs by key, and each room's keys."""

    def __init__(self) -> None:
        self.by_key: dict[JobKey, WriteJob] = {}
        self.of_room: dict[int, set[JobKey]] = {}

    def __len__(self) -> int:
        return len(self.by_key)

    def get(self, key: JobKey) -> WriteJob | None:
        return self.by_key.get(key)

    def add(self, entry: WriteJob) -> None:
        self.by_key[entry.key] = entry
        self.of_room.setdefault(entry.job.room, set()).add(entry.key)

    def forget(self, key: JobKey) -> WriteJob | None:
        entry = self.by_key.pop(key, None)
        keys = self.of_room.get(key[0])
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.of_room[key[0]]
        return entry

    def of(self, room: int) -> list[WriteJob]:
        return [self.by_key[key] for key in self.of_room.get(room, ())]

    def open_in(self, room: int) -> int:
        """The room's jobs not ended yet (queued or handed out)."""
        return len(self.of_room.get(room, ()))

    def alone_to_peer(self, job: ChunkJob) -> bool:
        """Whether every other job of `job`'s room to its decode rank ended (one that failed
        failed the room): a complete notification of `job` would then complete the room
        there. A gated write handed out with the room's earlier layers asks at its post."""
        key = (job.room, job.chunk_idx, job.peer_id)
        return all(
            other == key or other[2] != job.peer_id for other in self.of_room.get(job.room, ())
        )

    def in_flight(self, room: int) -> bool:
        """Whether a job of the room is handed out: the engine may still read its pages or
        land bytes in decode's."""
        return any(entry.handed_out for entry in self.of(room))

    def drop_queued(self, room: int) -> None:
        """Forget a room's jobs that were never handed out (their heap entries are skipped
        when their turn comes): a failed room starts none."""
        for entry in self.of(room):
            if not entry.handed_out:
                self.forget(entry.key)
