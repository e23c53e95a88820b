"""The serving peer's batching engine, step by step, with the engine's own pure rules.

Each peer's batch is the engine's own state machine (scheduler.BatchQueue): between steps
up to `max_running` waiting requests join the batch, oldest first, each matched and locked
then (late, as the engine does); a step decodes every sequence past its prompt and reads
prefill chunks within `step_tokens` (BatchQueue.plan) and takes
`Calibration.step_s(decodes, chunks)`. A waiting prompt that shares more blocks with a
prompt still being read than its cache holds waits for it (the engine's hold rule,
scheduler.waits_for_shared_prefill). A prompt's first token comes at the end of
the step that reads its last chunk, when its blocks are inserted (RadixCache.insert
evicts exactly what it needs); the lock is released when the request completes. Load is
what Engine.load reports; speeds are measured per step (speeds.observe_step).

A peer held to a CPU quota (SimParams.cpu_quotas) runs each step through its CpuQuota
(bench/sim/quota.py): at full speed within a period's budget, stalled after; its busy
time is the work over its share.

CPU a peer spends outside its engine's steps (the calibration's `request_overhead_s` per
request served when it arrives, plus `served_overhead_s` when another peer forwarded it,
`request_tail_s` at its first token, `forward_overhead_s` per request it forwards, and
with SimParams.trust_checks its re-scores of answers) is owed and paid before its next
step, which it lengthens (a step of overhead alone when the engine is idle): the peer's
one CPU share serves both, and the engine's measured speeds leave it out.
"""

from __future__ import annotations

import math

from bench.sim.swarm_state import END_BACK, FIRST_BACK, PHASE, VERDICT, Job, SimPeer, no_value
from peer.engine.scheduler import StepPlan, reusable_blocks, waits_for_shared_prefill
from peer.engine.speeds import observe_step
from peer.engine.verify_plan import verify_chunks
from peer.routing.trust import AUDITS_WAITING


