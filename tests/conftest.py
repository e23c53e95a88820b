"""Shared fixtures.

tiny_model          (session) the `tiny-random` LoadedModel (2-layer random Llama with the
                    SmolLM2 tokenizer), loaded once per test session.
tiny_engine_factory (session) `make(cache_bytes=TINY_CACHE_BYTES, block_size=16,
                    cache_generated=False) -> Engine`: a fresh Engine with its own empty
                    cache, sharing the one tiny model. Engines are cheap: build one per test.
tiny_engine         (function) `tiny_engine_factory()` with the defaults.
runners             (function) a peer.processes supervisor for children started from the
                    repository root; they all stop when the test ends.
"""

import logging
import os
from pathlib import Path

import pytest
from hypothesis import settings

# No per-example deadline: on this 2-core machine under `make test`'s two workers a
# 200 ms budget fails examples that a busy CPU slowed, not ones that are wrong (seen:
# parse_evidence). Speed is the benches' business; tests assert behaviour.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
# Torch's (and numpy's) threads: this process's share of the cores, set before torch
# loads (always: a worker inherits the xdist controller's). `make test` runs two workers;
# their default OpenMP threads, and those of the peer processes their tests start (which
# inherit these), would spin on every core against each other (peer/processes.py does the
# same for peer processes): under -n 2 on 2 cores a 1 s engine test took 30 s.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_name] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

TINY_CACHE_BYTES = 8 << 20  # 1024 tiny-random blocks of 16 tokens: room for every test prompt

# The longest tests (tens of seconds each, mostly waiting on processes and sockets) run
# first: under `make test`'s two workers the NAT test (~75-100 s) then overlaps the rest
# of the suite instead of starting last and setting the wall time alone.
LONGEST_FIRST = (
    "tests/test_bench_reach.py",
    "tests/test_cli.py",
    "tests/test_pipeline_processes.py",
    "tests/test_swarm_processes.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = item.nodeid.split("::", 1)[0]
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the rest keeps its order


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """A test that sets up logging (the CLI does) must not leave a handler bound to a
    captured stream pytest closes: later tests' log lines would fail to print."""
    root = logging.getLogger()
    level, before = root.level, set(root.handlers)
    yield
    root.setLevel(level)
    for handler in list(root.handlers):  # pytest's own capture handlers come and go itself
        if handler not in before and not type(handler).__module__.startswith("_pytest"):
            root.removeHandler(handler)


@pytest.fixture(scope="session")
def tiny_model():
    from peer.engine.model import load_model

    return load_model("tiny-random")


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_model):
    from peer.engine.engine import Engine

    def make(cache_bytes=TINY_CACHE_BYTES, block_size=16, cache_generated=False):
        return Engine.from_model(
            tiny_model, cache_bytes=cache_bytes, block_size=block_size,
            cache_generated=cache_generated,
        )

    return make


@pytest.fixture
def tiny_engine(tiny_engine_factory):
    return tiny_engine_factory()


@pytest.fixture
async def runners():
    from peer.processes import open_peer_processes

    async with open_peer_processes(cwd=Path(__file__).resolve().parent.parent) as procs:
        yield procs
