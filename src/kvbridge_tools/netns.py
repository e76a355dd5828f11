"""Two hosts on one machine: network namespaces joined by a veth pair, made and removed by the
benchmarks and tests that need them (root and iproute2's `ip`), and a way for a process to
move itself into one.

Each namespace has `lo` up and one end of the link, named `LINK` in both, with an address of
its own: traffic between the two goes through the kernel's TCP/IP stack over the veth, as it
would between two hosts (there is no bandwidth limit; what it costs is the stack's work).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# The link's name inside each namespace (engines that pick interfaces by name see one).
LINK = "kvbr0"
CLONE_NEWNET = 0x40000000  # <sched.h>


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no `ip`, or the kernel refused)."""


@dataclass(frozen=True)
class TwoHosts:
    prefill_ns: str
    decode_ns: str
    prefill_ip: str
    decode_ip: str
    prefill_link: str = LINK
    decode_link: str = LINK

    def command(self, namespace: str, *argv: str) -> list[str]:
        """`argv` run inside `namespace`."""
        return ["ip", "netns", "exec", namespace, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def unavailable_reason() -> str | None:
    """Why two hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip`"
    return None


@contextmanager
def two_hosts(
    prefill_ip: str = "192.168.231.1", decode_ip: str = "192.168.231.2"
) -> Iterator[TwoHosts]:
    """Namespaces for prefill and decode joined by a veth pair (a /30 between the two
    addresses); removed on exit. `NetnsUnavailable` if they cannot be made."""
    reason = unavailable_reason()
    if reason is not None:
        raise NetnsUnavailable(reason)
    tag = uuid.uuid4().hex[:6]
    hosts = TwoHosts(f"kvb-p-{tag}", f"kvb-d-{tag}", prefill_ip, decode_ip)
    # Created with names unique on this host, renamed to LINK once each end is in its own
    # namespace.
    temporary = (f"kvp{tag}", f"kvd{tag}")
    try:
        try:
            _ip("netns", "add", hosts.prefill_ns)
            _ip("netns", "add", hosts.decode_ns)
            _ip("link", "add", temporary[0], "type", "veth", "peer", "name", temporary[1])
            ends = ((hosts.prefill_ns, temporary[0], prefill_ip),
                    (hosts.decode_ns, temporary[1], decode_ip))  # fmt: skip
            for namespace, link, address in ends:
                _ip("link", "set", link, "netns", namespace)
                _ip("-n", namespace, "link", "set", link, "name", LINK)
                _ip("-n", namespace, "addr", "add", f"{address}/30", "dev", LINK)
                _ip("-n", namespace, "link", "set", LINK, "up")
                _ip("-n", namespace, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            raise NetnsUnavailable(
                f"cannot create network namespaces here: {exc.stderr.decode().strip()}"
            ) from None
        yield hosts
    finally:
        for namespace in (hosts.prefill_ns, hosts.decode_ns):
            subprocess.run(["ip", "netns", "delete", namespace], check=False, capture_output=True)


def enter(namespace: str) -> None:
    """Move the calling thread into a named network namespace (call it first thing in a new
    process, before it starts threads: threads it starts later inherit it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{namespace}") as handle:
        if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise NetnsUnavailable(f"cannot enter network namespace {namespace}: "
                                   f"{os.strerror(error)}")  # fmt: skip
