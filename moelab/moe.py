"""The routed-MoE front end: ``prepare_weights`` and ``routed_moe``, dispatched to a backend.

This module validates a call, bundles it as a :class:`moelab.contract.RoutedMoECall` (the data every backend
receives; the index arrays are named there) and assembles FlashInfer's return table from the backend's
:class:`moelab.contract.RoutedMoEResult`; the arithmetic lives in ``moelab/backends/<name>_backend.py``.
"""

from __future__ import annotations

import torch

from moelab import _checks
from moelab._checks import FLOAT_DTYPES, INT_DTYPES, check_int, check_tensor
from moelab.backends import available_backends, get_backend, resolve_backend
from moelab.contract import MoEWeights, RoutedMoECall, RoutedMoEResult, permuted_rows

__all__ = ["MoEWeights", "RoutedMoECall", "RoutedMoEResult", "prepare_weights", "routed_moe",
           "permuted_rows", "available_backends"]


def prepare_weights(w13: torch.Tensor, w2: torch.Tensor, backend: str = "auto") -> MoEWeights:
    """Convert HF-order expert weights to ``backend``'s layout.

    Args:
        w13: [E_local, 2I, H], rows ``[gate; up]`` (Hugging Face / vLLM order); bf16, fp16 or fp32.
        w2: [E_local, H, I], same dtype and device.
        backend: "auto", "torch", "triton" or "flashinfer" (see :func:`available_backends`).

    Example:
        >>> w13, w2 = torch.randn(4, 64, 32), torch.randn(4, 32, 32)
        >>> prepare_weights(w13, w2, backend="torch").intermediate_size
        32
    """
    E_local, H, I = _checks.check_expert_weights(w13, w2)
    name = resolve_backend(backend, w13.device)
    g1, g2 = get_backend(name).prepare(w13, w2)
    return MoEWeights(name, g1, g2, E_local, H, I)


def routed_moe(topk, hidden_states: torch.Tensor, weights: MoEWeights, *, num_experts: int, top_k: int,
               local_expert_offset: int = 0, gemm1_lora_delta: torch.Tensor | None = None,
               do_finalize: bool = True, output: torch.Tensor | None = None,
               validate: bool = True) -> list[torch.Tensor]:
    """FlashInfer's ``trtllm_bf16_routed_moe`` contract on any backend (docs/contract.md §3).

    Args:
        topk: packed int32 [T, K] (see :func:`moelab.pack_topk_ids_weights`) or ``(ids int [T,K], weights [T,K])``.
        hidden_states: [T, H], the dtype of ``weights``.
        weights: from :func:`prepare_weights` (local experts only).
        num_experts: global E; ``top_k``: K.
        local_expert_offset: first global id of this rank's window ``[offset, offset + E_local)``.
        gemm1_lora_delta: [T, K, 2I] in **[up, gate]** order, the input dtype, added before SwiGLU, unweighted.
        do_finalize: reduce over top-k into ``output`` (True) or return the permuted, unfinalized tensors.
        output: [T, H], written in place and returned when ``do_finalize``.
        validate: read ids on the device to reject out-of-range or duplicate ids (a host sync). Pass False
            under CUDA-graph capture and in benchmarks.

    Returns (always a list):
        finalize, no delta:  ``[output]``
        finalize, delta:     ``[output, expanded_idx_to_permuted_idx, gemm1_activation_output]``
        no finalize:         ``[gemm2_output, expert_weights, expanded_idx_to_permuted_idx]``,
                             plus ``gemm1_activation_output`` when a delta is given

    Example:
        >>> w = prepare_weights(torch.randn(4, 64, 32), torch.randn(4, 32, 32), backend="torch")
        >>> x = torch.randn(3, 32); ids = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32)
        >>> routed_moe((ids, torch.rand(3, 2)), x, w, num_experts=4, top_k=2)[0].shape
        torch.Size([3, 32])
    """
    call = validate_call(topk, hidden_states, weights, num_experts, top_k, local_expert_offset, gemm1_lora_delta,
                         do_finalize, output, validate)
    result = get_backend(weights.backend).routed_moe(call)
    if do_finalize:
        if gemm1_lora_delta is None:
            return [result.output]
        return [result.output, result.expanded_idx_to_permuted_idx, result.gemm1_activation_output]
    outs = [result.gemm2_output, call.expert_weights, result.expanded_idx_to_permuted_idx]
    if gemm1_lora_delta is not None:
        outs.append(result.gemm1_activation_output)
    return outs


