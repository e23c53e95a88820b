"""A remote peer that sends garbage on libp2p's own protocols cannot take a peer down."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import trio
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12
from libp2p.utils.varint import encode_uvarint

from peer.config import PeerConfig, Policy
from peer.engine.engine import SamplingParams
from peer.net.libp2p_fixes import NURSERY_CLOSED, _guard_pubsub_reader
from peer.net.wire import FrameStream
from peer.routing.router import Router
from protocols.framing import encode_frame
from protocols.ids import INFER_PROTOCOL
from protocols.infer import ErrorCode, InferError, InferRequest, parse_response
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


async def test_a_pubsub_reader_that_pubsub_stops_under_ends_quietly() -> None:
    # A message read while pubsub stops: scheduling its handling raises trio's "closed
    # nursery" RuntimeError, which used to escape through the connection and the host
    async def stopped(pubsub: object, stream: object) -> None:
        raise RuntimeError(NURSERY_CLOSED)

    async def broken(pubsub: object, stream: object) -> None:
        raise RuntimeError("a bug")

    pubsub = SimpleNamespace(is_peer_blacklisted=lambda peer: False)
    stream = SimpleNamespace(muxed_conn=SimpleNamespace(peer_id="peer"))
    await _guard_pubsub_reader(stopped)(pubsub, stream)
    with pytest.raises(RuntimeError, match="a bug"):
        await _guard_pubsub_reader(broken)(pubsub, stream)


async def _infer_exchange(entry, server, payload: bytes) -> object:
    """Open an inference stream from `entry` to `server`, send raw bytes, read one reply."""

    stream = await entry.peer.host.new_stream(ID.from_base58(server.peer.peer_id), [INFER_PROTOCOL])
    frames = FrameStream(stream)
    try:
        with trio.fail_after(10):
            await stream.write(payload)
            return parse_response(await frames.receive(), server.peer.engine.vocab_size)
    finally:
        await frames.reset()


async def _still_serves(entry, server) -> None:
    router = Router(Policy.LONGEST_PREFIX, random.Random(0), block_size=16)
    entry.peer.serving.pipeline.router = router
    prompt = [500 + i for i in range(40)]
    await server.peer.engine.generate(prompt, SamplingParams(max_new_tokens=1))
    chain = entry.peer.engine.hasher.chain(prompt)
    await wait_until(
        lambda: entry.peer.table.estimate_match(server.peer.peer_id, chain) == len(chain),
        timeout_s=10,
        what="the server's summary shows the prompt",
    )
    result = await entry.peer.generate(prompt, SamplingParams(max_new_tokens=3))
    assert result.served_by == server.peer.peer_id


async def test_requests_the_serving_peer_cannot_run_get_an_error_and_it_keeps_serving(
    nursery, tiny_engine_factory
):

    server = await start_peer(nursery, _model_config(), tiny_engine_factory())
    entry = await start_peer(nursery, _model_config(server.peer.multiaddrs), tiny_engine_factory())
    await wait_until(
        lambda: entry.peer.table.get(server.peer.peer_id, trio.current_time()) is not None,
        timeout_s=20,
        what="the entry knows the server",
    )
    too_long = InferRequest(  # valid on the wire; longer than tiny-random's 2048 context
        request_id="too-long", prompt_token_ids=(7,) * 2040, max_new_tokens=100,
        deadline_s=30.0, hops=1,
    )
    reply = await _infer_exchange(entry, server, encode_frame(too_long.to_wire()))
    assert isinstance(reply, InferError) and reply.code is ErrorCode.INVALID_REQUEST
    assert "context" in reply.message

    garbage = await _infer_exchange(entry, server, b"\x00\x00\x00\x05\xff\xff\xff\xff\xff")
    assert isinstance(garbage, InferError) and garbage.code is ErrorCode.INVALID_REQUEST

    stats = server.peer.serving.inference.statistics()
    assert stats["rejected_invalid"] == 2
    await _still_serves(entry, server)


def _model_config(bootstrap=()):

    return PeerConfig(
        model="tiny-random", listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap=tuple(bootstrap),
        identity_file=None, summary_interval_s=0.5,
        first_token_floor_s=5.0,  # the default 1 s floor stalls honest peers on a busy CI CPU
    )


class _Rpc:
    def __init__(self, record: bytes) -> None:
        self.senderRecord = record

    def HasField(self, name: str) -> bool:  # protobuf's name
        return name == "senderRecord" and bool(self.senderRecord)


class _Host:
    def __init__(self, peer_id: str) -> None:
        self._id = peer_id

    def get_id(self) -> str:
        return self._id


def test_a_peers_signed_record_is_verified_again_only_when_it_changes() -> None:
    from peer.net.received_record import RECHECK_S, remembering

    verified: list[tuple[str, str, bytes]] = []
    now = [0.0]

    def verify(msg: _Rpc, host: _Host, peer: str) -> bool:
        verified.append((host.get_id(), peer, msg.senderRecord))
        return msg.senderRecord != b"forged"

    consume = remembering(verify, clock=lambda: now[0])
    a, b = _Host("A"), _Host("B")
    assert all(consume(_Rpc(b"r1"), a, "P") for _ in range(5))
    assert verified == [("A", "P", b"r1")]  # four RPCs later, still checked once
    assert consume(_Rpc(b"r1"), b, "P")  # another of our hosts keeps its own peerstore
    assert consume(_Rpc(b"r2"), a, "P")  # the peer's addresses changed: checked again
    assert not consume(_Rpc(b"forged"), a, "P")
    assert not consume(_Rpc(b"forged"), a, "P")  # a rejected record is never remembered
    assert consume(_Rpc(b""), a, "Q")  # no record at all: nothing to check
    now[0] = RECHECK_S
    assert consume(_Rpc(b"r2"), a, "P")  # and once a minute anyway (the TTL refresh)
    assert [v[2] for v in verified] == [b"r1", b"r1", b"r2", b"forged", b"forged", b"r2"]


async def test_gossip_verifies_each_peer_record_once_not_on_every_rpc(nursery, monkeypatch):
    import libp2p.pubsub.utils as pubsub_utils

    verified = 0
    original = pubsub_utils.consume_envelope

    def counting(*args, **kwargs):
        nonlocal verified
        verified += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(pubsub_utils, "consume_envelope", counting)
    a = await start_peer(nursery, swarm_config())
    b = await start_peer(nursery, swarm_config(bootstrap=[a.peer.multiaddrs[0]]))

    def summaries_received() -> int:
        return sum(p.peer.statistics()["summaries_accepted"] for p in (a, b))

    await wait_until(lambda: summaries_received() >= 12, timeout_s=30, what="12 summaries")
    # Each summary is at least one RPC (plus IHAVE/IDONTWANT control RPCs); the two
    # records were checked about once per receiving side.
    assert verified <= 4, f"{verified} verifications for {summaries_received()} summaries"
