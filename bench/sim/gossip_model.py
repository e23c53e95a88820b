"""Anti-entropy: publishing by the live `PublishPolicy` and `CacheFilter`, delivery, apply.

Mode `full`: a summary reaches every other peer one one-way delay later (a direct flood;
GossipSub adds mesh hops and IHAVE gossip). Mode `ring`: only the peers whose
`Neighbourhood` holds the publisher, plus the entry peers that looked one of its roots
up; at each publish the `RootAnnouncer` tells the roots' home peers (`HomeRing`), whose
`ProviderIndex` records it. Receivers apply summaries with `PeerTable.apply`.
"""

from __future__ import annotations

from bench.sim.swarm_state import SUMMARY, TICK, SimPeer
from peer.swarm.peer_table import Verdict
from peer.swarm.providers import ProviderIndex
from protocols.framing import encode_frame
from protocols.roots import Ack, Announce, SummaryReply
from protocols.summary import CacheSummary, encode_summary


class GossipModel:
    """The anti-entropy side of `Simulator` (bench/sim/model.py), whose state it uses."""

    def _announce(self, peer: SimPeer, now: float) -> None:
        """Ring mode, at each publish: the holder's RootAnnouncer tells the homes of the
        roots its new summary covers; each home's ProviderIndex records it at once."""
        for msg in peer.announcer.sync(peer.cache.root_hashes(), self._homes, now):
            home = self._index[msg.home]
            index = self._home_index.get(home)
            if index is None:
                index = self._home_index[home] = ProviderIndex()
            for root in msg.drop:
                index.withdraw(root, peer.peer_id)
            kept = sum(index.announce(root, peer.peer_id, now) for root in msg.add)
            if home != peer.idx:
                self._count_exchange(Announce(msg.add, msg.drop), Ack(kept))

    def _tick(self, peer: SimPeer, now: float) -> None:
        """One turn of peer/swarm/gossip.py's publish loop, decided by the same PublishPolicy."""
        if peer.publish_policy.poll(now) is not None:
            self._publish(peer, now)
        self._push(peer.publish_policy.next_deadline(), TICK, peer.idx)

    def _publish(self, peer: SimPeer, now: float) -> None:
        peer.seq += 1
        bloom = peer.filter.current(peer.cache)
        summary = CacheSummary(
            peer_id=peer.peer_id,
            model_id=self.params.model_id,
            block_size=self.params.block_size,
            seq=peer.seq,
            bloom_bits=bloom.num_bits,
            bloom_hashes=bloom.num_hashes,
            bloom=bloom.to_bytes(),
            cached_blocks=peer.cache.public_blocks,
            capacity_blocks=peer.cache.capacity_blocks,
            queued_prompt_tokens=peer.queued_tokens,
            running_requests=peer.running,
            prefill_tokens_per_s=peer.prefill_tps,
            decode_tokens_per_s=peer.decode_tps,
            waiting_requests=len(peer.queue.waiting),
            batch_slots=self.params.max_running,
            batch_decode_tokens_per_s=peer.batch_decode_tps,
            step_tokens=self.params.step_tokens,
        )
        self._latest[peer.idx] = summary
        if self.on_publish is not None:
            self.on_publish(peer.idx, now, summary)
        data = encode_summary(summary)
        size = len(data)
        if self._ring:
            self._reply_bytes[peer.idx] = len(encode_frame(SummaryReply(data).to_wire()))
            self._announce(peer, now)
        peer.published += 1
        peer.bytes_published += size
        self._owe_cpu(peer, peer.cal.summary_publish_s, now)
        audience = len(self._audience[peer.idx])
        self._received += audience
        self._received_bytes += audience * size
        if audience:
            delay = self._one_way()
            self._push(now + delay, SUMMARY, peer.idx, (delay, summary))

    def _deliver_summary(self, source: int, item: tuple[float, CacheSummary], now: float) -> None:
        """A summary reaches its audience (every other peer, or the ring neighbours that
        hear `source`) now. Applying it is deferred to a receiver's
        next routing decision (`_catch_up`); a newer summary from the same source
        replaces it, which PeerTable.apply would do anyway."""
        delay, summary = item
        for receiver in self._audience[source]:  # each one decrypts, checks and relays it
            peer = self.peers[receiver]
            self._owe_cpu(peer, peer.cal.summary_receive_s, now)
        latest = self._delivered[source]
        if latest is None or latest[2].seq < summary.seq:
            self._delivered[source] = (now, delay, summary)

    def _catch_up(self, peer: SimPeer) -> None:
        """Apply, in delivery order and at their delivery times, the summaries delivered
        to `peer` since it last looked."""
        applied = self._applied_seq[peer.idx]
        delivered = self._delivered
        todo = []
        for source in self._sources[peer.idx]:
            latest = delivered[source]
            if latest is not None and latest[2].seq > applied[source]:
                todo.append((latest[0], source, latest))
        todo.sort()
        table = peer.table
        refused = []
        for t, source, (_, delay, summary) in todo:
            applied[source] = summary.seq
            sender = self.peers[source].peer_id
            result = table.apply(summary, sender, t)
            if result.reason is Verdict.TABLE_FULL:
                refused.append(source)
            if result.accepted:
                self._summaries_applied += 1
                table.record_rtt(sender, 2 * delay, t)
            else:
                self._summaries_rejected += 1
        if refused:
            gone = set(refused)
            self._sources[peer.idx] = [s for s in self._sources[peer.idx] if s not in gone]
