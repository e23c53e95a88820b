"""A remote peer that sends garbage on libp2p's own protocols cannot take a peer down."""

from __future__ import annotations

import trio
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12
from libp2p.utils.varint import encode_uvarint

from tests.helpers_swarm import start_peer, swarm_config, wait_until

# Field 1 with wire type 7 (invalid): protobuf's parser raises DecodeError on it.
UNDECODABLE_RPC = b"\x0f\xff\xff\xff\xff\xff"


async def test_an_undecodable_pubsub_rpc_does_not_kill_the_receiver(nursery):
    victim = await start_peer(nursery, swarm_config())
    attacker = await start_peer(nursery, swarm_config(bootstrap=victim.peer.multiaddrs))
    await wait_until(
        lambda: victim.peer.table.get(attacker.peer.peer_id, trio.current_time()) is not None,
        timeout_s=20,
        what="the victim knows the attacker",
    )
    stream = await attacker.peer.host.new_stream(
        ID.from_base58(victim.peer.peer_id), [PROTOCOL_ID_V12]
    )
    await stream.write(encode_uvarint(len(UNDECODABLE_RPC)) + UNDECODABLE_RPC)

    # The victim keeps running: it still publishes summaries the attacker accepts.
    def seq_seen() -> int:
        view = attacker.peer.table.get(victim.peer.peer_id, trio.current_time())
        return view.summary.seq if view else -1

    before = seq_seen()
    await wait_until(lambda: seq_seen() > before, timeout_s=10, what="a newer summary")
    assert not victim.done.is_set()
