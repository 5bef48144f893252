#!/usr/bin/env bash
# The Gluon GEMMs' tile schedules (gluon_gemm.TILE_SCHEDULE) on one GPU, from the repo root (~7 min):
#   run(command="bash scripts/device_tile_schedule.sh", timeout_s=590)
# 1. tests: tests/test_gluon_gemm.py (test_tile_schedules_give_the_static_rows among them), then the whole file
#    once more with every call on the dynamic schedule (MOELAB_TILE_SCHEDULE=dynamic).
# 2. ab1, ab2: scripts/tma_ab.py, one routed_moe call, the static schedule against grid and group2, then
#    against dynamic (a process of its own: a kernel that never returned would end only that step), at T = 4096 and
#    16384 on DeepSeek-V3, Qwen3-30B-A3B and Mixtral, and at T = 1024 (graph too) and 4096 on OLMoE and GPT-OSS-20B
#    (128 rows an expert at T = 1024: 1.5 tiles an expert, as DeepSeek's T = 4096; scripts/tile_passes.py).
# 3. ncu: DeepSeek-V3 T = 4096 on the dynamic schedule, DRAM and L2 bytes a kernel (against 23158 MB of GEMM1's
#    DRAM reads on the static one, H100, BENCHMARKS.md).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-build/tile_schedule}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"
S="deepseek-v3;qwen3-30b-a3b;mixtral"; S2="olmoe;gpt-oss-20b"
el tests
gpu_tests 60 tests/test_gluon_gemm.py
MOELAB_TILE_SCHEDULE=dynamic TESTS_LOG=dyn_tests gpu_tests 60 tests/test_gluon_gemm.py
ab ab1 static,grid-tiles,group2 "$S" 4096,16384 120
ab ab1b static,grid-tiles,group2 "$S2" 1024,4096 60
ab ab2 static,dynamic "$S" 4096,16384 90
ab ab2b static,dynamic "$S2" 1024,4096 50
el ncu
MOELAB_TILE_SCHEDULE=dynamic timeout -s INT 80 ncu --clock-control none --csv \
  --metrics "$(python3 scripts/ncu_kernels.py --metrics --l2)" python3 scripts/ncu_layer.py --shape deepseek-v3 \
  --tokens 4096 --calls 1 > "$OUT/ncu_dyn.csv" 2>&1
python3 scripts/ncu_kernels.py "$OUT/ncu_dyn.csv" | tee "$OUT/ncu_dyn.txt"; rm -f "$OUT/ncu_dyn.csv"
el done
