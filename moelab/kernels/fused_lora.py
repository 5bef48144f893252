"""Fused LoRA: the adapters of a :class:`moelab.LoRABank` folded into the routed MoE's grouped GEMMs
(``moelab/kernels/moe_gemm.py``, the triton backend's path for :class:`moelab.LoRAExperts`), instead of going
through HBM as [T,K,2I] and [T,K,H] deltas. This file holds the shrink kernels, the device functions the GEMMs'
LoRA steps call, and one small object per mode that carries the GEMMs' LoRA operands.

A tile's rows may carry different adapters, so the bank is used *stacked*: column ``j = adapter * R_PAD + r`` of a
rank vector (and row j of the stacked B^T) belongs to rank ``r`` of adapter ``adapter``, and a row's rank vector is
zero outside its own adapter's block. One dot with the stacked B then expands every row with its own adapter.

Tiles (:class:`TileLoRA`, prefill; rank vectors by *permuted row*, R = rows the live tiles can reach):

    shrink_w13_tiles     s13[p] = [A_up x[t] | A_gate x[t]] of row p's adapter, stacked  [R, 2, L_PAD*R_PAD]
    gemm1 epilogue       acc_up += s13_up[p] B_up^T, acc_gate += s13_gate[p] B_gate^T, before SwiGLU
    shrink_w2_tiles      s2[p] = A_down act[p] * w[slot] / bf16(w[slot]), stacked        [R, L_PAD*R_PAD]
    gemm2 epilogue       acc += s2[p] B_down^T

The GEMMs read their tile's rank vectors and stacked B^T before the K loop, so the loop hides that latency (loaded
in the epilogue it cost +122/+161 µs at T=16384 on the H200), and run the small expand dots after it. The factor
``w / bf16(w)`` turns the bf16 routing weight the finalize applies into the caller's weight for the LoRA term, as
vLLM's flow weights its W2 delta. Rank vectors are accumulated in fp32 and rounded to the input dtype, like vLLM's.
The W13 shrink marks the tiles that hold any adapter (``tile_flags``); the other tiles skip every LoRA step, and a
row without an adapter adds exact zeros, so its output is bit for bit the base path's as long as the bank is finite
(0 * inf is NaN; ``LoRABank`` rejects non-finite values).

Decode (:class:`DecodeLoRA`, small batches; rank vectors by *slot*) needs no shrink launch of its own:

    decode_segments_w13_shrink  program 0 builds the segments; the others write s13 by slot, each for a few rank
                                columns of the slot's adapter, and zero the slot's s2 row     [T*K, 2, L_PAD*R_PAD]
    gemm1 epilogue              expands as above, then adds this column block's share of the W2 shrink,
                                A_down[:, cols] act[p, cols], to s2 by slot (fp32 atomics)     [T*K, L_PAD*R_PAD]
    gemm2                       reads s2 by slot, times w / bf16(w), rounds, expands as above

Both GEMMs find a tile's adapters from ``lora_ids`` themselves (no tile flags). The atomics make the fp32 order of
the W2 shrink's sum over column blocks vary from run to run (the LoRA term of a row may differ in its last bit);
rows without an adapter never touch them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton.language as tl

from moelab import _runtime
from moelab.kernels._common import dot_flags, jit, shrink_step, to_output, wait_for_previous_kernel
from moelab.kernels.segments import build_segments_triton, one_chunk_segments, plan_one_chunk
from moelab.permutation import Segments, cdiv, next_pow2

if TYPE_CHECKING:
    from moelab.lora import LoRABank

__all__ = ["TileLoRA", "DecodeLoRA", "AdapterLoopLoRA", "shrink_w13_tiles", "shrink_w2_tiles",
           "decode_segments_w13_shrink", "adapter_loop_decode_launch", "adapter_loop_shrink_w13",
           "adapter_loop_shrink_w2", "adapter_sorted_segments", "slot_w13_shrink_step", "slot_shrink_shape", "scratch"]


# ---------------------------------------------------------------------------------------------- device functions

@jit
def _row_adapters(lora_ids_ptr, tokens, row_ok, num_loras):
    """Adapter slot of each row, int32 [BLOCK_M]; -1 for no adapter, a dead row, or an id outside the bank."""
    adapter = tl.load(lora_ids_ptr + tokens, mask=row_ok, other=-1).to(tl.int32)
    return tl.where((adapter >= 0) & (adapter < num_loras), adapter, -1)


@jit
def own_adapter_blocks(lora_ids_ptr, tokens, row_ok, num_loras, L_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """Each row's adapter (:func:`_row_adapters`), whether the tile holds any, and the mask of each row's own block
    of stacked columns, bool [BLOCK_M, L_PAD*R_PAD] (all False in a tile without an adapter)."""
    adapters = _row_adapters(lora_ids_ptr, tokens, row_ok, num_loras)
    has_lora = tl.max(adapters, axis=0) >= 0
    j = tl.arange(0, L_PAD * R_PAD)
    return adapters, has_lora, tl.where(has_lora, (j // R_PAD)[None, :] == adapters[:, None], False)


@jit
def stacked_a(expert, num_local_experts, num_loras, max_rank, D, L_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """Stacked A^T of this expert, bank ``A [L, E_local, max_rank, D]``: the offset of column j's row and whether
    it exists (int64 [L_PAD*R_PAD], bool), plus the adapter of each column."""
    j = tl.arange(0, L_PAD * R_PAD)
    adapter, rank = (j // R_PAD).to(tl.int64), (j % R_PAD).to(tl.int64)
    a_cols = (adapter * num_local_experts + expert) * max_rank * D + rank * D
    return a_cols, (adapter < num_loras) & (rank < max_rank), adapter


@jit
def caller_weight_ratio(weights_ptr, slots, has):
    """``w[slot] / bf16(w[slot])`` per row (0 where ``has`` is False or the bf16 weight is 0), fp32 [BLOCK_M].
    bf16(w) is rounded to nearest even, as the packing and the finalize's ``ROUND_WEIGHTS`` round it."""
    w = tl.load(weights_ptr + slots, mask=has, other=0.0).to(tl.float32)
    w_bf16 = to_output(w, tl.bfloat16).to(tl.float32)
    return tl.where(w_bf16 != 0.0, w / tl.where(w_bf16 != 0.0, w_bf16, 1.0), 0.0)


@jit
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
        a_cols, a_ok, adapter = stacked_a(expert, num_local_experts, num_loras, max_rank, D, L_PAD, R_PAD)
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
            acc0 = acc0 * caller_weight_ratio(weights_ptr, slots, adapters >= 0)[:, None]
        j = tl.arange(0, L_PAD * R_PAD)
        out = out_ptr + rows.to(tl.int64)[:, None] * (NUM_SLICES * L_PAD * R_PAD) + j[None, :]
        tl.store(out, to_output(tl.where(own, acc0, 0.0), out_ptr.dtype.element_ty))
        if NUM_SLICES == 2:
            tl.store(out + L_PAD * R_PAD, to_output(tl.where(own, acc1, 0.0), out_ptr.dtype.element_ty))


