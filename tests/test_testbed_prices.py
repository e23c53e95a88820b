"""The router's price of a request's chosen peer against what the request took."""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench.testbed.prices import MISS_TOKENS, kind_of, priced_to_first_token, prices, prices_dir
from peer.config import Policy
from peer.routing.cost import Candidate, Cost, PeerEstimate, estimate_cost, rank_estimates


def _reason_for(local: bool, cost: Cost) -> str:
    """A route reason in the router's words (the format is checked against a real
    candidate's below)."""
    total = cost.network_s + cost.queue_s + cost.prefill_s + cost.decode_s
    return (f"{'self' if local else 'peer'} p [cost]: exact match 2 blocks; cost {total:.3f} s "
            f"= net {cost.network_s:.3f} + queue {cost.queue_s:.3f} + prefill "
            f"{cost.prefill_s:.3f} + decode {cost.decode_s:.3f}; load 0 running")


def test_a_real_candidates_reason_is_read() -> None:
    estimate = PeerEstimate("p", False, 2, 32, 300, 1, 1000.0, 50.0, 0.02)
    cost = estimate_cost(32, 400, 8, 300, 1, 1000.0, 50.0, 0.02)
    total = cost.network_s + cost.queue_s + cost.prefill_s + cost.decode_s
    candidate = Candidate("p", False, 2, 32, total, cost.queue_s, Policy.COST, estimate, 400, 8)
    parts = candidate.cost
    assert abs(priced_to_first_token(candidate.reason)
               - (parts.network_s + parts.queue_s + parts.prefill_s)) < 2e-3


def test_a_reason_states_the_copy_and_busy_charges_of_its_prefill() -> None:
    """A miss where another candidate holds more, in a busy swarm: its reason says how much
    of the prefill is the charges, and the price without them is the idle prefill's."""
    local = PeerEstimate("me", True, 2, 32, 0, 0, 1000.0, 50.0, 0.0)
    holder = PeerEstimate("h", False, 20, 320, 0, 4, 1000.0, 50.0, 0.02)
    ranked = rank_estimates(Policy.COST, [local, holder], 400, 8, random.Random(0))
    me = next(c for c in ranked if c.is_local)
    idle = estimate_cost(32, 400, 8, 0, 0, 1000.0, 50.0, 0.0)
    assert "of the prefill the copy and busy charges" in me.reason
    assert me.cost.prefill_s > idle.prefill_s + 0.1  # 288 copied tokens, busy 2
    bare = priced_to_first_token(me.reason, charges=False)
    assert abs(bare - (idle.network_s + idle.queue_s + idle.prefill_s)) < 2e-3
    assert abs(priced_to_first_token(me.reason) - (me.cost_s - me.cost.decode_s)) < 2e-3
    # the holder's hit carries the busy charge alone: busy 2 (4 running over 2 peers)
    # times its 80 unmatched tokens at 1,000 tokens/s
    assert "; 0.160 of the prefill the copy and busy charges" in next(
        c for c in ranked if not c.is_local).reason
    # an idle swarm, nothing to copy: no charges, nothing said
    alone = rank_estimates(Policy.COST, [local], 400, 8, random.Random(0))[0]
    assert "charges" not in alone.reason


def _log(local: bool, computed: int, ttft: float, cost: Cost, steps: int = 1) -> dict:
    step = {"local": local, "reason": _reason_for(local, cost)}
    return {"outcome": "ok", "prompt_tokens": 400, "cached_tokens": 400 - computed,
            "ttft_s": ttft, "route": [step] * steps}


def test_the_price_to_the_first_token_leaves_out_the_decode() -> None:
    reason = _reason_for(False, Cost(0.04, 0.01, 0.05, 0.5))
    assert abs(priced_to_first_token(reason) - 0.10) < 1e-9
    assert priced_to_first_token("self p [local]: match not estimated") is None


def test_requests_are_sorted_into_misses_hits_and_forwards() -> None:
    cost = Cost(0.0, 0.0, 0.1, 0.02)
    assert kind_of(_log(True, MISS_TOKENS, 0.05, cost)) == "kept_miss"
    assert kind_of(_log(True, MISS_TOKENS - 1, 0.05, cost)) == "kept_hit"
    assert kind_of(_log(False, 300, 0.05, cost)) == "forwarded"
    assert kind_of(_log(False, 300, 0.05, cost, steps=2)) is None  # a retry says little
    assert kind_of({**_log(True, 300, 0.05, cost), "outcome": "failed"}) is None


def test_an_overpriced_miss_shows_as_a_ratio_above_one(tmp_path: Path) -> None:
    logs = [[_log(True, 300, 0.05, Cost(0.0, 0.02, 0.08, 0.02)),
             _log(True, 300, 0.05, Cost(0.0, 0.0, 0.10, 0.02)),
             _log(True, 16, 0.02, Cost(0.0, 0.0, 0.02, 0.02)),
             _log(False, 300, 0.12, Cost(0.06, 0.0, 0.03, 0.02))], None]
    rows = {(r["entry"], r["kind"]): r for r in prices(logs)}
    assert rows[(0, "kept_miss")] == {"entry": 0, "kind": "kept_miss", "requests": 2,
                                     "priced_s": 0.1, "ttft_s": 0.05, "priced_over_ttft": 2.0,
                                     "priced_without_charges_over_ttft": 2.0}
    assert rows[(0, "kept_hit")]["priced_over_ttft"] == 1.0
    assert rows[(0, "forwarded")]["priced_over_ttft"] == 0.75
    assert rows[(1, "kept_miss")]["requests"] == 0 and rows[(1, "kept_miss")]["ttft_s"] is None
    # a folder's runs of one point are pooled; other policies' runs are left out
    for run in (0, 1):
        (tmp_path / f"d20_half_run{run}_cost.json").write_text(
            json.dumps({"request_logs": logs}))
    (tmp_path / "d20_half_run0_local.json").write_text(json.dumps({"request_logs": logs}))
    pooled = {(r["entry"], r["kind"]): r for r in prices_dir(tmp_path, "cost")["d20_half"]}
    assert pooled[(0, "kept_miss")]["requests"] == 4
