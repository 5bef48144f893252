"""The triton backend's fused expert options (issue 11): every activation, GEMM1/GEMM2 biases, the router weight on
the input and LoRA, computed in the GEMMs' prologue and epilogues, against the float64 reference.

Each case draws fresh random weights and routing (shapes off the kernels' tiles: masked K steps and column blocks),
poisons the output buffer and runs in debug mode (dead rows NaN), so an unwritten element fails. fp32 runs the
interpreter's exact 'ieee' dots (tolerance 1e-5); GPT-OSS's case also runs in bf16. Tokens whose LoRA delta is zero
must come out bit for bit as the run without a delta. On a GPU the same tests run compiled.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers import assert_close_to_reference, poison, random_topk_ids, random_weights
from hypothesis import given
from hypothesis import strategies as st

import moelab
from moelab import reference
from moelab.backends import triton_backend
from moelab.contract import ACTIVATIONS, LoRAExpertsCall
from moelab.lab import rel_err

pytestmark = [
    pytest.mark.skipif("triton" not in moelab.available_backends(), reason="the triton backend cannot run"),
    # gelu_tanh's exp(-2u) overflows to inf for very negative inputs (the result, v / inf = -0, is right)
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]

CASES = sorted(ACTIVATIONS)
CASE_IDS = [f"{a}-{'gated' if g else 'plain'}" for a, g in CASES]
#: (biases, router weight on the input, W13 LoRA delta)
OPTIONS = [(b, o, d) for b in (False, True) for o in (False, True) for d in (False, True)]
OPTION_IDS = [f"{'bias' if b else 'nobias'}-{'oninput' if o else 'weighted'}-{'delta' if d else 'nodelta'}"
              for b, o, d in OPTIONS]


def _problem(activation, gated, bias, delta, *, T=9, E=5, K=2, H=40, I=24, seed=0, dtype=torch.float32,
             device="cpu"):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * I if gated else I
    p = dict(
        w13=torch.randn(E, rows, H, generator=g) / H**0.5 * 3,  # * 3: GEMM1's outputs reach the clamp of 7
        w2=torch.randn(E, H, I, generator=g) / I**0.5,
        b13=torch.randn(E, rows, generator=g) if bias else None,
        b2=torch.randn(E, H, generator=g) if bias else None,
        x=torch.randn(T, H, generator=g),
        delta=torch.randn(T, K, rows, generator=g) * 0.5 if delta else None,
    )
    if delta:
        p["delta"][::3] = 0  # every third token has no adapter: bit for bit the run without a delta
    p = {k: v.to(dtype).to(device) if v is not None else None for k, v in p.items()}
    p["ids"] = random_topk_ids(T, K, E, generator=g, device=device)
    p["w"] = random_weights(T, K, generator=g, device=device)
    return p


def _run(p, weights, *, packed, on_input, delta=True, do_finalize=True):
    E, K = weights.num_local_experts, p["ids"].shape[1]
    topk = moelab.pack_topk_ids_weights(p["ids"], p["w"]) if packed else (p["ids"], p["w"])
    if do_finalize:
        out = poison(torch.empty_like(p["x"]))
        return moelab.routed_moe(topk, p["x"], weights, num_experts=E, top_k=K, output=out,
                                 gemm1_lora_delta=p["delta"] if delta else None,
                                 apply_router_weight_on_input=on_input)[0]
    return moelab.routed_moe(topk, p["x"], weights, num_experts=E, top_k=K, do_finalize=False,
                             gemm1_lora_delta=p["delta"], apply_router_weight_on_input=on_input)


@pytest.mark.parametrize("bias,on_input,delta", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("activation,gated", CASES, ids=CASE_IDS)
def test_fused_options_against_reference(activation, gated, bias, on_input, delta, device):
    seed = zlib.crc32(repr((activation, gated, bias, on_input, delta)).encode())  # fresh inputs per case
    p = _problem(activation, gated, bias, delta, seed=seed, device=device)
    options = dict(activation=activation, gated=gated)
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton", w13_bias=p["b13"], w2_bias=p["b2"],
                                     **options)
    packed = on_input and not delta  # the weight on the input read from packed words, or from the caller's tensor
    w_ref = reference.bf16_round(p["w"]) if packed else p["w"]
    ref = reference.routed_moe(p["ids"], w_ref, p["x"], p["w13"], p["w2"], gemm1_lora_delta=p["delta"],
                               w13_bias=p["b13"], w2_bias=p["b2"], apply_router_weight_on_input=on_input, **options)
    moelab.set_debug(True)
    try:
        out = _run(p, weights, packed=packed, on_input=on_input)
        gemm2, expert_weights, e2p, *act = _run(p, weights, packed=packed, on_input=on_input, do_finalize=False)
        base = _run(p, weights, packed=packed, on_input=on_input, delta=False) if delta else None
    finally:
        moelab.set_debug(False)
    assert_close_to_reference(out, ref["output"], torch.float32, "output")
    rows = e2p.long()
    assert_close_to_reference(gemm2[rows], ref["gemm2"], torch.float32, "gemm2 rows")
    if act:
        assert_close_to_reference(act[0][rows], ref["act"], torch.float32, "activation rows")
    if on_input:
        assert torch.equal(expert_weights, torch.ones_like(expert_weights))
    if delta:  # tokens without an adapter (zero delta rows) are the base run's, bit for bit
        assert torch.equal(out[::3], base[::3]), "a token with a zero delta differs from the run without a delta"
    if not bias or on_input or delta:  # one case per activation is enough for the padding rows
        return
    # padding rows of live tiles: the bias is not added there (zeros outside debug mode, as the torch backend)
    clean = _run(p, weights, packed=packed, on_input=on_input, do_finalize=False)[0]
    dead = torch.ones(clean.shape[0], dtype=torch.bool, device=clean.device)
    dead[rows] = False
    assert torch.equal(clean[dead], torch.zeros_like(clean[dead])), "GEMM2 wrote into a padding row"


@pytest.mark.parametrize("on_input", [False, True], ids=["weighted", "oninput"])
def test_gpt_oss_in_bf16(on_input, device):
    """GPT-OSS's clamped SwiGLU with both biases in bf16 (the interpreter rounds as the GPU does)."""
    p = _problem("swigluoai", True, True, True, T=17, E=6, K=3, H=64, I=48, dtype=torch.bfloat16, device=device)
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton", activation="swigluoai",
                                     w13_bias=p["b13"], w2_bias=p["b2"])
    out = _run(p, weights, packed=True, on_input=on_input)
    ref = reference.routed_moe(p["ids"], reference.bf16_round(p["w"]), p["x"], p["w13"], p["w2"],
                               gemm1_lora_delta=p["delta"], w13_bias=p["b13"], w2_bias=p["b2"],
                               activation="swigluoai", apply_router_weight_on_input=on_input)["output"]
    assert_close_to_reference(out, ref, torch.bfloat16, "output")
    torch_weights = moelab.prepare_weights(p["w13"], p["w2"], backend="torch", activation="swigluoai",
                                           w13_bias=p["b13"], w2_bias=p["b2"])
    assert rel_err(out, _run(p, torch_weights, packed=True, on_input=on_input)) < 1e-2


