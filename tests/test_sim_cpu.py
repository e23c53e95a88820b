"""The simulator's account of a whole peer's CPU: what it spends outside its engine's
steps (requests, forwards, summaries, the entry's re-scores of answers) and the CPU quota
that holds it, as the testbed's peers are held."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.sim.calibration import Calibration
from bench.sim.model import Simulator, simulate
from bench.sim.params import SimParams
from bench.sim.quota import CpuQuota
from bench.workloads import TokenRequest
from tests.test_simulate import SMALL, workload


def test_overheads_outside_the_engine_take_the_peers_cpu() -> None:
    """A whole peer's CPU per request outside its engine's steps: the serving peer's
    `request_overhead_s` comes before the request's step (TTFT and busy time grow by
    it), its `request_tail_s` after the first token (busy time only), the entry's
    `forward_overhead_s` per request it forwards (on the request's path too); the
    engine's measured speeds leave them out."""
    cal = Calibration("flat", 0.0, 1e-3, 0.0, 0.01, "test", batch_step_slope=1.0)
    reqs = [TokenRequest(float(i), i, tuple(range(i, i + 100)), (), 1) for i in range(40)]
    params = SimParams(policy="round_robin", peers=2, delay_ms=100.0, jitter=0.0,
                       calibration=cal, warmup_fraction=0.0)
    paid = dataclasses.replace(params, calibration=dataclasses.replace(
        cal, request_overhead_s=0.02, request_tail_s=0.01, forward_overhead_s=0.03))
    plain, charged = Simulator(params, reqs), Simulator(paid, reqs)
    base, over = plain.run(), charged.run()
    # each request alone: 20 ms more before its step, served locally or forwarded, and a
    # forward waits 30 ms more for its entry
    assert sorted({round(t, 6) for t in over.ttft_s}) == [0.12, 0.35]
    forwards = [sum(1 for j in charged.jobs if j.entry == p.idx != j.target)
                for p in charged.peers]
    assert all(forwards)
    for before, after, sent in zip(plain.peers, charged.peers, forwards, strict=True):
        # (the run ends at the last answer: that request's tail may go unpaid)
        assert after.busy_s - before.busy_s == pytest.approx(0.03 * after.served + 0.03 * sent,
                                                             abs=0.0101)
        # steps of the same work, measured alike
        assert tuple(after.speeds) == pytest.approx(tuple(before.speeds))
    assert over.metrics["hit_ratio"] == base.metrics["hit_ratio"]


def test_the_client_path_reaches_the_client_not_the_peers() -> None:
    """`client_path_s` is wall time between a client and its entry: every request that
    enters at that peer reaches its client that much later, first token and last, and
    nothing a peer does or decides changes with it."""
    cal = Calibration("flat", 0.0, 1e-3, 0.0, 0.01, "test", batch_step_slope=1.0)
    reqs = [TokenRequest(0.05 * i, i % 5, tuple(range(i % 5, i % 5 + 100)), (), 3)
            for i in range(60)]
    params = SimParams(policy="cost", peers=3, delay_ms=5.0, jitter=0.0, calibration=cal,
                       warmup_fraction=0.0)
    far = dataclasses.replace(cal, client_path_s=0.004)
    paths = dataclasses.replace(params, peer_calibrations=(cal, far, cal))
    plain, pathed = Simulator(params, reqs), Simulator(paths, reqs)
    base, shifted = plain.run(), pathed.run()
    extra = [0.004 if job.entry == 1 else 0.0 for job in sorted(pathed.jobs, key=lambda j: j.rid)]
    assert 0 < sum(1 for e in extra if e) < len(extra)
    assert shifted.ttft_s == pytest.approx([t + e for t, e in zip(base.ttft_s, extra, strict=True)])
    assert shifted.e2e_s == pytest.approx([t + e for t, e in zip(base.e2e_s, extra, strict=True)])
    assert [j.target for j in pathed.jobs] == [j.target for j in plain.jobs]
    assert [p.busy_s for p in pathed.peers] == [p.busy_s for p in plain.peers]


def test_every_summary_takes_its_publishers_and_each_receivers_cpu() -> None:
    """`summary_publish_s` per summary a peer sends and `summary_receive_s` per summary
    it gets (full gossip: from every other peer): busy time grows by exactly that, and
    a peer that serves nothing is busy with gossip alone."""
    cal = Calibration("flat", 0.0, 1e-3, 0.0, 0.01, "test", batch_step_slope=1.0)
    reqs = [TokenRequest(0.5 * i, i, tuple(range(i * 1000, i * 1000 + 100)), (), 1)
            for i in range(20)]
    params = SimParams(policy="local", peers=3, delay_ms=5.0, jitter=0.0, calibration=cal,
                       warmup_fraction=0.0, summary_interval_s=1.0)
    paid = dataclasses.replace(params, calibration=dataclasses.replace(
        cal, summary_publish_s=0.002, summary_receive_s=0.003))
    plain, charged = Simulator(params, reqs), Simulator(paid, reqs)
    plain.run()
    charged.run()
    received = [0] * 3
    for p in charged.peers:
        for other in charged.peers:
            if other is not p:
                received[other.idx] += p.published
    for before, after, got in zip(plain.peers, charged.peers, received, strict=True):
        assert after.published == before.published > 0  # gossip itself is unchanged
        # (a summary still on its way when the run ends is not paid by its receivers)
        assert after.busy_s - before.busy_s == pytest.approx(
            0.002 * after.published + 0.003 * got, abs=0.003 * 3)
    assert all(p.busy_s > 0 for p in charged.peers)


@given(st.lists(st.tuples(st.floats(0.0, 0.3), st.floats(0.0, 0.5)), min_size=1, max_size=20),
       st.sampled_from([0.1, 0.25, 0.5, 1.0]))
@settings(max_examples=200, deadline=None)
def test_a_cpu_quota_runs_at_full_speed_within_its_budget(
        pieces: list[tuple[float, float]], share: float) -> None:
    """Never faster than one core, never slower than the share by more than a period,
    and no period gives more than its budget."""
    quota = CpuQuota(share, 0.1)
    t = 0.0
    used: dict[int, float] = {}
    for gap, work in pieces:
        start = t + gap
        end = quota.run(start, work)
        assert start + work - 1e-9 <= end <= start + work / share + 0.1 + 1e-9
        if work > 0 and end - start < 0.1 - 1e-9 and math.floor(start / 0.1) == math.floor(
                (end - 1e-12) / 0.1):
            used[math.floor(start / 0.1)] = used.get(math.floor(start / 0.1), 0.0) + work
        t = end
    assert all(u <= share * 0.1 + 1e-9 for u in used.values())


def test_a_peer_under_a_quota_is_quick_when_idle_and_held_when_busy() -> None:
    """A 0.25-core quota (25 ms a 100 ms period): a lone 10 ms request takes 10 ms, not
    the fluid 40 ms; 60 ms of work takes three periods; the busy time is the work over
    the share, as a cgroup's CPU over its share reads."""
    cal = Calibration("flat", 0.0, 1e-4, 0.0, 0.01, "test", batch_step_slope=1.0)
    short = [TokenRequest(float(i), i, tuple(range(i * 1000, i * 1000 + 100)), (), 1)
             for i in range(3)]
    params = SimParams(policy="local", peers=1, calibration=cal, warmup_fraction=0.0,
                       cpu_quotas=(0.25,))
    sim = Simulator(params, short)
    assert sim.run().ttft_s == pytest.approx([0.01] * 3)
    assert sim.peers[0].busy_s == pytest.approx(3 * 0.01 / 0.25)
    long = [TokenRequest(0.0, 0, tuple(range(600)), (), 1)]  # 3 chunks of 20 ms (1e-4/token)
    assert simulate(params, long).ttft_s == pytest.approx([0.2 + 0.01])
    with pytest.raises(ValueError, match="cpu_quotas"):
        SimParams(cpu_quotas=(1.5,))


def test_a_throttled_peer_runs_nothing_until_its_next_period() -> None:
    """`runnable_at`: once a period's budget has run out, the peer's other threads wait
    for the next period with budget; before that moment, and in a period not used up,
    they run at once. So a throttled entry sends a forward late, and holds a forward's
    first token until it can relay it to the client."""
    quota = CpuQuota(0.25, 0.1)  # 25 ms a period
    assert quota.run(0.0, 0.06) == pytest.approx(0.21)  # 25 + 25 + 10 ms
    assert quota.runnable_at(0.01) == 0.01  # the budget lasted until 25 ms
    assert quota.runnable_at(0.03) == pytest.approx(0.1)  # throttled from 25 to 100 ms
    assert quota.runnable_at(0.15) == pytest.approx(0.2)  # ... and from 125 to 200 ms
    assert quota.runnable_at(0.205) == 0.205  # 10 ms of 25 used: not throttled
    assert quota.runnable_at(5.0) == 5.0
    cal = Calibration("flat", 0.0, 1e-4, 0.0, 0.01, "test", batch_step_slope=1.0)
    # the oracle forwards the second request to the idle full-core peer (the others know
    # no peer before its first summary); the entry is throttled from 25 to 100 ms by the
    # first request's 100 ms of work, so the forward leaves at 100 ms, not at 50
    params = SimParams(policy="oracle", peers=2, calibration=cal, warmup_fraction=0.0,
                       delay_ms=0.0, cpu_quotas=(0.25, 1.0))
    second = TokenRequest(0.05, 1, tuple(range(5000, 5300)), (), 1)  # 30 ms at peer 1
    sim = Simulator(params, [TokenRequest(0.0, 0, tuple(range(1000)), (), 1), second],
                    [0, 0])
    sim.run()
    (job,) = [j for j in sim.jobs if j.target != j.entry]
    assert job.sent == pytest.approx(0.1) and job.arrival + job.ttft == pytest.approx(0.13)
    # a first token back at the entry at 150 ms (throttled from 125 ms) reaches the
    # client at 200 ms; one back at 110 ms at once
    entry = sim.peers[0]
    for back, relayed in ((0.15, 0.2), (0.11, 0.11)):
        job.ttft = math.nan
        sim._first_back(entry, job, back)
        assert job.arrival + job.ttft == pytest.approx(relayed)


def test_trust_checks_price_the_entrys_rescores() -> None:
    """With `trust_checks` the simulated entry re-scores answers as the live pipeline
    does: a verified answer (the ledger's verify_fraction of forwards) reaches its client
    whole, after the re-score at the entry, so its TTFT is its end to end and lies past
    the answer's return; the first answers of each promoted peer are audited (at most
    DEFAULT_PROBATION_REQUESTS per entry and peer run); the
    re-scores cost the swarm CPU. Without, no answer is checked."""
    from peer.routing.trust import DEFAULT_PROBATION_REQUESTS

    wl = workload(400, rate=4.0)
    runs = {}
    for checks in (False, True):
        params = dataclasses.replace(SMALL, policy="random", trust_checks=checks)
        sim = Simulator(params, wl)
        runs[checks] = (sim, sim.run().metrics)
    sim, m = runs[False]
    assert not any(j.verify for j in sim.jobs)
    assert m["verified_per_request"] == m["audits_per_request"] == 0.0
    sim, m = runs[True]
    forwarded = [j for j in sim.jobs if j.target != j.entry]
    verified = [j for j in forwarded if j.verify]
    assert 0.03 * len(forwarded) <= len(verified) <= 0.2 * len(forwarded)
    for job in verified:
        assert job.ttft == job.e2e and job.arrival + job.ttft > job.answered
    assert not any(j.verify for j in sim.jobs if j.target == j.entry)
    # an audit dropped (AUDITS_WAITING were waiting) is asked for again by the ledger
    pairs = SMALL.peers * (SMALL.peers - 1)
    assert 0 < sim.audits_run <= pairs * DEFAULT_PROBATION_REQUESTS
    assert m["audits_per_request"] == sim.audits_run / len(wl)
    busy = [sum(p.busy_s for p in s.peers) for s, _ in (runs[False], runs[True])]
    assert busy[1] > busy[0]