def validate_call(topk, hidden_states, weights, num_experts, top_k, local_expert_offset, gemm1_lora_delta,
                  do_finalize, output, validate) -> RoutedMoECall:
    """Check :func:`routed_moe`'s arguments (docs/contract.md §7 errors) and bundle them; ``validate`` adds the id
    checks that read the device."""
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights: expected MoEWeights from prepare_weights(), got {type(weights).__name__}")
    E_local, H, I = weights.num_local_experts, weights.hidden_size, weights.intermediate_size
    check_int("num_experts", num_experts, low=1, high=_checks.MAX_EXPERTS)
    check_int("top_k", top_k, low=1, high=num_experts)
    if E_local > num_experts:
        raise ValueError(f"weights: expected at most num_experts={num_experts} local experts, got {E_local}")
    check_int("local_expert_offset", local_expert_offset, low=0, high=num_experts - E_local)
    check_tensor("hidden_states", hidden_states, dtypes=FLOAT_DTYPES, ndim=2)
    _checks.check_dtype("hidden_states", hidden_states, weights.dtype, "the weights")
    T = hidden_states.shape[0]
    check_tensor("hidden_states", hidden_states, shape=(None, H))
    if isinstance(topk, tuple):
        if len(topk) != 2:
            raise ValueError(f"topk: expected (ids, weights), got a tuple of {len(topk)}")
        ids, expert_weights = topk
        check_tensor("topk[0] (ids)", ids, dtypes=INT_DTYPES, shape=(T, top_k))
        check_tensor("topk[1] (weights)", expert_weights, dtypes=FLOAT_DTYPES, shape=(T, top_k))
        packed = None
        _checks.check_same_device(weights=weights.gemm1_weights, topk_ids=ids, expert_weights=expert_weights)
    else:
        check_tensor("topk", topk, dtypes=(torch.int32,), shape=(T, top_k))
        packed = topk.contiguous()
        _checks.check_same_device(weights=weights.gemm1_weights, topk=packed)
    if gemm1_lora_delta is not None:
        check_tensor("gemm1_lora_delta", gemm1_lora_delta, dtypes=FLOAT_DTYPES, shape=(T, top_k, 2 * I))
        _checks.check_dtype("gemm1_lora_delta", gemm1_lora_delta, weights.dtype, "the weights")
        _checks.check_contiguous("gemm1_lora_delta", gemm1_lora_delta)
    if output is not None:
        if not do_finalize:
            raise ValueError("output: only written when do_finalize=True; pass output=None")
        check_tensor("output", output, dtypes=FLOAT_DTYPES, shape=(T, H))
        _checks.check_dtype("output", output, weights.dtype, "the weights")
        _checks.check_contiguous("output", output)
    _checks.check_same_device(weights=weights.gemm1_weights, hidden_states=hidden_states,
                              gemm1_lora_delta=gemm1_lora_delta, output=output)
    call = RoutedMoECall(topk, packed, hidden_states.contiguous(), weights, num_experts, top_k, local_expert_offset,
                         gemm1_lora_delta, do_finalize, output)
    if validate:  # tuple ids are checked as given: an int64 id >= 2**31 must not wrap into range by the int32 cast
        _checks.check_expert_ids("topk (expert ids)", ids if packed is None else call.topk_ids, num_experts)
    return call
