"""The pipeline's defences against hostile or slow peers, on a scripted fake host under a
virtual clock (like trio's happy-eyeballs tests): exact times, exact routes."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
import trio

from peer.engine.engine import SamplingParams
from peer.request.pipeline import GenerationChunk, Outcome
from peer.request.race import first_token_timeout_s, hedge_delay_s
from peer.routing.trust import TrustState
from tests.fake_host import (
    SELF,
    STALL,
    CacheOnlyVerifier,
    FakeEngine,
    Step,
    answer,
    fake_config,
    fake_swarm,
    honest,
    new_peer_id,
    reference,
    request,
)

A, B, C = new_peer_id(1), new_peer_id(2), new_peer_id(3)
PROMPT = list(range(100, 132))  # 8 blocks of 4
N = 6
PARAMS = SamplingParams(max_new_tokens=N)
GOOD = reference(PROMPT, N)


def stall(request):
    return [STALL]


def wrong(request):
    return answer(request, [(t + 1) % 1000 for t in reference(request.prompt_token_ids,
                                                              request.max_new_tokens)])


async def collect(pipeline, params=PARAMS, prompt=PROMPT, salt=None):
    chunks, result = [], None
    async for item in pipeline.stream(request(prompt, params, cache_salt=salt)):
        if isinstance(item, GenerationChunk):
            chunks.append(item)
        else:
            result = item
    return chunks, result


def route(result):
    return [(a.peer_id, a.outcome) for a in result.route]


async def test_a_stall_costs_the_deadline_from_the_estimate_not_the_fixed_one(autojump_clock):
    swarm = fake_swarm({A: (7, stall), B: (6, honest())}, PROMPT)
    ranked = swarm.pipeline._rank(PROMPT, PARAMS, 0.0)
    assert [c.peer_id for c in ranked] == [A, B, SELF]
    timeout = first_token_timeout_s(swarm.pipeline.config, ranked[0])
    assert timeout == 1.0  # the floor: 4x an estimate of ~10 ms is less
    _, result = await collect(swarm.pipeline)
    assert swarm.host.dials == [(0.0, A), (1.0, B)]  # not forward_first_token_s (30 s)
    assert route(result) == [(A, Outcome.STALLED), (B, Outcome.OK)]
    assert list(result.token_ids) == GOOD
    assert result.ttft_s == pytest.approx(1.01)


async def test_a_far_peer_gets_a_multiple_of_its_estimate(autojump_clock):
    swarm = fake_swarm({A: (7, stall), B: (6, honest())}, PROMPT, rtt_s={A: 0.5})
    a = swarm.pipeline._rank(PROMPT, PARAMS, 0.0)
    a = next(c for c in a if c.peer_id == A)
    cost = a.cost
    expected = 4.0 * (cost.network_s + cost.queue_s + cost.prefill_s)
    assert 1.0 < expected < 30.0
    await collect(swarm.pipeline)
    assert swarm.host.dials[1][1] == B
    assert swarm.host.dials[1][0] == pytest.approx(expected)


async def test_a_slow_candidate_is_hedged_and_the_first_token_wins(autojump_clock):
    slow = honest(ttft_s=0.5)
    swarm = fake_swarm({A: (7, slow), B: (6, honest(ttft_s=0.02))}, PROMPT,
                       hedge_multiple=2.0, hedge_floor_s=0.1)
    ranked = swarm.pipeline._rank(PROMPT, PARAMS, 0.0)
    assert hedge_delay_s(swarm.pipeline.config, ranked[0]) == 0.1
    chunks, result = await collect(swarm.pipeline)
    assert swarm.host.dials == [(0.0, A), (0.1, B)]
    assert result.ttft_s == pytest.approx(0.12)
    assert (pytest.approx(0.12), A) in swarm.host.resets  # the loser is cancelled at once
    assert {c.served_by for c in chunks} == {B}
    assert route(result) == [(A, Outcome.STALLED), (B, Outcome.OK)]
    assert list(result.token_ids) == GOOD
    assert swarm.pipeline.statistics()["hedges"] == 1
    # Slower than its hedge delay is not a stall: A is not backed off for it.
    assert swarm.pipeline.router.failed_s_ago(A, trio.current_time()) is None


async def test_a_hedge_that_loses_is_cancelled_and_not_blamed(autojump_clock):
    swarm = fake_swarm({A: (7, honest(ttft_s=0.15)), B: (6, honest(ttft_s=0.5))}, PROMPT,
                       hedge_multiple=2.0, hedge_floor_s=0.1)
    _, result = await collect(swarm.pipeline)
    assert swarm.host.dials == [(0.0, A), (0.1, B)]
    assert result.served_by == A and result.ttft_s == pytest.approx(0.15)
    assert (pytest.approx(0.15), B) in swarm.host.resets
    assert route(result) == [(A, Outcome.OK)]


async def test_a_failure_is_seen_by_concurrent_requests_at_once(autojump_clock):
    def breaks_later(request):
        if request.request_id == "first":
            return [Step(0.3, None)]  # the stream breaks at t = 0.3
        return [STALL]

    swarm = fake_swarm({A: (7, breaks_later), B: (6, honest())}, PROMPT)
    results = {}

    async def run(request_id, at):
        await trio.sleep(at)
        async for item in swarm.pipeline.stream(request(PROMPT, PARAMS, request_id=request_id)):
            if not isinstance(item, GenerationChunk):
                results[request_id] = item

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "first", 0.0)
        nursery.start_soon(run, "second", 0.2)  # waits on A's first token when A fails
        nursery.start_soon(run, "third", 0.4)  # arrives after: A is not its first choice
    assert swarm.host.dials[:4] == [(0.0, A), (0.2, A), (0.3, B), (0.3, B)]
    assert route(results["second"])[0] == (A, Outcome.STALLED)
    assert results["second"].ttft_s == pytest.approx(0.11)  # not the 1 s deadline
    assert swarm.host.dials[4] == (0.4, B)
    assert [a.peer_id for a in results["third"].route] == [B]
    assert swarm.pipeline.router.backoff_s(A) == 10.0  # one failure, recorded once


async def test_speeds_observed_on_a_forward_bound_the_advertised_ones(autojump_clock):
    prompt = list(range(100, 300))  # 200 tokens, none cached there: compute dominates
    swarm = fake_swarm({A: (1, honest(ttft_s=0.5, gap_s=0.1))}, prompt)
    await collect(swarm.pipeline, SamplingParams(max_new_tokens=10), prompt)
    view = swarm.trust.view(A)
    # nothing queued there; the round trip the router priced (~1 ms) is left out
    assert 200 / 0.5 < view.observed_prefill_tokens_per_s == pytest.approx(200 / 0.5, rel=0.01)
    assert view.observed_decode_tokens_per_s == pytest.approx(9 / 0.9)
    standing = swarm.trust.routing(A)
    assert (standing.observed_prefill, standing.observed_decode) == pytest.approx(
        (400.0, 10.0), rel=0.01)


async def test_wrong_tokens_are_caught_at_fraction_one_and_never_delivered(autojump_clock):
    swarm = fake_swarm({A: (7, wrong), B: (6, honest())}, PROMPT, verify_fraction=1.0)
    chunks, result = await collect(swarm.pipeline)
    assert all(c.served_by == B for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == GOOD
    assert list(result.token_ids) == GOOD and result.served_by == B
    assert route(result) == [(A, Outcome.WRONG_OUTPUT), (B, Outcome.OK)]
    assert not swarm.trust.routable(A)
    assert "wrong output" in swarm.trust.view(A).reason
    _, again = await collect(swarm.pipeline)
    assert A not in [a.peer_id for a in again.route]  # quarantined: never routed again


async def test_a_hedge_cancelled_by_a_liar_that_won_is_tried_again(autojump_clock):
    # A answers first (0.2 s) but wrongly; this peer's own run, started as a hedge at
    # 0.1 s, was cancelled when A won: it must still complete the request.
    def fast_liar(request):
        out = reference(request.prompt_token_ids, request.max_new_tokens)
        return answer(request, [(t + 1) % 1000 for t in out], ttft_s=0.2)

    swarm = fake_swarm({A: (7, fast_liar)}, PROMPT, engine=FakeEngine(ttft_s=0.5),
                       verify_fraction=1.0, hedge_multiple=2.0, hedge_floor_s=0.1)
    chunks, result = await collect(swarm.pipeline)
    assert list(result.token_ids) == GOOD and result.served_by == SELF
    assert route(result)[0] == (A, Outcome.WRONG_OUTPUT) and route(result)[-1][1] is Outcome.OK
    assert all(c.served_by == SELF for c in chunks)


async def test_a_verified_good_prefix_is_kept(autojump_clock):
    def bad_from_3(request):
        out = reference(request.prompt_token_ids, request.max_new_tokens)
        return answer(request, out[:3] + [(t + 1) % 1000 for t in out[3:]])

    swarm = fake_swarm({A: (7, bad_from_3), B: (6, honest())}, PROMPT, verify_fraction=1.0)
    _, result = await collect(swarm.pipeline)
    assert list(result.token_ids) == GOOD
    assert result.route[0].outcome is Outcome.WRONG_OUTPUT and result.route[0].tokens == 3
    b_request = next(r for t, p, r in swarm.host.requests if p == B)
    assert list(b_request.prompt_token_ids) == PROMPT + GOOD[:3]
    assert b_request.max_new_tokens == N - 3


async def test_excess_tokens_are_cut_and_the_peer_quarantined(autojump_clock):
    def too_many(request):
        return answer(request, reference(request.prompt_token_ids, request.max_new_tokens + 5))

    swarm = fake_swarm({A: (7, too_many), B: (6, honest())}, PROMPT)
    chunks, result = await collect(swarm.pipeline)
    delivered = [t for c in chunks for t in c.token_ids]
    assert delivered == GOOD and list(result.token_ids) == GOOD
    assert result.completion_tokens == N
    assert not swarm.trust.routable(A)
    assert "more than the 6 asked for" in swarm.trust.view(A).reason


async def test_text_and_served_by_are_this_peers_own(autojump_clock):
    def forger(request):
        out = reference(request.prompt_token_ids, request.max_new_tokens)
        return answer(request, out, served_by="12D3KooWsomeoneelse", text="EVIL")

    swarm = fake_swarm({A: (7, forger)}, PROMPT)
    chunks, result = await collect(swarm.pipeline)
    assert result.served_by == A and {c.served_by for c in chunks} == {A}
    assert result.text == swarm.engine.decode(GOOD)
    assert "EVIL" not in "".join(c.text for c in chunks)


async def test_cached_tokens_beyond_the_prompt_are_a_fault_not_a_usage_figure(
    autojump_clock,
):
    def inflates(request):
        steps = honest()(request)
        result = steps[-1].frame
        big = len(request.prompt_token_ids) + 1000
        return [*steps[:-1], Step(0.0, replace(result, prompt_tokens=big, cached_tokens=big))]

    swarm = fake_swarm({A: (7, inflates), B: (6, honest())}, PROMPT)
    _, result = await collect(swarm.pipeline)
    assert list(result.token_ids) == GOOD
    assert result.cached_tokens <= len(PROMPT)
    assert not swarm.trust.routable(A) and "cached tokens" in swarm.trust.view(A).reason


async def test_out_of_vocabulary_ids_fail_the_attempt(autojump_clock):
    swarm = fake_swarm({A: (7, honest()), B: (6, honest())}, PROMPT)
    swarm.host.scripts[A] = lambda request: [Step(0.01, _OOV)]
    _, result = await collect(swarm.pipeline)
    assert route(result)[0] == (A, Outcome.FAILED)
    assert list(result.token_ids) == GOOD


class _RawChunk:
    """A chunk frame that the typed TokenChunk would refuse to build (id 5000 >= 1000)."""

    def to_wire(self):
        return {"t": "chunk", "tokens": [5000], "text": ""}


_OOV = _RawChunk()


async def test_unproven_origins_are_never_dialed(autojump_clock):
    swarm = fake_swarm({A: (8, honest()), B: (6, honest())}, PROMPT, rtt_s={A: None})
    await collect(swarm.pipeline)
    assert swarm.host.dialed() == [B]
    assert swarm.pipeline.router.statistics().unproven_skipped == 1


@asynccontextmanager
async def shadows_served(swarm):
    """The pipeline's shadows, owned by a nursery as `Serving.serve` owns them."""
    async with trio.open_nursery() as nursery:
        await nursery.start(swarm.pipeline.shadows.serve)
        yield
        nursery.cancel_scope.cancel()


