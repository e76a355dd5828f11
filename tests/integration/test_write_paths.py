"""The write paths a prefill rank can be told to take (`ManagerConfig.write_path`), with real
managers and a real engine: the coalesced path at equal TP (each chunk gathered, one block
into decode's ring, scattered there) for MHA and MLA, with aux and state slots, a decode
prefix and positions decode skips; the direct path between TP sizes; a chunk too big for
the ring going direct."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from kv_cache import RankCache, as_torch, rank_cache
from real_engine import ENGINE, require_engine
from waiting import wait_for

from kvbridge.cache.pairing import PathReason, WritePath
from kvbridge.config import ManagerConfig
from kvbridge.decode import DecodeManager
from kvbridge.prefill import PrefillManager, PrefillStats
from kvbridge.wire import KVLayout, KVPoll

require_engine()
MHA = dict(kv_layout=KVLayout.MHA, total_kv_heads=2, head_dim=8)
MLA = dict(kv_layout=KVLayout.MLA, total_kv_heads=1, head_dim=24)
THROUGH_RING, CONFIGURED = WritePath.RING, PathReason.CONFIGURED
SLOTS = dict(aux_slots=4, aux_item_bytes=(32,), state_slots=3, state_item_bytes=(128, 16))


def move(
    sources: list[RankCache],
    dst: RankCache,
    config: ManagerConfig,
    dst_pages: npt.ArrayLike,
    chunks: list[npt.NDArray[np.int64]],
    prefix: int = 0,
    decode_config: ManagerConfig | None = None,
) -> tuple[list[PrefillStats], int]:
    """One room from every prefill rank (TP len(sources)) into one decode rank, in `chunks`
    (the last with aux slot 1 and state slot 2, into decode's 2 and 0); it must succeed.
    The prefill ranks' stats and decode's scattered chunks. `decode_config`: decode's own
    settings (else `config`'s)."""
    first = PrefillManager(sources[0].args, dataclasses.replace(config, run_bootstrap=True))
    url = first.bootstrap_url
    others = [
        PrefillManager(src.args, dataclasses.replace(config, bootstrap_url=url))
        for src in sources[1:]
    ]
    prefills = [first, *others]
    decode = DecodeManager(
        dst.args, dataclasses.replace(decode_config or config, bootstrap_url=url)
    )
    try:
        receiver = decode.receiver(5)
        slots = dict(aux_index=2, state_indices=[0]) if dst.aux else {}
        receiver.init(dst_pages, decode_prefix_len=prefix, **slots)
        senders = [prefill.sender(5) for prefill in prefills]
        for sender, src in zip(senders, sources, strict=True):
            for chunk in chunks[:-1]:
                sender.send(chunk)
            last = dict(aux_index=1, state_indices=[2]) if src.aux else {}
            sender.send(chunks[-1], last=True, **last)
        wait_for(
            lambda: all(
                end.poll() in (KVPoll.Success, KVPoll.Failed) for end in [receiver, *senders]
            )
        )
        assert receiver.poll() == KVPoll.Success, receiver.failure_reason
        return [prefill.stats for prefill in prefills], decode.stats.scattered_chunks
    finally:
        decode.close()
        for prefill in prefills:
            prefill.close()


@pytest.mark.parametrize("kernels", ["numpy", "torch"])
@pytest.mark.parametrize("geometry", [MHA, MLA], ids=["mha", "mla"])
def test_equal_tp_coalesced_gathers_each_chunk_into_one_ring_block(
    geometry: dict[str, object], kernels: str
) -> None:
    src = rank_cache(num_pages=16, seed=7, page_size=4, **geometry, **SLOTS)
    dst = rank_cache(num_pages=24, seed=None, page_size=4, **geometry, **SLOTS)
    if kernels == "torch":
        pytest.importorskip("torch", reason="torch staging kernels need torch")
        src, dst = as_torch(src), as_torch(dst)
    config = ManagerConfig(engine=ENGINE, write_path="coalesced", staging_kernels=kernels)
    dst_pages = np.array([20, 3, 7, 11, 0, 9])
    chunks = [np.array([2, 3]), np.array([8, 9, 10]), np.array([14])]
    stats, scattered = move([src], dst, config, dst_pages, chunks)
    assert stats[0].chunks_written == {(THROUGH_RING, CONFIGURED): 3}
    assert scattered == 3
    src_pages = np.concatenate(chunks)
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[dst_pages], want[src_pages])
    untouched = np.setdiff1d(np.arange(24), dst_pages)
    assert not any(got[untouched].any() for got in dst.kv)
    assert np.array_equal(dst.aux[0][2], src.aux[0][1])
    assert all(
        np.array_equal(got[0], want[2]) for got, want in zip(dst.state, src.state, strict=True)
    )


WHOLE_ROWS = {
    "head_major": dict(kv_layout=KVLayout.MHA_HEAD_MAJOR, total_kv_heads=2, head_dim=8),
    "kv_packed": dict(kv_layout=KVLayout.MHA_KV_PACKED, total_kv_heads=2, head_dim=8),
    "pages": dict(kv_layout=KVLayout.PAGES, total_kv_heads=1, head_dim=64, page_size=1),
}


@pytest.mark.parametrize("layout", sorted(WHOLE_ROWS))
def test_equal_tp_coalesced_moves_whole_rows_of_any_layout(layout: str) -> None:
    """vLLM's head-major blocks, a packed K and V, a hybrid's opaque pages: every head,
    page for page, gathered as whole rows of the buffers and scattered the same way."""
    geometry = {"page_size": 4, **WHOLE_ROWS[layout]}
    src = rank_cache(num_pages=16, seed=8, **geometry)
    dst = rank_cache(num_pages=24, seed=None, **geometry)
    config = ManagerConfig(engine=ENGINE, write_path="coalesced")
    dst_pages = np.array([20, 3, 7, 11, 0, 9])
    chunks = [np.array([2, 3]), np.array([8, 9, 10]), np.array([14])]
    stats, scattered = move([src], dst, config, dst_pages, chunks)
    assert stats[0].chunks_written == {(THROUGH_RING, CONFIGURED): 3}
    assert scattered == 3
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[dst_pages], want[np.concatenate(chunks)])
    untouched = np.setdiff1d(np.arange(24), dst_pages)
    assert not any(got[untouched].any() for got in dst.kv)


