"""Direct-connection upgrade over a relay: the pure core (peer/net/punch.py) and connection
reversal on loopback (a public peer reaches an outbound-only one through a relay; the
outbound-only one dials back where the relay sees the public one, and the next stream
goes over that direct connection)."""

from __future__ import annotations

import math

import multiaddr
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from libp2p.host.ping import ID as PING_PROTOCOL_ID

from peer.config import PeerConfig
from peer.net.host import open_host
from peer.net.punch import (
    ATTEMPTS_PER_PEER,
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    MAX_ADDRS,
    MAX_SYNC_DELAY_S,
    Attempts,
    Connect,
    Mechanism,
    Result,
    Role,
    Sync,
    choose_mechanism,
    dialable_tcp,
    parse_message,
    role_of,
    sync_delay,
)
from protocols.errors import RemoteProtocolError
from protocols.framing import FRAME_HEADER_BYTES, decode_cbor

PEER = "12D3KooWQ9jhXKDBEqvJpiRtsQUc1S4SaFKv8VdGsd3MWFEUvRWB"


def decode(frame: bytes) -> object:
    return parse_message(decode_cbor(frame[FRAME_HEADER_BYTES:]))


# -- messages ------------------------------------------------------------------------------


def test_messages_round_trip():
    hello = Connect(("/ip4/198.18.0.2/tcp/4001",), Mechanism.SIMULTANEOUS_OPEN, PEER)
    answer = Connect(("/ip4/198.18.0.4/tcp/4001", "/ip6/2001:db8::1/tcp/4001"))
    for message in (hello, answer, Sync(), Result(True), Result(False, "refused")):
        assert decode(message.encode()) == message


def test_a_connect_is_either_an_initiators_or_an_answer():
    with pytest.raises(ValueError):
        Connect((), Mechanism.REVERSAL)  # no peer id
    with pytest.raises(ValueError):
        Connect((), None, PEER)
    with pytest.raises(ValueError):
        Connect(tuple(f"/ip4/198.18.0.{i}/tcp/1" for i in range(MAX_ADDRS + 1)))


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {"type": "hello"},
        {"type": "connect", "addrs": "x"},
        {"type": "connect", "addrs": [1]},
        {"type": "connect", "addrs": [""]},
        {"type": "connect", "addrs": ["/ip4/1.2.3.4/tcp/1"] * (MAX_ADDRS + 1)},
        {"type": "connect", "addrs": [], "mechanism": "teleport", "peer": PEER},
        {"type": "connect", "addrs": [], "mechanism": "reversal"},  # no peer
        {"type": "connect", "addrs": [], "mechanism": "reversal", "peer": "x" * 200},
        {"type": "connect", "addrs": [], "peer": PEER},  # no mechanism
        {"type": "result", "ok": 1},
        {"type": "result", "ok": True, "error": 5},
    ],
)
def test_malformed_messages_are_remote_protocol_errors(raw):
    with pytest.raises(RemoteProtocolError):
        parse_message(raw)


values = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=20)
    | st.lists(st.text(max_size=30) | st.integers(), max_size=MAX_ADDRS + 1)
    | st.sampled_from(["connect", "sync", "result", "reversal", "simultaneous_open", PEER])
)


@given(st.dictionaries(st.sampled_from(["type", "addrs", "mechanism", "peer", "ok", "error"]),
                       values))
def test_anything_decoded_is_a_message_or_a_remote_protocol_error(raw):
    try:
        message = parse_message(raw)
    except RemoteProtocolError:
        return
    assert isinstance(message, Connect | Sync | Result)
    assert decode(message.encode()) == message  # what we accept, we can say again


