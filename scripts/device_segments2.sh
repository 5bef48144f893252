#!/usr/bin/env bash
# The final check of the segments' changes (ea1bf04 and after) on one GPU call: tests, the one program's steps, the
# segments alone (HEAD, the one program at 4 and 8 warps), the base layer in the bench, OLD (build/ab/old) and HEAD.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-build/segments2}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
. "$(dirname "$0")/device_env.sh"
el tests
PYTHONPATH=$PWD gpu_tests 150 tests/test_routed_moe.py tests/test_lora_banks.py tests/test_lora.py \
  tests/test_token_major.py -k "segments or bank or decode or graph"
el parts
PYTHONPATH=$PWD timeout 60 python3 scripts/one_chunk_parts.py --slots 256,1024 --bins 128,256 2>&1 | grep slots
el segnew
for E in 128 64; do PYTHONPATH=$PWD timeout 60 python3 scripts/segments_profile.py --tokens 32,128,1024,16384 \
  --adapters 0 --experts $E --one-chunk-warps 8 2>&1 | grep "^T=" | sed "s/^/E=$E /"; done
for r in old new; do
  el "bench $r"; root=$PWD; [[ $r == old ]] && root=$PWD/build/ab/old
  (cd "$root" && PYTHONPATH=$root timeout 140 python3 -m moelab.bench --quick --check-tokens 4 --peers none \
    --impls moelab --no-ceilings --graph-max-t 16384 --shape "qwen3-30b-a3b;olmoe;64,6,2048,1408" \
    --tokens 128,1024,16384 --time-budget 125 --out "$OUT/b_$r.json" > "$OUT/b_$r.log" 2>&1)
  echo "$r exit $?"; awk '/bf16: median µs/{p=1;print;next} /bf16: measured/{p=0} p && /^\| [0-9]/' "$OUT/b_$r.md"
done
el done
