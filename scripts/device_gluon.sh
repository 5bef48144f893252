#!/usr/bin/env bash
# Issue 12, the Gluon GEMMs (moelab/kernels/gluon_gemm.py) on an sm_90 GPU, in one call:
#   run(command="MOELAB_COMMIT=<HEAD> bash scripts/device_gluon.sh")
# Steps (RUNS): tests (TESTS, default tests/test_gluon_gemm.py, stopped after TESTS_S seconds), ab (scripts/gluon_ab.py: each GEMM alone, Gluon against Triton,
# AB_T tokens, GEMM1_TILES and GEMM2_TILES), layer0 layer1 (the base layer in the bench with MOELAB_GLUON=0, then 1:
# BENCH_SHAPES at BENCH_T, CUDA graphs up to 4096, eager above; the bench's summary lines printed), score (not by
# default: the scorecard's compute-bound points with the in-run ceilings and the torch grouped_mm peer, HEAD as is),
# lora0 lora1 (not by default: LoRA rows beside the base, LORA_VARIANTS on LORA_SHAPES at LORA_T, graphs up to 1024,
# with MOELAB_GLUON=0, then 1; LORA_PATHS the paths beside auto), lorab (not by default: scripts/gluon_lora_ab.py, a tile-mode bank's LoRAExperts
# call and its base call with the Gluon GEMMs off and on in one process, LORAB_SHAPES at LORAB_T, LORAB_BANKS),
# apply (not by default: `patch -p1 < $PATCH`, a change carried beside the tree; the later steps' files are named
# with the suffix -patched, so one call times a change against the tree it applies to), profile (not by default:
# scripts/profile_lora_banks.py, each kernel's GPU time of a serving bank's call on PROFILE_PATHS, PROFILE_SHAPES at
# PROFILE_T), shrinks (not by default: scripts/shrink_sweep.py, the adapter loop's shrinks at other launch shapes).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-build/gluon}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
. "$(dirname "$0")/device_env.sh"
SUF=
for step in ${RUNS:-tests ab layer0 layer1}; do
  el "$step"
  case $step in
    apply) patch -p1 < "$PATCH" && SUF=-patched ;;
    tests) PYTHONPATH=$PWD TESTS_LOG=tests$SUF gpu_tests "${TESTS_S:-120}" ${TESTS:-tests/test_gluon_gemm.py} ;;
    ab) PYTHONPATH=$PWD timeout "${AB_S:-240}" python3 scripts/gluon_ab.py --tokens "${AB_T:-1024,4096,16384}" \
          --gemm1-tiles "${GEMM1_TILES:-128,64,3;128,64,4}" --tiles "${GEMM2_TILES:-256,64,3}" \
          --json "$OUT/gluon_ab.json" 2>&1 | grep -v "^\s*$" | tee "$OUT/gluon_ab.log" ;;
    layer0|layer1)
      MOELAB_GLUON=${step#layer} PYTHONPATH=$PWD timeout "${BENCH_S:-130}" python3 -m moelab.bench --quick \
        --check-tokens 4 --peers none --impls moelab --no-ceilings --graph-max-t 4096 \
        --shape "${BENCH_SHAPES:-qwen3-30b-a3b;olmoe;64,6,2048,1408;gpt-oss-20b;mixtral}" \
        --tokens "${BENCH_T:-1024,4096,16384}" --time-budget "$(( ${BENCH_S:-130} - 20 ))" --out "$OUT/$step$SUF.json" \
        > "$OUT/$step.log" 2>&1
      echo "$step exit $?"; grep -E "^\| (Qwen|OLMoE|Mixtral|GPT|E64)" "$OUT/$step.log" | head -20; rm -f "$OUT/$step.log" ;;
    lora0|lora1)
      MOELAB_GLUON=${step#lora} PYTHONPATH=$PWD timeout "${LORA_S:-150}" python3 -m moelab.bench --quick \
        --check-tokens 4 --peers none --impls moelab --no-ceilings --graph-max-t 1024 --lora \
        --lora-variants "${LORA_VARIANTS:-1x all,8x mixed}" --lora-paths "${LORA_PATHS:-auto}" --shape "${LORA_SHAPES:-qwen3-30b-a3b;olmoe;mixtral}" \
        --tokens "${LORA_T:-1024,4096,16384}" --time-budget "$(( ${LORA_S:-150} - 20 ))" --out "$OUT/$step$SUF.json" \
        > "$OUT/$step.log" 2>&1
      echo "$step exit $?"; grep -E "^\| (Qwen|OLMoE|Mixtral|GPT|E64)" "$OUT/$step.log" | head -40; rm -f "$OUT/$step.log" ;;
    lorab) PYTHONPATH=$PWD timeout "${LORAB_S:-200}" python3 scripts/gluon_lora_ab.py \
          --shape "${LORAB_SHAPES:-qwen3-30b-a3b;olmoe;mixtral}" --tokens "${LORAB_T:-1024,4096,16384}" \
          --banks "${LORAB_BANKS:-1x16,4x16}" --json "$OUT/gluon_lora_ab$SUF.json" 2>&1 | grep -v "^\s*$" | tail -40 ;;
    profile) for shape in ${PROFILE_SHAPES:-qwen3-30b-a3b olmoe}; do
        (cd scripts && PYTHONPATH=$PWD/.. timeout "${PROFILE_S:-150}" python3 profile_lora_banks.py --shape "$shape" \
          --tokens "${PROFILE_T:-4096,16384}" --adapters "${PROFILE_ADAPTERS:-8,32}" --paths "${PROFILE_PATHS:-adapter-loop,flow}" \
          2>&1 | grep -v -i warn | tee -a "$OUT/profile$SUF.txt"); done ;;
    shrinks) (cd scripts && PYTHONPATH=$PWD/.. timeout "${SHRINKS_S:-200}" python3 shrink_sweep.py \
          --shape "${SHRINKS_SHAPE:-qwen3-30b-a3b}" --tokens "${SHRINKS_T:-4096,16384}" --adapters "${SHRINKS_ADAPTERS:-8}" \
          2>&1 | grep -v -i warn | tee "$OUT/shrinks$SUF.md") ;;
    score)
      PYTHONPATH=$PWD timeout "${SCORE_S:-420}" python3 -m moelab.bench --quick --check-tokens 4 --peers grouped_mm \
        --graph-max-t 1024 --shape "${SCORE_SHAPES:-qwen3-30b-a3b;olmoe;mixtral;gpt-oss-20b;deepseek-v3;64,6,2048,1408}" \
        --tokens "${SCORE_T:-1024,4096,16384}" --time-budget "$(( ${SCORE_S:-420} - 30 ))" --out "$OUT/score.json" \
        > "$OUT/score.log" 2>&1
      echo "score exit $?" ;;
  esac
done
el done
