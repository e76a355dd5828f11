"""kvbridge's connector inside vLLM 0.32's CPU build for each model family it moves besides
Llama (test_connector.py): MLA (DeepSeek-V2-shaped), a sliding-window hybrid (Gemma-3-shaped,
through vLLM's hybrid KV cache manager) and a Mamba-2 hybrid (Granite-4-hybrid-shaped). Each
family's prefill and decode instances move concurrent prompts of several lengths; decode's
tokens are held against a plain single-instance run (MLA: against vLLM's own NixlConnector in
the same deployment, as decode's first step runs another kernel than a plain run), and every
block decode holds is held, byte for byte, against prefill's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed here (make test runs this in .venv-vllm)", allow_module_level=True
    )

from vllm_harness import (
    FAMILY_ENV,
    Instance,
    free_port,
    kvbridge_config,
    make_model,
    nixl_config,
    prompt,
)

LENGTHS = (5, 32, 97, 300, 1000)
PROMPTS = [prompt(length, seed) for seed, length in enumerate(LENGTHS)]
MAX_TOKENS = 8
PREFILL_ONLY = {"do_remote_decode": True}
KV_BLOCKS = {"KVBRIDGE_TEST_KV_BLOCKS": "1"}


Outputs = list[dict[str, Any]]


def run_pair(
    model: Path, logs: Path, family: str, connector: str, one_at_a_time: bool = False
) -> tuple[Outputs, Outputs, dict[str, Any]]:
    """Prefill then decode, as a PD proxy does: (prefill outputs, decode outputs, decode's
    stats). `one_at_a_time`: decode each prompt alone (its tokens then do not depend on which
    loads ended together, and so shared a decode step)."""
    environment = {**FAMILY_ENV[family], **KV_BLOCKS}

    def config(role: str) -> dict[str, Any]:
        return nixl_config("kv_both") if connector == "vllm-nixl" else kvbridge_config(role, "nixl")

    prefill = Instance(
        model, config("kv_producer"), logs / f"{family}-{connector}-prefill.log", env=environment
    )
    try:
        decode = Instance(
            model, config("kv_consumer"), logs / f"{family}-{connector}-decode.log", env=environment
        )
        try:
            prefilled = prefill.generate(PROMPTS, 1, [PREFILL_ONLY] * len(PROMPTS))["outputs"]
            params = [output["kv_transfer_params"] for output in prefilled]
            if one_at_a_time:
                outputs = [
                    decode.generate([p], MAX_TOKENS, [q])["outputs"][0]
                    for p, q in zip(PROMPTS, params, strict=True)
                ]
            else:
                outputs = decode.generate(PROMPTS, MAX_TOKENS, params)["outputs"]
            stats = decode.call("stats")
            for instance in (prefill, decode):
                assert "KV load failed" not in instance.log()
        finally:
            decode.close()
    finally:
        prefill.close()
    return prefilled, outputs, stats


def plain_tokens(model: Path, logs: Path, family: str, dtype: str | None = None) -> list[list[int]]:
    """A plain single-instance run's tokens (`dtype`: other than the harness's bfloat16)."""
    env = {**FAMILY_ENV[family], **({"KVBRIDGE_TEST_DTYPE": dtype} if dtype else {})}
    suffix = f"-{dtype}" if dtype else ""
    plain = Instance(model, None, logs / f"{family}-plain{suffix}.log", env=env)
    try:
        return [output["tokens"] for output in plain.generate(PROMPTS, MAX_TOKENS)["outputs"]]
    finally:
        plain.close()


def assert_blocks_arrived(prefilled: list[dict[str, Any]], outputs: list[dict[str, Any]]) -> int:
    """Every whole block decode holds of each prompt equals prefill's block at the same
    position of the same KV cache group; how many were compared."""
    compared = 0
    for sent, received in zip(prefilled, outputs, strict=True):
        for group, blocks in received["kv_blocks"].items():
            theirs = sent["kv_blocks"][group]
            for position, digest in blocks.items():
                assert theirs.get(position) == digest, (group, position)
                compared += 1
    return compared


def assert_states_arrived(prefilled: Outputs, outputs: Outputs) -> int:
    """Every unit of the recurrent state each decode rank loaded (a head of x or of the SSM
    state, a group of B or C, per layer) equals that unit on a prefill rank that holds it;
    how many were compared."""
    compared = 0
    for sent, received in zip(prefilled, outputs, strict=True):

        def units(ranks: list[dict[str, str]]) -> dict[str, set[str]]:
            found: dict[str, set[str]] = {}
            for rank in ranks:  # "group/position/layer/part/unit": the block's place differs
                for key, digest in rank.items():
                    found.setdefault(key.split("/", 2)[2], set()).add(digest)
            return found

        theirs = units(sent["kv_states_by_rank"])
        for rank in received["kv_states_by_rank"]:
            for key, digest in rank.items():
                assert theirs.get(key.split("/", 2)[2]) == {digest}, key
                compared += 1
    return compared


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("families")
    return {
        family: make_model(folder / family, family=family) for family in ("mla", "sliding", "mamba")
    }


def test_mla_latent_arrives_byte_exact_and_decodes_as_nixl_connectors(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Concurrent loads, byte-exact; then each prompt decoded alone through kvbridge and
    through NixlConnector gives the same tokens (decoded together, which loads share a
    decode step differs between connectors, and vLLM's CPU MLA decode of this random model
    has near ties that batching flips)."""
    prefilled, outputs, stats = run_pair(models["mla"], tmp_path, "mla", "kvbridge")
    _, alone, _ = run_pair(models["mla"], tmp_path, "mla", "kvbridge", one_at_a_time=True)
    _, nixl_alone, _ = run_pair(models["mla"], tmp_path, "mla", "vllm-nixl", one_at_a_time=True)
    assert [o["tokens"] for o in alone] == [o["tokens"] for o in nixl_alone]
    # Blocks of 16 tokens (vLLM's CPU MLA): every whole one before each prompt's last token.
    assert assert_blocks_arrived(prefilled, outputs) == sum((n - 1) // 16 for n in LENGTHS)
    connector = stats["connector"]
    assert connector["requests_loaded"] == len(PROMPTS)
    assert connector["pages_loaded"] == sum(-(-n // 16) for n in LENGTHS)


TP_PAIRS = [(1, 2), (2, 1)]


def run_tp_pairs(
    model: Path, logs: Path, family: str, connector: str, dtype: str = "bfloat16"
) -> dict[tuple[int, int], tuple[Outputs, Outputs]]:
    """Per TP pair of TP_PAIRS, a prefill and a decode instance of one family, kvbridge's or
    NixlConnector's: prefill's outputs and decode's (each prompt decoded alone), with every
    rank's block hashes; prefill frees every block once decode has it. Two instances at a
    time, the one at TP 1 started first: an idle NixlConnector worker keeps a thread busy,
    and on two cores three instances' threads starved a fourth one's start-up for minutes."""
    env = {
        **FAMILY_ENV[family],
        **KV_BLOCKS,
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "KVBRIDGE_TEST_DTYPE": dtype,
    }

    def start(role: str, tp: int) -> Instance:
        if connector == "vllm-nixl":
            config = nixl_config("kv_both")
        else:  # prefill ranks register with rank 0's bootstrap service
            options = {"bootstrap_port": free_port()} if role == "kv_producer" else {}
            config = kvbridge_config(role, "nixl", **options)
        return Instance(
            model,
            config,
            logs / f"{family}-{connector}-{role}-tp{tp}.log",
            env={**env, "KVBRIDGE_TEST_TP": str(tp)},
        )

    results: dict[tuple[int, int], tuple[Outputs, Outputs]] = {}
    for prefill_tp, decode_tp in TP_PAIRS:
        instances: dict[str, Instance] = {}
        try:
            for role, tp in sorted(
                [("kv_producer", prefill_tp), ("kv_consumer", decode_tp)], key=lambda pair: pair[1]
            ):
                instances[role] = start(role, tp)
            prefill, decode = instances["kv_producer"], instances["kv_consumer"]
            free = prefill.call("stats")["free_blocks"]
            prefilled = prefill.generate(PROMPTS, 1, [PREFILL_ONLY] * len(PROMPTS))["outputs"]
            params = [output["kv_transfer_params"] for output in prefilled]
            outputs = [
                decode.generate([p], MAX_TOKENS, [q])["outputs"][0]
                for p, q in zip(PROMPTS, params, strict=True)
            ]
            assert all(output["kv_ready_s"] is not None for output in outputs)
            after = prefill.wait_for(lambda s, free=free: s["free_blocks"] == free)
            assert after["free_blocks"] == free, (connector, prefill_tp, decode_tp)
            for instance in instances.values():
                assert "KV load failed" not in instance.log()
            results[prefill_tp, decode_tp] = (prefilled, outputs)
        finally:
            for instance in instances.values():
                instance.close()
    return results


# Eight instances, four of them at TP 2 (three processes each), start one after another.
@pytest.mark.timeout(900)
def test_mla_between_tp_sizes_feeds_each_decode_rank_from_one_prefill_rank(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """MLA's latent is the same on every TP rank: each decode rank loads it from one prefill
    rank (kvbridge's MLA rule), at TP 1 → 2 and 2 → 1. Every block each decode rank holds
    equals prefill's, byte for byte, and each prompt decoded alone gives NixlConnector's tokens
    at the same TP pair. (Not a plain run's: vLLM's CPU MLA gives this random model other
    tokens at TP 2 than at TP 1 in plain runs, float32 included.)"""
    kvbridge = run_tp_pairs(models["mla"], tmp_path, "mla", "kvbridge")
    nixl = run_tp_pairs(models["mla"], tmp_path, "mla", "vllm-nixl")
    for pair in TP_PAIRS:
        prefilled, outputs = kvbridge[pair]
        assert [o["tokens"] for o in outputs] == [o["tokens"] for o in nixl[pair][1]], pair
        compared = 0
        for sent, received in zip(prefilled, outputs, strict=True):
            # The latent is replicated: every prefill rank's blocks are the same bytes.
            assert all(rank == sent["kv_blocks"] for rank in sent["kv_blocks_by_rank"]), pair
            assert len(received["kv_blocks_by_rank"]) == pair[1]
            for rank in received["kv_blocks_by_rank"]:
                assert rank == sent["kv_blocks"], pair
                compared += len(rank["0"])
        # Blocks of 16: every whole one before each prompt's last token, on each decode rank.
        assert compared == pair[1] * sum((n - 1) // 16 for n in LENGTHS), pair


def test_sliding_window_hybrid_moves_only_the_window(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Gemma-3-shaped: three sliding-window groups and a full-attention group share memory
    (vLLM's hybrid KV cache manager); a full group moves every block, each windowed group
    only the blocks its window still needs."""
    expected = plain_tokens(models["sliding"], tmp_path, "sliding")
    prefilled, outputs, stats = run_pair(models["sliding"], tmp_path, "sliding", "kvbridge")
    assert [o["tokens"] for o in outputs] == expected
    assert assert_blocks_arrived(prefilled, outputs) > 0
    # Blocks of 32: the full group all of a prompt's, each of the three windowed groups the
    # blocks holding its last 64 tokens (at most three).
    full = sum(-(-n // 32) for n in LENGTHS)
    windowed = sum(min(-(-n // 32), 3 if n > 64 else -(-n // 32)) for n in LENGTHS)
    assert stats["connector"]["pages_loaded"] <= full + 3 * windowed
    assert stats["connector"]["pages_loaded"] < 2 * full  # not every group's every block
    assert stats["connector"]["requests_loaded"] == len(PROMPTS)


def test_sliding_window_hybrid_after_a_decode_prefix_hit_skips_inside_the_room(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Decode's prefix cache holds the first 288 tokens of a 300-token prompt (from an
    earlier request: every full-attention block and the windowed blocks before token 288).
    Prefill's room holds each windowed group's window (blocks 7-9); decode needs block 9 of
    every group only, so it skips positions inside the room. Each prompt decoded alone gives
    a plain run's tokens, and every block decode holds equals prefill's."""
    model, family = models["sliding"], "sliding"
    first = PROMPTS[3]
    assert len(first) == 300
    second = first[:288] + prompt(12, 99)
    plain = Instance(model, None, tmp_path / "hit-plain.log", env=FAMILY_ENV[family])
    try:
        expected = [
            plain.generate([request], MAX_TOKENS)["outputs"][0]["tokens"]
            for request in (first, second)
        ]
    finally:
        plain.close()
    environment = {**FAMILY_ENV[family], **KV_BLOCKS}
    prefill = Instance(
        model, kvbridge_config("kv_producer", "nixl"), tmp_path / "hit-p.log", env=environment
    )
    decode = Instance(
        model, kvbridge_config("kv_consumer", "nixl"), tmp_path / "hit-d.log", env=environment
    )
    try:
        loaded: list[int] = []
        for request, want in zip((first, second), expected, strict=True):
            sent = prefill.generate([request], 1, [PREFILL_ONLY])["outputs"]
            got = decode.generate([request], MAX_TOKENS, [sent[0]["kv_transfer_params"]])
            assert got["outputs"][0]["tokens"] == want
            assert assert_blocks_arrived(sent, got["outputs"]) > 0
            loaded.append(decode.call("stats")["connector"]["pages_loaded"])
        connector = decode.call("stats")["connector"]
        assert (connector["requests_loaded"], connector["loads_failed"]) == (2, 0)
        # The second request loads block 9 of each of the four groups, nothing before it.
        assert loaded[1] - loaded[0] == 4
    finally:
        decode.close()
        prefill.close()


def test_mamba_hybrid_moves_the_state_with_the_attention_kv(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Granite-4-hybrid-shaped: each request's Mamba-2 state block moves with its attention
    blocks (pages whole: they share memory); prefill stops one token short so that decode
    computes the last token on the state before it."""
    expected = plain_tokens(models["mamba"], tmp_path, "mamba")
    prefilled, outputs, stats = run_pair(models["mamba"], tmp_path, "mamba", "kvbridge")
    assert [o["tokens"] for o in outputs] == expected
    assert all(
        p["kv_transfer_params"]["remote_num_tokens"] == n - 1
        for p, n in zip(prefilled, LENGTHS, strict=True)
    )
    assert stats["connector"]["requests_loaded"] == len(PROMPTS)
    assert assert_blocks_arrived(prefilled, outputs) >= 0
    # Every unit of each layer's state: 8 heads of x and SSM state, B and C's one group.
    assert assert_states_arrived(prefilled, outputs) == len(PROMPTS) * 2 * (8 + 8 + 1 + 1)


@pytest.mark.timeout(900)
def test_mamba_hybrid_between_tp_sizes_splits_the_state(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """Between TP 1 and 2 the Mamba-2 state splits as vLLM's mixer shards it: x and the SSM
    state by head, B and C by group (this model's one group on both TP 2 ranks). Each prompt
    decoded alone gives a plain run's tokens (float32), and every unit of the state each
    decode rank loaded equals prefill's, byte for byte, as vLLM's own layers view it."""
    expected = plain_tokens(models["mamba"], tmp_path, "mamba", dtype="float32")
    results = run_tp_pairs(models["mamba"], tmp_path, "mamba", "kvbridge", dtype="float32")
    for pair, (prefilled, outputs) in results.items():
        assert [o["tokens"] for o in outputs] == expected, pair
        # Per decode rank, of its 2 layers: its heads of x and SSM state, B and C's group.
        per_rank = 2 * (2 * 8 // pair[1] + 2)
        assert assert_states_arrived(prefilled, outputs) == len(PROMPTS) * pair[1] * per_rank


@pytest.mark.timeout(900)
def test_sliding_window_hybrid_between_tp_sizes_moves_head_slices(
    models: dict[str, Path], tmp_path: Path
) -> None:
    """The sliding-window hybrid's pages keep their attention geometry, so between TP 1 and 2
    each decode rank gets its heads of every block, windowed groups included: each prompt
    decoded alone gives a plain run's tokens (float32: TP 2 sums in another order than TP 1),
    and every head of every block each decode rank holds equals that head of prefill's, byte
    for byte."""
    expected = plain_tokens(models["sliding"], tmp_path, "sliding", dtype="float32")
    results = run_tp_pairs(models["sliding"], tmp_path, "sliding", "kvbridge", dtype="float32")
    for pair, (prefilled, outputs) in results.items():
        assert [o["tokens"] for o in outputs] == expected, pair
        # Each decode rank's heads of the blocks it holds: 4 heads in all, every group.
        assert assert_heads_arrived(prefilled, outputs) >= 4 * sum((n - 1) // 32 for n in LENGTHS)


def assert_heads_arrived(prefilled: Outputs, outputs: Outputs) -> int:
    """Every head of every block each decode rank holds equals that head on the prefill rank
    that holds it, byte for byte; how many were compared."""
    compared = 0
    for sent, received in zip(prefilled, outputs, strict=True):
        theirs: dict[str, dict[str, str]] = {}
        for rank in sent["kv_heads_by_rank"]:
            for group, heads in rank.items():
                theirs.setdefault(group, {}).update(heads)
        for rank in received["kv_heads_by_rank"]:
            for group, heads in rank.items():
                for key, digest in heads.items():
                    assert theirs[group].get(key) == digest, (group, key)
                    compared += 1
    return compared
