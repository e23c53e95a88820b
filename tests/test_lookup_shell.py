"""peer/swarm/lookup.py's shell under a virtual clock, over in-memory streams: holders
announce, homes answer, entry peers find holders within the budget; a stalled home
costs at most the budget, a peer of the previous version is refused cleanly, and what
a remote peer claims is checked before it counts (docs/protocol.md 5.4)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import trio
import trio.testing
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from peer.config import DEFAULT_LOOKUP_WAIT_S
from peer.engine.radix import RadixCache
from peer.net.wire import PeerUnreachable
from peer.swarm.bloom_sizing import summary_bloom
from peer.swarm.lookup import RootLookup
from peer.swarm.peer_table import PeerTable
from peer.swarm.providers import ANNOUNCE_REFRESH_S, HomeRing
from protocols.blocks import BlockHasher
from protocols.summary import CacheSummary, encode_summary
from tests.fake_host import new_peer_id

MODEL = "smollm2-135m"
BS = 16


class _Conn:
    def __init__(self, peer_id: str) -> None:
        self.peer_id = ID.from_base58(peer_id)


class _Side:
    """One end of an in-memory stream, with libp2p's stream methods and errors."""

    def __init__(self, stream: Any, remote: str) -> None:
        self._stream = stream
        self.muxed_conn = _Conn(remote)

    async def write(self, data: bytes) -> None:
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise BaseLibp2pError(f"stream reset: {exc!r}") from exc

    async def read(self, n: int) -> bytes:
        try:
            return bytes(await self._stream.receive_some(n))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise BaseLibp2pError(f"stream reset: {exc!r}") from exc

    async def close(self) -> None:
        await self._stream.send_stream.aclose()

    async def reset(self) -> None:
        await self._stream.aclose()


