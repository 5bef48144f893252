"""The grouped GEMMs' tile order (``GemmConfig.group_m``): any group size computes every tile exactly once, so the
output is bit for bit the ungrouped one and matches the float64 reference. On a CPU the kernels run in Triton's
interpreter."""

import pytest
import torch
from helpers import assert_close_to_reference, routed_on_tiles, routed_problem

from moelab import reference
from moelab.kernels.moe_gemm import GemmConfig


@pytest.mark.parametrize("group_m", [3, 64])  # 3: the last group is partial; 64: one group holds every tile
def test_grouped_order_is_bitwise_the_ungrouped_order(group_m, device):
    # 14 tiles of 16 rows over 4 experts (not a multiple of 3), 3 column blocks in GEMM1 and 2 in GEMM2.
    T, K, E, H, I, dtype = 40, 4, 4, 64, 96, torch.bfloat16
    x, ids, w, w13, w2, W = routed_problem(T, K, E, H, I, dtype, seed=group_m, device=device)
    out1, gemm2_1 = routed_on_tiles(GemmConfig(16, 32, 32, 4, 1), x, ids, w, W, E, K)
    outg, gemm2_g = routed_on_tiles(GemmConfig(16, 32, 32, 4, 1, group_m=group_m), x, ids, w, W, E, K)
    assert torch.equal(gemm2_g, gemm2_1), "a grouped tile order left a GEMM2 tile unwritten or wrote it twice"
    assert torch.equal(outg, out1)
    ref = reference.routed_moe(ids, w, x, w13, w2)
    assert_close_to_reference(outg, ref["output"], dtype, f"group_m={group_m}")

