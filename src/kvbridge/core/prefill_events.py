"""What prefill's protocol (`PrefillProtocol`) and its manager say to each other: the
actions it returns (connect to a decode peer, write a job, send a message, wake whoever waits
on rooms), the local events the manager feeds it (the scheduler's rooms and chunks, a
connection made, a write ended), its settings and its counters. Pure data."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvbridge.cache import KVArgs
from kvbridge.cache.costs import DEFAULT_COSTS, WriteCosts
from kvbridge.cache.pairing import Pairing, PathReason, WritePath
from kvbridge.core.protocol import RankStats, RoomsChanged, Send
from kvbridge.core.room import Chunk, ChunkJob, Failure
from kvbridge.wire import ChunkReady, FailureKind
from kvbridge.wire.messages import MemoryKind

JobKey = tuple[int, int, str]  # room, chunk index, decode peer id


# --- actions: what the manager executes ----------------------------------------------------


@dataclass(frozen=True)
class Connect:
    """Connect the engine to a decode peer; report `Connected`."""

    peer_id: str
    descriptor: bytes
    peer_args: KVArgs


@dataclass(frozen=True)
class RingSpace:
    """Where a gathered chunk goes in decode's staging ring (one block), and the message that
    tells decode it landed (sent once the write ended; decode then scatters it)."""

    ptr: int
    ready: ChunkReady


@dataclass(frozen=True)
class PageRows:
    """A gathered chunk goes straight into decode's pages, at these token rows."""

    rows: npt.NDArray[np.int64]


@dataclass(frozen=True)
class StagedChunk:
    """A chunk gathered into this rank's staging buffer at `local_offset` — bytes
    ``[column, column + width)`` of its token rows in every KV buffer, buffer-major — and
    written from there to `destination`."""

    src_rows: npt.NDArray[np.int64]
    column: int
    width: int
    nbytes: int
    local_offset: int
    destination: RingSpace | PageRows


@dataclass(frozen=True)
class Write:
    """Write one job: plan it (or gather it, when staged), write it to the peer with the
    notification if any, and report `WriteEnded` with this action."""

    room: int
    job: ChunkJob
    peer_args: KVArgs
    pairing: Pairing
    notify: bytes
    staged: StagedChunk | None = None
    # The room's last write to a peer that takes complete notifications: that form of its
    # notification, allowed when the room's chunks still out when it was handed out
    # (`complete_with`) go in the same transfer (`transfer_notification`).
    notify_complete: bytes = b""
    complete_with: frozenset[int] = frozenset()


def transfer_notification(writes: Sequence[Write]) -> tuple[bytes, Write | None]:
    """The notification of one transfer made of `writes` (in order; a transfer ends with the
    first write that carries one), and the write whose room that notification completes
    for the peer, if it does: every write of the room to that peer then either ended, and
    succeeded, before this one was handed out, or travels in this transfer — NIXL sends a
    notification only once its transfer's writes (and, flushing the endpoint, every earlier
    one) completed, and a transfer fails whole."""
    notifying = next((write for write in writes if write.notify), None)
    if notifying is None:
        return b"", None
    if notifying.notify_complete:
        travelling = {write.job.chunk_idx for write in writes if write.room == notifying.room}
        if notifying.complete_with <= travelling:
            return notifying.notify_complete, notifying
    return notifying.notify, None


Action = Send | Connect | Write | RoomsChanged


# --- local events ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SenderOpened:
    """The scheduler made a KVSender: the room is claimed (created if new)."""

    room: int


@dataclass(frozen=True)
class ChunkSubmitted:
    room: int
    chunk: Chunk


@dataclass(frozen=True)
class SenderAborted:
    """The scheduler gave the room up (ABORTED), or its manager found it cannot go on."""

    room: int
    reason: str
    kind: FailureKind = FailureKind.ABORTED


@dataclass(frozen=True)
class SenderCleared:
    """The scheduler's one cleanup of a room."""

    room: int


@dataclass(frozen=True)
class Connected:
    """A `Connect` ended; `error` is why it failed, or None."""

    peer_id: str
    error: str | None = None


@dataclass(frozen=True)
class WriteEnded:
    """A `Write` ended (or was never started: its room had ended); `failure` is why it
    failed, or None."""

    write: Write
    failure: Failure | None = None
    # It went with a complete notification (`transfer_notification`): decode heard of the
    # room's success from that, and is sent no status for it.
    completed: bool = False


@dataclass(frozen=True)
class PrefillSettings:
    kv_args: KVArgs
    endpoint: str  # this rank's control endpoint (decode answers staging requests there)
    engine: str
    heartbeat_interval_s: float
    peer_timeout_s: float
    request_timeout_s: float
    staging_timeout_s: float
    staging_bytes: int | None = None  # the local staging buffer's size; None: none
    write_path: str = "auto"  # how chunks go (`kvbridge.cache.pairing.WRITE_PATHS`)
    # What each path costs (auto chooses by it per chunk for pages of every head).
    write_costs: WriteCosts = DEFAULT_COSTS[MemoryKind.DRAM]
    # Write jobs handed out per decode peer at once (to the engine, or waiting for ring
    # space): the next ones are planned and gathered while earlier ones move.
    writes_in_flight: int = 4
    # The engine delivers a write's notification to the peer (NIXL): a room's last write
    # to a decode peer that registered `COMPLETING_NOTIFICATIONS` may then report its success.
    engine_notifies: bool = False
    # The decode peers are SGLang's: no heartbeats, leases or tokens (sglang has none); no
    # status to a rank's dummy request.
    sglang_peers: bool = False

    @property
    def rank(self) -> int:
        return self.kv_args.attn_tp_rank


# Chunks that fell back from the staging path to planned blocks.
FALLBACKS = frozenset({PathReason.TOO_BIG, PathReason.NEVER_FITS, PathReason.NO_STAGING})


@dataclass
class PrefillStats(RankStats):
    leases_renewed: int = 0  # rooms whose request deadline a decode lease started again
    staging_wait_s: float = 0.0  # waiting for decode's ring space
    # Chunk writes handed to the engine (a layer range of one counts once), by path and why.
    chunks_written: Counter[tuple[WritePath, PathReason]] = field(default_factory=Counter)

    def chunk_written(self, path: WritePath, reason: PathReason) -> None:
        self.chunks_written[path, reason] += 1

    @property
    def staged_chunks(self) -> int:
        """Chunks gathered into the staging buffer (into decode's pages or its ring)."""
        return sum(n for (path, _), n in self.chunks_written.items() if path != WritePath.DIRECT)

    @property
    def staging_fallbacks(self) -> int:
        """Chunks the staging path would have taken that went as planned blocks instead."""
        return sum(n for (_, reason), n in self.chunks_written.items() if reason in FALLBACKS)
