"""A rank's geometry as the native registration carries it, and back: one place for the
mapping between `KVArgs` and `Registration`."""

from __future__ import annotations

from kvbridge.cache.regions import MemoryRegion
from kvbridge.cache.spec import BufferSpec, KVArgs, StatePart
from kvbridge.wire.native import Registration


def registration_for(
    args: KVArgs,
    *,
    peer_id: str,
    host: str,
    control_port: int,
    engine: str,
    engine_descriptor: bytes,
    capabilities: frozenset[str] = frozenset(),
    session_token: bytes = b"",
) -> Registration:
    """The registration a decode rank sends to each prefill peer."""
    return Registration(
        peer_id=peer_id,
        host=host,
        control_port=control_port,
        engine=engine,
        engine_descriptor=engine_descriptor,
        tp_rank=args.attn_tp_rank,
        attn_tp_size=args.attn_tp_size,
        dcp_rank=args.dcp_rank,
        dcp_size=args.dcp_size,
        kv_layout=args.kv_layout,
        total_kv_heads=args.total_kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        page_size=args.page_size,
        kv_layer_ids=list(args.layer_ids),
        kv_ptrs=[buffer.ptr for buffer in args.kv_buffers],
        kv_item_lens=[buffer.item_len for buffer in args.kv_buffers],
        kv_lengths=[buffer.length for buffer in args.kv_buffers],
        aux_ptrs=[buffer.ptr for buffer in args.aux_buffers],
        aux_item_lens=[buffer.item_len for buffer in args.aux_buffers],
        aux_lengths=[buffer.length for buffer in args.aux_buffers],
        state_ptrs=[[buffer.ptr for buffer in args.state_buffers]] if args.state_buffers else [],
        state_item_lens=(
            [[buffer.item_len for buffer in args.state_buffers]] if args.state_buffers else []
        ),
        state_lengths=(
            [[buffer.length for buffer in args.state_buffers]] if args.state_buffers else []
        ),
        state_dim_per_tensor=[list(args.state_dims)] if args.state_dims else [],
        state_parts=[[n for part in parts for n in part.flat()] for parts in args.state_parts],
        staging_base_ptr=args.staging_buffer.ptr if args.staging_buffer else 0,
        staging_total_size=args.staging_buffer.length if args.staging_buffer else 0,
        memory_kind=args.memory_kind,
        device_id=args.device_id,
        capabilities=capabilities,
        session_token=session_token,
    )


def kv_args_of(registration: Registration) -> KVArgs:
    """The peer's geometry from its registration; `GeometryError` if it cannot be right."""

    def buffers(
        ptrs: list[int], item_lens: list[int], lengths: list[int]
    ) -> tuple[BufferSpec, ...]:
        return tuple(
            BufferSpec(ptr, length, item_len)
            for ptr, item_len, length in zip(ptrs, item_lens, lengths, strict=True)
        )

    state = tuple(
        buffer
        for ptrs, item_lens, lengths in zip(
            registration.state_ptrs,
            registration.state_item_lens,
            registration.state_lengths,
            strict=True,
        )
        for buffer in buffers(ptrs, item_lens, lengths)
    )
    return KVArgs(
        kv_layout=registration.kv_layout,
        layer_ids=tuple(registration.kv_layer_ids),
        total_kv_heads=registration.total_kv_heads,
        head_dim=registration.head_dim,
        dtype=registration.dtype,
        page_size=registration.page_size,
        kv_buffers=buffers(
            registration.kv_ptrs, registration.kv_item_lens, registration.kv_lengths
        ),
        attn_tp_rank=registration.tp_rank,
        attn_tp_size=registration.attn_tp_size,
        aux_buffers=buffers(
            registration.aux_ptrs, registration.aux_item_lens, registration.aux_lengths
        ),
        state_buffers=state,
        memory_kind=registration.memory_kind,
        device_id=registration.device_id,
        dcp_rank=registration.dcp_rank,
        dcp_size=registration.dcp_size,
        state_dims=tuple(dim for group in registration.state_dim_per_tensor for dim in group),
        state_parts=tuple(
            tuple(StatePart(*flat[i : i + 4]) for i in range(0, len(flat), 4))
            for flat in registration.state_parts
        ),
        staging_buffer=(
            BufferSpec(registration.staging_base_ptr, registration.staging_total_size, 1)
            if registration.staging_base_ptr and registration.staging_total_size
            else None
        ),
    )


def memory_regions(args: KVArgs) -> list[MemoryRegion]:
    """Every buffer of a rank as a region to register (or to bound a peer's writes), each
    span once: buffers may view the same memory (vLLM's hybrid KV cache describes a shared
    page as KV of one group and state of another), and an engine registers it once."""
    staging = (args.staging_buffer,) if args.staging_buffer is not None else ()
    spans = dict.fromkeys(
        (buffer.ptr, buffer.length)
        for buffer in (*args.kv_buffers, *args.aux_buffers, *args.state_buffers, *staging)
    )
    return [MemoryRegion(ptr, length, args.memory_kind, args.device_id) for ptr, length in spans]
