"""Child processes: read from /proc (Linux), and started as a terminal would start them."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path


def interruptible() -> None:
    """`preexec_fn` for a child that a test interrupts with SIGINT: the signal's default action
    back. A suite started as a background job (`make test &`, nohup) inherits SIGINT ignored,
    and Python leaves an ignored SIGINT ignored, so the test's SIGINT would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def children_of(pid: int | str) -> dict[int, str]:
    """Live (not yet reaped) children of `pid` ("self": this process) as {pid: command line},
    leaving out Python's multiprocessing resource tracker (started once per process by
    `spawn`, and gone with it)."""
    found: dict[int, str] = {}
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):  # the process is exiting
            for child in listing.read_text().split():
                with contextlib.suppress(OSError):  # the child is exiting
                    raw = Path(f"/proc/{child}/cmdline").read_bytes()
                    command = raw.replace(b"\0", b" ").decode(errors="replace").strip()
                    if "multiprocessing.resource_tracker" not in command:
                        found[int(child)] = command
    return found
