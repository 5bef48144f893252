"""Tile-aligned group segments on the GPU in one or two launches (``moelab.permutation`` explains the layout).

Same result as :func:`moelab.permutation.build_segments` (slot_to_row, row_to_slot, block_group), but Triton
launches instead of about two dozen small torch kernels; on the H200 the torch construction cost 430 µs of host
time at T=1 and 830 µs at T=16384 (Qwen3 shapes), more than the MoE layer itself.

    count    one program per chunk of CHUNK slots: histogram of the chunk's groups, and its exclusive scan over
             groups (where each group's slots start inside the chunk once the chunk is sorted); the -1 fill of
             its share of row_to_slot
    scan     exclusive scan of the histograms over chunks (where each chunk starts inside each group), group
             counts -> tile-padded segment starts: done by each scatter program for its own chunk, a launch of
             its own past ``SCAN_IN_SCATTER_MAX_COUNTS`` histogram counts
    scatter  one program per chunk: sort the chunk by (group, slot), then
             row = seg_start[g] + chunk_base[chunk, g] + (position in sorted chunk - chunk_bin_start[chunk, g]);
             and the group of its share of the tiles of rows

Up to one chunk (1024 slots: every decode batch) a single program does all three steps, because on the H200
each launch costs tens of microseconds of host time, more than the work. Past ``BISECT_BINS`` bins (the LoRA
groupings of 8 and more adapters) the steps take the ways that scale with the groups: atomic histograms, the scan
as launches of its own (programs of ``SCAN_BINS`` bins and one for the segment starts), the tile -> group map by
bisection. In a CUDA graph on Hopper the one program takes programmatic dependent launch; the launches of more
chunks do not: with it, 128 chunks (131072 slots) read 77 µs a graph replay against 25 without (H100, 2026-12-06).

The groups are ``value - offset`` (a slot outside ``[0, G)`` belongs to no group: row -1), or with ``adapter_ids``
the (adapter, local expert) groups of :func:`moelab.permutation.adapter_expert_groups`, read from the ids in the
kernels. Rows inside a group follow the slot (= token) order, or with ``token_order`` the tokens' places in that
permutation (the adapter loop's tokens sorted by adapter): deterministic (the atomics only count), no host sync.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton.language as tl

from moelab import _runtime
from moelab.kernels._common import jit, routing_word_expert, wait_for_previous_kernel
from moelab.permutation import Segments, adapter_expert_groups, build_segments, cdiv, max_live_rows, next_pow2

#: Groups the programs hold as one vector (the LoRA grouping is adapters x experts + 1: 32 adapters of 128 experts
#: are 4097); beyond: torch path (about 70 small launches and a radix sort). At 1025 groups and 8192 slots (8
#: adapters, Qwen3-30B-A3B, T = 1024) the torch path read 263 µs of GPU time under Nsight Compute (H200) and 659 µs
#: eagerly (``do_bench``, H100); these kernels 16.5 µs of GPU time (``scripts/segments_profile.py``, H100), 22.5 at
#: 4097 groups.
MAX_GROUPS = 8191
#: Above this many bins (groups + 1, a power of two: the LoRA groupings of 8 or more adapters; the experts of a
#: routed MoE stay below) the kernels take the ways that scale with the groups: the histogram by atomics, the scan
#: over chunks in programs of SCAN_BINS bins, and the tile -> group map by bisection of the segment starts,
#: BISECT_CB tiles at once (a compare of every tile with every group read 230 µs at 4097 groups, T = 1024, H200).
BISECT_BINS = 1024
SCAN_BINS = 256
#: Up to BISECT_BINS bins each scatter program scans the chunks' histograms itself (no scan launch) while they hold at
#: most this many counts (chunks x bins): each program reads all of them, so their reads grow with the square of the
#: chunks. Measured up to 128 chunks of 256 bins (Qwen3-30B-A3B T = 16384, H100: the segments 28.0 -> 25.2 µs a graph
#: replay); beyond, the one-program scan launch runs as before.
SCAN_IN_SCATTER_MAX_COUNTS = 128 * 256
BISECT_CB = 256
#: Slots one program sorts (the chunk); up to one chunk a single program builds the whole segments.
MAX_CHUNK = 1024


@jit
def _slot_in_order(order_ptr, slots, num_slots, top_k, ORDERED: tl.constexpr):
    """With ORDERED, the slot at place ``slots`` of the token order ``order_ptr`` (int32 [num_slots // top_k]):
    ``order[i // top_k] * top_k + i % top_k``; else ``slots`` itself."""
    if ORDERED:
        token = tl.load(order_ptr + slots // top_k, mask=slots < num_slots, other=0)
        return token * top_k + slots % top_k
    return slots


@jit
def _load_groups(values_ptr, slots, num_slots, offset, num_groups, NO_GROUP: tl.constexpr, PACKED: tl.constexpr,
                 adapter_ptr, top_k, num_experts, BY_ADAPTER: tl.constexpr, ORDERED: tl.constexpr = False):
    """Group of each slot (int32, NO_GROUP for a slot past ``num_slots`` or outside ``[0, num_groups)``): the value
    minus ``offset``, or with BY_ADAPTER the (adapter, expert) group ``adapter * num_experts + expert`` of
    ``moelab.permutation.adapter_expert_groups`` (adapter = ``adapter_ptr[slot // top_k]``; the last group for a
    slot without an adapter in ``[0, (num_groups - 1) // num_experts)`` or a local expert). With ORDERED
    (not with BY_ADAPTER) ``slots`` are places in the token order ``adapter_ptr`` (:func:`_slot_in_order`)."""
    live_slot = slots < num_slots
    at = _slot_in_order(adapter_ptr, slots, num_slots, top_k, ORDERED)
    g = tl.load(values_ptr + at, mask=live_slot, other=-1).to(tl.int32)
    if PACKED:  # FlashInfer's routing word: the expert id is the signed high half
        g = routing_word_expert(g)
    g = g - offset
    if BY_ADAPTER:
        adapter = tl.load(adapter_ptr + slots // top_k, mask=live_slot, other=-1).to(tl.int32)
        zero_group = num_groups - 1
        live = (g >= 0) & (g < num_experts) & (adapter >= 0) & (adapter < zero_group // num_experts)
        g = tl.where(live, adapter * num_experts + g, zero_group)
    return tl.where(live_slot & (g >= 0) & (g < num_groups), g, NO_GROUP)


@jit
def _store_block_groups(block_group_ptr, seg_start_ptr, seg_end, bins, num_groups, total, b_start, b_end,
                        TILE: tl.constexpr, CB: tl.constexpr, G_BINS: tl.constexpr, BISECT: tl.constexpr):
    """block_group[b] for b in [b_start, b_end): the group whose tile-padded segment holds rows
    [b*TILE, (b+1)*TILE) (the number of segments that end at or before it), -1 past ``total`` live rows.
    ``seg_end`` int32 [G_BINS]: where each group's segment ends (bins >= num_groups ignored); with BISECT, found
    by bisection of ``seg_start_ptr`` int32 [G_BINS] (segment starts, ``seg_start[g + 1]`` the end of g, the
    total from ``num_groups`` on) instead: log2(G_BINS) loads a tile rather than a compare with every group."""
    for b0 in range(b_start, b_end, CB):
        blocks = b0 + tl.arange(0, CB)
        if BISECT:
            group = tl.zeros((CB,), dtype=tl.int32)  # segments found to end at or before the tile
            for i in tl.static_range(14):  # steps G_BINS / 2, ..., 1 (G_BINS <= next_pow2(MAX_GROUPS + 1) = 2**13)
                if (G_BINS >> (i + 1)) > 0:
                    cand = group + (G_BINS >> (i + 1))
                    end = tl.load(seg_start_ptr + cand, mask=cand <= num_groups, other=0)  # end of group cand - 1
                    group = tl.where((cand <= num_groups) & (end <= blocks * TILE), cand, group)
        else:
            ends_before = (seg_end[None, :] <= (blocks * TILE)[:, None]) & (bins[None, :] < num_groups)
            group = tl.sum(ends_before.to(tl.int32), axis=1)  # empty segments end where they start: skipped
        tl.store(block_group_ptr + blocks, tl.where(blocks * TILE < total, group, -1), mask=blocks < b_end)


@jit
def _store_group_tiles(block_group_ptr, seg_start, padded, bins, num_groups, total, num_blocks, TILE: tl.constexpr,
                       CB: tl.constexpr):
    """block_group [num_blocks] as :func:`_store_block_groups` writes it, from the groups' side: each group writes
    its own tiles (``padded[g] / TILE`` of them from ``seg_start[g] / TILE``), one tile of every group a step, and
    the tiles past ``total`` live rows -1 (CB a step). Steps: the most tiles of any group, at most ``num_blocks``
    (up to ``MAX_CHUNK`` slots: 64 when all of them are in one group of 16-row tiles). On the H100 the compare of
    every tile with every bin took 6 µs of the one program's 18 at 1024 slots and 256 bins
    (``scripts/one_chunk_parts.py``)."""
    first = seg_start // TILE
    tiles = tl.where(bins < num_groups, padded // TILE, 0)
    for j in range(0, tl.minimum(tl.max(tiles, axis=0), num_blocks)):  # none when the caller asks for no map
        tl.store(block_group_ptr + first + j, bins, mask=(j < tiles) & (first + j < num_blocks))
    for b0 in range(total // TILE, num_blocks, CB):
        blocks = b0 + tl.arange(0, CB)
        tl.store(block_group_ptr + blocks, tl.full((CB,), -1, tl.int32), mask=blocks < num_blocks)


@jit
def _histogram(g, counts_ptr, G_BINS: tl.constexpr, ATOMIC: tl.constexpr):
    """``tl.histogram(g, G_BINS)`` (int32 [G_BINS]); with ATOMIC counted by atomic adds into ``counts_ptr``
    int32 [G_BINS] (zeroed here first): tl.histogram's cost grows with the bins (on the H200 one program of 1024
    slots took 45 µs at 8192 bins, 1.8 at 256). The counts are integers: the same whatever the order."""
    if ATOMIC:
        bins = tl.arange(0, G_BINS)
        tl.store(counts_ptr + bins, tl.zeros((G_BINS,), dtype=tl.int32))
        tl.debug_barrier()
        tl.atomic_add(counts_ptr + g, tl.full(g.shape, 1, tl.int32), sem="relaxed")
        tl.debug_barrier()
        hist = tl.load(counts_ptr + bins, cache_modifier=".cg")  # from L2, where the atomics landed
        tl.debug_barrier()  # read by every thread before the caller reuses the counts' memory
    else:
        hist = tl.histogram(g, G_BINS)
    return hist


@jit
def _padded_counts(counts, bins, num_groups, TILE: tl.constexpr):
    """Each group's rows, its count rounded up to whole tiles; 0 for the bins past ``num_groups`` (no group)."""
    return (tl.where(bins < num_groups, counts, 0) + TILE - 1) // TILE * TILE


@jit
def _fill_padding_rows(row_to_slot_ptr, lane, start, end, CHUNK: tl.constexpr):
    """``row_to_slot[start:end] = -1`` (padding rows; the live ones are scattered over them later), CHUNK rows
    (``lane`` = arange(CHUNK)) a step."""
    for r0 in range(start, end, CHUNK):
        tl.store(row_to_slot_ptr + r0 + lane, tl.full((CHUNK,), -1, tl.int32), mask=r0 + lane < end)


@jit
def _segments_count_kernel(values_ptr, hist_ptr, chunk_bin_start_ptr, row_to_slot_ptr, tile_counters_ptr, num_slots,
                           offset, num_groups, num_rows, rows_per_chunk, adapter_ptr, top_k, num_experts,
                           CHUNK: tl.constexpr, G_BINS: tl.constexpr, PACKED: tl.constexpr, BY_ADAPTER: tl.constexpr,
                           ATOMIC: tl.constexpr, ORDERED: tl.constexpr = False):
    """Each chunk's histogram and its exclusive scan over groups; also the -1 fill of this chunk's share of
    ``row_to_slot`` (the padding rows; the scatter, a later launch, writes the live ones) and, in the first
    program, the zeroed ``Segments.tile_counters``."""
    chunk = tl.program_id(0)
    if chunk == 0:
        _zero_tile_counters(tile_counters_ptr)
    lane = tl.arange(0, CHUNK)
    r_end = tl.minimum((chunk + 1) * rows_per_chunk, num_rows)
    _fill_padding_rows(row_to_slot_ptr, lane, chunk * rows_per_chunk, r_end, CHUNK)
    g = _load_groups(values_ptr, chunk * CHUNK + tl.arange(0, CHUNK), num_slots, offset, num_groups, G_BINS - 1,
                     PACKED, adapter_ptr, top_k, num_experts, BY_ADAPTER, ORDERED)
    hist = _histogram(g, hist_ptr + chunk * G_BINS, G_BINS, ATOMIC)
    bins = tl.arange(0, G_BINS)
    if not ATOMIC:
        tl.store(hist_ptr + chunk * G_BINS + bins, hist)
    tl.store(chunk_bin_start_ptr + chunk * G_BINS + bins, tl.cumsum(hist, axis=0) - hist)


@jit
def _zero_tile_counters(tile_counters_ptr):
    """Zero the two int32 ``Segments.tile_counters`` (one program of the launch)."""
    tl.store(tile_counters_ptr + tl.arange(0, 2), tl.zeros((2,), dtype=tl.int32))


@jit
def _segments_scan_kernel(hist_ptr, chunk_base_ptr, seg_start_ptr, num_chunks, num_groups,
                          TILE: tl.constexpr, G_BINS: tl.constexpr, CB: tl.constexpr, BG: tl.constexpr):
    """The scan over chunks of BG bins a program (past ``BISECT_BINS`` bins or ``SCAN_IN_SCATTER_MAX_COUNTS``
    counts: below both the scatter scans its own chunk's share). One program (BG = G_BINS) also writes the segment
    starts; else each writes its bins' padded
    counts there, and :func:`_segments_prefix_kernel` scans them (one program over 8192 bins of 128 chunks took 91 µs
    on the H200)."""
    bins = tl.program_id(0) * BG + tl.arange(0, BG)
    carry = tl.zeros((BG,), dtype=tl.int32)
    for c0 in range(0, num_chunks, CB):
        chunks = c0 + tl.arange(0, CB)
        idx = chunks[:, None] * G_BINS + bins[None, :]
        ok = (chunks < num_chunks)[:, None]
        h = tl.load(hist_ptr + idx, mask=ok, other=0)
        tl.store(chunk_base_ptr + idx, tl.cumsum(h, axis=0) - h + carry[None, :], mask=ok)
        carry += tl.sum(h, axis=0)
    padded = _padded_counts(carry, bins, num_groups, TILE)
    if BG == G_BINS:
        # seg_start of the bins >= num_groups (padded 0) is the total of live rows: the scatter reads it there.
        tl.store(seg_start_ptr + bins, tl.cumsum(padded, axis=0) - padded)
    else:
        tl.store(seg_start_ptr + bins, padded)


@jit
def _segments_prefix_kernel(seg_start_ptr, G_BINS: tl.constexpr):
    """The padded counts in ``seg_start_ptr`` int32 [G_BINS] -> the segment starts (their exclusive scan)."""
    bins = tl.arange(0, G_BINS)
    padded = tl.load(seg_start_ptr + bins)
    tl.store(seg_start_ptr + bins, tl.cumsum(padded, axis=0) - padded)


@jit
def _segments_scatter_kernel(values_ptr, chunk_bin_start_ptr, chunk_base_ptr, seg_start_ptr,
                             slot_to_row_ptr, row_to_slot_ptr, block_group_ptr, num_slots, offset, num_groups,
                             num_blocks, blocks_per_chunk, adapter_ptr, top_k, num_experts, TILE: tl.constexpr,
                             CHUNK: tl.constexpr, G_BINS: tl.constexpr, PACKED: tl.constexpr, CB: tl.constexpr,
                             BY_ADAPTER: tl.constexpr, BISECT: tl.constexpr, hist_ptr=None, num_chunks=1,
                             SCAN: tl.constexpr = False, SCAN_CB: tl.constexpr = 1, ORDERED: tl.constexpr = False):
    """Sort the chunk and scatter its slots to their rows. With SCAN (up to ``BISECT_BINS`` bins and
    ``SCAN_IN_SCATTER_MAX_COUNTS`` counts: no scan launch)
    the program first scans the chunks' histograms ``hist_ptr`` [num_chunks, G_BINS] itself, SCAN_CB chunks a step:
    where its chunk starts inside each group and the segment starts, written to its own row of ``chunk_base_ptr``
    (the base of each group's rows, ``seg_start + chunk_base``) and read back by the scatter's gathers."""
    chunk = tl.program_id(0)
    bins = tl.arange(0, G_BINS)
    if SCAN:
        before = tl.zeros((G_BINS,), dtype=tl.int32)  # slots of each group in the chunks before this one
        counts = tl.zeros((G_BINS,), dtype=tl.int32)
        for c0 in range(0, num_chunks, SCAN_CB):
            chunks = c0 + tl.arange(0, SCAN_CB)
            h = tl.load(hist_ptr + chunks[:, None] * G_BINS + bins[None, :], mask=(chunks < num_chunks)[:, None],
                        other=0)
            before += tl.sum(tl.where((chunks < chunk)[:, None], h, 0), axis=0)
            counts += tl.sum(h, axis=0)
        padded = _padded_counts(counts, bins, num_groups, TILE)
        seg_end = tl.cumsum(padded, axis=0)
        total = tl.sum(padded, axis=0)
        tl.store(chunk_base_ptr + chunk * G_BINS + bins, seg_end - padded + before)
        tl.debug_barrier()  # the bases visible to every thread of the program before the gathers below
    else:
        if BISECT:
            seg_end = bins  # unused: the bisection reads seg_start itself
        else:
            seg_end = tl.load(seg_start_ptr + bins + 1, mask=bins + 1 < G_BINS, other=0)  # seg_start[g+1], g < G
        total = tl.load(seg_start_ptr + G_BINS - 1)
    # This chunk's share of the tile -> group map (one program for all tiles took 45 µs at T=16384 on the H200).
    b_start = chunk * blocks_per_chunk
    _store_block_groups(block_group_ptr, seg_start_ptr, seg_end, bins, num_groups, total, b_start,
                        tl.minimum(b_start + blocks_per_chunk, num_blocks), TILE, CB, G_BINS, BISECT)
    lane = tl.arange(0, CHUNK)
    g = _load_groups(values_ptr, chunk * CHUNK + lane, num_slots, offset, num_groups, G_BINS - 1, PACKED,
                     adapter_ptr, top_k, num_experts, BY_ADAPTER, ORDERED)
    order = tl.sort(g * CHUNK + lane)  # by group, then by slot: a stable sort of the chunk
    g_sorted, lane_sorted = order // CHUNK, order % CHUNK
    in_group = g_sorted < num_groups
    at = chunk * G_BINS + g_sorted
    rank = lane - tl.load(chunk_bin_start_ptr + at)  # earlier slots of my group in this chunk
    if SCAN:
        base = tl.load(chunk_base_ptr + at)
    else:
        base = tl.load(seg_start_ptr + g_sorted) + tl.load(chunk_base_ptr + at)
    row = tl.where(in_group, base + rank, -1)
    place = chunk * CHUNK + lane_sorted
    slot = _slot_in_order(adapter_ptr, place, num_slots, top_k, ORDERED)
    tl.store(slot_to_row_ptr + slot, row, mask=place < num_slots)
    tl.store(row_to_slot_ptr + row, slot, mask=in_group)


@jit
def _segments_one_chunk_kernel(values_ptr, scratch_ptr, slot_to_row_ptr, row_to_slot_ptr, block_group_ptr,
                               tile_counters_ptr, num_slots, offset, num_groups, num_rows, num_blocks, adapter_ptr,
                               top_k, num_experts, TILE: tl.constexpr, CHUNK: tl.constexpr, G_BINS: tl.constexpr,
                               PACKED: tl.constexpr, CB: tl.constexpr, BY_ADAPTER: tl.constexpr,
                               BISECT: tl.constexpr, USE_GDC: tl.constexpr = False, ORDERED: tl.constexpr = False):
    wait_for_previous_kernel(USE_GDC)
    _zero_tile_counters(tile_counters_ptr)
    one_chunk_segments(values_ptr, scratch_ptr, slot_to_row_ptr, row_to_slot_ptr, block_group_ptr, num_slots, offset,
                       num_groups, num_rows, num_blocks, TILE, CHUNK, G_BINS, PACKED, CB, adapter_ptr, top_k,
                       num_experts, BY_ADAPTER, BISECT, ORDERED)


@jit
def one_chunk_segments(values_ptr, scratch_ptr, slot_to_row_ptr, row_to_slot_ptr, block_group_ptr,
                       num_slots, offset, num_groups, num_rows, num_blocks,
                       TILE: tl.constexpr, CHUNK: tl.constexpr, G_BINS: tl.constexpr, PACKED: tl.constexpr,
                       CB: tl.constexpr, adapter_ptr=None, top_k=1, num_experts=1, BY_ADAPTER: tl.constexpr = False,
                       BISECT: tl.constexpr = False, ORDERED: tl.constexpr = False):
    """All of the segments of up to CHUNK slots in one program (see :func:`plan_one_chunk` for the arguments;
    ``scratch_ptr`` int32 [G_BINS], [2 * G_BINS] with BISECT)."""
    lane = tl.arange(0, CHUNK)
    bins = tl.arange(0, G_BINS)
    g = _load_groups(values_ptr, lane, num_slots, offset, num_groups, G_BINS - 1, PACKED, adapter_ptr, top_k,
                     num_experts, BY_ADAPTER, ORDERED)
    hist = _histogram(g, scratch_ptr + G_BINS, G_BINS, BISECT)  # the seg_start half counts, then is overwritten
    padded = _padded_counts(hist, bins, num_groups, TILE)
    seg_end = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    # row of the j-th slot of group g in sorted order = seg_start[g] + j - (slots of groups < g) =: row_base[g] + j
    tl.store(scratch_ptr + bins, (seg_end - padded) - (tl.cumsum(hist, axis=0) - hist))
    if BISECT:
        tl.store(scratch_ptr + G_BINS + bins, seg_end - padded)  # seg_start, for the bisection
    _fill_padding_rows(row_to_slot_ptr, lane, 0, num_rows, CHUNK)
    tl.debug_barrier()  # row_base and seg_start visible to every thread, the -1 fill done before the live rows land
    if BISECT:
        _store_block_groups(block_group_ptr, scratch_ptr + G_BINS, seg_end, bins, num_groups, total, 0, num_blocks,
                            TILE, CB, G_BINS, BISECT)
    else:
        _store_group_tiles(block_group_ptr, seg_end - padded, padded, bins, num_groups, total, num_blocks, TILE, CHUNK)
    order = tl.sort(g * CHUNK + lane)
    g_sorted, place = order // CHUNK, order % CHUNK
    in_group = g_sorted < num_groups
    row = tl.where(in_group, tl.load(scratch_ptr + g_sorted) + lane, -1)
    slot = _slot_in_order(adapter_ptr, place, num_slots, top_k, ORDERED)
    tl.store(slot_to_row_ptr + slot, row, mask=place < num_slots)
    tl.store(row_to_slot_ptr + row, slot, mask=in_group)


@dataclass
class OneChunkPlan:
    """Buffers and launch arguments of the one-program segments (:func:`one_chunk_segments`), for a launch that runs
    it as one of its programs (the fused LoRA decode kernel): ``args`` by name, ``meta`` the constexprs."""

    segments: Segments
    args: dict
    meta: dict
    num_warps: int


def plan_one_chunk(values: torch.Tensor, num_groups: int, tile: int, offset: int = 0, *,
                   packed: bool = False) -> OneChunkPlan | None:
    """Allocate the segments of ``values`` (as :func:`build_segments_triton` takes them) for one program, or None
    when they need more (over ``MAX_CHUNK`` slots, over ``MAX_GROUPS`` groups, or no slot at all)."""
    values = values.flatten()
    n = values.numel()
    if n == 0 or n > MAX_CHUNK or num_groups > MAX_GROUPS:
        return None
    sizes, total, rows, chunk, g_bins, num_warps = _one_chunk_layout(n, num_groups, tile)
    num_warps = min(num_warps, 4)  # the launch's other programs (the fused LoRA's shrinks) were tuned at 4
    # One allocation for every output and the scratch (each allocation is host time at decode sizes).
    # (its two tile counters unused: these segments carry none, so a dynamic Gluon GEMM zeroes its own)
    slot_to_row, row_to_slot, block_group, _, scratch = torch.empty(
        total, dtype=torch.int32, device=values.device).split_with_sizes(sizes)
    return OneChunkPlan(
        Segments(slot_to_row, row_to_slot, block_group, tile, num_groups),
        dict(values_ptr=values, scratch_ptr=scratch, slot_to_row_ptr=slot_to_row, row_to_slot_ptr=row_to_slot,
             block_group_ptr=block_group, num_slots=n, offset=offset, num_groups=num_groups, num_rows=rows,
             num_blocks=rows // tile),
        dict(TILE=tile, CHUNK=chunk, G_BINS=g_bins, PACKED=packed, CB=max(1, 4096 // g_bins)),
        num_warps)


@functools.lru_cache(maxsize=4096)
def _one_chunk_layout(n: int, num_groups: int, tile: int) -> tuple[tuple[int, ...], int, int, int, int, int]:
    """Host arithmetic of the one-program segments of ``n`` slots, computed once per shape: the split of the one
    int32 buffer (slot_to_row, row_to_slot, block_group, the two tile counters, scratch) and its size, the live
    rows, CHUNK, G_BINS and the warps."""
    rows = max_live_rows(n, num_groups, tile)
    g_bins = next_pow2(num_groups + 1)  # the last bin collects the slots in no group
    chunk = next_pow2(n)
    sizes = (n, rows, rows // tile, 2, 2 * g_bins if g_bins > BISECT_BINS else g_bins)
    # on the H200, 256 slots: 7.0 µs at 2 warps, 7.8 at 4; on the H100 (scripts/segments_profile.py at db3bc8f),
    # 1024 slots: 7.4 µs at 8 warps against 8.7 at 4 (128 experts), 6.8 against 7.7 (64)
    return sizes, sum(sizes), rows, chunk, g_bins, 8 if chunk == MAX_CHUNK else 4 if chunk > 256 else 2


def _block_group_map(g_bins: int) -> dict:
    """The tile -> group map's constexprs (:func:`_store_block_groups`): bisection BISECT_CB tiles at a time past
    BISECT_BINS bins, else a compare of CB tiles with every bin (CB * G_BINS = 4096 elements a step)."""
    bisect = g_bins > BISECT_BINS
    return dict(CB=BISECT_CB if bisect else 4096 // g_bins, BISECT=bisect)


def build_segments_triton(values: torch.Tensor, num_groups: int, tile: int, offset: int = 0, *,
                          packed: bool = False, adapter_ids: torch.Tensor | None = None,
                          num_experts: int | None = None, token_order: torch.Tensor | None = None,
                          tile_map: bool = True, pdl: dict | None = None) -> Segments:
    """:func:`moelab.permutation.build_segments` of ``group = values - offset``, in one Triton launch up to
    ``MAX_CHUNK`` slots, else two (four past ``BISECT_BINS`` bins).

    Args:
        values: int32/int64 [N] (e.g. flattened global expert ids, ``offset`` the EP window's first id), or
            int32 packed routing words when ``packed`` (the id is ``word >> 16``).
        num_groups: G (at most ``MAX_GROUPS``, else the torch construction runs).
        tile: rows per tile (a power of two).
        adapter_ids: int [T] with ``values`` the expert ids of T tokens ([T*K]) and ``num_experts`` E_local: group
            by (adapter, local expert) instead, the groups of :func:`moelab.permutation.adapter_expert_groups` for
            ``G = L * E_local + 1`` (L adapters, the last group the slots of no adapter or no local expert).
        token_order: int32 [T], a permutation of the T tokens of ``values`` ([T*K], not with ``adapter_ids``):
            the rows inside each group follow the tokens in this order (then their slots' order) instead of
            the slots' order, as if ``values`` were ``values.view(T, K)[token_order]``; the slot ids written are
            the slots' own, and the segments come back ``token_ordered``.
        tile_map: False: no tile -> group map (``block_group`` comes back empty), for a caller that reads only
            the slot maps: the adapter loop's counting sort (one-row tiles: a map of T entries, by a compare of
            every tile with every group).
        pdl: the one program's launch options of :func:`moelab._runtime.pdl_launch` (default: asked here).
    """
    values = values.flatten()
    n = values.numel()
    by_adapter, ordered = adapter_ids is not None, token_order is not None
    top_k, experts = 1, 1
    if ordered:
        if by_adapter or token_order.dtype != torch.int32 or n % max(token_order.numel(), 1):
            raise ValueError(f"token_order: expected an int32 permutation of the {n} slots' tokens, without "
                             f"adapter_ids (got {token_order.dtype}, {token_order.numel()} tokens)")
        top_k = n // max(token_order.numel(), 1)
        values, adapter_ids = values.contiguous(), token_order.contiguous()  # read by slot, by token
    if by_adapter:
        adapter_ids = adapter_ids.contiguous()  # read by token index
        values = values.contiguous()  # the caller's topk_ids may be a strided view (flatten keeps it one)
        if n % max(adapter_ids.numel(), 1) or num_experts is None or (num_groups - 1) % num_experts:
            raise ValueError(f"adapter_ids: expected one id per token of values' {n} slots ({adapter_ids.numel()} "
                             f"given) and num_groups = adapters * num_experts + 1 ({num_groups} groups, "
                             f"num_experts {num_experts})")
        top_k, experts = n // max(adapter_ids.numel(), 1), num_experts
    if n == 0 or num_groups > MAX_GROUPS:
        ids = ((values >> 16) if packed else values).long()
        if by_adapter:
            group = adapter_expert_groups(ids.view(adapter_ids.numel(), top_k), adapter_ids,
                                          (num_groups - 1) // experts, experts, offset)
        else:
            group = ids - offset
        if not ordered or n == 0:
            seg = build_segments(group, num_groups, tile)
        else:
            seg = build_segments(group.view(-1, top_k)[token_order.long()].flatten(), num_groups, tile)
            place_slot = (token_order.long()[:, None] * top_k + torch.arange(top_k, device=ids.device)).flatten()
            slot_to_row = torch.empty_like(seg.slot_to_row)
            slot_to_row[place_slot] = seg.slot_to_row
            row_to_slot = torch.where(seg.row_to_slot >= 0, place_slot[seg.row_to_slot.long().clamp(min=0)], -1)
            seg = Segments(slot_to_row, row_to_slot.to(torch.int32), seg.block_group, tile, num_groups, True)
        return seg if tile_map else replace(seg, block_group=seg.block_group[:0])
    adapters = dict(adapter_ptr=adapter_ids, top_k=top_k, num_experts=experts, BY_ADAPTER=by_adapter,
                    ORDERED=ordered)
    if n <= MAX_CHUNK:  # one program (the arithmetic of plan_one_chunk: decode calls are host-bound)
        sizes, total, rows, chunk, g_bins, num_warps = _one_chunk_layout(n, num_groups, tile)
        slot_to_row, row_to_slot, block_group, tile_counters, scratch = torch.empty(
            total, dtype=torch.int32, device=values.device).split_with_sizes(sizes)
        block_group = block_group if tile_map else block_group[:0]
        _segments_one_chunk_kernel[(1,)](values, scratch, slot_to_row, row_to_slot, block_group, tile_counters, n,
                                         offset, num_groups, rows, block_group.numel(), **adapters, TILE=tile,
                                         CHUNK=chunk, G_BINS=g_bins, PACKED=packed, **_block_group_map(g_bins),
                                         num_warps=num_warps,
                                         **(_runtime.pdl_launch(values.device) if pdl is None else pdl))
        return Segments(slot_to_row, row_to_slot, block_group, tile, num_groups, ordered, tile_counters)
    device = values.device
    rows = max_live_rows(n, num_groups, tile)
    g_bins = next_pow2(num_groups + 1)  # the last bin collects the slots in no group
    chunk, warps = MAX_CHUNK, 4
    num_chunks = cdiv(n, chunk)
    many = g_bins > BISECT_BINS  # the scan launch(es) over BG bins a program and the atomic histogram (the map: below)
    bg = SCAN_BINS if many else g_bins
    scratch_size = 3 * num_chunks * g_bins + g_bins
    buf = torch.empty(n + rows + rows // tile + 2 + scratch_size, dtype=torch.int32, device=device)
    slot_to_row, row_to_slot, block_group, tile_counters, scratch = buf.split_with_sizes(
        [n, rows, rows // tile, 2, scratch_size])
    hist, chunk_bin_start, chunk_base, seg_start = scratch.split_with_sizes([num_chunks * g_bins] * 3 + [g_bins])
    _segments_count_kernel[(num_chunks,)](values, hist, chunk_bin_start, row_to_slot, tile_counters, n, offset,
                                          num_groups, rows, cdiv(rows, num_chunks), **adapters, CHUNK=chunk,
                                          G_BINS=g_bins, PACKED=packed, ATOMIC=many, num_warps=warps)
    scan = {}
    if many or num_chunks * g_bins > SCAN_IN_SCATTER_MAX_COUNTS:
        _segments_scan_kernel[(g_bins // bg,)](hist, chunk_base, seg_start, num_chunks, num_groups, TILE=tile,
                                               G_BINS=g_bins, CB=max(1, 4096 // bg), BG=bg, num_warps=4)
        if many:
            _segments_prefix_kernel[(1,)](seg_start, G_BINS=g_bins, num_warps=8)
    else:  # each scatter program scans the histograms itself (one launch fewer)
        scan = dict(hist_ptr=hist, num_chunks=num_chunks, SCAN=True, SCAN_CB=max(1, 4096 // g_bins))
    num_blocks = rows // tile if tile_map else 0
    block_group = block_group[:num_blocks]
    _segments_scatter_kernel[(num_chunks,)](values, chunk_bin_start, chunk_base, seg_start, slot_to_row,
                                            row_to_slot, block_group, n, offset, num_groups, num_blocks,
                                            cdiv(num_blocks, num_chunks), **adapters, TILE=tile, CHUNK=chunk,
                                            G_BINS=g_bins, PACKED=packed, **_block_group_map(g_bins), **scan,
                                            num_warps=warps)
    return Segments(slot_to_row, row_to_slot, block_group, tile, num_groups, ordered, tile_counters)