def test_swiglu_alpha_and_limit_are_the_weights_own(device):
    """A non-default alpha and limit reach the kernel (they are compile-time constants of GEMM1)."""
    p = _problem("swigluoai", True, False, False, device=device)
    for alpha, limit in ((1.0, 2.0), (2.5, 30.0)):
        weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton", activation="swigluoai",
                                         swiglu_alpha=alpha, swiglu_limit=limit)
        ref = reference.routed_moe(p["ids"], p["w"], p["x"], p["w13"], p["w2"], activation="swigluoai",
                                   swiglu_alpha=alpha, swiglu_limit=limit)["output"]
        assert_close_to_reference(_run(p, weights, packed=False, on_input=False), ref, torch.float32, "output")
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton", activation="gelu", swiglu_limit=1.5)
    ref = reference.routed_moe(p["ids"], p["w"], p["x"], p["w13"], p["w2"], activation="gelu", swiglu_limit=1.5)
    assert_close_to_reference(_run(p, weights, packed=False, on_input=False), ref["output"], torch.float32, "output")


GATED = [a for a, g in CASES if g]


@pytest.mark.parametrize("activation,mode", [(a, "tiles") for a in GATED] + [("swigluoai", "decode")])
def test_fused_lora_bank_composes(activation, mode, device):
    """The fused LoRA bank (expanded in GEMM1 before the activation, in GEMM2 after the bias) with each gated
    activation and both biases, against ``reference.lora_experts``; tokens without an adapter are the base's."""
    E, K, H, I, T, rank = 4, 2, 40, 24, 11, 4
    p = _problem(activation, True, True, False, T=T, E=E, K=K, H=H, I=I, device=device)
    options = dict(activation=activation)
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton", w13_bias=p["b13"], w2_bias=p["b2"],
                                     **options)
    g = torch.Generator().manual_seed(5)
    bank = moelab.LoRABank(2, E, H, I, rank, dtype=torch.float32, device=device)
    for slot in range(2):
        bank.set(slot, gate_a=torch.randn(E, rank, H, generator=g), gate_b=torch.randn(E, I, rank, generator=g),
                 up_a=torch.randn(E, rank, H, generator=g), up_b=torch.randn(E, I, rank, generator=g),
                 down_a=torch.randn(E, rank, I, generator=g), down_b=torch.randn(E, H, rank, generator=g),
                 scaling=0.05)
    lora_ids = torch.tensor([0, 1, -1] * 4, dtype=torch.int32, device=device)[:T]

    def forward(bank_or_none):
        call = LoRAExpertsCall(p["x"], p["ids"], p["w"], weights, E, K, 0, poison(torch.empty_like(p["x"])),
                               bank_or_none, lora_ids if bank_or_none is not None else None, fused=True, path=mode)
        return triton_backend.lora_experts(call)

    out, base = forward(bank), forward(None)
    ref = reference.lora_experts(p["x"], p["w"], p["ids"], lora_ids, p["w13"], p["w2"], bank, w13_bias=p["b13"],
                                 w2_bias=p["b2"], **options)
    assert_close_to_reference(out, ref["output"], torch.float32, "output")
    assert rel_err(out - base, ref["lora"]) < 1e-4, "the LoRA term"
    assert torch.equal(out[2::3], base[2::3]), "a token without an adapter differs from the base path"


