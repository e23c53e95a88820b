"""The simulator: determinism, conservation, the server model, summaries, the CLI's output."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.sim import experiments
from bench.sim.calibration import NOTES_CALIBRATION, Calibration
from bench.sim.model import Simulator, simulate
from bench.sim.params import ORACLE, POLICY_NAMES, SimParams
from bench.stats import mean
from bench.workloads import TokenizedMMLU, TokenRequest, poisson_arrivals, zipf_weights
from peer.config import DEFAULT_PROBATION_REQUESTS
from peer.swarm.incremental_bloom import IncrementalBloom
from protocols.bloom import BloomFilter

VOCAB = 49152


def synthetic_mmlu(subjects: int = 8, questions: int = 30, seed: int = 0) -> TokenizedMMLU:
    """Random token ids shaped like 5-shot MMLU: long shared prefixes, short questions."""
    rng = random.Random(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB) for _ in range(n))

    return TokenizedMMLU(
        tokenizer="synthetic",
        subjects=tuple(f"subject {i}" for i in range(subjects)),
        prefixes=tuple(ids(rng.randint(300, 600)) for _ in range(subjects)),
        questions=tuple(
            tuple(ids(rng.randint(30, 90)) for _ in range(questions)) for _ in range(subjects)
        ),
        answers=tuple(tuple((rng.randrange(VOCAB),) for _ in range(questions))
                      for _ in range(subjects)),
        markers={k: ids(3) for k in ("system", "user", "assistant", "end")},
    )


def workload(n: int = 300, rate: float = 3.0, s: float = 1.0, subjects: int = 8,
             seed: int = 0) -> list[TokenRequest]:
    rng = random.Random(seed)
    data = synthetic_mmlu(subjects, seed=seed)
    weights = zipf_weights(subjects, s)
    out = []
    for t in poisson_arrivals(rng, n, rate):
        k = rng.choices(range(subjects), weights)[0]
        q = rng.randrange(len(data.questions[k]))
        out.append(TokenRequest(t, k, data.prefixes[k], data.questions[k][q], 8, group=k))
    return out


SMALL = SimParams(peers=4, capacity_blocks=128, seed=3)


def test_tiny_run_completes() -> None:
    result = simulate(SMALL, workload(200))
    m = result.metrics
    assert m["requests"] == 180  # 10% warm-up left out
    assert all(0 < t <= e for t, e in zip(result.ttft_s, result.e2e_s, strict=True))
    assert 0 < m["hit_ratio"] < 1
    assert m["summaries_published"] > 0
    assert m["summaries_rejected"] == 0  # the real PeerTable accepts every summary


def test_warm_up_covers_the_first_summary_interval() -> None:
    """Before every peer's first summary (staggered over one interval) routing is blind;
    a fast workload whose first interval holds more than 10% of it leaves all of those
    requests out, a slow one only its first 10%, and warmup_fraction 0 none."""
    fast = workload(200, rate=40.0)
    early = sum(1 for r in fast if r.arrival_s < SMALL.summary_interval_s)
    assert early > 20  # the point of the case: more than 10% of 200
    assert simulate(SMALL, fast).metrics["requests"] == 200 - early
    assert simulate(SMALL, workload(200, rate=3.0)).metrics["requests"] == 180
    none = dataclasses.replace(SMALL, warmup_fraction=0.0)
    assert simulate(none, fast).metrics["requests"] == 200


def test_deterministic_under_seed() -> None:
    wl = workload(250)
    a = simulate(SMALL, wl)
    b = simulate(SMALL, wl)
    assert a.metrics == b.metrics
    assert a.ttft_s == b.ttft_s and a.served_by == b.served_by
    c = simulate(dataclasses.replace(SMALL, seed=4), wl)
    assert c.served_by != a.served_by  # entries and routes depend on the seed


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_request_completes_exactly_once(policy: str) -> None:
    wl = workload(150, rate=6.0)  # above the no-reuse capacity of 4 peers: queues build
    result = simulate(dataclasses.replace(SMALL, policy=policy), wl)
    assert result.completions == [1] * len(wl)
    assert len(result.served_by) == len(wl)
    assert all(0 <= p < SMALL.peers for p in result.served_by)


def test_oracle_hits_at_least_as_often_on_a_simple_case() -> None:
    # Requests 20 s apart (each is served alone), no delay, caches that never evict: the
    # cheapest route is the longest exact match, so the oracle hits whenever any policy could.
    wl = [dataclasses.replace(r, arrival_s=20.0 * i) for i, r in enumerate(workload(200, s=0.5))]
    params = SimParams(peers=4, delay_ms=0.0, capacity_blocks=4096, seed=1)
    hits = {p: simulate(dataclasses.replace(params, policy=p), wl).metrics["hit_ratio"]
            for p in POLICY_NAMES}
    for policy, hit in hits.items():
        assert hits[ORACLE] >= hit - 1e-9, (policy, hits)
    assert hits[ORACLE] > hits["random"] + 0.1


def test_local_policy_never_forwards() -> None:
    result = simulate(dataclasses.replace(SMALL, policy="local"), workload(100))
    assert result.metrics["forwarded_fraction"] == 0.0


def test_batching_server_by_hand() -> None:
    """Steps of the batching engine: a step costs decode_s * (1 - s + s * decodes) plus its
    prefill chunks (here 1 ms a token, no fixed or context cost; s = 0.5, decode 10 ms)."""
    cal = Calibration("flat", 0.0, 1e-3, 0.0, 0.01, "test", batch_step_slope=0.5)
    a, b = tuple(range(100)), tuple(range(1000, 1100))
    params = SimParams(policy="local", peers=1, calibration=cal, warmup_fraction=0.0)
    # a arrives and its step starts at once (5 ms + 100 ms); b joins the next step, which
    # also decodes a (10 ms + 100 ms); then one step decodes both (15 ms), then b alone.
    result = simulate(params, [TokenRequest(0.0, 0, a, (), 3), TokenRequest(0.0, 1, b, (), 3)])
    assert result.ttft_s == pytest.approx([0.105, 0.215])
    assert result.e2e_s == pytest.approx([0.23, 0.24])
    # One slot: b waits until a has completed (3 steps), then runs alone.
    one = dataclasses.replace(params, max_running=1)
    result = simulate(one, [TokenRequest(0.0, 0, a, (), 3), TokenRequest(0.0, 1, b, (), 3)])
    assert result.ttft_s == pytest.approx([0.105, 0.23])
    # A prompt longer than the step budget is read in chunks of 256, 256 and 88 tokens.
    long = tuple(range(600))
    assert simulate(params, [TokenRequest(0.0, 0, long, (), 1)]).ttft_s == pytest.approx([0.615])
    # The second request arrives after the first has prefilled: it reuses 96 tokens
    # (6 full blocks, the last token is always computed): 5 ms + 4 ms.
    result = simulate(params, [TokenRequest(0.0, 0, a, (), 1), TokenRequest(1.0, 0, a, (), 1)])
    assert result.ttft_s == pytest.approx([0.105, 0.009])
    assert result.metrics["hit_ratio"] == pytest.approx(96 / 200)


def test_the_engine_holds_a_prompt_that_shares_one_being_read() -> None:
    """The engine's hold rule (scheduler.waits_for_shared_prefill): b, the same 600-token
    prompt as a, arrives while a is read in three steps (256, 256, 88 tokens, 5 ms each
    fixed: 0.615 s); b waits instead of reading it again, then reuses 592 tokens (37 full
    blocks) and computes 8 (5 ms + 8 ms)."""
    cal = Calibration("flat", 0.0, 1e-3, 0.0, 0.01, "test", batch_step_slope=0.5)
    long = tuple(range(600))
    params = SimParams(policy="local", peers=1, calibration=cal, warmup_fraction=0.0)
    sim = Simulator(params, [TokenRequest(0.0, 0, long, (), 1),
                             TokenRequest(0.001, 0, long, (), 1)])
    result = sim.run()
    assert [job.cached for job in sim.jobs] == [0, 592]
    assert result.ttft_s == pytest.approx([0.615, 0.627])


def test_busiest_peer_utilization_is_busy_time_while_measured_requests_arrive() -> None:
    """One peer, a 100-token prompt every second, each served alone in 105 ms: over the
    window from the first to the last arrival (10 s) it is busy 10 x 105 ms."""
    cal = Calibration("flat", 0.0, 1e-3, 0.0, 0.01, "test", batch_step_slope=0.5)
    reqs = [TokenRequest(float(i), i, tuple(range(i, i + 100)), (), 1) for i in range(11)]
    params = SimParams(policy="local", peers=1, calibration=cal, warmup_fraction=0.0)
    m = simulate(params, reqs).metrics
    assert m["busiest_peer_utilization"] == pytest.approx(1.05 / 10)
    two = dataclasses.replace(params, peers=2, policy="round_robin", delay_ms=0.0)
    m = simulate(two, reqs).metrics  # the busiest of two serves 6 of the 11, 5 in the window
    assert m["busiest_peer_utilization"] == pytest.approx(5 * 0.105 / 10)


def test_requests_enter_where_the_caller_says() -> None:
    """A testbed's prediction replays the run's own entries (bench/testbed/workload.py
    `entry_peers`): each job enters at the peer given for it, not at a seeded draw, and a
    list that does not name a peer per request is refused."""
    wl = workload(40)
    entries = [(3 * i) % SMALL.peers for i in range(len(wl))]
    sim = Simulator(SMALL, wl, entries)
    sim.run()
    assert sorted((job.rid, job.entry) for job in sim.jobs if job.shadow is None) == list(
        enumerate(entries))
    drawn = Simulator(SMALL, wl)
    drawn.run()
    assert [j.entry for j in sorted(drawn.jobs, key=lambda j: j.rid)
            if j.shadow is None] != entries
    with pytest.raises(ValueError, match="one of"):
        Simulator(SMALL, wl, entries[:-1])
    with pytest.raises(ValueError, match="one of"):
        Simulator(SMALL, wl, [SMALL.peers] * len(wl))


def test_swarm_trust_established_or_cold() -> None:
    """An established swarm starts with every peer past every other's probation (the live
    ledger, fed matching shadow answers) and sends no shadow; in a cold one every peer
    starts on probation for every other, serves no client until promoted, and is promoted
    by the entries' shadows (the live ShadowPlanner: DEFAULT_PROBATION_REQUESTS matches):
    forwards start and grow as pairs are promoted."""
    wl = workload(300)
    runs = {}
    for state, probation in (("established", False), ("cold", True)):
        params = dataclasses.replace(SMALL, swarm_trust=state)
        sim = Simulator(params, wl)
        assert all(p.trust.on_probation(q.peer_id) is probation
                   for p in sim.peers for q in sim.peers if p is not q)
        runs[state] = (sim, sim.run().metrics)
    sim, m = runs["established"]
    assert m["shadows_per_request"] == 0 and not sim.shadow_jobs and not sim.promotions
    assert m["trusted_pair_fraction"] == 1.0
    sim, m = runs["cold"]
    assert sim.promotions and m["shadows_per_request"] > 0
    assert m["trusted_pair_fraction"] == len(sim.promotions) / (4 * 3)
    promoted = {(entry, peer): t for t, entry, peer in sim.promotions}
    for job in sim.jobs:  # a client is served by its entry or by a peer it promoted earlier
        if job.target != job.entry:
            assert promoted[job.entry, job.target] <= job.arrival
    for (entry, peer), t in promoted.items():  # after exactly K shadows, then none
        to_peer = [j for j in sim.shadow_jobs if (j.entry, j.target) == (entry, peer)]
        assert sum(1 for j in to_peer if j.arrival < t) == DEFAULT_PROBATION_REQUESTS
        assert all(j.arrival < t for j in to_peer)
    half = len(sim.jobs) // 2
    early, late = ([j.target != j.entry for j in part]
                   for part in (sim.jobs[:half], sim.jobs[half:]))
    assert 0 <= mean(early) < mean(late)
    assert 0 < m["forwarded_fraction"] < runs["established"][1]["forwarded_fraction"]
    with pytest.raises(ValueError, match="swarm_trust"):
        SimParams(swarm_trust="warm")


def test_shadows_cost_the_newcomer_compute_and_reach_no_client() -> None:
    """Two cold peers, a distinct 100-token prompt every second, each read alone in
    100 ms: every request is served once for its client; each shadow is one more 100 ms
    job at the peer on probation, none is a client's; both peers are promoted after K
    shadows each, then forward."""
    cal = Calibration("flat", 0.0, 1e-3, 0.0, 0.01, "test", batch_step_slope=1.0)
    rng = random.Random(5)
    reqs = [TokenRequest(float(i), i, tuple(rng.randrange(VOCAB) for _ in range(100)), (), 1)
            for i in range(60)]
    params = SimParams(policy="round_robin", peers=2, delay_ms=1.0, jitter=0.0,
                       calibration=cal, warmup_fraction=0.0, swarm_trust="cold")
    sim = Simulator(params, reqs)
    result = sim.run()
    assert result.completions == [1] * len(reqs)
    assert len(result.ttft_s) == len(reqs)
    assert sum(p.served for p in sim.peers) == len(reqs)
    shadows = sum(p.shadows_served for p in sim.peers)
    assert shadows == 2 * DEFAULT_PROBATION_REQUESTS == len(sim.shadow_jobs)
    assert all(j.shadow is not None and j.shadow.peer_id == sim.peers[j.target].peer_id
               and j.target != j.entry for j in sim.shadow_jobs)
    busy = sum(p.busy_s for p in sim.peers)
    assert busy == pytest.approx(0.1 * (len(reqs) + shadows))
    assert sorted((e, p) for _, e, p in sim.promotions) == [(0, 1), (1, 0)]
    assert 0 < result.metrics["forwarded_fraction"] < 1


def test_forwarding_pays_stream_setup_and_both_ways() -> None:
    # Two peers, d = 100 ms without jitter: a forwarded request pays its setup round trips
    # and 2 one-ways (slope 1: a step has no fixed cost, a lone prefill of 100 tokens takes
    # 100 ms).
    cal = Calibration("flat", 0.0, 1e-3, 0.0, 0.01, "test", batch_step_slope=1.0)
    reqs = [TokenRequest(float(i), i, tuple(range(i, i + 100)), (), 1) for i in range(40)]
    params = SimParams(policy="round_robin", peers=2, delay_ms=100.0, jitter=0.0,
                       calibration=cal, warmup_fraction=0.0)
    ttfts = sorted(round(t, 6) for t in simulate(params, reqs).ttft_s)
    assert set(ttfts) == {0.1, 0.3}  # prefill alone, or 2 x 100 ms more (a lazy stream)
    setup = dataclasses.replace(params, forward_setup_rtts=1)
    ttfts = sorted(round(t, 6) for t in simulate(setup, reqs).ttft_s)
    assert set(ttfts) == {0.1, 0.5}  # a round trip more to open the stream first


def test_summary_interval_and_early_publish() -> None:
    wl = workload(300)
    slow = simulate(dataclasses.replace(SMALL, summary_interval_s=30.0, early_publish=False), wl)
    fast = simulate(dataclasses.replace(SMALL, summary_interval_s=0.5, early_publish=False), wl)
    duration = slow.metrics["duration_s"]
    # every peer publishes once per interval (first one at a random phase)
    assert slow.metrics["summaries_published"] == pytest.approx(4 * duration / 30, abs=8)
    assert fast.metrics["summaries_published"] == pytest.approx(4 * duration / 0.5, rel=0.05)
    early = simulate(dataclasses.replace(SMALL, summary_interval_s=30.0), wl)
    assert early.metrics["summaries_published"] > 2 * slow.metrics["summaries_published"]


def test_bloom_bits_per_entry_shapes_the_filter() -> None:
    for bits in (4.0, 8.0, 16.0):
        f = dataclasses.replace(SMALL, capacity_blocks=512, bloom_bits_per_entry=bits
                                ).bloom_template()
        assert f.num_bits == 512 * bits
        assert f.num_hashes == round(bits * math.log(2))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 60)), max_size=200))
def test_incremental_bloom_equals_a_rebuild(ops: list[tuple[bool, int]]) -> None:
    template = BloomFilter.for_capacity(64, 0.01)
    inc = IncrementalBloom(template)
    keys = [random.Random(i).getrandbits(64) for i in range(61)]
    present: set[int] = set()
    for add, i in ops:
        if add:
            inc.add(keys[i])
            present.add(keys[i])
        elif keys[i] in present:
            inc.remove(keys[i])
            present.discard(keys[i])
    rebuilt = BloomFilter(template.num_bits, template.num_hashes)
    rebuilt.update(present)
    assert inc.to_bytes() == rebuilt.to_bytes()
    assert len(inc) == len(present)


def test_incremental_bloom_refuses_unknown_removal() -> None:
    inc = IncrementalBloom(BloomFilter.for_capacity(16))
    with pytest.raises(ValueError):
        inc.remove(12345)


def test_calibration_reproduces_the_notes() -> None:
    cal = NOTES_CALIBRATION
    assert cal.prefill_s(512, 0) == pytest.approx(1.0, rel=0.1)
    assert cal.prefill_s(1024, 0) == pytest.approx(2.2, rel=0.1)
    assert cal.prefill_s(512, 0) / cal.prefill_s(112, 400) == pytest.approx(3.4, rel=0.15)
    assert cal.prefill_s(1008, 0) / cal.prefill_s(112, 896) == pytest.approx(5.25, rel=0.15)
    assert cal.decode_s(10) == pytest.approx(0.7)
    fitted = Calibration.from_points(
        [(0, 512, 1.0), (0, 1024, 2.2), (400, 112, 1.0 / 3.4), (896, 112, 2.16 / 5.25)],
        0.07, "refit", "test")
    assert fitted.prefill_s_per_token == pytest.approx(cal.prefill_s_per_token, rel=0.02)


def test_calibration_from_a_bench_engine_result(tmp_path) -> None:
    cal = NOTES_CALIBRATION
    doc = {"prompt_tokens": 1016, "cached_tokens_hit50": 496, "cached_tokens_hit90": 912,
           "ttft_cold_s": cal.prefill_s(1016, 0), "ttft_hit50_s": cal.prefill_s(520, 496),
           "ttft_hit90_s": cal.prefill_s(104, 912)}
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(doc))
    fitted = Calibration.from_engine_json(path)
    for new, cached in ((512, 0), (100, 400), (1024, 0)):
        assert fitted.prefill_s(new, cached) == pytest.approx(cal.prefill_s(new, cached), rel=1e-6)
    assert fitted.decode_s_per_token == cal.decode_s_per_token


def test_params_are_validated() -> None:
    with pytest.raises(ValueError):
        SimParams(policy="nearest")
    with pytest.raises(ValueError):
        SimParams(peers=0)
    with pytest.raises(ValueError):
        simulate(SMALL, [])


def tiny_grid() -> experiments.Grid:
    base = experiments.Base(peers=4, requests=120, subjects=None, seed=2,
                            sim=SimParams(capacity_blocks=128))
    return experiments.Grid(base=base, delays_ms=(0, 50), zipf_s=(1.0,), loads=(0.5, 1.5),
                            policies=("random", "cost", ORACLE), skew_load_policies=None,
                            experiments=("delay", "skew", "load"))


def test_a_short_mmlu_run_draws_requests_for_its_minimum_length() -> None:
    data = synthetic_mmlu()
    sim = SimParams(peers=4, capacity_blocks=128)
    plain = experiments.Base(peers=4, requests=120, sim=sim)
    at_least = dataclasses.replace(plain, min_run_s=60.0)
    short, rate = experiments.make_workload(data, plain, 4, 1.0, 2.0, 120)
    assert len(short) == 120 and short[-1].arrival_s < 60.0  # the case the floor is for
    longer, rate2 = experiments.make_workload(data, at_least, 4, 1.0, 2.0, 120)
    assert longer[-1].arrival_s >= 0.9 * 60.0 and len(longer) > 120
    assert rate2 == pytest.approx(rate, rel=0.1)  # the same load: the rate is the load's
    light, _ = experiments.make_workload(data, at_least, 4, 1.0, 0.01, 120)
    same, _ = experiments.make_workload(data, plain, 4, 1.0, 0.01, 120)
    assert light == same  # a run already long enough keeps its draw


def test_the_quick_grid_sweeps_the_gpu_regime_to_a_higher_load() -> None:
    grid = experiments.quick_grid()
    assert grid.base.min_run_s == experiments.QUICK_MIN_RUN_S > 0
    assert grid.loads_for("cpu") == experiments.QUICK_LOADS
    assert max(grid.loads_for("gpu")) > max(experiments.QUICK_LOADS)
    loads = {(s.regime, s.load) for s in experiments.specs(grid) if s.experiment == "load"}
    assert ("gpu", 3.0) in loads and ("cpu", 3.0) not in loads


def test_grid_rows_and_cli_json(tmp_path, monkeypatch) -> None:
    import bench.simulate as cli

    data = synthetic_mmlu()
    monkeypatch.setattr(cli, "load_tokenized_mmlu", lambda: data)
    monkeypatch.setattr(cli, "quick_grid", lambda seed, seeds=1: tiny_grid())
    out = tmp_path / "quick.json"
    plots = tmp_path / "plots"
    assert cli.main(["--quick", "--jobs", "1", "--json", str(out), "--plots", str(plots)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc) >= {"params", "rows"}
    rows = doc["rows"]
    assert len(rows) == 3 * (2 + 1 + 2)
    for row in rows:
        assert set(experiments.REQUIRED_ROW_KEYS) <= row.keys()
        assert row["peers"] == 4
    assert {r["experiment"] for r in rows} == {"delay", "skew", "load"}
    assert (tmp_path / "plots" / "a_delay.png").stat().st_size > 0
    assert (tmp_path / "plots" / "cost_vs_best.md").exists()


def test_held_out_check_per_seed_on_the_mean_and_at_the_busy_load() -> None:
    from bench.sim.checks import held_out

    def row(seed, policy, ttft, load=0.5, busy=0.5, experiment="load", regime="cpu"):
        return {"experiment": experiment, "regime": regime, "seed": seed, "policy": policy,
                "peers": 16, "delay_ms": 5.0, "zipf_s": 1.0, "load": load,
                "ttft_mean_s": ttft, "busiest_peer_utilization": busy}

    rows = []
    for seed, cost in ((101, 1.0), (102, 1.3)):  # 0% and 30% behind random: mean 15%
        rows += [row(seed, "cost", cost), row(seed, "random", 1.0), row(seed, "oracle", 0.5)]
        rows += [row(seed, "cost", 2.0, 2.0, 0.95), row(seed, "random", 3.0, 2.0, 1.0),
                 row(seed, "oracle", 1.6, 2.0, 0.9),  # 1.25x: the busy target holds
                 row(seed, "cost", 4.0, 2.5, 1.0), row(seed, "oracle", 2.0, 2.5, 1.0)]
    out = held_out(rows)
    assert out["seeds"] == [101, 102]
    by_load = {m["load"]: m for m in out["mean"]}
    assert by_load[0.5]["ratio"] == pytest.approx(1.15)
    assert by_load[0.5]["best_other_policy"] == "random"
    assert max(c["ratio"] for c in out["per_seed"]) == pytest.approx(1.3)
    busy = [(t["load"], t["target_applies"]) for t in out["busy_load"]]
    assert busy == [(2.0, True), (2.5, False)]  # the lowest load >= 90% busy is the target
    assert out["targets"] == {"mean_within_5pct": False, "each_seed_within_15pct": False,
                              "busy_load_reached": True, "busy_cost_over_oracle_le_1_3": True}
    assert not out["pass"]

