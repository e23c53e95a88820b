"""libp2p and the network: everything that knows about hosts, connections and streams.

  host.py            the libp2p host: identity, Noise, yamux, TCP, deadlines
  host_services.py   the Kademlia DHT and GossipSub on the host
  libp2p_fixes.py    process-wide workarounds for py-libp2p 0.8.1 (docs/libp2p.md)
  discovery.py       bootstrap, provider records, dialling, liveness pings
  lan.py, upnp.py    peers on the same LAN; a port mapping on the home router
  reachability.py    pure: reachability verdicts, relay reservations, control messages
  relay_service.py   dial-back checks, reservations on relays, relayed streams (the shell
                     around reachability.py)
  relay_server.py    the relay side: slots held for private peers, circuits joined
  punch.py           pure: the hole punch's messages, roles, timing and budget
  punch_service.py   relayed -> direct: connection reversal, TCP simultaneous open
  wire.py            frames over a stream, the wire's errors, the stream seams

May import: engine/, config and the other root utilities, protocols/. Nothing above.
"""
