#!/usr/bin/env bash
# Issue 13 (house): at most 5 minutes wall on one H200 (each step under its own timeout: 100 + 65 + 38 + 30 + 15 +
# 25 s).
#   run(command="bash scripts/device_house.sh", timeout_s=290)       # from the repo root; results under $OUT
#   run(command="HOUSE_ONLY_INTERP=1 bash scripts/device_house.sh", timeout_s=120)   # step 0 alone (~1-2 min)
# Optional A/B of the eager step against main at f2ec8b1: put that tree's moelab/ in .dev_house/f2/moelab
# (git archive f2ec8b1 moelab | tar -x -C .dev_house/f2) and pass carry=[".dev_house"].
#  0. interp.log: the interpreter is moelab's business only (tests/test_interpreter.py): on the GPU moelab's kernels
#     are compiled CachedLaunchJIT, a user's kernel defined after import moelab is a compiled JITFunction that runs
#     the same before and after a moelab routed_moe (which matches the reference), TRITON_INTERPRET=1/0 behave;
#     with tests/test_launch.py (every compiled moelab kernel a CachedLaunchJIT, the fast launch bit-identical).
#  1. paths.{log,json,md}: every LoRA path of LoRAExperts forced with fused=<path> (moelab.experts.LORA_PATHS) and
#     the module's own choice ("auto"), Qwen3-30B-A3B (E128 K8 H2048 I768) bf16, T = 1, 32, 128, 1024, 4096, banks
#     "1x all" (one rank-16 adapter) and "8x mixed" (ranks 64,32,16,8,...; 512 stacked columns, so the fused paths
#     are skipped there); eager and CUDA graph (T <= 1024); each row checked against the float64 reference.
#  2. base.*: the base layer as BENCHMARKS.md's "Issue 13's refactor" table ran it (compare with its "after").
#  3. lora.*: the LoRA rows of that table (T = 1, 32, 16384; banks '1x all,4x all').
#  4. eager.log: eager wall / host time per call at T = 1, 32 of routed_moe and LoRAExperts (scripts/time_eager.py),
#     interleaved with the f2ec8b1 tree when carried.
# HOUSE_TINY=1 runs the same steps at the CPU-sized shape (a dry run of the script off the GPU).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-build/house}; mkdir -p "$OUT"
PY=${PY:-python3}
SHAPE="--shape qwen3-30b-a3b"; T_PATHS=1,32,128,1024,4096; T_BASE=1,32,128,1024,4096,16384; T_LORA=1,32,16384
if [ "${HOUSE_TINY:-0}" = 1 ]; then SHAPE="--tiny"; T_PATHS=1,8; T_BASE=1,8; T_LORA=1,8; fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null | tee "$OUT/env.txt"
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/env.txt"
COMMON="$SHAPE --quick --impls moelab --peers none --no-ceilings"

timeout 100 $PY -m pytest -q -n 2 -p no:cacheprovider tests/test_interpreter.py tests/test_launch.py -rs \
  > "$OUT/interp.log" 2>&1; echo "interp: exit $?"; tail -8 "$OUT/interp.log"
[ "${HOUSE_ONLY_INTERP:-0}" = 1 ] && exit 0

timeout 65 $PY -m moelab.bench $COMMON --lora --tokens $T_PATHS --lora-variants "1x all,8x mixed" \
  --lora-paths auto,tiles,decode,flow-grouped,flow-per-slot --check-tokens 4 --time-budget 57 \
  --out "$OUT/paths.json" > "$OUT/paths.log" 2>&1; echo "paths: exit $?"
grep -A16 "lora: .* median µs" "$OUT/paths.log" | head -17

timeout 38 $PY -m moelab.bench $COMMON --tokens $T_BASE --time-budget 32 --out "$OUT/base.json" > "$OUT/base.log" 2>&1
echo "base: exit $?"; grep -A9 "median µs" "$OUT/base.log" | head -10

timeout 30 $PY -m moelab.bench $COMMON --lora --tokens $T_LORA --lora-variants "1x all,4x all" --time-budget 25 \
  --out "$OUT/lora.json" > "$OUT/lora.log" 2>&1; echo "lora: exit $?"
grep -A12 "lora: .* median µs" "$OUT/lora.log" | head -13

[ "${HOUSE_TINY:-0}" = 1 ] && exit 0
timeout 15 $PY scripts/time_eager.py --tokens 1,32 2>&1 | tee "$OUT/eager.log"
if [ -d .dev_house/f2/moelab ]; then  # the same script on f2ec8b1 right after (its kernels compile first)
  echo "== f2ec8b1" | tee -a "$OUT/eager.log"
  PYTHONPATH=$PWD/.dev_house/f2 timeout 25 $PY scripts/time_eager.py --tokens 1,32 2>&1 | tee -a "$OUT/eager.log"
fi
