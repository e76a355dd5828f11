"""kvbridge's SGLang rank mapping (`kvbridge.cache.sglang_route`) against sglang 0.5.23's own
`CommonKVManager._resolve_rank_mapping`, for every pair of TP sizes that divide each other up
to 8, MHA and MLA: the prefill ranks asked, the requests each awaits, the statuses awaited."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "sglang is not installed here (tests/sglang_compat runs in .venv-sglang)",
        allow_module_level=True,
    )

import harness

from kvbridge.cache.sglang_route import sglang_route
from kvbridge.wire import KVLayout

SIZES = (1, 2, 4, 8)
PAIRS = [(p, d) for p in SIZES for d in SIZES if max(p, d) % min(p, d) == 0]


def sglang_mapping(prefill_tp: int, decode_tp: int, decode_rank: int, mla: bool) -> SimpleNamespace:
    cls = harness.common_conn.CommonKVManager
    manager = cls.__new__(cls)
    manager.is_mla_backend, manager.is_hybrid_mla_backend = mla, False
    manager.attn_tp_size, manager.attn_cp_size, manager.attn_cp_rank = decode_tp, 1, 0
    manager.pp_size, manager.pp_rank = 1, 0
    manager.enable_all_cp_ranks_for_transfer = False
    manager.kv_args = SimpleNamespace(engine_rank=decode_rank)
    info = SimpleNamespace(
        attn_tp_size=prefill_tp,
        attn_cp_size=1,
        pp_size=1,
        enable_kv_cache_sharding=False,
        enable_dsa_cache_layer_split=False,
    )
    manager._resolve_rank_mapping(info)
    return info


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), PAIRS)
@pytest.mark.parametrize("layout", [KVLayout.MHA, KVLayout.MLA])
def test_the_rank_mapping_is_sglangs(prefill_tp: int, decode_tp: int, layout: KVLayout) -> None:
    for decode_rank in range(decode_tp):
        theirs = sglang_mapping(prefill_tp, decode_tp, decode_rank, layout == KVLayout.MLA)
        ours = sglang_route(prefill_tp, decode_tp, decode_rank, 8, layout)
        assert list(ours.route.prefill_ranks) == theirs.target_tp_ranks
        assert ours.required_dst_info_num == theirs.required_dst_info_num
        assert len(ours.reporting) == theirs.required_prefill_response_num
        # sglang's real sender among them (the others are dummies for MLA): target_tp_rank.
        assert min(ours.reporting) == theirs.target_tp_rank
