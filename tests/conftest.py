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
