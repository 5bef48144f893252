#!/usr/bin/env bash
# Issue 12, serving banks on vLLM's flow (BENCHMARKS.md, "Serving banks on vLLM's flow"): HEAD against OLD, the moelab
# package of an earlier commit unpacked into build/ab/old, in one call; the delta kernel's tile sweep; Nsight Compute.
#   here:   mkdir -p build/ab/old && git archive <old commit> moelab | tar -x -C build/ab/old
#   device: run(command="MOELAB_COMMIT=<HEAD> OLD_COMMIT=<old> RUNS='tests sweep new1 old1' bash
#           scripts/device_flow_ranks.sh", carry=["build/ab"])   (NB2's call: 327 s on an H100 with BENCH_SHAPES=qwen3)
# Steps (RUNS, in order; the default runs all of them, ~15 min: split it over calls of under 10 minutes):
#   tests          GPU tests of the delta kernel, the LoRA paths and the segments (70 s warm; a cold H100 took 240 s and
#                  more: the 420 s limit)
#   old1 new1 ...  python -m moelab.bench --lora, LORA_VARIANTS (default the 8- and 32-adapter mixed banks, ranks
#                  64/32/16/8) on BENCH_SHAPES (default Qwen3-30B-A3B and OLMoE) at BENCH_T (default 32,128,1024,4096),
#                  on OLD (old*) or HEAD (new*); each process runs from its own tree (~50-70 s a shape)
#   sweep          scripts/lora_delta_sweep.py at SWEEP_T (default 128,1024,4096), segment tiles SWEEP_TILES (default
#                  16,32,64); sweep32 the 32-adapter bank
#   cross          HEAD's two delta modes forced (flow-grouped, flow-per-slot), Qwen3 8 adapters, T = 128-1024
#   segold segnew  scripts/segments_profile.py on OLD's or HEAD's moelab: each kernel of the segments by expert and
#                  of the LoRA grouping of 8 and 32 adapters (Qwen3's 128 experts), T = SEG_T (default 1024,4096,16384)
#   ncuT           Nsight Compute on each kernel of one eager call at T (ncu128, ncu1024), Qwen3 8 adapters
#   secT           Nsight Compute's sections (occupancy, memory, warp stalls) on the delta kernels of one eager call at T
#   host           scripts/host_time.py: the host time of eager calls of the 8-adapter bank at HOST_T (128,1024), each
#                  Triton launch named; then one call under torch's sync debug mode (a host sync raises)
#   replays        scripts/host_cost.py --compare-replays: eager calls with eager_graphs' replays on and off in one
#                  process, against the CUDA graph, Qwen3 T = 128 and 1024: the 8-adapter bank and one rank-16 adapter
#   segtests       the GPU tests of the segments and the delta kernel only (~60 s)
#   graphtests     the GPU tests of the eager replays and of LoRAExperts
# Writes $OUT/{env.txt,tests.log,<step>.json|.log|.md,sweep.log,ncuT.csv}.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-build/flow_ranks}; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
. "$(dirname "$0")/device_env.sh"  # el, gpu_tests, $OUT/env.txt
echo "old ${OLD_COMMIT:-unknown}" >> "$OUT/env.txt"
BENCH=(--quick --lora --check-tokens 4 --peers none --impls moelab --no-ceilings
       --lora-variants "${LORA_VARIANTS:-8x mixed,32x mixed}" --graph-max-t 4096)
