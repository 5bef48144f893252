#!/usr/bin/env bash
# Issue 12's whole table in one H200 call (~9 min wall at most; each step under its own timeout):
#   run(command="bash scripts/device_issue12.sh", timeout_s=590)      # from the repo root; results under $OUT
# 1. base.*: routed_moe (triton, eager and CUDA graph) beside torch grouped_mm on every shape of the bench's
#    SHAPES at T = 1, 32, 128, 1024, 4096, 16384; every row checked against the float64 reference (4 tokens).
# 2. unseen.*: the same on shapes moelab's tile table was never tuned on (the heuristic's test): DeepSeek-V2-Lite
#    (E64 K6 H2048 I1408), Qwen3-235B-A22B (E128 K8 H4096 I1536), Llama-4-Scout (E16 K1 H5120 I8192).
# 3. oai.*: GPT-OSS-20B's real experts (swigluoai, biases) at every T.
# 4. lora.*: LoRAExperts on Qwen3-30B-A3B, one rank-16 adapter and the 8- and 32-adapter mixed banks, T = 1 to
#    16384, eager and under CUDA graphs at every T (scorecard tables 5 and 6).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-build/issue12}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt
ALL_T=1,32,128,1024,4096,16384
B="python3 -m moelab.bench --quick --check-tokens 4 --peers grouped_mm"
el base
timeout 200 $B --tokens $ALL_T --shape qwen3-30b-a3b,olmoe,mixtral,gpt-oss-20b,deepseek-v3 --time-budget 185 \
  --out "$OUT/base.json" > "$OUT/base.log" 2>&1; echo "base: exit $?"
el unseen
timeout 90 $B --tokens $ALL_T --shape "64,6,2048,1408;128,8,4096,1536;16,1,5120,8192" --time-budget 78 \
  --out "$OUT/unseen.json" > "$OUT/unseen.log" 2>&1; echo "unseen: exit $?"
el oai
timeout 50 $B --tokens $ALL_T --shape gpt-oss-20b --activation swigluoai --bias --time-budget 40 \
  --out "$OUT/oai.json" > "$OUT/oai.log" 2>&1; echo "oai: exit $?"
el lora
timeout 200 python3 -m moelab.bench --quick --check-tokens 4 --peers none --lora --shape qwen3-30b-a3b \
  --tokens 1,8,32,128,1024,4096,16384 --lora-variants "1x all,8x mixed,32x mixed" --graph-max-t 16384 --time-budget 185 \
  --out "$OUT/lora.json" > "$OUT/lora.log" 2>&1; echo "lora: exit $?"
el done
grep -h "FAILED" "$OUT"/*.log | head -20
