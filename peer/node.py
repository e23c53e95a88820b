"""Peer: one swarm member. Owns the host, DHT, pubsub, gossip and discovery in one nursery.

    async with open_peer(config, engine=engine) as peer:
        peer.peer_id, peer.multiaddrs, peer.table, peer.engine, peer.statistics()
        peer.host.libp2p.set_stream_handler(...)      # extra protocols (inference)
        await peer.start_service(serve_something)     # extra services in the peer's nursery

Leaving the block cancels every service and closes the host (sockets included).
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.peer.id import ID
from libp2p.pubsub.pubsub import Pubsub

from peer import views
from peer.config import GossipMode, PeerConfig
from peer.engine.api import EngineView, GeneratingEngine
from peer.engine.compute_thread import compute_thread
from peer.net.discovery import Discovery
from peer.net.host import SwarmHost, open_host
from peer.net.host_services import new_dht, new_pubsub, run_service
from peer.net.punch_service import direct_remote
from peer.net.relay_service import peer_addrs
from peer.swarm.gossip import Gossip
from peer.swarm.lookup import RootLookup
from peer.swarm.peer_table import PeerTable
from protocols.ids import provider_key_multihash
from protocols.invite import Invite, encode_invite, is_invite_addr

if TYPE_CHECKING:  # serving is imported only by peers with a model
    from peer.engine.api import SamplingParams
    from peer.request.generation import GenerationChunk, GenerationResult, Prompt
    from peer.request.request_log import CacheSample, RequestLog
    from peer.request.serving import Serving

INVITE_ADDRS = 4  # a few ways in: this peer's addresses first, then known peers'

logger = logging.getLogger(__name__)

# GossipSub mesh degree: each summary is relayed to ~3 peers per hop; measured cost is
# ~7 ms CPU per 4 KiB message per receiver, and every mesh neighbour sends each message
# once (duplicates cost reading, decrypting and parsing before they are dropped), so
# small meshes keep gossip cheap; with 3 (2..4) a swarm of hundreds is a few hops deep.
# (With D_high 6, meshes in an 8-peer swarm grew to 5-6 as every peer grafted.)
MESH_DEGREE, MESH_DEGREE_LOW, MESH_DEGREE_HIGH = 3, 2, 4
# Ping every connected peer at most this often (RTTs for the router, zombie detection);
# each ping opens a stream, so not more often than RTTs change.
LIVENESS_INTERVAL_MIN_S = 5.0


class Peer:
    """A running swarm member; services are attributes, the nursery is the seam."""

    def __init__(
        self,
        *,
        config: PeerConfig,
        host: SwarmHost,
        dht: KadDHT,
        pubsub: Pubsub,
        table: PeerTable,
        engine: EngineView,
        gossip: Gossip,
        discovery: Discovery,
        nursery: trio.Nursery,
        serving: Serving | None = None,
        lookup: RootLookup | None = None,
    ) -> None:
        self.config = config
        self.host = host
        self.dht = dht
        self.pubsub = pubsub
        self.table = table
        self.engine = engine
        self.gossip = gossip
        self.discovery = discovery
        self.serving = serving
        self.lookup = lookup  # gossip mode ring only
        self._nursery = nursery

    @property
    def peer_id(self) -> str:
        return self.host.peer_id.to_base58()

    @property
    def multiaddrs(self) -> list[str]:
        """Dialable addresses, each ending in /p2p/<peer id>."""
        return self.host.multiaddrs

    async def drain(self, timeout_s: float) -> int:
        """Leave gently: refuse forwarded requests from now on and wait, up to
        `timeout_s`, for those in flight here to end; the requests still running then."""
        await self.gossip.publish_leaving()  # drop this peer now, not after 3 intervals
        if self.serving is None:
            return 0
        return await self.serving.drain(timeout_s)

    def invite(self) -> str | None:
        """One string that hands this swarm to someone (protocols/invite.py): the model id,
        this peer's dialable addresses, then known peers' up to INVITE_ADDRS; None while
        no address is known (behind NAT, before a relay slot)."""
        addrs = list(self.multiaddrs)
        for view in self.table.views(trio.current_time()):
            suffix = f"/p2p/{view.peer_id}"
            addrs += [a if a.endswith(suffix) else a + suffix for a in view.addrs]
        usable = [a for a in dict.fromkeys(addrs) if is_invite_addr(a)][:INVITE_ADDRS]
        if not usable:
            return None
        invite = Invite(self.engine.model_id, tuple(usable), self.config.swarm_name)
        return encode_invite(invite)

    @property
    def reachability(self) -> str:
        """'public', 'private' (behind NAT: served through relays) or 'unknown'."""
        return self.host.reachability().value

    def link_to(self, peer_id: str) -> str | None:
        """'direct' (a connection), 'relayed' (through a relay recently) or None."""
        pid = ID.from_base58(peer_id)
        if self.host.is_connected(pid):
            return "direct"
        return "relayed" if self.host.is_relayed(pid) else None

    async def start_service(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run `fn(*args, task_status=...)` in the peer's nursery (`nursery.start`)."""
        return await self._nursery.start(fn, *args)

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run `fn(*args)` in the peer's nursery; it is cancelled when the peer closes."""
        self._nursery.start_soon(fn, *args)

    # -- what the faces use (peer/api/http.py's HttpPeer) ------------------------------------

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def max_context(self) -> int:
        """The model's context window (an AttributeError on a cache-only engine)."""
        generating = self.engine.generating()
        if generating is None:
            raise AttributeError("a cache-only engine has no context window")
        return generating.max_context

    @property
    def generation(self) -> Serving | None:
        """The peer's GenerationService (peer/request/generation.py);
        None on a cache-only engine."""
        return self.serving

    @property
    def request_log(self) -> RequestLog | None:
        """The last requests that entered here and ended (None without serving)."""
        return self.serving.requests if self.serving is not None else None

    def observe_queue_wait(self, observe: Callable[[float], None]) -> None:
        """Call ``observe(seconds)`` with each request's wait for the engine's first step
        (engines without a queue never call it)."""
        generating = self.engine.generating()
        if generating is not None:
            generating.queue_wait_observers.append(observe)

    def cache_sample(self, now: float) -> CacheSample:
        """The engine's prefix-cache counters and size now (for the page's history)."""
        return views.cache_sample(self.engine, now)

    def swarm_view(self) -> dict[str, Any]:
        """This peer's view of the swarm as plain JSON (GET /v1/swarm)."""
        holepunch = self.host.holepunch
        return views.swarm_view(
            now=trio.current_time(),
            engine=self.engine,
            table=self.table,
            peer_id=self.peer_id,
            addrs=self.multiaddrs,
            policy=self.config.policy.value,
            reachability=self.reachability,
            invite=self.invite(),
            trust=self.serving.trust if self.serving is not None else None,
            holepunch=holepunch.statistics() if holepunch is not None else None,
            gossip_counts=self.gossip.gossip_counts(),
            link_to=self.link_to,
            link_remote=self.link_remote,
            forward_extra_s=(self.serving.router.forward_overhead.extra_s
                             if self.serving is not None else None),
        )

    def _serving(self) -> Serving:
        if self.serving is None:
            raise RuntimeError("this peer runs a cache-only engine: it cannot generate")
        return self.serving

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: bytes | None = None,
        timeout_s: float | None = None,
    ) -> GenerationResult:
        """Complete `prompt` (text, chat messages or token ids) on the best peer.

        Raises InvalidRequest, Overloaded, DeadlineExceeded or RequestFailed."""
        return await self._serving().generate(
            prompt, params, request_id=request_id, cache_salt=cache_salt, timeout_s=timeout_s
        )

    def stream(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: bytes | None = None,
        timeout_s: float | None = None,
    ) -> AsyncGenerator[GenerationChunk | GenerationResult, None]:
        """Like generate(), as chunks then the result; close it (aclosing) when done."""
        return self._serving().stream(
            prompt, params, request_id=request_id, cache_salt=cache_salt, timeout_s=timeout_s
        )

    def link_remote(self, peer_id: str) -> str | None:
        """'ip:port' at the other end of a direct connection to the peer, else None (so a
        connection through a relay's address can be told from one to the peer itself)."""
        return direct_remote(self.host, ID.from_base58(peer_id))

    def _holepunch_counters(self) -> dict[str, int]:
        """The upgrade counters, exported with the relay events in /metrics."""
        stats = self.host.holepunch.statistics() if self.host.holepunch else {}
        return {k: v for k, v in stats.items() if k.startswith("holepunch_")}

    def statistics(self) -> dict[str, Any]:
        """Membership and gossip counters (a snapshot; plain JSON types)."""
        now = trio.current_time()
        gossip = self.gossip.statistics()
        generating = self.engine.generating()
        return {
            "peer_id": self.peer_id,
            "peers_known": len(self.table.views(now)),
            "peers_connected": len(self.host.connected_peers()),
            "gossip_bytes_in": gossip["bytes_in"],
            "gossip_bytes_out": gossip["bytes_out"],
            "summaries_published": gossip["published"],
            "summaries_accepted": gossip["accepted"],
            "summaries_rejected": gossip["rejected"],
            "peers_expired": gossip["expired"],
            "gossip": gossip,
            "discovery": self.discovery.statistics(),
            "reach": (
                {**self.host.reach.statistics(), **self._holepunch_counters()}
                if self.host.reach
                else None
            ),
            "holepunch": self.host.holepunch.statistics() if self.host.holepunch else None,
            "serving": self.serving.statistics() if self.serving else None,
            "lookup": self.lookup.statistics() if self.lookup else None,
            "engine": dict(generating.statistics()) if generating is not None else None,
        }


