#!/usr/bin/env bash
# The Gluon GEMMs' tile schedule rule (gluon_gemm.TILE_SCHEDULE = "rule", the default) on one GPU, from the repo
# root (~7 min); at most eight files under $OUT:
#   run(command="bash scripts/device_tile_rule.sh", timeout_s=590)
# 1. tests: tests/test_gluon_gemm.py on the rule.
# 2. ab_*: scripts/tma_ab.py, the static schedule against the rule (and dynamic), one routed_moe call: DeepSeek-V3 at
#    T = 2048 and 4096 (dynamic-group2 too), the unseen shapes (E64 K6, E128 K8 H4096, Llama-4-Scout's experts) at
#    T = 1024, 4096 and 16384, Qwen3-30B-A3B, OLMoE, GPT-OSS-20B and Mixtral at T = 1024 (graph too).
# 3. bench: python -m moelab.bench on DeepSeek-V3 at T = 4096 and 16384 (the scorecard's cells, with their floors
#    and torch grouped_mm), float64-checked; then ab_unseen.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
OUT=${OUT:-build/tile_rule}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"
el tests
gpu_tests 60 tests/test_gluon_gemm.py
ab ab_ds static,dynamic,rule,dynamic-group2 deepseek-v3 2048,4096 100
ab ab_small static,rule "qwen3-30b-a3b;olmoe;gpt-oss-20b;mixtral" 1024 60
el bench
timeout 100 python3 -m moelab.bench --quick --check-tokens 4 --peers grouped_mm --shape deepseek-v3 --tokens 4096,16384 \
  --time-budget 90 --out "$OUT/bench.json" > /tmp/bench.log 2>&1; echo "bench: exit $?"
grep "DeepSeek" "$OUT/bench.md" | head -12
ab ab_unseen static,rule "64,6,2048,1408;128,8,4096,1536;16,1,5120,8192" 1024,4096,16384 130
el done
