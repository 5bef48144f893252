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
deltas. A tile's rows may carry different adapters, so the bank is used *stacked*: column
``j = adapter * R_PAD + r`` of a rank vector (and row j of the stacked B^T) belongs to rank ``r`` of adapter
``adapter``, and a row's rank vector is zero outside its own adapter's block. One dot with the stacked B then
expands every row with its own adapter.

    _lora_shrink_kernel (W13)  s13[p] = [A_up x[t] | A_gate x[t]] of row p's adapter, stacked  [R, 2, L_PAD*R_PAD]
    gemm1 epilogue             acc_up += s13_up[p] B_up^T, acc_gate += s13_gate[p] B_gate^T, before SwiGLU
    _lora_shrink_kernel (W2)   s2[p] = A_down act[p] * w[slot] / bf16(w[slot]), stacked       [R, L_PAD*R_PAD]
    gemm2 epilogue             acc += s2[p] B_down^T

R is the number of rows the live tiles can reach. The GEMMs read their tile's rank vectors and stacked B^T before
the K loop, so the loop hides that latency (loaded in the epilogue it cost +122/+161 µs at T=16384 on the H200),
and run the small expand dots after it. The factor ``w / bf16(w)`` turns the bf16 routing weight the
finalize applies into the caller's weight for the LoRA term, as vLLM's flow weights its W2 delta. Rank vectors
are accumulated in fp32 and rounded to the input dtype, like vLLM's. The W13 shrink marks the tiles that hold any
adapter (``tile_flags``); the other tiles skip every LoRA step, and a row without an adapter adds exact zeros, so
its output is bit for bit the base path's as long as the bank is finite (0 * inf is NaN; ``LoRABank`` rejects
non-finite values).

Decode (``LORA_DECODE``, small batches; ``triton_backend._pipeline`` decides) needs no shrink launch of its own:

    _decode_segments_w13_shrink_kernel  program 0 builds the segments; the others write s13 by *slot*, each for a
                                        few rank columns of the slot's adapter, and zero the slot's s2 row
                                                                                                [T*K, 2, L_PAD*R_PAD]
    gemm1 epilogue                      expands as above, then adds this column block's share of the W2 shrink,
                                        A_down[:, cols] act[p, cols], to s2 by slot (fp32 atomics) [T*K, L_PAD*R_PAD]
    gemm2                               reads s2 by slot, times w / bf16(w), rounds, expands as above

Both GEMMs find a tile's adapters from ``lora_ids`` themselves (no tile flags). The atomics make the fp32 order of
the W2 shrink's sum over column blocks vary from run to run (the LoRA term of a row may differ in its last bit);
rows without an adapter never touch them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelab.kernels._common import shrink_step, to_output, wait_for_previous_kernel
from moelab.kernels.segments import one_chunk_segments


@triton.jit
def _row_adapters(lora_ids_ptr, tokens, row_ok, num_loras):
    """Adapter slot of each row, int32 [BLOCK_M]; -1 for no adapter, a dead row, or an id outside the bank."""
    adapter = tl.load(lora_ids_ptr + tokens, mask=row_ok, other=-1).to(tl.int32)
    return tl.where((adapter >= 0) & (adapter < num_loras), adapter, -1)


