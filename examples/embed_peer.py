"""A Trio program that embeds a prefixswarm peer as a library (asyncio: embed_asyncio.py).

    python examples/embed_peer.py [--model tiny-random] [--bootstrap MULTIADDR]
        [--http 127.0.0.1:0]

Starts a peer (alone, or joining a swarm with --bootstrap), asks it two questions that
share a prefix (the second reuses the first one's cached blocks), streams a third, and
optionally serves the OpenAI-compatible HTTP API while it runs. Leaving the `async with`
block stops every service of the peer. prefixswarm.PeerConfig's defaults suit a library:
loopback on a free port, an ephemeral identity (a volunteer's peer keeps a key file).
"""

from __future__ import annotations

import argparse
import contextlib

import trio

from prefixswarm import GenerationChunk, PeerConfig, SamplingParams, open_peer, serve_http

SHARED = "You are a terse assistant. Answer in one short sentence.\n" * 4


async def main(model: str, bootstrap: list[str], http: str | None) -> None:
    config = PeerConfig(model=model, bootstrap=tuple(bootstrap))
    async with open_peer(config) as peer:
        print(f"peer {peer.peer_id} up at {peer.multiaddrs[0]}")
        if http:
            host, _, port = http.rpartition(":")
            url = await peer.start_service(serve_http, peer, host, int(port))
            print(f"HTTP API on {url}/v1")
        params = SamplingParams(max_new_tokens=12)  # greedy: temperature 0
        for question in ("What is the capital of France?", "What is the capital of Italy?"):
            result = await peer.generate(SHARED + question, params)
            print(
                f"{question!r} -> {result.text!r}\n"
                f"  served by {result.served_by[:16]}..., cached {result.cached_tokens}/"
                f"{result.prompt_tokens} prompt tokens, first token after {result.ttft_s:.3f} s"
            )
        print("streamed: ", end="", flush=True)
        chat = [{"role": "user", "content": "Name a colour."}]
        async with contextlib.aclosing(peer.stream(chat, params)) as items:
            async for item in items:
                if isinstance(item, GenerationChunk):
                    print(item.text, end="", flush=True)
        print()
        stats = peer.statistics()
        print(f"peers known: {stats['peers_known']}, engine: {stats['engine']['prompt_tokens']} "
              f"prompt tokens, {stats['engine']['cached_tokens']} from the cache")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--bootstrap", nargs="*", default=[])
    parser.add_argument("--http", default=None, help="also serve the HTTP API (HOST:PORT)")
    args = parser.parse_args()
    trio.run(main, args.model, args.bootstrap, args.http)
