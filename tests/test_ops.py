"""The seed's two standalone ops (docs/contract.md §5): Triton kernel and torch fallback against the float64
reference."""

import pytest
import torch
from helpers import REL_TOL, assert_close_to_reference, poison, random_topk_ids, rel_err
from hypothesis import given
from hypothesis import strategies as st

import moelab
from moelab import reference
from moelab.permutation import expanded_to_permuted_torch

PATHS = [True, False]  # use_triton: the Triton kernel (interpreted on a CPU) / the torch fallback


def make_map(T, K, E, E_local, offset, tile, device):
    ids = random_topk_ids(T, K, E, device=device)
    return ids, expanded_to_permuted_torch(ids, offset, E_local, tile)


@pytest.mark.parametrize("use_triton", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "T, K, E, E_local, offset, I",
    [
        (7, 2, 8, 8, 0, 40),  # every slot local; odd I: masked columns
        (9, 3, 8, 3, 2, 24),  # expert-parallel window [2, 5): many -1 slots must come out as zero rows
        (1, 1, 4, 4, 0, 1100),  # I wider than one 1024-column program
    ],
)
def test_unpermute_matches_reference(use_triton, dtype, T, K, E, E_local, offset, I, device):
    ids, e2p = make_map(T, K, E, E_local, offset, 8, device)
    rows = int(e2p.max()) + 1 + 8 if T else 8
    act = poison(torch.empty(rows, I, dtype=dtype, device=device))  # dead rows NaN: must never leak
    live = e2p[e2p >= 0].long()
    act[live] = torch.randn(live.numel(), I, device=device).to(dtype)
    out = moelab.unpermute_activation(act, e2p, T, K, use_triton=use_triton)
    ref = reference.unpermute_activation(act, e2p, T, K)
    assert out.shape == (T * K, I) and not out.isnan().any()
    assert torch.equal(out.double().cpu(), ref)  # a gather is exact
    assert bool((out[e2p < 0] == 0).all())


