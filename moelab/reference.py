"""The float64 truth: readable per-token loops for every public function of moelab (docs/contract.md §6).

Nothing here is fast and nothing here is clever: each function states the contract in the plainest Python
we could write, in float64 on the CPU. Kernels, notebooks and benchmarks are all checked against it.
Inputs may be any dtype/device; results are float64 CPU tensors.
"""

from __future__ import annotations

import math
import struct

import torch

from moelab.contract import ACTIVATIONS  # (activation, gated) pairs the contract accepts

__all__ = [
    "bf16_round", "pack_topk_ids_weights", "unpack_topk_ids_weights", "route", "routed_moe",
    "unpermute_activation", "finalize_with_w2_lora", "w13_lora_delta", "w2_lora_delta", "lora_experts",
    "ACTIVATIONS", "apply_activation",
]


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu", torch.float64)


# ---------------------------------------------------------------------------------------------- packing

def _bf16_bits_of(value: float) -> int:
    """16-bit pattern of ``value`` (as float32) rounded to bfloat16, round-to-nearest-even."""
    (bits32,) = struct.unpack("<I", struct.pack("<f", value))
    if math.isnan(value):
        return 0x7FC0
    lsb = (bits32 >> 16) & 1
    return ((bits32 + 0x7FFF + lsb) >> 16) & 0xFFFF


def _bf16_value_of(bits16: int) -> float:
    (value,) = struct.unpack("<f", struct.pack("<I", (bits16 & 0xFFFF) << 16))
    return value


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """Each element rounded to the nearest bfloat16 (ties to even), as float64."""
    flat = [_bf16_value_of(_bf16_bits_of(v)) for v in _f64(x).flatten().tolist()]
    return torch.tensor(flat, dtype=torch.float64).reshape(x.shape)


