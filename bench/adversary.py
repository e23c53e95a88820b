"""Attacks on a live swarm: 3 honest peer processes and 1 rogue (bench/rogue.py), per attack.

    python -m bench.adversary --json PATH [--requests 24] [--concurrency 4]
        [--scenarios baseline,liar_staller,wrong_tokens_greedy,wrong_tokens_sampled,
                     forged_origins,sybil,sampled_steerer]
        [--peer-args "--verify-fraction 1.0"] [--model tiny-random] [--dtype auto]

Each scenario starts a fresh swarm (3 honest tiny-random `serve` processes and, except
for `baseline`, one rogue), sends the same seeded MMLU requests over HTTP to the honest
peers in turn, and counts wrong outputs against the honest model's own (`summarise`),
the client's TTFT, and what each honest trust ledger then holds of the rogue
(bench/adversary_views.py). The JSON: {"params", "baseline", "adversaries": {NAME: ...},
"quarantine_trials"} (the last from bench.quarantine, in process).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shlex
import shutil
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from bench import adversary_relay, adversary_views
from bench.adversary_surface import watch_surface
from bench.adversary_tables import CLIENT_ROGUES, open_measurement
from bench.stats import percentile
from bench.swarm import (
    completion_body,
    run_main,
    stream_completion,
    swarm_workload,
)
from bench.workloads import TokenRequest
from peer.engine.compute_thread import compute_thread
from peer.engine.model import DTYPES
from peer.processes import (
    PeerProcess,
    PeerProcessError,
    PeerProcesses,
    open_peer_processes,
    peer_process_environment,
)

SCENARIOS = (
    "baseline", "liar_staller", "wrong_tokens_greedy", "wrong_tokens_sampled",
    "forged_origins", "sybil", "punch_scanner", "reachability_liar", "magnet_staller",
    "relay_impersonator", "freeloader", "probation_launderer", "sampled_steerer",
    "private_evictor", "table_filler",
)
LIARS = ("liar_staller", "wrong_tokens_greedy", "wrong_tokens_sampled", "sybil",
         "probation_launderer", "sampled_steerer")
HONEST_PEERS = 3
SYBIL_IDENTITIES = 10
FORGED_IDENTITIES = 40
READY_TIMEOUT_S = 180.0  # model loading on 2 busy cores
READY_ROGUE_S = 45.0  # honest peers learn the rogue's summaries within a few intervals
REQUEST_TIMEOUT_S = 150.0  # one request end to end; a stalled forward alone can cost 30 s
SAMPLED = {"temperature": 0.8, "top_p": 0.9}
# The scenarios whose requests are sampled, and how; each request carries the seed
# index + 1, so its honest answer is exactly the one that seed selects (`references`).
SAMPLING: dict[str, dict[str, float]] = {
    "wrong_tokens_sampled": SAMPLED,
    "sampled_steerer": {"temperature": 1.0, "top_p": 1.0},  # the API's defaults
}


def log(message: str) -> None:
    print(f"bench.adversary: {message}", file=sys.stderr, flush=True)


@dataclass
class RogueProcess:
    """What the rogue process (bench.rogue) reported: its identities and its counts."""

    peer_ids: list[str] = field(default_factory=list)
    forged_ids: list[str] = field(default_factory=list)
    received: dict[str, int] = field(default_factory=dict)
    answered: dict[str, int] = field(default_factory=dict)
    relay: dict[str, int] = field(default_factory=dict)  # relay_impersonator's counts
    up: trio.Event = field(default_factory=trio.Event)
    reports: int = 0  # stats lines read so far

    def apply(self, report: dict[str, Any]) -> None:
        """One JSON line of the rogue's (peer.processes hands them over)."""
        if report.get("event") == "up":
            self.peer_ids, self.forged_ids = report["peer_ids"], report["forged_ids"]
            self.up.set()
        elif report.get("event") == "stats":
            self.received, self.answered = report["received"], report["answered"]
            self.relay = report.get("relay", {})
            self.reports += 1

    async def wait_fresh_stats(self) -> None:
        """Until two more stats lines arrived: counts that include every request sent."""
        target = self.reports + 2
        with trio.move_on_after(5.0):
            while self.reports < target:
                await trio.sleep(0.05)


