"""The testbed's workload: the simulator's own generators (bench/workloads.py), mixed.

Half of the requests are MMLU 5-shot questions (a subject's shared prefix), a quarter
multi-turn chat turns (a conversation's prompts extend each other), a quarter agent steps
(a few long system prompts shared by sessions, then growing tool-call histories). The
three streams are drawn at shares of one total arrival rate and merged by arrival time;
the first `n` requests are kept. Think and tool times are shortened to the seconds a
testbed run lasts (the generators' defaults are for minutes-long simulations), and every
request's new tokens are capped (`max_new_tokens`): decode is the same work wherever a
request is served, so it only lengthens the run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from bench.workloads import (
    TokenizedMMLU,
    TokenRequest,
    agent_requests,
    chat_requests,
    mmlu_requests,
)

MMLU_SHARE, CHAT_SHARE, AGENT_SHARE = 0.5, 0.25, 0.25
TURNS = (2, 5)  # chat turns and agent steps per conversation or session (mean 3.5)
THINK_S = 2.0  # mean think time between chat turns (a run lasts 10-30 s)
TOOL_S = 1.0  # mean tool latency between agent steps
AGENT_SYSTEM_TOKENS = (300, 700)  # agents' shared system prompts (log-uniform length)
AGENT_TOOL_OUTPUT_TOKENS = 64
MMLU_SUBJECTS = 24  # subjects in play (Zipf 1.0 over a seeded popularity order)
MMLU_ZIPF = 1.0
GROUP_STRIDE = 1 << 24  # keeps the three streams' prefix keys and groups apart


@dataclass(frozen=True)
class WorkloadSpec:
    """What one testbed workload is drawn from (a row's workload is fully named by it)."""

    requests: int
    rate_per_s: float
    max_new_tokens: int = 4
    seed: int = 0
    max_prompt_tokens: int = 1536  # prompts beyond it are left out (the model's context)


def _offset(requests: list[TokenRequest], stream: int) -> list[TokenRequest]:
    """Shift prefix keys and groups so two streams never collide (the simulator hashes
    a prefix once per key, and multi-turn bookkeeping is per group)."""
    base = stream * GROUP_STRIDE
    return [replace(r, prefix_key=r.prefix_key + base, group=r.group + base) for r in requests]


def mixed_requests(data: TokenizedMMLU, spec: WorkloadSpec) -> list[TokenRequest]:
    """The first `spec.requests` requests of the MMLU + chat + agent mix (module docstring),
    by arrival time, each with at most `spec.max_new_tokens` new tokens."""
    if spec.requests < 1 or spec.rate_per_s <= 0:
        raise ValueError("requests and rate_per_s must be positive")
    n = spec.requests
    mean_turns = (TURNS[0] + TURNS[1]) / 2
    mmlu = mmlu_requests(data, n, spec.rate_per_s * MMLU_SHARE, MMLU_ZIPF,
                         max_new_tokens=spec.max_new_tokens, seed=spec.seed,
                         subjects=min(MMLU_SUBJECTS, len(data.subjects)))
    sessions = max(1, round(n * CHAT_SHARE / mean_turns) + 2)
    chat = chat_requests(data, sessions, spec.rate_per_s * CHAT_SHARE / mean_turns,
                         turns=TURNS, think_s=THINK_S, max_new_tokens=spec.max_new_tokens,
                         seed=spec.seed)
    agents = agent_requests(data, max(1, round(n * AGENT_SHARE / mean_turns) + 2),
                            spec.rate_per_s * AGENT_SHARE / mean_turns,
                            system_tokens=AGENT_SYSTEM_TOKENS, steps=TURNS,
                            tool_output_tokens=AGENT_TOOL_OUTPUT_TOKENS, tool_s=TOOL_S,
                            seed=spec.seed)
    merged = sorted(_offset(mmlu, 0) + _offset(chat, 1) + _offset(agents, 2),
                    key=lambda r: r.arrival_s)
    kept = [r for r in merged
            if r.prompt_tokens + spec.max_new_tokens <= spec.max_prompt_tokens][:n]
    return [replace(r, max_new_tokens=min(r.max_new_tokens, spec.max_new_tokens))
            for r in kept]


def paced_warmup(workload: list[TokenRequest], warmup: int, pace: float,
                 pause_s: float) -> list[TokenRequest]:
    """The first `warmup` requests arriving `pace` times closer together, the measured
    ones after them with their own spacing, `pause_s` later than their first one's gap.

    The warm-up only brings a fresh swarm to its running state (trust, caches): at a low
    load it would otherwise take most of a run's wall time. The pause lets the queue the
    faster warm-up built drain before the first measured request; the simulator is given
    the same arrivals."""
    if pace < 1.0 or pause_s < 0.0:
        raise ValueError("pace must be >= 1 and pause_s >= 0")
    if pace == 1.0 or not 0 < warmup < len(workload):
        return list(workload)
    head = [replace(r, arrival_s=r.arrival_s / pace) for r in workload[:warmup]]
    shift = workload[warmup - 1].arrival_s - head[-1].arrival_s - pause_s
    return head + [replace(r, arrival_s=r.arrival_s - shift) for r in workload[warmup:]]


def run_workload(data: TokenizedMMLU, spec: WorkloadSpec, warmup: int, pace: float,
                 pause_s: float) -> list[TokenRequest]:
    """What a testbed run sends, in order: the mix, its first `warmup` requests paced
    (`paced_warmup`). A run and every prediction of it (made then, or made again from
    its rows) draw it here."""
    return paced_warmup(mixed_requests(data, spec), warmup, pace, pause_s)


def entry_peers(seed: int, requests: int, peers: int) -> list[int]:
    """The peer (bed order) each request of a run is sent to, seeded: the same entries for
    every policy, and the simulator's prediction is given the very same ones."""
    rng = random.Random(f"{seed}/entries")
    return [rng.randrange(peers) for _ in range(requests)]


def describe(workload: list[TokenRequest]) -> dict[str, float]:
    """Sizes worth printing next to results: requests, mean prompt, span of arrivals."""
    if not workload:
        return {"requests": 0}
    prompts = [r.prompt_tokens for r in workload]
    return {
        "requests": len(workload),
        "prompt_tokens_mean": sum(prompts) / len(prompts),
        "prompt_tokens_max": max(prompts),
        "max_new_tokens_mean": sum(r.max_new_tokens for r in workload) / len(workload),
        "arrival_span_s": workload[-1].arrival_s,
    }
