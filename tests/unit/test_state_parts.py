"""State slots made of several TP-sharded parts (`StatePart`), as vLLM lays out a Mamba-2
layer's state in a hybrid model's page: the conv state's rows, each ``[x | B | C]`` (B and C
per group, replicated when TP exceeds the groups), then the SSM state by head, then padding.
Moved between TP sizes through the registration's wire form and the route's sources, each
decode rank's slot must come out as that rank computes it, every byte written once."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools

import numpy as np
import pytest

from kvbridge.cache.pairing import pair
from kvbridge.cache.peer import kv_args_of, registration_for
from kvbridge.cache.plan import PlanError, check_state_slicing, plan_state_slices
from kvbridge.cache.spec import GeometryError, KVArgs, StatePart
from kvbridge.cache.topology import rank_heads, topology
from kvbridge.wire.messages import KVLayout

HEADS, HEAD_DIM, GROUPS, STATE, ROWS = 4, 3, 1, 5, 3  # Mamba-2 heads, their dim, B/C groups…
CONV_EL, SSM_EL, SLOTS = 2, 4, 3
TRUTH_RNG = np.random.default_rng(41)
# The model-wide state of each slot: conv rows of x (heads × head_dim), B and C (groups ×
# state), and the SSM state (heads × head_dim × state).
X = TRUTH_RNG.integers(0, 256, (SLOTS, ROWS, HEADS, HEAD_DIM * CONV_EL), dtype=np.uint8)
B = TRUTH_RNG.integers(0, 256, (SLOTS, ROWS, GROUPS, STATE * CONV_EL), dtype=np.uint8)
C = TRUTH_RNG.integers(0, 256, (SLOTS, ROWS, GROUPS, STATE * CONV_EL), dtype=np.uint8)
SSM = TRUTH_RNG.integers(0, 256, (SLOTS, HEADS, HEAD_DIM * STATE * SSM_EL), dtype=np.uint8)


def rank_parts(rank: int, tp: int) -> tuple[StatePart, ...]:
    """One rank's slot as vLLM lays it out: per conv row x, B and C, then the SSM state."""
    heads, groups = rank_heads(rank, tp, HEADS), rank_heads(rank, tp, GROUPS)
    runs = []
    for _ in range(ROWS):
        runs.append((heads.count, HEAD_DIM * CONV_EL, HEADS))
        runs += [(groups.count, STATE * CONV_EL, GROUPS)] * 2
    runs.append((heads.count, HEAD_DIM * STATE * SSM_EL, HEADS))
    offsets = itertools.accumulate((units * size for units, size, _ in runs), initial=0)
    return tuple(StatePart(offset, *run) for offset, run in zip(offsets, runs, strict=False))


def slot_bytes(slot: int, rank: int, tp: int) -> np.ndarray:
    heads, groups = rank_heads(rank, tp, HEADS), rank_heads(rank, tp, GROUPS)
    pieces = []
    for row in range(ROWS):
        pieces.append(X[slot, row, heads.start : heads.stop].ravel())
        pieces += [p[slot, row, groups.start : groups.stop].ravel() for p in (B, C)]
    pieces.append(SSM[slot, heads.start : heads.stop].ravel())
    return np.concatenate(pieces)