def _load_engine(config: PeerConfig) -> GeneratingEngine:
    """Load config.model (blocking: seconds to minutes); run it in a worker thread."""
    from peer.engine.engine import load_engine  # torch: import only when a model is needed

    return load_engine(config.model, config.cache_bytes, config.block_size,
                       **config.load_options())


def _note_peer(table: PeerTable, host: SwarmHost, peer_id: str, rtt_s: float) -> bool:
    """A measured round trip: record it and the addresses the peer advertises."""
    table.note_addrs(peer_id, peer_addrs(host.libp2p, ID.from_base58(peer_id)))
    return table.record_rtt(peer_id, rtt_s, trio.current_time())


@asynccontextmanager
async def open_peer(config: PeerConfig, engine: EngineView | None = None) -> AsyncIterator[Peer]:
    """Start a peer (loading the model from config.model unless `engine` is given)."""
    if engine is None:
        engine = await compute_thread().run(_load_engine, config)
    async with open_host(config) as host:
        self_id = host.peer_id.to_base58()
        table = PeerTable(
            self_id=self_id,
            model_id=engine.model_id,
            block_size=engine.block_size,
            expiry_s=config.summary_expiry_s,
        )
        dht = new_dht(host)
        pubsub = new_pubsub(
            host, degree=MESH_DEGREE, degree_low=MESH_DEGREE_LOW, degree_high=MESH_DEGREE_HIGH
        )
        discovery = Discovery(
            host,
            dht,
            provider_key_multihash(engine.model_id),
            config.bootstrap,
            liveness_interval_s=max(LIVENESS_INTERVAL_MIN_S, config.summary_interval_s),
            rng=random.Random(),
            on_rtt=lambda peer, rtt: _note_peer(table, host, peer, rtt),
            on_forget=table.remove,
            members=lambda: [view.peer_id for view in table.views(trio.current_time())],
        )
        gossip = Gossip(
            pubsub,
            table,
            engine,
            peer_id=host.peer_id,
            interval_s=config.summary_interval_s,
            fp_rate=config.bloom_fp_rate,
            mode=config.gossip_mode,
            neighbours=config.gossip_neighbours,
            reachable=lambda peer: host.is_connected(peer) or host.is_relayed(peer),
            disconnect=host.disconnect,
            on_joined=discovery.member_joined,
        )
        lookup = None
        # the lookup beyond the ring (peer/swarm/lookup.py)
        if config.gossip_mode is GossipMode.RING:
            lookup = RootLookup(
                host, table, engine, gossip, self_id=self_id,
                interval_s=config.summary_interval_s, rng=random.Random(),
                budget_s=config.lookup_wait_s,
            )
            lookup.serve(host.libp2p)
            gossip.set_root_listener(lookup.on_published)
        async with (
            run_service(dht),
            run_service(pubsub),
            run_service(pubsub.router),
            trio.open_nursery() as nursery,
        ):
            await nursery.start(gossip.run)
            if lookup is not None:
                await nursery.start(lookup.run)
            await nursery.start(discovery.run)
            if host.reach is not None:
                host.reach.on_addrs_changed = discovery.provide_soon
                await nursery.start(host.reach.run)
            if host.holepunch is not None:
                await nursery.start(host.holepunch.run)
            if config.mdns:
                from peer.net.lan import LanDiscovery  # zeroconf: only peers that ask for mDNS

                await nursery.start(LanDiscovery(host, on_connect=discovery.poke).run)
            serving = None
            generating = engine.generating()  # None: a cache-only engine, it cannot serve
            if generating is not None:
                from peer.request.serving import Serving

                serving = Serving(
                    config=config, engine=generating, table=table, host=host,
                    self_id=self_id,
                    sign=host.libp2p.get_private_key().sign,
                    before_route=(
                        lookup.before_route if lookup is not None and config.lookup_wait_s > 0
                        else None
                    ),
                )
                await nursery.start(serving.serve, host.libp2p)
                nursery.start_soon(generating.refresh_speeds)
                if host.reach is not None:  # a quarantined peer gets no relay slot from us
                    trust = serving.trust
                    host.reach.set_reservation_filter(lambda pid: not trust.routable(pid))
            peer = Peer(
                config=config,
                host=host,
                dht=dht,
                pubsub=pubsub,
                table=table,
                engine=engine,
                gossip=gossip,
                discovery=discovery,
                nursery=nursery,
                serving=serving,
                lookup=lookup,
            )
            logger.info("peer %s up at %s", peer.peer_id, ", ".join(peer.multiaddrs))
            try:
                yield peer
            finally:
                nursery.cancel_scope.cancel()
