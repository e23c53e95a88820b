"""bench.lean_forward: the written-out decode step computes exactly what the runner does
(quantized, with its fused projections)."""

import json

import pytest
import torch

from bench import lean_forward
from bench.decode_profile import make_runner
from peer.engine.model import load_model
from peer.engine.runner import SeqKV


@pytest.mark.parametrize("dtype", ["float32", "int8", "int4"])
def test_lean_decode_equals_the_runner_step_for_step(dtype):
    loaded = load_model("tiny-random", dtype=dtype, device="cpu", attention="sdpa")
    runner = make_runner(loaded)
    with torch.inference_mode():
        ours = lean_forward.prefilled(runner, loaded, 3, 20, 8)
        theirs = [(SeqKV(kv.data.clone(), kv.length), tok) for kv, tok in ours]
        for _ in range(4):
            ref = runner.forward([(kv, [tok]) for kv, tok in ours], [1] * len(ours))
            lean = lean_forward.lean_decode(loaded.model, theirs)
            assert torch.equal(ref, lean)
            assert [kv.length for kv, _ in ours] == [kv.length for kv, _ in theirs]
            lean_forward.advance(ours, ref)
            lean_forward.advance(theirs, lean)


def test_a_run_reports_both_forwards_per_format_and_batch(tmp_path):
    out = tmp_path / "lean.json"
    assert lean_forward.main([
        "--json", str(out), "--model", "tiny-random", "--dtypes", "float32",
        "--threads", "1", "--steps", "2", "--context", "12", "--batches", "1,2",
    ]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["dtype"], r["batch"]) for r in rows] == [("float32", 1), ("float32", 2)]
    for r in rows:
        assert r["max_abs_logit_diff"] == 0.0 and r["same_argmax"]
        assert r["runner_step_ms"] > 0 and r["lean_step_ms"] > 0


def test_bad_batches_are_refused():
    with pytest.raises(SystemExit):
        lean_forward.main(["--json", "/dev/null", "--batches", "1,x"])
