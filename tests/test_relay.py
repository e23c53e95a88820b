"""Reachability and relays on loopback: peers with no listen address (outbound only, like a
volunteer behind NAT) are served through a relay; a reachable peer learns it is public."""

from __future__ import annotations

import random
import re
from typing import Any

import trio

from peer.api.metrics import Metrics
from peer.config import PeerConfig
from peer.engine.engine import SamplingParams
from peer.request.pipeline import Outcome
from tests.helpers_swarm import start_peer, wait_until

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
VOCAB = 49152


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB) for _ in range(n)]


def config(listen: tuple[str, ...], bootstrap: tuple[str, ...] = (), **extra: Any) -> PeerConfig:
    return PeerConfig(
        model="tiny-random",
        listen_addrs=listen,
        bootstrap=bootstrap,
        identity_file=None,
        summary_interval_s=0.5,
        forward_first_token_s=5.0,
        first_token_floor_s=5.0,  # a relayed first token on a busy CI CPU can take > 1 s
        forward_token_gap_s=5.0,
        **extra,
    )


def rtt_of(entry: Any, other: Any) -> float | None:
    view = entry.peer.table.get(other.peer.peer_id, trio.current_time())
    return None if view is None else view.rtt_s


async def test_outbound_only_peer_is_served_through_a_relay(nursery, tiny_engine_factory):
    relay = await start_peer(nursery, config(LOOPBACK), tiny_engine_factory())
    boot = tuple(relay.peer.multiaddrs)
    # Neither can dial the other: both have no listen address, as behind two NATs.
    holder = await start_peer(nursery, config((), boot), tiny_engine_factory())
    # The entry joins once the holder holds its relay slot: a relayed ping before that
    # fails and is retried only after twice the liveness interval (10 s), which this test
    # would spend waiting (peer/net/discovery.py); it proves the relayed route, not the retry.
    await wait_until(
        lambda: holder.peer.host.reach.relayed_addrs() != [],
        timeout_s=20,
        what="the holder reserved a relay slot",
    )
    # the entry trusts the holder from the start: a peer on probation serves no client
    entry = await start_peer(nursery, config((), boot, probation_requests=0), tiny_engine_factory())
    prefix = tokens(640, seed=1)
    prompt = prefix + tokens(20, seed=2)
    await holder.peer.engine.generate(prefix + tokens(9, seed=3), SamplingParams(max_new_tokens=1))
    chain = entry.peer.engine.hasher.chain(prompt)
    await wait_until(
        lambda: entry.peer.table.estimate_match(holder.peer.peer_id, chain) >= len(prefix) // 16
        and holder.peer.host.reach.relayed_addrs() != []
        and rtt_of(entry, holder) is not None,
        timeout_s=20,
        what="the entry knows the holder's prefix, the holder reserved a relay slot, and "
        "the entry measured its round trip through the relay (only such peers are routed to)",
    )
    assert holder.peer.reachability == "private"
    assert holder.peer.multiaddrs and all("/p2p-circuit/" in a for a in holder.peer.multiaddrs)
    assert not entry.peer.host.is_connected(holder.peer.host.peer_id)

    params = SamplingParams(max_new_tokens=8)
    result = await entry.peer.generate(prompt, params)
    assert result.served_by == holder.peer.peer_id
    assert result.cached_tokens == len(prefix)
    assert [x.outcome for x in result.route] == [Outcome.OK]
    reference = await tiny_engine_factory().generate(prompt, params)
    assert result.token_ids == reference.token_ids
    stats = relay.peer.host.reach.statistics()
    assert stats["circuits"] >= 1 and stats["reservations_granted"] >= 1
    # End to end through the relay: the holder proved the entry's identity in a handshake
    # (peer/net/relay_channel.py) and served it as the entry, never as the relay.
    assert holder.peer.host.reach.stats["relayed_inbound"] >= 1
    assert holder.peer.host.reach.stats["relayed_inbound_refused"] == 0
    # ...and operators see them in /metrics, with the NATed peer's verdict.
    exported = Metrics(relay.peer.statistics).render().decode()
    assert 'prefixswarm_relay_events_total{event="circuits"}' in exported
    granted = re.search(r'prefixswarm_relay_events_total\{event="reservations_granted"\} (\S+)',
                        exported)
    assert granted is not None and float(granted.group(1)) >= 1
    holder_metrics = Metrics(holder.peer.statistics).render().decode()
    assert 'prefixswarm_reachability{verdict="private"} 1.0' in holder_metrics
    reserved = re.search(r"^prefixswarm_relays_reserved (\S+)$", holder_metrics, re.M)
    assert reserved is not None and float(reserved.group(1)) >= 1
    assert entry.peer.link_to(holder.peer.peer_id) == "relayed"
    # Addresses land in the peer table (/v1/swarm shows them): the relay's, as dialled.
    await wait_until(
        lambda: any(
            v.peer_id == relay.peer.peer_id and v.addrs == tuple(relay.peer.multiaddrs)
            for v in entry.peer.table.views(trio.current_time())
        ),
        timeout_s=15,
        what="the entry's table holds the relay's advertised address",
    )
    # Peers dialled the relay back, all from loopback: one network, short of the quorum
    # that makes a peer PUBLIC (peer/net/reachability.py); not PRIVATE, so it relays.
    await wait_until(
        lambda: relay.peer.host.reach.tracker.evidence(trio.current_time())["ok"] >= 1,
        timeout_s=15, what="a dial-back reached the relay",
    )
    assert relay.peer.reachability == "unknown"
    assert not any("0.0.0.0" in a for a in relay.peer.multiaddrs)


