"""The GEMMs' TMA loads (``moe_gemm.W_DESC``: weight tiles, and GEMM2's activation tiles, through tensor
descriptors) on wide tiles (GEMM1's expert threshold lowered here to reach the interpreter's small shapes): right
against the float64 reference where the tiles read past the end of K (zero-filled), past an expert's columns into
the next expert's rows (never stored) and past the last expert, and the same output as the pointer loads. On a CPU
the kernels run in Triton's interpreter."""

import pytest
import torch
from helpers import (
    assert_close_to_reference,
    random_topk_ids,
    random_weights,
    record_tma_choices,
    routed_on_tiles,
    routed_problem,
)

import moelab
from moelab import reference
from moelab.kernels import moe_gemm
from moelab.kernels.moe_gemm import GemmConfig


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H, I", [(64, 64), (72, 80)], ids=["even", "K-tail-and-column-tail"])
def test_tma_loads_match_the_reference_and_the_pointer_loads(H, I, dtype, device, monkeypatch):
    _needs_tma(device)
    T, K, E = 40, 4, 4  # 40 rows an expert: one 64-row tile each
    x, ids, w, w13, w2, W = routed_problem(T, K, E, H, I, dtype, seed=H + I, device=device)
    config = GemmConfig(64, 32, 32, 4, 1)
    _tma_everywhere(monkeypatch)
    launched = record_tma_choices(monkeypatch)
    out_tma = routed_on_tiles(config, x, ids, w, W, E, K)[0]
    assert launched == [True, True], "both GEMMs should have taken the TMA loads"
    monkeypatch.setattr(moe_gemm, "TMA", False)
    out_ptr = routed_on_tiles(config, x, ids, w, W, E, K)[0]
    assert launched[2:] == [False, False]
    ref = reference.routed_moe(ids, w, x, w13, w2)
    assert_close_to_reference(out_tma, ref["output"], dtype, f"TMA, H={H} I={I}")
    assert_close_to_reference(out_ptr, ref["output"], dtype, f"pointers, H={H} I={I}")
    if device.type == "cpu":  # the interpreter multiplies each product exactly: the same sums in the same order
        assert torch.equal(out_tma, out_ptr)


def _needs_tma(device):
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("TMA descriptors need an SM 9.0+ GPU (Hopper); this GPU keeps the pointer loads")


def _tma_everywhere(monkeypatch):
    monkeypatch.setattr(moe_gemm, "TMA", True)
    monkeypatch.setattr(moe_gemm, "TMA_MIN_BLOCK_M", 64)
    monkeypatch.setattr(moe_gemm, "TMA_MIN_HI", 0)
    monkeypatch.setattr(moe_gemm, "TMA_MIN_HI_GEMM2", 0)


