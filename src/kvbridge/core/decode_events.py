"""What decode's protocol (`DecodeProtocol`) and its manager say to each other: the actions it
returns (scatter a staged chunk, forget a prefill rank's group, send a message, wake whoever
waits on rooms), the local events the manager feeds it (the scheduler's rooms, a registration
to make, a scatter ended, closing), its settings and its counters. Pure data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvbridge.cache.topology import DecodeRoute, Source
from kvbridge.core.protocol import RankStats, RoomsChanged, Send
from kvbridge.staging.ring import Allocation
from kvbridge.wire import ChunkReady, Registration
from kvbridge.wire.address import tcp_endpoint
from kvbridge.wire.sglang import mooncake, nixl

if TYPE_CHECKING:  # (decode_sglang builds on these events)
    from kvbridge.core.decode_sglang import SGLangPeer

# --- actions: what the manager executes ----------------------------------------------------


@dataclass(frozen=True)
class ScatterChunk:
    """Copy a staged chunk from the ring into the room's pages, then report `ChunkScattered`."""

    ready: ChunkReady
    allocation: Allocation
    dst_pages: npt.NDArray[np.int64]
    source: Source


@dataclass(frozen=True)
class ForgetPrefill:
    """A prefill rank was declared dead: drop every cached bootstrap group it was in (a
    restarted rank has a new endpoint, and the next room looks its group up again)."""

    endpoint: str


@dataclass(frozen=True)
class WriteAux:
    """Copy an aux slot's bytes that came in a message (SGLang's AUX_DATA) into aux buffer
    `buffer_index`, slot `slot`: checked against the rank's aux geometry before it is asked."""

    buffer_index: int
    slot: int
    data: bytes


Action = Send | ScatterChunk | ForgetPrefill | WriteAux | RoomsChanged


# --- local events: what the scheduler, the scatter thread and the clock report -------------


@dataclass(frozen=True)
class Registering:
    """A receiver needs this prefill rank: register with it, once. `sglang`: the rank is an
    SGLang prefill rank (`registration` is then sglang's), spoken to by its rules."""

    endpoint: str
    registration: Registration | mooncake.KVArgsRegisterInfo | nixl.KVArgsRegisterInfo
    sglang: SGLangPeer | None = None


@dataclass(frozen=True)
class PrefillsAnswered:
    """SGLang prefill ranks showed a sign of life: their group's bootstrap answered its health
    check (sglang's own decode watches its prefill the same way; they send no heartbeats)."""

    endpoints: tuple[str, ...]


@dataclass(frozen=True)
class RoomOpened:
    """`KVReceiver.init`: decode's pages (SKIPPED_PAGE where it needs nothing), aux slot and
    state slots for a room, and its way to the prefill group: its route (sources and dummies),
    per prefill rank the requests that rank counts on and its control endpoint, and the ranks
    whose status ends the room (None: every rank asked, kvbridge's rule; an SGLang dummy
    reports nothing)."""

    room: int
    route: DecodeRoute
    required: Mapping[int, int]
    endpoints: Mapping[int, str]
    pages: npt.NDArray[np.int32]
    aux_index: int | None = None
    state_indices: tuple[int, ...] = ()
    decode_prefix_len: int | None = None
    reporting: frozenset[int] | None = None


@dataclass(frozen=True)
class LeasesRenewing:
    """Decode's scheduler still means to ask for these rooms of a prefill group (requests in
    its queue): renew their request deadlines on the group's ranks this rank talks to."""

    endpoints: tuple[str, ...]
    rooms: tuple[int, ...]


@dataclass(frozen=True)
class RoomAborted:
    """The scheduler gave up on a room; `endpoints`: where to send the abort if the room never
    reached `init` (no state here: its receiver failed it)."""

    room: int
    reason: str
    endpoints: tuple[str, ...] = ()


@dataclass(frozen=True)
class RoomCleared:
    """The scheduler's one cleanup of a room: counted under its outcome and forgotten."""

    room: int


@dataclass(frozen=True)
class ChunkScattered:
    """A `ScatterChunk` ended (`failed`: it raised): its ring space is free again."""

    ready: ChunkReady
    allocation: Allocation
    failed: bool = False


@dataclass(frozen=True)
class Closing:
    """The rank is closing: rooms whose pages a prefill rank may still write into fail and
    their writers are asked to stop."""


@dataclass(frozen=True)
class DecodeSettings:
    """What the protocol needs to know about its rank and its configuration."""

    rank: int
    peer_id: str
    host: str  # this rank's control address, named in its aborts
    control_port: int
    session_token: bytes  # sent in registrations; prefill's statuses, acks and beats echo it
    heartbeat_interval_s: float
    peer_timeout_s: float  # also the write lease this rank grants, in its heartbeats
    # How long after its lease a writer that is hung, not dead, may still land a write: its
    # write timeout where the engine moves writes on its own threads, else nothing.
    write_grace_s: float = 0.0
    staging_bytes: int | None = None  # the ring's size; None: no ring
    transfer_timeout_s: float = 300.0  # a room's deadline, from when it opens
    # The engine delivers a write's notification (NIXL): a room waits for its sources' last.
    engine_notifies: bool = False
    # Per aux buffer (bytes per slot, slots), and whether they lie in host memory: where an
    # aux slot that arrives in a message (SGLang's AUX_DATA) may be copied.
    aux_geometry: tuple[tuple[int, int], ...] = ()
    aux_in_host_memory: bool = True

    @property
    def lease_ms(self) -> int:
        return int(self.peer_timeout_s * 1000)

    @property
    def endpoint(self) -> str:
        """This rank's control endpoint: who it is in its heartbeats."""
        return tcp_endpoint(self.host, self.control_port)


@dataclass
class DecodeStats(RankStats):
    unexpected_chunks: int = 0
    # Kept by the manager's scatter thread.
    scattered_chunks: int = 0
    scatter_s: float = 0.0
