"""moelab.kernels.launch: a repeated launch reuses the compiled kernel only when Triton would pick the same one.

On a CPU box Triton's own ``run`` cannot launch anything, so it is replaced by a recorder that stands for it (it
returns a fake compiled kernel); on a CUDA GPU the last test runs real launches of the routed MoE.
"""

from __future__ import annotations  # noqa: I001 (moelab before triton, below)

# moelab first: on a CPU it switches Triton to its interpreter, which triton.language reads when it is imported
import moelab
import pytest
import torch
import triton.language as tl
from triton.runtime import JITFunction

from moelab.backends import eager_graphs
from moelab.kernels import launch


def _kernel(x_ptr, y_ptr, n, scale, FLAG: tl.constexpr, BLOCK: tl.constexpr = 16, USE_GDC: tl.constexpr = False):
    pass


class _Compiled:
    """Stands for a CompiledKernel: records the launches ``kernel[grid](*args)`` makes."""

    def __init__(self, tag):
        self.tag, self.launches = tag, []

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


@pytest.fixture
def fake_triton(monkeypatch):
    """Triton's ``run`` replaced by a recorder of its calls; returns (kernel, calls, compiled)."""
    calls, compiled = [], []

    def run(self, *args, grid, warmup, **kwargs):
        calls.append((args, kwargs))
        compiled.append(_Compiled(len(compiled)))
        return compiled[-1]

    monkeypatch.setattr(JITFunction, "run", run)
    monkeypatch.setattr(launch, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    return launch.CachedLaunchJIT(_kernel), calls, compiled


def _tensors(dtype=torch.float32, offset=0):
    buf = torch.zeros(64 + offset, dtype=dtype)
    return buf[offset:offset + 32], torch.zeros(32, dtype=dtype)


def test_same_signature_launches_the_compiled_kernel_directly(fake_triton):
    kernel, calls, compiled = fake_triton
    x, y = _tensors()
    kernel[(4,)](x, y, 32, 0.5, FLAG=True, num_warps=4)
    assert len(calls) == 1 and compiled[0].launches == []  # the first call is Triton's own
    x2, y2 = _tensors()  # other tensors, same dtype and alignment; another float scale
    kernel[(4,)](x2, y2, 32, 2.0, FLAG=True, num_warps=4)
    assert len(calls) == 1
    (grid, args), = compiled[0].launches
    assert grid == (4, 1, 1)  # Triton's compiled launcher takes three grid sizes
    assert args[0] is x2 and args[1] is y2 and args[2:] == (32, 2.0, True, 16, False)  # defaults filled in, in order


def test_run_with_a_tuple_grid_shares_the_cached_launch(fake_triton):
    """``kernel.run(..., grid=..., warmup=False)`` (how Triton's autotuner and heuristics launch a kernel) takes
    the same cached launch as ``kernel[grid](...)``: a signature seen by either is launched directly by both."""
    kernel, calls, compiled = fake_triton
    x, y = _tensors()
    kernel.run(x, y, 32, 0.5, FLAG=True, grid=(2,), warmup=False)
    assert len(calls) == 1 and compiled[0].launches == []
    kernel[(2,)](x, y, 32, 0.5, FLAG=True)
    kernel.run(x, y, 32, 0.5, FLAG=True, grid=(2,), warmup=False)
    assert len(calls) == 1 and [g for g, _ in compiled[0].launches] == [(2, 1, 1)] * 2


@pytest.mark.parametrize("change", [
    "int", "int 1 -> True", "dtype", "misaligned", "constexpr", "constexpr default", "option", "new option", "device",
])
def test_a_new_signature_goes_through_triton(fake_triton, monkeypatch, change):
    kernel, calls, compiled = fake_triton
    x, y = _tensors()
    base = dict(n=1, FLAG=True, num_warps=4)
    kernel[(4,)](x, y, scale=0.5, **base)
    args, kw = (x, y), dict(base, scale=0.5)
    if change == "int":
        kw["n"] = 48
    elif change == "int 1 -> True":
        kw["n"] = True
    elif change == "dtype":
        args = _tensors(torch.bfloat16)
    elif change == "misaligned":  # 4 bytes past a 16-byte boundary: Triton specializes on 16-byte alignment
        args = (_tensors(offset=1)[0], y)
    elif change == "constexpr":
        kw["FLAG"] = False
    elif change == "constexpr default":
        kw["BLOCK"] = 32
    elif change == "option":
        kw["num_warps"] = 8
    elif change == "new option":
        kw["num_stages"] = 2
    else:
        monkeypatch.setattr(launch, "current_device", lambda: 1)
    kernel[(4,)](*args, **kw)
    assert len(calls) == 2 and compiled[0].launches == []
    kernel[(4,)](*args, **kw)  # and that signature is now remembered too
    assert len(calls) == 2 and len(compiled[1].launches) == 1


@pytest.mark.parametrize("how", ["missing parameter", "given twice", "too many", "callable grid", "pre-run hook",
                                 "warmup", "switched off"])
def test_what_cannot_be_keyed_goes_through_triton(fake_triton, monkeypatch, how):
    kernel, calls, compiled = fake_triton
    x, y = _tensors()
    for _ in range(2):
        if how == "missing parameter":  # Triton's own run raises the TypeError for these three
            kernel[(4,)](x, y, 32, FLAG=True)
        elif how == "given twice":
            kernel[(4,)](x, y, 32, 0.5, FLAG=True, n=32)
        elif how == "too many":
            kernel[(4,)](x, y, 32, 0.5, True, 16, False, 7)
        elif how == "callable grid":
            kernel[lambda meta: (4,)](x, y, 32, 0.5, FLAG=True)
        elif how == "pre-run hook":
            if not kernel.pre_run_hooks:
                kernel.add_pre_run_hook(lambda *a, **k: None)
            kernel[(4,)](x, y, 32, 0.5, FLAG=True)
        elif how == "warmup":
            kernel.warmup(x, y, 32, 0.5, FLAG=True, grid=(4,))
        else:
            monkeypatch.setattr(launch, "FAST_LAUNCH", False)
            kernel[(4,)](x, y, 32, 0.5, FLAG=True)
    assert len(calls) == 2 and all(not c.launches for c in compiled)


def test_every_compiled_kernel_is_a_cached_launch_jit():
    from moelab.kernels import finalize, moe_gemm, segments

    if moelab._runtime.INTERPRET:
        pytest.skip("the interpreter runs moelab's kernels (no compiled launches)")
    for fn in (segments._segments_one_chunk_kernel, moe_gemm._gemm1_swiglu_kernel, moe_gemm._gemm2_kernel,
               finalize._finalize_kernel):
        assert isinstance(fn, launch.CachedLaunchJIT), fn


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled launches need a CUDA GPU (runs on the H200)")
def test_routed_moe_repeated_on_the_gpu_is_bit_identical_and_skips_triton_dispatch(monkeypatch):
    T, K, E, H, I = 3, 2, 8, 64, 32
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g).bfloat16()
    w2 = torch.randn(E, H, I, device="cuda", generator=g).bfloat16()
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :K].int()
    W = moelab.prepare_weights(w13, w2, backend="triton")

    def call(seed):
        gs = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn(T, H, device="cuda", generator=gs).bfloat16()
        packed = moelab.pack_topk_ids_weights(ids, torch.rand(T, K, device="cuda", generator=gs))
        return moelab.routed_moe(packed, x, W, num_experts=E, top_k=K, validate=False)[0]

    monkeypatch.setattr(eager_graphs, "ENABLED", False)  # the launches themselves, not a graph replay
    monkeypatch.setattr(launch, "FAST_LAUNCH", False)
    want = [call(s) for s in (1, 2)]
    monkeypatch.setattr(launch, "FAST_LAUNCH", True)
    call(1)  # remembers every kernel's signature
    dispatched = []
    run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: dispatched.append(self) or run(self, *a, **k))
    got = [call(s) for s in (1, 2)]
    torch.cuda.synchronize()
    assert not dispatched, [fn.fn.__name__ for fn in dispatched]
    for w, o in zip(want, got):
        assert torch.equal(w, o)
