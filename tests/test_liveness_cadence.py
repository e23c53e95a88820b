"""Discovery's liveness pings in virtual time: a peer the table keeps round trips for is
warmed up at 1 s then pinged every liveness interval; one whose round trips the table
drops (no summary of it yet; in gossip mode `ring`, a peer we do not hear) is pinged at
doubling gaps up to UNKEPT_PING_MAX_INTERVALS intervals, and warms up once it is kept. A
member first pinged through relays (and failing) is pinged at once when it connects."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import trio
from libp2p.peer.id import ID

from peer.net.discovery import (
    RELAY_PING_BACKOFF_MAX_S,
    RTT_WARMUP_SAMPLES,
    UNKEPT_PING_MAX_INTERVALS,
    WARMING_TICK_S,
    WARMING_WINDOW_S,
    WARMUP_PING_INTERVAL_S,
    Discovery,
)
from peer.net.wire import PeerUnreachable
from tests.fake_host import new_peer_id

KEPT, UNKEPT = ID.from_base58(new_peer_id(1)), ID.from_base58(new_peer_id(2))
LIVENESS_S = 5.0


def discovery_of(host: object, **kwargs: Any) -> Discovery:
    """A Discovery over `host` alone (no DHT, no bootstrap), liveness every LIVENESS_S."""
    return Discovery(host, None, b"key", (),  # type: ignore[arg-type]
                     liveness_interval_s=LIVENESS_S, rng=random.Random(0), **kwargs)


class PingHost:
    """Two connected peers that answer every ping at once; records when each was pinged."""

    def __init__(self) -> None:
        self.pings: dict[ID, list[float]] = {KEPT: [], UNKEPT: []}

    def connected_peers(self) -> list[ID]:
        return [KEPT, UNKEPT]

    def may_relay_to(self, peer_id: ID) -> bool:
        return False

    async def ping(self, peer_id: ID, *, timeout_s: float) -> float:
        self.pings[peer_id].append(trio.current_time())
        return 0.001


async def test_unkept_round_trips_back_off_and_kept_ones_warm_up(autojump_clock):
    host = PingHost()
    table_knows = {str(KEPT)}
    discovery = discovery_of(host, on_rtt=lambda peer, rtt: peer in table_knows)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(discovery._liveness_loop)
        await trio.sleep(60.0)
        table_knows.add(str(UNKEPT))  # its first summary arrives
        await trio.sleep(25.0)
        nursery.cancel_scope.cancel()
    kept = host.pings[KEPT]
    # warm-up: RTT_WARMUP_SAMPLES pings a second apart (the loop ticks every second), then
    # one per liveness interval
    gaps = [round(b - a) for a, b in itertools.pairwise(kept)]
    assert gaps[: RTT_WARMUP_SAMPLES - 1] == [WARMUP_PING_INTERVAL_S] * (RTT_WARMUP_SAMPLES - 1)
    assert set(gaps[RTT_WARMUP_SAMPLES - 1 :]) == {LIVENESS_S}
    unkept = [t for t in host.pings[UNKEPT] if t < 60.0]
    gaps = [round(b - a) for a, b in itertools.pairwise(unkept)]
    cap = UNKEPT_PING_MAX_INTERVALS * LIVENESS_S
    assert gaps == [min(2.0**i, cap) for i in range(len(gaps))]
    assert len(unkept) <= 9  # 1, 2, 4, 8, 16, then every 20 s: not 60 pings in 60 s
    # once kept, it is pinged again within one capped gap and then warms up at 1 s
    later = [t for t in host.pings[UNKEPT] if t >= 60.0]
    assert later and later[0] < 60.0 + cap + 1
    assert [round(b - a) for a, b in itertools.pairwise(later)][:1] == [1]


class LateDirectHost:
    """A member known by gossip that no relay reaches (a swarm without relays), then
    dialled directly at `connect_at`; records the pings it answered."""

    def __init__(self, connect_at: float) -> None:
        self.connect_at = connect_at
        self.answered: list[float] = []

    def is_connected(self, peer_id: ID) -> bool:
        return trio.current_time() >= self.connect_at

    def connected_peers(self) -> list[ID]:
        return [KEPT] if self.is_connected(KEPT) else []

    def may_relay_to(self, peer_id: ID) -> bool:
        return not self.is_connected(peer_id)

    async def ping(self, peer_id: ID, *, timeout_s: float) -> float:
        if not self.is_connected(peer_id):
            raise PeerUnreachable("no direct or relayed route")
        self.answered.append(trio.current_time())
        return 0.001


async def test_a_member_pinged_through_relays_is_pinged_at_once_when_it_connects(
    autojump_clock,
):
    # In a starting swarm a peer hears of another by gossip (through the bootstrap peer)
    # before its discovery dials it; the relayed pings in between fail and back off by
    # liveness intervals. The direct connection must not inherit that back-off: until the
    # first round trip the router does not count the peer as a candidate.
    connect_at = 25.0
    host = LateDirectHost(connect_at)
    discovery = discovery_of(host, members=lambda: [str(KEPT)])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(discovery._liveness_loop)
        await trio.sleep(connect_at + 10.0)
        nursery.cancel_scope.cancel()
    assert LIVENESS_S * 2 < RELAY_PING_BACKOFF_MAX_S  # a back-off that would outlast a tick
    assert host.answered and host.answered[0] <= connect_at + WARMUP_PING_INTERVAL_S
    # ...then it warms up like any new connection
    gaps = [round(b - a) for a, b in itertools.pairwise(host.answered)]
    assert gaps[: RTT_WARMUP_SAMPLES - 1] == [WARMUP_PING_INTERVAL_S] * (RTT_WARMUP_SAMPLES - 1)


class JoiningHost:
    """A peer connected at `connect_at` (it dialled us: no dial of ours to wake on);
    records when it was pinged."""

    def __init__(self, connect_at: float) -> None:
        self.connect_at = connect_at
        self.pings: list[float] = []

    def is_connected(self, peer_id: ID) -> bool:
        return trio.current_time() >= self.connect_at

    def is_relayed(self, peer_id: ID) -> bool:
        return False

    def connected_peers(self) -> list[ID]:
        return [KEPT] if self.is_connected(KEPT) else []

    def may_relay_to(self, peer_id: ID) -> bool:
        return False

    async def ping(self, peer_id: ID, *, timeout_s: float) -> float:
        self.pings.append(trio.current_time())
        return 0.001


async def test_a_new_member_gets_its_first_kept_round_trip_within_a_warming_tick(
    autojump_clock,
):
    # The router skips a peer without a round trip, so a starting swarm waits on its
    # members' first kept pings: one whose summary comes after its first ping is pinged
    # again when gossip applies that summary, and one that connects later (it dialled
    # us) within a warming tick, not a whole liveness tick.
    host = JoiningHost(connect_at=0.0)
    table_knows: set[str] = set()
    kept_at: list[float] = []

    def on_rtt(peer: str, rtt: float) -> bool:
        if peer in table_knows:
            kept_at.append(trio.current_time())
            return True
        return False

    discovery = discovery_of(host, on_rtt=on_rtt, members=lambda: sorted(table_knows))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(discovery._liveness_loop)
        await trio.sleep(1.5)  # pinged at 1.0 s, before its summary: dropped
        assert host.pings == [1.0] and not kept_at
        table_knows.add(str(KEPT))
        discovery.member_joined(str(KEPT))  # its first summary is applied at 1.5 s
        await trio.sleep(0.5)
        assert kept_at == [1.5]  # at once, not at the unkept back-off's 2.0 s or later
        nursery.cancel_scope.cancel()

    # its summary came through the mesh at 0.5 s; it dials us at 3.3 s
    late = JoiningHost(connect_at=3.3)
    pinged_kept: list[float] = []
    discovery = discovery_of(
        late, on_rtt=lambda peer, rtt: pinged_kept.append(trio.current_time()) or True,
        members=lambda: [str(KEPT)],
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(discovery._liveness_loop)
        await trio.sleep(0.5)
        discovery.member_joined(str(KEPT))
        await trio.sleep(4.5)
        nursery.cancel_scope.cancel()
    assert pinged_kept and pinged_kept[0] <= 3.3 + WARMING_TICK_S + 1e-9


class CountingHost(JoiningHost):
    """Never connected; counts the liveness loop's ticks (each lists the connections)."""

    def __init__(self) -> None:
        super().__init__(connect_at=math.inf)
        self.ticks: list[float] = []

    def connected_peers(self) -> list[ID]:
        self.ticks.append(trio.current_time())
        return []


