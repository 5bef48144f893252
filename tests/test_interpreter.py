"""Triton's interpreter is moelab's own business: ``import moelab`` on a CPU interprets moelab's kernels and
nothing else (no TRITON_INTERPRET in the environment, no Triton knob, every other kernel a compiled JITFunction),
while TRITON_INTERPRET set by the user stays Triton's own switch."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

import moelab
from moelab.kernels import _common
from moelab.kernels.interpret import ScopedInterpretedFunction

ROOT = pathlib.Path(moelab.__file__).parent

#: Run in a fresh interpreter as a file (triton.jit reads a kernel's source from its file). Prints one JSON line.
USERS_CODE = '''
import json, os, sys
import torch, triton, triton.language as tl

variable_before = os.environ.get("TRITON_INTERPRET", "unset")
import moelab
from moelab import reference
from moelab.kernels import moe_gemm
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


@triton.jit
def users_kernel(x_ptr, out_ptr, N: tl.constexpr):
    acc = tl.zeros((N,), dtype=tl.float32)
    for i in tl.range(0, 2):
        acc += tl.load(x_ptr + i * N + tl.arange(0, N))
    tl.store(out_ptr, tl.sum(acc, axis=0) + tl.max(acc, axis=0))


def kind(fn):
    return type(fn).__name__ + (" (InterpretedFunction)" if isinstance(fn, InterpretedFunction) else "") + (
        " (JITFunction)" if isinstance(fn, JITFunction) else "")


def users_result():
    """users_kernel where it runs (a CUDA GPU, or every kernel interpreted); else its PTX for sm_90, compiled
    here from scratch (TRITON_ALWAYS_COMPILE=1): a kernel of the user's that saw moelab's interpreter would not
    compile, or compile to something else."""
    if torch.cuda.is_available() or isinstance(users_kernel, InterpretedFunction):
        device = "cpu" if isinstance(users_kernel, InterpretedFunction) else "cuda"
        x, out = torch.arange(32.0, device=device), torch.zeros(1, device=device)
        users_kernel[(1,)](x, out, N=16)
        return out.item()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=users_kernel, signature={"x_ptr": "*fp32", "out_ptr": "*fp32", "N": "constexpr"},
                       constexprs={"N": 16})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def state():
    return {"variable": os.environ.get("TRITON_INTERPRET", "unset"), "knobs": repr(vars(triton.knobs.runtime)),
            "users": kind(users_kernel), "sum": kind(tl.sum),
            "core": {name: id(value) for name, value in vars(tl.core).items()}}


before, users_before = state(), users_result()
device = "cuda" if torch.cuda.is_available() and not moelab._runtime.INTERPRET else "cpu"
g = torch.Generator().manual_seed(int(sys.argv[1]))
T, K, E, H, I = 5, 2, 4, 32, 16
x = torch.randn(T, H, generator=g)
w13, w2 = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
topk_weights, topk_ids = moelab.route(torch.randn(T, E, generator=g), K, "renormalize")
ok = "triton" in moelab.available_backends(torch.device(device))
err = None
if ok:
    weights = moelab.prepare_weights(w13.to(device), w2.to(device), backend="triton")
    (out,) = moelab.routed_moe((topk_ids.to(device), topk_weights.to(device)), x.to(device), weights,
                               num_experts=E, top_k=K)
    ref = reference.routed_moe(topk_ids, topk_weights, x, w13, w2)["output"]
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()


@triton.jit
def later_kernel(x_ptr):
    tl.store(x_ptr, 1.0)


print(json.dumps({"variable_before_import": variable_before, "before": before, "after": state(),
                  "users_unchanged": users_result() == users_before, "later": kind(later_kernel),
                  "users_value": users_before if isinstance(users_before, float) else None,
                  "moelab": kind(moe_gemm._gemm1_swiglu_kernel), "interpret": moelab._runtime.INTERPRET,
                  "triton_backend": ok, "err": err, "cuda": torch.cuda.is_available()}))
'''


def _run_users_code(tmp_path, variable: str | None) -> dict:
    """USERS_CODE in a fresh Python with TRITON_INTERPRET unset (None) or set to ``variable``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if variable is not None:
        env["TRITON_INTERPRET"] = variable
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT.parent), env.get("PYTHONPATH", "")])
    if not torch.cuda.is_available():  # the PTX after moelab's kernel ran is compiled again, not read from a cache
        env["TRITON_ALWAYS_COMPILE"] = "1"
        env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    (tmp_path / "users_code.py").write_text(USERS_CODE)
    seed = str(torch.randint(0, 2**31, ()).item())
    out = subprocess.run([sys.executable, str(tmp_path / "users_code.py"), seed], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


#: users_kernel's result on x = arange(32): acc = x[:16] + x[16:] = 16, 18, ..., 46; sum 496 + max 46.
USERS_VALUE = 542.0


def _assert_same_state(before: dict, after: dict, core: bool = True) -> None:
    """The environment variable, knobs and kinds equal; with ``core``, every name of triton.language.core holds the
    same object (Triton's interpreter leaves patches there, e.g. its own ``range``, which a compiled kernel would
    then meet; under TRITON_INTERPRET=1 that is Triton's business, and no kernel is compiled)."""
    core_before, core_after = before.pop("core"), after.pop("core")
    assert before == after
    if not core:
        return
    changed = sorted(name for name, value in core_before.items() if core_after.get(name) != value)
    assert not changed, f"triton.language.core names changed: {changed}"


def test_kernels_outside_moelab_stay_compiled(tmp_path):
    """Without TRITON_INTERPRET, a kernel the user defines after ``import moelab`` (and another after a moelab
    kernel ran) is a compiled JITFunction, the environment and Triton's knobs are as Triton left them, the user's
    kernel gives the same result (its PTX, on a CPU) before and after, and moelab's result matches the reference."""
    r = _run_users_code(tmp_path, None)
    assert r["variable_before_import"] == "unset"
    _assert_same_state(r["before"], r["after"])
    assert r["after"]["variable"] == "unset"
    assert r["after"]["users"] == r["later"] == r["after"]["sum"] == "JITFunction (JITFunction)"
    assert r["users_unchanged"] and r["users_value"] in (None, USERS_VALUE), r["users_value"]
    if r["cuda"]:  # compiled, through moelab's cached launches
        assert r["moelab"] == "CachedLaunchJIT (JITFunction)" and not r["interpret"]
    else:
        assert r["moelab"] == "ScopedInterpretedFunction (InterpretedFunction)" and r["interpret"]
    assert r["triton_backend"] and r["err"] < 1e-5, r["err"]


@pytest.mark.parametrize("variable", ["1", "0"])
def test_triton_interpret_is_tritons_switch(tmp_path, variable):
    """TRITON_INTERPRET=1 interprets every kernel of the process (moelab's included, by Triton's own function);
    TRITON_INTERPRET=0 none: moelab's kernels are compiled, and on a CPU its triton backend is unavailable."""
    if variable == "1":
        import numpy

        try:
            moelab._runtime.check_interpreter_numpy(triton.__version__, numpy.__version__)
        except ImportError as e:  # e.g. a GPU box with triton 3.6 and NumPy >= 2.4: import moelab refuses it
            pytest.skip(str(e))
    r = _run_users_code(tmp_path, variable)
    _assert_same_state(r["before"], r["after"], core=variable == "0")
    assert r["after"]["variable"] == variable
    assert r["users_unchanged"] and r["users_value"] in (None, USERS_VALUE), r["users_value"]
    if variable == "1":
        assert r["after"]["users"] == r["later"] == r["moelab"] == "InterpretedFunction (InterpretedFunction)"
        assert r["interpret"] and r["triton_backend"] and r["err"] < 1e-5, r
    else:
        assert r["after"]["users"] == r["later"] == "JITFunction (JITFunction)"
        assert r["moelab"] == "CachedLaunchJIT (JITFunction)" and not r["interpret"]
        assert r["triton_backend"] == r["cuda"]


def _sum_then_fail(x_ptr, out_ptr, N: tl.constexpr, FAIL: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    tl.store(out_ptr, tl.sum(x, axis=0) + tl.max(x, axis=0))
    tl.static_assert(not FAIL, "this kernel fails on purpose")


def _triton_state() -> dict:
    """Every name of the loaded triton.language modules and of the classes Triton's interpreter patches, with its
    value's identity; Triton's runtime knobs; the environment."""
    spaces = {name: m for name, m in sys.modules.items() if m is not None and name.startswith("triton.language")}
    spaces |= {c: getattr(tl.core, c) for c in ("tensor", "condition", "dtype", "tensor_descriptor_base")}
    return {"names": {(space, n): id(v) for space, obj in spaces.items() for n, v in vars(obj).items()},
            "knobs": dict(vars(triton.knobs.runtime)), "env": dict(os.environ)}


@pytest.mark.parametrize("fail", [False, True])
def test_a_kernel_leaves_triton_as_it_was(fail):
    """A kernel made by moelab's ``jit`` (here one calling Triton's library, which makes Triton's interpreter patch
    ``triton.language.core`` for good) leaves every triton.language name, the knobs and the environment as they
    were, also when it raises; its result is right."""
    kernel = _common.jit(_sum_then_fail)
    if not isinstance(kernel, ScopedInterpretedFunction):
        pytest.skip(f"moelab's kernels are {type(kernel).__name__} here (a GPU, or TRITON_INTERPRET set)")
    x = torch.randn(16, dtype=torch.float32)
    out = torch.full((1,), float("nan"))
    before = _triton_state()
    if fail:
        with pytest.raises(Exception, match="fails on purpose"):
            kernel[(1,)](x, out, N=16, FAIL=True)
    else:
        kernel[(1,)](x, out, N=16, FAIL=False)
        want = x.double().sum() + x.double().max()
        assert abs(out.item() - want.item()) <= 1e-5 * abs(want.item()) + 1e-6
    after = _triton_state()
    assert after["knobs"] == before["knobs"] and after["env"] == before["env"]
    changed = sorted(k for k, v in before["names"].items() if after["names"].get(k) != v)
    # names added to a class (modules may gain some: the interpreter's own globals, next to each function it rewrites)
    added = sorted(k for k in after["names"].keys() - before["names"].keys() if not k[0].startswith("triton."))
    assert not changed and not added, (changed[:8], added[:8])
    assert isinstance(tl.sum, JITFunction) and not isinstance(tl.sum, InterpretedFunction)


def test_every_moelab_kernel_goes_through_jit():
    """No ``triton.jit`` in moelab's source, and every kernel object of moelab.kernels is of the kind ``jit``
    makes here, but the Gluon kernels of gluon_gemm.py: compiled sm_90 code that no interpreter runs, which
    ``takes_gluon_gemm1``/``2`` never pick without an sm_90 GPU."""
    import importlib

    for path in ROOT.rglob("*.py"):
        for line in path.read_text().splitlines():
            code = line.split("#")[0]
            if path == ROOT / "kernels" / "_common.py" and code.strip() == "return triton.jit(fn)":
                continue  # jit itself, under TRITON_INTERPRET=1
            assert "triton.jit(" not in code and not code.strip().startswith("@triton.jit"), f"{path}: {line}"
    kind = type(_common.jit(_sum_then_fail))
    found = 0
    for path in sorted((ROOT / "kernels").glob("*.py")):
        module = importlib.import_module(f"moelab.kernels.{path.stem}")
        for name, value in vars(module).items():
            if isinstance(value, (JITFunction, InterpretedFunction)) and getattr(value, "fn", None) is not None \
                    and value.fn.__module__ == module.__name__:
                if getattr(value, "is_gluon", lambda: False)():
                    assert path.stem == "gluon_gemm", f"{module.__name__}.{name}: a Gluon kernel outside gluon_gemm.py"
                    continue
                assert type(value) is kind, f"{module.__name__}.{name} is {type(value).__name__}, not {kind.__name__}"
                found += 1
    assert found >= 20, found


def _row_sum_max(x_ptr, out_ptr, N: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * N + tl.arange(0, N))
    tl.store(out_ptr + row, tl.sum(x, axis=0) + tl.max(x, axis=0))


def test_launches_from_two_threads():
    """Two threads launching moelab kernels at once (a data loader next to the model, say) both get the right
    result and leave Triton's library compiled: launches take turns (without that, one thread's restore could put
    the other's interpreted twins back for good, and Triton's interpreter keeps one global grid position)."""
    import threading

    kernel = _common.jit(_row_sum_max)
    if not isinstance(kernel, ScopedInterpretedFunction):
        pytest.skip(f"moelab's kernels are {type(kernel).__name__} here (a GPU, or TRITON_INTERPRET set)")
    xs = [torch.randn(64, 16, dtype=torch.float32) for _ in range(2)]
    outs = [torch.full((64,), float("nan")) for _ in range(2)]

    def launch(i):
        for _ in range(3):
            kernel[(64,)](xs[i], outs[i], N=16)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the threads switch often, inside launches
    try:
        threads = [threading.Thread(target=launch, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    for x, out in zip(xs, outs):
        want = x.double().sum(1) + x.double().max(1).values
        assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-6)
    assert isinstance(tl.sum, JITFunction) and not isinstance(tl.sum, InterpretedFunction)


@triton.jit
def _users_kernel(x_ptr):
    tl.store(x_ptr, tl.sum(tl.zeros((4,), dtype=tl.float32), axis=0))


def _rank_report(rank, world_size, seed):
    """What a torch.distributed rank sees after its own ``import moelab`` (this module, imported by name) and one
    moelab kernel call: the environment variable, the kinds of kernel, moelab's error against the reference."""
    from moelab import reference

    g = torch.Generator().manual_seed(seed + rank)
    T, K, E, H, I = 3, 2, 4, 32, 16
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    topk_weights, topk_ids = moelab.route(torch.randn(T, E, generator=g), K, "renormalize")
    weights = moelab.prepare_weights(w13, w2, backend="triton")
    (out,) = moelab.routed_moe((topk_ids, topk_weights), x, weights, num_experts=E, top_k=K)
    ref = reference.routed_moe(topk_ids, topk_weights, x, w13, w2)["output"]
    from moelab.kernels import moe_gemm

    return {"variable": os.environ.get("TRITON_INTERPRET", "unset"), "moelab": type(moe_gemm._gemm2_kernel).__name__,
            "users": type(_users_kernel).__name__, "sum": type(tl.sum).__name__,
            "err": ((out.double() - ref).norm() / ref.norm()).item()}


def test_spawned_ranks_scope_it_themselves():
    """torch.distributed ranks spawned from a process that ran moelab's kernels (this one) import moelab
    themselves and get the same: no TRITON_INTERPRET, moelab's kernels interpreted, the user's compiled."""
    if torch.cuda.is_available() or "TRITON_INTERPRET" in os.environ:
        pytest.skip("the scoped interpreter: a CPU machine, TRITON_INTERPRET unset")
    kernel = _common.jit(_row_sum_max)
    kernel[(2,)](torch.randn(2, 16), torch.empty(2), N=16)  # a moelab-made kernel ran here first
    seed = int(torch.randint(0, 2**31, ()).item())
    for r in moelab.distributed.spawn_ranks(_rank_report, 2, seed, timeout=60):
        assert r["variable"] == "unset" and r["moelab"] == "ScopedInterpretedFunction", r
        assert r["users"] == r["sum"] == "JITFunction" and r["err"] < 1e-5, r
