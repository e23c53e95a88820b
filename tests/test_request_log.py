"""RequestLog: bounded, newest first, counts every outcome, cuts long sentences."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from peer.request.pipeline import Attempt, Outcome
from peer.request.request_log import (
    MAX_TEXT_CHARS,
    CacheHistory,
    CacheSample,
    RequestLog,
    RequestOutcome,
    RequestRecord,
    route_of,
)


def record(i: int, outcome: RequestOutcome = RequestOutcome.OK, at: float = 0.0) -> RequestRecord:
    return RequestRecord(f"r{i}", at, outcome, prompt_tokens=10 + i)


def test_newest_first_with_ages_and_route() -> None:
    log = RequestLog(capacity=3)
    attempts = [
        Attempt("B", False, Outcome.STALLED, "no first token in 5 s", 0, "peer B [cost]: ..."),
        Attempt("A", True, Outcome.OK, "", 7, "self A [cost]: exact match 2 blocks"),
    ]
    log.record(RequestRecord("x", 10.0, RequestOutcome.OK, 40, 32, 7, 0.25, 1.5, "A",
                             route_of(attempts)))
    log.record(record(1, RequestOutcome.FAILED, at=11.0))
    out = log.as_json(now=12.5)
    assert [r["request_id"] for r in out] == ["r1", "x"]
    assert [r["age_s"] for r in out] == [1.5, 2.5]
    first = out[1]
    assert first["cached_tokens"] == 32 and first["ttft_s"] == 0.25 and first["served_by"] == "A"
    assert first["route"] == [
        {"peer_id": "B", "local": False, "reason": "peer B [cost]: ...", "outcome": "stalled",
         "detail": "no first token in 5 s", "tokens": 0},
        {"peer_id": "A", "local": True, "reason": "self A [cost]: exact match 2 blocks",
         "outcome": "ok", "detail": "", "tokens": 7},
    ]
    assert out[0]["ttft_s"] is None and out[0]["outcome"] == "failed"


def test_long_sentences_are_cut() -> None:
    step = route_of([Attempt("B", False, Outcome.FAILED, "x" * 5000, 0, "y" * 5000)])[0]
    assert len(step.detail) == len(step.reason) == MAX_TEXT_CHARS
    assert step.detail.endswith("…")


@given(st.lists(st.sampled_from(list(RequestOutcome)), max_size=60), st.integers(1, 8))
def test_keeps_the_last_capacity_and_counts_all(outcomes, capacity) -> None:
    log = RequestLog(capacity)
    for i, outcome in enumerate(outcomes):
        log.record(record(i, outcome, at=float(i)))
    kept = [r.request_id for r in log.records()]
    assert kept == [f"r{i}" for i in reversed(range(len(outcomes)))][:capacity]
    counts = log.statistics()
    assert sum(counts.values()) == len(outcomes)
    for outcome in RequestOutcome:
        assert counts[outcome.value] == outcomes.count(outcome)


def test_cache_history_gives_ratios_since_start_and_per_window() -> None:
    history = CacheHistory(capacity=3)
    for at, prompt, cached, blocks in [(0, 0, 0, 0), (1, 100, 0, 5), (2, 100, 0, 5),
                                       (3, 300, 150, 10)]:
        history.add(CacheSample(float(at), prompt, cached, blocks, 20))
    assert len(history) == 3  # the oldest went
    assert history.as_json(now=4.0) == [
        {"age_s": 3.0, "hit_ratio": 0.0, "window_hit_ratio": None, "fill": 0.25},
        {"age_s": 2.0, "hit_ratio": 0.0, "window_hit_ratio": None, "fill": 0.25},  # no prompt
        {"age_s": 1.0, "hit_ratio": 0.5, "window_hit_ratio": 0.75, "fill": 0.5},
    ]
