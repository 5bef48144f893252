"""moelab as a transformers experts implementation: one HF experts module -> one moelab routed-MoE call.

    ExpertsSpec            what an HF experts module computes (sizes, activation, biases, weight layout)
    experts_spec(module)   read it off a module decorated with ``@use_experts_implementation`` (cached on it)
    hf_expert_weights      the module's weights in moelab's order: w13 [E, 2I, H] rows [gate; up] (not gated:
                           [E, I, H]), w2 [E, H, I], biases [E, 2I] / [E, H] (views where the layout allows)
    experts_forward        ``fn(module, hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K] or [T, E])``,
                           the function registered as ``"moelab"`` in transformers' ``ExpertsInterface``

The activation is *probed*, not guessed from names: the module's own ``_apply_gate`` (or ``act_fn`` when not gated)
is run on a grid of values from -12 to 12 and compared with each activation moelab has, with the module's own
``alpha``/``limit`` attributes; none matching means :class:`UnsupportedExperts`, never a silent wrong result.

Under ``torch.compile`` the whole experts computation is one custom op, ``moelab::hf_experts`` (one opaque node, no
graph break inside); eager calls skip the dispatcher's round trip through Python and run the same function
directly. Either way the converted weights come from a cache checked against the parameters' identity, storage
and version counters, so the conversion runs once per module and again after the parameters change (training
steps, ``load_state_dict``), with no copy per call and no host sync of its own.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from moelab.backends.torch_backend import activate
from moelab.lora import LoRABank, w2_lora_delta, w13_lora_delta
from moelab.moe import MoEWeights, prepare_weights, routed_moe
from moelab.ops import finalize_with_w2_lora, unpermute_activation

__all__ = ["ExpertsSpec", "UnsupportedExperts", "base_experts", "experts_spec", "hf_expert_weights", "experts_forward",
           "moelab_weights", "module_weights", "resolve_hf_backend", "run_experts"]


class UnsupportedExperts(ValueError):
    """An HF experts module computes something moelab's contract cannot express (the message says what)."""


@dataclass(frozen=True)
class ExpertsSpec:
    """What an HF experts module computes, in moelab's terms (see :func:`moelab.prepare_weights`)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    gated: bool = True
    activation: str = "silu"
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    has_bias: bool = False
    transposed: bool = False  # HF stores [E, in, out] (GPT-OSS, Aria) instead of nn.Linear's [E, out, in]
    interleaved: bool = False  # GPT-OSS: gate/up columns alternate instead of [gate; up]

    @property
    def is_default(self) -> bool:
        """SwiGLU without bias or clamp: what every backend's kernels run."""
        return self.gated and self.activation == "silu" and self.swiglu_limit is None and not self.has_bias

    def activation_options(self) -> dict:
        """The activation keywords of :func:`moelab.prepare_weights` (empty for plain SwiGLU)."""
        if self.gated and self.activation == "silu" and self.swiglu_limit is None:
            return {}
        options = dict(activation=self.activation, gated=self.gated)
        if self.swiglu_alpha is not None:
            options["swiglu_alpha"] = self.swiglu_alpha
        if self.swiglu_limit is not None:
            options["swiglu_limit"] = self.swiglu_limit
        return options

    def describe(self) -> str:
        act = f"{self.activation}{'-gated' if self.gated else ''}"
        if self.swiglu_limit is not None:
            act += f" (limit {self.swiglu_limit:g}" + (f", alpha {self.swiglu_alpha:g})" if self.swiglu_alpha
                                                        is not None else ")")
        extras = [w for w, on in (("bias", self.has_bias), ("transposed", self.transposed),
                                  ("interleaved", self.interleaved)) if on]
        return f"E={self.num_experts} H={self.hidden_size} I={self.intermediate_size} {act}" + \
            (f" [{', '.join(extras)}]" if extras else "")


# ---------------------------------------------------------------------------------------------- activation probe

def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a - b).abs() <= 1e-4 * (1 + b.abs())).all())


