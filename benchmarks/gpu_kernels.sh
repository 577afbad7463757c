#!/usr/bin/env bash
# The Triton kernels (kernels/) against their PyTorch references and torch.compile of those, on one GPU at
# Kimi K3 shapes (H 7168, V 163840, T 8192, bf16): forward + backward time, peak memory and parity for the
# fused head loss (EAGLE-3 and DSpark forms), the 3-tap RMSNorm and DFlash2's dynamic conv.
#
#   bash benchmarks/gpu_kernels.sh [driver args]     # e.g. --ops head_eagle3 --T 4096
#   bash benchmarks/gpu_kernels.sh --smoke           # CPU, TRITON_INTERPRET=1, tiny shapes (CI's smoke test)
#
# The driver (benchmarks/workers/gpu_kernels.py) needs only torch and triton (CUDA builds of torch bring triton) and this
# repository's `kernels` package. Prints one line per op and implementation, a markdown table, whether the
# head-loss goal (>= 2x less memory than the compiled reference at equal or better speed) is met, and a JSON
# line; exit status 1 if a case failed, missed parity or was skipped for time (--budget-s, default 420 s).
#
# Environment: PYTHON (default: .venv/bin/python here, python elsewhere), OUT (if set, the log is copied to
# $OUT/gpu_kernels.log), CHECK_TIMEOUT (s, default 540: the whole driver run).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python; fi
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
for arg in "$@"; do
  # The interpreter must be on before triton's first import.
  if [ "$arg" = "--smoke" ]; then export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""; fi
done
if [ -x "$(command -v nvidia-smi)" ] && [ -z "${TRITON_INTERPRET:-}" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi

LOG=$(mktemp /tmp/gpu_kernels.XXXXXX.log)
status=0
# As a module from the root: run as a script, benchmarks/ would head sys.path and benchmarks/tokenize_stage.py
# would shadow the stdlib module.
timeout "${CHECK_TIMEOUT:-540}" "$PYTHON" -m benchmarks.workers.gpu_kernels "$@" 2>&1 | tee "$LOG" || status=$?
if [ -n "${OUT:-}" ]; then cp "$LOG" "$OUT/gpu_kernels.log"; fi
rm -f "$LOG"
exit "$status"
