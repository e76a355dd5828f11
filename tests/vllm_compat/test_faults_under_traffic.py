"""Faults while traffic flows: a prefill and a decode `vllm serve` with kvbridge, kvbridge's PD
proxy in front and clients sending requests all along, then a prefill instance killed (-9)
or hung (SIGSTOP), a decode instance killed or hung, and the network between them cut. Every
request ends — with the plain run's tokens (decode recomputes a failed load: policy
`recompute`) or with an error naming the instance — well within the liveness and proxy
timeouts, none hangs, the surviving instance keeps serving, and once the instance is back
(restarted on its address, continued, the link up) KV moves again without restarting the
other.

The prefill instance runs in a network namespace of its own linked to this one (another
host, as far as the network goes) where the machine allows it (root, iproute2); elsewhere
both run on loopback and the cut is skipped."""

from __future__ import annotations

import http.client
import importlib.util
import json
import signal
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed here (make test runs this in .venv-vllm)", allow_module_level=True
    )

from vllm_harness import (
    KVBridgeProxy,
    Server,
    free_port,
    kvbridge_config,
    make_model,
    metric,
    prompt,
)

from kvbridge_tools import netns

PEER_TIMEOUT_S = 2.0  # kvbridge's liveness: a silent peer is dead after this
LEASE_S = 4.0  # prefill's lease on blocks no decode asks for
PROXY_TIMEOUT_S = 10.0  # the proxy's wait for a byte from a hung instance
OUTAGE_S = 3 * PEER_TIMEOUT_S  # how long a hang or a cut lasts
# The longest a request may take: a proxy timeout, a load failed by liveness then recomputed,
# and the generation itself on a busy 2-core machine (a request takes about 2 s here).
REQUEST_BOUND_S = PROXY_TIMEOUT_S + PEER_TIMEOUT_S + 25.0
CLIENTS = 3
MAX_TOKENS = 64
PROMPTS = [prompt(384 + 32 * index, seed=50 + index) for index in range(6)]


@dataclass
class Outcome:
    index: int  # into PROMPTS
    began: float
    ended: float
    status: int  # 0: no HTTP answer (never through the proxy: it answers every request)
    tokens: list[int] | None = None
    error: str = ""
    params: dict[str, Any] | None = None  # the answer's kv_transfer_params


def ask(
    url: str,
    model: Path,
    index: int,
    params: dict[str, Any] | None = None,
    max_tokens: int = MAX_TOKENS,
    request_id: str | None = None,
    timeout_s: float = 120.0,
) -> Outcome:
    """One greedy completion of PROMPTS[index] (with `kv_transfer_params` and vLLM's request
    id if given); whatever happens, an Outcome."""
    host, port = url.removeprefix("http://").split(":")
    body = {
        "model": str(model),
        "prompt": PROMPTS[index],
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **({"kv_transfer_params": params} if params else {}),
    }
    began = time.monotonic()
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        headers = {
            "Content-Type": "application/json",
            **({"X-Request-Id": request_id} if request_id else {}),
        }
        connection.request("POST", "/v1/completions", json.dumps(body).encode(), headers)
        response = connection.getresponse()
        data = response.read()
    except (OSError, http.client.HTTPException) as exc:
        return Outcome(index, began, time.monotonic(), 0, error=repr(exc))
    finally:
        connection.close()
    ended = time.monotonic()
    if response.status != 200:
        return Outcome(index, began, ended, response.status, error=data.decode(errors="replace"))
    answer = json.loads(data)
    return Outcome(
        index,
        began,
        ended,
        200,
        tokens=answer["choices"][0]["token_ids"],
        params=answer.get("kv_transfer_params"),
    )


