"""The forwards of a testbed run against the same requests under a baseline policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.testbed.forwards import compare, compare_dir, main


def _req(index: int, entry: int, served_by: int, ttft: float, cached: int = 0) -> dict:
    return {"index": index, "entry": entry, "served_by": served_by, "ok": True,
            "ttft_s": ttft, "cached_tokens": cached}


def test_a_forward_is_set_against_the_same_request_under_the_baseline() -> None:
    routed = [_req(0, 0, 1, 0.10, 64), _req(1, 0, 0, 0.05), _req(2, 1, 1, 0.03),
              _req(3, 0, 1, 0.30, 64)]
    local = [_req(0, 0, 0, 0.04), _req(1, 0, 0, 0.06), _req(2, 1, 1, 0.02),
             {**_req(3, 0, 0, 9.0), "ok": False}]  # failed there: not paired
    got = compare(routed, local, peers=2)
    first = got["entries"][0]
    assert first["forwarded"] == {"requests": 2, "ttft_mean_s": 0.1, "baseline_ttft_mean_s": 0.04,
                                  "cached_tokens_mean": 64.0, "baseline_cached_tokens_mean": 0.0}
    assert first["kept"]["ttft_mean_s"] == 0.05 and first["kept"]["baseline_ttft_mean_s"] == 0.06
    assert got["entries"][1]["forwarded"]["requests"] == 0
    assert got["entries"][1]["forwarded"]["ttft_mean_s"] is None
    assert got["pairs"] == [{"entry": 0, "server": 1, "forwards": 2, "ttft_mean_s": 0.2}]


def test_the_runs_of_a_folder_are_paired_by_point_and_seed(tmp_path: Path, capsys) -> None:
    def write(name: str, requests: list[dict]) -> None:
        (tmp_path / name).write_text(json.dumps({"peers": ["a", "b"], "requests": requests}))

    write("d20_half_run0_cost.json", [_req(0, 0, 1, 0.1)])
    write("d20_half_run0_local.json", [_req(0, 0, 0, 0.05)])
    write("d20_half_run1_cost.json", [_req(0, 0, 1, 0.1)])  # no baseline run: left out
    write("d20_half_run0_least_loaded.json", [_req(0, 0, 1, 0.2)])
    runs = compare_dir(tmp_path, "cost", "local")
    assert [(r["point"], r["run"]) for r in runs] == [("d20_half", 0)]
    assert [r["point"] for r in compare_dir(tmp_path, "least_loaded", "local")] == ["d20_half"]
    main(["--traces", str(tmp_path)])
    assert json.loads(capsys.readouterr().out)["runs"][0]["entries"][0]["forwarded"][
        "baseline_ttft_mean_s"] == 0.05
    with pytest.raises(SystemExit):
        main(["--traces", str(tmp_path), "--baseline", "random"])
