"""Triton kernel of the MoE-LoRA deltas (docs/contract.md §5): one fused shrink + expand per tile of same-adapter rows.

Index arrays, by name (built by :func:`moelab.lora.lora_segments` with ``moelab.permutation.build_segments``):

    slot          t*K + k, the expanded index of (token t, top-k slot k); one output row per slot
    group         lora_id * E_local + local_expert for a local slot whose token has an adapter, else
                  ``zero_group = L * E_local`` (one extra group: the slots whose delta is exactly zero)
    row_to_slot   int32 [R]: the slot of each permuted row, -1 on a segment's padding and past the live rows
    block_group   int32 [R / BLOCK_M]: the group of each tile of BLOCK_M rows, -1 past the live rows

Every row of a tile shares one (adapter, expert) pair, so a program reads that pair's A and B once for up to
BLOCK_M slots (punica's "segmented" GEMV turned into a tiny grouped GEMM; scattermoe: a LoRA expert is a
rank-r expert routed like any other).

Small batches skip the grouping (``PER_SLOT``): program s takes slot s alone, reads its adapter and expert
itself, and streams that pair's A and B (``moelab.lora.per_slot_by_size`` picks by the bytes streamed; the deltas'
``per_slot=`` forces either mode). The crossover was measured when the grouping was ~25 torch launches; it is
1-3 Triton launches now (``moelab.kernels.segments``) and has not been re-measured (``scripts/device_house.sh``).

Why one fused kernel and not a shrink launch + an expand launch. Per tile, in elements (S slices, r the
rank, D_in/D_out the input/output widths; W13: S=2, D_in=H, D_out=I; W2: S=1, D_in=I, D_out=H):

    fused (this file)   x: BLOCK_M*D_in   A: S*r*D_in   B: S*D_out*r   out: BLOCK_M*S*D_out
    shrink + expand     the same, plus the rank vectors written once (BLOCK_M*S*r) and re-read by each of the
                        S*D_out/BLOCK_N expand programs, plus a second launch
    grid over N blocks  x and A re-read (and the shrink recomputed) by each of the S*D_out/BLOCK_N programs

At Qwen3-30B-A3B (H=2048, I=768, r=16, K=8), T=16384, bf16: the W13 delta writes T*K*2I*2 B = 403 MB and
gathers x rows for T*K*H*2 B = 537 MB; a split shrink/expand adds 8 MB of rank vectors to HBM plus ~100 MB of
L2 re-reads (12 N blocks) and one launch (~3 us); a grid over N blocks re-reads x 12 times (6.4 GB through L2)
and adds 12x the shrink FLOPs (+16% of the base layer's FLOPs). The fused kernel moves the minimum: each x row,
each A and B tile and each output element once per tile. Its cost is less parallelism per program, which only
matters at decode, where the per-slot mode spreads the slots over the SMs. Measured on an H200 at T=16384
(CUDA events): W13 216 us (940 MB moved: 4.3 TB/s, the copy ceiling), W2 219 us (738 MB: 3.4 TB/s); among
BLOCK_K, BLOCK_N in {64, 128, 256}, BLOCK_M in {32, 64, 128}, 4 or 8 warps, 2-4 stages none was 2% faster.

Zeros: the output is allocated with ``torch.empty`` and every slot is written exactly once, because the
slots without a delta (no adapter, non-local expert) form the extra ``zero_group`` whose tiles store zeros
without reading x, A or B. A ``torch.zeros`` output would write all 403 MB twice (the fill, then the
delta) and cost one more launch; here the zero rows cost only their own store.

Precision (docs/contract.md §5, vLLM's ``fused_moe_lora``): the shrink accumulates in fp32 and the rank vector is
rounded to the input dtype; the expand accumulates in fp32; W2 multiplies the routing weight in fp32, then rounds.
bf16/fp16 operands go to ``tl.dot`` as they are on a GPU. ``DOT_F32`` and ``DOT_PRECISION`` are
``_common.dot_flags``'s, as in every moelab kernel: in Triton's interpreter ``DOT_F32`` upcasts the operands to
fp32 first (fp32 ones always, a no-op), because the interpreter multiplies raw bf16 bits (triton issue 11584),
and every fp32 -> bf16 rounding goes through ``_common.to_output`` (the interpreter truncates); the values are
the same, so results match the GPU's. fp32 inputs use ``input_precision="ieee"`` (TF32 would miss 1e-5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from moelab.kernels._common import dot_flags, jit, shrink_step, to_output
from moelab.permutation import Segments, next_pow2

__all__ = ["DeltaTiles", "lora_shrink_expand_triton"]


def _pow2_block(n: int, low: int, high: int) -> int:
    return min(max(next_pow2(max(n, 1)), low), high)


@jit
def _expand_store(rank_vec, b_ptr, out_rows_ptr, row_mask, weight, D_out, rank, own_rank,
                  BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                  DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[m, n] = (weight[m]) * sum_r rank_vec[m, r] * B[n, r], for n in [0, D_out), BLOCK_N at a time; B's row
    stride is ``rank``, and its columns from ``own_rank`` on (zeros in the bank) are not read."""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < own_rank
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, D_out, BLOCK_N):
        cols = n0 + offs_n
        n_mask = cols < D_out
        # B is [D_out, rank] row-major: the [BLOCK_R, BLOCK_N] tile is B^T, contiguous BLOCK_N*rank elements.
        b_t = tl.load(b_ptr + cols[None, :] * rank + offs_r[:, None], mask=r_mask[:, None] & n_mask[None, :],
                      other=0.0)
        if DOT_F32:
            b_t = b_t.to(tl.float32)
        acc = tl.dot(rank_vec, b_t, input_precision=DOT_PRECISION)
        if MUL_WEIGHT:
            acc = acc * weight[:, None]
        tl.store(out_rows_ptr[:, None] + cols[None, :], to_output(acc, out_rows_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & n_mask[None, :])


@jit
def _lora_shrink_expand_kernel(
    x_ptr, a0_ptr, a1_ptr, b0_ptr, b1_ptr, out_ptr, weight_ptr, row_to_slot_ptr, block_group_ptr,
    topk_ids_ptr, lora_ids_ptr, ranks_ptr, top_k, local_expert_offset, num_local_experts, max_loras,
    stride_x_row, slots_per_input_row, D_in, D_out, rank, zero_group,
    NUM_SLICES: tl.constexpr, MUL_WEIGHT: tl.constexpr, PER_SLOT: tl.constexpr, RANK_STEP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One program per tile of BLOCK_M permuted rows; all its rows share ``group`` = (adapter, local expert).

    x [*, D_in] (row of slot s: s // slots_per_input_row); A banks [G, rank, D_in]; B banks [G, D_out, rank];
    out [N, NUM_SLICES * D_out], slice j in columns [j*D_out, (j+1)*D_out); weight [N] (MUL_WEIGHT).
    PER_SLOT: program s takes slot s alone (row 0 of its tile) and finds its group from topk_ids [N] and
    lora_ids [T] itself, so no segments are built (the decode path).
    ranks_ptr: int32 [L], each slot's own rank (``LoRABank.rank_table``): a program reads A's rows and B's columns
    up to its adapter's rank, rounded up to RANK_STEP (8 where ``rank`` is a multiple of 8, so the masked loads of B
    stay 16 bytes wide; else 1), never past ``rank``; the bank is zero there, so the products are the same.
    """
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    if PER_SLOT:
        adapter = tl.load(lora_ids_ptr + pid // top_k).to(tl.int32)
        expert = tl.load(topk_ids_ptr + pid).to(tl.int32) - local_expert_offset
        live = (adapter >= 0) & (adapter < max_loras) & (expert >= 0) & (expert < num_local_experts)
        group = tl.where(live, adapter * num_local_experts + expert, zero_group)
        slot = tl.where(offs_m == 0, pid, -1)
    else:
        group = tl.load(block_group_ptr + pid)
        slot = tl.load(row_to_slot_ptr + pid * BLOCK_M + offs_m)
    row_mask = slot >= 0
    slot64 = tl.where(row_mask, slot, 0).to(tl.int64)
    width = NUM_SLICES * D_out
    out_rows = out_ptr + slot64 * width
    if group == zero_group:
        # No adapter or a non-local expert: the delta is exactly zero; x, A and B are never read.
        offs_n = tl.arange(0, BLOCK_N)
        zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
        for n0 in range(0, width, BLOCK_N):
            cols = n0 + offs_n
            tl.store(out_rows[:, None] + cols[None, :], zeros, mask=row_mask[:, None] & (cols < width)[None, :])
    elif group >= 0:
        # Shrink: acc_j[m, :] = A_j @ x[row m], fp32 accumulation; x is read once for both slices.
        x_rows = x_ptr + (slot64 // slots_per_input_row) * stride_x_row
        bank_a = group.to(tl.int64) * rank * D_in
        offs_k = tl.arange(0, BLOCK_K)
        offs_r = tl.arange(0, BLOCK_R)
        # Only the adapter's own rank is read: a mixed bank's rank-8 slot streams 1/8 of a rank-64 slot's bytes.
        own_rank = tl.load(ranks_ptr + group // num_local_experts)
        own_rank = tl.minimum((own_rank + RANK_STEP - 1) // RANK_STEP * RANK_STEP, rank)
        own_rank = tl.multiple_of(own_rank, RANK_STEP)
        r_mask = offs_r < own_rank  # padded to BLOCK_R (a power of two >= 16) with zeros
        acc0 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, D_in, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < D_in
            x = tl.load(x_rows[:, None] + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            a_offs = bank_a + offs_r[None, :] * D_in + ks[:, None]  # the [BLOCK_K, BLOCK_R] tile of A^T
            acc0, acc1 = shrink_step(x, a0_ptr, a1_ptr, a_offs, k_mask[:, None] & r_mask[None, :], acc0, acc1,
                                     NUM_SLICES, DOT_F32, DOT_PRECISION)
        weight = tl.zeros([BLOCK_M], dtype=tl.float32)
        if MUL_WEIGHT:
            weight = tl.load(weight_ptr + slot64, mask=row_mask, other=0.0).to(tl.float32)
        # The rank vector is rounded to the input dtype (vLLM's tmp_typed), then expanded in fp32.
        rank_vec = to_output(acc0, x_ptr.dtype.element_ty)
        if DOT_F32:
            rank_vec = rank_vec.to(tl.float32)
        bank_b = group.to(tl.int64) * D_out * rank
        _expand_store(rank_vec, b0_ptr + bank_b, out_rows, row_mask, weight, D_out, rank, own_rank,
                      BLOCK_N, BLOCK_R, MUL_WEIGHT, DOT_F32, DOT_PRECISION)
        if NUM_SLICES == 2:
            rank_vec = to_output(acc1, x_ptr.dtype.element_ty)
            if DOT_F32:
                rank_vec = rank_vec.to(tl.float32)
            _expand_store(rank_vec, b1_ptr + bank_b, out_rows + D_out, row_mask, weight, D_out, rank, own_rank,
                          BLOCK_N, BLOCK_R, MUL_WEIGHT, DOT_F32, DOT_PRECISION)


@dataclass(frozen=True)
class DeltaTiles:
    """The launch of :func:`lora_shrink_expand_triton` past BLOCK_M (the segments' tile, or 16 per slot):
    ``block_k`` and ``block_n`` cap BLOCK_K (over D_in) and BLOCK_N (over D_out); ``num_stages`` is the depth of
    Triton's software pipeline on both loops."""

    block_k: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3


#: Decode: every program streams one (adapter, expert) pair's A and B; wide tiles keep more bytes in flight per SM
#: (BLOCK_K = BLOCK_N = 256 measured fastest on an H200 at T=1).
PER_SLOT_TILES = DeltaTiles(256, 256)
#: Tiles grouped by (adapter, expert): measured best at T=16384 among BLOCK_K, BLOCK_N in {64, 128, 256}.
GROUPED_TILES = DeltaTiles(128, 128)
#: Many programs (per slot from ``MANY_SLOTS`` slots, or grouped tiles of at most 32 rows): narrower K steps, so
#: several programs share an SM (at 256 / 128 the shared memory of 3 stages held one program an SM: Nsight Compute,
#: H200, Qwen3-30B-A3B with 8 adapters of ranks 64/32/16/8, 46-58 % of the DRAM peak at T = 128 and 1024). Per slot
#: at T = 128 there (``scripts/lora_delta_sweep.py``, H100, 2026-12-06) the W13 delta took 119.9 µs at 64 / 128
#: against 154.4 at 256 / 256, the W2 delta (one slice, D_out = H) 67.5 µs at 64 / 64 against 84.1.
#: Grouped at T = 1024 (tiles of 16 rows, same sweep, H100, 2026-12-06): W13 149.8 µs at 64 / 128 (the best of 7),
#: W2 104.4 at 64 / 64 against 116.2 at 64 / 128 (256 / 256: 101.6).
MANY_PROGRAMS_TILES = DeltaTiles(64, 128)
MANY_W2_TILES = DeltaTiles(64, 64)
MANY_SLOTS = 512


def choose_delta_tiles(num_slots: int, segments: Segments | None, num_slices: int) -> DeltaTiles:
    """The default launch of :func:`lora_shrink_expand_triton` (see the constants above); ``num_slices`` 2 is the
    W13 delta, 1 the W2 delta."""
    if (segments is None and num_slots < MANY_SLOTS) or (segments is not None and segments.tile > 32):
        return PER_SLOT_TILES if segments is None else GROUPED_TILES
    return MANY_PROGRAMS_TILES if num_slices == 2 else MANY_W2_TILES


def lora_shrink_expand_triton(x: torch.Tensor, a_banks: list[torch.Tensor], b_banks: list[torch.Tensor],
                              out: torch.Tensor, segments: Segments | None, *, topk_ids: torch.Tensor,
                              lora_ids: torch.Tensor, ranks: torch.Tensor, local_expert_offset: int,
                              slots_per_input_row: int, weight: torch.Tensor | None = None,
                              tiles: DeltaTiles | None = None) -> torch.Tensor:
    """Launch the fused kernel; arguments are already validated by :mod:`moelab.lora`.

    Args:
        x: [*, D_in], unit column stride; slot s reads row ``s // slots_per_input_row``.
        a_banks: 1 or 2 contiguous A banks [L, E_local, rank, D_in] (slice order = output column order).
        b_banks: the matching contiguous B banks [L, E_local, D_out, rank].
        out: contiguous [N, len(a_banks) * D_out], every row written.
        segments: from :func:`moelab.lora.lora_segments` (tile = BLOCK_M), or None for one program per slot.
        topk_ids: int [T, K]; lora_ids: int [T]; local_expert_offset: the EP window's first global id.
        ranks: int32 [L] on the device, each slot's own rank (``LoRABank.rank_table()``); A's rows and B's
            columns past it are zeros in the bank and not read.
        weight: [N] float, multiplied in fp32 (W2), or None.
        tiles: the launch's :class:`DeltaTiles`; None: :func:`choose_delta_tiles`.
    """
    num_slices = len(a_banks)
    max_loras, num_local_experts, rank, d_in = a_banks[0].shape
    d_out = b_banks[0].shape[-2]
    num_slots = out.shape[0]
    per_slot = segments is None
    if per_slot:
        grid, block_m = num_slots, 16
        row_to_slot = block_group = out  # unused
    else:
        grid, block_m = segments.row_to_slot.numel() // segments.tile, segments.tile
        row_to_slot, block_group = segments.row_to_slot, segments.block_group
    tiles = tiles or choose_delta_tiles(num_slots, segments, num_slices)
    if grid == 0:
        return out
    a1, b1 = (a_banks[1], b_banks[1]) if num_slices == 2 else (a_banks[0], b_banks[0])
    _lora_shrink_expand_kernel[(grid,)](
        x, a_banks[0], a1, b_banks[0], b1, out, weight if weight is not None else out, row_to_slot, block_group,
        topk_ids.contiguous(), lora_ids.contiguous(), ranks, topk_ids.shape[1], local_expert_offset,
        num_local_experts, max_loras, x.stride(0), slots_per_input_row, d_in, d_out, rank,
        max_loras * num_local_experts,
        NUM_SLICES=num_slices, MUL_WEIGHT=weight is not None, PER_SLOT=per_slot, RANK_STEP=8 if rank % 8 == 0 else 1,
        BLOCK_M=block_m, BLOCK_K=_pow2_block(d_in, 16, tiles.block_k), BLOCK_N=_pow2_block(d_out, 16, tiles.block_n),
        BLOCK_R=_pow2_block(rank, 16, 1 << 30),
        **dot_flags(x.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out
