#!/usr/bin/env bash
# The GEMMs' persistent grid (moe_gemm.PERSISTENT) against one tile a program, then device_e128_host.sh; one H200 call:
#   1. the persistent, TMA, tile-order, routed-MoE and token-major tests on the GPU                      <= TEST_S (120 s)
#   2. scripts/tma_ab.py --modes one-tile,persistent-gemm1,persistent-both on six shapes, T = 1024, 4096, 16384 (Qwen3-30B-A3B at
#      T = 1024 has 64-row tiles: both modes launch the same kernel, the A/B's own noise)               <= AB_S (200 s)
#   3. Nsight Compute on GEMM1 and GEMM2 at Qwen3-30B-A3B T = 16384, one tile a program and both persistent       <= 2x60 s
#   4. scripts/device_e128_host.sh into $OUT/e128_host (E128 K8's eager T = 1, LoRA's eager host time) <= 130 s
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_persistent.sh", timeout_s=600).
# Files: env.txt, tests.log, ab.{md,json,err}, ncu_{one-tile,persistent}.txt, e128_host/.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} MPLBACKEND=Agg MOELAB_TMA=1
OUT=${OUT:-build/device_persistent}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt

el "tests"
gpu_tests "${TEST_S:-120}" tests/test_moe_gemm_persistent.py tests/test_moe_gemm_tma.py tests/test_moe_gemm_order.py \
  tests/test_routed_moe.py tests/test_token_major.py
el "a/b"
timeout -s INT "${AB_S:-200}" python3 scripts/tma_ab.py --modes one-tile,persistent-gemm1,persistent-both \
  --shape "${SHAPES:-qwen3-30b-a3b;olmoe;64,6,2048,1408;gpt-oss-20b;mixtral;deepseek-v3}" \
  --tokens "${TOKENS:-1024,4096,16384}" --json "$OUT/ab.json" > "$OUT/ab.md" 2> "$OUT/ab.err"
echo "rc=$?"; tail -3 "$OUT/ab.err"; cat "$OUT/ab.md"
for mode in one-tile persistent; do  # persistent: both GEMMs
  el "ncu $mode"
  timeout -s INT 60 ncu --clock-control none -k regex:_gemm --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    python3 scripts/ncu_layer.py --shape qwen3-30b-a3b --tokens 16384 --"$mode" > "$OUT/ncu_$mode.txt" 2>&1
  echo "rc=$?"; grep -E "_gemm|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Shared Memory Config|Stall" "$OUT/ncu_$mode.txt" | head -30
done
el "e128 host"
OUT="$OUT/e128_host" bash "$(dirname "$0")/device_e128_host.sh"
el done
