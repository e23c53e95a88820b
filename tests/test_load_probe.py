"""/prefixswarm/load/1.0.0 between two real libp2p hosts on loopback: a probe gets the
answering engine's load; a peer that does not serve the protocol is no answer."""

from __future__ import annotations

from collections import Counter

import trio

from peer.config import PeerConfig
from peer.engine.api import EngineLoad
from peer.net.host import open_host
from peer.routing.probe_service import LoadService, probe_loads
from peer.routing.probing import ProbePlan, ProbeRound
from protocols.load import LoadReport

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


class BusyEngine:
    model_id = "test/model+w0123456789ab"

    def load(self) -> EngineLoad:
        return EngineLoad(321, 4, 1000.0, 20.0, waiting_requests=2)


def config() -> PeerConfig:
    return PeerConfig(model="test/model", listen_addrs=LOOPBACK, identity_file=None)


async def test_a_probe_over_libp2p_gets_the_engine_load() -> None:
    with trio.fail_after(30):
        async with open_host(config()) as a, open_host(config()) as b, open_host(config()) as c:
            service = LoadService(BusyEngine())
            service.serve(a.libp2p)  # c serves no load protocol
            for other in (a, c):
                await b.connect(other.multiaddrs[0])
            a_id, c_id = a.peer_id.to_base58(), c.peer_id.to_base58()
            stats: Counter[str] = Counter()
            probe = ProbeRound(ProbePlan((a_id, c_id), 10.0, (1.0, 1.0)), trio.current_time())
            reports = await probe_loads(b, probe, stats)
            assert reports == {a_id: LoadReport(321, 4, 2, model_id=BusyEngine.model_id)}
            assert stats["probe_answered"] == 1 and stats["probe_refused"] == 1
            assert trio.current_time() < probe.deadline  # did not wait for the deadline
            assert service.statistics()["load_queries_answered"] == 1
