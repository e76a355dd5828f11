"""Stopping the `kvbridge` command with a signal: it exits promptly with the conventional
status and leaves no process behind, whichever way it is stopped."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import children_of, interruptible

from kvbridge.engines import unavailable_reason
from kvbridge.wire.native import VERSION

ROOT = Path(__file__).resolve().parents[2]
# Enough rooms that the demo is still running when the signal arrives (≈1.3 GiB per rank).
LONG_DEMO = ("demo", "--requests", "10000", "--tokens", "1", "--page-size", "1", "--chunks", "1")


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for whoever adopted it to reap it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" in status


def wait_until(condition: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.05)


@pytest.fixture
def start() -> Iterator[object]:
    started: list[subprocess.Popen[bytes]] = []

    def run(*args: str) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvbridge", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            preexec_fn=interruptible,
        )
        started.append(process)
        return process

    yield run
    for process in started:
        if process.poll() is None:
            process.kill()
        process.communicate()


def demo_with_ranks(start: object) -> tuple[subprocess.Popen[bytes], set[int]]:
    reason = unavailable_reason("nixl")
    if reason is not None:
        pytest.skip(f"nixl cannot be used here: {reason}")
    demo = start(*LONG_DEMO)  # type: ignore[operator]
    ranks: set[int] = set()

    def ranks_started() -> bool:
        ranks.update(children_of(demo.pid))  # the two rank processes
        return len(ranks) >= 2

    wait_until(ranks_started, 30)
    time.sleep(1.0)  # the ranks are allocating and filling their caches, or transferring
    assert demo.poll() is None, "the demo ended before it could be interrupted"
    return demo, ranks


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGTERM, 128 + 15), (signal.SIGINT, 128 + 2)]
)
def test_a_signalled_demo_stops_its_ranks_and_exits(
    start: object, signum: signal.Signals, status: int
) -> None:
    demo, ranks = demo_with_ranks(start)
    demo.send_signal(signum)
    _, stderr = demo.communicate(timeout=20)
    assert demo.returncode == status, stderr.decode()
    assert f"{signum.name}: demo stopped" in stderr.decode()
    wait_until(lambda: all(gone(pid) for pid in ranks), 5)


def test_ranks_do_not_outlive_a_killed_demo(start: object) -> None:
    demo, ranks = demo_with_ranks(start)
    demo.kill()
    demo.wait(timeout=5)
    wait_until(lambda: all(gone(pid) for pid in ranks), 5)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_bootstrap_service_stops_cleanly(start: object, signum: signal.Signals) -> None:
    service = start("bootstrap", "--port", "0")  # type: ignore[operator]
    assert service.stdout is not None
    url = service.stdout.readline().decode().split(" on ")[1].strip()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        connection.request("GET", "/health")
        answer = connection.getresponse()
        answer.read()
    finally:
        connection.close()
    assert answer.status == 503  # it serves: no prefill group has registered yet
    service.send_signal(signum)
    stdout, stderr = service.communicate(timeout=10)
    assert service.returncode == 0, stderr.decode()
    assert f"{signum.name}: bootstrap service stopped" in stdout.decode()


@pytest.mark.parametrize(("flags", "logged"), [((), False), (("-v",), True)])
def test_the_bootstrap_service_logs_registrations_only_when_asked(
    start: object, flags: tuple[str, ...], logged: bool
) -> None:
    service = start(*flags, "bootstrap", "--port", "0")  # type: ignore[operator]
    assert service.stdout is not None
    url = service.stdout.readline().decode().split(" on ")[1].strip()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps(
        {
            "rank": 0,
            "attn_tp_size": 1,
            "host": "127.0.0.1",
            "port": 5555,
            "engine": "nixl",
            "version": VERSION,
        }
    )
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        connection.request("PUT", "/prefill", body, {"Content-Type": "application/json"})
        assert connection.getresponse().status == 200
    finally:
        connection.close()
    service.send_signal(signal.SIGTERM)
    _, stderr = service.communicate(timeout=10)
    line = "INFO MainProcess kvbridge.bootstrap: prefill rank 0 of 1 registered at 127.0.0.1:5555"
    assert (line in stderr.decode()) is logged
