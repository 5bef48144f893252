"""The routed-MoE front end: ``prepare_weights`` and ``routed_moe``, dispatched to a backend.

This module validates a call, bundles it as a :class:`moelab.contract.RoutedMoECall` (the data every backend
receives; the index arrays are named there) and assembles FlashInfer's return table from the backend's
:class:`moelab.contract.RoutedMoEResult`; the arithmetic lives in ``moelab/backends/<name>_backend.py``.
"""

from __future__ import annotations

import math

import torch

from moelab import _checks
from moelab._checks import FLOAT_DTYPES, INT_DTYPES, check_int, check_tensor
from moelab.backends import available_backends, eager_graphs, get_backend, resolve_backend
from moelab.contract import ACTIVATIONS, SWIGLUOAI_ALPHA, MoEWeights, RoutedMoECall, RoutedMoEResult, permuted_rows

__all__ = ["MoEWeights", "RoutedMoECall", "RoutedMoEResult", "prepare_weights", "routed_moe",
           "permuted_rows", "available_backends"]


def prepare_weights(w13: torch.Tensor, w2: torch.Tensor, backend: str = "auto", *, activation: str = "silu",
                    gated: bool = True, w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                    swiglu_alpha: float | None = None, swiglu_limit: float | None = None) -> MoEWeights:
    """Convert HF-order expert weights (and the expert activation and biases) to ``backend``'s layout.

    Args:
        w13: [E_local, 2I, H], rows ``[gate; up]`` (Hugging Face / vLLM order); not ``gated``: [E_local, I, H] (up).
            bf16, fp16 or fp32.
        w2: [E_local, H, I], same dtype and device.
        backend: "auto", "torch", "triton" or "flashinfer" (see :func:`available_backends`); "auto" takes the
            fastest one here whose kernels run this activation and these biases.
        activation: gated: ``"silu"`` (SwiGLU), ``"gelu"``, ``"gelu_tanh"`` (``act(gate) * up``) or
            ``"swigluoai"`` (GPT-OSS: ``gate * sigmoid(alpha * gate) * (up + 1)``); not gated: ``"silu"``,
            ``"gelu"``, ``"gelu_tanh"``, ``"relu2"`` (``relu(up) ** 2``). vLLM's names.
        gated: GEMM1 computes gate and up (True) or up only (False, e.g. Nemotron-H's relu2 experts).
        w13_bias: [E_local, 2I] in w13's row order ([E_local, I] not gated), added to GEMM1's output.
        w2_bias: [E_local, H], added to GEMM2's output (before the routing weight, as HF's GPT-OSS does).
        swiglu_alpha: ``"swigluoai"``'s alpha (default 1.702).
        swiglu_limit: gated only: gate clamped to ``<= L`` and up to ``[-L, L]`` before the activation
            (``"swigluoai"`` default 7.0; DeepSeek-V4 clamps SwiGLU this way).

    The torch and triton backends run every activation and bias; the flashinfer kernels run plain SwiGLU (a
    ValueError names the backend to use).

    Example:
        >>> w13, w2 = torch.randn(4, 64, 32), torch.randn(4, 32, 32)
        >>> prepare_weights(w13, w2, backend="torch").intermediate_size
        32
        >>> prepare_weights(torch.randn(4, 32, 32), w2, backend="torch", activation="relu2", gated=False).gated
        False
    """
    if not isinstance(gated, bool):
        raise TypeError(f"gated: expected a bool, got {type(gated).__name__}")
    if (activation, gated) not in ACTIVATIONS:
        names = sorted(a for a, g in ACTIVATIONS if g == gated)
        raise ValueError(f"activation: expected one of {names} with gated={gated}, got {activation!r}")
    if gated:
        E_local, H, I = _checks.check_expert_weights(w13, w2)
    else:  # w13 is the up projection only: [E_local, I, H]
        check_tensor("w13", w13, dtypes=FLOAT_DTYPES, ndim=3)
        check_tensor("w2", w2, dtypes=FLOAT_DTYPES, ndim=3)
        E_local, I, H = w13.shape
        if min(E_local, H, I) == 0:
            raise ValueError(f"w13: expected non-zero E_local, I and H, got shape {list(w13.shape)}")
        check_tensor("w2", w2, shape=(E_local, H, I))
        _checks.check_dtype("w2", w2, w13.dtype, "w13")
    rows = w13.shape[1]
    for name, bias, shape in (("w13_bias", w13_bias, (E_local, rows)), ("w2_bias", w2_bias, (E_local, H))):
        if bias is not None:
            check_tensor(name, bias, dtypes=FLOAT_DTYPES, shape=shape)
            _checks.check_dtype(name, bias, w13.dtype, "w13")
    if swiglu_alpha is not None and activation != "swigluoai":
        raise ValueError(f"swiglu_alpha: only 'swigluoai' takes it, got {swiglu_alpha} with {activation!r}")
    if swiglu_limit is not None and (not gated or not isinstance(swiglu_limit, (int, float))
                                     or not math.isfinite(swiglu_limit) or swiglu_limit <= 0):
        raise ValueError(f"swiglu_limit: expected a positive finite float for a gated activation, got {swiglu_limit}")
    if activation == "swigluoai":
        swiglu_alpha = SWIGLUOAI_ALPHA if swiglu_alpha is None else float(swiglu_alpha)
        swiglu_limit = 7.0 if swiglu_limit is None else swiglu_limit
    _checks.check_same_device(w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias)
    options = dict(activation=activation, gated=gated, swiglu_alpha=swiglu_alpha,
                   swiglu_limit=None if swiglu_limit is None else float(swiglu_limit))
    has_bias = w13_bias is not None or w2_bias is not None
    name = _backend_for(backend, w13.device, has_bias=has_bias, **options)
    g1, g2 = get_backend(name).prepare(w13, w2)
    b1 = None if w13_bias is None else w13_bias.contiguous()
    b2 = None if w2_bias is None else w2_bias.contiguous()
    return MoEWeights(name, g1, g2, E_local, H, I, **options, gemm1_bias=b1, gemm2_bias=b2)


