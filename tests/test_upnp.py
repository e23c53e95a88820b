"""peer/net/upnp.py against a stand-in miniupnpc (no router is reachable from tests)."""

from __future__ import annotations

import sys
import types

from peer.net import upnp


class FakeIGD:
    discoverdelay = 0
    lanaddr = "192.168.1.20"

    def __init__(self, devices: int, refuse: bool = False) -> None:
        self.devices, self.refuse, self.mapped = devices, refuse, []

    def discover(self) -> int:
        return self.devices

    def selectigd(self) -> None:
        if not self.devices:
            raise Exception("No UPnP device discovered")  # as miniupnpc does

    def externalipaddress(self) -> str:
        return "203.0.113.9"

    def addportmapping(self, ext, proto, lan, port, desc, remote) -> bool:
        if self.refuse:
            raise Exception("ConflictInMappingEntry")
        self.mapped.append((ext, proto, lan, port))
        return True


def install(monkeypatch, igd: FakeIGD) -> None:
    module = types.ModuleType("miniupnpc")
    module.UPnP = lambda: igd  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "miniupnpc", module)


def test_a_router_that_maps_gives_the_public_address(monkeypatch):
    igd = FakeIGD(devices=1)
    install(monkeypatch, igd)
    assert upnp.map_port(4001) == "/ip4/203.0.113.9/tcp/4001"
    assert igd.mapped == [(4001, "TCP", "192.168.1.20", 4001)]


def test_no_router_or_a_refusal_gives_nothing(monkeypatch):
    install(monkeypatch, FakeIGD(devices=0))
    assert upnp.map_port(4001) is None
    install(monkeypatch, FakeIGD(devices=1, refuse=True))
    assert upnp.map_port(4001) is None
