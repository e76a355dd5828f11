"""Transfer planning: which bytes go where, as three flat numpy arrays.

A plan is (src_addr, dst_addr, length) arrays, one entry per contiguous block, built with
vectorized numpy: a request costs array arithmetic proportional to its page runs, never a
Python loop over pages or descriptors. Runs of pages that are contiguous on both sides are
merged into one block per buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbridge.cache.spec import BufferSpec, KVArgs
from kvbridge.cache.topology import Source, rank_heads, topology
from kvbridge.wire.messages import KVLayout

U64 = np.uint64
Addresses = npt.NDArray[np.uint64]


class PlanError(ValueError):
    """The two sides' geometry or the page indices make the requested transfer impossible."""


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Blocks to write: ``length[i]`` bytes from local ``src[i]`` to remote ``dst[i]``."""

    src: Addresses
    dst: Addresses
    length: Addresses

    def __post_init__(self) -> None:
        if not self.src.shape == self.dst.shape == self.length.shape or self.src.ndim != 1:
            raise PlanError("a plan's src, dst and length arrays must be 1-D and equally long")

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum(dtype=U64))

    @staticmethod
    def empty() -> TransferPlan:
        return TransferPlan(np.empty(0, U64), np.empty(0, U64), np.empty(0, U64))

    @staticmethod
    def concat(*plans: TransferPlan, memory: PlanMemory | None = None) -> TransferPlan:
        """The plans' blocks in order (one plan: itself, not a copy)."""
        if not plans:
            return TransferPlan.empty()
        if len(plans) == 1:
            return plans[0]
        src, dst, length = (memory or FRESH).take(sum(len(plan) for plan in plans))
        np.concatenate([plan.src for plan in plans], out=src)
        np.concatenate([plan.dst for plan in plans], out=dst)
        np.concatenate([plan.length for plan in plans], out=length)
        return TransferPlan(src, dst, length)

    def split(self, max_blocks: int) -> list[TransferPlan]:
        """Batches of at most `max_blocks` blocks (engines limit blocks in flight)."""
        return [
            TransferPlan(
                self.src[start : start + max_blocks],
                self.dst[start : start + max_blocks],
                self.length[start : start + max_blocks],
            )
            for start in range(0, len(self), max_blocks)
        ]


Arrays = tuple[Addresses, Addresses, Addresses]


class PlanMemory:
    """Where a planner puts a plan's arrays: fresh arrays (this class), or an arena's
    (`PlanArena`)."""

    def take(self, blocks: int) -> Arrays:
        """Arrays for `blocks` source addresses, destination addresses and lengths (contents
        undefined)."""
        return np.empty(blocks, U64), np.empty(blocks, U64), np.empty(blocks, U64)


FRESH = PlanMemory()


class PlanArena(PlanMemory):
    """Address arrays that plans of many blocks borrow and give back once nothing reads them
    any more (`give_back`). Fresh arrays of tens of MB cost the kernel's page faults and
    zeroing, as much as filling them (measured here: a 128k-token plan at page size 1 took
    about twice as long in fresh memory). Plans under `min_blocks` take fresh arrays; at most
    `keep` pairs wait for reuse. Thread-safe: one thread may plan while another gives back."""

    def __init__(self, keep: int = 4, min_blocks: int = 1 << 16) -> None:
        self.keep = keep
        self.min_blocks = min_blocks
        self._free: list[Arrays] = []
        self._lent: dict[int, Arrays] = {}  # id(the source array's base) → its arrays
        self._lock = threading.Lock()

    def take(self, blocks: int) -> Arrays:
        if blocks < self.min_blocks:
            return FRESH.take(blocks)
        with self._lock:
            fitting = [arrays for arrays in self._free if arrays[0].size >= blocks]
            if fitting:
                arrays = min(fitting, key=lambda arrays: arrays[0].size)
                self._free.remove(arrays)
            else:
                arrays = FRESH.take(blocks)
            self._lent[id(arrays[0])] = arrays
        src, dst, length = arrays
        return src[:blocks], dst[:blocks], length[:blocks]

    def give_back(self, plan: TransferPlan) -> None:
        """The plan's arrays may be reused (a plan not from this arena: nothing happens)."""
        arrays = self.forget(plan)
        if arrays is None:
            return
        with self._lock:
            self._free.append(arrays)
            if len(self._free) > self.keep:
                self._free.remove(min(self._free, key=lambda kept: kept[0].size))

    def forget(self, plan: TransferPlan) -> Arrays | None:
        """Stop tracking the plan's arrays without reusing them (something may still read
        them); the arrays, if they came from here."""
        base = plan.src.base if plan.src.base is not None else plan.src
        with self._lock:
            return self._lent.pop(id(base), None)

    @property
    def lent(self) -> int:
        return len(self._lent)