async def test_a_newcomer_earns_trust_on_shadows_and_never_serves_before(autojump_clock):
    swarm = fake_swarm({A: (7, honest())}, PROMPT, trusted=False, probation_requests=3,
                       verify_fraction=0.0)
    served_by = []
    async with shadows_served(swarm):
        for _ in range(6):
            _, result = await collect(swarm.pipeline)
            assert list(result.token_ids) == GOOD
            served_by.append(result.served_by)
            await trio.sleep(1.0)  # the shadow ends meanwhile
    # Shadows of requests 1-3 (served here) earn A its trust; from then on A serves.
    assert served_by == [SELF, SELF, SELF, A, A, A]
    assert swarm.host.dialed() == [A] * 6
    assert swarm.engine.verified == []  # no compute spent here on checking A
    assert swarm.trust.view(A).state is TrustState.TRUSTED
    stats = swarm.pipeline.statistics()
    assert stats["shadow_matched"] == 3 and stats["shadow_sent"] == 3
    assert stats["shadows_in_flight"] == 0


async def test_a_shadow_looks_like_a_forward_and_the_client_never_waits_for_it(
    autojump_clock,
):
    slow_new = honest(ttft_s=0.5)
    swarm = fake_swarm({A: (7, slow_new), B: (6, honest())}, PROMPT, trusted=False,
                       verify_fraction=0.0)
    for _ in range(swarm.trust.probation_requests):
        swarm.trust.record_served(B, verified=True)
    async with shadows_served(swarm):
        _, result = await collect(swarm.pipeline)
        assert result.served_by == B and result.ttft_s == pytest.approx(0.01)
        assert trio.current_time() == pytest.approx(0.06)  # not A's 0.55 s
        await trio.sleep(10.0)
    (_, _, to_b), (_, _, to_a) = sorted(swarm.host.requests, key=lambda r: r[1] != B)
    assert to_a.request_id != to_b.request_id and len(to_a.request_id) == 32
    assert replace(to_a, request_id="x") == replace(to_b, request_id="x")
    assert swarm.pipeline.statistics()["shadow_matched"] == 1


