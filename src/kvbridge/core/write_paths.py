"""The path each write job's chunk takes to its decode peer (pure): gathered or as planned
blocks (`chunk_path`, by the peer's pairing and, where either path can carry it, by the cost
model), and what gathering it takes (`gathering`)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvbridge.cache import KVArgs
from kvbridge.cache.costs import WriteCosts
from kvbridge.cache.pairing import Pairing, PathReason, WritePath
from kvbridge.cache.plan import page_runs, token_rows
from kvbridge.core.prefill_events import PageRows, StagedChunk
from kvbridge.core.prefill_peers import DecodePeer
from kvbridge.core.room import ChunkJob
from kvbridge.staging.kernels import staged_size
from kvbridge.staging.ring import StagingRing


def chunk_path(
    pairing: Pairing, job: ChunkJob, local: KVArgs, decode: KVArgs, costs: WriteCosts
) -> tuple[WritePath, PathReason]:
    """The path the job's chunk takes to `decode` (planned blocks, or gathered into page
    rows or into decode's ring), and why."""
    if job.layers is not None or job.gate is not None:  # its data is not computed yet
        if not (pairing.stageable or pairing.coalescible):
            return WritePath.DIRECT, pairing.reason
        why = PathReason.LAYER_RANGE if job.layers is not None else PathReason.GATED
        return WritePath.DIRECT, why
    if pairing.coalescible:
        ring = coalesces(job, local, costs)
        return WritePath.RING if ring else WritePath.DIRECT, PathReason.COST
    if pairing.rows_or_ring:
        ring = rows_go_through_ring(job, local, decode, costs)
        return WritePath.RING if ring else WritePath.PAGE_ROWS, PathReason.COST
    return pairing.path, pairing.reason


def coalesces(job: ChunkJob, local: KVArgs, costs: WriteCosts) -> bool:
    """Whether a chunk of whole pages goes cheaper gathered through decode's ring than as
    its page runs (a block per run and KV buffer; the gather copies a page per buffer)."""
    pages, buffers = job.src_pages.size, len(local.kv_buffers)
    pieces, nbytes = pages * buffers, pages * buffers * local.page_bytes
    if not costs.coalesces(pieces, pieces, nbytes):
        return False  # not even with a block per page: no need to count the runs
    dst_pages = np.asarray(job.dst_pages, dtype=np.int64)[job.page_offset : job.page_offset + pages]
    if dst_pages.size != pages:  # (its plan says what is wrong)
        return False
    runs = page_runs(job.src_pages, dst_pages)[2].size
    return costs.coalesces(runs * buffers, pieces, nbytes)


def rows_go_through_ring(job: ChunkJob, local: KVArgs, decode: KVArgs, costs: WriteCosts) -> bool:
    """Whether a chunk's head slices, which fill decode's token rows, go cheaper through
    decode's ring than straight into its pages: a block per decode page and KV buffer
    against decode's scatter (the gather copies a piece per token row and buffer either
    way)."""
    # Decode context parallelism: this decode rank holds every dcp_size-th token.
    tokens = job.src_pages.size * local.page_size // decode.dcp_size
    buffers = len(local.kv_buffers)
    pieces = tokens * buffers
    blocks = -(-tokens // decode.page_size) * buffers
    return costs.rows_go_through_ring(blocks, pieces, pieces * decode.token_bytes)


def path_of(staged: StagedChunk | None) -> WritePath:
    if staged is None:
        return WritePath.DIRECT
    return WritePath.PAGE_ROWS if isinstance(staged.destination, PageRows) else WritePath.RING


def gathering(
    local: KVArgs, buffer: StagingRing | None, job: ChunkJob, peer: DecodePeer, path: WritePath
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int, int, int] | PathReason:
    """What gathering the chunk into this rank's staging `buffer` for `path` (page rows or
    decode's ring) takes — (source rows, decode's rows, first byte, width, bytes) — or why it
    goes as planned blocks instead: no staging buffer here (or, through the ring, on decode),
    nothing of it for this decode rank, or a chunk bigger than a staging buffer."""
    peer_args, pairing = peer.kv_args, peer.pairing
    assert peer_args is not None
    assert pairing is not None
    assert pairing.source is not None
    ring = peer_args.staging_buffer
    if buffer is None:
        return PathReason.NO_STAGING
    through_ring = path == WritePath.RING
    if through_ring and ring is None:
        return PathReason.NO_RING
    token_start = job.page_offset * local.page_size
    src_rows, dst_rows = token_rows(
        job.src_pages,
        local.page_size,
        token_start,
        np.asarray(job.dst_pages, dtype=np.int64),
        peer_args.page_size,
        peer_args.dcp_size,
        peer_args.dcp_rank,
    )
    # Every head, page for page: whole rows, whatever the layout puts inside them.
    whole = (0, local.token_bytes) if pairing.whole_pages else None
    column, width = whole or pairing.source.columns(local.head_bytes, "src")
    nbytes = staged_size(len(local.kv_buffers), src_rows.size, width)
    if nbytes == 0:
        return PathReason.EMPTY
    too_big = not buffer.fits_ever(nbytes) or (
        through_ring and ring is not None and nbytes > ring.length
    )
    if too_big:
        return PathReason.TOO_BIG
    return src_rows, dst_rows, column, width, nbytes