for step in ${RUNS:-tests old1 new1 old2 new2 cross}; do
  el "$step"
  case $step in
    tests) PYTHONPATH=$PWD gpu_tests 420 tests/test_lora.py tests/test_experts.py tests/test_lora_banks.py \
             tests/test_routed_moe.py -k "not bench" ;;
    old*|new*)
      root=$PWD; [[ $step == old* ]] && root=$PWD/build/ab/old
      # `python3 -m` puts the working directory first on sys.path: run from the tree whose moelab is meant
      (cd "$root" && PYTHONPATH=$root timeout 230 python3 -m moelab.bench "${BENCH[@]}" \
        --shape "${BENCH_SHAPES:-qwen3-30b-a3b;olmoe}" --tokens "${BENCH_T:-32,128,1024,4096}" --time-budget 210 --out "$OUT/$step.json" \
        > "$OUT/$step.log" 2>&1)
      echo "$step exit $? ($(cd "$root" && python3 -c "import moelab; print(moelab.__file__)" 2>&1 | tail -1))" ;;
    sweep) PYTHONPATH=$PWD timeout 200 python3 scripts/lora_delta_sweep.py --tokens "${SWEEP_T:-128,1024,4096}" \
      --tiles "${SWEEP_TILES:-16,32,64}" | tee "$OUT/sweep.log" ;;
    sweep32) PYTHONPATH=$PWD timeout 200 python3 scripts/lora_delta_sweep.py --tokens 1024 \
      --ranks "$(python3 -c "print(','.join(['64,32,16,8'] * 8))")" --tiles 16 | tee "$OUT/sweep32.log" ;;
    ncu*)  # each kernel of one eager call of the 8-adapter mixed bank at T = ${step#ncu}, Qwen3, under Nsight Compute
      PYTHONPATH=$PWD timeout 240 ncu --clock-control none --profile-from-start off --csv --metrics \
        gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,$(
        )sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__registers_per_thread,$(
        )launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers \
        python3 scripts/lora_decode_ncu.py --shape qwen3-30b-a3b --tokens "${step#ncu}" --lora 64,32,16,8,64,32,16,8 \
        > "$OUT/$step.csv" 2> "$OUT/$step.err"
      echo "$step exit $?"; PYTHONPATH=$PWD python3 scripts/lora_decode_ncu.py --report "$OUT/$step.csv" ;;
    sec*)  # why the delta kernels stand where they do: one eager call of the 8-adapter bank at T = ${step#sec}
      PYTHONPATH=$PWD timeout 240 ncu --clock-control none --profile-from-start off -k regex:lora_shrink -c 2 \
        --section LaunchStats --section Occupancy --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats \
        python3 scripts/lora_decode_ncu.py --shape qwen3-30b-a3b --tokens "${step#sec}" --lora 64,32,16,8,64,32,16,8 \
        > "$OUT/$step.txt" 2> "$OUT/$step.err"; echo "$step exit $?"
      grep -E "lora_shrink|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|$(
        )Registers Per|Shared Memory Config|Dynamic Shared|Block Limit|Warp Cycles Per Issued|No Eligible|$(
        )Grid Size|L2 Hit|L1/TEX Hit" "$OUT/$step.txt" ;;
    host)
      PYTHONPATH=$PWD timeout 150 python3 scripts/host_time.py --shape qwen3-30b-a3b --tokens "${HOST_T:-128,1024}" \
        --calls 100 --lora 64,32,16,8,64,32,16,8 2>&1 | tee "$OUT/host.log"
      PYTHONPATH=$PWD:$PWD/scripts timeout 100 python3 -c "
import torch; from host_cost import make_call; from moelab.backends import eager_graphs
eager_graphs.ENABLED = False
for T in (${HOST_T:-128,1024}):
    call = make_call('qwen3-30b-a3b', T, 'silu', False, [64, 32, 16, 8] * 2); call(); torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error'); call(); torch.cuda.set_sync_debug_mode(0); torch.cuda.synchronize()
    print('T', T, 'no host sync in an eager call of the 8-adapter bank')
" 2>&1 | tail -5 | tee -a "$OUT/host.log" ;;
    replays)
      for ranks in 64,32,16,8,64,32,16,8 16; do
        PYTHONPATH=$PWD timeout 200 python3 scripts/host_cost.py --shape qwen3-30b-a3b --tokens 128,1024 --rounds 5 \
          --calls 50 --lora $ranks --compare-replays 2>&1 | tee -a "$OUT/replays.log"
      done ;;
    segtests) PYTHONPATH=$PWD gpu_tests 200 tests/test_routed_moe.py tests/test_lora.py -k "segments or delta" ;;
    graphtests) PYTHONPATH=$PWD gpu_tests 300 tests/test_eager_graphs.py tests/test_experts.py ;;
    segold|segnew)
      root=$PWD; [[ $step == segold ]] && root=$PWD/build/ab/old
      PYTHONPATH=$root timeout 150 python3 scripts/segments_profile.py --tokens "${SEG_T:-1024,4096,16384}" \
        --adapters 0,8,32 2>&1 | tee "$OUT/$step.log" ;;
    cross)
      PYTHONPATH=$PWD timeout 120 python3 -m moelab.bench "${BENCH[@]}" --shape qwen3-30b-a3b \
        --tokens 128,256,512,1024 --lora-variants "8x mixed" --lora-paths flow-grouped,flow-per-slot \
        --time-budget 100 --out "$OUT/cross.json" > "$OUT/cross.log" 2>&1
      echo "cross exit $?" ;;
  esac
done
el done
