"""The cost model `write_path` "auto" chooses by (`kvbridge.cache.costs`): page runs or
decode's ring for pages of every head, page rows or the ring for head slices that fill
decode's rows. Its arithmetic, its choices for the shapes the benchmarks measured, its
calibration file; and in prefill's protocol, each chunk's path by it, and no complete
notification for a room one of whose chunks went through decode's ring."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kv_cache import rank_cache

from kvbridge.cache import BufferSpec, KVArgs
from kvbridge.cache.costs import DEFAULT_COSTS, WriteCosts, load_costs
from kvbridge.cache.pairing import PathReason, WritePath
from kvbridge.cache.peer import registration_for
from kvbridge.core.prefill_events import (
    ChunkSubmitted,
    Connected,
    PageRows,
    PrefillSettings,
    RingSpace,
    SenderOpened,
    Write,
)
from kvbridge.core.prefill_protocol import PrefillProtocol
from kvbridge.core.protocol import Send
from kvbridge.core.room import Chunk, ChunkJob, split_chunk
from kvbridge.core.write_paths import chunk_path
from kvbridge.wire import Heartbeat, MemoryKind, StagingRequest, StagingResponse, TransferRequest
from kvbridge.wire.notifications import COMPLETING_NOTIFICATIONS
from kvbridge.write_gate import WriteGate

HOST, GPU = DEFAULT_COSTS[MemoryKind.DRAM], DEFAULT_COSTS[MemoryKind.VRAM]
MiB = 1 << 20


def test_the_estimates_add_up() -> None:
    costs = WriteCosts(1e-6, 1e9, 2e9, 1e-7, 1e-4, margin=1.0)
    assert costs.direct_s(blocks=100, nbytes=10**9) == pytest.approx(100e-6 + 1.0)
    # Gather and scatter (10 pieces and 0.5 s each), one engine block, the ring's round trip.
    assert costs.coalesced_s(pieces=10, nbytes=10**9) == pytest.approx(
        2 * (1e-6 + 0.5) + 1e-6 + 1.0 + 1e-4
    )
    # Page rows: the gather only, then a block per decode page.
    assert costs.page_rows_s(blocks=100, pieces=10, nbytes=10**9) == pytest.approx(
        1e-6 + 0.5 + 100e-6 + 1.0
    )


def chunk_of(token_bytes: int, page_size: int, tokens: int, layers: int) -> tuple[int, int, int]:
    """(blocks, pieces, bytes) of a chunk of scattered pages: a block and a piece per page
    and KV buffer (K and V of each layer)."""
    pages, buffers = tokens // page_size, 2 * layers
    return pages * buffers, pages * buffers, pages * buffers * page_size * token_bytes


LLAMA_3_8B = 8 * 128 * 2  # bytes of a token in one KV buffer: 8 KV heads of 128 bfloat16
QWEN_2_5_7B = 4 * 128 * 2
DEEPSEEK_V3 = 576 * 2  # MLA's latent row


@pytest.mark.parametrize(
    ("costs", "token_bytes", "page_size", "layers", "coalesced"),
    [
        # Host memory over CMA (measured 2026-12-06, TP 1→1, 1024 tokens): gathering pays
        # for blocks of a few KiB (pages of 1 and 4 tokens: 2.6 and 2.5 GB/s against 0.68
        # and 2.0 direct), not for 16 KiB and up (page 16: 3.2 against 4.5).
        (HOST, LLAMA_3_8B, 1, 32, True),
        (HOST, LLAMA_3_8B, 4, 32, True),
        (HOST, LLAMA_3_8B, 16, 32, False),
        (HOST, LLAMA_3_8B, 64, 32, False),
        (HOST, QWEN_2_5_7B, 16, 28, False),
        (HOST, DEEPSEEK_V3, 16, 61, False),
        # An H200 over cuda_ipc: ~7 µs a block against copies at 100 GB/s and more.
        (GPU, LLAMA_3_8B, 16, 32, True),
        (GPU, LLAMA_3_8B, 64, 32, True),
        (GPU, DEEPSEEK_V3, 16, 61, True),
    ],
)
def test_what_the_defaults_choose_for_the_measured_shapes(
    costs: WriteCosts, token_bytes: int, page_size: int, layers: int, coalesced: bool
) -> None:
    blocks, pieces, nbytes = chunk_of(token_bytes, page_size, 512, layers)
    assert costs.coalesces(blocks, pieces, nbytes) is coalesced


@pytest.mark.parametrize(
    ("costs", "decode_page", "through_ring"),
    [
        # Host memory over CMA, TP 2→4 of Llama-3-8B (a decode rank's 2 heads from one
        # prefill rank), chunks of 512 tokens: page rows moved 0.80× the ring's GB/s into
        # pages of 16 tokens (8 KiB blocks), 1.05× into 32, 1.06× into 64.
        (HOST, 16, True),
        (HOST, 32, False),
        (HOST, 64, False),
        # An H200: a block costs more than decode's scatter at any page size.
        (GPU, 16, True),
        (GPU, 64, True),
    ],
)
def test_what_the_defaults_choose_for_rows_that_fill_decodes_rows(
    costs: WriteCosts, decode_page: int, through_ring: bool
) -> None:
    tokens, buffers, row = 512, 2 * 32, 2 * 128 * 2
    blocks, pieces = -(-tokens // decode_page) * buffers, tokens * buffers
    assert costs.rows_go_through_ring(blocks, pieces, pieces * row) is through_ring


def test_a_chunk_of_one_run_per_buffer_goes_direct_and_a_small_one_pays_the_round_trip() -> None:
    _, pieces, nbytes = chunk_of(LLAMA_3_8B, 1, 512, 32)
    assert not HOST.coalesces(2 * 32, pieces, nbytes)  # its pages contiguous on both sides
    assert not HOST.coalesces(2, 2, 4096)  # a few KiB: the ring's round trip dominates


def test_a_calibration_file_replaces_the_kinds_it_names(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    figures: dict[str, Any] = {"per_block_s": 1e-5, "engine_bytes_per_s": 5e9}
    figures |= {"copy_bytes_per_s": 5e9, "per_piece_s": 0.0, "per_ring_chunk_s": 1e-4}
    figures["measured"] = "here, today"
    path.write_text(json.dumps({"DRAM": figures}))
    costs = load_costs(path)
    assert costs[MemoryKind.DRAM] == WriteCosts(**figures)
    assert costs[MemoryKind.VRAM] == GPU


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        ("[1, 2]", "not a JSON object by memory kind"),
        ("{", "Expecting property name"),
        ('{"HBM": {}}', "unknown memory kind 'HBM' \\(DRAM, VRAM\\)"),
        ('{"DRAM": 3}', "DRAM is not an object"),
        ('{"DRAM": {"per_block": 1}}', "unknown field\\(s\\) \\['per_block'\\]"),
        ('{"DRAM": {"per_block_s": 1}}', "missing 4 required positional arguments"),
        (
            '{"DRAM": {"per_block_s": 1, "engine_bytes_per_s": 0, "copy_bytes_per_s": 1,'
            ' "per_piece_s": 0, "per_ring_chunk_s": 0}}',
            "engine_bytes_per_s must be a number > 0, got 0",
        ),
        (
            '{"DRAM": {"per_block_s": "fast", "engine_bytes_per_s": 1, "copy_bytes_per_s": 1,'
            ' "per_piece_s": 0, "per_ring_chunk_s": 0}}',
            "per_block_s must be a number ≥ 0, got 'fast'",
        ),
    ],
)
def test_a_calibration_file_that_is_wrong_says_what_is_wrong(
    tmp_path: Path, document: str, problem: str
) -> None:
    path = tmp_path / "costs.json"
    path.write_text(document)
    with pytest.raises(ValueError, match=problem):
        load_costs(path)


def test_a_missing_calibration_file_is_named() -> None:
    with pytest.raises(ValueError, match=r"write costs /nonexistent/costs\.json"):
        load_costs("/nonexistent/costs.json")


# --- in prefill's protocol -----------------------------------------------------------------

GEOMETRY = dict(layer_ids=(0, 1), page_size=4, total_kv_heads=2, head_dim=8)
DECODE_ENDPOINT = "tcp://10.0.0.2:7100"
PEER = f"decode-0@{DECODE_ENDPOINT}"
RING = BufferSpec(0x7000_0000, MiB, 1)
DECODE = rank_cache(seed=None, **GEOMETRY)  # alive for the module: one address each run
# A block costs 1 ms, the ring's round trip 2.5: a chunk of two runs (8 blocks over 4 KV
# buffers, 8 ms) is cheaper gathered (~3.5 ms × the margin 1.3), one of one run (4 ms) not.
RUNS_DECIDE = WriteCosts(1e-3, 1e12, 1e12, 0.0, 2.5e-3)


def leased_protocol(
    costs: WriteCosts, staging_bytes: int | None = MiB, decode: KVArgs = DECODE.args
) -> PrefillProtocol:
    prefill = PrefillProtocol(
        PrefillSettings(
            kv_args=rank_cache(seed=1, **GEOMETRY).args,
            endpoint="tcp://10.0.0.1:7000",
            engine="nixl",
            heartbeat_interval_s=0.5,
            peer_timeout_s=3.0,
            request_timeout_s=30.0,
            staging_timeout_s=5.0,
            staging_bytes=staging_bytes,
            writes_in_flight=4,
            engine_notifies=True,
            write_costs=costs,
        )
    )
    registration = registration_for(
        dataclasses.replace(decode, staging_buffer=RING),
        peer_id=PEER,
        host="10.0.0.2",
        control_port=7100,
        engine="nixl",
        engine_descriptor=PEER.encode(),
        capabilities=frozenset({COMPLETING_NOTIFICATIONS}),
        session_token=b"d" * 16,
    )
    (beat,) = [a.message for a in prefill.handle(registration, 0.0) if isinstance(a, Send)]
    assert isinstance(beat, Heartbeat)
    prefill.handle(Connected(PEER), 0.0)
    prefill.handle(Heartbeat(DECODE_ENDPOINT, 1, 3000, beat.sequence), 0.0)
    return prefill


def test_each_chunk_goes_the_way_the_costs_say_and_a_ringed_room_has_no_complete_notification() -> (
    None
):
    prefill = leased_protocol(RUNS_DECIDE)
    pairing = prefill.decode_peers.by_id[PEER].pairing
    assert pairing is not None
    assert (pairing.coalescible, pairing.path) == (True, WritePath.DIRECT)
    prefill.handle(SenderOpened(1), 0.0)
    prefill.handle(ChunkSubmitted(1, Chunk(np.array([3, 5]), last=False)), 0.0)  # two runs
    prefill.handle(ChunkSubmitted(1, Chunk(np.array([6, 7]), last=True)), 0.0)  # one run
    actions = prefill.handle(
        TransferRequest(1, PEER, False, np.arange(10, 14, dtype=np.int32), 0, [], 1), 0.1
    )
    (ask,) = [a.message for a in actions if isinstance(a, Send)]
    (last,) = [a for a in actions if isinstance(a, Write)]
    assert last.staged is None  # direct, by cost
    assert last.notify_complete == b""  # decode scatters the first chunk before it succeeds
    assert isinstance(ask, StagingRequest)
    answer = StagingResponse(1, ask.chunk_idx, 0, 0, ask.nbytes, PEER)
    (first,) = [a for a in prefill.handle(answer, 0.2) if isinstance(a, Write)]
    assert first.staged is not None
    assert isinstance(first.staged.destination, RingSpace)
    assert prefill.stats.chunks_written == {
        (WritePath.RING, PathReason.COST): 1,
        (WritePath.DIRECT, PathReason.COST): 1,
    }
    # A room whose chunks all went direct keeps its complete notification.
    prefill.handle(SenderOpened(2), 0.3)
    prefill.handle(ChunkSubmitted(2, Chunk(np.array([8, 9]), last=True)), 0.3)
    request = TransferRequest(2, PEER, False, np.arange(20, 22, dtype=np.int32), 0, [], 1)
    (only,) = [a for a in prefill.handle(request, 0.4) if isinstance(a, Write)]
    assert (only.staged, only.notify_complete) == (None, b"kvbridge:2:0:complete")


# A decode rank of TP 2: one of the two heads, all from this (TP 1) rank. A block costs 1 ms,
# the ring's round trip 5: a chunk of two pages (8 blocks of decode's pages over 4 KV
# buffers, 8 ms) is cheaper through the ring (6 ms), one of one page (4 ms) as page rows.
HALF = rank_cache(seed=None, attn_tp_rank=1, attn_tp_size=2, **GEOMETRY)
ROWS_DECIDE = WriteCosts(1e-3, 1e12, 1e12, 0.0, 5e-3)


def test_rows_that_fill_decodes_rows_go_as_page_rows_or_through_the_ring_as_the_costs_say() -> None:
    prefill = leased_protocol(ROWS_DECIDE, decode=HALF.args)
    pairing = prefill.decode_peers.by_id[PEER].pairing
    assert pairing is not None
    assert (pairing.rows_or_ring, pairing.choice) == (True, "page_rows or ring")
    prefill.handle(SenderOpened(1), 0.0)
    prefill.handle(ChunkSubmitted(1, Chunk(np.array([3, 5]), last=False)), 0.0)  # two pages
    prefill.handle(ChunkSubmitted(1, Chunk(np.array([6]), last=True)), 0.0)  # one page
    actions = prefill.handle(
        TransferRequest(1, PEER, False, np.arange(10, 13, dtype=np.int32), 0, [], 1), 0.1
    )
    (ask,) = [a.message for a in actions if isinstance(a, Send)]
    (last,) = [a for a in actions if isinstance(a, Write)]
    assert last.staged is not None
    assert isinstance(last.staged.destination, PageRows)
    assert last.notify_complete == b""  # decode scatters the first chunk before it succeeds
    assert isinstance(ask, StagingRequest)
    answer = StagingResponse(1, ask.chunk_idx, 0, 0, ask.nbytes, PEER)
    (first,) = [a for a in prefill.handle(answer, 0.2) if isinstance(a, Write)]
    assert first.staged is not None
    assert isinstance(first.staged.destination, RingSpace)
    assert prefill.stats.chunks_written == {
        (WritePath.RING, PathReason.COST): 1,
        (WritePath.PAGE_ROWS, PathReason.COST): 1,
    }


def test_a_gated_last_chunk_handed_out_before_a_queued_one_does_not_complete_the_room() -> None:
    """A gated chunk is handed out at once, ahead of the room's queued chunks: the queued one
    may yet go through the ring, so the gated last write carries no complete notification."""
    prefill = leased_protocol(RUNS_DECIDE)
    prefill.handle(SenderOpened(1), 0.0)
    gate = WriteGate()
    prefill.handle(ChunkSubmitted(1, Chunk(np.array([3, 5]), last=False)), 0.0)
    prefill.handle(ChunkSubmitted(1, Chunk(np.array([6, 7]), last=True, gate=gate)), 0.0)
    request = TransferRequest(1, PEER, False, np.arange(10, 14, dtype=np.int32), 0, [], 1)
    actions = prefill.handle(request, 0.1)
    (gated,) = [a for a in actions if isinstance(a, Write)]
    assert gated.job.gate is gate
    assert (gated.notify, gated.notify_complete) == (b"kvbridge:1:0", b"")
    (ask,) = [a.message for a in actions if isinstance(a, Send)]
    assert isinstance(ask, StagingRequest)  # the queued chunk went through the ring after all


def test_without_a_staging_buffer_every_chunk_goes_direct_and_says_so() -> None:
    prefill = leased_protocol(RUNS_DECIDE, staging_bytes=None)
    prefill.handle(SenderOpened(1), 0.0)
    prefill.handle(ChunkSubmitted(1, Chunk(np.array([3, 5]), last=True)), 0.0)
    request = TransferRequest(1, PEER, False, np.arange(10, 12, dtype=np.int32), 0, [], 1)
    (write,) = [a for a in prefill.handle(request, 0.1) if isinstance(a, Write)]
    assert write.staged is None
    assert prefill.stats.chunks_written == {(WritePath.DIRECT, PathReason.NO_STAGING): 1}
    assert prefill.stats.staging_fallbacks == 1


def job(layers: tuple[int, int] | None = None, gate: WriteGate | None = None) -> ChunkJob:
    """A chunk of two scattered pages (two runs) toward the peer."""
    pages = np.array([1, 3])
    return ChunkJob(
        1, PEER, 0, pages, 0, np.array([5, 9], np.int32), True, None, None, (), (), layers, gate
    )


def test_layer_ranges_and_gated_chunks_go_direct_whatever_the_costs() -> None:
    """Their data is not computed when their writes are handed out: nothing to gather yet."""
    pairing = leased_protocol(RUNS_DECIDE).decode_peers.by_id[PEER].pairing
    assert pairing is not None
    local, decode = rank_cache(seed=1, **GEOMETRY).args, DECODE.args
    ring, direct = (WritePath.RING, PathReason.COST), (WritePath.DIRECT, PathReason.COST)
    assert chunk_path(pairing, job(), local, decode, RUNS_DECIDE) == ring
    layered = chunk_path(pairing, job(layers=(0, 1)), local, decode, RUNS_DECIDE)
    assert layered == (WritePath.DIRECT, PathReason.LAYER_RANGE)
    gated = chunk_path(pairing, job(gate=WriteGate()), local, decode, RUNS_DECIDE)
    assert gated == (WritePath.DIRECT, PathReason.GATED)
    never = WriteCosts(0.0, 1e12, 1e12, 0.0, 0.0)  # a block costs nothing: direct
    assert chunk_path(pairing, job(), local, decode, never) == direct
    rows = leased_protocol(ROWS_DECIDE, decode=HALF.args).decode_peers.by_id[PEER].pairing
    assert rows is not None
    layered = chunk_path(rows, job(layers=(0, 1)), local, HALF.args, ROWS_DECIDE)
    assert layered == (WritePath.DIRECT, PathReason.LAYER_RANGE)


# --- chunks bigger than a staging buffer ---------------------------------------------------


def test_a_chunk_splits_into_pieces_in_order_its_last_piece_carrying_the_end() -> None:
    gate = WriteGate()
    chunk = Chunk(np.arange(10), last=True, aux_index=3, state_indices=(1,), position=6)
    pieces = split_chunk(chunk, 4)
    assert [p.src_pages.tolist() for p in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [(p.last, p.aux_index, p.state_indices, p.position) for p in pieces] == [
        (False, None, (), 6),
        (False, None, (), 10),
        (True, 3, (1,), 14),
    ]
    assert [p.last for p in split_chunk(dataclasses.replace(chunk, last=False), 4)] == [False] * 3
    assert split_chunk(chunk, 10) == [chunk]
    for whole in (dataclasses.replace(chunk, layers=(0, 1)), dataclasses.replace(chunk, gate=gate)):
        assert split_chunk(whole, 4) == [whole]  # written as computed: never gathered


def test_a_chunk_too_big_to_gather_goes_as_pieces_where_it_would_be_gathered() -> None:
    """A staging buffer of 2 KiB gathers 2 pages of this rank's whole rows (512 B a page over
    4 KV buffers) with another piece in flight. A chunk of 10 pages (2.5 KiB of decode's
    head) would not fit it, and went as planned blocks; it goes through decode's ring as 5
    chunks instead (4 gathered at once, the 5th once one is written). Where it would go as
    page runs anyway, it stays whole."""
    prefill = leased_protocol(ROWS_DECIDE, staging_bytes=2048, decode=HALF.args)
    prefill.handle(SenderOpened(1), 0.0)
    prefill.handle(ChunkSubmitted(1, Chunk(np.arange(10), last=True)), 0.0)
    request = TransferRequest(1, PEER, False, np.arange(10, 20, dtype=np.int32), 0, [], 1)
    actions = prefill.handle(request, 0.1)
    asks = [a.message for a in actions if isinstance(a, Send)]
    assert [(ask.chunk_idx, ask.chunk_num_pages) for ask in asks] == [(i, 2) for i in range(4)]
    assert not [a for a in actions if isinstance(a, Write)]
    free = WriteCosts(0.0, 1e12, 1e12, 0.0, 0.0)  # a block costs nothing: page runs, whole
    direct = leased_protocol(free, staging_bytes=2048)
    direct.handle(SenderOpened(1), 0.0)
    direct.handle(ChunkSubmitted(1, Chunk(np.arange(10), last=True)), 0.0)
    (write,) = [a for a in direct.handle(request, 0.1) if isinstance(a, Write)]
    assert (write.job.src_pages.size, write.staged) == (10, None)
