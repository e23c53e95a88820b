"""A testbed of small machines on one box: real peers, each with its own CPU share and
network namespace, every byte between them through an emulated link; the workload of
the simulator replayed on them, next to the simulator's prediction (docs/testbed.md).

  __main__.py   the CLI: calibrate, pick the loads, run every point, policy and run
  beds.py       where peers run (isolated or loopback): a fresh swarm per policy run
  runner.py     one run: the workload sent open loop, timed at the client, summarised
  report.py     docs/RESULTS.md's testbed section from the committed rows
  workload.py   the simulator's generators mixed (MMLU, chat, agent)
  calibrate.py  each peer's speed under its quota, as a simulator Calibration
  predict.py    the simulator on those calibrations; the loads' arrival rates
  net.py, emulator.py, link.py, zygote.py  namespaces, links, CPU groups, fork server
"""
