"""Swarm membership on real libp2p hosts over loopback, all peers in this process.

Discovery through one bootstrap peer, summary exchange, expiry of a killed peer, return
of a restarted one, and rejection of malformed, oversized and forged summaries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from peer.engine.cache_only import CacheOnlyEngine
from peer.node import LIVENESS_INTERVAL_MIN_S
from peer.node_runner import probe_tokens
from peer.swarm.local_summary import build_summary
from protocols.summary import MAX_SUMMARY_BYTES, encode_summary
from tests.helpers_swarm import (
    TEST_INTERVAL_S,
    RunningPeer,
    everyone_sees_everyone,
    known_peers,
    start_peer,
    swarm_config,
    wait_until,
)

# Real-time bounds on gossip among peers sharing this process: a second pytest worker's
# load (the NAT test's peer processes loading torch) broke one (`newer summaries`, while
# the pairs' connections raced: "fail to upgrade mux"). `make test` runs these alone,
# after the parallel part.
pytestmark = pytest.mark.serial

N_PEERS = 5
# Extra seconds for a summary to arrive: all peers of a test share one process, and on a
# busy 2-core machine that process gets a fraction of a core (~7 ms CPU per receive).
SLACK_S = 3.0


async def _start_swarm(
    nursery: trio.Nursery, n: int, key_dir: Path | None = None
) -> list[RunningPeer]:
    """n peers; all but the first are told only the first one's address."""

    def identity(i: int) -> Path | None:
        return None if key_dir is None else key_dir / f"peer{i}.key"

    first = await start_peer(nursery, swarm_config(identity=identity(0)))
    boot = first.peer.multiaddrs[0]
    rest = [
        await start_peer(nursery, swarm_config(bootstrap=[boot], identity=identity(i)))
        for i in range(1, n)
    ]
    return [first, *rest]


async def test_five_peers_discover_each_other_and_exchange_summaries(nursery: trio.Nursery) -> None:
    with trio.fail_after(60):
        running = await _start_swarm(nursery, N_PEERS)
        peers = [r.peer for r in running]
        took = await wait_until(
            lambda: everyone_sees_everyone(peers), timeout_s=10, what="every table complete"
        )
        print(f"full tables after {took:.2f} s")
        # Gossip relays through the bootstrap peer alone would fill the tables too;
        # discovery (DHT provider records) must also connect every pair directly.
        took = await wait_until(
            lambda: all(
                p.host.is_connected(q.host.peer_id) for p in peers for q in peers if p is not q
            ),
            timeout_s=10,
            what="every pair connected via DHT discovery",
        )
        print(f"all pairs connected after {took:.2f} s")
        # Summaries keep coming: every entry of every table is replaced by a newer one.
        now = trio.current_time()
        waiting = {(p, v.peer_id): v.summary.seq for p in peers for v in p.table.views(now)}

        def all_newer() -> bool:
            now = trio.current_time()
            for (p, q), seq in list(waiting.items()):
                view = p.table.get(q, now)
                if view is not None and view.summary.seq > seq:
                    del waiting[(p, q)]
            return not waiting

        try:
            await wait_until(all_newer, timeout_s=TEST_INTERVAL_S + SLACK_S,
                             what="newer summaries")
        except AssertionError as exc:  # say which (receiver, sender) pairs are still waiting
            late = sorted((p.peer_id[-6:], q[-6:]) for p, q in waiting)
            raise AssertionError(f"{exc}: still waiting {late}") from None

        # One peer caches a prefix; the others estimate its match after the next summary.
        holder = peers[2]
        tokens = probe_tokens(64)
        engine = holder.engine
        assert isinstance(engine, CacheOnlyEngine)
        engine.insert(tokens)
        chain = engine.hasher.chain(tokens)
        assert len(chain) == 4
        others = [p for p in peers if p is not holder]
        await wait_until(
            lambda: all(p.table.estimate_match(holder.peer_id, chain) == 4 for p in others),
            timeout_s=TEST_INTERVAL_S + SLACK_S,  # the next summary carries it
            what="others see the holder's 4 cached blocks",
        )
        # Nobody else cached it, and empty filters give no false hits.
        for p in others:
            for q in others:
                if q is not p:
                    assert p.table.estimate_match(q.peer_id, chain) == 0
        stats = holder.statistics()
        assert stats["summaries_published"] > 0 and stats["gossip_bytes_out"] > 0
        await wait_until(
            lambda: holder.statistics()["peers_known"] == N_PEERS - 1,
            timeout_s=SLACK_S,
            what="statistics count the other peers",
        )


async def test_a_new_peers_round_trip_is_measured_before_the_first_liveness_round(
    nursery: trio.Nursery,
) -> None:
    # Routing prices a forward by the round trip; until one is measured it takes a WAN
    # prior (50 ms) that keeps requests away from a peer just joined.
    started = trio.current_time()
    running = await _start_swarm(nursery, 2)
    peers = [r.peer for r in running]

    def measured() -> bool:
        views = [v for p in peers for v in p.table.views(trio.current_time())]
        return len(views) == 2 and all(v.rtt_s is not None for v in views)

    deadline = started + LIVENESS_INTERVAL_MIN_S  # the steady cadence would ping only then
    await wait_until(
        measured, timeout_s=deadline - trio.current_time(), what="both round trips measured"
    )


