"""UPnP port mapping (opt-in, `--upnp`): ask a home router to forward our TCP port.

Uses miniupnpc when it is installed (py-libp2p's UPnP support depends on it); without it,
or without a router that answers, nothing happens. Blocking calls: run in a thread.
The reachability check then confirms the mapped address (or not) like any other.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

DISCOVER_MS = 1500  # SSDP discovery wait: routers answer within a few hundred ms
DESCRIPTION = "prefixswarm"


def _igd() -> Any | None:
    try:
        import miniupnpc
    except ImportError:
        logger.info("UPnP: miniupnpc is not installed; no port mapping")
        return None
    upnp = miniupnpc.UPnP()
    upnp.discoverdelay = DISCOVER_MS
    try:
        if upnp.discover() == 0:
            logger.info("UPnP: no router answered; no port mapping")
            return None
        upnp.selectigd()
    except Exception as exc:  # miniupnpc raises bare Exception for "no IGD found"
        logger.info("UPnP: no usable router (%s); no port mapping", exc)
        return None
    return upnp


def map_port(port: int) -> str | None:
    """Forward TCP `port` on the router to us; the public multiaddr, or None."""
    upnp = _igd()
    if upnp is None:
        return None
    try:
        external = upnp.externalipaddress()
        ok = upnp.addportmapping(port, "TCP", upnp.lanaddr, port, DESCRIPTION, "")
    except Exception as exc:  # the router refused (port taken, UPnP locked down)
        logger.warning("UPnP: the router refused to map TCP %d: %s", port, exc)
        return None
    if not ok or not external:
        return None
    logger.warning("UPnP: the router forwards TCP %s:%d to this machine", external, port)
    return f"/ip4/{external}/tcp/{port}"


def unmap_port(port: int) -> None:
    upnp = _igd()
    if upnp is not None:
        try:
            upnp.deleteportmapping(port, "TCP")
        except Exception as exc:  # already gone
            logger.debug("UPnP: removing the mapping of %d: %s", port, exc)
