"""What output verification costs a client: TTFT and tokens/s at verify_fraction 0, the
default and 1.0, side by side in one run (in process: an entry peer and a remote peer).

    python -m bench.verify_cost --json PATH [--model smollm2-135m] [--requests 6]
        [--max-new-tokens 32]

Two real peers (libp2p on loopback, each its own engine of the same model) in this
process. The entry routes by longest prefix; before each request the remote computes
the prompt (so its cache holds it and its summary says so) and the request, sent to the
entry, is forwarded to the remote. Each request uses another MMLU subject's 5-shot prompt,
so neither peer holds the next prompt by accident, and the entry (which verifies by
teacher forcing over prompt plus output) has never computed it: its verification is a
full prefill. The entry runs without probation (probation verifies every response of a
new peer whatever the fraction: this measures the steady state). Settings run in turns
(off, default, all, off, ...), so load drifts on this shared machine hit all three alike.

A verified response is held back until its verdict: its TTFT is the whole generation plus
the verification. Reported per setting: TTFT p50/mean, the client's tokens/s (completion
tokens over the request's whole time), and how many responses were verified.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import trio

from bench.report import emit_json
from bench.stats import percentile
from bench.workloads import load_tokenized_mmlu
from peer.config import DEFAULT_VERIFY_FRACTION, PeerConfig, Policy
from peer.engine.compute_thread import compute_thread
from peer.engine.engine import SamplingParams, load_engine
from peer.node import Peer, open_peer

SETTINGS = {"off": 0.0, "default": DEFAULT_VERIFY_FRACTION, "all": 1.0}
READY_TIMEOUT_S = 120.0  # the entry measures the remote's RTT (liveness pings) first
WARMUP_REQUESTS = 2
SUMMARY_WAIT_S = 10.0  # the remote's fresh summary reaches the entry within an interval


def log(message: str) -> None:
    print(f"bench.verify_cost: {message}", file=sys.stderr, flush=True)


def prompts(n: int, max_tokens: int) -> list[list[int]]:
    """The first question of n MMLU subjects (5-shot), one prompt per subject."""
    data = load_tokenized_mmlu()
    out: list[list[int]] = []
    for prefix, questions in zip(data.prefixes, data.questions, strict=True):
        prompt = list(prefix) + list(questions[0])
        if len(prompt) + 64 <= max_tokens:
            out.append(prompt)
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} MMLU prompts fit {max_tokens} tokens")


async def _until(predicate: Any, timeout_s: float, what: str) -> None:
    with trio.move_on_after(timeout_s):
        while not predicate():
            await trio.sleep(0.1)
        return
    raise RuntimeError(f"not within {timeout_s} s: {what}")


async def one_request(
    entry: Peer, remote: Peer, prompt: list[int], params: SamplingParams
) -> dict[str, Any]:
    """Warm the remote with `prompt`, wait until the entry's table says so, send it.
    (The new blocks make the remote publish early: peer/swarm/publish_policy.py.)"""
    await remote.generate(prompt, SamplingParams(max_new_tokens=1))
    chain = entry.engine.hasher.chain(prompt)  # type: ignore[attr-defined]
    want = max(1, (len(prompt) - 1) // entry.engine.block_size - 1)
    await _until(
        lambda: entry.table.estimate_match(remote.peer_id, chain) >= want,
        SUMMARY_WAIT_S, "the entry sees the remote's summary",
    )
    start = time.perf_counter()
    first: float | None = None
    result: Any = None
    async for item in entry.stream(prompt, params):
        if first is None:
            first = time.perf_counter()
        result = item
    end = time.perf_counter()
    return {
        "ttft_s": (first or end) - start,
        "total_s": end - start,
        "tokens": result.completion_tokens,
        "served_by_remote": result.served_by == remote.peer_id,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    log(f"loading two {args.model} engines")
    engines = [await compute_thread().run(load_engine, args.model) for _ in range(2)]
    context = engines[0].max_context
    work = prompts(
        WARMUP_REQUESTS + args.requests * len(SETTINGS), min(context, args.max_prompt_tokens)
    )
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    base = {"listen_addrs": ("/ip4/127.0.0.1/tcp/0",), "identity_file": None,
            "summary_interval_s": 0.5, "model": args.model}
    async with open_peer(PeerConfig(**base), engine=engines[1]) as remote:
        entry_config = PeerConfig(  # no probation: the steady state, set by the fraction
            **base, bootstrap=tuple(remote.multiaddrs[:1]), policy=Policy.LONGEST_PREFIX,
            probation_requests=0,
        )
        async with open_peer(entry_config, engine=engines[0]) as entry:
            assert entry.serving is not None
            trust = entry.serving.trust
            await _until(
                lambda: any(  # proven reachable: the router requires a measured RTT
                    v.peer_id == remote.peer_id and v.rtt_s is not None
                    for v in entry.table.views(trio.current_time())
                ),
                READY_TIMEOUT_S, "the entry measures the remote's round trip",
            )
            for prompt in work[:WARMUP_REQUESTS]:  # first calls of each engine run slower
                await one_request(entry, remote, prompt, params)
            rows: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
            pending = work[WARMUP_REQUESTS:]
            for i in range(args.requests):
                for name, fraction in SETTINGS.items():
                    trust.verify_fraction = fraction
                    before = trust.statistics().get("verified_ok", 0)
                    row = await one_request(entry, remote, pending.pop(), params)
                    row["verified"] = trust.statistics().get("verified_ok", 0) > before
                    rows[name].append(row)
                log(f"round {i + 1}/{args.requests} done")
            return {
                "params": {
                    "model": args.model, "requests_per_setting": args.requests,
                    "max_new_tokens": args.max_new_tokens,
                    "prompt_tokens_mean": statistics.fmean(len(p) for p in work),
                    "machine": f"{os.cpu_count()} CPUs, load average "
                               f"{os.getloadavg()[0]:.1f} at end",
                },
                "settings": {name: _summary(SETTINGS[name], r) for name, r in rows.items()},
                "trust": trust.statistics(),
            }


def _summary(fraction: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [r["ttft_s"] for r in rows]
    return {
        "verify_fraction": fraction,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_mean_s": statistics.fmean(ttft),
        "tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["total_s"] for r in rows),
        "verified": sum(r["verified"] for r in rows),
        "forwarded": sum(r["served_by_remote"] for r in rows),
        "requests": len(rows),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.verify_cost",
                                description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=6, help="per setting")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    args = p.parse_args(argv)
    emit_json(trio.run(run, args), args.json)


if __name__ == "__main__":
    main()
