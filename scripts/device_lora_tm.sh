#!/usr/bin/env bash
# The token-major LoRA path on one H200, one call of under 9 minutes (each step has its own timeout):
#   1. its tests and the LoRA tests on the GPU (compiled kernels, CUDA-graph capture)                      <= 200 s
#   2. the LoRA bench at T = 1 and 2 on five shapes: the module's choice (auto) beside the tiled paths it took
#      before (decode for one adapter, the adapter loop for the 8-adapter bank), eager and in CUDA graphs  <= 280 s
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_lora_tm.sh", timeout_s=560).
# Files: env.txt, tests.log, lora.{md,json,err}. TESTS and SHAPES narrow the steps.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} MPLBACKEND=Agg
OUT=${OUT:-build/device_lora_tm}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt

el "tests"
COLUMNS=400 timeout -s INT -k 10 "${TEST_S:-200}" python3 -m pytest -q -p no:cacheprovider -n 8 --tb=short \
  ${TESTS:-tests/test_token_major.py tests/test_experts.py tests/test_lora_banks.py} > "$OUT/tests.log" 2>&1
echo "rc=$?"; grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed|errors?)( |,|$)" "$OUT/tests.log" | tail -12

el "lora bench"
timeout -s INT "${BENCH_S:-280}" python3 -m moelab.bench --quick --lora --check-tokens 4 --peers none \
  --shape "${SHAPES:-qwen3-30b-a3b;olmoe;mixtral;deepseek-v3;gpt-oss-20b}" --tokens 1,2 \
  --lora-variants "1x all,8x mixed" --lora-paths auto,decode,adapter-loop --time-budget "$(( ${BENCH_S:-280} - 15 ))" \
  --out "$OUT/lora.json" > "$OUT/lora.md" 2> "$OUT/lora.err"
echo "rc=$?"; tail -3 "$OUT/lora.err"; grep -a -A12 "median µs" "$OUT/lora.md" | grep -a "^| [12] \|median" | head -60
el done
