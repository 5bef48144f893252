"""Every MoE family of the installed transformers on moelab (issue 11).

The families are *discovered*: every class of ``transformers.models`` whose forward was wrapped by
``@use_experts_implementation`` (:func:`moelab.hf.tiny.experts_classes`). For each:

- the experts module alone, at toy sizes with random weights and biases: moelab's torch backend against the
  module's own eager forward and against the float64 reference with the spec moelab read off the module; a module
  moelab cannot run raises :class:`moelab.hf.UnsupportedExperts` and is listed in the README;
- the causal LM where the family has one: HF eager logits against ``patch_model`` (torch backend, fused routing
  where recognised) and against the ``"moelab_torch"`` experts implementation, fp32 within 1e-4 relative; the
  experts must move the logits (zeroing them changes the logits), so a no-op could not pass;
- a few representative families on the triton backend in bf16 (Triton's interpreter on CPU), within 3e-2.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch

import moelab  # noqa: I001  (first: it sets up Triton's interpreter before peft/transformers import triton)

transformers = pytest.importorskip("transformers")

import moelab.hf  # noqa: E402
from moelab import reference  # noqa: E402
from moelab.hf.experts import UnsupportedExperts, experts_spec, hf_expert_weights, make_experts_forward  # noqa: E402
from moelab.hf.tiny import TinyModelError, experts_classes, is_experts_class, tiny_causal_lm, tiny_experts  # noqa: E402,E501
from moelab.lab import rel_err  # noqa: E402

transformers.utils.logging.set_verbosity_error()
warnings.filterwarnings("ignore", module="transformers")

CASES = [(family, cls) for family, classes in experts_classes().items() for cls in classes]
FAMILIES = sorted(experts_classes())
README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def _unsupported_in_readme() -> set[str]:
    """Family names listed in the README's table of experts moelab cannot run."""
    section = README.split("<!-- hf-unsupported -->")
    return set(re.findall(r"^\| `(\w+)` \|", section[1], re.M)) if len(section) > 2 else set()


def _wrapping_subclasses(cls) -> list[type]:
    """Undecorated subclasses of ``cls`` in its model file that override its forward (Ergo's ErgoExperts)."""
    module = importlib.import_module(cls.__module__)
    return [c for c in vars(module).values() if inspect.isclass(c) and c is not cls and issubclass(c, cls)
            and "forward" in vars(c) and not is_experts_class(c)]


def test_discovers_the_families():
    # 5.17 had ~60 decorated families, 5.24 has 67: the discovery must find them, not a hand-written list
    assert len(FAMILIES) >= 50, f"found only {len(FAMILIES)} families: {FAMILIES}"
    assert {"mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "nemotron_h"} <= set(FAMILIES)


def _routing(T, K, E, g):
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    return ids, torch.rand(T, K, generator=g) + 0.1


@pytest.mark.parametrize("family,cls", CASES, ids=[f"{f}-{c.__name__}" for f, c in CASES])
def test_experts_module(family, cls):
    module = tiny_experts(family, cls)
    try:
        spec = experts_spec(module)
    except UnsupportedExperts as e:
        assert family in _unsupported_in_readme(), f"{family} raised {e} but is not listed in the README"
        x = torch.randn(3, 64)
        with pytest.raises(UnsupportedExperts):  # the interface refuses it too: never a silent wrong output
            make_experts_forward("torch")(module, x, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))
        return
    if family in _unsupported_in_readme():  # listed for its block: a subclass wraps this module's forward
        assert _wrapping_subclasses(cls), f"{family} runs on moelab but the README lists it as unsupported"
    g = torch.Generator().manual_seed(7)
    T, K = 13, 2
    x = torch.randn(T, spec.hidden_size, generator=g)
    ids, w = _routing(T, K, spec.num_experts, g)
    original = type(module).forward.__wrapped__
    with torch.no_grad():
        try:
            eager = original(module, x, ids, w)
        except (IndexError, RuntimeError):  # one route per row, unit weight (Ergo's projections): give it that
            ids, w = ids[:, :1], torch.ones(T, 1)
            eager = original(module, x, ids, w)
        out = make_experts_forward("torch")(module, x, ids, w)
    assert rel_err(out, eager) < 1e-5, f"{family}: moelab vs eager {rel_err(out, eager):.2e} ({spec.describe()})"
    w13, w2, b13, b2 = hf_expert_weights(module)
    ref = reference.routed_moe(ids, w, x, w13, w2, w13_bias=b13, w2_bias=b2, **spec.activation_options())["output"]
    assert rel_err(out, ref) < 1e-5, f"{family}: moelab vs float64 reference {rel_err(out, ref):.2e}"


