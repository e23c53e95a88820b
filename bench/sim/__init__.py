"""The discrete-event swarm simulator behind `python -m bench.simulate`.

  calibration.py  prefill/decode service times of a peer, fitted to engine measurements
  regimes.py      cpu, gpu and mixed swarms: which calibration each peer serves at
  params.py       SimParams (every knob, with its reason), RunResult, the policy names
  model.py        the simulated swarm: the event loop, arrivals, network delay, metrics
  swarm_state.py  a simulated peer (the real radix cache, peer table, router, publish
                  policy and Bloom filter) and a request in flight
  server_model.py a peer's batching engine (the engine's scheduler rules)
  routing_model.py  the entry peer's choice: router, load probes, ring lookup, baselines
  gossip_model.py anti-entropy: publishing, delivery (full flooding or ring neighbours)
  experiments.py  the evaluation's sweeps (a)-(g), cache pressure, chat and agent
                  sessions as grids of runs over regimes and seeds, one row per run
  plots.py        Markdown tables and PNG plots of result rows
"""
