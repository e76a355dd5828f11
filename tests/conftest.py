"""Suite-wide checks: a test leaves no kvbridge thread, socket or child process behind."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from processes import children_of

SETTLE_S = 5.0  # closing is asynchronous in places (ZMQ's I/O thread, a child's exit)


def _kvbridge_threads() -> set[str]:
    return {
        f"{t.name}#{t.ident}"
        for t in threading.enumerate()
        if t.name.startswith("kvbridge") and t.is_alive()
    }


def _abstract_unix_socket_inodes() -> set[str]:
    # Mooncake's first TransferEngine binds an abstract Unix socket that lives as long as the
    # process (creating and closing more engines does not add to it): library state, not a leak.
    inodes = set()
    for line in Path("/proc/self/net/unix").read_text().splitlines()[1:]:
        columns = line.split()
        if len(columns) >= 8 and columns[7].startswith("@"):
            inodes.add(columns[6])
    return inodes


def _open_sockets() -> set[str]:
    """This process's socket descriptors, as `fd -> socket:[inode]`."""
    library_state = _abstract_unix_socket_inodes()
    sockets = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed while listing (the directory's own descriptor, a race)
            continue
        if target.startswith("socket:") and target[8:-1] not in library_state:
            sockets.add(f"{fd} -> {target}")
    return sockets


def _children() -> set[str]:
    """Live child processes of this process, as `pid command`."""
    return {f"{pid} {command[:120]}" for pid, command in children_of("self").items()}


LEAK_CHECKS: dict[str, Callable[[], set[str]]] = {
    "threads": _kvbridge_threads,
    "sockets": _open_sockets,
    "child processes": _children,
}


@pytest.fixture(scope="session")
def kept_processes() -> set[int]:
    """Child processes that a module's fixture keeps over its tests and that a test may
    replace (a server restarted on its address): the fixture stops them, not the test."""
    return set()


@pytest.fixture(autouse=True)
def no_leaks(kept_processes: set[int]) -> Iterator[None]:
    """Every manager, channel, worker, service and process a test starts is gone when it ends.

    Sockets are compared by descriptor: anything a test opened and did not close shows up.
    Process-wide state a library keeps for its lifetime (an engine's first agent) would show
    up here too; the engines close theirs, so the suite holds them to it."""
    before = {name: check() for name, check in LEAK_CHECKS.items()}
    yield
    deadline = time.monotonic() + SETTLE_S

    def new(name: str) -> set[str]:
        found = LEAK_CHECKS[name]() - before[name]
        if name == "child processes":
            found = {child for child in found if int(child.split()[0]) not in kept_processes}
        return found

    while True:
        leaked = {name: sorted(new(name)) for name in LEAK_CHECKS if new(name)}
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaked, f"left behind: {leaked}"
