"""bench.engine --compare llama_cpp: without llama-cpp-python it says how to install it and
exits 2; it refuses workloads it cannot compare; its decode ratio is the median of pairs
measured back to back."""

import pytest

from bench import engine as bench_engine
from bench import llama_cpp


def test_without_llama_cpp_python_the_bench_says_how_to_install_it_and_exits_2(
    monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr(llama_cpp, "available", lambda: False)
    out = tmp_path / "out.json"
    assert bench_engine.main(["--json", str(out), "--compare", "llama_cpp"]) == 2
    err = capsys.readouterr().err
    assert "pip install" in err and "llama-cpp-python" in err
    assert not out.exists()


def test_decode_pairs_come_in_an_even_number(tmp_path):
    with pytest.raises(SystemExit):
        bench_engine.main(["--json", str(tmp_path / "o.json"), "--compare", "llama_cpp",
                           "--decode-pairs", "5"])


def test_llama_cpp_compares_the_embedded_model_at_concurrency_8(tmp_path):
    with pytest.raises(SystemExit):
        bench_engine.main(["--json", str(tmp_path / "o.json"), "--compare", "llama_cpp",
                           "--model", "tiny-random"])
    with pytest.raises(SystemExit):
        bench_engine.main(["--json", str(tmp_path / "o.json"), "--compare", "llama_cpp",
                           "--concurrency", "1,4"])


def test_a_build_the_cpu_cannot_run_is_caught_before_the_benchmark(
    monkeypatch, capsys, tmp_path
):
    """A llama.cpp child killed by SIGILL (a native build's AMX code in a VM) names the
    rebuild; bench.engine then exits 2 before measuring anything."""
    import subprocess
    import sys

    real_run = subprocess.run

    def dies_of_sigill(cmd, **kwargs):
        kill = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"
        return real_run([sys.executable, "-c", kill], **kwargs)

    monkeypatch.setattr(llama_cpp.subprocess, "run", dies_of_sigill)
    assert llama_cpp.probe(tmp_path / "model.gguf", 1) == llama_cpp.NATIVE_HINT
    monkeypatch.setattr(llama_cpp, "available", lambda: True)
    out = tmp_path / "out.json"
    assert bench_engine.main(["--json", str(out), "--compare", "llama_cpp"]) == 2
    assert "GGML_NATIVE=OFF" in capsys.readouterr().err
    assert not out.exists()


def test_common_prefix():
    assert llama_cpp.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert llama_cpp.common_prefix([], [1]) == 0


@pytest.mark.skipif(not llama_cpp.available(),
                    reason="llama-cpp-python is the optional bench extra ('.[llama]')")
def test_greedy_tokens_are_the_argmax_of_the_last_logits():
    """The binding keeps `scores` only with logits_all; the bench reads the context's last
    logits instead, and they must be what a logits_all context scores."""
    from llama_cpp import Llama

    from peer.engine.embedded import SMOLLM2_GGUF, smollm2_gguf_dir

    gguf = smollm2_gguf_dir() / SMOLLM2_GGUF
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 314, 2]
    _, _, tokens = llama_cpp.LlamaCpp(gguf, 1).generate(prompt, 3)
    ref = Llama(model_path=str(gguf), n_threads=1, n_ctx=256, logits_all=True, verbose=False)
    expected = []
    ref.eval(prompt)
    for _ in range(3):
        expected.append(int(ref.scores[ref.n_tokens - 1].argmax()))
        ref.eval([expected[-1]])
    assert tokens == expected
    assert len(set(tokens)) > 1 or tokens[0] != 0


def test_decode_pairs_alternate_which_engine_goes_first_each_measured_warm():
    calls = []

    def ours():
        calls.append("ours")
        return 90.0

    def theirs():
        calls.append("theirs")
        return 100.0

    pairs = llama_cpp.decode_pairs(ours, theirs, 3, warm_runs=1)
    # each timed run right after an untimed one of the same engine
    assert calls == ["ours", "ours", "theirs", "theirs", "theirs", "theirs", "ours", "ours",
                     "ours", "ours", "theirs", "theirs"]
    assert [p["first"] for p in pairs] == ["ours", "llama_cpp", "ours"]
    assert all(p["ratio"] == 0.9 for p in pairs)
    assert llama_cpp.decode_pairs(ours, theirs, 0) == []
    calls.clear()
    llama_cpp.decode_pairs(ours, theirs, 1)
    assert calls == ["ours"] * (llama_cpp.WARM_RUNS + 1) + ["theirs"] * (llama_cpp.WARM_RUNS + 1)


def test_the_decode_ratio_is_the_median_of_the_pairs_and_the_apart_one_is_kept():
    ours = {"prefill_tokens_per_s_cold": 500.0, "decode_tokens_per_s_c1": 50.0,
            "tokens_per_s_by_concurrency": {"8": 80.0}}
    theirs = {"llama_cpp_prefill_tokens_per_s": 250.0, "llama_cpp_decode_tokens_per_s": 100.0,
              "llama_cpp_tokens_per_s_c8": 20.0, "llama_cpp_greedy_tokens": [1, 2, 3]}
    pairs = [{"ratio": r, "first": f}
             for r, f in ((0.8, "ours"), (1.1, "llama_cpp"), (0.95, "ours"))]
    keys = llama_cpp.compare_keys(ours, theirs, [1, 2, 4], pairs)
    assert keys["ratio_decode_c1_vs_llama_cpp"] == 0.95
    assert keys["ratio_decode_c1_ours_first_mean"] == pytest.approx(0.875)
    assert keys["ratio_decode_c1_llama_cpp_first_mean"] == 1.1
    assert keys["ratio_decode_c1_vs_llama_cpp_apart"] == 0.5
    assert keys["ratio_prefill_vs_llama_cpp"] == 2.0 and keys["ratio_c8_vs_llama_cpp"] == 4.0
    assert keys["greedy_tokens_shared_with_llama_cpp"] == 2
    assert llama_cpp.compare_keys(ours, theirs, [1], [])["ratio_decode_c1_vs_llama_cpp"] == 0.5
