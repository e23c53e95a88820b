"""bench.greedy_gaps: one run on tiny-random; float32 answers survive batching and the cache
exactly, and every row says how far honest tokens sit from the verifier's argmax."""

import json

import pytest

from bench import greedy_gaps
from peer.engine.verify import tolerance


def test_a_run_scores_every_answer_per_format(tmp_path):
    out = tmp_path / "gaps.json"
    assert greedy_gaps.main([
        "--json", str(out), "--model", "tiny-random", "--dtypes", "float32,int8",
        "--requests", "4", "--concurrency", "2",
    ]) == 0
    rows = {r["dtype"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"float32", "int8"}
    exact = rows["float32"]
    assert exact["batched_differs"] == exact["cached_differs"] == 0
    assert exact["gap_max"] < 1e-4 and exact["over_tolerance"] == 0
    for fmt, row in rows.items():
        assert row["tokens_scored"] > 0 and row["gap_max"] >= 0
        assert row["greedy_tolerance"] == tolerance(fmt).greedy


def test_auto_is_refused():
    with pytest.raises(SystemExit):
        greedy_gaps.main(["--json", "/dev/null", "--dtypes", "auto"])
