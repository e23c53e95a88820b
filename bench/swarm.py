"""The real thing: N peer processes on loopback, the MMLU workload over HTTP, per policy.

    python -m bench.swarm --json PATH [--peers 4] [--model tiny-random] [--requests 160]
        [--rate 4] [--zipf 1.0] [--subjects 40] [--cache-bytes 1000000]
        [--policies local,random,least_loaded,longest_prefix,cost]

For each policy a fresh swarm starts (cold caches), every peer waits until it knows
every other, then the same seeded workload is sent: Poisson arrivals, Zipf(s) subject
popularity, a random entry peer per request, prompts as token ids (the SmolLM2
tokenizer, which tiny-random shares), greedy decoding, streamed over server-sent events.
Time to first token is measured by this client (send to first text chunk), so it
includes HTTP, routing, forwarding and queueing. The hit ratio is cached over prompt
tokens, from each response's usage. Peers share this machine's cores and loopback; for
peers on their own CPU shares behind emulated wide-area links, see bench.testbed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.report import emit_json
from bench.stats import cov, percentile
from bench.workloads import TokenRequest, load_tokenized_mmlu, mmlu_requests
from peer.processes import (
    PeerProcess,
    PeerProcesses,
    open_peer_processes,
    peer_process_environment,
)

POLICIES = ("local", "random", "least_loaded", "longest_prefix", "cost")
# Context windows (prompt + new tokens) of the aliases: tiny-random's config, SmolLM2's.
MODEL_CONTEXT = {"tiny-random": 2048, "smollm2-135m": 8192}
READY_TIMEOUT_S = 180.0  # model loading on 2 busy cores; SmolLM2's first conversion ~20 s
STOP_GRACE_S = 15.0  # stdin closed and SIGTERM, then SIGKILL: a peer needs well under 1 s
REQUEST_TIMEOUT_S = 120.0  # one request end to end; far above any healthy request here
MAX_IN_FLIGHT = 64  # client-side bound; the peers' own admission bounds sit behind it
# Tiny-random KV is 8 KiB a block (2 layers, K and V, 2 KV heads of 16, fp32): 1 MB holds
# 122 blocks, about 4 of the 5-shot prompts per peer; the 4 peers together hold about half
# of the ~880 prefix blocks in play (32 subjects drawn), so where requests go decides what
# stays cached. At 2 MB the peers together hold them all, and bench.ceiling shows that even
# an exact longest-prefix router then reaches only ~2.1x random's hit ratio, with about one
# random run in five above half of it: luck would decide the 2x bar.
DEFAULT_CACHE_BYTES = 1_000_000


def log(message: str) -> None:
    print(f"bench.swarm: {message}", file=sys.stderr, flush=True)


async def _spawn(
    procs: PeerProcesses, args: argparse.Namespace, policy: str, bootstrap: Sequence[str]
) -> PeerProcess:
    cmd = [
        sys.executable, "-m", "peer.cli", "serve",
        "--model", args.model, "--policy", policy, "--identity", "none",
        "--listen", "/ip4/127.0.0.1/tcp/0", "--http", "127.0.0.1:0",
        "--cache-bytes", str(args.cache_bytes),
        "--summary-interval", str(args.summary_interval),
        "--report", "json", "--exit-with-stdin", "--log-level", args.peer_log_level,
        *shlex.split(args.peer_args),
    ]
    if bootstrap:
        cmd += ["--bootstrap", *bootstrap]
    peer = await procs.start(
        cmd, log_path=Path(args.peer_log), env=peer_process_environment(args.peers)
    )
    await peer.wait_up(READY_TIMEOUT_S)
    return peer


@dataclass
class Outcome:
    ok: bool
    entry: str
    served_by: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    forwarded: bool = False
    error: str = ""
    route: list[dict[str, Any]] = field(default_factory=list)  # x_prefixswarm's attempts


@dataclass
class Streamed:
    """What one streamed completion delivered (times from time.perf_counter)."""

    start: float
    end: float = 0.0
    first: float | None = None  # the first event with choices
    texts: list[str] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    extension: dict[str, Any] = field(default_factory=dict)  # x_prefixswarm
    error: str = ""


def completion_body(request: TokenRequest, model: str) -> dict[str, Any]:
    """A greedy, streamed /v1/completions body for `request` (prompt as token ids)."""
    return {
        "model": model,
        "prompt": list(request.prefix + request.suffix),
        "max_tokens": request.max_new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_completion(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout_s: float
) -> Streamed:
    """POST a streaming /v1/completions body; every failure becomes `error`."""
    out = Streamed(start=time.perf_counter())
    try:
        with trio.fail_after(timeout_s):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    out.error = f"HTTP {r.status_code}: {text}"
                    return out
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        out.error = str(event["error"])
                        return out
                    if out.first is None and event.get("choices"):
                        out.first = time.perf_counter()
                    out.texts += [c.get("text") or "" for c in event.get("choices", ())]
                    out.usage = event.get("usage") or out.usage
                    out.extension = event.get("x_prefixswarm") or out.extension
    except (httpx.HTTPError, trio.TooSlowError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    out.end = time.perf_counter()
    if out.first is None or not out.usage:
        out.error = "stream ended without tokens or usage"
    return out


async def _send(
    client: httpx.AsyncClient, peer: PeerProcess, request: TokenRequest, model: str
) -> Outcome:
    got = await stream_completion(client, peer.http, completion_body(request, model),
                                  REQUEST_TIMEOUT_S)
    if got.error or got.first is None:
        return Outcome(False, peer.peer_id, error=got.error)
    usage = got.usage
    served_by = got.extension.get("served_by", "")
    return Outcome(
        True,
        peer.peer_id,
        served_by=served_by,
        ttft_s=got.first - got.start,
        e2e_s=got.end - got.start,
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
        forwarded=served_by != peer.peer_id,
        route=list(got.extension.get("route", ())),
    )


def _summarise(policy: str, outcomes: list[Outcome], peers: list[PeerProcess]) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft_s for o in ok]
    served = Counter(o.served_by for o in ok)
    per_peer = [served.get(p.peer_id, 0) for p in peers]
    errors = Counter(o.error.split(":")[0] for o in outcomes if not o.ok)
    return {
        "policy": policy,
        "requests_ok": len(ok),
        "requests_failed": len(outcomes) - len(ok),
        "errors": dict(errors),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "e2e_mean_s": statistics.fmean(o.e2e_s for o in ok) if ok else float("nan"),
        "hit_ratio": (
            sum(o.cached_tokens for o in ok) / max(1, sum(o.prompt_tokens for o in ok))
        ),
        "forwards": sum(o.forwarded for o in ok),
        "per_peer_served": per_peer,
        "load_cov": cov(per_peer) if per_peer else 0.0,
    }


async def run_policy(
    args: argparse.Namespace, policy: str, workload: list[TokenRequest], model_name: str
) -> dict[str, Any]:
    rng = random.Random(f"{args.seed}/entries")  # same entry peers for every policy
    async with open_peer_processes(grace_s=STOP_GRACE_S) as procs:
        peers: list[PeerProcess] = []
        log(f"{policy}: starting {args.peers} peers ({args.model})")
        first = await _spawn(procs, args, policy, [])
        peers.append(first)
        async with trio.open_nursery() as starting:

            async def spawn_one() -> None:
                peers.append(await _spawn(procs, args, policy, first.multiaddrs[:1]))

            for _ in range(args.peers - 1):
                starting.start_soon(spawn_one)
        ids = {p.peer_id for p in peers}
        await procs.wait_for(
            lambda: all(p.known >= ids - {p.peer_id} for p in peers),
            "every peer knows every other", READY_TIMEOUT_S, poll_s=0.2,
        )
        log(f"{policy}: swarm ready; sending {len(workload)} requests at {args.rate}/s")
        outcomes: list[Outcome] = []
        limiter = trio.CapacityLimiter(MAX_IN_FLIGHT)
        limits = httpx.Limits(max_connections=MAX_IN_FLIGHT)
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            start = trio.current_time()
            async with trio.open_nursery() as requests:
                for request in workload:
                    entry = rng.choice(peers)
                    await trio.sleep_until(start + request.arrival_s)

                    async def one(request: TokenRequest = request,
                                  entry: PeerProcess = entry) -> None:
                        async with limiter:
                            outcomes.append(await _send(client, entry, request, model_name))

                    requests.start_soon(one)
        row = _summarise(policy, outcomes, peers)
        if args.outcomes:
            with open(args.outcomes, "a") as out:
                for o in outcomes:
                    out.write(json.dumps({"policy": policy, **dataclasses.asdict(o)}) + "\n")
        log(
            f"{policy}: ok {row['requests_ok']} failed {row['requests_failed']} "
            f"ttft mean {row['ttft_mean_s']:.3f} s hit ratio {row['hit_ratio']:.3f}"
        )
        return row


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The options that decide the workload and the peers' caches (shared with bench.ceiling)."""
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--subjects", type=int, default=40, help="MMLU subjects in play")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--cache-bytes", type=int, default=DEFAULT_CACHE_BYTES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-context", type=int, default=2048,
                   help="context of a model not in MODEL_CONTEXT (longer prompts left out)")


