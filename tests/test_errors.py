"""Errors that point at the real mistake (docs/contract.md §7): each bad input of the public API gets a TypeError
or ValueError naming the argument at fault and the fix, before any kernel runs; where the input used to be
accepted silently, the test also shows what a correct call computes (against the float64 reference).

Small shapes: every case runs in milliseconds on the torch backend; the triton cases run the interpreter on a few
tokens only.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from helpers import assert_close_to_reference, random_experts, random_topk_ids, random_weights

import moelab
from moelab import _checks, _runtime, reference

E, K, H, I = 4, 2, 32, 8  # 2I != H: a transposed w13 has another shape
#: Where a "triton" case runs: the CUDA GPU when there is one (the CPU interpreter is moelab's only where no GPU is).
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def device_of(backend: str) -> str:
    """The device of a case's tensors: the torch backend's on the CPU, the triton backend's on TRITON_DEVICE."""
    return TRITON_DEVICE if backend.startswith("triton") else "cpu"


def weights(dtype=torch.float32, device="cpu"):
    return random_experts(E, H, I, dtype, device=device)


def adapter(r=2, E_=E, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"gate_a": torch.randn(E_, r, H, generator=g), "gate_b": torch.randn(E_, I, r, generator=g),
            "up_a": torch.randn(E_, r, H, generator=g), "up_b": torch.randn(E_, I, r, generator=g),
            "down_a": torch.randn(E_, r, I, generator=g), "down_b": torch.randn(E_, H, r, generator=g)}


def bank_with(slots=(0,), L=2, dtype=torch.float32, max_rank=4, device="cpu"):
    bank = moelab.LoRABank(L, E, H, I, max_rank, dtype=dtype, device=device)
    for s in slots:
        bank.set(s, **adapter(seed=s), scaling=0.5)
    return bank


def routing(T=3, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return random_weights(T, K, generator=g).to(device), random_topk_ids(T, K, E, generator=g).to(device)


# ---------------------------------------------------------------------------------------------- weights

def test_transposed_w13_blames_w13():
    w13, w2 = weights()
    with pytest.raises(ValueError, match=r"^w13: expected shape \[E_local, 2I, H\] = \[4, 16, 32\].*looks "
                                         r"transposed; pass w13\.transpose"):
        moelab.prepare_weights(w13.transpose(1, 2), w2, backend="torch")
    with pytest.raises(ValueError, match=r"^w2: expected shape \[E_local, H, I\] = \[4, 32, 8\].*looks "
                                         r"transposed; pass w2\.transpose"):
        moelab.prepare_weights(w13, w2.transpose(1, 2), backend="torch")
    with pytest.raises(ValueError, match="^w13: .*looks transposed"):
        moelab.LoRAExperts(w13.transpose(1, 2).contiguous(), w2, num_experts=E, top_k=K, backend="torch")


def test_transposed_lora_a_says_so():
    bank = moelab.LoRABank(1, E, H, I, 4)
    for name in ("gate_a", "up_a", "down_a", "gate_b", "down_b"):
        a = adapter()
        a[name] = a[name].transpose(1, 2)
        with pytest.raises(ValueError, match=rf"^{name}: expected shape .*looks transposed; pass {name}\.transpose"):
            bank.set(0, **a)
    a = adapter()
    a["up_b"] = torch.randn(E, I, 3)  # rank 3 where gate_a has 2
    with pytest.raises(ValueError, match=r"^up_b: expected rank 2 \(that of gate_a"):
        bank.set(0, **a)
    with pytest.raises(ValueError, match=r"gate_a: rank 5 .*max_rank 4; make a bank with max_rank >= 5"):
        bank.set(0, **adapter(r=5))
    assert bank.ranks == [0]


def test_dtype_mismatch_says_how_to_fix_everywhere():
    w13, w2 = weights(torch.bfloat16)
    fix = r"expected dtype bfloat16 \(that of {}\), got float32; convert it with {}\.to\(torch\.bfloat16\)"
    with pytest.raises(TypeError, match=fix.format("w13", "w2")):
        moelab.prepare_weights(w13, w2.float(), backend="torch")
    mw = moelab.prepare_weights(w13, w2, backend="torch")
    w, ids = routing()
    x = torch.randn(3, H)
    with pytest.raises(TypeError, match=fix.format("the weights", "hidden_states")):
        moelab.routed_moe((ids, w), x, mw, num_experts=E, top_k=K)
    with pytest.raises(TypeError, match=fix.format("the weights", "output")):
        moelab.routed_moe((ids, w), x.bfloat16(), mw, num_experts=E, top_k=K, output=torch.empty(3, H))
    with pytest.raises(TypeError, match=fix.format("the weights", "gemm1_lora_delta")):
        moelab.routed_moe((ids, w), x.bfloat16(), mw, num_experts=E, top_k=K, gemm1_lora_delta=torch.zeros(3, K, 2 * I))
    bank = bank_with(dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=fix.format("the bank", "hidden_states")):
        moelab.w13_lora_delta(x, ids, torch.zeros(3, dtype=torch.long), bank)
    with pytest.raises(TypeError, match=fix.format("the bank", "act")):
        moelab.w2_lora_delta(torch.randn(3 * K, I), ids, w, torch.zeros(3, dtype=torch.long), bank)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, backend="torch", lora=bank)
    with pytest.raises(TypeError, match=fix.format("the weights", "hidden_states")):
        experts(x, w, ids, torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"lora: expected dtype float32 \(that of the weights\), got bfloat16; "
                                        r"make the bank with dtype=torch\.float32"):
        moelab.LoRAExperts(*weights(), num_experts=E, top_k=K, backend="torch", lora=bank)


