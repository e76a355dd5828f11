"""How long a request's KV lives on the prefill instance, inside vLLM:
- handed to kvbridge as the request finishes: a prefill `LLM` driven by vLLM's offline
  `LLM.generate`, which steps the engine only while outputs are due, sends every request, its
  last one included;
- leased: prefill frees the blocks of a request no decode asks for within the lease, unless
  the decode instance renews it while the request waits in its queue; a decode that dies
  renews nothing."""

from __future__ import annotations

import importlib.util
import signal
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed here (make test runs this in .venv-vllm)", allow_module_level=True
    )

from vllm_harness import Instance, kvbridge_config, make_model, prompt

PREFILL_ONLY = {"do_remote_decode": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("model"))


def test_an_offline_prefill_loop_sends_its_last_request_too(model: Path, tmp_path: Path) -> None:
    prompts = [prompt(100 + 37 * index, seed=index) for index in range(8)]
    prefill = Instance(model, kvbridge_config("kv_producer", "nixl"), tmp_path / "prefill.log")
    # A stranded request would fail its load after 20 s rather than the default 120.
    decode = Instance(
        model,
        kvbridge_config("kv_consumer", "nixl", transfer_timeout_s=20.0),
        tmp_path / "decode.log",
    )
    try:
        prefilled = prefill.call(
            "offline", prompts=prompts, max_tokens=1, params=[PREFILL_ONLY] * len(prompts)
        )["outputs"]
        params = [output["params"] for output in prefilled]
        assert all(p and p.get("kvbridge_room") for p in params)
        # The prefill instance now takes no engine step while decode loads.
        loaded = decode.generate(prompts, 8, params)["outputs"]
        counters = decode.call("stats")["connector"]
        assert counters["loads_failed"] == 0
        assert counters["requests_loaded"] == len(prompts)
        plain = prefill.generate(prompts, 8)["outputs"]
        assert [o["tokens"] for o in loaded] == [o["tokens"] for o in plain]
    finally:
        decode.close()
        prefill.close()


LEASE_S = 2.0


def test_a_decode_renews_the_lease_while_the_request_waits_and_a_dead_one_does_not(
    model: Path, tmp_path: Path
) -> None:
    """Decode runs one request at a time: a long request holds it while a loading one waits,
    three leases long. Prefill keeps that request's blocks (decode renews the lease) and the
    load succeeds; once a decode dies with a request waiting, prefill frees its blocks a
    lease after its last renewal."""
    first, second, blocker = prompt(300, seed=1), prompt(200, seed=2), prompt(50, seed=3)
    prefill = Instance(
        model,
        kvbridge_config("kv_producer", "nixl", request_timeout_s=LEASE_S),
        tmp_path / "prefill.log",
    )
    decode = Instance(
        model,
        kvbridge_config("kv_consumer", "nixl"),
        tmp_path / "decode.log",
        env={"KVBRIDGE_TEST_MAX_NUM_SEQS": "1"},
    )
    try:
        free = prefill.call("stats")["free_blocks"]
        plain = prefill.generate([first], 8)["outputs"][0]["tokens"]
        (sent,) = prefill.generate([first], 1, [PREFILL_ONLY])["outputs"]
        # The blocker runs (thousands of tokens); the load waits behind it for 3 leases.
        decode.call(
            "submit",
            prompts=[blocker, first],
            max_tokens=[4000, 8],
            params=[None, sent["kv_transfer_params"]],
        )
        time.sleep(3 * LEASE_S)
        held = prefill.call("stats")
        assert held["connector"]["sends_failed"] == 0
        assert held["free_blocks"] < free
        decode.call("abort", indices=[0])
        (loaded,) = decode.call("collect", indices=[1])["outputs"]
        assert loaded["tokens"] == plain
        assert loaded["kv_ready_s"] > 3 * LEASE_S  # it did wait past three leases
        counters = decode.call("stats")["connector"]
        assert (counters["requests_loaded"], counters["loads_failed"]) == (1, 0)
        # A decode that dies while a request waits renews nothing more.
        (sent,) = prefill.generate([second], 1, [PREFILL_ONLY])["outputs"]
        decode.call(
            "submit",
            prompts=[blocker, second],
            max_tokens=[4000, 8],
            params=[None, sent["kv_transfer_params"]],
        )
        time.sleep(LEASE_S)
        decode.signal(signal.SIGKILL)
        after = prefill.wait_for(lambda s: s["connector"]["sends_expired"] == 1, timeout_s=30)
        assert after["connector"]["sends_expired"] == 1
        assert "since decode's last lease renewal" in prefill.log()
        freed = prefill.wait_for(lambda s: s["free_blocks"] == free)
        assert freed["free_blocks"] == free
    finally:
        decode.close()
        prefill.close()