def _options_reason(name: str, **options) -> str | None:
    """Why backend ``name``'s kernels cannot run these expert options (None: they can)."""
    reason = getattr(get_backend(name), "expert_options_reason", None)
    return None if reason is None else reason(**options)


def _backend_for(backend: str, device, **options) -> str:
    """``backend`` ("auto": the fastest here that runs ``options``), or a ValueError naming one that does."""
    if backend == "auto":
        return next(n for n in available_backends(device) if _options_reason(n, **options) is None)
    name = resolve_backend(backend, device)
    reason = _options_reason(name, **options)
    if reason is not None:
        able = [n for n in available_backends(device) if _options_reason(n, **options) is None]
        raise ValueError(f"backend: {name!r} {reason}; use backend={able[0]!r} (or 'auto')")
    return name


def routed_moe(topk, hidden_states: torch.Tensor, weights: MoEWeights, *, num_experts: int, top_k: int,
               local_expert_offset: int = 0, gemm1_lora_delta: torch.Tensor | None = None,
               do_finalize: bool = True, output: torch.Tensor | None = None,
               validate: bool = True, apply_router_weight_on_input: bool = False) -> list[torch.Tensor]:
    """FlashInfer's ``trtllm_bf16_routed_moe`` contract on any backend (docs/contract.md §3).

    Args:
        topk: packed int32 [T, K] (see :func:`moelab.pack_topk_ids_weights`) or ``(ids int [T,K], weights [T,K])``.
        hidden_states: [T, H], the dtype of ``weights``.
        weights: from :func:`prepare_weights` (local experts only).
        num_experts: global E; ``top_k``: K.
        local_expert_offset: first global id of this rank's window ``[offset, offset + E_local)``.
        gemm1_lora_delta: [T, K, 2I] in **[up, gate]** order, the input dtype, added before the activation,
            unweighted; [T, K, I] (up only) for weights that are not gated.
        do_finalize: reduce over top-k into ``output`` (True) or return the permuted, unfinalized tensors.
        output: [T, H], written in place and returned when ``do_finalize``.
        validate: read ids on the device to reject out-of-range or duplicate ids (a host sync). Pass False
            under CUDA-graph capture and in benchmarks.
        apply_router_weight_on_input: multiply each slot's *input* by its routing weight and sum the expert
            outputs unweighted (Llama-4; vLLM's flag of the same name); the unfinalized ``expert_weights``
            returned are then ones. Torch and triton backends.

    Returns (always a list):
        finalize, no delta:  ``[output]``
        finalize, delta:     ``[output, expanded_idx_to_permuted_idx, gemm1_activation_output]``
        no finalize:         ``[gemm2_output, expert_weights, expanded_idx_to_permuted_idx]``,
                             plus ``gemm1_activation_output`` when a delta is given

    Example:
        >>> w = prepare_weights(torch.randn(4, 64, 32), torch.randn(4, 32, 32), backend="torch")
        >>> x = torch.randn(3, 32); ids = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32)
        >>> routed_moe((ids, torch.rand(3, 2)), x, w, num_experts=4, top_k=2)[0].shape
        torch.Size([3, 32])
    """
    if (validate is False and output is None and gemm1_lora_delta is None and do_finalize is True
            and apply_router_weight_on_input is False):
        # a decode step's call that replayed in place before replays again: its signature stands for the checks
        replayed = eager_graphs.replay_plain(topk, hidden_states, weights, num_experts, top_k, local_expert_offset)
        if replayed is not None:
            return [replayed]
    call = validate_call(topk, hidden_states, weights, num_experts, top_k, local_expert_offset, gemm1_lora_delta,
                         do_finalize, output, validate, apply_router_weight_on_input)
    result = get_backend(weights.backend).routed_moe(call)
    if do_finalize:
        if gemm1_lora_delta is None:
            return [result.output]
        return [result.output, result.expanded_idx_to_permuted_idx, result.gemm1_activation_output]
    expert_weights = call.expert_weights
    if apply_router_weight_on_input:  # the weights went into the input: the caller's finalize sums unweighted
        expert_weights = torch.ones_like(expert_weights)
    outs = [result.gemm2_output, expert_weights, result.expanded_idx_to_permuted_idx]
    if gemm1_lora_delta is not None:
        outs.append(result.gemm1_activation_output)
    return outs


