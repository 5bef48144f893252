"""Backend "torch": the routed-MoE contract in plain PyTorch, any device, bf16/fp16/fp32.

The executable, readable form of docs/contract.md §3 and the slow fallback: a Python loop over local experts, each a
gather, two fp32 matmuls and a scatter into permuted space. It runs every expert activation (SwiGLU, GELU(-tanh)
gated, GPT-OSS's clamped SwiGLU, non-gated relu2/gelu/silu), GEMM biases and the router weight on the input. It
synchronises with the host (``nonzero``) and so is not CUDA-graph capturable; the triton backend is.
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


def expert_options_reason(**options) -> str | None:
    """Every activation, bias and the router weight on the input run here."""
    return None


def _act(name: str, v: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return torch.nn.functional.silu(v)
    if name == "gelu":
        return torch.nn.functional.gelu(v)
    if name == "gelu_tanh":
        return torch.nn.functional.gelu(v, approximate="tanh")
    if name == "relu2":
        return torch.relu(v).square()
    raise ValueError(f"activation: unknown activation {name!r}")


def activate(gate: torch.Tensor | None, up: torch.Tensor, *, activation: str = "silu", gated: bool = True,
             swiglu_alpha: float | None = None, swiglu_limit: float | None = None) -> torch.Tensor:
    """The expert activation (see :func:`moelab.prepare_weights`) on fp32 ``gate`` / ``up`` [n, I] (``gate``
    None when not gated)."""
    if not gated:
        return _act(activation, up)
    if activation == "swigluoai" and swiglu_limit is None:
        swiglu_limit = 7.0
    if swiglu_limit is not None:
        gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
    if activation == "swigluoai":
        alpha = 1.702 if swiglu_alpha is None else swiglu_alpha
        return gate * torch.sigmoid(alpha * gate) * (up + 1.0)
    return _act(activation, gate) * up


def routed_moe(call: RoutedMoECall) -> RoutedMoEResult:
    x, ids, W = call.hidden_states, call.topk_ids, call.weights
    T, K = ids.shape
    E_local, H, I = W.num_local_experts, W.hidden_size, W.intermediate_size
    tile = default_tile(T, K, E_local)
    e2p = expanded_to_permuted_torch(ids, call.local_expert_offset, E_local, tile)
    fill = _runtime.dead_row_fill()
    act_perm = torch.full((permuted_rows(T, K, call.num_experts, tile, I), I), fill, dtype=x.dtype, device=x.device)
    gemm2 = torch.full((permuted_rows(T, K, call.num_experts, tile, H), H), fill, dtype=x.dtype, device=x.device)
    local_expert = local_expert_of_slot(ids, call.local_expert_offset)
    delta = None
    if call.gemm1_lora_delta is not None:
        delta = call.gemm1_lora_delta.reshape(T * K, call.gemm1_lora_delta.shape[-1])
    on_input = call.apply_router_weight_on_input
    slot_weights = call.expert_weights.reshape(-1) if on_input else None
    options = dict(activation=W.activation, gated=W.gated, swiglu_alpha=W.swiglu_alpha, swiglu_limit=W.swiglu_limit)
    for e in range(E_local):
        slots = (local_expert == e).nonzero().squeeze(1)  # expanded indices, ascending = token-ascending
        if slots.numel() == 0:
            continue
        xs = x[slots // K]
        if on_input:  # Llama-4: the expert sees w * x, rounded to the input dtype as the model rounds it
            xs = (xs.float() * slot_weights[slots].float()[:, None]).to(x.dtype)
        h = xs.float() @ W.gemm1_weights[e].float().T  # [n, 2I], HF order: [gate | up] (not gated: [n, I] up)
        if W.gemm1_bias is not None:
            h = h + W.gemm1_bias[e].float()
        # Contiguous halves, with or without a delta: PyTorch's SiLU and product round a vectorised body and a
        # scalar tail differently, so strided views here would move fp32 base tokens of the LoRA path by an ulp.
        gate, up = (h[:, :I].contiguous(), h[:, I:].contiguous()) if W.gated else (None, h)
        if delta is not None:
            d = delta[slots].float()
            up = up + d[:, :I]  # the delta is in FlashInfer order: up first
            if W.gated:
                gate = gate + d[:, I:]
        act = activate(gate, up, **options).to(x.dtype)  # rounded once to the input dtype
        y = act.float() @ W.gemm2_weights[e].float().T
        if W.gemm2_bias is not None:
            y = y + W.gemm2_bias[e].float()
        rows = e2p[slots].long()
        act_perm[rows] = act
        gemm2[rows] = y.to(x.dtype)
    output = None
    if call.do_finalize:
        out = call.output if call.output is not None else torch.empty(T, H, dtype=x.dtype, device=x.device)
        weights = torch.ones_like(call.expert_weights) if on_input else call.expert_weights
        output = finalize_torch(out, gemm2, weights, e2p, None)
    return RoutedMoEResult(output, gemm2, e2p, act_perm)


def lora_experts(call: LoRAExpertsCall) -> torch.Tensor:
    """vLLM's unfused flow with the torch fallbacks of moelab's LoRA ops (no Triton anywhere)."""
    return lora_flow.lora_experts(call, routed_moe, use_triton=False)


fused_lora_reason = lora_flow.no_fused_lora