# -- addresses, mechanism, roles, timing -------------------------------------------------------


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        ("/ip4/198.18.0.2/tcp/4001", ("198.18.0.2", 4001)),
        ("/ip6/2001:db8::1/tcp/80", ("2001:db8::1", 80)),
        ("/ip4/127.0.0.1/tcp/5", ("127.0.0.1", 5)),
        ("/ip4/0.0.0.0/tcp/4001", None),  # unspecified
        ("/ip4/224.0.0.1/tcp/4001", None),  # multicast
        ("/ip4/255.255.255.255/tcp/4001", None),
        ("/ip4/198.18.0.2/tcp/0", None),
        ("/ip4/198.18.0.2/tcp/65536", None),
        ("/ip4/198.18.0.2/tcp/080", None),
        ("/ip4/198.18.0.2/udp/4001", None),
        ("/ip6/198.18.0.2/tcp/4001", None),  # family mismatch
        ("/ip4/198.18.0.2/tcp/4001/p2p/" + PEER, None),
        ("/ip4/1.2.3.4/tcp/1/p2p/X/p2p-circuit/p2p/Y", None),
        ("/dns4/example.org/tcp/4001", None),
        ("ip4/1.2.3.4/tcp/1", None),
    ],
)
def test_only_plain_tcp_addresses_are_dialled(addr, expected):
    assert dialable_tcp(addr) == expected


@given(st.text(max_size=80))
def test_dialable_tcp_never_raises(addr):
    result = dialable_tcp(addr)
    assert result is None or 1 <= result[1] <= 65535


def test_mechanism_and_roles():
    assert choose_mechanism(initiator_public=True, responder_addrs=0) is Mechanism.REVERSAL
    assert choose_mechanism(initiator_public=False, responder_addrs=1) is (
        Mechanism.SIMULTANEOUS_OPEN
    )
    assert choose_mechanism(initiator_public=False, responder_addrs=0) is None
    # exactly one dialer on a simultaneous-open socket
    assert {role_of(initiator=True), role_of(initiator=False)} == {Role.DIALER, Role.LISTENER}


