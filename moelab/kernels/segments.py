"""Tile-aligned group segments in one Triton program (the decode path of ``moelab.permutation``).

Same result as :func:`moelab.permutation.build_segments` (slot_to_row, row_to_slot, block_group), but one
launch instead of about a dozen small torch kernels, which is what a decode step (T*K of a few hundred slots)
spends most of its metadata time on. One program walks the slots in chunks of CHUNK twice:

    pass 1  counts[g] += sum_i onehot[i, g]                       (histogram)
            seg_end = cumsum(ceil(counts / tile) * tile); block_group from seg_end; row_to_slot := -1
    pass 2  row_i = seg_start[g_i] + seen_before_chunk[g_i] + (cumsum(onehot, axis=0)[i, g_i] - 1)

so each group's rows follow the slot (= token) order: deterministic, no atomics, no host sync. A slot whose
``value - offset`` is outside ``[0, G)`` belongs to no group. Sizes above ``MAX_SLOTS`` use the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelab.permutation import Segments, build_segments, max_live_rows

#: Above this many slots the sequential chunks of one program cost more than the torch path's launches.
MAX_SLOTS = 4096
#: Groups one program can hold as a vector (the LoRA grouping is adapters x experts + 1).
MAX_GROUPS = 1024


@triton.jit
def _segments_kernel(
    group_ptr, slot_to_row_ptr, row_to_slot_ptr, block_group_ptr,
    num_slots, offset, num_groups, num_rows, num_blocks,
    TILE: tl.constexpr, CHUNK: tl.constexpr, G_BINS: tl.constexpr,
):
    bins = tl.arange(0, G_BINS)
    lane = tl.arange(0, CHUNK)
    counts = tl.zeros((G_BINS,), dtype=tl.int32)
    for c0 in range(0, num_slots, CHUNK):
        slots = c0 + lane
        g = tl.load(group_ptr + slots, mask=slots < num_slots, other=-1).to(tl.int32) - offset
        g = tl.where((slots < num_slots) & (g >= 0) & (g < num_groups), g, G_BINS)  # G_BINS: no group
        counts += tl.sum((g[:, None] == bins[None, :]).to(tl.int32), axis=0)
    padded = (counts + TILE - 1) // TILE * TILE
    seg_end = tl.cumsum(padded, axis=0)
    seg_start = seg_end - padded
    total = tl.sum(padded, axis=0)
    # block_group[b] = number of segments ending at or before row b*TILE (empty segments end where they start)
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + lane
        ends_before = (seg_end[None, :] <= (blocks * TILE)[:, None]) & (bins[None, :] < num_groups)
        grp = tl.sum(ends_before.to(tl.int32), axis=1)
        tl.store(block_group_ptr + blocks, tl.where(blocks * TILE < total, grp, -1), mask=blocks < num_blocks)
    for r0 in range(0, num_rows, CHUNK):
        rows = r0 + lane
        tl.store(row_to_slot_ptr + rows, tl.full((CHUNK,), -1, tl.int32), mask=rows < num_rows)
    tl.debug_barrier()  # the -1 fill above must land before pass 2 writes the live rows
    seen = tl.zeros((G_BINS,), dtype=tl.int32)
    for c0 in range(0, num_slots, CHUNK):
        slots = c0 + lane
        g = tl.load(group_ptr + slots, mask=slots < num_slots, other=-1).to(tl.int32) - offset
        in_group = (slots < num_slots) & (g >= 0) & (g < num_groups)
        onehot = (tl.where(in_group, g, G_BINS)[:, None] == bins[None, :]).to(tl.int32)
        rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # earlier slots of my group, this chunk
        base = tl.sum(onehot * (seg_start + seen)[None, :], axis=1)
        row = tl.where(in_group, base + rank, -1)
        tl.store(slot_to_row_ptr + slots, row, mask=slots < num_slots)
        tl.store(row_to_slot_ptr + row, slots, mask=in_group)
        seen += tl.sum(onehot, axis=0)


def build_segments_triton(values: torch.Tensor, num_groups: int, tile: int, offset: int = 0) -> Segments:
    """:func:`moelab.permutation.build_segments` of ``group = values - offset``, one launch when it fits.

    Args:
        values: int32/int64 [N] (e.g. flattened global expert ids, with ``offset`` the EP window start).
    """
    values = values.flatten()
    n = values.numel()
    if n > MAX_SLOTS or num_groups + 1 > MAX_GROUPS or n == 0:
        return build_segments(values.long() - offset, num_groups, tile)
    rows = max_live_rows(n, num_groups, tile)
    device = values.device
    slot_to_row = torch.empty(n, dtype=torch.int32, device=device)
    row_to_slot = torch.empty(rows, dtype=torch.int32, device=device)
    block_group = torch.empty(rows // tile, dtype=torch.int32, device=device)
    g_bins = triton.next_power_of_2(num_groups + 1)
    chunk = max(16, min(128, 8192 // g_bins))  # one-hot tile [CHUNK, G_BINS] of at most 8K int32
    _segments_kernel[(1,)](
        values, slot_to_row, row_to_slot, block_group, n, offset, num_groups, rows, rows // tile,
        TILE=tile, CHUNK=chunk, G_BINS=g_bins, num_warps=4,
    )
    return Segments(slot_to_row, row_to_slot, block_group, tile)
