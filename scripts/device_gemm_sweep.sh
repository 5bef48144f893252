#!/usr/bin/env bash
# Each grouped GEMM alone over tile configs of its own (scripts/gemm_sweep.py), one H200 call < 9 min.
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_gemm_sweep.sh", timeout_s=590).
# Files: env.txt, sweep.{md,json,err}. SHAPES, TOKENS, BUDGET (s per shape, T and GEMM) narrow it.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} MPLBACKEND=Agg MOELAB_TMA=1
OUT=${OUT:-build/device_gemm_sweep}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt
el "sweep"
timeout -s INT "${SWEEP_S:-560}" python3 scripts/gemm_sweep.py --shape "${SHAPES:-qwen3-30b-a3b;olmoe;deepseek-v3;gpt-oss-20b;64,6,2048,1408}" \
  --tokens "${TOKENS:-4096,16384}" --budget-s "${BUDGET:-25}" --json "$OUT/sweep.json" > "$OUT/sweep.md" 2> "$OUT/sweep.err"
echo "rc=$?"; tail -3 "$OUT/sweep.err"; grep -a "^best\|table " "$OUT/sweep.md"
el done