def as_pages(pages: npt.ArrayLike, num_pages: int, side: str) -> npt.NDArray[np.int64]:
    """Page indices as int64, refused unless 1-D and inside ``[0, num_pages)``."""
    array = np.asarray(pages)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise PlanError(f"{side} page indices must be a 1-D integer array, got {array.dtype}")
    array = array.astype(np.int64, copy=False)
    if array.size and (array.min() < 0 or array.max() >= num_pages):
        raise PlanError(
            f"{side} page indices must lie in [0, {num_pages}), got [{array.min()}, {array.max()}]"
        )
    return array


def page_runs(
    src_pages: npt.NDArray[np.int64], dst_pages: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Maximal runs where both sides' pages advance by one: (src starts, dst starts, lengths)."""
    pages = src_pages.size
    if pages == 0:
        empty = np.empty(0, np.int64)
        return empty, empty, empty
    # Planned on every write, mostly a few pages: few numpy calls, no np.diff (its Python
    # wrapper cost more than the work at that size; 2026-12-03: 16 → 9 µs at 4 pages).
    run_starts_here = np.empty(pages, dtype=bool)
    run_starts_here[0] = True
    np.not_equal(src_pages[1:] - src_pages[:-1], 1, out=run_starts_here[1:])
    run_starts_here[1:] |= dst_pages[1:] - dst_pages[:-1] != 1
    starts = np.flatnonzero(run_starts_here)
    lengths = np.empty(starts.size, np.int64)
    np.subtract(starts[1:], starts[:-1], out=lengths[:-1])
    lengths[-1] = pages - starts[-1]
    return src_pages[starts], dst_pages[starts], lengths


def _buffer_pairs(src: KVArgs, dst: KVArgs) -> tuple[Addresses, Addresses]:
    """Base addresses of the KV buffers to pair, src and dst, matched by layer id (read-only
    arrays: asked for on every write, so built from each side's cached addresses)."""
    if src.layer_ids == dst.layer_ids:  # the same layers in the same order: buffer for buffer
        return src.kv_ptrs, dst.kv_ptrs
    dst_position = dst.layer_positions
    missing = [layer for layer in src.layer_ids if layer not in dst_position]
    if missing:
        raise PlanError(f"the destination has no KV buffers for layers {missing}")
    dst_layers = len(dst.layer_ids)
    dst_layer_index = np.array([dst_position[layer] for layer in src.layer_ids], dtype=np.int64)
    # MHA: K of every layer, then V of every layer (the same order on both sides).
    dst_index = np.concatenate(
        [dst_layer_index + part * dst_layers for part in range(src.buffers_per_layer)]
    )
    return src.kv_ptrs, dst.kv_ptrs[dst_index]


def check_same_model(src: KVArgs, dst: KVArgs) -> None:
    """Refuse a pair that cannot be running the same model's KV cache."""
    if src.kv_layout != dst.kv_layout:
        raise PlanError(f"KV layouts differ: {src.kv_layout.name} → {dst.kv_layout.name}")
    for name in ("dtype", "head_dim", "total_kv_heads"):
        if getattr(src, name) != getattr(dst, name):
            raise PlanError(
                f"{name} differs: {getattr(src, name)!r} → {getattr(dst, name)!r}; both sides "
                "must run the same model"
            )


def check_compatible(src: KVArgs, dst: KVArgs) -> None:
    """Refuse pairs that `plan_kv` (whole pages) cannot serve, with the reason."""
    check_same_model(src, dst)
    if src.page_size != dst.page_size:
        raise PlanError(
            f"page_size differs: {src.page_size} → {dst.page_size}; plan_kv copies whole pages"
        )
    if src.kv_heads != dst.kv_heads:
        raise PlanError(
            f"KV heads per rank differ ({src.kv_heads} → {dst.kv_heads}: attention TP "
            f"{src.attn_tp_size} → {dst.attn_tp_size}); head slices need plan_tokens (MHA) or "
            "plan_head_pages (MHA_HEAD_MAJOR)"
        )


def plan_kv(
    src: KVArgs,
    dst: KVArgs,
    src_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
    memory: PlanMemory = FRESH,
) -> TransferPlan:
    """Blocks that copy ``src_pages`` of every local KV buffer to ``dst_pages`` of the peer's
    buffer of the same layer (same page geometry on both sides)."""
    check_compatible(src, dst)
    src_array, dst_array = _paired_pages(src, dst, src_pages, dst_pages)
    src_starts, dst_starts, run_pages = page_runs(src_array, dst_array)
    return _on_every_buffer(
        src,
        dst,
        src_starts * src.page_bytes,
        dst_starts * dst.page_bytes,
        run_pages * src.page_bytes,
        memory,
    )


def _paired_pages(
    src: KVArgs, dst: KVArgs, src_pages: npt.ArrayLike, dst_pages: npt.ArrayLike
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Both sides' pages, checked, one destination page for each source page."""
    src_array = as_pages(src_pages, src.num_pages, "source")
    dst_array = as_pages(dst_pages, dst.num_pages, "destination")
    if src_array.size != dst_array.size:
        raise PlanError(
            f"{src_array.size} source pages but {dst_array.size} destination pages: one each"
        )
    return src_array, dst_array


def _check_heads_fit(src: KVArgs, dst: KVArgs, source: Source) -> None:
    count = source.heads.count
    if (
        source.src_head_offset + count > src.kv_heads
        or source.dst_head_offset + count > dst.kv_heads
    ):
        raise PlanError(
            f"heads {source.heads} do not fit: source holds {src.kv_heads}, destination "
            f"{dst.kv_heads}"
        )


def _on_every_buffer(
    src: KVArgs,
    dst: KVArgs,
    src_offsets: npt.NDArray[np.int64],
    dst_offsets: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    memory: PlanMemory = FRESH,
) -> TransferPlan:
    """The same blocks (byte offsets within a buffer) in every KV buffer, paired by layer."""
    src_ptrs, dst_ptrs = _buffer_pairs(src, dst)
    return _grid(src_ptrs, dst_ptrs, src_offsets, dst_offsets, lengths, memory)


def _grid(
    src_bases: Addresses,
    dst_bases: Addresses,
    src_offsets: npt.NDArray[np.int64],
    dst_offsets: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    memory: PlanMemory = FRESH,
) -> TransferPlan:
    """Blocks at the same offsets from each pair of base addresses: (bases, blocks) grids
    flattened base-major, so each buffer's blocks keep their order."""
    shape = (src_bases.size, src_offsets.size)
    src_addr, dst_addr, length = memory.take(shape[0] * shape[1])
    np.add(src_bases[:, None], src_offsets.astype(U64)[None, :], out=src_addr.reshape(shape))
    np.add(dst_bases[:, None], dst_offsets.astype(U64)[None, :], out=dst_addr.reshape(shape))
    np.copyto(length.reshape(shape), lengths.astype(U64)[None, :])
    return TransferPlan(src_addr, dst_addr, length)


def plan_head_pages(
    src: KVArgs,
    dst: KVArgs,
    source: Source,
    src_pages: npt.ArrayLike,
    dst_pages: npt.ArrayLike,
    memory: PlanMemory = FRESH,
) -> TransferPlan:
    """Blocks for a head slice of MHA_HEAD_MAJOR pages (vLLM's CPU cache,
    ``[pages, heads, page_size, 2 * head_dim]``): within a page each head's tokens are
    contiguous, so a slice of heads is one block per page and buffer. Both sides need the same
    page size; pages stay whole in the token dimension."""
    check_same_model(src, dst)
    if src.kv_layout != KVLayout.MHA_HEAD_MAJOR:
        raise PlanError(f"plan_head_pages plans MHA_HEAD_MAJOR pages, not {src.kv_layout.name}")
    if src.page_size != dst.page_size:
        raise PlanError(
            f"MHA_HEAD_MAJOR pages keep their tokens together: page sizes must be equal, got "
            f"{src.page_size} → {dst.page_size}"
        )
    _check_heads_fit(src, dst, source)
    src_array, dst_array = _paired_pages(src, dst, src_pages, dst_pages)
    # One head's tokens of one page: its K and V rows side by side.
    head_page_bytes = src.kv_layout.kv_in_page * src.page_size * src.head_bytes
    src_offsets = src_array * src.page_bytes + source.src_head_offset * head_page_bytes
    dst_offsets = dst_array * dst.page_bytes + source.dst_head_offset * head_page_bytes
    # Merges only where the slice is all of both sides' heads (then it is plan_kv's runs).
    src_starts, dst_starts, lengths = merge_runs(
        src_offsets, dst_offsets, source.heads.count * head_page_bytes
    )
    return _on_every_buffer(src, dst, src_starts, dst_starts, lengths, memory)


def merge_runs(
    src_offsets: npt.NDArray[np.int64], dst_offsets: npt.NDArray[np.int64], length: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Equal-length blocks merged wherever both sides continue contiguously: (src starts,
    dst starts, run lengths in bytes)."""
    if src_offsets.size == 0:
        empty = np.empty(0, np.int64)
        return empty, empty, empty
    joins = (np.diff(src_offsets) == length) & (np.diff(dst_offsets) == length)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    blocks = np.diff(np.concatenate((starts, [src_offsets.size])))
    return src_offsets[starts], dst_offsets[starts], blocks * length


def token_rows(
    src_pages: npt.NDArray[np.int64],
    src_page_size: int,
    token_start: int,
    dst_pages: npt.NDArray[np.int64],
    dst_page_size: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Where each token of a chunk that goes to this decode (DCP) rank lives on both sides, as
    token rows of a buffer (``page * page_size + slot``), in token order.

    The chunk is `src_pages` from global token `token_start`; `dst_pages` are all the
    request's pages on the decode rank. With DCP, global token i lives on DCP rank
    ``i % dcp_size`` at local token ``i // dcp_size``. Tokens past the destination's pages
    (prefill's last-page padding) are left out.
    """
    local, tokens = chunk_tokens(
        token_start,
        src_pages.size * src_page_size,
        dst_pages.size * dst_page_size,
        dcp_size,
        dcp_rank,
    )
    src_rows = src_pages[local // src_page_size] * src_page_size + local % src_page_size
    return src_rows, _rows(dst_pages, dst_page_size, tokens)


def chunk_tokens(
    token_start: int, token_count: int, dst_tokens: int, dcp_size: int = 1, dcp_rank: int = 0
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The chunk's tokens that this decode (DCP) rank holds: (index within the chunk, token
    index on the decode rank), in token order."""
    local = np.arange(token_count, dtype=np.int64)
    tokens = token_start + local
    if dcp_size > 1:
        mine = tokens % dcp_size == dcp_rank
        local, tokens = local[mine], tokens[mine] // dcp_size
    keep = tokens < dst_tokens
    return local[keep], tokens[keep]


def _rows(
    pages: npt.NDArray[np.int64], page_size: int, tokens: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    rows: npt.NDArray[np.int64] = pages[tokens // page_size] * page_size + tokens % page_size
    return rows


def dst_token_rows(
    token_start: int,
    token_count: int,
    dst_pages: npt.NDArray[np.int64],
    dst_page_size: int,
    dcp_size: int = 1,
    dcp_rank: int = 0,
) -> npt.NDArray[np.int64]:
    """Decode's half of `token_rows`: where a chunk's tokens land, from the token range alone
    (decode never needs to know prefill's pages)."""
    _, tokens = chunk_tokens(
        token_start, token_count, dst_pages.size * dst_page_size, dcp_size, dcp_rank
    )
    return _rows(dst_pages, dst_page_size, tokens)


def plan_tokens(
    src: KVArgs,
    dst: KVArgs,
    source: Source,
    src_pages: npt.ArrayLike,
    token_start: int,
    dst_pages: npt.ArrayLike,
    *,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    memory: PlanMemory = FRESH,
) -> TransferPlan:
    """Blocks for a chunk at token granularity: any head slice, page sizes and DCP layout.

    `src_pages` hold the chunk's tokens from global token `token_start` (a page boundary).
    `dst_pages` are all of the request's pages on this decode rank, in token order; with DCP,
    global token i lives on DCP rank ``i % dcp_size`` at local token ``i // dcp_size``.
    Tokens past the destination's pages (the padding of prefill's last page) are not sent.
    Per buffer, one block per token, merged wherever both sides are contiguous.
    """
    check_same_model(src, dst)
    if not src.kv_layout.token_major:
        raise PlanError(
            f"{src.kv_layout.name} pages move whole (or by head slices: plan_head_pages): "
            "plan_tokens cannot split their tokens"
        )
    if token_start % src.page_size:
        raise PlanError(f"chunk starts at token {token_start}, not a page boundary")
    _check_heads_fit(src, dst, source)
    src_array = as_pages(src_pages, src.num_pages, "source")
    dst_array = as_pages(dst_pages, dst.num_pages, "destination")
    src_rows, dst_rows = token_rows(
        src_array, src.page_size, token_start, dst_array, dst.page_size, dcp_size, dcp_rank
    )
    src_column, width = source.columns(src.head_bytes, "src")
    dst_column, _ = source.columns(src.head_bytes, "dst")
    src_offsets = src_rows * src.token_bytes + src_column
    dst_offsets = dst_rows * dst.token_bytes + dst_column
    src_starts, dst_starts, lengths = merge_runs(src_offsets, dst_offsets, width)
    return _on_every_buffer(src, dst, src_starts, dst_starts, lengths, memory)


def plan_gathered(
    src: KVArgs,
    dst: KVArgs,
    source: Source,
    staged_ptr: int,
    dst_rows: npt.NDArray[np.int64],
    memory: PlanMemory = FRESH,
) -> TransferPlan:
    """Blocks that put a chunk gathered at `staged_ptr` (``[buffers, tokens, width]`` bytes,
    buffer-major, as `staging.kernels.gather` lays it out) into decode's pages at their token
    rows `dst_rows`. Used where this prefill rank alone holds the decode rank's heads: a
    token's slice is then the decode rank's whole row, and runs of consecutive rows are one
    block per buffer, with no ring and no scatter on decode."""
    if src.layer_ids != dst.layer_ids:
        raise PlanError("a gathered chunk goes to a decode rank with the same layers in order")
    _check_heads_fit(src, dst, source)
    dst_column, width = source.columns(src.head_bytes, "dst")
    tokens = dst_rows.size
    src_offsets = np.arange(tokens, dtype=np.int64) * width
    dst_offsets = dst_rows.astype(np.int64) * dst.token_bytes + dst_column
    src_starts, dst_starts, lengths = merge_runs(src_offsets, dst_offsets, width)
    buffers = len(src.kv_buffers)
    src_bases = U64(staged_ptr) + np.arange(buffers, dtype=U64) * U64(tokens * width)
    dst_bases = np.array([buffer.ptr for buffer in dst.kv_buffers], dtype=U64)
    return _grid(src_bases, dst_bases, src_starts, dst_starts, lengths, memory)


def plan_slots(
    src_buffers: tuple[BufferSpec, ...],
    dst_buffers: tuple[BufferSpec, ...],
    src_slot: int,
    dst_slot: int,
    kind: str,
) -> TransferPlan:
    """Copy one slot of every buffer (aux metadata, per-request state) to the peer's slot."""
    if len(src_buffers) != len(dst_buffers):
        raise PlanError(
            f"{len(src_buffers)} local {kind} buffers but the peer registered {len(dst_buffers)}"
        )
    if not src_buffers:
        return TransferPlan.empty()
    for index, (local, remote) in enumerate(zip(src_buffers, dst_buffers, strict=True)):
        if local.item_len != remote.item_len:
            raise PlanError(
                f"{kind} buffer {index}: slot sizes differ ({local.item_len} B → "
                f"{remote.item_len} B)"
            )
        if not 0 <= src_slot < local.num_items:
            raise PlanError(f"{kind} buffer {index}: source slot {src_slot} out of range")
        if not 0 <= dst_slot < remote.num_items:
            raise PlanError(f"{kind} buffer {index}: destination slot {dst_slot} out of range")
    item_lens = np.array([buffer.item_len for buffer in src_buffers], dtype=U64)
    src_addr = np.array([buffer.ptr for buffer in src_buffers], dtype=U64)
    dst_addr = np.array([buffer.ptr for buffer in dst_buffers], dtype=U64)
    return TransferPlan(
        src_addr + U64(src_slot) * item_lens, dst_addr + U64(dst_slot) * item_lens, item_lens
    )


def check_state_slicing(src: KVArgs, dst: KVArgs) -> None:
    """State moves whole between equal TP sizes when both sides lay a slot out alike (where
    both describe it), and between different TP sizes when both sides describe each slot's
    parts (`KVArgs.state_layouts`), the parts are the same tensors cut by TP, and the prefill
    ranks that write to this decode rank hold every unit it needs."""
    ours, theirs = src.state_layouts, dst.state_layouts
    if src.attn_tp_size == dst.attn_tp_size:
        if ours is not None and theirs is not None and ours != theirs:
            raise PlanError(
                "state slots are laid out differently on the two sides (another state dtype, "
                f"conv state layout or speculative rows?): {ours} here, {theirs} on the peer"
            )
        return
    if src.kv_layout.replicated:
        raise PlanError("state buffers with MLA move only between equal TP sizes")
    if len(src.state_buffers) != len(dst.state_buffers):
        raise PlanError(
            f"{len(src.state_buffers)} local state buffers but the peer registered "
            f"{len(dst.state_buffers)}"
        )
    if ours is None or theirs is None:
        raise PlanError(
            f"state buffers cannot move between attention TP {src.attn_tp_size} and "
            f"{dst.attn_tp_size} without their sharded parts (state_dims or state_parts) on "
            "both sides"
        )
    for index, (local, remote) in enumerate(zip(ours, theirs, strict=True)):
        shapes = [(part.unit_bytes, part.total_units) for part in local]
        if shapes != [(part.unit_bytes, part.total_units) for part in remote]:
            raise PlanError(
                f"state buffer {index}: parts of (unit bytes, units) {shapes} here and "
                f"{[(p.unit_bytes, p.total_units) for p in remote]} on the peer are not the "
                "same tensors"
            )
    # The state follows the attention's route: only its sources write to this decode rank.
    route = topology(src.attn_tp_size, dst.attn_tp_size, src.total_kv_heads, src.kv_layout)
    senders = [source.prefill_rank for source in route.route(dst.attn_tp_rank).sources]
    for index, parts in enumerate(ours):
        for part in parts:
            held: set[int] = set()
            for rank in senders:
                units = rank_heads(rank, src.attn_tp_size, part.total_units)
                held.update(range(units.start, units.stop))
            wanted = rank_heads(dst.attn_tp_rank, dst.attn_tp_size, part.total_units)
            missing = [unit for unit in range(wanted.start, wanted.stop) if unit not in held]
            if missing:
                raise PlanError(
                    f"state buffer {index}: decode rank {dst.attn_tp_rank} needs units "
                    f"{missing[0]}-{missing[-1]} of {part.total_units}, which only prefill ranks "
                    f"that send it no KV hold (attention TP {src.attn_tp_size} → "
                    f"{dst.attn_tp_size} over {src.total_kv_heads} KV heads); kvbridge moves "
                    "this state between these TP sizes only where the KV heads are not replicated"
                )


def plan_state_slices(
    src: KVArgs, dst: KVArgs, src_slot: int, dst_slot: int, senders: Sequence[int] = ()
) -> TransferPlan:
    """The units of each state slot's parts that this prefill rank holds and the decode rank
    needs, one block per part. `senders`: every prefill rank that writes to this decode rank;
    of the ones holding the same replicated units, the lowest sends them."""
    layouts, peer_layouts = src.state_layouts, dst.state_layouts
    assert layouts is not None
    assert peer_layouts is not None
    sources, targets, lengths = [], [], []
    for local, remote, parts, peer_parts in zip(
        src.state_buffers, dst.state_buffers, layouts, peer_layouts, strict=True
    ):
        if not (0 <= src_slot < local.num_items and 0 <= dst_slot < remote.num_items):
            raise PlanError(f"state slot {src_slot} → {dst_slot} out of range")
        for part, peer_part in zip(parts, peer_parts, strict=True):
            total = part.total_units
            held = rank_heads(src.attn_tp_rank, src.attn_tp_size, total)
            wanted = rank_heads(dst.attn_tp_rank, dst.attn_tp_size, total)
            low, high = max(held.start, wanted.start), min(held.stop, wanted.stop)
            replica_below = any(
                rank < src.attn_tp_rank and rank_heads(rank, src.attn_tp_size, total) == held
                for rank in senders
            )
            if low >= high or replica_below:
                continue
            unit = part.unit_bytes
            sources.append(
                local.ptr + src_slot * local.item_len + part.offset + (low - held.start) * unit
            )
            targets.append(
                remote.ptr
                + dst_slot * remote.item_len
                + peer_part.offset
                + (low - wanted.start) * unit
            )
            lengths.append((high - low) * unit)
    return TransferPlan(
        np.array(sources, dtype=U64), np.array(targets, dtype=U64), np.array(lengths, dtype=U64)
    )
