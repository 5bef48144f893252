"""What a backend receives and returns: the routed-MoE contract as data.

A leaf of the package (it imports no backend and no front end): :mod:`moelab.moe` and :mod:`moelab.experts`
validate a call and build one of these objects, ``moelab/backends/<name>.py`` compute from it.

    MoEWeights        expert weights in one backend's layout (from :func:`moelab.prepare_weights`)
    RoutedMoECall     one validated :func:`moelab.routed_moe` call
    RoutedMoEResult   what the backend computed, before :func:`moelab.routed_moe` shapes FlashInfer's return list
    LoRAExpertsCall   one validated :class:`moelab.LoRAExperts` forward (base MoE plus a LoRA bank)

Index arrays, by name:

    topk_ids                      int32 [T, K]    global expert id of slot (t, k)
    expert_weights                [T, K]          routing weight of slot (t, k) as the kernel uses it
    expanded_idx_to_permuted_idx  int32 [T*K]     permuted row of expanded slot t*K+k, or -1 (non-local)
    gemm1_activation_output       [R1, I]         SwiGLU output, permuted rows (index only through the map)
    gemm2_output                  [R2, H]         unweighted expert output, permuted rows
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moelab.packing import unpack_topk_ids_weights
from moelab.permutation import max_live_rows

if TYPE_CHECKING:  # annotations only: moelab.lora stays a sibling, not a dependency
    from moelab.lora import LoRABank

__all__ = ["MoEWeights", "RoutedMoECall", "RoutedMoEResult", "LoRAExpertsCall", "permuted_rows", "ACTIVATIONS",
           "SWIGLUOAI_ALPHA"]

#: Expert activations, as ``(activation, gated)`` pairs (:func:`moelab.prepare_weights`). Gated ones read GEMM1's
#: output as ``[gate; up]``: ``act(gate) * up``, or GPT-OSS's ``"swigluoai"``; not gated: ``act(up)``.
ACTIVATIONS = frozenset({
    ("silu", True), ("gelu", True), ("gelu_tanh", True), ("swigluoai", True),
    ("silu", False), ("gelu", False), ("gelu_tanh", False), ("relu2", False),
})
#: GPT-OSS's ``"swigluoai"`` alpha, ``gate * sigmoid(alpha * gate) * (up + 1)``, when a caller gives none.
SWIGLUOAI_ALPHA = 1.702


@dataclass
class MoEWeights:
    """Expert weights prepared for one backend (from :func:`moelab.prepare_weights`).

    ``gemm1_weights`` / ``gemm2_weights`` are in the backend's own layout: HF order ``[E_local, 2I, H]`` /
    ``[E_local, H, I]`` for torch and triton, FlashInfer's BlockMajorK for flashinfer (``moelab.layout``).

    Example:
        >>> import moelab
        >>> w = moelab.prepare_weights(torch.randn(4, 64, 32), torch.randn(4, 32, 32), backend="torch")
        >>> w.backend, w.num_local_experts, w.hidden_size, w.intermediate_size, w.dtype
        ('torch', 4, 32, 32, torch.float32)
    """

    backend: str
    gemm1_weights: torch.Tensor
    gemm2_weights: torch.Tensor
    num_local_experts: int
    hidden_size: int
    intermediate_size: int
    activation: str = "silu"  # with ``gated``: one of ACTIVATIONS
    gated: bool = True  # GEMM1 is [E_local, 2I, H] rows [gate; up]; not gated: [E_local, I, H] (up only)
    swiglu_alpha: float | None = None  # "swigluoai" only (default 1.702)
    swiglu_limit: float | None = None  # gated: gate <= L, |up| <= L before the activation ("swigluoai": 7)
    gemm1_bias: torch.Tensor | None = None  # [E_local, 2I] ([gate; up]) or [E_local, I], GEMM1's dtype
    gemm2_bias: torch.Tensor | None = None  # [E_local, H]

    @property
    def is_swiglu(self) -> bool:
        """Plain SwiGLU without biases or clamp: what every backend's kernels run (flashinfer's only this)."""
        return (self.activation == "silu" and self.gated and self.swiglu_limit is None
                and self.gemm1_bias is None and self.gemm2_bias is None)

    @property
    def dtype(self) -> torch.dtype:
        return self.gemm1_weights.dtype

    @property
    def device(self) -> torch.device:
        return self.gemm1_weights.device


@dataclass
class RoutedMoECall:
    """A validated ``routed_moe`` call as a backend receives it.

    ``topk_ids`` / ``expert_weights`` decode packed routing on first use only: the triton backend reads the
    packed words in its kernels, so the decode (five small launches) runs only for ``validate=True`` or when
    ``expert_weights`` must be returned.
    """

    topk: torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # exactly what the caller passed
    packed: torch.Tensor | None  # int32 [T, K] contiguous routing words, or None for tuple input
    hidden_states: torch.Tensor  # [T, H] contiguous
    weights: MoEWeights
    num_experts: int
    top_k: int
    local_expert_offset: int
    gemm1_lora_delta: torch.Tensor | None  # [T, K, 2I] [up, gate] ([T, K, I] up only when not gated)
    do_finalize: bool
    output: torch.Tensor | None  # [T, H]
    _decoded: tuple[torch.Tensor, torch.Tensor] | None = None
    apply_router_weight_on_input: bool = False  # scale each slot's input by its weight, sum outputs unweighted

    def _decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._decoded is None:
            if self.packed is not None:
                self._decoded = unpack_topk_ids_weights(self.packed)
            else:
                self._decoded = (self.topk[0].to(torch.int32).contiguous(), self.topk[1])
        return self._decoded

    @property
    def topk_ids(self) -> torch.Tensor:
        """int32 [T, K], global ids."""
        return self._decode()[0]

    @property
    def expert_weights(self) -> torch.Tensor:
        """[T, K]: bf16 decoded (packed input) or the caller's own tensor (tuple input)."""
        return self._decode()[1]


