"""The entry peer's decision: the live router's ranking, load probes, the ring lookup.

The router, probing and lookup decisions are the live cores' (peer/routing/, peer/swarm/
interest.py); the oracle and exact policies are the baselines they are measured against.
A lookup asks the root's first home (`lookup_rtts` round trips), probes `lookup_probes`
holders' matches and asks the best `lookup_providers` for their summary, within
`lookup_wait_s`; messages are counted with their frame sizes (protocols/roots.py).
"""

from __future__ import annotations

from typing import Any

from bench.sim.swarm_state import Job, SimPeer
from peer.engine.scheduler import reusable_tokens
from peer.engine.speeds import forward_speeds
from peer.routing.cost import single_stream_decode
from peer.routing.decide import ProbeFirst, next_step
from peer.routing.probing import ProbeRound
from peer.routing.router import Candidate, LocalState, PeerEstimate
from protocols.framing import encode_frame
from protocols.load import LoadReport
from protocols.roots import MAX_MATCH_BLOCKS, Find, Match, Matched, Providers, SummaryQuery

_SUMMARY_QUERY_BYTES = len(encode_frame(SummaryQuery().to_wire()))


class RoutingModel:
    """The entry side of `Simulator` (bench/sim/model.py), whose state it uses."""

    def _lookup(self, entry: SimPeer, job: Job, now: float) -> float:
        """Ring mode: look up the prompt's root unless the entry holds it or hears a peer
        that holds the whole prompt; listen to the best holders found from now on.
        Returns the seconds the request waited."""
        bs = self.params.block_size
        local = entry.cache.peek(job.tokens) // bs
        if local:
            return 0.0
        self._catch_up(entry)
        root = job.chain[0]
        rows = entry.table.routing_rows(job.chain, now)
        heard = max((row.match_blocks for row in rows), default=0)
        if not entry.lookups.wanted(root, local, heard, len(job.chain), now):
            return 0.0
        self._lookups += 1
        budget = self.params.lookup_wait_s
        home = self._index[self._homes.homes(root, now)[0]]
        index = self._home_index.get(home)
        found = index.providers(root, now) if index is not None else []
        wait = 0.0
        if home != entry.idx:  # one stream to the home: Find, then Providers
            self._count_exchange(Find(root), Providers(root, tuple(found)))
            wait = self._round_trips(self.params.lookup_rtts)
            if wait >= budget:
                return budget
        hood = [self.peers[i].peer_id for i in entry.neighbours]
        probed = entry.lookups.holders_to_probe(found, {entry.peer_id, *hood})
        if not probed:
            return wait
        # one stream per holder, in parallel: Match, then Matched
        trips = self.params.stream_setup_rtts + 1
        match = Match(tuple(job.chain[:MAX_MATCH_BLOCKS]))
        matches = {}
        latest = wait
        for peer_id in probed:
            at = wait + self._round_trips(trips)
            latest = max(latest, at)
            blocks = self.peers[self._index[peer_id]].cache.match_hashes(match.chain)
            self._count_exchange(match, Matched(blocks))
            if at <= budget:
                matches[peer_id] = blocks
        wait = min(budget, latest)
        chosen = entry.lookups.holders_to_ask(matches, heard)
        if not chosen:
            return wait
        # one stream per holder, in parallel: SummaryQuery, then the last summary it published
        answers = [(wait + self._round_trips(trips), p) for p in chosen]
        applied = self._applied_seq[entry.idx]
        answered = []
        for at, peer_id in answers:
            source = self._index[peer_id]
            summary = self._latest[source]
            self._received += 2
            self._received_bytes += _SUMMARY_QUERY_BYTES + self._reply_bytes[source]
            if at > budget:
                continue  # the request goes on without it
            answered.append(peer_id)
            if summary is not None and entry.table.apply(summary, peer_id, now).accepted:
                applied[source] = summary.seq
                self._summaries_applied += 1
                entry.table.record_rtt(peer_id, (at - wait) / trips, now)  # the query's
        wait = min(budget, max(at for at, _ in answers))
        change = entry.lookups.admit(
            answered,
            lambda p: entry.table.estimate_match(p, job.chain[:1]) >= 1,
            exclude=hood,
        )
        for peer_id in change.removed:
            source = self._index[peer_id]
            self._audience[source].remove(entry.idx)
            self._sources[entry.idx].remove(source)
            applied[source] = 0
            entry.table.remove(peer_id)
        for peer_id in change.added:
            source = self._index[peer_id]
            self._audience[source].append(entry.idx)
            self._sources[entry.idx].append(source)
        return wait

    def _round_trips(self, n: int) -> float:
        return sum(self._one_way() + self._one_way() for _ in range(n))

    def _count_exchange(self, request: Any, reply: Any) -> None:
        """A request and its reply on one stream (protocols/roots.py), each received once."""
        self._received += 2
        self._received_bytes += len(encode_frame(request.to_wire())) + len(
            encode_frame(reply.to_wire())
        )

    def _local_state(self, peer: SimPeer, tokens: tuple[int, ...]) -> LocalState:
        return LocalState(
            peer.peer_id,
            self._reusable(peer, tokens),
            peer.queued_tokens,
            peer.running,
            peer.prefill_tps,
            peer.decode_tps,
            peer.batch_decode_tps,
            self.params.max_running,
            self.params.step_tokens,
        )

    def _reusable(self, peer: SimPeer, tokens: tuple[int, ...]) -> int:
        return reusable_tokens(peer.cache.peek(tokens), len(tokens), self.params.block_size)

    def _ranked(self, entry: SimPeer, job: Job, now: float) -> list[Candidate]:
        """The entry peer's router, as the live pipeline calls it, on its current table:
        the candidates, best first; the peers on probation go to ``job.probation``."""
        self._catch_up(entry)
        ranked = entry.router.rank_all(
            job.chain,
            len(job.tokens),
            job.req.max_new_tokens,
            self._local_state(entry, job.tokens),
            entry.table,
            now,
        )
        job.probation = ranked.probation
        return ranked.candidates

    def _router_choice(self, entry: SimPeer, job: Job, now: float) -> tuple[int, int]:
        ranked = self._ranked(entry, job, now)
        job.chosen = ranked[0]
        return self._index[ranked[0].peer_id], min(ranked[0].match_tokens, len(job.tokens) - 1)

    def _exact_load_choice(self, entry: SimPeer, job: Job, now: float) -> tuple[int, int]:
        """COST_EXACT_LOAD: the router's ranking, re-ranked with every remote candidate's
        true load now (no probe, no wait)."""
        ranked = self._ranked(entry, job, now)
        reports = {}
        for c in ranked:
            if not c.is_local:
                peer = self.peers[self._index[c.peer_id]]
                reports[c.peer_id] = LoadReport(peer.queued_tokens, peer.running)
        if reports:
            ranked = entry.router.rerank(ranked, reports, entry.table, now)
        job.chosen = ranked[0]
        return self._index[ranked[0].peer_id], min(ranked[0].match_tokens, len(job.tokens) - 1)

    def _probe_choice(self, entry: SimPeer, job: Job, now: float) -> tuple[int, int, float]:
        """COST with load probes, decided as the live pipeline decides (peer/routing/decide.py
        `next_step`: rank, probe whom and how long peer/routing/probing.py says, rank again):
        (target, its match, seconds spent waiting for answers)."""
        ranked = self._ranked(entry, job, now)
        reports = None  # after a probe, next_step answers with the candidates
        waited = 0.0
        while isinstance(
            step := next_step(ranked, reports, now, router=entry.router, table=entry.table,
                              settings=self._probe_settings),
            ProbeFirst,
        ):
            waited = self._probe(step.round, now)
            reports = step.round.reports
            entry.router.probe_waits.waited(waited, step.round.plan.rtt_s)  # as live
        self._probe_stats["changed"] += step.changed
        chosen = job.chosen = step.candidates[0]
        return self._index[chosen.peer_id], min(chosen.match_tokens, len(job.tokens) - 1), waited

    def _probe(self, probe: ProbeRound, now: float) -> float:
        """Run a probe round: each probe opens a stream (`stream_setup_rtts` round trips)
        and makes one query round trip; the report is the probed peer's load when the entry
        asked (a few one-way delays early: the simulator decides at arrival). Returns the
        seconds waited for answers."""
        trips = 2 * self.params.stream_setup_rtts + 2  # one-way legs: the stream, the query
        answers = []
        for peer_id in probe.plan.peers:
            at = now + sum(self._one_way() for _ in range(trips))
            peer = self.peers[self._index[peer_id]]
            answers.append((at, peer_id, LoadReport(peer.queued_tokens, peer.running)))
        answers.sort()
        decided = probe.deadline
        for at, peer_id, report in answers:
            probe.offer(peer_id, report, at)
            if probe.done:
                decided = at
                break
        stats = self._probe_stats
        stats["rounds"] += 1
        stats["sent"] += len(probe.plan.peers)
        stats["answered"] += len(probe.reports)
        stats["wait_s"] += decided - now
        return decided - now

    def _exact_choice(self, entry: SimPeer, job: Job) -> tuple[int, int]:
        """EXACT_LONGEST_PREFIX: the longest exact match anywhere, a tie to the entry peer,
        then to the fewest running requests, then to the lowest index."""
        best = max(self.peers, key=lambda p: (self._reusable(p, job.tokens), p is entry,
                                              -p.running, -p.idx))
        return best.idx, self._reusable(best, job.tokens)

    def _oracle_choice(self, entry: SimPeer, job: Job, now: float) -> tuple[int, int]:
        bs = self.params.block_size
        rtt = 2 * self._d * (1.0 + self.params.jitter / 2)  # the true mean round trip
        # Peers of the same calibration are priced at the entry peer's measured speeds (the
        # router does the same with speeds within SPEED_NOISE_FACTOR of its own); others,
        # in a heterogeneous swarm, at their own.
        slots, step_tokens = self.params.max_running, self.params.step_tokens
        estimates = []
        for peer in self.peers:
            speeds_of = entry if peer.cal is entry.cal else peer
            prefill_tps = speeds_of.prefill_tps
            decode_tps = single_stream_decode(speeds_of.decode_tps, speeds_of.batch_decode_tps)
            m = self._reusable(peer, job.tokens)
            local = peer is entry
            estimates.append(
                PeerEstimate(
                    peer.peer_id,
                    local,
                    m // bs,
                    m,
                    peer.queued_tokens,
                    peer.running,
                    prefill_tps,
                    decode_tps,
                    0.0 if local else rtt,
                    batch_slots=slots,
                    step_tokens=step_tokens,
                )
            )
        ranked = entry.router.rank_estimates(estimates, len(job.tokens), job.req.max_new_tokens)
        return self._index[ranked[0].peer_id], ranked[0].match_tokens

    def _forward_done(self, entry: SimPeer, job: Job, now: float) -> int:
        """A forward's last token is back at its entry: the entry's bookkeeping, as
        peer/request/run_context.py `RunContext.served` does it: the table's count of the forward,
        and what the trust ledger learns (served, the claimed match, observed speeds). A
        shadow's answer waits for the client's to be judged (`_verdict`). With
        `trust_checks`, a verified answer is re-scored before its client sees it and an
        unverified one may be audited (`_check_answer`). Returns the client requests it
        completed (1, or 0 for a shadow or an answer still to be re-scored)."""
        entry.table.forward_ended(job.charge, prefilled=True)
        if job.shadow is not None:
            return 0
        self._owe_cpu(entry, entry.cal.forward_tail_s, now)
        peer_id = self.peers[job.target].peer_id
        trust = entry.trust
        trust.record_served(peer_id, verified=job.verify or trust.on_probation(peer_id))
        if not job.verify:  # its last token reaches the client as its first did
            job.e2e = self._runnable(entry, now) - job.arrival
        self._observe(entry, job)
        if self.params.trust_checks:
            self._check_answer(entry, job, peer_id, now)
        return 0 if job.verify else 1  # a verified one: done when re-scored (`_phase`)

    def _verdict(self, entry: SimPeer, job: Job, now: float) -> None:
        """A shadow's answer and its request's are both at the entry: an honest simulated
        peer's greedy answer always matches, so the entry records what the forward showed
        and the planner counts the match (`record_shadow_match`: promoted after
        DEFAULT_PROBATION_REQUESTS), as peer/request/shadow.py `_judge` does."""
        assert job.shadow is not None
        self._observe(entry, job)
        if entry.shadows.matched(job.shadow) is not None:
            self.promotions.append((now, entry.idx, job.target))

    def _observe(self, entry: SimPeer, job: Job) -> None:
        """What a finished forward showed of its peer (`RunContext.observe`): its claim,
        its speeds."""
        peer_id = self.peers[job.target].peer_id
        trust = entry.trust
        bs = self.params.block_size
        n = len(job.tokens)
        claimed = entry.table.estimate_match(peer_id, job.chain) * bs
        trust.record_claim(peer_id, min(claimed, (n - 1) // bs * bs), job.cached)
        ttft = job.arrival + job.ttft - job.sent  # from the request sent to its first token
        span = job.e2e - job.ttft  # first to last token, both as they reach the entry
        # what the router priced when it chose the peer (a shadow: the probation candidate)
        priced = job.chosen.estimate if job.chosen is not None else None
        if job.shadow is not None and job.twin is not None:
            priced = next((c.estimate for c in job.twin.probation if c.peer_id == peer_id), None)
        trust.record_speeds(peer_id, *forward_speeds(
            n - job.cached, ttft, job.req.max_new_tokens, span,
            queued_tokens=priced.queued_prompt_tokens if priced is not None else 0,
            rtt_s=priced.rtt_s if priced is not None else 0.0,
            own_prefill_tokens_per_s=entry.prefill_tps))