# ---------------------------------------------------------------------------------------------- LoRAExperts

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_experts=E, top_k=E + 1), ValueError, r"top_k: expected an int in \[1, 4\], got 5"),
    (dict(num_experts=E, top_k=0), ValueError, r"top_k: expected an int in \[1, 4\], got 0"),
    (dict(num_experts=0, top_k=1), ValueError, r"num_experts: expected an int in \[4, 32767\], got 0"),
    (dict(num_experts=str(E), top_k=1), TypeError, "num_experts: expected an int, got str"),
    (dict(num_experts=E, top_k=1, local_expert_offset=-1), ValueError,
     r"local_expert_offset: expected an int in \[0, 0\], got -1"),
    (dict(num_experts=8, top_k=1, local_expert_offset=5), ValueError,
     r"local_expert_offset: expected an int in \[0, 4\], got 5"),
])
def test_lora_experts_rejects_bad_sizes_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        moelab.LoRAExperts(*weights(), backend="torch", **kwargs)


@pytest.mark.parametrize("backend", ["torch", "triton", "triton/flow"])
def test_lora_ids_naming_an_empty_slot_raises_in_validate_mode(backend):
    name, _, mode = backend.partition("/")
    dev = device_of(backend)
    w13, w2 = weights(device=dev)
    bank = bank_with(slots=(1,), L=3, device=dev)  # slot 1 set; 0 and 2 empty
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, backend=name, lora=bank,
                                 fused=False if mode else None)
    w, ids = routing(device=dev)
    x = torch.randn(3, H, device=dev)
    for lora_ids in ([1, 0, -1], [2, 2, 2]):
        with pytest.raises(ValueError, match=r"lora_ids: slots \[(0|2)\] hold no adapter \(bank\.ranks = \[0, 2, 0"):
            experts(x, w, ids, torch.tensor(lora_ids, device=dev))
    # unvalidated (CUDA graphs), an empty slot adds exactly nothing: the base output
    got = experts(x, w, ids, torch.tensor([0, 0, 2], device=dev), validate=False)
    base = experts(x, w, ids, None)
    assert torch.equal(got, base)
    # a set slot still works, against the float64 reference
    got = experts(x, w, ids, torch.tensor([1, -1, 1], device=dev))
    ref = reference.lora_experts(x, w, ids, torch.tensor([1, -1, 1], device=dev), w13, w2, bank)["output"]
    assert_close_to_reference(got, ref, torch.float32, backend)