def validate_call(topk, hidden_states, weights, num_experts, top_k, local_expert_offset, gemm1_lora_delta,
                  do_finalize, output, validate, apply_router_weight_on_input=False) -> RoutedMoECall:
    """Check :func:`routed_moe`'s arguments (docs/contract.md §7 errors) and bundle them; ``validate`` adds the id
    checks that read the device."""
    if not isinstance(weights, MoEWeights):
        raise TypeError(f"weights: expected MoEWeights from prepare_weights(), got {type(weights).__name__}")
    if (gemm1_lora_delta is None and output is None and apply_router_weight_on_input is False
            and _plain_call_ok(topk, hidden_states, weights, num_experts, top_k, local_expert_offset)):
        # Every check below would pass (decode calls are host-bound: the checks one by one cost more than the GPU work)
        packed = topk.contiguous() if type(topk) is torch.Tensor else None
        call = RoutedMoECall(topk, packed, hidden_states.contiguous(), weights, num_experts, top_k,
                             local_expert_offset, None, do_finalize, None)
        if validate:
            _checks.check_expert_ids("topk (expert ids)", call.topk_ids if packed is not None else topk[0], num_experts)
        return call
    E_local, H, I = weights.num_local_experts, weights.hidden_size, weights.intermediate_size
    check_int("num_experts", num_experts, low=1, high=_checks.MAX_EXPERTS)
    check_int("top_k", top_k, low=1, high=num_experts)
    if E_local > num_experts:
        raise ValueError(f"weights: expected at most num_experts={num_experts} local experts, got {E_local}")
    check_int("local_expert_offset", local_expert_offset, low=0, high=num_experts - E_local)
    check_tensor("hidden_states", hidden_states, dtypes=FLOAT_DTYPES, ndim=2)
    _checks.check_dtype("hidden_states", hidden_states, weights.dtype, "the weights")
    T = hidden_states.shape[0]
    check_tensor("hidden_states", hidden_states, shape=(None, H))
    if isinstance(topk, tuple):
        if len(topk) != 2:
            raise ValueError(f"topk: expected (ids, weights), got a tuple of {len(topk)}")
        ids, expert_weights = topk
        check_tensor("topk[0] (ids)", ids, dtypes=INT_DTYPES, shape=(T, top_k))
        check_tensor("topk[1] (weights)", expert_weights, dtypes=FLOAT_DTYPES, shape=(T, top_k))
        packed = None
        _checks.check_same_device(weights=weights.gemm1_weights, topk_ids=ids, expert_weights=expert_weights)
    else:
        check_tensor("topk", topk, dtypes=(torch.int32,), shape=(T, top_k))
        packed = topk.contiguous()
        _checks.check_same_device(weights=weights.gemm1_weights, topk=packed)
    if gemm1_lora_delta is not None:
        width = 2 * I if weights.gated else I
        check_tensor("gemm1_lora_delta", gemm1_lora_delta, dtypes=FLOAT_DTYPES, shape=(T, top_k, width))
        _checks.check_dtype("gemm1_lora_delta", gemm1_lora_delta, weights.dtype, "the weights")
        _checks.check_contiguous("gemm1_lora_delta", gemm1_lora_delta)
    if output is not None:
        if not do_finalize:
            raise ValueError("output: only written when do_finalize=True; pass output=None")
        check_tensor("output", output, dtypes=FLOAT_DTYPES, shape=(T, H))
        _checks.check_dtype("output", output, weights.dtype, "the weights")
        _checks.check_contiguous("output", output)
        # the finalize (or the token-major GEMM2) reads the routing while it writes the output; x may be the
        # output (every kernel that reads it has finished before the output is written)
        routing = {"topk": packed} if packed is not None else {"topk[0] (ids)": ids,
                                                               "topk[1] (weights)": expert_weights}
        _checks.check_no_overlap("output", output, **routing)
    _checks.check_same_device(weights=weights.gemm1_weights, hidden_states=hidden_states,
                              gemm1_lora_delta=gemm1_lora_delta, output=output)
    if not isinstance(apply_router_weight_on_input, bool):
        raise TypeError(f"apply_router_weight_on_input: expected a bool, got "
                        f"{type(apply_router_weight_on_input).__name__}")
    if apply_router_weight_on_input:
        reason = _options_reason(weights.backend, activation=weights.activation, gated=weights.gated,
                                 swiglu_alpha=weights.swiglu_alpha, swiglu_limit=weights.swiglu_limit,
                                 has_bias=weights.gemm1_bias is not None or weights.gemm2_bias is not None,
                                 apply_router_weight_on_input=True)
        if reason is not None:
            raise ValueError(f"apply_router_weight_on_input: backend {weights.backend!r} {reason}; prepare the "
                             f"weights with backend='torch'")
    call = RoutedMoECall(topk, packed, hidden_states.contiguous(), weights, num_experts, top_k, local_expert_offset,
                         gemm1_lora_delta, do_finalize, output,
                         apply_router_weight_on_input=apply_router_weight_on_input)
    if validate:  # tuple ids are checked as given: an int64 id >= 2**31 must not wrap into range by the int32 cast
        _checks.check_expert_ids("topk (expert ids)", ids if packed is None else call.topk_ids, num_experts)
    return call


