"""Where the GPU time of a T = 1 ``LoRAExperts`` call goes, kernel by kernel (torch.profiler's CUDA activity), on
the token-major path beside the base call and the tiled decode mode. GPU only; prints a table.

    python scripts/profile_lora_tm.py [--shapes qwen3-30b-a3b,deepseek-v3,mixtral] [--calls 50]
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import moelab
from moelab.roofline import get_shape


def kernel_times(fn, calls: int) -> dict[str, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time / calls  # µs per call
    return dict(total)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3,mixtral")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rank", type=int, default=16)
    a = p.parse_args()
    for name in a.shapes.split(","):
        s = get_shape(name)
        print(f"\n## {name} T=1 (E{s.E} K{s.K} H{s.H} I{s.I}), rank {a.rank}: GPU µs per call, by kernel")
        for label, fn in calls_of(s, a.rank).items():
            times = kernel_times(fn, a.calls)
            parts = ", ".join(f"{k.split('_kernel')[0].lstrip('_')} {v:.1f}" for k, v in
                              sorted(times.items(), key=lambda kv: -kv[1]))
            print(f"- {label}: total {sum(times.values()):.1f} | {parts}")
        torch.cuda.empty_cache()


def calls_of(s, r: int) -> dict:
    """The calls to profile at shape ``s``: the base module, and a one-adapter bank forced to each path."""
    dev = torch.device("cuda")
    E, K, H, I = s.E, s.K, s.H, s.I
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) / H**0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) / I**0.5
    bank = moelab.LoRABank(1, E, H, I, r, dtype=torch.bfloat16, device=dev)
    bank.set(0, gate_a=torch.randn(E, r, H, device=dev) / H**0.5, up_a=torch.randn(E, r, H, device=dev) / H**0.5,
             gate_b=torch.randn(E, I, r, device=dev) * 0.1, up_b=torch.randn(E, I, r, device=dev) * 0.1,
             down_a=torch.randn(E, r, I, device=dev) / I**0.5, down_b=torch.randn(E, H, r, device=dev) * 0.1)
    x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
    w, ids = moelab.route(torch.randn(1, E, device=dev), K)
    lora_ids = torch.zeros(1, dtype=torch.int32, device=dev)
    base = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, backend="triton")
    calls = {"base (no bank)": lambda: base(x, w, ids, None, validate=False)}
    for path in ("token-major", "decode"):
        mod = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton", fused=path)
        calls[f"{path}, 1 adapter"] = lambda m=mod: m(x, w, ids, lora_ids, has_lora=True, validate=False)
        calls[f"{path}, no adapter"] = lambda m=mod: m(x, w, ids, None, validate=False)
    return calls


if __name__ == "__main__":
    main()
