"""The testbed runs that docs/RESULTS.md shows after the grids, in its order: each run's
committed rows, the section's title and the command that made them (`bench.claims`
renders each with bench/testbed/report.py `section`)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


class CommittedRun(NamedTuple):
    """One committed testbed run on the page."""

    path: Path
    title: str
    command: str


# the full run (its title and command are report.py's own), then the what-ifs
FULL_RUN = RESULTS / "testbed.json"
TESTBED_PAGES = (
    # the first run with each serving peer's wait priced: cost and local at the half load
    CommittedRun(
        RESULTS / "testbed_half_d14a0e9.json",
        "A partial run at d14a0e9, the first with each serving peer's wait priced: cost "
        "and local only, the half load only (its rate fixed at 6 requests/s), five runs",
        "sudo .venv/bin/python -m bench.testbed --json docs/results/testbed_half_d14a0e9.json "
        "--policies cost,local --delays-ms 0,20,50 --loads half --runs 5 --rates half=6",
    ),
    # the same partial run on another machine kind (an Intel Xeon without bfloat16)
    CommittedRun(
        RESULTS / "testbed_half_intel_df69797.json",
        "The same partial run at df69797 on an Intel Xeon kind (AVX-512, no bfloat16): "
        "cost and local only, the half load only (6 requests/s), five runs",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_half_intel_df69797.json --policies cost,local "
        "--delays-ms 0,20,50 --loads half --runs 5 --rates half=6",
    ),
    # the first full run with the forward pilot live, predictions made again with the
    # pilots' factors off the path (the run's own kept under predicted_at_run)
    CommittedRun(
        RESULTS / "testbed_45d9c55.json",
        "The full run at 45d9c55, the first with the forward pilot live: predictions "
        "made again with the load pilots' CPU factors charged off the path and the "
        "forwards' residual CPU (bench.testbed.repredict)",
        "sudo .venv/bin/python -m bench.testbed --json docs/results/testbed_45d9c55.json "
        "&& .venv/bin/python -m bench.testbed.repredict --json "
        "docs/results/testbed_45d9c55.json",
    ),
    # the full run at dbc02d6 (bfloat16 layers laid out once), predictions made again with
    # the load pilots' CPU factors and the forward residual of its random rows (the run's
    # own kept under predicted_at_run)
    CommittedRun(
        RESULTS / "testbed_dbc02d6.json",
        "The full run at dbc02d6, a third day on the same machine kind, predictions made "
        "again with the load pilots' CPU factors and the forwards' residual CPU "
        "(bench.testbed.repredict)",
        "sudo .venv/bin/python -m bench.testbed --json docs/results/testbed_dbc02d6.json "
        "&& .venv/bin/python -m bench.testbed.repredict --json "
        "docs/results/testbed_dbc02d6.json",
    ),
    # the full run again at the same testbed code, a day later (its own pilots' rates)
    CommittedRun(
        RESULTS / "testbed_b4e083e.json",
        "The full run again at b4e083e, the next day on the same machine kind, at its "
        "own pilots' rates (since 8ae0639: the API's 15 s keep-alive, the "
        "calibration's client path walked through the quota), predictions made again",
        "sudo .venv/bin/python -m bench.testbed --json docs/results/testbed_b4e083e.json "
        "&& .venv/bin/python -m bench.testbed.repredict --json "
        "docs/results/testbed_b4e083e.json",
    ),
    # the first full run on random-256x2 (the full run until 8ae0639's), another day
    CommittedRun(
        RESULTS / "testbed_665aab6.json",
        "The first full run on random-256x2, at 665aab6 (the same machine kind, "
        "another day)",
        "sudo .venv/bin/python -m bench.testbed --json docs/results/testbed.json",
    ),
    # the CPU groups' CFS period at 10 ms instead of the kernel's 100 ms, d = 0
    CommittedRun(
        RESULTS / "testbed_period10ms_d0.json",
        "The CPU groups' period at 10 ms instead of 100: d = 0 ms only, two runs per "
        "point, at a 10 ms run's own pilots' rates",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_period10ms_d0.json --delays-ms 0 --cfs-period-ms 10 "
        "--runs 2 --rates half=5.74,high=13.97",
    ),
    # the full run again, on the code after its review mends, at the first run's rates
    # (the same workloads): how far one full run's verdicts carry
    CommittedRun(
        RESULTS / "testbed_repeat.json",
        "The full run at 665aab6 again (the same rates and seeds, the code after its "
        "review mends)",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_repeat.json --rates "
        "half=11.84761583608273,high=26.669759680950357",
    ),
    # the testbed on another machine kind (an Intel Xeon with AMX), d = 0 only, two runs
    CommittedRun(
        RESULTS / "testbed_intel_d0.json",
        "The testbed on an Intel Xeon (AMX): d = 0 ms only, two runs per point, at "
        "its own pilots' rates",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_intel_d0.json --delays-ms 0 --runs 2",
    ),
    # ... the same again (rates and seeds), with five calibration draws a point
    CommittedRun(
        RESULTS / "testbed_intel_d0_again.json",
        "The Intel Xeon partial run again (the same rates and seeds, five calibration"
        " draws a point)",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_intel_d0_again.json --delays-ms 0 --runs 2 --rates "
        "half=6.07303172332896,high=16.92160037775222",
    ),
    # ... and again at ca72241, whose aged queue reports (toward the swarm's mean) were
    # withdrawn after
    CommittedRun(
        RESULTS / "testbed_intel_d0_aged.json",
        "The Intel Xeon partial run at ca72241, with aged queue reports, a rule since"
        " withdrawn (the same rates and seeds)",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_intel_d0_aged.json --delays-ms 0 --runs 2 --rates "
        "half=6.07303172332896,high=16.92160037775222",
    ),
    # ... the same rates and seeds on b39c480 (stale queue reports age toward each peer's
    # usual queue)
    CommittedRun(
        RESULTS / "testbed_intel_d0_usual_queue.json",
        "The Intel Xeon partial run at b39c480: stale queue reports age toward each "
        "peer's usual queue (the same rates and seeds)",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_intel_d0_usual_queue.json --delays-ms 0 --runs 2 "
        "--rates half=6.07303172332896,high=16.92160037775222",
    ),
    # ... then on the code before it (a294b3b), one invocation after the other
    CommittedRun(
        RESULTS / "testbed_intel_d0_before_usual_queue.json",
        "The same at a294b3b, without the rule, right after (the same rates and "
        "seeds)",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_intel_d0_before_usual_queue.json --delays-ms 0 --runs 2"
        " --rates half=6.07303172332896,high=16.92160037775222 (at a294b3b)",
    ),
    # ... and at b785fee, whose simulator adds each entry's measured client path
    CommittedRun(
        RESULTS / "testbed_intel_d0_client_path.json",
        "The Intel Xeon partial run at b785fee: the simulator adds the path between a "
        "client and its entry (the same rates and seeds)",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_intel_d0_client_path.json --delays-ms 0 --runs 2 "
        "--rates half=6.07303172332896,high=16.92160037775222",
    ),
    # ... and with every share and both rates halved (one run): the peers' contention
    CommittedRun(
        RESULTS / "testbed_intel_d0_half_shares.json",
        "The same with every share and both rates halved, one run (at b785fee; a test"
        " of the simulator, not a verdict)",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_intel_d0_half_shares.json --delays-ms 0 --runs 1 "
        "--shares 0.1,0.15,0.2,0.25 --rates half=3.03651586166448,high=8.46080018887611",
    ),
    # ... and at 6acd5a3, whose router prices a load probe at what its rounds waited
    CommittedRun(
        RESULTS / "testbed_intel_d0_probe_waits.json",
        "The Intel Xeon partial run with probes priced at their measured wait (the "
        "tree of 6acd5a3 before its commit; the same rates and seeds)",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_intel_d0_probe_waits.json --delays-ms 0 --runs 2 "
        "--rates half=6.07303172332896,high=16.92160037775222",
    ),
    # ... and five runs at 6acd5a3: the host sped up after the calibration, so "high"
    # left the busiest peer under 0.6 busy
    CommittedRun(
        RESULTS / "testbed_intel_d0_probe_waits_5runs.json",
        "The same, five runs at 6acd5a3 (a host faster than at its calibration: the "
        "busiest peer 0.28-0.65 busy at high)",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_intel_d0_probe_waits_5runs.json --delays-ms 0 --runs 5 "
        "--rates half=6.07303172332896,high=16.92160037775222",
    ),
    # ... and side by side: the code before the rule, then 5f9b486, one invocation after
    # the other (cost, longest_prefix and local)
    CommittedRun(
        RESULTS / "testbed_intel_d0_probe_ab_before.json",
        "Before the probe rule (a7f6eb1), cost, longest_prefix and local, two runs",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_intel_d0_probe_ab_before.json --delays-ms 0 --runs 2 "
        "--policies cost,longest_prefix,local --rates "
        "half=6.07303172332896,high=16.92160037775222 (at a7f6eb1)",
    ),
    CommittedRun(
        RESULTS / "testbed_intel_d0_probe_ab_after.json",
        "With the probe rule (5f9b486), right after, the same policies, rates and seeds",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_intel_d0_probe_ab_after.json --delays-ms 0 --runs 2 "
        "--policies cost,longest_prefix,local --rates "
        "half=6.07303172332896,high=16.92160037775222",
    ),
    # ... and the pair again in the other order: the rule first (a3ab359), then a7f6eb1
    CommittedRun(
        RESULTS / "testbed_intel_d0_probe_ab2_after.json",
        "The pair again, the rule first (a3ab359), the same policies, rates and seeds",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_intel_d0_probe_ab2_after.json --delays-ms 0 --runs 2 "
        "--policies cost,longest_prefix,local --rates "
        "half=6.07303172332896,high=16.92160037775222",
    ),
    CommittedRun(
        RESULTS / "testbed_intel_d0_probe_ab2_before.json",
        "Then before the rule (a7f6eb1), right after",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_intel_d0_probe_ab2_before.json --delays-ms 0 --runs 2 "
        "--policies cost,longest_prefix,local --rates "
        "half=6.07303172332896,high=16.92160037775222 (at a7f6eb1)",
    ),
    # an AMD EPYC without AVX-512 (about half as fast): the high load at all three
    # delays, three runs each (the half load's 200 requests at 1.4/s are 2.5 minutes a
    # policy run there)
    CommittedRun(
        RESULTS / "testbed_epyc_avx2_high.json",
        "The testbed on an AVX2-only EPYC (no AVX-512) at 1a17b39: the high load at d = "
        "0, 20 and 50 ms, three runs per point, at its own pilots' rate",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_epyc_avx2_high.json --loads high --runs 3",
    ),
    # d = 0 again on that EPYC, five runs a point: the diagnostic run whose traces found
    # connections lost to cancelled writes (no fix; scratch scripts ran beside it), then
    # quiet runs before the fix and with it (peer/net/cancel_safe.py)
    CommittedRun(
        RESULTS / "testbed_epyc_avx2_d0_loaded.json",
        "The AVX2-only EPYC at d = 0, high load, five runs: the diagnostic run (before "
        "peer/net/cancel_safe.py, other work on the machine)",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_epyc_avx2_d0_loaded.json --delays-ms 0 --loads high --runs 5"
        " --rates high=6.75 --traces DIR (the tree of the per-entry rows, without the fix)",
    ),
    CommittedRun(
        RESULTS / "testbed_epyc_avx2_d0_before.json",
        "The same at ce2cd19, before the fix, on a quiet machine (the same rates and "
        "seeds)",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_epyc_avx2_d0_before.json --delays-ms 0 --loads high --runs 5"
        " --rates high=6.75 (at ce2cd19)",
    ),
    CommittedRun(
        RESULTS / "testbed_epyc_avx2_d0_cancel_safe.json",
        "The same with cancelled writes and stream opens made safe (peer/net/"
        "cancel_safe.py), on a quiet machine",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_epyc_avx2_d0_cancel_safe.json --delays-ms 0 --loads high "
        "--runs 5 --rates high=6.75 --traces DIR",
    ),
    # the calibration's idle rates over the gossip measurement's windows, all peers at
    # once, instead of 3 s per peer (the first one right after start-up)
    CommittedRun(
        RESULTS / "testbed_epyc_avx2_d0_idle_windows_given_rate.json",
        "The AVX2-only EPYC at d = 0, high load, five runs, each peer's idle rate over the "
        "gossip measurement's windows, at the earlier runs' rate (6.75/s, which put the "
        "busiest peer at >= 0.99 in 15 of 25 runs that day)",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_epyc_avx2_d0_idle_windows_given_rate.json --delays-ms 0 "
        "--loads high --runs 5 --rates high=6.75 --traces DIR",
    ),
    CommittedRun(
        RESULTS / "testbed_epyc_avx2_d0_idle_windows.json",
        "The same with the high rate measured by the pilots, right after",
        "sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_epyc_avx2_d0_idle_windows.json --delays-ms 0 --loads high "
        "--runs 5 --traces DIR",
    ),
    # the same model as the full run's, before its warm-up was paced (80 unmeasured
    # requests at each load's own rate): ~56 minutes here
    CommittedRun(
        RESULTS / "testbed_r256.json",
        "The testbed's model with an unpaced 80-request warm-up (the run before the "
        "full run's; --model given as a folder)",
        "python -m bench.random_model /tmp/models/r256x2 --hidden 256 --layers 2 && "
        "sudo .venv/bin/python -m bench.testbed --json docs/results/testbed_r256.json"
        " --model /tmp/models/r256x2 --cache-bytes 8000000 --runs 5 --warmup 80 (with"
        " the warm-up unpaced, at b101006)",
    ),
    # the full run on tiny-random, the testbed's default model before random-256x2: a
    # request is mostly the peer's own overhead there, so no routing can pay
    CommittedRun(
        RESULTS / "testbed_tiny.json",
        "The testbed on tiny-random (hidden 64: the default model before; a request "
        "is mostly its peer's overhead)",
        "sudo .venv/bin/python -m bench.testbed --json docs/results/testbed_tiny.json"
        " --model tiny-random --cache-bytes 2000000 --warmup 80 (with the warm-up "
        "unpaced, at b427f72)",
    ),
    # a what-if: the testbed on a larger random model, where a prefill is most of a
    # request
    CommittedRun(
        RESULTS / "testbed_mid512.json",
        "The testbed on a larger random model (a what-if: hidden 512, 4 layers, where"
        " a prefill is most of a request)",
        "python -m bench.random_model /tmp/models/mid512x4 --hidden 512 --layers 4 &&"
        " sudo .venv/bin/python -m bench.testbed --json "
        "docs/results/testbed_mid512.json --model /tmp/models/mid512x4 --cache-bytes "
        "16000000 --policies cost,local --delays-ms 20 --runs 3 --rates "
        "half=2.9,high=6.5",
    ),
)
