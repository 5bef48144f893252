"""Decode-speed launches: a compiled Triton kernel launched again without ``JITFunction.run``'s per-call work.

``kernel[grid](...)`` on a ``triton.jit`` function binds and specializes every argument, reads Triton's knobs,
builds the cache key and looks the compiled kernel up on every call, then launches it. At decode sizes that host
work costs more than the kernels themselves (``scripts/host_time.py`` splits an eager ``routed_moe`` call into
moelab's Python, Triton's dispatch and the compiled launcher). :class:`CachedLaunchJIT` is a ``JITFunction``
(``moelab.kernels._common.jit`` makes every compiled moelab kernel one) that remembers, per argument signature, the
``CompiledKernel`` Triton's own ``run`` returned the first time, and launches it again through Triton's compiled
launcher (``CompiledKernel[grid](*args)``: the same stream, launch hooks and scratch allocation as ``run``).

The signature is at least as fine as Triton's specialization, so the kernel launched is the one ``run`` would
pick: the current CUDA device, the launch options (``num_warps``, ``num_stages``, ``launch_pdl``, ...), and for
each parameter its type and: a tensor's dtype and address modulo 16 (Triton specializes on 16-byte alignment); an
int, bool, string or constexpr's value; a float's value only for a constexpr (Triton passes the others as fp32 at
run time). What it cannot key (a callable grid, an unhashable argument, a missing parameter or one given twice,
pre-run hooks, ``warmup``) goes through Triton's ``run``, which also raises the errors. ``MOELAB_FAST_LAUNCH=0``
sends every launch through ``run``. ``kernel[grid]`` with a tuple grid goes straight to that lookup (Triton's own
``__getitem__`` would hand the ~40 keywords of a GEMM launch through one more call): on a CPU with Triton stubbed
(``scripts/host_cost.py``) an eager T = 1 ``routed_moe`` call's host cost fell from 87-99 to 68-79 µs with it and
the getters of the signature's tensors and values.

The same in Triton 3.6 (the H200's) and 3.9 (read in both sources): ``JITFunction.run`` returns the launched
``CompiledKernel``, and ``CompiledKernel.__getitem__(grid)`` launches it with the full argument list (constexprs
included).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import operator
import os

import torch
from triton.runtime import JITFunction

#: Launch compiled kernels directly once their signature has been seen (``MOELAB_FAST_LAUNCH=0``: never).
FAST_LAUNCH: bool = os.environ.get("MOELAB_FAST_LAUNCH", "1") == "1"
#: Signatures remembered per kernel before the table starts over (each entry is one dict slot; the compiled kernels
#: themselves live in Triton's cache anyway).
MAX_SIGNATURES = 4096

_MISSING = object()
current_device = torch.cuda.current_device  # the device Triton launches on (a module attribute: tests replace it)


class CachedLaunchJIT(JITFunction):
    """``triton.jit``'s ``JITFunction`` whose repeated launches skip Triton's per-call dispatch (module docstring)."""

    def __init__(self, fn, **options):
        super().__init__(fn, **options)
        self._launch_layout = _Layout(self)
        self._launch_kernels: dict[tuple, object] = {}  # signature -> CompiledKernel

    def __getitem__(self, grid):
        """``kernel[grid]``: a tuple grid calls :meth:`_launch` directly (Triton's ``lambda`` would pass the ~40
        keywords of a GEMM launch through one more call, to :meth:`run`); a callable grid takes Triton's path."""
        if isinstance(grid, tuple):
            return functools.partial(self._launch, grid)
        return super().__getitem__(grid)

    def run(self, *args, grid, warmup, **kwargs):
        if warmup or not isinstance(grid, tuple):
            return super().run(*args, grid=grid, warmup=warmup, **kwargs)
        return self._launch(grid, *args, **kwargs)

    def _launch(self, grid: tuple, *args, **kwargs):
        """``run(*args, grid=grid, warmup=False, **kwargs)``: the compiled kernel of a seen signature launched
        directly, anything else through Triton's own ``run``."""
        if not FAST_LAUNCH or self.pre_run_hooks:
            return JITFunction.run(self, *args, grid=grid, warmup=False, **kwargs)
        layout, kernels = self._launch_layout, self._launch_kernels
        values, options = layout.bind(args, kwargs)
        key = None if values is None else layout.signature(values, options)
        try:
            kernel = None if key is None else kernels.get(key)
        except TypeError:  # an unhashable argument: Triton's dispatch decides
            key = kernel = None
        if kernel is None:
            kernel = JITFunction.run(self, *args, grid=grid, warmup=False, **kwargs)
            if key is not None and kernel is not None:
                if len(kernels) >= MAX_SIGNATURES:
                    kernels.clear()
                kernels[key] = kernel
            return kernel
        kernel[grid + (1,) * (3 - len(grid))](*values)
        return kernel


