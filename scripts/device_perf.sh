#!/usr/bin/env bash
# Issue 12, eager host time: ~3 min wall on one H200 (its timeouts add up to 4.2). Run from the repo root:
#   run(command="bash scripts/device_perf.sh", carry=[".dev_perf"], timeout_s=260)
# 0. The GPU tests of the fast launch path and the routed MoE (tests/test_launch.py, tests/test_routed_moe.py).
# 1. scripts/host_time.py: host µs of one eager routed_moe call at T=1 on four shapes, split into moelab's Python,
#    the kernel dispatch (Triton's, or moelab.kernels.launch's) and the compiled launcher; this tree, this tree with
#    MOELAB_FAST_LAUNCH=0 (Triton's own dispatch), and a baseline tree when .dev_perf/base/moelab exists (a copy of
#    the baseline's moelab package, not committed), interleaved so all see one host; twice.
# 2. python -m moelab.bench: eager vs CUDA-graph time of routed_moe at T=1 and 32 (the issue's target:
#    eager <= 1.5x graph), Qwen3-30B-A3B, OLMoE, Mixtral, GPT-OSS; every row checked against float64.
# Writes $OUT/{env.txt,tests.log,host.log,bench_eager_graph.{json,md,log}}.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-build/perf}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt
el tests
PYTHONPATH=$PWD timeout 40 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_launch.py tests/test_routed_moe.py \
  2>&1 | tail -4 | tee "$OUT/tests.log"
host() {  # label, PYTHONPATH, extra env, timeout (the first run compiles the kernels of four shapes)
  echo "== $1" | tee -a "$OUT/host.log"
  env PYTHONPATH="$2" $3 timeout ${4:-25} python3 scripts/host_time.py --tokens 1 --calls 200 2>&1 | grep -v Warn \
    | tee -a "$OUT/host.log"
}
for round in 1 2; do
  el "host time round $round"
  host "this tree (round $round)" "$PWD" "" 45
  [ "$round" = 1 ] && host "this tree, MOELAB_FAST_LAUNCH=0 (round $round)" "$PWD" "MOELAB_FAST_LAUNCH=0"
  [ -d .dev_perf/base/moelab ] && host "baseline .dev_perf/base (round $round)" "$PWD/.dev_perf/base" ""
done
el bench
PYTHONPATH=$PWD timeout 65 python3 -m moelab.bench --quick --no-ceilings --peers none --impls moelab --tokens 1,32 \
  --shape qwen3-30b-a3b,olmoe,mixtral,gpt-oss-20b --check-tokens 4 --time-budget 55 \
  --out "$OUT/bench_eager_graph.json" > "$OUT/bench_eager_graph.log" 2>&1
echo "bench exit $?"
grep -A12 "eager / \[graph\]" "$OUT/bench_eager_graph.md" | head -60
el done
