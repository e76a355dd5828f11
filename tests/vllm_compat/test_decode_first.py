"""Decode first, inside vLLM: the request goes to the prefill and the decode instance at once;
decode allocates its blocks and asks prefill for them while prefill computes, and prefill's
worker writes each attention layer from `save_kv_layer` as its forward computes it, chunked
prefill included. A decode request that comes after the forward gets the whole-request write.
Tokens equal a plain run either way; through `vllm serve` and `kvbridge vllm-proxy
--prefill-bootstrap` as users deploy it."""

from __future__ import annotations

import importlib.util
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed here (make test runs this in .venv-vllm)", allow_module_level=True
    )

from test_connector import complete_all, data_parallel_prefill_behind_proxy
from test_model_families import (
    KV_BLOCKS,
    assert_blocks_arrived,
    assert_heads_arrived,
    assert_states_arrived,
    plain_tokens,
)
from vllm_harness import (
    FAMILY_ENV,
    LENGTHS,
    MAX_TOKENS,
    PROMPTS,
    Instance,
    Server,
    free_port,
    kvbridge_config,
    make_model,
    prompt,
    stats_lines_at_every_level,
)

from kvbridge.integrations.vllm_proxy import PDProxy
from kvbridge.integrations.vllm_requests import decode_first_request, stream_prefill_request

CHUNKED = {"KVBRIDGE_TEST_MAX_BATCHED_TOKENS": "128"}  # the 300- and 1000-token prompts in chunks


