"""Backend "torch": the routed-MoE contract in plain PyTorch, any device, bf16/fp16/fp32.

The executable, readable form of docs/contract.md §3 and the slow fallback: a Python loop over local experts, each a
gather, two fp32 matmuls and a scatter into permuted space. It synchronises with the host (``nonzero``) and
so is not CUDA-graph capturable; the triton backend is.
"""

from __future__ import annotations

import torch

from moelab import _runtime
from moelab.backends import lora_flow
from moelab.contract import LoRAExpertsCall, RoutedMoECall, RoutedMoEResult, permuted_rows
from moelab.ops import finalize_torch
from moelab.permutation import default_tile, expanded_to_permuted_torch, local_expert_of_slot


def unavailable_reason(device: torch.device) -> str | None:
    return None


def prepare(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return w13.contiguous(), w2.contiguous()


def routed_moe(call: RoutedMoECall) -> RoutedMoEResult:
    x, ids, W = call.hidden_states, call.topk_ids, call.weights
    T, K = ids.shape
    E_local, H, I = W.num_local_experts, W.hidden_size, W.intermediate_size
    tile = default_tile(T, K, E_local)
    e2p = expanded_to_permuted_torch(ids, call.local_expert_offset, E_local, tile)
    fill = float("nan") if _runtime.DEBUG_DEAD_ROWS else 0.0
    act_perm = torch.full((permuted_rows(T, K, call.num_experts, tile, I), I), fill, dtype=x.dtype, device=x.device)
    gemm2 = torch.full((permuted_rows(T, K, call.num_experts, tile, H), H), fill, dtype=x.dtype, device=x.device)
    local_expert = local_expert_of_slot(ids, call.local_expert_offset)
    delta = None if call.gemm1_lora_delta is None else call.gemm1_lora_delta.reshape(T * K, 2 * I)
    for e in range(E_local):
        slots = (local_expert == e).nonzero().squeeze(1)  # expanded indices, ascending = token-ascending
        if slots.numel() == 0:
            continue
        h = x[slots // K].float() @ W.gemm1_weights[e].float().T  # [n, 2I], HF order: [gate | up]
        gate, up = h[:, :I], h[:, I:]
        if delta is not None:
            d = delta[slots].float()
            up = up + d[:, :I]  # the delta is in FlashInfer order: up first
            gate = gate + d[:, I:]
        act = (torch.nn.functional.silu(gate) * up).to(x.dtype)  # rounded once to the input dtype
        y = (act.float() @ W.gemm2_weights[e].float().T).to(x.dtype)
        rows = e2p[slots].long()
        act_perm[rows] = act
        gemm2[rows] = y
    output = None
    if call.do_finalize:
        out = call.output if call.output is not None else torch.empty(T, H, dtype=x.dtype, device=x.device)
        output = finalize_torch(out, gemm2, call.expert_weights, e2p, None)
    return RoutedMoEResult(output, gemm2, e2p, act_perm)


def lora_experts(call: LoRAExpertsCall) -> torch.Tensor:
    """vLLM's unfused flow with the torch fallbacks of moelab's LoRA ops (no Triton anywhere)."""
    return lora_flow.lora_experts(call, routed_moe, use_triton=False)


fused_lora_reason = lora_flow.no_fused_lora
