"""Backend "flashinfer" without a Blackwell GPU: availability, preparation, the call's keyword arguments bound
against the installed FlashInfer's signature, and the four return shapes (docs/contract.md §3, §4).

The kernel itself runs only on SM 10.x; here a fake kernel stands in for it. The fake takes FlashInfer's
arguments, undoes the weight layout and computes with the torch backend, and answers in FlashInfer's return
shapes, so ``moelab.routed_moe`` on flashinfer weights must equal the torch backend bit for bit: that checks the
layout inverse, the arguments and the normalisation together.
"""

import inspect
import re

import pytest
import torch
from helpers import assert_close_to_reference, random_topk_ids, random_weights

import moelab
from moelab import layout
from moelab.backends import flashinfer_backend as fb
from moelab.moe import MoEWeights, RoutedMoECall

#: Importing flashinfer 0.7.4 warns about its own use of deprecated cutlass-dsl names: not ours to fix.
pytestmark = pytest.mark.filterwarnings(r"ignore:cutlass\.utils\..* is deprecated:DeprecationWarning")

#: Parameters of ``trtllm_bf16_routed_moe`` in flashinfer-python 0.7.4 (0.6.18 lacks ``workspace_buffer``):
#: what ``build_call_kwargs`` is checked against where flashinfer is not installed.
FLASHINFER_0_7_4_PARAMS = (
    "topk_ids", "hidden_states", "gemm1_weights", "gemm2_weights", "num_experts", "top_k", "n_group",
    "topk_group", "intermediate_size", "local_expert_offset", "local_num_experts", "routed_scaling_factor",
    "routing_method_type", "use_shuffled_weight", "weight_layout", "do_finalize", "enable_pdl",
    "gemm1_lora_delta", "tune_max_num_tokens", "activation_type", "routing_replay_out", "gemm1_alpha",
    "gemm1_beta", "gemm1_clamp_limit", "output", "workspace_buffer",
)
#: Those without a default: a call must pass every one.
FLASHINFER_REQUIRED = FLASHINFER_0_7_4_PARAMS[:11]

E, H, I, K = 4, 128, 128, 2


def _installed_kernel():
    module = pytest.importorskip("flashinfer.fused_moe", reason="flashinfer is not installed "
                                 "(pip install 'moelab[flashinfer]'); the signature check needs it")
    return module.trtllm_bf16_routed_moe


def _installed_signature() -> inspect.Signature | None:
    module, _ = fb._import_flashinfer_moe()
    return None if module is None else inspect.signature(module.trtllm_bf16_routed_moe)


@pytest.fixture
def experts():
    """HF-order bf16 weights, the same weights prepared for "torch" and laid out for "flashinfer"."""
    w13 = (torch.randn(E, 2 * I, H) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I) / I**0.5).bfloat16()
    torch_weights = moelab.prepare_weights(w13, w2, backend="torch")
    # prepare_weights(backend="flashinfer") refuses a CPU; the backend's prepare() is what it would call.
    fi_weights = MoEWeights("flashinfer", *fb.prepare(w13, w2), E, H, I)
    return torch_weights, fi_weights


def fake_kernel(*, new_return_type=False, calls=None):
    """Stands in for ``trtllm_bf16_routed_moe``: binds the arguments, computes with the torch backend on the
    un-laid-out weights, and returns as FlashInfer 0.7 does (a bare tensor for finalize without a delta) or, with
    ``new_return_type``, as 0.8 will (``[output]``)."""
    signature = _installed_signature()

    def kernel(**kwargs):
        if signature is not None:
            signature.bind(**kwargs)
        else:
            assert set(FLASHINFER_REQUIRED) <= set(kwargs) <= set(FLASHINFER_0_7_4_PARAMS)
        if calls is not None:
            calls.append(kwargs)
        w13, w2 = layout.from_flashinfer(kwargs["gemm1_weights"], kwargs["gemm2_weights"])
        weights = MoEWeights("torch", w13, w2, kwargs["local_num_experts"], H, kwargs["intermediate_size"])
        outs = moelab.routed_moe(kwargs["topk_ids"], kwargs["hidden_states"], weights,
                                 num_experts=kwargs["num_experts"], top_k=kwargs["top_k"],
                                 local_expert_offset=kwargs["local_expert_offset"],
                                 gemm1_lora_delta=kwargs["gemm1_lora_delta"], do_finalize=kwargs["do_finalize"],
                                 output=kwargs["output"])
        if kwargs["do_finalize"] and kwargs["gemm1_lora_delta"] is None and not new_return_type:
            return outs[0]
        return outs

    return kernel


