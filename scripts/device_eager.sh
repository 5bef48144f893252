#!/usr/bin/env bash
# Eager host time measured back to back (scripts/host_cost.py) on every bench shape, one H200 call. LAYERS layers of
# their own weights are called in turn (default 4, as a model's forward pass calls them: no call finds its weights
# in the L2), each time per layer:
#   1. the base call at T = 1 and 32 on seven shapes: back-to-back eager, the CUDA-graph replay of the same calls,
#      and the bench's own eager timing (do_bench after an L2 flush)                                    <= 240 s
#   2. LoRAExperts, one rank-16 adapter on every token, and the base call, at Qwen3-30B-A3B, OLMoE, GPT-OSS-20B,
#      T = 1, 8, 32, 128                                                                                 <= 200 s
#   3. scripts/host_time.py: one T = 1 call's host time split into moelab's Python, dispatch and launcher   <= 60 s
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_eager.sh", timeout_s=540).
# Files: env.txt, host_base.txt, host_lora.txt, host_time.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} MPLBACKEND=Agg
OUT=${OUT:-build/device_eager}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt
L=${LAYERS:-4}
el "host cost, base"
timeout -s INT 240 python3 scripts/host_cost.py --rounds 5 --calls 50 --tokens 1,32 --layers "$L" \
  --shape "qwen3-30b-a3b;olmoe;mixtral;gpt-oss-20b;deepseek-v3;64,6,2048,1408;128,8,4096,1536" 2>&1 \
  | tee "$OUT/host_base.txt" | grep -v "^moelab"
el "host cost, LoRA and base"
{ timeout -s INT 100 python3 scripts/host_cost.py --rounds 5 --calls 50 --tokens 1,8,32,128 --layers "$L" --lora 16 \
    --shape "qwen3-30b-a3b;olmoe;gpt-oss-20b"
  timeout -s INT 100 python3 scripts/host_cost.py --rounds 5 --calls 50 --tokens 8,128 --layers "$L" \
    --shape "qwen3-30b-a3b;olmoe;gpt-oss-20b"; } 2>&1 | tee "$OUT/host_lora.txt" | grep -v "^moelab"
el "host time split"
timeout -s INT 60 python3 scripts/host_time.py --shape qwen3-30b-a3b,gpt-oss-20b --tokens 1 --calls 300 2>&1 \
  | tee "$OUT/host_time.txt" | tail -12
el done
