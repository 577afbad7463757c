#!/usr/bin/env bash
# The FSDP2 trainer on one GPU at Kimi K3 drafter sizes: NCCL, FSDP2 bf16/fp32, fused AdamW, torch.compile and
# tokens/s / peak memory / MFU for eagle3 (MLA), dflash2 and dspark, eager then compiled.
#
#   bash benchmarks/gpu_train_check.sh [driver args]      # e.g. --families eagle3 --seq 8192
#   bash benchmarks/gpu_train_check.sh --smoke            # CPU, gloo, toy widths (what CI's smoke test runs)
#
# The driver (benchmarks/workers/gpu_train_check.py) needs only torch, transformers, safetensors, fsspec, PyYAML
# and pydantic (draftsmith.drafters.training + draftsmith.core.config; no Prefect, no vLLM). If pydantic cannot be imported
# and the repository's `.whl/` folder holds its wheels (pydantic, pydantic-core, annotated-types,
# typing-inspection, typing-extensions; ~2.8 MB), they are installed into a scratch folder first. Prints one
# line per check and case, a markdown table and a JSON line; exit status 1 if anything failed or was skipped
# for time (the driver stops starting cases after --budget-s, default 300 s, eager cases first).
#
# Environment: PYTHON (default: .venv/bin/python here, python3 elsewhere), OUT (if set, the log is copied
# to $OUT/gpu_train_check.log), CHECK_TIMEOUT (s, default 480: the whole driver run).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if ! "$PYTHON" -c 'import pydantic' 2>/dev/null; then
  if ! ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    echo "gpu_train_check: $PYTHON cannot import pydantic and $ROOT/.whl holds no wheels (download them into .whl/ as this header says)" >&2
    exit 2
  fi
  SITE=$(mktemp -d /tmp/gpu_train_check_site.XXXXXX)
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$ROOT"/.whl/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -x "$(command -v nvidia-smi)" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi

LOG=$(mktemp /tmp/gpu_train_check.XXXXXX.log)
status=0
timeout --kill-after=20 "${CHECK_TIMEOUT:-480}" "$PYTHON" -m benchmarks.workers.gpu_train_check "$@" 2>&1 | tee "$LOG" \
  || status=$?
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then cp "$LOG" "$OUT/gpu_train_check.log"; fi
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
  echo "gpu_train_check: the driver ran past CHECK_TIMEOUT=${CHECK_TIMEOUT:-480}s and was killed" >&2
fi
exit "$status"
