"""Run one peer in this process and report it as JSON lines on stdout (tests, benchmarks).

    python -m peer.node_runner --listen /ip4/127.0.0.1/tcp/0 [--bootstrap ADDR]
        [--identity PATH] [--interval 0.5] [--insert-tokens N] [--probe-tokens N]

Lines: {"event": "up", "peer_id", "multiaddrs"}; every --report-interval a
{"event": "table", "peers": {peer_id: {"seq", "age_s", "match_blocks"}}, "stats"};
with --log-gossip one line per summary published and accepted (wall-clock times, for
propagation delays). SIGTERM, SIGINT or stdin closing end the peer cleanly.

By default the peer runs a cache-only engine (a radix cache without a model: membership
and gossip need nothing else); --model loads a real one. --fill-blocks and
--churn-tokens-per-s give the cache-only engine realistic content for benchmarks;
with a real model, --serve-rps sends this peer a steady stream of short random prompts
(Peer.generate: routed, forwarded or served here), so gossip is measured on a busy peer.

`runner_command()` is its command line for peer.processes, which starts and follows it.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import resource
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from peer.config import DEFAULT_GOSSIP_NEIGHBOURS, GossipMode, PeerConfig
from peer.engine.cache_only import CACHE_ONLY_MODEL_ID, CacheOnlyEngine
from peer.net.host import WireBytes, count_wire_bytes
from peer.node import Peer, open_peer
from protocols.summary import CacheSummary


def probe_tokens(n: int) -> list[int]:
    """The deterministic prefix --insert-tokens caches and --probe-tokens looks for."""
    return [(7919 * i + 13) % 49152 for i in range(n)]


def table_report(peer: Peer, probe: list[int]) -> dict[str, Any]:
    """{peer_id: {"seq", "age_s", "match_blocks"}} for every peer in the table."""
    now = trio.current_time()
    chain = peer.engine.hasher.chain(probe) if probe else []
    out: dict[str, Any] = {}
    for view in peer.table.views(now):
        out[view.peer_id] = {
            "seq": view.summary.seq,
            "age_s": round(view.age_s, 3),
            "match_blocks": peer.table.estimate_match(view.peer_id, chain),
        }
    return out


_wire: WireBytes | None = None  # set by --count-wire-bytes


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def process_report() -> dict[str, float]:
    """CPU seconds of this process so far, and libp2p TCP bytes if counted."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report = {"cpu_s": usage.ru_utime + usage.ru_stime}
    if _wire is not None:
        report["wire_sent"] = float(_wire.sent)
        report["wire_received"] = float(_wire.received)
    return report


async def _churn(engine: CacheOnlyEngine, tokens_per_s: float, rng: random.Random) -> None:
    """Insert random 64-token sequences at `tokens_per_s` (LRU eviction makes room)."""
    while True:
        await trio.sleep(64 / tokens_per_s)
        engine.insert([rng.randrange(49152) for _ in range(64)])


SERVE_PROMPT_TOKENS = 64  # a short prompt: 4 blocks, a few ms of tiny-random prefill
SERVE_NEW_TOKENS = 8
SERVE_MAX_IN_FLIGHT = 4  # the steady load never piles up behind a slow peer


async def _serve_load(peer: Peer, rps: float, rng: random.Random) -> None:
    """Generate short random prompts at `rps` (at most SERVE_MAX_IN_FLIGHT at once);
    counts outcomes in `_served`."""
    from peer.engine.api import SamplingParams
    from peer.request.admission import Overloaded
    from peer.request.pipeline import RequestFailed

    limiter = trio.CapacityLimiter(SERVE_MAX_IN_FLIGHT)
    params = SamplingParams(max_new_tokens=SERVE_NEW_TOKENS)

    async def one(prompt: list[int]) -> None:
        async with limiter:
            try:
                await peer.generate(prompt, params)
                _served["ok"] += 1
            except (RequestFailed, Overloaded):
                _served["failed"] += 1

    async with trio.open_nursery() as nursery:
        while True:
            await trio.sleep(rng.expovariate(rps))
            if limiter.borrowed_tokens >= SERVE_MAX_IN_FLIGHT:
                _served["skipped"] += 1
                continue
            nursery.start_soon(one, [rng.randrange(1, 1000) for _ in range(SERVE_PROMPT_TOKENS)])


_served = {"ok": 0, "failed": 0, "skipped": 0}


async def _until_stdin_closes() -> None:
    while await trio.to_thread.run_sync(  # type: ignore[call-arg]
        sys.stdin.readline, abandon_on_cancel=True
    ):
        pass


