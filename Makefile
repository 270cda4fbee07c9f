# Two commands do everything on a fresh machine:
#   make demo   the whole stack (collector, dashboard, 4-rank CPU training run)
#   make test   lint, the type check and the whole test suite
#   make test-fast   the tests that start no processes (under 2 minutes; see CONTRIBUTING.md)
# Both create .venv if it is missing and install what they need into it: the demo only the
# package and torch, the tests their extras too; `make test` also installs the Debian
# packages the alerting and browser tests need (system-deps).
#   make demo COLLECTOR_PORT=9000 DASHBOARD_PORT=9501   other ports

PYTHON ?= python3
VENV ?= .venv
# Installed only when torch is not importable; a user's existing torch is never replaced.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.trainvitals-installed
DEMO_STAMP := $(VENV)/.trainvitals-demo-installed
# `make test` runs the suite in this many pytest processes, a test file to each at a time
# (`--dist loadfile`: a file's module fixtures, often a real training run, start once).
# Two, not one per core: the multi-process tests each start 4-5 processes, and on 2 cores
# most of the gain is one file's waits (process start-up, a collector's first answer,
# heartbeats) overlapping another's work. Fresh-clone CI here: pytest 25:33 in one
# process, 15:23-17:03 in two.
TEST_WORKERS ?= 2
COLLECTOR_PORT ?= 8000
DASHBOARD_PORT ?= 8501

.PHONY: install system-deps demo test test-fast lint typecheck clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# What the demo runs, without the test extras (playwright, schemathesis, mypy...).
$(DEMO_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e .
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/trainvitals demo --collector-port $(COLLECTOR_PORT) --dashboard-port $(DASHBOARD_PORT)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

system-deps:
	bash scripts/install-system-deps.sh

test: lint typecheck system-deps
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile

test-fast: install
	$(BIN)/pytest -m "not slow"

typecheck: install
	$(BIN)/python scripts/typecheck.py

clean:
	rm -rf $(VENV) demo-data .pytest_cache .ruff_cache .mypy_cache build/typecheck
