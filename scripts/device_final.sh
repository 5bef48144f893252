#!/usr/bin/env bash
# The session's closing H200 call (~8.5 min wall; each step under its own timeout), from the repo root:
#   run(command="bash scripts/device_final.sh", carry=[".whl-lab"], timeout_s=590)
# 1. gpu_suite.log: the GPU test suite (kernels, routed MoE, LoRA paths and wide banks, ops, routing, house,
#    launches, the scoped interpreter's GPU checks).
# 2. scripts/device_install.sh: the GPU box's `make lab` (install timed, then every notebook at full size).
# 3. base.*: routed_moe on Qwen3-30B-A3B at every T (issue 13's before/after table), moelab alone.
# 4. big.*: issue 12's missing rows: DeepSeek-V3 at every T, beside grouped_mm.
set -uo pipefail
export PYTHONUNBUFFERED=1
DEST=${OUT:-build/final}; mkdir -p "$DEST"
# The logs are written to /tmp/final and packed into $DEST/final.tgz on exit (the tool brings back 8 files at most).
OUT=/tmp/final; rm -rf "$OUT"; mkdir -p "$OUT"
trap 'tar czf "$DEST/final.tgz" -C "$OUT" .' EXIT
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt
el "gpu suite"
PYTHONPATH=$PWD COLUMNS=200 timeout -s INT 150 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE --tb=short \
  tests/test_experts.py tests/test_routed_moe.py tests/test_ops.py tests/test_routing.py tests/test_lora.py \
  tests/test_house.py tests/test_launch.py tests/test_interpreter.py tests/test_lora_banks.py \
  tests/test_kernel_activations.py > "$OUT/gpu_suite.log" 2>&1; echo "gpu suite: exit $?"
grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed)" "$OUT/gpu_suite.log" | tail -15
el install
OUT=$OUT INSTALL_S=150 NB_S=230 bash scripts/device_install.sh 2>&1 | tail -40 | tee "$OUT/install.txt"
el base
B="python3 -m moelab.bench --quick --check-tokens 4"
PYTHONPATH=$PWD timeout 45 $B --shape qwen3-30b-a3b --impls moelab --peers none --no-ceilings \
  --tokens 1,32,128,1024,4096,16384 --time-budget 38 --out "$OUT/base.json" > "$OUT/base.log" 2>&1
echo "base: exit $?"; grep -A9 "median µs" "$OUT/base.md" | head -10
el big
PYTHONPATH=$PWD timeout 75 $B --peers grouped_mm --shape deepseek-v3 --tokens 1,32,128,1024,4096,16384 \
  --time-budget 55 --out "$OUT/big.json" > "$OUT/big.log" 2>&1; echo "big: exit $?"
grep -A9 "median µs" "$OUT/big.md" | head -10
el done