def _environment() -> dict[str, str]:
    return peer_process_environment(HONEST_PEERS + 1)


async def _spawn_honest(
    procs: PeerProcesses, args: argparse.Namespace, bootstrap: Sequence[str],
    listen: str = "/ip4/127.0.0.1/tcp/0", extra: Sequence[str] = (),
) -> PeerProcess:
    cmd = [
        sys.executable, "-m", "peer.cli", "serve",
        "--model", args.model, "--dtype", args.dtype, "--identity", "none",
        "--listen", listen, "--http", "127.0.0.1:0", *extra,
        "--cache-bytes", str(args.cache_bytes), "--summary-interval", "1",
        "--report", "json", "--exit-with-stdin", "--log-level", args.peer_log_level,
        *shlex.split(args.peer_args),
    ]
    if bootstrap:
        cmd += ["--bootstrap", *bootstrap]
    peer = await procs.start(cmd, log_path=Path(args.peer_log), env=_environment())
    await peer.wait_up(READY_TIMEOUT_S)
    return peer


async def _spawn_rogue(
    procs: PeerProcesses, args: argparse.Namespace, mode: str, bootstrap: Sequence[str]
) -> RogueProcess:
    cmd = [
        sys.executable, "-m", "bench.rogue", "--mode", mode, "--model", args.model,
        "--dtype", args.dtype,
        "--cache-bytes", str(args.cache_bytes), "--identities", str(SYBIL_IDENTITIES),
        "--forged", str(FORGED_IDENTITIES), "--bootstrap", *bootstrap,
        "--relay-dump", str(_relay_dump(args)),
    ]
    shutil.rmtree(_relay_dump(args), ignore_errors=True)  # relay_impersonator's, per run
    rogue = RogueProcess()
    started = await procs.start(
        cmd, log_path=Path(args.peer_log), env=_environment(), on_report=rogue.apply
    )
    with trio.move_on_after(READY_TIMEOUT_S):
        await rogue.up.wait()
    if not rogue.up.is_set():
        started.check_alive()  # exited: its log's end says why
        raise PeerProcessError(f"the rogue ({mode}) not up within {READY_TIMEOUT_S:.0f} s")
    return rogue


def _relay_dump(args: argparse.Namespace) -> Path:
    return Path(args.json).with_suffix(".relay-dump")


# -- requests -----------------------------------------------------------------------------


@dataclass
class Outcome:
    index: int
    ok: bool
    entry: str
    text: str = ""
    served_by: str = ""
    completion_tokens: int = 0
    ttft_s: float = 0.0
    route: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""


def request_body(
    request: TokenRequest, index: int, sampling: dict[str, float] | None, model: str
) -> dict[str, Any]:
    body = completion_body(request, model)
    if sampling:
        body.update(sampling, seed=index + 1)
    return body


async def _send(
    client: httpx.AsyncClient, peer: PeerProcess, body: dict[str, Any], index: int
) -> Outcome:
    got = await stream_completion(client, peer.http, body, REQUEST_TIMEOUT_S)
    if got.error or got.first is None:
        return Outcome(index, False, peer.peer_id, error=got.error)
    return Outcome(
        index, True, peer.peer_id, text="".join(got.texts),
        served_by=got.extension.get("served_by", ""),
        completion_tokens=got.usage.get("completion_tokens", 0),
        ttft_s=got.first - got.start,
        route=got.extension.get("route", []),
    )


async def references(
    args: argparse.Namespace, workload: Sequence[TokenRequest],
    sampling: dict[str, float] | None,
) -> list[str]:
    """The honest model's text for every request (this process, an uncached engine)."""
    from peer.engine.engine import SamplingParams, load_engine

    engine = await compute_thread().run(
        functools.partial(load_engine, args.model, 0, 16, dtype=args.dtype)
    )
    out = []
    for i, request in enumerate(workload):
        params = SamplingParams(max_new_tokens=request.max_new_tokens)
        if sampling:
            params = SamplingParams(
                max_new_tokens=request.max_new_tokens, seed=i + 1, **sampling
            )
        completion = await engine.generate(list(request.prefix + request.suffix), params)
        out.append(completion.text)
    return out


