"""``nn.ModuleList`` experts (older and remote-code MoE models) on moelab, and PEFT LoRA on their Linear layers.

transformers 5.x ships no family whose experts are a ModuleList, so the blocks are built here the way remote-code
models (Qwen2-MoE and DeepSeek before transformers moved to 3-D experts, Mixtral's original w1/w3/w2) wrote them:
a router Linear, an ``nn.ModuleList`` of expert MLPs and a forward that loops over the experts. They are put into
tiny random qwen2_moe / mixtral causal LMs (the same weights as the 3-D experts, so the model's own 3-D forward is a
second check). Truth: the model's own forward (fp32 within 1e-4), PeftModel's own forward for adapters (1e-4).
Any family of the installed transformers with ModuleList experts is discovered and run too.
"""

from __future__ import annotations

import copy
import importlib.util
import pkgutil
import re
import warnings

import pytest
import torch
from torch import nn

import moelab  # noqa: I001  (first: it sets up Triton's interpreter before peft/transformers import triton)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import moelab.hf  # noqa: E402
from moelab.hf.experts import hf_expert_weights  # noqa: E402
from moelab.hf.tiny import TinyModelError, tiny_causal_lm  # noqa: E402
from moelab.lab import rel_err  # noqa: E402

transformers.utils.logging.set_verbosity_error()
warnings.filterwarnings("ignore")


class ExpertMLP(nn.Module):
    """One expert: down(silu(gate(x)) * up(x)), with Qwen2-MoE's or Mixtral's original attribute names."""

    def __init__(self, hidden: int, inter: int, layout: str = "qwen", bias: bool = False):
        super().__init__()
        self.names = ("gate_proj", "up_proj", "down_proj") if layout == "qwen" else ("w1", "w3", "w2")
        for name, (i, o) in zip(self.names, ((hidden, inter), (hidden, inter), (inter, hidden))):
            setattr(self, name, nn.Linear(i, o, bias=bias))
        self.act_fn = nn.SiLU()

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act_fn(gate(x)) * up(x))


class TempRouter(nn.Module):
    """A router module moelab does not recognise (softmax at temperature 2, top-k, no renormalisation), returning
    (logits, weights, ids) as transformers' TopKRouter modules do."""

    def __init__(self, hidden, num_experts, top_k):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_experts, hidden))
        self.top_k = top_k

    def forward(self, x):
        logits = nn.functional.linear(x, self.weight)
        weights, ids = torch.topk(torch.softmax(logits.float() / 2, dim=-1), self.top_k, dim=-1)
        return logits, weights.to(x.dtype), ids


class OldSparseMoeBlock(nn.Module):
    """A remote-code MoE block: router, ModuleList of experts, optional shared expert with a sigmoid gate, and a
    forward that loops over the experts itself."""

    def __init__(self, hidden, inter, num_experts, top_k, *, norm_topk_prob=True, layout="qwen", bias=False,
                 shared=None, router="linear", returns_logits=False):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.returns_logits = top_k, norm_topk_prob, returns_logits
        self.gate = nn.Linear(hidden, num_experts, bias=False) if router == "linear" else \
            TempRouter(hidden, num_experts, top_k)
        self.experts = nn.ModuleList(ExpertMLP(hidden, inter, layout, bias) for _ in range(num_experts))
        if shared is not None:
            self.shared_expert = shared
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if isinstance(self.gate, nn.Linear):
            logits = self.gate(x)
            weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            weights = weights.to(x.dtype)
        else:
            logits, weights, ids = self.gate(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        out = out.reshape(shape)
        return (out, logits) if self.returns_logits else out


def modulelist_lm(family: str, layout: str = "qwen"):
    """tiny_causal_lm(family) with every MoE block replaced by an :class:`OldSparseMoeBlock` holding the same
    weights; returns (ModuleList model, the original 3-D model)."""
    original = tiny_causal_lm(family)
    model = copy.deepcopy(original)
    config = model.config
    for layer in model.model.layers:
        block = layer.mlp
        if not hasattr(block, "experts"):
            continue
        w13, w2, _, _ = hf_expert_weights(block.experts)
        E, I = w13.shape[0], w13.shape[1] // 2
        shared = getattr(block, "shared_expert", None)
        old = OldSparseMoeBlock(config.hidden_size, I, E, config.num_experts_per_tok, layout=layout,
                                norm_topk_prob=getattr(config, "norm_topk_prob", True), shared=shared)
        with torch.no_grad():
            old.gate.weight.copy_(block.gate.weight)
            for e, expert in enumerate(old.experts):
                gate, up, down = (getattr(expert, n) for n in expert.names)
                gate.weight.copy_(w13[e, :I])
                up.weight.copy_(w13[e, I:])
                down.weight.copy_(w2[e])
            if shared is not None:
                old.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
        layer.mlp = old
    return model.eval(), original


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(0))
CASES = [("qwen2_moe", "qwen"), ("mixtral", "w")]