@pytest.mark.parametrize("activation", GATED)
def test_notebook_02_lesson_holds_for_every_activation(activation, device):
    """The [up, gate] delta matches the reference; the same delta in HF [gate, up] order is finite and wrong."""
    p = _problem(activation, True, activation == "swigluoai", True, device=device)
    I = p["w2"].shape[2]
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton", activation=activation,
                                     w13_bias=p["b13"], w2_bias=p["b2"])
    ref = reference.routed_moe(p["ids"], p["w"], p["x"], p["w13"], p["w2"], gemm1_lora_delta=p["delta"],
                               activation=activation, w13_bias=p["b13"], w2_bias=p["b2"])["output"]
    right = _run(p, weights, packed=False, on_input=False)
    p["delta"] = torch.cat([p["delta"][..., I:], p["delta"][..., :I]], dim=-1)  # HF order: the mistake
    wrong = _run(p, weights, packed=False, on_input=False)
    assert_close_to_reference(right, ref, torch.float32, "output, [up, gate] delta")
    assert torch.isfinite(wrong).all() and rel_err(wrong, ref) > 0.05, f"{activation}: [gate, up] not visibly wrong"


@given(case=st.sampled_from(CASES), T=st.integers(1, 12), E=st.integers(1, 6), K=st.integers(1, 3),
       H=st.integers(1, 50), I=st.integers(1, 40), bias=st.booleans(), on_input=st.booleans(),
       seed=st.integers(0, 2**16))
def test_any_shape(case, T, E, K, H, I, bias, on_input, seed):
    activation, gated = case
    K = min(K, E)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (hypothesis takes no function-scoped fixture)
    p = _problem(activation, gated, bias, False, T=T, E=E, K=K, H=H, I=I, seed=seed, device=device)
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton", activation=activation, gated=gated,
                                     w13_bias=p["b13"], w2_bias=p["b2"])
    ref = reference.routed_moe(p["ids"], p["w"], p["x"], p["w13"], p["w2"], activation=activation, gated=gated,
                               w13_bias=p["b13"], w2_bias=p["b2"], apply_router_weight_on_input=on_input)
    out = _run(p, weights, packed=False, on_input=on_input)
    assert_close_to_reference(out, ref["output"], torch.float32, "output")


def test_fused_lora_refuses_experts_that_are_not_gated(device):
    p = _problem("relu2", False, False, False, device=device)
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton", activation="relu2", gated=False)
    bank = moelab.LoRABank(1, 5, 40, 24, 4, dtype=torch.float32, device=device)
    call = LoRAExpertsCall(p["x"], p["ids"], p["w"], weights, 5, 2, 0, torch.empty_like(p["x"]), bank,
                           torch.zeros(9, dtype=torch.int32, device=device), fused=True)
    with pytest.raises(ValueError, match="lora: the fused LoRA bank runs gated activations only"):
        triton_backend.lora_experts(call)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels at real tiles: a CUDA GPU (the H200)")
@pytest.mark.parametrize("T", [1, 300], ids=["decode", "prefill"])
@pytest.mark.parametrize("bias,on_input", [(False, False), (True, False), (True, True)],
                         ids=["plain", "bias", "bias-oninput"])
@pytest.mark.parametrize("activation,gated", CASES, ids=CASE_IDS)
def test_bf16_compiled(activation, gated, bias, on_input, T):
    """bf16 on the GPU at the tuned tiles (decode and prefill configs, wgmma), sizes off every tile."""
    p = _problem(activation, gated, bias, True, T=T, E=8, K=3, H=200, I=328, dtype=torch.bfloat16, device="cuda")
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton", activation=activation, gated=gated,
                                     w13_bias=p["b13"], w2_bias=p["b2"])
    moelab.set_debug(True)
    try:
        out = _run(p, weights, packed=True, on_input=on_input)
        base = _run(p, weights, packed=True, on_input=on_input, delta=False)
    finally:
        moelab.set_debug(False)
    ref = reference.routed_moe(p["ids"], reference.bf16_round(p["w"]), p["x"], p["w13"], p["w2"],
                               gemm1_lora_delta=p["delta"], w13_bias=p["b13"], w2_bias=p["b2"], activation=activation,
                               gated=gated, apply_router_weight_on_input=on_input)["output"]
    assert_close_to_reference(out, ref, torch.bfloat16, "output")
    assert torch.equal(out[::3], base[::3]), "a token with a zero delta differs from the run without a delta"
