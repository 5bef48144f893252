"""The seed's two standalone ops (docs/contract.md §5): ``unpermute_activation`` and ``finalize_with_w2_lora``.

Each public function validates, allocates and launches the Triton kernel of ``moelab/kernels/`` when Triton
can run on the tensors' device (a CUDA GPU, or the interpreter on CPU), else runs its torch fallback.
``use_triton=False`` forces the fallback (tests compare both).
"""

from __future__ import annotations

import math

import torch

from moelab import _checks, _runtime
from moelab._checks import FLOAT_DTYPES, check_int, check_tensor

__all__ = ["unpermute_activation", "finalize_with_w2_lora", "unpermute_torch", "finalize_torch"]


def unpermute_torch(act_permuted: torch.Tensor, e2p: torch.Tensor) -> torch.Tensor:
    """[T*K, I]: ``act_permuted[e2p[r]]``, zeros where ``e2p[r] == -1``."""
    live = (e2p >= 0) & (e2p < act_permuted.shape[0])
    rows = act_permuted[torch.where(live, e2p, 0).long()]
    return torch.where(live[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def finalize_torch(output, gemm2_output, expert_weights, e2p, w2_delta, scale: float = 1.0) -> torch.Tensor:
    """Fused finalize in torch: fp32 sum over k in order, then the already-weighted W2 delta, one write."""
    T, K = expert_weights.shape
    e2p = e2p.view(T, K)
    acc = torch.zeros(T, gemm2_output.shape[1], dtype=torch.float32, device=gemm2_output.device)
    for k in range(K):
        live = (e2p[:, k] >= 0) & (e2p[:, k] < gemm2_output.shape[0])
        rows = gemm2_output[torch.where(live, e2p[:, k], 0).long()].float()
        term = expert_weights[:, k].float()[:, None] * rows
        acc = acc + torch.where(live[:, None], term, torch.zeros((), device=acc.device))
    if scale != 1.0:
        acc = acc * scale
    if w2_delta is not None:
        lora = torch.zeros_like(acc)
        for k in range(K):
            lora = lora + w2_delta[:, k].float()
        acc = acc + lora
    output.copy_(acc)
    return output


def _check_map(e2p: torch.Tensor, num_rows: int, validate: bool) -> None:
    """The map must be contiguous (kernels index it flat) and, when ``validate``, inside [-1, num_rows)."""
    _checks.check_contiguous("expanded_idx_to_permuted_idx", e2p)
    if validate:
        _checks.check_in_range("expanded_idx_to_permuted_idx", e2p, -1, num_rows, "rows", " of the permuted buffer")


def _use_triton(device: torch.device, use_triton: bool | None) -> bool:
    can = _runtime.triton_can_run(device)
    if use_triton and not can:
        raise ValueError(f"use_triton: Triton cannot run on {device} here (no triton, or a CPU tensor where moelab "
                         "does not interpret: next to a CUDA GPU or under TRITON_INTERPRET=0); pass use_triton=None")
    return can if use_triton is None else use_triton


def unpermute_activation(act_permuted: torch.Tensor, expanded_idx_to_permuted_idx: torch.Tensor, num_tokens: int,
                         top_k: int, *, validate: bool = True, use_triton: bool | None = None) -> torch.Tensor:
    """Gather the permuted SwiGLU activation back to expanded order, non-local rows as zeros.

    Args:
        act_permuted: [R1, I] (``gemm1_activation_output`` of :func:`moelab.routed_moe`), bf16/fp16/fp32.
        expanded_idx_to_permuted_idx: int32 [T*K], values in [-1, R1).
        num_tokens, top_k: T and K.
        validate: read the map to reject rows outside ``[-1, R1)`` (a host sync). With False (CUDA graphs,
            benchmarks) a row out of range gives a zero row instead of an out-of-bounds read.

    Returns:
        [T*K, I], dtype of ``act_permuted``: row r is ``act_permuted[map[r]]`` or zeros (``map[r] == -1``).
        The zeros matter: the W2 LoRA sums over every slot, so garbage here would leak into the output.

    Example:
        >>> act_permuted = torch.arange(8.0).view(4, 2)          # R1 = 4 permuted rows, I = 2
        >>> e2p = torch.tensor([2, -1, 0, 3], dtype=torch.int32)  # T = 2, K = 2; slot 1 is non-local
        >>> unpermute_activation(act_permuted, e2p, 2, 2).tolist()
        [[4.0, 5.0], [0.0, 0.0], [0.0, 1.0], [6.0, 7.0]]
    """
    check_tensor("act_permuted", act_permuted, dtypes=FLOAT_DTYPES, ndim=2)
    check_int("num_tokens", num_tokens, low=0)
    check_int("top_k", top_k, low=1)
    check_tensor("expanded_idx_to_permuted_idx", expanded_idx_to_permuted_idx, dtypes=(torch.int32,),
                 shape=(num_tokens * top_k,))
    _checks.check_same_device(act_permuted=act_permuted, expanded_idx_to_permuted_idx=expanded_idx_to_permuted_idx)
    _checks.check_contiguous("act_permuted", act_permuted)
    _check_map(expanded_idx_to_permuted_idx, act_permuted.shape[0], validate)
    if not _use_triton(act_permuted.device, use_triton):
        return unpermute_torch(act_permuted, expanded_idx_to_permuted_idx)
    from moelab.kernels.unpermute import unpermute_activation_triton

    return unpermute_activation_triton(act_permuted, expanded_idx_to_permuted_idx)


def finalize_with_w2_lora(output: torch.Tensor, gemm2_output: torch.Tensor, expert_weights: torch.Tensor,
                          expanded_idx_to_permuted_idx: torch.Tensor, w2_delta: torch.Tensor | None, *,
                          scale: float = 1.0, validate: bool = True, use_triton: bool | None = None) -> torch.Tensor:
    """``out[t] = scale * sum_{k: map>=0} w[t,k] * gemm2[map[t*K+k]] + sum_k w2_delta[t,k]``, fp32, one write.

    Args:
        output: [T, H] written in place and returned (bf16/fp16/fp32).
        gemm2_output: [R2, H] permuted, unweighted (from ``routed_moe(..., do_finalize=False)``).
        expert_weights: [T, K] (bf16 decoded, or the caller's fp32).
        expanded_idx_to_permuted_idx: int32 [T*K].
        w2_delta: [T, K, H], already weighted by the routing weights, or None.
        scale: multiplies the base sum only (vLLM passes 1.0).
        validate: as in :func:`unpermute_activation` (rows outside ``[-1, R2)`` rejected; without it skipped).

    ``output`` must not share memory with any input (a ``ValueError`` otherwise). Returns ``output``.

    Example:
        >>> gemm2 = torch.tensor([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]])        # R2 = 3 permuted rows, H = 2
        >>> weights = torch.tensor([[0.5, 0.25]]); e2p = torch.tensor([1, 2], dtype=torch.int32)  # T = 1, K = 2
        >>> delta = torch.full((1, 2, 2), 0.5)                                 # already weighted W2 LoRA delta
        >>> finalize_with_w2_lora(torch.empty(1, 2), gemm2, weights, e2p, delta).tolist()  # 0.5*2 + 0.25*4 + 1
        [[3.0, 3.0]]
    """
    check_tensor("output", output, dtypes=FLOAT_DTYPES, ndim=2)
    T, H = output.shape
    check_tensor("gemm2_output", gemm2_output, dtypes=FLOAT_DTYPES, shape=(None, H))
    check_tensor("expert_weights", expert_weights, dtypes=FLOAT_DTYPES, shape=(T, None))
    K = expert_weights.shape[1]
    if K < 1:
        raise ValueError(f"expert_weights: expected at least one column (top_k >= 1), got shape "
                         f"{list(expert_weights.shape)}")
    check_tensor("expanded_idx_to_permuted_idx", expanded_idx_to_permuted_idx, dtypes=(torch.int32,), shape=(T * K,))
    if w2_delta is not None:
        check_tensor("w2_delta", w2_delta, dtypes=FLOAT_DTYPES, shape=(T, K, H))
        _checks.check_contiguous("w2_delta", w2_delta)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale}")
    _checks.check_same_device(output=output, gemm2_output=gemm2_output, expert_weights=expert_weights,
                              expanded_idx_to_permuted_idx=expanded_idx_to_permuted_idx, w2_delta=w2_delta)
    for name, t in (("output", output), ("gemm2_output", gemm2_output)):
        _checks.check_contiguous(name, t)
    _checks.check_no_overlap("output", output, gemm2_output=gemm2_output, expert_weights=expert_weights,
                             expanded_idx_to_permuted_idx=expanded_idx_to_permuted_idx, w2_delta=w2_delta)
    _check_map(expanded_idx_to_permuted_idx, gemm2_output.shape[0], validate)
    if T == 0:
        return output
    if not _use_triton(output.device, use_triton):
        return finalize_torch(output, gemm2_output, expert_weights, expanded_idx_to_permuted_idx, w2_delta, scale)
    from moelab.kernels.finalize import finalize_triton

    return finalize_triton(output, gemm2_output, expert_weights.contiguous(), expanded_idx_to_permuted_idx,
                           w2_delta, scale)
