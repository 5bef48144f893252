"""Where a LoRA decode call's GPU time goes: each kernel of one eager call, base against ``LoRAExperts`` with one
rank-16 adapter, timed by Nsight Compute (cold caches, the median of 3 calls), on a CUDA GPU:

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python scripts/lora_decode_ncu.py --shape qwen3-30b-a3b --tokens 1 --lora 16 > lora.csv
    python scripts/lora_decode_ncu.py --report lora.csv

The call is ``scripts/host_cost.py``'s (``make_call``) with eager graph replays off, so each kernel launches on its
own (no programmatic dependent launch: the sum of the kernels is the call's GPU time without launch gaps). The
report gives each kernel of the call, in launch order, its median µs and the call's sum.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from gemm_sweep import launch_for_ncu, ncu_durations  # noqa: E402  (scripts/ is on sys.path when run as a script)
from host_cost import make_call  # noqa: E402

from moelab.backends import eager_graphs

CALLS = 3


def report(csv_file: str) -> None:
    """Print each kernel of the profiled call (launch order), its median µs over the calls, and the sum."""
    launches = ncu_durations(csv_file)
    if len(launches) % CALLS:
        raise SystemExit(f"{csv_file}: {len(launches)} launches, not {CALLS} calls of one kernel list")
    per_call = len(launches) // CALLS
    times = defaultdict(list)
    for i, (name, us) in enumerate(launches):
        times[i % per_call, name].append(us)
    total = 0.0
    for (i, name), us in sorted(times.items()):
        total += statistics.median(us)
        print(f"  {i}  {name[:60]:60s} {statistics.median(us):8.2f} µs")
    print(f"  sum {total:.2f} µs over {per_call} kernels")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--lora", help="ranks of the bank's adapters (e.g. 16); none: the base call")
    p.add_argument("--report", metavar="CSV", help="report an ncu --csv output of this script")
    a = p.parse_args()
    if a.report:
        return report(a.report)
    eager_graphs.ENABLED = False
    call = make_call(a.shape, a.tokens, "silu", False, a.lora and [int(r) for r in a.lora.split(",")])
    for _ in range(3):  # compile and warm up
        call()
    launch_for_ncu(call, CALLS)


if __name__ == "__main__":
    main()
