"""peer.swarm.gossip without a network: the published filter equals one rebuilt from scratch;
the counts of summaries published and accepted per sender."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2

from peer.engine.cache_only import CacheOnlyEngine
from peer.swarm.bloom_sizing import summary_bloom
from peer.swarm.gossip import Gossip
from peer.swarm.local_summary import build_summary
from peer.swarm.peer_table import PeerTable
from protocols.summary import encode_summary


def _gossip(engine: CacheOnlyEngine) -> Gossip:
    peer_id = ID.from_pubkey(create_new_key_pair().public_key)
    table = PeerTable(peer_id.to_base58(), engine.model_id, engine.block_size, expiry_s=6.0)
    return Gossip(
        None,  # type: ignore[arg-type]  # the filter path never touches pubsub
        table,
        engine,
        peer_id=peer_id,
        interval_s=2.0,
        fp_rate=0.01,
    )


def _rebuilt(engine: CacheOnlyEngine) -> object:
    bloom = summary_bloom(engine.cache.num_blocks, 0.01)
    bloom.update(engine.cache.cached_hashes())
    return bloom


@pytest.mark.parametrize("capacity_blocks", [4096, 300])  # 300: evictions force rebuilds
async def test_incremental_filter_equals_rebuilt_filter(capacity_blocks: int) -> None:
    rng = random.Random(capacity_blocks)
    engine = CacheOnlyEngine(capacity_blocks=capacity_blocks)
    gossip = _gossip(engine)
    for _round in range(12):
        for _ in range(rng.randrange(0, 30)):
            prefix = [rng.randrange(50) for _ in range(16 * rng.randrange(1, 3))]
            engine.insert(prefix + [rng.randrange(49152) for _ in range(16 * rng.randrange(1, 5))])
        assert gossip._current_bloom() == _rebuilt(engine)


async def test_summary_carries_cache_size_and_load() -> None:
    engine = CacheOnlyEngine()
    engine.insert(list(range(64)))
    summary = build_summary(engine, peer_id="12D3KooWtest", seq=7, fp_rate=0.01)
    assert (summary.seq, summary.cached_blocks, summary.capacity_blocks) == (7, 4, 1456)
    bloom = summary.bloom_filter()
    assert all(h in bloom for h in engine.hasher.chain(list(range(64))))


def _summary_from(sender: ID, seq: int, *, leaving: bool = False) -> rpc_pb2.Message:
    """What pubsub hands the validator: `sender`'s signed summary (signature not checked)."""
    summary = build_summary(
        CacheOnlyEngine(), peer_id=sender.to_base58(), seq=seq, fp_rate=0.01, leaving=leaving
    )
    return rpc_pb2.Message(from_id=sender.to_bytes(), data=encode_summary(summary))


