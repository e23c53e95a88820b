"""An asyncio program that embeds a prefixswarm peer (the peer runs in a Trio thread).

    python examples/embed_asyncio.py [--model tiny-random] [--bootstrap MULTIADDR]

prefixswarm.PeerThread starts the peer under Trio in a thread of its own; its `a*`
methods are awaitable from asyncio and the event loop keeps running meanwhile (a
heartbeat task here shows it). Cancelling the awaiting task (here by a timeout) cancels
the request inside the peer. Leaving `async with` stops the peer and joins its thread.
"""

from __future__ import annotations

import argparse
import asyncio

from prefixswarm import GenerationChunk, PeerConfig, PeerThread, SamplingParams, serve_http

QUESTION = "You are a terse assistant. Answer in one short sentence.\nWhat is a swarm?"


async def heartbeat(beats: list[float]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        beats.append(loop.time())
        await asyncio.sleep(0.01)


async def main(model: str, bootstrap: list[str]) -> None:
    config = PeerConfig(model=model, bootstrap=tuple(bootstrap))
    async with PeerThread(config) as peer:
        print(f"peer {peer.peer_id} up at {peer.multiaddrs[0]}")
        beats: list[float] = []
        beating = asyncio.create_task(heartbeat(beats))
        result = await peer.agenerate(QUESTION, SamplingParams(max_new_tokens=12))
        beating.cancel()
        print(f"{result.text!r} ({result.completion_tokens} tokens, served by "
              f"{result.served_by[:16]}...); the asyncio loop ran {len(beats)} times meanwhile")
        print("streamed: ", end="", flush=True)
        async for item in peer.astream([{"role": "user", "content": "Name a colour."}],
                                       SamplingParams(max_new_tokens=8)):
            if isinstance(item, GenerationChunk):
                print(item.text, end="", flush=True)
        print()
        try:
            await asyncio.wait_for(
                peer.agenerate(QUESTION, SamplingParams(max_new_tokens=500)), timeout=0.05
            )
        except TimeoutError:
            print("a request past its timeout was cancelled inside the peer")
        url = await peer.acall(lambda p: p.start_service(serve_http, p, "127.0.0.1", 0))
        print(f"HTTP API on {url}/v1 while the peer runs")
    print("peer stopped")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--bootstrap", nargs="*", default=[])
    args = parser.parse_args()
    asyncio.run(main(args.model, args.bootstrap))
