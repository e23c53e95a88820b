"""The peer: Trio shells around pure cores, by responsibility.

Imports run one way (tests/test_layers.py checks it):
entry points -> api -> node -> request -> routing -> swarm -> net -> engine; the plain
utilities (config, settings, logs, progress, version, demo_data) and protocols/ are
usable from every layer.

  api/        the faces: OpenAI HTTP API, responses, auth, schema, metrics, the page
  request/    the request path: pipeline, race, forward, inference service, admission,
              the generation service, serving, the request log
  routing/    router, the cost formula, load probes and their shell, the trust ledger
  swarm/      what peers know of each other: gossip, summaries, peer table, ring lookup
  net/        libp2p: host and its fixes, discovery, LAN, UPnP, reachability, relay,
              hole punch, the stream wire helpers
  engine/     the model, the radix prefix cache and generation (see its __init__)

The composition root stays here: node.py (Peer, open_peer), cli.py and cli_clients.py,
settings.py and config.py, preflight.py, local_swarm.py, processes.py, node_runner.py,
views.py (the peer's state as JSON for the faces), demo_data.py, logs.py, progress.py,
version.py.

Nothing is imported here, so importing a pure core does not pull in trio or libp2p.
"""
