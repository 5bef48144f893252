#!/usr/bin/env bash
# GEMM2's TMA loads on every expert size and its 3-stage pipeline on 128-row tiles, one H200 call < 9 min:
#   1. the GEMM, TMA and LoRA tests on the GPU                                                          <= TEST_S (150 s)
#   2. scripts/tma_ab.py --modes rule-a201208,rule: HEAD's rule against a201208's, in one process       <= AB_S (170 s)
#   3. the same on Mixtral at T = 16384 (4096 rows an expert: the 4-stage bucket)                        <= 45 s
#   4. the bench at BENCH_TOKENS beside torch grouped_mm                                                 <= BENCH_S (140 s)
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_gemm2.sh", timeout_s=560).
# Files: env.txt, tests.log, ab.{md,json,err}, ab_mixtral.{md,json,err}, bench.{md,json,err}.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} MPLBACKEND=Agg MOELAB_TMA=1
OUT=${OUT:-build/device_gemm2}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt

el "tests"
gpu_tests "${TEST_S:-150}" tests/test_moe_gemm_tma.py tests/test_moe_gemm_order.py tests/test_routed_moe.py tests/test_experts.py
el "a/b"
timeout -s INT "${AB_S:-170}" python3 scripts/tma_ab.py --modes rule-a201208,rule \
  --shape "${SHAPES:-qwen3-30b-a3b;olmoe;64,6,2048,1408;gpt-oss-20b}" --tokens "${TOKENS:-1024,4096,16384}" \
  --json "$OUT/ab.json" > "$OUT/ab.md" 2> "$OUT/ab.err"
echo "rc=$?"; tail -3 "$OUT/ab.err"; cat "$OUT/ab.md"
el "a/b mixtral"
timeout -s INT 45 python3 scripts/tma_ab.py --modes rule-a201208,rule --shape mixtral --tokens 16384 \
  --json "$OUT/ab_mixtral.json" > "$OUT/ab_mixtral.md" 2> "$OUT/ab_mixtral.err"
echo "rc=$?"; tail -3 "$OUT/ab_mixtral.err"; cat "$OUT/ab_mixtral.md"
el "bench"
timeout -s INT "${BENCH_S:-140}" python3 -m moelab.bench --quick --check-tokens 4 --peers grouped_mm \
  --shape "${BENCH_SHAPES:-qwen3-30b-a3b;olmoe;64,6,2048,1408;gpt-oss-20b}" --tokens "${BENCH_TOKENS:-1024,4096,16384}" \
  --time-budget "$(( ${BENCH_S:-140} - 15 ))" --out "$OUT/bench.json" > "$OUT/bench.md" 2> "$OUT/bench.err"
echo "rc=$?"; tail -3 "$OUT/bench.err"; grep -a -A14 "median µs" "$OUT/bench.md" | head -70
el done
