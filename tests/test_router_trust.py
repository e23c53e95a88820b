"""Routing under the trust ledger: proven reachability, quarantine, probation apart,
discounted claims, capped speeds, and a failure backoff that doubles."""

from __future__ import annotations

import random

from peer.config import Policy
from peer.routing.router import Router, build_router
from peer.routing.trust import TrustLedger
from tests.test_router import BS, chain_of, me, summary, table_with

NEW = 16


def router(trust: TrustLedger | None = None, policy: Policy = Policy.COST) -> Router:
    return Router(policy, random.Random(0), block_size=BS, trust=trust, require_rtt=True)


def trusted(*peer_ids: str, **kwargs) -> TrustLedger:
    ledger = TrustLedger(**kwargs)
    for peer_id in peer_ids:
        for _ in range(ledger.probation_requests):
            ledger.record_served(peer_id, verified=True)
    return ledger


def ids(candidates) -> list[str]:
    return [c.peer_id for c in candidates]


def test_a_summary_origin_without_a_measured_round_trip_is_never_a_candidate():
    chain = chain_of(40)
    table = table_with(summary("forged", chain), summary("proven", chain[:20]))
    table.record_rtt("proven", 0.002, 0.0)
    r = router(trusted("forged", "proven"))
    ranked = r.rank(chain, 40 * BS, NEW, me(), table, 0.0)
    assert ids(ranked) == ["proven", "12D3KooWself"]
    assert r.statistics().unproven_skipped == 1
    # Without the requirement the forged origin, which claims more, would come first.
    loose = Router(Policy.COST, random.Random(0), block_size=BS)
    assert loose.rank(chain, 40 * BS, NEW, me(), table, 0.0)[0].peer_id == "forged"


def test_the_factory_gives_a_ledger_the_round_trip_rule_and_no_ledger_neither():
    chain = chain_of(40)
    table = table_with(summary("forged", chain), summary("proven", chain[:20]))
    table.record_rtt("proven", 0.002, 0.0)
    ledger = trusted("forged", "proven")
    serving = build_router(Policy.COST, random.Random(0), block_size=BS, trust=ledger)
    assert serving.trust is ledger and serving.policy is Policy.COST
    assert ids(serving.rank(chain, 40 * BS, NEW, me(), table, 0.0)) == ["proven", "12D3KooWself"]
    assert serving.statistics().unproven_skipped == 1
    bare = build_router(Policy.COST, random.Random(0), block_size=BS)
    assert bare.trust is None
    assert ids(bare.rank(chain, 40 * BS, NEW, me(), table, 0.0))[0] == "forged"
    assert bare.statistics().unproven_skipped == 0


def test_a_quarantined_peer_is_never_a_candidate():
    chain = chain_of(40)
    table = table_with(summary("liar", chain))
    table.record_rtt("liar", 0.002, 0.0)
    ledger = trusted("liar")
    r = router(ledger)
    assert ids(r.rank(chain, 40 * BS, NEW, me(), table, 0.0))[0] == "liar"
    ledger.quarantine("liar", "wrong tokens", 1.0)
    assert ids(r.rank(chain, 40 * BS, NEW, me(), table, 1.0)) == ["12D3KooWself"]


def test_probation_peers_are_never_candidates_and_come_apart_best_first():
    chain = chain_of(40)
    sybils = [f"sybil{i}" for i in range(10)]
    table = table_with(*(summary(p, chain[: 4 * i]) for i, p in enumerate(sybils)),
                       summary("honest", chain[:8]))
    for p in [*sybils, "honest"]:
        table.record_rtt(p, 0.002, 0.0)
    r = router(trusted("honest"))
    for _ in range(40):
        ranked = r.rank_all(chain, 40 * BS, NEW, me(), table, 0.0)
        assert ids(ranked.candidates) == ["honest", "12D3KooWself"]
        assert ids(ranked.probation) == sybils[::-1]  # the longest match is the cheapest
        assert r.rank(chain, 40 * BS, NEW, me(), table, 0.0) == ranked.candidates
    assert r.statistics().probation_held_back == 80 * 10
    # One that failed recently ranks after every healthy one.
    r.record_outcome("sybil9", False, 0.0)
    assert ids(r.rank_all(chain, 40 * BS, NEW, me(), table, 1.0).probation)[-1] == "sybil9"


def test_overshooting_claims_are_discounted_then_ignored():
    chain = chain_of(40)
    table = table_with(summary("boaster", chain))
    table.record_rtt("boaster", 0.002, 0.0)
    ledger = trusted("boaster")
    r = router(ledger, Policy.LONGEST_PREFIX)
    assert r.rank(chain, 40 * BS, NEW, me(10 * BS), table, 0.0)[0].match_blocks == 40
    matches = []
    for _ in range(8):
        ledger.record_claim("boaster", 40 * BS, 0)  # claimed all, had nothing
        ranked = r.rank(chain, 40 * BS, NEW, me(10 * BS), table, 0.0)
        matches.append(next(c for c in ranked if c.peer_id == "boaster").match_blocks)
    assert matches[0] == 40
    assert any(0 < m < 40 for m in matches)  # discounted
    assert matches[-1] == 0  # ignored
    assert r.rank(chain, 40 * BS, NEW, me(10 * BS), table, 0.0)[0].is_local


def test_advertised_speeds_are_capped_by_ours_then_by_observation():
    chain = chain_of(40)
    table = table_with(summary("fast", [], prefill=1e9, decode=1e9))
    table.record_rtt("fast", 0.002, 0.0)
    ledger = trusted("fast")
    r = router(ledger)
    fast = next(c for c in r.rank(chain, 40 * BS, NEW, me(), table, 0.0) if c.peer_id == "fast")
    assert fast.estimate.prefill_tokens_per_s == 1000.0  # ours: never observed faster
    assert fast.estimate.decode_tokens_per_s == 20.0
    assert r.rank(chain, 40 * BS, NEW, me(), table, 0.0)[0].is_local
    ledger.record_speeds("fast", 8000.0, 100.0)
    fast = next(c for c in r.rank(chain, 40 * BS, NEW, me(), table, 0.0) if c.peer_id == "fast")
    assert fast.estimate.prefill_tokens_per_s == 16000.0  # up to twice what was observed
    assert fast.estimate.decode_tokens_per_s == 200.0


def test_failure_backoff_doubles_with_consecutive_failures():
    r = Router(Policy.COST, random.Random(0), block_size=BS, failure_backoff_s=10.0)
    r.record_outcome("p", False, 0.0)
    assert r.failed_s_ago("p", 9.9) is not None and r.failed_s_ago("p", 10.0) is None
    r.record_outcome("p", False, 10.0)
    assert r.failed_s_ago("p", 29.9) is not None and r.failed_s_ago("p", 30.0) is None
    r.record_outcome("p", False, 30.0)
    assert r.backoff_s("p") == 40.0
    for t in range(100):
        r.record_outcome("p", False, 31.0 + t)
    assert r.backoff_s("p") == 600.0
    r.record_outcome("p", True, 200.0)
    assert r.failed_s_ago("p", 200.0) is None and r.backoff_s("p") == 10.0
