"""bench.decode_profile: the op categories, and one run on tiny-random per weight kind."""

import json

from bench import decode_profile


def test_categories():
    assert decode_profile.category("aten::linear") == "linear"
    assert decode_profile.category("aten::_weight_int4pack_mm_for_cpu") == "linear"
    assert decode_profile.category("aten::scaled_dot_product_attention") == "attention"
    assert decode_profile.category(decode_profile.FIXED_ATTENTION_LABEL) == "attention"
    assert decode_profile.category("aten::rms_norm") == "other_ops"


def test_a_run_splits_each_formats_step_and_times_batches_and_prefill(tmp_path):
    out = tmp_path / "p.json"
    assert decode_profile.main([
        "--json", str(out), "--model", "tiny-random", "--dtypes", "float32,int8",
        "--threads", "1", "--steps", "2", "--context", "20", "--batch", "2",
        "--prefill-tokens", "40",
    ]) == 0
    result = json.loads(out.read_text())
    for dtype in ("float32", "int8"):
        r = result["by_dtype"][dtype]
        assert set(r["profile_ms_per_step"]) == set(decode_profile.CATEGORIES)
        assert r["profile_ms_per_step"]["linear"] > 0
        assert abs(sum(r["profile_share"].values()) - 1) < 1e-6
        assert r["batch_2"]["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0
    assert "_weight_int8pack_mm" in " ".join(result["by_dtype"]["int8"]["top_ops_ms_per_step"])
    # int8 runs the fixed-order attention (auto), and its calls are counted as attention
    assert [result["by_dtype"][d]["attention"] for d in ("float32", "int8")] == ["sdpa", "fixed"]
    assert result["by_dtype"]["int8"]["profile_ms_per_step"]["attention"] > 0
