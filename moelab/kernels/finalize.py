"""Fused finalize (docs/contract.md §3 step 5 and §5): one pass that reduces over top-k and writes each output row once.

    out[t] = scale * sum_{k: map[t*K+k] >= 0} float(w[t,k]) * float(gemm2[map[t*K+k]])  +  sum_k float(d[t,k])

Accumulation is fp32 in k order; the base sum is finished before the (already weighted) W2 LoRA delta is
added, so a token whose delta rows are zero gets bit-for-bit the base path's row (the base path runs this same
kernel with HAS_DELTA=False). Bytes: K gathered rows of gemm2 (+ K delta rows) read, one row written.

Why a pass of its own and not GEMM2's epilogue (a scatter-add of each weighted row into its token's row): measured on
an H100 (BENCHMARKS.md, "The top-k combine in GEMM2's epilogue"), fp32 atomics lost 2-30 % to this pass at T >= 1024
and bf16 atomics gained at most 2.5 %, at the price of a rounding at every add, outputs that differ from run to run,
and no interpreter support; this pass is deterministic and rounds once.
"""

from __future__ import annotations

import torch
import triton.language as tl

from moelab import _runtime
from moelab.kernels._common import jit, routing_word_weight, to_output, wait_for_previous_kernel
from moelab.permutation import cdiv, next_pow2


@jit
def _finalize_kernel(
    out_ptr, gemm2_ptr, weights_ptr, e2p_ptr, delta_ptr, scale,
    num_rows, H, stride_out_t, stride_gemm2_r, stride_w_t, stride_d_t, stride_d_k,
    TOP_K: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_SCALE: tl.constexpr, PACKED_WEIGHTS: tl.constexpr,
    ROUND_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    wait_for_previous_kernel(USE_GDC)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    # Unrolled over k without branches, so all K row gathers are in flight at once (decode is latency bound).
    for k in tl.static_range(TOP_K):
        row = tl.load(e2p_ptr + t * TOP_K + k)
        live = (row >= 0) & (row < num_rows)  # non-local slots contribute nothing (their rows are never read)
        if PACKED_WEIGHTS:  # the low half of the routing word is the bf16 weight: widen it exactly
            word = tl.load(weights_ptr + t * stride_w_t + k)
            w = routing_word_weight(word)
        else:
            w = tl.load(weights_ptr + t * stride_w_t + k).to(tl.float32)
            if ROUND_WEIGHTS:  # the weight packing would have carried: bf16, nearest even
                w = to_output(w, tl.bfloat16).to(tl.float32)
        y_ptrs = gemm2_ptr + tl.where(live, row, 0).to(tl.int64) * stride_gemm2_r + cols
        y = tl.load(y_ptrs, mask=tl.where(live, col_ok, False), other=0.0)  # (scalar & vector breaks the interpreter)
        acc = tl.where(live, acc + w * y.to(tl.float32), acc)
    if HAS_SCALE:
        acc = acc * scale
    if HAS_DELTA:
        lora = tl.zeros((BLOCK_H,), dtype=tl.float32)
        d_ptrs = delta_ptr + t.to(tl.int64) * stride_d_t + cols
        for k in tl.static_range(TOP_K):
            lora += tl.load(d_ptrs + k * stride_d_k, mask=col_ok, other=0.0).to(tl.float32)
        acc = acc + lora
    tl.store(out_ptr + t.to(tl.int64) * stride_out_t + cols, to_output(acc, out_ptr.dtype.element_ty), mask=col_ok)


def finalize_triton(output: torch.Tensor, gemm2_output: torch.Tensor, expert_weights: torch.Tensor,
                    e2p: torch.Tensor, w2_delta: torch.Tensor | None, scale: float = 1.0, *,
                    packed_weights: bool = False, round_weights: bool = False, pdl: dict | None = None) -> torch.Tensor:
    """Launch :func:`_finalize_kernel` (inputs already validated by ``moelab.ops.finalize_with_w2_lora``).

    ``packed_weights``: ``expert_weights`` holds int32 routing words whose low halves are the bf16 weights.
    ``round_weights``: round float ``expert_weights`` to bf16 first (the weights the packing would carry).
    ``pdl``: the launch options of :func:`moelab._runtime.pdl_launch` (default: asked here)."""
    T, H = output.shape
    K = expert_weights.shape[1]
    if T == 0:
        return output
    # 16-byte vectors per thread, up to 1024 columns per program (a row of H=2048 is two programs); decode batches
    # take 512 for more programs in flight (H200, T=32: 1.8 vs 2.3 µs in a CUDA graph).
    block_h = min(1024 if T >= 1024 else 512, next_pow2(H))
    delta = w2_delta if w2_delta is not None else output  # placeholder pointer, never read
    _finalize_kernel[(T, cdiv(H, block_h))](
        out_ptr=output, gemm2_ptr=gemm2_output, weights_ptr=expert_weights, e2p_ptr=e2p, delta_ptr=delta,
        scale=float(scale), num_rows=gemm2_output.shape[0], H=H, stride_out_t=output.stride(0),
        stride_gemm2_r=gemm2_output.stride(0), stride_w_t=expert_weights.stride(0),
        stride_d_t=delta.stride(0) if w2_delta is not None else 0,
        stride_d_k=delta.stride(1) if w2_delta is not None else 0,
        TOP_K=K, HAS_DELTA=w2_delta is not None, HAS_SCALE=scale != 1.0, PACKED_WEIGHTS=packed_weights,
        ROUND_WEIGHTS=round_weights, BLOCK_H=block_h, num_warps=4 if block_h >= 512 else 1,
        **(_runtime.pdl_launch(output.device) if pdl is None else pdl),
    )
    return output
