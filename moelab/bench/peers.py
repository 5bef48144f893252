"""The peers measured beside moelab: what a reader writes first, PyTorch's grouped GEMM, Hugging Face's experts,
Liger-Kernel's fused MoE, vLLM-style unfused LoRA and PEFT LoRA.

transformers, PEFT and Liger are imported inside their builders, only when that peer is asked for (``--peers``).
Each ``build_*`` takes the run's :class:`~moelab.bench.runner.Ctx` and returns ``fn(InputSet) -> [T, H]``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

import moelab
from moelab.bench.impls import Skip


def _grouped_mm():
    fn = getattr(torch, "_grouped_mm", None) or getattr(F, "grouped_mm", None)
    if fn is None:
        raise Skip(f"torch {torch.__version__} has neither torch._grouped_mm nor F.grouped_mm")
    return fn


def swiglu_only(ctx, who: str) -> None:
    """Skip a peer that computes plain SwiGLU without biases when the run's experts are not that."""
    if ctx.expert:
        raise Skip(f"{who} runs SwiGLU without biases only")


def build_naive(ctx):
    """Per-expert PyTorch loop: where() per expert (a host sync each), two matmuls, weighted index_add_."""
    swiglu_only(ctx, "the naive loop")
    w13, w2, E = ctx.w13, ctx.w2, ctx.shape.E

    def fn(s):
        out = torch.zeros(s.x.shape, dtype=torch.float32, device=s.x.device)
        for e in range(E):
            tok, k = torch.where(s.ids64 == e)
            if tok.numel() == 0:
                continue
            gate, up = (s.x[tok] @ w13[e].T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ w2[e].T
            out.index_add_(0, tok, y.float() * s.weights[tok, k].float()[:, None])
        return out.to(s.x.dtype)

    return fn


def build_grouped_mm(ctx):
    """A full MoE layer on torch._grouped_mm (CUTLASS grouped GEMM on Hopper), no host sync: slots sorted by
    expert, int32 cumulative offsets, gate_up GEMM, silu*up, down GEMM, weighted index_add_ in fp32. With
    ``--activation``/``--bias``: the biases gathered per slot and added to each GEMM's output, the activation in
    PyTorch between the GEMMs (as HF's grouped_mm experts run GPT-OSS)."""
    from moelab.backends.torch_backend import activate

    gmm = _grouped_mm()
    b13, b2 = ctx.expert.get("w13_bias"), ctx.expert.get("w2_bias")
    activation = ctx.expert.get("activation", "silu")
    E, K, H, I = ctx.shape.E, ctx.shape.K, ctx.shape.H, ctx.shape.I
    w13_t = ctx.w13.transpose(1, 2)  # [E, H, 2I], column-major per expert: CUTLASS's B layout, a free view
    w2_t = ctx.w2.transpose(1, 2)  # [E, I, H]

    def fn(s):
        T = s.x.shape[0]
        flat = s.ids64.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)  # cumulative end row of each expert's group
        tok = order // K
        h = gmm(s.x[tok], w13_t, offs=offs)  # [T*K, 2I], HF order [gate | up]
        if b13 is not None:
            h = h + b13[flat[order]]
        if activation == "silu":
            a = F.silu(h[:, :I]) * h[:, I:]
        else:
            a = activate(h[:, :I], h[:, I:], activation=activation)
        y = gmm(a, w2_t, offs=offs)  # [T*K, H]
        if b2 is not None:
            y = y + b2[flat[order]]
        y = y.float() * s.weights.flatten()[order].float()[:, None]
        out = torch.zeros(T, H, dtype=torch.float32, device=s.x.device).index_add_(0, tok, y)
        return out.to(s.x.dtype)

    return fn