async def test_a_member_never_reached_stops_the_fast_tick_after_its_window(autojump_clock):
    host = CountingHost()
    known = [str(KEPT)]  # known, never connected, never measured
    discovery = discovery_of(host, members=lambda: known)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(discovery._liveness_loop)
        discovery.member_joined(str(KEPT))
        await trio.sleep(WARMING_WINDOW_S + 20.0)
        nursery.cancel_scope.cancel()
    early = [t for t in host.ticks if t <= WARMING_WINDOW_S]
    late = [t for t in host.ticks if t > WARMING_WINDOW_S + 1.0]
    assert len(early) >= WARMING_WINDOW_S / WARMING_TICK_S - 2  # fast while it may connect
    assert len(late) <= 20  # then the ordinary tick, once a second


class HangingHost(PingHost):
    """PingHost, but UNKEPT's pings hang until their timeout; records KEPT's answers."""

    def __init__(self) -> None:
        super().__init__()
        self.answered = self.pings[KEPT]

    def is_connected(self, peer_id: ID) -> bool:
        return True

    async def ping(self, peer_id: ID, *, timeout_s: float) -> float:
        if peer_id == UNKEPT:
            await trio.sleep(timeout_s)
            raise PeerUnreachable("no answer")
        return await super().ping(peer_id, timeout_s=timeout_s)


async def test_a_ping_waiting_out_its_timeout_holds_back_no_other(autojump_clock):
    host = HangingHost()
    table_knows: set[str] = set()
    discovery = discovery_of(host, on_rtt=lambda peer, rtt: peer in table_knows)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(discovery._liveness_loop)
        await trio.sleep(1.5)  # both pinged at 1.0 s; UNKEPT's hangs until 6.0 s
        table_knows.add(str(KEPT))
        discovery.member_joined(str(KEPT))
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    assert host.answered[:2] == [1.0, 1.5]  # not held until the hanging ping gave up
