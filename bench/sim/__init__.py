"""The discrete-event swarm simulator behind `python -m bench.simulate`.

  calibration.py  prefill/decode service times of a peer, fitted to engine measurements
  regimes.py      cpu, gpu and mixed swarms: which calibration each peer serves at
  params.py       SimParams (every knob, with its reason), RunResult, the policy names
  model.py        the simulated swarm: peers with the real radix cache, peer table and
                  router; batching servers (the engine's scheduler); network delay;
                  anti-entropy (full flooding or ring neighbourhoods)
  experiments.py  the evaluation's sweeps (a)-(g), cache pressure, chat and agent
                  sessions as grids of runs over regimes and seeds, one row per run
  plots.py        Markdown tables and PNG plots of result rows
"""
