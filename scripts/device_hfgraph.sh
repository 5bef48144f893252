#!/usr/bin/env bash
# Issue 11 item 6 on one H200, one call of under 5 minutes (each step has its own timeout; 8 files under $OUT):
#   1. python -m moelab.hf.bench, 4 layers of Qwen3-30B-A3B, T = 1,128,4096: whole forwards (HF eager, grouped_mm,
#      moelab, PEFT, moelab + LoRA), generate() tokens/s, and the experts' share of the moelab forward two ways:
#      eager, each experts call stamped alone (host launch time included), and timed as python -m moelab.bench
#      times its call (graph_share: CUDA-graph replays at T <= 1024, eager above, of the forward, the forward with
#      stand-in experts, the layer calls alone); stderr lines "# experts share"                              <= 140 s
#   2. the same on 2 layers of GPT-OSS-20B (3 timed calls per row, 8 generated tokens)                      <= 100 s
#   3. tests/test_hf_bench.py on the GPU (the capture test runs there only)                                  <= 60 s
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_hfgraph.sh", timeout_s=330).
# Files: env.txt, hf_qwen3.{md,err,json}, hf_gptoss.{md,err,json}, hf_bench_tests.log.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-} MPLBACKEND=Agg
OUT=${OUT:-build/device_hfgraph}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt
python3 -c "import transformers, peft; print('transformers', transformers.__version__, 'peft', peft.__version__)" \
  2>&1 | tee -a "$OUT/env.txt"

bench() {  # NAME SECONDS ARGS...: one python -m moelab.hf.bench run; its table, share lines and errors printed
  local name=$1 secs=$2; shift 2
  el "$name"
  timeout "$secs" python3 -m moelab.hf.bench "$@" --json "$OUT/$name.json" > "$OUT/$name.md" 2> "$OUT/$name.err"
  echo "rc=$?"; cat "$OUT/$name.md"
  grep -E "^# (experts share|[0-9]+ MoE layer)|^#   not measured" "$OUT/$name.err"
  grep -v "^#" "$OUT/$name.err" | grep -iE "error|traceback" | tail -12
}
bench hf_qwen3 "${QWEN_S:-140}" --shape qwen3-30b-a3b --layers 4 --tokens 1,128,4096 --generate 16 --iters 5
bench hf_gptoss "${GPTOSS_S:-100}" --shape gpt-oss-20b --layers 2 --tokens 1,128,4096 --generate 8 --iters 3

el "hf bench tests"
# timeout sends SIGINT first, so pytest still prints the summary of what ran; COLUMNS keeps its lines whole
COLUMNS=400 timeout -s INT -k 10 "${TEST_S:-60}" python3 -m pytest -q -p no:cacheprovider -rA --tb=short \
  tests/test_hf_bench.py > "$OUT/hf_bench_tests.log" 2>&1
echo "rc=$?"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED) |[0-9]+ (passed|failed|errors?)( |,|$)" \
  "$OUT/hf_bench_tests.log" | tail -12
el done
