"""The benches that time the compiled decode step in blocks (their shared command line:
bench/step_bench.py), each run on tiny-random: bench.compile_options times the step's old
and new builds, bench.compute_thread the step on the compute thread, on a thread of its
own and beside a second OpenMP team."""

import json
from typing import Any

import pytest

from bench import compile_options, compute_thread
from tests.helpers_engine import NEEDS_CXX

pytestmark = NEEDS_CXX


def _tiny_row(bench: Any, tmp_path: Any, steps: int) -> dict[str, Any]:
    out = tmp_path / "o.json"
    assert bench.main(["--json", str(out), "--model", "tiny-random", "--dtype", "int4",
                       "--context", "40", "--blocks", "2", "--steps", str(steps)]) == 0
    return json.loads(out.read_text())


def test_old_and_new_builds_are_timed_alternately(tmp_path):
    row = _tiny_row(compile_options, tmp_path, steps=2)
    assert len(row["old_ms"]) == len(row["new_ms"]) == len(row["ratios"]) == 2
    assert row["ratio_mean"] > 0
    # each build ran its own steps: the two compile shapes, 5 untimed, 2 blocks of 2
    assert row["compiled_steps"] == {"old": 2 + 5 + 4, "new": 2 + 5 + 4}
    assert compile_options.compiled_decode.INDUCTOR_OPTIONS["max_autotune"] is True


def test_each_thread_arrangement_is_timed_in_every_block(tmp_path):
    row = _tiny_row(compute_thread, tmp_path, steps=3)
    for key in ("compute_ms", "other_ms", "compute_beside_ms", "ratios"):
        assert len(row[key]) == 2 and all(v > 0 for v in row[key])
    assert set(row["context_switches_per_step"]) == {"compute", "other", "compute_beside"}


@pytest.mark.parametrize("bench", [compile_options, compute_thread])
@pytest.mark.parametrize("flag", ["--steps", "--blocks", "--context", "--threads"])
def test_nonsense_sizes_are_refused(bench, flag, tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--json", str(tmp_path / "o.json"), flag, "0"])