async def test_a_lying_newcomer_reaches_no_client_and_is_quarantined(autojump_clock):
    swarm = fake_swarm({A: (7, wrong)}, PROMPT, trusted=False, verify_fraction=0.0)
    async with shadows_served(swarm):
        for _ in range(4):
            chunks, result = await collect(swarm.pipeline)
            assert list(result.token_ids) == GOOD
            assert {c.served_by for c in chunks} == {SELF}
            await trio.sleep(1.0)
    assert swarm.trust.view(A).state is TrustState.QUARANTINED
    assert swarm.host.dialed() == [A]  # one shadow, then never again
    assert len(swarm.engine.verified) == 1  # the difference was checked before judging
    assert swarm.pipeline.statistics()["shadow_mismatched"] == 1


async def test_a_failed_shadow_backs_the_newcomer_off_and_shutdown_cancels_one(
    autojump_clock,
):
    swarm = fake_swarm({A: (7, stall)}, PROMPT, trusted=False)
    async with shadows_served(swarm):
        _, result = await collect(swarm.pipeline)
        assert result.served_by == SELF
        await trio.sleep(fake_config().forward_first_token_s + 1.0)  # a shadow's deadline
        assert swarm.pipeline.statistics()["shadow_stalled"] == 1
        await collect(swarm.pipeline)  # within the back-off: no shadow
        assert swarm.host.dialed() == [A]
        await trio.sleep(20.0)
        await collect(swarm.pipeline)  # the next shadow is in flight at shutdown
        assert swarm.pipeline.shadows.planner.in_flight == 1
    assert swarm.host.dialed() == [A, A]
    assert swarm.pipeline.shadows.planner.in_flight == 0
    assert swarm.trust.view(A).state is TrustState.PROBATION