class ServerModel:
    """The serving side of `Simulator` (bench/sim/model.py), whose state it uses."""

    def _start(self, job: Job, now: float) -> None:
        """The request reaches its serving peer: it waits for a batch slot."""
        peer = self.peers[job.target]
        job.server_start = now
        job.queued = len(job.tokens) - self._reusable(peer, job.tokens)
        peer.queued_tokens += job.queued
        peer.running += 1
        peer.queue.submit(job)
        peer.overhead_s += peer.cal.request_overhead_s
        if job.target != job.entry:  # a forward (or a shadow) arrived on a stream
            peer.overhead_s += peer.cal.served_overhead_s
        if peer.step_started < 0:
            self._step(peer, now)

    def _rescore_s(self, peer: SimPeer, job: Job) -> float:
        """CPU seconds `peer` spends re-scoring `job`'s answer: a forward per chunk
        (peer/engine/verify_plan.py) over the prompt's prefix that `peer` has cached."""
        chunks = verify_chunks(len(job.tokens), job.req.max_new_tokens,
                               self._reusable(peer, job.tokens))
        return sum(peer.cal.step_s(0, [chunk]) for chunk in chunks)

    def _check_answer(self, entry: SimPeer, job: Job, peer_id: str, now: float) -> None:
        """A forwarded answer is back at `entry`: re-scored before delivery if it was
        chosen for verification (its client's first token waits for the step that pays
        it), else perhaps audited (peer/request/run_context.py `RunContext.audit`): queued until
        the engine is idle, dropped beyond AUDITS_WAITING, as peer/request/evidence.py
        does (whose 30 s wait-for-idle limit is not simulated)."""
        if job.verify:
            entry.verifying.append(job)
            self._owe_cpu(entry, self._rescore_s(entry, job), now)
            return
        if not entry.trust.should_audit(peer_id):
            return
        if len(entry.audits) >= AUDITS_WAITING:
            self.audits_dropped += 1
            return
        entry.trust.record_audit(peer_id)
        entry.audits.append(self._rescore_s(entry, job))
        if entry.step_started < 0:
            self._step(entry, now)

    def _owe_cpu(self, peer: SimPeer, seconds: float, now: float) -> None:
        """`peer` owes `seconds` of CPU outside its engine (module docstring)."""
        if seconds <= 0:
            return
        peer.overhead_s += seconds
        if peer.step_started < 0:
            self._step(peer, now)

    def _step(self, peer: SimPeer, now: float) -> None:
        """Admit waiting requests, plan the next step and schedule its end (none if idle)."""
        bs = self.params.block_size

        def join(job: Job) -> None:
            n = len(job.tokens)
            match = peer.cache.match(job.tokens, now, reusable_blocks(n, bs))
            peer.cache.lock(match)
            job.match = match
            job.cached = job.pos = match.num_tokens
            job.new = n - job.cached

        def hold(job: Job) -> bool:
            prefilling = (o.tokens for o in peer.queue.batch.values() if o.pos < len(o.tokens))
            return waits_for_shared_prefill(job.tokens, self._reusable(peer, job.tokens), bs,
                                            prefilling)

        peer.queue.admit(self.params.max_running, join, hold)
        plan = peer.queue.plan(self.params.step_tokens)
        if not plan and peer.overhead_s <= 0:
            if peer.running or not peer.audits:
                peer.step_started = -1.0
                return
            peer.overhead_s = peer.audits.pop(0)  # the engine is idle: one audit runs
            self.audits_run += 1
        chunks = [(n, peer.queue.batch[rid].pos) for rid, n in plan.prefill]
        seconds = peer.cal.step_s(len(plan.decode), chunks) if plan else 0.0
        peer.step_overhead_s, peer.overhead_s = peer.overhead_s, 0.0
        # what this step owes after it, on its work less what an earlier step owed
        peer.after_step_s = peer.cal.after_step_fraction * (seconds + peer.step_overhead_s
                                                            - peer.after_step_s)
        peer.step_verifying, peer.verifying = peer.verifying, []
        peer.step_work_s = seconds + peer.step_overhead_s
        peer.step_started = now
        end = (peer.quota.run(now, peer.step_work_s) if peer.quota is not None
               else now + peer.step_work_s)
        self._push(end, PHASE, peer.idx, plan)

    def _phase(self, peer: SimPeer, plan: StepPlan, now: float) -> int:
        """A step ended on `peer`: advance its requests; returns the client requests
        completed (shadows are not)."""
        seconds = now - peer.step_started
        start, end = self.busy_window
        overlap = max(0.0, min(now, end) - max(peer.step_started, start))
        engine_s = seconds - peer.step_overhead_s
        if peer.quota is None:
            peer.busy_s += seconds
            peer.busy_in_window_s += overlap
        else:  # busy: the share of the quota used (the work over the share), pro rata
            busy = peer.step_work_s / peer.quota.share
            peer.busy_s += busy
            peer.busy_in_window_s += overlap / seconds * busy if seconds > 0 else 0.0
            work = peer.step_work_s
            engine_s = seconds * (work - peer.step_overhead_s) / work if work > 0 else 0.0
        if plan:
            prefill_tokens = sum(n for _, n in plan.prefill)
            peer.speeds, _ = observe_step(peer.speeds, prefill_tokens, len(plan.decode),
                                          engine_s)
        done = 0
        for rid in plan.decode:
            job = peer.queue.batch[rid]
            job.decode_left -= 1
            if job.decode_left <= 0:
                done += self._complete(peer, job, now)
        for rid, n in plan.prefill:
            job = peer.queue.batch[rid]
            job.pos += n
            if job.pos == len(job.tokens):
                self._prefill_done(peer, job, now)
                job.decode_left = job.req.max_new_tokens - 1
                if job.decode_left <= 0:
                    done += self._complete(peer, job, now)
        for job in peer.step_verifying:  # re-scored: the whole answer reaches its client
            job.ttft = job.e2e = now - job.arrival
            self._learn_overhead(peer, job, now - job.first_back)
            done += 1
        peer.step_verifying = []
        peer.overhead_s += peer.after_step_s  # paid after the step's requests moved on
        self._step(peer, now)
        return done

    def _prefill_done(self, peer: SimPeer, job: Job, now: float) -> None:
        job.server_ttft = now - job.server_start  # what its answer reports
        peer.queued_tokens -= job.queued
        peer.overhead_s += peer.cal.request_tail_s  # paid before the next step (_phase)
        self._insert(peer, job.tokens, now)
        job.ret = 0.0 if job.target == job.entry else self._one_way()
        job.ttft = now + job.ret - job.arrival
        if job.charge is not None:
            self._push(now + job.ret, FIRST_BACK, job.entry, job)

    def _runnable(self, peer: SimPeer, t: float) -> float:
        """When `peer`'s threads besides its steps can run from `t` (its quota's
        `runnable_at`; at once without a quota)."""
        return peer.quota.runnable_at(t) if peer.quota is not None else t

    def _first_back(self, entry: SimPeer, job: Job, now: float) -> None:
        """A forward's first token is at its entry: the table counts the forward's
        prefill done, and the client gets the token when the entry can relay it (a
        throttled entry holds it until its next period)."""
        if job.charge is not None:
            entry.table.forward_prefilled(job.charge)
        job.first_back = now
        if job.shadow is None and not job.verify:
            relayed = self._runnable(entry, now)
            job.ttft = relayed - job.arrival
            self._learn_overhead(entry, job, relayed - now)

    def _learn_overhead(self, entry: SimPeer, job: Job, after_first_s: float) -> None:
        """The entry's router learns its own wait on a forward when the first token is
        delivered, as peer/request/run_context.py `_learn_forward` does: before the request went
        out, for the first token beyond the round trip and the serving engine's time to
        it, and from the first token's arrival to its delivery (a verified answer's
        re-score included)."""
        if job.chosen is not None and not math.isnan(job.lead_s):
            entry.router.forward_overhead.forwarded(
                job.lead_s, job.chosen.estimate.rtt_s, max(0.0, after_first_s),
                peer_id=self.peers[job.target].peer_id,
                first_wait_s=max(0.0, job.first_back - job.sent),
                server_ttft_s=None if math.isnan(job.server_ttft) else job.server_ttft)

    def _complete(self, peer: SimPeer, job: Job, now: float) -> int:
        """The last token of ``job`` at its server: 1 for a client request served at its
        entry (or forwarded untracked, as the oracle does), 0 for a shadow or a forward,
        which is done when its entry has relayed or re-scored it."""
        peer.cache.unlock(job.match)
        job.match = None
        peer.queue.finish(job.rid)
        if self.params.cache_generated and job.req.output:
            self._insert(peer, job.tokens + job.req.output, now)
        peer.running -= 1
        job.e2e = now + job.ret - job.arrival
        job.answered = now + job.ret
        if job.charge is not None:
            self._push(now + job.ret, END_BACK, job.entry, job)
        twin = job.twin
        if twin is not None and not math.isnan(twin.answered):
            # both answers are at the entry: the shadow is judged (peer/request/shadow.py)
            shadow_job = twin if job.shadow is None else job
            self._push(max(job.answered, twin.answered), VERDICT, job.entry, shadow_job)
        if job.shadow is not None:
            peer.shadows_served += 1
            return 0
        peer.served += 1
        if self._measured(job):
            peer.served_after_warmup += 1
        return 0 if job.charge is not None else 1

    def _insert(self, peer: SimPeer, tokens: tuple[int, ...], now: float) -> None:
        """Insert `tokens`' full blocks as the engine does (evicting exactly what it needs)."""
        peer.cache.insert(tokens, no_value, now)
        self._drain(peer, now)

    def _drain(self, peer: SimPeer, now: float) -> None:
        events = peer.cache.drain_events()
        peer.filter.observe(events)
        peer.publish_policy.observe(events, peer.cache.public_blocks)