@jit
def _decode_segments_w13_shrink_kernel(
    values_ptr, scratch_ptr, slot_to_row_ptr, row_to_slot_ptr, block_group_ptr,
    num_slots, offset, num_groups, num_rows, num_blocks,
    x_ptr, up_a_ptr, gate_a_ptr, s13_ptr, s2_ptr, lora_ids_ptr, H, top_k, num_loras, max_rank, stride_x,
    TILE: tl.constexpr, CHUNK: tl.constexpr, G_BINS: tl.constexpr, PACKED: tl.constexpr, CB: tl.constexpr,
    L_PAD: tl.constexpr, R_PAD: tl.constexpr, COLS: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr = False, ranks_ptr=None, OWN: tl.constexpr = False,
):
    """Decode (one chunk of slots): program 0 builds the segments (:func:`one_chunk_segments`, ids unpacked), every
    other program shrinks one slot for COLS of its adapter's 2*R_PAD [up | gate] rank columns, in the same launch.

    s13 [slots, 2, L_PAD*R_PAD] (input dtype, fp32 accumulation) is written by *slot* and only in the block of the
    slot's adapter (GEMM1 reads nothing else); the slot's first program zeroes that block of s2 [slots,
    L_PAD*R_PAD] (fp32) for GEMM1's atomics. Slots without an adapter or a local expert write nothing. BLOCK_K >= H
    reads x and the A rows in one step (a loop of dependent loads costs ~1 µs a step at decode).

    OWN (the adapter loop): s13 is [slots, 2, R_PAD] and s2 [slots, R_PAD], the slot's own adapter only (L_PAD
    unused), and ranks past the adapter's own rank (``ranks_ptr``) are zeros, not read.
    """
    wait_for_previous_kernel(USE_GDC)
    pid = tl.program_id(0)
    if pid == 0:
        one_chunk_segments(values_ptr, scratch_ptr, slot_to_row_ptr, row_to_slot_ptr, block_group_ptr, num_slots,
                           offset, num_groups, num_rows, num_blocks, TILE, CHUNK, G_BINS, PACKED, CB)
    else:
        slot_w13_shrink_step(pid - 1, values_ptr, offset, num_groups, x_ptr, up_a_ptr, gate_a_ptr, s13_ptr, s2_ptr,
                             lora_ids_ptr, H, top_k, num_loras, max_rank, stride_x, L_PAD, R_PAD, COLS, BLOCK_K,
                             ranks_ptr, OWN)


