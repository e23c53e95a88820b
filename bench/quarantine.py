"""How fast a lying peer is quarantined at the default verify_fraction (in process).

    python -m bench.quarantine --json PATH [--trials 200] [--seed 0]

Seeded trials forward one request at a time to a scripted liar until the real trust
ledger (peer/routing/trust.py) quarantines it, driven by the ledger alone and by the real
Pipeline + Router + TrustLedger over tests/fake_host.py (virtual clock). Reported per
liar (LIARS): the lying forwards until quarantine (p50, p95, max), the share of trials
quarantined within TARGET_FORWARDS, and (pipeline) the wrong outputs that reached the
client before: the price of verifying a fraction only.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from bench.report import emit_json
from bench.stats import percentile
from peer.routing.trust import DEFAULT_VERIFY_FRACTION, TrustLedger

TARGET_FORWARDS = 50  # the target: quarantined within 50 forwarded requests...
TARGET_SHARE = 0.95  # ...in at least 95% of trials
MAX_FORWARDS = 10_000  # a trial that never ends is a bug: stop and report it as not caught
# always: lies on every response from its first one (a new identity: on probation, its
#   answers are shadows, each compared); after_probation: honest until the ledger trusts
#   it, then lies on every response, counted from its first lie (only verify_fraction
#   draws catch it).
LIARS = ("always", "after_probation")
MAX_PIPELINE_REQUESTS = 500  # requests per pipeline trial; the liar gets most of them
PEER = "12D3KooWScriptedLiar"


def forwards_until_quarantine(liar: str, verify_fraction: float, rng: random.Random) -> int | None:
    """Forwards to the liar (from its first lie) until the ledger quarantines it."""
    ledger = TrustLedger(verify_fraction=verify_fraction)
    lying = liar == "always"
    lies = 0
    for _ in range(MAX_FORWARDS):
        if not lying and not ledger.on_probation(PEER):
            lying = True
        if ledger.on_probation(PEER):  # a shadow (peer/routing/shadow.py): always compared
            lies += lying
            if lying:
                ledger.quarantine(PEER, "shadow answer differs", 0.0)
                return lies
            ledger.record_shadow_match(PEER)
            continue
        verify = ledger.should_verify(PEER, rng)
        audit = not verify and ledger.should_audit(PEER)  # re-scored after delivery
        if audit:
            ledger.record_audit(PEER)
        if lying:
            lies += 1
            if verify or audit:
                ledger.quarantine(PEER, "verification failed", 0.0)
                assert not ledger.routable(PEER)
                return lies
            ledger.record_served(PEER, verified=False)
        else:
            ledger.record_served(PEER, verified=verify)
    return None


async def pipeline_trial(liar: str, verify_fraction: float, seed: str) -> tuple[int | None, int]:
    """One trial through the real Pipeline, Router and TrustLedger over tests/fake_host.py's
    scripted host and engine (run under a virtual clock): the liar claims the longest
    prefix, an honest peer the next. Returns (lying forwards until quarantine, wrong outputs
    that reached the client before it)."""
    from peer.engine.api import SamplingParams
    from peer.request.admission import Admission
    from peer.request.generation import GenerationRequest
    from peer.request.pipeline import Pipeline
    from peer.routing.router import Router
    from tests.fake_host import (
        BLOCK,
        SELF,
        FakeEngine,
        answer,
        fake_config,
        fake_peers,
        honest,
        new_peer_id,
        reference,
    )

    liar_id, honest_id = new_peer_id(1), new_peer_id(2)
    prompt = list(range(100, 132))
    received = 0
    lying_forwards = 0

    def script(request: Any) -> Any:
        nonlocal received, lying_forwards
        received += 1
        good = reference(request.prompt_token_ids, request.max_new_tokens)
        # It reports the cached tokens its summary claimed: its claims stay believed.
        if liar == "after_probation" and received <= cfg.probation_requests:
            return answer(request, good, cached=7 * BLOCK)
        lying_forwards += 1
        return answer(request, [(t + 1) % 1000 for t in good], cached=7 * BLOCK)

    engine = FakeEngine()
    cfg = fake_config(verify_fraction=verify_fraction)
    trust = TrustLedger(
        verify_fraction=verify_fraction, probation_requests=cfg.probation_requests,
        can_verify=True,
    )
    table, host = fake_peers(
        {liar_id: (7, script), honest_id: (6, honest(cached=6 * BLOCK))}, prompt, engine
    )
    router = Router(cfg.policy, random.Random(seed), block_size=BLOCK, trust=trust,
                    require_rtt=True)
    import trio

    audits: list[Any] = []  # delivered answers to re-score (EvidenceService's audits)

    def audit(evidence: Any) -> bool:
        audits.append(evidence)
        return True

    async def run_audits() -> None:
        while audits:
            evidence = audits.pop(0)
            verdict = await engine.verify(
                list(evidence.request.prompt_token_ids), list(evidence.answer), params
            )
            if not verdict.ok:
                pipeline.quarantine(evidence.accused, f"audit: {verdict.detail}")

    pipeline = Pipeline(
        config=cfg, engine=engine, router=router, table=table, host=host,
        admission=Admission(cfg.max_queue), self_id=SELF, trust=trust,
        rng=random.Random(f"{seed}/pipeline"), on_audit=audit,
    )
    params = SamplingParams(max_new_tokens=6)
    good = reference(prompt, 6)

    wrong = 0
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.shadows.serve)  # as Serving.serve owns them
        for n in range(MAX_PIPELINE_REQUESTS):
            request = GenerationRequest(f"request-{n}", tuple(prompt), params)
            result = await pipeline.generate(request)
            await trio.sleep(1.0)  # a shadow of this request ends meanwhile
            await run_audits()
            wrong += list(result.token_ids) != good
            if not trust.routable(liar_id):
                nursery.cancel_scope.cancel()
                return lying_forwards, wrong
        nursery.cancel_scope.cancel()
    return None, wrong


def _pipeline_trials(trials: int, seed: int, verify_fraction: float, liar: str) -> list[Any]:
    import trio
    import trio.testing

    async def run_all() -> list[tuple[int | None, int]]:
        return [
            await pipeline_trial(liar, verify_fraction, f"{seed}/{liar}/{i}")
            for i in range(trials)
        ]

    return trio.run(run_all, clock=trio.testing.MockClock(autojump_threshold=0))


def _stats(counts: list[int | None], trials: int) -> dict[str, Any]:
    caught = [c for c in counts if c is not None]
    within = sum(c <= TARGET_FORWARDS for c in caught)
    return {
        "forwards_until_quarantine_p50": percentile(caught, 0.5),
        "forwards_until_quarantine_p95": percentile(caught, 0.95),
        "forwards_until_quarantine_max": max(caught, default=None),
        "never_quarantined": len(counts) - len(caught),
        "share_within_50": within / trials,
        "meets_target": within / trials >= TARGET_SHARE,
    }


def quarantine_trials_sync(
    trials: int, seed: int = 0, verify_fraction: float = DEFAULT_VERIFY_FRACTION
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "trials": trials,
        "verify_fraction": verify_fraction,
        "target": f">= {TARGET_SHARE:.0%} of trials within {TARGET_FORWARDS} forwards",
        "ledger": {"method": "the real TrustLedger driven by a scripted liar, one forward at "
                             "a time, seeded draws per trial"},
        "pipeline": {"method": "the real Pipeline, Router and TrustLedger over a scripted "
                               "fake host and engine (tests/fake_host.py) under a virtual "
                               "clock; the liar claims the longest prefix"},
    }
    for liar in LIARS:
        counts = [
            forwards_until_quarantine(liar, verify_fraction, random.Random(f"{seed}/{liar}/{i}"))
            for i in range(trials)
        ]
        out["ledger"][liar] = _stats(counts, trials)
        results = _pipeline_trials(trials, seed, verify_fraction, liar)
        row = _stats([r[0] for r in results], trials)
        wrong = [r[1] for r in results]
        row["wrong_outputs_delivered_before_quarantine_mean"] = sum(wrong) / trials
        row["wrong_outputs_delivered_before_quarantine_max"] = max(wrong)
        out["pipeline"][liar] = row
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.quarantine",
                                description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify-fraction", type=float, default=DEFAULT_VERIFY_FRACTION)
    args = p.parse_args(argv)
    if args.trials < 1:
        p.error("--trials must be positive")
    result = quarantine_trials_sync(args.trials, args.seed, args.verify_fraction)
    emit_json(result, args.json)


if __name__ == "__main__":
    main()