#: Experts classes with per-layer SwiGLU limits in their config (Step-3.7, Bailing-hybrid: clamped after the
#: activation). Empty where the installed transformers has none.
CLAMPED_AFTER = [(f, c) for f, c in CASES if "layer_idx" in inspect.signature(c.__init__).parameters
                 and hasattr(tiny_experts(f, c).config, "swiglu_limits")]


@pytest.mark.parametrize("family,cls", CLAMPED_AFTER, ids=[f"{f}-{c.__name__}" for f, c in CLAMPED_AFTER])
def test_a_clamp_after_the_activation_is_refused(family, cls):
    """min(silu(gate), L) * clamp(up, -L, L) is not moelab's swiglu_limit (which clamps the gate first): refused
    by the spec, the experts interface and patch_model, while an unclamped layer of the same class runs."""
    module = tiny_experts(family, cls, swiglu_limits=[7.0, 0.0], layer_idx=0)
    assert module.limit == 7.0
    with pytest.raises(UnsupportedExperts, match="after the activation"):
        experts_spec(module)
    with pytest.raises(UnsupportedExperts, match="after the activation"):
        make_experts_forward("torch")(module, torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.long),
                                      torch.ones(3, 2))
    assert experts_spec(tiny_experts(family, cls, swiglu_limits=[7.0, 0.0], layer_idx=1)).swiglu_limit is None
    try:
        model = tiny_causal_lm(family, swiglu_limits=[7.0, 7.0])
    except TinyModelError:  # no toy causal LM (Step-3.7's is multimodal only): the module checks above stand
        return
    report = moelab.patch_model(model, backend="torch")
    assert not report and report.skipped and all("after the activation" in why for _, why in report.skipped)


#: Where the triton tests run: compiled on a CUDA GPU, else in Triton's interpreter on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _zero_experts(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name and "shared" not in name:
                p.zero_()


#: Families whose toy causal LM must build (a builder regression fails here instead of skipping quietly).
MUST_BUILD = {"mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe",
              "gpt_oss", "granitemoe", "granitemoeshared", "minimax", "minimax_m2", "nemotron_h", "phimoe",
              "ernie4_5_moe", "aria", "deepseek_v4", "flex_olmo", "jamba", "lfm2_moe", "gemma4"}


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_lm_logits(family):
    try:
        model = tiny_causal_lm(family)
    except TinyModelError as e:
        if family in MUST_BUILD:
            raise
        pytest.skip(f"no toy causal LM (the experts module is tested alone): {e}")
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(3))
    eager = _logits(model, ids)
    patched = copy.deepcopy(model)
    report = moelab.patch_model(patched, backend="torch")
    experts = [m for n, m in model.named_modules() if n.endswith(".experts")]
    if not report:
        reasons = "; ".join(why for _, why in report.skipped)
        assert family in _unsupported_in_readme(), f"{family}: nothing patched ({reasons})"
        if any(_wrapping_subclasses(c) for c in experts_classes()[family]):  # the wrapped projections run on moelab
            model.set_experts_implementation("moelab_torch")
            err = rel_err(_logits(model, ids), eager)
            assert err < 1e-4, f"{family}: experts_implementation='moelab_torch' vs HF eager {err:.2e}"
        return
    assert len(report) + len(report.skipped) == len(experts)
    err = rel_err(_logits(patched, ids), eager)
    assert err < 1e-4, f"{family}: patch_model logits vs HF eager {err:.2e}\n{report}"
    model.set_experts_implementation("moelab_torch")
    err = rel_err(_logits(model, ids), eager)
    assert err < 1e-4, f"{family}: experts_implementation='moelab_torch' vs HF eager {err:.2e}"
    _zero_experts(patched)
    assert rel_err(_logits(patched, ids), eager) > 1e-3, f"{family}: the experts do not move the logits"