def rank_args(
    rank: int, tp: int, fill: bool, pad: int = 7, kv_heads: int = 4
) -> tuple[KVArgs, list[np.ndarray]]:
    """A rank whose one state buffer is a page per slot holding the Mamba state (padded), and
    whose KV (`kv_heads` over TP, replicated past them) is beside it."""
    used = len(slot_bytes(0, rank, tp))
    pages = np.zeros((SLOTS, used + pad), dtype=np.uint8)
    if fill:
        for slot in range(SLOTS):
            pages[slot, :used] = slot_bytes(slot, rank, tp)
    kv = [np.zeros((2, 1, max(1, kv_heads // tp), 4), np.uint16) for _ in range(2)]
    args = KVArgs.from_numpy(
        kv,
        kv_layout=KVLayout.MHA,
        total_kv_heads=kv_heads,
        attn_tp_rank=rank,
        attn_tp_size=tp,
        state=[pages],
    )
    args = dataclasses.replace(args, state_parts=(rank_parts(rank, tp),))
    return args, [pages, *kv]


@pytest.mark.parametrize(("pt", "dt"), list(itertools.product((1, 2, 4), repeat=2)))
def test_mamba_state_moves_between_tp_sizes_byte_exact_each_byte_once(pt: int, dt: int) -> None:
    prefill = [rank_args(p, pt, fill=True) for p in range(pt)]
    mapping = topology(pt, dt, 4, KVLayout.MHA)
    for d in range(dt):
        args, arrays = rank_args(d, dt, fill=False)
        # The decode rank's geometry as prefill reads it: through its registration.
        wire = kv_args_of(
            registration_for(
                args,
                peer_id="d",
                host="127.0.0.1",
                control_port=1,
                engine="loopback",
                engine_descriptor=b"",
            )
        )
        assert wire.state_parts == args.state_parts
        senders = [source.prefill_rank for source in mapping.route(d).sources]
        written = 0
        for sender in senders:
            src_args = prefill[sender][0]
            assert pair(src_args, wire).source is not None
            check_state_slicing(src_args, wire)
            plan = plan_state_slices(src_args, wire, 2, 1, senders)
            for src, dst, length in zip(plan.src, plan.dst, plan.length, strict=True):
                ctypes.memmove(int(dst), int(src), int(length))
                written += int(length)
        pages = arrays[0]
        used = len(slot_bytes(0, d, dt))
        assert np.array_equal(pages[1, :used], slot_bytes(2, d, dt))
        assert written == used  # replicas (B and C over TP 2 and 4) sent once
        assert not pages[[0, 2]].any()
        assert not pages[1, used:].any()


def test_parts_that_do_not_match_the_rank_or_the_peer_are_refused() -> None:
    args, _arrays = rank_args(1, 2, fill=False)
    parts = args.state_parts[0]
    wrong_units = (StatePart(0, 3, 6, HEADS), *parts[1:])  # rank 1 of 2 holds 2 of 4 heads
    with pytest.raises(GeometryError, match="give rank 1 2, the part holds 3"):
        dataclasses.replace(args, state_parts=(wrong_units,))
    past_the_slot = (*parts[:-1], StatePart(parts[-1].offset + 8, 2, 60, HEADS))
    with pytest.raises(GeometryError, match="parts end at byte"):
        dataclasses.replace(args, state_parts=(past_the_slot,))
    other, _more = rank_args(0, 1, fill=False)
    ssm = other.state_parts[0][-1]  # another SSM state size: 1 more byte a head
    changed = (*other.state_parts[0][:-1], StatePart(ssm.offset, HEADS, ssm.unit_bytes + 1, HEADS))
    other = dataclasses.replace(other, state_parts=(changed,))
    with pytest.raises(PlanError, match="are not the same tensors"):
        pair(other, args)


def test_state_that_only_prefill_ranks_sending_no_kv_hold_is_refused_at_pairing() -> None:
    """The state follows the attention's route: with 2 KV heads over prefill TP 4, decode
    rank 0 of 2 reads its KV from prefill rank 0 alone, which holds Mamba head 0 only of the
    heads 0-1 the decode rank needs: head 1 would be left unwritten, so the pair is refused."""
    decode, _arrays = rank_args(0, 2, fill=False, kv_heads=2)
    prefill, _more = rank_args(0, 4, fill=False, kv_heads=2)
    with pytest.raises(PlanError, match="which only prefill ranks that send it no KV hold"):
        pair(prefill, decode)
    fed, _kept = rank_args(0, 2, fill=False, kv_heads=2)  # at TP 2 → 2 every head is sent
    assert pair(fed, decode).source is not None


def test_state_slots_laid_out_differently_at_equal_tp_are_refused() -> None:
    """Whole slots move at equal TP: only between slots laid out alike (another SSM dtype or
    conv layout pads to the same page but puts the parts elsewhere)."""
    local, _arrays = rank_args(0, 1, fill=False)
    peer, _more = rank_args(0, 1, fill=False)
    *conv, ssm = peer.state_parts[0]
    moved = (*conv, StatePart(ssm.offset + 2, ssm.units, ssm.unit_bytes, ssm.total_units))
    with pytest.raises(PlanError, match="laid out differently"):
        pair(local, dataclasses.replace(peer, state_parts=(moved,)))
