"""The peer: Trio shells around the pure cores, plus the local inference engine.

  config.py       PeerConfig: everything a peer can be told, validated once
  node.py         Peer / open_peer(): host, DHT, pubsub, gossip and discovery in one
                  nursery; the seam where inference and HTTP services are added
  host.py         libp2p host (persisted ed25519 identity, Noise, yamux) with deadlines;
                  the only module that knows py-libp2p internals and their workarounds
  discovery.py    bootstrap with back-off, provide the model key, find and dial providers,
                  ping for liveness and round-trip times
  gossip.py       anti-entropy: publish our cache summary, validate and apply others'
  peer_table.py   pure: what this peer believes about the others (summaries, ages, RTTs)
  router.py       pure: routing policies -> ranked candidates with reasons
  bloom_sizing.py pure: the shape of the Bloom filter a summary carries
  reach.py        pure: reachability verdicts, relay reservations, their control messages
  relay.py        dial-back checks and our relay (the shell around reach.py)
  punch.py        pure: the direct-connection upgrade's messages, roles, timing, budget
  holepunch.py    relayed -> direct: connection reversal, TCP simultaneous open
  node_runner.py  one peer per process, reporting JSON lines (tests, benchmarks)
  processes.py    open_peer_processes(): start, follow and stop child peer processes
  local_swarm.py  `prefixswarm local` (+ demo_data.py: the demo's MMLU prompts)
  engine/         the model, the radix prefix cache and generation (see its __init__)

Nothing is imported here, so importing a pure core does not pull in trio or libp2p.
"""
