"""The simulator keeps no copy of a peer's constant or rule: it imports them, and these
tests fail the day one is copied or drifts (one copy of every decision)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import bench.sim.gossip_model as sim_gossip
import bench.sim.routing_model as sim_routing
import bench.sim.server_model as sim_server
import bench.sim.swarm_state as sim_state
from bench.sim.calibration import NOTES_CALIBRATION, Calibration
from bench.sim.params import SimParams
from peer import config
from peer.engine import scheduler, speeds
from peer.routing import cost as ranking

SIM_DIR = Path(__file__).resolve().parents[1] / "bench" / "sim"

# Module-level numbers bench/sim may hold: the simulator's own, none a peer's.
SIMULATOR_OWN = {
    "NOMINAL_PROMPT_TOKENS",  # where a nominal prefill speed is quoted (reports only)
    "PY_LIBP2P_CPU_S_PER_MESSAGE",  # an experiment's measured input (docs/RESULTS.md)
    # Ring mode's provider lookup as the simulator models it (the live shell has none yet).
    "PROVIDER_HOMES",
    "LOOKUP_REQUEST_BYTES",
    "PROVIDER_RECORD_BYTES",
    "_PROVIDER_TTL_S",
    # Regimes and workloads: what is simulated, not how a peer decides.
    "ENGINE_JSON",
    "GPU_CALIBRATION",
    "MIXED_GPU_EVERY",
    "MIXED_SLOW_FACTOR",
    "MULTI_TURN_CAPACITY_BLOCKS",
    "SIM_SEED_OFFSET",
    "TURNS_PER_SESSION",
    "QUICK_LOADS",
    "QUICK_GPU_LOADS",
    "QUICK_MIN_RUN_S",  # how long a grid run lasts: the experiment's, not a peer's
    "GREEDY",
    # The machine a testbed peer runs on: the kernel's CFS period, float slack, and how
    # many periods' throttling is remembered (quota.py).
    "DEFAULT_PERIOD_S",
    "_EPS",
    "KEPT_PERIODS",
    # The evaluation's targets over result rows (bench/sim/checks.py): claims, not rules.
    "BUSY",
    "BUSY_ORACLE_RATIO",
    "HELD_OUT_MEAN_RATIO",
    "HELD_OUT_SEED_RATIO",
}


def _module_numbers(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(
            isinstance(n, ast.Constant) and type(n.value) in (int, float) for n in ast.walk(value)
        ):
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def test_the_simulator_defines_no_numbers_of_its_own_but_these() -> None:
    """A number written into bench/sim must be the simulator's own, and listed above."""
    event_kinds = {"ARRIVE", "DELIVER", "PHASE", "TICK", "SUMMARY", "FIRST_BACK", "END_BACK",
                   "VERDICT"}
    found: set[str] = set()
    for path in sorted(SIM_DIR.glob("*.py")):
        found |= _module_numbers(path)
    assert found - event_kinds <= SIMULATOR_OWN, found - event_kinds - SIMULATOR_OWN


def test_sim_params_defaults_are_the_peers() -> None:
    p = SimParams()
    assert p.max_running is scheduler.DEFAULT_MAX_RUNNING
    assert p.step_tokens is scheduler.DEFAULT_STEP_TOKENS
    assert p.block_size is config.DEFAULT_BLOCK_SIZE
    assert p.summary_interval_s is config.DEFAULT_SUMMARY_INTERVAL_S
    assert p.bloom_fp_rate is config.DEFAULT_BLOOM_FP_RATE
    assert p.model_id is config.DEFAULT_MODEL
    assert p.forward_setup_rtts + 1 == ranking.ROUND_TRIPS_PER_FORWARD
    assert p.stream_setup_rtts == ranking.STREAM_SETUP_ROUND_TRIPS
    assert not {"evict_slack_fraction"} & {f.name for f in dataclasses.fields(SimParams)}


def test_the_server_model_and_the_cost_model_share_the_batch_slope() -> None:
    assert Calibration().batch_step_slope is ranking.BATCH_STEP_SLOPE
    assert NOTES_CALIBRATION.batch_step_slope is ranking.BATCH_STEP_SLOPE


