"""Permuted row space: which row of the expert-sorted buffers each (token, slot) lands in (SPEC §3).

    expanded index            t*K + k, the slot k of token t
    expanded_idx_to_permuted_idx  int32 [T*K]: permuted row of each expanded index, -1 if non-local
    segment of local expert e rows [seg_start[e], seg_start[e] + ceil(count[e]/tile)*tile), ascending e;
                              inside it, tokens ascending (deterministic); empty experts take no rows

This module holds the tile heuristic and the readable torch construction; the Triton kernel that builds the
same map on the GPU without a host sync is ``moelab/kernels/permutation.py``.
"""

from __future__ import annotations

import torch


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_tile(num_tokens: int, top_k: int, num_local_experts: int) -> int:
    """FlashInfer's default CTA token tile (``computeSelectedTileN``): the smallest of its candidates.

    ``c = clamp(next_pow2(ceil(T*K / E_local)), 8, 128)``; candidates {prev, c, next, next-next} within
    [8, 128]; the default is the smallest one.
    """
    per_expert = -(-(num_tokens * top_k) // num_local_experts)
    c = min(max(_next_pow2(max(per_expert, 1)), 8), 128)
    return max(c // 2, 8)


def expanded_to_permuted_torch(topk_ids: torch.Tensor, local_expert_offset: int, num_local_experts: int,
                               tile: int) -> torch.Tensor:
    """``expanded_idx_to_permuted_idx`` int32 [T*K] from global ids int [T,K], with torch ops (no host sync)."""
    n = topk_ids.numel()
    device = topk_ids.device
    local_expert = topk_ids.flatten().long() - local_expert_offset
    is_local = (local_expert >= 0) & (local_expert < num_local_experts)
    key = torch.where(is_local, local_expert, num_local_experts)  # non-local slots sort last
    order = torch.sort(key, stable=True).indices  # stable: expanded (= token) order inside an expert
    counts = torch.zeros(num_local_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:num_local_experts] + tile - 1) // tile * tile
    seg_start = torch.cumsum(padded, 0) - padded
    first_sorted = torch.cumsum(counts, 0) - counts  # position of each expert's first slot in sorted order
    sorted_key = key[order]
    rank = torch.arange(n, device=device) - first_sorted[sorted_key]
    seg_start = torch.cat([seg_start, seg_start.new_zeros(1)])
    permuted_sorted = torch.where(sorted_key < num_local_experts, seg_start[sorted_key] + rank, -1)
    e2p = torch.empty(n, dtype=torch.int32, device=device)
    e2p[order] = permuted_sorted.to(torch.int32)
    return e2p
