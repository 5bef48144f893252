#!/usr/bin/env bash
# The pipelined token-major tiles (choose_token_major_config at H < 4096), one H200 call:
#   1. the GPU tests (TESTS: the token-major and eager-graph paths)                                      <= TESTS_S
#   2. scripts/token_major_ncu.py at T = 1 on the large experts (NCU_SHAPES: Mixtral, DeepSeek-V3)
#   3. scripts/token_major_ab.py, T = 1 and 2: tiled against token-major, eagerly and in graph replays (AB=0: not)
#   4. scripts/host_cost.py --layers 4 (TOKENS: T = 1), the base call and one rank-16 adapter, with
#      TOKEN_MAJOR_MAX_SLOTS_GRAPH set to each of SLOTS in turn (0: the tiled pipeline in graphs; default 0 8 0 8)
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_token_major_graphs.sh", timeout_s=590).
# Files: env.txt, tests.log, ncu_big.csv, plan_big.json, sweep_big.txt, ab.txt, host_graph_slots.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} MPLBACKEND=Agg
OUT=${OUT:-build/device_token_major_graphs}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"
el "GPU tests"
WORKERS=${WORKERS:-8} gpu_tests "${TESTS_S:-90}" ${TESTS:-tests/test_token_major.py tests/test_eager_graphs.py}
el "token-major kernels under ncu, large experts"
timeout -s INT 100 ncu --profile-from-start off -k regex:token_major --metrics gpu__time_duration.sum --csv \
  python3 scripts/token_major_ncu.py --shape "${NCU_SHAPES:-mixtral;deepseek-v3}" --tokens 1 --plan "$OUT/plan_big.json" \
  > "$OUT/ncu_big.csv" 2>&1
python3 scripts/token_major_ncu.py --report "$OUT/plan_big.json" "$OUT/ncu_big.csv" > "$OUT/sweep_big.txt" 2>&1
grep -E "^best|Error|not the same" "$OUT/sweep_big.txt"
[ "${AB:-1}" = 1 ] && el "token_major_ab" && timeout -s INT 150 python3 scripts/token_major_ab.py --shape "qwen3-30b-a3b;olmoe;64,6,2048,1408;gpt-oss-20b" \
  --tokens 1,2 2>&1 | tee "$OUT/ab.txt"
el "host cost, TOKEN_MAJOR_MAX_SLOTS_GRAPH in turn: ${SLOTS:-0 8 0 8}"
for slots in ${SLOTS:-0 8 0 8}; do
  for v in "" "--lora 16"; do
    echo "=== TOKEN_MAJOR_MAX_SLOTS_GRAPH=$slots ${v:-base}"
    GRAPH_SLOTS=$slots timeout -s INT 60 python3 - --rounds 5 --calls 50 --tokens "${TOKENS:-1}" \
      --layers "${LAYERS:-4}" --shape "${SHAPES:-qwen3-30b-a3b;olmoe;64,6,2048,1408;gpt-oss-20b}" $v <<'PY'
import os, runpy, sys
from moelab.backends import triton_backend
triton_backend.TOKEN_MAJOR_MAX_SLOTS_GRAPH = int(os.environ["GRAPH_SLOTS"])
sys.argv[0] = "host_cost.py"
runpy.run_path("scripts/host_cost.py", run_name="__main__")
PY
  done
done 2>&1 | tee "$OUT/host_graph_slots.txt" | grep -v "^moelab"
el done
