# Sourced by the device scripts after they set OUT: `el NAME` prints the seconds since the script began, and
# $OUT/env.txt gets the GPU, its driver and clocks, torch and triton, the commit (MOELAB_COMMIT: the device's copy
# of the tree has no .git) and the CPU count.
T0=$(date +%s); el() { echo "--- $1 at $(( $(date +%s) - T0 )) s"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__)"
  echo "commit ${MOELAB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"; nproc; } 2>&1 | tee "$OUT/env.txt"
# `gpu_tests SECONDS FILE...`: pytest on the GPU ($WORKERS workers, 8 unless set) into $OUT/$TESTS_LOG.log (tests.log
# unless set), stopped after SECONDS; prints the exit status and the summary lines. -rA: the log names every test
# that ran, so a run cut short still says which passed. One CPU thread a worker: with torch's 16 threads in each of
# 10-15 workers, the float64 references' small matrix products kept the LoRA tests from finishing in 8 minutes (82 s
# on one thread a worker, H100 box, 2026-12-06).
# Each test stops after TEST_TIMEOUT seconds (150 unless set; pytest-timeout's thread method, where installed: it
# dumps the stacks and ends the worker, so a kernel that never returns names its test and the rest run on).
gpu_tests() {
  local limit=$1; shift
  local per_test=()
  python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "${TEST_TIMEOUT:-150}" --timeout-method thread)
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} COLUMNS=400 timeout -s INT -k 10 "$limit" python3 -m pytest -q -rA -p no:cacheprovider -n "${WORKERS:-8}" --tb=short "${per_test[@]}" "$@" \
    > "$OUT/${TESTS_LOG:-tests}.log" 2>&1
  echo "rc=$?"; grep -E "^(FAILED|ERROR) |[0-9]+ (passed|failed|errors?)( |,|$)" "$OUT/${TESTS_LOG:-tests}.log" | tail -12
}
# `ab NAME MODES SHAPES TOKENS SECONDS`: one scripts/tma_ab.py process (MODES against the first, eager and, up to
# T = 1024, graph) into $OUT/NAME.json, its log in /tmp (the files that come back are few), its table printed.
ab() {
  el "$1"
  (cd scripts && timeout "$5" python3 tma_ab.py --modes "$2" --shape "$3" --tokens "$4" --graph-max-t 1024 \
    --json "$OUT/$1.json" > "/tmp/$1.log" 2>&1); echo "$1: exit $?"
  grep "|" "/tmp/$1.log" | grep -v -- "---" | grep -v "^| shape"
}
