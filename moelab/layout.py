"""FlashInfer's BF16 expert-weight layout, built from small named steps (docs/contract.md §4).

moelab takes weights in Hugging Face order; FlashInfer's ``trtllm_bf16_routed_moe`` reads them in its own
physical layout. :func:`to_flashinfer` gets there in four steps, each a function a notebook can draw:

    w13  [E, 2I, H]  rows [gate; up]                          (HF / vLLM order)
     1. swap_halves          -> [up; gate]                    (FlashInfer order: SiLU goes on the second half)
     2. gated_reorder_rows   -> up_0, gate_0, up_1, gate_1 ...  (the kernel pairs the halves row by row)
     3. shuffle_rows         -> inside 32-row blocks, new row j = old row 4*(j%8) + j//8
                                (the MMA epilogue tile, epilogue_tile_m = 128, reads rows in this order)
     4. block_major_k        -> [E, H/64, 2I, 64]             (K cut into 128-byte blocks = 64 bf16)

    w2   [E, H, I]           -> shuffle_rows, block_major_k -> [E, I/64, H, 64]   (no halves, no reorder)

Steps 2 and 3 are row gathers; :func:`gemm1_row_map` / :func:`gemm2_row_map` are their composition in closed
form: for each physical row, the logical row it holds. :func:`from_flashinfer` undoes everything exactly.

Index maps, by name (all int64, usable as ``rows[map]``; "new row j takes old row map[j]"):

    gated_reorder_rows(I)   [2I]  row 2i <- up_i (i), row 2i+1 <- gate_i (I + i), in [up; gate] numbering
    shuffle_rows(n)         [n]   row j <- 32*(j//32) + 4*(j%8) + (j%32)//8
    gemm1_row_map(I)        [2I]  physical GEMM1 row n <- logical [up; gate] row q//2 + (q%2)*I,
                                  q = 32*(n//32) + 4*(n%8) + (n%32)//8
    gemm2_row_map(H)        [H]   physical GEMM2 row n <- logical down_proj row shuffle_rows(H)[n]

FlashInfer requires ``I % 128 == 0`` and (to be safe, docs/contract.md §3) ``H % 128 == 0``; moelab's own torch and
triton backends take any I and H. FlashInfer's docstring shapes (``.../128, 128``) are wrong: the block is
128 *bytes*. Checked equal to ``flashinfer.fused_moe.prepare.prepare_trtllm_bf16_weights`` (fed ``[up; gate]``)
in ``tests/test_layout.py``.

Example:
    >>> w13 = torch.randn(2, 256, 128).bfloat16(); w2 = torch.randn(2, 128, 128).bfloat16()
    >>> gemm1, gemm2 = to_flashinfer(w13, w2)
    >>> gemm1.shape, gemm2.shape
    (torch.Size([2, 2, 256, 64]), torch.Size([2, 2, 128, 64]))
    >>> all(torch.equal(a, b) for a, b in zip(from_flashinfer(gemm1, gemm2), (w13, w2)))
    True
"""

from __future__ import annotations

import torch

from moelab._checks import check_tensor

__all__ = ["ALIGNMENT", "BLOCK_K", "SHUFFLE_BLOCK", "swap_halves", "gated_reorder_rows", "shuffle_rows",
           "gemm1_row_map", "gemm2_row_map", "block_major_k", "from_block_major_k", "check_flashinfer_weights",
           "to_flashinfer", "from_flashinfer"]

#: BlockMajorK cuts K into 128-byte blocks: 64 bf16 elements (not 128, whatever FlashInfer's docstring says).
BLOCK_K = 128 // torch.bfloat16.itemsize
#: Rows shuffled together: 32 for the BF16 kernels' epilogue_tile_m = 128 (16 for smaller tiles).
SHUFFLE_BLOCK = 32
#: FlashInfer checks ``I % 128 == 0``; ``H % 128 == 0`` is the shape its tests cover (docs/contract.md §3).
ALIGNMENT = 128


