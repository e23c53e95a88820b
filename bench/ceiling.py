"""What hit ratio routing can reach on bench.swarm's workload, replayed with exact knowledge.

The real swarm's hit ratios depend on the workload as much as on the router: how many
subjects are in play, how many requests, and how many prefixes one peer's cache holds.
This replays bench.swarm's exact request sequence (same options, same seed, same entry
peers, same context filter) one request at a time through N real `RadixCache`s sized like
the peers' caches (cache bytes over the model's KV bytes per block, LRU eviction), under
two routers that know every cache exactly and instantly:

- `random`: each request to a uniformly chosen peer, as bench.swarm's `random` policy
  (its choices are not seeded in the peers, so the replay draws it `--draws` times);
- `exact_longest_prefix`: the peer holding the longest cached prefix, a tie to the entry
  peer. Deterministic, since the entry peers are.

No queueing, no staleness, no concurrency: a reference for the real swarm's numbers, not a
model of its timing. It answers "can any prefix router reach twice random's hit ratio on
this workload, and how often would random's luck deny it?": `ratio_p5` and
`draws_below_2x` are over the random draws, each against the one longest-prefix result.

    python -m bench.ceiling --json PATH [the workload options of bench.swarm]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from bench.stats import percentile
from bench.swarm import add_workload_arguments, swarm_workload
from bench.workloads import TokenRequest
from peer.engine.embedded import TINY_CONFIG, TINY_RANDOM
from peer.engine.radix import RadixCache
from protocols.blocks import BlockHasher

BLOCK_SIZE = 16  # peer.config.DEFAULT_BLOCK_SIZE, what bench.swarm's peers run with
FP32_BYTES = 4
# KV bytes per token (K and V, every layer, fp32) of the aliases bench.swarm runs.
KV_BYTES_PER_TOKEN = {
    TINY_RANDOM: TINY_CONFIG["num_hidden_layers"] * 2 * TINY_CONFIG["num_key_value_heads"]
    * (TINY_CONFIG["hidden_size"] // TINY_CONFIG["num_attention_heads"]) * FP32_BYTES,
    "smollm2-135m": 30 * 2 * 3 * 64 * FP32_BYTES,  # 30 layers, 3 KV heads of 64
}
DEFAULT_DRAWS = 200
MAX_DRAWS = 10_000
TARGET_RATIO = 2.0  # the target: prefix routing at >= 2x random's hit ratio


def replay_hit_ratio(
    workload: Sequence[TokenRequest],
    entries: Sequence[int],
    peers: int,
    capacity_blocks: int,
    route: str,
    rng: random.Random | None = None,
) -> float:
    """Cached over prompt tokens when `workload` runs in order on `peers` LRU radix caches.

    `entries[i]` is request i's entry peer; `route` is "random" (needs `rng`) or
    "exact_longest_prefix". A request's prompt is matched, then cached whole.
    """
    if len(entries) != len(workload):
        raise ValueError(f"{len(entries)} entries for {len(workload)} requests")
    if route == "random" and rng is None:
        raise ValueError("the random route needs an rng")
    hasher = BlockHasher("replay", BLOCK_SIZE)
    caches = [RadixCache[None](BLOCK_SIZE, capacity_blocks, hasher) for _ in range(peers)]
    cached = prompt = 0
    for step, (request, entry) in enumerate(zip(workload, entries, strict=True)):
        tokens = request.prefix + request.suffix
        max_blocks = (len(tokens) - 1) // BLOCK_SIZE  # the engine computes the last token
        if route == "random":
            assert rng is not None
            target = rng.randrange(peers)
        elif route == "exact_longest_prefix":
            matches = [c.match(tokens, float(step), max_blocks).num_tokens for c in caches]
            best = max(matches)
            target = entry if matches[entry] == best else matches.index(best)
        else:
            raise ValueError(f"unknown route {route!r}")
        cached += caches[target].match(tokens, float(step), max_blocks).num_tokens
        prompt += len(tokens)
        caches[target].insert(tokens, lambda _: None, float(step))
    return cached / max(1, prompt)


def ceiling(args: argparse.Namespace) -> dict[str, Any]:
    """Both routers on bench.swarm's workload for `args`; the JSON this command prints."""
    workload, left_out = swarm_workload(args)
    entry_rng = random.Random(f"{args.seed}/entries")  # bench.swarm's entry peers
    entries = [entry_rng.randrange(args.peers) for _ in workload]
    block_bytes = KV_BYTES_PER_TOKEN[args.model] * BLOCK_SIZE
    capacity = args.cache_bytes // block_bytes
    prefix_blocks = {r.prefix_key: len(r.prefix) // BLOCK_SIZE for r in workload}
    longest = replay_hit_ratio(workload, entries, args.peers, capacity, "exact_longest_prefix")
    randoms = [
        replay_hit_ratio(workload, entries, args.peers, capacity, "random",
                         random.Random(f"{args.seed}/random/{draw}"))
        for draw in range(args.draws)
    ]
    ratios = [longest / r for r in randoms]
    return {
        "params": {
            "peers": args.peers, "model": args.model, "requests": args.requests,
            "zipf_s": args.zipf, "subjects": args.subjects, "seed": args.seed,
            "cache_bytes": args.cache_bytes, "block_bytes": block_bytes,
            "cache_blocks_per_peer": capacity, "requests_replayed": len(workload),
            "left_out_over_context": left_out, "draws": args.draws,
            "prefixes_in_play": len(prefix_blocks),
            "prefix_blocks_in_play": sum(prefix_blocks.values()),
        },
        "exact_longest_prefix_hit_ratio": longest,
        "random_hit_ratio": {
            "mean": statistics.fmean(randoms), "p5": percentile(randoms, 0.05),
            "p50": percentile(randoms, 0.5), "p95": percentile(randoms, 0.95),
        },
        "ratio_of_means": longest / statistics.fmean(randoms),
        "ratio_p5": percentile(ratios, 0.05),
        "draws_below_2x": sum(r < TARGET_RATIO for r in ratios) / len(ratios),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--peers", type=int, default=4)
    p.add_argument("--model", default=TINY_RANDOM, choices=sorted(KV_BYTES_PER_TOKEN))
    p.add_argument("--draws", type=int, default=DEFAULT_DRAWS, help="random routes replayed")
    add_workload_arguments(p)
    args = p.parse_args(argv)
    if args.peers < 1 or args.requests < 1 or not 1 <= args.draws <= MAX_DRAWS:
        p.error(f"--peers and --requests must be positive, --draws in [1, {MAX_DRAWS}]")
    print(f"bench.ceiling: replaying {args.draws + 1} routes", file=sys.stderr, flush=True)
    text = json.dumps(ceiling(args), indent=2)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