@dataclass
class Traffic:
    """CLIENTS clients sending PROMPTS in turn through the proxy until stopped."""

    url: str
    model: Path
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        for client in range(CLIENTS):
            thread = threading.Thread(target=self._client, args=(client,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _client(self, client: int) -> None:
        turn = client
        while not self._stop.is_set():
            outcome = ask(self.url, self.model, turn % len(PROMPTS))
            turn += CLIENTS
            with self._lock:
                self.outcomes.append(outcome)
            if outcome.status != 200:
                time.sleep(0.2)  # an instance away answers at once: no busy loop

    def succeeded_since(self, moment: float) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.status == 200 and o.began >= moment)

    def wait_for_successes(self, count: int, since: float, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.succeeded_since(since) < count:
            assert time.monotonic() < deadline, f"fewer than {count} answers: {self.failures()}"
            time.sleep(0.2)

    def failures(self) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.status != 200]

    def stop(self) -> None:
        """Stop sending; every request out ends within REQUEST_BOUND_S or the test fails."""
        self._stop.set()
        deadline = time.monotonic() + REQUEST_BOUND_S
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = sum(thread.is_alive() for thread in self._threads)
        assert hung == 0, f"{hung} request(s) still out {REQUEST_BOUND_S:g} s after the stop"


@dataclass
class Deployment:
    """The instances under test (replaced as they are restarted) and the plain run's tokens
    for each prompt."""

    model: Path
    logs: Path
    away: netns.HostAway | None
    kept: set[int]  # the servers' processes, kept over the tests (conftest's leak check)
    started: list[int] = field(default_factory=list)  # which of them this deployment started
    bootstrap_port: int = field(default_factory=free_port)  # prefill's, kept over restarts
    reference: dict[int, list[int]] = field(default_factory=dict)
    prefill: Server = field(init=False)
    decode: Server = field(init=False)
    proxy: KVBridgeProxy = field(init=False)
    restarts: int = 0

    @property
    def prefill_host(self) -> str:
        return self.away.ip if self.away else "127.0.0.1"

    def start_prefill(self, port: int | None = None) -> Server:
        self.restarts += 1
        transfer = kvbridge_config(
            "kv_producer",
            "nixl",
            host=self.prefill_host,
            bootstrap_port=self.bootstrap_port,
            request_timeout_s=LEASE_S,
            peer_timeout_s=PEER_TIMEOUT_S,
        )
        return self._kept(
            Server(
                self.model,
                transfer,
                self.logs / f"prefill-{self.restarts}.log",
                host=self.prefill_host,
                port=port,
                namespace=self.away.namespace if self.away else None,
            )
        )

    def start_decode(self, port: int | None = None) -> Server:
        self.restarts += 1
        host = self.away.local_ip if self.away else "127.0.0.1"
        transfer = kvbridge_config(
            "kv_consumer", "nixl", "recompute", host=host, peer_timeout_s=PEER_TIMEOUT_S
        )
        # No prefix cache on decode: every request loads all its blocks, repeats included.
        arguments = ("--skip-tokenizer-init", "--no-enable-prefix-caching")
        return self._kept(
            Server(
                self.model,
                transfer,
                self.logs / f"decode-{self.restarts}.log",
                port=port,
                arguments=arguments,
            )
        )

    def _kept(self, server: Server) -> Server:
        self.kept.add(server.process.pid)
        self.started.append(server.process.pid)
        return server

    def scrape(self, server: Server) -> str:
        return str(urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode())

    def loads(self) -> float:
        return metric(
            self.scrape(self.decode), "vllm:kvbridge_requests_transferred_total", 'side="load"'
        )

    def failed_loads(self) -> float:
        return metric(
            self.scrape(self.decode), "vllm:kvbridge_num_failed_transfers_total", 'side="load"'
        )


class CaughtLoad:
    """A load certainly in flight when a fault strikes prefill or the link: PROMPTS[index]
    prefilled before the fault (`prepare`), then sent to decode under a request id of its own
    once prefill is hung or cut off (`send`), as the proxy would: decode's load waits on a
    prefill it cannot yet know is gone (that takes the peer timeout). `check`: decode's log
    says this request's load failed, and it ended with the plain run's tokens (recomputed)."""

    def __init__(self, deployment: Deployment, index: int = 2) -> None:
        self.deployment = deployment
        self.index = index
        self.request_id = f"caught-{uuid.uuid4().hex}"
        self.outcomes: list[Outcome] = []
        self.params: dict[str, Any] = {}
        self.client: threading.Thread | None = None

    def prepare(self) -> None:
        d = self.deployment
        prefilled = ask(d.prefill.url, d.model, self.index, {"do_remote_decode": True}, 1)
        assert prefilled.status == 200, prefilled
        assert prefilled.params, prefilled
        self.params = prefilled.params

    def send(self) -> None:
        d = self.deployment
        self.client = threading.Thread(
            target=lambda: self.outcomes.append(
                ask(
                    d.decode.url,
                    d.model,
                    self.index,
                    self.params,
                    request_id=self.request_id,
                )
            ),
            daemon=True,
        )
        self.client.start()
        time.sleep(PEER_TIMEOUT_S / 4)  # decode has it and asks prefill for the KV

    def check(self) -> None:
        assert self.client is not None
        self.client.join(timeout=REQUEST_BOUND_S)
        assert len(self.outcomes) == 1, "the request was still out"
        assert self.outcomes[0].tokens == self.deployment.reference[self.index], self.outcomes
        failed = [
            line
            for line in self.deployment.decode.log(tail=None).splitlines()
            if self.request_id in line and "KV load failed" in line
        ]
        assert failed, f"no failed load logged for {self.request_id}"


NO_NETNS: list[str] = []  # why the deployment runs on loopback, if it does


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, kept_processes: set[int]
) -> Iterator[Deployment]:
    model = make_model(tmp_path_factory.mktemp("model"))
    logs = tmp_path_factory.mktemp("logs")
    try:
        with netns.host_away() as away:
            yield from _deployment(Deployment(model, logs, away, kept_processes))
    except netns.NetnsUnavailable as exc:
        NO_NETNS.append(str(exc))
        yield from _deployment(Deployment(model, logs, None, kept_processes))


