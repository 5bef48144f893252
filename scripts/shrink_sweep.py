"""Sweep the launch shape of the adapter loop's tile shrinks (``fused_lora._own_shrink_kernel``: the W13 shrink over
the gathered x rows, the W2 shrink over GEMM1's act) on a GPU, for a serving bank as the bench's "Nx mixed" (ranks
64/32/16/8 in turn, tokens spread uniformly) on 128-row tiles with each expert's rows sorted by adapter, as the
adapter loop runs them inside the Gluon GEMMs. Each variant's rank vectors are checked against the module's own
launch (rows with an adapter, relative error of the whole) before it is timed (``triton.testing.do_bench``, µs).
The shrinks were the loop's largest cost on the H100 (BENCHMARKS.md, "Serving banks on the Gluon GEMMs").

    python scripts/shrink_sweep.py [--shape qwen3-30b-a3b] [--tokens 4096,16384] [--adapters 8]
        [--sub-m 16,32,64,128] [--block-k 32,64,128] [--warps 4,8] [--stages 2,3,4] [--pair-m 0,64]

``--pair-m``: 0 runs the sub-tiles; N > 0 the whole-pair runs of N rows (``PAIRS``, over the rows sorted by adapter
these banks take), whatever the module's own rule would pick for the shape.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import triton
from profile_lora_banks import mixed_bank

import moelab
from moelab.kernels import fused_lora
from moelab.roofline import get_shape

TILE = 128


def launch(shrink: str, lora, x, act, out, sub_m: int, block_k: int, warps: int, stages: int, pair_m: int) -> None:
    """One W13 (``shrink`` "w13") or W2 ("w2") shrink of ``lora``'s rows into ``out`` at this launch shape."""
    meta = dict(lora.shrink_meta, SUB_M=sub_m, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
                PAIRS=pair_m > 0, PAIR_M=pair_m or sub_m)
    grid = (lora.segments.block_group.numel() * (TILE // sub_m),)
    rows = fused_lora._own_shrink_rows(lora)
    if shrink == "w13":
        fused_lora._own_shrink_kernel[grid](
            in_ptr=x, a0_ptr=lora.bank.up_a, a1_ptr=lora.bank.gate_a, out_ptr=out, **rows, D=x.shape[1],
            stride_in=x.stride(0), GATHER=True, NUM_SLICES=2, WEIGHTED=False, **meta)
    else:
        fused_lora._own_shrink_kernel[grid](
            in_ptr=act, a0_ptr=lora.bank.down_a, a1_ptr=lora.bank.down_a, out_ptr=out, **rows, D=act.shape[1],
            stride_in=act.stride(0), GATHER=False, NUM_SLICES=1, WEIGHTED=True, **meta)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--sub-m", default="16,32,64,128")
    p.add_argument("--block-k", default="32,64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="2,3,4")
    p.add_argument("--pair-m", default="0")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run in Triton's interpreter (tiny shapes only)")
    a = p.parse_args()
    s, dev = get_shape(a.shape), torch.device(a.device)
    E, K, H, I = s.E, s.K, s.H, s.I
    bank = mixed_bank(E, H, I, a.adapters, dev)
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    for T in ints(a.tokens):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        weights, ids = moelab.route(torch.randn(T, E, device=dev), K)
        lora_ids = torch.randint(0, a.adapters, (T,), device=dev, dtype=torch.int32)
        seg = fused_lora.adapter_sorted_segments(ids.int(), lora_ids, a.adapters, E, TILE, 0, {})
        lora = fused_lora.adapter_loop_shrink_w13(x, bank, lora_ids, weights.float().contiguous(), seg, top_k=K,
                                                  num_local_experts=E, pdl={})
        act = torch.randn(seg.row_to_slot.numel(), I, device=dev, dtype=torch.bfloat16)
        fused_lora.adapter_loop_shrink_w2(act, lora)
        slots = seg.row_to_slot.long()
        has = (slots >= 0) & (lora_ids.long()[slots.clamp(min=0) // K] >= 0)
        print(f"\n## {a.shape} T={T}, {a.adapters} adapters (module's launch: SUB_M {lora.sub_m}, "
              f"{ {k: lora.shrink_meta[k] for k in ('BLOCK_K', 'num_warps', 'PAIRS', 'PAIR_M')} })")
        print("| shrink | SUB_M | PAIR_M | BLOCK_K | warps | stages | µs | rel. error |\n" + "|---" * 8 + "|")
        for shrink, ref in (("w13", lora.s13), ("w2", lora.s2)):
            for sub_m, block_k, warps, stages, pair_m in itertools.product(
                    ints(a.sub_m), ints(a.block_k), ints(a.warps), ints(a.stages), ints(a.pair_m)):
                row = f"| {shrink} | {sub_m} | {pair_m or '-'} | {block_k} | {warps} | {stages} |"
                out = torch.full_like(ref, float("nan"))
                try:
                    launch(shrink, lora, x, act, out, sub_m, block_k, warps, stages, pair_m)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                except Exception as e:  # a shape this kernel cannot take (shared memory): say so, go on
                    print(f"{row} failed: {type(e).__name__} | |")
                    continue
                err = ((out[has].float() - ref[has].float()).norm() / ref[has].float().norm()).item()
                if dev.type != "cuda":  # the interpreter: checked, not timed
                    print(f"{row} - | {err:.1e} |")
                    continue
                us = 1e3 * triton.testing.do_bench(functools.partial(launch, shrink, lora, x, act, out, sub_m,
                                                                     block_k, warps, stages, pair_m))
                print(f"{row} {us:.1f} | {err:.1e} |")


if __name__ == "__main__":
    main()
