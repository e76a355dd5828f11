"""kvbridge's SGLang bootstrap routes (`kvbridge.control.sglang_routes`) against sglang 0.5.23's
own `CommonKVBootstrapServer`: the registrations kvbridge's prefill ranks send are taken by
sglang's server, and kvbridge's service answers sglang's decode what sglang's server answers
for the same registrations — the group's settings (sglang's `PrefillServerInfo`, its keys
exactly) and each rank's endpoint."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip(
        "sglang is not installed here (tests/sglang_compat runs in .venv-sglang)",
        allow_module_level=True,
    )

import harness

from kvbridge.control.bootstrap import BootstrapServer
from kvbridge.control.sglang_bootstrap import lookup_sglang_group
from kvbridge.control.sglang_routes import (
    SGLangBootstrapService,
    SGLangPrefillRank,
    register_sglang_prefill,
    server_info,
)

SGLANG_SERVER = """
import time
from sglang_import import import_sglang
conn = import_sglang()["sglang.srt.disaggregation.mooncake.conn"]
conn.MooncakeKVBootstrapServer("{host}", {port})
time.sleep(600)
"""
QUERY = "/route?prefill_dp_rank={}&prefill_cp_rank={}&target_tp_rank={}&target_pp_rank={}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def get(address: str, path: str) -> tuple[int, Any]:
    """The status and, for a 200, the JSON answer (sglang's /health answers text)."""
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, None
    return HTTPStatus.OK, json.loads(body) if path.startswith("/route") else None


def ranks(tp: int) -> list[SGLangPrefillRank]:
    return [SGLangPrefillRank(rank, tp, "127.0.0.1", 7000 + rank, 16, "auto") for rank in range(tp)]


def test_the_group_settings_are_sglangs_prefill_server_info() -> None:
    info_class = harness.common_conn.PrefillServerInfo
    ours = server_info(ranks(2)[0])
    # sglang's decode builds the dataclass from the answer: any other key would break it.
    theirs = dataclasses.asdict(info_class(**ours))
    theirs.pop("kv_layout")  # sent only when set, as sglang's server sends it
    theirs.pop("dsv41_spec_layout")
    assert theirs == ours


@contextmanager
def both_services() -> Iterator[tuple[str, str]]:
    """sglang's bootstrap server and kvbridge's SGLang service, side by side: their
    `host:port`s."""
    sglang_address = f"127.0.0.1:{free_port()}"
    host, port = sglang_address.split(":")
    # sglang's server has no way to stop: it runs in a process of its own.
    server = subprocess.Popen(
        [sys.executable, "-c", SGLANG_SERVER.format(host=host, port=port)],
        cwd=Path(__file__).resolve().parent,
    )
    ours = BootstrapServer(service=SGLangBootstrapService()).start()
    try:
        yield sglang_address, ours.url.removeprefix("http://")
    finally:
        ours.close()
        server.kill()
        server.wait()


def test_kvbridges_service_answers_as_sglangs_server_for_the_same_registrations() -> None:
    with both_services() as (sglang_address, kvbridge_address):
        group = ranks(2)
        for address in (sglang_address, kvbridge_address):
            register_sglang_prefill(address, group[0], timeout_s=10)  # waits for it to be up
        for address in (sglang_address, kvbridge_address):
            assert get(address, QUERY.format(-1, -1, -1, -1))[0] == HTTPStatus.SERVICE_UNAVAILABLE
            register_sglang_prefill(address, group[1], timeout_s=10)
        for query in (
            QUERY.format(-1, -1, -1, -1),
            QUERY.format(0, 0, 0, 0),
            QUERY.format(0, 0, 1, 0),
        ):
            assert get(sglang_address, query) == get(kvbridge_address, query)
        for query in (QUERY.format(0, 0, 2, 0), "/route?target_tp_rank=0"):
            assert get(sglang_address, query)[0] == get(kvbridge_address, query)[0]
        assert get(sglang_address, "/health")[0] == get(kvbridge_address, "/health")[0] == 200
        # kvbridge's own decode client reads both alike.
        assert lookup_sglang_group(sglang_address, 5) == dataclasses.replace(
            lookup_sglang_group(kvbridge_address, 5), address=sglang_address
        )


def post(address: str, path: str, document: Any) -> tuple[int, Any]:
    request = urllib.request.Request(
        f"http://{address}{path}",
        data=json.dumps(document).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, None
    return HTTPStatus.OK, json.loads(body) if path == "/query_dp_ranks" else None


def test_an_instance_with_data_parallelism_and_its_rooms_are_answered_as_sglangs_server() -> None:
    # Two DP ranks of attention TP 1 whose rooms are spread by round robin: each registers
    # the rooms it takes (as sglang's sender does) and decode asks for a batch.
    with both_services() as (sglang_address, kvbridge_address):
        group = [
            SGLangPrefillRank(0, 1, "127.0.0.1", 7000 + dp, 16, "auto", dp, 2, False)
            for dp in range(2)
        ]
        for address in (sglang_address, kvbridge_address):
            for rank in group:
                register_sglang_prefill(address, rank, timeout_s=10)
            for room, dp in ((7, 1), (8, 0), (2**62 + 5, 1)):
                body = {"bootstrap_room": room, "dp_rank": dp}
                assert post(address, "/register_dp_rank", body)[0] == HTTPStatus.OK
        for query in (
            QUERY.format(-1, -1, -1, -1),
            QUERY.format(0, 0, 0, 0),
            QUERY.format(1, 0, 0, 0),
        ):
            assert get(sglang_address, query) == get(kvbridge_address, query)
        assert get(kvbridge_address, QUERY.format(-1, -1, -1, -1))[1]["dp_size"] == 2
        assert get(sglang_address, QUERY.format(2, 0, 0, 0))[0] == 404
        assert get(kvbridge_address, QUERY.format(2, 0, 0, 0))[0] == 404
        rooms = {"bootstrap_rooms": [7, 8, 9, 2**62 + 5]}
        theirs = post(sglang_address, "/query_dp_ranks", rooms)
        assert theirs == post(kvbridge_address, "/query_dp_ranks", rooms)
        assert theirs[1] == {"7": 1, "8": 0, str(2**62 + 5): 1}
        # kvbridge's decode reads both alike: every DP rank's ranks, not following rooms.
        found = lookup_sglang_group(sglang_address, 5)
        assert (found.dp_size, found.follow_bootstrap_room) == (2, False)
        assert found == dataclasses.replace(
            lookup_sglang_group(kvbridge_address, 5), address=sglang_address
        )
