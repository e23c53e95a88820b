"""bench.engine --compare llama_cpp: without llama-cpp-python it says how to install it and
exits 2; it refuses workloads it cannot compare."""

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

    from peer.engine.model import SMOLLM2_GGUF, smollm2_gguf_dir

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