def _plain_call_ok(topk, hidden_states, weights: MoEWeights, num_experts, top_k, local_expert_offset) -> bool:
    """True when a call with packed routing or an ``(ids, weights)`` tuple, no delta and no ``output`` passes every
    check of :func:`validate_call` (False says nothing: the checks one by one then name what is wrong)."""
    if not (type(hidden_states) is torch.Tensor and type(num_experts) is int and type(top_k) is int
            and type(local_expert_offset) is int):
        return False
    E_local = weights.num_local_experts
    w = weights.gemm1_weights
    if not (E_local <= num_experts <= _checks.MAX_EXPERTS and 1 <= top_k <= num_experts
            and 0 <= local_expert_offset <= num_experts - E_local
            and hidden_states.dtype == w.dtype and hidden_states.dim() == 2
            and hidden_states.shape[1] == weights.hidden_size and hidden_states.device == w.device):
        return False
    shape = (hidden_states.shape[0], top_k)
    if type(topk) is tuple:  # (ids, weights): what a model's own router hands over (moelab.hf)
        if len(topk) != 2:
            return False
        ids, expert_weights = topk
        return (type(ids) is torch.Tensor and type(expert_weights) is torch.Tensor and ids.dtype in INT_DTYPES
                and expert_weights.dtype in FLOAT_DTYPES and ids.shape == shape and expert_weights.shape == shape
                and ids.device == w.device and expert_weights.device == w.device)
    return (type(topk) is torch.Tensor and topk.dtype == torch.int32 and topk.shape == shape
            and topk.device == w.device)
