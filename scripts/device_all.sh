#!/usr/bin/env bash
# One call of the lent H200 for everything this round (device time is short): the GPU test suite, the GEMM
# tile sweep (its winners rewrite moelab/backends/triton_configs.json there and come back in $OUT), then the
# benchmarks with those configs. Run from the repo root:
#   run(command="MOELAB_COMMIT=<sha> bash scripts/device_all.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-build}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_S:-130} python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_routed_moe.py tests/test_ops.py \
  tests/test_experts.py tests/test_lora.py tests/test_packing.py 2>&1 | tail -8 | tee "$OUT/tests.log"
timeout ${TUNE_S:-170} python3 scripts/tune_moe.py --budget-s ${TUNE_PER_T:-22} 2>&1 | grep -v failed | tee "$OUT/tune.log"
timeout ${BASE_S:-150} python3 -m moelab.bench --shape qwen3-30b-a3b --tokens 1,32,128,1024,4096,16384 --quick \
  --time-budget $(( ${BASE_S:-150} - 20 )) --out "$OUT/bench_base.json" > "$OUT/bench_base.log" 2>&1
tail -25 "$OUT/bench_base.log"
timeout ${LORA_S:-110} python3 -m moelab.bench --shape qwen3-30b-a3b --tokens 1,32,16384 --lora --ops --quick \
  --lora-variants "1x all,4x all,4x half" --time-budget $(( ${LORA_S:-110} - 20 )) --out "$OUT/bench_lora.json" \
  > "$OUT/bench_lora.log" 2>&1
tail -25 "$OUT/bench_lora.log"
