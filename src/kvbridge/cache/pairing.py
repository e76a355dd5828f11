"""How a prefill rank writes to one decode rank (`Pairing`), decided once, at registration:
which of its heads go there, and the path a chunk's KV takes (`WritePath`):

- direct: planned blocks, one per page run and KV buffer (or per head slice of a page, or
  per token row) — no copy besides the engine's;
- page rows: gathered into this rank's staging buffer, then written straight into decode's
  pages (one prefill rank fills decode's whole token rows);
- ring, the coalesced path: gathered into this rank's staging buffer, written as one block
  into decode's staging ring and scattered there — one engine block per chunk, whatever
  its pages, for two copies more.

`WRITE_PATHS` are the choices a rank is configured with: "auto" (head slices between TP
sizes: the staging path, page rows where decode's pages are big enough blocks; pages of
every head — equal TP, or MLA's latent at any TP — each chunk direct or through the ring,
whichever `kvbridge.cache.costs` says is cheaper), "direct" (never gathered) or
"coalesced" (through decode's ring wherever it can: whole pages of any layout, head slices
of token rows).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbridge.cache.plan import (
    FRESH,
    PlanError,
    PlanMemory,
    TransferPlan,
    check_same_model,
    check_state_slicing,
    plan_head_pages,
    plan_kv,
    plan_tokens,
)
from kvbridge.cache.spec import KVArgs
from kvbridge.cache.topology import Source, Topology, TopologyError, topology
from kvbridge.wire.messages import KVLayout

WRITE_PATHS = ("auto", "direct", "coalesced")
# Layouts whose token rows hold a token's every head of a buffer (K or V): one gather and
# one scatter of token rows move any head slice of them, or all of a rank's heads.
RING_LAYOUTS = frozenset({KVLayout.MHA, KVLayout.MLA})
# Layouts whose pages go through the ring only whole (every head, the same page size, no
# DCP): copied as whole rows of the buffer, they land byte for byte whatever is inside
# them (vLLM's head-major blocks, a hybrid's opaque pages). Only a decode rank that scatters
# whole rows of such chunks (`STAGED_WHOLE_ROWS`) gets them.
WHOLE_ROW_LAYOUTS = frozenset({KVLayout.MHA_HEAD_MAJOR, KVLayout.MHA_KV_PACKED, KVLayout.PAGES})
# A decode rank's registration capability: it scatters a staged chunk from a prefill rank
# that sends it every head as whole rows of its buffers (else the heads' columns of them).
STAGED_WHOLE_ROWS = "staged-whole-rows"


class WritePath(enum.Enum):
    """The path a chunk's KV takes to a decode rank."""

    DIRECT = "direct"
    PAGE_ROWS = "page_rows"
    RING = "ring"


class PathReason(enum.Enum):
    """Why a chunk took its path (a fixed set: a metric's label)."""

    CONFIGURED = "configured"  # write_path direct or coalesced
    NO_HEADS = "no_heads"  # this rank holds none of decode's heads (its dummy requests)
    WHOLE_PAGES = "whole_pages"  # auto: every head, page for page, as page runs
    LAYOUT = "layout"  # a layout not gathered here (auto between TP sizes: MHA only)
    LAYERS_DIFFER = "layers_differ"  # pipeline stages: decode scatters into every layer
    NO_RING = "no_ring"  # decode registered no staging ring
    OLD_DECODE = "old_decode"  # decode does not scatter whole rows (`STAGED_WHOLE_ROWS`)
    SHARED_ROWS = "shared_rows"  # auto: several prefill ranks' heads share decode's rows
    COST = "cost"  # auto: the cheaper path by the cost model
    # Per chunk, against the pairing's path:
    LAYER_RANGE = "layer_range"  # layer-wise: its data is not computed when handed out
    GATED = "gated"  # the same, behind a gate
    TOO_BIG = "too_big"  # bigger than a staging buffer
    NO_STAGING = "no_staging"  # this rank has no staging buffer (its staging failed to open)
    EMPTY = "empty"  # nothing of it for this decode rank (DCP): no block either way
    NEVER_FITS = "never_fits"  # decode answered that it never fits its ring


@dataclass(frozen=True)
class Pairing:
    """How this prefill rank writes to one decode rank: decided once, at registration."""

    topology: Topology
    source: Source | None  # None: this rank only answers the decode rank's dummy requests
    whole_pages: bool  # same heads and page size: plan by page runs
    # Chunks are gathered into this rank's staging buffer (both sides hold the same layers
    # in the same order): written straight into decode's pages (`direct`: page rows) or
    # through decode's staging ring.
    stageable: bool = False
    direct: bool = False
    reason: PathReason = PathReason.WHOLE_PAGES  # why chunks take `path`
    # auto, pages of every head (equal TP; MLA at any TP): each chunk may go either way,
    # direct or through decode's ring; the cost model (`kvbridge.cache.costs`) chooses.
    coalescible: bool = False
    # auto, one source filling decode's token rows, and a ring there: each chunk is gathered
    # and goes as page rows or through the ring, as the cost model chooses.
    rows_or_ring: bool = False

    @property
    def choice(self) -> str:
        """The paths chunks take, as a log line says them."""
        if self.coalescible:
            return "direct or ring"
        if self.rows_or_ring:
            return "page_rows or ring"
        return self.path.value

    @property
    def through_ring(self) -> bool:
        """Chunks may be gathered and written into decode's staging ring (then scattered)."""
        return self.stageable and not self.direct

    @property
    def path(self) -> WritePath:
        """The path a chunk takes unless it cannot (a layer range or a gated chunk, whose
        data is not computed when it is handed out, and a chunk too big for the staging
        buffers go direct)."""
        if not self.stageable:
            return WritePath.DIRECT
        return WritePath.PAGE_ROWS if self.direct else WritePath.RING

    def plan(
        self,
        src: KVArgs,
        dst: KVArgs,
        src_pages: npt.NDArray[np.int64],
        page_offset: int,
        dst_pages: npt.ArrayLike,
        memory: PlanMemory = FRESH,
    ) -> TransferPlan:
        """The KV blocks of a chunk that starts `page_offset` pages into the room."""
        if self.source is None:
            return TransferPlan.empty()
        if self.whole_pages or src.kv_layout == KVLayout.MHA_HEAD_MAJOR:
            # Page for page: the chunk's pages on decode follow the ones sent before it.
            all_pages = np.asarray(dst_pages)
            chunk = all_pages[page_offset : page_offset + src_pages.size]
            if chunk.size != src_pages.size:
                raise PlanError(
                    f"prefill sends {page_offset + src_pages.size} pages but decode gave "
                    f"{all_pages.size}"
                )
            if self.whole_pages:
                return plan_kv(src, dst, src_pages, chunk, memory)
            return plan_head_pages(src, dst, self.source, src_pages, chunk, memory)
        return plan_tokens(
            src,
            dst,
            self.source,
            src_pages,
            page_offset * src.page_size,
            dst_pages,
            dcp_size=dst.dcp_size,
            dcp_rank=dst.dcp_rank,
            memory=memory,
        )