class _Layout:
    """A kernel's parameters as :meth:`CachedLaunchJIT.run` binds and keys them (C-level maps over the arguments:
    a Python loop over the ~40 parameters of a GEMM cost more than the dispatch it saves)."""

    def __init__(self, fn: JITFunction):
        params = fn.params
        self.names = [p.name for p in params]
        self.name_set = frozenset(self.names)
        self.defaults = [_MISSING if p.default is inspect.Parameter.empty else p.default for p in params]
        self.constexpr = [p.is_constexpr for p in params]
        self.binders: dict[tuple, tuple] = {}  # (number of positional arguments, keywords) -> getters
        self.plans: dict[tuple, tuple] = {}  # argument types -> (number, getter of tensors, getter of keyed values)
        self.serial = itertools.count(1)  # a number per type pattern ever seen (next() is atomic under the GIL)

    def bind(self, args: tuple, kwargs: dict) -> tuple[tuple | None, tuple]:
        """(every parameter's value in order, the launch options as (name, value) sorted by name); values None when
        the arguments do not bind (too many, or one given twice)."""
        pattern = (len(args), tuple(kwargs))
        binder = self.binders.get(pattern)
        if binder is None:
            if len(self.binders) >= MAX_SIGNATURES:
                self.binders.clear()
            binder = self.binders[pattern] = self._binder(*pattern)
        if not binder:
            return None, ()
        values_of, option_names, options_of = binder
        seq = (*args, *kwargs.values(), *self.defaults)
        return values_of(seq), (tuple(zip(option_names, options_of(seq))) if option_names else ())

    def _binder(self, n: int, keywords: tuple) -> tuple:
        """For calls of ``n`` positional arguments and these keywords: getters of the parameters' values and of the
        options from ``(*args, *kwargs.values(), *defaults)``; () when they do not bind."""
        names = self.names
        where = {name: n + j for j, name in enumerate(keywords)}
        if n > len(names) or any(name in where for name in names[:n]):
            return ()
        base = n + len(keywords)
        idx = [i if i < n else where.get(name, base + i) for i, name in enumerate(names)]
        options = sorted(name for name in keywords if name not in self.name_set)
        pick = [where[name] for name in options]
        return (_getter(idx), tuple(options), _getter(pick))

    def signature(self, values: tuple, options: tuple) -> tuple | None:
        """The launch's key (module docstring), None when a parameter has no value."""
        types = tuple(map(type, values))
        plan = self.plans.get(types)
        if plan is None:
            if len(self.plans) >= MAX_SIGNATURES:
                self.plans.clear()
            plan = self.plans[types] = self._plan(types, next(self.serial))  # never reused, even after a clear
        if not plan:
            return None
        types_id, tensors_of, keyed_of = plan
        tensors = tensors_of(values)
        # types (by their plan's number) tell 1 from True and 1.0; ints, bools, strings, constexprs by value; floats
        # that are not constexprs by type only; tensors by dtype and address modulo 16 (Triton's alignment)
        return (current_device(), options, types_id, keyed_of(values), tuple(map(_dtype, tensors)),
                tuple(map(_mod16, map(_data_ptr, tensors))))

    def _plan(self, types: tuple, serial: int) -> tuple:
        """(``serial``, a getter of the tensors, a getter of the values keyed by value) for arguments of these
        types; () when one is missing."""
        tensors, keyed = [], []
        for i, (kind, constexpr) in enumerate(zip(types, self.constexpr)):
            if kind is object:  # _MISSING: Triton's own run raises the TypeError for it
                return ()
            if issubclass(kind, torch.Tensor):
                tensors.append(i)
            elif kind is not float or constexpr:
                keyed.append(i)
        return serial, _getter(tensors), _getter(keyed)


_dtype = operator.attrgetter("dtype")
_data_ptr = torch.Tensor.data_ptr
_mod16 = (15).__and__


def _getter(idx: list[int]):
    """A C-level getter of these positions of a sequence, always as a tuple."""
    if len(idx) == 1:
        i = idx[0]
        return lambda seq: (seq[i],)
    return operator.itemgetter(*idx) if idx else (lambda seq: ())