@pytest.mark.parametrize("use_triton", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_delta", [True, False])  # HAS_DELTA: the fused W2 LoRA add, or base finalize only
@pytest.mark.parametrize("scale", [1.0, 0.5])  # HAS_SCALE skipped at 1.0 (vLLM's value)
@pytest.mark.parametrize("E_local, offset", [(8, 0), (3, 4)])  # all local / an EP window with skipped slots
def test_finalize_matches_reference(use_triton, dtype, with_delta, scale, E_local, offset, device):
    T, K, E, H = 10, 3, 8, 72
    ids, e2p = make_map(T, K, E, E_local, offset, 8, device)
    rows = int(e2p.max()) + 9
    gemm2 = poison(torch.empty(rows, H, dtype=dtype, device=device))  # unmapped rows NaN: never read
    live = e2p[e2p >= 0].long()
    gemm2[live] = torch.randn(live.numel(), H, device=device).to(dtype)
    weights = torch.rand(T, K, device=device).to(dtype)
    delta = torch.randn(T, K, H, device=device).to(dtype) if with_delta else None
    out = poison(torch.empty(T, H, dtype=dtype, device=device))
    got = moelab.finalize_with_w2_lora(out, gemm2, weights, e2p, delta, scale=scale, use_triton=use_triton)
    assert got is out and not out.isnan().any()
    zero = torch.zeros(T, K, H) if delta is None else delta
    ref = reference.finalize_with_w2_lora(gemm2, weights, e2p, zero, scale=scale)
    assert_close_to_reference(out, ref, dtype, "finalize")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_finalize_triton_and_torch_agree_and_zero_delta_is_bitwise_base(dtype, device):
    # The base-token guarantee rests on this: adding an all-zero delta leaves every output bit unchanged, on both
    # implementations; and the two agree (fp32 sums in the same order: bit for bit but for fused multiply-adds).
    T, K, E, H = 12, 4, 8, 64
    ids, e2p = make_map(T, K, E, E, 0, 8, device)
    gemm2 = torch.randn(int(e2p.max()) + 1, H, device=device).to(dtype)
    weights = torch.rand(T, K, device=device).to(dtype)
    delta = torch.randn(T, K, H, device=device).to(dtype)
    outs = {}
    for use_triton in (True, False):
        def finalize(d, use_triton=use_triton):
            out = poison(torch.empty(T, H, dtype=dtype, device=device))
            return moelab.finalize_with_w2_lora(out, gemm2, weights, e2p, d, use_triton=use_triton)
        base = finalize(None)
        assert torch.equal(base, finalize(torch.zeros(T, K, H, dtype=dtype, device=device)))
        outs[use_triton] = (base, finalize(delta))
    for i, what in enumerate(("base", "with delta")):
        triton_out, torch_out = outs[True][i].double(), outs[False][i].double()
        assert rel_err(triton_out, torch_out) < REL_TOL[dtype] / 10, what


@given(T=st.integers(0, 20), K=st.integers(1, 6), H=st.integers(1, 50), seed=st.integers(0, 99))
def test_finalize_property(T, K, H, seed):
    g = torch.Generator().manual_seed(seed)
    E = 8
    K = min(K, E)
    ids = random_topk_ids(T, K, E, generator=g)
    e2p = expanded_to_permuted_torch(ids, 0, E, 8)
    gemm2 = torch.randn(int(e2p.max()) + 1 if T else 1, H, generator=g)
    weights = torch.rand(T, K, generator=g)
    delta = torch.randn(T, K, H, generator=g)
    out = poison(torch.empty(T, H))
    moelab.finalize_with_w2_lora(out, gemm2, weights, e2p, delta)
    ref = reference.finalize_with_w2_lora(gemm2, weights, e2p, delta)
    if T:
        assert_close_to_reference(out, ref, torch.float32, "finalize")


def test_ops_reject_bad_input():
    e2p = torch.zeros(6, dtype=torch.int32)
    with pytest.raises(ValueError, match="expanded_idx_to_permuted_idx.*shape"):
        moelab.unpermute_activation(torch.zeros(4, 8), e2p, 2, 2)
    with pytest.raises(TypeError, match="expanded_idx_to_permuted_idx.*int32"):
        moelab.unpermute_activation(torch.zeros(4, 8), e2p.long(), 3, 2)
    with pytest.raises(ValueError, match="w2_delta.*shape"):
        moelab.finalize_with_w2_lora(torch.zeros(3, 8), torch.zeros(4, 8), torch.zeros(3, 2), e2p, torch.zeros(3, 2, 4))
    with pytest.raises(ValueError, match="gemm2_output.*shape"):
        moelab.finalize_with_w2_lora(torch.zeros(3, 8), torch.zeros(4, 5), torch.zeros(3, 2), e2p, None)
    with pytest.raises(TypeError, match="act_permuted.*dtype"):
        moelab.unpermute_activation(torch.zeros(4, 8, dtype=torch.int32), e2p, 3, 2)


@pytest.mark.parametrize("use_triton", PATHS)
def test_map_rows_out_of_range_rejected_or_masked(use_triton, device):
    # A map row past the permuted buffer: validate=True raises; validate=False must not read out of bounds.
    act = torch.randn(8, 16, device=device)
    e2p = torch.tensor([0, 1, 7, 1000000], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"expanded_idx_to_permuted_idx.*\[-1, 8\)"):
        moelab.unpermute_activation(act, e2p, 2, 2, use_triton=use_triton)
    out = moelab.unpermute_activation(act, e2p, 2, 2, validate=False, use_triton=use_triton)
    assert torch.equal(out[:3], act[[0, 1, 7]]) and bool((out[3] == 0).all())
    gemm2, weights = torch.randn(8, 16, device=device), torch.rand(2, 2, device=device)
    with pytest.raises(ValueError, match="expanded_idx_to_permuted_idx"):
        moelab.finalize_with_w2_lora(torch.empty(2, 16, device=device), gemm2, weights, e2p, None,
                                     use_triton=use_triton)
    out = moelab.finalize_with_w2_lora(torch.empty(2, 16, device=device), gemm2, weights, e2p, None, validate=False,
                                       use_triton=use_triton)
    assert torch.allclose(out[1], weights[1, 0] * gemm2[7], atol=1e-6)


def test_non_contiguous_map_rejected():
    e2p = torch.zeros(8, 2, dtype=torch.int32)[:, 0]
    with pytest.raises(ValueError, match="expanded_idx_to_permuted_idx.*contiguous"):
        moelab.unpermute_activation(torch.zeros(4, 8), e2p, 4, 2)
