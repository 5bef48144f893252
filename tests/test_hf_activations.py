"""Expert activations, GEMM biases and the router weight on the input (issue 11), against the float64 reference.

Each case draws fresh random weights, routing and (where asked) biases and a LoRA W13 delta, runs
``moelab.routed_moe`` on the torch backend and compares the output, the activation and GEMM2's rows with
``moelab.reference.routed_moe``; unwritten rows would be NaN (debug mode poisons them). The reference's own
formulas are checked against independent closed forms. Backends whose kernels run plain SwiGLU only (flashinfer)
refuse the other options with a ValueError naming the backend to use.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close_to_reference, random_topk_ids, random_weights

import moelab
from moelab import reference
from moelab.contract import ACTIVATIONS

CASES = sorted(ACTIVATIONS)


def test_reference_activations_closed_forms():
    v = torch.linspace(-9, 9, 37, dtype=torch.float64)
    erf_gelu = v * 0.5 * (1 + torch.special.erf(v / math.sqrt(2)))
    assert torch.allclose(reference.apply_activation(v, "gelu", gated=False), erf_gelu)
    assert torch.allclose(reference.apply_activation(v, "relu2", gated=False), torch.where(v > 0, v * v, 0.0))
    assert torch.allclose(reference.apply_activation(v, "gelu_tanh", gated=False),
                          torch.nn.functional.gelu(v, approximate="tanh"))
    gate, up = v, v.flip(0)
    h = torch.cat([gate, up])
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    oai = g * torch.sigmoid(1.702 * g) * (u + 1)  # GPT-OSS: alpha 1.702, limit 7, (up + 1)
    assert torch.allclose(reference.apply_activation(h, "swigluoai"), oai)
    assert torch.allclose(reference.apply_activation(h, "silu", swiglu_limit=3.0),
                          torch.nn.functional.silu(gate.clamp(max=3.0)) * up.clamp(-3.0, 3.0))
    with pytest.raises(ValueError, match="activation"):
        reference.apply_activation(h, "relu2", gated=True)


@pytest.mark.parametrize("activation,gated", CASES, ids=[f"{a}-{'gated' if g else 'plain'}" for a, g in CASES])
@pytest.mark.parametrize("bias,on_input,lora", [
    (False, False, False),  # the activation alone
    (True, False, True),    # GEMM1 + GEMM2 biases and a W13 LoRA delta (before the activation, [up, gate])
    (True, True, False),    # Llama-4: the routing weight scales the input, the outputs sum unweighted
], ids=["plain", "bias+lora", "bias+on_input"])
def test_torch_backend_against_reference(activation, gated, bias, on_input, lora):
    g = torch.Generator().manual_seed(11)
    E, K, H, I, T = 4, 2, 32, 16, 9
    rows = 2 * I if gated else I
    w13 = torch.randn(E, rows, H, generator=g) / H**0.5 * 3  # *3: activations well outside [-1, 1] (clamps hit)
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    b13 = torch.randn(E, rows, generator=g) if bias else None
    b2 = torch.randn(E, H, generator=g) if bias else None
    x = torch.randn(T, H, generator=g)
    ids, w = random_topk_ids(T, K, E, generator=g), random_weights(T, K, generator=g)
    delta = torch.randn(T, K, rows, generator=g) * 0.5 if lora else None
    options = dict(activation=activation, gated=gated)
    weights = moelab.prepare_weights(w13, w2, backend="torch", w13_bias=b13, w2_bias=b2, **options)
    moelab.set_debug(True)
    try:
        gemm2, expert_weights, e2p, *act = moelab.routed_moe(
            (ids, w), x, weights, num_experts=E, top_k=K, gemm1_lora_delta=delta, do_finalize=False,
            apply_router_weight_on_input=on_input)
        (out, *_) = moelab.routed_moe((ids, w), x, weights, num_experts=E, top_k=K, gemm1_lora_delta=delta,
                                      apply_router_weight_on_input=on_input)
    finally:
        moelab.set_debug(False)
    ref = reference.routed_moe(ids, w, x, w13, w2, gemm1_lora_delta=delta, w13_bias=b13, w2_bias=b2,
                               apply_router_weight_on_input=on_input, **options)
    assert_close_to_reference(out, ref["output"], torch.float32, "output")
    rows_of = e2p.long()
    assert_close_to_reference(gemm2[rows_of], ref["gemm2"], torch.float32, "gemm2 rows")
    if act:
        assert_close_to_reference(act[0][rows_of], ref["act"], torch.float32, "activation rows")
    if on_input:
        assert torch.equal(expert_weights, torch.ones_like(w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_swigluoai_with_bias(dtype):
    g = torch.Generator().manual_seed(3)
    E, K, H, I, T = 4, 2, 32, 16, 7
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / 2, torch.randn(E, H, I, generator=g) / 4
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    x = torch.randn(T, H, generator=g)
    ids, w = random_topk_ids(T, K, E, generator=g), random_weights(T, K, generator=g)
    cast = [t.to(dtype) for t in (w13, w2, b13, b2, x)]
    weights = moelab.prepare_weights(cast[0], cast[1], backend="torch", activation="swigluoai", w13_bias=cast[2],
                                      w2_bias=cast[3])
    (out,) = moelab.routed_moe((ids, w), cast[4], weights, num_experts=E, top_k=K)
    ref = reference.routed_moe(ids, w, *cast[4:], cast[0], cast[1], activation="swigluoai", w13_bias=cast[2],
                               w2_bias=cast[3])["output"]
    assert_close_to_reference(out, ref, dtype, "output")


def test_kernels_refuse_what_they_do_not_run():
    """flashinfer's closed kernel runs plain SwiGLU without biases only: its reason names what it cannot run; the
    triton and torch backends run every option, and "auto" picks a backend that runs it."""
    from moelab.backends import get_backend, swiglu_only_reason

    assert swiglu_only_reason() is None
    assert "activation 'gelu_tanh'" in swiglu_only_reason(activation="gelu_tanh")
    assert "GEMM biases" in swiglu_only_reason(has_bias=True)
    assert "the router weight on the input" in swiglu_only_reason(apply_router_weight_on_input=True)
    for name in ("triton", "torch"):
        assert get_backend(name).expert_options_reason(activation="relu2", gated=False, has_bias=True,
                                                        apply_router_weight_on_input=True) is None
    w13, w2 = torch.randn(4, 32, 16), torch.randn(4, 16, 16)
    assert moelab.prepare_weights(w13, w2, activation="gelu").backend in moelab.available_backends("cpu")


def test_argument_errors_name_the_argument():
    w13, w2 = torch.randn(4, 32, 16), torch.randn(4, 16, 16)
    with pytest.raises(ValueError, match="activation"):
        moelab.prepare_weights(w13, w2, backend="torch", activation="relu2")  # relu2 is not gated
    with pytest.raises(ValueError, match="w2"):
        moelab.prepare_weights(w13, w2, backend="torch", activation="relu2", gated=False)  # I = 32 then
    with pytest.raises(ValueError, match="w13_bias"):
        moelab.prepare_weights(w13, w2, backend="torch", w13_bias=torch.zeros(4, 16))
    with pytest.raises(TypeError, match="w2_bias"):
        moelab.prepare_weights(w13, w2, backend="torch", w2_bias=torch.zeros(4, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="swiglu_alpha"):
        moelab.prepare_weights(w13, w2, backend="torch", swiglu_alpha=1.0)
    with pytest.raises(ValueError, match="swiglu_limit"):
        moelab.prepare_weights(w13, w2, backend="torch", swiglu_limit=-1.0)
    weights = moelab.prepare_weights(torch.randn(4, 16, 16), w2, backend="torch", activation="relu2", gated=False)
    with pytest.raises(ValueError, match="gemm1_lora_delta"):  # not gated: the delta is [T, K, I] (up only)
        moelab.routed_moe((torch.tensor([[0, 1]]), torch.ones(1, 2)), torch.randn(1, 16), weights, num_experts=4,
                          top_k=2, gemm1_lora_delta=torch.zeros(1, 2, 32))
