"""How a decode rank reaches an SGLang prefill group: sglang 0.5.23's rank mapping
(`CommonKVManager._resolve_rank_mapping`, `disaggregation/common/conn.py`), as a kvbridge
route.

sglang decides which prefill ranks a decode rank asks by attention-TP sizes alone: at equal
sizes its own rank; when decode has more ranks, the one prefill rank whose heads it holds
(`(rank % D) // (D / P)`), which then awaits D / P requests per room; when decode has fewer,
the P / D ranks whose heads make up its own — for MLA only the first of them sends (the
latent is the same on all), the others get a dummy request and send nothing. Unlike
kvbridge's own mapping (`topology`), an SGLang dummy reports no status: a room waits only for
the ranks that write. Pipeline and context parallelism on the prefill side are not mapped
here (refused where the group is looked up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvbridge.cache.spec import KVArgs
from kvbridge.cache.topology import DecodeRoute, HeadRange, Source, TopologyError, rank_heads
from kvbridge.wire.messages import KVLayout, MemoryKind

SGLANG_LAYOUTS = (KVLayout.MHA, KVLayout.MLA)  # what an SGLang prefill group moves


@dataclass(frozen=True)
class SGLangRoute:
    """A decode rank's way to an SGLang prefill group, per room."""

    route: DecodeRoute  # the prefill ranks asked: sources (they write) and dummies
    required_dst_info_num: int  # requests each asked prefill rank awaits per room
    # The prefill ranks whose status ends a room (sglang's required_prefill_response_num).
    reporting: frozenset[int]

    @property
    def required(self) -> dict[int, int]:
        return {rank: self.required_dst_info_num for rank in self.route.prefill_ranks}