def pair(src: KVArgs, dst: KVArgs, write_path: str = "auto", whole_rows: bool = True) -> Pairing:
    """The pairing of a prefill rank with a decode rank, its chunks' path as `write_path`
    (one of `WRITE_PATHS`) says (`whole_rows`: decode scatters `WHOLE_ROW_LAYOUTS` chunks);
    `PlanError` naming what makes the pair impossible (different model, heads that do not
    divide, state at different TP)."""
    check_same_model(src, dst)
    try:
        mapping = topology(src.attn_tp_size, dst.attn_tp_size, src.total_kv_heads, src.kv_layout)
    except TopologyError as exc:
        raise PlanError(str(exc)) from None
    if src.state_buffers or dst.state_buffers:
        check_state_slicing(src, dst)
    sources = [
        source
        for source in mapping.route(dst.attn_tp_rank).sources
        if source.prefill_rank == src.attn_tp_rank
    ]
    source = sources[0] if sources else None
    whole = (
        source is not None
        and src.page_size == dst.page_size
        and dst.dcp_size == 1
        and source.heads.count == src.kv_heads == dst.kv_heads
    )
    if source is not None and not whole and src.kv_layout == KVLayout.PAGES:
        raise PlanError(
            "opaque pages (a hybrid model's KV and state, or a block of every layer) move only "
            "whole: both sides need "
            f"the same TP size and no DCP, got TP {src.attn_tp_size} → {dst.attn_tp_size}, "
            f"DCP {dst.dcp_size}"
        )
    if (
        source is not None
        and not whole
        and src.kv_layout == KVLayout.MHA_HEAD_MAJOR
        and (src.page_size != dst.page_size or dst.dcp_size != 1)
    ):
        raise PlanError(
            "MHA_HEAD_MAJOR pages (vLLM's CPU cache) keep their tokens together: both sides "
            f"need the same page size and no DCP, got pages of {src.page_size} → "
            f"{dst.page_size} tokens, DCP {dst.dcp_size}"
        )
    if write_path not in WRITE_PATHS:
        raise PlanError(f"write_path must be one of {', '.join(WRITE_PATHS)}, got {write_path!r}")
    if source is None:  # (whole is False)
        return Pairing(mapping, None, whole, reason=PathReason.NO_HEADS)
    if write_path == "direct":
        return Pairing(mapping, source, whole, reason=PathReason.CONFIGURED)
    if src.layer_ids != dst.layer_ids:
        return Pairing(mapping, source, whole, reason=PathReason.LAYERS_DIFFER)
    ring = dst.staging_buffer is not None
    layout = src.kv_layout
    ringable = layout in RING_LAYOUTS or (whole and layout in WHOLE_ROW_LAYOUTS and whole_rows)
    if write_path == "coalesced":  # one block per chunk into decode's ring, where it can
        if not ringable:
            why = PathReason.OLD_DECODE if whole and layout in WHOLE_ROW_LAYOUTS else None
            return Pairing(mapping, source, whole, reason=why or PathReason.LAYOUT)
        if not ring:
            return Pairing(mapping, source, whole, reason=PathReason.NO_RING)
        return Pairing(mapping, source, whole, stageable=True, reason=PathReason.CONFIGURED)
    # auto: pages of every head (equal TP; MLA at any TP) go as page runs or, where the cost
    # model says so, through decode's ring; head slices of token rows are gathered.
    if whole:
        return Pairing(mapping, source, whole, coalescible=ringable and ring)
    if src.kv_layout != KVLayout.MHA:
        return Pairing(mapping, source, whole, reason=PathReason.LAYOUT)
    # Several prefill ranks' heads interleave in each of decode's token rows: only a ring
    # (and decode's scatter) puts them together. One source fills whole rows itself, and
    # writes them straight into decode's pages (a block per page and buffer) or through its
    # ring, whichever the cost model says per chunk (into its pages only, without a ring).
    if source.heads.count == dst.kv_heads:
        if not ring:
            return Pairing(
                mapping, source, whole, stageable=True, direct=True, reason=PathReason.NO_RING
            )
        return Pairing(
            mapping, source, whole, stageable=True, rows_or_ring=True, reason=PathReason.COST
        )
    if not ring:
        return Pairing(mapping, source, whole, reason=PathReason.NO_RING)
    return Pairing(mapping, source, whole, stageable=True, reason=PathReason.SHARED_ROWS)