@triton.jit
def _own_adapter_blocks(lora_ids_ptr, tokens, row_ok, num_loras, L_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """Each row's adapter (:func:`_row_adapters`), whether the tile holds any, and the mask of each row's own block
    of stacked columns, bool [BLOCK_M, L_PAD*R_PAD] (all False in a tile without an adapter)."""
    adapters = _row_adapters(lora_ids_ptr, tokens, row_ok, num_loras)
    has_lora = tl.max(adapters, axis=0) >= 0
    j = tl.arange(0, L_PAD * R_PAD)
    return adapters, has_lora, tl.where(has_lora, (j // R_PAD)[None, :] == adapters[:, None], False)


@triton.jit
def _stacked_a(expert, num_local_experts, num_loras, max_rank, D, L_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """Stacked A^T of this expert, bank ``A [L, E_local, max_rank, D]``: the offset of column j's row and whether
    it exists (int64 [L_PAD*R_PAD], bool), plus the adapter of each column."""
    j = tl.arange(0, L_PAD * R_PAD)
    adapter, rank = (j // R_PAD).to(tl.int64), (j % R_PAD).to(tl.int64)
    a_cols = (adapter * num_local_experts + expert) * max_rank * D + rank * D
    return a_cols, (adapter < num_loras) & (rank < max_rank), adapter


@triton.jit
def _caller_weight_ratio(weights_ptr, slots, has):
    """``w[slot] / bf16(w[slot])`` per row (0 where ``has`` is False or the bf16 weight is 0), fp32 [BLOCK_M].
    bf16(w) is rounded to nearest even, as the packing and the finalize's ``ROUND_WEIGHTS`` round it."""
    w = tl.load(weights_ptr + slots, mask=has, other=0.0).to(tl.float32)
    w_bf16 = to_output(w, tl.bfloat16).to(tl.float32)
    return tl.where(w_bf16 != 0.0, w / tl.where(w_bf16 != 0.0, w_bf16, 1.0), 0.0)


@triton.jit
def _lora_shrink_kernel(
    in_ptr, a0_ptr, a1_ptr, out_ptr, tile_flags_ptr, row_to_slot_ptr, block_group_ptr, lora_ids_ptr, weights_ptr,
    D, top_k, num_local_experts, num_loras, max_rank, stride_in,
    GATHER: tl.constexpr, NUM_SLICES: tl.constexpr, WEIGHTED: tl.constexpr, WRITE_FLAGS: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    L_PAD: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    """One program per live tile of the GEMMs' rows: stacked rank vectors ``A_j @ in[row]`` of each row's adapter,
    [BLOCK_M, NUM_SLICES, L_PAD*R_PAD] in the input dtype (fp32 accumulation), zero outside its block.

    GATHER: row p reads ``in[token of p]`` (x, W13), else ``in[p]`` (the permuted act, W2). Banks ``A [L, E_local,
    max_rank, D]`` contiguous. WEIGHTED: times ``w[slot] / bf16(w[slot])`` (see the module docstring).
    WRITE_FLAGS: store whether the tile holds any adapter (tiles without one are skipped, here and in the GEMMs).
    """
    wait_for_previous_kernel(USE_GDC)
    pid_m = tl.program_id(0)
    expert = tl.load(block_group_ptr + pid_m)
    if expert < 0:  # past the live rows: the GEMMs read nothing here
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(row_to_slot_ptr + rows)
    row_ok = slots >= 0
    slots = tl.where(row_ok, slots, 0).to(tl.int64)
    adapters = _row_adapters(lora_ids_ptr, slots // top_k, row_ok, num_loras)
    tile_has_lora = tl.max(adapters, axis=0) >= 0
    if WRITE_FLAGS:
        tl.store(tile_flags_ptr + pid_m, tile_has_lora.to(tl.int32))
    if tile_has_lora:
        a_cols, a_ok, adapter = _stacked_a(expert, num_local_experts, num_loras, max_rank, D, L_PAD, R_PAD)
        in_rows = (slots // top_k) if GATHER else rows.to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        in_ptrs = in_ptr + in_rows[:, None] * stride_in + ks[None, :]
        acc0 = tl.zeros((BLOCK_M, L_PAD * R_PAD), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_M, L_PAD * R_PAD), dtype=tl.float32)
        for k0 in range(0, tl.cdiv(D, BLOCK_K)):
            k = ks + k0 * BLOCK_K
            k_ok = k < D
            xt = tl.load(in_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a_offs = a_cols[None, :] + k[:, None]  # [BLOCK_K, L_PAD*R_PAD]
            acc0, acc1 = shrink_step(xt, a0_ptr, a1_ptr, a_offs, k_ok[:, None] & a_ok[None, :], acc0, acc1,
                                     NUM_SLICES, DOT_F32, DOT_PRECISION)
            in_ptrs += BLOCK_K
        own = adapter[None, :] == adapters[:, None]  # [BLOCK_M, L_PAD*R_PAD]
        if WEIGHTED:
            acc0 = acc0 * _caller_weight_ratio(weights_ptr, slots, adapters >= 0)[:, None]
        j = tl.arange(0, L_PAD * R_PAD)
        out = out_ptr + rows.to(tl.int64)[:, None] * (NUM_SLICES * L_PAD * R_PAD) + j[None, :]
        tl.store(out, to_output(tl.where(own, acc0, 0.0), out_ptr.dtype.element_ty))
        if NUM_SLICES == 2:
            tl.store(out + L_PAD * R_PAD, to_output(tl.where(own, acc1, 0.0), out_ptr.dtype.element_ty))


@triton.jit
def _decode_segments_w13_shrink_kernel(
    values_ptr, scratch_ptr, slot_to_row_ptr, row_to_slot_ptr, block_group_ptr,
    num_slots, offset, num_groups, num_rows, num_blocks,
    x_ptr, up_a_ptr, gate_a_ptr, s13_ptr, s2_ptr, lora_ids_ptr, H, top_k, num_loras, max_rank, stride_x,
    TILE: tl.constexpr, CHUNK: tl.constexpr, G_BINS: tl.constexpr, PACKED: tl.constexpr, CB: tl.constexpr,
    L_PAD: tl.constexpr, R_PAD: tl.constexpr, COLS: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    """Decode (one chunk of slots): program 0 builds the segments (:func:`one_chunk_segments`, ids unpacked), every
    other program shrinks one slot for COLS of its adapter's 2*R_PAD [up | gate] rank columns, in the same launch.

    s13 [slots, 2, L_PAD*R_PAD] (input dtype, fp32 accumulation) is written by *slot* and only in the block of the
    slot's adapter (GEMM1 reads nothing else); the slot's first program zeroes that block of s2 [slots,
    L_PAD*R_PAD] (fp32) for GEMM1's atomics. Slots without an adapter or a local expert write nothing. BLOCK_K >= H
    reads x and the A rows in one step (a loop of dependent loads costs ~1 µs a step at decode).
    """
    wait_for_previous_kernel(USE_GDC)
    pid = tl.program_id(0)
    if pid == 0:
        one_chunk_segments(values_ptr, scratch_ptr, slot_to_row_ptr, row_to_slot_ptr, block_group_ptr, num_slots,
                           offset, num_groups, num_rows, num_blocks, TILE, CHUNK, G_BINS, PACKED, CB)
    else:
        slot = (pid - 1) // (2 * R_PAD // COLS)
        part = (pid - 1) % (2 * R_PAD // COLS)
        c = part * COLS + tl.arange(0, COLS)  # [up ranks | gate ranks] of the adapter
        expert = tl.load(values_ptr + slot).to(tl.int32) - offset
        token = (slot // top_k).to(tl.int64)
        adapter = tl.load(lora_ids_ptr + token).to(tl.int32)
        if (expert >= 0) & (expert < num_groups) & (adapter >= 0) & (adapter < num_loras):
            is_gate, rank = c // R_PAD, c % R_PAD
            a_rows = ((adapter * num_groups + expert).to(tl.int64) * max_rank + rank) * H  # [COLS]
            a_base = tl.where(is_gate == 1, gate_a_ptr + a_rows, up_a_ptr + a_rows)
            ok = rank < max_rank
            acc = tl.zeros((COLS,), dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < H
                xv = tl.load(x_ptr + token * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
                a = tl.load(a_base[:, None] + k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
                acc += tl.sum(a.to(tl.float32) * xv[None, :], axis=1)
            out = s13_ptr + slot.to(tl.int64) * (2 * L_PAD * R_PAD) + is_gate * (L_PAD * R_PAD) + adapter * R_PAD + rank
            tl.store(out, to_output(acc, s13_ptr.dtype.element_ty))
            if part == 0:
                r = tl.arange(0, R_PAD)
                tl.store(s2_ptr + slot.to(tl.int64) * (L_PAD * R_PAD) + adapter * R_PAD + r,
                         tl.zeros((R_PAD,), dtype=tl.float32))


@triton.jit
def _stacked_b(b_ptr, expert, cols, col_ok, D_out, num_local_experts, num_loras, max_rank, tile_has_lora,
               L_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """The stacked B^T tile [L_PAD*R_PAD, BLOCK_N] of this expert (zeros where ``tile_has_lora`` is False, read
    nothing then); B banks ``[L, E_local, D_out, max_rank]``."""
    j = tl.arange(0, L_PAD * R_PAD)
    adapter, rank = (j // R_PAD).to(tl.int64), (j % R_PAD).to(tl.int64)
    b_offs = (adapter * num_local_experts + expert)[:, None] * D_out * max_rank + cols[None, :] * max_rank
    b_mask = ((adapter < num_loras) & (rank < max_rank))[:, None] & col_ok[None, :]
    b_mask = tl.where(tile_has_lora, b_mask, False)  # (a scalar & a block mask breaks the interpreter)
    return tl.load(b_ptr + b_offs + rank[:, None], mask=b_mask, other=0.0)


@triton.jit
def _stacked_s(s_ptr, rows, row_width, tile_has_lora, L_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """The tile's stacked rank vectors [BLOCK_M, L_PAD*R_PAD] at ``s_ptr`` (rows ``row_width`` apart; zeros where
    ``tile_has_lora`` is False, read nothing then)."""
    j = tl.arange(0, L_PAD * R_PAD)
    ptrs = s_ptr + rows.to(tl.int64)[:, None] * row_width + j[None, :]
    every = (rows >= 0)[:, None] & (j >= 0)[None, :]
    return tl.load(ptrs, mask=tl.where(tile_has_lora, every, False), other=0.0)


@triton.jit
def _lora_expand(s, b, acc, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + s @ b (the stacked rank vectors times the stacked B^T)."""
    if DOT_F32:
        s, b = s.to(tl.float32), b.to(tl.float32)
    return tl.dot(s, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def _gemm1_swiglu_kernel(
    x_ptr, w13_ptr, delta_ptr, act_ptr, row_to_slot_ptr, block_group_ptr,
    num_live_blocks, num_rows, H, I, top_k,
    stride_x_t, stride_w_e, stride_w_n, stride_d_slot, stride_act_r,
    # fused LoRA (LORA): stacked W13 rank vectors [R, 2, L_PAD*R_PAD], tile flags, the bank's B_up and B_gate;
    # LORA_DECODE: s13 by slot, the adapter ids, the bank's A_down and s2 by slot [T*K, L_PAD*R_PAD] (fp32, added to)
    s13_ptr, tile_flags_ptr, up_b_ptr, gate_b_ptr, num_local_experts, num_loras, max_rank,
    lora_ids_ptr, down_a_ptr, s2_ptr,
    HAS_DELTA: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, DEAD_FILL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    LORA: tl.constexpr = False, L_PAD: tl.constexpr = 1, R_PAD: tl.constexpr = 16, LORA_DECODE: tl.constexpr = False,
    USE_GDC: tl.constexpr = False,
):
    wait_for_previous_kernel(USE_GDC)
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
    if LORA:  # read the LoRA operands now: the K loop hides their latency (an epilogue load would not be hidden)
        if LORA_DECODE:  # rank vectors by slot, in the block of each row's own adapter
            _, has_lora, own = _own_adapter_blocks(lora_ids_ptr, tokens, row_ok, num_loras, L_PAD, R_PAD)
            j = tl.arange(0, L_PAD * R_PAD)
            s_ptrs = s13_ptr + tl.where(row_ok, slots, 0).to(tl.int64)[:, None] * (2 * L_PAD * R_PAD) + j[None, :]
            s_up = tl.load(s_ptrs, mask=own, other=0.0)
            s_gate = tl.load(s_ptrs + L_PAD * R_PAD, mask=own, other=0.0)
            a_cols, a_ok, _ = _stacked_a(expert, num_local_experts, num_loras, max_rank, I, L_PAD, R_PAD)
            a2_mask = tl.where(has_lora, col_ok[:, None] & a_ok[None, :], False)
            a2 = tl.load(down_a_ptr + a_cols[None, :] + cols[:, None], mask=a2_mask, other=0.0)  # [BLOCK_N, cols]
        else:
            has_lora = tl.load(tile_flags_ptr + pid_m) != 0
            s_up = _stacked_s(s13_ptr, rows, 2 * L_PAD * R_PAD, has_lora, L_PAD, R_PAD)
            s_gate = _stacked_s(s13_ptr + L_PAD * R_PAD, rows, 2 * L_PAD * R_PAD, has_lora, L_PAD, R_PAD)
        bank = (expert, cols, col_ok, I, num_local_experts, num_loras, max_rank, has_lora)
        b_up = _stacked_b(up_b_ptr, *bank, L_PAD, R_PAD)
        b_gate = _stacked_b(gate_b_ptr, *bank, L_PAD, R_PAD)
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
        if has_lora:  # W13 LoRA, [up | gate] rank vectors, expanded before SwiGLU
            acc_up = _lora_expand(s_up, b_up, acc_up, DOT_F32, DOT_PRECISION)
            acc_gate = _lora_expand(s_gate, b_gate, acc_gate, DOT_F32, DOT_PRECISION)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    act = to_output(tl.where(row_ok[:, None], act, DEAD_FILL), act_ptr.dtype.element_ty)
    tl.store(out_ptrs, act, mask=out_mask)
    if LORA_DECODE:
        if has_lora:  # this column block's share of the W2 shrink, from the stored (rounded) activation
            part = _lora_expand(act, a2, tl.zeros((BLOCK_M, L_PAD * R_PAD), dtype=tl.float32), DOT_F32, DOT_PRECISION)
            s2_ptrs = s2_ptr + tl.where(row_ok, slots, 0).to(tl.int64)[:, None] * (L_PAD * R_PAD) + j[None, :]
            tl.atomic_add(s2_ptrs, part, mask=own, sem="relaxed")


@triton.jit
def _gemm2_kernel(
    act_ptr, w2_ptr, out_ptr, block_group_ptr,
    num_live_blocks, num_rows, H, I,
    stride_act_r, stride_w_e, stride_w_n, stride_out_r,
    # fused LoRA (LORA): stacked W2 rank vectors [R, L_PAD*R_PAD] (weighted), tile flags, the bank's B_down;
    # LORA_DECODE: s2 by slot [T*K, L_PAD*R_PAD] (fp32, unweighted; GEMM1's sums), the slots, adapter ids, weights
    s2_ptr, tile_flags_ptr, down_b_ptr, num_local_experts, num_loras, max_rank,
    row_to_slot_ptr, lora_ids_ptr, weights_ptr, top_k,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, DEAD_FILL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    LORA: tl.constexpr = False, L_PAD: tl.constexpr = 1, R_PAD: tl.constexpr = 16, LORA_DECODE: tl.constexpr = False,
    USE_GDC: tl.constexpr = False,
):
    wait_for_previous_kernel(USE_GDC)
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
    if LORA:  # read the LoRA operands now, as GEMM1 does
        if LORA_DECODE:  # GEMM1's W2 shrink of each row's own adapter block, by slot, weighted after the K loop
            slots = tl.load(row_to_slot_ptr + rows)
            row_ok = slots >= 0
            slots = tl.where(row_ok, slots, 0).to(tl.int64)
            adapters, has_lora, own = _own_adapter_blocks(lora_ids_ptr, slots // top_k, row_ok, num_loras, L_PAD,
                                                          R_PAD)
            j = tl.arange(0, L_PAD * R_PAD)
            s2_sum = tl.load(s2_ptr + slots[:, None] * (L_PAD * R_PAD) + j[None, :], mask=own, other=0.0)
            ratio = _caller_weight_ratio(weights_ptr, slots, adapters >= 0)
        else:
            has_lora = tl.load(tile_flags_ptr + pid_m) != 0
            s_down = _stacked_s(s2_ptr, rows, L_PAD * R_PAD, has_lora, L_PAD, R_PAD)
        b_down = _stacked_b(down_b_ptr, expert, cols, col_ok, H, num_local_experts, num_loras, max_rank, has_lora,
                            L_PAD, R_PAD)
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
        if LORA_DECODE:  # the W2 rank vectors: weighted, rounded to the input dtype
            s_down = to_output(s2_sum * ratio[:, None], act_ptr.dtype.element_ty)
        if has_lora:  # W2 LoRA: expand the (weighted) rank vectors
            acc = _lora_expand(s_down, b_down, acc, DOT_F32, DOT_PRECISION)
    tl.store(out_ptrs, to_output(acc, out_ptr.dtype.element_ty), mask=out_mask)