def _hf_experts(ctx, implementation: str):
    """transformers' Qwen3MoeExperts (the generic HF experts layout: gate_up_proj [E, 2I, H], down_proj
    [E, H, I]) on our weights, no copy, with ``config._experts_implementation = implementation``."""
    try:
        import transformers
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except ImportError as e:
        raise Skip(f"transformers Qwen3MoeExperts not importable: {e}") from e
    s = ctx.shape
    cfg = Qwen3MoeConfig(hidden_size=s.H, moe_intermediate_size=s.I, num_experts=s.E, num_experts_per_tok=s.K,
                         hidden_act="silu")
    if implementation != "eager":
        try:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        except ImportError as e:
            raise Skip(f"transformers {transformers.__version__} has no experts_implementation registry") from e
        if implementation not in ALL_EXPERTS_FUNCTIONS:
            raise Skip(f"transformers {transformers.__version__}: experts_implementation {implementation!r} not "
                       f"registered (have {sorted(ALL_EXPERTS_FUNCTIONS.keys())})")
    cfg._experts_implementation = implementation
    with torch.device("meta"):
        m = Qwen3MoeExperts(cfg)
    if implementation != "eager" and getattr(m, "is_concatenated", None) is None:
        raise Skip(f"transformers {transformers.__version__}: Qwen3MoeExperts has no experts_implementation switch")
    if getattr(m.config, "_experts_implementation", "eager") != implementation:
        raise Skip(f"config._experts_implementation did not take {implementation!r}")
    m.gate_up_proj = torch.nn.Parameter(ctx.w13, requires_grad=False)
    m.down_proj = torch.nn.Parameter(ctx.w2, requires_grad=False)
    return m.eval()


def build_hf(ctx, implementation: str):
    """Hugging Face's experts forward, ``implementation`` "eager" or "grouped_mm"."""
    swiglu_only(ctx, "Qwen3MoeExperts")
    m = _hf_experts(ctx, implementation)
    return lambda s: m(s.x, s.ids64, s.weights)


def build_liger(ctx):
    """Liger-Kernel's Triton fused MoE (``LigerFusedMoEFunction``), its autotuner pinned to one config unless
    ``--liger-autotune``."""
    swiglu_only(ctx, "Liger's fused MoE")
    if ctx.device.type != "cuda":
        raise Skip("Liger's Triton kernels are timed on CUDA only (its bf16 tl.dot is wrong in the interpreter)")
    if not ctx.args.liger_autotune:
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")  # read when liger_kernel is first imported
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError as e:
        raise Skip(f"liger-kernel not installed ({e}); carry the wheel in .whl/") from e
    w13, w2 = ctx.w13.contiguous(), ctx.w2.contiguous()  # HF layout is Liger's layout
    return lambda s: LigerFusedMoEFunction.apply(s.x, w13, w2, s.ids, s.weights)


