"""How long one routing decision takes: `python -m bench.router --json PATH`.

`Router.rank()`, the full call the request pipeline makes, ranks a 64-block prompt among
64 peers whose summaries carry the Bloom filters peer/swarm/gossip.py would publish
(`summary_bloom`: 10k unrelated blocks each, plus prefixes of the prompts). Three kinds
of prompt (new, the headline; warm; cold, defined where `main` builds them) and a table
of four filter shapes; wall-clock medians are the targets, CPU-time medians and the load
average beside them, and `table_part_*` is `PeerTable.routing_rows` alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

from bench.stats import percentile
from peer.config import Policy
from peer.routing.router import LocalState, Router
from peer.routing.trust import TrustLedger
from peer.swarm.bloom_sizing import summary_bloom
from peer.swarm.peer_table import PeerTable
from protocols.summary import CacheSummary

MODEL_ID = "bench-model"
BLOCK_SIZE = 16
CAPACITY_BLOCKS = 20_000  # ~320k tokens: 1 GiB of fp32 SmolLM2 KV holds ~23k tokens; generous
FP_RATE = 0.01  # PeerConfig's default
FILLER_BLOCKS = 10_000  # half the capacity cached
MIXED_FILLER_BLOCKS = (2_500, 5_000, 10_000, 20_000, 40_000)  # filters of 4 shapes
HOLD_FRACTION = 0.25  # share of (peer, prompt) pairs where the peer caches a prefix
PREFIX_BLOCKS = 48  # a new prompt's shared part; the rest of its 64 blocks is new
TARGET_US = 200.0  # the budget for one decision: far below a network round trip


def _peer_id(i: int) -> str:
    return f"12D3KooWbenchPeer{i:04d}"


def build_table(
    peers: int, held: list[list[int]], rng: random.Random, filler: tuple[int, ...]
) -> PeerTable:
    """A table of `peers` live peers, each caching `filler` unrelated blocks (one of) and a
    random-depth prefix of about HOLD_FRACTION of the `held` chains."""
    table = PeerTable("12D3KooWbenchLocal", MODEL_ID, BLOCK_SIZE, 60.0)
    for i in range(peers):
        keys = {rng.getrandbits(64) for _ in range(rng.choice(filler))}
        for chain in held:
            if rng.random() < HOLD_FRACTION:
                keys.update(chain[: rng.randint(1, len(chain))])
        bloom = summary_bloom(len(keys), FP_RATE)
        bloom.update(keys)
        summary = CacheSummary(
            peer_id=_peer_id(i),
            model_id=MODEL_ID,
            block_size=BLOCK_SIZE,
            seq=1,
            bloom_bits=bloom.num_bits,
            bloom_hashes=bloom.num_hashes,
            bloom=bloom.to_bytes(),
            cached_blocks=len(keys),
            capacity_blocks=CAPACITY_BLOCKS,
            queued_prompt_tokens=rng.randint(0, 2000),
            running_requests=rng.randint(0, 3),
            prefill_tokens_per_s=rng.uniform(300.0, 1500.0),
            decode_tokens_per_s=rng.uniform(10.0, 40.0),
        )
        result = table.apply(summary, summary.peer_id, 0.0)
        if not result.accepted:
            raise RuntimeError(f"bench summary rejected: {result.reason} {result.detail}")
        table.record_rtt(summary.peer_id, rng.uniform(0.001, 0.05), 0.0)
        if i % 4 == 0:
            table.record_forward(summary.peer_id, 1024, 0.0)
    return table


LOCAL = LocalState("12D3KooWbenchLocal", 256, 500, 1, 800.0, 20.0)


def _trusting(table: PeerTable) -> TrustLedger:
    """A ledger that passed every peer of ``table`` through probation and observed it."""
    ledger = TrustLedger()
    for view in table.views(0.0):
        for _ in range(ledger.probation_requests):
            ledger.record_served(view.peer_id, verified=True)
        ledger.record_speeds(view.peer_id, 2000.0, 40.0)
        ledger.record_claim(view.peer_id, 64, 64)
    return ledger


def measure(
    router: Router, table: PeerTable, prompts: list[list[int]], iterations: int
) -> tuple[list[float], list[float], list[float]]:
    """Per rank() call, cycling through the prompts: wall us, CPU us, and the CPU us of the
    table's part alone (`routing_rows`) measured on the same prompt just after."""
    wall, cpu, table_cpu = [], [], []
    for n in range(iterations):
        chain = prompts[n % len(prompts)]
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        router.rank(chain, len(chain) * BLOCK_SIZE, 64, LOCAL, table, 1.0)
        end_cpu, end = time.thread_time_ns(), time.perf_counter_ns()
        wall.append((end - start) / 1000.0)
        cpu.append((end_cpu - start_cpu) / 1000.0)
        start_cpu = time.thread_time_ns()
        table.routing_rows(chain, 1.0)
        table_cpu.append((time.thread_time_ns() - start_cpu) / 1000.0)
    return wall, cpu, table_cpu


