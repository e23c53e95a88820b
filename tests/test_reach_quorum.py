"""Reachability needs agreement: PUBLIC only when PUBLIC_QUORUM reporters in distinct
networks (/24, /48) reached us at one address; one liar, or many in one network, never
flips a peer behind NAT, and every answer expires."""

from __future__ import annotations

import ipaddress

from hypothesis import given
from hypothesis import strategies as st

from peer.net.reachability import (
    MIN_FAILING_PEERS,
    PUBLIC_QUORUM,
    RESULT_TTL_S,
    Reachability,
    ReachabilityTracker,
    network_of,
)

HOME = "/ip4/198.18.0.2/tcp/4001"  # where honest reporters reach us
LIE = "/ip4/6.6.6.6/tcp/4001"  # what a liar says it reached


def agree(t: ReachabilityTracker, n: int, *, addr: str = HOME, now: float = 0.0) -> None:
    """`n` honest reporters, each in its own /24, reached us at `addr`."""
    for i in range(n):
        t.record(f"honest{i}", ok=True, addr=addr, now=now, reporter_ip=f"203.0.{i}.9")


def test_network_of_groups_by_24_and_48():
    assert network_of("203.0.113.7") == network_of("203.0.113.250") == "203.0.113.0/24"
    assert network_of("203.0.114.7") != network_of("203.0.113.7")
    assert network_of("2001:db8:1:2::1") == network_of("2001:db8:1:ffff::9")
    assert network_of("2001:db8:2::1") != network_of("2001:db8:1::1")
    assert network_of("::ffff:203.0.113.7") == "203.0.113.0/24"
    assert network_of("not an ip") == network_of("") == ""


def test_one_ok_never_flips_a_private_peer():
    t = ReachabilityTracker(listen_ports=1)
    t.record("honest", ok=False, addr=HOME, now=0.0, reporter_ip="198.51.100.1")
    assert t.verdict(0.0) is Reachability.PRIVATE
    t.record("liar", ok=True, addr=LIE, now=1.0, reporter_ip="192.0.2.66")
    assert t.verdict(1.0) is Reachability.PRIVATE
    assert t.confirmed_addrs(1.0) == []


def test_quorum_of_distinct_networks_at_one_address():
    t = ReachabilityTracker(listen_ports=1)
    agree(t, PUBLIC_QUORUM - 1)
    assert t.verdict(0.0) is Reachability.UNKNOWN
    # reporters in a network already counted add nothing
    for i in range(10):
        t.record(f"same24-{i}", ok=True, addr=HOME, now=0.0, reporter_ip=f"203.0.0.{100 + i}")
    assert t.verdict(0.0) is Reachability.UNKNOWN
    # a reporter in a new network, but at another address, does not agree
    t.record("elsewhere", ok=True, addr=LIE, now=0.0, reporter_ip="192.0.2.1")
    assert t.verdict(0.0) is Reachability.UNKNOWN
    t.record("third", ok=True, addr=HOME, now=0.0, reporter_ip="192.0.2.2")
    assert t.verdict(0.0) is Reachability.PUBLIC
    assert t.confirmed_addrs(0.0) == [HOME]  # never the lone liar's address
    assert t.evidence(0.0)["agreeing_networks"] == PUBLIC_QUORUM


def test_reporters_without_a_known_ip_are_one_network():
    t = ReachabilityTracker(listen_ports=1)
    for i in range(5):
        t.record(f"p{i}", ok=True, addr=HOME, now=0.0)
    assert t.verdict(0.0) is Reachability.UNKNOWN


def test_agreement_expires():
    t = ReachabilityTracker(listen_ports=1)
    agree(t, PUBLIC_QUORUM, now=10.0)
    assert t.verdict(10.0 + RESULT_TTL_S) is Reachability.PUBLIC
    assert t.verdict(10.0 + RESULT_TTL_S + 0.001) is Reachability.UNKNOWN


def test_a_liar_address_is_offered_to_hole_punches_last():
    t = ReachabilityTracker(listen_ports=1)
    agree(t, 2, now=0.0)
    t.record("liar", ok=True, addr=LIE, now=1.0, reporter_ip="192.0.2.66")
    assert t.observed_addrs(1.0) == [HOME, LIE]


reporters = st.tuples(
    st.integers(0, 20),  # reporter id
    st.booleans(),  # ok
    st.sampled_from([HOME, LIE]),
    st.integers(0, 5),  # /24 index
    st.integers(1, 254),  # host within it
    st.floats(0, 2 * RESULT_TTL_S),
)


@given(st.lists(reporters, max_size=40), st.floats(0, 3 * RESULT_TTL_S))
def test_public_iff_quorum_networks_agree(events, now):
    """The verdict equals a brute-force reading of the evidence (latest answer per
    reporter, fresh ones only, distinct /24s per address)."""
    t = ReachabilityTracker(listen_ports=1)
    latest: dict[int, tuple[bool, str, str, float]] = {}
    for peer, ok, addr, net, host, at in sorted(events, key=lambda e: e[5]):
        ip = f"10.{net}.0.{host}"
        t.record(f"p{peer}", ok=ok, addr=addr, now=at, reporter_ip=ip)
        latest[peer] = (ok, addr, str(ipaddress.ip_network(f"{ip}/24", strict=False)), at)
    fresh = [v for v in latest.values() if now - v[3] <= RESULT_TTL_S]
    agreed = {
        a for a in (HOME, LIE)
        if len({n for ok, addr, n, _ in fresh if ok and addr == a}) >= PUBLIC_QUORUM
    }
    failed = sum(1 for ok, *_ in fresh if not ok)
    expected = (
        Reachability.PUBLIC if agreed
        else Reachability.PRIVATE if failed >= MIN_FAILING_PEERS
        else Reachability.UNKNOWN
    )
    assert t.verdict(now) is expected
    assert set(t.confirmed_addrs(now)) == agreed
