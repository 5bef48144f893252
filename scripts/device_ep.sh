#!/usr/bin/env bash
# Issue 14's GPU side on a 2-GPU box (NCCL): at most 6 minutes wall (the steps' timeouts add up to 350 s).
#   1. pytest test_expert_parallel_on_nccl (the gloo checks on cuda:0/1, triton bf16, CUDA-graph capture)
#   2. torchrun --nproc-per-node 2 tests/test_distributed.py (the same checks under torchrun's NCCL group)
#   3. python -m moelab.distributed.bench --gpus 2 at T = 4096 and 16384 per GPU: both modes, skew 0 and 1,
#      contiguous and EPLB placement, dynamic / static-capacity / CUDA-graph variants, the LoRAExperts one-GPU
#      baseline (eager and graph); JSON + log per T.
# Run from the repo root:  run(command="bash scripts/device_ep.sh", kind="nvidia-h200-x2", timeout_s=420)
# Results under $OUT (default build/device_ep): *.log, bench_T*.json, versions.txt. NVLink multicast stays off.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-build/device_ep}; mkdir -p "$OUT"
PY=${PY:-python3}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -4
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "nccl",
          ".".join(map(str, torch.cuda.nccl.version())))'
  git rev-parse HEAD 2>/dev/null || echo "commit: not a git checkout"
} 2>&1 | tee "$OUT/versions.txt"
status=0

echo "== 1. pytest (NCCL, 2 GPUs)"
timeout 120 $PY -m pytest -q -rs -p no:cacheprovider tests/test_distributed.py -k nccl --durations=3 2>&1 \
  | tee "$OUT/pytest_nccl.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 2. torchrun --nproc-per-node 2 tests/test_distributed.py"
timeout 75 $PY -m torch.distributed.run --nproc-per-node 2 tests/test_distributed.py > "$OUT/torchrun.log" 2>&1
echo "torchrun exit code $? (an exit-time abort after 'all checks passed' is the house helper's issue)" \
  | tee -a "$OUT/torchrun.log"
grep -E "all checks passed|Error|assert" "$OUT/torchrun.log" | head -20
grep -q "all checks passed on 2 ranks" "$OUT/torchrun.log" || status=1

echo "== 3. benchmark (Qwen3-30B-A3B layer, bf16)"
for T in 4096 16384; do
  budget=$([ "$T" = 4096 ] && echo 70 || echo 85)
  timeout $budget $PY -m moelab.distributed.bench --gpus 2 --tokens "$T" --skews 0 1 --iters 5 --warmup 2 \
    --timeout 60 --json "$OUT/bench_T$T.json" > "$OUT/bench_T$T.log" 2>&1 || status=1
  cat "$OUT/bench_T$T.log"
done
echo "device_ep.sh: status $status"
exit $status
