#!/usr/bin/env bash
# Nsight Compute over one routed-MoE layer call at each POINTS entry (shape:T), each kernel of the measured call
# summarised by scripts/ncu_kernels.py (µs, DRAM % of peak, bytes, SM and tensor pipes: its hmma metric counts the
# Gluon GEMMs' wgmma too, 44-63 % on the H100) into $OUT/ncu.txt; CSVs in $OUT. From the repo root:
#   run(command="POINTS='olmoe:1024 qwen3-30b-a3b:4096' bash scripts/device_ncu_layers.sh")
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD/scripts
OUT=${OUT:-build/device_ncu_layers}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"
METRICS=$(python3 scripts/ncu_kernels.py --metrics ${NCU_L2:+--l2})  # NCU_L2=1: L2's throughput and bytes too
for point in ${POINTS:-olmoe:1024 qwen3-30b-a3b:1024 qwen3-30b-a3b:4096}; do
  shape=${point%:*}; T=${point#*:}; csv="$OUT/ncu_${shape//[^a-z0-9]/_}_$T.csv"
  el "ncu $shape T=$T"
  timeout -s INT "${POINT_S:-90}" ncu --clock-control none --csv --metrics "$METRICS" \
    python3 scripts/ncu_layer.py --shape "$shape" --tokens "$T" --calls 1 > "$csv" 2>&1
  echo "rc=$?"; python3 scripts/ncu_kernels.py "$csv" 2>&1 | tee -a "$OUT/ncu.txt"
done
el done
