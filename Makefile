# Two commands set everything up: `make run` and `make test`. Both create .venv on first use.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RECIPE ?= deployments/recipes/smollm2-cpu-eagle3.yaml
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test bench lint setup clean-runs

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first and pinned: the CPU wheel lies on disk; anything unpinned pulls CUDA builds.
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import draftsmith, prefect, transformers, safetensors"
	touch $@

setup: $(BIN)/.installed
	$(BIN)/draftsmith setup-target

run: setup
	$(BIN)/draftsmith run $(RECIPE)

test: setup
	$(BIN)/python -m pytest tests

bench: setup
	@for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean-runs:
	rm -rf runs
