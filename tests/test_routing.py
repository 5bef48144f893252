"""moelab.route against the float64 reference, every method, plus ties, saturation and errors (docs/contract.md §6, §7).

Ids are compared exactly and in order (descending selection score, ties to the lower id); weights by relative
error < 1e-5 (fp32 math; bf16/fp16 logits are upcast exactly, so the reference sees the same values).
"""

import doctest

import pytest
import torch
from helpers import assert_close_to_reference
from hypothesis import given
from hypothesis import strategies as st

import moelab
from moelab import reference, routing
from moelab.routing import ROUTING_METHODS

#: Methods whose weights are renormalised to sum to 1 (before routed_scaling_factor).
RENORMALIZING = ("renormalize", "renormalize_naive", "deepseek_v3")


def random_logits(T: int, E: int, dtype=torch.float32, *, seed: int, scale: float = 2.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, E, generator=g) * scale).to(dtype).to(device)


def check_route(logits: torch.Tensor, top_k: int, method: str, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run moelab.route and the reference on the same (upcast) values; ids exactly, weights to 1e-5."""
    weights, ids = moelab.route(logits, top_k, method, **kwargs)
    ref_kwargs = dict(kwargs)
    ref_kwargs.pop("validate", None)  # the reference has no host sync to skip
    if kwargs.get("correction_bias") is not None:
        ref_kwargs["correction_bias"] = kwargs["correction_bias"].double()
    T = logits.shape[0]
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (T, top_k)
    assert weights.device == ids.device == logits.device
    if T == 0:
        return weights, ids  # reference.route cannot build a [0, K] result (reshape(0, -1) is ambiguous)
    ref_weights, ref_ids = reference.route(logits.double(), top_k, method, **ref_kwargs)
    assert torch.equal(ids.cpu(), ref_ids.reshape(T, top_k)), f"{method}: ids differ from the reference"
    assert_close_to_reference(weights, ref_weights.reshape(T, top_k), torch.float32, what=f"{method} weights")
    return weights, ids


@pytest.mark.parametrize(
    "method, top_k, kwargs",
    [
        ("softmax", 6, {}),  # softmax over E, top-k, no renormalisation: weights sum below 1
        ("renormalize", 6, {}),  # the default: top-k of the logits, softmax over the k
        ("renormalize_naive", 6, {}),  # softmax over E, top-k, divided by their sum
        ("sigmoid", 6, {}),  # independent sigmoid gates, no renormalisation
        ("deepseek_v3", 6, {}),  # one group, no bias: sigmoid top-k renormalised
        ("deepseek_v3", 6, {"n_group": 8, "topk_group": 3}),  # group-limited: 3 of 8 groups of 8 experts
        ("llama4", 1, {}),  # top-1 of the logits, sigmoid weight
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])  # fp32 math for every dtype
def test_route_matches_reference(method, top_k, kwargs, dtype, device):
    logits = random_logits(37, 64, dtype, seed=1, device=device)  # T = 37: not a power of two
    check_route(logits, top_k, method, **kwargs)


@pytest.mark.parametrize("method", ROUTING_METHODS)  # each method's path over random shapes and dtypes
@given(data=st.data())
def test_route_property_matches_reference(method, data):
    T = data.draw(st.integers(0, 64), label="T")
    E = data.draw(st.integers(1, 64), label="E")
    kwargs = {"routed_scaling_factor": data.draw(st.sampled_from([1.0, 2.5]), label="routed_scaling_factor")}
    if method == "deepseek_v3":
        n_group = data.draw(st.sampled_from([d for d in range(1, E + 1) if E % d == 0]), label="n_group")
        topk_group = data.draw(st.integers(1, n_group), label="topk_group")
        top_k = data.draw(st.integers(1, topk_group * (E // n_group)), label="top_k")
        kwargs.update(n_group=n_group, topk_group=topk_group)
        if data.draw(st.booleans(), label="with correction_bias"):
            g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="bias seed"))
            kwargs["correction_bias"] = torch.rand(E, generator=g) * 0.5
    else:
        top_k = 1 if method == "llama4" else data.draw(st.integers(1, E), label="top_k")
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]), label="dtype")
    logits = random_logits(T, E, dtype, seed=data.draw(st.integers(0, 2**16), label="seed"))
    weights, ids = check_route(logits, top_k, method, **kwargs)
    # Invariants that hold whatever the reference says: distinct ids in [0, E), non-negative weights.
    assert bool(((ids >= 0) & (ids < E)).all())
    sorted_ids = ids.sort(dim=1).values
    assert not bool((sorted_ids[:, 1:] == sorted_ids[:, :-1]).any())
    assert bool((weights >= 0).all())
    if method in RENORMALIZING and T > 0:
        sums = weights.sum(dim=1)
        assert torch.allclose(sums, torch.full_like(sums, kwargs["routed_scaling_factor"]), rtol=1e-5)


@pytest.mark.parametrize(
    "n_group, topk_group, bias_dtype, scale",
    [
        (8, 4, torch.float32, 2.5),  # DeepSeek-V3's layout scaled down: 8 groups, keep 4, scaled weights
        (8, 1, torch.float32, 1.0),  # one kept group of 8: top_k = 8 takes all of it
        (64, 8, torch.float32, 2.5),  # groups of one expert: the group score is that expert's biased score
        (4, 4, torch.bfloat16, 2.5),  # every group kept, bf16 bias: plain biased top-k
        (1, 1, torch.float64, 1.0),  # fp64 bias is accepted and used in fp32
    ],
)
def test_deepseek_v3_groups_bias_scale(n_group, topk_group, bias_dtype, scale):
    logits = random_logits(41, 64, seed=2, scale=1.0)
    bias = (torch.rand(64, generator=torch.Generator().manual_seed(3)) * 0.5).to(bias_dtype)
    check_route(logits, 8, "deepseek_v3", n_group=n_group, topk_group=topk_group, correction_bias=bias,
                routed_scaling_factor=scale)


def test_deepseek_v3_bias_selects_but_does_not_weigh():
    # Expert 3 has the lowest score but a bias that lifts it to the top; its weight stays its unbiased sigmoid.
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    weights, ids = moelab.route(logits, 2, "deepseek_v3", correction_bias=bias, routed_scaling_factor=2.0)
    assert ids.tolist() == [[3, 0]]
    s = logits[0, [3, 0]].sigmoid()
    assert torch.allclose(weights[0], 2.0 * s / s.sum(), rtol=1e-6)


def test_deepseek_v3_drops_the_best_expert_of_a_weak_group():
    # Group 0 = {0, 1} holds the single best expert but the worse top-2 sum; topk_group = 1 keeps group 1 only.
    logits = torch.tensor([[4.0, -4.0, 2.0, 2.0]])
    _, ids = moelab.route(logits, 2, "deepseek_v3", n_group=2, topk_group=1)
    assert ids.tolist() == [[2, 3]]
    check_route(logits, 2, "deepseek_v3", n_group=2, topk_group=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # llama4 in fp32 and from bf16 logits
def test_llama4_is_top1_sigmoid(dtype):
    logits = random_logits(50, 16, dtype, seed=4)
    weights, ids = check_route(logits, 1, "llama4", routed_scaling_factor=0.5)
    best = logits.float().max(dim=1)
    assert torch.equal(ids[:, 0].long(), best.indices)
    assert torch.allclose(weights[:, 0], 0.5 * best.values.sigmoid(), rtol=1e-6)


@pytest.mark.parametrize("method", ROUTING_METHODS)  # the scale multiplies the final weights, ids unchanged
def test_routed_scaling_factor_scales_weights_only(method):
    logits = random_logits(9, 16, seed=5)
    top_k = 1 if method == "llama4" else 4
    w1, ids1 = moelab.route(logits, top_k, method)
    w3, ids3 = moelab.route(logits, top_k, method, routed_scaling_factor=3)  # an int scale is accepted
    assert torch.equal(ids1, ids3)
    assert torch.allclose(w3, 3 * w1, rtol=1e-6)


@pytest.mark.parametrize("method", ROUTING_METHODS)  # T = 0: an empty batch on every path
def test_zero_tokens_give_empty_results(method):
    top_k = 1 if method == "llama4" else 3
    weights, ids = moelab.route(torch.empty(0, 8, dtype=torch.bfloat16), top_k, method)
    assert weights.shape == ids.shape == (0, top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32


@pytest.mark.parametrize("method", ROUTING_METHODS)  # exact ties (common with bf16): the lower id comes first
def test_ties_go_to_the_lower_id(method):
    logits = torch.tensor([[0.5, 1.0, 1.0, 0.5, 1.0, 0.5, 0.5, 0.5]], dtype=torch.bfloat16).repeat(3, 1)
    top_k = 1 if method == "llama4" else 5
    kwargs = {"n_group": 4, "topk_group": 3} if method == "deepseek_v3" else {}
    _, ids = check_route(logits, top_k, method, **kwargs)
    if method != "deepseek_v3":
        assert ids[0].tolist() == [1, 2, 4, 0, 3][:top_k]


@pytest.mark.parametrize(
    "method, row",
    [
        ("sigmoid", [20.0, 21.0, 19.0]),  # fp32 sigmoid is 1.0 for all three: order by the logits, not by ties
        ("softmax", [0.0, -200.0, -300.0]),  # fp32 softmax underflows to 0 for the last two; order still exact
        ("renormalize_naive", [0.0, -200.0, -300.0]),  # the same underflow, renormalised
    ],
)
def test_saturated_scores_keep_the_exact_order(method, row):
    check_route(torch.tensor([row]), 3, method)


def test_docstring_example_runs():
    result = doctest.testmod(routing, verbose=False)
    assert result.attempted > 0 and result.failed == 0


E8 = torch.zeros(2, 8)


@pytest.mark.parametrize(
    "logits, top_k, method, kwargs, error, match",
    [
        ([[1.0, 2.0]], 1, "softmax", {}, TypeError, "router_logits.*Tensor.*list"),  # not a tensor
        (torch.zeros(2, 8, dtype=torch.int32), 1, "softmax", {}, TypeError, "router_logits.*dtype.*int32"),  # ints
        (torch.zeros(8), 1, "softmax", {}, ValueError, r"router_logits.*2-D.*\(8,\)"),  # 1-D logits
        (torch.zeros(2, 4, 2), 1, "softmax", {}, ValueError, "router_logits.*2-D"),  # 3-D logits
        (E8, 0, "softmax", {}, ValueError, r"top_k.*\[1, 8\].*0"),  # top_k below 1
        (E8, 9, "renormalize", {}, ValueError, r"top_k.*\[1, 8\].*9"),  # top_k above E
        (E8, 2.0, "renormalize", {}, TypeError, "top_k.*int.*float"),  # top_k not an int
        (E8, 2, "topk_softmax", {}, ValueError, "method.*'softmax'.*'llama4'.*'topk_softmax'"),  # unknown method
        (E8, 2, "llama4", {}, ValueError, "top_k.*1.*llama4.*2"),  # llama4 is top-1 only
        (E8, 2, "deepseek_v3", {"n_group": 3}, ValueError, "n_group.*divisor.*E=8.*3"),  # 8 % 3 != 0
        (E8, 2, "deepseek_v3", {"n_group": 0}, ValueError, r"n_group.*\[1, 8\].*0"),  # no groups
        (E8, 2, "deepseek_v3", {"n_group": 4, "topk_group": 0}, ValueError, r"topk_group.*\[1, 4\].*0"),  # keep none
        (E8, 2, "deepseek_v3", {"n_group": 4, "topk_group": 5}, ValueError, r"topk_group.*\[1, 4\].*5"),  # > n_group
        (E8, 3, "deepseek_v3", {"n_group": 4, "topk_group": 1}, ValueError, "top_k.*at most.*2.*got 3"),  # > kept
        (E8, 2, "deepseek_v3", {"correction_bias": torch.zeros(7)}, ValueError,
         r"correction_bias.*shape \[8\].*\[7\]"),  # bias of the wrong length
        (E8, 2, "deepseek_v3", {"correction_bias": torch.zeros(1, 8)}, ValueError,
         r"correction_bias.*shape \[8\].*\[1, 8\]"),  # bias of the wrong rank
        (E8, 2, "deepseek_v3", {"correction_bias": torch.zeros(8, dtype=torch.int64)}, TypeError,
         "correction_bias.*dtype"),  # integer bias
        (E8, 2, "deepseek_v3", {"correction_bias": torch.zeros(8, device="meta")}, ValueError,
         "correction_bias.*device"),  # bias on another device than the logits
        (E8, 2, "sigmoid", {"n_group": 2}, ValueError, "n_group.*None.*deepseek_v3"),  # group arg elsewhere
        (E8, 2, "softmax", {"correction_bias": torch.zeros(8)}, ValueError, "correction_bias.*deepseek_v3"),
        (E8, 2, "softmax", {"routed_scaling_factor": "2"}, TypeError, "routed_scaling_factor.*str"),  # not a number
    ],
)
def test_route_rejects_bad_input(logits, top_k, method, kwargs, error, match):
    with pytest.raises(error, match=match):
        moelab.route(logits, top_k, method, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("method", ROUTING_METHODS)  # every path on the GPU with no device-to-host copy
def test_route_does_not_sync_on_cuda(method):
    logits = random_logits(128, 64, torch.bfloat16, seed=6, device="cuda")
    # validate=False: route's one documented host sync is the NaN/inf check of correction_bias (validate=True)
    kwargs = {"n_group": 8, "topk_group": 4, "correction_bias": torch.rand(64, device="cuda"), "validate": False} \
        if method == "deepseek_v3" else {}
    top_k = 1 if method == "llama4" else 8
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        weights, ids = moelab.route(logits, top_k, method, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_route(logits, top_k, method, **kwargs)
    assert weights.is_cuda and ids.is_cuda
