"""bench.compute_thread: the compiled step timed on the compute thread, on a thread of its
own, and on the compute thread beside a second OpenMP team, alternately in one process."""

import json

import pytest

from bench import compute_thread
from tests.helpers_engine import NEEDS_CXX

pytestmark = NEEDS_CXX


def test_each_thread_arrangement_is_timed_in_every_block(tmp_path):
    out = tmp_path / "o.json"
    assert compute_thread.main(["--json", str(out), "--model", "tiny-random", "--dtype",
                                "int4", "--context", "40", "--blocks", "2", "--steps",
                                "3"]) == 0
    row = json.loads(out.read_text())
    for key in ("compute_ms", "other_ms", "compute_beside_ms", "ratios"):
        assert len(row[key]) == 2 and all(v > 0 for v in row[key])
    assert set(row["context_switches_per_step"]) == {"compute", "other", "compute_beside"}


def test_nonsense_sizes_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        compute_thread.main(["--json", str(tmp_path / "o.json"), "--steps", "0"])
