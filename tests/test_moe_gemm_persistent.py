"""The GEMMs on the persistent grid (``moe_gemm.PERSISTENT``: a few programs walk every live tile in one flattened
loop, then fill the tiles past the live rows): every element of their outputs written, bit for bit the one-tile
kernels', right against the float64 reference, with the tile threshold lowered to reach the interpreter's small
tiles. On a CPU the kernels run in Triton's interpreter. Three programs make the grid here, so each walks several
tiles."""

import pytest
import torch
from helpers import assert_close_to_reference, routed_on_tiles, routed_problem

import moelab
from moelab import reference
from moelab.kernels import moe_gemm
from moelab.kernels.moe_gemm import GemmConfig
from moelab.kernels.segments import build_segments_triton

SENTINEL = 12345.0  # never a value of the activation here (|act| is far below it)


def _persistent(monkeypatch, on: bool):
    monkeypatch.setattr(moe_gemm, "PERSISTENT", {"gemm1": on, "gemm2": on})
    monkeypatch.setattr(moe_gemm, "PERSISTENT_MIN_BLOCK_M", 16)
    monkeypatch.setattr(moe_gemm, "PERSISTENT_PROGRAMS", 3)


def _spy_kernels(monkeypatch) -> list[str]:
    """Names of the GEMM kernels launched from now on."""
    launched = []
    for name in ("_gemm1_swiglu_kernel", "_gemm1_swiglu_persistent_kernel", "_gemm2_kernel",
                 "_gemm2_persistent_kernel"):
        kernel = getattr(moe_gemm, name)

        class Spy:
            def __getitem__(self, grid, kernel=kernel, name=name):
                launched.append(name)
                return kernel[grid]
        monkeypatch.setattr(moe_gemm, name, Spy())
    return launched


def _gemms(x, ids, W, E, K, config, **options):
    """GEMM1 and GEMM2 into outputs filled with SENTINEL: (act, GEMM2's output, segments)."""
    seg = build_segments_triton(ids, E, config.block_m)
    rows, (H, I) = seg.row_to_slot.numel(), W.gemm2_weights.shape[1:]
    act = torch.full((rows, I), SENTINEL, dtype=x.dtype, device=x.device)
    moe_gemm.gemm1_swiglu(x, W.gemm1_weights, act, seg, top_k=K, config=config, **options)
    out = torch.full((rows, H), SENTINEL, dtype=x.dtype, device=x.device)
    moe_gemm.gemm2(act, W.gemm2_weights, out, seg, config=config, dead_fill=options.get("dead_fill", 0.0))
    return act, out, seg


@pytest.mark.parametrize("config", [GemmConfig(16, 32, 32, 4, 1), GemmConfig(16, 32, 32, 4, 2, group_m=3)],
                         ids=["plain", "grouped"])
@pytest.mark.parametrize("H, I", [(64, 96), (72, 80)], ids=["even", "K-tail-and-column-tail"])
def test_persistent_gemms_write_every_element_as_the_one_tile_kernels(H, I, config, device, monkeypatch):
    T, K, E, dtype = 40, 4, 4, torch.bfloat16
    x, ids, w, w13, w2, W = routed_problem(T, K, E, H, I, dtype, seed=H + I + config.group_m, device=device)
    launched = _spy_kernels(monkeypatch)
    _persistent(monkeypatch, False)
    one_tile = _gemms(x, ids, W, E, K, config, dead_fill=0.0)
    _persistent(monkeypatch, True)
    persistent = _gemms(x, ids, W, E, K, config, dead_fill=0.0)
    assert launched == ["_gemm1_swiglu_kernel", "_gemm2_kernel", "_gemm1_swiglu_persistent_kernel",
                        "_gemm2_persistent_kernel"]
    seg = persistent[2]
    live_tiles = int((seg.block_group >= 0).sum())
    assert live_tiles < seg.block_group.numel(), "the problem should have row tiles past the live rows"
    for name, got, expected in zip(("GEMM1", "GEMM2"), persistent[:2], one_tile[:2]):
        assert not (got == SENTINEL).any(), f"the persistent {name} left elements unwritten"
        assert torch.equal(got, expected), name
        assert (got[live_tiles * config.block_m:] == 0).all(), f"{name}'s dead tiles hold DEAD_FILL"


