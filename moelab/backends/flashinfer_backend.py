"""Backend "flashinfer": docs/contract.md §3 on FlashInfer's ``trtllm_bf16_routed_moe`` (Blackwell, SM 10.x, bf16 only).

The kernel does the work; this module only translates. :func:`prepare` converts HF-order weights to the
BlockMajorK layout (docs/contract.md §4) with FlashInfer's own helper when it imports, else
:func:`moelab.layout.to_flashinfer` (the same bytes). :func:`build_call_kwargs` is the call as keyword
arguments, a pure function that CPU tests bind against the installed FlashInfer's signature.
:func:`normalize_result` maps FlashInfer's four return shapes (a bare tensor for ``do_finalize=True`` without a
delta, ``[output]`` from 0.8.0 on; lists otherwise)
onto :class:`~moelab.contract.RoutedMoEResult`.

``T = 0``: FlashInfer's routing raises on an empty batch with tuple routing, while docs/contract.md §7 asks for empty
results; so an empty batch never reaches the kernel: :func:`routed_moe` returns empty results shaped as
FlashInfer would size them (``output`` [0, H], the map [0], permuted buffers of ``ceil(65536/width)`` dead rows).

Checked against FlashInfer 0.7.4 (the signature and the weight helper; see ``tests/test_flashinfer_backend.py``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from moelab import _runtime, layout
from moelab.backends import lora_flow, swiglu_only_reason
from moelab.contract import LoRAExpertsCall, RoutedMoECall, RoutedMoEResult, permuted_rows
from moelab.permutation import default_tile

#: ``RoutingMethodType.Renormalize``. In routed mode the method only selects validation, never math
#: (docs/contract.md §4): weights are used as given. Renormalize accepts every top_k (Llama4 = 3 would demand
#: top_k == 1).
ROUTING_METHOD_RENORMALIZE = 1
#: ``WeightLayout.BlockMajorK`` and ``ActivationType.Swiglu``: what :func:`prepare` produces and what
#: docs/contract.md §3 computes.
#: Passed explicitly so a change of FlashInfer's defaults cannot silently change the meaning of our weights.
WEIGHT_LAYOUT_BLOCK_MAJOR_K = 2
ACTIVATION_SWIGLU = 3


@functools.cache
def _import_flashinfer_moe():
    """``(flashinfer.fused_moe, None)`` or ``(None, why it does not import)``; imported once (about 1.5 s)."""
    try:
        return importlib.import_module("flashinfer.fused_moe"), None
    except Exception as e:  # ImportError, or a broken install raising anything at import time
        return None, f"flashinfer does not import ({type(e).__name__}: {e}); pip install 'moelab[flashinfer]'"


def _kernel():
    """``flashinfer.fused_moe.trtllm_bf16_routed_moe`` (tests replace this function with a fake)."""
    module, why = _import_flashinfer_moe()
    if module is None:
        raise RuntimeError(f"backend 'flashinfer': {why}")
    return module.trtllm_bf16_routed_moe


def unavailable_reason(device: torch.device) -> str | None:
    """None when ``device`` is a CUDA GPU of compute capability 10.x and flashinfer imports; else what is missing.

    On a device that cannot run the kernel anyway, flashinfer is only looked for (no 1.5 s import).
    """
    device = torch.device(device)
    reasons = []
    cap = _runtime.cuda_capability(device) if device.type == "cuda" else None
    if cap is None:
        reasons.append(f"needs a CUDA GPU of compute capability 10.x (Blackwell, SM100/SM103), got {device}")
    elif cap[0] != 10:
        reasons.append(f"FlashInfer's BF16 routed MoE kernel runs on SM 10.x only (Blackwell); {device} is "
                       f"SM {cap[0]}.{cap[1]}")
    if reasons:
        if importlib.util.find_spec("flashinfer") is None:
            reasons.append("flashinfer is not installed (pip install 'moelab[flashinfer]')")
    else:
        why = _import_flashinfer_moe()[1]
        if why is not None:
            reasons.append(why)
    return "; and ".join(reasons) or None


expert_options_reason = swiglu_only_reason  # the kernels run plain SwiGLU without biases only


def prepare(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-order ``w13`` bf16 [E, 2I, H] and ``w2`` bf16 [E, H, I] to FlashInfer's ``gemm1_weights``
    [E, H/64, 2I, 64] and ``gemm2_weights`` [E, I/64, H, 64] (docs/contract.md §4). I and H must be multiples of 128."""
    E, H, I = layout.check_flashinfer_weights(w13, w2)
    module, _ = _import_flashinfer_moe()
    if module is None:
        return layout.to_flashinfer(w13, w2)
    from flashinfer.fused_moe.prepare import prepare_trtllm_bf16_weights

    # FlashInfer's helper does reorder, shuffle and blocking but not the swap: it wants [up; gate].
    prepared = prepare_trtllm_bf16_weights(layout.swap_halves(w13), w2, num_local_experts=E, hidden_size=H,
                                           intermediate_size=I, device=w13.device)
    return prepared["gemm1_weights"], prepared["gemm2_weights"]


def _kernel_topk(call: RoutedMoECall):
    """The routing as the kernel reads it: the caller's packed tensor, or the caller's ``(ids, weights)`` pair.

    The caller's objects go through unchanged when the kernel can read them (contiguous int32 ids, bf16 or
    fp32 weights); otherwise ids become int32 and fp16 weights fp32, both exact.
    """
    if not isinstance(call.topk, tuple):
        return call.topk.contiguous()
    weights = call.expert_weights
    if weights.dtype not in (torch.bfloat16, torch.float32):
        weights = weights.float()
    return call.topk_ids, weights.contiguous()


