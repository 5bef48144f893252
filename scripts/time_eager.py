"""Eager time per call of routed_moe and LoRAExperts at Qwen3-30B-A3B shapes (bf16, one rank-16 adapter on every
token), where small batches are bound by the host: the wall time of N back-to-back calls (host and GPU pipelined),
and the host time alone (the calls' Python and launches, measured until each call returns, no sync inside).

    python scripts/time_eager.py --tokens 1,32 --calls 300          # on a CUDA GPU, any moelab tree on PYTHONPATH

Only public API, so the same script times an older tree (``PYTHONPATH=<old tree>``) beside this one.
"""

from __future__ import annotations

import argparse
import time

import torch

import moelab
from moelab.packing import pack_topk_ids_weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,32")
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args()
    E, K, H, I, dev, dt = 128, 8, 2048, 768, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, device=dev, dtype=dt, generator=g) / I**0.5
    W = moelab.prepare_weights(w13, w2, backend="triton")
    bank = moelab.LoRABank(1, E, H, I, 16, dtype=dt, device=dev)
    bank.set(0, gate_a=torch.randn(E, 16, H), gate_b=torch.randn(E, I, 16), up_a=torch.randn(E, 16, H),
             up_b=torch.randn(E, I, 16), down_a=torch.randn(E, 16, I), down_b=torch.randn(E, H, 16), scaling=0.01)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton")

    def wall_and_host(f, n):
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        host = 0.0
        t0 = time.perf_counter()
        for _ in range(n):
            t1 = time.perf_counter()
            f()
            host += time.perf_counter() - t1
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6, host / n * 1e6

    def row(T: int) -> str:
        x = torch.randn(T, H, device=dev, dtype=dt, generator=g)
        ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]).int()
        w = torch.rand(T, K, device=dev)
        packed = pack_topk_ids_weights(ids, w)
        lora_ids = torch.zeros(T, dtype=torch.int32, device=dev)
        rows = {
            "routed_moe": lambda: moelab.routed_moe(packed, x, W, num_experts=E, top_k=K, validate=False),
            "LoRAExperts": lambda: experts(x, w, ids, lora_ids, has_lora=True, validate=False),
            "LoRAExperts validate=True": lambda: experts(x, w, ids, lora_ids, has_lora=True),
        }
        cells = []
        for name, f in rows.items():
            wall, host = wall_and_host(f, a.calls if "validate=True" not in name else a.calls // 3)
            cells.append(f"{name} {wall:7.1f} / {host:6.1f}")
        return f"T={T:5d}  " + "   ".join(cells)

    print(f"moelab at {moelab.__file__}; wall / host µs per eager call, {a.calls} back-to-back calls", flush=True)
    for T in (int(t) for t in a.tokens.split(",")):
        print(row(T), flush=True)


if __name__ == "__main__":
    main()
