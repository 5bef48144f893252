"""Where an eager call's time goes: host time before each launch and the GPU's idle gaps between kernels.

    python scripts/profile_launch.py --tokens 1,128,16384 --modes base,lora,lora-idle   # on a CUDA GPU
    python scripts/profile_launch.py --tokens 1 --modes routed --host 200               # + where host time goes

For each T and mode, one eager call after warm-up (Qwen3-30B-A3B shapes, bf16, uniform routing), printed as
every CUDA kernel with its start and end on the GPU, relative to the first host op of the call, and the idle
gaps; then the host time of a whole call. An eager call is slower than its CUDA graph by the host time the GPU
waits for. Modes: ``base`` (no LoRA), ``lora`` (LoRAExperts, one rank-16 adapter on every token; ``--flow``
for the unfused flow), ``lora-idle`` (the LoRA path forced with every id -1: the cost of the LoRA code alone),
``routed`` (``moelab.routed_moe`` with packed routing, ``validate=False``: the bench's ``moelab triton``).
``--host N``: also N eager calls under cProfile, the functions with the most own host time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import moelab
from moelab.bench import SHAPES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="128", help="comma-separated token counts")
    p.add_argument("--modes", default="base,lora", help="comma-separated: base, lora, lora-idle, routed")
    p.add_argument("--flow", action="store_true", help="LoRAExperts(fused=False): vLLM's unfused flow")
    p.add_argument("--host", type=int, default=0, help="N calls under cProfile (0: none)")
    a = p.parse_args()
    for T in (int(t) for t in a.tokens.split(",")):
        for mode in a.modes.split(","):
            profile_one(T, mode, a.flow, a.host)
    print_registers()


def print_registers() -> None:
    """Registers and spills of every compiled variant of the GEMM kernels (what a fused epilogue costs)."""
    from moelab.kernels import fused_lora, moe_gemm

    for fn in (moe_gemm._gemm1_swiglu_kernel, moe_gemm._gemm2_kernel, fused_lora._lora_shrink_kernel,
               fused_lora._decode_segments_w13_shrink_kernel):
        for cache in getattr(fn, "device_caches", {}).values():
            for kernel in cache[0].values():
                print(f"{fn.__name__}: {kernel.n_regs} registers, {kernel.n_spills} spills, "
                      f"{kernel.metadata.num_warps} warps, {kernel.metadata.shared} B shared")


def profile_one(T: int, mode: str, flow: bool, host_calls: int = 0) -> None:
    s = SHAPES["qwen3-30b-a3b"]
    dev, dt = "cuda", torch.bfloat16
    lora = mode not in ("base", "routed")
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(s.E, 2 * s.I, s.H, device=dev, dtype=dt, generator=g) / s.H**0.5
    w2 = torch.randn(s.E, s.H, s.I, device=dev, dtype=dt, generator=g) / s.I**0.5
    x = torch.randn(T, s.H, device=dev, dtype=dt, generator=g)
    ids = torch.rand(T, s.E, device=dev, generator=g).argsort(dim=1)[:, :s.K].int()
    w = torch.rand(T, s.K, device=dev, generator=g)
    bank = moelab.LoRABank(1, s.E, s.H, s.I, 16, dtype=dt, device=dev) if lora else None
    if bank is not None:
        for name in ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"):
            getattr(bank, name).normal_(0, 0.02)
    experts = moelab.LoRAExperts(w13, w2, num_experts=s.E, top_k=s.K, lora=bank, backend="triton",
                                 fused=False if flow else None)
    lora_ids = torch.full((T,), -1 if mode == "lora-idle" else 0, dtype=torch.int32, device=dev) if lora else None

    W, packed = moelab.prepare_weights(w13, w2, backend="triton"), moelab.pack_topk_ids_weights(ids, w)

    def call():
        if mode == "routed":
            return moelab.routed_moe(packed, x, W, num_experts=s.E, top_k=s.K, validate=False)[0]
        return experts(x, w, ids, lora_ids, has_lora=lora, validate=False)

    for _ in range(20):
        call()
    torch.cuda.synchronize()
    host = []
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        call()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    t_first_cpu = min(e.time_range.start for e in cpu if "synchronize" not in e.name.lower()) if cpu else 0
    busy = sum(e.time_range.end - e.time_range.start for e in events)
    print(f"T={T} {mode}{' (flow)' if flow and lora else ''}: GPU kernels of one eager call, µs from the first "
          f"host op; {busy:.1f} µs busy")
    last_end = None
    for e in sorted(events, key=lambda e: e.time_range.start):
        start, end = e.time_range.start - t_first_cpu, e.time_range.end - t_first_cpu
        gap = "" if last_end is None else f"  (idle {start - last_end:.1f})"
        print(f"  {start:8.1f} - {end:8.1f}  {end - start:7.1f}  {e.name[:70]}{gap}")
        last_end = end
    host.sort()
    print(f"host time of a call (GPU idle before it): median {1e6 * host[len(host) // 2]:.1f} µs")
    if host_calls:
        with cProfile.Profile() as prof_host:
            for _ in range(host_calls):
                call()
        torch.cuda.synchronize()
        print(f"host: {host_calls} calls under cProfile, by own time")
        pstats.Stats(prof_host).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