class _Net:
    """Peers reachable by id; `refusing` ones lack the protocol (a previous version),
    `stalling` ones never answer a dial."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.nodes: dict[str, _Node] = {}
        self.refusing: set[str] = set()
        self.stalling: set[str] = set()


class _Host:
    def __init__(self, net: _Net, me: str) -> None:
        self._net = net
        self._me = me

    async def new_stream(self, peer_id: ID, protocols: Sequence[str], *, timeout_s: float) -> Any:
        target = peer_id.to_base58()
        if target in self._net.stalling:
            await trio.sleep(timeout_s)
            raise PeerUnreachable(f"stream to {target} timed out")
        if target in self._net.refusing or target not in self._net.nodes:
            raise PeerUnreachable(f"stream to {target} failed: protocol not supported")
        mine, theirs = trio.testing.memory_stream_pair()
        self._net.nursery.start_soon(
            self._net.nodes[target].lookup.handle_stream, _Side(theirs, self._me)
        )
        return _Side(mine, target)

    def is_connected(self, peer_id: ID) -> bool:
        return peer_id.to_base58() in self._net.nodes


class _Gossip:
    def __init__(self, net: _Net, me: str) -> None:
        self._net = net
        self._me = me
        self.neighbours: frozenset[str] = frozenset()
        self.summary: bytes | None = None
        self.heard: frozenset[str] = frozenset()

    def ring_peers(self) -> list[str]:
        return [p for p in self._net.nodes if p != self._me]

    def last_summary(self) -> bytes | None:
        return self.summary

    def hear(self, extra: frozenset[str]) -> None:
        self.heard = extra


class _Engine:
    block_size = BS

    def __init__(self) -> None:
        self.hasher = BlockHasher(MODEL, BS)
        self.cache: RadixCache[None] = RadixCache(BS, 256, self.hasher)

    def local_match_tokens(self, token_ids: Sequence[int]) -> int:
        return self.cache.peek(token_ids)


class _Node:
    def __init__(self, net: _Net, peer_id: str) -> None:
        self.peer_id = peer_id
        self.engine = _Engine()
        self.table = PeerTable(peer_id, MODEL, BS, expiry_s=6.0)
        self.gossip = _Gossip(net, peer_id)
        self.seq = 0
        self.lookup = RootLookup(
            _Host(net, peer_id), self.table, self.engine, self.gossip, self_id=peer_id,
            interval_s=2.0, rng=random.Random(peer_id),
        )

    def summary_of(self, peer_id: str) -> bytes:
        cache = self.engine.cache
        bloom = summary_bloom(cache.num_blocks, 0.01)
        bloom.update(cache.cached_hashes())
        self.seq += 1
        return encode_summary(CacheSummary(
            peer_id=peer_id, model_id=MODEL, block_size=BS, seq=self.seq,
            bloom_bits=bloom.num_bits, bloom_hashes=bloom.num_hashes, bloom=bloom.to_bytes(),
            cached_blocks=cache.num_blocks, capacity_blocks=cache.capacity_blocks,
            queued_prompt_tokens=0, running_requests=0, prefill_tokens_per_s=500.0,
            decode_tokens_per_s=20.0,
        ))  # fmt: skip

    def lookups_members(self) -> frozenset[str]:
        return self.lookup.lookups.interest.members

    async def publish(self) -> None:
        """What gossip does at a publish: the summary, then the roots it covers."""
        self.gossip.summary = self.summary_of(self.peer_id)
        self.lookup.on_published(self.engine.cache.root_hashes())
        await trio.sleep(0.01)  # the announce loop sends (in-memory: no time passes)


async def _swarm(nursery: trio.Nursery, n: int) -> tuple[_Net, list[_Node]]:
    net = _Net(nursery)
    nodes = [_Node(net, new_peer_id(i + 1)) for i in range(n)]
    for node in nodes:
        net.nodes[node.peer_id] = node
        await nursery.start(node.lookup.run)
    return net, nodes


def _prompt(seed: int, blocks: int = 4) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(BS * blocks)]


async def _route(entry: _Node, prompt: list[int], deadline: float) -> None:
    """What the pipeline does before ranking a request."""
    await entry.lookup.before_route(prompt, entry.engine.hasher.chain(prompt), deadline)


def _homes(nodes: list[_Node], prompt: list[int]) -> tuple[str, ...]:
    ring = HomeRing()
    ring.update(n.peer_id for n in nodes)
    return ring.homes(BlockHasher(MODEL, BS).chain(prompt[:BS])[0], 0.0)


async def test_an_entry_finds_a_holder_it_does_not_hear_and_keeps_hearing_it(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    net, nodes = await _swarm(nursery, 5)
    holder, entry = nodes[0], nodes[1]
    entry.gossip.neighbours = frozenset({nodes[2].peer_id, nodes[3].peer_id})
    prompt = _prompt(1)
    holder.engine.cache.insert(prompt, lambda _b: None, 0.0)
    await holder.publish()
    root = holder.engine.hasher.chain(prompt[:BS])[0]
    for home in _homes(nodes, prompt):  # both homes recorded the holder
        assert net.nodes[home].lookup.index.providers(root, trio.current_time()) == [
            holder.peer_id
        ]
    start = trio.current_time()
    await _route(entry, prompt, start + 10.0)
    assert trio.current_time() == start  # in memory: no round trip takes time
    chain = entry.engine.hasher.chain(prompt)
    assert entry.table.estimate_match(holder.peer_id, chain) == 4
    view = entry.table.get(holder.peer_id, trio.current_time())
    assert view is not None and view.rtt_s is not None
    assert entry.gossip.heard == {holder.peer_id} == entry.lookups_members()
    stats = entry.lookup.statistics()
    assert (stats["lookups"], stats["summaries_fetched"], stats["interest_joined"]) == (1, 1, 1)
    assert holder.lookup.statistics()["matches_answered"] == 1  # asked, then its summary
    # the holder is heard now: the same root is not looked up again
    await _route(entry, prompt, trio.current_time() + 10.0)
    assert entry.lookup.statistics()["lookups"] == 1
    # the holder evicts the root: the withdrawal reaches the homes with its next
    # announcement there, at the latest a refresh period later
    holder.engine.cache.evict(4)
    await holder.publish()
    await trio.sleep(ANNOUNCE_REFRESH_S)
    await holder.publish()
    for home in _homes(nodes, prompt):
        assert net.nodes[home].lookup.index.providers(root, trio.current_time()) == []


async def test_a_stalled_home_costs_the_budget_and_no_more(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    net, nodes = await _swarm(nursery, 4)
    entry = nodes[0]
    net.stalling |= {n.peer_id for n in nodes[1:]}
    elsewhere = [s for s in range(100) if entry.peer_id not in _homes(nodes, _prompt(s))]
    start = trio.current_time()
    await _route(entry, _prompt(elsewhere[0]), start + 10.0)
    assert trio.current_time() == start + DEFAULT_LOOKUP_WAIT_S
    assert entry.lookup.statistics()["lookups_out_of_time"] == 1
    start = trio.current_time()
    await _route(entry, _prompt(elsewhere[1]), start + 0.1)  # the deadline first
    assert trio.current_time() == start + 0.1
    await _route(entry, _prompt(elsewhere[2])[: BS - 1], start + 10.0)  # no block
    assert entry.lookup.statistics()["lookups"] == 2


async def test_a_home_of_the_previous_version_is_refused_and_skipped(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    net, nodes = await _swarm(nursery, 6)
    old = nodes[5]
    net.refusing.add(old.peer_id)  # no /prefixswarm/roots handler: a previous version
    holder, entry = nodes[0], nodes[1]
    seed = next(s for s in range(10_000) if _homes(nodes, _prompt(s))[0] == old.peer_id)
    prompt = _prompt(seed)
    holder.engine.cache.insert(prompt, lambda _b: None, 0.0)
    await holder.publish()
    assert holder.lookup.statistics()["announcements_failed"] >= 1
    root = holder.engine.hasher.chain(prompt[:BS])[0]
    assert old.peer_id not in holder.lookup.ring.homes(root, trio.current_time())
    await holder.publish()  # the next summary re-homes the roots the old peer missed
    await _route(entry, prompt, trio.current_time() + 10.0)
    stats = entry.lookup.statistics()
    assert stats["finds_failed"] == 1  # asked the old peer first, then the next home
    assert entry.gossip.heard == {holder.peer_id}


async def test_a_provider_record_is_a_claim_and_a_summary_must_be_the_senders(
    nursery: trio.Nursery, autojump_clock: Any
) -> None:
    net, nodes = await _swarm(nursery, 5)
    holder, entry, liar, impostor = nodes[0], nodes[1], nodes[2], nodes[3]
    prompt = _prompt(4)
    holder.engine.cache.insert(prompt, lambda _b: None, 0.0)
    root = holder.engine.hasher.chain(prompt[:BS])[0]
    liar.gossip.summary = liar.summary_of(liar.peer_id)  # an honest summary without the root
    impostor.gossip.summary = holder.summary_of(holder.peer_id)  # someone else's summary
    for node in (liar, impostor):  # both claim to hold the whole prompt
        node.engine.cache.match_hashes = len  # type: ignore[method-assign]
    now = trio.current_time()
    for home in _homes(nodes, prompt):  # a home says they hold it (only a claim)
        net.nodes[home].lookup.index.announce(root, liar.peer_id, now)
        net.nodes[home].lookup.index.announce(root, impostor.peer_id, now)
    await _route(entry, prompt, now + 10.0)
    stats = entry.lookup.statistics()
    assert stats["summaries_fetched"] == 1  # the liar's, applied: it shows no root
    assert stats["summaries_rejected_identity"] == 1  # the impostor's summary names another
    assert entry.gossip.heard == frozenset() and entry.lookups_members() == frozenset()
    assert entry.table.get(impostor.peer_id, trio.current_time()) is None
