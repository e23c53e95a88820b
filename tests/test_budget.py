"""The remote budget (peer/request/budget.py): per-identity and total token buckets of
engine-seconds, and a bound on remote requests running, all in virtual time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.request.budget import (
    MAX_IDENTITIES,
    Admitted,
    BudgetPolicy,
    OverBudget,
    RemoteBudget,
    request_cost_s,
)

POLICY = BudgetPolicy(identity_share=0.25, remote_share=0.5, burst_s=8.0, remote_slots=4)


def test_cost_is_prompt_at_prefill_speed_plus_answer_at_decode_speed() -> None:
    assert request_cost_s(2000, 64, 1000.0, 32.0) == pytest.approx(2.0 + 2.0)
    assert request_cost_s(2000, 0, 0.0, 0.0) > 0  # unmeasured speeds: assumed, never free


def test_one_identity_gets_its_burst_then_its_share() -> None:
    budget = RemoteBudget(POLICY)
    got = []
    for _ in range(5):
        got.append(budget.admit("a", 0.5, 0.0))
        if isinstance(got[-1], Admitted):
            budget.release(got[-1])
    assert [isinstance(g, Admitted) for g in got] == [True] * 4 + [False]  # 2 s of burst
    refused = got[-1]
    assert isinstance(refused, OverBudget) and "identity" in refused.reason
    assert refused.retry_after_s == pytest.approx(0.5 / 0.25)
    assert isinstance(budget.admit("a", 0.5, 1.9), OverBudget)
    assert isinstance(budget.admit("a", 0.5, 2.0), Admitted)  # refilled at 0.25 s per s


def test_fresh_identities_share_one_remote_bucket() -> None:
    budget = RemoteBudget(POLICY)
    admitted = 0
    for i in range(40):  # a Sybil swarm: each identity's own bucket is full
        got = budget.admit(f"sybil{i}", 1.0, 0.0)
        if isinstance(got, Admitted):
            admitted += 1
            budget.release(got)
        else:
            assert "remote peers" in got.reason
    assert admitted == 4  # the remote bucket holds 0.5 x 8 s


def test_a_request_longer_than_a_full_bucket_runs_once_then_pays_its_debt() -> None:
    budget = RemoteBudget(POLICY)
    got = budget.admit("a", 3.0, 0.0)  # more than the 2 s an identity's bucket holds
    assert isinstance(got, Admitted)
    budget.release(got)
    refused = budget.admit("a", 3.0, 0.0)
    assert isinstance(refused, OverBudget)
    assert refused.retry_after_s == pytest.approx((2.0 + 1.0) / 0.25)  # back to full


def test_remote_requests_running_at_once_are_bounded() -> None:
    budget = RemoteBudget(POLICY)
    running = [budget.admit(f"p{i}", 0.01, 0.0) for i in range(4)]
    assert all(isinstance(r, Admitted) for r in running)
    refused = budget.admit("p9", 0.01, 0.0)
    assert isinstance(refused, OverBudget) and "at once" in refused.reason
    first = running[0]
    assert isinstance(first, Admitted)
    budget.release(first)
    assert isinstance(budget.admit("p9", 0.01, 0.0), Admitted)


def test_identities_remembered_are_bounded() -> None:
    budget = RemoteBudget(BudgetPolicy(remote_share=1.0, burst_s=1e6, remote_slots=1))
    for i in range(MAX_IDENTITIES + 10):
        got = budget.admit(f"p{i}", 1e-3, 0.0)
        assert isinstance(got, Admitted)
        budget.release(got)
    assert budget.statistics()["identities_tracked"] == MAX_IDENTITIES


def test_policy_rejects_shares_outside_0_1() -> None:
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError):
            BudgetPolicy(identity_share=bad)


requests = st.lists(
    st.tuples(st.integers(0, 5), st.floats(0.01, 5.0), st.floats(0.0, 2.0)),
    max_size=120,
)


@settings(max_examples=200, deadline=None)
@given(requests)
def test_no_identity_and_no_swarm_gets_more_than_its_share(
    script: list[tuple[int, float, float]],
) -> None:
    """Over any run, what was admitted to one identity is at most its bucket plus its
    refill plus one overdraft; for all identities, likewise with the remote share."""
    budget = RemoteBudget(POLICY)
    now = 0.0
    per_id: dict[int, float] = {}
    largest: dict[int, float] = {}
    total = 0.0
    for who, cost, gap in script:
        now += gap
        got = budget.admit(str(who), cost, now)
        if isinstance(got, Admitted):
            budget.release(got)
            per_id[who] = per_id.get(who, 0.0) + cost
            largest[who] = max(largest.get(who, 0.0), cost)
            total += cost
    p = POLICY
    for who, spent in per_id.items():
        assert spent <= p.identity_share * (p.burst_s + now) + largest[who] + 1e-9
    assert total <= p.remote_share * (p.burst_s + now) + max(largest.values(), default=0) + 1e-9


def test_an_idle_engine_serves_over_budget_and_charges_it() -> None:
    budget = RemoteBudget(POLICY)
    assert isinstance(budget.admit("a", 2.0, 0.0), Admitted)  # the identity's 2 s
    assert isinstance(budget.admit("a", 1.0, 0.0), OverBudget)  # busy: refused
    idle = budget.admit("a", 1.0, 0.0, idle=True)
    assert isinstance(idle, Admitted)  # idle: it takes time from nobody
    refused = budget.admit("a", 0.5, 0.0)
    assert isinstance(refused, OverBudget)
    assert refused.retry_after_s == pytest.approx((1.0 + 0.5) / 0.25)  # its debt counts
    for _ in range(10):  # the debt is bounded by the bucket's capacity
        budget.release(budget.admit("a", 5.0, 0.0, idle=True))  # type: ignore[arg-type]
    assert budget._identities["a"].level == -2.0
