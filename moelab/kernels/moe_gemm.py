"""Grouped GEMMs of the routed MoE over the permuted row space (see ``moelab/permutation.py``).

    gemm1_swiglu:  act[p]   = silu(x[t] @ W_gate[e]^T + d_gate) * (x[t] @ W_up[e]^T + d_up)   [R1, I]
    gemm2:         y[p]     = act[p] @ W2[e]^T                                                   [R2, H]

``p`` is a permuted row, ``t = row_to_slot[p] // K`` its token, ``e = block_group[p // BLOCK_M]`` the local
expert shared by the whole tile of rows, ``d`` the optional ``gemm1_lora_delta`` row of the slot
(FlashInfer's **[up, gate]** order) added to the fp32 accumulators before SwiGLU. The weights stay in HF
order (``w13 [E_local, 2I, H]`` rows [gate; up], ``w2 [E_local, H, I]``), read K-major like vLLM's
``fused_moe_kernel``. Padding rows (slot -1) and tiles past the live rows are written with ``DEAD_FILL``
(0, or NaN in debug mode); dead tiles touch no weight.

Fused LoRA (``LORA``, the triton backend's path for :class:`moelab.LoRAExperts`): the adapters of a
:class:`moelab.LoRABank` are folded into the same tiles instead of going through HBM as [T,K,2I] and [T,K,H]
deltas. A tile's rows may carry different adapters, so each bank matrix is read *stacked*: column
``j = adapter * R_PAD + r`` of the stacked A (or row of the stacked B) is rank ``r`` of adapter ``adapter``;
a row keeps only its own adapter's block (``own``), which makes the other blocks exact zeros.

    _lora_shrink13_kernel  s13[p] = (A_up x[t], A_gate x[t]) of row p's adapter          [R1, 2, R_PAD]
    gemm1 epilogue         acc_up += s13_up[p] B_up^T, acc_gate += s13_gate[p] B_gate^T (before SwiGLU), then
                           s2_part[n, p] = act[p, n-block] A_down[:, n-block]^T          [N1, R1, R_PAD] fp32
    gemm2 epilogue         acc += (sum_n s2_part[n, p]) B_down^T * w[slot] / bf16(w[slot])

The last factor turns the bf16 routing weight the finalize applies into the caller's weight for the LoRA
term, as vLLM's flow weights its W2 delta. Rank vectors are rounded to the input dtype like vLLM's. A row
without an adapter adds exact zeros (tiles without any adapter skip the LoRA work), so its output is
bit-for-bit the base path's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelab.kernels._common import to_output


@triton.jit
def _stacked_index(L_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """(adapter, rank) of each column j of a stacked bank matrix, int64 [L_PAD * R_PAD] each."""
    j = tl.arange(0, L_PAD * R_PAD)
    return (j // R_PAD).to(tl.int64), (j % R_PAD).to(tl.int64)


@triton.jit
def _row_adapters(lora_ids_ptr, tokens, row_ok, num_loras):
    """Adapter slot of each row, int32 [BLOCK_M]; -1 for no adapter, a dead row, or an id outside the bank."""
    adapter = tl.load(lora_ids_ptr + tokens, mask=row_ok, other=-1).to(tl.int32)
    return tl.where((adapter >= 0) & (adapter < num_loras), adapter, -1)


@triton.jit
def _own_block(stacked, adapters, BLOCK_M: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """[BLOCK_M, L_PAD*R_PAD] -> [BLOCK_M, R_PAD]: each row's own adapter block (zeros without an adapter)."""
    block = tl.arange(0, L_PAD * R_PAD) // R_PAD
    stacked = tl.where(block[None, :] == adapters[:, None], stacked, 0.0)
    return tl.sum(tl.reshape(stacked, (BLOCK_M, L_PAD, R_PAD)), axis=1)


