"""moelab.packing against the float64 reference, including the sign-mask trap (docs/contract.md §2)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moelab
from moelab import reference


def test_sign_mask_trap_keeps_expert_id():
    # The trap: a negative or -0.0 weight has its bf16 sign bit set; unmasked, it sign-extends into the id.
    ids = torch.tensor([[5, 7, 9]], dtype=torch.int32)
    weights = torch.tensor([[-0.5, -0.0, 0.25]])
    packed = moelab.pack_topk_ids_weights(ids, weights)
    got_ids, got_w = moelab.unpack_topk_ids_weights(packed)
    assert got_ids.tolist() == [[5, 7, 9]]
    assert got_w.float().tolist() == [[-0.5, 0.0, 0.25]]
    assert torch.signbit(got_w[0, 1].float())  # -0.0 survives as -0.0
    # What the unmasked formula (FlashInfer's test helper) would have produced: id -1 for the signed slots.
    unmasked = (ids << 16) | weights.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    assert (unmasked >> 16).tolist() == [[-1, -1, 9]]


@given(T=st.integers(0, 64), K=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_pack_matches_reference(T, K, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32768, (T, K), generator=g, dtype=torch.int32)
    weights = torch.randn(T, K, generator=g) * 3  # negative weights included on purpose
    packed = moelab.pack_topk_ids_weights(ids, weights)
    assert packed.dtype == torch.int32
    assert torch.equal(packed, reference.pack_topk_ids_weights(ids, weights))
    got_ids, got_w = moelab.unpack_topk_ids_weights(packed)
    ref_ids, ref_w = reference.unpack_topk_ids_weights(packed)
    assert torch.equal(got_ids, ids) and torch.equal(got_ids, ref_ids)
    assert got_w.dtype == torch.bfloat16
    assert torch.equal(got_w.double(), ref_w)
    assert torch.equal(got_w, weights.to(torch.bfloat16))  # round to nearest even, like .to(bf16)


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int16, torch.int32])  # every int dtype is accepted
def test_pack_accepts_int_dtypes(ids_dtype):
    ids = torch.tensor([[0, 32767]], dtype=ids_dtype)
    packed = moelab.pack_topk_ids_weights(ids, torch.tensor([[1.0, 2.0]]))
    assert moelab.unpack_topk_ids_weights(packed)[0].tolist() == [[0, 32767]]


@pytest.mark.parametrize(
    "ids, weights, kwargs, error, match",
    [
        (torch.tensor([[32768]]), torch.ones(1, 1), {}, ValueError, "topk_ids.*32768"),  # over the int16 field
        (torch.tensor([[-1]]), torch.ones(1, 1), {}, ValueError, "topk_ids.*-1"),  # negative id
        (torch.tensor([[4]]), torch.ones(1, 1), {"num_experts": 4}, ValueError, r"\[0, 4\)"),  # id == E
        (torch.tensor([[1.0]]), torch.ones(1, 1), {}, TypeError, "topk_ids.*dtype"),  # float ids
        (torch.tensor([[1, 2]]), torch.ones(1, 3), {}, ValueError, "topk_weights.*shape"),  # shape mismatch
        (torch.tensor([1, 2]), torch.ones(2), {}, ValueError, "topk_ids.*2-D"),  # 1-D
        ([[1]], torch.ones(1, 1), {}, TypeError, "topk_ids.*Tensor"),  # not a tensor
        (torch.tensor([[1]]), torch.ones(1, 1, dtype=torch.int32), {}, TypeError, "topk_weights.*dtype"),
        (torch.tensor([[1]]), torch.ones(1, 1), {"num_experts": 40000}, ValueError, "num_experts"),
    ],
)
def test_pack_rejects_bad_input(ids, weights, kwargs, error, match):
    with pytest.raises(error, match=match):
        moelab.pack_topk_ids_weights(ids, weights, **kwargs)


def test_unpack_rejects_non_int32():
    with pytest.raises(TypeError, match="packed.*int32"):
        moelab.unpack_topk_ids_weights(torch.zeros(2, 2, dtype=torch.int64))


def test_pack_rejects_duplicate_ids_in_a_token():
    with pytest.raises(ValueError, match="topk_ids.*distinct"):
        moelab.pack_topk_ids_weights(torch.tensor([[3, 3]]), torch.ones(1, 2))
    packed = moelab.pack_topk_ids_weights(torch.tensor([[3, 3]]), torch.ones(1, 2), validate=False)
    assert moelab.unpack_topk_ids_weights(packed)[0].tolist() == [[3, 3]]