@pytest.mark.parametrize("prefix", [0, 4])
def test_coalesced_chunks_skip_the_positions_decode_does_not_want(prefix: int) -> None:
    """Decode skips room pages (-1) and, with a prefix, the first page: the others land in
    order, the skipped ones nowhere, every chunk still through the ring."""
    src = rank_cache(num_pages=16, seed=9, page_size=4, **MHA)
    dst = rank_cache(num_pages=24, seed=None, page_size=4, **MHA)
    config = ManagerConfig(engine=ENGINE, write_path="coalesced")
    wanted = [20, -1, 7, 11, -1]  # room pages 2, 3, 8, 9, 10
    chunks = [np.arange(2, 4), np.arange(8, 11)]
    stats, _ = move([src], dst, config, np.array(wanted[prefix // 4 :]), chunks, prefix)
    assert stats[0].staging_fallbacks == 0
    pairs = {7: 8, 11: 9} if prefix else {20: 2, 7: 8, 11: 9}  # decode page: prefill page
    written = np.zeros(24, dtype=bool)
    written[list(pairs)] = True
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[list(pairs)], want[list(pairs.values())])
        assert not got[~written].any()


def test_a_chunk_bigger_than_the_staging_buffers_goes_through_the_ring_in_pieces() -> None:
    src = rank_cache(num_pages=16, seed=3, page_size=4, **MHA)
    dst = rank_cache(num_pages=24, seed=None, page_size=4, **MHA)
    # 4 buffers × 4 tokens × 32 B = 512 B a page: pieces of one page (half of 1 KiB), each
    # chunk of its own through decode's ring.
    assert len(src.args.kv_buffers) * src.args.page_bytes == 512
    config = ManagerConfig(engine=ENGINE, write_path="coalesced", staging_bytes=1024)
    dst_pages = np.array([5, 6, 1, 2, 3, 4, 17])
    chunks = [np.array([0, 1]), np.array([2, 3, 4, 5, 6])]
    stats, scattered = move([src], dst, config, dst_pages, chunks)
    assert stats[0].chunks_written == {(THROUGH_RING, CONFIGURED): 7}
    assert (stats[0].staged_chunks, stats[0].staging_fallbacks, scattered) == (7, 0, 7)
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[dst_pages], want[np.arange(7)])


def test_a_chunk_too_big_for_the_staging_buffers_and_not_split_goes_direct() -> None:
    src = rank_cache(num_pages=16, seed=3, page_size=4, **MHA)
    dst = rank_cache(num_pages=24, seed=None, page_size=4, **MHA)
    # 512 B a page, more than half of 640: no pieces. The first chunk fits, the second not.
    config = ManagerConfig(engine=ENGINE, write_path="coalesced", staging_bytes=640)
    dst_pages = np.array([5, 6, 1, 2, 3, 4, 17])
    chunks = [np.array([0]), np.array([1, 2, 3, 4, 5, 6])]
    stats, scattered = move([src], dst, config, dst_pages, chunks)
    assert stats[0].chunks_written == {
        (THROUGH_RING, CONFIGURED): 1,
        (WritePath.DIRECT, PathReason.TOO_BIG): 1,
    }
    assert (stats[0].staged_chunks, stats[0].staging_fallbacks, scattered) == (1, 1, 1)
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[dst_pages], want[np.arange(7)])