def test_lora_ids_minus_two_rejected_whatever_the_other_ids():
    experts = moelab.LoRAExperts(*weights(), num_experts=E, top_k=K, backend="torch", lora=bank_with())
    w, ids = routing()
    for lora_ids in ([-2, -1, -1], [-2, -2, -2], [-2, 0, -1]):
        with pytest.raises(ValueError, match=r"lora_ids: expected adapter ids in \[-1, 2\) \(-1 = no adapter\), "
                                              r"got -2"):
            experts(torch.randn(3, H), w, ids, torch.tensor(lora_ids))
    with pytest.raises(ValueError, match=r"lora_ids: expected adapter ids in \[-1, 2\).*got 2"):
        experts(torch.randn(3, H), w, ids, torch.tensor([-1, -1, 2]))


def test_lora_ids_without_a_bank_are_refused():
    experts = moelab.LoRAExperts(*weights(), num_experts=E, top_k=K, backend="torch")
    w, ids = routing()
    for lora_ids in (torch.tensor([7, -1, 0]), torch.tensor([-1, -1, -1]), "abc"):
        with pytest.raises(ValueError, match=r"lora_ids: this LoRAExperts has no LoRABank \(lora=None\)"):
            experts(torch.randn(3, H), w, ids, lora_ids)


def test_a_bank_tensor_assigned_non_contiguous_is_named():
    bank = bank_with()
    experts = moelab.LoRAExperts(*weights(), num_experts=E, top_k=K, backend="torch", lora=bank)
    w, ids = routing()
    bank.up_b = bank.up_b.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, strides of the transpose
    with pytest.raises(ValueError, match=r"bank\.up_b"):
        experts(torch.randn(3, H), w, ids, torch.tensor([0, -1, 0]))


def test_lora_experts_misleading_messages_fixed():
    experts = moelab.LoRAExperts(*weights(), num_experts=E, top_k=K, backend="torch", lora=bank_with())
    w, ids = routing()
    lora_ids = torch.tensor([0, -1, 0])
    with pytest.raises(ValueError, match=r"^hidden_states: expected a 2-D tensor, got shape \(32,\)"):
        experts(torch.randn(H), w, ids, lora_ids)
    with pytest.raises(TypeError, match=r"^hidden_states: expected a torch\.Tensor, got list"):
        experts(torch.randn(3, H).tolist(), w, ids, lora_ids)
    # T mismatch: the one argument whose T differs is blamed, whichever it is
    x = torch.randn(3, H)
    with pytest.raises(ValueError, match=r"^topk_ids: expected 3 rows .*got 2; rows per argument: hidden_states 3, "
                                         r"topk_weights 3, topk_ids 2, lora_ids 3"):
        experts(x, w, ids[:2], lora_ids)
    with pytest.raises(ValueError, match=r"^hidden_states: expected 3 rows .*got 4"):
        experts(torch.randn(4, H), w, ids, lora_ids)
    with pytest.raises(ValueError, match=r"^lora_ids: expected 3 rows .*got 5"):
        experts(x, w, ids, torch.zeros(5, dtype=torch.long))


def test_device_mismatch_names_both_sides():
    # "meta" tensors stand in for a second device: the check reads devices only
    with pytest.raises(ValueError, match=r"^w2: expected the device of w13 \(cpu\), got meta; .*move w2 or w13"):
        _checks.check_same_device(w13=torch.zeros(1), w2=torch.zeros(1, device="meta"))


def test_range_messages_print_the_bound_that_exists():
    with pytest.raises(ValueError, match=r"^rank: expected an int >= 1, got 0$"):
        moelab.lora_scaling(16, 0)
    with pytest.raises(ValueError, match=r"^max_loras: expected an int >= 1, got -3$"):
        moelab.LoRABank(-3, E, H, I, 4)


