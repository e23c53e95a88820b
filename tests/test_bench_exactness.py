"""bench.exactness on tiny-random: each cause of a batched answer differing from
`generate` is measured per format; in int4 the products and the fixed-order attention are
row-invariant, so every engine setup answers as `generate` does."""

import json

import pytest

from bench import exactness


def test_int4_rows_and_batching_alone_are_exact_and_attention_is_measured(tmp_path):
    out = tmp_path / "o.json"
    assert exactness.main(["--json", str(out), "--model", "tiny-random", "--dtypes", "int4",
                           "--prompts", "3", "--new-tokens", "3", "--rows", "64"]) == 0
    row = json.loads(out.read_text())["by_format"]["int4"]
    assert set(row["linear_rows_differing"]) == {str(m) for m in exactness.CALL_ROWS}
    assert all(v == 0 for v in row["linear_rows_differing"].values())
    for length in exactness.PROMPT_LENGTHS:
        counts = row["attention_rows_differing"][str(length)]
        assert set(counts) == {f"chunks_of_{m}" for m in exactness.CALL_ROWS} | {"alone"}
        assert all(0 <= v <= length for v in counts.values())
        fixed = row["fixed_attention_rows_differing"][str(length)]
        assert set(fixed) == set(counts) and all(v == 0 for v in fixed.values())
    assert row["engine_attention"] == "fixed"
    assert row["engine_identical"] == {"whole_prompts_no_cache": 3, "chunks_no_cache": 3,
                                       "default": 3}


@pytest.mark.parametrize("flags", [["--dtypes", "int4,bogus"], ["--dtypes", "auto"],
                                   ["--prompts", "0"], ["--rows", "0"]])
def test_bad_flags_are_refused(tmp_path, flags):
    with pytest.raises(SystemExit) as exc:
        exactness.main(["--json", str(tmp_path / "o.json"), *flags])
    assert exc.value.code == 2