def swap_halves(w13: torch.Tensor) -> torch.Tensor:
    """Swap the two row halves along dim -2: ``[gate; up] -> [up; gate]`` (and back: it is its own inverse).

    Args:
        w13: [..., 2I, H], any dtype.
    Returns:
        [..., 2I, H], a new contiguous tensor.
    """
    if w13.dim() < 2 or w13.shape[-2] % 2:
        raise ValueError(f"w13: expected [..., 2I, H] with an even row count, got shape {list(w13.shape)}")
    first, second = w13.chunk(2, dim=-2)
    return torch.cat([second, first], dim=-2)


def gated_reorder_rows(I: int) -> torch.Tensor:
    """Interleave the halves of an ``[up; gate]`` matrix: new row ``2i`` = up_i, ``2i+1`` = gate_i.

    Returns int64 [2I]: new row j takes old row ``map[j]`` (``map[2i] = i``, ``map[2i+1] = I + i``).
    """
    up = torch.arange(I)
    return torch.stack([up, up + I], dim=1).flatten()


def shuffle_rows(n: int) -> torch.Tensor:
    """The epilogue shuffle (epilogue_tile_m = 128): inside each 32-row block, new row j takes old row
    ``4*(j%8) + j//8`` (FlashInfer's ``srcToDstBlk32RowMap`` read backwards).

    Returns int64 [n]: new row j takes old row ``map[j]``. ``n`` must be a multiple of 32.
    """
    if n % SHUFFLE_BLOCK:
        raise ValueError(f"n: expected a multiple of {SHUFFLE_BLOCK} rows for the shuffle, got {n}")
    j = torch.arange(n)
    within = j % SHUFFLE_BLOCK
    return j - within + 4 * (within % 8) + within // 8


