#!/usr/bin/env bash
# Issue 12, wide LoRA banks (the fused adapter loop): 4 min wall on one H200 (244 s at d629e95; its timeouts add up
# to 5.8). From the repo root (or a copy of the tree): run(command="bash scripts/device_banks.sh", timeout_s=360)
# 0. The GPU tests of the LoRA paths: tests/test_lora_banks.py (the adapter loop, its GPU-size and CUDA-graph test),
#    tests/test_experts.py and tests/test_lora.py (-k: the fused paths, path forcing, CUDA graphs, the banks).
# 1. python -m moelab.bench --lora: Qwen3-30B-A3B, T = 1, 32, 1024, 16384, one rank-16 adapter and the 8- and
#    32-adapter mixed banks (ranks 64/32/16/8), each with the module's own choice (auto: the stacked modes for the
#    one adapter; for the mixed banks the adapter loop up to 0.5 rows per expert, the flow above), the adapter loop
#    forced, and vLLM's unfused flow (fused=False); every row checked against float64 on 4 tokens.
# Writes $OUT/{env.txt,tests.log,lora.json,lora.md,lora.log}.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-build/banks}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt
el tests
PYTHONPATH=$PWD timeout 100 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_lora_banks.py \
  tests/test_experts.py tests/test_lora.py -k "banks or adapter or fused or path or graph or bank or rank" \
  > "$OUT/tests.log" 2>&1
echo "tests exit $?"; tail -15 "$OUT/tests.log"
el bench
PYTHONPATH=$PWD timeout 225 python3 -m moelab.bench --quick --lora --shape qwen3-30b-a3b --tokens 1,32,1024,16384 \
  --peers none --lora-variants "1x all,8x mixed,32x mixed" --lora-paths auto,adapter-loop,flow --check-tokens 4 \
  --time-budget 190 --out "$OUT/lora.json" > "$OUT/lora.log" 2>&1
echo "bench exit $?"
grep -E "T=|FAIL|Error" "$OUT/lora.log" | grep -v "^\[.*\] T=.*elapsed" | cut -c1-150 | head -90
el done