def pack_topk_ids_weights(topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """int32 [T,K]: high 16 bits the expert id, low 16 bits the bf16 pattern of the weight."""
    words = []
    for expert, weight in zip(topk_ids.flatten().tolist(), _f64(topk_weights).flatten().tolist()):
        word = (expert << 16) | _bf16_bits_of(weight)  # the low half is masked to 16 bits by construction
        words.append(word - (1 << 32) if word >= (1 << 31) else word)  # as a signed int32
    return torch.tensor(words, dtype=torch.int32).reshape(topk_ids.shape)


def unpack_topk_ids_weights(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [T,K], weights float64 [T,K]) from packed words."""
    ids, weights = [], []
    for word in packed.flatten().tolist():
        ids.append(word >> 16)  # Python's >> on a negative int is arithmetic, like int32 >> 16
        weights.append(_bf16_value_of(word & 0xFFFF))
    shape = packed.shape
    ids_t = torch.tensor(ids, dtype=torch.int32).reshape(shape)
    return ids_t, torch.tensor(weights, dtype=torch.float64).reshape(shape)


# ---------------------------------------------------------------------------------------------- routing

def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _top(scores: list[float], k: int) -> list[int]:
    """Indices of the k largest scores, largest first (ties: lower index first)."""
    return sorted(range(len(scores)), key=lambda e: (-scores[e], e))[:k]


def route(router_logits, top_k, method="renormalize", *, n_group=None, topk_group=None,
          correction_bias=None, routed_scaling_factor=1.0):
    """(topk_weights float64 [T,K], topk_ids int32 [T,K]), ids ordered by descending selection score."""
    logits = _f64(router_logits).tolist()
    bias = _f64(correction_bias).tolist() if correction_bias is not None else None
    all_w, all_ids = [], []
    for row in logits:
        num_experts = len(row)
        if method in ("softmax", "renormalize_naive"):
            z = max(row)
            p = [math.exp(v - z) for v in row]
            p = [v / sum(p) for v in p]
            ids = _top(p, top_k)
            w = [p[e] for e in ids]
            if method == "renormalize_naive":
                w = [v / sum(w) for v in w]
        elif method == "renormalize":
            ids = _top(row, top_k)
            z = max(row[e] for e in ids)
            w = [math.exp(row[e] - z) for e in ids]
            w = [v / sum(w) for v in w]
        elif method == "sigmoid":
            s = [_sigmoid(v) for v in row]
            ids = _top(s, top_k)
            w = [s[e] for e in ids]
        elif method == "llama4":
            ids = _top(row, 1)
            w = [_sigmoid(row[ids[0]])]
        elif method == "deepseek_v3":
            s = [_sigmoid(v) for v in row]
            biased = [s[e] + (bias[e] if bias is not None else 0.0) for e in range(num_experts)]
            groups = n_group or 1
            size = num_experts // groups
            group_score = []
            for g in range(groups):
                members = sorted((biased[e] for e in range(g * size, (g + 1) * size)), reverse=True)
                group_score.append(sum(members[:2]))
            kept = set(_top(group_score, topk_group or groups))
            masked = [biased[e] if e // size in kept else -math.inf for e in range(num_experts)]
            ids = _top(masked, top_k)
            w = [s[e] for e in ids]  # selection uses the bias, the weights do not
            w = [v / sum(w) for v in w]
        else:
            raise ValueError(f"method: unknown routing method {method!r}")
        all_w.append([v * routed_scaling_factor for v in w])
        all_ids.append(ids)
    T, K = len(logits), (1 if method == "llama4" else top_k)
    return (torch.tensor(all_w, dtype=torch.float64).reshape(T, K),
            torch.tensor(all_ids, dtype=torch.int32).reshape(T, K))


# ---------------------------------------------------------------------------------------------- routed MoE

def _silu(v: torch.Tensor) -> torch.Tensor:
    return v / (1.0 + torch.exp(-v))


def _act(name: str, v: torch.Tensor) -> torch.Tensor:
    """The pointwise function ``name`` in float64."""
    if name == "silu":
        return _silu(v)
    if name == "gelu":  # exact: x * Phi(x)
        return 0.5 * v * (1.0 + torch.erf(v / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * v * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))
    if name == "relu2":
        return torch.clamp(v, min=0.0) ** 2
    raise ValueError(f"activation: unknown activation {name!r}")


def _gated(name: str, gate: torch.Tensor, up: torch.Tensor, swiglu_alpha, swiglu_limit) -> torch.Tensor:
    if name == "swigluoai" and swiglu_limit is None:
        swiglu_limit = 7.0
    if swiglu_limit is not None:
        gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
    if name == "swigluoai":
        alpha = 1.702 if swiglu_alpha is None else swiglu_alpha
        return gate / (1.0 + torch.exp(-alpha * gate)) * (up + 1.0)
    return _act(name, gate) * up


def apply_activation(h: torch.Tensor, activation: str = "silu", *, gated: bool = True,
                     swiglu_alpha: float | None = None, swiglu_limit: float | None = None) -> torch.Tensor:
    """An expert's activation of GEMM1's output ``h`` [..., 2I] (gated: [gate; up]) or [..., I] (not gated).

    Gated: ``act(gate) * up``; with ``swiglu_limit`` L, gate is first clamped to ``<= L`` and up to ``[-L, L]``.
    ``"swigluoai"`` (GPT-OSS): ``gate * sigmoid(alpha * gate) * (up + 1)``, alpha default 1.702, L default 7.
    Not gated: ``act(h)``; ``"relu2"`` is ``relu(h)**2``.
    """
    if (activation, gated) not in ACTIVATIONS:
        raise ValueError(f"activation: {activation!r} with gated={gated} is not one of {sorted(ACTIVATIONS)}")
    h = _f64(h)
    if not gated:
        return _act(activation, h)
    I = h.shape[-1] // 2
    return _gated(activation, h[..., :I], h[..., I:], swiglu_alpha, swiglu_limit)


def routed_moe(topk_ids, topk_weights, hidden_states, w13, w2, *, local_expert_offset=0,
               gemm1_lora_delta=None, activation="silu", gated=True, w13_bias=None, w2_bias=None,
               swiglu_alpha=None, swiglu_limit=None, apply_router_weight_on_input=False) -> dict[str, torch.Tensor]:
    """docs/contract.md §3 in float64, per slot.

    Args:
        topk_ids: int [T,K] global ids; topk_weights [T,K] (the weights the kernel uses, e.g. bf16-decoded).
        hidden_states [T,H]; w13 [E_local,2I,H] HF order (rows [gate; up]), or [E_local,I,H] (up) when not
            ``gated``; w2 [E_local,H,I].
        gemm1_lora_delta: [T,K,2I] in **[up, gate]** order (not gated: [T,K,I], up only), added before the
            activation, unweighted.
        activation, gated, swiglu_alpha, swiglu_limit: the expert activation (:func:`apply_activation`).
        w13_bias: [E_local, 2I] (not gated: [E_local, I]) added to GEMM1's output, in w13's row order;
            w2_bias: [E_local, H] added to GEMM2's output (both before the routing weight).
        apply_router_weight_on_input: scale the expert's *input* by the routing weight and sum the expert
            outputs unweighted (Llama-4), instead of weighting the outputs.

    Returns dict of float64 tensors:
        ``output [T,H]``, ``act [T*K,I]`` (activation output per expanded slot), ``gemm2 [T*K,H]`` (unweighted
        expert output per expanded slot), ``local [T*K] bool``. Non-local slots are zero rows.
    """
    if (activation, gated) not in ACTIVATIONS:
        raise ValueError(f"activation: {activation!r} with gated={gated} is not one of {sorted(ACTIVATIONS)}")
    x, w, W13, W2 = _f64(hidden_states), _f64(topk_weights), _f64(w13), _f64(w2)
    b13 = _f64(w13_bias) if w13_bias is not None else None
    b2 = _f64(w2_bias) if w2_bias is not None else None
    delta = _f64(gemm1_lora_delta) if gemm1_lora_delta is not None else None
    T, K = topk_ids.shape
    E_local, H, I = W2.shape
    out = torch.zeros(T, H, dtype=torch.float64)
    act = torch.zeros(T * K, I, dtype=torch.float64)
    gemm2 = torch.zeros(T * K, H, dtype=torch.float64)
    local = torch.zeros(T * K, dtype=torch.bool)
    ids = topk_ids.tolist()
    for t in range(T):
        for k in range(K):
            e = ids[t][k] - local_expert_offset
            if not 0 <= e < E_local:
                continue
            x_in = w[t, k] * x[t] if apply_router_weight_on_input else x[t]
            h = W13[e] @ x_in
            if b13 is not None:
                h = h + b13[e]
            gate, up = (h[:I].clone(), h[I:].clone()) if gated else (None, h.clone())
            if delta is not None:
                up += delta[t, k, :I]  # FlashInfer order: the first half of the delta is up
                if gated:
                    gate += delta[t, k, I:]
            a = _gated(activation, gate, up, swiglu_alpha, swiglu_limit) if gated else _act(activation, up)
            y = W2[e] @ a
            if b2 is not None:
                y = y + b2[e]
            act[t * K + k], gemm2[t * K + k], local[t * K + k] = a, y, True
            out[t] += y if apply_router_weight_on_input else w[t, k] * y
    return {"output": out, "act": act, "gemm2": gemm2, "local": local}


def unpermute_activation(act_permuted, expanded_idx_to_permuted_idx, num_tokens, top_k) -> torch.Tensor:
    """[T*K, I]: row r is ``act_permuted[map[r]]``, or zeros where ``map[r] == -1``."""
    a = _f64(act_permuted)
    out = torch.zeros(num_tokens * top_k, a.shape[1], dtype=torch.float64)
    for r, p in enumerate(expanded_idx_to_permuted_idx.tolist()):
        if p >= 0:
            out[r] = a[p]
    return out


def finalize_with_w2_lora(gemm2_output, expert_weights, expanded_idx_to_permuted_idx, w2_delta, *, scale=1.0):
    """[T,H]: ``scale * sum_{k: map>=0} w[t,k] * gemm2[map[t*K+k]] + sum_k w2_delta[t,k]``."""
    y, w, d = _f64(gemm2_output), _f64(expert_weights), _f64(w2_delta)
    T, K = w.shape
    out = torch.zeros(T, y.shape[1], dtype=torch.float64)
    mapping = expanded_idx_to_permuted_idx.tolist()
    for t in range(T):
        for k in range(K):
            p = mapping[t * K + k]
            if p >= 0:
                out[t] += scale * w[t, k] * y[p]
            out[t] += d[t, k]
    return out


# ---------------------------------------------------------------------------------------------- LoRA

def _adapter_slots(topk_ids, lora_ids, local_expert_offset, num_local_experts):
    """(t, k, adapter slot, local expert) of every local slot whose token has an adapter."""
    ids, adapters = topk_ids.tolist(), lora_ids.tolist()
    for t, adapter in enumerate(adapters):
        for k, expert in enumerate(ids[t]):
            e = expert - local_expert_offset
            if adapter >= 0 and 0 <= e < num_local_experts:
                yield t, k, adapter, e


def w13_lora_delta(hidden_states, topk_ids, lora_ids, bank, *, local_expert_offset=0) -> torch.Tensor:
    """[T,K,2I] in [up, gate] order: ``cat(B_up (A_up x), B_gate (A_gate x))`` for local slots with an adapter.

    ``bank`` has ``gate_a, up_a [L,E_local,r,H]``, ``gate_b, up_b [L,E_local,I,r]`` (scaling already in B).
    """
    x = _f64(hidden_states)
    T, K = topk_ids.shape
    E_local, I = bank.gate_b.shape[1], bank.gate_b.shape[2]
    ga, gb, ua, ub = (_f64(t) for t in (bank.gate_a, bank.gate_b, bank.up_a, bank.up_b))
    delta = torch.zeros(T, K, 2 * I, dtype=torch.float64)
    for t, k, slot, e in _adapter_slots(topk_ids, lora_ids, local_expert_offset, E_local):
        delta[t, k, :I] = ub[slot, e] @ (ua[slot, e] @ x[t])  # FlashInfer order: up first
        delta[t, k, I:] = gb[slot, e] @ (ga[slot, e] @ x[t])
    return delta


def w2_lora_delta(act, topk_ids, topk_weights, lora_ids, bank, *, local_expert_offset=0) -> torch.Tensor:
    """[T,K,H]: ``w[t,k] * B_down (A_down act[t*K+k])`` for local slots with an adapter, else zeros.

    ``act`` is the unpermuted activation [T*K, I]; ``bank`` has ``down_a [L,E_local,r,I]``,
    ``down_b [L,E_local,H,r]``.
    """
    a, w = _f64(act), _f64(topk_weights)
    da, db = _f64(bank.down_a), _f64(bank.down_b)
    T, K = topk_ids.shape
    E_local, H = db.shape[1], db.shape[2]
    delta = torch.zeros(T, K, H, dtype=torch.float64)
    for t, k, slot, e in _adapter_slots(topk_ids, lora_ids, local_expert_offset, E_local):
        delta[t, k] = w[t, k] * (db[slot, e] @ (da[slot, e] @ a[t * K + k]))
    return delta


def lora_experts(hidden_states, topk_weights, topk_ids, lora_ids, w13, w2, bank, *,
                 local_expert_offset=0, round_weights=True, **expert_options) -> dict[str, torch.Tensor]:
    """The whole LoRA-MoE forward of docs/contract.md §5 (vLLM's ``TrtLlmBf16LoRAExperts.apply``), float64.

    The base term uses the weights as packing rounds them (bf16; ``round_weights=False``: the caller's own, as the
    Hugging Face integration runs it); the W2 LoRA term uses the caller's weights. ``expert_options`` are
    :func:`routed_moe`'s ``activation, gated, w13_bias, w2_bias, swiglu_alpha, swiglu_limit,
    apply_router_weight_on_input``: not gated, only the up half of the W13 delta is used; with the router weight
    on the input, the W13 delta sees the scaled input (it is linear in it) and the W2 delta is not weighted.
    Returns dict with ``output [T,H]``, ``base [T,H]`` (no LoRA at all) and ``lora [T,H]`` (output - base).
    """
    base_weights = bf16_round(topk_weights) if round_weights else _f64(topk_weights)
    if lora_ids is None or bank is None:
        lora_ids = torch.full((topk_ids.shape[0],), -1, dtype=torch.int64)
    moe_args = dict(local_expert_offset=local_expert_offset, **expert_options)
    base = routed_moe(topk_ids, base_weights, hidden_states, w13, w2, **moe_args)
    if bank is None:
        zero = torch.zeros_like(base["output"])
        return {"output": base["output"], "base": base["output"], "lora": zero}
    on_input = expert_options.get("apply_router_weight_on_input", False)
    delta = w13_lora_delta(hidden_states, topk_ids, lora_ids, bank, local_expert_offset=local_expert_offset)
    if on_input:
        delta = delta * base_weights.unsqueeze(-1)
    if not expert_options.get("gated", True):
        delta = delta[..., : bank.up_b.shape[2]]
    moe = routed_moe(topk_ids, base_weights, hidden_states, w13, w2, gemm1_lora_delta=delta, **moe_args)
    w2_weights = torch.ones_like(_f64(topk_weights)) if on_input else topk_weights
    down = w2_lora_delta(moe["act"], topk_ids, w2_weights, lora_ids, bank, local_expert_offset=local_expert_offset)
    output = moe["output"] + down.sum(dim=1)
    return {"output": output, "base": base["output"], "lora": output - base["output"]}