#: Families run on the triton backend (Triton's interpreter on CPU is slow: a representative handful). mixtral:
#: softmax renormalised; qwen2_moe: shared expert with sigmoid gate; deepseek_v3: grouped sigmoid with bias and
#: scale; granitemoe: another block layout; gpt_oss: clamped SwiGLU, biases and interleaved gate/up, which the
#: kernels fuse, so patch_model keeps it on triton (the other activations: tests/test_kernel_activations.py).
TRITON_FAMILIES = ["mixtral", "qwen2_moe", "deepseek_v3", "granitemoe", "gpt_oss"]


@pytest.mark.parametrize("family", TRITON_FAMILIES)
def test_triton_bf16_logits(family):
    model = tiny_causal_lm(family, dtype=torch.bfloat16).to(DEVICE)  # triton: a GPU, else the CPU interpreter
    ids = torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    eager = _logits(model, ids)
    patched = copy.deepcopy(model)
    report = moelab.patch_model(patched, backend="triton")
    assert report and all(r.backend == "triton" for r in report)
    err = rel_err(_logits(patched, ids), eager)
    assert err < 3e-2, f"{family}: bf16 triton logits vs HF eager {err:.2e}"


def test_routing_fused_where_recognised_and_metadata():
    """Fused routing is chosen per router (and only where it reproduces the block); EPLB metadata per layer."""
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    expect = {"mixtral": "fused (renormalize)", "qwen2_moe": "fused (softmax)", "deepseek_v3": "fused (deepseek_v3"}
    for family, label in expect.items():
        model = tiny_causal_lm(family)
        eager = _logits(model, ids)
        report = moelab.patch_model(model, backend="torch", routing="fused")
        assert all(r.routing.startswith(label) for r in report), f"{family}: {report}"
        assert rel_err(_logits(model, ids), eager) < 1e-4
    assert "correction bias" in report[0].routing and "routed_scaling_factor=2.5" in report[0].routing
    assert report.num_logical_experts == report.num_physical_experts == 4 and report.num_redundant_experts == 0
    report.update_physical_experts_metadata(8, 4, [torch.tensor([0, 1, 2, 3, 3, 2, 1, 0])] * len(report))
    assert report.num_redundant_experts == 4 and report[0].expert_map.tolist() == [0, 1, 2, 3, 3, 2, 1, 0]
    ernie = tiny_causal_lm("ernie4_5_moe")  # clamped renormalisation with a bias: not one of moelab's methods
    with pytest.raises(ValueError, match="routing: 'fused'"):
        moelab.patch_model(copy.deepcopy(ernie), backend="torch", routing="fused")
    report = moelab.patch_model(ernie, routing="external", backend="torch")
    assert report and all(r.routing == "external" for r in report)


def test_llama4_router_weight_on_the_input():
    """Llama-4's experts are not decorated and take dense inputs: patch_model fuses its top-1 sigmoid router and
    applies the weight to the expert's input."""
    model = tiny_causal_lm("llama4", num_experts_per_tok=1)
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    eager = _logits(model, ids)
    report = moelab.patch_model(model, backend="torch")
    assert len(report) == 2 and all(r.routing == "fused (llama4)" for r in report), report
    err = rel_err(_logits(model, ids), eager)
    assert err < 1e-4, f"llama4 logits vs HF eager {err:.2e}"