@pytest.mark.parametrize("backend", ["torch", "triton", "triton/flow"])
def test_non_contiguous_hidden_states_same_result_on_every_path(backend):
    name, _, mode = backend.partition("/")
    dev = device_of(backend)
    w13, w2 = weights(device=dev)
    bank = bank_with(device=dev)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, backend=name, lora=bank,
                                 fused=False if mode else None)
    w, ids = routing(T=4, device=dev)
    x = torch.randn(H, 4, device=dev).t()  # strided view [4, H]
    assert not x.is_contiguous()
    for lora_ids in (None, torch.tensor([-1, -1, -1, -1], device=dev), torch.tensor([0, -1, 0, -1], device=dev)):
        got = experts(x, w, ids, lora_ids)
        assert torch.equal(got, experts(x.contiguous(), w, ids, lora_ids)), f"{backend} {lora_ids}"
    ref = reference.lora_experts(x, w, ids, torch.tensor([0, -1, 0, -1], device=dev), w13, w2, bank)["output"]
    assert_close_to_reference(got, ref, torch.float32, backend)


# ---------------------------------------------------------------------------------------------- routed_moe

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_int64_ids_beyond_int32_rejected_before_the_cast(backend):
    dev = device_of(backend)
    mw = moelab.prepare_weights(*weights(device=dev), backend=backend)
    x = torch.randn(2, H, device=dev)
    ids = torch.tensor([[0, 2**32 + 1], [2, 3]], dtype=torch.int64, device=dev)  # 2**32 + 1 would wrap to expert 1
    with pytest.raises(ValueError, match=r"topk \(expert ids\): expected expert ids in \[0, 4\), got 4294967297"):
        moelab.routed_moe((ids, torch.rand(2, K, device=dev)), x, mw, num_experts=E, top_k=K)
    with pytest.raises(ValueError, match="expected expert ids in"):
        moelab.pack_topk_ids_weights(ids, torch.rand(2, K, device=dev))


@pytest.mark.parametrize("bad, match", [
    (lambda ids, w: (ids.float(), w), r"topk\[0\] \(ids\)"),
    (lambda ids, w: (ids, w.to(torch.int32)), r"topk\[1\] \(weights\)"),
    (lambda ids, w: (ids[:, :1], w), r"topk\[0\] \(ids\)"),
    (lambda ids, w: (ids, w[:1]), r"topk\[1\] \(weights\)"),
    (lambda ids, w: (ids, w, w), "tuple of 3"),
])
def test_tuple_routing_takes_the_fast_path_and_is_still_checked(bad, match):
    """``(ids, weights)`` (what a Hugging Face model's router hands moelab) takes validate_call's fast path: a good
    tuple computes the float64 reference, every bad part is still named."""
    w13, w2 = weights()
    mw = moelab.prepare_weights(w13, w2, backend="torch")
    w, ids = routing()
    x = torch.randn(3, H)
    got = moelab.routed_moe((ids.long(), w), x, mw, num_experts=E, top_k=K, validate=False)[0]
    assert_close_to_reference(got, reference.routed_moe(ids, w, x, w13, w2)["output"], torch.float32)
    with pytest.raises((TypeError, ValueError), match=match):
        moelab.routed_moe(bad(ids, w), x, mw, num_experts=E, top_k=K, validate=False)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_routed_moe_output_overlapping_the_routing_is_refused(backend):
    """The finalize reads the routing while it writes ``output``: an output over the routing's memory would read
    words it already overwrote. (``output`` may be ``hidden_states``: every kernel reading x ends before.)"""
    T, dev = 3, (TRITON_DEVICE if backend == "triton" else "cpu")
    mw = moelab.prepare_weights(*weights(torch.bfloat16, device=dev), backend=backend)
    w, ids = routing(T, device=dev)
    x = torch.randn(T, H, device=dev).bfloat16()
    storage = torch.zeros(T * H, dtype=torch.bfloat16, device=dev)  # the output's memory, partly the routing's
    packed = storage[: 2 * T * K].view(torch.int32).view(T, K)
    packed.copy_(moelab.pack_topk_ids_weights(ids, w))
    weights_over = storage[2 * T * K: 4 * T * K].view(torch.float32).view(T, K)
    weights_over.copy_(w)
    for topk, named in ((packed, r"topk"), ((ids, weights_over), r"topk\[1\] \(weights\)")):
        with pytest.raises(ValueError, match=rf"^output: shares memory with {named}; .*pass a separate output"):
            moelab.routed_moe(topk, x, mw, num_experts=E, top_k=K, output=storage.view(T, H))
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=dev)  # apart: written; x may be the output
    moelab.routed_moe(packed, x, mw, num_experts=E, top_k=K, output=out)
    y = x.clone()
    moelab.routed_moe(packed, y, mw, num_experts=E, top_k=K, output=y)
    assert torch.equal(y, out) and not out.isnan().any()


