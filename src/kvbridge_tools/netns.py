"""Two hosts on one machine: network namespaces joined by a veth pair, made and removed by the
benchmarks and tests that need them (root and iproute2's `ip`), and a way for a process to
move itself into one.

Each namespace has `lo` up and one end of the link, named `LINK` in both, with an address of
its own: traffic between the two goes through the kernel's TCP/IP stack over the veth, as it
would between two hosts (there is no bandwidth limit; what it costs is the stack's work).
"""

from __future__ import annotations

import ctypes
import ipaddress
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


def _ip(*args: str) -> str:
    """`ip` with these arguments; its output."""
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True).stdout


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
    tag = uuid.uuid4().hex[:6]
    hosts = TwoHosts(f"kvb-p-{tag}", f"kvb-d-{tag}", prefill_ip, decode_ip)
    with _namespaces(hosts.prefill_ns, hosts.decode_ns):
        _link(tag, (hosts.prefill_ns, prefill_ip), (hosts.decode_ns, decode_ip))
        yield hosts


@dataclass(frozen=True)
class HostAway:
    """A namespace joined to this one by a veth pair: `ip` there, `local_ip` on
    `local_link` here; `cut` and `heal` take the link down and up (packets dropped, no
    connection told)."""

    namespace: str
    ip: str
    local_ip: str
    local_link: str

    def cut(self) -> None:
        _ip("-n", self.namespace, "link", "set", LINK, "down")

    def heal(self) -> None:
        _ip("-n", self.namespace, "link", "set", LINK, "up")


# Where `host_away` looks for a /30 of its own in this namespace.
AWAY_NETWORK = ipaddress.IPv4Network("192.168.232.0/24")


def free_subnet(
    addresses: str, network: ipaddress.IPv4Network = AWAY_NETWORK
) -> ipaddress.IPv4Network:
    """The first /30 of `network` that none of `addresses` (`ip -o -4 addr show`'s listing)
    falls in: a link left by a run that was killed keeps its address and route, and a second
    link on the same /30 would lose its traffic to it."""
    taken = [ipaddress.IPv4Interface(word).network for word in _inet_words(addresses)]
    for subnet in network.subnets(new_prefix=30):
        if not any(subnet.overlaps(other) for other in taken):
            return subnet
    raise NetnsUnavailable(f"every /30 of {network} is in use here (links left by earlier runs?)")


def _inet_words(listing: str) -> Iterator[str]:
    """The address/prefix after each `inet` of `ip -o addr show`."""
    words = listing.split()
    for index, word in enumerate(words[:-1]):
        if word == "inet":
            yield words[index + 1]


@contextmanager
def host_away() -> Iterator[HostAway]:
    """A namespace linked to the calling process's own (a /30 no link here uses, `ip` there
    and `local_ip` here): processes started in it are another host to this one, which can
    still start, reach and cut them. Removed on exit; `NetnsUnavailable` if it cannot be
    made."""
    reason = unavailable_reason()
    if reason is not None:
        raise NetnsUnavailable(reason)
    ip, local_ip = (str(host) for host in free_subnet(_checked("-o", "-4", "addr", "show")).hosts())
    tag = uuid.uuid4().hex[:6]
    away = HostAway(f"kvb-a-{tag}", ip, local_ip, f"kvl{tag}")
    try:
        with _namespaces(away.namespace):
            _link(tag, (away.namespace, ip), (None, local_ip), local_name=away.local_link)
            yield away
    finally:
        # Gone with the namespace, unless a process still holds the namespace: then the
        # link's route would outlive it and catch the next run's traffic.
        subprocess.run(["ip", "link", "delete", away.local_link], check=False, capture_output=True)


@contextmanager
def _namespaces(*names: str) -> Iterator[None]:
    """Named namespaces with `lo` up, deleted on exit (their veth ends with them)."""
    reason = unavailable_reason()
    if reason is not None:
        raise NetnsUnavailable(reason)
    try:
        for name in names:
            _checked("netns", "add", name)
            _checked("-n", name, "link", "set", "lo", "up")
        yield
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)


def _link(tag: str, *ends: tuple[str | None, str], local_name: str = LINK) -> None:
    """A veth pair between two ends, each (namespace or None for this one, address /30).
    Created with names unique on this host, renamed to LINK once an end is in its own
    namespace (an end left here gets `local_name`)."""
    temporary = (f"kvp{tag}", f"kvd{tag}")
    _checked("link", "add", temporary[0], "type", "veth", "peer", "name", temporary[1])
    try:
        for (namespace, address), link in zip(ends, temporary, strict=True):
            if namespace is None:
                _checked("link", "set", link, "name", local_name)
                _checked("addr", "add", f"{address}/30", "dev", local_name)
                _checked("link", "set", local_name, "up")
                continue
            _checked("link", "set", link, "netns", namespace)
            _checked("-n", namespace, "link", "set", link, "name", LINK)
            _checked("-n", namespace, "addr", "add", f"{address}/30", "dev", LINK)
            _checked("-n", namespace, "link", "set", LINK, "up")
    except NetnsUnavailable:
        # Whichever end is still here (deleting it deletes its peer too).
        here = (local_name,) if any(namespace is None for namespace, _ in ends) else ()
        for name in (*temporary, *here):
            subprocess.run(["ip", "link", "delete", name], check=False, capture_output=True)
        raise


def _checked(*args: str) -> str:
    try:
        return _ip(*args)
    except subprocess.CalledProcessError as exc:
        raise NetnsUnavailable(
            f"cannot create network namespaces here: ip {' '.join(args)}: {exc.stderr.strip()}"
        ) from None


def enter(namespace: str) -> None:
    """Move the calling thread into a named network namespace (call it first thing in a new
    process, before it starts threads: threads it starts later inherit it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{namespace}") as handle:
        if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise NetnsUnavailable(
                f"cannot enter network namespace {namespace}: {os.strerror(error)}"
            )
