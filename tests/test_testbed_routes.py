"""The per-entry view of a testbed run (bench/testbed/routes.py) and the run's traces."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.testbed.routes import UNKNOWN_SERVER, Routed, by_entry
from bench.testbed.runner import RunMeasurement, Timed, _recent, routed, summarise, trace


def test_each_entry_gets_its_own_matrix_row_hits_forwards_and_ttft() -> None:
    got = by_entry([
        Routed(0, 0, 100, 0, 0.4),
        Routed(0, 2, 100, 80, 0.2),
        Routed(0, 2, 200, 120, 0.3),
        Routed(1, 1, 50, 50, 0.1),
        Routed(1, UNKNOWN_SERVER, 50, 0, 0.5),
    ], 3)
    assert got["served_matrix"] == [[1, 0, 2], [0, 1, 0], [0, 0, 0]]
    assert got["hit_ratio_per_entry"] == [200 / 400, 50 / 100, None]
    assert got["forwarded_fraction_per_entry"] == [2 / 3, 1 / 2, None]
    assert got["ttft_mean_per_entry_s"][0] == pytest.approx(0.3)
    assert got["ttft_mean_per_entry_s"][2] is None


def test_an_entry_outside_the_bed_is_an_error() -> None:
    with pytest.raises(ValueError, match="entry 3"):
        by_entry([Routed(3, 0, 10, 0, 0.1)], 3)
    with pytest.raises(ValueError, match="peers"):
        by_entry([], 0)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(-1, 3), st.integers(1, 500),
                          st.floats(0, 1), st.floats(0.001, 5)), max_size=60))
def test_the_matrix_counts_every_request_with_a_known_server(
        rows: list[tuple[int, int, int, float, float]]) -> None:
    routes = [Routed(e, s, p, int(p * c), t) for e, s, p, c, t in rows]
    got = by_entry(routes, 4)
    assert sum(map(sum, got["served_matrix"])) == sum(r.server >= 0 for r in routes)
    for entry in range(4):
        mine = [r for r in routes if r.entry == entry]
        assert sum(got["served_matrix"][entry]) == sum(r.server >= 0 for r in mine)
        if mine:
            assert 0 <= got["hit_ratio_per_entry"][entry] <= 1
            assert 0 <= got["forwarded_fraction_per_entry"][entry] <= 1
        else:
            assert got["ttft_mean_per_entry_s"][entry] is None


def _measurement() -> RunMeasurement:
    route = [{"peer_id": "B", "local": False, "outcome": "failed", "detail": "reset"},
             {"peer_id": "A", "local": True, "outcome": "ok", "detail": ""}]
    outcomes = [
        Timed(True, "A", served_by="A", ttft_s=0.2, e2e_s=0.3, prompt_tokens=100,
              cached_tokens=60, index=5, route=route, entry_ttft_s=0.15),
        Timed(True, "B", served_by="A", ttft_s=0.4, e2e_s=0.5, prompt_tokens=100,
              cached_tokens=0, forwarded=True, index=6,
              route=[{"peer_id": "A", "outcome": "ok"}, "not an attempt"]),
        Timed(False, "B", error="timeout: 120 s", index=7),
    ]
    logs = [[{"route": [{"reason": "self A [cost]: exact match 3 blocks"}]}], None]
    return RunMeasurement(outcomes, 10.0, [0.5, 0.4], None, 1.0, 0.5, peer_ids=("A", "B"),
                          request_logs=logs)


def test_a_row_and_the_traces_name_peers_by_their_place_in_the_bed() -> None:
    measured = _measurement()
    assert [(r.entry, r.server) for r in routed(measured)] == [(0, 0), (1, 0)]
    row = summarise(measured)
    assert row["served_matrix"] == [[1, 0], [1, 0]]
    assert row["forwarded_fraction_per_entry"] == [0.0, 1.0]
    assert row["served_per_peer"] == [2, 0]
    traced = trace(measured)
    first, second, failed = traced["requests"]
    assert first["entry"] == 0 and first["served_by"] == 0
    assert [a["peer_id"] for a in first["route"]] == [1, 0]
    assert second["route"] == [{"peer_id": 0, "outcome": "ok"}]  # not a dict: left out
    assert failed["ok"] is False and failed["served_by"] is None and failed["ttft_s"] is None
    assert failed["error"].startswith("timeout")
    assert traced["request_logs"][1] is None
    assert not math.isnan(first["entry_ttft_s"])


def test_the_simulated_run_gives_the_same_per_entry_figures() -> None:
    from bench.sim.calibration import Calibration
    from bench.testbed.predict import SimSetup, predict
    from bench.testbed.workload import entry_peers
    from bench.workloads import TokenRequest

    cal = Calibration("flat", 0.0, 1e-3, 0.0, 0.01, "test", batch_step_slope=1.0)
    reqs = [TokenRequest(float(i), i, tuple(range(i * 1000, i * 1000 + 100)), (), 1)
            for i in range(20)]
    setup = SimSetup((cal, cal), capacity_blocks=256, summary_interval_s=0.5)
    got = predict(setup, "local", 0.0, reqs, seed=3)
    matrix = got.per_entry["served_matrix"]
    entries = entry_peers(3, len(reqs), 2)
    assert matrix == [[entries.count(0), 0], [0, entries.count(1)]]
    assert [sum(col) for col in zip(*matrix, strict=True)] == list(got.served_per_peer)
    assert got.per_entry["forwarded_fraction_per_entry"] == [0.0, 0.0]
    assert got.per_entry["hit_ratio_per_entry"] == [0.0, 0.0]  # no prompt repeats
    assert all(t > 0 for t in got.per_entry["ttft_mean_per_entry_s"])


def _row(run: int, ttft: list[float], matrix: list[list[int]]) -> dict[str, object]:
    return {"policy": "cost", "delay_ms": 0.0, "load": "high", "run": run,
            "ttft_mean_s": 0.3, "predicted_ttft_mean_s": 0.3, "hit_ratio": 0.5,
            "forwarded_fraction": 0.5, "busiest_peer_utilization": 0.9,
            "predicted_busiest_peer_utilization": 0.9,
            "ttft_mean_per_entry_s": ttft, "predicted_ttft_mean_per_entry_s": [0.5, None],
            "hit_ratio_per_entry": [0.5, 0.25], "predicted_hit_ratio_per_entry": [0.5, 0.5],
            "forwarded_fraction_per_entry": [1.0, 0.0],
            "predicted_forwarded_fraction_per_entry": [0.5, 0.0],
            "served_matrix": matrix, "predicted_served_matrix": [[1, 1], [0, 2]]}


def test_the_page_shows_each_entry_measured_next_to_simulated(tmp_path: Path) -> None:
    from bench.testbed.report import section

    path = tmp_path / "rows.json"
    rows = [_row(0, [0.4, 0.2], [[0, 3], [0, 2]]), _row(1, [0.6, 0.2], [[1, 2], [0, 1]])]
    path.write_text(json.dumps({"rows": rows, "params": {}}))
    line = next(x for x in section(path).splitlines() if x.startswith("| cost | 0.500 / "))
    assert "0.500 / 0.500, 0.200 / -" in line  # means over runs; none simulated: -
    assert "| 1 5; 0 3 | 2 2; 0 4 |" in line  # served matrices summed over runs
    for row in rows:  # rows of older runs have no per-entry prediction: no table
        del row["served_matrix"]
    path.write_text(json.dumps({"rows": rows, "params": {}}))
    assert "Per entry peer" not in section(path)


def test_a_peers_recent_requests_are_read_only_as_a_list_of_records() -> None:
    import httpx

    def answer(body: object) -> httpx.Response:
        return httpx.Response(200, json=body)

    assert _recent(answer({"recent": [{"route": []}]})) == [{"route": []}]
    for bad in ({"recent": {"route": []}}, {"recent": ["x"]}, {"recent": None}):
        with pytest.raises(TypeError):
            _recent(answer(bad))
    with pytest.raises(KeyError):
        _recent(answer({}))