# ---------------------------------------------------------------------------------------------- finalize

def _finalize_inputs(T=3, R=8, device="cpu"):
    gemm2 = torch.randn(R, H, device=device)
    e2p = torch.tensor([0, 1, 2, -1, 5, 4], dtype=torch.int32, device=device)[: T * K]
    return gemm2, torch.rand(T, K, device=device), e2p, torch.randn(T, K, H, device=device)


@pytest.mark.parametrize("use_triton", [False, True])
def test_finalize_output_overlapping_an_input_is_refused(use_triton):
    dev = TRITON_DEVICE if use_triton else "cpu"
    gemm2, w, e2p, delta = _finalize_inputs(device=dev)
    for overlap in (gemm2[:3], gemm2[2:5], delta.view(-1, H)[:3]):
        with pytest.raises(ValueError, match=r"^output: shares memory with (gemm2_output|w2_delta).*pass a separate"):
            moelab.finalize_with_w2_lora(overlap, gemm2, w, e2p, delta, use_triton=use_triton)
    out = torch.full((3, H), float("nan"), device=dev)  # separate memory: the reference's result
    moelab.finalize_with_w2_lora(out, gemm2, w, e2p, delta, use_triton=use_triton)
    ref = reference.finalize_with_w2_lora(gemm2, w, e2p, delta)
    assert_close_to_reference(out, ref, torch.float32, "finalize")
    moelab.finalize_with_w2_lora(gemm2[5:8], gemm2[:5], w, e2p.clamp(max=4), delta, use_triton=use_triton)  # apart


def test_finalize_top_k_zero_and_bad_scale():
    gemm2, _, _, _ = _finalize_inputs()
    with pytest.raises(ValueError, match=r"expert_weights: expected at least one column \(top_k >= 1\)"):
        moelab.finalize_with_w2_lora(torch.empty(3, H), gemm2, torch.rand(3, 0), torch.zeros(0, dtype=torch.int32),
                                     None)
    gemm2, w, e2p, delta = _finalize_inputs()
    for scale in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale: expected a finite float"):
            moelab.finalize_with_w2_lora(torch.empty(3, H), gemm2, w, e2p, delta, scale=scale)


# ---------------------------------------------------------------------------------------------- route

def test_route_rejects_nan_bias_and_scaling():
    logits = torch.randn(5, 8)
    bias = torch.zeros(8)
    bias[3] = float("nan")
    with pytest.raises(ValueError, match=r"correction_bias: expected finite values, got nan at expert 3 \(1 of 8"):
        moelab.route(logits, 2, "deepseek_v3", correction_bias=bias)
    for factor in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="routed_scaling_factor: expected a finite number"):
            moelab.route(logits, 2, routed_scaling_factor=factor)
    bias[3] = 0.5  # finite: as the reference
    weights, ids = moelab.route(logits, 2, "deepseek_v3", correction_bias=bias, routed_scaling_factor=2.0)
    ref_w, ref_ids = reference.route(logits, 2, "deepseek_v3", correction_bias=bias, routed_scaling_factor=2.0)
    assert torch.equal(ids.long(), ref_ids.long())
    assert_close_to_reference(weights, ref_w, torch.float32, "route")


