"""How long one routing decision takes: `python -m bench.router --json PATH`.

A table of 64 peers, each with a real CacheSummary whose Bloom filter is sized for 20k
blocks at 1% false positives and holds 10k unrelated blocks (a half-full cache) plus, for
about a quarter of the test prompts, the prompt's first d blocks (d uniform in 1..64).
Each decision ranks one 64-block (1024-token) prompt among those peers and the local peer.

Two measurements on one table, both reported:
- cold: each prompt is ranked once, so none of its block hashes is in the probe cache, as
  for a prompt that shares nothing with recent ones (the headline, `rank_median_us`);
- warm: a few prompts ranked again and again (shared system prompts, chat turns).
Wall-clock medians are the targets; CPU-time medians (thread time) and the load average
are reported beside them because a busy machine inflates wall time. `table_part_*` is the
CPU time of the PeerTable calls alone (views, Bloom matches) on the same prompt, right after
its rank() call, so with its probes already mixed: the rest of rank() is the router's own.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from peer.config import Policy
from peer.peer_table import PeerTable
from peer.router import LocalState, Router
from protocols.bloom import BloomFilter, ProbeCache
from protocols.summary import CacheSummary

MODEL_ID = "bench-model"
BLOCK_SIZE = 16
CAPACITY_BLOCKS = 20_000  # ~320k tokens: 1 GiB of fp32 SmolLM2 KV holds ~23k tokens; generous
FP_RATE = 0.01  # PeerConfig's default
FILLER_BLOCKS = 10_000  # half the capacity cached
HOLD_FRACTION = 0.25  # share of (peer, prompt) pairs where the peer caches a prefix
TARGET_US = 200.0  # the budget for one decision


def _peer_id(i: int) -> str:
    return f"12D3KooWbenchPeer{i:04d}"


def build_table(
    peers: int, prompts: list[list[int]], rng: random.Random, probe_cache: ProbeCache
) -> tuple[PeerTable, list[int]]:
    """A table of `peers` live peers; returns it and how deep each peer holds prompt 0."""
    table = PeerTable("12D3KooWbenchLocal", MODEL_ID, BLOCK_SIZE, 60.0, probe_cache)
    depths0 = []
    for i in range(peers):
        bloom = BloomFilter.for_capacity(CAPACITY_BLOCKS, FP_RATE)
        keys = {rng.getrandbits(64) for _ in range(FILLER_BLOCKS)}
        for j, chain in enumerate(prompts):
            depth = rng.randint(1, len(chain)) if rng.random() < HOLD_FRACTION else 0
            keys.update(chain[:depth])
            if j == 0:
                depths0.append(depth)
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
    return table, depths0


LOCAL = LocalState("12D3KooWbenchLocal", 256, 500, 1, 800.0, 20.0)


def measure(
    router: Router, table: PeerTable, prompts: list[list[int]], iterations: int
) -> tuple[list[float], list[float], list[float]]:
    """Per rank() call, cycling through the prompts: wall us, CPU us, and the CPU us of the
    table's part alone (views, Bloom matches) measured on the same prompt just after."""
    wall, cpu, table_cpu = [], [], []
    for n in range(iterations):
        chain = prompts[n % len(prompts)]
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        router.rank(chain, len(chain) * BLOCK_SIZE, 64, LOCAL, table, 1.0)
        end_cpu, end = time.thread_time_ns(), time.perf_counter_ns()
        wall.append((end - start) / 1000.0)
        cpu.append((end_cpu - start_cpu) / 1000.0)
        start_cpu = time.thread_time_ns()
        table.views(1.0)
        table.estimate_matches(table.probes(chain), 1.0)
        table_cpu.append((time.thread_time_ns() - start_cpu) / 1000.0)
    return wall, cpu, table_cpu


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "median_us": round(statistics.median(ordered), 1),
        "p10_us": round(ordered[int(0.10 * (len(ordered) - 1))], 1),
        "p99_us": round(ordered[int(0.99 * (len(ordered) - 1))], 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--peers", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=64, help="prompt length in blocks")
    parser.add_argument("--prompts", type=int, default=32, help="distinct warm prompts")
    parser.add_argument("--iterations", type=int, default=2000, help="warm decisions")
    parser.add_argument("--cold", type=int, default=500, help="cold decisions (new prompts)")
    parser.add_argument("--policy", type=Policy, default=Policy.COST,
                        choices=list(Policy), metavar="{" + ",".join(p.value for p in Policy) + "}")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    total = args.prompts + args.cold
    pool = [[rng.getrandbits(64) for _ in range(args.blocks)] for _ in range(total)]
    warm_prompts, cold_prompts = pool[: args.prompts], pool[args.prompts :]
    results: dict[str, object] = {
        "policy": args.policy.value,
        "peers": args.peers,
        "blocks": args.blocks,
        "block_size": BLOCK_SIZE,
        "prompts": args.prompts,
        "iterations": args.iterations,
        "cold_iterations": args.cold,
        "capacity_blocks": CAPACITY_BLOCKS,
        "fp_rate": FP_RATE,
        "filler_blocks": FILLER_BLOCKS,
        "hold_fraction": HOLD_FRACTION,
        "python": platform.python_version(),
        "target_us": TARGET_US,
    }
    table, depths0 = build_table(args.peers, pool, random.Random(args.seed), ProbeCache())
    results["holders_of_prompt0"] = sum(d > 0 for d in depths0)
    router = Router(args.policy, random.Random(0), block_size=BLOCK_SIZE)
    measure(router, table, warm_prompts, args.prompts)  # warm up interpreter and cache
    for label, prompts, iterations in (
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
    ranked = router.rank(pool[0], args.blocks * BLOCK_SIZE, 64, LOCAL, table, 1.0)
    results["example_best"] = ranked[0].reason
    results["rank_median_us"] = results["rank_cold_median_us"]
    results["rank_p99_us"] = results["rank_cold_p99_us"]
    results["load_average_1m"] = round(os.getloadavg()[0], 2)  # this bench shares the CPU
    text = json.dumps(results, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
