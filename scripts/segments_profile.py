"""Where the time of :func:`moelab.kernels.segments.build_segments_triton` goes, on a CUDA GPU:

    python scripts/segments_profile.py --tokens 1024,4096 --groups 129,1025,4097 --tile 16 --k 8

For each (T, groups): T*K random group ids in [0, groups) (uniform, as tokens spread over a bank's adapters and
experts), the GPU time of each kernel of one call (torch.profiler, mean of --reps calls), the whole call's
eager time (``do_bench`` median) and its CUDA-graph replay. Every call's segments are checked against the torch
construction (:func:`moelab.permutation.build_segments`) first.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import triton

from moelab.kernels.segments import build_segments_triton
from moelab.permutation import build_segments


def check(values: torch.Tensor, groups: int, tile: int) -> None:
    got = build_segments_triton(values, groups, tile)
    want = build_segments(values.long(), groups, tile)
    for name in ("slot_to_row", "row_to_slot", "block_group"):
        if not torch.equal(getattr(got, name), getattr(want, name)):
            raise SystemExit(f"segments differ from the torch construction: {name}, {groups} groups")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--groups", default="129,1025,4097")
    p.add_argument("--tile", type=int, default=16)
    p.add_argument("--k", type=int, default=8, help="slots per token")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    for T in map(int, a.tokens.split(",")):
        for G in map(int, a.groups.split(",")):
            values = torch.randint(0, G, (T * a.k,), device=dev, generator=gen, dtype=torch.int32)
            check(values, G, a.tile)
            def call(values=values, G=G):
                return build_segments_triton(values, G, a.tile)
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(a.reps):
                    call()
                torch.cuda.synchronize()
            per_kernel = defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per_kernel[e.name] += e.device_time / a.reps
            eager = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                call()
                with torch.cuda.graph(graph, stream=s):
                    call()
            torch.cuda.current_stream().wait_stream(s)
            replay = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3
            kernels = ", ".join(f"{n[:40]} {t:.1f}" for n, t in sorted(per_kernel.items(), key=lambda kv: -kv[1]))
            print(f"T={T:6d} groups={G:5d} tile={a.tile}: eager {eager:7.1f} us, graph {replay:7.1f} us, "
                  f"GPU {sum(per_kernel.values()):7.1f} us: {kernels}", flush=True)


if __name__ == "__main__":
    main()