@pytest.mark.parametrize("family,layout", CASES)
@pytest.mark.parametrize("routing", ["auto", "external"])
def test_modulelist_model_matches_its_own_forward(family, layout, routing):
    model, original = modulelist_lm(family, layout)
    want = _logits(model, IDS)
    assert rel_err(want, _logits(original, IDS)) < 1e-5  # the test's blocks compute what the 3-D model does
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if routing == "external":  # a Linear router inside the block's loop: nothing to hand through
        report = moelab.patch_model(model, backend="torch", routing=routing)
        assert len(report) == 0 and len(report.skipped) == 2, str(report)
        assert "nn.ModuleList" in report.skipped[0][1] and "router module" in report.skipped[0][1]
        return
    report = moelab.patch_model(model, backend="torch", routing=routing)
    assert len(report) == 2, str(report)
    assert all(r.routing.startswith("fused") for r in report), str(report)
    assert f"E={len(model.model.layers[0].mlp.experts)}" in report[0].experts
    got = _logits(model, IDS)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) < 1e-4
    assert model.state_dict().keys() == state.keys()  # the original Linear weights stay the parameters
    # the stack follows the parameters: an in-place update (a training step) is seen at the next call
    with torch.no_grad():
        model.model.layers[0].mlp.experts[1].down_proj.weight.mul_(2) if layout == "qwen" else \
            model.model.layers[0].mlp.experts[1].w2.weight.mul_(2)
    moelab.hf.unpatch_model(model)
    want2 = _logits(model, IDS)
    assert rel_err(want2, want) > 1e-3
    moelab.patch_model(model, backend="torch")
    assert rel_err(_logits(model, IDS), want2) < 1e-4
    with torch.no_grad():
        model.model.layers[1].mlp.experts[0].gate_proj.weight.add_(0.5) if layout == "qwen" else \
            model.model.layers[1].mlp.experts[0].w1.weight.add_(0.5)
    got3 = _logits(model, IDS)
    moelab.hf.unpatch_model(model)
    assert rel_err(got3, _logits(model, IDS)) < 1e-4


def test_modulelist_block_router_module_external():
    """A router moelab does not recognise, as a module returning (logits, weights, ids): routed externally through
    it, the block's (out, logits) tuple reproduced."""
    torch.manual_seed(3)
    block = OldSparseMoeBlock(32, 16, 6, 2, router="module", returns_logits=True, bias=True).eval()
    model = nn.ModuleDict({"mlp": block})
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        want, want_logits = block(x)
    report = moelab.patch_model(model, backend="torch")
    assert len(report) == 1 and report[0].routing == "external" and "router module gate" in report[0].note, \
        str(report)
    assert "bias" in report[0].experts
    with torch.no_grad():
        got, got_logits = block(x)
    assert rel_err(got, want) < 1e-4 and torch.equal(got_logits, want_logits)
    with pytest.raises(ValueError, match="fused"):
        moelab.patch_model(nn.ModuleDict({"mlp": copy.deepcopy(block)}), backend="torch", routing="fused")


def test_modulelist_expert_that_computes_something_else_is_left_alone():
    block = OldSparseMoeBlock(32, 16, 4, 2)
    block.experts[2].forward = lambda x, e=block.experts[2]: 1.5 * ExpertMLP.forward(e, x)
    report = moelab.patch_model(nn.ModuleDict({"mlp": block}), backend="torch")
    assert len(report) == 0 and "down(act(gate(x)) * up(x))" in report.skipped[0][1]
    odd = nn.ModuleDict({"mlp": OldSparseMoeBlock(32, 16, 4, 2)})
    odd.mlp.experts[1].up_proj = nn.Linear(32, 8, bias=False)
    report = moelab.patch_model(odd, backend="torch")
    assert len(report) == 0 and "different sizes" in report.skipped[0][1]


