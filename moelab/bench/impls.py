"""moelab's own rows of the benchmark: ``routed_moe`` on a backend, ``LoRAExperts``, and vLLM's unfused LoRA flow
built from moelab's public ops. Each ``build_*`` takes the run's :class:`~moelab.bench.runner.Ctx` and returns
``fn(InputSet) -> [T, H] output``; :class:`Skip` says why one cannot run here."""

from __future__ import annotations

import math

import torch

import moelab


class Skip(Exception):
    """An implementation that cannot run here; the message says why."""


def build_moelab(ctx, backend: str):
    """``moelab.routed_moe`` with packed routing words (as vLLM passes them), ``validate=False``."""
    if backend not in moelab.available_backends(ctx.device):
        raise Skip(f"moelab backend {backend!r} does not run on {ctx.device} here "
                   f"(available: {moelab.available_backends(ctx.device)})")
    W = moelab.prepare_weights(ctx.w13, ctx.w2, backend=backend, **ctx.expert)
    E, K = ctx.shape.E, ctx.shape.K
    return lambda s: moelab.routed_moe(s.packed, s.x, W, num_experts=E, top_k=K, validate=False)[0]


def build_moelab_tiled(ctx):
    """``moelab.routed_moe`` on the triton backend's tiled pipeline at every batch size (its token-major decode
    kernels ruled out): the base rows that the LoRA ops' tokens without an adapter equal bit for bit."""
    from moelab.backends import triton_backend
    from moelab.moe import validate_call

    W = moelab.prepare_weights(ctx.w13, ctx.w2, backend="triton", **ctx.expert)
    E, K = ctx.shape.E, ctx.shape.K
    return lambda s: triton_backend.routed_moe(validate_call(s.packed, s.x, W, E, K, 0, None, True, None, False),
                                               token_major=False).output


def make_bank(ctx, ranks: list[int]) -> moelab.LoRABank:
    """A LoRABank with one random adapter per entry of ``ranks`` (slot i has rank ``ranks[i]``), scaling 1. Slot 0
    shares one A between gate and up (PEFT's fused gate_up LoRA), so HF + PEFT computes the same function."""
    E, H, I = ctx.shape.E, ctx.shape.H, ctx.shape.I
    bank = moelab.LoRABank(len(ranks), E, H, I, max(ranks), dtype=ctx.dtype, device=ctx.device)
    for slot, rank in enumerate(ranks):
        sa, sb = 1.0 / math.sqrt(H), 0.3 / math.sqrt(rank)  # delta ~30% of the base pre-activation
        gate_a = torch.randn(E, rank, H, device=ctx.device) * sa
        up_a = gate_a if slot == 0 else torch.randn(E, rank, H, device=ctx.device) * sa
        bank.set(slot, gate_a=gate_a, up_a=up_a,
                 gate_b=torch.randn(E, I, rank, device=ctx.device) * sb,
                 up_b=torch.randn(E, I, rank, device=ctx.device) * sb,
                 down_a=torch.randn(E, rank, I, device=ctx.device) / math.sqrt(I),
                 down_b=torch.randn(E, H, rank, device=ctx.device) * sb)
    return bank


def build_lora_experts(ctx, variant: str, path: str | None = None):
    """``moelab.LoRAExperts(..., backend="triton")`` called as a serving engine calls it: ``has_lora`` known on
    the host, ``validate=False``. Variant ``ids=-1``: every token without an adapter. ``path``: one of
    ``moelab.experts.LORA_PATHS`` forced with ``fused=path`` (None: the module's own choice); a path this bank or
    batch cannot take is a :class:`Skip`. ``fn.base``: the same module's call without adapters, whose rows its
    tokens without an adapter equal bit for bit."""
    from moelab.backends.triton_backend import FUSED_DECODE_MAX_SLOTS

    s = ctx.shape
    try:
        mod = moelab.LoRAExperts(ctx.w13, ctx.w2, num_experts=s.E, top_k=s.K, lora=ctx.bank_of(variant),
                                 backend="triton", fused=path)
    except ValueError as e:
        raise Skip(f"fused={path!r}: {e}") from None
    has_lora = variant != "ids=-1"

    def fn(st):
        if path == "decode" and st.ids.numel() > FUSED_DECODE_MAX_SLOTS:
            raise Skip(f"fused='decode' takes at most {FUSED_DECODE_MAX_SLOTS} slots, got {st.ids.numel()}")
        return mod(st.x, st.weights, st.ids, st.lora_ids[variant], has_lora=has_lora, validate=False)

    fn.base = lambda st: mod(st.x, st.weights, st.ids, None, validate=False)
    return fn


def build_lora_ops(ctx, variant: str):
    """vLLM's unfused LoRA flow from moelab's public pieces: lora_segments, w13_lora_delta, routed_moe(delta,
    do_finalize=False), unpermute_activation, w2_lora_delta, finalize_with_w2_lora."""
    from moelab.lora import lora_segments

    W = moelab.prepare_weights(ctx.w13, ctx.w2, backend="triton")
    E, K, bank = ctx.shape.E, ctx.shape.K, ctx.bank_of(variant)

    def fn(s):
        T, lora_ids = s.x.shape[0], s.lora_ids[variant]
        seg = lora_segments(s.ids, lora_ids, bank)
        d13 = moelab.w13_lora_delta(s.x, s.ids, lora_ids, bank, validate=False, segments=seg)
        gemm2, ew, e2p, act = moelab.routed_moe(s.packed, s.x, W, num_experts=E, top_k=K, gemm1_lora_delta=d13,
                                                do_finalize=False, validate=False)
        d2 = moelab.w2_lora_delta(moelab.unpermute_activation(act, e2p, T, K, validate=False), s.ids, s.weights,
                                  lora_ids, bank, validate=False, segments=seg)
        return moelab.finalize_with_w2_lora(torch.empty_like(s.x), gemm2, ew, e2p, d2, validate=False)

    fn.base = build_moelab_tiled(ctx)  # routed_moe with a delta runs the tiled pipeline
    return fn
