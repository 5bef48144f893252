#!/usr/bin/env bash
# Eager T = 1 on the token-major path whatever the bytes, and where LoRA's eager host time goes; one H200 call:
#   1. scripts/token_major_ab.py on E128 K8 H4096 I1536 (8 experts of 37.7 MB), T = 1, 2 (each token-major
#      output checked against the tiled pipeline's)                                                      <= 55 s
#   2. the bench's eager and graph rows there, T = 1, 32 (the scorecard's table 4)                        <= 40 s
#   3. scripts/host_cost.py on Qwen3-30B-A3B, T = 1, 128: the base call and LoRAExperts (one rank-16 adapter)  <= 60 s
#   RUN_TESTS=1 first runs tests/test_token_major.py on the GPU (<= 90 s).
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_e128_host.sh", timeout_s=170).
# Files: env.txt, [tests.log], tm_ab.{md,json}, bench.{md,json,err}, host.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} MPLBACKEND=Agg
OUT=${OUT:-build/device_e128_host}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, $OUT/env.txt
if [ -n "${RUN_TESTS:-}" ]; then
  el "tests"
  gpu_tests 90 tests/test_token_major.py
fi
el "token-major a/b"
timeout -s INT 55 python3 scripts/token_major_ab.py --shape "128,8,4096,1536" --tokens 1,2 --json "$OUT/tm_ab.json" \
  2>&1 | tee "$OUT/tm_ab.md" | tail -8
el "bench"
timeout -s INT 40 python3 -m moelab.bench --quick --check-tokens 4 --peers none --impls moelab --no-ceilings \
  --shape 128,8,4096,1536 --tokens 1,32 --time-budget 32 --out "$OUT/bench.json" > "$OUT/bench.md" 2> "$OUT/bench.err"
echo "rc=$?"; tail -2 "$OUT/bench.err"; grep -a -A6 "median µs" "$OUT/bench.md" | head -8
el "host cost"
{ timeout -s INT 30 python3 scripts/host_cost.py --shape qwen3-30b-a3b --tokens 1,128 --rounds 5 --calls 100
  timeout -s INT 30 python3 scripts/host_cost.py --shape qwen3-30b-a3b --tokens 1,128 --rounds 5 --calls 100 --lora 16
} 2>&1 | tee "$OUT/host.txt" | grep -v "^moelab"
el done