def test_unavailable_on_cpu_says_why():
    reason = fb.unavailable_reason(torch.device("cpu"))
    assert reason is not None and "CUDA GPU of compute capability 10.x" in reason and "cpu" in reason
    if _installed_signature() is None:
        assert "flashinfer is not installed" in reason
    assert "flashinfer" not in moelab.available_backends("cpu")


@pytest.mark.parametrize(
    "capability, imports, expected",
    [
        ((9, 0), True, "SM 10.x only.*SM 9.0"),  # Hopper (the lent H200): the cubins do not exist there
        ((12, 0), True, "SM 10.x only.*SM 12.0"),  # SM 12x: the launcher admits it, no BF16 routed cubins
        ((10, 0), False, "flashinfer does not import"),  # Blackwell without flashinfer
        ((10, 3), True, None),  # B300 with flashinfer: runs
    ],
)
def test_unavailable_reason_on_cuda(monkeypatch, capability, imports, expected):
    monkeypatch.setattr(fb._runtime, "cuda_capability", lambda device: capability)
    monkeypatch.setattr(fb, "_import_flashinfer_moe",
                        lambda: (object(), None) if imports else (None, "flashinfer does not import (test)"))
    reason = fb.unavailable_reason(torch.device("cuda:0"))
    if expected is None:
        assert reason is None
    else:
        assert reason is not None
        assert re.search(expected, reason), reason


def test_prepare_weights_on_cpu_names_a_backend_that_runs():
    w13, w2 = torch.randn(2, 256, 128).bfloat16(), torch.randn(2, 128, 128).bfloat16()
    with pytest.raises(ValueError, match=r"backend: 'flashinfer' cannot run on cpu: .*use one of \[.*'torch'\]"):
        moelab.prepare_weights(w13, w2, backend="flashinfer")


def test_prepare_gives_the_layout():
    # With flashinfer installed this is FlashInfer's own helper against moelab.layout; without, layout itself.
    w13, w2 = torch.randn(3, 256, 128).bfloat16(), torch.randn(3, 128, 128).bfloat16()
    got, want = fb.prepare(w13, w2), layout.to_flashinfer(w13, w2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    "I_, H_, dtype, error, match",
    [
        (96, 128, torch.bfloat16, ValueError, "intermediate_size I: FlashInfer requires a multiple of 128, got 96"),
        (128, 64, torch.bfloat16, ValueError, "hidden_size H: FlashInfer requires a multiple of 128, got 64"),
        (128, 128, torch.float32, TypeError, "w13: expected dtype bfloat16"),  # torch/triton take fp32; FI not
    ],
)
def test_prepare_rejects_what_flashinfer_cannot_run(I_, H_, dtype, error, match):
    w13, w2 = torch.randn(2, 2 * I_, H_).to(dtype), torch.randn(2, H_, I_).to(dtype)
    with pytest.raises(error, match=match):
        fb.prepare(w13, w2)


def _routing(packed: bool, T: int = 5, ids_dtype=torch.int32, weights_dtype=torch.float32):
    ids = random_topk_ids(T, K, E).to(ids_dtype)
    weights = random_weights(T, K).to(weights_dtype)
    return moelab.pack_topk_ids_weights(ids, weights) if packed else (ids, weights)


def _capture_kwargs(monkeypatch, experts, topk, **kwargs):
    calls = []
    monkeypatch.setattr(fb, "_kernel", lambda: fake_kernel(calls=calls))
    x = torch.randn(5, H).bfloat16()
    moelab.routed_moe(topk, x, experts[1], num_experts=E, top_k=K, **kwargs)
    (got,) = calls
    return got, x


def test_build_call_kwargs_values(monkeypatch, experts):
    topk = _routing(packed=True)
    delta = torch.randn(5, K, 2 * I).bfloat16()
    got, x = _capture_kwargs(monkeypatch, experts, topk, local_expert_offset=0, gemm1_lora_delta=delta,
                             do_finalize=False)
    fi = experts[1]
    assert got["topk_ids"] is topk  # the packed words go through as given: the kernel decodes them
    assert got["hidden_states"] is x and got["gemm1_lora_delta"] is delta and got["output"] is None
    assert got["gemm1_weights"] is fi.gemm1_weights and got["gemm2_weights"] is fi.gemm2_weights
    assert (got["num_experts"], got["top_k"], got["intermediate_size"], got["local_num_experts"]) == (E, K, I, E)
    assert got["n_group"] is None and got["topk_group"] is None and got["routed_scaling_factor"] is None
    assert got["routing_method_type"] == 1  # Renormalize: validation only in routed mode, any top_k
    assert (got["use_shuffled_weight"], got["weight_layout"], got["activation_type"]) == (True, 2, 3)
    assert got["do_finalize"] is False