async def test_killed_peer_expires_and_returns_with_same_identity(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    with trio.fail_after(60):
        running = await _start_swarm(nursery, N_PEERS, key_dir=tmp_path)
        peers = [r.peer for r in running]
        await wait_until(lambda: everyone_sees_everyone(peers), timeout_s=10, what="full tables")

        victim = running[3]
        victim_id = victim.peer.peer_id
        killed_at = trio.current_time()
        await victim.kill()
        survivors = [p for i, p in enumerate(peers) if i != 3]
        await wait_until(
            lambda: all(victim_id not in known_peers(p) for p in survivors),
            timeout_s=3 * TEST_INTERVAL_S + 1,
            what="killed peer gone from every table",
        )
        took = trio.current_time() - killed_at
        print(f"killed peer expired after {took:.2f} s")
        # 3 intervals after its last summary; the slack covers a summary still in
        # flight at the kill and scheduling delays on a loaded machine.
        assert took <= 3 * TEST_INTERVAL_S + 0.75

        boot = peers[0].multiaddrs[0]
        back = await start_peer(
            nursery, swarm_config(bootstrap=[boot], identity=tmp_path / "peer3.key")
        )
        assert back.peer.peer_id == victim_id
        took = await wait_until(
            lambda: everyone_sees_everyone([*survivors, back.peer]),
            timeout_s=10,
            what="restarted peer seen again by everyone",
        )
        print(f"restarted peer seen again after {took:.2f} s")


async def test_bad_summaries_are_rejected_and_the_swarm_keeps_working(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(60):
        running = await _start_swarm(nursery, 4)
        peers = [r.peer for r in running]
        await wait_until(lambda: everyone_sees_everyone(peers), timeout_s=10, what="full tables")

        sender = peers[0]
        topic = sender.gossip.topic
        victim_id = peers[1].peer_id
        engine = sender.engine
        forged = build_summary(engine, peer_id=victim_id, seq=2**62, fp_rate=0.01)
        bad = {
            "malformed": b"\xa1\x61v\x02 not a summary",
            "oversize": b"\x00" * (MAX_SUMMARY_BYTES + 1),
            "identity": encode_summary(forged),  # signed by sender, claims to be victim
        }
        for payload in bad.values():
            await sender.pubsub.publish(topic, payload)

        receivers = peers[1:]

        def rejected(reason: str) -> int:
            return sum(p.statistics()["summaries_rejected"].get(reason, 0) for p in receivers)

        await wait_until(
            lambda: all(rejected(reason) >= 1 for reason in bad),
            timeout_s=5,
            what=f"each bad summary rejected: {[rejected(r) for r in bad]}",
        )
        # Rejected messages are not forwarded: at most one rejection per receiver.
        for reason in bad:
            assert rejected(reason) <= len(receivers)
        # The forged summary did not replace the victim's real one.
        for p in peers[2:]:
            view = p.table.get(victim_id, trio.current_time())
            assert view is None or view.summary.seq < 2**62

        # Everyone keeps working: summaries keep flowing and tables stay complete.
        accepted_before = [p.statistics()["summaries_accepted"] for p in peers]
        await wait_until(
            lambda: all(
                p.statistics()["summaries_accepted"] >= before + len(peers) - 1
                for p, before in zip(peers, accepted_before, strict=True)
            ),
            timeout_s=4 * TEST_INTERVAL_S + 2,
            what="summaries still accepted after the bad ones",
        )
        assert everyone_sees_everyone(peers)


async def test_generation_on_a_real_engine_reaches_the_other_tables(
    nursery: trio.Nursery, tiny_engine_factory: Any
) -> None:
    from peer.engine.engine import SamplingParams

    with trio.fail_after(60):
        engines = [tiny_engine_factory() for _ in range(3)]
        first = await start_peer(nursery, swarm_config(), engine=engines[0])
        boot = [first.peer.multiaddrs[0]]
        rest = [
            await start_peer(nursery, swarm_config(bootstrap=boot), engine=e) for e in engines[1:]
        ]
        peers = [first.peer] + [r.peer for r in rest]
        await wait_until(lambda: everyone_sees_everyone(peers), timeout_s=10, what="full tables")

        server = engines[1]
        prompt = server.encode_prompt("The quick brown fox jumps over the lazy dog. " * 6)
        await server.generate(prompt, SamplingParams(max_new_tokens=2))
        cached_blocks = server.local_match_tokens(prompt) // server.block_size
        assert cached_blocks >= 2
        chain = server.hasher.chain(prompt)
        server_id = peers[1].peer_id
        await wait_until(
            lambda: all(
                p.table.estimate_match(server_id, chain) == cached_blocks
                for p in (peers[0], peers[2])
            ),
            timeout_s=TEST_INTERVAL_S + SLACK_S,
            what=f"others estimate the server's {cached_blocks} cached blocks",
        )
        view = peers[0].table.get(server_id, trio.current_time())
        assert view is not None and view.summary.cached_blocks == server.cache.num_blocks
