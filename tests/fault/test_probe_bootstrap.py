"""Issue 11, finding 5: the bootstrap service under slow, malformed and hostile clients.

The service runs as `kvbridge bootstrap` in its own process. Hundreds of half-open
connections do not grow its threads or stop it answering `/health` or SIGTERM; bodies nested
too deep, cut short, too long or naming bad hosts get a 4xx; with a secret every route needs
the token, a non-ASCII token is a 401, and a client that keeps guessing gets 429.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kvbridge.control.bootstrap import bootstrap_token
from kvbridge.wire.native import VERSION

HALF_OPEN = 600
RANK = {
    "rank": 0,
    "attn_tp_size": 1,
    "host": "127.0.0.1",
    "port": 9000,
    "engine": "nixl",
    "version": VERSION,
}


def start(secret: str | None = None) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ}
    env.pop("KVBRIDGE_SECRET", None)
    if secret is not None:
        env["KVBRIDGE_SECRET"] = secret
    process = subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "bootstrap", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    url = process.stdout.readline().split()[-1]
    return process, url


@pytest.fixture
def service() -> Iterator[tuple[subprocess.Popen[str], str]]:
    process, url = start()
    yield process, url
    if process.poll() is None:
        process.kill()
        process.wait(10)


def call(
    url: str, method: str = "GET", body: bytes | None = None, token: str | None = None
) -> tuple[int, str]:
    request = urllib.request.Request(url, data=body, method=method)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def threads(process: subprocess.Popen[str]) -> int:
    return len(os.listdir(f"/proc/{process.pid}/task"))


def test_half_open_connections_neither_grow_threads_nor_stop_the_service(service) -> None:  # type: ignore[no-untyped-def]
    process, url = service
    host, port = url.removeprefix("http://").split(":")
    idle = threads(process)
    clients = []
    for _ in range(HALF_OPEN):
        client = socket.create_connection((host, int(port)))
        client.sendall(b"PUT /prefill HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")  # never ends
        clients.append(client)
    time.sleep(0.5)
    started = time.monotonic()
    assert call(f"{url}/health")[0] == 503  # still answering
    answered_s = time.monotonic() - started
    assert threads(process) <= idle + 2
    for client in clients:
        client.close()
    assert call(f"{url}/health")[0] == 503
    print(
        f"{HALF_OPEN} half-open clients: /health in {answered_s:.2f} s, "
        f"{threads(process)} threads (idle {idle})"
    )
    process.send_signal(signal.SIGTERM)
    assert process.wait(15) == 0


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        (b"[" * 60000 + b"]" * 60000, 413, "accepted"),
        (b"[" * 2000 + b"]" * 2000, 400, "nested too deep"),
        (json.dumps({**RANK, "host": "*"}).encode(), 400, "host"),
        (json.dumps({**RANK, "host": "a b"}).encode(), 400, "host"),
        (json.dumps({**RANK, "host": "h" * 60000}).encode(), 413, "accepted"),
        (json.dumps({**RANK, "attn_tp_size": 10**6}).encode(), 400, "attn_tp_size"),
        (json.dumps({**RANK, "engine": "x y"}).encode(), 400, "engine"),
    ],
)
def test_bad_bodies_get_a_4xx_and_the_service_keeps_serving(service, body, status, reason) -> None:  # type: ignore[no-untyped-def]
    _, url = service
    got, text = call(f"{url}/prefill", "PUT", body)
    assert got == status
    assert reason in text
    assert call(f"{url}/health")[0] == 503


def test_a_body_shorter_than_its_length_is_cut_off(service) -> None:  # type: ignore[no-untyped-def]
    _, url = service
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=15) as client:
        client.sendall(b"PUT /prefill HTTP/1.1\r\nContent-Length: 1000\r\n\r\n{}")
        started = time.monotonic()
        client.recv(4096)  # a 400 or the connection closed, after the client timeout
        assert time.monotonic() - started < 10
    assert call(f"{url}/health")[0] == 503


def test_with_a_secret_every_route_needs_the_token() -> None:
    process, url = start(secret="s3cret")
    try:
        token = bootstrap_token(b"s3cret")
        assert call(f"{url}/prefill")[0] == 401
        assert call(f"{url}/health")[0] == 401
        assert call(f"{url}/health", token=token)[0] == 503
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as client:
            client.sendall("GET /health HTTP/1.1\r\nAuthorization: Bearer é\r\n\r\n".encode())
            assert b" 401 " in client.recv(4096)
        for _ in range(25):
            status = call(f"{url}/health", token="wrong")[0]
        assert status == 429
        assert call(f"{url}/prefill", "PUT", json.dumps(RANK).encode(), token=token)[0] == 429
    finally:
        process.kill()
        process.wait(10)
