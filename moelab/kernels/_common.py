"""Small pieces every kernel shares, above all the workarounds for Triton's CPU interpreter.

The expert activations both GEMM1 kernels run (``expert_activation``) live here too.

Two interpreter bugs (both absent on a GPU) would otherwise skew every bf16 result on a CPU:
- ``tl.dot`` multiplies the raw bits of bfloat16 operands (triton issue 11584): kernels upcast dot operands
  to fp32 when interpreting (``moelab._runtime.INTERPRET``; their ``DOT_F32`` flag).
- fp32 -> bf16 conversion truncates instead of rounding to nearest even, doubling the rounding error:
  :func:`to_output` rounds by integer arithmetic first when interpreting.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moelab import _runtime
from moelab.kernels.launch import CachedLaunchJIT

INTERPRET = tl.constexpr(_runtime.INTERPRET)


def dot_flags(dtype: torch.dtype) -> dict:
    """The ``DOT_F32`` and ``DOT_PRECISION`` constexprs of a kernel whose dot operands are ``dtype``: upcast them to
    fp32 in the interpreter (see above) or when they are fp32 already, and fp32 operands multiply in exact 'ieee'
    (TF32 would miss 1e-5); bf16 and fp16 operands go to the tensor cores as they are."""
    return dict(DOT_F32=_runtime.INTERPRET or dtype == torch.float32,
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")


def tma_ok(t: torch.Tensor) -> bool:
    """``t`` can back a TMA descriptor over its last two dimensions: unit column stride, its row stride and base
    address multiples of 16 bytes."""
    return t.stride(-1) == 1 and (t.stride(-2) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def jit(fn):
    """``triton.jit`` for moelab's kernels, the one place that decides how they run (``moelab._runtime``):

    - compiled (a CUDA GPU, or ``TRITON_INTERPRET=0``): a :class:`moelab.kernels.launch.CachedLaunchJIT`, whose
      repeated launches skip Triton's per-call dispatch;
    - no CUDA GPU and ``TRITON_INTERPRET`` unset: a :class:`moelab.kernels.interpret.ScopedInterpretedFunction`,
      run by Triton's interpreter, which it switches on for its own launches only (the process's other Triton
      kernels stay compiled ``JITFunction`` objects);
    - ``TRITON_INTERPRET=1`` (Triton's own switch, every kernel of the process interpreted): ``triton.jit``'s own
      ``InterpretedFunction``.
    """
    if not _runtime.INTERPRET:
        return CachedLaunchJIT(fn)
    if triton.knobs.runtime.interpret:
        return triton.jit(fn)
    from moelab.kernels.interpret import ScopedInterpretedFunction

    return ScopedInterpretedFunction(fn)


@jit
def wait_for_previous_kernel(USE_GDC: tl.constexpr):
    """First statement of every pipeline kernel launched with programmatic dependent launch (``USE_GDC``, see
    ``moelab._runtime.PDL``): wait until the previous kernel in the stream has finished and its writes are visible,
    then let the next kernel's programs be scheduled (they wait here in turn before touching memory)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@jit
def routing_word_expert(word):
    """The global expert id of FlashInfer's int32 routing word ``(id << 16) | bf16(weight)``: its signed high half
    (an arithmetic shift; ``moelab.packing``)."""
    return word >> 16


@jit
def routing_word_weight(word):
    """The routing weight of an int32 routing word: its low half, the bf16 weight, widened exactly to fp32."""
    return ((word & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@jit
def to_output(x, dtype: tl.constexpr):
    """Cast fp32 ``x`` to ``dtype`` with round-to-nearest-even, also in the interpreter."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@jit
def shrink_step(x, a0_ptr, a1_ptr, a_offs, a_mask, acc0, acc1, NUM_SLICES: tl.constexpr, DOT_F32: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """One K step of a LoRA shrink: ``acc_j += x @ A_j^T`` for the 1 or 2 A banks, the [BLOCK_K, columns] tile of
    A^T read at ``a_offs`` (``a_mask``); x [BLOCK_M, BLOCK_K] is read once for both. Returns (acc0, acc1)."""
    a0 = tl.load(a0_ptr + a_offs, mask=a_mask, other=0.0)
    if DOT_F32:
        x, a0 = x.to(tl.float32), a0.to(tl.float32)
    acc0 = tl.dot(x, a0, acc0, input_precision=DOT_PRECISION)
    if NUM_SLICES == 2:
        a1 = tl.load(a1_ptr + a_offs, mask=a_mask, other=0.0)
        if DOT_F32:
            a1 = a1.to(tl.float32)
        acc1 = tl.dot(x, a1, acc1, input_precision=DOT_PRECISION)
    return acc0, acc1


@jit
def _pointwise(v, ACTIVATION: tl.constexpr):
    """``ACTIVATION`` of fp32 ``v``: silu, gelu (erf), gelu_tanh (as ``v * sigmoid(2u)``, which is
    ``0.5 v (1 + tanh(u))``) or relu2."""
    if ACTIVATION == "silu":
        out = v / (1.0 + tl.exp(-v))
    elif ACTIVATION == "gelu":
        out = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
    elif ACTIVATION == "gelu_tanh":
        out = v / (1.0 + tl.exp(-1.5957691216057308 * (v + 0.044715 * v * v * v)))
    else:
        tl.static_assert(ACTIVATION == "relu2", "activation: silu, gelu, gelu_tanh, relu2 or (gated) swigluoai")
        out = tl.maximum(v, 0.0)
        out = out * out
    return out


@jit
def expert_activation(gate, up, ACTIVATION: tl.constexpr, GATED: tl.constexpr, SWIGLU_ALPHA: tl.constexpr,
                SWIGLU_LIMIT: tl.constexpr):
    """The expert activation of GEMM1's fp32 accumulators (``moelab.reference.apply_activation``): gated
    ``act(gate) * up``, gate first clamped to ``<= SWIGLU_LIMIT`` and up to ``[-SWIGLU_LIMIT, SWIGLU_LIMIT]`` when
    a limit is set, ``"swigluoai"`` ``gate * sigmoid(SWIGLU_ALPHA * gate) * (up + 1)``; not gated ``act(up)``
    (``gate`` unused)."""
    if GATED:
        if SWIGLU_LIMIT is not None:
            gate = tl.minimum(gate, SWIGLU_LIMIT)
            up = tl.minimum(tl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
        if ACTIVATION == "swigluoai":
            out = gate / (1.0 + tl.exp(-SWIGLU_ALPHA * gate)) * (up + 1.0)
        else:
            out = _pointwise(gate, ACTIVATION) * up
    else:
        out = _pointwise(up, ACTIVATION)
    return out
