#!/usr/bin/env bash
# The token-major decode kernels' tiles and pipeline depths under Nsight Compute, T = 1 (then T = 2), one H200 call
# (scripts/token_major_ncu.py). From the repo root: run(command="MOELAB_COMMIT=<commit> bash
# scripts/device_token_major_ncu.sh", timeout_s=590). Files: env.txt, plan_t<T>.json, ncu_t<T>.csv, sweep_t<T>.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} MPLBACKEND=Agg
OUT=${OUT:-build/device_token_major_ncu}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"
for T in ${TOKENS:-1 2}; do
  el "token-major sweep T=$T under ncu"
  timeout -s INT "${SWEEP_S:-200}" ncu --profile-from-start off -k regex:token_major --metrics gpu__time_duration.sum \
    --csv python3 scripts/token_major_ncu.py --shape "${SHAPES:-qwen3-30b-a3b;olmoe;64,6,2048,1408;gpt-oss-20b}" \
    --tokens "$T" --plan "$OUT/plan_t$T.json" > "$OUT/ncu_t$T.csv" 2>&1
  echo "rc=$?"; python3 scripts/token_major_ncu.py --report "$OUT/plan_t$T.json" "$OUT/ncu_t$T.csv" > "$OUT/sweep_t$T.txt" 2>&1
  grep -E "^best|WRONG|Error|not the same" "$OUT/sweep_t$T.txt" "$OUT/ncu_t$T.csv" | head -20
done
el done
