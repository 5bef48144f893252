"""Where the GPU time of a prefill ``LoRAExperts`` call with a serving bank goes, kernel by kernel (torch.profiler's
CUDA activity): the base call beside the bank on each path asked for (``auto``: the module's own choice; a name of
``moelab.experts.LORA_PATHS`` forces that path, e.g. "adapter-loop", which on an sm_90 GPU with 128-row tiles runs
inside the Gluon GEMMs). Banks as the bench's "Nx mixed" (ranks 64/32/16/8 in turn, tokens spread uniformly). GPU
only; prints a table.

    python scripts/profile_lora_banks.py [--shape qwen3-30b-a3b] [--tokens 4096,16384] [--adapters 8,32]
                                         [--paths adapter-loop,flow] [--loop-block-m 128]

``--loop-block-m N``: the adapter loop's pipeline takes the tile table's first bucket of N-row tiles or more where
its own bucket has fewer rows (an experiment: at Qwen3 T = 1024, 64 rows an expert, the loop then runs inside the
Gluon GEMMs on 128-row tiles instead of the Triton kernels on 64-row ones; the base call keeps its tiles).
"""

from __future__ import annotations

import argparse

import torch
from profile_lora_tm import kernel_times
from tma_ab import tiles_of_at_least

import moelab
from moelab.backends import triton_backend
from moelab.bench.runner import MIXED_RANKS
from moelab.roofline import get_shape


def mixed_bank(E: int, H: int, I: int, adapters: int, dev) -> moelab.LoRABank:
    ranks = [MIXED_RANKS[i % len(MIXED_RANKS)] for i in range(adapters)]
    bank = moelab.LoRABank(adapters, E, H, I, max(ranks), dtype=torch.bfloat16, device=dev)
    for slot, r in enumerate(ranks):
        bank.set(slot, gate_a=torch.randn(E, r, H, device=dev) / H**0.5, up_a=torch.randn(E, r, H, device=dev) / H**0.5,
                 gate_b=torch.randn(E, I, r, device=dev) * 0.1, up_b=torch.randn(E, I, r, device=dev) * 0.1,
                 down_a=torch.randn(E, r, I, device=dev) / I**0.5, down_b=torch.randn(E, H, r, device=dev) * 0.1)
    return bank


def calls_at(T: int, base, w13, w2, E: int, K: int, H: int, I: int, adapters: list[int], paths: list[str],
             dev) -> dict:
    """The calls to profile at T tokens: the base module, and each mixed bank on each path."""
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    w, ids = moelab.route(torch.randn(T, E, device=dev), K)
    calls = {"base": lambda: base(x, w, ids, None, validate=False)}
    for n in adapters:
        bank = mixed_bank(E, H, I, n, dev)
        lora_ids = torch.randint(0, n, (T,), device=dev, dtype=torch.int32)
        for path in paths:
            mod = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton",
                                     fused=None if path == "auto" else path)
            calls[f"{n} adapters, {path}"] = lambda m=mod, li=lora_ids: m(x, w, ids, li, has_lora=True,
                                                                          validate=False)
    return calls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--adapters", default="8,32")
    p.add_argument("--paths", default="adapter-loop,flow")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--loop-block-m", type=int, default=0)
    a = p.parse_args()
    if a.loop_block_m:  # before any call: the pipeline caches its layout per shape
        triton_backend.choose_config = tiles_of_at_least(a.loop_block_m, lora_own_only=True)
    torch.manual_seed(0)  # the same weights, routing and adapter ids for every tree this script profiles
    s, dev = get_shape(a.shape), torch.device("cuda")
    E, K, H, I = s.E, s.K, s.H, s.I
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) / H**0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) / I**0.5
    base = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, backend="triton")
    for T in map(int, a.tokens.split(",")):
        print(f"\n## {a.shape} T={T} (E{E} K{K} H{H} I{I}): GPU µs per call, by kernel")
        calls = calls_at(T, base, w13, w2, E, K, H, I, [int(n) for n in a.adapters.split(",")], a.paths.split(","),
                         dev)
        for label, fn in calls.items():
            times = kernel_times(fn, a.calls)
            parts = ", ".join(f"{k.split('_kernel')[0].lstrip('_')[:40]} {v:.1f}" for k, v in
                              sorted(times.items(), key=lambda kv: -kv[1]) if v >= 1.0)
            print(f"- {label}: total {sum(times.values()):.1f} | {parts}")
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
