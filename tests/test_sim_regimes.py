"""Regimes, multi-turn workloads, seeds and the claims script of the simulator."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest

from bench import claims
from bench.sim import experiments
from bench.sim.calibration import Calibration
from bench.sim.model import simulate
from bench.sim.params import EXACT_LONGEST_PREFIX, SimParams
from bench.sim.regimes import GPU_CALIBRATION, MIXED_GPU_EVERY, regime
from bench.workloads import TokenRequest, agent_requests, chat_requests
from tests.test_simulate import synthetic_mmlu, workload

FLAT = Calibration("flat", 0.0, 1e-3, 0.0, 0.01, "test")


def test_regimes_are_parameter_sets() -> None:
    gpu = regime("gpu")
    # the figure to match: recomputing a 377-token prefix costs ~40 ms on a GPU-class peer
    assert 0.03 < gpu.calibration.prefill_s(377, 0) < 0.06
    assert gpu.calibration.source and "vLLM" in gpu.calibration.source
    cpu = regime("cpu")
    assert cpu.calibration.prefill_s(377, 0) > 5 * gpu.calibration.prefill_s(377, 0)
    mixed = regime("mixed")
    sim = dataclasses.replace(SimParams(), peer_calibrations=mixed.peer_calibrations)
    fast = [i for i in range(16) if sim.calibration_of(i) is GPU_CALIBRATION]
    assert fast == list(range(0, 16, MIXED_GPU_EVERY))
    with pytest.raises(ValueError):
        regime("tpu")


def test_heterogeneous_capacity_and_routing() -> None:
    slow = FLAT.scaled(10)
    wl = workload(300, rate=4.0)
    homo = SimParams(peers=4, capacity_blocks=128, seed=3, calibration=FLAT)
    mixed = dataclasses.replace(homo, peer_calibrations=(FLAT, slow))
    # the offered load counts each peer's own capacity
    r_homo = experiments.arrival_rate(wl, homo, 4, 1.0)
    r_mixed = experiments.arrival_rate(wl, mixed, 4, 1.0)
    assert r_mixed == pytest.approx(r_homo * (1 + 0.1) / 2, rel=1e-9)
    # the cost router sends the fast peers more than their head count
    res = simulate(dataclasses.replace(mixed, policy="cost"), wl)
    fast_share = sum(1 for t in res.served_by if t % 2 == 0) / len(res.served_by)
    assert fast_share > 0.6
    # the oracle prices each peer at its own speed: never slower than random here
    orc = simulate(dataclasses.replace(mixed, policy="oracle"), wl).metrics["ttft_mean_s"]
    rnd = simulate(dataclasses.replace(mixed, policy="random"), wl).metrics["ttft_mean_s"]
    assert orc < rnd


def test_exact_longest_prefix_finds_the_longest_match() -> None:
    wl = workload(300)
    exact = simulate(dataclasses.replace(workload_params(), policy=EXACT_LONGEST_PREFIX), wl)
    rnd = simulate(dataclasses.replace(workload_params(), policy="random"), wl)
    assert exact.metrics["hit_ratio"] > rnd.metrics["hit_ratio"]
    # a request whose prefix is cached on one peer only goes there
    prefix = tuple(range(200))
    reqs = [TokenRequest(0.0, 0, prefix, (1,), 1), TokenRequest(5.0, 0, prefix, (2,), 1)]
    params = SimParams(policy=EXACT_LONGEST_PREFIX, peers=8, calibration=FLAT,
                       warmup_fraction=0.0, seed=1)
    res = simulate(params, reqs)
    assert res.served_by[0] == res.served_by[1]
    assert res.metrics["hit_ratio"] > 0.45


def workload_params() -> SimParams:
    return SimParams(peers=4, capacity_blocks=128, seed=3)


def test_chat_and_agent_turns_extend_each_other() -> None:
    data = synthetic_mmlu()
    for reqs in (chat_requests(data, 20, 1.0, seed=1), agent_requests(data, 20, 1.0, seed=1)):
        assert reqs == sorted(reqs, key=lambda r: r.arrival_s)
        sessions: dict[int, list[TokenRequest]] = {}
        for r in reqs:
            sessions.setdefault(r.group, []).append(r)
        assert len(sessions) == 20
        for turns in sessions.values():
            assert [t.turn for t in turns] == list(range(len(turns)))
            for prev, nxt in itertools.pairwise(turns):
                prompt = prev.prefix + prev.suffix
                assert (nxt.prefix + nxt.suffix)[: len(prompt)] == prompt
                assert nxt.prefix[len(prompt) : len(prompt) + len(prev.output)] == prev.output
    agents = agent_requests(data, 30, 1.0, agents=3, seed=2)
    firsts = {r.prefix for r in agents if r.turn == 0}
    assert len(firsts) <= 3  # first steps share their agent's system prompt
    assert chat_requests(data, 5, 1.0, seed=4) == chat_requests(data, 5, 1.0, seed=4)


def test_followup_cached_fraction() -> None:
    data = synthetic_mmlu()
    reqs = chat_requests(data, 30, 0.5, think_s=30.0, seed=1)
    one = SimParams(policy="local", peers=1, calibration=FLAT, capacity_blocks=4096,
                    warmup_fraction=0.0)
    m = simulate(one, reqs).metrics
    assert m["followup_turns"] == sum(1 for r in reqs if r.turn > 0)
    assert m["followup_cached_fraction"] == 1.0  # one peer, room for everything
    tiny = dataclasses.replace(one, capacity_blocks=8)
    assert simulate(tiny, reqs).metrics["followup_cached_fraction"] < 0.5
    spread = dataclasses.replace(one, policy="random", peers=8, capacity_blocks=4096)
    assert simulate(spread, reqs).metrics["followup_cached_fraction"] < 0.5
    assert math.isnan(simulate(one, workload(50)).metrics["followup_cached_fraction"])


def tiny_grid() -> experiments.Grid:
    base = experiments.Base(peers=4, requests=80, seed=2, sim=SimParams(capacity_blocks=128))
    return experiments.Grid(base=base, delays_ms=(0, 50), loads=(0.5, 1.5),
                            policies=("local", "longest_prefix", "cost", "oracle"),
                            skew_load_policies=None, experiments=("delay", "load", "chat"),
                            regimes=("cpu", "gpu"), seeds=(1, 2),
                            delays_by_regime=(("gpu", (0, 5)),),
                            multi_turn_policies=("random", "cost"),
                            multi_turn_delays_ms=(5.0,))


def test_grid_rows_carry_seed_regime_and_workload() -> None:
    grid = tiny_grid()
    rows = experiments.run_grid(grid, synthetic_mmlu())
    # per seed and regime: 2 delays x 4 + 2 loads x 4 (the base point shared) + 2 chat
    assert len(rows) == 2 * 2 * (8 + 8 + 2)
    for r in rows:
        assert set(experiments.REQUIRED_ROW_KEYS) <= r.keys()
        assert r["sim_seed"] == r["seed"] + experiments.SIM_SEED_OFFSET
    assert {(r["regime"], r["seed"]) for r in rows} == {(g, s) for g in ("cpu", "gpu")
                                                        for s in (1, 2)}
    assert {r["delay_ms"] for r in rows if r["regime"] == "gpu" and
            r["experiment"] == "delay"} == {0.0, 5.0}
    chat = [r for r in rows if r["workload"] == "chat"]
    assert chat and all(0 <= r["followup_cached_fraction"] <= 1 for r in chat)
    # seeds differ, the same seed gives the same row
    by = {(r["regime"], r["seed"], r["experiment"], r["policy"], r["delay_ms"], r["load"]):
          r["ttft_mean_s"] for r in rows}
    assert by[("cpu", 1, "delay", "cost", 0.0, 0.5)] != by[("cpu", 2, "delay", "cost", 0.0, 0.5)]
    again = experiments.run_grid(dataclasses.replace(grid, seeds=(2,), regimes=("cpu",)),
                                 synthetic_mmlu())
    r2 = next(r for r in again if r["experiment"] == "delay" and r["policy"] == "cost"
              and r["delay_ms"] == 0.0)
    assert r2["ttft_mean_s"] == by[("cpu", 2, "delay", "cost", 0.0, 0.5)]


def _row(policy: str, seed: int, ttft: float, experiment: str = "load", load: float = 1.5,
         **extra: float) -> dict[str, object]:
    return {"regime": "cpu", "workload": "mmlu", "experiment": experiment, "policy": policy,
            "seed": seed, "peers": 16, "delay_ms": 5.0, "zipf_s": 1.0, "load": load,
            "capacity_blocks": 256, "ttft_mean_s": ttft, "e2e_mean_s": ttft * 2,
            "hit_ratio": 0.8, **extra}


def test_claims_from_rows(tmp_path) -> None:
    quick = []
    for seed in (1, 2, 3):
        quick += [_row("cost", seed, 1.0 + seed / 100), _row("longest_prefix", seed, 1.0),
                  _row("oracle", seed, 0.9), _row("cost", seed, 0.5, load=0.5),
                  _row("longest_prefix", seed, 0.6, load=0.5), _row("oracle", seed, 0.45,
                                                                    load=0.5)]
    result = claims.claims(quick, [], 3)
    w = result["within5:cpu:ttft_mean_s"]
    assert w["holds"] and w["points"] == 2
    assert w["worst"]["ratio"] == pytest.approx(1.02)
    o = result["oracle:cpu"]
    assert o["ratio"] == pytest.approx(1.02 / 0.9) and o["holds"]
    # one point 6% behind fails the claim, and the page says so
    bad = [dict(r, ttft_mean_s=1.06) if r["policy"] == "cost" and r["load"] == 1.5 else r
           for r in quick]
    result = claims.claims(bad, [], 3)
    assert not result["within5:cpu:ttft_mean_s"]["holds"]
    page = claims.render(bad, [], {}, result, 3)
    assert "**does not hold**" in page and "1.060" in page
    # the CLI writes the page from result files and --check compares
    for name, rows in (("q.json", quick), ("f.json", [])):
        (tmp_path / name).write_text(json.dumps({"params": {}, "rows": rows}))
    args = ["--quick-json", str(tmp_path / "q.json"), "--final-json", str(tmp_path / "f.json"),
            "--write", str(tmp_path / "R.md")]
    assert claims.main(args) == 0
    assert claims.main([*args, "--check"]) == 0
    (tmp_path / "R.md").write_text("edited")
    assert claims.main([*args, "--check"]) == 1


def test_committed_results_page_matches_committed_rows() -> None:
    # docs/RESULTS.md is generated: rerunning a grid without regenerating the page (or
    # editing the page by hand) fails here. `python -m bench.claims` rewrites it.
    assert claims.QUICK_JSON.is_file() and claims.FINAL_JSON.is_file()
    assert claims.main(["--check"]) == 0
