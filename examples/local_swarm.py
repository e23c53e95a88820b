"""Spawn a local swarm from code and send it requests.

    python examples/local_swarm.py [--peers 3] [--model tiny-random]

Starts N peer processes on loopback (`peer.local_swarm.open_local_swarm`), then sends
requests that share a long prefix, entering at a different peer each time, and prints
which peer served each one and how many prompt tokens came from a cache. Leaving the
`async with` block stops every process.
"""

from __future__ import annotations

import argparse
import sys

import httpx
import trio

from peer.local_swarm import LocalSwarmOptions, open_local_swarm

SHARED = "Here is a long shared context that many requests start with. " * 12


async def main(peers: int, model: str) -> None:
    options = LocalSwarmOptions(peers=peers, model=model)

    def progress(message: str) -> None:
        print(f"  {message}", file=sys.stderr)

    async with (
        open_local_swarm(options, say=progress) as swarm,
        httpx.AsyncClient(timeout=300) as client,
    ):
        names = {p.peer_id: f"peer {p.index}" for p in swarm}
        for i in range(2 * len(swarm)):
            entry = swarm[i % len(swarm)]
            response = await client.post(
                f"{entry.http}/v1/completions",
                json={"model": model, "prompt": f"{SHARED}Question {i}:", "max_tokens": 8,
                      "temperature": 0},
            )
            body = response.json()
            served = body["x_prefixswarm"]["served_by"]
            usage = body["usage"]
            print(f"request {i}: entered {names[entry.peer_id]}, served by {names[served]}, "
                  f"cached {usage['prompt_tokens_details']['cached_tokens']}/"
                  f"{usage['prompt_tokens']} prompt tokens")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    trio.run(main, args.peers, args.model)