def swarm_workload(args: argparse.Namespace) -> tuple[list[TokenRequest], int]:
    """The seeded MMLU requests that fit the model's context, and how many were left out."""
    data = load_tokenized_mmlu()
    drawn = mmlu_requests(
        data, args.requests, args.rate, args.zipf, max_new_tokens=args.max_new_tokens,
        seed=args.seed, subjects=args.subjects,
    )
    # Prompts the model cannot hold would get a 400 at every peer: not a routing result.
    context = model_context(args)
    workload = [r for r in drawn if r.prompt_tokens + r.max_new_tokens <= context]
    return workload, len(drawn) - len(workload)


def model_context(args: argparse.Namespace) -> int:
    """Prompt plus new tokens the peers' model holds."""
    context: int = MODEL_CONTEXT.get(args.model, args.max_context)
    return context


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workload, left_out = swarm_workload(args)
    context = model_context(args)
    log(f"{left_out} of {len(workload) + left_out} requests exceed the {context}-token "
        "context and are left out")
    rows = [await run_policy(args, p, workload, args.model) for p in args.policies]
    prompt_tokens = [r.prompt_tokens for r in workload]
    return {
        "params": {
            "peers": args.peers, "model": args.model, "requests": args.requests,
            "rate_per_s": args.rate, "zipf_s": args.zipf, "subjects": args.subjects,
            "max_new_tokens": args.max_new_tokens, "cache_bytes": args.cache_bytes,
            "summary_interval_s": args.summary_interval, "peer_args": args.peer_args,
            "seed": args.seed, "prompt_tokens_mean": statistics.fmean(prompt_tokens),
            "requests_sent": len(workload), "left_out_over_context": left_out,
            "context_tokens": context,
            "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at end",
        },
        "rows": rows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.swarm", description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--model", default="tiny-random", help="or smollm2-135m")
    p.add_argument("--policies", default=",".join(POLICIES))
    add_workload_arguments(p)
    p.add_argument("--summary-interval", type=float, default=1.0)
    p.add_argument("--peer-log", default=os.devnull, help="peers' stderr goes here")
    p.add_argument("--outcomes", help="append every request's outcome here (JSON lines)")
    p.add_argument("--peer-args", default="",
                   help="more `serve` flags for every peer, e.g. \"--probation-requests 0\"")
    p.add_argument("--peer-log-level", default="ERROR",
                   help="the peers' log level (DEBUG logs every routing decision)")
    args = p.parse_args(argv)
    args.policies = [x for x in args.policies.split(",") if x]
    unknown = set(args.policies) - set(POLICIES) - {"round_robin"}
    if unknown:
        p.error(f"unknown policies: {sorted(unknown)}")
    if args.peers < 1 or args.requests < 1 or args.rate <= 0:
        p.error("--peers, --requests and --rate must be positive")
    return args


def run_main(main_async: Any, args: argparse.Namespace) -> None:
    """Run `main_async(args)`; write and print its JSON to args.json (bench.swarm,
    bench.adversary)."""
    emit_json(trio.run(main_async, args), args.json)


def main(argv: list[str] | None = None) -> None:
    run_main(main_async, parse_args(argv))


if __name__ == "__main__":
    main()
