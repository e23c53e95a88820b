"""bench.compile_options: both builds of the compiled step run in one process, each timed
in its own blocks."""

import json

import pytest

from bench import compile_options
from tests.helpers_engine import NEEDS_CXX

pytestmark = NEEDS_CXX


def test_old_and_new_builds_are_timed_alternately(tmp_path):
    out = tmp_path / "o.json"
    assert compile_options.main(["--json", str(out), "--model", "tiny-random", "--dtype",
                                 "int4", "--context", "40", "--blocks", "2", "--steps",
                                 "2"]) == 0
    row = json.loads(out.read_text())
    assert len(row["old_ms"]) == len(row["new_ms"]) == len(row["ratios"]) == 2
    assert row["ratio_mean"] > 0
    # each build ran its own steps: the two compile shapes, 5 untimed, 2 blocks of 2
    assert row["compiled_steps"] == {"old": 2 + 5 + 4, "new": 2 + 5 + 4}
    assert compile_options.compiled_decode.INDUCTOR_OPTIONS["max_autotune"] is True


def test_nonsense_sizes_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        compile_options.main(["--json", str(tmp_path / "o.json"), "--blocks", "0"])
