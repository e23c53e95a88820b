"""Reachability needs agreement: PUBLIC only when PUBLIC_QUORUM reporters in distinct
networks (/24, /48) reached us at one address; one liar, or many in one network, never
flips a peer behind NAT, and every answer expires."""

from __future__ import annotations

import ipaddress
import itertools

import trio
from hypothesis import given
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.net.reachability import (
    MIN_FAILING_PEERS,
    PUBLIC_QUORUM,
    RESULT_TTL_S,
    Reachability,
    ReachabilityTracker,
    network_of,
    unknown_check_delay,
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


def test_unknown_checks_back_off_while_only_asked_peers_remain():
    assert unknown_check_delay(0, 5.0, 120.0) == 5.0
    assert [unknown_check_delay(q, 5.0, 120.0) for q in (1, 2, 3, 4, 5, 99)] == [
        10.0, 20.0, 40.0, 80.0, 120.0, 120.0]


class _Silent:
    """A host whose peers never answer a dial-back request: the verdict stays unknown."""

    def __init__(self, connected: list[ID]) -> None:
        self.connected = connected
        self.peer_id = ID.from_pubkey(create_new_key_pair().public_key)
        self.asked: list[tuple[float, ID]] = []

    def connected_peers(self) -> list[ID]:
        return list(self.connected)

    async def new_stream(self, peer_id: ID, *_: object, **__: object) -> object:
        self.asked.append((trio.current_time(), peer_id))
        raise ConnectionError("no dial-back here")


async def test_a_peer_in_one_network_backs_off_and_a_new_peer_is_asked_at_once(
    autojump_clock,
):
    from peer.net.relay_service import CHECK_FANOUT, CHECK_INTERVAL_S, CHECK_UNKNOWN_S, Reach

    def ids(n: int) -> list[ID]:
        return [ID.from_pubkey(create_new_key_pair().public_key) for _ in range(n)]

    host = _Silent(ids(3))
    reach = Reach(host, listen_ports=(4001,), announce=(), relay_service=False,
                  use_relays=False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reach._check_loop)
        await trio.sleep(600)
        rounds = sorted({t for t, _ in host.asked})
        # 1 s, then 5 s (three new peers), then 10, 20, 40, 80 and 120 s apart
        gaps = [round(b - a, 6) for a, b in itertools.pairwise(rounds)]
        assert gaps[:6] == [CHECK_UNKNOWN_S * 2 ** q for q in range(5)] + [CHECK_INTERVAL_S]
        assert len(rounds) < 600 / CHECK_UNKNOWN_S / 10  # every 5 s: 120 rounds
        assert reach.verdict() is Reachability.UNKNOWN
        newcomer = ids(1)[0]
        host.connected.append(newcomer)
        before = len(host.asked)
        await trio.sleep(CHECK_INTERVAL_S + 1)
        first = next(t for t, p in host.asked[before:] if p == newcomer)
        later = [t for t, _ in host.asked[before:] if t > first]
        # the newcomer is asked at the next round, and the round after comes 5 s later
        assert later and min(later) - first == CHECK_UNKNOWN_S
        assert all(len([p for t, p in host.asked if t == r]) <= CHECK_FANOUT for r in rounds)
        nursery.cancel_scope.cancel()


def test_the_schedule_asks_new_peers_first_and_remembers_a_bounded_number():
    import random

    from peer.net.reachability import CheckSchedule

    schedule = CheckSchedule(fanout=3, remembered=4)
    rng = random.Random(1)
    assert sorted(schedule.choose(["a", "b"], rng)) == ["a", "b"]
    assert schedule.unknown_delay(5.0, 120.0) == 5.0
    # c is new: asked first, with one of the old ones; the round had news
    picked = schedule.choose(["a", "b", "c"], rng)
    assert picked[0] == "c" and len(picked) == 3
    assert schedule.unknown_delay(5.0, 120.0) == 5.0
    schedule.choose(["a", "b", "c"], rng)  # nothing new: quiet
    assert schedule.unknown_delay(5.0, 120.0) == 10.0
    small = CheckSchedule(fanout=1, remembered=2)
    for peer in ("a", "b", "c"):  # a, then b, then c: a is forgotten
        assert small.choose([peer], rng) == [peer]
    small.choose(["c"], rng)
    assert small.unknown_delay(5.0, 120.0) == 10.0  # c again: quiet
    assert small.choose(["a"], rng) == ["a"]
    assert small.unknown_delay(5.0, 120.0) == 5.0  # a counts as new again
