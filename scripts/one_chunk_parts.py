"""Where the one-program segments' time goes (``moelab.kernels.segments.one_chunk_segments``), on a CUDA GPU.

    python scripts/one_chunk_parts.py --slots 256,1024 --bins 128,256

Each step of the one program alone, as a kernel of its own over N slots of random groups in [0, G) (G_BINS bins):
the loads of the groups, ``tl.histogram``, ``tl.cumsum`` of the bins, ``tl.sort`` of the N keys, the -1 fill of
the rows and the tile -> group map (compare of every tile with every bin), and the whole ``one_chunk_segments``;
each timed as CUDA-graph replays of 20 launches (median µs a launch, ``triton.testing.do_bench``).
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl

from moelab.kernels import segments
from moelab.permutation import max_live_rows, next_pow2


@triton.jit
def _part_kernel(g_ptr, out_ptr, rows_ptr, num_rows, num_blocks, N: tl.constexpr, G_BINS: tl.constexpr,
                 TILE: tl.constexpr, CB: tl.constexpr, PART: tl.constexpr):
    lane = tl.arange(0, N)
    g = tl.load(g_ptr + lane)
    if PART == "load":
        tl.store(out_ptr + lane, g)
    elif PART == "histogram":
        tl.store(out_ptr + tl.arange(0, G_BINS), tl.histogram(g, G_BINS))
    elif PART == "sort":
        tl.store(out_ptr + lane, tl.sort(g * N + lane))
    elif PART == "fill":
        for r0 in range(0, num_rows, N):
            tl.store(rows_ptr + r0 + lane, tl.full((N,), -1, tl.int32), mask=r0 + lane < num_rows)
    elif PART == "blocks":
        bins = tl.arange(0, G_BINS)
        seg_end = (bins + 1) * TILE * 2  # any ascending ends
        for b0 in range(0, num_blocks, CB):
            blocks = b0 + tl.arange(0, CB)
            ends_before = (seg_end[None, :] <= (blocks * TILE)[:, None])
            tl.store(out_ptr + blocks, tl.sum(ends_before.to(tl.int32), axis=1), mask=blocks < num_blocks)


def _graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3 / 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", default="256,1024")
    p.add_argument("--bins", default="128,256", help="G_BINS (groups + 1, a power of two)")
    p.add_argument("--warps", default="4")
    a = p.parse_args()
    dev, tile = torch.device("cuda"), 16
    for n in map(int, a.slots.split(",")):
        for g_bins in map(int, a.bins.split(",")):
            groups = g_bins - 1
            g = torch.randint(0, groups, (n,), dtype=torch.int32, device=dev)
            rows = max_live_rows(n, groups, tile)
            out = torch.empty(max(rows, n, g_bins), dtype=torch.int32, device=dev)
            row_buf = torch.empty(rows, dtype=torch.int32, device=dev)
            for warps in map(int, a.warps.split(",")):
                times = {}
                for part in ("load", "histogram", "sort", "fill", "blocks"):
                    times[part] = _graph_us(functools.partial(
                        _part_kernel[(1,)], g, out, row_buf, rows, rows // tile, N=next_pow2(n), G_BINS=g_bins,
                        TILE=tile, CB=max(1, 4096 // g_bins), PART=part, num_warps=warps))
                times["whole"] = _graph_us(functools.partial(segments.build_segments_triton, g, groups, tile))
                print(f"slots {n:5d} bins {g_bins:5d} warps {warps:2d}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in times.items()) + " µs a launch", flush=True)


if __name__ == "__main__":
    main()
