"""`prefixswarm local`: a swarm of N peer processes on loopback, for trying things out.

Peer 1 starts first (its address bootstraps the rest; on first use it also converts the
model), then peers 2..N together. Each child is `python -m peer.cli serve --report json
--exit-with-stdin` with its own identity file and HTTP port in a temporary folder; the
swarm is ready when every peer has every other peer in its table. peer.processes starts,
follows and stops the children (Ctrl-C, SIGTERM or the end of --demo stops them all).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from peer.config import DEFAULT_CACHE_BYTES, DEFAULT_MODEL, Policy
from peer.demo_data import DEMO_SUBJECTS, demo_prompts
from peer.processes import (
    PeerProcess,
    PeerProcessError,
    open_peer_processes,
    peer_process_environment,
)
from peer.settings import ENV_PREFIX

LOCAL_SUMMARY_INTERVAL_S = 1.0  # a few loopback peers: fresher summaries cost little
MAX_LOCAL_PEERS = 64  # each child holds a model copy: more than this is surely a typo
FIRST_USE_NOTE = " (the first use converts the model: ~20 s)"
DEMO_MAX_TOKENS = 4  # an answer letter and a little more
DEMO_REQUEST_TIMEOUT_S = 300.0


class LocalSwarmError(RuntimeError):
    """A demo request failed."""


@dataclass(frozen=True)
class LocalSwarmOptions:
    """How to start the children (the `local` command's options)."""

    peers: int = 3
    model: str = DEFAULT_MODEL
    http: str = "127.0.0.1:0"  # the first peer's HTTP API; the others take free ports
    cache_bytes: int = DEFAULT_CACHE_BYTES
    policy: str = Policy.COST.value
    summary_interval_s: float = LOCAL_SUMMARY_INTERVAL_S
    ready_timeout_s: float = 600.0
    log_level: str = "WARNING"

    def __post_init__(self) -> None:
        if not 1 <= self.peers <= MAX_LOCAL_PEERS:
            raise ValueError(f"peers must be in [1, {MAX_LOCAL_PEERS}], got {self.peers}")


def child_command(
    options: LocalSwarmOptions, workdir: Path, index: int, http: str, bootstrap: Sequence[str]
) -> list[str]:
    cmd = [
        sys.executable, "-m", "peer.cli", "serve",
        "--listen", "/ip4/127.0.0.1/tcp/0",
        "--http", http,
        "--identity", str(workdir / f"peer-{index}.key"),
        "--model", options.model,
        "--cache-bytes", str(options.cache_bytes),
        "--policy", options.policy,
        "--summary-interval", str(options.summary_interval_s),
        "--log-level", options.log_level,
        "--report", "json",
        "--exit-with-stdin",
        # A throwaway swarm: the operator's config file and PREFIXSWARM_* variables (an
        # API key, a bootstrap list) are for their real peer, not for these children.
        "--config", "none",
        # These peers are this operator's own processes on this machine, not strangers:
        # no probation among them (they still verify verify_fraction of what they forward).
        "--probation-requests", "0",
    ]
    if bootstrap:
        cmd += ["--bootstrap", *bootstrap]
    return cmd


def local_child_environment(peers: int) -> dict[str, str]:
    """A child's environment: the peer-process one without any PREFIXSWARM_* variable."""
    env = peer_process_environment(peers)
    return {k: v for k, v in env.items() if not k.startswith(ENV_PREFIX)}


@asynccontextmanager
async def open_local_swarm(
    options: LocalSwarmOptions,
    *,
    workdir: Path | None = None,
    say: Callable[[str], None] = lambda message: None,
) -> AsyncIterator[list[PeerProcess]]:
    """Start the children, wait until they know each other, yield them; stop all on exit.

    Identity keys and logs go to `workdir` (default: a temporary folder, removed after)."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="prefixswarm-local-") as tmp:
            async with open_local_swarm(options, workdir=Path(tmp), say=say) as started:
                yield started
        return
    n = options.peers
    timeout_s = options.ready_timeout_s
    async with open_peer_processes() as procs:

        async def spawn(index: int, http: str, bootstrap: Sequence[str]) -> PeerProcess:
            return await procs.start(
                child_command(options, workdir, index, http, bootstrap),
                log_path=workdir / f"peer-{index}.log",
                env=local_child_environment(n),
            )

        peers: list[PeerProcess] = []
        try:
            note = FIRST_USE_NOTE if options.model == DEFAULT_MODEL else ""
            say(f"loading model {options.model} on peer 1/{n}{note}...")
            first = await spawn(1, options.http, ())
            peers.append(first)
            await procs.wait_for(lambda: bool(first.peer_id), "peer 1 up", timeout_s)
            say(f"peer 1/{n} up: {first.multiaddrs[0]}")
            if n > 1:
                say(f"loading model on peers 2-{n}/{n}...")
                for i in range(2, n + 1):
                    peers.append(await spawn(i, "127.0.0.1:0", first.multiaddrs[:1]))
                await procs.wait_for(
                    lambda: all(p.peer_id for p in peers), "every peer up", timeout_s
                )
                say(f"{n} peers up; waiting for them to find each other...")
            ids = {p.peer_id for p in peers}
            await procs.wait_for(
                lambda: all(p.known >= ids - {p.peer_id} for p in peers),
                "every peer knows every other", timeout_s,
            )
            yield peers
        finally:
            if peers:
                say(f"stopping {len(peers)} peers...")


# -- the demo ----------------------------------------------------------------------------


async def run_demo(peers: Sequence[PeerProcess], model: str) -> dict[str, Any]:
    """Send the MMLU questions, entering at each peer in turn; print a line per answer."""
    import httpx

    names = {p.peer_id: f"peer {p.index}" for p in peers}
    prompts = demo_prompts()
    print(f"{len(prompts)} MMLU questions (5-shot), {len(DEMO_SUBJECTS)} subjects, greedy:")
    print(f"{'#':>2}  {'subject':<16} {'entry':<7} {'served by':<9} {'cached/prompt':>13}"
          f"  {'answer':<6} {'correct':<7} {'time':>6}")
    totals = {"requests": 0, "prompt": 0, "cached": 0, "correct": 0, "hits": 0}
    async with httpx.AsyncClient(timeout=DEMO_REQUEST_TIMEOUT_S) as client:
        for i, (subject, prompt, correct) in enumerate(prompts):
            entry = peers[i % len(peers)]
            response = await client.post(
                f"{entry.http}/v1/completions",
                json={"model": model, "prompt": prompt, "max_tokens": DEMO_MAX_TOKENS,
                      "temperature": 0, "stop": ["\n"]},
            )
            body = response.json()
            if response.status_code != 200:
                raise LocalSwarmError(f"request {i + 1} failed: {body['error']['message']}")
            usage, ext = body["usage"], body["x_prefixswarm"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            text = body["choices"][0]["text"].strip()
            answer = next((c for c in text if c in "ABCD"), text[:6] or "-")
            totals["requests"] += 1
            totals["prompt"] += usage["prompt_tokens"]
            totals["cached"] += cached
            totals["hits"] += cached > 0
            totals["correct"] += answer == correct
            served = names.get(ext["served_by"], ext["served_by"][:9])
            share = f"{cached}/{usage['prompt_tokens']}"
            print(f"{i + 1:>2}  {subject:<16} {names[entry.peer_id]:<7} {served:<9} "
                  f"{share:>13}  {answer:<6} {correct:<7} {ext['total_s']:>5.2f}s", flush=True)
    ratio = totals["cached"] / totals["prompt"] if totals["prompt"] else 0.0
    print(f"{totals['hits']}/{totals['requests']} requests reused a cached prefix; "
          f"{totals['cached']} of {totals['prompt']} prompt tokens cached ({ratio:.0%}); "
          f"{totals['correct']}/{totals['requests']} answers correct")
    return totals


# -- the command -------------------------------------------------------------------------


async def run_local(args: argparse.Namespace) -> int:
    """`prefixswarm local`: start, report, serve until Ctrl-C (or run the demo), stop."""
    options = LocalSwarmOptions(
        peers=args.peers,
        model=args.model,
        http=args.http,
        cache_bytes=args.cache_bytes,
        policy=args.policy,
        summary_interval_s=args.summary_interval,
        ready_timeout_s=args.ready_timeout,
        log_level=args.log_level,
    )

    def say(message: str) -> None:
        print(f"prefixswarm: {message}", file=sys.stderr, flush=True)

    status = 0
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for _ in signals:
                    say("interrupted")
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
            try:
                async with open_local_swarm(options, say=say) as peers:
                    first = peers[0]
                    serving = f" serving {first.model}" if first.model else ""
                    say(f"swarm ready: {len(peers)} peers{serving}, HTTP on {first.http}")
                    if args.json:
                        print(json.dumps({
                            "event": "ready", "pid": os.getpid(), "http": first.http,
                            "model": first.model,
                            "peers": [{"index": p.index, "pid": p.pid, "peer_id": p.peer_id,
                                       "multiaddrs": list(p.multiaddrs), "http": p.http}
                                      for p in peers],
                        }), flush=True)
                    if args.demo:
                        await run_demo(peers, args.model)
                    else:
                        say(f"open {first.http}/ in a browser, or "
                            f"try: prefixswarm generate 'Hello' --url {first.http}   "
                            f"prefixswarm status --url {first.http}   (Ctrl-C stops)")
                        await trio.sleep_forever()
            except (PeerProcessError, LocalSwarmError) as exc:
                say(str(exc))
                status = 1
            nursery.cancel_scope.cancel()
    say("all peers stopped")
    return status
