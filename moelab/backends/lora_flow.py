"""vLLM's unfused MoE-LoRA flow (``TrtLlmBf16LoRAExperts.apply``) on any backend's ``routed_moe``: the one
implementation of ``lora_experts`` every backend falls back on.

    pack routing (the triton backend: the ids and bf16 weights the words decode to)
    -> [no adapter in the batch: the finalized base MoE straight into ``output``]
    W13 delta [T,K,2I] in [up, gate] order -> routed MoE, unfinalized (gemm2 [R2,H], act [R1,I], map [T*K])
    -> unpermute act to [T*K, I] (non-local rows zero) -> W2 delta [T,K,H], weighted -> one fused finalize

A token without an adapter comes out bit for bit as the base path computes it: its delta rows are exact zeros,
the GEMMs run the same tiles, and the finalize finishes the base sum before it adds the (zero) LoRA sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moelab.contract import LoRAExpertsCall, RoutedMoECall, RoutedMoEResult
from moelab.lora import LoRABank, lora_segments, w2_lora_delta, w13_lora_delta
from moelab.ops import _use_triton, finalize_with_w2_lora, unpermute_activation
from moelab.packing import pack_topk_ids_weights


def lora_experts(call: LoRAExpertsCall, routed_moe: Callable[[RoutedMoECall], RoutedMoEResult], *,
                 use_triton: bool | None = None, pack: bool = True) -> torch.Tensor:
    """``call`` through ``routed_moe`` (a backend's, taking a :class:`~moelab.contract.RoutedMoECall`) and
    moelab's standalone LoRA ops; ``use_triton`` as in :func:`moelab.w13_lora_delta` (the torch backend passes
    False). ``pack``: hand ``routed_moe`` FlashInfer's packed words, as vLLM does; False: the (int32 ids, bf16
    weights) pair they would decode to, the same values without the packing's four launches (the triton backend's
    kernels read either). Writes and returns ``call.output`` [T, H]."""
    x, ids, W = call.hidden_states, call.topk_ids, call.weights
    T, K = ids.shape
    # What decoding the packed words gives (the finalize's weights, a torch backend's ids), without its five
    # launches; packing them again rounds nothing (bf16 to bf16, int32 to int32 are the tensors themselves).
    decoded = (ids.to(torch.int32).contiguous(), call.topk_weights.to(torch.bfloat16))
    packed = pack_topk_ids_weights(*decoded, validate=False) if pack else None  # checked by the caller

    def moe_call(delta: torch.Tensor | None, do_finalize: bool) -> RoutedMoECall:
        return RoutedMoECall(decoded if packed is None else packed, packed, x, W, call.num_experts, K,
                             call.local_expert_offset, delta, do_finalize, call.output if do_finalize else None,
                             _decoded=decoded)

    if call.lora is None:
        routed_moe(moe_call(None, True))  # writes call.output
        return call.output
    bank, lora_ids, offset = call.lora, call.lora_ids, call.local_expert_offset
    per_slot = {"flow-per-slot": True, "flow-grouped": False}.get(call.path)  # None: by batch size
    if per_slot and not _use_triton(x.device, use_triton):
        raise ValueError("fused: 'flow-per-slot' runs moelab's Triton delta kernel, and this backend's flow runs its "
                         "torch fallback here; pass fused=False or 'flow-grouped'")
    lora_args = dict(local_expert_offset=offset, validate=False, use_triton=use_triton, per_slot=per_slot)
    segments = lora_segments(ids, lora_ids, bank, local_expert_offset=offset, per_slot=per_slot)
    delta = w13_lora_delta(x, ids, lora_ids, bank, segments=segments, **lora_args)
    unfinalized = moe_call(delta, False)
    result = routed_moe(unfinalized)
    e2p = result.expanded_idx_to_permuted_idx
    act = unpermute_activation(result.gemm1_activation_output, e2p, T, K, validate=False, use_triton=use_triton)
    w2_delta = w2_lora_delta(act, ids, call.topk_weights, lora_ids, bank, segments=segments, **lora_args)
    # validate=False: the map comes from routed_moe itself, in range by construction (and no host sync).
    return finalize_with_w2_lora(call.output, result.gemm2_output, unfinalized.expert_weights, e2p, w2_delta,
                                 validate=False, use_triton=use_triton)


def no_fused_lora(bank: LoRABank, path: str | None = None) -> str:
    """``fused_lora_reason`` of a backend whose kernels take no LoRA bank."""
    return "only the triton backend folds a LoRA bank into its kernels"