def _deployment(shell: Deployment) -> Iterator[Deployment]:
    model = shell.model
    shell.prefill = shell.start_prefill()
    try:
        shell.decode = shell.start_decode()
        try:
            # The plain run's tokens: decode computing each prompt itself.
            for index in range(len(PROMPTS)):
                plain = ask(shell.decode.url, model, index)
                assert plain.tokens is not None, plain
                shell.reference[index] = plain.tokens
            shell.proxy = KVBridgeProxy(
                [shell.prefill.url],
                [shell.decode.url],
                shell.logs / "proxy.log",
                "--upstream-timeout",
                str(PROXY_TIMEOUT_S),
            )
            try:
                yield shell
            finally:
                shell.proxy.close()
        finally:
            shell.decode.close()
    finally:
        shell.prefill.close()
        shell.kept.difference_update(shell.started)


def under_traffic(
    deployment: Deployment, fault: Callable[[], None], recover: Callable[[], None]
) -> tuple[Traffic, float]:
    """Traffic through the proxy: answers first, then `fault`, then `recover` and answers
    again with KV loaded; every request checked. The fault's moment is returned."""
    traffic = Traffic(deployment.proxy.url, deployment.model)
    traffic.start()
    try:
        traffic.wait_for_successes(CLIENTS, since=0.0)
        at = time.monotonic()
        try:
            fault()
        finally:  # the next test gets a working deployment either way
            recover()
        back = time.monotonic()
        loads_before = deployment.loads()
        traffic.wait_for_successes(2 * CLIENTS, since=back)
        # KV moves again: decode loaded those answers' blocks from prefill.
        assert deployment.loads() > loads_before
    finally:
        traffic.stop()
    for outcome in traffic.outcomes:
        took = outcome.ended - outcome.began
        assert took < REQUEST_BOUND_S, (took, outcome)
        if outcome.status == 200:
            assert outcome.tokens == deployment.reference[outcome.index], outcome
        else:  # refused, cut off or timed out by the proxy, with the instance named
            assert outcome.status in (502, 504), outcome
            named = (deployment.prefill.url, deployment.decode.url)
            assert any(url in outcome.error for url in named), outcome
    report(traffic, at)
    return traffic, at


def report(traffic: Traffic, at: float) -> None:
    """What the fault did to the requests out at that moment (printed: the figures)."""
    caught = [o for o in traffic.outcomes if o.began <= at <= o.ended]
    slowest = max((o.ended - at for o in caught), default=0.0)
    print(
        f"{len(traffic.outcomes)} requests, {len(traffic.failures())} ended with an error; "
        f"{len(caught)} out at the fault, the last ended {slowest:.1f} s after it"
    )
    for failure in traffic.failures():
        print(
            f"  {failure.began - at:+.1f} s to {failure.ended - at:+.1f} s: "
            f"{failure.status} {failure.error[:300]}"
        )


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.2)


def test_a_prefill_hung_past_the_proxys_timeout_then_continued(deployment: Deployment) -> None:
    hang_prefill(deployment)


