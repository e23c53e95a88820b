"""bench.testbed: the quick run on real isolated peers (root and a capable kernel only),
and the pieces that need no machine: the workload mix, the gossip delivered fraction, the
calibration fit, the per-point summary and the one-line refusal."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.testbed import __main__ as cli
from bench.testbed.calibrate import QUICK_EFFORT, fit
from bench.testbed.runner import (
    gossip_delivery,
    pipeline_events,
    summed_events,
    trusted_pair_fraction,
)
from bench.testbed.workload import GROUP_STRIDE, WorkloadSpec, mixed_requests, paced_warmup
from tests.helpers_testbed import mmlu_by_chars as _data

ROW_KEYS = {"policy", "delay_ms", "load", "run", "seed", "requests", "ttft_mean_s", "ttft_p99_s",
            "e2e_mean_s", "hit_ratio", "busiest_peer_utilization", "predicted_ttft_mean_s",
            "forwarded_fraction", "failed", "gossip_delivered_fraction", "shares", "model",
            "ttft_mean_outside_entry_s"}


def test_the_mix_is_sorted_capped_and_keeps_streams_apart() -> None:
    spec = WorkloadSpec(requests=120, rate_per_s=20.0, max_new_tokens=2, seed=3)
    requests = mixed_requests(_data(), spec)
    assert len(requests) == 120
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals)
    assert all(1 <= r.max_new_tokens <= 2 for r in requests)
    streams = {r.prefix_key // GROUP_STRIDE for r in requests}
    assert streams == {0, 1, 2}  # MMLU, chat and agent requests all present
    # one prefix key, one prefix: the simulator hashes a shared prefix once per key
    by_key: dict[int, tuple[int, ...]] = {}
    for r in requests:
        assert by_key.setdefault(r.prefix_key, r.prefix) == r.prefix
    assert mixed_requests(_data(), spec) == requests  # seeded


def test_a_paced_warmup_comes_faster_and_the_measured_requests_keep_their_spacing() -> None:
    requests = mixed_requests(_data(), WorkloadSpec(requests=120, rate_per_s=20.0, seed=3))
    paced = paced_warmup(requests, 40, 2.0, 0.5)
    same = [(r.prefix, r.suffix) for r in paced] == [(r.prefix, r.suffix) for r in requests]
    assert same  # the same requests, in the same order
    assert [r.arrival_s for r in paced[:40]] == [r.arrival_s / 2 for r in requests[:40]]
    gap = requests[40].arrival_s - requests[39].arrival_s
    assert abs(paced[40].arrival_s - paced[39].arrival_s - (gap + 0.5)) < 1e-9
    assert all(abs((p.arrival_s - q.arrival_s) - (paced[40].arrival_s - requests[40].arrival_s))
               < 1e-9 for p, q in zip(paced[40:], requests[40:], strict=True))
    assert paced[-1].arrival_s < requests[-1].arrival_s  # the run is shorter
    assert paced_warmup(requests, 40, 1.0, 0.5) == requests  # pace 1: unchanged
    assert paced_warmup(requests, 0, 2.0, 0.5) == requests  # no warm-up
    assert cli.warmup_pace("high") == 1.0 and cli.warmup_pace("half") > 1.0
    with pytest.raises(ValueError):
        paced_warmup(requests, 40, 0.5, 0.5)


def _counts(first: int, seq: int, accepted: dict[str, int], last: dict[str, int],
            late: dict[str, int] | None = None) -> dict[str, object]:
    return {"gossip_counts": {"published": seq - first + 1, "publish_failures": 0,
                              "first_seq": first, "seq": seq, "accepted": accepted,
                              "late": late or {}, "last_seq": last}}


def test_gossip_delivery_counts_losses_not_summaries_still_on_their_way() -> None:
    ids = ["a", "b", "c"]
    views = [
        # a heard b's 10 (one of them late) and c's first 5 of 10 (5 on their way)
        _counts(1, 10, {"b": 9, "c": 5}, {"b": 110, "c": 205}, late={"b": 1}),
        # b heard a's 10, and 9 of c's first 10 (one lost)
        _counts(101, 110, {"a": 10, "c": 9}, {"a": 10, "c": 210}),
        # c heard a's first 9 and b's 10; its own are not deliveries
        _counts(201, 210, {"a": 9, "b": 10, "c": 99}, {"a": 9, "b": 110}),
    ]
    delivery = gossip_delivery(views, ids)
    assert delivery is not None
    # expected: a<-b 10, a<-c 5, b<-a 10, b<-c 10, c<-a 9, c<-b 10 = 54; arrived 53
    assert delivery.delivered_fraction == pytest.approx(53 / 54)
    assert delivery.late_fraction == pytest.approx(1 / 54)
    assert delivery.in_flight_max == 5
    assert gossip_delivery([*views[:2], {"peers": []}], ids) is None
    assert gossip_delivery([*views[:2], None], ids) is None


def test_trust_and_events_are_read_from_views_and_metrics() -> None:
    views = [{"peers": [{"trust": {"state": "trusted"}}, {"trust": {"state": "probation"}}]},
             None, {"peers": [{"trust": {"state": "trusted"}}, {"trust": None}]}]
    assert trusted_pair_fraction(views) == 0.5
    assert trusted_pair_fraction([None, {"peers": []}]) is None
    metrics = ("# TYPE prefixswarm_pipeline_events counter\n"
               'prefixswarm_pipeline_events_total{event="shadow_sent"} 12.0\n'
               'prefixswarm_pipeline_events_created{event="shadow_sent"} 1.7e9\n'
               'prefixswarm_requests_total{route="x"} 3.0\n')
    assert pipeline_events(metrics) == {"shadow_sent": 12.0}
    # summed over the peers that answered; one that did not (None) is left out
    assert summed_events([{"shadow_sent": 12.0}, None, {"shadow_sent": 3.0, "hedges": 1.0}]) == {
        "hedges": 1.0, "shadow_sent": 15.0}


def test_fit_recovers_a_calibration_and_falls_back_when_noise_wins() -> None:
    points = [(0, n, 0.05 + 1e-4 * n) for n in (32, 512, 1024)]
    points += [(k, 96, 0.05 + 1e-4 * 96) for k in (32, 512, 1024)]
    cal = fit(points, 0.02, "p", "test")
    assert cal.prefill_fixed_s == pytest.approx(0.05, abs=2e-3)
    assert cal.prefill_s_per_token == pytest.approx(1e-4, rel=0.05)
    # a negative attention or per-token term from noise: the two-term fit, still positive
    noisy = [(0, 32, 0.20), (0, 512, 0.21), (0, 1024, 0.19), (512, 96, 0.25)]
    cal = fit(noisy, 0.02, "p", "test")
    assert cal.prefill_s_per_token > 0 and cal.prefill_s_per_token_ctx == 0.0


def test_summary_gives_a_mean_and_interval_per_point_and_policy() -> None:
    rows = [{"delay_ms": 0.0, "load": "high", "policy": "cost", "ttft_mean_s": t,
             "predicted_ttft_mean_s": None} for t in (1.0, 1.2, 1.1)]
    rows.append({"delay_ms": 0.0, "load": "high", "policy": "local", "ttft_mean_s": 2.0})
    out = {(s["policy"]): s for s in cli.summary(rows)}
    assert out["cost"]["runs"] == 3
    assert out["cost"]["ttft_mean_s"] == pytest.approx(1.1)
    assert 0 < out["cost"]["ttft_mean_s_ci95"] < 0.5
    assert math.isnan(out["local"]["ttft_mean_s_ci95"])  # one run: no interval


def test_an_unsupported_machine_gets_one_line_and_exit_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import bench.testbed.net as net

    monkeypatch.setattr(net, "check_support", lambda: "no cgroup cpu controller")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--json", "/nonexistent/x.json", "--quick"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["bench.testbed: no cgroup cpu controller"]


def _unsupported() -> str | None:
    from bench.testbed.net import check_support

    return check_support()


@pytest.mark.skipif(_unsupported() is not None, reason=f"testbed: {_unsupported()}")
def test_quick_run_on_isolated_peers(tmp_path: Path) -> None:
    out = tmp_path / "quick.json"
    # a guard against a hang, not a speed check: 4.6 min alone on a slow 2-core machine
    traces = tmp_path / "traces"
    done = subprocess.run([sys.executable, "-m", "bench.testbed", "--quick", "--json", str(out),
                           "--traces", str(traces)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["complete"] and result["params"]["isolated"] and result["params"]["quick"]
    assert result["params"]["calibration_effort"]["repeats"] == QUICK_EFFORT.repeats
    gossip = result["gossip_cost"]  # calibrated: summaries beyond the idle ones were sent
    assert gossip["publishes"] >= 1 and gossip["receive_cpu_s"] >= 0
    assert all(c["calibration"]["summary_receive_s"] >= 0 for c in result["calibration"])
    # the load was measured: two `local` pilots, the second at the first line's high rate
    assert result["params"]["rates_from"] == "pilots" and len(result["pilots"]) == 2
    first, second = result["pilots"]
    assert second["rate_per_s"] > first["rate_per_s"] > 0
    assert max(second["peer_utilization"]) > max(first["peer_utilization"])
    # the forward pilot ran, below the high load, and its forwards were counted; one
    # quick run's are too few to charge (FORWARD_MIN_FORWARDS)
    pilot = result["forward_pilot"]
    assert pilot["policy"] == "random" and len(pilot["runs"]) == cli.QUICK["forward_pilots"]
    assert pilot["rate_per_s"] < result["params"]["rates_per_s"]["high"]
    assert sum(pilot["runs"][0]["forwards_per_entry"]) > cli.QUICK["requests"] // 2
    assert pilot["forward_cpu_s"] == 0.0
    rows = result["rows"]
    assert sorted(r["policy"] for r in rows) == sorted(cli.POLICIES)
    for row in rows:
        assert row.keys() >= ROW_KEYS
        assert row["quick"] and row["requests"] == cli.QUICK["requests"]
        assert row["failed"] <= row["requests"] // 10
        assert 0 < row["ttft_mean_s"] <= row["e2e_mean_s"]
        # the entry's own TTFT lies inside the client's: what is left is outside it
        assert 0 <= row["ttft_mean_outside_entry_s"] < row["ttft_mean_s"]
        assert 0 < row["busiest_peer_utilization"] <= 1.2  # a quota is a ceiling
        assert row["predicted_ttft_mean_s"] > 0
        assert sum(row["served_per_peer"]) == row["requests"] - row["failed"]
        # per entry, measured and simulated: the matrix's columns are served_per_peer
        for prefix in ("", "predicted_"):
            matrix = row[f"{prefix}served_matrix"]
            served = [sum(column) for column in zip(*matrix, strict=True)]
            assert served == row[f"{prefix}served_per_peer"]
        if row["policy"] == "local":
            assert all(f in (0.0, None) for f in row["forwarded_fraction_per_entry"])
        # the run's traces: every measured request, and the routers' reasons
        name = f"d{row['delay_ms']:g}_high_run0_{row['policy']}.json"
        traced = json.loads((traces / name).read_text())
        assert len(traced["requests"]) == row["requests"]
        assert sum(r["served_by"] == r["entry"] for r in traced["requests"]) == round(
            (1 - row["forwarded_fraction"]) * (row["requests"] - row["failed"]))
        assert all(r["route"] for r in traced["requests"] if r["ok"])
        reasons = [step["reason"] for log in traced["request_logs"] if log for rec in log
                   for step in rec["route"]]
        assert any(f"[{row['policy']}]" in reason for reason in reasons)
        # every entry counted its requests (warm-up included) in /metrics
        assert row["pipeline_events"]["requests"] >= row["requests"]
        if row["policy"] != "local":
            assert 0 <= row["trusted_pair_fraction"] <= 1
        # what each peer advertised of its own speeds, measured and simulated
        for measured, simulated in zip(row["advertised_tokens_per_s"],
                                       row["predicted_advertised_tokens_per_s"], strict=True):
            assert min(measured) > 0 and min(simulated) > 0
    assert len(result["summary"]) == len(cli.POLICIES)


def _row(policy: str, run: int, ttft: float, predicted: float) -> dict[str, object]:
    return {"policy": policy, "delay_ms": 20.0, "load": "high", "run": run,
            "ttft_mean_s": ttft, "predicted_ttft_mean_s": predicted, "hit_ratio": 0.5,
            "forwarded_fraction": 0.5, "busiest_peer_utilization": 0.9}


def test_the_targets_are_read_from_the_rows() -> None:
    from bench.testbed.report import checks

    rows = [_row("cost", r, 1.0 + 0.01 * r, 1.1) for r in range(3)]
    rows += [_row("random", r, 2.0 + 0.01 * r, 2.1) for r in range(3)]
    rows += [_row("local", r, 1.5 + 0.01 * r, 1.0) for r in range(3)]
    (point,) = checks(rows)
    assert point["cost_lowest"] and point["cost_clear_of_random"] and point["cost_clear_of_local"]
    assert point["predicted_over_measured"]["local"] == pytest.approx(1.0 / 1.51)
    assert not point["predictions_within_25pct"]  # local's 0.66 is off by more than 25%
    assert point["cost_within_5pct_of_longest_prefix"] is None  # not run: not judged
    rows += [_row("longest_prefix", r, 0.9, 0.9) for r in range(3)]
    (point,) = checks(rows)
    assert not point["cost_lowest"] and not point["cost_within_5pct_of_longest_prefix"]


def test_the_prediction_leaves_out_the_warm_up() -> None:
    from bench.sim.calibration import Calibration
    from bench.testbed.predict import SimSetup, predict
    from bench.workloads import TokenRequest

    cal = Calibration("flat", 0.0, 1e-3, 0.0, 0.01, "test", batch_step_slope=1.0)
    # 10 requests of 100 tokens, then 10 of 300, far apart: each peer serves them alone
    reqs = [TokenRequest(float(i), i, tuple(range(i * 1000, i * 1000 + (100 if i < 10 else 300))),
                         (), 1) for i in range(20)]
    setup = SimSetup((cal,), capacity_blocks=256, summary_interval_s=0.5)
    everything = predict(setup, "local", 0.0, reqs, seed=1).ttft_mean_s
    measured = predict(SimSetup((cal,), 256, 0.5, warmup_requests=10), "local", 0.0, reqs,
                       seed=1).ttft_mean_s
    assert everything == pytest.approx(0.2, rel=0.05)
    assert measured == pytest.approx(0.3, rel=0.05)
    with pytest.raises(ValueError, match="warm-up"):
        predict(SimSetup((cal,), 256, 0.5, warmup_requests=20), "local", 0.0, reqs, seed=1)


def test_overheads_and_utilisation_as_the_testbed_reads_them() -> None:
    """The calibration's per-request overhead is its fixed term less a lone simulated
    step's fixed cost, split where the first token comes; a forward's CPU at the entry is
    paid at each peer's usable share; and the predicted utilisation adds the idle peer's
    own CPU, as the cgroup counts it."""
    from bench.sim.calibration import Calibration
    from bench.testbed.calibrate import PeerSpeed, with_overheads
    from bench.testbed.predict import SimSetup, predict
    from bench.workloads import TokenRequest

    fitted = Calibration("p", 0.05, 1e-3, 0.0, 0.02, "test", batch_step_slope=0.5)
    speed = PeerSpeed((), 0.02, fitted, background_cores=0.1)
    cal = with_overheads(speed, share=0.3, forward_cpu_s=0.004)
    assert cal.request_overhead_s == pytest.approx(0.05 - 0.02 * 0.5)  # all before
    assert cal.request_tail_s == 0.0
    # 60% of a short request's time before its first token: 30 ms, of which the step 10
    split = with_overheads(dataclasses.replace(speed, first_token_fraction=0.6), 0.3, 0.004)
    assert split.request_overhead_s == pytest.approx(0.02)
    assert split.request_tail_s == pytest.approx(0.02)
    assert cal.forward_overhead_s == pytest.approx(0.004 / 0.2)
    flat = Calibration("flat", 0.0, 1e-3, 0.0, 0.01, "test", batch_step_slope=1.0)
    reqs = [TokenRequest(float(i), i, tuple(range(i * 1000, i * 1000 + 100)), (), 1)
            for i in range(11)]  # one a second, 100 ms each: 10% busy
    idle = predict(SimSetup((flat,), 256, 0.5), "local", 0.0, reqs, seed=1)
    busy = predict(SimSetup((flat,), 256, 0.5, backgrounds=(0.4,)), "local", 0.0, reqs, seed=1)
    assert idle.busiest_peer_utilization == pytest.approx(0.1)
    assert idle.peer_utilization == (idle.busiest_peer_utilization,)
    assert idle.served_per_peer == (len(reqs),)  # no warm-up asked for: all measured
    assert busy.busiest_peer_utilization == pytest.approx(0.4 + 0.6 * 0.1)


def test_a_forward_costs_its_server_what_it_measured_beyond_a_local_request() -> None:
    """A serving peer's CPU for a forwarded request, less what its own calibration gives
    the same request from its client (a cold 32-token prompt), is its `served_overhead_s`
    at its usable share; a peer that served no forward while measured gets the median of
    the others', and a stream cheaper than HTTP charges nothing. The simulator adds it to
    a request's cost only where another peer forwarded it."""
    from bench.sim.calibration import Calibration
    from bench.sim.model import Simulator
    from bench.sim.params import SimParams
    from bench.testbed.calibrate import (
        FORWARD_PROMPT_TOKENS,
        ForwardCost,
        PeerSpeed,
        served_extra_cpu,
        with_overheads,
    )
    from bench.workloads import TokenRequest

    fitted = Calibration("p", 0.05, 1e-3, 0.0, 0.02, "test", batch_step_slope=0.5)
    speed = PeerSpeed((), 0.02, fitted, background_cores=0.1)
    local_cpu = fitted.prefill_s(FORWARD_PROMPT_TOKENS, 0) * 0.2  # at 0.3 less 0.1 idle
    forward = ForwardCost(0.004, 0.003, 10, 20, served_cpu_s={
        "a": local_cpu + 0.006, "b": local_cpu + 0.002, "c": local_cpu - 0.001})
    shares = [0.3] * 4
    extras = served_extra_cpu([speed] * 4, shares, ["a", "b", "c", "entry"], forward)
    assert extras == pytest.approx([0.006, 0.002, 0.0, 0.002])
    cal = with_overheads(speed, 0.3, 0.004, served_extra_cpu_s=extras[0])
    assert cal.served_overhead_s == pytest.approx(0.006 / 0.2)
    assert with_overheads(speed, 0.3, 0.004).served_overhead_s == 0.0
    # the simulator: a request forwarded to a peer costs it served_overhead_s more
    flat = Calibration("flat", 0.0, 1e-3, 0.0, 0.01, "test", batch_step_slope=1.0)
    reqs = [TokenRequest(float(i), i, tuple(range(i * 1000, i * 1000 + 100)), (), 1)
            for i in range(11)]
    busy = []
    for extra in (0.0, 0.05):
        params = SimParams(policy="random", peers=2, delay_ms=0.0, warmup_fraction=0.0,
                           calibration=dataclasses.replace(flat, served_overhead_s=extra))
        sim = Simulator(params, reqs)
        sim.run()
        forwarded = sum(1 for j in sim.jobs if j.target != j.entry)
        busy.append((sum(p.busy_s for p in sim.peers), forwarded))
    (plain, n), (charged, m) = busy
    assert n == m > 0 and charged - plain == pytest.approx(0.05 * n)


