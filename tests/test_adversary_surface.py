"""bench/adversary_surface.py's rows: what the honest peers' own /v1/swarm samples say
about the surface rogues, and that an attack that worked would show in them."""

from __future__ import annotations

from bench.adversary import SCENARIOS
from bench.adversary_surface import SurfaceWatch
from bench.rogue import Mode
from bench.rogues.reachability_liar import LIE_IP


def sample(reachability: str, addrs: list[str], dials: int = 0) -> dict[str, object]:
    return {"reachability": reachability, "addrs": addrs,
            "holepunch": {"holepunch_dials_to_unobserved": dials,
                          "holepunch_dials_to_observed": 0,
                          "holepunch_refused_not_our_relay": 3, "source": "127.0.0.1:1"}}


def test_the_surface_rogues_are_scenarios_and_modes():
    for name in ("punch_scanner", "reachability_liar"):
        assert name in SCENARIOS and Mode(name)


def test_a_scan_that_got_through_shows_in_the_row():
    watch = SurfaceWatch()
    watch.add("peer-aaaaaa", sample("unknown", [], dials=8))
    watch.add("peer-bbbbbb", sample("unknown", []))
    row = watch.row("punch_scanner", {"scan_connections": 32, "scan_ports_hit": 8,
                                      "punch_connects_sent": 1})
    assert row["punch_dials_to_unobserved"] == 8
    assert row["punch_refused"] == {"refused_not_our_relay": 6}
    assert (row["scan_connections"], row["scan_ports_hit"]) == (32, 8)


def test_a_lie_that_got_through_shows_in_the_row():
    watch = SurfaceWatch()
    circuit = "/ip4/127.0.0.1/tcp/5/p2p/R/p2p-circuit/p2p/me"
    watch.add("peer-aaaaaa", sample("private", [circuit]))
    watch.add("peer-aaaaaa", sample("public", [f"/ip4/{LIE_IP}/tcp/4001"]))
    row = watch.row("reachability_liar", {"dialback_lies": 2})
    assert row["reachability_seen"] == {"aaaaaa": {"private": 1, "public": 1}}
    assert row["liar_address_advertised_samples"] == 1
    assert row["relayed_addrs_min_max"] == {"aaaaaa": [0, 1]}  # it dropped its relay
    assert row["dialback_lies_told"] == 2