@given(st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_sync_delay_is_half_the_round_trip_bounded(rtt):
    delay = sync_delay(rtt)
    assert 0 <= delay <= MAX_SYNC_DELAY_S
    assert delay == min(rtt / 2, MAX_SYNC_DELAY_S)


@pytest.mark.parametrize("rtt", [-0.1, math.nan])
def test_sync_delay_refuses_a_bad_clock(rtt):
    with pytest.raises(ValueError):
        sync_delay(rtt)


# -- the attempt budget ----------------------------------------------------------------------


def test_one_attempt_at_a_time_with_backoff_and_a_cap():
    attempts = Attempts()
    assert attempts.try_start("p", 0.0)
    assert not attempts.try_start("p", 0.0)  # running
    attempts.finished("p", ok=False, now=1.0)
    assert not attempts.try_start("p", 1.0 + BACKOFF_FIRST_S - 0.01)
    assert attempts.try_start("p", 1.0 + BACKOFF_FIRST_S)
    attempts.finished("p", ok=False, now=10.0)
    assert not attempts.try_start("p", 10.0 + BACKOFF_FIRST_S)  # doubled
    assert attempts.try_start("p", 10.0 + 2 * BACKOFF_FIRST_S)
    attempts.finished("p", ok=False, now=100.0)
    assert attempts.failures("p") == ATTEMPTS_PER_PEER
    assert not attempts.try_start("p", 100.0 + BACKOFF_MAX_S - 0.01)  # the long pause
    assert attempts.try_start("p", 100.0 + BACKOFF_MAX_S)
    attempts.finished("p", ok=False, now=1000.0)
    assert not attempts.try_start("p", 1000.0 + BACKOFF_MAX_S - 0.01)  # stays long
    attempts.forget("p")  # reconnected by other means: a fresh budget
    assert attempts.try_start("p", 1000.0)
    attempts.finished("p", ok=True, now=1000.0)
    assert attempts.failures("p") == 0 and len(attempts) == 0


def test_finishing_what_never_started_is_our_bug():
    with pytest.raises(ValueError):
        Attempts().finished("p", ok=True, now=0.0)


@given(st.lists(st.tuples(st.integers(0, 5), st.booleans(), st.floats(0, 50)), max_size=60))
def test_failed_tries_per_peer_are_rate_bounded(steps):
    """Whatever the outcomes, a peer's failed tries are spaced by the backoff: never two
    within BACKOFF_FIRST_S, and after ATTEMPTS_PER_PEER in a row, BACKOFF_MAX_S apart."""
    attempts, now = Attempts(), 0.0
    last_failure: dict[str, float] = {}
    streak: dict[str, int] = {}
    for peer, ok, dt in steps:
        now += dt
        key = f"p{peer}"
        if attempts.try_start(key, now):
            if key in last_failure:
                gap = BACKOFF_MAX_S if streak[key] >= ATTEMPTS_PER_PEER else BACKOFF_FIRST_S
                # as the policy states it (a try is due at the failure's time + the gap):
                # now - last >= gap can differ in the last bit of a float
                assert now >= last_failure[key] + gap
            attempts.finished(key, ok=ok, now=now)
            if ok:
                last_failure.pop(key, None)
                streak[key] = 0
            else:
                last_failure[key] = now
                streak[key] = streak.get(key, 0) + 1


# -- connection reversal on loopback ---------------------------------------------------------


def host_config(listen: tuple[str, ...]) -> PeerConfig:
    return PeerConfig(model="tiny-random", listen_addrs=listen, identity_file=None)


async def wait_for(predicate, what: str, timeout_s: float = 20.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.05)


async def test_a_public_peer_reached_through_a_relay_is_dialled_back(nursery):
    """Entry E (public, loopback) reaches holder H (no listen address) only through relay
    R. The relayed stream starts an upgrade: E asks H (through R) to dial it; H does; E's
    next stream to H is on that connection, not through R."""
    loopback = ("/ip4/127.0.0.1/tcp/0",)
    async with (
        open_host(host_config(loopback)) as relay,
        open_host(host_config(())) as holder,
        open_host(host_config(loopback)) as entry,
    ):
        for host in (relay, holder, entry):
            await nursery.start(host.reach.run)
            await nursery.start(host.holepunch.run)
        await holder.connect(relay.multiaddrs[0])
        await entry.connect(relay.multiaddrs[0])
        await wait_for(lambda: holder.reach.relayed_addrs() != [], "H reserved a slot on R")
        # E is public: three reporters in distinct networks reached it at its address (on
        # loopback every real reporter shares 127.0.0.0/24, which counts once).
        e_addr = str(entry.multiaddrs[0]).split("/p2p/")[0]
        for i, reporter in enumerate(("192.0.2.1", "198.51.100.1", "203.0.113.1")):
            entry.reach.tracker.record(f"reporter{i}", ok=True, addr=e_addr,
                                       now=trio.current_time(), reporter_ip=reporter)
        assert entry.reachability().value == "public"
        assert not entry.is_connected(holder.peer_id)
        entry.libp2p.get_peerstore().add_addrs(
            holder.peer_id,
            [multiaddr.Multiaddr(a) for a in holder.reach.relayed_addrs()],
            60,
        )
        circuits_before = relay.reach.stats["circuits"]
        await entry.ping(holder.peer_id)  # through R: starts the upgrade
        assert relay.reach.stats["circuits"] == circuits_before + 1
        await wait_for(lambda: entry.is_connected(holder.peer_id), "H dialled E back")
        await wait_for(
            lambda: entry.holepunch.stats["reversal_ok"] == 1, "E recorded the reversal"
        )
        assert holder.holepunch.stats["served_reversal_ok"] == 1
        # H dialled only where R sees E connected (punch_policy): 127.0.0.1, this host
        assert holder.holepunch.stats["dials_to_observed"] >= 1
        assert holder.holepunch.stats["dials_to_unobserved"] == 0
        upgraded = entry.holepunch.upgraded[holder.peer_id.to_base58()]
        assert upgraded["mechanism"] == "reversal" and upgraded["remote"].startswith("127.0.0.1:")
        circuits = relay.reach.stats["circuits"]  # the upgrade's own stream went through R
        stream = await entry.new_stream(holder.peer_id, [str(PING_PROTOCOL_ID)])
        try:
            assert stream.muxed_conn.peer_id == holder.peer_id  # not R's connection
        finally:
            await stream.reset()
        await entry.ping(holder.peer_id)
        assert relay.reach.stats["circuits"] == circuits  # the relay is no longer used