def test_the_summary_cadence_moves_from_the_background_to_per_summary_charges() -> None:
    """A summary's measured CPU becomes the calibration's per-summary costs at each
    peer's usable share; the idle cadence they account for (a summary of its own and one
    from every other peer per interval) leaves the background and returns to the quota,
    so the idle peer is not charged twice."""
    from bench.sim.calibration import Calibration
    from bench.testbed.calibrate import GossipCost, PeerSpeed, with_overheads
    from bench.testbed.predict import testbed_setup

    fitted = Calibration("p", 0.05, 1e-3, 0.0, 0.02, "test", batch_step_slope=0.5)
    speed = PeerSpeed((), 0.02, fitted, background_cores=0.05)
    gossip = GossipCost(publish_cpu_s=0.002, receive_cpu_s=0.003, publishes=20, publisher=1)
    cal = with_overheads(speed, share=0.25, forward_cpu_s=0.004, gossip=gossip)
    assert cal.summary_publish_s == pytest.approx(0.002 / 0.2)
    assert cal.summary_receive_s == pytest.approx(0.003 / 0.2)
    assert gossip.idle_cores(peers=4, interval_s=0.5) == pytest.approx((0.002 + 3 * 0.003) / 0.5)
    idle = gossip.idle_cores(peers=2, interval_s=0.5)  # the setup below has two peers
    setup = testbed_setup([cal, cal], [0.05, 0.05], [0.25, 0.25], True, 256, 0.5, 0, gossip)
    assert setup.backgrounds == pytest.approx(((0.05 - idle) / 0.25,) * 2)
    params = setup.params("local", 0.0, seed=1)
    assert params.cpu_quotas == pytest.approx((0.2 + idle,) * 2)
    # the calibration's unit stays the share less the whole background
    assert params.peer_calibrations[0].summary_receive_s == pytest.approx(0.003)
    without = testbed_setup([cal], [0.05], [0.25], True, 256, 0.5, 0)
    assert without.params("local", 0.0, seed=1).cpu_quotas == pytest.approx((0.2,))


