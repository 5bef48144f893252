#!/usr/bin/env bash
# Eager decode calls replayed from CUDA graphs (moelab/backends/eager_graphs.py), two H200 calls:
#   PART=host (default)
#     1. the tests that touch the graph path (test_eager_graphs, token_major, launch, routed_moe)             <= 150 s
#     2. scripts/host_cost.py back to back, four layers in turn, T = 1, 8 and 32 on seven shapes, with the graph
#        replays (MOELAB_EAGER_GRAPHS=1) and without them (=0, the launches as before), one after the other   <= 200 s
#     3. scripts/host_time.py: a replayed call's host time split by the functions it passes through           <= 60 s
#     4. what the first call of a key costs (its capture) against the calls after it                          <= 30 s
#   PART=suite: the whole GPU test suite (every eager call of T <= 32 on the GPU now replays a graph)       <= 560 s
#   PART=rule: step 1, then step 2 as shipped (eager_graphs.MAX_BYTES_PER_LAUNCH) and with none replayed
#     (host_rule.txt, host_launches.txt)                                                                     <= 350 s
# From the repo root: run(command="MOELAB_COMMIT=<commit> PART=host bash scripts/device_eager_graphs.sh", timeout_s=590).
# Files: env.txt, tests.log, host_graphs.txt, host_launches.txt, host_split.txt, capture.txt (host_rule.txt).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts:${PYTHONPATH:-} MPLBACKEND=Agg
OUT=${OUT:-build/device_eager_graphs}; mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh"  # el, gpu_tests, $OUT/env.txt
if [ "${PART:-host}" = suite ]; then
  el "GPU tests"
  gpu_tests "${SUITE_S:-560}" $(ls tests/test_*.py | grep -vE "test_(browser|notebooks|docs|faults)\.py")
  el done; exit 0
fi
el "GPU tests of the graph path"
gpu_tests 150 tests/test_eager_graphs.py tests/test_token_major.py tests/test_launch.py tests/test_routed_moe.py
SHAPES="qwen3-30b-a3b;olmoe;mixtral;gpt-oss-20b;deepseek-v3;64,6,2048,1408;128,8,4096,1536"
# name:MOELAB_EAGER_GRAPHS:bound. host_graphs: every call of T <= 32 replayed (eager_graphs.MAX_BYTES_PER_LAUNCH
# lifted, to see where the bound should fall); host_rule: the bound as shipped
RUNS="graphs:1:lifted launches:0:lifted"
[ "${PART:-host}" = rule ] && RUNS="rule:1:shipped launches:0:lifted"
for run in $RUNS; do
  IFS=: read -r name on bytes <<< "$run"; name=host_$name
  el "host cost, $name, MOELAB_EAGER_GRAPHS=$on, MAX_BYTES_PER_LAUNCH $bytes"
  MOELAB_EAGER_GRAPHS=$on LIFT=$([ $bytes = lifted ] && echo 1 || echo 0) timeout -s INT 100 python3 -c '
import os, runpy, sys
from moelab.backends import eager_graphs
if os.environ["LIFT"] == "1":
    eager_graphs.MAX_BYTES_PER_LAUNCH = 2**62
sys.argv = ["host_cost.py", *sys.argv[1:]]
runpy.run_path("scripts/host_cost.py", run_name="__main__")' --rounds 5 --calls 50 --tokens 1,8,32 \
    --layers 4 --shape "$SHAPES" 2>&1 | tee "$OUT/$name.txt" | grep -v "^moelab"
done
[ "${PART:-host}" = rule ] && { el done; exit 0; }
el "host time split"
{ MOELAB_EAGER_GRAPHS=1 timeout -s INT 30 python3 scripts/host_time.py --shape qwen3-30b-a3b,olmoe --tokens 1 --calls 300
  MOELAB_EAGER_GRAPHS=0 timeout -s INT 50 python3 scripts/host_time.py --shape qwen3-30b-a3b,olmoe,gpt-oss-20b \
    --tokens 1,8 --calls 300; } 2>&1 | tee "$OUT/host_split.txt"
el "capture cost"
timeout -s INT 30 python3 - <<'PY' 2>&1 | tee "$OUT/capture.txt"
import time, torch, moelab
from moelab.roofline import get_shape
from moelab.backends import eager_graphs
for name in ("qwen3-30b-a3b", "mixtral"):
    s = get_shape(name)
    w13 = torch.randn(s.E, 2 * s.I, s.H, device="cuda", dtype=torch.bfloat16) / s.H**0.5
    w2 = torch.randn(s.E, s.H, s.I, device="cuda", dtype=torch.bfloat16) / s.I**0.5
    W = moelab.prepare_weights(w13, w2, backend="triton")
    for T in (1, 1, 8, 32):  # the second T = 1 is a first call again after clear(): kernels compiled, capture only
        if T == 1:
            eager_graphs.clear()
        x = torch.randn(T, s.H, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(T, s.E, device="cuda").argsort(dim=1)[:, :s.K].int()
        packed = moelab.pack_topk_ids_weights(ids, torch.rand(T, s.K, device="cuda"))
        times = []
        for _ in range(5):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            moelab.routed_moe(packed, x, W, num_experts=s.E, top_k=s.K, validate=False)
            torch.cuda.synchronize(); times.append((time.perf_counter() - t0) * 1e3)
        print(f"{name:15s} T={T:<3d} first call {times[0]:8.2f} ms, then {min(times[1:]) * 1e3:7.1f} µs "
              f"(synchronized); graphs held {eager_graphs.held()}, "
              f"allocated {torch.cuda.memory_allocated() / 2**20:.0f} MiB")
# the replay's input copies: two copy_ calls against one torch._foreach_copy_ (host µs per pair, no sync)
x, r = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16), torch.zeros(1, 8, device="cuda", dtype=torch.int32)
sx, sr = torch.empty_like(x), torch.empty_like(r)
for name, fn in (("two copy_", lambda: (sx.copy_(x), sr.copy_(r))),
                 ("_foreach_copy_", lambda: torch._foreach_copy_([sx, sr], [x, r]))):
    best = []
    for _ in range(5):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(200):
            fn()
        best.append((time.perf_counter() - t0) / 200 * 1e6)
    torch.cuda.synchronize()
    print(f"input copies, {name}: {min(best):.1f} µs host per call")
PY
el done
