"""The bootstrap service over real HTTP: 503 until the group is complete, 409 on conflicts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, replace

import pytest
from kv_cache import rank_cache
from processes import interruptible
from real_engine import ENGINE, require_engine

from kvbridge.config import ManagerConfig
from kvbridge.control.bootstrap import (
    BootstrapError,
    BootstrapServer,
    PrefillRank,
    lookup_prefill_group,
    register_prefill,
)
from kvbridge.prefill import PrefillManager
from kvbridge.wire.native import VERSION


@pytest.fixture
def server() -> Iterator[BootstrapServer]:
    service = BootstrapServer().start()
    yield service
    service.close()


def call(url: str, method: str = "GET", body: bytes | None = None) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def rank(index: int, size: int = 2, port: int = 17000) -> PrefillRank:
    return PrefillRank(index, size, "127.0.0.1", port + index, "nixl")


def test_lookups_wait_for_the_whole_group(server: BootstrapServer) -> None:
    assert call(f"{server.url}/health")[0] == 503
    register_prefill(server.url, rank(1))
    status, document = call(f"{server.url}/prefill")
    assert (status, document) == (503, {"registered": 1, "expected": 2})
    with pytest.raises(BootstrapError, match=r"not complete after 0\.2 s"):
        lookup_prefill_group(server.url, timeout_s=0.2)
    register_prefill(server.url, rank(0))
    assert call(f"{server.url}/health")[0] == 200
    assert lookup_prefill_group(server.url) == [rank(0), rank(1)]


def test_conflicts_are_refused_not_overwritten(server: BootstrapServer) -> None:
    register_prefill(server.url, rank(0))
    register_prefill(server.url, rank(0))  # the same registration again is fine
    with pytest.raises(BootstrapError, match=r"409.*already registered"):
        register_prefill(server.url, rank(0, port=18000))
    with pytest.raises(BootstrapError, match=r"409.*attn_tp_size 2, this rank says 4"):
        register_prefill(server.url, rank(1, size=4))
    assert call(f"{server.url}/prefill")[1] == {"registered": 1, "expected": 2}


def test_a_prefill_rank_of_another_protocol_version_is_refused(server: BootstrapServer) -> None:
    other = replace(rank(1), version="kvbridge/1.5")
    began = time.monotonic()
    with pytest.raises(BootstrapError, match=f"400.*speaks kvbridge/1.5, this side {VERSION}"):
        register_prefill(server.url, other, timeout_s=30.0, wait_out_conflicts=True)
    assert time.monotonic() - began < 5.0  # refused at once, not waited out like a conflict
    # A service of another release that holds it: decode's look-up refuses the group.
    register_prefill(server.url, rank(0))
    assert server.service.group.register(other, time.monotonic()) is None
    with pytest.raises(BootstrapError, match=f"speaks kvbridge/1.5, this side {VERSION}: run"):
        lookup_prefill_group(server.url, timeout_s=5.0)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"not json", "Expecting value"),
        (json.dumps({"rank": 0}).encode(), "expected the fields"),
        (json.dumps({**asdict(rank(0)), "rank": "0"}).encode(), "rank must be a int"),
        (json.dumps({**asdict(rank(0)), "rank": 5}).encode(), "outside attn_tp_size"),
        (json.dumps({**asdict(rank(0)), "port": 70000}).encode(), "not a TCP port"),
        (
            json.dumps({k: v for k, v in asdict(rank(0)).items() if k != "version"}).encode(),
            f"names no protocol version: it runs a kvbridge older than {VERSION}",
        ),
    ],
)
def test_bad_registrations_get_400(server: BootstrapServer, body: bytes, match: str) -> None:
    status, document = call(f"{server.url}/prefill", "PUT", body)
    assert status == 400
    assert match in str(document["error"])
    assert call(f"{server.url}/health")[0] == 503  # and the service still serves


def test_unknown_route(server: BootstrapServer) -> None:
    assert call(f"{server.url}/nope")[0] == 404


def test_standalone_command() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "bootstrap", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    try:
        assert process.stdout is not None
        url = process.stdout.readline().split()[-1]
        deadline = time.monotonic() + 10
        while True:
            try:
                assert call(f"{url}/health")[0] == 503
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(10) == 0


def test_registration_needs_the_token_when_a_secret_is_set() -> None:
    service = BootstrapServer(secret=b"s").start()
    try:
        status, document = call(
            f"{service.url}/prefill", "PUT", json.dumps(asdict(rank(0))).encode()
        )
        assert status == 401
        assert "token" in str(document["error"])
        with pytest.raises(BootstrapError, match="401"):
            register_prefill(service.url, rank(0), secret=b"wrong")
        register_prefill(service.url, rank(0), secret=b"s")
        register_prefill(service.url, rank(1), secret=b"s")
        assert call(f"{service.url}/health")[0] == 401  # every route needs the token
        assert lookup_prefill_group(service.url, secret=b"s") == [rank(0), rank(1)]
    finally:
        service.close()


def test_a_prefill_manager_that_cannot_register_leaves_nothing_running() -> None:
    require_engine()
    service = BootstrapServer(secret=b"s").start()
    try:
        cache = rank_cache()
        config = ManagerConfig(engine=ENGINE, bootstrap_url=service.url, secret=b"wrong")
        with pytest.raises(BootstrapError, match="401"):
            PrefillManager(cache.args, config)
        # (the suite's leak check verifies that its threads and the engine's sockets are gone)
    finally:
        service.close()
