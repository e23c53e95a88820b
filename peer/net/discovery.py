"""Swarm discovery: bootstrap, provide the model key in the DHT, find and dial providers.

Three loops in one nursery: bootstrap (dial the configured addresses with back-off),
providers (announce the model's key, ask connected peers for the others, dial the new
ones within a budget: peer/net/dial_candidates.py decides which) and liveness (ping
known peers, report round trips, forget those that stop answering). A new peer is
pinged every second until its first round trips are kept, so routing has a measured
delay within seconds; docs/protocol.md section 8 has the timings.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import trio
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from peer.logs import root_cause
from peer.net.dial_candidates import LOCAL_SOURCE, CandidateBook, Dial
from peer.net.host import SwarmHost, parse_peer_addr
from peer.net.host_services import (
    dht_add_peer,
    dht_forget_peer,
    dht_local_providers,
    dht_provide,
    dht_query_providers,
)
from peer.net.wire import PeerUnreachable

logger = logging.getLogger(__name__)

BOOTSTRAP_BACKOFF_FIRST_S = 0.25  # first retry soon: the bootstrap peer may be starting too
BOOTSTRAP_BACKOFF_MAX_S = 30.0  # keep trying, but at most twice a minute per address
# A member reachable only through relays that does not answer (gone, or an identity that
# never connected anywhere) is pinged ever more rarely: doubling up to every 5 minutes.
RELAY_PING_BACKOFF_MAX_S = 300.0
FORGET_AFTER_FAILURES = 3  # consecutive failed dials/pings before a peer is forgotten
DISCOVERY_INTERVAL_MIN_S = 0.5  # look for providers this often while the swarm changes
DISCOVERY_INTERVAL_MAX_S = 15.0  # ...backing off to this when nothing new turns up
# ...but at most to this while gossip names members we have no connection to (their
# provider records may still be on their way through the DHT).
DISCOVERY_INTERVAL_MISSING_S = 2.0
PROVIDE_INTERVAL_S = 30.0  # re-announce: peers that joined since may now be closest
PROVIDE_TIMEOUT_S = 15.0  # a provide walks the DHT: a few round trips to up to 20 peers
QUERY_FANOUT = 3  # connected peers asked for providers per round (k=20 hold the record)
LIVENESS_TIMEOUT_S = 5.0  # a ping takes milliseconds; seconds only on a starved CPU
# Consecutive failed pings before a connection is dropped as a zombie. One is not
# enough: on an overloaded machine single pings time out, and dropping live connections
# then broke the gossip mesh (measured: 8 processes on 2 busy cores, ~45% delivery).
LIVENESS_FAILURES_TO_DROP = 3
WARMUP_PING_INTERVAL_S = 1.0  # a new peer's pings come this often...
RTT_WARMUP_SAMPLES = 3  # ...until this many were kept: a minimum over 3 is already sane
# A connected peer whose round trips the table does not keep (no summary of it yet; in
# gossip mode `ring`, any peer we do not hear) is pinged at doubling gaps from the warm-up
# interval up to this many liveness intervals: its first summary still gets an RTT within
# seconds, but a swarm of N peers does not cost each one N pings a second forever.
UNKEPT_PING_MAX_INTERVALS = 4
# The liveness loop's tick while a member that joined lately has no round trip yet: its
# first ping after it connects is then at most this late (the warm-up cadence is
# unchanged). A member not reached within the window goes back to the ordinary tick.
WARMING_TICK_S = 0.2
WARMING_WINDOW_S = 10.0
MAX_WARMING = 256  # members tracked as joining at once (a flood of new ids adds no more)


class Discovery:
    """Finds the other peers serving the same model and keeps connections to them."""

    def __init__(
        self,
        host: SwarmHost,
        dht: KadDHT,
        provider_key: bytes,
        bootstrap: Sequence[str],
        *,
        liveness_interval_s: float,
        rng: random.Random,
        on_rtt: Callable[[str, float], bool] = lambda peer, rtt: True,
        on_forget: Callable[[str], None] = lambda peer: None,
        members: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        self._host = host
        self._dht = dht
        self._key = provider_key
        self._bootstrap = [parse_peer_addr(a) for a in bootstrap]
        self._liveness_interval_s = liveness_interval_s
        self._rng = rng
        self._on_rtt = on_rtt
        self._on_forget = on_forget
        self._members = members  # peer ids gossip knows: a hint that discovery is not done
        self._book: CandidateBook[PeerInfo] = CandidateBook()
        self._ping_failures: dict[ID, int] = {}
        self._relay_ping_failures: dict[ID, int] = {}  # members reachable only via relays
        self._rtts_kept: dict[ID, int] = {}  # per connected peer, for the warm-up cadence
        self._rtts_unkept: dict[ID, int] = {}  # consecutive answered pings the table dropped
        self._next_ping: dict[ID, float] = {}
        self._direct: set[ID] = set()  # directly connected at the last liveness tick
        self._bootstrapped = trio.Event()
        # bootstrap peer id -> its last dial error (cli.py digs out the root cause)
        self.bootstrap_errors: dict[str, Exception] = {}
        self._wakeup = trio.Event()
        self._ping_now = trio.Event()  # a member joined: the liveness loop ticks at once
        self._joined: dict[ID, float] = {}  # members that joined lately, without a round trip
        self._pinging: set[ID] = set()  # pings in flight
        self._provide_now = trio.Event()
        self._stats = {
            "bootstrap_attempts": 0,
            "bootstrap_failures": 0,
            "provides": 0,
            "provider_queries": 0,
            "dials": 0,
            "dial_failures": 0,
            "pings": 0,
            "ping_failures": 0,
            "zombies_dropped": 0,
            "forgotten": 0,
        }

    # -- public ---------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run the discovery loops until cancelled."""
        async with trio.open_nursery() as nursery:
            if self._bootstrap:
                for info in self._bootstrap:
                    nursery.start_soon(self._bootstrap_one, info)
            else:
                logger.info("no bootstrap addresses: starting a new swarm")
                self._bootstrapped.set()
            nursery.start_soon(self._provide_loop)
            nursery.start_soon(self._discover_loop)
            nursery.start_soon(self._liveness_loop)
            task_status.started()

    async def wait_bootstrapped(self) -> None:
        """Return once one bootstrap address answered (at once for a new swarm)."""
        await self._bootstrapped.wait()

    @property
    def bootstrapped(self) -> bool:
        return self._bootstrapped.is_set()

    def poke(self) -> None:
        """Look for providers now (e.g. after a connection was lost)."""
        self._wakeup.set()

    def provide_soon(self) -> None:
        """Re-announce now: our advertised addresses changed (reachability, relays)."""
        self._provide_now.set()

    def statistics(self) -> dict[str, int]:
        return {
            **self._stats,
            **{f"candidates_{k}": v for k, v in self._book.statistics().items()},
            "candidates": len(self._book),
            "connected": len(self._host.connected_peers()),
            "routing_table": self._dht.get_routing_table_size(),
        }

    # -- bootstrap --------------------------------------------------------------------

    async def _bootstrap_one(self, info: PeerInfo) -> None:
        if info.peer_id == self._host.peer_id:
            self._bootstrapped.set()  # we are the bootstrap peer ourselves
            return
        backoff = BOOTSTRAP_BACKOFF_FIRST_S
        while True:
            self._stats["bootstrap_attempts"] += 1
            try:
                await self._host.connect(info)
            except PeerUnreachable as exc:
                self._stats["bootstrap_failures"] += 1
                first = str(info.peer_id) not in self.bootstrap_errors
                self.bootstrap_errors[str(info.peer_id)] = exc
                level = logging.WARNING if first else logging.INFO  # said once, loud
                logger.log(level, "bootstrap %s failed (%s); retry in %.2f s",
                           info.peer_id, root_cause(exc), backoff)
                await trio.sleep(backoff * (0.5 + self._rng.random()))  # jitter
                backoff = min(BOOTSTRAP_BACKOFF_MAX_S, backoff * 2)
                continue
            await dht_add_peer(self._dht, info.peer_id)
            logger.info("bootstrapped via %s", info.peer_id)
            self._bootstrapped.set()
            self.poke()
            return

    # -- providers --------------------------------------------------------------------

    async def _provide_loop(self) -> None:
        await self._bootstrapped.wait()
        while True:
            ok = await dht_provide(self._dht, self._key, timeout_s=PROVIDE_TIMEOUT_S)
            self._stats["provides"] += 1
            logger.debug("provided model key (reached remote peers: %s)", ok)
            self.poke()
            with trio.move_on_after(PROVIDE_INTERVAL_S):
                await self._provide_now.wait()
            self._provide_now = trio.Event()

    async def _discover_loop(self) -> None:
        await self._bootstrapped.wait()
        interval = DISCOVERY_INTERVAL_MIN_S
        while True:
            self._wakeup = trio.Event()  # before the round: a wake-up during it is kept
            found_new = await self._discover_once()
            if found_new:
                interval = DISCOVERY_INTERVAL_MIN_S
            elif self._missing_members():
                interval = min(DISCOVERY_INTERVAL_MISSING_S, interval * 2)
            else:
                interval = min(DISCOVERY_INTERVAL_MAX_S, interval * 2)
            with trio.move_on_after(interval):
                await self._wakeup.wait()

    def _missing_members(self) -> bool:
        connected = {str(p) for p in self._host.connected_peers()}
        return any(member not in connected for member in self._members())

    async def _discover_once(self) -> bool:
        """One round: feed the routing table, learn providers, dial new ones.

        Returns whether a connection to a peer not connected before was made."""
        me = self._host.peer_id
        connected = self._host.connected_peers()
        for peer_id in connected:
            await dht_add_peer(self._dht, peer_id)

        # Our own store's records were announced by their providers themselves (the DHT
        # checks the sender); a connected peer's reply is hearsay, weighed by its source.
        learned = [(info, LOCAL_SOURCE) for info in dht_local_providers(self._dht, self._key)]
        asked = self._rng.sample(connected, min(QUERY_FANOUT, len(connected)))
        for peer_id in asked:
            self._stats["provider_queries"] += 1
            try:
                replied = await dht_query_providers(self._dht, peer_id, self._key)
            except PeerUnreachable as exc:
                logger.debug("provider query: %s", exc)
                continue
            learned.extend((info, peer_id.to_base58()) for info in replied)
        now = trio.current_time()
        for info, source in learned:
            if info.peer_id != me:  # an empty address list keeps the known addresses
                self._book.learn(info.peer_id.to_base58(), info, source, now,
                                 replace_info=bool(info.addrs))

        dials = self._book.due(now, self._reached)
        async with trio.open_nursery() as nursery:
            for dial in dials:
                nursery.start_soon(self._dial, dial)
        return bool(dials)  # a dial is news either way: look again soon

    def _reached(self, peer: str) -> bool:
        peer_id = ID.from_base58(peer)
        return self._host.is_connected(peer_id) or self._host.is_relayed(peer_id)

    async def _dial(self, dial: Dial[PeerInfo]) -> None:
        peer_id = dial.info.peer_id
        self._stats["dials"] += 1
        try:
            await self._host.connect(dial.info)
        except PeerUnreachable as exc:
            self._stats["dial_failures"] += 1
            if self._reached(dial.peer_id):  # it dialled us meanwhile: the race is won
                self._book.connected(dial.peer_id)
                return
            failures = self._book.dial_failed(dial.peer_id, trio.current_time())
            if failures == 1 and dial.peer_id in self._book:  # once per outage
                logger.warning("peer %s unreachable (%s); retrying with back-off",
                               peer_id, root_cause(exc))
            else:
                logger.debug("dial provider: %s", exc)
            self._after_failure(peer_id, failures)
            return
        if self._book.failures(dial.peer_id):
            logger.warning("peer %s reachable again", peer_id)
        self._book.connected(dial.peer_id)
        self._ping_now.set()  # its first round trip makes it a candidate
        await dht_add_peer(self._dht, peer_id)
        logger.debug("connected to provider %s", peer_id)

    def _after_failure(self, peer_id: ID, failures: int) -> None:
        """Forget a peer that keeps failing, and at once one the book gave up on (a
        provider never reached: its record must not come back from our own store)."""
        if failures and peer_id.to_base58() not in self._book:
            self._forget(peer_id, quietly=True)
        elif failures == FORGET_AFTER_FAILURES:
            self._forget(peer_id)

    def _forget(self, peer_id: ID, *, quietly: bool = False) -> None:
        """Stop routing to a peer that stopped answering; dials continue with back-off."""
        self._stats["forgotten"] += 1
        level = logging.DEBUG if quietly else logging.INFO
        logger.log(level, "forgetting unresponsive peer %s", peer_id)
        dht_forget_peer(self._dht, self._key, peer_id)
        self._on_forget(str(peer_id))

    # -- liveness ---------------------------------------------------------------------

    async def _liveness_loop(self) -> None:
        tick = min(WARMUP_PING_INTERVAL_S, self._liveness_interval_s)
        # Pings run beside the loop: one waiting out its timeout holds back no other.
        async with trio.open_nursery() as pings:
            while True:
                with trio.move_on_after(WARMING_TICK_S if self._warming() else tick):
                    await self._ping_now.wait()
                self._ping_now = trio.Event()
                self._liveness_tick(pings)

    def _liveness_tick(self, pings: trio.Nursery) -> None:
        """Ping every connected (or relayed) peer that is due and not being pinged."""
        direct = set(self._host.connected_peers())
        connected = direct | self._relayed_members()
        # A gone peer, and one now directly connected that was not at the last tick,
        # start afresh: the latter may be a member we pinged through relays before
        # the dial (those pings fail in a swarm without relays), whose back-off would
        # otherwise hold its first round trip, and so its candidacy, for 10 s or more.
        for fresh in (set(self._next_ping).union(self._ping_failures) - connected) | (
            direct - self._direct
        ):
            self._next_ping.pop(fresh, None)  # a reconnected peer warms up again
            self._rtts_kept.pop(fresh, None)
            self._rtts_unkept.pop(fresh, None)
            self._ping_failures.pop(fresh, None)
            self._relay_ping_failures.pop(fresh, None)
        self._direct = direct
        now = trio.current_time()
        for peer_id in connected:
            if peer_id not in self._pinging and now >= self._next_ping.get(peer_id, now):
                self._pinging.add(peer_id)
                pings.start_soon(self._probe, peer_id)

    def _warming(self) -> bool:
        """A member that joined in the last WARMING_WINDOW_S has no kept round trip yet
        (it is about to connect, may dial us, or its summary came after its first pings):
        the liveness loop ticks fast meanwhile. A tick pings only the peers that are due,
        so this costs no traffic; a member never reached stops it after the window."""
        now = trio.current_time()
        for peer_id, at in list(self._joined.items()):
            if peer_id in self._rtts_kept or now - at > WARMING_WINDOW_S:
                del self._joined[peer_id]
        return bool(self._joined)

    def member_joined(self, peer: str) -> None:
        """Gossip applied the first summary of `peer`: the router skips a peer without a
        round trip, so one is measured now. A connected peer is pinged at once (its earlier
        pings came before its summary, and the table dropped them); one heard through the
        mesh alone wakes discovery to find its address and dial it. Otherwise a new peer
        waits a liveness tick or a discovery interval to become a candidate."""
        try:
            peer_id = ID.from_base58(peer)
        except ValueError:
            return
        if peer_id in self._rtts_kept:
            return  # measured already
        if len(self._joined) < MAX_WARMING or peer_id in self._joined:
            self._joined[peer_id] = trio.current_time()
        self._next_ping.pop(peer_id, None)  # due now (pinged if connected or relayed)
        self._ping_now.set()
        if not self._reached(peer):
            self._wakeup.set()  # heard through the mesh only: look up its address now

    def _relayed_members(self) -> set[ID]:
        """Known members reachable only through relays (behind NAT): pinged like the
        connected ones, so their round trip is measured and they become candidates."""
        out: set[ID] = set()
        for member in self._members():
            try:
                peer_id = ID.from_base58(member)
            except ValueError:
                continue
            if self._host.may_relay_to(peer_id):
                out.add(peer_id)
        return out

    async def _probe(self, peer_id: ID) -> None:
        try:
            await self._ping_once(peer_id)
        finally:
            self._pinging.discard(peer_id)

    async def _ping_once(self, peer_id: ID) -> None:
        self._stats["pings"] += 1
        self._next_ping[peer_id] = trio.current_time() + self._liveness_interval_s
        try:
            rtt = await self._host.ping(peer_id, timeout_s=LIVENESS_TIMEOUT_S)
        except PeerUnreachable as exc:
            self._stats["ping_failures"] += 1
            if not self._host.is_connected(peer_id):  # a member tried through relays
                misses = min(self._relay_ping_failures.get(peer_id, 0) + 1, 16)
                self._relay_ping_failures[peer_id] = misses
                backoff = min(RELAY_PING_BACKOFF_MAX_S, self._liveness_interval_s * 2**misses)
                self._next_ping[peer_id] = trio.current_time() + backoff
                logger.debug("no relayed route to %s (%d in a row): %s", peer_id, misses, exc)
                return
            failures = self._ping_failures.get(peer_id, 0) + 1
            self._ping_failures[peer_id] = failures
            logger.debug("liveness (%d in a row): %s", failures, exc)
            if failures < LIVENESS_FAILURES_TO_DROP:
                return
            # A connection that stopped answering pings is a zombie: drop it so the
            # next discovery round re-dials (or finds the peer really gone).
            del self._ping_failures[peer_id]
            self._stats["zombies_dropped"] += 1
            failures = self._book.dial_failed(peer_id.to_base58(), trio.current_time())
            self._after_failure(peer_id, failures)
            await self._host.disconnect(peer_id)
            self.poke()
            return
        self._ping_failures.pop(peer_id, None)
        self._relay_ping_failures.pop(peer_id, None)
        if not self._on_rtt(str(peer_id), rtt):
            unkept = min(self._rtts_unkept.get(peer_id, 0) + 1, 16)
            self._rtts_unkept[peer_id] = unkept
            gap = min(
                WARMUP_PING_INTERVAL_S * 2 ** (unkept - 1),
                UNKEPT_PING_MAX_INTERVALS * self._liveness_interval_s,
            )
            self._next_ping[peer_id] = trio.current_time() + gap
            return
        self._rtts_unkept.pop(peer_id, None)
        kept = self._rtts_kept.get(peer_id, 0) + 1
        self._rtts_kept[peer_id] = kept
        if kept < RTT_WARMUP_SAMPLES:
            self._next_ping[peer_id] = trio.current_time() + WARMUP_PING_INTERVAL_S
