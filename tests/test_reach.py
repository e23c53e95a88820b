"""peer/net/reachability.py: reachability verdicts, reservations, control messages,
address rules."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peer.net.reachability import (
    RESULT_TTL_S,
    DialBackRequest,
    DialBackResponse,
    Reachability,
    ReachabilityTracker,
    RelayConnect,
    RelayLimits,
    RelayReply,
    RelayReserve,
    Reservations,
    circuit_addr,
    control_body_length,
    decode_control,
    expand_unspecified,
    is_circuit,
    parse_relay_request,
    relay_of,
)
from protocols.errors import RemoteProtocolError
from protocols.framing import FRAME_HEADER_BYTES


def roundtrip(frame: bytes) -> object:
    length = control_body_length(frame[:FRAME_HEADER_BYTES])
    assert length == len(frame) - FRAME_HEADER_BYTES
    return decode_control(frame[FRAME_HEADER_BYTES:])


def test_outbound_only_is_private_at_once():
    assert ReachabilityTracker(listen_ports=0).verdict(0.0) is Reachability.PRIVATE


def test_verdicts_follow_the_evidence():
    t = ReachabilityTracker(listen_ports=1)
    assert t.verdict(0.0) is Reachability.UNKNOWN
    t.record("p1", ok=False, addr="/ip4/198.18.0.2/tcp/4001", now=1.0)
    assert t.verdict(1.0) is Reachability.PRIVATE
    for i, reporter in enumerate(("192.0.2.7", "198.51.100.7", "203.0.113.7")):
        t.record(f"p{i + 2}", ok=True, addr="/ip4/198.18.0.2/tcp/4001", now=2.0,
                 reporter_ip=reporter)
    assert t.verdict(2.0) is Reachability.PUBLIC  # three networks agree (PUBLIC_QUORUM)
    assert t.confirmed_addrs(2.0) == ["/ip4/198.18.0.2/tcp/4001"]
    # evidence expires: a network may change
    assert t.verdict(2.0 + RESULT_TTL_S + 1) is Reachability.UNKNOWN
    assert t.confirmed_addrs(2.0 + RESULT_TTL_S + 1) == []


def test_a_peer_counts_once_its_latest_answer_wins():
    t = ReachabilityTracker(listen_ports=1)
    t.record("p1", ok=True, addr="/ip4/1.2.3.4/tcp/1", now=0.0)
    t.record("p1", ok=False, addr="/ip4/1.2.3.4/tcp/1", now=1.0)
    assert t.verdict(1.0) is Reachability.PRIVATE
    assert t.evidence(1.0) == {"ok": 0, "failed": 1, "agreeing_networks": 0, "quorum": 3}


@given(st.lists(st.tuples(st.text(min_size=1, max_size=8), st.booleans()), max_size=200))
def test_results_kept_are_bounded(results):
    t = ReachabilityTracker(listen_ports=1)
    for i, (peer, ok) in enumerate(results):
        t.record(peer, ok=ok, addr="/ip4/1.2.3.4/tcp/1", now=float(i))
    ev = t.evidence(float(len(results)))
    assert ev["ok"] + ev["failed"] <= 32


def test_reservations_are_bounded_and_expire():
    r = Reservations(RelayLimits(max_reservations=2, reservation_ttl_s=10.0))
    assert r.reserve("a", 0.0) == 10.0
    assert r.reserve("b", 0.0) == 10.0
    assert r.reserve("c", 1.0) is None  # full
    assert r.reserve("a", 5.0) == 15.0  # a refresh is always granted
    assert r.holds("b", 9.9) and not r.holds("b", 10.0)
    assert r.reserve("c", 10.0) == 20.0  # b lapsed: its slot is free
    assert len(r) == 2


@pytest.mark.parametrize("bad", [dict(max_circuits=0), dict(max_circuit_s=0.0)])
def test_relay_limits_validate(bad):
    with pytest.raises(ValueError):
        RelayLimits(**bad)


def test_control_messages_roundtrip():
    req = DialBackRequest((4001, 4002))
    assert DialBackRequest.parse(roundtrip(req.encode())) == req
    resp = DialBackResponse("198.18.0.2", (4001,))
    assert DialBackResponse.parse(roundtrip(resp.encode()), req) == resp
    assert parse_relay_request(roundtrip(RelayReserve().encode())) == RelayReserve()
    conn = RelayConnect("12D3KooWabc", "/prefixswarm/infer/1.0.0")
    assert parse_relay_request(roundtrip(conn.encode())) == conn
    reply = RelayReply(False, "no reservation for that peer")
    assert RelayReply.parse(roundtrip(reply.encode())) == reply


@pytest.mark.parametrize(
    "raw",
    [[], {"ports": [0]}, {"ports": [1, 2, 3, 4, 5]}, {"ports": [True]}, {"ports": "4001"}],
)
def test_bad_dialback_requests_are_rejected(raw):
    with pytest.raises(RemoteProtocolError):
        DialBackRequest.parse(raw)


def test_a_dialback_answer_cannot_claim_ports_not_asked_or_a_non_ip():
    asked = DialBackRequest((4001,))
    with pytest.raises(RemoteProtocolError):
        DialBackResponse.parse({"observed_ip": "1.2.3.4", "ok_ports": [22]}, asked)
    with pytest.raises(RemoteProtocolError):
        DialBackResponse.parse({"observed_ip": "example.com", "ok_ports": []}, asked)


@pytest.mark.parametrize(
    "raw",
    [{"op": "dance"}, {"op": "connect", "peer": "", "proto": "/x"},
     {"op": "connect", "peer": "x" * 500, "proto": "/x"}, "reserve"],
)
def test_bad_relay_requests_are_rejected(raw):
    with pytest.raises(RemoteProtocolError):
        parse_relay_request(raw)


def test_oversized_control_frames_are_refused_before_reading():
    with pytest.raises(RemoteProtocolError):
        control_body_length((1 << 20).to_bytes(4, "big"))
    with pytest.raises(RemoteProtocolError):
        control_body_length(b"\0\0\0\0")


def test_addresses():
    relay = "/ip4/198.18.0.1/tcp/4001/p2p/12D3Relay"
    addr = circuit_addr(relay, "12D3Me")
    assert addr == "/ip4/198.18.0.1/tcp/4001/p2p/12D3Relay/p2p-circuit/p2p/12D3Me"
    assert is_circuit(addr) and not is_circuit(relay)
    assert relay_of(addr) == "12D3Relay" and relay_of(relay) is None
    assert expand_unspecified("/ip4/0.0.0.0/tcp/4001", ["127.0.0.1", "192.168.1.5"]) == [
        "/ip4/192.168.1.5/tcp/4001", "/ip4/127.0.0.1/tcp/4001"
    ]
    assert expand_unspecified("/ip4/10.0.0.1/tcp/1", ["127.0.0.1"]) == ["/ip4/10.0.0.1/tcp/1"]