def test_the_simulator_uses_the_engines_own_rules() -> None:
    """Names the simulator takes from the engine's pure modules are those very objects."""
    assert sim_state.BatchQueue is scheduler.BatchQueue
    assert sim_routing.reusable_tokens is scheduler.reusable_tokens
    assert sim_server.reusable_blocks is scheduler.reusable_blocks
    assert sim_server.observe_step is speeds.observe_step
    assert sim_state.WARMUP_PROMPT_TOKENS is speeds.WARMUP_PROMPT_TOKENS
    assert sim_state.warmup_max_prompt_tokens is speeds.warmup_max_prompt_tokens
    assert sim_routing.single_stream_decode is ranking.single_stream_decode


def test_the_simulator_builds_its_routers_as_the_live_peer_does() -> None:
    from peer.request import serving
    from peer.routing import router

    assert sim_state.build_router is router.build_router is serving.build_router
    assert not [p.name for p in SIM_DIR.glob("*.py") if "Router(" in p.read_text()]


def test_the_simulator_batches_with_the_engines_state_machine() -> None:
    """Each simulated peer's batch is a BatchQueue, admitted and planned by its methods as
    BatchLoop does (peer/engine/batch.py); bench/sim admits and plans nothing by itself."""
    assert "self.queue: BatchQueue[Job] = BatchQueue()" in inspect.getsource(sim_state.SimPeer)
    step_src = inspect.getsource(sim_server.ServerModel._step)
    assert "peer.queue.admit(" in step_src and "peer.queue.plan(" in step_src
    sim_src = "".join(p.read_text() for p in sorted(SIM_DIR.glob("*.py")))
    for own in ("plan_step(", "admit_count(", "popleft(", "deque("):
        assert own not in sim_src, own


def test_the_simulator_decides_probes_as_the_pipeline_does() -> None:
    """Rank -> probe -> rerank is one decision (peer/routing/decide.py next_step), called by
    the live pipeline and the simulator; neither plans or reranks a probe by itself."""
    from peer.request import pipeline
    from peer.routing import decide

    assert sim_routing.next_step is decide.next_step is pipeline.next_step
    assert sim_routing.ProbeFirst is decide.ProbeFirst
    probe_src = inspect.getsource(sim_routing.RoutingModel._probe_choice)
    assert "next_step(" in probe_src
    sim_src = "".join(p.read_text() for p in sorted(SIM_DIR.glob("*.py")))
    assert "plan_probes(" not in sim_src
    # the one what-if that reranks by itself: exact load, no probe (COST_EXACT_LOAD)
    reranks = [
        node.name
        for node in ast.walk(ast.parse((SIM_DIR / "routing_model.py").read_text()))
        if isinstance(node, ast.FunctionDef) and ".rerank(" in ast.unparse(node)
    ]
    assert reranks == ["_exact_load_choice"], reranks
    pipeline_src = inspect.getsource(pipeline)
    assert "next_step(" in pipeline_src and ".rerank(" not in pipeline_src


def test_the_engine_uses_the_same_rules() -> None:
    """The engine's module calls the pure rules the simulator calls (read from its source:
    importing it needs torch, which this check does not)."""
    root = SIM_DIR.parents[1] / "peer" / "engine"
    engine_src = (root / "engine.py").read_text() + (root / "batch.py").read_text()
    assert "BatchQueue(" in engine_src  # its batch state machine (pure) admits and plans
    engine_src += inspect.getsource(scheduler.BatchQueue)
    for name in ("plan_step", "admit_count", "reusable_tokens", "reusable_blocks",
                 "observe_step", "warmup_max_prompt_tokens"):
        assert f"{name}(" in engine_src, name
    warmup_src = (root / "warmup.py").read_text()
    assert "from .speeds import WARMUP_PROMPT_TOKENS" in warmup_src
    assert "WARMUP_PROMPT_TOKENS =" not in warmup_src


def test_the_simulator_and_the_gossip_shell_drive_one_publish_policy() -> None:
    """When to publish (PublishPolicy) and the filter sent (CacheFilter): one object each."""
    from peer.swarm import gossip

    assert sim_state.PublishPolicy is gossip.PublishPolicy
    assert sim_state.CacheFilter is gossip.CacheFilter
    for module in (sim_state, sim_gossip):
        assert not hasattr(module, "GOSSIP_CHANGE_FRACTION")
