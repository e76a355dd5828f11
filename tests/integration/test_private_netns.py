"""The benchmarks' private network namespace (`json_in_private_netns`): the process sees only
its own loopback, and the namespace has no name, so nothing is left behind once it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_for

from kvbridge_tools.bench import json_in_private_netns, private_netns_unavailable

UNAVAILABLE = private_netns_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")

INTERFACES = """
import json, os, socket
names = sorted(name for _, name in socket.if_nameindex())
with socket.create_server(("127.0.0.1", 0)) as server:  # loopback is up
    port = server.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port)):
        pass
print("noise on an earlier line")
print(json.dumps({"interfaces": names, "netns": os.readlink("/proc/self/ns/net")}))
"""


def named_netns() -> str:
    return subprocess.run(
        ["ip", "netns", "list"], check=True, capture_output=True, text=True
    ).stdout


def test_a_run_sees_only_its_own_loopback_and_leaves_no_namespace_behind() -> None:
    before = named_netns()
    row = json_in_private_netns(["-c", INTERFACES])
    assert row["interfaces"] == ["lo"]
    assert row["netns"] != os.readlink("/proc/self/ns/net")
    assert named_netns() == before


def test_a_failing_run_raises_with_its_error_output() -> None:
    with pytest.raises(subprocess.CalledProcessError) as failed:
        json_in_private_netns(["-c", "raise SystemExit('the cell broke')"])
    assert "the cell broke" in failed.value.stderr


def test_a_run_killed_midway_leaves_no_namespace_behind(tmp_path: Path) -> None:
    """SIGTERM skips a `finally` in the process it ends: a named namespace deleted there
    outlived such runs (three were found after benchmark runs had been stopped)."""
    before = named_netns()
    pid_file = tmp_path / "pid"
    inside = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    run = f"from kvbridge_tools.bench import json_in_private_netns as run; run(['-c', {inside!r}])"
    runner = subprocess.Popen([sys.executable, "-c", run])
    try:
        wait_for(lambda: pid_file.exists() and bool(pid_file.read_text()))
        runner.terminate()
        runner.wait(timeout=10)
        assert named_netns() == before
    finally:
        runner.kill()
        if pid_file.exists() and pid_file.read_text():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
