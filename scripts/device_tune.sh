#!/usr/bin/env bash
# One tile table for every shape, tuned and checked in one H200 call (each step has its own timeout):
#   0. python -m moelab.bench on the current table, the two shapes the sweep never sees (DeepSeek-V3's layer,
#      Qwen3-235B-A22B's E128 K8 H4096 I1536): the "before" of step 2's A/B on untuned shapes             <= 60 s
#   1. scripts/tune_moe.py --aggregate over five shapes: per rows-per-expert bucket, the candidate with the best
#      geometric mean of time / the current config's time over the bucket's points (it rewrites the config file
#      of the device's copy; $OUT gets a copy)                                                               <= TUNE_S
#   2. python -m moelab.bench on the new table: the swept shapes and those two, graph replays to T = 1024  <= BENCH_S
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_tune.sh", timeout_s=590).
# Files: env.txt, unseen_before.*, tune.log, moe_gemm_configs.json (when a bucket changed), bench.{md,json,err}.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} MPLBACKEND=Agg
OUT=${OUT:-build/device_tune}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt

UNSEEN=(--quick --check-tokens 4 --peers none --shape "128,8,4096,1536;deepseek-v3" --tokens 128,1024,4096)
el "unseen, current table"
timeout -s INT 55 python3 -m moelab.bench "${UNSEEN[@]}" --time-budget 45 --out "$OUT/unseen_before.json" \
  > "$OUT/unseen_before.md" 2> "$OUT/unseen_before.err"
echo "rc=$?"; grep -m1 -A9 "median µs" "$OUT/unseen_before.md"

el "tune"
timeout -s INT "${TUNE_S:-250}" python3 scripts/tune_moe.py --aggregate --budget-s "${POINT_S:-10}" --total-s 210 \
  --tokens "${TUNE_TOKENS:-32,128,1024,4096,16384}" \
  --shape qwen3-30b-a3b --shape olmoe --shape mixtral --shape gpt-oss-20b --shape 64,6,2048,1408 > "$OUT/tune.log" 2>&1
echo "rc=$?"; grep -E "^(T=|\||shape)" "$OUT/tune.log"
git diff --stat 2>/dev/null; cat moelab/kernels/moe_gemm_configs.json

el "bench"
timeout -s INT "${BENCH_S:-170}" python3 -m moelab.bench --quick --check-tokens 4 --peers none \
  --shape "qwen3-30b-a3b;olmoe;gpt-oss-20b;mixtral;64,6,2048,1408;128,8,4096,1536;deepseek-v3" \
  --tokens "${BENCH_TOKENS:-32,128,1024,4096}" --time-budget "${BENCH_BUDGET:-135}" --out "$OUT/bench.json" \
  > "$OUT/bench.md" 2> "$OUT/bench.err"
echo "rc=$?"; tail -3 "$OUT/bench.err"; grep -A32 "median µs" "$OUT/bench.md" | head -80
el done