def test_tma_rule(device, monkeypatch):
    _needs_tma(device)
    monkeypatch.setattr(moe_gemm, "TMA", True)
    wide, w = GemmConfig(128, 128, 64, 8, 3), torch.zeros(2, 32, 64, device=device)
    big, small = 4096 * 14336, 2048 * 768  # Mixtral's experts, Qwen3-30B-A3B's
    assert moe_gemm.takes_tma(wide, big, w)
    assert not moe_gemm.takes_tma(wide, small, w), "GEMM1 keeps the pointer loads on small experts"
    assert not moe_gemm.takes_tma(GemmConfig(64, 128, 64, 4, 4), big, w), "64-row tiles keep the pointer loads"
    assert not moe_gemm.takes_tma(wide, big, torch.zeros(2, 32, 65, device=device)), "rows of 260 B"
    assert not moe_gemm.takes_tma(wide, big, w, torch.zeros(4, 66, device=device)[:, :65]), "operand rows of 264 B"
    assert moe_gemm.takes_tma(wide, big, w, torch.zeros(4, 72, device=device)[:, :65]), "a strided, aligned view"
    assert not moe_gemm.takes_tma(wide, big, w.transpose(1, 2)), "a transposed weight is not K-major"
    assert not moe_gemm.takes_tma(wide, big, w, torch.zeros(65, device=device)[1:].view(1, 64)), "misaligned base"
    gemm2 = moe_gemm.TMA_MIN_HI_GEMM2
    assert moe_gemm.takes_tma(wide, small, w, min_hi=gemm2), "GEMM2 (whole-tile operands) takes TMA on small experts"
    assert not moe_gemm.takes_tma(GemmConfig(64, 128, 64, 4, 4), small, w, min_hi=gemm2), "but not on 64-row tiles"
    monkeypatch.setattr(moe_gemm, "TMA", False)
    assert not moe_gemm.takes_tma(wide, big, w), "MOELAB_TMA=0 keeps the pointer loads"
    assert not moe_gemm.takes_tma(wide, small, w, min_hi=gemm2), "in both GEMMs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_small_experts_on_128_row_tiles_take_tma_in_gemm2_only(dtype, device, monkeypatch):
    """The default thresholds on experts far below TMA_MIN_HI: GEMM1 (gathered input rows) keeps the pointer
    loads, GEMM2 reads its tiles through TMA, and the output is right."""
    _needs_tma(device)
    monkeypatch.setattr(moe_gemm, "TMA", True)
    T, K, E, H, I = 40, 4, 4, 64, 48
    x, ids, w, w13, w2, W = routed_problem(T, K, E, H, I, dtype, seed=3, device=device)
    launched = record_tma_choices(monkeypatch)
    out = routed_on_tiles(GemmConfig(128, 32, 32, 4, 4), x, ids, w, W, E, K)[0]
    assert launched == [False, True], "GEMM1 by pointer, GEMM2 through TMA"
    ref = reference.routed_moe(ids, w, x, w13, w2)
    assert_close_to_reference(out, ref["output"], dtype, "small experts, 128-row tiles")


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_tma_loads_of_an_up_only_w13(bias, device, monkeypatch):
    """Not gated (relu2, w13 [E, I, H]): each expert's rows of the TMA view are its I up rows."""
    _needs_tma(device)
    T, K, E, H, I, dtype = 40, 4, 4, 72, 80, torch.float32
    g = torch.Generator().manual_seed(7 + bias)
    w13 = (torch.randn(E, I, H, generator=g) / H**0.5).to(device)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(device)
    b13 = (torch.randn(E, I, generator=g) * 0.1).to(device) if bias else None
    x = torch.randn(T, H, generator=g).to(device)
    ids = random_topk_ids(T, K, E, generator=g, device=device)
    w = random_weights(T, K, generator=g, device=device)
    W = moelab.prepare_weights(w13, w2, backend="triton", activation="relu2", gated=False, w13_bias=b13)
    _tma_everywhere(monkeypatch)
    launched = record_tma_choices(monkeypatch)
    out = routed_on_tiles(GemmConfig(64, 32, 32, 4, 1), x, ids, w, W, E, K)[0]
    assert launched == [True, True]
    ref = reference.routed_moe(ids, w, x, w13, w2, activation="relu2", gated=False, w13_bias=b13)
    assert_close_to_reference(out, ref["output"], dtype, f"relu2, bias={bias}")


class _StagesSpy:
    """Stands in for a GEMM kernel: records each launch's ``num_stages``, then launches the kernel."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def call(*args, **kwargs):
            self.seen.append(kwargs["num_stages"])
            return launch(*args, **kwargs)
        return call


@pytest.mark.parametrize("block_m, gemm2_stages", [(128, moe_gemm.GEMM2_MAX_STAGES), (64, 4)],
                         ids=["128-row", "64-row"])
def test_gemm2_stages_are_capped_on_128_row_tiles(block_m, gemm2_stages, device, monkeypatch):
    """GEMM2 runs at most GEMM2_MAX_STAGES stages on tiles of 128 rows (GEMM1 keeps the config's 4), and the
    config's stages on smaller tiles; the output is right either way."""
    T, K, E, H, I, dtype = 40, 4, 4, 64, 48, torch.float32
    x, ids, w, w13, w2, W = routed_problem(T, K, E, H, I, dtype, seed=block_m, device=device)
    stages1, stages2 = [], []
    monkeypatch.setattr(moe_gemm, "_gemm1_swiglu_kernel", _StagesSpy(moe_gemm._gemm1_swiglu_kernel, stages1))
    monkeypatch.setattr(moe_gemm, "_gemm2_kernel", _StagesSpy(moe_gemm._gemm2_kernel, stages2))
    out = routed_on_tiles(GemmConfig(block_m, 32, 32, 4, 4), x, ids, w, W, E, K)[0]
    assert (stages1, stages2) == ([4], [gemm2_stages])
    ref = reference.routed_moe(ids, w, x, w13, w2)
    assert_close_to_reference(out, ref["output"], dtype, f"{block_m}-row tiles")