def test_build_call_kwargs_tuple_routing(monkeypatch, experts):
    ids, weights = topk = _routing(packed=False)  # int32 ids, fp32 weights: what the kernel reads as is
    got, _ = _capture_kwargs(monkeypatch, experts, topk)
    assert isinstance(got["topk_ids"], tuple)
    assert got["topk_ids"][0] is ids and got["topk_ids"][1] is weights
    # int64 ids and fp16 weights are what moelab accepts and FlashInfer does not: converted, exactly.
    ids, weights = topk = _routing(packed=False, ids_dtype=torch.int64, weights_dtype=torch.float16)
    got, _ = _capture_kwargs(monkeypatch, experts, topk)
    assert got["topk_ids"][0].dtype == torch.int32 and torch.equal(got["topk_ids"][0], ids.int())
    assert got["topk_ids"][1].dtype == torch.float32 and torch.equal(got["topk_ids"][1], weights.float())


def test_build_call_kwargs_bind_to_installed_signature(experts):
    kernel = _installed_kernel()
    ids, weights = topk = _routing(packed=False)
    call = RoutedMoECall(topk, None, torch.randn(5, H).bfloat16(), experts[1], num_experts=E, top_k=K,
                         local_expert_offset=0, gemm1_lora_delta=None, do_finalize=True, output=None)
    kwargs = fb.build_call_kwargs(call)
    bound = inspect.signature(kernel).bind(**kwargs)  # TypeError on a renamed, removed or missing parameter
    assert set(FLASHINFER_REQUIRED) <= set(bound.arguments)


@pytest.mark.parametrize("packed", [True, False])  # packed words / (ids, fp32 weights): two routing modes
@pytest.mark.parametrize(
    "do_finalize, with_delta, local_expert_offset, num_experts",
    [
        (True, False, 0, E),  # [output]: FlashInfer returns a bare tensor
        (True, True, 0, E),  # [output, map, act]
        (False, False, 0, E),  # [gemm2, weights, map]
        (False, True, 2, 8),  # [gemm2, weights, map, act]; EP: this rank holds experts 2..5 of 8
    ],
)
def test_routed_moe_matches_torch_backend(monkeypatch, experts, packed, do_finalize, with_delta,
                                          local_expert_offset, num_experts):
    monkeypatch.setattr(fb, "_kernel", lambda: fake_kernel())
    T = 7
    ids = random_topk_ids(T, K, num_experts)
    weights = random_weights(T, K)
    topk = moelab.pack_topk_ids_weights(ids, weights) if packed else (ids, weights)
    x = torch.randn(T, H).bfloat16()
    delta = torch.randn(T, K, 2 * I).bfloat16() if with_delta else None
    args = dict(num_experts=num_experts, top_k=K, local_expert_offset=local_expert_offset, gemm1_lora_delta=delta,
                do_finalize=do_finalize)
    want = moelab.routed_moe(topk, x, experts[0], **args)
    got = moelab.routed_moe(topk, x, experts[1], **args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    if not do_finalize and not packed:
        assert got[1] is weights  # tuple routing: the caller's own weights come back


@pytest.mark.parametrize("new_return_type", [False, True])  # FlashInfer 0.7 (bare tensor) and 0.8 ([output])
def test_output_is_written_in_place(monkeypatch, experts, new_return_type):
    monkeypatch.setattr(fb, "_kernel", lambda: fake_kernel(new_return_type=new_return_type))
    topk, x = _routing(packed=True), torch.randn(5, H).bfloat16()
    out = torch.full((5, H), float("nan"), dtype=torch.bfloat16)
    (got,) = moelab.routed_moe(topk, x, experts[1], num_experts=E, top_k=K, output=out)
    assert got is out and not out.isnan().any()
    assert torch.equal(out, moelab.routed_moe(topk, x, experts[0], num_experts=E, top_k=K)[0])


@pytest.mark.parametrize("packed", [True, False])  # FlashInfer raises on T = 0 with tuple routing
@pytest.mark.parametrize("do_finalize, with_delta", [(True, False), (True, True), (False, False), (False, True)])
def test_zero_tokens_never_reach_the_kernel(monkeypatch, experts, packed, do_finalize, with_delta):
    def kernel():
        raise AssertionError("the kernel must not be called for T = 0")

    monkeypatch.setattr(fb, "_kernel", kernel)
    topk = _routing(packed=packed, T=0)
    x = torch.empty(0, H, dtype=torch.bfloat16)
    delta = torch.empty(0, K, 2 * I, dtype=torch.bfloat16) if with_delta else None
    args = dict(num_experts=E, top_k=K, gemm1_lora_delta=delta, do_finalize=do_finalize)
    got = moelab.routed_moe(topk, x, experts[1], **args)
    want = moelab.routed_moe(topk, x, experts[0], **args)  # the torch backend sizes the same buffers
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]


