"""Backend registry. Each backend module computes the routed-MoE contract (``moelab.contract``) on one engine
and exposes:

    unavailable_reason(device) -> str | None   why it cannot run on ``device`` (None: it can)
    prepare(w13, w2) -> (gemm1_weights, gemm2_weights)   HF-order weights to its own layout
    routed_moe(call: RoutedMoECall) -> RoutedMoEResult
    lora_experts(call: LoRAExpertsCall) -> Tensor   :class:`moelab.LoRAExperts`' forward, ``call.output`` [T, H];
                                                 :func:`moelab.backends.lora_flow.lora_experts` (vLLM's unfused
                                                 flow on the backend's own ``routed_moe``) is every backend's fallback
    fused_lora_reason(bank, path=None) -> str | None   why ``lora_experts`` cannot fold ``bank`` into its
                                                 kernels (None: it can, with ``call.fused``), or cannot on that
                                                 one fused path of ``moelab.experts.LORA_PATHS``

Backends import ``moelab.contract`` and the ops below it, never ``moelab.moe`` or ``moelab.experts`` (the front
ends that import them).
"""

from __future__ import annotations

import importlib

import torch

from moelab import _runtime

#: Preference order of ``backend="auto"``: the fastest engine that runs here first.
BACKENDS = ("flashinfer", "triton", "torch")


_loaded: dict[str, object] = {}  # imported once, then a plain dict lookup (torch.compile traces that)


def get_backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {('auto',) + BACKENDS}, got {name!r}")
    if name not in _loaded:
        _loaded[name] = importlib.import_module(f"moelab.backends.{name}_backend")
    return _loaded[name]


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Backends that can run on ``device`` (default: the current CUDA device, else the CPU), fastest first.

    Example:
        >>> "torch" in available_backends("cpu")  # plain PyTorch runs anywhere; "auto" picks the first entry
        True
    """
    device = _runtime.default_device() if device is None else torch.device(device)
    return [name for name in BACKENDS if _reason(name, device) is None]


def _reason(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run on ``device`` (None: it can), an import failure included."""
    try:
        return get_backend(name).unavailable_reason(device)
    except ImportError as e:  # e.g. no triton wheel for this platform
        return f"its module does not import ({e})"


def resolve_backend(name: str, device: torch.device | str | None = None) -> str:
    """``name`` if it can run on ``device`` ("auto": the first that can), else a ValueError naming one that can."""
    device = _runtime.default_device() if device is None else torch.device(device)
    if name == "auto":
        return available_backends(device)[0]
    reason = _reason(name, device)
    if reason is not None:
        raise ValueError(f"backend: {name!r} cannot run on {device}: {reason}; "
                         f"use one of {available_backends(device)} (or 'auto')")
    return name


def swiglu_only_reason(*, activation: str = "silu", gated: bool = True, swiglu_alpha=None, swiglu_limit=None,
                          has_bias: bool = False, apply_router_weight_on_input: bool = False) -> str | None:
    """Why kernels that run plain SwiGLU without biases (flashinfer's) cannot run an expert activation/bias
    option (None: they can). Such a backend exposes it as its ``expert_options_reason``."""
    if activation == "silu" and gated and swiglu_limit is None and not has_bias and not apply_router_weight_on_input:
        return None
    what = []
    if (activation, gated) != ("silu", True) or swiglu_limit is not None:
        what.append(f"activation {activation!r}" + ("" if gated else " (not gated)")
                    + (f" with swiglu_limit={swiglu_limit}" if swiglu_limit is not None else ""))
    if has_bias:
        what.append("GEMM biases")
    if apply_router_weight_on_input:
        what.append("the router weight on the input")
    return f"runs SwiGLU without biases only, not {', '.join(what)}"