async def _until_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            return


async def run(args: argparse.Namespace) -> None:
    config = PeerConfig(
        model=CACHE_ONLY_MODEL_ID if args.model is None else args.model,
        listen_addrs=tuple(args.listen),
        bootstrap=tuple(args.bootstrap),
        identity_file=Path(args.identity) if args.identity else None,
        summary_interval_s=args.interval,
        gossip_mode=GossipMode(args.gossip_mode),
        gossip_neighbours=args.neighbours,
    )
    engine = CacheOnlyEngine() if args.model is None else None
    rng = random.Random(args.seed)
    if engine is not None and args.insert_tokens:
        engine.insert(probe_tokens(args.insert_tokens))
    if engine is not None:
        for _ in range(args.fill_blocks // 4):
            engine.insert([rng.randrange(49152) for _ in range(64)])
    probe = probe_tokens(args.probe_tokens)

    def published(summary: CacheSummary, wall: float) -> None:
        _emit({"event": "published", "seq": summary.seq, "t": wall})

    def accepted(summary: CacheSummary, wall: float) -> None:
        _emit({"event": "accepted", "sender": summary.peer_id, "seq": summary.seq, "t": wall})

    async with open_peer(config, engine=engine) as peer:
        if args.log_gossip:
            peer.gossip.set_hooks(on_published=published, on_accepted=accepted)
        if args.no_publish:
            peer.gossip.set_publishing(False)
        _emit({"event": "up", "peer_id": peer.peer_id, "multiaddrs": peer.multiaddrs})
        async with trio.open_nursery() as nursery:

            async def stop_when(waiter: Any) -> None:
                await waiter()
                nursery.cancel_scope.cancel()

            nursery.start_soon(stop_when, _until_signal)
            if not args.ignore_stdin:
                nursery.start_soon(stop_when, _until_stdin_closes)
            if args.duration:
                nursery.start_soon(stop_when, lambda: trio.sleep(args.duration))
            if engine is not None and args.churn_tokens_per_s > 0:
                nursery.start_soon(_churn, engine, args.churn_tokens_per_s, rng)
            if args.serve_rps > 0:
                nursery.start_soon(_serve_load, peer, args.serve_rps, rng)
            while True:
                _emit(
                    {
                        "event": "table",
                        "t": time.time(),
                        "peers": table_report(peer, probe),
                        "stats": {**peer.statistics(), "served_load": dict(_served)},
                        "process": process_report(),
                    }
                )
                await trio.sleep(args.report_interval)
    _emit({"event": "down", "t": time.time()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m peer.node_runner", description=__doc__)
    parser.add_argument("--listen", action="append", default=None)
    parser.add_argument("--bootstrap", action="append", default=[])
    parser.add_argument("--identity", default=None, help="key file (default: ephemeral)")
    parser.add_argument("--interval", type=float, default=2.0, help="summary interval, s")
    parser.add_argument("--gossip-mode", choices=[m.value for m in GossipMode], default="full")
    parser.add_argument("--neighbours", type=int, default=DEFAULT_GOSSIP_NEIGHBOURS,
                        help="ring gossip mode: neighbours heard")
    parser.add_argument("--model", default=None, help="load a real model (default: none)")
    parser.add_argument("--insert-tokens", type=int, default=0)
    parser.add_argument("--probe-tokens", type=int, default=0)
    parser.add_argument("--report-interval", type=float, default=0.25)
    parser.add_argument("--duration", type=float, default=0.0, help="stop after, s (0: never)")
    parser.add_argument("--log-gossip", action="store_true")
    parser.add_argument("--no-publish", action="store_true", help="baseline: never publish")
    parser.add_argument("--fill-blocks", type=int, default=0, help="random blocks at start")
    parser.add_argument("--churn-tokens-per-s", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--serve-rps", type=float, default=0.0,
                        help="with --model: steady requests per second to this peer")
    parser.add_argument("--count-wire-bytes", action="store_true", help="libp2p TCP bytes")
    parser.add_argument("--ignore-stdin", action="store_true")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    args.listen = args.listen or ["/ip4/127.0.0.1/tcp/0"]
    logging.basicConfig(level=args.log_level, stream=sys.stderr)
    if args.count_wire_bytes:
        global _wire
        _wire = count_wire_bytes()
    trio.run(run, args)


def runner_command(args: Sequence[str]) -> list[str]:
    """The command line of a runner child (start it with peer.processes)."""
    return [sys.executable, "-m", "peer.node_runner", *args]


if __name__ == "__main__":
    main()
