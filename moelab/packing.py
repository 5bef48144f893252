"""Packed routing: one int32 word per (token, slot), as FlashInfer's routed MoE reads it (docs/contract.md §2).

    bits 31..16  global expert id, signed int16        id     = word >> 16   (arithmetic shift)
    bits 15..0   bfloat16 bit pattern of the weight    weight = (word & 0xFFFF) viewed as bf16

The ``& 0xFFFF`` is the whole point: a bf16 weight with its sign bit set (negative, or -0.0) read as int16
and widened to int32 is sign-extended to 0xFFFF____, and OR-ing that into the id field turns every id into -1,
so the kernel silently drops the slot. FlashInfer's own test helper omits the mask; vLLM masks.
"""

from __future__ import annotations

import torch

from moelab._checks import FLOAT_DTYPES, INT_DTYPES, MAX_EXPERTS, check_expert_ids, check_int, check_tensor

__all__ = ["pack_topk_ids_weights", "unpack_topk_ids_weights", "bf16_bits"]


def bf16_bits(weights: torch.Tensor) -> torch.Tensor:
    """int32 tensor holding the 16-bit pattern (0..65535) of ``weights`` rounded to bf16 (nearest even)."""
    return weights.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF


def pack_topk_ids_weights(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, num_experts: int | None = None, validate: bool = True
) -> torch.Tensor:
    """Pack global expert ids and routing weights into FlashInfer's int32 routing words.

    Args:
        topk_ids: int [T, K], global expert ids in ``[0, num_experts)`` (``num_experts <= 32767``).
        topk_weights: float [T, K]; rounded to bf16 (round to nearest even) by packing.
        num_experts: when given, ids must be below it.
        validate: read the ids on the device to reject ids out of range or twice in one token (a host sync).
            Pass False under CUDA-graph capture or in benchmarks.

    Returns:
        int32 [T, K]: ``(id << 16) | (bf16_bits(weight) & 0xFFFF)``.

    Example:
        >>> ids = torch.tensor([[3, 1]]); w = torch.tensor([[0.75, -0.25]])
        >>> unpack_topk_ids_weights(pack_topk_ids_weights(ids, w))[0].tolist()
        [[3, 1]]
    """
    check_routing(topk_ids, topk_weights, num_experts=num_experts, validate=validate)
    return (topk_ids.to(torch.int32) << 16) | bf16_bits(topk_weights)


def check_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, num_experts: int | None = None,
                  validate: bool = True) -> None:
    """The checks of :func:`pack_topk_ids_weights` (same arguments), for callers that read ids and weights
    unpacked (the triton backend's fused LoRA path)."""
    check_tensor("topk_ids", topk_ids, dtypes=INT_DTYPES, ndim=2)
    check_tensor("topk_weights", topk_weights, dtypes=FLOAT_DTYPES + (torch.float64,), ndim=2)
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(f"topk_weights: expected the shape of topk_ids {list(topk_ids.shape)}, "
                         f"got {list(topk_weights.shape)}")
    if topk_ids.device != topk_weights.device:
        raise ValueError(f"topk_weights: expected device {topk_ids.device} (that of topk_ids), "
                         f"got {topk_weights.device}")
    if num_experts is not None:
        check_int("num_experts", num_experts)
        if not 0 < num_experts <= MAX_EXPERTS:
            raise ValueError(f"num_experts: expected 1..{MAX_EXPERTS} (the id field is int16), got {num_experts}")
    if validate:
        check_expert_ids("topk_ids", topk_ids, MAX_EXPERTS + 1 if num_experts is None else num_experts)


def unpack_topk_ids_weights(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_topk_ids_weights`.

    Args:
        packed: int32 [T, K] routing words.

    Returns:
        ``(ids int32 [T, K], weights bf16 [T, K])``.

    Example:
        >>> packed = pack_topk_ids_weights(torch.tensor([[5, 0]]), torch.tensor([[-0.5, 0.25]]))
        >>> ids, weights = unpack_topk_ids_weights(packed)
        >>> ids.tolist(), weights.tolist()   # the negative weight keeps its expert id: the mask at work
        ([[5, 0]], [[-0.5, 0.25]])
    """
    check_tensor("packed", packed, dtypes=(torch.int32,), ndim=2)
    ids = packed >> 16
    low = packed & 0xFFFF
    signed_low = torch.where(low >= 0x8000, low - 0x10000, low)  # exact int16 value, no wrap-around cast
    return ids, signed_low.to(torch.int16).view(torch.bfloat16)