def sglang_route(
    prefill_tp: int, decode_tp: int, decode_rank: int, total_heads: int, kv_layout: KVLayout
) -> SGLangRoute:
    """sglang's mapping for `decode_rank`; TopologyError where sglang's rule cannot hold (sizes
    that do not divide, heads a named prefill rank does not hold)."""
    if prefill_tp < 1 or decode_tp < 1 or not 0 <= decode_rank < decode_tp:
        raise TopologyError(f"decode rank {decode_rank} of TP {decode_tp}, prefill TP {prefill_tp}")
    if kv_layout not in SGLANG_LAYOUTS:
        raise TopologyError(
            f"an SGLang prefill group moves {KVLayout.MHA.name} or {KVLayout.MLA.name} KV, "
            f"not {kv_layout.name}"
        )
    if max(prefill_tp, decode_tp) % min(prefill_tp, decode_tp):
        raise TopologyError(
            f"sglang pairs TP sizes that divide each other, not prefill {prefill_tp} and "
            f"decode {decode_tp}"
        )
    if decode_tp == prefill_tp:
        targets, required = [decode_rank], 1
    elif decode_tp > prefill_tp:
        targets, required = [decode_rank // (decode_tp // prefill_tp)], decode_tp // prefill_tp
    else:
        ratio = prefill_tp // decode_tp
        targets, required = list(range(decode_rank * ratio, (decode_rank + 1) * ratio)), 1
    mla = kv_layout == KVLayout.MLA
    writers = targets[:1] if mla else targets
    sources = tuple(
        _source(rank, prefill_tp, decode_rank, decode_tp, total_heads, mla) for rank in writers
    )
    route = DecodeRoute(decode_rank, sources, tuple(targets[len(writers) :]))
    return SGLangRoute(route, required, frozenset(writers))


def _source(
    prefill_rank: int,
    prefill_tp: int,
    decode_rank: int,
    decode_tp: int,
    total_heads: int,
    mla: bool,
) -> Source:
    """What `prefill_rank` writes into `decode_rank`: the heads both hold (sglang's
    `compute_head_slice_params`), all of the latent for MLA."""
    if mla:
        return Source(prefill_rank, HeadRange(0, total_heads), 0, 0)
    held = rank_heads(prefill_rank, prefill_tp, total_heads)
    wanted = rank_heads(decode_rank, decode_tp, total_heads)
    start, stop = max(held.start, wanted.start), min(held.stop, wanted.stop)
    if start >= stop:
        raise TopologyError(
            f"sglang names prefill rank {prefill_rank} for decode rank {decode_rank}, but it "
            f"holds heads {held.start}..{held.stop - 1} and decode rank {decode_rank} "
            f"{wanted.start}..{wanted.stop - 1} (replicated heads map otherwise in kvbridge)"
        )
    return Source(
        prefill_rank, HeadRange(start, stop - start), start - held.start, start - wanted.start
    )


class SGLangGroupSettings(Protocol):
    """What an SGLang prefill group's bootstrap says that decode checks."""

    @property
    def attn_tp_size(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def kv_cache_dtype(self) -> str: ...


# sglang's kv_cache_dtype strings (`--kv-cache-dtype`, `kv_cache_dtype.py`) as kvbridge dtypes.
SGLANG_KV_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
# "auto": the model's own dtype, which a decode rank of the same model holds unquantized.
MODEL_DTYPES = ("bfloat16", "float16", "float32")


def group_problem(group: SGLangGroupSettings, args: KVArgs, engine: str = "mooncake") -> str | None:
    """Why this rank cannot take KV from an SGLang prefill group with these settings (None: it
    can). sglang's prefill writes with its own page stride and never sees decode's buffer
    sizes, so a page size or dtype that differs would land bytes in the wrong places. Over
    NIXL its prefill moves head slices between TP sizes only into GPU memory: toward host
    memory it would stop its listener for good, so that is refused here first."""
    page_size, kv_cache_dtype = group.page_size, group.kv_cache_dtype
    if (
        engine == "nixl"
        and group.attn_tp_size != args.attn_tp_size
        and args.kv_layout != KVLayout.MLA
    ):
        return (
            f"the SGLang NIXL prefill group has TP {group.attn_tp_size}, this rank "
            f"{args.attn_tp_size}: sglang's NIXL prefill moves head slices between TP sizes "
            "only into GPU memory"
        )
    if engine == "nixl" and args.state_buffers and args.memory_kind != MemoryKind.VRAM:
        return (
            "sglang's NIXL backend registers state buffers as GPU memory on both sides: a "
            "Mamba state in host memory cannot move to or from it"
        )
    if (
        args.state_buffers
        and group.attn_tp_size != args.attn_tp_size
        and args.state_layouts is None
    ):
        return (
            f"the SGLang prefill group has TP {group.attn_tp_size}, this rank "
            f"{args.attn_tp_size}: its Mamba state moves between TP sizes only in slices, "
            "which need this rank's state_dims (or state_parts)"
        )
    if page_size != args.page_size:
        return (
            f"the SGLang prefill group has pages of {page_size} tokens, this rank "
            f"{args.page_size}: sglang moves whole pages of one size"
        )
    if kv_cache_dtype == "auto":
        if args.dtype in MODEL_DTYPES:
            return None
        return (
            f"the SGLang prefill group holds the model's own dtype (kv_cache_dtype auto), "
            f"this rank {args.dtype}"
        )
    theirs = SGLANG_KV_DTYPES.get(kv_cache_dtype)
    if theirs is None:
        known = ", ".join(["auto", *SGLANG_KV_DTYPES])
        return f"the SGLang prefill group's kv_cache_dtype {kv_cache_dtype!r} is none of {known}"
    if theirs != args.dtype:
        return f"the SGLang prefill group holds {kv_cache_dtype} KV, this rank {args.dtype}"
    return None


def sglang_dtype_name(dtype: str) -> str:
    """The `kv_cache_dtype` an SGLang instance of the same model holds this rank's KV as:
    `auto` for the model's own dtype (sglang's default, which its decode compares as a
    string), else sglang's name of the quantized type."""
    if dtype in MODEL_DTYPES:
        return "auto"
    names = {ours: theirs for theirs, ours in SGLANG_KV_DTYPES.items() if "_" in theirs}
    if dtype not in names:
        raise ValueError(f"an SGLang instance holds no KV of dtype {dtype}")
    return names[dtype]


def sglang_rank_problem(args: KVArgs) -> str | None:
    """Why a rank with this geometry cannot have SGLang peers (None: it can)."""
    if args.kv_layout not in SGLANG_LAYOUTS:
        return (
            "beside SGLang ranks a kvbridge rank moves MHA or MLA KV, aux slots and a Mamba "
            f"state (not {args.kv_layout.name} pages)"
        )
    if args.dcp_size != 1:
        return "decode context parallelism beside SGLang ranks is not supported"
    return None
