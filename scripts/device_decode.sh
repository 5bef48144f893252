#!/usr/bin/env bash
# Where a decode call's GPU time goes, and whether its GEMMs want other tiles, one H200 call:
#   1. Nsight Compute on the tiled pipeline at T = 1 (segments, GEMM1, GEMM2, finalize: the kernels a CUDA graph of
#      a decode call replays), Qwen3-30B-A3B and OLMoE: each kernel's duration, DRAM throughput, grid and occupancy
#   2. scripts/gemm_sweep.py at T = 1 and 32 on four shapes: each GEMM alone over decode tiles of 16 rows, each
#      launch timed by Nsight Compute (cold caches, the median of 3): the do_bench timings of a few µs scatter
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_decode.sh", timeout_s=590).
# Files: env.txt, ncu_<shape>.txt (NCU_SHAPES="" leaves them out), plan_t<T>.json, ncu_sweep_t<T>.csv, sweep_t<T>.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} MPLBACKEND=Agg
OUT=${OUT:-build/device_decode}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"
for shape in ${NCU_SHAPES-qwen3-30b-a3b olmoe}; do
  el "ncu $shape T=1, tiled"
  MOELAB_EAGER_GRAPHS=0 timeout -s INT 90 ncu --clock-control none -k regex:"segments|gemm|finalize" \
    --launch-skip 4 --launch-count 4 --section SpeedOfLight --section LaunchStats --section Occupancy \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum \
    python3 scripts/ncu_layer.py --shape "$shape" --tokens 1 --tiled --calls 2 > "$OUT/ncu_$shape.txt" 2>&1
  echo "rc=$?"; grep -E "^  [a-z_]+kernel|Duration|DRAM Throughput|dram__bytes|Grid Size|Registers Per|Achieved Occupancy|Waves Per SM" \
    "$OUT/ncu_$shape.txt" | head -48
done
CANDIDATES=${CANDIDATES:-"16,128,4,4;16,256,4,3;32,256,4,3;32,64,4,8;32,128,2,4;32,128,4,6;64,128,4,4;64,64,4,6;64,256,4,2;128,128,4,3;32,128,8,4;16,128,2,6;128,64,4,4;256,64,4,4;256,128,8,3"}
for T in ${TOKENS:-1 32}; do  # one ncu process per T: ncu prints its CSV when the process ends
  el "gemm sweep T=$T under ncu"
  timeout -s INT "${SWEEP_S:-240}" ncu --profile-from-start off -k regex:gemm --metrics gpu__time_duration.sum --csv \
    python3 scripts/gemm_sweep.py --shape "${SHAPES:-qwen3-30b-a3b;olmoe;64,6,2048,1408;gpt-oss-20b}" --tokens "$T" \
    --budget-s "${BUDGET_S:-60}" --ncu "$OUT/plan_t$T.json" --candidates "$CANDIDATES" > "$OUT/ncu_sweep_t$T.csv" 2>&1
  echo "rc=$?"; python3 scripts/gemm_sweep.py --ncu-report "$OUT/plan_t$T.json" "$OUT/ncu_sweep_t$T.csv" \
    > "$OUT/sweep_t$T.txt" 2>&1; grep -E "^best|Error|not the same" "$OUT/sweep_t$T.txt"
done
el done
