#!/usr/bin/env bash
# Issue 12, the segments in two launches (count with the -1 fill, scatter with its own scan; PDL in graphs): HEAD
# against OLD, the moelab package of an earlier commit unpacked into build/ab/old, in one call.
#   here:   rm -rf build/ab/old && mkdir -p build/ab/old && git archive <old commit> moelab | tar -x -C build/ab/old
#   device: run(command="MOELAB_COMMIT=<HEAD> OLD_COMMIT=<old> bash scripts/device_segments.sh", carry=["build/ab"])
# Steps (RUNS): tests (the GPU tests of the segments and of the LoRA paths that build them), segold segnew
# (scripts/segments_profile.py on OLD's or HEAD's moelab, routed-MoE groupings of SEG_E experts, K = 8, T = SEG_T;
# segnew also times the one-program segments at 2-16 warps), bold1 bnew1 bold2 bnew2 (the base layer in the bench,
# BENCH_SHAPES at BENCH_T, CUDA graphs up to 4096; the bench's summary lines printed).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-build/segments}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
. "$(dirname "$0")/device_env.sh"
echo "old ${OLD_COMMIT:-unknown}" >> "$OUT/env.txt"
for step in ${RUNS:-tests segold segnew bold1 bnew1 bold2 bnew2}; do
  el "$step"
  case $step in
    tests) PYTHONPATH=$PWD gpu_tests 200 tests/test_routed_moe.py tests/test_lora.py tests/test_lora_banks.py \
             -k "segments or delta or bank" ;;
    segold|segnew)
      root=$PWD; [[ $step == segold ]] && root=$PWD/build/ab/old
      warps=""; [[ $step == segnew ]] && warps=2,4,8,16
      for E in ${SEG_E:-128 64}; do
        PYTHONPATH=$root timeout 100 python3 scripts/segments_profile.py --tokens "${SEG_T:-32,128,1024,4096,16384}" \
          --adapters 0 --experts "$E" --one-chunk-warps "$warps" 2>&1 | sed "s/^/E=$E /" | tee -a "$OUT/$step.log"
      done ;;
    bold*|bnew*)
      root=$PWD; [[ $step == bold* ]] && root=$PWD/build/ab/old
      (cd "$root" && PYTHONPATH=$root timeout 150 python3 -m moelab.bench --quick --check-tokens 4 --peers none \
        --impls moelab --no-ceilings --graph-max-t 4096 --shape "${BENCH_SHAPES:-qwen3-30b-a3b;olmoe}" \
        --tokens "${BENCH_T:-1024,4096}" --time-budget 130 --out "$OUT/$step.json" > "$OUT/$step.log" 2>&1)
      echo "$step exit $?"; grep -E "^\| (Qwen|OLMoE|Mixtral|GPT|E64)" "$OUT/$step.log" | head -12; rm -f "$OUT/$step.log" ;;
  esac
done
el done