@jit
def slot_w13_shrink_step(pid, ids_ptr, offset, num_groups, x_ptr, up_a_ptr, gate_a_ptr, s13_ptr, s2_ptr,
                         lora_ids_ptr, H, top_k, num_loras, max_rank, stride_x, L_PAD: tl.constexpr,
                         R_PAD: tl.constexpr, COLS: tl.constexpr, BLOCK_K: tl.constexpr, ranks_ptr,
                         OWN: tl.constexpr):
    """Shrink program ``pid`` of the W13 shrink by slot (:func:`_decode_segments_w13_shrink_kernel` explains the
    layouts): slot ``pid // (2 * R_PAD // COLS)``, COLS of its 2*R_PAD [up | gate] rank columns; ``ids_ptr`` the
    global expert ids [T*K] (int), ``num_groups`` the local experts from ``offset`` on."""
    slot = pid // (2 * R_PAD // COLS)
    part = pid % (2 * R_PAD // COLS)
    c = part * COLS + tl.arange(0, COLS)  # [up ranks | gate ranks] of the adapter
    expert = tl.load(ids_ptr + slot).to(tl.int32) - offset
    token = (slot // top_k).to(tl.int64)
    adapter = tl.load(lora_ids_ptr + token).to(tl.int32)
    if (expert >= 0) & (expert < num_groups) & (adapter >= 0) & (adapter < num_loras):
        is_gate, rank = c // R_PAD, c % R_PAD
        a_rows = ((adapter * num_groups + expert).to(tl.int64) * max_rank + rank) * H  # [COLS]
        a_base = tl.where(is_gate == 1, gate_a_ptr + a_rows, up_a_ptr + a_rows)
        if OWN:
            ok = rank < tl.minimum(tl.load(ranks_ptr + adapter), max_rank)
        else:
            ok = rank < max_rank
        acc = tl.zeros((COLS,), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < H
            xv = tl.load(x_ptr + token * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(a_base[:, None] + k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * xv[None, :], axis=1)
        if OWN:  # the slot's own rank vector, every one of its R_PAD columns written
            out = s13_ptr + slot.to(tl.int64) * (2 * R_PAD) + is_gate * R_PAD + rank
            s2_row = s2_ptr + slot.to(tl.int64) * R_PAD
        else:
            out = s13_ptr + slot.to(tl.int64) * (2 * L_PAD * R_PAD) + is_gate * (L_PAD * R_PAD) + adapter * R_PAD \
                + rank
            s2_row = s2_ptr + slot.to(tl.int64) * (L_PAD * R_PAD) + adapter * R_PAD
        tl.store(out, to_output(acc, s13_ptr.dtype.element_ty))
        if part == 0:
            tl.store(s2_row + tl.arange(0, R_PAD), tl.zeros((R_PAD,), dtype=tl.float32))


@jit
def stacked_b(b_ptr, expert, cols, col_ok, D_out, num_local_experts, num_loras, max_rank, tile_has_lora,
               L_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """The stacked B^T tile [L_PAD*R_PAD, BLOCK_N] of this expert (zeros where ``tile_has_lora`` is False, read
    nothing then); B banks ``[L, E_local, D_out, max_rank]``."""
    j = tl.arange(0, L_PAD * R_PAD)
    adapter, rank = (j // R_PAD).to(tl.int64), (j % R_PAD).to(tl.int64)
    b_offs = (adapter * num_local_experts + expert)[:, None] * D_out * max_rank + cols[None, :] * max_rank
    b_mask = ((adapter < num_loras) & (rank < max_rank))[:, None] & col_ok[None, :]
    b_mask = tl.where(tile_has_lora, b_mask, False)  # (a scalar & a block mask breaks the interpreter)
    return tl.load(b_ptr + b_offs + rank[:, None], mask=b_mask, other=0.0)


@jit
def stacked_s(s_ptr, rows, row_width, tile_has_lora, L_PAD: tl.constexpr, R_PAD: tl.constexpr):
    """The tile's stacked rank vectors [BLOCK_M, L_PAD*R_PAD] at ``s_ptr`` (rows ``row_width`` apart; zeros where
    ``tile_has_lora`` is False, read nothing then)."""
    j = tl.arange(0, L_PAD * R_PAD)
    ptrs = s_ptr + rows.to(tl.int64)[:, None] * row_width + j[None, :]
    every = (rows >= 0)[:, None] & (j >= 0)[None, :]
    return tl.load(ptrs, mask=tl.where(tile_has_lora, every, False), other=0.0)


@jit
def lora_expand(s, b, acc, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + s @ b (the stacked rank vectors times the stacked B^T)."""
    if DOT_F32:
        s, b = s.to(tl.float32), b.to(tl.float32)
    return tl.dot(s, b, acc, input_precision=DOT_PRECISION)


# ---------------------------------------------------------------------------------------------- the adapter loop
#
# Banks wider than the stacked layout takes (8 or 32 adapters of ranks 8..64: 512 or 2048 stacked columns) need a
# layout whose cost does not grow with L: each routed row needs only ITS adapter's A and B. Bytes and FLOPs at
# Qwen3-30B-A3B (E128 K8 H2048 I768; an (adapter, expert) pair holds r * 3(H+I) * 2 B = r * 16.9 KB of A and B,
# 1.08 MB at r=64, against 9.4 MB of base weights an expert), for 8 / 32 mixed adapters (mean rank 30):
#   T=1      8 slots, one row a tile: 8 pairs, 8.6 MB at r=64 (0.7 % of the base's 75 MB). Latency-bound: what
#            costs is dependent loads and launches, so the row's adapter's operands are read before the K loop.
#   T=32     256 slots, ~2.3 rows per touched expert: ~250 pairs; reading each at the padded rank 64 is 250 MB
#            (24 % of the base's 1.04 GB, the whole 1.25x budget), at its own rank ~120 MB (12 %): every read
#            stops at the adapter's own rank (``LoRABank.rank_table``).
#   T=1024   8192 slots, 64 rows per expert (one 64-row tile): all 1024 / ~3500 pairs, 0.52 / 1.8 GB at their own
#            ranks against the base's 1.21 GB. Bandwidth-bound on the bank itself: the 32-adapter bank cannot reach
#            1.25x of the base here whatever the layout (its bytes alone are 1.5x the base's).
#   T=16384  131072 slots, 1024 rows per expert: compute-bound. The exact LoRA FLOPs are r(1/I + 1/H) = 5 % of the
#            base's at r=30; what a layout wastes on top is what counts.
# (a) stacked columns (the mode above): every row dots all L*R_PAD columns: +25 % / +100 % of GEMM1's FLOPs at
#     16384 for 8 / 32 adapters, and the operands outgrow shared memory past 64 columns. Out.
# (c) tiles per (expert, adapter) segment: exact FLOPs, but each segment re-streams the expert's weights and pads
#     to a tile: at T=32 ~2 rows per expert split into ~2 segments doubles the weight bytes (the 1.04 GB), at
#     16384 with 32 adapters 32-row segments in 128-row tiles quadruple the GEMM FLOPs. Out.
# (b)+(a) what runs here: the shrinks write each row's OWN rank vector ([rows, R_PAD], its adapter's A only), the
#     GEMM tiles stay one per expert (weights streamed once, as the base path) and expand by looping over the
#     adapters present in the tile: a scalar test per adapter between the tile's lowest and highest, only present
#     adapters' B read, up to their own rank, in RANK_CHUNK steps; the tile's lowest adapter's operands are read
#     before the K loop (at decode that is the only one). The expand dot of one adapter runs over the whole tile
#     (rows of other adapters masked to zero), so its FLOPs grow with the adapters per tile: at T >= 1024 the
#     rows inside each expert's segment are sorted by adapter first (a stable counting sort of the tokens by adapter
#     before the segments are built: ~5 launches), so a 128-row tile at 16384 holds ~2 (8 adapters) or ~5 (32)
#     adapters, not 8 or 32: +3-8 % of the GEMM FLOPs. The tile shrinks run on sub-tiles of those sorted rows
#     (16-64 rows: about the rows of one (adapter, expert) pair), where one adapter's dot wastes little.
# Measured (H200, commit d629e95, BENCHMARKS.md "Wide LoRA banks"; x the base MoE, CUDA graph, 16384 eager), for
# 8 / 32 mixed adapters: T=1 1.13 / 1.13 (the flow: 2.06 / 2.07), T=32 1.40 / 1.46 (flow 1.34 / 1.35), T=1024
# 2.66 / 6.0 (flow 2.41 / 4.21), T=16384 1.51 / 2.10 (flow 1.52 / 1.75). The bytes above hold at T=1 only: from
# T=32 on tiles hold several adapters and every one past the first makes the epilogue wait on its loads (a GEMM1
# or GEMM2 CTA of the decode tiles runs alone on its SM, so nothing hides the wait), and at T >= 1024 the tile
# shrinks run one K loop per adapter of each sub-tile. So the module's own choice takes the loop for a wide bank at
# small batches only (``moelab.backends.triton_backend.ADAPTER_LOOP_MAX_ROWS_PER_EXPERT``). Next: read the operands
# of the tile's first two adapters before the K loop (T=32: ~2 adapters a tile), and profile the T >= 1024 shrinks.
# Inside the Gluon GEMMs (``gluon_gemm.py``, sm_90, 128-row tiles; since 2026-12-06) the epilogue waits no more: a
# tile's adapters sit side by side in a few more K steps through the GEMMs' rings, 8 ranks a unit (each row's rank
# vector where its adapter's units fall, zeros elsewhere, and each column's B from its adapter, copied by the load
# partition while the tensor cores run the previous steps; the tile's packing written by the W13 shrink and read at
# the tile's start), so the module takes it from ``triton_backend.GLUON_ADAPTER_LOOP_MIN_ROWS_PER_PAIR`` rows
# per (expert, slot) on. What it costs there (H100, 8 adapters at Qwen3 T = 16384: ~2830-2850 µs on a ~2130-2160 µs
# base, 9013e62): the shrinks (~430 µs; at T = 4096 the W13 one read 1.27x its inputs' bytes), GEMM2's K steps
# (+~100) and GEMM1's (+~110).


@jit
def tile_adapters(lora_ids_ptr, tokens, row_ok, num_loras, ranks_ptr, max_rank):
    """The adapter loop's view of a tile: each row's adapter (:func:`_row_adapters`) and its rank (0 without one),
    the lowest and the highest adapter present (``num_loras`` and -1 when none) and the lowest one's rank. The
    ranks are read once here, before the K loop: the epilogue's loop over adapters then waits on no rank load."""
    adapters = _row_adapters(lora_ids_ptr, tokens, row_ok, num_loras)
    row_ranks = tl.load(ranks_ptr + tl.where(adapters >= 0, adapters, 0), mask=adapters >= 0, other=0)
    row_ranks = tl.minimum(row_ranks, max_rank)
    lo = tl.min(tl.where(adapters >= 0, adapters, num_loras), axis=0)
    hi = tl.max(adapters, axis=0)
    return adapters, row_ranks, lo, hi, tl.max(tl.where(adapters == lo, row_ranks, 0), axis=0)


@jit
def own_s(s_ptr, s_rows, row_width, mine, rank, R: tl.constexpr):
    """Rank vectors [BLOCK_M, R] of the rows ``mine`` (others zero, not read), columns past ``rank`` zero; row p
    at ``s_ptr + s_rows[p] * row_width``."""
    r = tl.arange(0, R)
    ptrs = s_ptr + s_rows[:, None] * row_width + r[None, :]
    return tl.load(ptrs, mask=mine[:, None] & (r < rank)[None, :], other=0.0)


@jit
def own_b(b_ptr, adapter, rank, expert, cols, col_ok, D_out, num_local_experts, max_rank, R: tl.constexpr):
    """One adapter's B^T [R, BLOCK_N] at output columns ``cols`` of a bank B [L, E_local, D_out, max_rank]; ranks
    past ``rank`` zero (not read). Offset ``b_ptr`` by c for ranks c.. ."""
    r = tl.arange(0, R)
    base = (adapter * num_local_experts + expert).to(tl.int64) * D_out * max_rank
    mask = (r < rank)[:, None] & col_ok[None, :]
    return tl.load(b_ptr + base + cols[None, :].to(tl.int64) * max_rank + r[:, None], mask=mask, other=0.0)


@jit
def own_a_t(a_ptr, adapter, rank, expert, cols, col_ok, D_in, num_local_experts, max_rank, R: tl.constexpr):
    """One adapter's A^T [BLOCK_N, R] at input columns ``cols`` of a bank A [L, E_local, max_rank, D_in]; ranks
    past ``rank`` zero (not read). Offset ``a_ptr`` by c * D_in for ranks c.. ."""
    r = tl.arange(0, R)
    base = (adapter * num_local_experts + expert).to(tl.int64) * max_rank * D_in
    mask = col_ok[:, None] & (r < rank)[None, :]
    return tl.load(a_ptr + base + r[None, :].to(tl.int64) * D_in + cols[:, None], mask=mask, other=0.0)


@jit
def lora_dot(s, b, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """s @ b in fp32."""
    if DOT_F32:
        s, b = s.to(tl.float32), b.to(tl.float32)
    return tl.dot(s, b, input_precision=DOT_PRECISION)


@jit
def expand_other_adapters(acc, adapters, row_ranks, lo, hi, s_ptr, s_rows, row_width, b_ptr, expert, cols, col_ok,
                          D_out, num_local_experts, max_rank, ratio, S_DTYPE: tl.constexpr, SCALED: tl.constexpr,
                          RANK_CHUNK: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + the expand of every adapter above the tile's lowest (``lo``, expanded from operands read before the
    K loop) up to ``hi``: a scalar test per adapter (its rank among the rows, 0: absent), then its rows' rank
    vectors times its B^T, RANK_CHUNK ranks a step up to its own rank. SCALED: the rank vectors are fp32 sums,
    times ``ratio`` per row, rounded to S_DTYPE (the decode W2 term)."""
    for a in range(lo + 1, hi + 1):
        mine = adapters == a
        rank = tl.max(tl.where(mine, row_ranks, 0), axis=0)
        if rank > 0:
            for c in range(0, rank, RANK_CHUNK):
                s = own_s(s_ptr + c, s_rows, row_width, mine, rank - c, RANK_CHUNK)
                if SCALED:
                    s = to_output(s * ratio[:, None], S_DTYPE)
                b = own_b(b_ptr + c, a, rank - c, expert, cols, col_ok, D_out, num_local_experts, max_rank, RANK_CHUNK)
                acc = lora_expand(s, b, acc, DOT_F32, DOT_PRECISION)
    return acc


@jit
def expand_other_adapters_w13(acc_up, acc_gate, adapters, row_ranks, lo, hi, s13_ptr, s_rows, up_b_ptr, gate_b_ptr,
                              expert, cols, col_ok, I, num_local_experts, max_rank, R_PAD: tl.constexpr,
                              RANK_CHUNK: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """:func:`expand_other_adapters` for GEMM1's up and gate together (one pass, one wait a step): s13 rows
    [up | gate] of 2 * R_PAD."""
    for a in range(lo + 1, hi + 1):
        mine = adapters == a
        rank = tl.max(tl.where(mine, row_ranks, 0), axis=0)
        if rank > 0:
            for c in range(0, rank, RANK_CHUNK):
                s_up = own_s(s13_ptr + c, s_rows, 2 * R_PAD, mine, rank - c, RANK_CHUNK)
                s_gate = own_s(s13_ptr + R_PAD + c, s_rows, 2 * R_PAD, mine, rank - c, RANK_CHUNK)
                b_up = own_b(up_b_ptr + c, a, rank - c, expert, cols, col_ok, I, num_local_experts, max_rank,
                             RANK_CHUNK)
                b_gate = own_b(gate_b_ptr + c, a, rank - c, expert, cols, col_ok, I, num_local_experts, max_rank,
                               RANK_CHUNK)
                acc_up = lora_expand(s_up, b_up, acc_up, DOT_F32, DOT_PRECISION)
                acc_gate = lora_expand(s_gate, b_gate, acc_gate, DOT_F32, DOT_PRECISION)
    return acc_up, acc_gate


@jit
def w2_shrink_share(act, a2_lo, adapters, row_ranks, lo, hi, rank_lo, down_a_ptr, s2_ptr, s_rows, expert, cols,
                    col_ok, I, num_local_experts, max_rank, R_PAD: tl.constexpr, RANK_CHUNK: tl.constexpr,
                    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Decode, GEMM1's epilogue: this column block's share of every row's W2 shrink, ``A_down[:, cols] act[p,
    cols]`` of its own adapter, added to ``s2`` [slots, R_PAD] (fp32 atomics): the lowest adapter's from
    ``a2_lo`` (read before the K loop), the others' RANK_CHUNK ranks a step."""
    r = tl.arange(0, R_PAD)
    part = lora_dot(act, a2_lo, DOT_F32, DOT_PRECISION)
    tl.atomic_add(s2_ptr + s_rows[:, None] * R_PAD + r[None, :], part,
                  mask=(adapters == lo)[:, None] & (r < rank_lo)[None, :], sem="relaxed")
    rc = tl.arange(0, RANK_CHUNK)
    for a in range(lo + 1, hi + 1):
        mine = adapters == a
        rank = tl.max(tl.where(mine, row_ranks, 0), axis=0)
        if rank > 0:
            for c in range(0, rank, RANK_CHUNK):
                a2 = own_a_t(down_a_ptr + c * I, a, rank - c, expert, cols, col_ok, I, num_local_experts, max_rank,
                             RANK_CHUNK)
                chunk = lora_dot(act, a2, DOT_F32, DOT_PRECISION)
                tl.atomic_add(s2_ptr + s_rows[:, None] * R_PAD + c + rc[None, :], chunk,
                              mask=mine[:, None] & (c + rc < rank)[None, :], sem="relaxed")


@jit
def _write_tile_packing(tile, row_to_slot_ptr, lora_ids_ptr, ranks_ptr, top_k, num_loras, max_rank, row_first_ptr,
                        row_ranks_ptr, tile_units_ptr, unit_map_ptr, units_max, TILE: tl.constexpr,
                        ADAPTER_UNITS: tl.constexpr):
    """How the Gluon GEMMs pack tile ``tile``'s adapters side by side in their LoRA K steps, in adapter order, each
    ceil(rank / 8) units of 8 ranks: each row's rank (0 without an adapter) and its adapter's first unit (0 without
    one) into int32 ``row_ranks`` and ``row_first`` [rows], the tile's units in all into ``tile_units`` [tiles], and
    each unit's ``adapter << 16 | its adapter's first unit`` into ``unit_map`` [tiles, units_max] (units past the
    tile's not written). One reduction an adapter here, once a tile, so the GEMMs' partitions run none."""
    rows = tile * TILE + tl.arange(0, TILE)
    slots = tl.load(row_to_slot_ptr + rows)
    row_ok = slots >= 0
    adapters, row_ranks, lo, hi, _ = tile_adapters(lora_ids_ptr, tl.where(row_ok, slots, 0) // top_k, row_ok,
                                                   num_loras, ranks_ptr, max_rank)
    first_unit = tl.zeros([TILE], dtype=tl.int32)
    units = 0
    u = tl.arange(0, ADAPTER_UNITS)
    for a in range(lo, hi + 1):
        mine = adapters == a
        n = tl.cdiv(tl.max(tl.where(mine, row_ranks, 0), axis=0), 8)
        first_unit = tl.where(mine, units, first_unit)
        tl.store(unit_map_ptr + tile.to(tl.int64) * units_max + units + u, (a << 16) | units, mask=u < n)
        units += n
    tl.store(row_first_ptr + rows, first_unit)
    tl.store(row_ranks_ptr + rows, row_ranks)
    tl.store(tile_units_ptr + tile, units)


@jit
def _shrink_adapter_rows(in_ptr, a0_ptr, a1_ptr, out_ptr, rows, in_rows, mine, ratio, a, rank, expert,
                         num_local_experts, max_rank, D, stride_in, NUM_SLICES: tl.constexpr, WEIGHTED: tl.constexpr,
                         DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, R_PAD: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """One adapter's part of a tile shrink: the rank vectors ``A_a @ in[row]`` of the rows ``mine`` (input rows
    ``in_rows``; times ``ratio`` when WEIGHTED) into their rows of ``out`` [rows, NUM_SLICES, R_PAD], all R_PAD
    columns (zeros past ``rank``), fp32 accumulation over a K loop of D."""
    ks = tl.arange(0, BLOCK_K)
    r = tl.arange(0, R_PAD)
    a_offs = ((a * num_local_experts + expert).to(tl.int64) * max_rank + r[None, :]) * D + ks[:, None]
    a_ok = r < rank
    acc0 = tl.zeros((rows.shape[0], R_PAD), dtype=tl.float32)
    acc1 = tl.zeros((rows.shape[0], R_PAD), dtype=tl.float32)
    in_ptrs = in_ptr + in_rows[:, None] * stride_in + ks[None, :]
    for k0 in range(0, tl.cdiv(D, BLOCK_K)):
        k_ok = ks + k0 * BLOCK_K < D
        xt = tl.load(in_ptrs, mask=mine[:, None] & k_ok[None, :], other=0.0)
        acc0, acc1 = shrink_step(xt, a0_ptr, a1_ptr, a_offs, k_ok[:, None] & a_ok[None, :], acc0, acc1,
                                 NUM_SLICES, DOT_F32, DOT_PRECISION)
        in_ptrs += BLOCK_K
        a_offs += BLOCK_K
    if WEIGHTED:
        acc0 = acc0 * ratio[:, None]
    out = out_ptr + rows.to(tl.int64)[:, None] * (NUM_SLICES * R_PAD) + r[None, :]
    every = mine[:, None] & (r >= 0)[None, :]
    tl.store(out, to_output(acc0, out_ptr.dtype.element_ty), mask=every)
    if NUM_SLICES == 2:
        tl.store(out + R_PAD, to_output(acc1, out_ptr.dtype.element_ty), mask=every)


@jit
def _own_shrink_kernel(
    in_ptr, a0_ptr, a1_ptr, out_ptr, row_to_slot_ptr, block_group_ptr, lora_ids_ptr, weights_ptr, ranks_ptr,
    row_first_ptr, row_ranks_ptr, tile_units_ptr, unit_map_ptr, units_max, D, top_k, num_local_experts, num_loras,
    max_rank, stride_in,
    GATHER: tl.constexpr, NUM_SLICES: tl.constexpr, WEIGHTED: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    R_PAD: tl.constexpr, SUB_M: tl.constexpr, TILE: tl.constexpr, BLOCK_K: tl.constexpr,
    PAIRS: tl.constexpr = False, PAIR_M: tl.constexpr = 16,
    WRITE_PACKING: tl.constexpr = False, ADAPTER_UNITS: tl.constexpr = 16, USE_GDC: tl.constexpr = False,
):
    """The adapter loop's tile shrink, one program per SUB_M rows of the GEMMs' permuted rows (a sub-tile of their
    TILE): each row's own rank vector ``A_j @ in[row]`` of its adapter, [rows, NUM_SLICES, R_PAD] in the input
    dtype (fp32 accumulation), all R_PAD columns written (zeros past the adapter's rank) for rows with an adapter,
    nothing for the others (the GEMMs never read them). A K loop per adapter, each reading only its rows:
    - PAIRS (each expert's rows sorted by adapter, so an (adapter, expert) pair's rows are one run): the program
      takes the pairs whose first row is in its sub-tile, whole, PAIR_M rows at a time from that first row, so each
      pair's A is read once where its run fits PAIR_M rows (a pair that starts in another sub-tile is skipped; a
      run whose last row is the pair's goes on to one more run of no rows, as the next row is not read first);
    - else the adapters present in its sub-tile, over the sub-tile's rows.
    GATHER, WEIGHTED: as :func:`_lora_shrink_kernel`. WRITE_PACKING: the first program of each tile also writes
    the tile's packing for the Gluon GEMMs (:func:`_write_tile_packing`; ADAPTER_UNITS: the most units of one
    adapter, a power of two)."""
    wait_for_previous_kernel(USE_GDC)
    pid = tl.program_id(0)
    expert = tl.load(block_group_ptr + pid // (TILE // SUB_M))
    if expert < 0:
        return
    if WRITE_PACKING:
        if pid % (TILE // SUB_M) == 0:
            _write_tile_packing(pid // (TILE // SUB_M), row_to_slot_ptr, lora_ids_ptr, ranks_ptr, top_k, num_loras,
                                max_rank, row_first_ptr, row_ranks_ptr, tile_units_ptr, unit_map_ptr, units_max,
                                TILE, ADAPTER_UNITS)
    rows = pid * SUB_M + tl.arange(0, SUB_M)
    slots = tl.load(row_to_slot_ptr + rows)
    row_ok = slots >= 0
    slots = tl.where(row_ok, slots, 0).to(tl.int64)
    adapters, row_ranks, lo, hi, _ = tile_adapters(lora_ids_ptr, slots // top_k, row_ok, num_loras, ranks_ptr,
                                                   max_rank)
    if PAIRS:
        # the row before the sub-tile: a pair that goes on from it belongs to the program before
        before = tl.maximum(pid * SUB_M - 1, 0)
        before_slot = tl.load(row_to_slot_ptr + before)
        before_ok = (pid > 0) & (before_slot >= 0) & (tl.load(block_group_ptr + before // TILE) == expert)
        before_adapter = tl.load(lora_ids_ptr + tl.where(before_ok, before_slot, 0) // top_k, mask=before_ok,
                                 other=-1).to(tl.int32)
        num_rows = tl.num_programs(0) * SUB_M
        p = tl.arange(0, PAIR_M)
        for i in range(0, hi - lo + 1):
            a = lo + i
            mine = adapters == a
            rank = tl.max(tl.where(mine, row_ranks, 0), axis=0)
            if (rank > 0) & (a != before_adapter):
                start = tl.min(tl.where(mine, rows, num_rows), axis=0)
                more = rank > 0
                while more:
                    pair_rows = start + p
                    pair_ok = pair_rows < num_rows
                    pair_slots = tl.load(row_to_slot_ptr + pair_rows, mask=pair_ok, other=-1)
                    pair_ok = (pair_slots >= 0) & (tl.load(block_group_ptr + pair_rows // TILE, mask=pair_ok,
                                                           other=-1) == expert)
                    pair_slots = tl.where(pair_ok, pair_slots, 0).to(tl.int64)
                    pair_mine = _row_adapters(lora_ids_ptr, pair_slots // top_k, pair_ok, num_loras) == a
                    ratio = caller_weight_ratio(weights_ptr, pair_slots, pair_mine) if WEIGHTED else 0.0
                    _shrink_adapter_rows(in_ptr, a0_ptr, a1_ptr, out_ptr, pair_rows,
                                         (pair_slots // top_k) if GATHER else pair_rows.to(tl.int64), pair_mine,
                                         ratio, a, rank, expert, num_local_experts, max_rank, D, stride_in,
                                         NUM_SLICES, WEIGHTED, DOT_F32, DOT_PRECISION, R_PAD, BLOCK_K)
                    more = tl.sum(tl.where(p == PAIR_M - 1, pair_mine, False).to(tl.int32), axis=0) > 0
                    start += PAIR_M
    else:
        in_rows = (slots // top_k) if GATHER else rows.to(tl.int64)
        ratio = caller_weight_ratio(weights_ptr, slots, adapters >= 0) if WEIGHTED else 0.0
        # an adapter cut by a sub-tile boundary is the last of one program's and the first of the next's: even
        # programs walk their adapters down and odd ones up, so both read its A at about the same time (the second
        # from L2)
        down = pid % 2 == 0
        for i in range(0, hi - lo + 1):
            a = tl.where(down, hi - i, lo + i)
            mine = adapters == a
            rank = tl.max(tl.where(mine, row_ranks, 0), axis=0)
            if rank > 0:
                _shrink_adapter_rows(in_ptr, a0_ptr, a1_ptr, out_ptr, rows, in_rows, mine, ratio, a, rank, expert,
                                     num_local_experts, max_rank, D, stride_in, NUM_SLICES, WEIGHTED, DOT_F32,
                                     DOT_PRECISION, R_PAD, BLOCK_K)


# ---------------------------------------------------------------------------------------------- launchers

def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fused-LoRA scratch buffer, NaN-poisoned in debug mode (``moelab.set_debug``) so that a read of a value no
    kernel wrote shows up in the output."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    return buf.fill_(float("nan")) if _runtime.DEBUG_DEAD_ROWS else buf


def _bank_sizes(bank: LoRABank, num_local_experts: int) -> dict:
    return dict(num_local_experts=num_local_experts, num_loras=bank.max_loras, max_rank=bank.max_rank)


@dataclass(frozen=True)
class _LoRAOperands:
    """What every fused mode's LoRA operands hold first: the bank, each token's slot, the routing weights, the GEMMs'
    segments, top-k and the local expert count (the mode classes below add their shrink buffers)."""

    bank: LoRABank
    lora_ids: torch.Tensor  # int [T], -1 = none
    expert_weights: torch.Tensor  # float [T, K], the caller's
    segments: Segments  # the GEMMs' rows
    top_k: int
    num_local_experts: int


@dataclass(frozen=True)
class TileLoRA(_LoRAOperands):
    """The GEMMs' LoRA operands in the tile mode (prefill): rank vectors by permuted row, written by
    :func:`shrink_w13_tiles` (``s13``) and :func:`shrink_w2_tiles` (``s2``), and the tiles holding an adapter."""

    s13_by_row: torch.Tensor  # [R, 2, L_PAD*R_PAD] input dtype, stacked [up | gate]
    s2_by_row: torch.Tensor  # [R, L_PAD*R_PAD] input dtype, weighted
    tile_flags: torch.Tensor  # int32 [live tiles]: the tile holds a row with an adapter
    shrink_meta: dict  # constexprs and launch options of both shrink launches

    def gemm1_args(self, unused: torch.Tensor) -> dict:
        bank = self.bank
        l_pad, r_pad = bank.stacked_pads
        return dict(s13_ptr=self.s13_by_row, tile_flags_ptr=self.tile_flags, up_b_ptr=bank.up_b,
                    gate_b_ptr=bank.gate_b, **_bank_sizes(bank, self.num_local_experts), lora_ids_ptr=unused,
                    down_a_ptr=unused, s2_ptr=unused, LORA=True, L_PAD=l_pad, R_PAD=r_pad)

    def gemm2_args(self, unused: torch.Tensor) -> dict:
        bank = self.bank
        l_pad, r_pad = bank.stacked_pads
        return dict(s2_ptr=self.s2_by_row, tile_flags_ptr=self.tile_flags, down_b_ptr=bank.down_b,
                    **_bank_sizes(bank, self.num_local_experts), row_to_slot_ptr=unused, lora_ids_ptr=unused,
                    weights_ptr=unused, top_k=0, LORA=True, L_PAD=l_pad, R_PAD=r_pad)


@dataclass(frozen=True)
class DecodeLoRA(_LoRAOperands):
    """The GEMMs' LoRA operands in the decode mode: rank vectors by slot, s13 written by
    :func:`decode_segments_w13_shrink`, s2 summed by GEMM1's epilogue (fp32 atomics) and read by GEMM2."""

    s13_by_slot: torch.Tensor  # [T*K, 2, L_PAD*R_PAD] input dtype, stacked [up | gate]
    s2_by_slot: torch.Tensor  # [T*K, L_PAD*R_PAD] fp32, unweighted

    def gemm1_args(self, unused: torch.Tensor) -> dict:
        bank = self.bank
        l_pad, r_pad = bank.stacked_pads
        return dict(s13_ptr=self.s13_by_slot, tile_flags_ptr=unused, up_b_ptr=bank.up_b, gate_b_ptr=bank.gate_b,
                    **_bank_sizes(bank, self.num_local_experts), lora_ids_ptr=self.lora_ids, down_a_ptr=bank.down_a,
                    s2_ptr=self.s2_by_slot, LORA=True, L_PAD=l_pad, R_PAD=r_pad, LORA_DECODE=True)

    def gemm2_args(self, unused: torch.Tensor) -> dict:
        bank = self.bank
        l_pad, r_pad = bank.stacked_pads
        return dict(s2_ptr=self.s2_by_slot, tile_flags_ptr=unused, down_b_ptr=bank.down_b,
                    **_bank_sizes(bank, self.num_local_experts), row_to_slot_ptr=self.segments.row_to_slot,
                    lora_ids_ptr=self.lora_ids, weights_ptr=self.expert_weights, top_k=self.top_k, LORA=True,
                    L_PAD=l_pad, R_PAD=r_pad, LORA_DECODE=True)


def _shrink_block_k(block_m: int, columns: int, itemsize: int) -> int:
    """BLOCK_K of the tile shrinks: 256 for decode tiles, 64 for prefill tiles (H200), smaller when a pipeline
    stage (x tile + two stacked A tiles, ``BK * (BLOCK_M + 2 * columns)`` elements) would pass 64 KB."""
    fits = 65536 // (itemsize * (block_m + 2 * columns))
    return max(16, min(256 if block_m < 64 else 64, 1 << (fits.bit_length() - 1)))


def shrink_w13_tiles(x: torch.Tensor, bank: LoRABank, lora_ids: torch.Tensor, expert_weights: torch.Tensor,
                     segments: Segments, *, top_k: int, num_local_experts: int, pdl: dict) -> TileLoRA:
    """Allocate the tile mode's rank vectors and launch the W13 shrink, one program per live tile of ``segments``
    (whose tile is the GEMMs' BLOCK_M). ``x`` [T, H]; ``lora_ids`` int [T]; ``expert_weights`` float [T, K]."""
    l_pad, r_pad = bank.stacked_pads
    columns, block_m = l_pad * r_pad, segments.tile
    live_blocks, reach = segments.block_group.numel(), segments.row_to_slot.numel()
    lora = TileLoRA(
        bank, lora_ids, expert_weights, segments, top_k, num_local_experts,
        s13_by_row=scratch((reach, 2, columns), x.dtype, x.device),
        s2_by_row=scratch((reach, columns), x.dtype, x.device),
        tile_flags=torch.empty(live_blocks, dtype=torch.int32, device=x.device),
        shrink_meta=dict(**dot_flags(x.dtype), L_PAD=l_pad, R_PAD=r_pad, BLOCK_M=block_m,
                         BLOCK_K=_shrink_block_k(block_m, columns, x.element_size()),
                         num_warps=8 if block_m * columns > 128 * 64 else 4, **pdl))
    if live_blocks:
        _lora_shrink_kernel[(live_blocks,)](
            in_ptr=x, a0_ptr=bank.up_a, a1_ptr=bank.gate_a, out_ptr=lora.s13_by_row, **_shrink_rows(lora),
            D=x.shape[1], stride_in=x.stride(0), GATHER=True, NUM_SLICES=2, WEIGHTED=False, WRITE_FLAGS=True,
            **lora.shrink_meta)
    return lora


def shrink_w2_tiles(act: torch.Tensor, lora: TileLoRA) -> None:
    """Launch the W2 shrink of the tile mode over GEMM1's output ``act`` [R1, I] (permuted rows), weighted."""
    if lora.tile_flags.numel():
        _lora_shrink_kernel[(lora.tile_flags.numel(),)](
            in_ptr=act, a0_ptr=lora.bank.down_a, a1_ptr=lora.bank.down_a, out_ptr=lora.s2_by_row, **_shrink_rows(lora),
            D=act.shape[1], stride_in=act.stride(0), GATHER=False, NUM_SLICES=1, WEIGHTED=True, WRITE_FLAGS=False,
            **lora.shrink_meta)


def _shrink_rows(lora: TileLoRA) -> dict:
    return dict(tile_flags_ptr=lora.tile_flags, row_to_slot_ptr=lora.segments.row_to_slot,
                block_group_ptr=lora.segments.block_group, lora_ids_ptr=lora.lora_ids,
                weights_ptr=lora.expert_weights, top_k=lora.top_k, **_bank_sizes(lora.bank, lora.num_local_experts))


def slot_shrink_shape(H: int, r_pad: int) -> tuple[int, int]:
    """(BLOCK_K, COLS) of the decode launch's W13 shrink: x and a program's A rows in one K step up to H = 2048 (on
    the H200 that launch took 7.9 µs with 4 steps of 512, 3.7 with one: each dependent step waits on memory), at
    most 4096 elements of A a program, so a slot's 2*R_PAD rank columns spread over 2*R_PAD / COLS programs."""
    block_k = min(next_pow2(H), 2048)
    return block_k, max(2, min(2 * r_pad, 4096 // block_k))


def decode_segments_w13_shrink(topk_ids: torch.Tensor, x: torch.Tensor, bank: LoRABank, lora_ids: torch.Tensor,
                               expert_weights: torch.Tensor, *, num_local_experts: int, tile: int,
                               local_expert_offset: int, pdl: dict) -> DecodeLoRA | None:
    """One launch: the segments of ``topk_ids`` int [T, K] by local expert (tile ``tile``) and the W13 shrink by
    slot. None when one program cannot build the segments (``moelab.kernels.segments.plan_one_chunk``)."""
    plan = plan_one_chunk(topk_ids, num_local_experts, tile, local_expert_offset, packed=False)
    if plan is None:
        return None
    T, K = topk_ids.shape
    H = x.shape[1]
    l_pad, r_pad = bank.stacked_pads
    lora = DecodeLoRA(bank, lora_ids, expert_weights, plan.segments, K, num_local_experts,
                      s13_by_slot=scratch((T * K, 2, l_pad * r_pad), x.dtype, x.device),
                      s2_by_slot=scratch((T * K, l_pad * r_pad), torch.float32, x.device))
    block_k, cols = slot_shrink_shape(H, r_pad)
    _decode_segments_w13_shrink_kernel[(1 + T * K * (2 * r_pad // cols),)](
        **plan.args, x_ptr=x, up_a_ptr=bank.up_a, gate_a_ptr=bank.gate_a, s13_ptr=lora.s13_by_slot,
        s2_ptr=lora.s2_by_slot, lora_ids_ptr=lora_ids, H=H, top_k=K, num_loras=bank.max_loras,
        max_rank=bank.max_rank, stride_x=x.stride(0), **plan.meta, L_PAD=l_pad, R_PAD=r_pad, COLS=cols,
        BLOCK_K=block_k, num_warps=plan.num_warps, **pdl)
    return lora


# ---------------------------------------------------------------------------------------------- adapter loop: launchers

#: Ranks the adapter loop's epilogue expands a step, for the adapters past a tile's first: each step waits on its
#: loads (~1 µs), so 32 (two steps for rank 64, one for the rest) rather than tl.dot's minimum of 16.
RANK_CHUNK = 32


def own_rank_pad(bank: LoRABank) -> int:
    """R_PAD of the adapter loop's rank vectors: ``max_rank`` padded to a power of two, at least 16."""
    return max(next_pow2(bank.max_rank), 16)


@dataclass(frozen=True)
class AdapterLoopLoRA(_LoRAOperands):
    """The GEMMs' LoRA operands of the adapter loop (wide banks, see "the adapter loop" above): each row's own rank
    vectors, by slot at decode (``s13`` written by :func:`adapter_loop_decode_launch`, ``s2`` summed by GEMM1's
    epilogue, fp32) or by permuted row in tiles (:func:`adapter_loop_shrink_w13`, :func:`adapter_loop_shrink_w2`;
    ``s2`` weighted, in the input dtype), and the bank's rank table."""

    decode: bool
    ranks: torch.Tensor  # int32 [L], bank.rank_table()
    s13: torch.Tensor  # [T*K or R, 2, R_PAD] input dtype, [up | gate]
    s2: torch.Tensor  # [T*K, R_PAD] fp32 unweighted (decode) or [R, R_PAD] input dtype weighted (tiles)
    sub_m: int = 16  # rows of a tile-shrink program
    # tiles, the Gluon GEMMs' packing of each live tile's adapters (written by the W13 shrink):
    row_first_units: torch.Tensor | None = None  # int32 [R], each row's adapter's first unit of 8 ranks (0 none)
    row_ranks: torch.Tensor | None = None  # int32 [R], each row's rank (0 without an adapter)
    tile_units: torch.Tensor | None = None  # int32 [R / tile], the tile's units in all
    unit_map: torch.Tensor | None = None  # int32 [R / tile, units_max], each unit's adapter << 16 | adapter's first
    shrink_meta: dict | None = None

    def _common(self) -> dict:
        return dict(**_bank_sizes(self.bank, self.num_local_experts), lora_ids_ptr=self.lora_ids,
                    ranks_ptr=self.ranks, LORA=True, L_PAD=1, R_PAD=own_rank_pad(self.bank),
                    LORA_DECODE=self.decode, LORA_OWN=True, RANK_CHUNK=RANK_CHUNK)

    def gemm1_args(self, unused: torch.Tensor) -> dict:
        bank = self.bank
        return dict(s13_ptr=self.s13, tile_flags_ptr=unused, up_b_ptr=bank.up_b, gate_b_ptr=bank.gate_b,
                    down_a_ptr=bank.down_a, s2_ptr=self.s2, **self._common())

    def gemm2_args(self, unused: torch.Tensor) -> dict:
        return dict(s2_ptr=self.s2, tile_flags_ptr=unused, down_b_ptr=self.bank.down_b,
                    row_to_slot_ptr=self.segments.row_to_slot, weights_ptr=self.expert_weights, top_k=self.top_k,
                    **self._common())


def adapter_loop_decode_launch(topk_ids: torch.Tensor, x: torch.Tensor, bank: LoRABank, lora_ids: torch.Tensor,
                               expert_weights: torch.Tensor, *, num_local_experts: int, tile: int,
                               local_expert_offset: int, pdl: dict) -> AdapterLoopLoRA | None:
    """:func:`decode_segments_w13_shrink` for the adapter loop: one launch, the segments and each slot's own W13
    rank vectors [T*K, 2, R_PAD]. None when one program cannot build the segments."""
    plan = plan_one_chunk(topk_ids, num_local_experts, tile, local_expert_offset, packed=False)
    if plan is None:
        return None
    T, K = topk_ids.shape
    H = x.shape[1]
    r_pad = own_rank_pad(bank)
    lora = AdapterLoopLoRA(bank, lora_ids, expert_weights, plan.segments, K, num_local_experts, True,
                           bank.rank_table(), s13=scratch((T * K, 2, r_pad), x.dtype, x.device),
                           s2=scratch((T * K, r_pad), torch.float32, x.device))
    block_k, cols = slot_shrink_shape(H, r_pad)
    _decode_segments_w13_shrink_kernel[(1 + T * K * (2 * r_pad // cols),)](
        **plan.args, x_ptr=x, up_a_ptr=bank.up_a, gate_a_ptr=bank.gate_a, s13_ptr=lora.s13, s2_ptr=lora.s2,
        lora_ids_ptr=lora_ids, H=H, top_k=K, num_loras=bank.max_loras, max_rank=bank.max_rank,
        stride_x=x.stride(0), **plan.meta, L_PAD=1, R_PAD=r_pad, COLS=cols, BLOCK_K=block_k,
        num_warps=plan.num_warps, **pdl, ranks_ptr=lora.ranks, OWN=True)
    return lora


#: The adapter loop's tile shrinks take whole (adapter, expert) pairs (``_own_shrink_kernel``'s PAIRS) where each
#: expert's rows are sorted by adapter and ``adapter_sub_m`` is this: 17-32 rows a pair on average. There each
#: pair's A is read once instead of once for every sub-tile the pair crosses. Shorter pairs lose to the extra
#: dependent loads each pair's run starts with, longer ones to the lost parallelism (one program runs a whole pair).
#: H100, 2026-12-06, ``scripts/profile_lora_banks.py``, Qwen3-30B-A3B, ranks 64/32/16/8, GPU µs of both shrinks,
#: PAIRS against the sub-tiles: 32 rows a pair 0.89x (T = 4096 with 8 adapters: 197-198 against 222-224 µs) and
#: 0.87-0.91x (T = 16384 with 32: 732 against 808-840); 2 rows 1.29x, 8 rows 1.06-1.25x, 128 rows 1.17-1.20x.
SHRINK_PAIRS_SUB_M = 32


def shrink_takes_pairs(sub_m: int) -> bool:
    """Whether the tile shrinks of ``sub_m``-row sub-tiles take whole pairs over rows sorted by adapter."""
    return sub_m == SHRINK_PAIRS_SUB_M


def sorts_by_adapter(num_slots: int, num_local_experts: int, num_loras: int, sub_m: int) -> bool:
    """Whether the adapter loop sorts each expert's rows by adapter: for a bank of several slots, when an expert's
    rows span more than one tile-shrink sub-tile (T >= ~512 at Qwen3 shapes), so that a sub-tile and a GEMM tile
    hold few adapters."""
    return num_loras > 1 and num_slots > sub_m * num_local_experts


def adapter_sub_m(num_slots: int, num_local_experts: int, tile: int, num_loras: int) -> int:
    """Rows of a tile-shrink program: about the rows of one (adapter, expert) pair, in [16, min(tile, 64)]."""
    per_pair = -(-num_slots // (num_local_experts * num_loras))
    return min(max(next_pow2(per_pair), 16), tile, 64)


def adapter_sorted_segments(topk_ids: torch.Tensor, lora_ids: torch.Tensor, num_loras: int, num_local_experts: int,
                            tile: int, local_expert_offset: int, pdl: dict) -> Segments:
    """Segments by local expert (as ``build_segments_triton``) whose rows inside each expert follow the tokens
    sorted by adapter (stable: token order inside an adapter; tokens without one, or with an id outside the bank's
    ``num_loras``, last). ``topk_ids`` int [T, K], ``lora_ids`` int [T]. The sort is a counting sort on the
    segments kernels: one-row segments of the tokens grouped by adapter (their ``row_to_slot`` is the order; one
    launch up to 1024 tokens, two above, against ``torch.sort``'s 21-31 µs of radix sort at T = 4096-16384 on the
    H100), then the expert segments over the tokens in that order (``token_order``: the slot ids they write are
    the slots' own)."""
    order = build_segments_triton(torch.zeros_like(lora_ids), num_loras + 1, 1, adapter_ids=lora_ids, num_experts=1,
                                  tile_map=False, pdl=pdl).row_to_slot  # int32 [T]: each token in a group (last: none)
    return build_segments_triton(topk_ids, num_local_experts, tile, offset=local_expert_offset, token_order=order,
                                 pdl=pdl)


def adapter_loop_shrink_w13(x: torch.Tensor, bank: LoRABank, lora_ids: torch.Tensor, expert_weights: torch.Tensor,
                            segments: Segments, *, top_k: int, num_local_experts: int, pdl: dict) -> AdapterLoopLoRA:
    """Allocate the adapter loop's tile operands and launch its W13 shrink, one program per ``sub_m`` rows of the
    rows ``segments`` reaches. ``x`` [T, H]."""
    r_pad, tile = own_rank_pad(bank), segments.tile
    reach = segments.row_to_slot.numel()
    sub_m = adapter_sub_m(top_k * x.shape[0], num_local_experts, tile, bank.max_loras)
    pairs = shrink_takes_pairs(sub_m) and segments.token_ordered  # each expert's rows sorted by adapter
    shrink_m = min(2 * sub_m, 128) if pairs else sub_m  # rows of one K loop: most pairs in one
    tiles, adapter_units = reach // tile, cdiv(bank.max_rank, 8)
    units_max = cdiv(min(bank.max_loras, tile) * adapter_units, 16) * 16  # whole steps of 8 units (and Triton's hint)
    tiles_pad = cdiv(tiles, 4) * 4  # the unit map 16-byte aligned
    packing = torch.empty(2 * reach + tiles_pad + tiles * units_max, dtype=torch.int32, device=x.device)
    lora = AdapterLoopLoRA(
        bank, lora_ids, expert_weights, segments, top_k, num_local_experts, False, bank.rank_table(),
        s13=scratch((reach, 2, r_pad), x.dtype, x.device), s2=scratch((reach, r_pad), x.dtype, x.device),
        sub_m=sub_m, row_first_units=packing[:reach], row_ranks=packing[reach:2 * reach],
        tile_units=packing[2 * reach:2 * reach + tiles],
        unit_map=packing[2 * reach + tiles_pad:].view(tiles, units_max),
        shrink_meta=dict(**dot_flags(x.dtype), R_PAD=r_pad, SUB_M=sub_m, TILE=tile, PAIRS=pairs, PAIR_M=shrink_m,
                         BLOCK_K=_shrink_block_k(shrink_m, r_pad, x.element_size()),
                         num_warps=8 if shrink_m * r_pad > 64 * 64 else 4, **pdl))
    if segments.block_group.numel():
        _own_shrink_kernel[(segments.block_group.numel() * (tile // sub_m),)](
            in_ptr=x, a0_ptr=bank.up_a, a1_ptr=bank.gate_a, out_ptr=lora.s13, **_own_shrink_rows(lora),
            D=x.shape[1], stride_in=x.stride(0), GATHER=True, NUM_SLICES=2, WEIGHTED=False, WRITE_PACKING=True,
            ADAPTER_UNITS=next_pow2(adapter_units),
            **lora.shrink_meta)
    return lora


def adapter_loop_shrink_w2(act: torch.Tensor, lora: AdapterLoopLoRA) -> None:
    """Launch the adapter loop's W2 shrink over GEMM1's output ``act`` [R1, I] (permuted rows), weighted."""
    tiles = lora.segments.block_group.numel()
    if tiles:
        _own_shrink_kernel[(tiles * (lora.segments.tile // lora.sub_m),)](
            in_ptr=act, a0_ptr=lora.bank.down_a, a1_ptr=lora.bank.down_a, out_ptr=lora.s2, **_own_shrink_rows(lora),
            D=act.shape[1], stride_in=act.stride(0), GATHER=False, NUM_SLICES=1, WEIGHTED=True, **lora.shrink_meta)


def _own_shrink_rows(lora: AdapterLoopLoRA) -> dict:
    return dict(row_to_slot_ptr=lora.segments.row_to_slot, block_group_ptr=lora.segments.block_group,
                lora_ids_ptr=lora.lora_ids, weights_ptr=lora.expert_weights, ranks_ptr=lora.ranks, top_k=lora.top_k,
                row_first_ptr=lora.row_first_units, row_ranks_ptr=lora.row_ranks, tile_units_ptr=lora.tile_units,
                unit_map_ptr=lora.unit_map, units_max=lora.unit_map.shape[1],
                **_bank_sizes(lora.bank, lora.num_local_experts))
