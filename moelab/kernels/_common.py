"""Small pieces every kernel shares, above all the workarounds for Triton's CPU interpreter.

Two interpreter bugs (both absent on a GPU) would otherwise skew every bf16 result on a CPU:
- ``tl.dot`` multiplies the raw bits of bfloat16 operands (triton issue 11584): kernels upcast dot operands
  to fp32 when interpreting (their ``DOT_F32`` flag).
- fp32 -> bf16 conversion truncates instead of rounding to nearest even, doubling the rounding error:
  :func:`to_output` rounds by integer arithmetic first when interpreting.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moelab import _runtime

INTERPRET = tl.constexpr(_runtime.INTERPRET)


@triton.jit
def to_output(x, dtype: tl.constexpr):
    """Cast fp32 ``x`` to ``dtype`` with round-to-nearest-even, also in the interpreter."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
