"""bench.format_fidelity's comparison: agreement of argmaxes and KL from the reference."""

from __future__ import annotations

import torch

from bench.format_fidelity import compare


def test_identical_distributions_agree_and_diverge_by_nothing() -> None:
    ref = torch.log_softmax(torch.randn(5, 11, generator=torch.Generator().manual_seed(0)), -1)
    got = compare(ref, ref.clone())
    assert got["top1_agreement"] == 1.0
    assert abs(got["kl_mean"]) < 1e-6 and abs(got["kl_max"]) < 1e-6


def test_a_changed_argmax_and_a_flatter_distribution_are_counted() -> None:
    ref = torch.log_softmax(torch.tensor([[4.0, 0.0, 0.0], [0.0, 4.0, 0.0]]), -1)
    other = torch.log_softmax(torch.tensor([[4.0, 0.0, 0.0], [0.0, 0.0, 4.0]]), -1)
    got = compare(ref, other)
    assert got["top1_agreement"] == 0.5
    assert got["kl_max"] > 1.0 and got["kl_mean"] == got["kl_max"] / 2


def test_bad_arguments_are_refused_before_any_model_loads(tmp_path, capsys) -> None:
    import pytest

    from bench.format_fidelity import main

    for argv in (["--dtypes", "int3"], ["--dtypes", "auto"], ["--questions", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(["--json", str(tmp_path / "out.json"), *argv])
        assert exc.value.code == 2
    assert "--dtypes" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()