def _summary(times: list[float]) -> dict[str, float]:
    return {
        "median_us": round(percentile(times, 0.5), 1),
        "p10_us": round(percentile(times, 0.10), 1),
        "p99_us": round(percentile(times, 0.99), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--peers", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=64, help="prompt length in blocks")
    parser.add_argument("--prompts", type=int, default=32, help="distinct shared prefixes")
    parser.add_argument("--iterations", type=int, default=2000, help="decisions per kind")
    parser.add_argument("--cold", type=int, default=500, help="cold decisions (unseen chains)")
    parser.add_argument("--policy", type=Policy, default=Policy.COST,
                        choices=list(Policy), metavar="{" + ",".join(p.value for p in Policy) + "}")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--trust", action="store_true",
                        help="route under a trust ledger (every peer trusted, speeds observed)")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    prefix_blocks = min(PREFIX_BLOCKS, args.blocks)

    def chain(n: int) -> list[int]:
        return [rng.getrandbits(64) for _ in range(n)]

    # new (the headline, `rank_median_us`): what a request usually is, one of the shared
    #   prefixes (system prompts, few-shot headers, conversations; each held by about a
    #   quarter of the peers to a depth in 1..48) then 16 blocks nobody has seen;
    # warm: a shared prefix extended by a fixed suffix, asked again and again (retries,
    #   identical prompts); peers hold it to a depth in 1..64;
    # cold: 64 blocks this router never saw that peers hold to a depth in 1..64 (cached
    #   elsewhere by other clients): the most matching work per decision.
    prefixes = [chain(prefix_blocks) for _ in range(args.prompts)]
    warm_prompts = [p + chain(args.blocks - prefix_blocks) for p in prefixes]
    new_prompts = [
        rng.choice(prefixes) + chain(args.blocks - prefix_blocks) for _ in range(args.iterations)
    ]
    cold_prompts = [chain(args.blocks) for _ in range(args.cold)]
    results: dict[str, object] = {
        "policy": args.policy.value,
        "peers": args.peers,
        "blocks": args.blocks,
        "prefix_blocks": prefix_blocks,
        "block_size": BLOCK_SIZE,
        "prompts": args.prompts,
        "iterations": args.iterations,
        "cold_iterations": args.cold,
        "fp_rate": FP_RATE,
        "filler_blocks": FILLER_BLOCKS,
        "hold_fraction": HOLD_FRACTION,
        "python": platform.python_version(),
        "target_us": TARGET_US,
        "headline": "rank_median_us = rank_new_median_us: a shared 48-block prefix that some "
        "peers cache, then 16 new blocks; every decision's chain is new",
    }
    # Peers hold prefixes of the warm prompts (which extend the shared prefixes) and of the
    # cold ones; a new prompt's suffix is held by nobody.
    held = warm_prompts + cold_prompts
    table = build_table(args.peers, held, random.Random(args.seed), (FILLER_BLOCKS,))
    router = Router(args.policy, random.Random(0), block_size=BLOCK_SIZE,
                    trust=_trusting(table) if args.trust else None, require_rtt=args.trust)
    results["trust"] = args.trust
    measure(router, table, warm_prompts, args.prompts)  # warm up the interpreter
    for label, prompts, iterations in (
        ("new", new_prompts, args.iterations),
        ("cold", cold_prompts, args.cold),
        ("warm", warm_prompts, args.iterations),
    ):
        wall, cpu, table_cpu = measure(router, table, prompts, iterations)
        stats = _summary(wall)
        results[f"rank_{label}_median_us"] = stats["median_us"]
        results[f"rank_{label}_p99_us"] = stats["p99_us"]
        results[f"rank_{label}_p10_us"] = stats["p10_us"]  # near the uncontended cost
        results[f"rank_{label}_cpu_median_us"] = _summary(cpu)["median_us"]
        results[f"table_part_{label}_cpu_median_us"] = _summary(table_cpu)["median_us"]
    ranked = router.rank(warm_prompts[0], args.blocks * BLOCK_SIZE, 64, LOCAL, table, 1.0)
    results["example_best"] = ranked[0].reason
    # Peers caching 2.5k..40k blocks: four filter shapes, four bit-sliced banks, not one.
    mixed = build_table(args.peers, warm_prompts, random.Random(args.seed), MIXED_FILLER_BLOCKS)
    results["mixed_shapes"] = len({(v.summary.bloom_bits, v.summary.bloom_hashes)
                                   for v in mixed.views(1.0)})
    wall, _, _ = measure(router, mixed, new_prompts, args.cold)
    results["rank_new_mixed_shapes_median_us"] = _summary(wall)["median_us"]
    results["rank_median_us"] = results["rank_new_median_us"]
    results["rank_p99_us"] = results["rank_new_p99_us"]
    results["load_average_1m"] = round(os.getloadavg()[0], 2)  # this bench shares the CPU
    text = json.dumps(results, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
