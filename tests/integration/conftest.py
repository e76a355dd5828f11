"""Fixtures for tests that run real processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator

import pytest


@pytest.fixture
def private_netns() -> Iterator[list[str]]:
    """A fresh network namespace with only `lo` up; yields the command prefix that runs a
    process inside it. Engines that bind wildcard listeners (Mooncake) run there, so that
    nothing of theirs listens on the host's interfaces."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a private network namespace needs root and iproute2's `ip`")
    name = f"kvbridge-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)
