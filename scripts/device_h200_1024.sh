#!/usr/bin/env bash
# Where a T = 1024 layer call's time goes on the GPU it runs on (issue 12's misses of the small experts at T = 1024):
# the kernels of one eager call in place (torch.profiler: durations and gaps, PDL overlap included), Nsight
# Compute's per-kernel DRAM and L2 load at Qwen3 and OLMoE T = 1024, GEMM1's warp stall reasons at Qwen3, and a
# plain 1 GiB copy under the same metrics (what "% of the DRAM peak" a copy reaches on this card). From the repo root:
#   run(command="bash scripts/device_h200_1024.sh", kind="nvidia-h200")
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}:$PWD/scripts
OUT=${OUT:-build/device_h200_1024}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"
METRICS=$(python3 scripts/ncu_kernels.py --metrics --l2)
el "copy under ncu"
# an elementwise kernel (a plain y.copy_(x) is a cudaMemcpy, which ncu does not profile): 1 GiB read, 1 GiB written
timeout -s INT 60 ncu --clock-control none --csv --metrics "$METRICS" -k regex:elementwise python3 -c "
import torch
x = torch.empty(2**29, dtype=torch.bfloat16, device='cuda'); y = torch.empty_like(x)
for _ in range(3): torch.mul(x, 1, out=y)
torch.cuda.synchronize()" > "$OUT/ncu_copy.csv" 2>&1
grep -E 'gpu__time_duration|dram__throughput|dram__bytes|lts__' "$OUT/ncu_copy.csv" | tail -7
el "kernels in place"
timeout 120 python3 scripts/profile_launch.py --tokens 1024,4096 --modes routed 2>&1 | tee "$OUT/profile.txt"
OUT=$OUT NCU_L2=1 POINTS=${POINTS:-qwen3-30b-a3b:1024 olmoe:1024} bash scripts/device_ncu_layers.sh
el "GEMM1 stalls, Qwen3 T = 1024"
timeout -s INT 120 ncu --clock-control none -k regex:gemm1 --launch-skip 1 --launch-count 1 \
  --section WarpStateStats --section SpeedOfLight --section Occupancy \
  python3 scripts/ncu_layer.py --shape qwen3-30b-a3b --tokens 1024 --calls 1 > "$OUT/ncu_gemm1_stalls.txt" 2>&1
echo "rc=$?"; grep -vE '^==PROF==|^\s*$' "$OUT/ncu_gemm1_stalls.txt" | tail -70
el done
