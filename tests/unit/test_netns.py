"""`netns.free_subnet`: the host-away link never lands on a /30 another link here holds."""

from __future__ import annotations

import ipaddress

import pytest

from kvbridge_tools.netns import AWAY_NETWORK, NetnsUnavailable, free_subnet

LISTING = """\
1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
2: eth0    inet 10.0.2.15/24 brd 10.0.2.255 scope global eth0\\       valid_lft forever
"""


def test_the_first_subnet_when_none_is_taken() -> None:
    assert free_subnet(LISTING) == ipaddress.IPv4Network("192.168.232.0/30")
    hosts = [str(host) for host in free_subnet(LISTING).hosts()]
    assert hosts == ["192.168.232.1", "192.168.232.2"]


def test_a_link_left_by_a_killed_run_is_stepped_around() -> None:
    stale = LISTING + "7: kvl3f2a1c    inet 192.168.232.2/30 scope global kvl3f2a1c\n"
    assert free_subnet(stale) == ipaddress.IPv4Network("192.168.232.4/30")
    wider = LISTING + "8: br0    inet 192.168.232.9/29 scope global br0\n"
    assert free_subnet(wider) == ipaddress.IPv4Network("192.168.232.0/30")
    both = stale + "8: br0    inet 192.168.232.5/29 scope global br0\n"
    assert free_subnet(both) == ipaddress.IPv4Network("192.168.232.8/30")


def test_a_full_network_is_refused_with_the_reason() -> None:
    taken = "".join(
        f"{index}: kvl{index}    inet {subnet[1]}/30 scope global kvl{index}\n"
        for index, subnet in enumerate(AWAY_NETWORK.subnets(new_prefix=30))
    )
    with pytest.raises(NetnsUnavailable, match=r"every /30 of 192\.168\.232\.0/24 is in use"):
        free_subnet(taken)