def test_the_cfs_period_reaches_the_simulated_quotas() -> None:
    """The CPU groups' period (`--cfs-period-ms`, params `cfs_period_ms`) is the simulated
    quotas' period; a result from before it was a setting ran at the kernel's 100 ms."""
    from bench.testbed.predict import setup_from_result

    cal = {"name": "p", "prefill_fixed_s": 0.02, "prefill_s_per_token": 1e-5,
           "prefill_s_per_token_ctx": 0.0, "decode_s_per_token": 0.005, "source": "test"}
    result = {"params": {"shares": [0.5], "isolated": True, "capacity_blocks": 64,
                         "summary_interval_s": 1.0, "warmup_requests": 0},
              "calibration": [{"calibration": cal, "background_cores": 0.0}]}
    assert setup_from_result(result).params("local", 0.0, 0).quota_period_s == 0.1
    result["params"]["cfs_period_ms"] = 10.0
    assert setup_from_result(result).params("local", 0.0, 0).quota_period_s == 0.01
    args = cli.parse_args(["--json", "x.json", "--cfs-period-ms", "10"])
    assert args.cfs_period_us == 10_000
    with pytest.raises(SystemExit):
        cli.parse_args(["--json", "x.json", "--cfs-period-ms", "0.5"])  # below the kernel's
    with pytest.raises(SystemExit):  # 0.5 ms of quota in a 10 ms period
        cli.parse_args(["--json", "x.json", "--cfs-period-ms", "10", "--shares", "0.05,0.5"])


