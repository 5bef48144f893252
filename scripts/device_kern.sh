#!/usr/bin/env bash
# Issue 11 part 2 on the H200, at most 3 minutes wall: the triton backend's fused expert activations, biases and
# router weight on the input, compiled.
#   1. GPU tests, <= 60 s: bf16 at the tuned tiles vs the float64 reference (every activation x bias x weight on the
#      input, decode and prefill configs), GPT-OSS bf16, the fused LoRA bank with each gated activation, notebook
#      02's lesson per activation, hypothesis shapes (the fp32 option grid ran on the CPU interpreter)
#   2. moelab.bench at GPT-OSS-20B's layer shape (E32 K4 H2880 I2880), swigluoai with biases, T=1,128,4096: moelab
#      triton (eager and CUDA graph) vs moelab torch vs torch._grouped_mm, <= 45 s; then moelab triton alone in
#      plain SwiGLU without biases at the same shape (the cost of the fused options), <= 15 s
#   3. python -m moelab.hf.bench: 2 GPT-OSS-20B layers, moelab ("auto" now picks triton) vs HF grouped_mm and
#      eager, PEFT, generate(), <= 60 s
# Run from the repo root: run(command="bash scripts/device_kern.sh", timeout_s=200). Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-build/device_kern}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__)"
start=$SECONDS
timeout ${TEST_S:-60} python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernel_activations.py \
  tests/test_hf_activations.py -k "compiled or bf16 or lora or alpha or notebook or any_shape or refuse or torch" \
  2>&1 | tail -6 | tee "$OUT/tests.log"
echo "tests: $((SECONDS - start)) s"; start=$SECONDS
timeout ${BENCH_S:-45} python3 -m moelab.bench --shape gpt-oss-20b --activation swigluoai --bias --tokens 1,128,4096 \
  --quick --no-ceilings --peers torch,grouped_mm --time-budget 32 --out "$OUT/bench_gptoss_swigluoai_bias.json" \
  > "$OUT/bench_gptoss_swigluoai_bias.log" 2>&1; echo "bench rc=$?"
grep -A6 "median µs" "$OUT/bench_gptoss_swigluoai_bias.log" | head -7
timeout 15 python3 -m moelab.bench --shape gpt-oss-20b --tokens 1,128,4096 --quick --no-ceilings --no-graphs \
  --peers none --out "$OUT/bench_gptoss_swiglu.json" > "$OUT/bench_gptoss_swiglu.log" 2>&1
echo "bench (plain SwiGLU) rc=$?"; grep -A6 "median µs" "$OUT/bench_gptoss_swiglu.log" | head -7
echo "bench: $((SECONDS - start)) s"; start=$SECONDS
timeout ${HF_S:-60} python3 -m moelab.hf.bench --shape gpt-oss-20b --layers 2 --tokens 1,128,4096 --generate 8 \
  --iters 3 --json "$OUT/hf_bench_gptoss.json" 2>&1 | tail -25 | tee "$OUT/hf_bench_gptoss.log"
echo "hf bench: $((SECONDS - start)) s"
