"""Summarise Nsight Compute's CSV of one routed-MoE layer call: each kernel of the last call, a line each.

    ncu --clock-control none --csv --metrics "$(python scripts/ncu_kernels.py --metrics)" \\
        python scripts/ncu_layer.py --shape olmoe --tokens 1024 --calls 1 > olmoe_1024.csv
    python scripts/ncu_kernels.py olmoe_1024.csv

``ncu_layer.py --calls 1`` makes two calls (a warm-up and the one measured); the report holds the kernels of both
(and the setup's torch kernels first), so the second half of the report's kernels after the setup is printed: µs,
DRAM throughput (% of peak), bytes read and written, SM throughput, tensor pipe activity, warps active, grid,
registers and the L2 hit rate (BENCHMARKS.md, "Where a layer's GPU time goes").
"""

from __future__ import annotations

import argparse
import csv
from collections import OrderedDict

METRICS = ("gpu__time_duration.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes_read.sum",
           "dram__bytes_write.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
           "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
           "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__grid_size", "launch__registers_per_thread",
           "lts__t_sector_hit_rate.pct", "launch__block_size")
#: L2's own load (``--l2``): its throughput (% of peak) and the bytes it served, to see whether tiles that reread
#: weights from L2 are bound by L2 bandwidth rather than by DRAM or the tensor pipes.
L2_METRICS = ("lts__throughput.avg.pct_of_peak_sustained_elapsed", "lts__t_bytes.sum")


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def summarise(path: str) -> None:
    with open(path) as f:
        rows = list(csv.DictReader(line for line in f if line.startswith('"')))
    kernels: OrderedDict = OrderedDict()
    for r in rows:
        kernels.setdefault((r["ID"], r["Kernel Name"]), {})[r["Metric Name"]] = r["Metric Value"]
    items = list(kernels.items())
    layer = [i for i, ((_, name), _) in enumerate(items) if name.startswith("_")]  # moelab's Triton kernels
    if not layer:
        raise SystemExit(f"{path}: no Triton kernel in the report")
    first = layer[0] + (layer[-1] - layer[0] + 1) // 2  # the measured call: the second half of the layer's kernels
    total = 0.0
    print(f"{path}: {len(items)} kernels; the last call's:")
    for (_, name), m in items[first:]:
        us = _number(m["gpu__time_duration.sum"]) / 1e3
        total += us
        print(f"  {name[:40]:40s} {us:8.1f} µs  DRAM {m['dram__throughput.avg.pct_of_peak_sustained_elapsed']:>6s} %"
              f"  read {_number(m['dram__bytes_read.sum']) / 1e6:7.1f} MB"
              f"  written {_number(m['dram__bytes_write.sum']) / 1e6:6.1f} MB"
              f"  SM {m['sm__throughput.avg.pct_of_peak_sustained_elapsed']:>5s} %"
              f"  tensor {m['sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active']:>5s} %"
              f"  warps {m['sm__warps_active.avg.pct_of_peak_sustained_active']:>5s} %"
              f"  grid {m['launch__grid_size']} x {m['launch__block_size']}"
              f"  registers {m['launch__registers_per_thread']}  L2 hit {m['lts__t_sector_hit_rate.pct']} %"
              + (f"  L2 {m[L2_METRICS[0]]} % of peak, {_number(m[L2_METRICS[1]]) / 1e6:.0f} MB"
                 if L2_METRICS[0] in m else ""))
    print(f"  sum {total:.1f} µs")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", nargs="*", help="ncu --csv reports")
    p.add_argument("--metrics", action="store_true", help="print the --metrics list for ncu and exit")
    p.add_argument("--l2", action="store_true", help="with --metrics: L2's throughput and bytes too")
    a = p.parse_args()
    if a.metrics:
        print(",".join(METRICS + (L2_METRICS if a.l2 else ())))
        return
    for path in a.csv:
        summarise(path)


if __name__ == "__main__":
    main()
