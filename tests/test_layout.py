"""moelab.layout: FlashInfer's BF16 BlockMajorK weight layout, step by step and against FlashInfer
(docs/contract.md §4)."""

import pytest
import torch

from moelab import layout

#: Importing flashinfer 0.7.4 warns about its own use of deprecated cutlass-dsl names: not ours to fix.
pytestmark = pytest.mark.filterwarnings(r"ignore:cutlass\.utils\..* is deprecated:DeprecationWarning")


def _hf_weights(E, H, I):
    return torch.randn(E, 2 * I, H).bfloat16(), torch.randn(E, H, I).bfloat16()


@pytest.mark.parametrize(
    "E, H, I",
    [
        (2, 256, 128),  # the smallest I FlashInfer takes; gemm1 is 8 shuffle blocks tall
        (3, 128, 384),  # I > H, an odd number of 128-blocks of I
        (1, 512, 256),  # one expert
    ],
)
def test_round_trip_is_exact(E, H, I):
    w13, w2 = _hf_weights(E, H, I)
    gemm1, gemm2 = layout.to_flashinfer(w13, w2)
    assert gemm1.shape == (E, H // 64, 2 * I, 64) and gemm2.shape == (E, I // 64, H, 64)
    assert gemm1.dtype == gemm2.dtype == torch.bfloat16
    assert gemm1.is_contiguous() and gemm2.is_contiguous()
    back13, back2 = layout.from_flashinfer(gemm1, gemm2)
    assert torch.equal(back13, w13) and torch.equal(back2, w2)


def test_physical_element_placement():
    # Element (row n, col k) of the physical GEMM1 matrix sits at [k // 64, n, k % 64] and holds logical
    # [up; gate] row gemm1_row_map(I)[n]: read three elements by hand.
    E, H, I = 1, 256, 128
    w13, w2 = _hf_weights(E, H, I)
    gemm1, gemm2 = layout.to_flashinfer(w13, w2)
    up, gate = w13[0, I:], w13[0, :I]
    # n = 0: q = 0 -> up_0.  n = 1: q = 4 -> up_2.  n = 8: q = 1 -> gate_0 (row 0 + I of [up; gate]).
    assert torch.equal(gemm1[0, 130 // 64, 0, 130 % 64], up[0, 130])
    assert torch.equal(gemm1[0, 7 // 64, 1, 7 % 64], up[2, 7])
    assert torch.equal(gemm1[0, 255 // 64, 8, 255 % 64], gate[0, 255])
    # w2: shuffle only. n = 1 takes down_proj row 4, at column block 1 for k = 100.
    assert torch.equal(gemm2[0, 100 // 64, 1, 100 % 64], w2[0, 4, 100])


@pytest.mark.parametrize("I", [128, 256, 384, 1024])
def test_gemm1_row_map_is_reorder_then_shuffle(I):
    composed = layout.gated_reorder_rows(I)[layout.shuffle_rows(2 * I)]
    assert torch.equal(layout.gemm1_row_map(I), composed)
    assert torch.equal(layout.gemm1_row_map(I).sort().values, torch.arange(2 * I))  # a permutation


@pytest.mark.parametrize("H", [128, 256, 2048])
def test_gemm2_row_map_is_the_shuffle(H):
    assert torch.equal(layout.gemm2_row_map(H), layout.shuffle_rows(H))
    assert torch.equal(layout.gemm2_row_map(H).sort().values, torch.arange(H))


def test_shuffle_rows_inverts_flashinfers_src_to_dst_table():
    # FlashInfer states the shuffle as srcToDstBlk32RowMap: old row s goes to new row 8*(s%4) + s//4
    # (0, 8, 16, 24, 1, 9, ...). shuffle_rows states it as a gather; one must undo the other, block by block.
    src = torch.arange(64)
    dst = 32 * (src // 32) + 8 * (src % 4) + (src % 32) // 4
    assert torch.equal(layout.shuffle_rows(64)[dst], src)


def test_gated_reorder_rows_interleaves_up_and_gate():
    assert layout.gated_reorder_rows(3).tolist() == [0, 3, 1, 4, 2, 5]  # up_0, gate_0, up_1, gate_1, ...


def test_swap_halves_is_its_own_inverse():
    w = torch.arange(8.0).reshape(1, 4, 2)  # rows [g0, g1, u0, u1]
    swapped = layout.swap_halves(w)
    assert swapped[0, :, 0].tolist() == [4.0, 6.0, 0.0, 2.0]  # [u0, u1, g0, g1]
    assert torch.equal(layout.swap_halves(swapped), w)


def test_block_major_k_round_trip():
    rows = torch.randn(2, 96, 192)  # the blocking itself takes any dtype and any Mn
    blocks = layout.block_major_k(rows)
    assert blocks.shape == (2, 3, 96, 64)
    assert torch.equal(blocks[1, 2, 5, 7], rows[1, 5, 2 * 64 + 7])
    assert torch.equal(layout.from_block_major_k(blocks), rows)


def test_matches_flashinfers_own_helper():
    prepare = pytest.importorskip("flashinfer.fused_moe.prepare", reason="flashinfer is not installed "
                                  "(pip install 'moelab[flashinfer]'); only this cross-check needs it")
    E, H, I = 2, 256, 384
    w13, w2 = _hf_weights(E, H, I)
    ours = layout.to_flashinfer(w13, w2)
    # FlashInfer's helper does reorder, shuffle and blocking, not the swap: it is given [up; gate].
    theirs = prepare.prepare_trtllm_bf16_weights(layout.swap_halves(w13), w2, num_local_experts=E, hidden_size=H,
                                                 intermediate_size=I, device=torch.device("cpu"))
    assert torch.equal(ours[0], theirs["gemm1_weights"])
    assert torch.equal(ours[1], theirs["gemm2_weights"])


@pytest.mark.parametrize(
    "E, H, I, dtype, error, match",
    [
        (2, 256, 96, torch.bfloat16, ValueError, r"intermediate_size I: FlashInfer requires a multiple of 128, "
                                                 r"got 96.*torch"),  # I % 128 != 0
        (2, 192, 128, torch.bfloat16, ValueError, r"hidden_size H: FlashInfer requires.*got 192.*triton"),
        (2, 256, 128, torch.float32, TypeError, r"w13: expected dtype bfloat16.*got float32"),
        (2, 256, 128, torch.float16, TypeError, r"w13: expected dtype bfloat16.*got float16"),
    ],
)
def test_to_flashinfer_rejects(E, H, I, dtype, error, match):
    w13, w2 = (w.to(dtype) for w in _hf_weights(E, H, I))
    with pytest.raises(error, match=match):
        layout.to_flashinfer(w13, w2)


def test_to_flashinfer_rejects_bad_shapes():
    w13, w2 = _hf_weights(2, 256, 128)
    with pytest.raises(ValueError, match=r"w2: expected shape \[2, 256, 128\], got \[2, 128, 256\]"):
        layout.to_flashinfer(w13, w2.transpose(1, 2))  # w2 given as [E, I, H]
    with pytest.raises(ValueError, match="w13: expected an even second dimension"):
        layout.to_flashinfer(w13[:, :-1], w2)
    with pytest.raises(ValueError, match="w13: expected a 3-D tensor"):
        layout.to_flashinfer(w13[0], w2)
    with pytest.raises(TypeError, match="w2: expected a torch.Tensor"):
        layout.to_flashinfer(w13, w2.tolist())
    with pytest.raises(TypeError, match="w2: expected dtype bfloat16"):
        layout.to_flashinfer(w13, w2.float())


def test_from_flashinfer_rejects_bad_shapes():
    gemm1, gemm2 = layout.to_flashinfer(*_hf_weights(2, 256, 128))
    with pytest.raises(ValueError, match=r"gemm1: expected shape \[\*, \*, \*, 64\]"):
        layout.from_flashinfer(gemm1.reshape(2, 2, 256, 128), gemm2)  # FlashInfer's docstring's 128-wide blocks
    with pytest.raises(ValueError, match=r"gemm2: expected shape \[2, 2, 256, 64\]"):
        layout.from_flashinfer(gemm1, gemm2[:1])
    with pytest.raises(TypeError, match="gemm1: expected dtype bfloat16"):
        layout.from_flashinfer(gemm1.float(), gemm2)


def test_step_errors():
    with pytest.raises(ValueError, match="n: expected a multiple of 32"):
        layout.shuffle_rows(48)
    with pytest.raises(ValueError, match="K a multiple of 64"):
        layout.block_major_k(torch.zeros(4, 100))
    with pytest.raises(ValueError, match="even row count"):
        layout.swap_halves(torch.zeros(3, 4))
