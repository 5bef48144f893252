"""Where the time of the segments goes, on a CUDA GPU: the routed MoE's (by expert) and the LoRA flow's (by adapter
and expert, ``moelab.lora.build_lora_segments``):

    python scripts/segments_profile.py --tokens 1024,4096 --adapters 0,8,32 --experts 128 --k 8

For each (T, adapters): random distinct experts per token and each token on a random adapter (0 adapters: the
segments by expert, ``build_segments_triton``); the GPU time of each kernel of one call (torch.profiler, mean of
--reps calls), the whole call's eager time (``do_bench`` median) and its CUDA-graph replay. Each call's segments
are first checked against the torch construction (``moelab.permutation.build_segments``) of the groups written
out here. Runs on any moelab tree (the A/B of ``scripts/device_flow_ranks.sh``).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import triton

import moelab
from moelab.kernels import segments
from moelab.kernels.segments import build_segments_triton
from moelab.lora import build_lora_segments
from moelab.permutation import build_segments


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--adapters", default="0,8,32")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--k", type=int, default=8, help="slots per token")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--one-chunk-warps", default="", help="comma list: the one-program segments (up to MAX_CHUNK "
                   "slots, by expert) also at these warps")
    a = p.parse_args()
    dev, E, K = torch.device("cuda"), a.experts, a.k
    gen = torch.Generator(device=dev).manual_seed(0)
    for T in map(int, a.tokens.split(",")):
        for L in map(int, a.adapters.split(",")):
            ids = torch.rand(T, E, device=dev, generator=gen).argsort(dim=1)[:, :K].int()
            lora_ids = torch.randint(0, max(L, 1), (T,), device=dev, generator=gen)
            if L == 0:
                groups, G, tile = ids.long().flatten(), E, 16
                def call(ids=ids):
                    return build_segments_triton(ids.flatten(), E, 16)
            else:
                bank = moelab.LoRABank(L, E, 64, 64, 8, dtype=torch.bfloat16, device=dev)
                for slot in range(L):  # every slot loaded (the tile rule counts them)
                    bank.set(slot, **{n: torch.zeros(E, *d, device=dev) for n, d in
                                      dict(gate_a=(8, 64), up_a=(8, 64), gate_b=(64, 8), up_b=(64, 8),
                                           down_a=(8, 64), down_b=(64, 8)).items()})
                groups, G = (lora_ids.long()[:, None] * E + ids.long()).flatten(), L * E + 1
                tile = build_lora_segments(ids, lora_ids, bank).tile
                def call(ids=ids, lora_ids=lora_ids, bank=bank):
                    return build_lora_segments(ids, lora_ids, bank)
            one_chunk = L == 0 and T * K <= segments.MAX_CHUNK
            for warps in [None] + ([int(w) for w in a.one_chunk_warps.split(",") if w] if one_chunk else []):
                segments._one_chunk_layout = _ONE_CHUNK_LAYOUT if warps is None else _with_warps(warps)
                profile_one(call, groups, G, tile, T, L, a.reps, "" if warps is None else f" warps={warps}")
            segments._one_chunk_layout = _ONE_CHUNK_LAYOUT


_ONE_CHUNK_LAYOUT = segments._one_chunk_layout


def _with_warps(warps: int):
    """``segments._one_chunk_layout`` with ``warps`` warps for the one program."""
    def layout(n, num_groups, tile):
        return (*_ONE_CHUNK_LAYOUT(n, num_groups, tile)[:-1], warps)
    return layout


def profile_one(call, groups, G, tile, T, L, reps, label) -> None:
    """Check ``call``'s segments against the torch construction, then time its kernels, its eager call and its
    CUDA-graph replay (one printed line)."""
    got, want = call(), build_segments(groups, G, tile)
    for name in ("slot_to_row", "row_to_slot", "block_group"):
        if not torch.equal(getattr(got, name), getattr(want, name)):
            raise SystemExit(f"T={T} adapters={L}: {name} differs from the torch construction")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name[:40]] += e.device_time / reps
    eager = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
        with torch.cuda.graph(graph, stream=stream):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    replay = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3
    kernels = "; ".join(f"{n} {t:.1f}" for n, t in sorted(per_kernel.items(), key=lambda kv: -kv[1]))
    print(f"T={T:6d} adapters={L:3d} groups={G:5d} tile={tile}{label}: eager {eager:7.1f} us, graph {replay:7.1f} "
          f"us, GPU {sum(per_kernel.values()):7.1f} us in {len(per_kernel)} kernels: {kernels}", flush=True)


if __name__ == "__main__":
    main()
