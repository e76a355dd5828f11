"""kvbridge's KV connector inside a real vLLM (0.32's CPU build, in .venv-vllm, which
`make test` builds): prefill and decode instances as separate processes, loaded through
``kv_connector_module_path``, against a plain single-instance run of the same model. In
kvbridge's own environment, where vLLM is not installed, this module is skipped.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import math
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed here (make test runs this in .venv-vllm)", allow_module_level=True
    )

from vllm_harness import (
    BLOCK_SIZE,
    MAX_TOKENS,
    PROMPTS,
    SHARED_PREFIX,
    Instance,
    InstanceError,
    Server,
    ToyProxy,
    free_port,
    kvbridge_config,
    metric,
    nixl_config,
    stats_lines_at_every_level,
)

from kvbridge.integrations.vllm_proxy import PDProxy
from kvbridge.wire.native import VERSION

PREFILL_ONLY = {"do_remote_decode": True}
ENGINES = ["nixl", "mooncake"]


def pages(length: int) -> int:
    return math.ceil(length / BLOCK_SIZE)


class Pair:
    """A prefill and a decode instance with kvbridge (or, with engine "vllm-nixl", vLLM's own
    NixlConnector, through the same harness)."""

    def __init__(self, model: Path, logs: Path, engine: str, **options: Any) -> None:
        self.engine = engine

        def config(role: str) -> dict[str, Any]:
            if engine == "vllm-nixl":
                return nixl_config("kv_both")
            return kvbridge_config(role, engine, **options)

        self.prefill = Instance(model, config("kv_producer"), logs / f"prefill-{engine}.log")
        try:
            self.decode = Instance(model, config("kv_consumer"), logs / f"decode-{engine}.log")
        except BaseException:
            self.prefill.close()
            raise
        self.prefill_free = self.prefill.call("stats")["free_blocks"]
        self.decode_free = self.decode.call("stats")["free_blocks"]

    def run(self, prompts: list[list[int]]) -> tuple[list[Any], list[dict[str, Any]]]:
        """Prefill (max_tokens=1), then decode with the prefill outputs' kv_transfer_params,
        as a PD proxy does; the decode outputs and the parameters."""
        prefilled = self.prefill.generate(prompts, 1, [PREFILL_ONLY] * len(prompts))["outputs"]
        params = [output["kv_transfer_params"] for output in prefilled]
        return self.decode.generate(prompts, MAX_TOKENS, params)["outputs"], params

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()


@pytest.fixture(scope="module", params=ENGINES)
def pair(
    request: pytest.FixtureRequest, model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    engine = request.param
    if engine == "mooncake" and importlib.util.find_spec("mooncake") is None:
        pytest.skip("Mooncake is not installed in .venv-vllm (scripts/install-mooncake.sh)")
    pair = Pair(model, tmp_path_factory.mktemp(f"logs-{engine}"), engine)
    yield pair
    pair.close()


def test_decode_tokens_equal_a_plain_run(pair: Pair, reference: dict[Any, Any]) -> None:
    outputs, params = pair.run(PROMPTS)
    assert [output["tokens"] for output in outputs] == [reference[tuple(p)] for p in PROMPTS]
    assert all(
        p["kvbridge_room"] and p["remote_num_tokens"] == len(q)
        for p, q in zip(params, PROMPTS, strict=True)
    )
    decode = pair.decode.call("stats")["connector"]
    assert decode["loads_failed"] == 0
    assert decode["requests_loaded"] == len(PROMPTS)
    assert decode["pages_loaded"] == sum(pages(len(p)) for p in PROMPTS)
    # Prefill frees every block once decode has it; decode holds what its prefix cache keeps.
    prefill = pair.prefill.wait_for(lambda s: s["free_blocks"] == pair.prefill_free)
    assert prefill["free_blocks"] == pair.prefill_free
    assert prefill["connector"]["requests_sent"] == len(PROMPTS)


def test_bad_or_unreachable_parameters_are_computed_locally(
    pair: Pair, reference: dict[Any, Any]
) -> None:
    # A client's kv_transfer_params are input: nothing in them may stop the engine.
    malformed = {
        "do_remote_prefill": True,
        "kvbridge_bootstrap_url": "http://127.0.0.1:1",
        "kvbridge_room": "seven",
        "kvbridge_blocks": [[0, 4]],
        "kvbridge_block_sizes": [32],
        "remote_num_tokens": 97,
        "kvbridge_version": VERSION,
    }
    unreachable = {**malformed, "kvbridge_room": 7}  # nothing listens on port 1
    other_release = {**unreachable, "kvbridge_version": "kvbridge/1.5"}
    began = time.monotonic()
    outputs = pair.decode.generate(
        [PROMPTS[2]] * 3, MAX_TOKENS, [malformed, unreachable, other_release]
    )
    assert time.monotonic() - began < 20  # bootstrap_timeout_s is 5 s
    computed, failed, refused = outputs["outputs"]
    assert computed["tokens"] == reference[tuple(PROMPTS[2])]
    assert failed["finish_reason"] == "error"  # vLLM's default kv_load_failure_policy: fail
    assert refused["tokens"] == reference[tuple(PROMPTS[2])]
    log = pair.decode.log()
    assert "computed locally: kv_transfer_params.kvbridge_room: 'seven' is not an integer" in log
    assert (
        "computed locally: kv_transfer_params: the prefill instance speaks 'kvbridge/1.5', "
        f"this decode instance {VERSION}: run one kvbridge release on both"
    ) in log
    assert "KV load failed: prefill group at http://127.0.0.1:1 not complete after 5 s" in log


def test_vllms_own_nixl_connector_runs_in_the_same_harness(
    model: Path, tmp_path: Path, reference: dict[Any, Any]
) -> None:
    # The comparison with NixlConnector (benchmarks) stands on this: same model, prompts and
    # flow, vLLM's connector in place of kvbridge's.
    pair = Pair(model, tmp_path, "vllm-nixl")
    try:
        outputs, params = pair.run(PROMPTS)
        assert [output["tokens"] for output in outputs] == [reference[tuple(p)] for p in PROMPTS]
        assert all(p["remote_block_ids"] for p in params)
    finally:
        pair.close()


# TP 2 sums its partial products in another order than TP 1: in bf16 that flipped a greedy
# token of this random model (one run, 2026-12-01); in float32 the runs agree.
TP_DTYPE = {"KVBRIDGE_TEST_DTYPE": "float32"}


def tp_instance(model: Path, logs: Path, role: str, tp: int, **options: Any) -> Instance:
    """A kvbridge instance at tensor-parallel size `tp` in float32: one vLLM worker process per
    rank, each running its own kvbridge rank, compute threads bound one core each."""
    env = {**TP_DTYPE, "KVBRIDGE_TEST_TP": str(tp), "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    config = kvbridge_config(role, "nixl", **options)
    return Instance(model, config, logs / f"{role}-tp{tp}.log", env=env)


def test_every_pairing_of_tp_1_and_2_gives_the_plain_runs_tokens(
    model: Path, tmp_path: Path
) -> None:
    """Prefill and decode instances at TP 1 and 2 in every pairing: vLLM's CPU pages move
    whole at equal TP and by head slices between TP 1 and 2 (kvbridge's topology picks each
    decode rank's sources); prefill frees every block once each decode rank has its heads."""
    plain = Instance(model, None, tmp_path / "plain-float32.log", env=TP_DTYPE)
    try:
        expected = [output["tokens"] for output in plain.generate(PROMPTS, MAX_TOKENS)["outputs"]]
    finally:
        plain.close()
    instances: list[Instance] = []
    try:
        prefills, decodes = {}, {}
        for tp in (1, 2):
            prefills[tp] = tp_instance(
                model, tmp_path, "kv_producer", tp, bootstrap_port=free_port()
            )
            instances.append(prefills[tp])
            decodes[tp] = tp_instance(model, tmp_path, "kv_consumer", tp)
            instances.append(decodes[tp])
        free = {tp: prefill.call("stats")["free_blocks"] for tp, prefill in prefills.items()}
        for prefill_tp, decode_tp in [(2, 2), (1, 2), (2, 1), (1, 1)]:
            prefill, decode = prefills[prefill_tp], decodes[decode_tp]
            assert decode.call("reset_prefix_cache")["reset"]  # every block moves again
            prefilled = prefill.generate(PROMPTS, 1, [PREFILL_ONLY] * len(PROMPTS))["outputs"]
            params = [output["kv_transfer_params"] for output in prefilled]
            outputs = decode.generate(PROMPTS, MAX_TOKENS, params)["outputs"]
            tokens = [output["tokens"] for output in outputs]
            assert tokens == expected, (prefill_tp, decode_tp)
            # vLLM's scheduler heard each load end: the KV came from prefill, not computed here.
            assert all(output["kv_ready_s"] is not None for output in outputs)
            after = prefill.wait_for(lambda s, tp=prefill_tp: s["free_blocks"] == free[tp])
            assert after["free_blocks"] == free[prefill_tp], (prefill_tp, decode_tp)
        for instance in instances:
            assert "KV load failed" not in instance.log()
        assert "kvbridge prefill rank 1" in prefills[2].log()  # the second worker's own rank
    finally:
        for instance in reversed(instances):
            instance.close()


def test_only_the_blocks_decode_lacks_move(pair: Pair, reference: dict[Any, Any]) -> None:
    pair.run([PROMPTS[3]])  # decode's prefix cache now holds PROMPTS[3]'s full blocks
    before = pair.decode.call("stats")["connector"]
    outputs, _ = pair.run([SHARED_PREFIX])
    after = pair.decode.call("stats")["connector"]
    assert outputs[0]["tokens"] == reference[tuple(SHARED_PREFIX)]
    assert after["loads_failed"] == before["loads_failed"]
    # 150 tokens: 3 blocks cached locally, 2 move.
    assert after["pages_loaded"] - before["pages_loaded"] == pages(150) - 3
    assert after["requests_loaded"] - before["requests_loaded"] == 1


def test_a_prefill_no_decode_picks_up_frees_its_blocks_after_the_deadline(
    model: Path, tmp_path: Path
) -> None:
    prefill = Instance(
        model, kvbridge_config("kv_producer", "nixl", request_timeout_s=2.0), tmp_path / "p.log"
    )
    try:
        free = prefill.call("stats")["free_blocks"]
        prefill.generate([PROMPTS[4]], 1, [PREFILL_ONLY])
        held = prefill.call("stats")
        assert held["free_blocks"] == free - pages(len(PROMPTS[4]))
        began = time.monotonic()
        after = prefill.wait_for(lambda s: s["free_blocks"] == free, timeout_s=20)
        assert after["free_blocks"] == free
        assert 1.5 < time.monotonic() - began < 10
        assert after["connector"]["sends_failed"] == 1
        assert "0 of any transfer request(s) from decode in 2 s" in prefill.log()
    finally:
        prefill.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_killed_mid_transfer_ends_decode_per_policy(
    model: Path, tmp_path: Path, reference: dict[Any, Any], policy: str
) -> None:
    options = {"peer_timeout_s": 2.0, "policy": policy}
    pair = Pair(model, tmp_path, "nixl", **options)
    try:
        pair.run([PROMPTS[0]])  # both sides know each other: decode's next room is in flight
        prefilled = pair.prefill.generate([PROMPTS[2]], 1, [PREFILL_ONLY])["outputs"]
        pair.prefill.signal(signal.SIGSTOP)  # hung: the request reaches it, nothing moves
        began = time.monotonic()
        pair.decode.call(
            "submit",
            prompts=[PROMPTS[2]],
            max_tokens=MAX_TOKENS,
            params=[prefilled[0]["kv_transfer_params"]],
        )
        time.sleep(0.5)
        pair.prefill.signal(signal.SIGKILL)
        (output,) = pair.decode.call("collect", timeout_s=60)["outputs"]
        elapsed = time.monotonic() - began
        # Declared dead after 2 s of silence, its write lease out 0.5 s later: not minutes.
        assert elapsed < 15, elapsed
        log = pair.decode.log()
        assert "KV load failed" in log, log[-3000:]
        assert "silent for 2.0 s (peer timeout 2 s)" in log
        if policy == "recompute":
            assert output["tokens"] == reference[tuple(PROMPTS[2])]
        else:
            assert output["finish_reason"] == "error", output
    finally:
        pair.close()


def test_a_decode_abort_frees_the_blocks_on_both_sides(model: Path, tmp_path: Path) -> None:
    pair = Pair(model, tmp_path, "nixl")
    try:
        pair.run([PROMPTS[0]])
        prefilled = pair.prefill.generate([PROMPTS[4]], 1, [PREFILL_ONLY])["outputs"]
        pair.prefill.signal(signal.SIGSTOP)  # the request waits in its socket
        pair.decode.call(
            "submit",
            prompts=[PROMPTS[4]],
            max_tokens=MAX_TOKENS,
            params=[prefilled[0]["kv_transfer_params"]],
        )
        time.sleep(0.3)
        assert pair.decode.call("abort")["aborted"] == 1  # the client went away
        time.sleep(0.3)
        pair.prefill.signal(signal.SIGCONT)  # back within its peer timeout: hears the abort
        prefill = pair.prefill.wait_for(lambda s: s["free_blocks"] == pair.prefill_free)
        assert prefill["free_blocks"] == pair.prefill_free
        decode = pair.decode.wait_for(lambda s: s["connector"]["loads_aborted"] == 1)
        assert decode["connector"]["loads_aborted"] == 1
        assert decode["running"] == decode["waiting"] == 0
    finally:
        pair.close()


def complete(url: str, model: Path, prompt_ids: list[int]) -> dict[str, Any]:
    """One OpenAI completion request, greedy, answered with the token ids."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {
        "model": str(model),
        "prompt": prompt_ids,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    try:
        connection.request(
            "POST",
            "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        response = connection.getresponse()
        answer = json.loads(response.read())
        assert response.status == 200, answer
        return dict(answer)
    finally:
        connection.close()


@contextmanager
def behind_proxy(
    prefill: Callable[[], Server], decode: Callable[[], Server], **proxy_options: Any
) -> Iterator[tuple[Server, Server, PDProxy]]:
    """A prefill and a decode server (started in that order) with kvbridge's PD proxy in
    front (`proxy_options`: PDProxy's), all stopped at the end."""
    first = prefill()
    try:
        second = decode()
    except BaseException:
        first.close()
        raise
    proxy = PDProxy([first.url], [second.url], **proxy_options)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        yield first, second, proxy
    finally:
        proxy.shutdown()
        second.close()
        first.close()


def complete_all(url: str, model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens, from as many concurrent clients as prompts."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: complete(url, model, p), prompts))
    return [answer["choices"][0]["token_ids"] for answer in answers]


def test_through_vllm_serve_and_the_pd_proxy(
    model: Path, tmp_path: Path, reference: dict[Any, Any]
) -> None:
    """The way users deploy: two `vllm serve` instances, kvbridge's PD proxy in front, then
    vLLM's own NIXL test proxy; the connector's metrics scraped from vLLM's /metrics."""
    with behind_proxy(
        lambda: Server(model, kvbridge_config("kv_producer", "nixl"), tmp_path / "prefill.log"),
        lambda: Server(
            model,
            kvbridge_config("kv_consumer", "nixl", metrics_port=0),
            tmp_path / "decode.log",
            # vLLM's development endpoints: /reset_prefix_cache
            environment={**stats_lines_at_every_level(tmp_path), "VLLM_SERVER_DEV_MODE": "1"},
        ),
    ) as (prefill, decode, proxy):
        tokens = complete_all(proxy.url, model, PROMPTS)
        assert tokens == [reference[tuple(p)] for p in PROMPTS]
        assert "KV load failed" not in decode.log()
        # kvbridge's Prometheus metrics from inside vLLM, and vLLM's connector stats line.
        found = re.search(r"metrics on (http://[\d.]+:\d+/metrics)", decode.log(tail=None))
        assert found, decode.log()[-3000:]
        scraped = urllib.request.urlopen(found.group(1), timeout=10).read().decode()
        assert "kvbridge_rooms_finished_total{" in scraped
        deadline = time.monotonic() + 10

        def logged() -> int:  # summed over the log intervals
            return sum(map(int, re.findall(r"requests_loaded=(\d+)", decode.log(tail=None))))

        # Every load once, over however many intervals: the stat logger prints every line
        # here (at info level vLLM drops intervals it thinks idle: 0 of 5 loads in a CI run).
        while logged() < len(PROMPTS) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert logged() == len(PROMPTS), decode.log()[-3000:]
        # And on vLLM's own /metrics, beside vLLM's: each side's transfers, durations, bytes,
        # failures by kind, requests in flight.
        loaded = scrape_until(
            decode, "vllm:kvbridge_requests_transferred_total", "load", len(PROMPTS)
        )
        assert metric(loaded, "vllm:kvbridge_load_time_seconds_count") == len(PROMPTS)
        assert "vllm:kvbridge_requests_in_flight{" in loaded
        assert metric(loaded, "vllm:kvbridge_requests_in_flight", 'side="load"') == 0
        assert "vllm:kvbridge_num_failed_transfers_total{" in loaded  # every kind, from 0
        assert metric(loaded, "vllm:kvbridge_num_failed_transfers_total") == 0
        assert "vllm:num_requests_running" in loaded  # vLLM's own, on the same page
        sent = scrape_until(
            prefill, "vllm:kvbridge_requests_transferred_total", "send", len(PROMPTS)
        )
        assert metric(sent, "vllm:kvbridge_xfer_time_seconds_count") >= len(PROMPTS)
        assert metric(sent, "vllm:kvbridge_bytes_transferred_sum") > 0
        assert metric(sent, "vllm:kvbridge_requests_in_flight", 'side="send"') == 0
        # vLLM's own NIXL test proxy, unchanged, in front of the same servers, the same
        # prompts once decode dropped its prefix cache (so that it loads every block again).
        request = urllib.request.Request(decode.url + "/reset_prefix_cache", method="POST")
        assert urllib.request.urlopen(request, timeout=30).status == 200
        toy = ToyProxy(prefill, decode, tmp_path / "toy-proxy.log")
        try:
            assert complete_all(toy.url, model, PROMPTS) == [reference[tuple(p)] for p in PROMPTS]
        finally:
            toy.close()
        total = 2 * len(PROMPTS)
        loaded = scrape_until(decode, "vllm:kvbridge_requests_transferred_total", "load", total)
        assert metric(loaded, "vllm:kvbridge_requests_transferred_total", 'side="load"') == total


def scrape_until(server: Server, name: str, side: str, value: float) -> str:
    """The server's /metrics page once `name` for `side` reached `value` (stats reach vLLM's
    stat loggers with the engine's outputs), or after 20 s."""
    deadline = time.monotonic() + 20
    while True:
        page = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
        if metric(page, name, f'side="{side}"') >= value or time.monotonic() > deadline:
            return page
        time.sleep(0.5)


def test_instances_of_different_block_sizes_are_refused_when_they_meet(
    model: Path, tmp_path: Path, reference: dict[Any, Any]
) -> None:
    """vLLM's CPU pages keep a head's tokens together, so blocks of 32 and 64 tokens cannot
    pair: prefill refuses decode's registration naming both sizes, decode's load fails with
    that reason and (policy recompute) computes the prompt itself: never a wrong token."""
    prefill = Instance(model, kvbridge_config("kv_producer", "nixl"), tmp_path / "p32.log")
    try:
        decode = Instance(
            model,
            kvbridge_config("kv_consumer", "nixl", policy="recompute"),
            tmp_path / "d64.log",
            env={"KVBRIDGE_TEST_BLOCK_SIZE": "64"},
        )
        try:
            prefilled = prefill.generate([PROMPTS[3]], 1, [PREFILL_ONLY])["outputs"]
            params = [prefilled[0]["kv_transfer_params"]]
            (output,) = decode.generate([PROMPTS[3]], MAX_TOKENS, params)["outputs"]
            assert output["tokens"] == reference[tuple(PROMPTS[3])]
            assert "got pages of 32 → 64 tokens" in decode.log(), decode.log()[-3000:]
        finally:
            decode.close()
    finally:
        prefill.close()


def test_a_pipeline_parallel_decode_is_refused_at_start(model: Path, tmp_path: Path) -> None:
    """kvbridge moves a pipeline-parallel prefill's KV (each stage its own rank, bootstrap
    service and rooms, decode loading every stage's layers) to a decode without pipeline
    parallelism; a decode instance with it is refused when vLLM starts. (vLLM 0.32's CPU
    build does not run pipeline parallelism itself: a plain instance at
    pipeline_parallel_size 2 fails its first step in the second stage's worker, `assert
    self.intermediate_tensors is not None`, so the prefill side is not run here.)"""
    env = {"KVBRIDGE_TEST_PP": "2", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with pytest.raises(InstanceError, match="decode instances without pipeline parallelism"):
        Instance(
            model, kvbridge_config("kv_consumer", "nixl"), tmp_path / "decode-pp2.log", env=env
        )


def data_parallel_prefill_behind_proxy(
    model: Path, tmp_path: Path, port: int, **proxy_options: Any
) -> AbstractContextManager[tuple[Server, Server, PDProxy]]:
    """`vllm serve --data-parallel-size 2` for prefill (two engine cores behind one API
    server, each DP rank's bootstrap service at `port` + its index) and a decode server, with
    kvbridge's proxy in front. Three engines on this machine's two cores: liveness, look-ups
    and prefill's lease on a request's blocks get time to spare (these tests check the
    routing; the fault tests check liveness). Both prefill ranks run on core 0 and decode
    unpinned: vLLM steps an engine without pause while its finished requests' KV waits to be
    sent, and with one prefill rank spinning on each core, decode and this process (the
    proxy) got so little CPU that they stalled for up to a minute, until prefill's lease on
    those requests ran out and they failed."""
    patient = {"peer_timeout_s": 10.0, "bootstrap_timeout_s": 30.0, "request_timeout_s": 60.0}
    return behind_proxy(
        lambda: Server(
            model,
            kvbridge_config("kv_producer", "nixl", bootstrap_port=port, **patient),
            tmp_path / "prefill-dp2.log",
            arguments=("--skip-tokenizer-init", "--data-parallel-size", "2"),
            environment={"VLLM_CPU_OMP_THREADS_BIND": "0|0"},
        ),
        lambda: Server(
            model,
            kvbridge_config("kv_consumer", "nixl", **patient),
            tmp_path / "decode.log",
            environment={"VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        ),
        **proxy_options,
    )


def test_a_data_parallel_prefill_serves_each_request_from_its_own_rank(
    model: Path, tmp_path: Path, reference: dict[Any, Any]
) -> None:
    """Each DP rank of a prefill instance runs its own kvbridge bootstrap service at
    bootstrap_port + its DP index, and decode loads each request from the rank that served
    it (named in prefill's answer)."""
    port = free_port()
    with data_parallel_prefill_behind_proxy(model, tmp_path, port) as (prefill, decode, proxy):
        prompts = PROMPTS * 2
        assert complete_all(proxy.url, model, prompts) == [reference[tuple(p)] for p in prompts]
        log = prefill.log(tail=None)
        for rank in (0, 1):
            assert f"bootstrap http://127.0.0.1:{port + rank}" in log, log[-3000:]
        assert "KV load failed" not in decode.log()
