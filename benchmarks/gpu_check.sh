#!/usr/bin/env bash
# The GPU check: at most 8 minutes on one H200, bf16. Writes its figures under $OUT (default ./gpu_out):
# gpu_results.md (the report), gpu_results.jsonl (every measurement, appended as taken) and gpu_check.log.
#
#   bash benchmarks/gpu_check.sh                      # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --device cpu --tiny  # the same stages with tiny widths on CPU (a test runs this)
#
# Wheels in ./.whl (made here by benchmarks/gpu_wheels.sh) are installed first into /tmp/site: the GPU image has
# torch (2.11, where the package pins 2.13: the check runs the image's) but not our trl/transformers versions. The
# versions it ran with, and which miss the package's pins, are recorded by benchmarks/gpu_versions.py. Each stage is
# a separate process under `timeout`, so one that hangs or runs out of memory does not stop the others, and each stage
# appends its figures as it goes.
set -u

OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
TOTAL_S="${GPU_CHECK_TOTAL_S:-450}"   # 7.5 min for everything, install included
# Multiplies every stage's budget (still capped by the time left): the CPU test of this script runs tiny stages whose
# work does not grow with the budget, on a machine whose load can make each take twice as long.
SCALE="${GPU_CHECK_BUDGET_SCALE:-1}"
START=$(date +%s)
EXTRA=("$@")
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1

log() { echo "[gpu_check $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
left() { echo $((TOTAL_S - ($(date +%s) - START))); }

log "start; OUT=$OUT; args: ${EXTRA[*]:-}"
SITE="${GPU_CHECK_SITE:-/tmp/site}"
WHEELS=()  # --site for benchmarks/gpu_versions.py when the wheels were installed
if [ "${GPU_CHECK_NO_WHEELS:-0}" != 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
    log "installing $(ls .whl/*.whl | wc -l) wheels from .whl into $SITE"
    PIP=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE")
    if ! timeout 120 "${PIP[@]}" .whl/*.whl >>"$LOG" 2>&1; then
        # One unsupported wheel fails the whole install: then install them one by one, keeping what works.
        log "WARNING: wheel install failed (see log); installing one by one"
        for w in .whl/*.whl; do timeout 60 "${PIP[@]}" "$w" >>"$LOG" 2>&1 || log "WARNING: could not install $w"; done
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    WHEELS=(--site "$SITE")
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, transformers, trl; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
    'transformers', transformers.__version__, 'trl', trl.__version__)" 2>&1 | tee -a "$LOG" ||
    log "ERROR: $PY cannot import torch/transformers/trl; the stages below will record the error"
# The versions this run resolves (the image's torch, the wheels' trl/transformers, any wheel that failed to install)
# against the package's pins: a `versions` record in gpu_results.jsonl, and a section appended to gpu_results.md.
"$PY" benchmarks/gpu_versions.py --out "$OUT" ${WHEELS[@]+"${WHEELS[@]}"} >>"$LOG" 2>&1 ||
    log "WARNING: could not record the versions (see log)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1

# stage NAME SECONDS ARGS...: one python stage with a time budget; the shell's timeout is the backstop.
stage() {
    local name=$1 budget=$(($2 * SCALE))
    shift 2
    local remaining
    remaining=$(left)
    if [ "$remaining" -lt 25 ]; then
        log "SKIP $name: ${remaining}s left"
        return
    fi
    [ "$budget" -gt $((remaining - 15)) ] && budget=$((remaining - 15))
    if [ "$budget" -lt 20 ]; then
        log "SKIP $name: budget ${budget}s"
        return
    fi
    log "stage $name (budget ${budget}s)"
    timeout --kill-after=10 $((budget + 30)) "$PY" benchmarks/gpu_check.py --out "$OUT" --budget-s "$budget" "$@" \
        "${EXTRA[@]}" 2>&1 | tee -a "$LOG"
    log "stage $name exit ${PIPESTATUS[0]}"
}

stage env 50 --stage env
# Issue 13's figure first: whole GRPO steps (generation + loss) of the Qwen3.6 slice at the largest P they fit.
stage whole_step 170 --stage whole_step --model qwen3_5
stage kernels 50 --stage kernels
stage bf16 60 --stage bf16
# The hybrid and MLA models' loss steps (a 32K detached step each at least: the GLM/Qwen per-token prefill ratio);
# the llama-family slice then takes whatever time is left.
stage qwen3_5 60 --stage model --model qwen3_5
stage glm_moe_dsa 60 --stage model --model glm_moe_dsa
stage llama $(($(left) - 30)) --stage model --model llama
timeout 60 "$PY" benchmarks/gpu_check.py --stage summary --out "$OUT" "${EXTRA[@]}" >>"$LOG" 2>&1
[ -f "$OUT/versions.md" ] && cat "$OUT/versions.md" >>"$OUT/gpu_results.md"
log "done; report: $OUT/gpu_results.md"
cat "$OUT/gpu_results.md" 2>/dev/null
