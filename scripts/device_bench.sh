#!/usr/bin/env bash
# moelab's benchmark in one call of the lent H200 (BENCH.md): base layer vs peers, then LoRA, logs under $OUT.
# From the repo root, through the device tool (carry the liger-kernel wheel in .whl/):
#   run(command="MOELAB_COMMIT=<sha> bash scripts/device_bench.sh", carry=[".whl"], timeout_s=600)
# Env knobs: SHAPES (default qwen3-30b-a3b; e.g. qwen3-30b-a3b,olmoe,mixtral), QUICK=1 (fewer T and reps),
# LIGER_AUTOTUNE=1 (let Liger tune ~100 configs on its first call: +1-3 min), BASE_S / LORA_S (time budgets, s).
# Files back (6 of the 8 allowed): bench_base.{json,md,log}, bench_lora.{json,md,log}.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-build}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
SHAPES=${SHAPES:-qwen3-30b-a3b}; BASE_S=${BASE_S:-230}; LORA_S=${LORA_S:-150}
QUICK_FLAG=""; [ "${QUICK:-0}" = 1 ] && QUICK_FLAG=--quick
LIGER_FLAG=""; [ "${LIGER_AUTOTUNE:-0}" = 1 ] && LIGER_FLAG=--liger-autotune
{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  timeout $((BASE_S + 40)) python3 -m moelab.bench --shape "$SHAPES" --routing uniform,zipf --time-budget "$BASE_S" \
    $QUICK_FLAG $LIGER_FLAG --out "$OUT/bench_base.json"
  echo "base bench exit $?"
} 2>&1 | tee "$OUT/bench_base.log"
{
  timeout $((LORA_S + 40)) python3 -m moelab.bench --shape "${SHAPES%%,*}" --lora --ops --time-budget "$LORA_S" \
    $QUICK_FLAG --out "$OUT/bench_lora.json"
  echo "lora bench exit $?"
} 2>&1 | tee "$OUT/bench_lora.log"
