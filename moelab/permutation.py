"""Permuted row space: which row of the expert-sorted buffers each (token, slot) lands in (docs/contract.md §3).

    slot (expanded index)         t*K + k, the slot k of token t
    expanded_idx_to_permuted_idx  int32 [T*K]: permuted row of each slot, -1 if the slot is non-local
    segment of group g            rows [seg_start[g], seg_start[g] + ceil(count[g]/tile)*tile), groups in
                                  ascending order, slots ascending inside (deterministic); empty groups
                                  take no rows; the padding rows of a segment belong to no slot
    row_to_slot                   int32 [R]: the inverse, -1 on padding and dead rows
    block_group                   int32 [R/tile]: the group of each tile of rows, -1 past the live rows

For the routed MoE a group is a local expert; for the LoRA kernels it is an (adapter, expert) pair. A tile of
rows never straddles two groups, so a GEMM program reads one weight matrix. All of it is built on the device
without a host sync (``torch.sort`` + scans), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b), e.g. for launch grids (plain Python: ``triton.cdiv`` is a constexpr function, a few µs of host
    time a call, which decode launches feel)."""
    return -(-a // b)


def default_tile(num_tokens: int, top_k: int, num_local_experts: int) -> int:
    """FlashInfer's default CTA token tile (``computeSelectedTileN``): the smallest of its candidates.

    ``c = clamp(next_pow2(ceil(T*K / E_local)), 8, 128)``; candidates {c/2, c, 2c, 4c} within [8, 128];
    the default is the smallest one.
    """
    per_expert = -(-(num_tokens * top_k) // num_local_experts)
    c = min(max(next_pow2(per_expert), 8), 128)
    return max(c // 2, 8)


def max_live_rows(num_slots: int, num_groups: int, tile: int) -> int:
    """Upper bound of the tile-padded live rows: ``tile * (m + (N - m) // tile)``, ``m = min(groups, N)``."""
    m = min(num_groups, num_slots)
    return tile * (m + (num_slots - m) // tile)


@dataclass
class Segments:
    """Tile-aligned group segments of N slots (see the module docstring)."""

    slot_to_row: torch.Tensor  # int32 [N]
    row_to_slot: torch.Tensor  # int32 [R], R = max_live_rows(N, G, tile)
    block_group: torch.Tensor  # int32 [R // tile]
    tile: int
    num_groups: int
    token_ordered: bool = False  # rows inside each group follow a caller's token order (not the slots' order)
    # int32 [2], zeroed with the segments (the Triton construction's first launch): the Gluon GEMM1's and GEMM2's
    # tile counters for their dynamic schedule, which each call leaves at zero again; None: each call zeroes its own.
    # So one GEMM1 and one GEMM2 at a time on these segments: two GEMM1s at once (other streams) share a counter
    tile_counters: torch.Tensor | None = None


def build_segments(group: torch.Tensor, num_groups: int, tile: int) -> Segments:
    """Sort N slots into tile-padded segments by group, with torch ops only (no host sync).

    Args:
        group: int [N], the group of each slot; values outside ``[0, num_groups)`` mean "in no group".
        num_groups: G.
        tile: rows per tile; every segment starts at a multiple of it.
    """
    n = group.numel()
    device = group.device
    rows = max_live_rows(n, num_groups, tile)
    group = group.flatten().long()
    in_group = (group >= 0) & (group < num_groups)
    key = torch.where(in_group, group, num_groups)  # slots in no group sort last
    order = torch.sort(key, stable=True).indices  # stable: slot (= token) order inside a group
    counts = torch.zeros(num_groups + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_groups] + tile - 1) // tile * tile
    seg_end = torch.cumsum(padded, 0)
    seg_start = torch.cat([seg_end - padded, seg_end.new_zeros(1)])
    first_sorted = torch.cumsum(counts, 0) - counts  # position of each group's first slot in sorted order
    sorted_key = key[order]
    rank = torch.arange(n, device=device) - first_sorted[sorted_key]
    row_sorted = torch.where(sorted_key < num_groups, seg_start[sorted_key] + rank, -1)
    slot_to_row = torch.empty(n, dtype=torch.int32, device=device)
    slot_to_row[order] = row_sorted.to(torch.int32)
    # Inverse map: scatter slot ids to their rows; slots in no group go to a spill row that is cut off.
    row_to_slot = torch.full((rows + 1,), -1, dtype=torch.int32, device=device)
    target = torch.where(row_sorted >= 0, row_sorted, rows)
    row_to_slot.scatter_(0, target, order.to(torch.int32))
    row_to_slot = row_to_slot[:rows]
    block_start = torch.arange(0, rows, tile, device=device)
    block_group = torch.searchsorted(seg_end, block_start, right=True)  # groups that end at or before it
    block_group = torch.where(block_group < num_groups, block_group, -1).to(torch.int32)
    return Segments(slot_to_row, row_to_slot.contiguous(), block_group, tile, num_groups)


def adapter_expert_groups(topk_ids: torch.Tensor, adapter_ids: torch.Tensor, num_adapters: int,
                          num_local_experts: int, local_expert_offset: int = 0) -> torch.Tensor:
    """int64 [T*K]: the (adapter, local expert) group of each slot, ``adapter * E_local + expert``, for a slot whose
    token's adapter (``adapter_ids`` int [T]) is in ``[0, num_adapters)`` and whose expert (``topk_ids`` int [T, K],
    global ids) is local; every other slot goes to the last group ``num_adapters * E_local`` (the LoRA kernels'
    zero group). The groups :func:`moelab.kernels.segments.build_segments_triton` forms with ``adapter_ids``."""
    expert = topk_ids.long() - local_expert_offset
    adapter = adapter_ids.long()[:, None]
    live = (expert >= 0) & (expert < num_local_experts) & (adapter >= 0) & (adapter < num_adapters)
    return torch.where(live, adapter * num_local_experts + expert, num_adapters * num_local_experts).flatten()


def local_expert_of_slot(topk_ids: torch.Tensor, local_expert_offset: int) -> torch.Tensor:
    """int64 [T*K]: ``global id - offset`` (a value outside [0, E_local) marks a non-local slot)."""
    return topk_ids.flatten().long() - local_expert_offset


def expanded_to_permuted_torch(topk_ids: torch.Tensor, local_expert_offset: int, num_local_experts: int,
                               tile: int) -> torch.Tensor:
    """``expanded_idx_to_permuted_idx`` int32 [T*K] from global ids int [T,K]."""
    return build_segments(local_expert_of_slot(topk_ids, local_expert_offset), num_local_experts, tile).slot_to_row