def hang_prefill(deployment: Deployment) -> None:
    """Prefill hung longer than the proxy waits: a load decode had begun fails and is
    recomputed (CaughtLoad), and a request sent through the proxy once prefill is hung ends
    with 504 when the proxy gives up on it. (The traffic's own requests may all miss the hang's
    long part: which of them meet it depends on this machine's pace.)"""
    caught = CaughtLoad(deployment)
    held: list[Outcome] = []

    def hang() -> None:
        caught.prepare()
        deployment.prefill.signal(signal.SIGSTOP)
        caught.send()
        sender = threading.Thread(
            target=lambda: held.append(ask(deployment.proxy.url, deployment.model, 0)),
            daemon=True,
        )
        sender.start()
        sender.join(timeout=PROXY_TIMEOUT_S + 20.0)  # prefill resumes once the proxy gave up

    under_traffic(deployment, hang, lambda: deployment.prefill.signal(signal.SIGCONT))
    caught.check()
    silent = f"prefill {deployment.prefill.url} sent nothing for {PROXY_TIMEOUT_S:g} s"
    assert len(held) == 1, "the request held by the hung prefill was still out"
    assert held[0].status == 504, held[0]
    assert silent in held[0].error, held[0]
    took = held[0].ended - held[0].began
    assert PROXY_TIMEOUT_S <= took < PROXY_TIMEOUT_S + 10.0, held[0]


def test_the_network_cut_between_prefill_and_decode_then_back(deployment: Deployment) -> None:
    if deployment.away is None:
        pytest.skip("the cut needs a network namespace: " + "; ".join(NO_NETNS))
    away = deployment.away
    caught = CaughtLoad(deployment)

    def cut() -> None:
        caught.prepare()
        away.cut()
        caught.send()
        time.sleep(OUTAGE_S)

    under_traffic(deployment, cut, away.heal)
    caught.check()


def expired_leases(deployment: Deployment) -> float:
    return metric(deployment.scrape(deployment.prefill), "vllm:kvbridge_num_kv_expired_reqs_total")


def prefill_holds_nothing(deployment: Deployment) -> bool:
    page = deployment.scrape(deployment.prefill)
    return (
        metric(page, "vllm:kvbridge_requests_in_flight", 'side="send"') == 0
        and metric(page, "vllm:kv_cache_usage_perc") == 0
    )


def test_a_decode_killed_and_restarted_on_its_address(deployment: Deployment) -> None:
    expired = expired_leases(deployment)

    def kill() -> None:
        deployment.decode.signal(signal.SIGKILL)
        deployment.decode.close()
        # Requests prefilled for it are never asked for: prefill frees their blocks when
        # their lease ends, and keeps serving (a request it computes whole).
        wait_until(lambda: expired_leases(deployment) > expired, LEASE_S + 10, "a lease ends")
        plain = ask(deployment.prefill.url, deployment.model, 1)
        assert plain.tokens == deployment.reference[1], plain

    def restart() -> None:
        deployment.decode = deployment.start_decode(port=deployment.decode.port)

    traffic, _ = under_traffic(deployment, kill, restart)
    assert any(deployment.decode.url in o.error for o in traffic.failures())
    # With the traffic stopped, every lease ended or was claimed.
    wait_until(lambda: prefill_holds_nothing(deployment), LEASE_S + 10, "prefill holds nothing")


def test_a_decode_hung_then_continued(deployment: Deployment) -> None:
    def hang() -> None:
        deployment.decode.signal(signal.SIGSTOP)
        time.sleep(OUTAGE_S)

    under_traffic(deployment, hang, lambda: deployment.decode.signal(signal.SIGCONT))
    wait_until(lambda: prefill_holds_nothing(deployment), LEASE_S + 10, "prefill holds nothing")


def test_a_prefill_killed_mid_load_and_restarted_on_its_address(deployment: Deployment) -> None:
    caught = CaughtLoad(deployment)

    def kill() -> None:
        caught.prepare()
        deployment.prefill.signal(signal.SIGSTOP)  # hung first: a load waits on it
        caught.send()
        deployment.prefill.signal(signal.SIGKILL)
        deployment.prefill.close()
        caught.check()
        # Decode keeps serving: a request it computes itself.
        assert ask(deployment.decode.url, deployment.model, 0).tokens == deployment.reference[0]

    def restart() -> None:
        deployment.prefill = deployment.start_prefill(port=deployment.prefill.port)

    under_traffic(deployment, kill, restart)
    sent = metric(
        deployment.scrape(deployment.prefill),
        "vllm:kvbridge_requests_transferred_total",
        'side="send"',
    )
    assert sent > 0  # the new prefill instance moved KV to the same decode instance


def test_a_restarted_prefill_hung_then_continued(deployment: Deployment) -> None:
    """The previous test restarted the prefill instance: decode's liveness holds for the new
    one as for the first."""
    hang_prefill(deployment)
