#!/usr/bin/env bash
# Every GPU check that needs no vLLM, in one run on a machine with one NVIDIA GPU and a CUDA PyTorch:
# the Triton kernels against their references (gpu_kernels.sh), then the FSDP2 trainer at Kimi K3 drafter
# sizes (gpu_train_check.sh). Made for a bare GPU image with no package index: draftsmith is installed
# in editable mode without its dependencies, and pydantic comes from wheels in `.whl/` when the image
# lacks it (see gpu_train_check.sh for the download line).
#
#   bash benchmarks/gpu_check.sh            # ~6 minutes on an H200
#
# Environment: PYTHON (default python3), OUT (logs and the JSON lines are copied there), KERNEL_BUDGET_S
# (150), TRAIN_BUDGET_S (150), KERNEL_T (rows of the kernel cases, 8192), KERNEL_OPS (all four), TRAIN_SEQ
# (4096), TRAIN_FAMILIES (all three).
# Exit status: the first failing check's, after both have run.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
export PYTHON=$PY PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$OUT"
export OUT

"$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
"triton", triton.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'
if ! "$PY" -c 'import draftsmith.core' 2>/dev/null; then
  if ! "$PY" -c 'import pydantic' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    SITE=$(mktemp -d /tmp/gpu_check_site.XXXXXX)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
    || { echo "gpu_check: editable install failed:" >&2; tail -n 20 "$OUT/install.log" >&2; exit 2; }
fi

status=0
echo "== kernels"
CHECK_TIMEOUT=$(( ${KERNEL_BUDGET_S:-150} + 120 )) bash benchmarks/gpu_kernels.sh \
  --budget-s "${KERNEL_BUDGET_S:-150}" --T "${KERNEL_T:-8192}" \
  --ops "${KERNEL_OPS:-head_eagle3,head_dspark,rms_norm,dyn_conv}" || status=$?
echo "== trainer"
CHECK_TIMEOUT=$(( ${TRAIN_BUDGET_S:-150} + 120 )) bash benchmarks/gpu_train_check.sh \
  --budget-s "${TRAIN_BUDGET_S:-150}" --seq "${TRAIN_SEQ:-4096}" --families "${TRAIN_FAMILIES:-eagle3,dflash2,dspark}" \
  || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true
exit "$status"