# ---------------------------------------------------------------------------------------------- the bank

def test_bank_set_from_parameters_keeps_no_graph():
    bank = moelab.LoRABank(1, E, H, I, 4)
    params = {k: torch.nn.Parameter(v) for k, v in adapter().items()}
    bank.set(0, **params, scaling=2.0)
    for name in ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"):
        t = getattr(bank, name)
        assert not t.requires_grad and t.grad_fn is None, name
    assert torch.equal(bank.gate_b[0, :, :, :2], (params["gate_b"].detach() * 2.0).to(bank.dtype))


def _save(path, tensors, meta):
    from safetensors.torch import save_file

    save_file(tensors, os.fspath(path), metadata={k: json.dumps(v) for k, v in meta.items()})


def _bank_file(tmp_path, **changes):
    """A bank file as LoRABank.save writes it, then with ``changes`` (metadata keys or tensor names) applied."""
    bank = bank_with(slots=(0,), L=2)
    path = tmp_path / "bank.safetensors"
    bank.save(path)
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as f:
        meta = {k: json.loads(v) for k, v in f.metadata().items()}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for k, v in changes.items():
        if k in tensors:
            if v is None:
                del tensors[k]
            else:
                tensors[k] = v(tensors[k])
        else:
            meta[k] = v
    _save(path, tensors, meta)
    return path


def test_bank_roundtrip(tmp_path):
    bank = bank_with(slots=(0,), L=2)
    bank.save(tmp_path / "b.safetensors")
    back = moelab.LoRABank.load(tmp_path / "b.safetensors")
    assert back.ranks == bank.ranks and torch.equal(back.down_b, bank.down_b)


def test_bank_load_of_files_that_are_not_banks(tmp_path):
    good = _bank_file(tmp_path)
    data = good.read_bytes()
    cases = {
        "empty": b"",
        "truncated": data[: len(data) // 2],
        "garbage": os.urandom(256),
        "text": b"hello, not a bank\n" * 10,
    }
    for name, content in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=rf"^path: {path} is not a LoRABank file .*not a readable safetensors"):
            moelab.LoRABank.load(path)
    # a pickle (torch.save) is refused as a file, never unpickled: its payload would create a marker file
    marker = tmp_path / "executed"
    evil = tmp_path / "evil.pt"

    class Payload:
        def __reduce__(self):
            return (open, (os.fspath(marker), "w"))

    evil.write_bytes(pickle.dumps(Payload()))
    torch_file = tmp_path / "torch.pt"
    torch.save({"gate_a": torch.zeros(1)}, torch_file)
    for path in (evil, torch_file):
        with pytest.raises(ValueError, match="not a readable safetensors file"):
            moelab.LoRABank.load(path)
    assert not marker.exists()
    # a safetensors file of something else
    _save(tmp_path / "other.safetensors", {"weight": torch.zeros(2)}, {})
    with pytest.raises(ValueError, match=r"expected format 'moelab.LoRABank/1' in its metadata, got None"):
        moelab.LoRABank.load(tmp_path / "other.safetensors")


