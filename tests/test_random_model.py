"""bench.random_model writes a checkpoint folder that the peer loads, and the same
arguments give the same weights (peers that build it apart can verify each other)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import random_model
from peer.engine.model import load_model
from protocols.ids import split_model_id


def test_the_same_arguments_build_the_same_model_and_the_peer_loads_it(tmp_path: Path) -> None:
    folders = [tmp_path / "one" / "m", tmp_path / "two" / "m", tmp_path / "three" / "m"]
    for folder, seed in zip(folders, (7, 7, 8), strict=True):
        random_model.build(folder, hidden=32, layers=1, seed=seed)
    ids = [load_model(str(f), dtype="float32").model_id for f in folders]
    assert split_model_id(ids[0])[0] == "m"
    assert ids[0] == ids[1] != ids[2]  # the id carries the weights' fingerprint


def test_a_hidden_size_the_heads_cannot_split_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        random_model.main([str(tmp_path / "m"), "--hidden", "30"])
