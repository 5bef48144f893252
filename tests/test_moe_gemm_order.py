"""The grouped GEMMs' tile order (``GemmConfig.group_m``): any group size computes every tile exactly once, so the
output is bit for bit the ungrouped one and matches the float64 reference. On a CPU the kernels run in Triton's
interpreter."""

import pytest
import torch
from helpers import assert_close_to_reference, poison, random_experts, random_topk_ids, random_weights

import moelab
from moelab import reference
from moelab.backends import triton_backend
from moelab.contract import RoutedMoECall
from moelab.kernels.moe_gemm import GemmConfig


def _routed(config, x, ids, w, W, E, K):
    out = poison(torch.empty_like(x))
    call = RoutedMoECall((ids, w), None, x, W, num_experts=E, top_k=K, local_expert_offset=0,
                         gemm1_lora_delta=None, do_finalize=True, output=out)
    result = triton_backend.routed_moe(call, config=config)
    return result.output, result.gemm2_output


@pytest.mark.parametrize("group_m", [3, 64])  # 3: the last group is partial; 64: one group holds every tile
def test_grouped_order_is_bitwise_the_ungrouped_order(group_m, device):
    # 14 tiles of 16 rows over 4 experts (not a multiple of 3), 3 column blocks in GEMM1 and 2 in GEMM2.
    T, K, E, H, I, dtype = 40, 4, 4, 64, 96, torch.bfloat16
    g = torch.Generator().manual_seed(group_m)
    w13, w2 = random_experts(E, H, I, dtype, device=device)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    ids = random_topk_ids(T, K, E, generator=g, device=device)
    w = random_weights(T, K, generator=g, device=device)
    W = moelab.prepare_weights(w13, w2, backend="triton")
    base = GemmConfig(16, 32, 32, 4, 1)
    out1, gemm2_1 = _routed(base, x, ids, w, W, E, K)
    outg, gemm2_g = _routed(GemmConfig(16, 32, 32, 4, 1, group_m=group_m), x, ids, w, W, E, K)
    assert torch.equal(gemm2_g, gemm2_1), "a grouped tile order left a GEMM2 tile unwritten or wrote it twice"
    assert torch.equal(outg, out1)
    ref = reference.routed_moe(ids, w, x, w13, w2)
    assert_close_to_reference(outg, ref["output"], dtype, f"group_m={group_m}")