def params(bootstrap_url: str, count: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per prompt, prefill's and decode's kv_transfer_params of one decode-first request."""
    rooms = [secrets.randbits(63) for _ in range(count)]
    return (
        [stream_prefill_request({}, room)["kv_transfer_params"] for room in rooms],
        [decode_first_request({}, bootstrap_url, room)["kv_transfer_params"] for room in rooms],
    )


def decode_first_round(prefill: Instance, decode: Instance, port: int) -> tuple[Any, Any]:
    """Every prompt decode first, decode's requests in before prefill's: prefill's outputs
    and decode's."""
    to_prefill, to_decode = params(f"http://127.0.0.1:{port}", len(PROMPTS))
    decode.call("submit", prompts=PROMPTS, max_tokens=MAX_TOKENS, params=to_decode)
    time.sleep(2.0)  # its requests reach prefill first
    prefilled = prefill.generate(PROMPTS, 1, to_prefill)["outputs"]
    return prefilled, decode.call("collect")["outputs"]


def counters(instance: Instance) -> dict[str, int]:
    return dict(instance.call("stats")["connector"])


def test_decode_first_writes_each_layer_during_the_forward_and_falls_back_when_late(
    model: Path, tmp_path: Path, reference: dict[Any, Any]
) -> None:
    port = free_port()
    bootstrap = f"http://127.0.0.1:{port}"
    prefill = Instance(
        model,
        kvbridge_config("kv_producer", "nixl", bootstrap_port=port),
        tmp_path / "prefill.log",
        env=CHUNKED,
    )
    try:
        decode = Instance(model, kvbridge_config("kv_consumer", "nixl"), tmp_path / "decode.log")
        try:
            # Decode asks first, then prefill computes: each layer goes out as it is saved.
            to_prefill, to_decode = params(bootstrap, len(PROMPTS))
            decode.call("submit", prompts=PROMPTS, max_tokens=MAX_TOKENS, params=to_decode)
            time.sleep(2.0)  # its requests reach prefill (registration, engine connection) first
            prefill.generate(PROMPTS, 1, to_prefill)
            outputs = decode.call("collect")["outputs"]
            assert [o["tokens"] for o in outputs] == [reference[tuple(p)] for p in PROMPTS]
            streamed = prefill.wait_for(lambda s: s["connector"]["requests_sent"] == 5)
            assert streamed["connector"]["requests_sent"] == len(PROMPTS)
            # At least a range per layer of the forward: 2 layers, every prompt, the long ones
            # in several chunks.
            assert streamed["connector"]["layer_writes"] >= 2 * len(PROMPTS)
            assert counters(decode)["requests_loaded"] == len(PROMPTS)
            # Decode asks only after prefill's forward: the whole-request write, no layer.
            before = streamed["connector"]["layer_writes"]
            to_prefill, to_decode = params(bootstrap, len(PROMPTS))
            prefill.generate(PROMPTS, 1, to_prefill)
            late = decode.generate(PROMPTS, MAX_TOKENS, to_decode)["outputs"]
            assert [o["tokens"] for o in late] == [reference[tuple(p)] for p in PROMPTS]
            after = prefill.wait_for(lambda s: s["connector"]["requests_sent"] == 10)
            assert after["connector"]["requests_sent"] == 2 * len(PROMPTS)
            assert after["connector"]["layer_writes"] == before
            assert "KV load failed" not in decode.log()
        finally:
            decode.close()
    finally:
        prefill.close()


QUEUED_TIMEOUT_S = 2.0


def test_a_request_queued_on_prefill_past_its_request_timeout_is_still_streamed(
    model: Path, tmp_path: Path, reference: dict[Any, Any]
) -> None:
    """Decode's request reaches prefill while prefill's one sequence slot runs another
    request: the room waits for prefill's scheduler three request timeouts long, decode renewing
    it, and is then written; no load fails."""
    port = free_port()
    prefill = Instance(
        model,
        kvbridge_config(
            "kv_producer", "nixl", bootstrap_port=port, request_timeout_s=QUEUED_TIMEOUT_S
        ),
        tmp_path / "prefill.log",
        env={"KVBRIDGE_TEST_MAX_NUM_SEQS": "1"},
    )
    try:
        decode = Instance(model, kvbridge_config("kv_consumer", "nixl"), tmp_path / "decode.log")
        try:
            (to_prefill,), (to_decode,) = params(f"http://127.0.0.1:{port}", 1)
            chosen, blocker = PROMPTS[3], prompt(50, seed=3)
            prefill.call(
                "submit", prompts=[blocker, chosen], max_tokens=[4000, 1], params=[None, to_prefill]
            )
            decode.call("submit", prompts=[chosen], max_tokens=MAX_TOKENS, params=[to_decode])
            time.sleep(3 * QUEUED_TIMEOUT_S)
            assert counters(decode)["loads_failed"] == 0
            prefill.call("abort", indices=[0])  # the queued request runs now
            (loaded,) = decode.call("collect")["outputs"]
            assert loaded["tokens"] == reference[tuple(chosen)]
            assert loaded["kv_ready_s"] > 3 * QUEUED_TIMEOUT_S  # it did wait that long
            final = counters(decode)
            assert (final["requests_loaded"], final["loads_failed"]) == (1, 0)
            assert "not given this room" not in prefill.log()
            # Streamed, layer by layer, as decode's request was in when it ran.
            sent = prefill.wait_for(lambda s: s["connector"]["requests_sent"] >= 1)
            assert sent["connector"]["layer_writes"] > 0
        finally:
            decode.close()
    finally:
        prefill.close()


def test_through_vllm_serve_and_the_proxy_in_decode_first_mode(
    model: Path, tmp_path: Path, reference: dict[Any, Any]
) -> None:
    port = free_port()
    prefill = Server(
        model,
        kvbridge_config("kv_producer", "nixl", bootstrap_port=port),
        tmp_path / "p.log",
        environment=stats_lines_at_every_level(tmp_path),
        # Long prompts in many chunks: decode's request tends to come while prefill computes.
        arguments=(
            "--skip-tokenizer-init",
            "--max-num-batched-tokens",
            "64",
            "--max-num-seqs",
            "8",
        ),
    )
    try:
        decode = Server(model, kvbridge_config("kv_consumer", "nixl"), tmp_path / "d.log")
        try:
            proxy = PDProxy(
                [prefill.url], [decode.url], prefill_bootstrap=[f"http://127.0.0.1:{port}"]
            )
            threading.Thread(target=proxy.serve_forever, daemon=True).start()
            try:
                # Whether decode asks before prefill's forward ends (layer by layer) or after
                # it (the whole request) is a race here; either way the tokens are the plain
                # run's. (test_decode_first_writes_each_layer_... counts the layers.)
                tokens = complete_all(proxy.url, model, PROMPTS)
            finally:
                proxy.shutdown()
            assert tokens == [reference[tuple(p)] for p in PROMPTS]
            assert "KV load failed" not in decode.log(tail=None)
        finally:
            decode.close()
    finally:
        prefill.close()


def test_decode_first_with_a_data_parallel_prefill_through_the_proxy(
    model: Path, tmp_path: Path, reference: dict[Any, Any]
) -> None:
    """`vllm serve --data-parallel-size 2` for prefill behind `kvbridge vllm-proxy
    --prefill-bootstrap URL --prefill-data-parallel-size 2`: the proxy sends each request to
    one DP rank (vLLM's X-data-parallel-rank) and decode asks that rank's bootstrap service,
    at the same time; tokens equal a plain run's. A request sent to the other rank than the
    one decode asks would leave both rooms waiting for the other side until the request
    timeout (60 s here): decode's load would fail."""
    port = free_port()
    with data_parallel_prefill_behind_proxy(
        model, tmp_path, port, prefill_bootstrap=[f"http://127.0.0.1:{port}"], prefill_dp_size=2
    ) as (prefill, decode, proxy):
        prompts = PROMPTS * 2
        assert complete_all(proxy.url, model, prompts) == [reference[tuple(p)] for p in prompts]
        assert "KV load failed" not in decode.log(tail=None)
        log = prefill.log(tail=None)
        for rank in (0, 1):
            assert f"bootstrap http://127.0.0.1:{port + rank}" in log, log[-3000:]


def test_mla_decode_first_writes_the_latent_layer_by_layer_byte_exact(tmp_path: Path) -> None:
    """A DeepSeek-V2-shaped MLA model (one latent KV cache group, vLLM's CPU MLA with blocks
    of 16): decode asks first and each layer's latent goes out during prefill's chunked
    forward; every whole block decode holds equals prefill's, byte for byte. (Tokens: MLA's
    CPU decode of the random model has near ties that batching flips, see
    test_model_families.py.)"""
    model = make_model(tmp_path / "mla", family="mla")
    port = free_port()
    bootstrap = f"http://127.0.0.1:{port}"
    env = {**FAMILY_ENV["mla"], **KV_BLOCKS}
    prefill = Instance(
        model,
        kvbridge_config("kv_producer", "nixl", bootstrap_port=port),
        tmp_path / "mla-prefill.log",
        env={**env, **CHUNKED},
    )
    try:
        decode = Instance(
            model, kvbridge_config("kv_consumer", "nixl"), tmp_path / "mla-d.log", env=env
        )
        try:
            to_prefill, to_decode = params(bootstrap, len(PROMPTS))
            decode.call("submit", prompts=PROMPTS, max_tokens=MAX_TOKENS, params=to_decode)
            time.sleep(2.0)  # its requests reach prefill first
            prefilled = prefill.generate(PROMPTS, 1, to_prefill)["outputs"]
            outputs = decode.call("collect")["outputs"]
            assert assert_blocks_arrived(prefilled, outputs) == sum((n - 1) // 16 for n in LENGTHS)
            streamed = prefill.wait_for(lambda s: s["connector"]["requests_sent"] == len(PROMPTS))
            assert streamed["connector"]["layer_writes"] >= 2 * len(PROMPTS)
            assert counters(decode)["requests_loaded"] == len(PROMPTS)
            assert "KV load failed" not in decode.log()
        finally:
            decode.close()
    finally:
        prefill.close()


@pytest.mark.parametrize("family", ["sliding", "mamba"])
def test_a_hybrid_decode_first_gets_every_group_into_the_proxys_room(
    family: str, tmp_path: Path
) -> None:
    """Hybrids (Gemma-3-shaped: sliding-window groups before a full one; Granite-4-hybrid-
    shaped: a Mamba-2 state) through decode first: decode plans the room before prefill
    computes, every group from block position 0. The full-attention group's layers go out
    during the forward, layer by layer, at their place among the room's pages; the other
    groups after it as the room's last chunks: the Mamba hybrid's state, and the sliding-
    window hybrid's windows (chunked: they drop blocks as the prompt moves on; the dropped
    ones marked and never written). Tokens equal a plain run's; every block (and state
    unit) decode holds equals prefill's. When decode asks only after the forward, every
    group goes whole in one chunk."""
    model = make_model(tmp_path / family, family=family)
    expected = plain_tokens(model, tmp_path, family)
    port = free_port()
    env = {**FAMILY_ENV[family], **KV_BLOCKS}
    prefill = Instance(
        model,
        kvbridge_config("kv_producer", "nixl", bootstrap_port=port),
        tmp_path / f"{family}-p.log",
        env={**env, **CHUNKED},
    )
    try:
        decode = Instance(
            model, kvbridge_config("kv_consumer", "nixl"), tmp_path / f"{family}-d.log", env=env
        )
        try:
            prefilled, outputs = decode_first_round(prefill, decode, port)
            assert [o["tokens"] for o in outputs] == expected
            assert assert_blocks_arrived(prefilled, outputs) > 0
            if family == "mamba":  # each layer's state: 8 heads of x and SSM, B and C's group
                assert assert_states_arrived(prefilled, outputs) == len(PROMPTS) * 2 * 18
            connector = counters(decode)
            assert (connector["requests_loaded"], connector["loads_failed"]) == (len(PROMPTS), 0)
            assert "KV load failed" not in decode.log()
            sent = prefill.wait_for(lambda s: s["connector"]["requests_sent"] == len(PROMPTS))
            layer_writes = sent["connector"]["layer_writes"]
            # A range per full-attention layer of each prompt (the sliding hybrid's chunks
            # each stream theirs).
            assert layer_writes >= len(PROMPTS)
            # Decode asks only after prefill's forward: every group whole.
            to_prefill, to_decode = params(f"http://127.0.0.1:{port}", len(PROMPTS))
            prefilled = prefill.generate(PROMPTS, 1, to_prefill)["outputs"]
            late = decode.generate(PROMPTS, MAX_TOKENS, to_decode)["outputs"]
            assert [o["tokens"] for o in late] == expected
            assert assert_blocks_arrived(prefilled, late) > 0
            after = prefill.wait_for(lambda s: s["connector"]["requests_sent"] == 2 * len(PROMPTS))
            assert after["connector"]["layer_writes"] == layer_writes
            assert counters(decode)["loads_failed"] == 0
        finally:
            decode.close()
    finally:
        prefill.close()


@pytest.mark.timeout(900)
def test_two_prefill_ranks_stream_their_heads_of_a_sliding_window_hybrid_into_one_decode_rank(
    tmp_path: Path,
) -> None:
    """Decode first between TP sizes: a prefill instance at TP 2 streams each rank's heads of
    the full-attention layers during its forward, at their place among the room's pages, and
    the windows after it, into a decode instance at TP 1. Tokens equal a plain run's
    (float32: TP 2 sums in another order than TP 1), and every head of every block decode
    holds equals that head of prefill's, byte for byte."""
    family = "sliding"
    model = make_model(tmp_path / family, family=family)
    expected = plain_tokens(model, tmp_path, family, dtype="float32")
    port = free_port()
    env = {
        **FAMILY_ENV[family],
        **KV_BLOCKS,
        "KVBRIDGE_TEST_DTYPE": "float32",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    }
    decode = Instance(
        model, kvbridge_config("kv_consumer", "nixl"), tmp_path / "decode.log", env=env
    )
    try:
        prefill = Instance(
            model,
            kvbridge_config("kv_producer", "nixl", bootstrap_port=port),
            tmp_path / "prefill.log",
            env={**env, "KVBRIDGE_TEST_TP": "2"},
        )
        try:
            prefilled, outputs = decode_first_round(prefill, decode, port)
            assert [o["tokens"] for o in outputs] == expected
            assert assert_heads_arrived(prefilled, outputs) >= 4 * sum(
                (n - 1) // 32 for n in LENGTHS
            )
            # Summed over prefill's two ranks: each sends its heads of every request, by layer.
            every = 2 * len(PROMPTS)
            sent = prefill.wait_for(lambda s: s["connector"]["requests_sent"] == every)
            assert sent["connector"]["layer_writes"] >= every
            assert counters(decode)["loads_failed"] == 0
        finally:
            prefill.close()
    finally:
        decode.close()
