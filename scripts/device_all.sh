#!/usr/bin/env bash
# One call of the lent H200 for everything this round (device time is short): the GPU test suite, the GEMM
# tile sweep (its winners rewrite moelab/backends/triton_configs.json there and come back in $OUT), the
# benchmarks with those configs, then every notebook at full size. Run from the repo root:
#   run(command="MOELAB_COMMIT=<sha> bash scripts/device_all.sh", carry=[".whl"], timeout_s=560)
# A step whose *_S budget is 0 is skipped (TEST_S, TUNE_S, BASE_S, LORA_S, PROF_S, NB_S). LORA_VARIANTS picks the
# LoRA bench's variants (its bank has as many slots as the widest one), LORA_TAG suffixes its output files.
# .whl/ holds the liger-kernel wheel; .whl/nb/ papermill, ipykernel and what they need beyond the image.
# They are not committed (.git/info/exclude has /.whl/); fetch them once per machine with:
#   P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64"
#   P="$P --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
#   python3 -m pip download --no-deps $P -d .whl liger-kernel
#   python3 -m pip download $P -d .whl/nb papermill ipykernel ipywidgets nbformat nbclient
#   (then delete from .whl/nb what the image already has: attrs certifi charset_normalizer click idna packaging
#    psutil pygments python_dateutil PyYAML requests tqdm typing_extensions urllib3)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
OUT=${OUT:-build}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl .whl/nb/*.whl 2>&1 | tail -2
export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
[ "${TEST_S:-90}" -gt 0 ] && timeout ${TEST_S:-90} python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_experts.py tests/test_routed_moe.py tests/test_ops.py tests/test_routing.py \
  tests/test_lora.py tests/test_house.py 2>&1 | tail -4 | tee "$OUT/tests.log"
[ "${TUNE_S:-100}" -gt 0 ] && timeout ${TUNE_S:-100} python3 scripts/tune_moe.py --tokens ${TUNE_T:-32,128,1024,4096} --budget-s ${TUNE_PER_T:-15} \
  2>&1 | grep -v failed | tee "$OUT/tune.log"
[ "${PROF_S:-40}" -gt 0 ] && timeout ${PROF_S:-40} python3 scripts/profile_launch.py --tokens ${PROF_T:-128} \
  --modes ${PROF_MODES:-base,lora} 2>&1 | grep -v Warn | tee "$OUT/profile.log"
[ "${BASE_S:-120}" -gt 0 ] && timeout ${BASE_S:-120} python3 -m moelab.bench --shape qwen3-30b-a3b --tokens 1,32,128,1024,4096,16384 --quick \
  --time-budget $(( ${BASE_S:-120} - 15 )) --out "$OUT/bench_base.json" > "$OUT/bench_base.log" 2>&1
grep -A9 "median µs" "$OUT/bench_base.log" | head -10
[ "${LORA_S:-90}" -gt 0 ] && timeout ${LORA_S:-90} python3 -m moelab.bench --shape qwen3-30b-a3b --tokens 1,32,16384 --lora --ops --quick \
  --lora-variants "${LORA_VARIANTS:-1x all,4x all}" --time-budget $(( ${LORA_S:-90} - 15 )) \
  --out "$OUT/bench_lora${LORA_TAG:-}.json" > "$OUT/bench_lora${LORA_TAG:-}.log" 2>&1
grep -B2 -A12 "time / base\|/ base" "$OUT/bench_lora${LORA_TAG:-}.log" | head -30
grep -A8 "^\*\*ops" "$OUT/bench_lora${LORA_TAG:-}.log"
[ "${NB_S:-130}" -gt 0 ] && timeout ${NB_S:-130} python3 -m moelab.lab --full --out /tmp/lab 2>&1 | tail -12 | tee "$OUT/lab.log"