async def test_a_slow_newcomer_earns_credit_past_a_forwards_first_token_deadline(
    autojump_clock,
):
    """Nobody waits for a shadow: a first token after the estimate-based deadline a
    client's forward would get (1 s floor here) still counts, up to forward_first_token_s."""
    swarm = fake_swarm({A: (7, honest(ttft_s=5.0))}, PROMPT, trusted=False, verify_fraction=0.0)
    async with shadows_served(swarm):
        _, result = await collect(swarm.pipeline)
        assert result.served_by == SELF
        await trio.sleep(10.0)
    stats = swarm.pipeline.statistics()
    assert stats["shadow_matched"] == 1 and stats.get("shadow_stalled", 0) == 0


async def test_a_sampled_request_is_shadowed_with_the_seed_the_entry_chose(autojump_clock):
    swarm = fake_swarm({A: (7, honest())}, PROMPT, trusted=False)
    async with shadows_served(swarm):
        _, result = await collect(swarm.pipeline,
                                  params=SamplingParams(max_new_tokens=N, temperature=0.8))
        assert result.served_by == SELF
        await trio.sleep(1.0)
    assert swarm.host.dialed() == [A]
    (_, _, shadow), = swarm.host.requests
    assert shadow.temperature == 0.8 and shadow.seed is not None
    assert swarm.pipeline.statistics()["shadow_matched"] == 1


