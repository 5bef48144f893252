"""The flow's LoRA delta kernel alone (``moelab/kernels/lora.py``), W13 and W2, over launch tiles, on a CUDA GPU:

    python scripts/lora_delta_sweep.py --shape qwen3-30b-a3b --tokens 128,1024,4096 --ranks 64,32,16,8,64,32,16,8

A bank of those adapters (random values, tokens spread over all of them), the routing of ``scripts/host_cost.py``
(distinct random experts per token); for each T the module's own mode (per slot or grouped, ``moelab.lora.
per_slot_by_size``) and, grouped, each segment tile of --tiles; each :class:`moelab.kernels.lora.DeltaTiles` of
--candidates (BLOCK_K/BLOCK_N/warps/stages). Every candidate's output is compared with the default tiles' (the
same math: equal up to fp32 summation order) before it is timed (``do_bench`` median, L2 flushed). Prints one
row per point and the best candidate per (T, delta).
"""

from __future__ import annotations

import argparse

import torch
import triton

import moelab
from moelab.kernels import segments as segments_kernels
from moelab.kernels.lora import GROUPED_TILES, PER_SLOT_TILES, DeltaTiles, lora_shrink_expand_triton
from moelab.lora import build_lora_segments, per_slot_by_size
from moelab.roofline import get_shape

CANDIDATES = "256/256/4/3,128/128/4/3,64/128/4/3,64/64/4/3,64/128/4/4,128/128/4/2,64/128/8/3"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="128,1024,4096")
    p.add_argument("--ranks", default="64,32,16,8,64,32,16,8")
    p.add_argument("--tiles", default="16,32,64", help="segment tiles (BLOCK_M) of the grouped mode")
    p.add_argument("--candidates", default=CANDIDATES, help="BLOCK_K/BLOCK_N/warps/stages, comma-separated")
    a = p.parse_args()
    s, dev, dt = get_shape(a.shape), torch.device("cuda"), torch.bfloat16
    ranks = [int(r) for r in a.ranks.split(",")]
    g = torch.Generator(device=dev).manual_seed(0)
    bank = moelab.LoRABank(len(ranks), s.E, s.H, s.I, max(ranks), dtype=dt, device=dev)
    for slot, r in enumerate(ranks):
        dims = {"gate_a": (r, s.H), "up_a": (r, s.H), "gate_b": (s.I, r), "up_b": (s.I, r), "down_a": (r, s.I),
                "down_b": (s.H, r)}
        bank.set(slot, **{n: torch.randn(s.E, *d, device=dev, generator=g) / d[-1] ** 0.5 for n, d in dims.items()})
    cands = [DeltaTiles(*map(int, c.split("/"))) for c in a.candidates.split(",")]
    print(f"{a.shape} E{s.E} K{s.K} H{s.H} I{s.I}, ranks {ranks}")
    for T in map(int, a.tokens.split(",")):
        x = torch.randn(T, s.H, device=dev, dtype=dt, generator=g)
        act = torch.randn(T * s.K, s.I, device=dev, dtype=dt, generator=g)
        ids = torch.rand(T, s.E, device=dev, generator=g).argsort(dim=1)[:, :s.K].int()
        w = torch.rand(T, s.K, device=dev, generator=g)
        lora_ids = (torch.arange(T, device=dev) % len(ranks)).int()
        per_slot = per_slot_by_size(T * s.K, bank)
        tiles = [None] if per_slot else [int(t) for t in a.tiles.split(",")]
        best = {}
        if not per_slot:  # the grouping itself: the Triton kernels against the torch construction
            for max_groups in (segments_kernels.MAX_GROUPS, 0):
                saved, segments_kernels.MAX_GROUPS = segments_kernels.MAX_GROUPS, max_groups
                def group(ids=ids, lora_ids=lora_ids):
                    return build_lora_segments(ids, lora_ids, bank)

                try:
                    us = triton.testing.do_bench(group, warmup=25, rep=100, return_mode="median") * 1e3
                except Exception as e:  # noqa: BLE001 (report it, time the rest on the torch construction)
                    print(f"  T={T:5d} segments at MAX_GROUPS {max_groups}: {type(e).__name__}: {e}")
                    saved, us = 0, float("nan")
                segments_kernels.MAX_GROUPS = saved
                print(f"  T={T:5d} segments of {bank.max_loras * s.E + 1} groups, "
                      f"{'torch' if max_groups == 0 else 'Triton'}: {us:8.1f} us")
        for tile in tiles:
            seg = None if per_slot else build_lora_segments(ids, lora_ids, bank, tile=tile)
            for delta in ("w13", "w2"):
                if delta == "w13":
                    args = (x, [bank.up_a, bank.gate_a], [bank.up_b, bank.gate_b])
                    out = torch.empty(T * s.K, 2 * s.I, device=dev, dtype=dt)
                    kw = dict(slots_per_input_row=s.K)
                else:
                    args = (act, [bank.down_a], [bank.down_b])
                    out = torch.empty(T * s.K, s.H, device=dev, dtype=dt)
                    kw = dict(slots_per_input_row=1, weight=w.flatten())

                def run(c, out=out, args=args, kw=kw, seg=seg, ids=ids, lora_ids=lora_ids):
                    return lora_shrink_expand_triton(*args, out, seg, topk_ids=ids, lora_ids=lora_ids,
                                                     ranks=bank.rank_table(), local_expert_offset=0, tiles=c, **kw)

                ref = run(PER_SLOT_TILES if per_slot else GROUPED_TILES).clone()  # the tiles before 2026-12-06
                for c in cands:
                    out.fill_(float("nan"))
                    try:
                        got = run(c)
                    except triton.runtime.errors.OutOfResources as e:  # e.g. 256 / 256 on 16-row tiles
                        print(f"  T={T} {delta} tile {tile} {c}: {e}")
                        continue
                    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
                    if not err < 1e-2:
                        print(f"  T={T} {delta} tile {tile} {c}: rel err {err:.2e} against the default tiles")
                        continue
                    us = triton.testing.do_bench(lambda c=c: run(c), warmup=25, rep=100, return_mode="median") * 1e3
                    mode = "per-slot" if per_slot else f"tile {tile}"
                    print(f"  T={T:5d} {delta:3s} {mode:8s} K{c.block_k:3d} N{c.block_n:3d} w{c.num_warps} "
                          f"s{c.num_stages}: {us:8.1f} us")
                    key = (T, delta)
                    if key not in best or us < best[key][0]:
                        best[key] = (us, mode, c)
        for (T_, delta), (us, mode, c) in sorted(best.items()):
            print(f"BEST T={T_} {delta}: {us:.1f} us, {mode}, {c}")


if __name__ == "__main__":
    main()