def test_quota_problems_are_named_before_any_group_is_made() -> None:
    from bench.testbed.net import quota_problem

    assert quota_problem([0.2, 0.5], 10_000) is None
    assert quota_problem([0.2], 100_000) is None
    assert "least quota" in (quota_problem([0.2, 0.05], 10_000) or "")
    assert "period" in (quota_problem([0.2], 500) or "")
    assert "share" in (quota_problem([0.0], 100_000) or "")


def test_idle_rates_become_backgrounds_within_half_a_share() -> None:
    from bench.testbed.calibrate import GossipCost, background_cores

    gossip = GossipCost(0.002, 0.003, 20, 1, idle_rates=(0.05, -0.01, 0.3))
    assert gossip.as_dict()["idle_rates"] == [0.05, -0.01, 0.3]
    assert background_cores(gossip.idle_rates, [0.2, 0.3, 0.4]) == pytest.approx(
        [0.05, 0.0, 0.2])  # a negative rate is noise; more than half a share, broken


def test_the_fork_server_preloads_every_project_module() -> None:
    # A peer forked by the zygote must read no project code from disk: a file edited
    # while a testbed runs would otherwise reach the peers of its later runs. Checked in
    # a fresh interpreter (this one has imported whatever other tests did).
    script = (
        "import importlib, pkgutil, sys\n"
        "from bench.testbed import zygote\n"
        "zygote.preload()\n"
        "missing = [m.name for p in zygote.CODE_PACKAGES for m in pkgutil.walk_packages(\n"
        "    importlib.import_module(p).__path__, p + '.') if m.name not in sys.modules]\n"
        "print(len(sys.modules), missing)\n"
        "sys.exit(1 if missing or 'peer.request.run' not in sys.modules else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