@triton.jit
def _lora_shrink13_kernel(
    x_ptr, up_a_ptr, gate_a_ptr, s13_ptr, row_to_slot_ptr, block_group_ptr, lora_ids_ptr,
    H, top_k, num_local_experts, num_loras, max_rank, stride_x_t,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    L_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program per live tile of GEMM1's rows: s13[p] = [A_up x; A_gate x] of the row's adapter, [2, R_PAD]
    in the input dtype (fp32 accumulation). Banks ``A [L, E_local, max_rank, H]`` contiguous."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_group_ptr + pid_m)
    if expert < 0:  # past the live rows: GEMM1 reads nothing here
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(row_to_slot_ptr + rows)
    row_ok = slots >= 0
    tokens = tl.where(row_ok, slots // top_k, 0).to(tl.int64)
    adapters = _row_adapters(lora_ids_ptr, tokens, row_ok, num_loras)
    s_up = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    s_gate = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
    if tl.max(adapters, axis=0) >= 0:  # a tile without adapters writes zeros and reads nothing
        adapter, rank = _stacked_index(L_PAD, R_PAD)
        a_cols = (adapter * num_local_experts + expert) * max_rank * H + rank * H  # [L_PAD*R_PAD]
        a_ok = (adapter < num_loras) & (rank < max_rank)
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + tokens[:, None] * stride_x_t + ks[None, :]
        acc_up = tl.zeros((BLOCK_M, L_PAD * R_PAD), dtype=tl.float32)
        acc_gate = tl.zeros((BLOCK_M, L_PAD * R_PAD), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(H, BLOCK_K)):
            k = ks + k0 * BLOCK_K
            k_ok = k < H
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a_offs = a_cols[None, :] + k[:, None]  # [BLOCK_K, L_PAD*R_PAD]: stacked A^T
            a_mask = k_ok[:, None] & a_ok[None, :]
            up_t = tl.load(up_a_ptr + a_offs, mask=a_mask, other=0.0)
            gate_t = tl.load(gate_a_ptr + a_offs, mask=a_mask, other=0.0)
            if DOT_F32:
                xt, up_t, gate_t = xt.to(tl.float32), up_t.to(tl.float32), gate_t.to(tl.float32)
            acc_up = tl.dot(xt, up_t, acc_up, input_precision=DOT_PRECISION)
            acc_gate = tl.dot(xt, gate_t, acc_gate, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
        s_up = _own_block(acc_up, adapters, BLOCK_M, L_PAD, R_PAD)
        s_gate = _own_block(acc_gate, adapters, BLOCK_M, L_PAD, R_PAD)
    out = s13_ptr + rows.to(tl.int64)[:, None] * (2 * R_PAD) + tl.arange(0, R_PAD)[None, :]
    tl.store(out, to_output(s_up, s13_ptr.dtype.element_ty))
    tl.store(out + R_PAD, to_output(s_gate, s13_ptr.dtype.element_ty))


@triton.jit
def _expand_stacked(s, b_ptr, b_offs, b_mask, acc, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + s @ B^T: ``s`` [BLOCK_M, L_PAD*R_PAD] rank vectors in the input dtype (zero outside each row's
    own block), the stacked B^T tile [L_PAD*R_PAD, BLOCK_N] read at ``b_offs``."""
    b = tl.load(b_ptr + b_offs, mask=b_mask, other=0.0)
    if DOT_F32:
        s, b = s.to(tl.float32), b.to(tl.float32)
    return tl.dot(s, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _gemm1_swiglu_kernel(
    x_ptr, w13_ptr, delta_ptr, act_ptr, row_to_slot_ptr, block_group_ptr,
    num_live_blocks, num_rows, H, I, top_k,
    stride_x_t, stride_w_e, stride_w_n, stride_d_slot, stride_act_r,
    # fused LoRA (LORA): rank vectors in/out, per-token adapter ids, the bank's B_up, B_gate, A_down
    s13_ptr, s2_part_ptr, lora_ids_ptr, up_b_ptr, gate_b_ptr, down_a_ptr,
    num_local_experts, num_loras, max_rank, stride_part,
    HAS_DELTA: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, DEAD_FILL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    LORA: tl.constexpr = False, L_PAD: tl.constexpr = 1, R_PAD: tl.constexpr = 16,
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
    if LORA:
        adapters = _row_adapters(lora_ids_ptr, tokens, row_ok, num_loras)
        adapter, rank = _stacked_index(L_PAD, R_PAD)
        own = adapter[None, :] == adapters[:, None]  # [BLOCK_M, L_PAD*R_PAD]
        bank_ok = (adapter < num_loras) & (rank < max_rank)
        bank_row = adapter * num_local_experts + expert  # (adapter, expert) matrix of each stacked column
        if tl.max(adapters, axis=0) >= 0:  # W13 LoRA: expand the shrink kernel's rank vectors before SwiGLU
            s_ptrs = s13_ptr + rows.to(tl.int64)[:, None] * (2 * R_PAD) + rank[None, :]  # [up | gate]
            b_offs = bank_row[:, None] * I * max_rank + cols[None, :] * max_rank + rank[:, None]  # stacked B^T
            b_mask = bank_ok[:, None] & col_ok[None, :]
            acc_up = _expand_stacked(tl.load(s_ptrs, mask=own, other=0.0), up_b_ptr, b_offs, b_mask, acc_up,
                                     DOT_F32, DOT_PRECISION)
            acc_gate = _expand_stacked(tl.load(s_ptrs + R_PAD, mask=own, other=0.0), gate_b_ptr, b_offs, b_mask,
                                       acc_gate, DOT_F32, DOT_PRECISION)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    act = tl.where(row_ok[:, None], act, DEAD_FILL)
    act = to_output(act, act_ptr.dtype.element_ty)
    tl.store(out_ptrs, act, mask=out_mask)
    if LORA:
        if tl.max(adapters, axis=0) >= 0:  # W2 LoRA shrink of this column block of act: one partial per block
            da_offs = bank_row[None, :] * max_rank * I + rank[None, :] * I + cols[:, None]  # stacked A_down^T
            da = tl.load(down_a_ptr + da_offs, mask=col_ok[:, None] & bank_ok[None, :], other=0.0)
            act_in = act
            if DOT_F32:
                act_in, da = act.to(tl.float32), da.to(tl.float32)
            part = _own_block(tl.dot(act_in, da, input_precision=DOT_PRECISION), adapters, BLOCK_M, L_PAD, R_PAD)
            part_ptrs = (s2_part_ptr + pid_n * stride_part + rows.to(tl.int64)[:, None] * R_PAD
                         + tl.arange(0, R_PAD)[None, :])
            tl.store(part_ptrs, part)


@triton.jit
def _gemm2_kernel(
    act_ptr, w2_ptr, out_ptr, block_group_ptr,
    num_live_blocks, num_rows, H, I,
    stride_act_r, stride_w_e, stride_w_n, stride_out_r,
    # fused LoRA (LORA): GEMM1's W2 rank-vector partials, the bank's B_down, ids and both routing weights
    s2_part_ptr, row_to_slot_ptr, lora_ids_ptr, down_b_ptr, weights_ptr, packed_ptr,
    top_k, num_local_experts, num_loras, max_rank, num_parts, stride_part,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, DEAD_FILL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    LORA: tl.constexpr = False, L_PAD: tl.constexpr = 1, R_PAD: tl.constexpr = 16,
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
    if LORA:
        slots = tl.load(row_to_slot_ptr + rows)
        row_ok = slots >= 0
        slots = tl.where(row_ok, slots, 0).to(tl.int64)
        adapters = _row_adapters(lora_ids_ptr, slots // top_k, row_ok, num_loras)
        if tl.max(adapters, axis=0) >= 0:  # W2 LoRA: sum the partials, round like vLLM, expand, weight
            adapter, rank = _stacked_index(L_PAD, R_PAD)
            own = adapter[None, :] == adapters[:, None]
            p_ptrs = s2_part_ptr + rows.to(tl.int64)[:, None] * R_PAD + rank[None, :]
            s2 = tl.zeros((BLOCK_M, L_PAD * R_PAD), dtype=tl.float32)
            for p in range(0, num_parts):
                s2 += tl.load(p_ptrs + p * stride_part, mask=own, other=0.0)
            bank_row = adapter * num_local_experts + expert
            db_offs = bank_row[:, None] * H * max_rank + cols[None, :] * max_rank + rank[:, None]
            db_mask = ((adapter < num_loras) & (rank < max_rank))[:, None] & col_ok[None, :]
            lora = _expand_stacked(to_output(s2, act_ptr.dtype.element_ty), down_b_ptr, db_offs, db_mask,
                                   tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), DOT_F32, DOT_PRECISION)
            # The finalize multiplies by the bf16 weight of the routing word; the LoRA term wants the caller's.
            has = adapters >= 0
            w = tl.load(weights_ptr + slots, mask=has, other=0.0).to(tl.float32)
            w_bf16 = ((tl.load(packed_ptr + slots, mask=has, other=0) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
            ratio = tl.where(w_bf16 != 0.0, w / tl.where(w_bf16 != 0.0, w_bf16, 1.0), 0.0)
            acc += lora * ratio[:, None]
    tl.store(out_ptrs, to_output(acc, out_ptr.dtype.element_ty), mask=out_mask)
