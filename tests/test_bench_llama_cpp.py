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


def test_common_prefix():
    assert bench_engine.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert bench_engine.common_prefix([], [1]) == 0
