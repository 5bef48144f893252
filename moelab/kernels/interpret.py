"""moelab's kernels in Triton's CPU interpreter, without switching the interpreter on for the process.

Triton's own switch (``TRITON_INTERPRET=1``, read when Triton is imported and at each ``triton.jit``) is
process-wide: every Triton kernel of the process is then interpreted, Liger's, torch.compile's and the user's
included. Where no CUDA GPU is found and ``TRITON_INTERPRET`` is unset, :func:`moelab.kernels._common.jit` instead
makes each moelab kernel a :class:`ScopedInterpretedFunction`: an ``InterpretedFunction`` (Triton's interpreter
runs it), the rest of the process untouched. One thing the interpreter needs from outside the kernel: Triton's
library functions written in Triton (``tl.sum``, ``tl.max``, ``tl.cdiv``, ...) are compiled ``JITFunction`` objects
when Triton was imported without the switch, which the interpreter cannot call. While a moelab kernel is launched
(``kernel[grid](...)``), the ``triton.language`` modules' ``JITFunction`` attributes are swapped for interpreted
twins (the same kind of temporary patch Triton's interpreter itself applies to ``triton.language`` during every
launch). After it, also when it raises, every name of those modules (and of the classes the interpreter patches)
holds its old value again: the twins go, and so do the patches Triton's interpreter leaves in
``triton.language.core`` when a kernel calls a library function (a user's kernel calling ``tl.zeros`` then failed to
compile for a GPU target).

One thing the interpreter does differently from a GPU is patched for the duration of a launch too: its ``tl.dot`` is
one ``numpy.matmul`` of the whole tile in the accumulator's dtype, and a BLAS may sum a row in another order when it
sits elsewhere in the tile (an edge of its blocking), so the same row could come out of two tiles a last bit apart.
On a GPU a row's result does not depend on its neighbours, and moelab promises rows that are bit for bit the same
across paths that place them differently (``LoRAExperts``' tokens without an adapter, rows sorted by adapter). During
a moelab launch a floating-point ``tl.dot`` multiplies in float64 and rounds once to the accumulator's dtype
(:func:`_create_dot`): exact products, a row's sum whatever its place up to float64 rounding (a different last bit
after the final rounding stays possible, at about 2**-29 an element), then the accumulator added as before. moelab's
kernels upcast their dot operands to fp32 in the interpreter, so every moelab dot takes this path.

Nothing else changes: no environment variable and no Triton knob is set, even during a launch, so a kernel defined
meanwhile is a compiled ``JITFunction`` and a child process (pytest-xdist worker, torch.distributed rank) decides
for itself when it imports moelab. Threads: launches are serialized by one lock (Triton's interpreter keeps its grid
position in one global builder, so two interpreted launches at once were never safe); a kernel that another thread
*compiles* during a launch would see the twins, as it would see Triton's own patches.
"""

from __future__ import annotations

import sys
import threading
import types

import numpy as np
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder, TensorHandle
from triton.runtime.jit import JITFunction, mangle_type

_lock = threading.RLock()
_twins: dict[int, tuple[JITFunction, InterpretedFunction]] = {}  # id(library function) -> (it, its twin)
_warm = False
_MISSING = object()


class ScopedInterpretedFunction(InterpretedFunction):
    """A moelab kernel (or device function) run by Triton's interpreter, Triton's library interpreted only for the
    duration of each launch (module docstring). Called from inside a kernel it is a plain ``InterpretedFunction``:
    the launch around it has swapped the library in already."""

    def run(self, *args, grid, warmup, **kwargs):
        with _lock:
            _warm_up()
            saved = _save_language()
            create_dot = InterpreterBuilder.create_dot
            try:
                _swap_library(saved)
                InterpreterBuilder.create_dot = _create_dot
                return super().run(*args, grid=grid, warmup=warmup, **kwargs)
            finally:
                InterpreterBuilder.create_dot = create_dot
                _restore_language(saved)


_interpreter_dot = InterpreterBuilder.create_dot


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's ``tl.dot`` with a row's result independent of its place in the tile (module docstring):
    floating operands multiplied in float64, rounded once to the accumulator's dtype, the accumulator added."""
    acc = d.data.dtype
    if not (np.issubdtype(acc, np.floating) and np.issubdtype(a.data.dtype, np.floating)
            and np.issubdtype(b.data.dtype, np.floating)):  # integer dots; bf16 and fp8 (stored as ints) as before
        return _interpreter_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(acc)
    return TensorHandle(product + d.data, d.dtype.scalar)


def _warm_up() -> None:
    """Triton imports modules the first time it specializes an argument (``triton.experimental.gluon``, whose
    import copies ``tl.cdiv``, ``tl.sum``, ... and asserts they are compiled functions): let that happen once before
    the first launch, with the library as Triton made it."""
    global _warm
    if not _warm:
        mangle_type(1)
        mangle_type(torch.empty(1))
        _warm = True


def _language_modules() -> list:
    """The loaded ``triton.language`` modules (the package and its submodules)."""
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == "triton.language" or name.startswith("triton.language."))]


def _save_language() -> list[tuple[object, dict]]:
    """(object, a copy of its namespace) of every ``triton.language`` module and of the classes Triton's
    interpreter patches (``tensor``, ``condition``, ``dtype``, ``tensor_descriptor_base``)."""
    core = tl.core
    classes = [getattr(core, name) for name in ("tensor", "condition", "dtype", "tensor_descriptor_base")
               if isinstance(getattr(core, name, None), type)]
    return [(obj, dict(vars(obj))) for obj in _language_modules() + classes]


def _restore_language(saved: list[tuple[object, dict]]) -> None:
    """Give every saved name its value back: the twins go, and so do the patches Triton's interpreter leaves behind
    when a kernel calls a library function (it patches ``triton.language.core`` for the callee and never restores
    that; under TRITON_INTERPRET=1 the same leak is harmless). Names added to a class go (the interpreter's restore
    writes an inherited ``__repr__`` into ``tensor``); names added to a module stay: the interpreter adds its own
    globals to the module of each function it rewrites, and calls the cached rewrite with them later."""
    for obj, before in saved:
        now = vars(obj)
        if isinstance(obj, type):
            for name in [n for n in now if n not in before]:
                delattr(obj, name)
        for name, value in before.items():
            if now.get(name, _MISSING) is not value:
                setattr(obj, name, value)


def _swap_library(saved: list[tuple[object, dict]]) -> None:
    """Replace every ``JITFunction`` of the saved ``triton.language`` modules by its interpreted twin."""
    for module, names in saved:
        if not isinstance(module, types.ModuleType):
            continue
        for name, value in names.items():
            if isinstance(value, JITFunction):
                entry = _twins.get(id(value))
                if entry is None:  # the entry holds the original, so its id is never reused
                    entry = _twins[id(value)] = (value, InterpretedFunction(value.fn))
                setattr(module, name, entry[1])