def build_call_kwargs(call: RoutedMoECall) -> dict:
    """The keyword arguments of ``flashinfer.fused_moe.trtllm_bf16_routed_moe`` for ``call`` (pure: no import).

    Routing is precomputed, so ``n_group``/``topk_group``/``routed_scaling_factor`` are None and the routing
    method only picks validation (Renormalize = 1). Layout and activation are spelled out (BlockMajorK,
    shuffled, SwiGLU) because :func:`prepare` produced exactly that.
    """
    W = call.weights
    return dict(
        topk_ids=_kernel_topk(call),
        hidden_states=call.hidden_states,
        gemm1_weights=W.gemm1_weights,
        gemm2_weights=W.gemm2_weights,
        num_experts=call.num_experts,
        top_k=call.top_k,
        n_group=None,
        topk_group=None,
        intermediate_size=W.intermediate_size,
        local_expert_offset=call.local_expert_offset,
        local_num_experts=W.num_local_experts,
        routed_scaling_factor=None,
        routing_method_type=ROUTING_METHOD_RENORMALIZE,
        use_shuffled_weight=True,
        weight_layout=WEIGHT_LAYOUT_BLOCK_MAJOR_K,
        activation_type=ACTIVATION_SWIGLU,
        do_finalize=call.do_finalize,
        gemm1_lora_delta=call.gemm1_lora_delta,
        output=call.output,
    )


def normalize_result(returned, *, do_finalize: bool, has_delta: bool,
                     output: torch.Tensor | None = None) -> RoutedMoEResult:
    """FlashInfer's return value (docs/contract.md §3 table) as a :class:`RoutedMoEResult`.

    ========  =====  =================================================================================
    finalize  delta  FlashInfer returns
    ========  =====  =================================================================================
    True      None   ``output`` (a bare tensor up to 0.7.x; ``[output]`` from 0.8.0: both accepted)
    True      given  ``[output, expanded_idx_to_permuted_idx, gemm1_activation_output]``
    False     None   ``[gemm2_output, expert_weights, expanded_idx_to_permuted_idx]``
    False     given  ``[gemm2_output, expert_weights, expanded_idx_to_permuted_idx, gemm1_activation_output]``
    ========  =====  =================================================================================

    ``expert_weights`` is dropped: :func:`moelab.routed_moe` returns its own (the same values, or for tuple
    input the caller's very tensor). ``output``, when the caller passed one, is the object returned (FlashInfer
    writes it in place; were a version to hand back another tensor, its values are copied in).
    """
    if isinstance(returned, torch.Tensor):
        returned = [returned]
    want = {(True, False): 1, (True, True): 3, (False, False): 3, (False, True): 4}[(do_finalize, has_delta)]
    if not isinstance(returned, (list, tuple)) or len(returned) != want:
        got = type(returned).__name__ + (f" of {len(returned)}" if isinstance(returned, (list, tuple)) else "")
        raise RuntimeError(f"flashinfer returned {got}, expected {want} tensor(s) for do_finalize={do_finalize}, "
                           f"gemm1_lora_delta {'given' if has_delta else 'None'}: an unsupported flashinfer version?")
    if do_finalize:
        out = returned[0]
        if output is not None and out is not output:
            out = output.copy_(out)
        e2p, act = (returned[1], returned[2]) if has_delta else (None, None)
        return RoutedMoEResult(output=out, gemm2_output=None, expanded_idx_to_permuted_idx=e2p,
                               gemm1_activation_output=act)
    act = returned[3] if has_delta else None
    return RoutedMoEResult(output=None, gemm2_output=returned[0], expanded_idx_to_permuted_idx=returned[2],
                           gemm1_activation_output=act)


def _empty_result(call: RoutedMoECall) -> RoutedMoEResult:
    """T = 0 without the kernel: what it would return, sized by its formulas (docs/contract.md §3)."""
    x, W = call.hidden_states, call.weights
    K, H, I = call.top_k, W.hidden_size, W.intermediate_size
    tile = default_tile(0, K, W.num_local_experts)
    fill = _runtime.dead_row_fill()

    def dead_rows(width: int) -> torch.Tensor:
        return torch.full((permuted_rows(0, K, call.num_experts, tile, width), width), fill, dtype=x.dtype,
                          device=x.device)

    has_delta = call.gemm1_lora_delta is not None
    e2p = torch.empty(0, dtype=torch.int32, device=x.device)
    output = None
    if call.do_finalize:
        output = call.output if call.output is not None else torch.empty(0, H, dtype=x.dtype, device=x.device)
    return RoutedMoEResult(
        output=output,
        gemm2_output=None if call.do_finalize else dead_rows(H),
        expanded_idx_to_permuted_idx=e2p if has_delta or not call.do_finalize else None,
        gemm1_activation_output=dead_rows(I) if has_delta else None,
    )


def routed_moe(call: RoutedMoECall) -> RoutedMoEResult:
    if call.hidden_states.shape[0] == 0:
        return _empty_result(call)
    returned = _kernel()(**build_call_kwargs(call))
    return normalize_result(returned, do_finalize=call.do_finalize, has_delta=call.gemm1_lora_delta is not None,
                            output=call.output)


def lora_experts(call: LoRAExpertsCall) -> torch.Tensor:
    """vLLM's unfused flow around the closed kernel, moelab's Triton ops for the deltas, unpermute and finalize."""
    return lora_flow.lora_experts(call, routed_moe)


fused_lora_reason = lora_flow.no_fused_lora