# -- one scenario -------------------------------------------------------------------------


def summarise(
    name: str,
    outcomes: list[Outcome],
    refs: Sequence[str],
    honest: Sequence[PeerProcess],
    rogue: RogueProcess | None,
    max_tokens: int,
) -> dict[str, Any]:
    """One scenario's row. The reference is the honest model's text (`references`):
    greedy, the argmax at every step; sampled, the tokens the request's seed selects
    (every peer draws with the one seeded sampler, peer/engine/sampling.py, so this is
    exact, not a probability test). An output is wrong when it differs and a rogue
    identity contributed tokens to it (by the entry's route); one that differs though
    only honest peers served it (a near tie in the last bits of the logits over a cached
    prefix or another batch shape) is counted apart. TTFT is send to first text."""
    ok = sorted((o for o in outcomes if o.ok), key=lambda o: o.index)
    ttft = [o.ttft_s for o in ok]
    swarm_ids = {p.peer_id for p in honest} | set(rogue.peer_ids if rogue else ())
    fake_ids = set(rogue.peer_ids if rogue else ()) | set(rogue.forged_ids if rogue else ())
    differs = [o for o in ok if o.text != refs[o.index]]
    # Wrong: differs from the honest reference and a rogue identity contributed tokens
    # (the route is the entry's own account). Honest peers differ too, rarely: at a near
    # tie the last bits of the logits can pick another token; those are counted apart.
    wrong = [
        o for o in differs
        if any(a["peer_id"] in fake_ids and a.get("tokens", 0) > 0 for a in o.route)
    ]
    attempts: Counter[str] = Counter()
    last_touch = -1
    for position, o in enumerate(ok):
        touched = [a["peer_id"] for a in o.route if a["peer_id"] in fake_ids]
        attempts.update(touched)
        if touched:
            last_touch = position
    tail = max(1, len(ok) // 4)
    stopped = bool(ok) and last_touch < len(ok) - tail
    row: dict[str, Any] = {
        "requests_ok": len(ok),
        "requests_failed": len(outcomes) - len(ok),
        "errors": dict(Counter(o.error[:300] for o in outcomes if not o.ok)),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else float("nan"),
        "wrong_outputs_delivered": len(wrong),
        "differs_from_reference_served_honestly": len(differs) - len(wrong),
        "over_max_tokens_delivered": sum(o.completion_tokens > max_tokens for o in ok),
        # served_by must name the peer whose stream produced the last tokens
        "served_by_not_the_server": sum(
            1 for o in ok
            if o.route and o.served_by != o.route[-1]["peer_id"]
        ),
        "served_by_unknown_peer": sum(o.served_by not in swarm_ids for o in ok),
        "fallbacks": sum(len(o.route) > 1 for o in ok),
        "served_by_another_peer": sum(o.served_by != o.entry for o in ok),  # forwarded
        # Each honest peer's own clients (freeloader: the first is the one attacked).
        "ttft_p50_by_entry_s": [
            percentile([o.ttft_s for o in ok if o.entry == p.peer_id], 0.5) for p in honest
        ],
    }
    if rogue is not None:
        row["rogue_ids"] = len(rogue.peer_ids) + len(rogue.forged_ids)
        row["rogue_received"] = rogue.received
        row["rogue_answered"] = rogue.answered
        row["attempts_on_rogue_identities"] = sum(attempts.values())
        row["requests_touching_rogue"] = sum(
            any(a["peer_id"] in fake_ids for a in o.route) for o in ok
        )
        row["rogue_still_tried_in_last_quarter"] = not stopped
    if name in LIARS and rogue is not None:
        row["requests_until_quarantine"] = None  # set from the ledgers (adversary_views)
    if name == "magnet_staller" and rogue is not None:
        from bench.rogues.magnet_staller import tried_first

        row.update(tried_first(ok, fake_ids))
    if name in ("forged_origins", "sybil") and rogue is not None:
        # None of them ever serves correctly, so every attempt came before it proved itself.
        ids = rogue.forged_ids if name == "forged_origins" else rogue.peer_ids
        per_id = [attempts.get(i, 0) for i in ids]
        row["requests_before_proven_per_identity"] = per_id
        row["identities_tried"] = sum(n > 0 for n in per_id)
    return row


async def run_scenario(
    args: argparse.Namespace, name: str, workload: list[TokenRequest], refs: Sequence[str]
) -> dict[str, Any]:
    """A fresh swarm (`sybil`: the rogue is one process with SYBIL_IDENTITIES identities,
    each its own libp2p host); once the honest peers know each other (and, for up to
    READY_ROGUE_S, the rogue's identities), the requests go to the honest peers in turn,
    `--concurrency` at a time, streamed; greedy except under the SAMPLING scenarios."""
    sampling = SAMPLING.get(name)
    async with open_peer_processes() as procs:  # every child stops when this block ends
        honest: list[PeerProcess] = []
        rogue: RogueProcess | None = None
        log(f"{name}: starting {HONEST_PEERS} honest peers")
        relayed = name == adversary_relay.SCENARIO  # peers 2 and 3 reachable only via relays
        shape = adversary_relay.honest_shape if relayed else lambda i: ("/ip4/127.0.0.1/tcp/0", ())
        first = await _spawn_honest(procs, args, [], *shape(0))
        honest.append(first)
        async with trio.open_nursery() as starting:

            async def spawn_one(index: int) -> None:
                honest.append(await _spawn_honest(procs, args, first.multiaddrs[:1], *shape(index)))

            for index in range(1, HONEST_PEERS):
                starting.start_soon(spawn_one, index)
        ids = {p.peer_id for p in honest}
        with trio.fail_after(READY_TIMEOUT_S):
            while not all(p.known >= ids - {p.peer_id} for p in honest):
                await trio.sleep(0.2)
        if name != "baseline" and name not in CLIENT_ROGUES:
            log(f"{name}: starting the rogue")
            rogue = await _spawn_rogue(procs, args, name, first.multiaddrs[:1])
            # Until every honest peer lists the rogue's identities (or a while: a
            # defended peer may keep unproven ones out of its table).
            wanted = set(rogue.peer_ids) | set(rogue.forged_ids)
            with trio.move_on_after(READY_ROGUE_S):
                while not all(p.known >= wanted for p in honest):
                    await trio.sleep(0.2)
            known = [len(p.known & wanted) for p in honest]
            log(f"{name}: honest peers list {known} of {len(wanted)} rogue identities")
            if relayed:  # until the outbound-only peers route to each other via the rogue
                private = honest[1:]
                with trio.move_on_after(READY_ROGUE_S):
                    while not all(p.routable >= {q.peer_id for q in private} - {p.peer_id}
                                  for p in private):
                        await trio.sleep(0.2)
                log(f"{name}: relay so far {rogue.relay}")
        measured = open_measurement(
            name, args, honest[:HONEST_PEERS],
            lambda: _spawn_honest(procs, args, first.multiaddrs[:1]),
            lambda: rogue.answered if rogue is not None else {},
        )
        async with measured as extra:
            async with watch_surface(name, honest, rogue) as surface:
                outcomes = await _drive(args, honest, workload, sampling)
            if rogue is not None:
                await rogue.wait_fresh_stats()
        row = summarise(name, outcomes, refs, honest, rogue, args.max_new_tokens)
        row.update(extra)
        row.update(surface.row(name, rogue.answered if rogue else None))
        if relayed and rogue is not None:
            row.update(adversary_relay.relay_row(
                _relay_dump(args), [r.prefix + r.suffix for r in workload], refs, rogue.relay,
                sum(o.ok and o.text != refs[o.index] for o in outcomes),
            ))
        if args.outcomes:
            with open(args.outcomes, "a") as out:
                for o in sorted(outcomes, key=lambda o: o.index):
                    line = {"scenario": name, **dataclasses.asdict(o),
                            "reference": refs[o.index],
                            "rogue": bool(rogue) and o.served_by in rogue.peer_ids}
                    out.write(json.dumps(line) + "\n")
        if rogue is not None:
            fakes = set(rogue.peer_ids) | set(rogue.forged_ids)
            row["rogue_listed_by_honest_peers"] = [len(p.known & fakes) for p in honest]
            await adversary_views.add_trust_states(row, honest, fakes)
        await adversary_views.add_false_accusations(row, honest)
        log(
            f"{name}: ok {row['requests_ok']} failed {row['requests_failed']} wrong "
            f"{row['wrong_outputs_delivered']} ttft p50 {row['ttft_p50_s']:.3f} s "
            f"p99 {row['ttft_p99_s']:.3f} s errors {row['errors']}"
        )
        return row


async def _drive(
    args: argparse.Namespace,
    honest: list[PeerProcess],
    workload: list[TokenRequest],
    sampling: dict[str, float] | None,
) -> list[Outcome]:
    outcomes: list[Outcome] = []
    limiter = trio.CapacityLimiter(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with (
        httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client,
        trio.open_nursery() as nursery,
    ):
        for index, request in enumerate(workload):
            await limiter.acquire_on_behalf_of(index)
            entry = honest[index % len(honest)]
            body = request_body(request, index, sampling, args.model_name)

            async def one(entry: PeerProcess = entry, body: dict[str, Any] = body,
                          index: int = index) -> None:
                try:
                    outcomes.append(await _send(client, entry, body, index))
                finally:
                    limiter.release_on_behalf_of(index)

            nursery.start_soon(one)
    return outcomes


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    workload, _ = swarm_workload(args)
    workload = workload[: args.requests]
    result: dict[str, Any] = {"params": _params(args, workload), "adversaries": {}}
    refs: dict[str, list[str]] = {}
    for name in args.scenarios:
        sampling = SAMPLING.get(name)
        key = json.dumps(sampling, sort_keys=True)
        if key not in refs:
            log(f"computing reference outputs ({sampling or 'greedy'})")
            refs[key] = await references(args, workload, sampling)
        row = await run_scenario(args, name, workload, refs[key])
        if name == "baseline":
            result["baseline"] = row
        else:
            result["adversaries"][name] = row
    if args.quarantine_trials:
        from bench.quarantine import quarantine_trials_sync

        # its own trio.run (a virtual clock), so in a thread of its own
        result["quarantine_trials"] = await trio.to_thread.run_sync(
            quarantine_trials_sync, args.quarantine_trials
        )
    return result


def _params(args: argparse.Namespace, workload: Sequence[TokenRequest]) -> dict[str, Any]:
    return {
        "honest_peers": HONEST_PEERS, "model": args.model, "dtype": args.dtype,
        "requests": len(workload),
        "concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens,
        "peer_args": args.peer_args, "sybil_identities": SYBIL_IDENTITIES,
        "forged_identities": FORGED_IDENTITIES,
        "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in workload),
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.adversary",
                                description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="every peer's weight format, the rogue's and the reference's")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--cache-bytes", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-args", default="", help="extra `serve` options for honest peers")
    p.add_argument("--quarantine-trials", type=int, default=0,
                   help="also run this many in-process quarantine trials (bench.quarantine)")
    p.add_argument("--peer-log", default=os.devnull, help="peers' stderr goes here")
    p.add_argument("--peer-log-level", default="ERROR")
    p.add_argument("--outcomes", help="append every request's outcome here (JSON lines)")
    args = p.parse_args(argv)
    args.scenarios = [x for x in args.scenarios.split(",") if x]
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios: {sorted(unknown)}")
    if args.requests < 1 or args.concurrency < 1:
        p.error("--requests and --concurrency must be positive")
    # swarm_workload's options: few subjects so prefixes repeat, arrivals unused
    args.rate, args.zipf, args.subjects, args.max_context = 1.0, 1.0, 8, 2048
    args.model_name = args.model
    return args


def main(argv: list[str] | None = None) -> None:
    run_main(main_async, parse_args(argv))


if __name__ == "__main__":
    main()
