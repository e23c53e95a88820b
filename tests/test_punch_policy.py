"""A hole punch dials only where the other side was observed: plan_dials, the budget
per authenticated peer (pure; time is a parameter) and the observed? exchange."""

from __future__ import annotations

import contextlib
import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peer.net.punch import (
    MAX_OBSERVED_IPS,
    ObservedAnswer,
    ObservedQuery,
    dialable_tcp,
    parse_observed_answer,
    parse_observed_query,
)
from peer.net.punch_policy import (
    BUDGET_BURST,
    BUDGET_REFILL_S,
    MAX_PUNCH_DIALS,
    PORTS_PER_IP,
    PunchBudget,
    is_lan,
    on_our_lan,
    plan_dials,
)
from protocols.errors import RemoteProtocolError
from protocols.framing import FRAME_HEADER_BYTES, decode_cbor

OURS = [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("192.168.1.0/24")]
SCAN = [f"/ip4/127.0.0.1/tcp/{p}" for p in range(9000, 9008)]


def test_a_scan_of_our_own_host_by_a_stranger_dials_nothing():
    """The initiator was seen at a public IP: none of its loopback/private names count."""
    plan = plan_dials([*SCAN[:6], "/ip4/192.168.1.1/tcp/80", "/ip4/10.0.0.1/tcp/22"],
                      ["203.0.113.5"], OURS)
    assert plan.targets == ()
    assert plan.refused["not_observed"] == 8


def test_only_observed_ips_are_dialled_one_port_each():
    plan = plan_dials(["/ip4/198.18.0.4/tcp/4001", "/ip4/198.18.0.4/tcp/22",
                       "/ip4/198.18.0.9/tcp/4001"], ["198.18.0.4"], OURS)
    assert plan.targets == (("198.18.0.4", 4001),)
    assert plan.refused == {"ports_per_ip": 1, "not_observed": 1}


def test_lan_addresses_only_for_a_peer_on_our_lan():
    on_lan = plan_dials(["/ip4/192.168.1.20/tcp/4001"], ["192.168.1.20"], OURS)
    assert on_lan.targets == (("192.168.1.20", 4001),)
    # observed at a private address of another network (a relay's LAN, say): refused
    elsewhere = plan_dials(["/ip4/10.77.0.2/tcp/4001"], ["10.77.0.2"], OURS)
    assert elsewhere.targets == () and elsewhere.refused == {"lan_not_ours": 1}
    # on this host: loopback is ours
    assert plan_dials(SCAN[:1], ["127.0.0.1"], OURS).targets == (("127.0.0.1", 9000),)


def test_unparsable_observations_and_names_are_ignored():
    plan = plan_dials(["/ip4/1.2.3.4/tcp/1/p2p-circuit", "garbage", "/ip4/1.2.3.4/tcp/1"],
                      ["not-an-ip", "1.2.3.4"], OURS)
    assert plan.targets == (("1.2.3.4", 1),)
    assert plan.refused == {"not_dialable": 2}


def test_lan_ranges():
    for ip in ("127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.0.1", "169.254.1.1",
               "100.64.0.1", "::1", "fe80::1", "fd00::2", "0.0.0.0", "nonsense"):
        assert is_lan(ip), ip
    for ip in ("198.18.0.4", "203.0.113.5", "8.8.8.8", "2001:db8::1"):
        assert not is_lan(ip), ip
    assert not on_our_lan("8.8.8.8", [ipaddress.ip_network("0.0.0.0/0")])  # public: not LAN


ip4 = st.builds(lambda a, b: f"{a}.0.0.{b}", st.sampled_from([127, 10, 192, 203, 198]),
                st.integers(1, 3))
addrs = st.builds(lambda ip, port: f"/ip4/{ip}/tcp/{port}", ip4, st.integers(1, 65535))


@given(st.lists(addrs | st.text(max_size=30), max_size=12), st.lists(ip4, max_size=4))
def test_every_target_is_named_observed_and_allowed(claimed, observed):
    plan = plan_dials(claimed, observed, OURS)
    assert len(plan.targets) <= MAX_PUNCH_DIALS
    assert len(set(plan.targets)) == len(plan.targets)
    named = {dialable_tcp(a) for a in claimed}
    for ip, port in plan.targets:
        assert (ip, port) in named
        assert ip in observed
        assert not is_lan(ip) or on_our_lan(ip, OURS)
        assert sum(t[0] == ip for t in plan.targets) <= PORTS_PER_IP


def test_budget_bursts_then_refills_per_peer():
    budget = PunchBudget()
    assert all(budget.try_take("relay", 0.0) for _ in range(BUDGET_BURST))
    assert not budget.try_take("relay", 0.0)
    assert budget.try_take("other", 0.0)  # each peer its own bucket
    assert not budget.try_take("relay", BUDGET_REFILL_S - 0.001)
    assert budget.try_take("relay", BUDGET_REFILL_S)
    assert not budget.try_take("relay", BUDGET_REFILL_S)


def test_budget_is_bounded_and_cycling_ids_refills_nobody():
    budget = PunchBudget(burst=2, refill_s=10.0, max_keys=3)
    assert budget.try_take("a", 0.0) and budget.try_take("a", 0.0)
    for name in "bcde":  # pushes "a" out
        budget.try_take(name, 0.0)
    assert len(budget) == 3
    assert not budget.try_take("a", 0.0)  # back, but empty: no fresh burst
    assert budget.try_take("a", 10.0)


def test_budget_refuses_bad_settings():
    with pytest.raises(ValueError):
        PunchBudget(burst=0)
    with pytest.raises(ValueError):
        PunchBudget(refill_s=0.0)


@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 5.0)), max_size=100))
def test_budget_never_grants_more_than_burst_plus_refills(steps):
    budget = PunchBudget(burst=3, refill_s=10.0, max_keys=2)
    now, granted = 0.0, {k: 0 for k in range(4)}
    for key, dt in steps:
        now += dt
        granted[key] += budget.try_take(str(key), now)
    for n in granted.values():
        assert n <= 3 + now / 10.0


# -- the observed? exchange ----------------------------------------------------------------



def test_observed_messages_round_trip_and_reject_what_is_not_an_ip():
    query = ObservedQuery("12D3KooWQ9jhXKDBEqvJpiRtsQUc1S4SaFKv8VdGsd3MWFEUvRWB")
    assert parse_observed_query(decode_cbor(query.encode()[FRAME_HEADER_BYTES:])) == query
    answer = ObservedAnswer(("198.18.0.4", "2001:db8::1"))
    assert parse_observed_answer(decode_cbor(answer.encode()[FRAME_HEADER_BYTES:])) == answer
    for bad in ({"type": "observed", "ips": ["1.2.3.4/24"]},
                {"type": "observed", "ips": ["1.1.1.1"] * (MAX_OBSERVED_IPS + 1)},
                {"type": "observed", "ips": [7]}, {"type": "observed?", "peer": ""}, []):
        with pytest.raises(RemoteProtocolError):
            parse_observed_answer(bad)
    with pytest.raises(ValueError):
        ObservedAnswer(("1.1.1.1",) * (MAX_OBSERVED_IPS + 1))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20,
)


@given(json_values | st.fixed_dictionaries(
    {"type": st.sampled_from(["observed", "observed?"]),
     "ips": st.lists(st.text(max_size=50), max_size=6), "peer": st.text(max_size=140)}))
def test_observed_decoders_return_a_message_or_raise_remote_protocol_error(raw):
    for parse in (parse_observed_query, parse_observed_answer):
        with contextlib.suppress(RemoteProtocolError):
            parse(raw)