def _fake_outputs(T=3):
    return (torch.zeros(T, H), torch.zeros(16, H), torch.zeros(T, K), torch.zeros(T * K, dtype=torch.int32),
            torch.zeros(16, I))


@pytest.mark.parametrize("do_finalize, has_delta", [(True, False), (True, True), (False, False), (False, True)])
def test_normalize_result_maps_the_four_return_shapes(do_finalize, has_delta):
    output, gemm2, expert_weights, e2p, act = _fake_outputs()
    returned = {
        (True, False): output,  # the deprecated bare tensor
        (True, True): [output, e2p, act],
        (False, False): [gemm2, expert_weights, e2p],
        (False, True): [gemm2, expert_weights, e2p, act],
    }[(do_finalize, has_delta)]
    r = fb.normalize_result(returned, do_finalize=do_finalize, has_delta=has_delta)
    assert r.output is (output if do_finalize else None)
    assert r.gemm2_output is (None if do_finalize else gemm2)
    assert r.expanded_idx_to_permuted_idx is (e2p if has_delta or not do_finalize else None)
    assert r.gemm1_activation_output is (act if has_delta else None)


def test_normalize_result_new_list_return_and_foreign_output():
    output, *_ = _fake_outputs()
    assert fb.normalize_result([output], do_finalize=True, has_delta=False).output is output  # 0.8.0 form
    mine = torch.full_like(output, float("nan"))
    r = fb.normalize_result(output + 1, do_finalize=True, has_delta=False, output=mine)
    assert r.output is mine and torch.equal(mine, output + 1)  # the caller's tensor is what comes back


def test_normalize_result_rejects_an_unexpected_shape():
    output, gemm2, expert_weights, e2p, _ = _fake_outputs()
    with pytest.raises(RuntimeError, match="expected 4 tensor.*do_finalize=False.*given"):
        fb.normalize_result([gemm2, expert_weights, e2p], do_finalize=False, has_delta=True)


@pytest.mark.gpu
def test_kernel_matches_torch_backend_on_blackwell():
    reason = fb.unavailable_reason(torch.device("cuda")) if torch.cuda.is_available() else "no CUDA GPU"
    if reason is not None:
        pytest.skip(f"the FlashInfer kernel cannot run here: {reason}")
    T, E_, H_, I_, K_ = 40, 8, 256, 256, 2
    w13 = (torch.randn(E_, 2 * I_, H_) / H_**0.5).bfloat16().cuda()
    w2 = (torch.randn(E_, H_, I_) / I_**0.5).bfloat16().cuda()
    ids, weights = random_topk_ids(T, K_, E_, device="cuda"), random_weights(T, K_, device="cuda")
    x = torch.randn(T, H_, device="cuda").bfloat16()
    delta = (torch.randn(T, K_, 2 * I_, device="cuda") * 0.1).bfloat16()
    args = dict(num_experts=E_, top_k=K_, gemm1_lora_delta=delta)
    got = moelab.routed_moe((ids, weights), x, moelab.prepare_weights(w13, w2, backend="flashinfer"), **args)
    want = moelab.routed_moe((ids, weights), x, moelab.prepare_weights(w13, w2, backend="torch"), **args)
    assert_close_to_reference(got[0], want[0], torch.bfloat16, "output")
    # Permuted rows differ in order above 16 tokens: compare through each map.
    act_got, act_want = (moelab.unpermute_activation(r[2], r[1], T, K_) for r in (got, want))
    assert_close_to_reference(act_got, act_want, torch.bfloat16, "gemm1_activation_output")
