"""Anti-entropy: publish this peer's cache summary, validate and apply everyone else's.

When to publish is decided by the pure `peer.swarm.publish_policy.PublishPolicy` (every
`interval_s`, and early once 5% of the cached blocks changed, at most once per
`interval_s / 4`), fed with the radix cache's stored/removed events; the simulator drives
the same object. The Bloom filter is kept current from the same events and sized for
publishing by the pure `peer.swarm.incremental_bloom.CacheFilter`, which the simulator
uses too.

Two gossip modes (peer.config.GossipMode; docs/protocol.md, "Gossip modes"):
- `full`: one topic per model (`/prefixswarm/summary/1/<model>`); every summary floods
  to every peer, so each peer receives N - 1 summaries per interval.
- `ring`: each peer publishes on its own topic (`/prefixswarm/summary/2/<model>/@<id>`)
  and subscribes to the topics of its ring neighbours (peer.swarm.neighbourhood, chosen among
  the connected ring peers, re-chosen every interval): a bounded number per interval
  whatever the swarm's size. A ring peer still listens on the version-1 topic, so it
  understands peers of the previous version (they are in its table); it does not
  publish there, so they do not hear it (docs/protocol.md).
  Beyond its neighbours a ring peer also listens to the extra peers its lookup chose
  (peer/swarm/lookup.py `hear`): it subscribes to the topics of neighbours and extra peers
  together, and forgets a peer once it is neither. After each publish, the roots the
  summary covers go to the root listener (the lookup's announcer).

Received summaries are checked inside pubsub's topic validator, so a rejected message
is neither applied nor forwarded: size and schema (protocols.summary.decode_summary),
sender identity against the signed gossip source (and, on a ring topic, against the
topic's owner), then PeerTable.apply (model id, block size, increasing seq, Bloom
sanity). Each rejection is logged and counted by reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub

from peer.config import DEFAULT_GOSSIP_NEIGHBOURS, GossipMode
from peer.engine.api import EngineView
from peer.swarm.delivery_counts import DeliveryCounts
from peer.swarm.gossip_gate import GRAYLIST_S, GateVerdict, GossipGate
from peer.swarm.incremental_bloom import CacheFilter
from peer.swarm.local_summary import build_summary
from peer.swarm.neighbourhood import Neighbourhood
from peer.swarm.peer_table import MAX_PEERS, PeerTable, Verdict
from peer.swarm.publish_policy import PublishPolicy
from peer.swarm.rejections import Rejections
from peer.version import version
from protocols.bloom import BloomFilter
from protocols.errors import RemoteProtocolError
from protocols.ids import gossip_topic, ring_topic
from protocols.summary import MAX_SUMMARY_BYTES, CacheSummary, decode_summary, encode_summary

logger = logging.getLogger(__name__)
SOFTWARE = f"prefixswarm/{version()}"  # in every summary: peers flag older software

PUBLISH_TIMEOUT_S = 5.0  # publishing queues to mesh peers; a stall must not stop the loop
# Table verdicts that say nothing bad about the message: relayed, not applied.
_NOT_THE_SENDERS_FAULT = frozenset({Verdict.STALE_SEQ, Verdict.TABLE_FULL, Verdict.UNPROVEN_FULL})


class Gossip:
    """Publishes our summary and feeds received ones into the PeerTable."""

    def __init__(
        self,
        pubsub: Pubsub,
        table: PeerTable,
        engine: EngineView,
        *,
        peer_id: ID,
        interval_s: float,
        fp_rate: float,
        on_expired: Callable[[list[str]], None] = lambda peers: None,
        on_joined: Callable[[str], None] = lambda peer: None,
        mode: GossipMode = GossipMode.FULL,
        neighbours: int = DEFAULT_GOSSIP_NEIGHBOURS,
        reachable: Callable[[ID], bool] = lambda peer: False,
        disconnect: Callable[[ID], Awaitable[None]] | None = None,
    ) -> None:
        """`reachable`: whether this peer holds a connection (direct or relayed) to a
        summary's origin; the table admits origins never reached only to a share of it.
        `disconnect`: close the connection to a graylisted forwarder. `on_joined`: a
        peer the table did not hold has its first summary applied."""
        self._pubsub = pubsub
        self._reachable = reachable
        self._disconnect_peer = disconnect
        self._table = table
        self._engine = engine
        self._peer_id = peer_id
        self._peer_id_str = peer_id.to_base58()
        self._mode = mode
        self._legacy_topic = gossip_topic(engine.model_id)
        # where we publish: the swarm's topic, or our own ring topic
        self._topic = (
            self._legacy_topic
            if mode is GossipMode.FULL
            else ring_topic(engine.model_id, self._peer_id_str)
        )
        self._neighbourhood = Neighbourhood(self._peer_id_str, neighbours)
        # ring mode: the extra peers a lookup chose to hear (peer/swarm/lookup.py), and for
        # each peer listened to (neighbours and extra ones) its reader's cancel scope
        self._extra: frozenset[str] = frozenset()
        self._listening: dict[str, trio.CancelScope] = {}
        self._reconciling = trio.Lock()
        self._extra_changed = trio.Event()
        self._on_roots: Callable[[list[int]], None] | None = None
        self._last_data: bytes | None = None  # the last summary published, encoded
        self._interval_s = interval_s
        self._policy = PublishPolicy(interval_s)
        self._fp_rate = fp_rate
        self._on_expired = on_expired
        self._on_joined = on_joined
        self._on_published: Callable[[CacheSummary, float], None] | None = None
        self._on_accepted: Callable[[CacheSummary, float], None] | None = None
        # Start seq at wall-clock milliseconds: a peer restarted with the same identity
        # continues above its old seq, which receivers may still hold (an id, not a
        # decision: nothing is timed by it).
        self._seq = int(time.time() * 1000)
        # The filter of the cached blocks, kept current from the cache's events instead of
        # rebuilt from every cached hash (~20 us per hash) at each publish.
        self._filter = CacheFilter(fp_rate)
        self._publishing = True
        self._rejections = Rejections(logger)
        # per sender, for as many senders as the table holds peers
        self._delivery = DeliveryCounts(MAX_PEERS)
        self._cpu_s = 0.0
        self._gate = GossipGate()
        self._stats = {
            "published": 0,
            "published_early": 0,
            "publish_failures": 0,
            "bytes_out": 0,
            "received": 0,
            "bytes_in": 0,
            "accepted": 0,
            "superseded": 0,
            "delivered": 0,
            "expired": 0,
            "left": 0,
            "neighbours_joined": 0,
            "neighbours_left": 0,
        }

    @property
    def topic(self) -> str:
        """The topic this peer publishes on."""
        return self._topic

    @property
    def mode(self) -> GossipMode:
        return self._mode

    @property
    def neighbours(self) -> frozenset[str]:
        """Ring mode: our ring neighbours, whose summaries we hear (empty in full mode)."""
        return self._neighbourhood.members

    @property
    def listening(self) -> frozenset[str]:
        """Ring mode: every peer whose ring topic we are subscribed to now."""
        return frozenset(self._listening)

    def hear(self, extra: frozenset[str]) -> None:
        """Ring mode: listen to these peers too, beyond the neighbours (a lookup's
        Interest); peers dropped from the set are unsubscribed and forgotten."""
        self._extra = frozenset(extra)
        self._extra_changed.set()

    def set_root_listener(self, on_roots: Callable[[list[int]], None] | None) -> None:
        """Call `on_roots(roots)` after each publish with the prefix roots the summary
        covers (RadixCache.root_hashes at build time)."""
        self._on_roots = on_roots

    def last_summary(self) -> bytes | None:
        """The last summary published (wire bytes), or None before the first."""
        return self._last_data

    def ring_peers(self) -> list[str]:
        """Connected peers subscribed to their own ring topic: the ring as we know it (a
        version-1 peer is not on it; it is heard on the version-1 topic anyway)."""
        topics = self._pubsub.peer_topics
        known = []
        for peer_id in list(self._pubsub.peers):
            name = peer_id.to_base58()
            if peer_id in topics.get(self._ring_topic(name), ()):
                known.append(name)
        return known

    def set_hooks(
        self,
        *,
        on_published: Callable[[CacheSummary, float], None] | None = None,
        on_accepted: Callable[[CacheSummary, float], None] | None = None,
    ) -> None:
        """Observe each summary published / accepted, with the wall-clock time (bench)."""
        self._on_published = on_published
        self._on_accepted = on_accepted

    def set_publishing(self, enabled: bool) -> None:
        """Stop or resume publishing (a benchmark baseline; peers then expire us)."""
        self._publishing = enabled

    def statistics(self) -> dict[str, Any]:
        """Counters; `cpu_s` is the thread CPU time spent building, publishing and
        validating summaries (not pubsub's own signing, relaying and transport)."""
        router = self._pubsub.router
        return {
            **self._stats,
            "mode": self._mode.value,
            "neighbours": sorted(self._neighbourhood.members),
            "extra_peers": sorted(self._extra),
            "mesh_peers": len(getattr(router, "mesh", {}).get(self._topic, ())),
            "topic_peers": len(self._pubsub.peer_topics.get(self._topic, ())),
            "rejected": self._rejections.counts,
            "rejected_total": sum(self._rejections.counts.values()),
            "gate": {str(v): n for v, n in self._gate.counts.items()},
            "graylisted": self._gate.graylisted,
            "seq": self._seq,
            "cpu_s": self._cpu_s,
        }

    def gossip_counts(self) -> dict[str, Any]:
        """What this peer published and received per sender (peer/swarm/delivery_counts.py):
        what a testbed compares across peers to find summaries that never arrived."""
        return self._delivery.snapshot(self._stats["published"], self._stats["publish_failures"])

    def _live(self, peer_id: str) -> bool:
        return self._table.get(peer_id, trio.current_time()) is not None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Subscribe, then publish and expire until cancelled."""
        topics = [self._legacy_topic]
        if self._mode is GossipMode.RING:
            topics.append(self._topic)  # our own: its mesh carries our summaries
        push_msg = self._pubsub.push_msg
        self._pubsub.push_msg = self._gated(push_msg)  # type: ignore[method-assign,assignment]
        try:
            async with trio.open_nursery() as nursery:
                for topic in topics:
                    owner = None if topic == self._legacy_topic else self._peer_id_str
                    self._pubsub.set_topic_validator(topic, self._validator(owner), False)
                    nursery.start_soon(self._drain, await self._pubsub.subscribe(topic))
                nursery.start_soon(self._publish_loop, nursery)
                if self._mode is GossipMode.RING:
                    nursery.start_soon(self._extra_loop, nursery)
                task_status.started()
        finally:
            self._pubsub.push_msg = push_msg  # type: ignore[method-assign]
            for topic in [*topics, *(self._ring_topic(p) for p in self._listening)]:
                self._pubsub.remove_topic_validator(topic)

    def _gated(
        self, push_msg: Callable[[ID, rpc_pb2.Message], Awaitable[None]]
    ) -> Callable[[ID, rpc_pb2.Message], Awaitable[None]]:
        """pubsub's push_msg behind the gossip gate (peer/swarm/gossip_gate.py): a
        summary from an unproven identity is looked at before its signature is checked."""

        async def gated(forwarder: ID, msg: rpc_pb2.Message) -> None:
            verdict = self._gate_verdict(forwarder, msg)
            if verdict is GateVerdict.CHECK:
                await push_msg(forwarder, msg)
            elif verdict is GateVerdict.NO_ROOM:  # not relayed, and not fetched again
                self._pubsub.seen_messages.add(self._pubsub.get_message_id(msg))
            elif verdict is GateVerdict.GRAYLIST and not self._pubsub.is_peer_blacklisted(
                forwarder
            ):
                logger.warning("graylisting %s for %.0f s: it keeps sending summaries of "
                               "identities this peer cannot take", forwarder, GRAYLIST_S)
                self._pubsub.add_to_blacklist(forwarder)  # no stream of ours to it...
                with trio.move_on_after(PUBLISH_TIMEOUT_S):  # ...nor of its to us: the
                    await self._disconnect(forwarder)  # next one is refused when opened

        return gated

    def _gate_verdict(self, forwarder: ID, msg: rpc_pb2.Message) -> GateVerdict:
        try:
            origin = ID(msg.from_id)
        except Exception:  # not an id: pubsub's own checks drop it
            return GateVerdict.CHECK
        if origin == self._peer_id:
            return GateVerdict.CHECK
        now = trio.current_time()
        origin_str = origin.to_base58()
        return self._gate.decide(
            forwarder.to_base58(),
            proven=self._table.is_proven(origin_str) or self._reachable(origin),
            held=self._table.holds(origin_str),
            room=self._table.room_for_unproven(now),
            now=now,
        )

    async def _disconnect(self, peer: ID) -> None:
        if self._disconnect_peer is not None:
            await self._disconnect_peer(peer)

    def _end_graylists(self, now: float) -> None:
        for forwarder in self._gate.graylist_ended(now):
            self._pubsub.remove_from_blacklist(ID.from_base58(forwarder))

    def _ring_topic(self, peer_id: str) -> str:
        return ring_topic(self._engine.model_id, peer_id)

    def _validator(self, owner: str | None) -> Callable[[ID, rpc_pb2.Message], bool]:
        return lambda forwarder, msg: self._validate(forwarder, msg, owner)

    async def _update_neighbours(self, nursery: trio.Nursery) -> None:
        """Ring mode: re-choose the neighbourhood among the ring peers we are connected
        to, then listen to who joined and stop listening to who left."""
        change = self._neighbourhood.update(self.ring_peers())
        self._stats["neighbours_left"] += len(change.removed)
        self._stats["neighbours_joined"] += len(change.added)
        await self._reconcile(nursery)

    async def _extra_loop(self, nursery: trio.Nursery) -> None:
        while True:
            await self._extra_changed.wait()
            self._extra_changed = trio.Event()
            await self._reconcile(nursery)

    async def _reconcile(self, nursery: trio.Nursery) -> None:
        """Subscribe to the ring topics of neighbours and extra peers, and only those; a
        peer we stop listening to is dropped from the table (its summaries stop)."""
        async with self._reconciling:
            wanted = self._neighbourhood.members | self._extra
            # (py-libp2p changes its local subscriptions before announcing them to every
            # peer; a stalled announcement must not stop the publish loop)
            for peer_id in sorted(set(self._listening) - wanted):
                self._listening.pop(peer_id).cancel()
                topic = self._ring_topic(peer_id)
                with trio.move_on_after(PUBLISH_TIMEOUT_S):
                    await self._pubsub.unsubscribe(topic)
                self._pubsub.remove_topic_validator(topic)
                self._table.remove(peer_id)  # no longer hears its summaries
            for peer_id in sorted(wanted - set(self._listening)):
                topic = self._ring_topic(peer_id)
                self._pubsub.set_topic_validator(topic, self._validator(peer_id), False)
                with trio.move_on_after(PUBLISH_TIMEOUT_S):
                    await self._pubsub.subscribe(topic)
                subscription = await self._pubsub.subscribe(topic)  # subscribed: at once
                scope = trio.CancelScope()
                self._listening[peer_id] = scope
                nursery.start_soon(self._drain_until_cancelled, subscription, scope)

    async def _drain_until_cancelled(self, subscription: Any, scope: trio.CancelScope) -> None:
        with scope:
            await self._drain(subscription)

    # -- publishing -------------------------------------------------------------------

    async def _drain(self, subscription: Any) -> None:
        # Summaries are applied in the validator; the subscription only has to be read
        # promptly: its queue holds 32 messages and drops silently when full.
        async for _msg in subscription:
            self._stats["delivered"] += 1

    def _count_changes(self, *, for_policy: bool = True) -> None:
        """Drain the cache's events into the filter and (unless they are going into the
        summary being built) the publish policy's count."""
        events = self._engine.cache.drain_events()
        self._filter.observe(events)
        if for_policy:
            self._policy.observe(events, self._engine.cache.public_blocks)

    def _current_bloom(self) -> BloomFilter:
        """A filter of exactly the cached hashes, in the shape to publish now."""
        self._count_changes(for_policy=False)
        return self._filter.current(self._engine.cache).to_filter()

    async def _publish_loop(self, nursery: trio.Nursery) -> None:
        while True:
            now = trio.current_time()
            self._count_changes()
            decision = self._policy.poll(now)
            if decision is not None:
                if self._mode is GossipMode.RING and not decision.early:
                    await self._update_neighbours(nursery)
                await self._publish(early=decision.early)
            self._end_graylists(now)
            expired = self._table.expire(now)
            if expired:
                self._stats["expired"] += len(expired)
                logger.info(
                    "peers expired (no summary for %.1f s): %s", self._table.expiry_s, expired
                )
                self._on_expired(expired)
            await trio.sleep_until(self._policy.next_deadline())

    async def publish_leaving(self) -> None:
        """Tell the swarm this peer stops (one last summary, `leaving`), then publish no more."""
        if self._publishing:
            await self._publish(early=True, leaving=True)
            self._publishing = False

    async def _publish(self, *, early: bool, leaving: bool = False) -> None:
        if not self._publishing:
            return
        start = time.thread_time()
        self._seq += 1
        self._delivery.published(self._seq)
        summary = build_summary(
            self._engine,
            peer_id=self._peer_id_str,
            seq=self._seq,
            fp_rate=self._fp_rate,
            bloom=self._current_bloom(),
            software=SOFTWARE,
            leaving=leaving,
        )
        data = encode_summary(summary)
        roots = self._engine.cache.root_hashes() if self._on_roots is not None else []
        try:
            with trio.fail_after(PUBLISH_TIMEOUT_S):
                await self._pubsub.publish(self._topic, data)
        except trio.TooSlowError:
            self._stats["publish_failures"] += 1
            logger.warning("publishing summary seq %d timed out", summary.seq)
            return
        finally:
            self._cpu_s += time.thread_time() - start
        self._stats["published"] += 1
        self._stats["published_early"] += int(early)
        self._stats["bytes_out"] += len(data)
        self._last_data = data
        if self._on_roots is not None:
            self._on_roots(roots)
        if self._on_published is not None:
            self._on_published(summary, time.time())

    # -- receiving --------------------------------------------------------------------

    def _validate(self, forwarder: ID, msg: rpc_pb2.Message, owner: str | None) -> bool:
        """pubsub topic validator: True applies and forwards, False drops. `owner`: the
        peer whose ring topic this is (None for the swarm's version-1 topic)."""
        start = time.thread_time()
        try:
            return self._check(msg, owner)
        except Exception:  # a bug here must not kill pubsub's task: reject and say so
            logger.exception("summary validator failed")
            self._rejections.count("internal_error")
            return False
        finally:
            self._cpu_s += time.thread_time() - start

    def _check(self, msg: rpc_pb2.Message, owner: str | None) -> bool:
        source = ID(msg.from_id)
        if source == self._peer_id:
            return True  # our own summary coming back
        source_str = source.to_base58()
        if owner is not None and source_str != owner:
            return self._reject(source_str, "wrong_topic", f"published on {owner}'s topic")
        self._stats["received"] += 1
        self._stats["bytes_in"] += len(msg.data)
        if len(msg.data) > MAX_SUMMARY_BYTES:
            return self._reject(source_str, "oversize", f"{len(msg.data)} bytes")
        try:
            summary = decode_summary(msg.data)
        except RemoteProtocolError as exc:
            return self._reject(source_str, "malformed", str(exc))
        # The table checks identity (summary.peer_id == the signed gossip source),
        # model, block size, increasing seq and Bloom plausibility.
        result = self._table.apply(
            summary, source_str, trio.current_time(), reachable=self._reachable(source)
        )
        if not result.accepted and result.reason in _NOT_THE_SENDERS_FAULT:
            # A summary overtaken by a newer one (paths differ in delay) is valid, just
            # not news: relay it and let pubsub mark it seen. Rejecting it would make
            # pubsub penalise the forwarder and re-fetch it on every IHAVE (measured:
            # an 8-process swarm under load collapsed to 23% delivery).
            self._stats["superseded"] += 1
            held = self._table.get(source_str, trio.current_time())
            if held is not None and summary.seq < held.summary.seq:  # not a duplicate
                self._delivery.late(source_str, self._live)
            logger.debug("summary from %s not applied: %s", source_str, result.detail)
            return True
        if not result.accepted:
            return self._reject(source_str, str(result.reason), result.detail)
        self._stats["accepted"] += 1
        self._delivery.accepted(source_str, summary.seq, self._live)
        if result.reason is Verdict.LEFT:
            self._stats["left"] += 1
            logger.info("peer %s left the swarm", source_str)
            self._on_expired([source_str])
            return True
        if result.reason is Verdict.NEW_PEER:
            self._on_joined(source_str)
        if self._on_accepted is not None:
            self._on_accepted(summary, time.time())
        return True

    def _reject(self, source: str, reason: str, detail: str) -> bool:
        return self._rejections.reject(source, reason, detail)
