#!/usr/bin/env bash
# Issue 12 on one GPU call, the steps of RUNS in turn (default: narrow prefetch ncu tests):
#   tests:    tests/test_token_major.py's CUDA-graph tests (the weights' L2 prefetch on and off), stopped after
#             TESTS_S seconds
#   prefetch: scripts/prefetch_ab.py on PF_SHAPES at PF_T (GEMM2's W2 prefetch before its wait for GEMM1, token-major
#             and tiled; token-major GEMM1's too), graph replays, modes off, w2, both
#   narrow:   scripts/gluon_ab.py at NARROW_T (1024): the Gluon GEMMs on narrow tiles with deep rings (FlashInfer's
#             SM90 default is 128 rows x 64 columns, 8 stages) against the Triton kernels of the tile table, with
#             HEAD's Gluon tiles beside them
#   ncu:      scripts/device_ncu_layers.sh at NCU_POINTS (each kernel of one call: µs, DRAM % of peak, bytes; its
#             files beside the others)
#   run(command="MOELAB_COMMIT=<HEAD> bash scripts/device_balanced.sh")
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-build/balanced}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
. "$(dirname "$0")/device_env.sh"
for step in ${RUNS:-narrow prefetch ncu tests}; do
  el "$step"
  case $step in
    tests) PYTHONPATH=$PWD gpu_tests "${TESTS_S:-60}" tests/test_token_major.py -k cuda_graph ;;
    prefetch) (cd scripts && PYTHONPATH=$PWD/.. timeout "${PF_S:-150}" python3 prefetch_ab.py \
          --shape "${PF_SHAPES:-qwen3-30b-a3b;olmoe;gpt-oss-20b}" --tokens "${PF_T:-1,32,128}" \
          --json "$OUT/prefetch.json" 2>&1 | grep -v -i warn | tee "$OUT/prefetch.md") ;;
    narrow) (cd scripts && PYTHONPATH=$PWD/.. timeout "${NARROW_S:-220}" python3 gluon_ab.py --tokens "${NARROW_T:-1024}" \
          --shape "${NARROW_SHAPES:-olmoe;64,6,2048,1408;gpt-oss-20b;mixtral;128,8,4096,1536}" \
          --gemm1-tiles "${NARROW_GEMM1:-32,64,8;64,64,6;128,64,4}" --tiles "${NARROW_GEMM2:-64,64,8;128,64,6;256,64,3}" \
          --json "$OUT/narrow.json" 2>&1 | grep -v "^\s*$" | grep -v -i warn | tee "$OUT/narrow.md") ;;
    ncu) OUT=$OUT POINT_S=${POINT_S:-80} POINTS="${NCU_POINTS:-qwen3-30b-a3b:1024}" bash scripts/device_ncu_layers.sh ;;
  esac
done
el done