@pytest.mark.parametrize("changes, match", [
    (dict(ranks=[2]), r"ranks: expected 2 ints in \[0, max_rank=4\], got \[2\]"),
    (dict(ranks=[2, 0, 0]), r"ranks: expected 2 ints"),
    (dict(ranks=[5, 0]), r"ranks: expected 2 ints in \[0, max_rank=4\], got \[5, 0\]"),
    (dict(ranks=[-1, 0]), r"ranks: expected 2 ints"),
    (dict(ranks="2,0"), r"ranks: expected 2 ints"),
    (dict(ranks=[2.5, 0]), r"ranks: expected 2 ints"),
    (dict(max_rank="4"), r"max_rank: expected a positive int, got '4'"),
    (dict(hidden_size=0), r"hidden_size: expected a positive int, got 0"),
    (dict(gate_a=None), r"tensors \['gate_a'\] are missing"),
    (dict(gate_a=lambda t: t.to(torch.int32)), r"expected one dtype among .* got .*'gate_a': 'int32'"),
    (dict(down_b=lambda t: t.to(torch.float16)), r"expected one dtype among .*'down_b': 'float16'"),
    (dict(up_b=lambda t: t[:, :, :-1].contiguous()),
     r"up_b: expected shape \[2, 4, 8, 4\] for these sizes, got \[2, 4, 7, 4\]"),
    (dict(up_a=lambda t: t.index_fill(0, torch.tensor([1]), 0.5)),
     r"up_a: slot 1 of rank 0 holds non-zero values past its rank"),
    (dict(down_b=lambda t: t.index_fill(3, torch.tensor([3]), 1.0)),
     r"down_b: slot 0 of rank 2 holds non-zero values past its rank"),
    (dict(gate_b=lambda t: t.index_fill(0, torch.tensor([0]), float("nan"))),
     r"gate_b: expected finite values, got inf or NaN"),
])
def test_bank_load_of_forged_files(tmp_path, changes, match):
    path = _bank_file(tmp_path, **changes)
    with pytest.raises(ValueError, match=rf"^path: {path} is not a LoRABank file .*{match}"):
        moelab.LoRABank.load(path)


# ---------------------------------------------------------------------------------------------- set-up

def test_interpreter_numpy_pair_refused_with_the_fix():
    with pytest.raises(ImportError, match=r"triton 3\.6\.0 with numpy 2\.4\.1 cannot.*pip install 'numpy<2\.4'"):
        _runtime.check_interpreter_numpy("3.6.0", "2.4.1")
    for ok in (("3.6.0", "2.3.5"), ("3.7.0", "2.4.6"), ("3.9.0", "2.4.6"), ("3.6.0", None), ("3.10.0+git1", "3.0")):
        _runtime.check_interpreter_numpy(*ok)


# ---------------------------------------------------------------------------------------------- fuzzing

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

#: One argument of a valid LoRAExperts call, spoiled. Each must raise TypeError or ValueError (never another
#: exception, never a silent result): the fuzzer checks the public entry points against that promise.
SPOILERS = {
    "ids out of range": lambda a: a.update(ids=a["ids"] + 2**32),
    "ids negative": lambda a: a.update(ids=a["ids"] - E),
    "ids float": lambda a: a.update(ids=a["ids"].float()),
    "ids 1-D": lambda a: a.update(ids=a["ids"][:, 0]),
    "ids duplicated": lambda a: a.update(ids=a["ids"][:, :1].expand(-1, K).contiguous()),
    "weights short": lambda a: a.update(w=a["w"][:, :1]),
    "weights int": lambda a: a.update(w=a["w"].long()),
    "x dtype": lambda a: a.update(x=a["x"].double()),
    "x width": lambda a: a.update(x=torch.randn(a["x"].shape[0], H + 1)),
    "x list": lambda a: a.update(x=a["x"].tolist()),
    "x 3-D": lambda a: a.update(x=a["x"][None]),
    "T mismatch": lambda a: a.update(x=torch.randn(a["x"].shape[0] + 1, H)),
    "lora_ids past the bank": lambda a: a.update(lora_ids=torch.full_like(a["lora_ids"], 3)),
    "lora_ids -2": lambda a: a.update(lora_ids=torch.full_like(a["lora_ids"], -2)),
    "lora_ids empty slot": lambda a: a.update(lora_ids=torch.full_like(a["lora_ids"], 1)),
    "lora_ids float": lambda a: a.update(lora_ids=a["lora_ids"].float()),
    "lora_ids 2-D": lambda a: a.update(lora_ids=a["lora_ids"][:, None]),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(T=st.integers(0, 5), seed=st.integers(0, 2**16), spoil=st.sampled_from([None, *SPOILERS]))
def test_fuzz_lora_experts_valid_matches_reference_invalid_raises(T, seed, spoil):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = random_experts(E, H, I, torch.float32)
    bank = moelab.LoRABank(3, E, H, I, 4, dtype=torch.float32)  # slot 1 stays empty
    for s in (0, 2):
        bank.set(s, **adapter(seed=s), scaling=0.5)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="torch")
    args = {"x": torch.randn(T, H, generator=g), "w": random_weights(T, K, generator=g),
            "ids": random_topk_ids(T, K, E, generator=g).long(),
            "lora_ids": torch.tensor([(-1, 0, 2)[i] for i in torch.randint(0, 3, (T,), generator=g).tolist()],
                                     dtype=torch.long)}
    if spoil is None:
        got = experts(args["x"], args["w"], args["ids"], args["lora_ids"])
        ref = reference.lora_experts(args["x"], args["w"], args["ids"], args["lora_ids"], w13, w2, bank)["output"]
        assert got.shape == (T, H) and torch.isfinite(got).all()
        if T:
            assert_close_to_reference(got, ref, torch.float32, "fuzz")
        return
    SPOILERS[spoil](args)
    if T == 0 and spoil in ("ids out of range", "ids negative", "ids duplicated", "lora_ids past the bank",
                            "lora_ids -2", "lora_ids empty slot"):
        return  # no element carries the bad value
    with pytest.raises((TypeError, ValueError)):
        experts(args["x"], args["w"], args["ids"], args["lora_ids"])