async def test_a_peer_that_opted_out_relays_nothing(nursery, tiny_engine_factory):
    relay = await start_peer(
        nursery, config(LOOPBACK, relay_service=False), tiny_engine_factory()
    )
    holder = await start_peer(
        nursery, config((), tuple(relay.peer.multiaddrs)), tiny_engine_factory()
    )
    await wait_until(
        lambda: holder.peer.host.reach.stats["reservations_refused_to_us"] >= 1,
        timeout_s=15,
        what="the holder asked for a slot and was refused",
    )
    assert holder.peer.host.reach.relayed_addrs() == []
    assert relay.peer.host.reach.statistics()["reservations_held_for_others"] == 0


async def ended_without_answer(stream: Any) -> bool:
    from libp2p.network.stream.exceptions import StreamEOF, StreamReset

    try:
        return await stream.read(100) == b""
    except (StreamEOF, StreamReset):
        return True


async def test_garbage_on_the_reach_protocols_is_dropped_and_the_peer_keeps_serving(nursery):
    from libp2p.io.utils import read_exactly

    from peer.net.reachability import DialBackRequest, DialBackResponse
    from peer.net.relay_service import DIALBACK_PROTOCOL, RELAY_PROTOCOL
    from tests.helpers_swarm import swarm_config

    target = await start_peer(nursery, swarm_config())
    asker = await start_peer(nursery, swarm_config(bootstrap=target.peer.multiaddrs))
    host, tid = asker.peer.host, target.peer.host.peer_id
    for protocol in (RELAY_PROTOCOL, DIALBACK_PROTOCOL):
        for junk in ((1 << 20).to_bytes(4, "big"), b"\0\0\0\x03abc", b"\0\0\0\x01\xff"):
            stream = await host.new_stream(tid, [protocol], relay=False)
            await stream.write(junk)
            with trio.fail_after(10):
                assert await ended_without_answer(stream)
    # A relay connect for a peer with no reservation is refused with a reason.
    stream = await host.new_stream(tid, [RELAY_PROTOCOL], relay=False)
    from peer.net.reachability import RelayConnect, RelayReply, control_body_length, decode_control

    await stream.write(RelayConnect(host.peer_id.to_base58(), "/prefixswarm/infer/1.0.0").encode())
    with trio.fail_after(10):
        header = await read_exactly(stream, 4)
        body = await read_exactly(stream, control_body_length(header))
    reply = RelayReply.parse(decode_control(body))
    assert not reply.ok and "reservation" in reply.error
    # ...and a well-formed dial-back still works: the asker listens on loopback.
    request = DialBackRequest((int(asker.peer.multiaddrs[0].split("/tcp/")[1].split("/")[0]),))
    stream = await host.new_stream(tid, [DIALBACK_PROTOCOL], relay=False)
    await stream.write(request.encode())
    with trio.fail_after(10):
        header = await read_exactly(stream, 4)
        body = await read_exactly(stream, control_body_length(header))
    answer = DialBackResponse.parse(decode_control(body), request)
    assert answer.observed_ip == "127.0.0.1" and answer.ok_ports == request.ports
