#!/usr/bin/env bash
# A/Bs of the token-major path in CUDA graphs, one H200 call a PART:
#   PART=base: the GPU tests (TESTS), then scripts/host_cost.py --layers 4 at T = 1 and 2 with prefetch2 off and
#              on in turn (ROUNDS times), then Mixtral T = 1 on its unpipelined tiles and the pipelined ones in turn
#   PART=lora: one rank-16 adapter, T = 1 and 2: the tiled pipeline in graphs (lora_slots=0) against the token-major
#              path with the shrink before GEMM1 (beside=0) and beside it (beside=1), in turn (ROUNDS times)
#   PART=rule: the GPU tests of the token-major path, LoRA and graphs, then HEAD's rule with one rank-16 adapter at
#              T = 1-3 on SHAPES, then Mixtral T = 1 on its unpipelined tiles and the pipelined ones with
#              programmatic dependent launch on (MOELAB_PDL=1) and off
#   PART=pdl:  tests/test_token_major.py, then T = 1 on HEAD's rule, with programmatic dependent launch on and off
#              on every shape, and with Mixtral's unpipelined tiles (pdl.txt)
#   PART=early: tests/test_token_major.py, then one rank-16 adapter at T = 1 and 2 on SHAPES with GEMM2's B_down
#              tile loaded after its K loop (early_b=0) and before it (early_b=1), in turn (early.txt; the toggle
#              lived at c84b30f only: check that commit out to run it)
#   PART=fused: the GPU tests of the token-major path, LoRA and graphs, then at T = 1 and 2 on SHAPES: the base call,
#              then one rank-16 adapter on HEAD's rule, and on the token-major path from one slot on
#              (lora_min_slots=1) with the W13 shrink in GEMM1's grid (fused_shrink=1) and as a launch of its own
#              (fused_shrink=0), in turn (fused.txt)
#   PART=final: the GPU tests of the token-major path, LoRA and graphs, then HEAD at T = 1 and 2 on SHAPES, the base
#              call and one rank-16 adapter (ROUNDS times; final.txt), then one rank-16 adapter at T = 1 on
#              BIG_SHAPES: HEAD against the tree in OLD_TREE (a `git archive` of 69f4d6d carried to the device)
#              with the shrink as a launch of its own (fused_shrink=0) and in GEMM1's grid (big.txt)
# Each variant is scripts/token_major_variants.py's. From the repo root:
#   run(command="MOELAB_COMMIT=<commit> PART=base bash scripts/device_prefetch.sh", timeout_s=590)
# Files: env.txt, tests.log, base.txt, mixtral.txt, lora.txt (rule: tests.log, lora_rule.txt, mixtral_pdl.txt).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} MPLBACKEND=Agg
OUT=${OUT:-build/device_prefetch}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"
SHAPES=${SHAPES:-qwen3-30b-a3b;olmoe;64,6,2048,1408;gpt-oss-20b}
variant() {  # variant NAME=VALUE,... -- host_cost flags
  local v=$1; shift
  echo "=== ${v:-HEAD}"
  timeout -s INT "${EACH_S:-70}" python3 scripts/token_major_variants.py $v -- --rounds 5 --calls 50 --layers 4 "$@" \
    2>&1 | grep -v "^moelab"
}
if [ "${PART:-base}" = base ]; then
  [ -n "${TESTS-tests/test_token_major.py tests/test_eager_graphs.py}" ] && el "GPU tests" && \
    WORKERS=${WORKERS:-8} gpu_tests "${TESTS_S:-100}" ${TESTS-tests/test_token_major.py tests/test_eager_graphs.py}
  el "prefetch2 off / on"
  for r in $(seq "${ROUNDS:-2}"); do
    for p in 0 1; do variant "prefetch2=$p" --tokens "${TOKENS:-1,2}" --shape "$SHAPES"; done
  done | tee "$OUT/base.txt"
  el "Mixtral T = 1: unpipelined / pipelined tiles"
  for r in $(seq "${ROUNDS:-2}"); do
    for m in "" "mixtral=pipelined"; do variant "$m" --tokens 1 --shape mixtral; done
  done | tee "$OUT/mixtral.txt"
