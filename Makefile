# Two commands do everything on a fresh machine:
#   make demo   the whole stack (collector, dashboard, 4-rank CPU training run)
#   make test   lint, the type check and the whole test suite
#   make test-fast   the tests that start no processes (under 2 minutes; see CONTRIBUTING.md)
# Both create .venv if it is missing and install what they need into it; `make test` also
# installs the Debian packages the alerting and browser tests need (system-deps).

PYTHON ?= python3
VENV ?= .venv
# Installed only when torch is not importable; a user's existing torch is never replaced.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.trainvitals-installed

.PHONY: install system-deps demo test test-fast lint typecheck clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/trainvitals demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

system-deps:
	bash scripts/install-system-deps.sh

test: lint typecheck system-deps
	$(BIN)/pytest

test-fast: install
	$(BIN)/pytest -m "not slow"

typecheck: install
	$(BIN)/python scripts/typecheck.py

clean:
	rm -rf $(VENV) demo-data .pytest_cache .ruff_cache .mypy_cache build/typecheck