def gemm1_row_map(I: int) -> torch.Tensor:
    """For each physical GEMM1 row n, the logical ``[up; gate]`` row it holds (reorder, then shuffle).

    Closed form (docs/contract.md §4): ``q = 32*(n//32) + 4*(n%8) + (n%32)//8``, row ``q//2 + (q%2)*I``.
    Equal to ``gated_reorder_rows(I)[shuffle_rows(2I)]``. Returns int64 [2I].
    """
    n = torch.arange(2 * I)
    q = SHUFFLE_BLOCK * (n // SHUFFLE_BLOCK) + 4 * (n % 8) + (n % SHUFFLE_BLOCK) // 8
    return q // 2 + (q % 2) * I


def gemm2_row_map(H: int) -> torch.Tensor:
    """For each physical GEMM2 row n, the logical down_proj row it holds: the shuffle only.

    Closed form: ``32*(n//32) + 4*(n%8) + (n%32)//8``, i.e. ``shuffle_rows(H)``. Returns int64 [H].
    """
    return shuffle_rows(H)


def block_major_k(rows: torch.Tensor) -> torch.Tensor:
    """BlockMajorK: cut K into 64-element (128-byte bf16) blocks and put the block index first.

    Args:
        rows: [..., Mn, K], K a multiple of 64.
    Returns:
        [..., K/64, Mn, 64], contiguous: element ``(n, k)`` lands at ``[k // 64, n, k % 64]``.
    """
    if rows.dim() < 2 or rows.shape[-1] % BLOCK_K:
        raise ValueError(f"rows: expected [..., Mn, K] with K a multiple of {BLOCK_K}, got shape {list(rows.shape)}")
    K = rows.shape[-1]
    return rows.unflatten(-1, (K // BLOCK_K, BLOCK_K)).transpose(-3, -2).contiguous()


def from_block_major_k(blocks: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`block_major_k`: [..., K/64, Mn, 64] -> [..., Mn, K], contiguous."""
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK_K:
        raise ValueError(f"blocks: expected [..., K/{BLOCK_K}, Mn, {BLOCK_K}], got shape {list(blocks.shape)}")
    return blocks.transpose(-3, -2).flatten(-2).contiguous()


def _check_bf16(name: str, x) -> None:
    check_tensor(name, x)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{name}: expected dtype bfloat16 (FlashInfer's layout is defined on bf16 bytes; the torch "
                        f"and triton backends also take float16/float32), got {str(x.dtype).replace('torch.', '')}")


def _check_aligned(what: str, value: int, shapes: str) -> None:
    if value % ALIGNMENT:
        raise ValueError(f"{what}: FlashInfer requires a multiple of {ALIGNMENT}, got {value} ({shapes}); "
                         f"moelab's torch and triton backends do not: use backend='triton' or 'torch'")


def check_flashinfer_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """Check HF-order weights fit FlashInfer: bf16, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, I and H multiples of
    128. Raises TypeError (type, dtype) or ValueError (shape, alignment). Returns ``(E, H, I)``."""
    _check_bf16("w13", w13)
    _check_bf16("w2", w2)
    check_tensor("w13", w13, ndim=3)
    E, two_i, H = w13.shape
    if two_i % 2:
        raise ValueError(f"w13: expected an even second dimension 2I, got {two_i}")
    I = two_i // 2
    check_tensor("w2", w2, shape=(E, H, I))
    shapes = f"w13 {list(w13.shape)}, w2 {list(w2.shape)}"
    _check_aligned("intermediate_size I", I, shapes)
    _check_aligned("hidden_size H", H, shapes)
    return E, H, I


def to_flashinfer(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-order expert weights to FlashInfer's BF16 BlockMajorK layout (docs/contract.md §4), on their own device.

    Args:
        w13: bf16 [E, 2I, H], rows ``[gate; up]``.
        w2: bf16 [E, H, I].
    Returns:
        ``gemm1_weights`` bf16 [E, H/64, 2I, 64] and ``gemm2_weights`` bf16 [E, I/64, H, 64], contiguous.
    """
    E, H, I = check_flashinfer_weights(w13, w2)
    up_gate = swap_halves(w13)
    gemm1 = block_major_k(up_gate[:, gemm1_row_map(I).to(w13.device)])
    gemm2 = block_major_k(w2[:, gemm2_row_map(H).to(w2.device)])
    return gemm1, gemm2


def from_flashinfer(gemm1: torch.Tensor, gemm2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact inverse of :func:`to_flashinfer`.

    Args:
        gemm1: bf16 [E, H/64, 2I, 64]; gemm2: bf16 [E, I/64, H, 64].
    Returns:
        ``w13`` bf16 [E, 2I, H] rows ``[gate; up]`` and ``w2`` bf16 [E, H, I].
    """
    _check_bf16("gemm1", gemm1)
    _check_bf16("gemm2", gemm2)
    check_tensor("gemm1", gemm1, shape=(None, None, None, BLOCK_K))
    E, h_blocks, two_i, _ = gemm1.shape
    if two_i % 2:
        raise ValueError(f"gemm1: expected an even third dimension 2I, got {two_i}")
    H, I = h_blocks * BLOCK_K, two_i // 2
    shapes = f"gemm1 {list(gemm1.shape)}, gemm2 {list(gemm2.shape)}"
    _check_aligned("intermediate_size I", I, shapes)
    _check_aligned("hidden_size H", H, shapes)
    check_tensor("gemm2", gemm2, shape=(E, I // BLOCK_K, H, BLOCK_K))
    # Physical row n holds logical row map[n]: scatter each row back to where it came from.
    up_gate = torch.empty(E, 2 * I, H, dtype=gemm1.dtype, device=gemm1.device)
    up_gate[:, gemm1_row_map(I).to(gemm1.device)] = from_block_major_k(gemm1)
    w2 = torch.empty(E, H, I, dtype=gemm2.dtype, device=gemm2.device)
    w2[:, gemm2_row_map(H).to(gemm2.device)] = from_block_major_k(gemm2)
    return swap_halves(up_gate), w2
