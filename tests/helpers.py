"""Shared checks: relative error against the float64 reference, poisoning, random routing."""

from __future__ import annotations

import torch

from moelab.lab import rel_err  # ||out - ref|| / ||ref|| in float64; NaN gives inf; shapes must match

#: ||out - ref|| / ||ref|| bounds against the float64 reference (docs/contract.md §7). bf16 keeps 8 bits of mantissa
#: (rounding 2^-9 ~ 2e-3 per element, a few roundings per path: ~3e-3 typical); fp16 keeps 11 bits;
#: fp32 paths accumulate in fp32 (~1e-7 per op) and stay far under 1e-5.
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "") -> float:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = rel_err(out, ref)
    assert err < REL_TOL[dtype], f"{what}: rel err {err:.2e} >= {REL_TOL[dtype]:.0e} ({dtype})"
    return err


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floats) or a sentinel (ints) so an unwritten element fails loudly."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(-12345)


def random_topk_ids(T: int, K: int, E: int, *, generator=None, device="cpu") -> torch.Tensor:
    """int32 [T, K]: K distinct experts per token, uniformly chosen."""
    scores = torch.rand(T, E, generator=generator)
    return scores.topk(K, dim=1).indices.to(torch.int32).to(device)


def random_weights(T: int, K: int, *, generator=None, device="cpu") -> torch.Tensor:
    """fp32 [T, K] routing weights, positive, not normalised (the kernel applies no routing math)."""
    return (torch.rand(T, K, generator=generator) + 0.1).to(device)


def random_experts(E: int, H: int, I: int, dtype, *, device="cpu", scale: float = 1.0):
    """HF-order w13 [E, 2I, H] and w2 [E, H, I], scaled so activations stay O(1)."""
    w13 = (torch.randn(E, 2 * I, H) * scale / H**0.5).to(dtype).to(device)
    w2 = (torch.randn(E, H, I) * scale / I**0.5).to(dtype).to(device)
    return w13, w2


def routed_problem(T: int, K: int, E: int, H: int, I: int, dtype, *, seed: int, device="cpu"):
    """A random routed-MoE problem: (x [T, H], topk ids [T, K], weights [T, K], w13, w2, the triton backend's
    prepared weights)."""
    import moelab

    g = torch.Generator().manual_seed(seed)
    w13, w2 = random_experts(E, H, I, dtype, device=device)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    ids = random_topk_ids(T, K, E, generator=g, device=device)
    w = random_weights(T, K, generator=g, device=device)
    return x, ids, w, w13, w2, moelab.prepare_weights(w13, w2, backend="triton")


def routed_on_tiles(config, x, ids, w, W, E: int, K: int):
    """The triton backend's routed MoE on GEMM tiles ``config`` into a poisoned output: (output, GEMM2's output)."""
    from moelab.backends import triton_backend
    from moelab.contract import RoutedMoECall

    out = poison(torch.empty_like(x))
    call = RoutedMoECall((ids, w), None, x, W, num_experts=E, top_k=K, local_expert_offset=0,
                         gemm1_lora_delta=None, do_finalize=True, output=out)
    result = triton_backend.routed_moe(call, config=config)
    return result.output, result.gemm2_output


def record_tma_choices(monkeypatch) -> list[bool]:
    """A list that collects what ``moe_gemm.takes_tma`` answers at each GEMM launch from now on (GEMM1's, then
    GEMM2's, per call)."""
    from moelab.kernels import moe_gemm

    launched, takes = [], moe_gemm.takes_tma
    monkeypatch.setattr(moe_gemm, "takes_tma", lambda *a, **k: launched.append(takes(*a, **k)) or launched[-1])
    return launched


def lora_and_base_outputs(experts, x, topk_weights, topk_ids, lora_ids):
    """``experts`` called with ``lora_ids`` and without LoRA, in moelab's debug mode (every launch checked):
    returns (out, base), both [T, H]."""
    import moelab

    moelab.set_debug(True)
    try:
        return experts(x, topk_weights, topk_ids, lora_ids), experts(x, topk_weights, topk_ids, None)
    finally:
        moelab.set_debug(False)