elif [ "$PART" = rule ]; then
  el "GPU tests" && WORKERS=${WORKERS:-8} gpu_tests "${TESTS_S:-200}" ${TESTS-tests/test_token_major.py \
    tests/test_eager_graphs.py tests/test_lora.py tests/test_lora_banks.py tests/test_experts.py}
  el "HEAD's rule, one rank-16 adapter"
  for r in $(seq "${ROUNDS:-2}"); do variant "" --tokens "${TOKENS:-1,2,3}" --shape "$SHAPES" --lora 16; done \
    | tee "$OUT/lora_rule.txt"
  el "Mixtral T = 1: unpipelined / pipelined tiles, PDL on / off"
  for r in $(seq "${ROUNDS:-2}"); do
    for pdl in 1 0; do for m in "" "mixtral=pipelined"; do
      echo "MOELAB_PDL=$pdl"; MOELAB_PDL=$pdl variant "$m" --tokens 1 --shape mixtral
    done; done
  done | tee "$OUT/mixtral_pdl.txt"
elif [ "$PART" = pdl ]; then
  el "GPU tests" && WORKERS=${WORKERS:-8} gpu_tests "${TESTS_S:-100}" ${TESTS-tests/test_token_major.py}
  el "T = 1: HEAD's rule, then programmatic dependent launch on, off; Mixtral's unpipelined tiles"
  for r in $(seq "${ROUNDS:-2}"); do
    for v in "" pdl=1 pdl=0 mixtral=unpipelined; do variant "$v" --tokens 1 --shape "${PDL_SHAPES:-mixtral;qwen3-30b-a3b;deepseek-v3}"; done
  done | tee "$OUT/pdl.txt"
elif [ "$PART" = final ]; then
  el "GPU tests" && WORKERS=${WORKERS:-8} gpu_tests "${TESTS_S:-200}" ${TESTS-tests/test_token_major.py \
    tests/test_eager_graphs.py tests/test_lora.py tests/test_experts.py tests/test_lora_banks.py}
  el "HEAD: base, one rank-16 adapter"
  for r in $(seq "${ROUNDS:-2}"); do
    variant "" --tokens "${TOKENS:-1,2}" --shape "$SHAPES"
    variant "" --tokens "${TOKENS:-1,2}" --shape "$SHAPES" --lora 16
  done | tee "$OUT/final.txt"
  el "big experts, one rank-16 adapter at T = 1: HEAD / OLD_TREE launched shrink / OLD_TREE fused"
  for r in $(seq "${ROUNDS:-2}"); do
    variant "" --tokens 1 --shape "${BIG_SHAPES:-mixtral;deepseek-v3}" --lora 16
    if [ -n "${OLD_TREE:-}" ]; then for f in 0 1; do
      echo "=== $OLD_TREE fused_shrink=$f"
      (cd "$OLD_TREE" && PYTHONPATH=$PWD:$PWD/scripts timeout -s INT "${EACH_S:-70}" python3 \
        scripts/token_major_variants.py "fused_shrink=$f" -- --rounds 5 --calls 50 --layers 4 --tokens 1 \
        --shape "${BIG_SHAPES:-mixtral;deepseek-v3}" --lora 16 2>&1 | grep -v "^moelab")
    done; fi
  done | tee "$OUT/big.txt"
elif [ "$PART" = fused ]; then
  el "GPU tests" && WORKERS=${WORKERS:-8} gpu_tests "${TESTS_S:-200}" ${TESTS-tests/test_token_major.py \
    tests/test_eager_graphs.py tests/test_lora.py tests/test_experts.py}
  el "base, then one rank-16 adapter: HEAD / token-major with the shrink fused / launched"
  { variant "" --tokens "${TOKENS:-1,2}" --shape "$SHAPES"
    for r in $(seq "${ROUNDS:-2}"); do
      for v in "" lora_min_slots=1,fused_shrink=1 lora_min_slots=1,fused_shrink=0; do
        variant "$v" --tokens "${TOKENS:-1,2}" --shape "$SHAPES" --lora 16
      done
    done; } | tee "$OUT/fused.txt"
elif [ "$PART" = early ]; then
  el "GPU tests" && WORKERS=${WORKERS:-8} gpu_tests "${TESTS_S:-100}" ${TESTS-tests/test_token_major.py}
  el "one rank-16 adapter: B_down after / before GEMM2's K loop"
  for r in $(seq "${ROUNDS:-2}"); do
    for v in early_b=0 early_b=1; do variant "$v" --tokens "${TOKENS:-1,2}" --shape "$SHAPES" --lora 16; done
  done | tee "$OUT/early.txt"
else
  el "one rank-16 adapter: tiled / token-major, shrink before / beside GEMM1"
  for r in $(seq "${ROUNDS:-2}"); do
    for v in lora_slots=0 lora_slots=16,beside=0 lora_slots=16,beside=1; do
      variant "$v" --tokens "${TOKENS:-1,2}" --shape "$SHAPES" --lora 16
    done
  done | tee "$OUT/lora.txt"
fi
el done
