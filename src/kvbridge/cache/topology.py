"""Which prefill rank sends which heads to which decode rank: the one rank mapping.

Attention-TP size `tp` splits `H` KV heads: each rank holds `max(1, H // tp)` heads. When `tp`
exceeds `H`, heads are replicated: `tp // H` consecutive ranks hold the same heads, and a
rank's head group is its rank divided (never taken modulo) by that replica count.

For MHA, every decode rank receives its heads from the prefill ranks that hold them, one
replica per head group (replicas are shared out round-robin among the decode ranks that need
the group). For MLA, the latent is identical everywhere: each decode rank receives it from
exactly one prefill rank. Every prefill rank must hear from some decode rank about every room
(it runs every request), so a prefill rank that feeds nobody gets a dummy request from one
decode rank, and reports completion without sending anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from kvbridge.wire.messages import KVLayout


class TopologyError(ValueError):
    """A parallel layout that cannot be mapped (heads that do not divide evenly, ...)."""


@dataclass(frozen=True)
class HeadRange:
    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


def rank_heads(rank: int, tp_size: int, total_heads: int) -> HeadRange:
    """The global KV heads an attention-TP rank holds."""
    if tp_size <= total_heads:
        if total_heads % tp_size:
            raise TopologyError(f"{total_heads} KV heads do not divide over TP {tp_size}")
        per_rank = total_heads // tp_size
        return HeadRange(rank * per_rank, per_rank)
    if tp_size % total_heads:
        raise TopologyError(f"TP {tp_size} is not a multiple of {total_heads} KV heads")
    replicas = tp_size // total_heads
    return HeadRange(rank // replicas, 1)


@dataclass(frozen=True)
class Source:
    """One prefill rank's contribution to one decode rank."""

    prefill_rank: int
    heads: HeadRange  # global heads moved
    src_head_offset: int  # first of them within the prefill rank's heads
    dst_head_offset: int  # and within the decode rank's heads

    def columns(self, head_bytes: int, side: str) -> tuple[int, int]:
        """Where the moved heads lie in one token row of a KV buffer, in bytes: (first byte,
        width), on the prefill ("src") or the decode ("dst") side."""
        offset = self.src_head_offset if side == "src" else self.dst_head_offset
        return offset * head_bytes, self.heads.count * head_bytes


@dataclass(frozen=True)
class DecodeRoute:
    """What one decode rank does for every room."""

    decode_rank: int
    sources: tuple[Source, ...]
    dummies: tuple[int, ...]  # prefill ranks it sends a dummy request to

    @property
    def prefill_ranks(self) -> tuple[int, ...]:
        """Every prefill rank this decode rank sends a request to and awaits a status from."""
        return tuple(source.prefill_rank for source in self.sources) + self.dummies


@dataclass(frozen=True)
class Topology:
    prefill_tp: int
    decode_tp: int
    total_heads: int
    kv_layout: KVLayout
    routes: tuple[DecodeRoute, ...]

    def route(self, decode_rank: int) -> DecodeRoute:
        return self.routes[decode_rank]

    def required_requests(self, prefill_rank: int, dcp_size: int = 1) -> int:
        """Requests (real and dummy) a prefill rank receives per room. With decode context
        parallelism every DCP rank of a decode rank asks for its own tokens; only DCP rank 0
        sends the dummies."""
        real = sum(
            any(source.prefill_rank == prefill_rank for source in route.sources)
            for route in self.routes
        )
        dummy = sum(prefill_rank in route.dummies for route in self.routes)
        return real * dcp_size + dummy


@cache
def topology(prefill_tp: int, decode_tp: int, total_heads: int, kv_layout: KVLayout) -> Topology:
    """The mapping between a prefill group and a decode group (computed once per pair)."""
    if prefill_tp < 1 or decode_tp < 1 or total_heads < 1:
        raise TopologyError("TP sizes and head counts must be at least 1")
    sources: list[tuple[Source, ...]]
    if kv_layout == KVLayout.PAGES:
        if prefill_tp != decode_tp:
            raise TopologyError(
                f"opaque pages (a hybrid model's KV and state in shared pages) move only "
                f"between equal TP sizes, got prefill TP {prefill_tp} and decode TP {decode_tp}"
            )
        sources = [(Source(d, HeadRange(0, total_heads), 0, 0),) for d in range(decode_tp)]
    elif kv_layout.replicated:
        sources = [
            (Source(d * prefill_tp // decode_tp, HeadRange(0, total_heads), 0, 0),)
            for d in range(decode_tp)
        ]
    else:
        sources = _mha_sources(prefill_tp, decode_tp, total_heads)
    fed = {source.prefill_rank for route in sources for source in route}
    dummies: list[list[int]] = [[] for _ in range(decode_tp)]
    for prefill_rank in range(prefill_tp):
        if prefill_rank not in fed:
            dummies[prefill_rank * decode_tp // prefill_tp].append(prefill_rank)
    routes = tuple(DecodeRoute(d, sources[d], tuple(dummies[d])) for d in range(decode_tp))
    return Topology(prefill_tp, decode_tp, total_heads, kv_layout, routes)


def _mha_sources(prefill_tp: int, decode_tp: int, total_heads: int) -> list[tuple[Source, ...]]:
    prefill_replicas = max(1, prefill_tp // total_heads)
    prefill_heads_per_rank = rank_heads(0, prefill_tp, total_heads).count
    served: dict[int, int] = {}  # head group → decode ranks served so far (for round-robin)
    routes = []
    for decode_rank in range(decode_tp):
        wanted = rank_heads(decode_rank, decode_tp, total_heads)
        route = []
        head = wanted.start
        while head < wanted.stop:
            group = head // prefill_heads_per_rank
            group_start = group * prefill_heads_per_rank
            count = min(wanted.stop, group_start + prefill_heads_per_rank) - head
            replica = served.get(group, 0) % prefill_replicas
            served[group] = served.get(group, 0) + 1
            route.append(
                Source(
                    prefill_rank=group * prefill_replicas + replica,
                    heads=HeadRange(head, count),
                    src_head_offset=head - group_start,
                    dst_head_offset=head - wanted.start,
                )
            )
            head += count
        routes.append(tuple(route))
    return routes
