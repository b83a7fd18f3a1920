# kfac-bench developer entry points. Every target sets up .venv on first use (no manual step).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP_INSTALL := $(BIN)/pip install --disable-pip-version-check -q -c constraints.txt
# uv installs the same constraints faster than pip (parallel downloads and unpacking of torch's CUDA
# wheels); pip does it where uv cannot be installed.
UV_INSTALL  := $(BIN)/uv pip install -q --python $(BIN)/python -c constraints.txt
# Bytecode. Where PYTHONDONTWRITEBYTECODE is set (CI images, containers), every process would compile what it
# imports, again: each rank and CLI run of the suite would compile torch. The targets below run with it unset
# (the venv and the tree's __pycache__ are this project's own, as pip's install-time compile is), so each
# module compiles once, in whichever process imports it first, rather than every module of every package
# at install time. make setup imports what a run and the suite's workers import (WARM) so that the two
# workers do not both compile torch at start-up.
unexport PYTHONDONTWRITEBYTECODE
WARM := torch._dynamo kfac_bench.cli kfac_bench.train.run kfac_bench.models.bert kfac_bench.models.bert_qa
# pytest-xdist workers (0: one process). Whole test files go to one worker (--dist loadfile), so a module's
# fixtures (the BERT and SQuAD smoke chains) are built once; most tests wait on subprocesses or sleep.
# Files go out in collection order, the end-to-end ones first (tests/conftest.py), not xdist's most-tests-first.
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder
MYPY   := $(BIN)/mypy kfac_bench benchmarks

.DEFAULT_GOAL := help
.PHONY: help setup train test test-fast test-slow test-slurm ruff lint format bench gpu-check clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	{ $(PIP_INSTALL) uv && $(UV_INSTALL) -e ".[dev]"; } || $(PIP_INSTALL) -e ".[dev]"
	$(BIN)/python -c 'import importlib; [importlib.import_module(m) for m in "$(WARM)".split()]'
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install kfac-bench (editable) with its dev extra

train: $(STAMP)  ## run the main job: digits CNN, SGD vs SGD + K-FAC x 16 seeds, then the comparison (CPU, ~60 s)
	$(BIN)/kfac-bench demo

ruff: $(STAMP)  ## ruff: lint and format check
	$(BIN)/ruff check kfac_bench tests benchmarks
	$(BIN)/ruff format --check kfac_bench tests benchmarks

lint: ruff  ## ruff (lint + format check) and mypy on the library and benchmarks/
	$(MYPY)

test-fast: $(STAMP)  ## the inner loop: no lint, no end-to-end (slow) or multi-process (distributed) tests
	$(PYTEST) -m "not slow and not distributed and not gpu"

test-slow: $(STAMP)  ## the end-to-end (slow) and multi-process (distributed) tests
	$(PYTEST) -m "(slow or distributed) and not gpu"

test-slurm: $(STAMP)  ## the slurm tests on a single-node SLURM they start (as root: installs slurm-wlm, munge)
	.ci/slurm-install
	$(BIN)/python -m pytest -v -m slurm --durations=5 tests/harness/test_slurm.py

test: ruff  ## lint and the whole suite but the GPU tests: test-fast and test-slow (PYTEST_WORKERS=2)
	@# mypy (about 30 s of one core without its cache, as in a clean clone) checks beside the suite, not before it;
	@# its report follows the suite's, and either failing fails the target.
	$(MYPY) > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	$(PYTEST) -m "not gpu" --durations=15; tests=$$?; \
	wait $$mypy; typed=$$?; echo "$(MYPY):"; cat $(VENV)/mypy.log; \
	exit $$(( tests != 0 || typed != 0 ))

bench: $(STAMP)  ## K-FAC overhead benchmark (CPU): step-time ratios K-FAC/SGD by stage, then compute ops per step by stage; ARGS=--quick: a smoke run
	$(BIN)/python -m benchmarks.overhead $(ARGS)

gpu-check: $(STAMP)  ## GPU readiness check on one CUDA device (~5 min) -> gpu-report.json/.md, gpu-profile.yaml (a plan profile); ARGS=--dry-run: CPU rehearsal
	$(BIN)/python -m benchmarks.gpu $(ARGS)

format: $(STAMP)  ## apply ruff's formatter and import sorting
	$(BIN)/ruff check --fix kfac_bench tests benchmarks
	$(BIN)/ruff format kfac_bench tests benchmarks

clean:  ## remove the virtual environment and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
