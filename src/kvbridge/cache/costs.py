"""What writing a chunk costs on each path, and which is cheaper: the choice `write_path`
"auto" makes per chunk where more than one path can carry it (pure arithmetic).

    direct     blocks × per_block_s + bytes / engine_bytes_per_s
    coalesced  2 × (pieces × per_piece_s + bytes / copy_bytes_per_s)      gather and scatter
               + per_block_s + bytes / engine_bytes_per_s                  one engine block
               + per_ring_chunk_s                   the staging ask, its grant, ChunkReady
    page rows  pieces × per_piece_s + bytes / copy_bytes_per_s            gather only
               + blocks × per_block_s + bytes / engine_bytes_per_s   a block per decode page

Pages of every head (equal TP; MLA) go direct or coalesced; head slices that fill decode's
token rows (one prefill rank feeds them, TP 1→2 say) are gathered either way, and go as page
rows or coalesced through decode's ring, the cheaper of the two.

`blocks`: the engine descriptors the chunk's plan makes (a page run per KV buffer); `pieces`:
the contiguous copies the gather and the scatter each make (a page per KV buffer for whole
token rows). The engine's cost per block is what the coalesced path saves; its copies cost
bytes twice more. The figures are per memory kind, measured (`measured` says where): on host
memory over NIXL/UCX's CMA per block costs ~3 µs and copies run near memory speed, so
gathering wins only for small blocks (pages of a few KiB); on a GPU over cuda_ipc a block
costs ~7 µs against copies at 100+ GB/s, so it wins for any page size a model uses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from kvbridge.wire.messages import MemoryKind

# Coalesced only where its estimate is this many times cheaper: near the crossover the
# estimates' error (and a drifting host) would flip chunks between paths for nothing.
MARGIN = 1.3


@dataclass(frozen=True)
class WriteCosts:
    """The cost figures of one memory kind (seconds, bytes per second)."""

    per_block_s: float
    engine_bytes_per_s: float
    copy_bytes_per_s: float
    per_piece_s: float
    per_ring_chunk_s: float
    margin: float = MARGIN
    measured: str = ""

    def __post_init__(self) -> None:
        at_least = {
            "per_block_s": (self.per_block_s, 0.0),
            "per_piece_s": (self.per_piece_s, 0.0),
            "per_ring_chunk_s": (self.per_ring_chunk_s, 0.0),
            "margin": (self.margin, 1.0),
        }
        for name, (value, low) in at_least.items():
            if not (isinstance(value, (int, float)) and value >= low):
                raise ValueError(f"write costs: {name} must be a number ≥ {low:g}, got {value!r}")
        rates = {
            "engine_bytes_per_s": self.engine_bytes_per_s,
            "copy_bytes_per_s": self.copy_bytes_per_s,
        }
        for name, value in rates.items():
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"write costs: {name} must be a number > 0, got {value!r}")

    def direct_s(self, blocks: int, nbytes: int) -> float:
        return blocks * self.per_block_s + nbytes / self.engine_bytes_per_s

    def coalesced_s(self, pieces: int, nbytes: int) -> float:
        copies = 2 * (pieces * self.per_piece_s + nbytes / self.copy_bytes_per_s)
        write = self.per_block_s + nbytes / self.engine_bytes_per_s
        return copies + write + self.per_ring_chunk_s

    def coalesces(self, blocks: int, pieces: int, nbytes: int) -> bool:
        """Whether the chunk goes cheaper gathered through decode's ring, by the margin."""
        return self.direct_s(blocks, nbytes) > self.margin * self.coalesced_s(pieces, nbytes)

    def page_rows_s(self, blocks: int, pieces: int, nbytes: int) -> float:
        gather = pieces * self.per_piece_s + nbytes / self.copy_bytes_per_s
        return gather + self.direct_s(blocks, nbytes)

    def rows_go_through_ring(self, blocks: int, pieces: int, nbytes: int) -> bool:
        """Whether gathered rows go cheaper through decode's ring (one block, then decode's
        scatter) than straight into its pages (`blocks`). Both gather: no margin."""
        return self.page_rows_s(blocks, pieces, nbytes) > self.coalesced_s(pieces, nbytes)


# Host memory: this 2-core host, NIXL over UCX's CMA, numpy kernels (2026-12-06: `kvbridge
# demo` at TP 1→1, Llama-3-8B, 1024 tokens: direct 0.68 / 2.0 / 4.5 GB/s at pages of 1 / 4
# / 16 tokens, coalesced 2.6 / 2.5 / 3.2; per block ~3 µs with 9.3 GB/s of bytes, fitted
# from `kvbridge bench`'s raw engine rows). GPU memory: one H200, UCX's cuda_ipc
# (2026-12-04: 32 KiB blocks at 3.9-5.9 GB/s, large ones at 211-850 GB/s; the gather
# through torch 80-170 GB/s with a synchronize per call).
DEFAULT_COSTS: Mapping[MemoryKind, WriteCosts] = {
    MemoryKind.DRAM: WriteCosts(
        per_block_s=3.0e-6,
        engine_bytes_per_s=9.3e9,
        copy_bytes_per_s=10e9,
        per_piece_s=80e-9,
        per_ring_chunk_s=200e-6,
        measured="default: host memory, NIXL over CMA, 2026-12-06",
    ),
    MemoryKind.VRAM: WriteCosts(
        per_block_s=7.0e-6,
        engine_bytes_per_s=400e9,
        copy_bytes_per_s=100e9,
        per_piece_s=0.0,
        per_ring_chunk_s=400e-6,
        measured="default: H200, NIXL over cuda_ipc, 2026-12-04",
    ),
}


def load_costs(path: str | Path) -> dict[MemoryKind, WriteCosts]:
    """Cost figures from a calibration file: a JSON object by memory kind ("DRAM", "VRAM"),
    each with `WriteCosts`' fields (`margin` and `measured` optional). ValueError naming
    what is wrong; kinds the file leaves out keep their defaults."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"write costs {path}: {exc}") from None
    if not isinstance(document, dict):
        raise ValueError(f"write costs {path}: not a JSON object by memory kind")
    known = {field.name for field in fields(WriteCosts)}
    costs = dict(DEFAULT_COSTS)
    for kind_name, figures in document.items():
        if kind_name not in MemoryKind.__members__:
            kinds = ", ".join(MemoryKind.__members__)
            raise ValueError(f"write costs {path}: unknown memory kind {kind_name!r} ({kinds})")
        if not isinstance(figures, dict):
            raise ValueError(f"write costs {path}: {kind_name} is not an object")
        unknown = sorted(set(figures) - known)
        if unknown:
            raise ValueError(f"write costs {path}: {kind_name}: unknown field(s) {unknown}")
        try:
            costs[MemoryKind[kind_name]] = WriteCosts(**figures)
        except TypeError as exc:  # a field left out
            raise ValueError(f"write costs {path}: {kind_name}: {exc}") from None
    return costs