def test_pieces_fit_decodes_ring_when_it_is_smaller() -> None:
    src = rank_cache(num_pages=16, seed=3, page_size=4, **MHA)
    dst = rank_cache(num_pages=24, seed=None, page_size=4, **MHA)
    # 512 B a page: prefill would gather pieces of 4 pages (half of 4 KiB), decode's ring
    # holds 2: the second chunk goes as pieces of 2 pages.
    config = ManagerConfig(engine=ENGINE, write_path="coalesced", staging_bytes=4096)
    dst_pages = np.array([5, 6, 1, 2, 3, 4, 17])
    chunks = [np.array([0, 1]), np.array([2, 3, 4, 5, 6])]
    small_ring = dataclasses.replace(config, staging_bytes=1024)
    stats, scattered = move([src], dst, config, dst_pages, chunks, decode_config=small_ring)
    assert stats[0].chunks_written == {(THROUGH_RING, CONFIGURED): 4}
    assert (stats[0].staged_chunks, stats[0].staging_fallbacks, scattered) == (4, 0, 4)
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[dst_pages], want[np.arange(7)])


def test_direct_between_tp_sizes_gathers_nothing() -> None:
    geometry = dict(page_size=4, total_kv_heads=4, head_dim=8)
    sources = [
        rank_cache(num_pages=16, seed=40 + rank, attn_tp_rank=rank, attn_tp_size=2, **geometry)
        for rank in range(2)
    ]
    dst = rank_cache(num_pages=24, seed=None, **geometry)
    config = ManagerConfig(engine=ENGINE, write_path="direct")
    dst_pages = np.array([20, 3, 7, 11, 0])
    stats, scattered = move(sources, dst, config, dst_pages, [np.arange(2, 4), np.arange(8, 11)])
    assert [s.chunks_written for s in stats] == [{(WritePath.DIRECT, CONFIGURED): 2}] * 2
    assert scattered == 0
    src_pages = np.r_[2:4, 8:11]
    for rank, cache in enumerate(sources):
        for got, want in zip(dst.kv, cache.kv, strict=True):
            assert np.array_equal(got[dst_pages][:, :, 2 * rank : 2 * rank + 2], want[src_pages])


def test_auto_at_equal_tp_chooses_each_chunk_by_the_calibrated_costs(tmp_path: Path) -> None:
    """A calibration file where a block costs 1 ms and the ring's round trip 2.5: the chunk
    of scattered pages goes gathered through decode's ring, the one of a single run as it
    is, and the room's bytes all land."""
    figures = dict(per_block_s=1e-3, engine_bytes_per_s=1e12, copy_bytes_per_s=1e12)
    figures |= dict(per_piece_s=0.0, per_ring_chunk_s=2.5e-3)
    (tmp_path / "costs.json").write_text(json.dumps({"DRAM": figures}))
    src = rank_cache(num_pages=16, seed=5, page_size=4, **MHA)
    dst = rank_cache(num_pages=24, seed=None, page_size=4, **MHA)
    config = ManagerConfig(engine=ENGINE, write_costs=str(tmp_path / "costs.json"))
    dst_pages = np.array([10, 11, 12, 13])
    chunks = [np.array([3, 5]), np.array([6, 7])]  # two runs, then one
    stats, scattered = move([src], dst, config, dst_pages, chunks)
    assert stats[0].chunks_written == {
        (THROUGH_RING, PathReason.COST): 1,
        (WritePath.DIRECT, PathReason.COST): 1,
    }
    assert scattered == 1
    for got, want in zip(dst.kv, src.kv, strict=True):
        assert np.array_equal(got[dst_pages], want[np.concatenate(chunks)])


def test_a_calibration_file_that_is_wrong_is_refused_at_start(tmp_path: Path) -> None:
    (tmp_path / "costs.json").write_text('{"DRAM": {"per_block_s": -1}}')
    config = ManagerConfig(
        engine=ENGINE, run_bootstrap=True, write_costs=str(tmp_path / "costs.json")
    )
    with pytest.raises(ValueError, match=r"write costs .*costs\.json: DRAM"):
        PrefillManager(rank_cache(seed=1, **MHA).args, config)


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        (dict(write_path="coalesced", staging=False), "needs staging on"),
        (dict(write_path="fastest"), "write_path must be one of auto, direct, coalesced"),
    ],
)
def test_a_write_path_that_cannot_work_is_refused_at_start(
    settings: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        ManagerConfig(engine=ENGINE, **settings)  # type: ignore[arg-type]