async def test_a_private_request_carries_no_shadow(autojump_clock):
    swarm = fake_swarm({A: (7, honest())}, PROMPT, trusted=False)
    async with shadows_served(swarm):
        await collect(swarm.pipeline, params=SamplingParams(max_new_tokens=N, temperature=0.8),
                      salt=b"tenant")
        await trio.sleep(1.0)
    assert swarm.host.dialed() == []


async def test_claims_that_overshoot_are_discounted_until_the_peer_is_not_preferred(
    autojump_clock,
):
    # A claims 8 blocks (a poisoned filter) but reports 0 cached; B claims 6 and has them.
    swarm = fake_swarm({A: (8, honest(cached=0)), B: (6, honest(cached=24))}, PROMPT)
    firsts = []
    for _ in range(8):
        _, result = await collect(swarm.pipeline)
        firsts.append(result.route[0].peer_id)
    assert firsts[0] == A
    assert firsts[-1] == B
    assert swarm.trust.claim_factor(A) < 1.0
    assert swarm.trust.claim_factor(B) == 1.0


async def test_without_a_verifier_verification_is_skipped_and_says_so(autojump_clock):
    swarm = fake_swarm({A: (7, wrong)}, PROMPT, engine=CacheOnlyVerifier(),
                       verify_fraction=1.0)
    await collect(swarm.pipeline)
    stats = swarm.pipeline.statistics()
    assert stats["verification_available"] == 0
    assert stats["responses_unverified"] == 1