def _expert_lora(model, r, alpha, attention=True, **kwargs):
    experts = r"experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
    return peft.LoraConfig(r=r, lora_alpha=alpha, init_lora_weights=False,
                           target_modules=rf".*({experts}|q_proj)" if attention else rf".*{experts}", **kwargs)


# PEFT 0.21 rewrites w1/w2/w3 targets of a model_type "mixtral" model for transformers 5's 3-D experts, so the
# w1/w3/w2 layout is tested in the qwen2_moe model and mixtral with the gate_proj names.
@pytest.mark.parametrize("family,layout", [("qwen2_moe", "w"), ("mixtral", "qwen")])
def test_modulelist_peft_unmerged(family, layout):
    model, _ = modulelist_lm(family, layout)
    torch.manual_seed(1)
    pm = peft.get_peft_model(model, _expert_lora(model, 4, 8))
    pm.add_adapter("second", _expert_lora(model, 2, 16, attention=False, use_rslora=True))
    # a third adapter on one expert's gate only (PEFT's per-module target: experts.0.gate_proj)
    gate_name = "gate_proj" if layout == "qwen" else "w1"
    pm.add_adapter("one", peft.LoraConfig(r=3, lora_alpha=3, init_lora_weights=False,
                                          target_modules=[f"experts.0.{gate_name}"]))
    pm.eval()
    truth = {}
    with torch.no_grad():
        for name in ("default", "second", "one"):
            pm.set_adapter(name)
            truth[name] = pm(IDS).logits
        with pm.disable_adapter():
            truth[None] = pm(IDS).logits
    pm.set_adapter("default")
    for name in ("second", "one"):
        assert rel_err(truth[name], truth[None]) > 1e-3  # each adapter moves the logits
    report = moelab.patch_model(pm, backend="torch")
    assert set(report.adapters) == {"default", "second", "one"} and len(report) == 2, str(report)
    assert rel_err(_logits(pm, IDS), truth["default"]) < 1e-4  # the active adapter by default
    pm.set_adapter("second")
    assert rel_err(_logits(pm, IDS), truth["second"]) < 1e-4
    with pm.disable_adapter():
        assert rel_err(_logits(pm, IDS), truth[None]) < 1e-4
    pm.set_adapter("one")  # per sequence below: "one" and "second" have no attention LoRA (PEFT's, one per batch)
    slots = [report.adapters["one"], report.adapters["second"], -1]
    with moelab.hf.adapter_ids(pm, torch.tensor(slots)):
        mixed = _logits(pm, IDS)
    for row, name in enumerate(("one", "second", None)):
        assert rel_err(mixed[row], truth[name][row]) < 1e-4, (row, name)


def test_modulelist_peft_dora_is_a_clear_error():
    model, _ = modulelist_lm("qwen2_moe")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=2, use_dora=True,
                                                    target_modules=[r"experts.0.gate_proj"]))
    with pytest.raises(moelab.hf.AdapterError, match="DoRA"):
        moelab.patch_model(pm, backend="torch")


def modulelist_families() -> list[str]:
    """Families of the installed transformers whose modeling file assigns ``self.experts = nn.ModuleList(...)``
    (none in 5.17 or 5.24; read from the source, nothing imported)."""
    from transformers import models

    pattern = re.compile(r"self\.experts\s*=\s*(torch\.)?(nn\.)?ModuleList\(")
    found = []
    for info in pkgutil.iter_modules(models.__path__):
        spec = importlib.util.find_spec(f"transformers.models.{info.name}")
        path = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None
        try:
            with open(f"{path}/modeling_{info.name}.py") as f:
                if pattern.search(f.read()):
                    found.append(info.name)
        except (OSError, TypeError):
            continue
    return found


@pytest.mark.parametrize("family", modulelist_families() or [pytest.param(None, marks=pytest.mark.skip(
    reason=f"transformers {transformers.__version__} has no family with nn.ModuleList experts"))])
def test_installed_modulelist_families(family):
    try:
        model = tiny_causal_lm(family)
    except TinyModelError as e:
        pytest.skip(f"{family}: no tiny causal LM ({e})")
    want = _logits(model, IDS)
    report = moelab.patch_model(model, backend="torch")
    assert len(report) or report.skipped, f"{family}: no MoE block found"
    if len(report):
        assert rel_err(_logits(model, IDS), want) < 1e-4, str(report)
    else:  # left alone: the reason is reported and the model's own output is untouched
        assert torch.equal(_logits(model, IDS), want)
