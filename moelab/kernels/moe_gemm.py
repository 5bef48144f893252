"""Grouped GEMMs of the routed MoE over the permuted row space (see ``moelab/permutation.py``).

    gemm1_swiglu:  act[p]   = silu(x[t] @ W_gate[e]^T + d_gate) * (x[t] @ W_up[e]^T + d_up)   [R1, I]
    gemm2:         y[p]     = act[p] @ W2[e]^T                                                   [R2, H]

``p`` is a permuted row, ``t = row_to_slot[p] // K`` its token, ``e = block_group[p // BLOCK_M]`` the local
expert shared by the whole tile of rows, ``d`` the optional ``gemm1_lora_delta`` row of the slot
(FlashInfer's **[up, gate]** order) added to the fp32 accumulators before SwiGLU. The weights stay in HF
order (``w13 [E_local, 2I, H]`` rows [gate; up], ``w2 [E_local, H, I]``), read K-major like vLLM's
``fused_moe_kernel``. Padding rows (slot -1) and tiles past the live rows are written with ``DEAD_FILL``
(0, or NaN in debug mode); dead tiles touch no weight.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelab.kernels._common import to_output


@triton.jit
def _gemm1_swiglu_kernel(
    x_ptr, w13_ptr, delta_ptr, act_ptr, row_to_slot_ptr, block_group_ptr,
    num_live_blocks, num_rows, H, I, top_k,
    stride_x_t, stride_w_e, stride_w_n, stride_d_slot, stride_act_r,
    HAS_DELTA: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, DEAD_FILL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    num_n = tl.cdiv(I, BLOCK_N)
    pid = tl.program_id(0)
    pid_m = pid // num_n  # consecutive programs share the gathered rows and sweep the expert's columns
    pid_n = pid % num_n
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    out_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_act_r + cols[None, :]
    out_mask = (rows < num_rows)[:, None] & col_ok[None, :]
    expert = -1
    if pid_m < num_live_blocks:
        expert = tl.load(block_group_ptr + pid_m)
    if expert < 0:  # past the live rows: no weights to read
        tl.store(out_ptrs, tl.full((BLOCK_M, BLOCK_N), DEAD_FILL, act_ptr.dtype.element_ty), mask=out_mask)
        return
    slots = tl.load(row_to_slot_ptr + rows)
    row_ok = slots >= 0
    tokens = tl.where(row_ok, slots // top_k, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_x_t + ks[None, :]
    w_base = w13_ptr + expert.to(tl.int64) * stride_w_e
    gate_ptrs = w_base + cols[None, :].to(tl.int64) * stride_w_n + ks[:, None]  # [BLOCK_K, BLOCK_N]
    up_ptrs = gate_ptrs + I * stride_w_n
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(H, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            wg = tl.load(gate_ptrs, mask=col_ok[None, :], other=0.0)
            wu = tl.load(up_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks + k0 * BLOCK_K < H
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(gate_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            wu = tl.load(up_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:  # the interpreter mis-multiplies bf16 in tl.dot (triton #11584); fp32 inputs need ieee
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_gate = tl.dot(a, wg, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, wu, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if HAS_DELTA:  # LoRA delta of the slot, [up | gate], added before the activation, unweighted
        d_ptrs = delta_ptr + tl.where(row_ok, slots, 0).to(tl.int64)[:, None] * stride_d_slot + cols[None, :]
        d_mask = row_ok[:, None] & col_ok[None, :]
        acc_up += tl.load(d_ptrs, mask=d_mask, other=0.0).to(tl.float32)
        acc_gate += tl.load(d_ptrs + I, mask=d_mask, other=0.0).to(tl.float32)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    act = tl.where(row_ok[:, None], act, DEAD_FILL)
    tl.store(out_ptrs, to_output(act, act_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _gemm2_kernel(
    act_ptr, w2_ptr, out_ptr, block_group_ptr,
    num_live_blocks, num_rows, H, I,
    stride_act_r, stride_w_e, stride_w_n, stride_out_r,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, DEAD_FILL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    num_n = tl.cdiv(H, BLOCK_N)
    pid = tl.program_id(0)
    pid_m = pid // num_n
    pid_n = pid % num_n
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out_r + cols[None, :]
    out_mask = (rows < num_rows)[:, None] & col_ok[None, :]
    expert = -1
    if pid_m < num_live_blocks:
        expert = tl.load(block_group_ptr + pid_m)
    if expert < 0:
        tl.store(out_ptrs, tl.full((BLOCK_M, BLOCK_N), DEAD_FILL, out_ptr.dtype.element_ty), mask=out_mask)
        return
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_act_r + ks[None, :]  # live rows: contiguous
    w_ptrs = w2_ptr + expert.to(tl.int64) * stride_w_e + cols[None, :].to(tl.int64) * stride_w_n + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(I, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks + k0 * BLOCK_K < I
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(out_ptrs, to_output(acc, out_ptr.dtype.element_ty), mask=out_mask)