async def test_swarm_view_shows_each_peers_trust():
    from types import SimpleNamespace

    from peer.engine.api import EngineLoad
    from peer.views import swarm_view

    swarm = fake_swarm({A: (7, honest()), B: (6, honest())}, PROMPT, trusted=False,
                       probation_requests=3)
    swarm.trust.quarantine(B, "wrong output: token 2", 0.0)
    swarm.trust.record_served(A, verified=True)
    engine = SimpleNamespace(
        load=lambda: EngineLoad(0, 0, 0.0, 0.0), cache=SimpleNamespace(num_blocks=0,
        capacity_blocks=1), model_id="m", block_size=4,
    )
    swarm_json = swarm_view(
        now=trio.current_time(), engine=engine, table=swarm.table, trust=swarm.trust,
        peer_id=SELF, addrs=[], policy="cost",
    )
    view = {p["peer_id"]: p["trust"] for p in swarm_json["peers"]}
    assert view[A] == {"state": "probation", "reason": "new identity", "verified": 1,
                       "served": 1, "discount": 1.0, "claims": "believed", "debt": 0.0,
                       "lapses": 0}
    assert view[B]["state"] == "quarantined" and view[B]["reason"] == "wrong output: token 2"
    assert view[B]["discount"] == 0.0


async def test_quarantine_is_persisted_next_to_the_identity_and_reloaded(
    tmp_path, autojump_clock
):
    import json

    from peer.request.serving import Serving
    from tests.fake_host import FakeEngine, fake_config, fake_peers

    config = fake_config(identity_file=tmp_path / "identity.key", verify_fraction=1.0,
                         probation_requests=0)
    engine = FakeEngine()
    table, host = fake_peers({A: (7, wrong)}, PROMPT, engine)
    serving = Serving(config=config, engine=engine, table=table, host=host, self_id=SELF)
    result = await serving.generate(PROMPT, PARAMS)
    assert list(result.token_ids) == GOOD
    saved = json.loads((tmp_path / "quarantine.json").read_text())
    assert [r["peer_id"] for r in saved["quarantined"]] == [A]
    assert saved["quarantined"][0]["reason"].startswith("wrong output")

    # A restart: the new ledger loads the file; A is never dialed again.
    table, host = fake_peers({A: (7, honest())}, PROMPT, engine)
    restarted = Serving(config=config, engine=engine, table=table, host=host, self_id=SELF)
    assert not restarted.trust.routable(A)
    await restarted.generate(PROMPT, PARAMS)
    assert host.dials == []
    assert restarted.statistics()["trust"]["peers_quarantined"] == 1


async def test_an_unreadable_quarantine_file_is_a_clear_error(tmp_path):
    from peer.request.serving import Serving
    from tests.fake_host import FakeEngine, FakeHost, fake_config

    (tmp_path / "quarantine.json").write_text("{not json")
    config = fake_config(identity_file=tmp_path / "identity.key")
    with pytest.raises(ValueError, match="quarantine file"):
        Serving(config=config, engine=FakeEngine(), table=None, host=FakeHost(), self_id=SELF)


async def test_a_private_request_is_never_forwarded(autojump_clock):
    salts = []

    class SaltedEngine(FakeEngine):
        def stream(self, prompt, params, cache_salt=None, background=False):
            salts.append(cache_salt)
            return super().stream(prompt, params)

    swarm = fake_swarm({A: (7, honest())}, PROMPT, engine=SaltedEngine())
    private = request(PROMPT, PARAMS, cache_salt=b"salt")
    items = [i async for i in swarm.pipeline.stream(private)]
    assert swarm.host.dials == [] and salts == [b"salt"]
    assert list(items[-1].token_ids) == GOOD


async def test_all_tokens_before_a_fault_complete_the_request(autojump_clock):
    def one_too_many(request):
        return answer(request, reference(request.prompt_token_ids, request.max_new_tokens + 1))

    swarm = fake_swarm({A: (7, one_too_many)}, PROMPT, engine=FakeEngine(ttft_s=100.0))
    _, result = await collect(swarm.pipeline)
    assert list(result.token_ids) == GOOD and result.finish_reason == "length"
    assert route(result) == [(A, Outcome.HANDED_OVER)]  # this peer never had to run it
    assert not swarm.trust.routable(A)
