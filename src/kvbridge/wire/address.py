"""Network addresses carried in messages, pure: what a host or a control endpoint may be.

A peer's host and endpoint come off the wire and become ZMQ `connect()` targets; a wildcard
(`*`), a space or an interface name would make ZMQ raise inside the channel's thread, so they
are refused when a message is decoded. One rule for every message and the bootstrap registry.
"""

from __future__ import annotations

import ipaddress
import re

MAX_HOST_LENGTH = 253  # a DNS name's limit
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_ENDPOINT = re.compile(r"tcp://(\[[^\]]*\]|[^:\[\]]*):([0-9]{1,5})")


def host_problem(host: str) -> str | None:
    """Why `host` cannot be a peer's address (an IPv4/IPv6 literal or a DNS name), or None."""
    if not host:
        return "the host is empty"
    if len(host) > MAX_HOST_LENGTH:
        return f"a host is at most {MAX_HOST_LENGTH} characters, got {len(host)}"
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(literal)
    except ValueError:
        pass
    else:
        return None
    if literal is not host:
        return f"{host!r} is bracketed but not an IPv6 address"
    labels = host.removesuffix(".").split(".")
    if not all(_LABEL.fullmatch(label) for label in labels) or labels[-1].isdigit():
        return f"{host!r} is not an IP address or a host name"
    return None


def check_host(host: str) -> str:
    """`host` if it can be a peer's address; `ValueError` saying why not."""
    problem = host_problem(host)
    if problem is not None:
        raise ValueError(problem)
    return host


def tcp_endpoint(host: str, port: int) -> str:
    """The ZMQ endpoint of (host, port); IPv6 literals are bracketed."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def endpoint_problem(endpoint: str) -> str | None:
    """Why `endpoint` cannot be a peer's control endpoint (`tcp://host:port`), or None."""
    match = _ENDPOINT.fullmatch(endpoint)
    if match is None:
        return f"{endpoint[:80]!r} is not tcp://host:port"
    problem = host_problem(match.group(1))
    if problem is not None:
        return problem
    if not 0 < int(match.group(2)) < 65536:
        return f"port {match.group(2)} is not a TCP port"
    return None