def _module_numbers(module: nn.Module, names: tuple[str, ...]) -> list[float]:
    found = []
    for name in names:
        value = getattr(module, name, None)
        if value is None:
            value = getattr(getattr(module, "config", None), name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            found.append(float(value))
    return list(dict.fromkeys(found))


def _probe_activation(module: nn.Module, gated: bool, interleaved: bool) -> tuple[str, float | None, float | None]:
    """(activation, swiglu_alpha, swiglu_limit) matching the module's own math on a grid of inputs."""
    grid = torch.linspace(-12.0, 12.0, 97)
    if not gated:
        act_fn = getattr(module, "act_fn", None)
        if act_fn is None:
            raise UnsupportedExperts(f"{type(module).__name__}: not gated and no act_fn to probe")
        with torch.no_grad():
            got = act_fn(grid.clone())
        for name in ("silu", "gelu", "gelu_tanh", "relu2"):
            if _close(got, activate(None, grid, activation=name, gated=False)):
                return name, None, None
        raise UnsupportedExperts(f"{type(module).__name__}: its activation {type(act_fn).__name__} is none of "
                                 f"moelab's non-gated activations (silu, gelu, gelu_tanh, relu2)")
    gate, up = torch.meshgrid(grid, grid, indexing="ij")
    gate, up = gate.reshape(-1, 1).repeat(1, 2), up.reshape(-1, 1).repeat(1, 2)  # I = 2 columns
    if interleaved:
        probe = torch.stack([gate, up], dim=-1).reshape(gate.shape[0], 4)
    else:
        probe = torch.cat([gate, up], dim=-1)
    with torch.no_grad():
        got = module._apply_gate(probe.clone())
    limits = [None] + _module_numbers(module, ("limit", "swiglu_limit", "clamp_limit"))
    alphas = _module_numbers(module, ("alpha", "swiglu_alpha")) or [1.702]
    candidates = [(name, None, limit) for name in ("silu", "gelu", "gelu_tanh") for limit in limits]
    candidates += [("swigluoai", alpha, limit) for alpha in alphas for limit in limits[1:] or [7.0]]
    for name, alpha, limit in candidates:
        if _close(got, activate(gate, up, activation=name, swiglu_alpha=alpha, swiglu_limit=limit)):
            return name, alpha, limit
    for name in ("silu", "gelu", "gelu_tanh"):
        for limit in limits[1:]:
            after = activate(None, gate, activation=name, gated=False).clamp(max=limit) * up.clamp(-limit, limit)
            if _close(got, after):
                raise UnsupportedExperts(
                    f"{type(module).__name__}: its gate clamps after the activation, min({name}(gate), {limit:g}) * "
                    f"clamp(up, -{limit:g}, {limit:g}) (Step-3.7's and Bailing-hybrid's order); moelab's swiglu_limit "
                    f"clamps the gate before it (GPT-OSS's order), which differs wherever gate > {limit:g}")
    raise UnsupportedExperts(
        f"{type(module).__name__}: its gate ({'_apply_gate' if '_apply_gate' in type(module).__dict__ else 'act_fn'}"
        f") matches none of moelab's gated activations (silu, gelu, gelu_tanh with an optional clamp of gate <= L "
        f"and |up| <= L, or GPT-OSS's swigluoai) on inputs in [-12, 12]")


def experts_spec(module: nn.Module) -> ExpertsSpec:
    """Read (once, then cached on the module) what a ``@use_experts_implementation`` experts module computes.

    Raises :class:`UnsupportedExperts` for what moelab's contract cannot express: a post-expert norm, an activation
    none of moelab's matches, weights of unexpected shapes.
    """
    spec = module.__dict__.get("_moelab_spec")
    if spec is not None:
        return spec
    name = type(module).__name__
    if getattr(module, "has_post_expert_norm", False):
        raise UnsupportedExperts(f"{name}: has_post_expert_norm (a norm of each expert's output before the routing "
                                 f"weight) is not part of moelab's routed-MoE contract")
    gated = getattr(module, "has_gate", True)
    transposed = getattr(module, "is_transposed", False)
    interleaved = not getattr(module, "is_concatenated", True)
    has_bias = getattr(module, "has_bias", False)
    first = getattr(module, "gate_up_proj" if gated else "up_proj", None)
    down = getattr(module, "down_proj", None)
    if not isinstance(first, torch.Tensor) or not isinstance(down, torch.Tensor) or first.dim() != 3 \
            or down.dim() != 3:
        raise UnsupportedExperts(f"{name}: expected 3-D {'gate_up_proj' if gated else 'up_proj'} and down_proj "
                                 f"parameters")
    E = first.shape[0]
    width, H = (first.shape[2], first.shape[1]) if transposed else (first.shape[1], first.shape[2])
    I = width // 2 if gated else width
    want_down = (E, I, H) if transposed else (E, H, I)
    if tuple(down.shape) != want_down or (gated and width % 2):
        raise UnsupportedExperts(f"{name}: down_proj of shape {list(down.shape)} does not match "
                                 f"{'gate_up_proj' if gated else 'up_proj'} {list(first.shape)}")
    activation, alpha, limit = _probe_activation(module, gated, interleaved)
    spec = ExpertsSpec(E, H, I, gated, activation, alpha, limit, has_bias, transposed, interleaved)
    module.__dict__["_moelab_spec"] = spec
    return spec


def base_experts(module: nn.Module) -> nn.Module:
    """The HF experts module under PEFT's ParamWrapper nesting (``get_base_layer`` until it stops)."""
    while hasattr(module, "base_layer") and not isinstance(module, nn.ModuleList):
        module = module.base_layer
    return module


# ---------------------------------------------------------------------------------------------- weights

def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate/up alternating -> [..., 2I] as [gate; up]."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def hf_expert_weights(module: nn.Module, spec: ExpertsSpec | None = None):
    """(w13, w2, w13_bias, w2_bias) in moelab's order, from the module's parameters (views where possible).

    w13 [E, 2I, H] rows [gate; up] ([E, I, H] not gated), w2 [E, H, I]; biases [E, 2I] / [E, H] or None.
    """
    spec = spec or experts_spec(module)
    first = module.gate_up_proj if spec.gated else module.up_proj
    first_bias = getattr(module, "gate_up_proj_bias" if spec.gated else "up_proj_bias", None) if spec.has_bias \
        else None
    down, down_bias = module.down_proj, getattr(module, "down_proj_bias", None) if spec.has_bias else None
    return _to_moelab_order(first, down, first_bias, down_bias, spec)


def _to_moelab_order(first, down, first_bias, down_bias, spec: ExpertsSpec):
    if spec.transposed:
        first, down = first.transpose(1, 2), down.transpose(1, 2)
    if spec.interleaved:
        first = _deinterleave(first.transpose(1, 2)).transpose(1, 2)
        if first_bias is not None:
            first_bias = _deinterleave(first_bias)
    return first, down, first_bias, down_bias


def resolve_hf_backend(backend: str, spec: ExpertsSpec, device: torch.device) -> str:
    """"auto": triton on a CUDA GPU when its kernels run this spec, else torch (the CPU's fast path: Triton's
    interpreter is for tests). An explicit name is checked by :func:`moelab.prepare_weights`."""
    if backend != "auto":
        return backend
    if device.type == "cuda":
        from moelab.backends import available_backends

        if "triton" in available_backends(device) and _triton_runs(spec):
            return "triton"
    return "torch"


def _triton_runs(spec: ExpertsSpec) -> bool:
    try:
        from moelab.backends import triton_backend
    except ImportError:
        return False
    options = dict(activation=spec.activation, gated=spec.gated, swiglu_alpha=spec.swiglu_alpha,
                   swiglu_limit=spec.swiglu_limit, has_bias=spec.has_bias)
    return triton_backend.expert_options_reason(**options) is None


_WEIGHTS_CACHE: dict[tuple, tuple] = {}


def _key(tensors) -> tuple:
    return tuple((t.data_ptr(), t.dtype, t.device, tuple(t.shape), t.stride()) if t is not None else None
                 for t in tensors)


def moelab_weights(params: tuple, spec: ExpertsSpec, backend: str) -> MoEWeights:
    """:func:`moelab.prepare_weights` of HF parameters ``(first, down, first_bias, down_bias)``, cached: the
    conversion runs again only when a parameter's storage or version counter (an in-place update) changed."""
    key = (_key(params), spec, backend)
    versions = tuple(t._version if t is not None else None for t in params)
    hit = _WEIGHTS_CACHE.get(key)
    if hit is not None:
        refs, cached_versions, weights = hit
        if cached_versions == versions and all(r() is t for r, t in zip(refs, params) if t is not None):
            return weights
    w13, w2, b13, b2 = _to_moelab_order(*(t.detach() if t is not None else None for t in params), spec)
    options = spec.activation_options()
    if b13 is not None:
        options.update(w13_bias=b13, w2_bias=b2)
    weights = prepare_weights(w13, w2, backend=resolve_hf_backend(backend, spec, w13.device), **options)
    for dead in [k for k, (refs, _, _) in _WEIGHTS_CACHE.items() if any(r() is None for r in refs)]:
        del _WEIGHTS_CACHE[dead]
    _WEIGHTS_CACHE[key] = (tuple(weakref.ref(t) for t in params if t is not None), versions, weights)
    return weights


# ---------------------------------------------------------------------------------------------- compute

def run_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                weights: MoEWeights, num_experts: int, *, bank: LoRABank | None = None,
                lora_ids: torch.Tensor | None = None, apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """[T, H]: the routed experts with the caller's exact routing weights, plus a LoRA bank's terms when given.

    ``lora_ids`` int [T] (-1: none). With a bank this is vLLM's unfused flow (W13 delta before the activation,
    W2 delta weighted in the finalize), built from moelab's public ops, so it runs every activation and bias the
    backend runs.
    """
    T, K = top_k_index.shape
    ids = top_k_index
    moe_args = dict(num_experts=num_experts, top_k=K, validate=False,
                    apply_router_weight_on_input=apply_router_weight_on_input)
    if bank is None or lora_ids is None:  # the base MoE: the tuple takes routed_moe's fast path (no per-check cost)
        return routed_moe((ids, top_k_weights), hidden_states, weights, **moe_args)[0]
    use_triton = weights.backend != "torch"
    delta = w13_lora_delta(hidden_states, ids, lora_ids, bank, validate=False, use_triton=use_triton)
    if apply_router_weight_on_input:  # the expert sees w * x; its LoRA delta is linear in x
        delta = (delta.float() * top_k_weights.float()[..., None]).to(delta.dtype)
    I = weights.intermediate_size
    if not weights.gated:
        delta = delta[..., :I].contiguous()  # not gated: the up half only
    gemm2, expert_weights, e2p, act = routed_moe((ids, top_k_weights), hidden_states, weights,
                                                 gemm1_lora_delta=delta, do_finalize=False, **moe_args)
    act = unpermute_activation(act, e2p, T, K, validate=False, use_triton=use_triton)
    w2_weights = torch.ones_like(top_k_weights) if apply_router_weight_on_input else top_k_weights
    w2_delta = w2_lora_delta(act, ids, w2_weights, lora_ids, bank, validate=False, use_triton=use_triton)
    out = torch.empty_like(hidden_states)
    return finalize_with_w2_lora(out, gemm2, w2_weights, e2p, w2_delta, validate=False, use_triton=use_triton)


_BANKS: dict[int, weakref.ref] = {}  # gate_a.data_ptr() -> the LoRABank (the op receives its tensors)


def register_bank(bank: LoRABank) -> None:
    _BANKS[bank.gate_a.data_ptr()] = weakref.ref(bank)


def _bank_of(gate_a: torch.Tensor) -> LoRABank:
    ref = _BANKS.get(gate_a.data_ptr())
    bank = ref() if ref is not None else None
    if bank is None or bank.gate_a is not gate_a and bank.gate_a.data_ptr() != gate_a.data_ptr():
        raise RuntimeError("moelab.hf: the LoRA bank of this layer is gone; call moelab.patch_model again")
    return bank


@torch.library.custom_op("moelab::hf_experts", mutates_args=())
def _hf_experts_op(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   first: torch.Tensor, down: torch.Tensor, first_bias: torch.Tensor | None,
                   down_bias: torch.Tensor | None, bank_gate_a: torch.Tensor | None, lora_ids: torch.Tensor | None,
                   num_experts: int, gated: bool, activation: str, swiglu_alpha: float, swiglu_limit: float,
                   transposed: bool, interleaved: bool, backend: str, apply_router_weight_on_input: bool
                   ) -> torch.Tensor:
    """One HF experts call as an opaque op: weights from the cache, then :func:`run_experts`."""
    spec = ExpertsSpec(num_experts, hidden_states.shape[1], down.shape[1] if transposed else down.shape[2], gated,
                       activation, None if math.isnan(swiglu_alpha) else swiglu_alpha,
                       None if math.isnan(swiglu_limit) else swiglu_limit, first_bias is not None, transposed,
                       interleaved)
    weights = moelab_weights((first, down, first_bias, down_bias), spec, backend)
    bank = _bank_of(bank_gate_a) if bank_gate_a is not None else None
    return run_experts(hidden_states.contiguous(), top_k_index, top_k_weights, weights, num_experts, bank=bank,
                       lora_ids=lora_ids, apply_router_weight_on_input=apply_router_weight_on_input)


@_hf_experts_op.register_fake
def _hf_experts_fake(hidden_states, *args):
    return torch.empty_like(hidden_states)


def _module_params(module: nn.Module, spec: ExpertsSpec) -> tuple:
    """(first, down, first_bias, down_bias): the HF parameters the op converts (ModuleList experts: their stack,
    already in moelab's order, from the function :mod:`moelab.hf.modulelist` leaves on the module)."""
    stack = module.__dict__.get("_moelab_stacker")
    if stack is not None:
        return stack(module)
    first = _param(module, "gate_up_proj" if spec.gated else "up_proj")
    if not spec.has_bias:
        return first, _param(module, "down_proj"), None, None
    return (first, _param(module, "down_proj"), _param(module, "gate_up_proj_bias" if spec.gated else "up_proj_bias"),
            _param(module, "down_proj_bias"))


def _param(module: nn.Module, name: str) -> torch.Tensor:
    """``getattr(module, name)``, read from ``module._parameters`` first (a dict lookup: this runs on every call;
    nn.Module's ``__getattr__`` costs 5x more)."""
    p = module._parameters.get(name)
    return p if p is not None else getattr(module, name)


def _stacked_spec(spec: ExpertsSpec) -> ExpertsSpec:
    """The spec of weights already stacked in moelab's order (ModuleList experts)."""
    return ExpertsSpec(spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.gated, spec.activation,
                       spec.swiglu_alpha, spec.swiglu_limit, spec.has_bias, False, False)


def module_weights(module: nn.Module, spec: ExpertsSpec, backend: str) -> MoEWeights:
    """The module's converted :class:`moelab.MoEWeights`, cached on the module itself (the eager path's lookup:
    identity, storage pointer and version counter of its few parameters, no key hashing)."""
    params = _module_params(module, spec)
    cached = module.__dict__.get("_moelab_weights")
    if cached is not None and cached[0] == backend:
        _, old, versions, ptrs, weights = cached
        for p, q, v, ptr in zip(params, old, versions, ptrs):
            if p is not q or (p is not None and (p._version != v or p.data_ptr() != ptr)):
                break
        else:
            return weights
    weights = moelab_weights(params, _stacked_spec(spec) if isinstance(module, nn.ModuleList) else spec, backend)
    module.__dict__["_moelab_weights"] = (backend, params, tuple(p._version if p is not None else None for p in params),
                                          tuple(p.data_ptr() if p is not None else None for p in params), weights)
    return weights


def call_experts_op(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, *, backend: str = "auto", bank: LoRABank | None = None,
                    lora_ids: torch.Tensor | None = None, apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """Run ``module``'s experts (routing weights [T, K], or [T, E] gathered).

    Eager: straight to :func:`run_experts` with the weights cached on the module (no dispatcher round trip, no
    per-call key building). Under ``torch.compile``: one ``moelab::hf_experts`` op, opaque to the compiler.
    """
    spec = module.__dict__.get("_moelab_spec") or experts_spec(module)
    if top_k_weights.shape[-1] != top_k_index.shape[-1]:  # dense [T, E] router scores
        top_k_weights = top_k_weights.gather(1, top_k_index.long())
    if not torch.compiler.is_compiling():
        weights = module_weights(module, spec, backend)
        if not hidden_states.is_contiguous():
            hidden_states = hidden_states.contiguous()
        return run_experts(hidden_states, top_k_index, top_k_weights, weights, spec.num_experts, bank=bank,
                           lora_ids=lora_ids, apply_router_weight_on_input=apply_router_weight_on_input)
    first, down, first_bias, down_bias = _module_params(module, spec)
    transposed, interleaved = spec.transposed, spec.interleaved
    if isinstance(module, nn.ModuleList):
        transposed = interleaved = False
    nan = float("nan")
    return torch.ops.moelab.hf_experts(
        hidden_states, top_k_index, top_k_weights, first, down, first_bias, down_bias,
        bank.gate_a if bank is not None else None, lora_ids, spec.num_experts, spec.gated, spec.activation,
        nan if spec.swiglu_alpha is None else spec.swiglu_alpha, nan if spec.swiglu_limit is None else
        spec.swiglu_limit, transposed, interleaved, backend, apply_router_weight_on_input)


def make_experts_forward(backend: str):
    """The function transformers' ``ExpertsInterface`` calls: ``fn(module, hidden_states, top_k_index,
    top_k_weights)``; a layer patched by :func:`moelab.patch_model` adds its LoRA bank and adapter ids."""

    def forward(self, hidden_states, top_k_index=None, top_k_weights=None, **kwargs):
        if top_k_index is None:
            top_k_index = kwargs.pop("router_indices")
        if top_k_weights is None:
            top_k_weights = kwargs.pop("routing_weights")
        state = self.__dict__.get("_moelab_layer")
        if state is not None:
            return state.forward(self, hidden_states, top_k_index, top_k_weights)
        return call_experts_op(self, hidden_states, top_k_index, top_k_weights, backend=backend)

    forward.__name__ = f"moelab_{backend}_experts_forward"
    return forward


experts_forward = make_experts_forward("auto")