@dataclass
class RoutedMoEResult:
    """What a backend computed; :func:`moelab.routed_moe` turns it into FlashInfer's return list."""

    output: torch.Tensor | None
    gemm2_output: torch.Tensor | None
    expanded_idx_to_permuted_idx: torch.Tensor | None
    gemm1_activation_output: torch.Tensor | None


@dataclass
class LoRAExpertsCall:
    """A validated :class:`moelab.LoRAExperts` forward as a backend's ``lora_experts`` receives it.

    The base term weights each slot by ``bf16(topk_weights)`` (as FlashInfer's packed routing rounds it), the W2
    LoRA term by the caller's ``topk_weights`` (as vLLM does). ``lora is None`` means no token of this batch has
    an adapter: the backend computes the base MoE only (vLLM's fast path).
    """

    hidden_states: torch.Tensor  # [T, H] contiguous, the weights' dtype
    topk_ids: torch.Tensor  # int [T, K], global ids (checked in range when the caller validated)
    topk_weights: torch.Tensor  # float [T, K], the caller's (fp64 allowed)
    weights: MoEWeights
    num_experts: int
    top_k: int
    local_expert_offset: int
    output: torch.Tensor  # [T, H], written and returned
    lora: LoRABank | None  # the adapters of the E_local experts, or None: base MoE only
    lora_ids: torch.Tensor | None  # int [T] on the device (-1: no adapter), None with ``lora`` None
    fused: bool = False  # fold the bank into the backend's own kernels (only where ``fused_lora_reason`` is None)
    path: str | None = None  # force one LoRA path (``moelab.experts.LORA_PATHS``); None: by backend and batch
    bank: LoRABank | None = None  # the module's bank, also when ``lora`` is None (kernels that take one run the same
    #                               code with and without adapters, so the base rows agree bit for bit)


def permuted_rows(num_tokens: int, top_k: int, num_experts: int, tile: int, width: int) -> int:
    """Rows FlashInfer allocates for a permuted buffer of row width ``width`` (H for gemm2, I for gemm1).

    ``Rmax = tile * (m + (T*K - m) // tile)`` with ``m = min(E, T*K)`` bounds the tile-padded live rows; the
    ``ceil(65536 / width)`` floor comes from FlashInfer's 128 KiB minimum allocation.
    """
    return max(max_live_rows(num_tokens * top_k, num_experts, tile), -(-65536 // width))
