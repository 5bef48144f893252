#!/usr/bin/env bash
# GEMM1's persistent grid (moe_gemm.PERSISTENT) against one tile a program, then device_e128_host.sh; one H200 call:
#   1. the persistent, TMA, tile-order, routed-MoE and token-major tests on the GPU                      <= TEST_S (150 s)
#   2. scripts/tma_ab.py --modes one-tile,persistent on six shapes, T = 1024, 4096, 16384 (Qwen3-30B-A3B at
#      T = 1024 has 64-row tiles: both modes launch the same kernel, the A/B's own noise)               <= AB_S (220 s)
#   3. scripts/device_e128_host.sh into $OUT/e128_host (E128 K8's eager T = 1, LoRA's eager host time) <= 130 s
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_persistent.sh", timeout_s=560).
# Files: env.txt, tests.log, ab.{md,json,err}, e128_host/.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} MPLBACKEND=Agg MOELAB_TMA=1
OUT=${OUT:-build/device_persistent}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt

el "tests"
gpu_tests "${TEST_S:-150}" tests/test_moe_gemm_persistent.py tests/test_moe_gemm_tma.py tests/test_moe_gemm_order.py \
  tests/test_routed_moe.py tests/test_token_major.py
el "a/b"
timeout -s INT "${AB_S:-220}" python3 scripts/tma_ab.py --modes one-tile,persistent \
  --shape "${SHAPES:-qwen3-30b-a3b;olmoe;64,6,2048,1408;gpt-oss-20b;mixtral;deepseek-v3}" \
  --tokens "${TOKENS:-1024,4096,16384}" --json "$OUT/ab.json" > "$OUT/ab.md" 2> "$OUT/ab.err"
echo "rc=$?"; tail -3 "$OUT/ab.err"; cat "$OUT/ab.md"
el "e128 host"
OUT="$OUT/e128_host" bash "$(dirname "$0")/device_e128_host.sh"
el done
