"""Unpermute the FC1 activation (docs/contract.md §5): ``out[r] = act_permuted[map[r]]``, or zeros when
``map[r] == -1``.

The zeros matter: the W2 LoRA sums over every slot, so a non-local slot's row must be exactly zero, never
whatever the permuted buffer holds. Bytes: T*K rows read (local slots only) and T*K rows written.
"""

from __future__ import annotations

import torch
import triton.language as tl

from moelab.kernels._common import jit
from moelab.permutation import cdiv, next_pow2


@jit
def _unpermute_activation_kernel(act_ptr, e2p_ptr, out_ptr, num_rows, I, stride_act_r, stride_out_r,
                                 BLOCK_I: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    col_ok = cols < I
    row = tl.load(e2p_ptr + r + tl.zeros_like(cols))  # the slot's row, broadcast over the columns
    live = (row >= 0) & (row < num_rows)  # -1: a non-local slot; past the buffer: never read (validate=False)
    vals = tl.load(act_ptr + tl.where(live, row, 0).to(tl.int64) * stride_act_r + cols, mask=col_ok & live,
                   other=0.0)
    tl.store(out_ptr + r.to(tl.int64) * stride_out_r + cols, vals, mask=col_ok)


def unpermute_activation_triton(act_permuted: torch.Tensor, e2p: torch.Tensor) -> torch.Tensor:
    """Launch :func:`_unpermute_activation_kernel`; returns [T*K, I] in the dtype of ``act_permuted``."""
    n, I = e2p.numel(), act_permuted.shape[1]
    out = torch.empty(n, I, dtype=act_permuted.dtype, device=act_permuted.device)
    if n == 0 or I == 0:
        return out
    block_i = min(1024, next_pow2(I))
    _unpermute_activation_kernel[(n, cdiv(I, block_i))](
        act_ptr=act_permuted, e2p_ptr=e2p, out_ptr=out, num_rows=act_permuted.shape[0], I=I,
        stride_act_r=act_permuted.stride(0), stride_out_r=out.stride(0), BLOCK_I=block_i,
        num_warps=4 if block_i >= 512 else 1,
    )
    return out