def build_unfused_lora(ctx, variant: str):
    """vLLM-style unfused LoRA: slots sorted by (adapter, expert), shrink and expand by torch._grouped_mm, the
    W13 delta into moelab's routed_moe, a torch gather of the activation, W2 shrink/expand, torch finalize."""
    gmm = _grouped_mm()
    b, (E, K, H, I) = ctx.bank_of(variant), (ctx.shape.E, ctx.shape.K, ctx.shape.H, ctx.shape.I)
    L, r = b.max_loras, b.max_rank  # slots of lower rank are zero past their rank: exact
    G = L * E
    a13_t = torch.cat([b.up_a, b.gate_a], dim=2).reshape(G, 2 * r, H).transpose(1, 2)  # [G, H, 2r]
    b13 = torch.zeros(G, 2 * I, 2 * r, dtype=ctx.dtype, device=ctx.device)  # block diagonal: [up, gate] out
    b13[:, :I, :r] = b.up_b.reshape(G, I, r)
    b13[:, I:, r:] = b.gate_b.reshape(G, I, r)
    b13_t = b13.transpose(1, 2)  # [G, 2r, 2I]
    a2_t = b.down_a.reshape(G, r, I).transpose(1, 2)  # [G, I, r]
    b2_t = b.down_b.reshape(G, H, r).transpose(1, 2)  # [G, r, H]
    W = moelab.prepare_weights(ctx.w13, ctx.w2, backend="triton")

    def fn(s):
        T = s.x.shape[0]
        lora = s.lora_ids[variant].long().repeat_interleave(K)
        live = lora >= 0
        group = torch.where(live, lora * E + s.ids64.flatten(), G)
        order = torch.argsort(group, stable=True)
        counts = torch.zeros(G + 1, dtype=torch.int64, device=group.device).scatter_add_(0, group,
                                                                                          torch.ones_like(group))
        offs = torch.cumsum(counts[:G], 0).to(torch.int32)
        live_s = live[order][:, None]
        d13_s = gmm(gmm(s.x[order // K], a13_t, offs=offs), b13_t, offs=offs)  # shrink, expand
        d13 = torch.empty_like(d13_s)
        d13[order] = torch.where(live_s, d13_s, torch.zeros((), dtype=d13_s.dtype, device=d13_s.device))
        gemm2, ew, e2p, act = moelab.routed_moe(s.packed, s.x, W, num_experts=E, top_k=K,
                                                gemm1_lora_delta=d13.view(T, K, 2 * I), do_finalize=False,
                                                validate=False)
        idx = e2p.clamp(min=0).long()
        d2_s = gmm(gmm(act[idx][order], a2_t, offs=offs), b2_t, offs=offs).float()
        d2_s = d2_s * s.weights.flatten()[order].float()[:, None]
        d2 = torch.empty_like(d2_s)
        d2[order] = torch.where(live_s, d2_s, torch.zeros((), device=d2_s.device))
        out = (gemm2[idx].float() * ew.flatten().float()[:, None] + d2).view(T, K, H).sum(1)
        return out.to(s.x.dtype)

    return fn


def build_peft(ctx, variant: str):
    """HF experts + PEFT LoRA on the 3-D parameters (``target_parameters=["gate_up_proj", "down_proj"]``), the
    adapter = bank slot 0. PEFT applies one adapter to the whole batch: variant "1x all" only."""
    if variant != "1x all":
        raise Skip("PEFT applies one adapter to the whole batch: only the '1x all' variant")
    try:
        import peft
    except ImportError as e:
        raise Skip(f"peft not installed ({e})") from e
    try:
        m = _hf_experts(ctx, "grouped_mm")
    except Skip as e:
        print(f"HF grouped_mm + PEFT: {e}; PEFT runs on HF eager instead", flush=True)
        m = _hf_experts(ctx, "eager")

    class Holder(torch.nn.Module):
        def __init__(self, experts):
            super().__init__()
            self.experts = experts

        def forward(self, x, ids, w):
            return self.experts(x, ids, w)

    b, E = ctx.bank_of(variant), ctx.shape.E
    r = b.ranks[0]
    config = peft.LoraConfig(r=r, lora_alpha=r, lora_dropout=0.0, target_modules=[],
                             target_parameters=["gate_up_proj", "down_proj"])
    model = peft.get_peft_model(Holder(m), config)
    # PEFT's layout (peft/tuners/lora/layer.py ParamWrapper): lora_A [E*r, in] (expert-major),
    # lora_B [out, r*E] (expert fastest); delta[e] = B[:, :, e] @ A[e] * alpha/r with out/in of W[e] [out, in].
    factors = {"gate_up_proj": (b.gate_a[0, :, :r], torch.cat([b.gate_b[0, :, :, :r], b.up_b[0, :, :, :r]], dim=1)),
               "down_proj": (b.down_a[0, :, :r], b.down_b[0, :, :, :r])}
    found = set()
    for mod in model.modules():
        name = getattr(mod, "parameter_name", None)
        if name in factors and hasattr(mod, "lora_A"):
            a, bb = factors[name]  # [E, r, in], [E, out, r]
            with torch.no_grad():
                mod.lora_A["default"].weight.copy_(a.reshape(E * r, -1))
                mod.lora_B["default"].weight.copy_(bb.permute(1, 2, 0).reshape(bb.shape[1], r * E))
            found.add(name)
    if found != set(factors):
        raise Skip(f"peft {peft.__version__}: target_parameters wrapped {sorted(found)}, expected {sorted(factors)}")
    model.eval()
    return lambda s: model(s.x, s.ids64, s.weights)
