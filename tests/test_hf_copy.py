"""A copy of a patched model runs its own modules (``copy.deepcopy``; anything that rebinds submodules).

``patch_model`` replaces each MoE block's forward; that forward must look the experts, router, shared expert and
correction bias up on the block it is called on, never hold the original's. Check: patch a tiny model (torch
backend, fp32), run it once (so moelab's weight caches are filled and copied too), deepcopy it, run the copy,
change its experts (as ``model.to()`` does: new storage, same version counter), router, shared expert and
correction bias, and compare the copy's logits with HF eager on the same changed weights (1e-4 relative) while the
original's still match HF eager on the unchanged ones.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import moelab  # noqa: I001  (first: it sets up Triton's interpreter before peft/transformers import triton)

transformers = pytest.importorskip("transformers")

from test_hf_modulelist import modulelist_lm  # noqa: E402

import moelab.hf  # noqa: E402
from moelab.hf.tiny import tiny_causal_lm  # noqa: E402
from moelab.lab import rel_err  # noqa: E402

transformers.utils.logging.set_verbosity_error()
warnings.filterwarnings("ignore", module="transformers")

IDS = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(5))


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _change(model) -> int:
    """Change every MoE weight, by name (the same on a patched and an unpatched model): experts x2 rebinding their
    ``.data`` (new storage, same version counter: what ``model.to()`` does), shared experts x2 and routers x1.5 in
    place, correction biases + noise (a buffer: a new tensor, as ``model.to()`` makes). Returns how many changed."""
    g = torch.Generator().manual_seed(11)
    changed = 0
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if ".experts." in name:
                t.data = t.data * 2
            elif "shared_expert" in name:
                t.mul_(2)
            elif name.endswith(("mlp.gate.weight", "feed_forward.router.weight")):
                t.mul_(1.5)
            elif name.endswith(("e_score_correction_bias", "expert_bias")):
                owner, _, attr = name.rpartition(".")
                owner = model.get_submodule(owner)
                if attr in owner._buffers:  # a new tensor, as model.to() makes for buffers
                    owner._buffers[attr] = t + 0.05 * torch.randn(t.shape, generator=g)
                else:
                    t.add_(0.05 * torch.randn(t.shape, generator=g))
            else:
                continue
            changed += 1
    return changed


def _check_copy(model, family):
    """``model``: an unpatched fp32 model in eval mode."""
    eager = _logits(model)
    patched = copy.deepcopy(model)
    report = moelab.patch_model(patched, backend="torch")
    assert report and all(r.routing.startswith("fused") for r in report), f"{family}: {report}"
    assert rel_err(_logits(patched), eager) < 1e-4  # fills moelab's weight caches before the copy
    clone = copy.deepcopy(patched)
    assert rel_err(_logits(clone), eager) < 1e-4  # the copy's own caches, before its weights change
    assert _change(clone) == _change(model) > 0
    eager_changed = _logits(model)
    assert rel_err(eager_changed, eager) > 1e-2, f"{family}: the change does not move HF's logits"
    err = rel_err(_logits(clone), eager_changed)
    assert err < 1e-4, f"{family}: the deepcopy's logits are {err:.2e} from HF eager on its changed weights"
    err = rel_err(_logits(patched), eager)
    assert err < 1e-4, f"{family}: the original's logits moved ({err:.2e}) when its copy's weights changed"


#: qwen2_moe: softmax router + shared expert with sigmoid gate; deepseek_v3: grouped sigmoid with correction bias
#: and shared experts; llama4: experts called directly with dense inputs (router weight on the input).
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "llama4"])
def test_deepcopy_of_patched_model_runs_its_own_modules(family):
    kwargs = dict(num_experts_per_tok=1) if family == "llama4" else {}
    _check_copy(tiny_causal_lm(family, **kwargs).float().eval(), family)


def test_deepcopy_of_patched_modulelist_model_runs_its_own_modules():
    model, _ = modulelist_lm("qwen2_moe")
    _check_copy(model.float().eval(), "qwen2_moe (ModuleList)")


def test_deepcopy_of_a_layer_registers_its_own_lora_bank():
    """The compiled path finds a layer's LoRA bank by its ``gate_a``: a copied layer's bank must be found too."""
    from moelab.hf.experts import _bank_of, register_bank
    from moelab.hf.patch import AdapterSelection, MoELayer

    layer = MoELayer(None, "torch", AdapterSelection(), None)
    layer.bank = moelab.LoRABank(1, num_local_experts=4, hidden_size=8, intermediate_size=4, max_rank=2)
    register_bank(layer.bank)
    clone = copy.deepcopy(layer)
    assert clone.bank is not layer.bank and clone.bank.gate_a.data_ptr() != layer.bank.gate_a.data_ptr()
    assert _bank_of(clone.bank.gate_a) is clone.bank and _bank_of(layer.bank.gate_a) is layer.bank
