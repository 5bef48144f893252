"""Test conventions (issue 2): seeded, NaN-poisoned outputs, float64 reference, per-dtype tolerances.

Hypothesis runs a small, derandomized profile by default (Triton's interpreter is slow on 2 CPU cores);
``HYPOTHESIS_PROFILE=thorough`` runs more examples on a GPU box.
"""

import os

import matplotlib
import pytest
import torch
from hypothesis import HealthCheck, settings

matplotlib.use("Agg")

settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# pytest-xdist workers share the machine's cores: each takes its share of torch's CPU threads (the float64
# references are many small products in Python loops). With torch's default, every worker takes all the cores: on a
# 16-core GPU box the LoRA tests of 10-15 workers did not finish in 8 minutes, and ran in 82 s on one thread each.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_graphs_of_other_tests():
    """On a GPU, eager decode calls replay CUDA graphs keyed by their tensors' addresses: a test's weights may be
    allocated where an earlier test's were, so each test starts without the graphs of the ones before it."""
    yield
    from moelab.backends import eager_graphs

    eager_graphs.clear()


@pytest.fixture
def device():
    """The CUDA GPU when there is one (the lent H200), else the CPU (Triton runs interpreted)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def recording_run(folder: str, run):
    """``ScopedInterpretedFunction.run`` that also writes each interpreted moelab launch's kernel, argument types,
    constexprs and options, once each, as JSON lines in ``<folder>/<worker>.jsonl`` (``run``: the method it wraps),
    for ``scripts/ptx_sm90.py --launched <folder>`` to compile for sm_90. ``MOELAB_RECORD_LAUNCHES=<folder>``
    installs it for the whole session (``make sm90-launches``)."""
    import inspect
    import json

    import triton.language as tl
    from triton.runtime.jit import mangle_type

    os.makedirs(folder, exist_ok=True)
    path = os.path.abspath(os.path.join(folder, f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl"))
    seen = set()

    def recording(self, *args, grid, warmup, **kwargs):
        signature_of_fn = inspect.signature(self.fn)
        params = signature_of_fn.parameters
        bound = signature_of_fn.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in params})
        bound.apply_defaults()
        signature, constexprs, hinted = {}, {}, []
        for name, value in bound.arguments.items():
            annotation = params[name].annotation
            # Triton's own specialization: constexprs, None and integers equal to 1 are constants; the types are
            # Triton's (mangle_type); 16-byte-aligned pointers and integers divisible by 16 are hinted
            if annotation is tl.constexpr or annotation == "tl.constexpr" or value is None or (
                    type(value) is int and value == 1):
                constexprs[name] = value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
            else:
                signature[name] = mangle_type(value)
                if not isinstance(value, (bool, float)) and \
                        (value.data_ptr() if isinstance(value, torch.Tensor) else value) % 16 == 0:
                    hinted.append(name)
        options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
        line = json.dumps(dict(module=self.fn.__module__, kernel=self.fn.__name__, signature=signature,
                               constexprs=constexprs, hinted=hinted, options=options), sort_keys=True)
        if line not in seen:
            seen.add(line)
            with open(path, "a") as f:
                f.write(line + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    return recording


if os.environ.get("MOELAB_RECORD_LAUNCHES"):
    from moelab.kernels.interpret import ScopedInterpretedFunction

    ScopedInterpretedFunction.run = recording_run(os.environ["MOELAB_RECORD_LAUNCHES"], ScopedInterpretedFunction.run)
