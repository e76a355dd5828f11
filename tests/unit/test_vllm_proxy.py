"""`kvbridge vllm-proxy` between stand-in prefill and decode servers (real HTTP on loopback):
what each instance receives, streamed and whole answers, and errors named for the client.
The proxy with real vLLM instances runs in tests/vllm_compat."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvbridge.integrations.vllm_proxy import PDProxy
from kvbridge.integrations.vllm_proxy_pool import prefill_targets
from kvbridge.integrations.vllm_requests import PREFILL_PARAMS, decode_request, prefill_request

REMOTE = {"do_remote_prefill": True, "kvbridge_room": 7, "kvbridge_bootstrap_url": "http://x:1"}


class StandIn:
    """An HTTP server answering POSTs with `answer(body)`; it records every body."""

    def __init__(self, answer: Any, stream: bool = False) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.connections: set[tuple[str, int]] = set()  # (host, port) the proxy came from
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stand_in.bodies.append(body)
                stand_in.headers.append(dict(self.headers))
                stand_in.connections.add(self.client_address)
                status, reply = answer(body)
                data = json.dumps(reply).encode()
                self.send_response(status)
                if stream:  # server-sent events, chunked
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for event in (b"data: " + data + b"\n\n", b"data: [DONE]\n\n"):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                        if body.get("cut"):  # the instance dies after its first event
                            self.wfile.flush()
                            self.connection.shutdown(socket.SHUT_RDWR)
                            return
                    self.wfile.write(b"0\r\n\r\n")
                    return
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxied(request: pytest.FixtureRequest) -> Iterator[tuple[PDProxy, StandIn, StandIn]]:
    stream, prefill_status = getattr(request, "param", (False, 200))
    prefill = StandIn(lambda body: (prefill_status, {"kv_transfer_params": REMOTE}))
    decode = StandIn(lambda body: (200, {"choices": [{"token_ids": [1, 2, 3]}]}), stream=stream)
    proxy = PDProxy([prefill.url], [decode.url])
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    yield proxy, prefill, decode
    proxy.shutdown()
    prefill.close()
    decode.close()


def post(
    url: str, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        connection.request(
            "POST", path, data, {"Content-Type": "application/json", **(headers or {})}
        )
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_requests_are_rewritten_as_vllms_pd_flow() -> None:
    body = {"prompt": [1, 2], "max_tokens": 50, "stream": True, "stream_options": {"x": 1}}
    prefill = prefill_request(body)
    assert prefill["kv_transfer_params"] == PREFILL_PARAMS
    assert (prefill["max_tokens"], prefill["stream"]) == (1, False)
    assert "stream_options" not in prefill
    assert (
        prefill_request({"messages": [], "max_completion_tokens": 9})["max_completion_tokens"] == 1
    )
    # vLLM refuses min_tokens above max_tokens: prefill's one token goes without it.
    assert "min_tokens" not in prefill_request({**body, "min_tokens": 20})
    assert (
        decode_request({**body, "min_tokens": 20}, {"kv_transfer_params": REMOTE})["min_tokens"]
        == 20
    )
    assert decode_request(body, {"kv_transfer_params": REMOTE}) == {
        **body,
        "kv_transfer_params": REMOTE,
    }
    with pytest.raises(ValueError, match="answered without kv_transfer_params"):
        decode_request(body, {"choices": []})


def test_a_request_goes_to_prefill_then_decode_with_prefills_parameters(
    proxied: tuple[PDProxy, StandIn, StandIn],
) -> None:
    proxy, prefill, decode = proxied
    status, data = post(proxy.url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 8})
    assert (status, json.loads(data)) == (200, {"choices": [{"token_ids": [1, 2, 3]}]})
    assert prefill.bodies[0]["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill.bodies[0]["max_tokens"] == 1
    assert decode.bodies == [{"prompt": [5, 6], "max_tokens": 8, "kv_transfer_params": REMOTE}]


def test_both_instances_get_the_clients_credentials_and_one_request_id(
    proxied: tuple[PDProxy, StandIn, StandIn],
) -> None:
    proxy, prefill, decode = proxied
    post(proxy.url, "/v1/completions", {"prompt": [5]}, {"Authorization": "Bearer k1"})
    post(proxy.url, "/v1/completions", {"prompt": [5]}, {"X-Request-Id": "client-7"})
    first, second = zip(prefill.headers, decode.headers, strict=True)
    assert {h["Authorization"] for h in first} == {"Bearer k1"}
    assert len({h["X-Request-Id"] for h in first}) == 1  # made up, the same for both
    assert [h["X-Request-Id"] for h in second] == ["client-7", "client-7"]
    assert not any("Authorization" in h for h in second)


def test_concurrent_clients_share_pooled_upstream_connections(
    proxied: tuple[PDProxy, StandIn, StandIn],
) -> None:
    proxy, prefill, decode = proxied
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda i: post(proxy.url, "/v1/completions", {"prompt": [i], "max_tokens": 4}),
                range(64),
            )
        )
    assert all(status == 200 for status, _ in answers)
    assert sorted(body["prompt"][0] for body in decode.bodies) == list(range(64))
    # Kept alive and reused: a handful of connections per instance, not one per request.
    assert len(prefill.connections) <= 8
    assert len(decode.connections) <= 8


def test_with_two_of_each_every_prefill_decode_pairing_occurs() -> None:
    instances = [StandIn(lambda body: (200, {"kv_transfer_params": REMOTE})) for _ in range(4)]
    prefills, decodes = instances[:2], instances[2:]
    proxy = PDProxy([p.url for p in prefills], [d.url for d in decodes])
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        for index in range(4):
            post(proxy.url, "/v1/completions", {"prompt": [index]})
    finally:
        proxy.shutdown()
        for instance in instances:
            instance.close()

    def by_id(stand_in: StandIn) -> set[str]:
        return {headers["X-Request-Id"] for headers in stand_in.headers}

    pairs = {(p, d) for p in range(2) for d in range(2) if by_id(prefills[p]) & by_id(decodes[d])}
    assert pairs == {(0, 0), (0, 1), (1, 0), (1, 1)}
    own, before_first_byte = proxy.timings()
    assert len(own) == 4  # the proxy's own time, per request
    # Whole answers reach the client at the end: no earlier first byte.
    assert before_first_byte == own


@pytest.mark.parametrize("proxied", [(True, 200)], indirect=True)
def test_a_streamed_answer_is_relayed_as_it_comes(
    proxied: tuple[PDProxy, StandIn, StandIn],
) -> None:
    proxy, _, _ = proxied
    status, data = post(proxy.url, "/v1/completions", {"prompt": [5], "stream": True})
    assert status == 200
    assert data.endswith(b"data: [DONE]\n\n")
    assert b'"token_ids": [1, 2, 3]' in data
    # The first event went out before the second was relayed. (The timing is recorded once
    # the handler returns, just after the client has the end of the answer.)
    deadline = time.monotonic() + 5
    while not proxy.timings()[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    (own,), (before_first_byte,) = proxy.timings()
    assert 0 < before_first_byte < own


@pytest.mark.parametrize("proxied", [(True, 200)], indirect=True)
def test_an_answer_cut_short_upstream_is_cut_for_the_client_too(
    proxied: tuple[PDProxy, StandIn, StandIn],
) -> None:
    proxy, _, _ = proxied
    with pytest.raises(
        (http.client.IncompleteRead, http.client.RemoteDisconnected, ConnectionError)
    ):
        post(proxy.url, "/v1/completions", {"prompt": [5], "stream": True, "cut": True})
    status, data = post(proxy.url, "/v1/completions", {"prompt": [5], "stream": True})
    assert status == 200  # the proxy serves on
    assert data.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("proxied", [(False, 500)], indirect=True)
def test_errors_reach_the_client_with_the_instance_named(
    proxied: tuple[PDProxy, StandIn, StandIn],
) -> None:
    proxy, prefill, decode = proxied
    status, data = post(proxy.url, "/v1/completions", {"prompt": [5]})
    assert status == 500
    assert f"prefill {prefill.url}" in json.loads(data)["error"]
    assert decode.bodies == []
    status, data = post(proxy.url, "/v1/completions", b"not json")
    assert status == 400
    assert "bad request body" in json.loads(data)["error"]
    assert post(proxy.url, "/v1/embeddings", {})[0] == 404


def test_an_unreachable_instance_is_a_502_and_a_bad_url_refused_at_start() -> None:
    with pytest.raises(ValueError, match="is not an http://host:port URL"):
        PDProxy(["tcp://127.0.0.1:1"], ["http://127.0.0.1:2"])
    proxy = PDProxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        status, data = post(proxy.url, "/v1/completions", {"prompt": [1]})
        assert status == 502
        assert "http://127.0.0.1:9 unreachable" in json.loads(data)["error"]
    finally:
        proxy.shutdown()


def test_a_hung_instance_ends_its_requests_with_504_naming_it() -> None:
    """A prefill instance that takes a request and sends nothing (stopped, say): the request
    ends after the proxy's upstream timeout, the instance named; the proxy serves on."""
    release = threading.Event()

    def hang(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if body["prompt"] == [0]:
            release.wait(10)
        return 200, {"kv_transfer_params": REMOTE}

    prefill = StandIn(hang)
    decode = StandIn(lambda body: (200, {"choices": [{"token_ids": [1]}]}))
    proxy = PDProxy([prefill.url], [decode.url], upstream_timeout_s=0.5)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        status, data = post(proxy.url, "/v1/completions", {"prompt": [0]})
        assert status == 504
        assert f"prefill {prefill.url} sent nothing for 0.5 s" in json.loads(data)["error"]
        assert post(proxy.url, "/v1/completions", {"prompt": [1]})[0] == 200
    finally:
        release.set()
        proxy.shutdown()
        prefill.close()
        decode.close()
    with pytest.raises(ValueError, match="positive"):
        PDProxy([prefill.url], [decode.url], upstream_timeout_s=0)


def test_decode_first_sends_both_instances_the_request_at_once_into_one_room() -> None:
    """Decode answers while prefill still computes: the client has decode's answer, and both
    requests name the same room; prefill's is held until it answered."""
    release = threading.Event()

    def slow_prefill(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        release.wait(10)
        return 200, {"kv_transfer_params": {}}

    prefill = StandIn(slow_prefill)
    decode = StandIn(lambda body: (200, {"choices": [{"token_ids": [4]}]}))
    proxy = PDProxy([prefill.url], [decode.url], prefill_bootstrap=["http://10.0.0.1:8998"])
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                post, proxy.url, "/v1/completions", {"prompt": [5], "max_tokens": 8}
            )
            deadline = time.monotonic() + 10
            while not decode.bodies and time.monotonic() < deadline:
                time.sleep(0.01)
            assert decode.bodies, "decode waited for prefill's answer"
            release.set()
            status, data = answer.result(timeout=10)
        assert (status, json.loads(data)) == (200, {"choices": [{"token_ids": [4]}]})
        (to_prefill,), (to_decode,) = prefill.bodies, decode.bodies
        streamed, loading = to_prefill["kv_transfer_params"], to_decode["kv_transfer_params"]
        assert (streamed["do_remote_decode"], streamed["kvbridge_stream"]) == (True, True)
        assert to_prefill["max_tokens"] == 1
        assert loading["kvbridge_decode_first"] is True
        assert loading["kvbridge_bootstrap_url"] == "http://10.0.0.1:8998"
        assert loading["kvbridge_room"] == streamed["kvbridge_room"]
        assert to_decode["max_tokens"] == 8
    finally:
        release.set()
        proxy.shutdown()
        prefill.close()
        decode.close()
    with pytest.raises(ValueError, match="2 prefill instance"):
        PDProxy(["http://a:1", "http://b:1"], ["http://c:1"], prefill_bootstrap=["http://d:1"])


def test_decode_first_cuts_decode_off_when_prefill_fails() -> None:
    """Decode would wait for KV that will not come: its request is cut off (vLLM aborts it)
    and the client hears at once; the prefill instance is free again."""
    release = threading.Event()
    prefill = StandIn(lambda body: (500, {"error": "out of memory"}))

    def stuck_decode(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        release.wait(10)
        return 200, {"choices": []}

    decode = StandIn(stuck_decode)
    proxy = PDProxy([prefill.url], [decode.url], prefill_bootstrap=["http://10.0.0.1:8998"])
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        started = time.monotonic()
        status, _ = post(proxy.url, "/v1/completions", {"prompt": [5], "max_tokens": 8})
        assert status >= 500
        assert time.monotonic() - started < 5
    finally:
        release.set()
        proxy.shutdown()
        prefill.close()
        decode.close()
    with pytest.raises(ValueError, match="not an http://host:port URL"):
        PDProxy(["http://a:1"], ["http://c:1"], prefill_bootstrap=["http://d"])


def test_decode_first_with_a_data_parallel_prefill_sends_each_request_to_one_rank() -> None:
    """`--prefill-data-parallel-size 2`: each request goes to one DP rank of the prefill
    instance (vLLM's X-data-parallel-rank header), fewest in flight first, and decode asks
    that rank's bootstrap service (the instance's port + the rank's index) for the room."""
    prefill = StandIn(lambda body: (200, {"kv_transfer_params": {}}))
    decode = StandIn(lambda body: (200, {"choices": [{"token_ids": [4]}]}))
    proxy = PDProxy(
        [prefill.url],
        [decode.url],
        prefill_bootstrap=["http://10.0.0.1:8998"],
        prefill_dp_size=2,
    )
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        for _ in range(4):
            status, _ = post(proxy.url, "/v1/completions", {"prompt": [5], "max_tokens": 8})
            assert status == 200
        ranks = [headers["X-data-parallel-rank"] for headers in prefill.headers]
        assert sorted(ranks) == ["0", "0", "1", "1"]
        for rank, to_prefill, to_decode in zip(ranks, prefill.bodies, decode.bodies, strict=True):
            loading = to_decode["kv_transfer_params"]
            assert loading["kvbridge_bootstrap_url"] == f"http://10.0.0.1:{8998 + int(rank)}"
            assert loading["kvbridge_room"] == to_prefill["kv_transfer_params"]["kvbridge_room"]
        assert all("X-data-parallel-rank" not in headers for headers in decode.headers)
    finally:
        proxy.shutdown()
        prefill.close()
        decode.close()
    ipv6 = prefill_targets(["http://a:1"], ["http://[::1]:8998"], 2)
    assert [(t.name, t.bootstrap, t.headers) for t in ipv6.values()] == [
        ("http://a:1 (DP rank 0)", "http://[::1]:8998", {"X-data-parallel-rank": "0"}),
        ("http://a:1 (DP rank 1)", "http://[::1]:8999", {"X-data-parallel-rank": "1"}),
    ]
    with pytest.raises(ValueError, match="is for decode first"):
        PDProxy(["http://a:1"], ["http://c:1"], prefill_dp_size=2)
    with pytest.raises(ValueError, match="give 1 or more"):
        PDProxy(["http://a:1"], ["http://c:1"], prefill_bootstrap=["http://d:1"], prefill_dp_size=0)
