"""The simulator's prediction of a testbed run, and the arrival rates of the loads.

The same workload (the very TokenRequest list the client sends, each request to the
same entry peer), the same peers (one measured Calibration each,
bench/testbed/calibrate.py, as SimParams.peer_calibrations), their cache capacity,
summary interval, delay and policy; a cold swarm (every peer on probation for every
other, promoted by shadows: each testbed run starts a fresh swarm), its answers verified
and audited at their entries as the live peers do (SimParams.trust_checks), and the
same warm-up left out (`warmup_requests`: the requests the testbed sends before
the measured ones; the busiest peer's utilisation is over the measured arrivals, as the
testbed measures it: all of the peer's CPU over its share, so the simulated busy fraction
of what requests get is added to what the idle peer uses, `backgrounds`). `rate_for_utilization`
picks an arrival rate at which the simulated busiest peer under a policy reaches a target
utilisation: where the testbed's measured load pilots start (bench/testbed/loads.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from bench.sim.calibration import Calibration
from bench.sim.model import Simulator
from bench.sim.params import COLD, SimParams
from bench.sim.quota import DEFAULT_PERIOD_S
from bench.testbed.calibrate import GossipCost, usable_cores
from bench.testbed.routes import Routed, by_entry
from bench.testbed.workload import entry_peers
from bench.workloads import TokenRequest

SIM_JITTER = 0.0  # the emulator's links have a fixed delay


@dataclass(frozen=True)
class SimSetup:
    """The swarm the simulator is given (everything but policy, delay and workload)."""

    calibrations: tuple[Calibration, ...]
    capacity_blocks: int
    summary_interval_s: float
    block_size: int = 16
    swarm_trust: str = COLD  # each testbed run starts a fresh swarm
    warmup_requests: int = 0  # the first requests of every workload are not measured
    backgrounds: tuple[float, ...] = ()  # per peer, the share its idle self uses (0 if empty)
    # per peer, the cores its quota leaves requests (share less the idle self): the
    # simulated peers run under those quotas (bench/sim/quota.py), the calibrations (times
    # at that share) turned into a core's CPU seconds; empty: fluid servers at share
    quotas: tuple[float, ...] = ()
    # per peer, the cores its idle self spends on the summary cadence (in its measured
    # background): the simulator charges every summary instead (Calibration's
    # summary_publish_s and summary_receive_s), so its quota gets them back
    gossip_cores: tuple[float, ...] = ()
    quota_period_s: float = DEFAULT_PERIOD_S  # the CPU groups' CFS period
    # per peer, how much more CPU a request took in the running swarm than measured alone
    # (`cpu_factors`, from the load pilots); empty: as measured alone
    cpu_factors: tuple[float, ...] = ()
    # where a factor above 1 is charged: True, after each step, off its requests' path
    # (Calibration's after_step_fraction); False, on their path (every cost scaled by the
    # factor). Off the path predicted more points within 25 % on the four committed runs
    # with per-entry rows (88 of 120 against 80, docs/testbed.md)
    factors_off_path: bool = True
    # the CPU seconds a forward costs its entry beyond what the calibration and the
    # simulator charge, at every peer (`forward_cpu`, from the forward pilot)
    forward_cpu_s: float = 0.0
    # where it is charged: False, with the calibration's own cost of a forward, on the
    # request's path (shadows too); True, once a client request's answer is back, off
    # its path (Calibration.forward_tail_s: predicted worse on the committed runs)
    forward_after_answer: bool = False

    def params(self, policy: str, delay_ms: float, seed: int) -> SimParams:
        calibrations = self.calibrations
        cpu_quotas = self.quotas
        factors = self.cpu_factors or (1.0,) * len(calibrations)
        if self.factors_off_path:
            calibrations = tuple(replace(c, after_step_fraction=max(0.0, f - 1.0))
                                 for c, f in zip(calibrations, factors, strict=True))
            factors = tuple(min(1.0, f) for f in factors)
        if self.quotas:
            calibrations = tuple(replace(c.scaled(q * f), name=f"{c.name}-cpu")
                                 for c, q, f in zip(calibrations, self.quotas, factors,
                                                    strict=True))
            if self.gossip_cores:
                cpu_quotas = tuple(q + g for q, g in zip(self.quotas, self.gossip_cores,
                                                         strict=True))
        elif any(f != 1.0 for f in factors):
            calibrations = tuple(c.scaled(f) for c, f in zip(calibrations, factors, strict=True))
        if self.forward_cpu_s:  # the calibrations are in CPU seconds of one core by now
            calibrations = tuple(self._with_forward_residual(c, self.forward_cpu_s)
                                 for c in calibrations)
        return SimParams(
            policy=policy, peers=len(self.calibrations), delay_ms=delay_ms, jitter=SIM_JITTER,
            summary_interval_s=self.summary_interval_s, capacity_blocks=self.capacity_blocks,
            block_size=self.block_size, warmup_fraction=0.0, seed=seed,
            calibration=calibrations[0], peer_calibrations=calibrations,
            swarm_trust=self.swarm_trust, cpu_quotas=cpu_quotas,
            quota_period_s=self.quota_period_s, trust_checks=True,
        )

    def _with_forward_residual(self, cal: Calibration, residual_s: float) -> Calibration:
        """`cal` charging `residual_s` more CPU per forward (less, where negative: the
        calibration's own cost of a forward, down to none)."""
        if residual_s > 0 and self.forward_after_answer:
            return replace(cal, forward_tail_s=cal.forward_tail_s + residual_s)
        return replace(cal, forward_overhead_s=max(0.0, cal.forward_overhead_s + residual_s))


def testbed_setup(calibrations: Sequence[Calibration], background_cores: Sequence[float],
                  shares: Sequence[float], isolated: bool, capacity_blocks: int,
                  summary_interval_s: float, warmup_requests: int,
                  gossip: GossipCost | None = None,
                  quota_period_s: float = DEFAULT_PERIOD_S) -> SimSetup:
    """The simulated swarm of a testbed: its measured calibrations (times at each peer's
    share less its idle self), idle selves as shares of the quota, and, where the peers
    were isolated, those quotas (the loopback bed has none). With `gossip`, the part of
    each idle self that is the summary cadence (GossipCost.idle_cores), which the
    simulator charges per summary, leaves the background and returns to the quota."""
    usable = utilization_cores(shares, isolated)
    cadence = gossip.idle_cores(len(shares), summary_interval_s) if gossip else 0.0
    idle_gossip = [min(cadence, b) for b in background_cores]
    rest = [b - g for b, g in zip(background_cores, idle_gossip, strict=True)]
    backgrounds = tuple(min(1.0, b / s) for b, s in zip(rest, usable, strict=True))
    quotas = (tuple(usable_cores(s, b) for s, b in zip(usable, background_cores, strict=True))
              if isolated else ())
    return SimSetup(tuple(calibrations), capacity_blocks, summary_interval_s,
                    warmup_requests=warmup_requests, backgrounds=backgrounds, quotas=quotas,
                    gossip_cores=tuple(idle_gossip) if isolated and gossip else (),
                    quota_period_s=quota_period_s)


def utilization_cores(shares: Sequence[float], isolated: bool) -> list[float]:
    """The cores each peer's utilisation is measured over: its share (a whole core on the
    loopback bed, which has no quotas)."""
    return [s if isolated else 1.0 for s in shares]


def idle_utilization(background_cores: Sequence[float], shares: Sequence[float],
                     isolated: bool) -> list[float]:
    """Each peer's idle self as the testbed measures utilisation: its CPU over its
    `utilization_cores`."""
    return [b / c for b, c in zip(background_cores, utilization_cores(shares, isolated),
                                  strict=True)]


# A factor outside these bounds is a failed pilot, not a slower swarm: it is clamped.
CPU_FACTOR_BOUNDS = (0.5, 3.0)


def cpu_factors(measured: Sequence[Sequence[float]], simulated: Sequence[Sequence[float]],
                idle: Sequence[float]) -> tuple[float, ...]:
    """Per peer, the CPU its requests took in the pilots (measured utilisation less its
    idle self's, summed over the pilots) over what the simulator charged for the same
    arrivals on the calibration measured alone (likewise): in the running swarm a peer's
    requests took up to 1.6 times the CPU they took alone, by day on one machine kind
    (where it goes is not measured apart: busy neighbours' caches and memory traffic,
    work after the first token). 1.0 where the simulator charged nothing; clamped to
    CPU_FACTOR_BOUNDS."""
    if len(measured) != len(simulated):
        raise ValueError("one simulated run per measured pilot")
    low, high = CPU_FACTOR_BOUNDS
    factors = []
    for peer, base in enumerate(idle):
        got = sum(max(0.0, m[peer] - base) for m in measured)
        charged = sum(max(0.0, s[peer] - base) for s in simulated)
        factors.append(1.0 if charged <= 0 else min(high, max(low, got / charged)))
    return tuple(factors)


def with_pilot_factors(setup: SimSetup, pilots: Sequence[tuple[float, Sequence[float]]],
                       idle: Sequence[float],
                       workload_at: Callable[[float], Sequence[TokenRequest]],
                       policy: str, delay_ms: float, seed: int) -> SimSetup:
    """`setup` with `cpu_factors` from the load pilots ((rate, per-peer utilisation),
    run under `policy` at `delay_ms` on `workload_at(rate)` with `seed`), each simulated
    on `setup` as measured alone."""
    alone = replace(setup, cpu_factors=())
    simulated = [predict(alone, policy, delay_ms, workload_at(rate), seed).peer_utilization
                 for rate, _ in pilots]
    return replace(setup, cpu_factors=cpu_factors([u for _, u in pilots], simulated, idle))


# A residual beyond this per forward (CPU seconds) is a failed pilot: it is clamped.
FORWARD_CPU_MAX_S = 0.2
# The forward pilot's policy (bench/testbed/forward_pilot.py): three requests in four
# forwarded, from every entry alike.
FORWARD_PILOT_POLICY = "random"
# Fewer forwards than this give no residual (0): one run's 150 put it anywhere from -10 to
# +25 ms of CPU on a day whose five runs together said 8; a quick run's 45, at -21.
FORWARD_MIN_FORWARDS = 300


@dataclass(frozen=True)
class ForwardSample:
    """One measured run for `forward_cpu`: each peer's utilisation, measured and simulated
    on the same arrivals, the requests each entry forwarded (measured), and the window
    the utilisations are over."""

    measured: Sequence[float]
    simulated: Sequence[float]
    forwards: Sequence[int]
    window_s: float


def forward_cpu(samples: Sequence[ForwardSample], usable: Sequence[float],
                min_forwards: int = FORWARD_MIN_FORWARDS) -> float:
    """The CPU seconds a forward took its entry beyond what the simulator charged: what
    the peers' measured utilisation exceeded the simulated one by (in CPU seconds:
    utilisation is CPU over `usable` cores), summed over the peers and the samples, over
    the requests they forwarded (negative where they ran below the simulation). On the
    committed runs the peers' CPU per request served matched the simulator's while a
    forward took its entry 12-28 ms of CPU against 0-15 charged (docs/testbed.md), so
    the residual is put on the forwards; one figure for the swarm, as a pilot's per-peer
    figures swung by tens of ms from run to run. 0 where fewer than `min_forwards` were
    forwarded; clamped to +-FORWARD_CPU_MAX_S."""
    extra = sum((m - s) * cores * sample.window_s
                for sample in samples
                for m, s, cores in zip(sample.measured, sample.simulated, usable, strict=True))
    sent = sum(sum(sample.forwards) for sample in samples)
    if sent < max(1, min_forwards):
        return 0.0
    return min(FORWARD_CPU_MAX_S, max(-FORWARD_CPU_MAX_S, extra / sent))


def forwards_per_entry(served_matrix: Sequence[Sequence[int]]) -> list[int]:
    """Requests each entry forwarded: its row of `served_matrix` (entry i, server j) off
    the diagonal."""
    return [sum(n for j, n in enumerate(row) if j != i) for i, row in enumerate(served_matrix)]


def measured_window(workload: Sequence[TokenRequest], warmup: int) -> float:
    """The span of the measured arrivals, which a run's utilisations are over."""
    arrivals = [r.arrival_s for r in workload[warmup:]]
    return max(arrivals) - min(arrivals) if arrivals else 0.0


def with_forward_pilot(setup: SimSetup, runs: Sequence[tuple[Sequence[float], Sequence[int],
                                                               Sequence[TokenRequest], int]],
                       usable: Sequence[float], policy: str, delay_ms: float,
                       min_forwards: int = FORWARD_MIN_FORWARDS) -> SimSetup:
    """`setup` with `forward_cpu_s` from measured runs under `policy` at `delay_ms`, each
    (per-peer utilisation, forwards per entry, the arrivals it sent, its seed), simulated
    on `setup` without any forward residual."""
    plain = replace(setup, forward_cpu_s=0.0)
    samples = [ForwardSample(measured=util,
                             simulated=predict(plain, policy, delay_ms, workload,
                                               seed).peer_utilization,
                             forwards=forwards,
                             window_s=measured_window(workload, setup.warmup_requests))
               for util, forwards, workload, seed in runs]
    return replace(setup, forward_cpu_s=forward_cpu(samples, usable, min_forwards))


def setup_from_result(result: dict[str, Any]) -> SimSetup:
    """`testbed_setup` of a bench.testbed result file's params and calibration."""
    params = result["params"]
    names = {f.name for f in fields(Calibration)}
    calibrations = [Calibration(**{k: v for k, v in c["calibration"].items() if k in names})
                    for c in result["calibration"]]
    gossip = result.get("gossip_cost")
    return testbed_setup(calibrations, [float(c.get("background_cores", 0.0))
                                        for c in result["calibration"]],
                         params["shares"], bool(params.get("isolated", True)),
                         int(params["capacity_blocks"]), float(params["summary_interval_s"]),
                         int(params.get("warmup_requests", 0)),
                         GossipCost(**gossip) if gossip else None,
                         # runs before the period was a setting ran at the kernel's
                         float(params.get("cfs_period_ms", DEFAULT_PERIOD_S * 1e3)) / 1e3)


@dataclass(frozen=True)
class Prediction:
    ttft_mean_s: float
    busiest_peer_utilization: float
    hit_ratio: float
    forwarded_fraction: float
    # per peer (bed order), as the testbed's rows give them measured: where the simulated
    # policy sent the measured requests, and each peer's utilisation
    served_per_peer: tuple[int, ...] = ()
    peer_utilization: tuple[float, ...] = ()
    # per peer, its own (prefill, decode) tokens/s at the end, as it advertised them
    advertised: tuple[tuple[float, float], ...] = ()
    # per entry peer, as the rows give them measured (bench/testbed/routes.py `by_entry`)
    per_entry: dict[str, Any] = field(default_factory=dict)


def predict(setup: SimSetup, policy: str, delay_ms: float, workload: Sequence[TokenRequest],
            seed: int) -> Prediction:
    """One simulated run of `workload`, its first `setup.warmup_requests` not measured,
    each request entering at the peer the testbed sends it to (`entry_peers`)."""
    params = setup.params(policy, delay_ms, seed)
    if setup.warmup_requests:
        if setup.warmup_requests >= len(workload):
            raise ValueError(f"a warm-up of {setup.warmup_requests} leaves nothing of "
                             f"{len(workload)} requests to measure")
        # int(n * fraction) is the first measured request (Simulator._warmup)
        fraction = (setup.warmup_requests + 0.5) / len(workload)
        params = replace(params, warmup_fraction=fraction)
    sim = Simulator(params, workload, entry_peers(seed, len(workload), params.peers))
    result = sim.run()
    utilization = peer_utilization(setup, sim)
    return Prediction(result.metrics["ttft_mean_s"], max(utilization, default=math.nan),
                      result.metrics["hit_ratio"], result.metrics["forwarded_fraction"],
                      tuple(p.served_after_warmup for p in sim.peers), utilization,
                      tuple((round(p.prefill_tps, 1), round(p.decode_tps, 1))
                            for p in sim.peers),
                      by_entry(simulated_routes(setup, sim), len(sim.peers)))


def simulated_routes(setup: SimSetup, sim: Simulator) -> list[Routed]:
    """The simulated run's measured requests as `by_entry` reads them, each TTFT as the
    client sees it (over its entry's client path, as the simulator's own mean counts it)."""
    return [Routed(j.entry, j.target, len(j.tokens), j.cached,
                   j.ttft + sim.peers[j.entry].cal.client_path_s)
            for j in sim.measured_jobs() if not math.isnan(j.ttft)]


def peer_utilization(setup: SimSetup, sim: Simulator) -> tuple[float, ...]:
    """Each peer's CPU over its share in the measured window, as the testbed reads it:
    its idle background plus the simulated busy fraction of the rest (empty when the
    window is empty)."""
    start, end = sim.busy_window
    window = end - start
    if window <= 0:
        return ()
    backgrounds = setup.backgrounds or (0.0,) * len(sim.peers)
    return tuple(b + (1.0 - b) * p.busy_in_window_s / window
                 for b, p in zip(backgrounds, sim.peers, strict=True))


def rate_for_utilization(
    setup: SimSetup, target: float, make_workload: Callable[[float], list[TokenRequest]],
    lo: float = 0.5, hi: float = 200.0, steps: int = 12, policy: str = "local",
) -> tuple[float, float]:
    """(rate, simulated busiest utilisation) nearest `target` by bisection on the rate."""
    best = (lo, 0.0)
    for _ in range(steps):
        rate = (lo * hi) ** 0.5
        util = predict(setup, policy, 0.0, make_workload(rate), seed=0).busiest_peer_utilization
        best = (rate, util)
        if util < target:
            lo = rate
        else:
            hi = rate
    return best
