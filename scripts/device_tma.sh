#!/usr/bin/env bash
# The GEMMs' TMA loads on one H200, one call of under 9 minutes (each step has its own timeout):
#   1. the GEMM and LoRA tests on the GPU with TMA on (compiled kernels, CUDA-graph capture)          <= TEST_S (170 s)
#   2. scripts/tma_ab.py: TMA against the pointer loads, in one process, six shapes                   <= AB_S (330 s)
#   3. with BENCH_SHAPES set: the bench at BENCH_TOKENS, torch grouped_mm beside it                   <= BENCH_S (200 s)
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_tma.sh", timeout_s=560).
# Files: env.txt, tests.log, tma_ab.{md,json,err}, bench.{md,json,err}. TESTS, SHAPES and TOKENS narrow the steps.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} MPLBACKEND=Agg MOELAB_TMA=1
OUT=${OUT:-build/device_tma}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt

el "tests"
gpu_tests "${TEST_S:-170}" ${TESTS:-tests/test_moe_gemm_tma.py tests/test_moe_gemm_order.py tests/test_experts.py tests/test_routed_moe.py tests/test_kernel_activations.py}

el "tma a/b"
timeout -s INT "${AB_S:-330}" python3 scripts/tma_ab.py --shape "${SHAPES:-qwen3-30b-a3b;olmoe;mixtral;gpt-oss-20b;deepseek-v3;64,6,2048,1408}" \
  --tokens "${TOKENS:-128,1024,4096,16384}" --json "$OUT/tma_ab.json" > "$OUT/tma_ab.md" 2> "$OUT/tma_ab.err"
echo "rc=$?"; tail -3 "$OUT/tma_ab.err"; cat "$OUT/tma_ab.md"
if [ -n "${BENCH_SHAPES:-}" ]; then
  el "bench"
  timeout -s INT "${BENCH_S:-200}" python3 -m moelab.bench --quick --check-tokens 4 --peers grouped_mm \
    --shape "$BENCH_SHAPES" --tokens "${BENCH_TOKENS:-1024,4096,16384}" --time-budget "$(( ${BENCH_S:-200} - 15 ))" \
    --out "$OUT/bench.json" > "$OUT/bench.md" 2> "$OUT/bench.err"
  echo "rc=$?"; tail -3 "$OUT/bench.err"; grep -a -A12 "median µs" "$OUT/bench.md"
fi
el done