async def test_gossip_counts_what_was_published_and_accepted_per_sender(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gossip = _gossip(CacheOnlyEngine())
    published: list[bytes] = []

    async def publish(topic: str, data: bytes) -> None:
        published.append(data)

    gossip._pubsub = SimpleNamespace(publish=publish)  # type: ignore[assignment]
    a, b, c = (ID.from_pubkey(create_new_key_pair().public_key) for _ in range(3))
    for _ in range(3):
        await gossip._publish(early=False)
    for msg in [_summary_from(a, 1), _summary_from(a, 2), _summary_from(b, 1)]:
        assert gossip._validate(a, msg, None)
    junk = rpc_pb2.Message(from_id=c.to_bytes(), data=b"junk")
    assert not gossip._validate(a, junk, None)  # rejected: not counted
    assert gossip._validate(a, _summary_from(a, 2), None)  # a replay: relayed, not counted
    assert gossip._validate(a, _summary_from(a, 1), None)  # late, out of order: counted
    counts = gossip.gossip_counts()
    assert counts["published"] == len(published) == 3
    assert counts["seq"] == counts["first_seq"] + 2  # publishes number seqs one by one
    assert counts["accepted"] == {a.to_base58(): 2, b.to_base58(): 1}
    assert counts["late"] == {a.to_base58(): 1}
    assert counts["last_seq"] == {a.to_base58(): 2, b.to_base58(): 1}
    # bounded by the table's size: once full, senders gone from the table are forgotten
    monkeypatch.setattr(gossip._delivery, "_limit", 2)
    assert gossip._validate(a, _summary_from(a, 3, leaving=True), None)  # a leaves
    assert gossip._stats["left"] == 1
    assert gossip._validate(c, _summary_from(c, 1), None)
    assert gossip.gossip_counts()["accepted"] == {b.to_base58(): 1, c.to_base58(): 1}
    assert gossip.gossip_counts()["last_seq"] == {b.to_base58(): 1, c.to_base58(): 1}


async def test_the_gate_drops_new_identities_without_room_and_budgets_the_rest(
    autojump_clock: object,
) -> None:
    """Behind the gossip gate, pubsub's push_msg (signature, validator, relay) runs for a
    summary of an unproven identity only while the table holds it or has room for it, and
    then only within the forwarder's budget; connected origins always get through."""
    import trio

    from peer.swarm.gossip_gate import UNPROVEN_PER_FORWARDER_BURST

    engine = CacheOnlyEngine()
    self_id = ID.from_pubkey(create_new_key_pair().public_key)
    table = PeerTable(self_id.to_base58(), engine.model_id, engine.block_size, expiry_s=6.0,
                      max_peers=64, max_unproven=4)
    connected = ID.from_pubkey(create_new_key_pair().public_key)
    gossip = Gossip(None, table, engine, peer_id=self_id, interval_s=2.0,  # type: ignore[arg-type]
                    fp_rate=0.01, reachable=lambda peer: peer == connected)
    pushed: list[bytes] = []
    seen: set[bytes] = set()

    async def push_msg(forwarder: ID, msg: rpc_pb2.Message) -> None:  # pubsub, validator only
        pushed.append(msg.from_id)
        gossip._validate(forwarder, msg, None)

    gossip._pubsub = SimpleNamespace(  # type: ignore[assignment]
        seen_messages=seen, get_message_id=lambda msg: msg.from_id + msg.seqno
    )
    gated = gossip._gated(push_msg)
    rogue, honest = (ID.from_pubkey(create_new_key_pair().public_key) for _ in range(2))
    ghosts = [ID.from_pubkey(create_new_key_pair().public_key) for _ in range(40)]
    for ghost in ghosts:
        await gated(rogue, _summary_from(ghost, 1))
    assert pushed == [g.to_bytes() for g in ghosts[:4]]  # the unproven share: 4
    assert seen == {g.to_bytes() for g in ghosts[4:]}  # dropped unchecked, never fetched again
    await gated(rogue, _summary_from(ghosts[0], 2))  # a held identity's refresh: budgeted
    await gated(honest, _summary_from(connected, 1))  # connected: checked
    assert pushed[-2:] == [ghosts[0].to_bytes(), connected.to_bytes()]
    assert table.holds(connected.to_base58())
    # With room again (the ghosts fell silent), new identities cost the forwarder budget
    await trio.sleep(7.0)
    table.expire(trio.current_time())
    assert table.room_for_unproven(trio.current_time())
    pushed.clear()
    burst = UNPROVEN_PER_FORWARDER_BURST
    fresh = [ID.from_pubkey(create_new_key_pair().public_key) for _ in range(burst + 8)]
    big = PeerTable(self_id.to_base58(), engine.model_id, engine.block_size, expiry_s=6.0)
    gossip._table = big  # room for all of them: only the budget decides
    for origin in fresh:
        await gated(rogue, _summary_from(origin, 1))
    assert len(pushed) == UNPROVEN_PER_FORWARDER_BURST
    await gated(honest, _summary_from(fresh[-1], 1))  # another forwarder's budget is its own
    assert len(pushed) == UNPROVEN_PER_FORWARDER_BURST + 1
    await trio.sleep(1.0)  # refilled at UNPROVEN_PER_FORWARDER_PER_S
    await gated(rogue, _summary_from(fresh[-2], 1))
    assert len(pushed) == UNPROVEN_PER_FORWARDER_BURST + 2
    counts = gossip._gate.counts
    assert counts["no_room"] == 36 and counts["over_budget"] == 8


async def test_a_forwarder_that_keeps_sending_what_is_refused_is_graylisted(
    autojump_clock: object,
) -> None:
    import trio

    from peer.swarm.gossip_gate import GRAYLIST_S, REFUSALS_BURST

    engine = CacheOnlyEngine()
    self_id = ID.from_pubkey(create_new_key_pair().public_key)
    table = PeerTable(self_id.to_base58(), engine.model_id, engine.block_size, expiry_s=6.0,
                      max_peers=64, max_unproven=0)  # no room for any unproven identity
    disconnected: list[ID] = []

    async def disconnect(peer: ID) -> None:
        disconnected.append(peer)

    gossip = Gossip(None, table, engine, peer_id=self_id, interval_s=2.0,  # type: ignore[arg-type]
                    fp_rate=0.01, disconnect=disconnect)
    blacklist: set[ID] = set()
    gossip._pubsub = SimpleNamespace(  # type: ignore[assignment]
        seen_messages=set(), get_message_id=lambda msg: msg.from_id,
        is_peer_blacklisted=lambda peer: peer in blacklist,
        add_to_blacklist=blacklist.add, remove_from_blacklist=blacklist.discard,
    )

    async def push_msg(forwarder: ID, msg: rpc_pb2.Message) -> None:
        raise AssertionError("nothing here may be checked")

    gated = gossip._gated(push_msg)
    rogue, honest = (ID.from_pubkey(create_new_key_pair().public_key) for _ in range(2))
    for _ in range(40):  # a few a second from an honest relay are tolerated...
        await gated(honest, _summary_from(ID.from_pubkey(create_new_key_pair().public_key), 1))
        await trio.sleep(0.1)
    for _ in range(REFUSALS_BURST):  # ...and a burst
        await gated(rogue, _summary_from(ID.from_pubkey(create_new_key_pair().public_key), 1))
    assert blacklist == set()
    await gated(rogue, _summary_from(ID.from_pubkey(create_new_key_pair().public_key), 1))
    assert blacklist == {rogue} and disconnected == [rogue]  # a sustained flood is not
    await gated(rogue, _summary_from(ID.from_pubkey(create_new_key_pair().public_key), 1))
    assert disconnected == [rogue]  # once
    assert gossip._gate.graylisted == 1
    await trio.sleep(GRAYLIST_S)
    gossip._end_graylists(trio.current_time())
    assert blacklist == set() and gossip._gate.graylisted == 0
