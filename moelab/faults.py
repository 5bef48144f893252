"""Planted faults for the bug hunt: run the notebooks with one classic MoE-LoRA bug switched on, and see which
assertion and which figure catch it.

    python -m moelab.lab --break list                 the faults, what each breaks, the notebooks that catch it
    python -m moelab.lab --break unmasked-unpermute   run the notebooks with that fault on

A fault swaps one public moelab function for a faulty twin built from torch ops, in every loaded ``moelab``
module that holds it (``moelab.X``, ``moelab.ops.X``, the ``X`` that ``moelab.experts`` imported, ...), so the
notebooks' own calls reach it. No file changes, no kernel changes, and ``moelab.reference`` is never touched:
the float64 truth stays true. Three ways to switch one on (this is the test hook; the tests use all three):

- ``MOELAB_BREAK=<name>`` in the environment: ``import moelab`` plants it (how ``lab --break`` reaches the
  notebooks' kernels);
- ``with moelab.faults.planted(name): ...`` for a block, restored on exit;
- :func:`plant` for the rest of the process.

Example:
    >>> import torch, moelab
    >>> from moelab import faults
    >>> ids, w = torch.tensor([[3, 1]]), torch.tensor([[0.5, -0.25]])
    >>> with faults.planted("sign-mask"):
    ...     moelab.unpack_topk_ids_weights(moelab.pack_topk_ids_weights(ids, w))[0].tolist()
    [[3, -1]]
    >>> moelab.unpack_topk_ids_weights(moelab.pack_topk_ids_weights(ids, w))[0].tolist()
    [[3, 1]]
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["Fault", "FAULTS", "ENV_VAR", "planted", "plant", "plant_from_env", "describe"]

#: The environment variable ``import moelab`` reads: the name of one fault to plant.
ENV_VAR = "MOELAB_BREAK"


@dataclass(frozen=True)
class Fault:
    """One planted bug: ``target`` (``"module.function"``) is replaced by ``make_twin(original)``."""

    name: str
    target: str
    what: str  # the bug, in one sentence
    caught_by: tuple[str, ...]  # the notebooks (number prefixes) expected to catch it, in curriculum order
    make_twin: Callable[[Callable], Callable]


# ---------------------------------------------------------------------------------------------- the twins

def _sign_mask(original):
    from moelab.packing import check_routing

    def pack_topk_ids_weights(topk_ids, topk_weights, *, num_experts=None, validate=True):
        """PLANTED FAULT sign-mask: the bf16 bits are sign-extended into the id field (no ``& 0xFFFF``)."""
        check_routing(topk_ids, topk_weights, num_experts=num_experts, validate=validate)
        return (topk_ids.to(torch.int32) << 16) | topk_weights.to(torch.bfloat16).view(torch.int16).to(torch.int32)

    return pack_topk_ids_weights


def _hf_order_delta(original):
    def w13_lora_delta(*args, **kwargs):
        """PLANTED FAULT hf-order-delta: the W13 delta comes out [gate, up] (HF order), not [up, gate]."""
        delta = original(*args, **kwargs)
        half = delta.shape[-1] // 2
        return delta.copy_(torch.cat([delta[..., half:], delta[..., :half]], dim=-1))

    return w13_lora_delta


def _unmasked_unpermute(original):
    def unpermute_activation(act_permuted, expanded_idx_to_permuted_idx, num_tokens, top_k, *, validate=True,
                             use_triton=None):
        """PLANTED FAULT unmasked-unpermute: ``act_permuted[map]``, so a -1 slot reads the last (dead) row."""
        return act_permuted[expanded_idx_to_permuted_idx.long()].contiguous()

    return unpermute_activation


def _unweighted_w2_delta(original):
    def w2_lora_delta(act, topk_ids, topk_weights, *args, **kwargs):
        """PLANTED FAULT unweighted-w2-delta: the W2 delta ignores the routing weights."""
        return original(act, topk_ids, torch.ones_like(topk_weights), *args, **kwargs)

    return w2_lora_delta


def _delta_before_scale(original):
    def finalize_with_w2_lora(output, gemm2_output, expert_weights, expanded_idx_to_permuted_idx, w2_delta, *,
                              scale=1.0, validate=True, use_triton=None):
        """PLANTED FAULT delta-before-scale: ``scale * (base + delta)`` instead of ``scale * base + delta``."""
        base = original(torch.empty(output.shape, dtype=torch.float32, device=output.device), gemm2_output,
                        expert_weights, expanded_idx_to_permuted_idx, None, scale=1.0, validate=validate,
                        use_triton=use_triton)
        lora = w2_delta.float().sum(dim=1) if w2_delta is not None else torch.zeros_like(base)
        return output.copy_(scale * (base + lora))

    return finalize_with_w2_lora


def _dead_row_read(original):
    def finalize_with_w2_lora(output, gemm2_output, expert_weights, expanded_idx_to_permuted_idx, w2_delta, *,
                              scale=1.0, validate=True, use_triton=None):
        """PLANTED FAULT dead-row-read: every slot's row is read, unmasked: a -1 slot reads the buffer's last
        row, a dead row."""
        T, K = expert_weights.shape
        rows = gemm2_output[expanded_idx_to_permuted_idx.long()].float().view(T, K, -1)  # -1 -> the last row
        acc = scale * (expert_weights.float()[:, :, None] * rows).sum(dim=1)
        if w2_delta is not None:
            acc = acc + w2_delta.float().sum(dim=1)
        return output.copy_(acc)

    return finalize_with_w2_lora


def _no_swap_layout(original):
    from moelab import layout

    def to_flashinfer(w13, w2):
        """PLANTED FAULT no-swap-layout: HF [gate; up] goes into the reorder unswapped (FlashInfer's own
        ``prepare_trtllm_bf16_weights`` fed HF order), so SiLU lands on up."""
        return original(layout.swap_halves(w13), w2)

    return to_flashinfer


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("sign-mask", "moelab.packing.pack_topk_ids_weights",
          "packing without & 0xFFFF: a weight with its sign bit set turns the id into -1 (the slot is dropped)",
          ("01",), _sign_mask),
    Fault("hf-order-delta", "moelab.lora.w13_lora_delta",
          "the W13 LoRA delta in HF [gate, up] order: the kernel adds the gate delta to up and vice versa",
          ("02", "05"), _hf_order_delta),
    Fault("unmasked-unpermute", "moelab.ops.unpermute_activation",
          "unpermute without masking: act_permuted[map] reads the last (dead) row for a -1 slot",
          ("03",), _unmasked_unpermute),
    Fault("unweighted-w2-delta", "moelab.lora.w2_lora_delta",
          "the W2 LoRA delta not multiplied by the routing weights",
          ("05",), _unweighted_w2_delta),
    Fault("delta-before-scale", "moelab.ops.finalize_with_w2_lora",
          "the finalize adds the W2 delta before scaling: scale * (base + delta)",
          ("04",), _delta_before_scale),
    Fault("dead-row-read", "moelab.ops.finalize_with_w2_lora",
          "the finalize reads gemm2_output[map] unmasked: a -1 slot reads a dead row",
          ("04",), _dead_row_read),
    Fault("no-swap-layout", "moelab.layout.to_flashinfer",
          "FlashInfer weight preparation without swapping HF's halves: SiLU lands on the up projection",
          ("06",), _no_swap_layout),
)}


# ---------------------------------------------------------------------------------------------- the hook

def _get(name: str) -> Fault:
    if name not in FAULTS:
        raise ValueError(f"fault: unknown name {name!r}; expected one of {', '.join(FAULTS)} "
                         "(python -m moelab.lab --break list)")
    return FAULTS[name]


def _swap(old, new) -> list[tuple[object, str]]:
    """Replace ``old`` by ``new`` in every loaded moelab module (but this one and the reference); returns what
    was swapped."""
    swapped = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "moelab" or module_name.startswith("moelab.")):
            continue
        if module_name in ("moelab.faults", "moelab.reference"):
            continue
        for attr, value in list(vars(module).items()):
            if value is old:
                setattr(module, attr, new)
                swapped.append((module, attr))
    return swapped


def _resolve(fault: Fault):
    module_name, attr = fault.target.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), attr)


def plant(name: str) -> Callable[[], None]:
    """Plant fault ``name`` for the rest of the process; returns a function that takes it out again."""
    fault = _get(name)
    original = _resolve(fault)
    twin = fault.make_twin(original)
    twin.__moelab_fault__ = fault.name
    twin.__wrapped__ = original  # inspect.getsource shows the original: the bug hides, as real ones do
    swapped = _swap(original, twin)

    def restore() -> None:
        for module, attr in swapped:
            setattr(module, attr, original)

    return restore


@contextlib.contextmanager
def planted(name: str) -> Iterator[Fault]:
    """``with planted(name):`` the fault is on inside the block (see the module docstring)."""
    restore = plant(name)
    try:
        yield FAULTS[name]
    finally:
        restore()


def plant_from_env() -> str | None:
    """Plant the fault named by ``$MOELAB_BREAK`` (called by ``import moelab``); returns its name, or None."""
    name = os.environ.get(ENV_VAR, "").strip()
    if not name:
        return None
    plant(name)
    print(f"moelab: planted fault {name!r} ({ENV_VAR}): {FAULTS[name].what}", file=sys.stderr)
    return name


def describe() -> str:
    """The fault table ``lab --break list`` prints."""
    width = max(len(n) for n in FAULTS)
    lines = [f"{'fault':<{width}}  caught by  replaces / what it breaks"]
    for f in FAULTS.values():
        lines.append(f"{f.name:<{width}}  {', '.join(f.caught_by):<9}  {f.target}\n{'':<{width}}  {'':<9}  {f.what}")
    return "\n".join(lines)
