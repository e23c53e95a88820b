"""Two peers with mDNS and no bootstrap address; prints JSON once they are connected.

Run by tests/test_mdns.py inside a network namespace it builds (multicast stays there):
    python -m tests.helpers_mdns IP
"""

from __future__ import annotations

import json
import sys

import trio

from peer.config import PeerConfig
from peer.engine.cache_only import CacheOnlyEngine
from peer.node import open_peer

TIMEOUT_S = 30.0


async def main(ip: str) -> None:
    config = PeerConfig(
        model="prefixswarm/cache-only", listen_addrs=(f"/ip4/{ip}/tcp/0",),
        identity_file=None, summary_interval_s=0.5, mdns=True,
    )
    async with open_peer(config, CacheOnlyEngine()) as a, open_peer(config, CacheOnlyEngine()) as b:
        start = trio.current_time()
        with trio.move_on_after(TIMEOUT_S):
            while not (
                {v.peer_id for v in a.table.views(trio.current_time())} == {b.peer_id}
                and {v.peer_id for v in b.table.views(trio.current_time())} == {a.peer_id}
            ):
                await trio.sleep(0.1)
        print(json.dumps({
            "a": a.peer_id, "b": b.peer_id,
            "a_knows": [v.peer_id for v in a.table.views(trio.current_time())],
            "b_knows": [v.peer_id for v in b.table.views(trio.current_time())],
            "seconds": round(trio.current_time() - start, 2),
        }))


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
