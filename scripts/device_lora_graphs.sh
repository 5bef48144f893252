#!/usr/bin/env bash
# LoRAExperts' eager decode calls replayed from CUDA graphs (moelab/backends/eager_graphs.py, run_lora), one H200 call:
#   1. the GPU tests of the LoRA and graph paths (TESTS: the files)                                         <= TESTS_S
#   2. scripts/host_cost.py back to back, four layers in turn, T = 1, 8 and 32, in one process per setting:
#      the base call, one rank-16 adapter (--lora 16) and a bank of 8 adapters of ranks 64/32/16/8 (tokens in turn)
#      with the replays (MOELAB_EAGER_GRAPHS=1), then the two LoRA variants without them (=0; RUNS=graphs:1
#      leaves that out; RUNS="copies:1:0 graphs:1 launches:0" adds the replays without in-place graphs;
#      SHAPES, TOKENS, LAYERS and VARIANTS change what runs)                                                                 <= 330 s
#   3. scripts/host_time.py: a replayed LoRAExperts call's host time split by the functions it passes through
#      (SPLIT=0 leaves it out)                                                                               <= 60 s
# From the repo root: run(command="MOELAB_COMMIT=<commit> bash scripts/device_lora_graphs.sh", timeout_s=590).
# Files: env.txt, tests.log, host_lora_graphs.txt, host_lora_launches.txt, host_split.txt, copies.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} MPLBACKEND=Agg
OUT=${OUT:-build/device_lora_graphs}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, gpu_tests, $OUT/env.txt
el "GPU tests of the LoRA and graph paths"
WORKERS=${WORKERS:-12} gpu_tests "${TESTS_S:-170}" ${TESTS:-tests/test_eager_graphs.py tests/test_experts.py \
  tests/test_lora_banks.py tests/test_lora.py tests/test_token_major.py}
SHAPES=${SHAPES:-"qwen3-30b-a3b;olmoe;gpt-oss-20b;64,6,2048,1408"}
for run in ${RUNS:-graphs:1 launches:0}; do  # name:MOELAB_EAGER_GRAPHS[:MOELAB_EAGER_GRAPHS_IN_PLACE]
  IFS=: read -r name on in_place <<< "$run"; name=host_lora_$name
  variants=${VARIANTS:-"base 16 64,32,16,8,64,32,16,8"}; [ "$on" = 0 ] && variants=${variants#base }
  el "host cost, $name, MOELAB_EAGER_GRAPHS=$on, MOELAB_EAGER_GRAPHS_IN_PLACE=${in_place:-1}: $variants"
  MOELAB_EAGER_GRAPHS=$on MOELAB_EAGER_GRAPHS_IN_PLACE=${in_place:-1} \
    timeout -s INT "${HOST_S:-160}" python3 - "$SHAPES" $variants <<'PY' 2>&1 \
    | tee "$OUT/$name.txt" | grep -v "^moelab"
import os, runpy, sys
shapes, variants = sys.argv[1], sys.argv[2:]
for v in variants:  # one process: the base and the LoRA calls on the same host
    print(f"=== {'base call' if v == 'base' else 'LoRAExperts, adapters of ranks ' + v}", flush=True)
    sys.argv = ["host_cost.py", "--rounds", "5", "--calls", "50", "--tokens", os.environ.get("TOKENS", "1,8,32"),
                "--layers", os.environ.get("LAYERS", "4"),
                "--shape", shapes, *([] if v == "base" else ["--lora", v])]
    runpy.run_path("scripts/host_cost.py", run_name="__main__")
PY
done
[ "${SPLIT:-1}" = 1 ] && el "host time split" && { for v in "" 16 64,32,16,8,64,32,16,8; do
    MOELAB_EAGER_GRAPHS=1 timeout -s INT 40 python3 scripts/host_time.py --shape qwen3-30b-a3b,olmoe --tokens 1,8 \
      --calls 300 ${v:+--lora $v}
  done; } 2>&1 | tee "$OUT/host_split.txt"
el "the replay's input copies: copy_ per tensor against one torch._foreach_copy_ (host µs, no sync)"
timeout -s INT 30 python3 - <<'PY' 2>&1 | tee "$OUT/copies.txt"
import time, torch

def host_us(fn, calls=300):
    """Best of 7 rounds: host µs per call of fn, the GPU synchronized only around each round."""
    best = []
    for _ in range(7):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return min(best)

x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
small = [torch.zeros(1, 8, device="cuda", dtype=d) for d in (torch.int32, torch.float32, torch.int64)]
for n in (2, 4):
    src = [x, *small][:n]
    dst = [torch.empty_like(t) for t in src]
    for name, fn in (("copy_ each", lambda: [d.copy_(s) for d, s in zip(dst, src)]),
                     ("_foreach_copy_", lambda: torch._foreach_copy_(dst, src))):
        print(f"{n} input copies, {name}: {host_us(fn):.1f} µs host per call")
# the three small inputs of a LoRA call (ids int32, weights fp32, adapter ids int64) as one torch.cat of byte views
small = [torch.zeros(1, 8, device="cuda", dtype=torch.int32), torch.rand(1, 8, device="cuda"),
         torch.zeros(1, device="cuda", dtype=torch.int64)]
flat = torch.empty(sum(t.numel() * t.element_size() for t in small), dtype=torch.uint8, device="cuda")
dst = [torch.empty_like(t) for t in small]
for name, fn in (("copy_ each", lambda: [d.copy_(s) for d, s in zip(dst, small)]),
                 ("one torch.cat of byte views", lambda: torch.cat([t.view(-1).view(torch.uint8) for t in small],
                                                                   out=flat))):
    print(f"3 small LoRA inputs, {name}: {host_us(fn):.1f} µs host per call")
PY
el done
