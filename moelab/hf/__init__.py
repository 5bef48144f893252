"""Hugging Face MoE models on moelab: the experts interface, ``patch_model`` and PEFT adapters run unmerged.

``import moelab.hf`` registers three experts implementations with transformers' ``ExpertsInterface``:

    "moelab"          the fastest moelab backend that runs the module (triton on a CUDA GPU, else torch)
    "moelab_torch"    moelab's torch backend (any device)
    "moelab_triton"   moelab's triton kernels (CUDA; on CPU Triton's interpreter, for tests)

so ``AutoModelForCausalLM.from_config(cfg, experts_implementation="moelab")`` or
``model.set_experts_implementation("moelab")`` runs every experts module on moelab.

    patch_model(model, backend=, routing=)   replace every MoE block (fused routing where recognised), import a
                                             PeftModel's expert adapters; returns a PatchReport
    adapter_ids(model, ids)                  context: adapter slot per sequence [B] or per token [B, S]
    load_adapter(model, directory, name)     a PEFT adapter directory (safetensors) straight into the banks

Example:
    >>> import moelab.hf
    >>> from moelab.hf.tiny import tiny_causal_lm
    >>> model = tiny_causal_lm("qwen3_moe")
    >>> model.set_experts_implementation("moelab")
    >>> model(torch.randint(0, 128, (1, 5))).logits.shape
    torch.Size([1, 5, 128])
"""

from __future__ import annotations

import torch  # noqa: F401  (the docstring example uses it)

from moelab.hf.experts import ExpertsSpec, UnsupportedExperts, experts_spec, make_experts_forward
from moelab.hf.patch import LayerReport, PatchReport, patch_model, unpatch_model
from moelab.hf.peft import AdapterError, adapter_ids, load_adapter

__all__ = ["ExpertsSpec", "UnsupportedExperts", "experts_spec", "IMPLEMENTATIONS", "register", "patch_model",
           "unpatch_model", "PatchReport", "LayerReport", "adapter_ids", "load_adapter", "AdapterError"]

#: The experts implementations ``import moelab.hf`` registers, name -> moelab backend.
IMPLEMENTATIONS = {"moelab": "auto", "moelab_torch": "torch", "moelab_triton": "triton"}


def register() -> None:
    """Register :data:`IMPLEMENTATIONS` with transformers' ``ExpertsInterface`` (done on import)."""
    from transformers.integrations.moe import ExpertsInterface

    for name, backend in IMPLEMENTATIONS.items():
        ExpertsInterface.register(name, make_experts_forward(backend))


register()
