"""Fused finalize (SPEC §3 step 5 and §5): one pass that reduces over top-k and writes each output row once.

    out[t] = scale * sum_{k: map[t*K+k] >= 0} float(w[t,k]) * float(gemm2[map[t*K+k]])  +  sum_k float(d[t,k])

Accumulation is fp32 in k order; the base sum is finished before the (already weighted) W2 LoRA delta is
added, so a token whose delta rows are zero gets bit-for-bit the base path's row (the base path runs this same
kernel with HAS_DELTA=False). Bytes: K gathered rows of gemm2 (+ K delta rows) read, one row written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelab.kernels._common import to_output


@triton.jit
def _finalize_kernel(
    out_ptr, gemm2_ptr, weights_ptr, e2p_ptr, delta_ptr, scale,
    num_rows, H, top_k, stride_out_t, stride_gemm2_r, stride_w_t, stride_d_t, stride_d_k,
    HAS_DELTA: tl.constexpr, HAS_SCALE: tl.constexpr, PACKED_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in range(0, top_k):
        row = tl.load(e2p_ptr + t * top_k + k)
        if (row >= 0) & (row < num_rows):  # non-local slots contribute nothing (their rows are never read)
            if PACKED_WEIGHTS:  # the low half of the routing word is the bf16 weight: widen it exactly
                word = tl.load(weights_ptr + t * stride_w_t + k)
                w = ((word & 0xFFFF) << 16).to(tl.float32, bitcast=True)
            else:
                w = tl.load(weights_ptr + t * stride_w_t + k).to(tl.float32)
            y = tl.load(gemm2_ptr + row.to(tl.int64) * stride_gemm2_r + cols, mask=col_ok, other=0.0)
            acc += w * y.to(tl.float32)
    if HAS_SCALE:
        acc = acc * scale
    if HAS_DELTA:
        lora = tl.zeros((BLOCK_H,), dtype=tl.float32)
        d_ptrs = delta_ptr + t.to(tl.int64) * stride_d_t + cols
        for k in range(0, top_k):
            lora += tl.load(d_ptrs + k * stride_d_k, mask=col_ok, other=0.0).to(tl.float32)
        acc = acc + lora
    tl.store(out_ptr + t.to(tl.int64) * stride_out_t + cols, to_output(acc, out_ptr.dtype.element_ty), mask=col_ok)


def finalize_triton(output: torch.Tensor, gemm2_output: torch.Tensor, expert_weights: torch.Tensor,
                    e2p: torch.Tensor, w2_delta: torch.Tensor | None, scale: float = 1.0, *,
                    packed_weights: bool = False) -> torch.Tensor:
    """Launch :func:`_finalize_kernel` (inputs already validated by ``moelab.ops.finalize_with_w2_lora``).

    ``packed_weights``: ``expert_weights`` holds int32 routing words whose low halves are the bf16 weights."""
    T, H = output.shape
    K = expert_weights.shape[1]
    if T == 0:
        return output
    # 16-byte vectors per thread, up to 1024 columns per program: a row of H=2048 is two programs.
    block_h = min(1024, triton.next_power_of_2(H))
    delta = w2_delta if w2_delta is not None else output  # placeholder pointer, never read
    _finalize_kernel[(T, triton.cdiv(H, block_h))](
        output, gemm2_output, expert_weights, e2p, delta, float(scale),
        gemm2_output.shape[0], H, K, output.stride(0), gemm2_output.stride(0), expert_weights.stride(0),
        delta.stride(0) if w2_delta is not None else 0, delta.stride(1) if w2_delta is not None else 0,
        HAS_DELTA=w2_delta is not None, HAS_SCALE=scale != 1.0, PACKED_WEIGHTS=packed_weights, BLOCK_H=block_h,
        num_warps=4 if block_h >= 512 else 1,
    )
    return output