#: The spoilers only ``validate=True`` sees (they need the ids' values, read on the device).
VALUE_SPOILERS = {"ids out of range", "ids negative", "ids duplicated", "lora_ids past the bank", "lora_ids -2",
                  "lora_ids empty slot"}


@pytest.mark.parametrize("spoil", [None, *sorted(set(SPOILERS) - VALUE_SPOILERS)])
def test_lora_experts_one_predicate_path_only_for_well_formed_calls(spoil):
    """With ``validate=False`` a well-formed call takes ``LoRAExperts``' one-predicate path (and matches the
    reference); a spoiled shape, dtype or type fails the predicate, and the checks one by one raise."""
    w13, w2 = random_experts(E, H, I, torch.float32)
    bank = moelab.LoRABank(3, E, H, I, 4, dtype=torch.float32)
    bank.set(0, **adapter(seed=0), scaling=0.5)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="torch")
    g = torch.Generator().manual_seed(5)
    args = {"x": torch.randn(4, H, generator=g), "w": random_weights(4, K, generator=g),
            "ids": random_topk_ids(4, K, E, generator=g).long(), "lora_ids": torch.tensor([0, -1, 0, 0])}
    if spoil is None:
        assert experts._plain_call_ok(args["x"], args["w"], args["ids"], args["lora_ids"])
        got = experts(args["x"], args["w"], args["ids"], args["lora_ids"], validate=False)
        ref = reference.lora_experts(args["x"], args["w"], args["ids"], args["lora_ids"], w13, w2, bank)["output"]
        assert_close_to_reference(got, ref, torch.float32, "one-predicate path")
        bank.down_b = bank.down_b.transpose(0, 1).contiguous().transpose(0, 1)  # a bank tensor assigned strided
        assert not experts._plain_call_ok(args["x"], args["w"], args["ids"], args["lora_ids"])
        with pytest.raises(ValueError, match="bank.down_b"):
            experts(args["x"], args["w"], args["ids"], args["lora_ids"], validate=False)
        return
    SPOILERS[spoil](args)
    assert not experts._plain_call_ok(args["x"], args["w"], args["ids"], args["lora_ids"])
    with pytest.raises((TypeError, ValueError)):
        experts(args["x"], args["w"], args["ids"], args["lora_ids"], validate=False)
