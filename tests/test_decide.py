"""peer/routing/decide.py: the rank -> probe -> rerank decision, without any I/O: the
ranking of tests/test_pipeline_probe.py's scenario, reports handed in, `now` a number."""

from __future__ import annotations

from peer.config import Policy
from peer.engine.engine import SamplingParams
from peer.routing.decide import ProbeFirst, RaceThese, next_step
from peer.routing.probing import ProbeSettings
from protocols.load import LoadReport
from tests.fake_host import SELF, fake_swarm, honest, new_peer_id

A, B = new_peer_id(1), new_peer_id(2)
PROMPT = list(range(100, 132))  # 8 blocks of 4
PARAMS = SamplingParams(max_new_tokens=6)
SETTINGS = ProbeSettings()


def scenario(policy=Policy.COST):
    """A holds 7 blocks but gossips 8 running requests, B holds 6 and is idle: by cost B
    ranks first, and A is worth a probe."""
    s = fake_swarm({A: (7, honest()), B: (6, honest())}, PROMPT, running={A: 8}, policy=policy)
    ranked = s.pipeline._rank(PROMPT, PARAMS, 0.0)
    if policy is Policy.COST:
        assert [c.peer_id for c in ranked] == [B, SELF, A]
    return s, ranked


def step(s, ranked, reports, now=0.0, **kwargs):
    return next_step(ranked, reports, now, router=s.pipeline.router, table=s.table,
                     settings=SETTINGS, **kwargs)


def test_first_a_probe_of_the_peer_worth_it_bounded_by_the_deadline():
    s, ranked = scenario()
    first = step(s, ranked, None, now=2.0, not_after=2.01)
    assert isinstance(first, ProbeFirst)
    assert first.round.plan.peers == (A,)
    assert first.round.deadline == 2.01  # the request's deadline comes before the wait


def test_a_fresh_idle_report_changes_the_choice():
    s, ranked = scenario()
    after = step(s, ranked, {A: LoadReport(0, 0)})
    assert isinstance(after, RaceThese) and after.changed
    assert [c.peer_id for c in after.candidates] == [A, B, SELF]


def test_a_busy_report_or_none_keeps_the_ranking():
    s, ranked = scenario()
    busy = step(s, ranked, {A: LoadReport(0, 8)})
    assert busy == RaceThese(busy.candidates, changed=False)
    assert busy.candidates[0].peer_id == B
    assert step(s, ranked, {}) == RaceThese(list(ranked))  # nobody answered in time


def test_no_probe_when_none_is_worth_it_or_the_request_is_private():
    s, ranked = scenario(policy=Policy.LONGEST_PREFIX)
    assert step(s, ranked, None) == RaceThese(list(ranked))  # probes serve the cost policy
    s, ranked = scenario()
    private = step(s, ranked, None, private=True)
    assert private == RaceThese([c for c in ranked if c.is_local])
    assert [c.peer_id for c in private.candidates] == [SELF]
    none = next_step(ranked, None, 0.0, router=s.pipeline.router, table=s.table,
                     settings=ProbeSettings(max_probes=0))
    assert none == RaceThese(list(ranked))


def test_rounds_that_held_their_requests_long_stop_the_probing_until_forgotten():
    """The router's ProbeWaits: where this entry's rounds waited out their deadline (peers
    out of CPU answer late), a probe costs that wait, not its round trips, and is not
    worth it; requests routed without one age the figure until a probe is tried again."""
    s, ranked = scenario()
    waits = s.pipeline.router.probe_waits
    assert isinstance(step(s, ranked, None), ProbeFirst)
    for _ in range(3):  # each waited out the default deadline, far beyond its round trips
        waits.waited(SETTINGS.max_wait_s, 0.001)
    assert step(s, ranked, None) == RaceThese(list(ranked))
    aged = 0  # each request routed without a probe ages the figure (next_step does)
    while step(s, ranked, None) == RaceThese(list(ranked)):
        aged += 1
        assert aged < 2000
    assert aged > 50  # not at the next request: a slow figure holds for a while
    assert step(s, ranked, None, private=True) == RaceThese([c for c in ranked if c.is_local])
