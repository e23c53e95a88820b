"""table_filler: ghosts for every peer table and fake providers for every discovery.

Two floods from one rogue process, each within what an honest peer's validation accepts:

- GHOSTS (256) fresh identities that never connect, whose validly signed summaries
  (empty filters, consistent counts) the rogue publishes evenly spread over each
  GHOST_ROUND_S (a burst of 256 overflows py-libp2p's per-peer queue of 100): kept
  fresh, they would fill a table of 256 and turn newcomers away (TABLE_FULL);
- FAKE_PROVIDERS (1,024) provider records of the model's key, stuffed into the rogue's
  own DHT store so that every GET_PROVIDERS an honest peer sends it answers with all of
  them: fresh identities at the address of the rogue's *sink*, a loopback TCP listener
  that closes every connection at once (an unreachable peer) and counts it: each
  connection there is a dial an honest peer made to a fake provider.

Counts go into the rogue's `answered` stats: ghost_summaries_sent, fake_provider_dials
(TCP connections the sink accepted, py-libp2p's retries included).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from typing import Any

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.provider_store import ProviderRecord
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from multiaddr import Multiaddr

from bench.rogues.lies import forged_message
from peer.swarm.bloom_sizing import summary_bloom
from protocols.ids import gossip_topic, provider_key_multihash
from protocols.summary import CacheSummary, encode_summary

GHOSTS = 256  # the table's size (peer/swarm/peer_table.py MAX_PEERS)
FAKE_PROVIDERS = 1024  # discovery's candidate bound before it was a CandidateBook
PUBLISH_TIMEOUT_S = 5.0
GHOST_ROUND_S = 2.0  # every ghost once per round: within the 3 s an honest table keeps
#   a summary at the bench's 1 s interval, at 128 messages a second


def ghost_summary(peer_id: str, model_id: str, block_size: int, seq: int) -> CacheSummary:
    """A summary every honest table's validation accepts: an empty cache, idle."""
    bloom = summary_bloom(0, 0.01)
    return CacheSummary(
        peer_id=peer_id, model_id=model_id, block_size=block_size, seq=seq,
        bloom_bits=bloom.num_bits, bloom_hashes=bloom.num_hashes, bloom=bloom.to_bytes(),
        cached_blocks=0, capacity_blocks=1024, queued_prompt_tokens=0, running_requests=0,
        prefill_tokens_per_s=500.0, decode_tokens_per_s=20.0,
    )


def install(peer: Any, engine: Any, rng: Any, answered: Counter[str]) -> list[str]:
    """Start both floods on a running rogue `peer`; returns the ghosts' ids."""
    keys = [create_new_key_pair(rng.randbytes(32)) for _ in range(GHOSTS)]
    peer.start_soon(_ghosts, peer, engine, keys, rng, answered)
    peer.start_soon(_fake_providers, peer, engine, rng, answered)
    return [ID.from_pubkey(k.public_key).to_base58() for k in keys]


async def _ghosts(
    peer: Any, engine: Any, keys: list[Any], rng: Any, answered: Counter[str]
) -> None:
    topic = gossip_topic(engine.model_id)
    origins = [ID.from_pubkey(k.public_key).to_base58() for k in keys]
    seq = 0
    while True:
        seq += 1
        for key, origin in zip(keys, origins, strict=True):
            summary = ghost_summary(origin, engine.model_id, engine.block_size, seq)
            msg = forged_message(key, topic, encode_summary(summary), rng)
            with trio.move_on_after(PUBLISH_TIMEOUT_S):
                # Straight to the router: the rogue's own validation and delivery to its
                # own subscription would cost it most of its CPU (~25 messages a second)
                await peer.pubsub.router.publish(peer.pubsub.my_id, msg)
                answered["ghost_summaries_sent"] += 1
            await trio.sleep(GHOST_ROUND_S / len(keys))


async def _fake_providers(peer: Any, engine: Any, rng: Any, answered: Counter[str]) -> None:
    async def sink(stream: trio.SocketStream) -> None:
        answered["fake_provider_dials"] += 1
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, sink, 0, host="127.0.0.1")
        listeners = await nursery.start(serve)
        port = listeners[0].socket.getsockname()[1]
        addr = Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")
        fakes = {
            ID.from_pubkey(create_new_key_pair(rng.randbytes(32)).public_key)
            for _ in range(FAKE_PROVIDERS)
        }
        # Past the store's own bound of 20 per key: its GET_PROVIDERS answers with all.
        records = peer.dht.provider_store.providers.setdefault(
            provider_key_multihash(engine.model_id), {}
        )
        for fake in fakes:
            records[str(fake)] = ProviderRecord(PeerInfo(fake, [addr]), time.time())
        answered["fake_providers"] = len(fakes)
        # The rogue's own discovery reads its store too: it does not dial its fakes.
        dial = peer.discovery._dial
        fake_ids = {f.to_base58() for f in fakes}

        async def own_dial(candidate: Any) -> None:
            # a Dial (or, on code before the CandidateBook, a _Candidate with .info)
            peer_id = getattr(candidate, "peer_id", None) or candidate.info.peer_id.to_base58()
            if peer_id not in fake_ids:
                await dial(candidate)

        peer.discovery._dial = own_dial
