#!/usr/bin/env bash
# The token-major decode path on one H200, one call of under 8 minutes (each step has its own timeout):
#   1. its tests and the routed-MoE contract tests on the GPU (compiled kernels, CUDA-graph capture)     <= 150 s
#   2. scripts/token_major_ab.py: tiled vs token-major, eager and graph, six shapes, T = 1, 2, 4, 8       <= 130 s
#   3. the same with --sweep at T = 1, four shapes: each tile candidate of both kernels                  <= 170 s
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_token_major.sh", timeout_s=560).
# Files: env.txt, tests.log, ab.{md,json}, sweep.{md,json}. TESTS, AB_TOKENS and SWEEP=0 narrow the steps.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} MPLBACKEND=Agg
OUT=${OUT:-build/device_token_major}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt

el "tests"
COLUMNS=400 timeout -s INT -k 10 "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider -n 8 --tb=short \
  ${TESTS:-tests/test_token_major.py tests/test_routed_moe.py tests/test_experts.py} > "$OUT/tests.log" 2>&1
echo "rc=$?"; grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed|errors?)( |,|$)" "$OUT/tests.log" | tail -12

el "a/b"
timeout "${AB_S:-130}" python3 scripts/token_major_ab.py --tokens "${AB_TOKENS:-1,2,4,8}" --json "$OUT/ab.json" > "$OUT/ab.md" 2>&1
echo "rc=$?"; cat "$OUT/ab.md"

[ "${SWEEP:-1}" = 0 ] && { el done; exit 0; }  # SWEEP=0: no sweep
el "sweep"
timeout "${SWEEP_S:-170}" python3 scripts/token_major_ab.py --tokens 1 --sweep --shape "${SWEEP_SHAPES:-qwen3-30b-a3b,mixtral,gpt-oss-20b,deepseek-v3}" --json "$OUT/sweep.json" \
  > "$OUT/sweep.md" 2>&1
echo "rc=$?"; cat "$OUT/sweep.md"
el done
