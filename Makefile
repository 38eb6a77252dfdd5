# vlmrl: `make train` (installs what is missing, then runs the embedded default), `make test`
# (the CPU suite) and `make test-fast` (its unit tier, for a quick check while editing).
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.vlmrl-installed
# CPU machines take the local CPU build of torch; machines with a GPU keep whatever torch
# they have (or set TORCH_SPEC, e.g. TORCH_SPEC='torch==2.11.0').
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.6" || echo "torch==2.13.0")
PYTEST_ARGS ?=
ARGS ?=
# pytest-xdist workers for the CPU suite, a test file at a time per worker (a file's module
# fixtures, such as the learning run, are built once) in collection order, the longest files
# first (tests/conftest.py; xdist's own order, most tests first, left the learning run's file
# for last), each worker and the processes it starts pinned to its own cores. Wall times on two
# cores: bench/results/suite.md. TEST_WORKERS=0 runs it in one process. On a machine with a GPU
# the tests share one device, so they run in one process there.
TEST_WORKERS ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 0 || echo 2)
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: help setup train test test-fast test-all check-wheel lint bench plan sglang-contract clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# torch first, so the project's range is already satisfied and pip never pulls a CUDA build
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP) ## create .venv and install vlmrl with its dev tools (seconds when already done)

# Bytecode of the project's own files, written here because Python does not write it where
# PYTHONDONTWRITEBYTECODE is set (pip compiles the installed packages; an editable install's
# sources it leaves alone): without it every process a run or the suite starts (trainer
# ranks, engines, reward workers, spawned test ranks) compiles vlmrl again, about 1 s each.
# Only files changed since the last compile are compiled again.
.PHONY: bytecode
bytecode: setup
	@PYTHONDONTWRITEBYTECODE= $(PY) -m compileall -q vlmrl tests >/dev/null

train: bytecode ## run the embedded default end to end (tiny model, procedural task, CPU); ARGS='key=value ...'
	$(PY) -m vlmrl.train $(ARGS)

test: bytecode ## the CPU test suite (GPU tests skip without CUDA, slow ones are left out)
	$(PY) -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

# the unit tier alone: pure functions and single-process checks (no Ray, no trainer ranks, no
# loop run), for a quick check while editing; `make test` runs these too. Its wall time on two
# cores is in bench/results/suite.md.
test-fast: bytecode ## the unit tier only (tests/unit), under 3 minutes on two cores
	$(PY) -m pytest tests/unit -m "not slow" $(XDIST) $(PYTEST_ARGS)

test-all: bytecode ## every test, slow ones included
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# the wheel, installed outside the checkout with only what the dry-run path imports (Hydra,
# OmegaConf): its configs must compose from the package alone
WHEEL_CHECK ?= /tmp/vlmrl-wheel-check
check-wheel: setup ## build the wheel, install it in a fresh venv outside the checkout, compose configs there
	@rm -rf $(WHEEL_CHECK) && mkdir -p $(WHEEL_CHECK)
	$(PY) -m pip wheel -q --no-deps -w $(WHEEL_CHECK)/dist . && rm -rf build
	$(PYTHON) -m venv $(WHEEL_CHECK)/venv
	$(WHEEL_CHECK)/venv/bin/pip install -q "hydra-core>=1.3.2,<1.4" "omegaconf>=2.3,<2.4"
	$(WHEEL_CHECK)/venv/bin/pip install -q --no-deps $(WHEEL_CHECK)/dist/vlmrl-*.whl
	cd $(WHEEL_CHECK) && venv/bin/vlmrl-train --cfg job experiment=geo3k_qwen35 parallel.tp=4 hardware=b200 \
		| grep -q "name: qwen3_5_35b_a3b"
	cd $(WHEEL_CHECK) && venv/bin/vlmrl-train -m reward=math,geo3k_tol05,geo3k_strict dry_run=true \
		| grep -c "# dry run: valid" | grep -qx 3
	@# the folder put on SGLang's PYTHONPATH declares vlmrl's SGLang plugin from the installed wheel too
	cd $(WHEEL_CHECK) && PYTHONPATH=$$(venv/bin/python -c "from vlmrl.rollout.sglang_plugin import PLUGIN_DIR; print(PLUGIN_DIR)") \
		$(PYTHON) -I -c "import sys, os; sys.path[:0] = os.environ['PYTHONPATH'].split(':'); \
		from importlib.metadata import entry_points; \
		assert [e.value for e in entry_points(group='sglang.srt.plugins')] == ['vlmrl_sglang_hooks:register']"
	@echo "check-wheel: the installed wheel composes its configs outside the checkout"

lint: setup ## ruff
	$(VENV)/bin/ruff check vlmrl tests

bench: setup ## benchmarks; results land in bench/results/ with the command that produced them
	$(PY) -m vlmrl.bench $(ARGS)

plan: setup ## print the rank layout and memory estimate: make plan ARGS='experiment=geo3k_qwen35'
	$(PY) -m vlmrl.plan $(ARGS)

# the SGLang release whose pair of files (contract + flag list) `make sglang-contract` writes into
# vlmrl/contracts/; default: the newest release there (make sglang-contract SGLANG_VERSION=0.5.24)
SGLANG_VERSION ?= $(shell ls vlmrl/contracts/ | sed -n 's/^sglang-\(.*\)\.json$$/\1/p' | sort -V | tail -n 1)

sglang-contract: setup ## write vlmrl/contracts/sglang-$(SGLANG_VERSION).{json,flags.txt} from that SGLang wheel (downloaded)
	@test -n "$(SGLANG_VERSION)" || { echo "set SGLANG_VERSION=x.y.z" >&2; exit 2; }
	@d=$$(mktemp -d) && trap 'rm -rf "$$d"' EXIT && \
	$(PY) -m pip download -q --no-deps "sglang==$(SGLANG_VERSION)" -d "$$d" && \
	$(PY) -m vlmrl.rollout.sglang flags --source "$$d"/sglang-*.whl \
		--out vlmrl/contracts/sglang-$(SGLANG_VERSION).flags.txt && \
	$(PY) -m vlmrl.rollout.sglang contract --source "$$d"/sglang-*.whl \
		--out vlmrl/contracts/sglang-$(SGLANG_VERSION).json

clean: ## remove the virtualenv and caches (runs/ is kept)
	rm -rf $(VENV) .pytest_cache .ruff_cache
