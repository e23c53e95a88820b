"""What an entry learns of a remote peer's speeds from one forward (peer/engine/speeds.py
`forward_speeds`): only when compute dominates the timing, against the queue and round
trip the router priced, and never lifted past our own speed by a claimed queue."""

from __future__ import annotations

from peer.engine.speeds import forward_speeds


def test_a_forward_says_something_of_speeds_only_when_compute_dominates_its_timing():
    assert forward_speeds(640, 2.0, 9, 0.5) == (320.0, 16.0)
    assert forward_speeds(63, 2.0, 7, 0.5) == (None, None)  # a hit's short suffix, 7 tokens
    assert forward_speeds(640, None, 9, None) == (None, None)  # not timed
    assert forward_speeds(640, 0.0, 9, 0.0) == (None, None)


def test_a_forwards_prefill_is_measured_against_the_queue_and_round_trip_it_was_priced_at():
    own = 1e6  # the entry's own prefill speed: no bound in these cases
    # 640 tokens behind 1,280 queued, first token 2.0 s after sending, 0.4 s of it the trip
    assert forward_speeds(640, 2.0, 9, 0.5, queued_tokens=1280, rtt_s=0.4,
                          own_prefill_tokens_per_s=own)[0] == 1920 / 1.6
    # a round trip longer than the wait leaves a quarter of the wait as compute
    assert forward_speeds(640, 2.0, 9, 0.5, rtt_s=5.0, own_prefill_tokens_per_s=own)[0] == 640 / 0.5
    assert forward_speeds(640, 2.0, 9, 0.5, queued_tokens=-5,
                          own_prefill_tokens_per_s=own)[0] == 320.0  # no credit below 0
    assert forward_speeds(63, 2.0, 9, 0.5, queued_tokens=10_000) == (None, 16.0)  # ours too few


def test_a_claimed_queue_lifts_an_observation_only_up_to_our_own_speed():
    # a peer that claimed 100,000 queued tokens and answered 640 in 2 s: 320 tokens/s bare
    assert forward_speeds(640, 2.0, 9, 0.5, queued_tokens=100_000,
                          own_prefill_tokens_per_s=1000.0)[0] == 1000.0
    assert forward_speeds(640, 2.0, 9, 0.5, queued_tokens=100_000)[0] == 320.0  # ours unknown
    # faster than ours in bare tokens over time: that figure stands
    assert forward_speeds(6400, 2.0, 9, 0.5, queued_tokens=100_000,
                          own_prefill_tokens_per_s=1000.0)[0] == 3200.0