@pytest.mark.parametrize("options", ["plain", "swigluoai-bias"])
def test_persistent_gemms_in_the_routed_moe_match_the_reference(options, device, monkeypatch):
    T, K, E, H, I, dtype = 40, 4, 4, 64, 48, torch.float32
    x, ids, w, w13, w2, W = routed_problem(T, K, E, H, I, dtype, seed=len(options), device=device)
    ref_kwargs = {}
    if options == "swigluoai-bias":
        g = torch.Generator().manual_seed(5)
        b13 = (torch.randn(E, 2 * I, generator=g) * 0.1).to(device)
        b2 = (torch.randn(E, H, generator=g) * 0.1).to(device)
        W = moelab.prepare_weights(w13, w2, backend="triton", activation="swigluoai", w13_bias=b13, w2_bias=b2)
        ref_kwargs = dict(activation="swigluoai", w13_bias=b13, w2_bias=b2)
    launched = _spy_kernels(monkeypatch)
    _persistent(monkeypatch, True)
    out = routed_on_tiles(GemmConfig(16, 32, 32, 4, 1), x, ids, w, W, E, K)[0]
    assert launched == ["_gemm1_swiglu_persistent_kernel", "_gemm2_persistent_kernel"]
    ref = reference.routed_moe(ids, w, x, w13, w2, **ref_kwargs)
    assert_close_to_reference(out, ref["output"], dtype, f"persistent GEMM1, {options}")


def test_persistent_gemm1_with_a_delta_and_weights_on_the_input(device, monkeypatch):
    """GEMM1's activation rows against float64: silu(gate + d_gate) * (up + d_up) of each slot's w * x."""
    T, K, E, H, I, dtype = 40, 4, 4, 64, 48, torch.float32
    x, ids, w, w13, w2, W = routed_problem(T, K, E, H, I, dtype, seed=9, device=device)
    delta = (torch.randn(T * K, 2 * I, generator=torch.Generator().manual_seed(5)) * 0.1).to(device)  # [up | gate]
    launched = _spy_kernels(monkeypatch)
    _persistent(monkeypatch, True)
    act, _, seg = _gemms(x, ids, W, E, K, GemmConfig(16, 32, 32, 4, 1), delta=delta, input_weights=w.contiguous())
    assert launched == ["_gemm1_swiglu_persistent_kernel", "_gemm2_persistent_kernel"]
    inputs = x.double()[torch.arange(T * K, device=device) // K] * w.double().flatten()[:, None]
    experts = w13.double()[ids.flatten().long()]  # [T*K, 2I, H], rows [gate; up]
    gate = torch.einsum("sh,sih->si", inputs, experts[:, :I]) + delta.double()[:, I:]
    up = torch.einsum("sh,sih->si", inputs, experts[:, I:]) + delta.double()[:, :I]
    expected = torch.nn.functional.silu(gate) * up
    assert_close_to_reference(act[seg.slot_to_row.long()], expected, dtype, "persistent GEMM1, delta, w on input")


def test_persistent_gemms_with_no_local_rows_fill_every_tile(device, monkeypatch):
    """Every slot routed to another rank's experts: no live tile, every row tile filled."""
    T, K, E, H, I, dtype = 40, 4, 4, 64, 48, torch.bfloat16
    x, ids, w, w13, w2, W = routed_problem(T, K, E, H, I, dtype, seed=11, device=device)
    _persistent(monkeypatch, True)
    act, out, seg = _gemms(x, ids + E, W, E, K, GemmConfig(16, 32, 32, 4, 1), dead_fill=0.0)
    assert (seg.block_group < 0).all()
    assert (act == 0).all() and (out == 0).all(), "the persistent grid left dead tiles unfilled"


def test_the_persistent_rule(device, monkeypatch):
    monkeypatch.setattr(moe_gemm, "PERSISTENT", {"gemm1": True, "gemm2": False})
    wide, narrow = GemmConfig(128, 128, 64, 8, 4), GemmConfig(64, 128, 64, 4, 4)
    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=device)
    if device.type == "cuda" and moe_gemm.device_limits(device).shared_memory < 224 * 1024:
        assert not moe_gemm.takes_persistent(wide, x), "no room for the epilogue's tile beside 4 stages"
    else:
        assert moe_gemm.takes_persistent(wide, x)
    assert not moe_gemm.takes_persistent(narrow, x), "tiles below PERSISTENT_MIN_BLOCK_M keep one tile each"
    assert not moe_gemm.takes_persistent(wide, x, "gemm2"), "each GEMM has its own switch"
    monkeypatch.setattr(moe_gemm, "PERSISTENT", {"gemm1": False, "gemm2": False})
    assert not moe_gemm.takes_persistent(wide, x)
