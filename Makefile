# sluice — the two Quickstart commands (`make run`, `make test`) and their setup.
# Both create .venv and install pinned dependencies on first use; re-running is a no-op.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONSTRAINTS := constraints/cpu.txt
STAMP := $(VENV)/.sluice-installed

.PHONY: run test lint format typecheck unit integration venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c $(CONSTRAINTS) "torch==2.13.0"
	$(BIN)/pip install --quiet --disable-pip-version-check -c $(CONSTRAINTS) -e ".[dev]"
	@$(BIN)/python -c "import torch, sys; v = torch.__version__; print('torch', v); sys.exit(0 if v.startswith('2.13.0') else 'wrong torch: ' + v)"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/sluice train $(ARGS)

test: $(STAMP) lint typecheck
	$(BIN)/pytest tests

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks examples
	$(BIN)/ruff check --fix src tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy src/sluice/api src/sluice/controller src/sluice/trainer src/sluice/queue

unit: $(STAMP)
	$(BIN)/pytest tests/unit

integration: $(STAMP)
	$(BIN)/pytest tests/integration

clean:
	rm -rf $(VENV) .cache runs
