"""moelab: learn, check and measure LoRA on Mixture-of-Experts layers.

Everything users call is importable from here (docs/contract.md §6). On a machine without a CUDA GPU, moelab's Triton
kernels run in Triton's interpreter, switched on for them alone: ``import moelab`` sets no ``TRITON_INTERPRET``, and
the process's other Triton kernels stay compiled (``moelab._runtime``).
"""

from moelab._runtime import set_debug  # noqa: I001  (first: where moelab's kernels run)
from moelab.backends import available_backends
from moelab.experts import LoRAExperts
from moelab.lora import LoRABank, lora_scaling, w2_lora_delta, w13_lora_delta
from moelab.moe import MoEWeights, prepare_weights, routed_moe
from moelab.ops import finalize_with_w2_lora, unpermute_activation
from moelab.packing import pack_topk_ids_weights, unpack_topk_ids_weights
from moelab.routing import route

__all__ = [
    "available_backends", "finalize_with_w2_lora", "LoRABank", "LoRAExperts", "lora_scaling", "w13_lora_delta",
    "w2_lora_delta", "MoEWeights", "pack_topk_ids_weights", "prepare_weights",
    "route", "routed_moe", "set_debug", "unpack_topk_ids_weights", "unpermute_activation", "patch_model",
]
__version__ = "0.1.0"


def __getattr__(name):
    """``moelab.distributed`` and ``moelab.hf`` on first use: plain ``import moelab`` stays free of the
    multi-process machinery and of transformers."""
    if name in ("distributed", "hf"):
        import importlib

        return importlib.import_module(f"moelab.{name}")
    raise AttributeError(f"module 'moelab' has no attribute {name!r}")


def patch_model(model, *, backend: str = "auto", routing: str = "auto"):
    """Run a Hugging Face MoE model's experts on moelab: see :func:`moelab.hf.patch_model` (imports transformers).

    Example:
        >>> from moelab.hf.tiny import tiny_causal_lm
        >>> report = moelab.patch_model(tiny_causal_lm("mixtral"), backend="torch")
        >>> [layer.routing for layer in report]
        ['fused (renormalize)', 'fused (renormalize)']
    """
    from moelab.hf import patch_model as _patch_model

    return _patch_model(model, backend=backend, routing=routing)


def _plant_fault_from_env() -> None:
    """The bug hunt's test hook: ``MOELAB_BREAK=<name>`` plants one fault of :mod:`moelab.faults` at import."""
    import os

    if os.environ.get("MOELAB_BREAK", "").strip():
        import importlib

        importlib.import_module("moelab.faults").plant_from_env()


_plant_fault_from_env()
