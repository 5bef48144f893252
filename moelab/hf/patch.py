"""``moelab.patch_model``: run every MoE block of a Hugging Face model on moelab (vLLM's ``MoEMixin`` idea).

The walk finds each MoE block (the parent of an ``experts`` child holding 3-D expert parameters, or an
``nn.ModuleList`` of expert MLPs: see :mod:`moelab.hf.modulelist`), then for each:

    experts   the module's forward is replaced, on this instance only, by one ``moelab::hf_experts`` op with the
              layer's LoRA bank; the parameters stay where they are (``save_pretrained`` writes the original
              weights, ``state_dict`` is unchanged)
    routing   "fused": the block's forward becomes router logits -> :func:`moelab.route` -> experts (+ shared
              expert and its sigmoid gate), for a router moelab recognises; "external": the block's own forward
              runs and hands its ``(top_k_index, top_k_weights)`` to the experts; "auto": fused where recognised

A router is *recognised* by trying moelab's routing methods (with the config's top-k, ``n_group``/``topk_group``,
``routed_scaling_factor`` and the block's ``e_score_correction_bias``) and keeping the one whose whole-block output
matches the block's own on a probe batch; nothing matching means external routing (``routing="fused"``: an error).
Fail closed: a fused forward is only installed after it reproduced the original. The replaced forwards hold the
attribute paths of the experts, router, shared expert and correction bias, looked up on the block at each call, so a
``copy.deepcopy`` of a patched model (or a block whose submodules are swapped later) runs its own weights.

A ModuleList block's own forward loops over its experts, so it cannot hand moelab a top-k: it is fused where its
router is recognised, else routed by the block's own router *module* (a child returning the top-k ids and weights,
as transformers' TopKRouter modules do), else left alone with the reason in ``report.skipped``. Every expert MLP
is first checked against moelab on its stacked weights.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from moelab.hf.experts import (
    ExpertsSpec,
    UnsupportedExperts,
    _probe_activation,
    base_experts,
    call_experts_op,
    experts_spec,
    register_bank,
    resolve_hf_backend,
)
from moelab.hf.tiny import is_experts_class

__all__ = ["patch_model", "PatchReport", "LayerReport", "MoELayer", "unpatch_model"]

#: Config names, first hit wins (vLLM's lists, plus the v5 aliases).
TOP_K_NAMES = ("num_experts_per_tok", "top_k", "moe_k", "moe_topk", "moe_top_k")
SCALE_NAMES = ("routed_scaling_factor",)


def _config_value(configs, names, default=None):
    for config in configs:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, (list, tuple)) and value:
                value = value[0]
            if value is not None:
                return value
    return default


@dataclass
class LayerReport:
    """One replaced MoE block: where, what, how routed, and why anything was left to the model."""

    path: str
    block: str
    experts: str
    routing: str  # "fused (<method>)" or "external"
    backend: str
    note: str = ""
    metadata: object = field(default=None, repr=False)  # ExpertParallelMetadata of the layer

    @property
    def expert_map(self) -> torch.Tensor:
        return self.metadata.expert_map


class PatchReport(list):
    """What :func:`patch_model` did: one :class:`LayerReport` per replaced block (empty: nothing replaced).

    ``skipped``: (path, reason) of every experts module left as it was; ``adapters``: adapter name -> bank slot.
    Expert-parallel metadata under vLLM's names: ``num_logical_experts``, ``num_physical_experts``,
    ``num_local_physical_experts``, ``num_redundant_experts`` (of the first MoE layer; every layer's own in
    ``report[i].metadata``, its placement in ``report[i].expert_map``) and
    :meth:`update_physical_experts_metadata`.
    """

    def __init__(self):
        super().__init__()
        self.skipped: list[tuple[str, str]] = []
        self.adapters: dict[str, int] = {}

    def _first(self):
        if not self:
            raise ValueError("report: no MoE layer was replaced, so there is no expert metadata")
        return self[0].metadata

    num_logical_experts = property(lambda self: self._first().num_logical_experts)
    num_physical_experts = property(lambda self: self._first().num_physical_experts)
    num_local_physical_experts = property(lambda self: self._first().num_local_physical_experts)
    num_redundant_experts = property(lambda self: self._first().num_redundant_experts)
    num_moe_layers = property(lambda self: len(self))

    def update_physical_experts_metadata(self, num_physical_experts: int, num_local_physical_experts: int,
                                         expert_maps=None) -> None:
        """vLLM's hook: a new physical layout for every MoE layer (``expert_maps``: one int [P] per layer, or None)."""
        if expert_maps is not None and len(expert_maps) != len(self):
            raise ValueError(f"expert_maps: expected one map per MoE layer ({len(self)}), got {len(expert_maps)}")
        for i, layer in enumerate(self):
            layer.metadata.update_physical_experts_metadata(
                num_physical_experts, num_local_physical_experts, None if expert_maps is None else expert_maps[i])

    def __str__(self) -> str:
        lines = [f"{len(self)} MoE layer(s) on moelab" + (f", adapters {self.adapters}" if self.adapters else "")]
        for r in self:
            lines.append(f"  {r.path}: {r.block} [{r.experts}] routing={r.routing} backend={r.backend}"
                         + (f" ({r.note})" if r.note else ""))
        for path, reason in self.skipped:
            lines.append(f"  left alone {path}: {reason}")
        return "\n".join(lines)

    def rows(self) -> list[dict]:
        """One dict per layer (for a table)."""
        return [dict(path=r.path, block=r.block, experts=r.experts, routing=r.routing, backend=r.backend,
                     note=r.note) for r in self] + [dict(path=p, block="", experts="", routing="left alone",
                                                         backend="", note=why) for p, why in self.skipped]


class AdapterSelection:
    """The adapter every token of a model's next forward uses (shared by the model's MoE layers).

    ``ids``: int [B] or [B, S] set by :func:`moelab.hf.adapter_ids`, on the model's device. Without it, a model
    patched from a ``PeftModel`` follows PEFT: its active adapter (``set_adapter``) serves every token, none inside
    ``with peft_model.disable_adapter():``.
    """

    def __init__(self):
        self.ids: torch.Tensor | None = None
        self.adapters: dict[str, int] = {}  # name -> slot
        self.peft_layer = None  # one of PEFT's (bypassed) expert wrappers: it holds PEFT's active/disabled state

    @property
    def default_slot(self) -> int:
        layer = self.peft_layer
        if layer is None or layer.disable_adapters:
            return -1
        active = layer.active_adapters
        return self.adapters.get(active[0] if active else None, -1)

    def token_ids(self, num_tokens: int, device: torch.device) -> torch.Tensor | None:
        """int [T] adapter slot of each flattened token, or None when no token has one."""
        if self.ids is None:
            slot = self.default_slot
            if slot < 0:
                return None
            return torch.full((num_tokens,), slot, dtype=torch.int32, device=device)
        ids = self.ids
        if ids.dim() == 2:
            if ids.numel() != num_tokens:
                raise ValueError(f"adapter_ids: per-token ids of shape {list(ids.shape)} do not match this forward's "
                                 f"{num_tokens} tokens; use per-sequence ids [B] for generate()")
            return ids.reshape(-1)
        if num_tokens % ids.shape[0]:
            raise ValueError(f"adapter_ids: {ids.shape[0]} per-sequence ids do not divide this forward's "
                             f"{num_tokens} tokens")
        return ids.repeat_interleave(num_tokens // ids.shape[0])


class MoELayer:
    """moelab's state for one HF experts module: backend, LoRA bank, adapter selection, EP metadata."""

    def __init__(self, spec: ExpertsSpec, backend: str, selection: AdapterSelection, metadata,
                 apply_router_weight_on_input: bool = False):
        self.spec, self.backend, self.selection, self.metadata = spec, backend, selection, metadata
        self.bank = None
        self.apply_router_weight_on_input = apply_router_weight_on_input

    def __setstate__(self, state):
        """A copy (``copy.deepcopy`` of the model, pickle) registers its own LoRA bank, which the compiled path's
        ``moelab::hf_experts`` op finds by its ``gate_a``."""
        self.__dict__.update(state)
        if self.bank is not None:
            register_bank(self.bank)

    def forward(self, experts: nn.Module, hidden_states, top_k_index, top_k_weights, **kwargs):
        if top_k_index is None:
            top_k_index = kwargs.pop("router_indices")
        if top_k_weights is None:
            top_k_weights = kwargs.pop("routing_weights")
        lora_ids = None
        if self.bank is not None:
            lora_ids = self.selection.token_ids(hidden_states.shape[0], hidden_states.device)
        return call_experts_op(experts, hidden_states, top_k_index, top_k_weights, backend=self.backend,
                               bank=self.bank if lora_ids is not None else None, lora_ids=lora_ids,
                               apply_router_weight_on_input=self.apply_router_weight_on_input)


def _experts_forward(self, hidden_states, top_k_index=None, top_k_weights=None, **kwargs):
    return self._moelab_layer.forward(self, hidden_states, top_k_index, top_k_weights, **kwargs)


# ---------------------------------------------------------------------------------------------- finding blocks

def _is_3d_experts(module: nn.Module) -> bool:
    params = [p for _, p in module.named_parameters(recurse=False)]
    return bool(params) and any(p.dim() == 3 for p in params) and all(p.dim() in (2, 3) for p in params) and \
        hasattr(module, "down_proj")


def find_moe_blocks(model: nn.Module):
    """[(path of the block, block, experts child name, HF experts module)] in model order."""
    found = []
    for path, block in model.named_modules():
        experts = getattr(block, "_modules", {}).get("experts")
        if experts is None:
            continue
        inner = base_experts(experts)
        if is_experts_class(type(inner)) or _is_3d_experts(inner) or isinstance(inner, nn.ModuleList):
            found.append((path, block, "experts", inner))
    return found


def _spec_of(experts: nn.Module, hidden_size: int | None) -> ExpertsSpec:
    """:func:`experts_spec` for decorated classes; undecorated 3-D experts (Llama-4) read from their shapes."""
    if is_experts_class(type(experts)):
        return experts_spec(experts)
    decorated = next((c for c in type(experts).__mro__[1:] if is_experts_class(c)), None)
    if decorated is not None:  # Ergo: per-route RMSNorms around its projections' decorated forward
        raise UnsupportedExperts(
            f"{type(experts).__name__}: its own forward wraps the decorated {decorated.__name__}.forward in more "
            f"math (a norm of each route's output before the routing weight, not part of moelab's routed-MoE "
            f"contract); model.set_experts_implementation('moelab') runs that inner {decorated.__name__} on moelab")
    if isinstance(experts, nn.ModuleList):
        from moelab.hf.modulelist import modulelist_spec

        return modulelist_spec(experts)
    first, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if first is None or down is None or first.dim() != 3 or down.dim() != 3:
        raise UnsupportedExperts(f"{type(experts).__name__}: expected gate_up_proj and down_proj 3-D parameters")
    E = first.shape[0]
    if hidden_size is None:
        raise UnsupportedExperts(f"{type(experts).__name__}: undecorated experts and no hidden_size in the config")
    if down.shape[1] != down.shape[2]:  # down_proj [E, H, I] (nn.Linear order) or [E, I, H] (transposed)
        transposed = down.shape[2] == hidden_size
    else:  # H == I: gate_up [E, 2I, H] or [E, H, 2I] tells
        transposed = first.shape[1] == hidden_size
    H = first.shape[1] if transposed else first.shape[2]
    I = (first.shape[2] if transposed else first.shape[1]) // 2
    if not hasattr(experts, "_apply_gate"):  # the probe runs act_fn(gate) * up
        experts._apply_gate = types.MethodType(lambda self, gu: self.act_fn(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1],
                                               experts)
    try:
        activation, alpha, limit = _probe_activation(experts, True, False)
    finally:
        experts.__dict__.pop("_apply_gate", None)
    spec = ExpertsSpec(E, H, I, True, activation, alpha, limit, False, transposed, False)
    experts.__dict__["_moelab_spec"] = spec  # what experts_spec() returns for it from now on
    return spec


# ---------------------------------------------------------------------------------------------- fused routing

def _router_of(block: nn.Module, num_experts: int, hidden_size: int):
    """(name, module with ``weight`` [E, H] and optional ``bias`` [E]) of the block's router, or (None, None)."""
    for name, child in block.named_children():
        if name == "experts" or "shared" in name:
            continue
        for sub_name, sub in [("", child)] + list(child.named_children()):
            w = getattr(sub, "weight", None)
            if isinstance(w, torch.Tensor) and tuple(w.shape) == (num_experts, hidden_size):
                return f"{name}.{sub_name}".rstrip("."), sub
    return None, None


def _correction_bias(block: nn.Module, num_experts: int):
    """(attribute path from the block, tensor) of the block's routing correction bias, or (None, None)."""
    for path, module in block.named_modules():
        for name in ("e_score_correction_bias", "expert_bias"):
            b = getattr(module, name, None)
            if isinstance(b, torch.Tensor) and b.numel() == num_experts:
                return f"{path}.{name}".lstrip("."), b
    return None, None


def _path_in(block: nn.Module, module: nn.Module | None) -> tuple[str, ...] | None:
    """The attribute names leading from ``block`` to its submodule ``module`` (None for None)."""
    if module is None:
        return None
    for path, sub in block.named_modules():
        if sub is module:
            return tuple(path.split(".")) if path else ()
    raise ValueError(f"{type(module).__name__} is not a submodule of {type(block).__name__}")


def _lookup(block: nn.Module, names: tuple[str, ...]):
    """``block.<names[0]>.<names[1]>...`` at call time: the patched forward holds names, never modules or tensors,
    so a ``copy.deepcopy`` of the model (or a submodule swapped in later) runs its own weights."""
    for name in names:
        block = getattr(block, name)
    return block


def _shared_parts(block: nn.Module):
    """(shared expert module or None, its sigmoid gate Linear(H, 1) or None, names of other extra children)."""
    shared, gate, others = None, None, []
    for name, child in block.named_children():
        if name == "experts":
            continue
        if "shared" in name and isinstance(child, nn.Linear) and child.out_features == 1:
            gate = child
        elif "shared" in name and shared is None:
            shared = child
    return shared, gate, others


def _candidates(configs, num_experts: int, top_k: int, bias):
    scale = float(_config_value(configs, SCALE_NAMES, 1.0) or 1.0)
    n_group = _config_value(configs, ("n_group", "num_expert_group"))
    topk_group = _config_value(configs, ("topk_group",))
    scales = [1.0] if scale == 1.0 else [scale, 1.0]
    out = []
    for s in scales:
        out += [("renormalize", dict(routed_scaling_factor=s)), ("softmax", dict(routed_scaling_factor=s))]
        ds = dict(routed_scaling_factor=s, correction_bias=bias)
        if n_group and num_experts % int(n_group) == 0:
            out.append(("deepseek_v3", dict(ds, n_group=int(n_group), topk_group=int(topk_group or n_group))))
        out.append(("deepseek_v3", ds))
        if bias is None:
            out.append(("sigmoid", dict(routed_scaling_factor=s)))
    return out


def _make_block_forward(layer: MoELayer, experts: nn.Module, routing_fn, shared, shared_gate, returns_logits: bool,
                        flat_output: bool = False, block: nn.Module | None = None):
    """The block's new forward: ``routing_fn(block, x [T, H]) -> (weights [T, K], ids [T, K], logits [T, E])``,
    then the experts on moelab (+ the shared expert and its sigmoid gate). ``experts``, ``shared`` and
    ``shared_gate`` are submodules of ``block``: the forward keeps their attribute paths and looks them up on the
    block it is called on (``layer``: the experts' own ``_moelab_layer``), never the modules themselves."""
    direct = layer.apply_router_weight_on_input or isinstance(experts, nn.ModuleList)
    experts_path, shared_path, gate_path = (_path_in(block, m) for m in (experts, shared, shared_gate))

    def forward(block, hidden_states, *args, **kwargs):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        weights, ids, logits = routing_fn(block, x)
        experts = _lookup(block, experts_path)
        if direct:  # Llama-4's experts take dense inputs, a ModuleList is not callable: moelab directly
            out = experts.__dict__["_moelab_layer"].forward(experts, x, ids, weights)
        else:  # through the module, so its hooks see the call
            out = experts(x, ids, weights)
        if shared_path is not None:
            s = _lookup(block, shared_path)(x)
            if gate_path is not None:
                s = torch.sigmoid(_lookup(block, gate_path)(x)) * s
            out = out + s
        if not flat_output:  # Llama-4's block returns [T, H]; the others the input's shape
            out = out.reshape(shape)
        if returns_logits:
            return out, logits.to(hidden_states.dtype)
        return out

    return forward


def _make_fused_forward(block: nn.Module, layer: MoELayer, experts: nn.Module, router: nn.Module, method: str,
                        route_args: dict, top_k: int, shared, shared_gate, returns_logits: bool,
                        flat_output: bool = False, bias_path: str | None = None):
    from moelab.routing import route

    router_path = _path_in(block, router)
    route_args = dict(route_args)
    bias_names = None
    if route_args.pop("correction_bias", None) is not None:  # looked up per call, as the modules are
        bias_names = tuple(bias_path.split("."))

    def routing_fn(block, x):
        router = _lookup(block, router_path)
        bias = getattr(router, "bias", None)
        logits = nn.functional.linear(x.float(), router.weight.float(), None if bias is None else bias.float())
        args = route_args
        if bias_names is not None:
            args = dict(route_args, correction_bias=_lookup(block, bias_names).reshape(-1))
        # validate=False: no host sync per call (CUDA-graph safe); the model's correction bias is a parameter,
        # not per-call input
        weights, ids = route(logits, top_k, method, validate=False, **args)
        return weights, ids, logits

    return _make_block_forward(layer, experts, routing_fn, shared, shared_gate, returns_logits, flat_output, block)


def _parse_router_output(out, num_experts: int):
    """(weights [T, K], ids [T, K], logits [T, E] or None) from a router module's output, or None."""
    tensors = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
    ids = next((t for t in tensors if not t.dtype.is_floating_point and t.dim() == 2), None)
    if ids is None:
        return None
    floats = [t for t in tensors if t.dtype.is_floating_point and t.dim() == 2 and t.shape[0] == ids.shape[0]]
    weights = next((t for t in floats if t.shape[1] == ids.shape[1]), None)
    logits = next((t for t in floats if t.shape[1] == num_experts and t is not weights), None)
    if weights is None and logits is not None:  # dense [T, E] scores: gathered at the chosen experts
        weights = logits
    return None if weights is None else (weights, ids, logits)


def _try_router_module(block, experts, layer, spec, probe, original, tol):
    """External routing for a block whose experts are not callable (a ModuleList): call the block's own router
    module (a child returning the top-k ids and weights, as transformers' TopKRouter modules do), verified."""
    returns_tuple = isinstance(original, tuple)
    flat_output = (original[0] if returns_tuple else original).dim() == 2
    shared, shared_gate, _ = _shared_parts(block)
    x = probe.reshape(-1, spec.hidden_size)
    for name, child in block.named_children():
        if name == "experts" or "shared" in name or isinstance(child, nn.Linear):
            continue
        try:
            with torch.no_grad():
                parsed = _parse_router_output(child(x), spec.num_experts)
        except Exception:
            continue
        if parsed is None or (returns_tuple and parsed[2] is None):
            continue

        def routing_fn(block, h, router_name=name):
            weights, ids, logits = _parse_router_output(getattr(block, router_name)(h), spec.num_experts)
            if weights.shape[1] != ids.shape[1]:
                weights = weights.gather(1, ids.long())
            return weights, ids, logits

        forward = _make_block_forward(layer, experts, routing_fn, shared, shared_gate, returns_tuple, flat_output,
                                      block)
        ok, err = _block_close(block, forward, probe, tol)
        if ok:
            block.forward = types.MethodType(forward, block)
            return "external", f"the block's router module {name}" + (", shared expert" if shared is not None else "")
        return None, f"its router module {name} plus moelab's experts is {err:.1e} from the block's own output"
    return None, "no router module returning top-k ids and weights"


def _block_close(block, fused, probe: torch.Tensor, tol: float) -> tuple[bool, float]:
    with torch.no_grad():
        want = block(probe)
        got = fused(block, probe)
    want = want[0] if isinstance(want, tuple) else want
    got = got[0] if isinstance(got, tuple) else got
    if want.shape != got.shape:
        return False, math.inf
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    return err <= tol, err


def _probe_input(block, hidden_size, device, dtype, router):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2, 16, hidden_size, generator=g)
    # logits of O(3): decisive routing, so rounding cannot flip a choice between the two forwards
    scale = 1.0 if router is None else 3.0 / max(router.weight.detach().float().norm(dim=1).mean().item(), 1e-6)
    return (x * scale).to(device=device, dtype=dtype)


def _try_fuse(path, block, experts, layer, spec, configs, strict, fuse: bool = True):
    """Install a verified fused forward on ``block`` (ModuleList experts: else the block's own router module);
    returns (routing label, note)."""
    name, router = _router_of(block, spec.num_experts, spec.hidden_size)
    device, dtype = spec_device_dtype(experts)
    probe = _probe_input(block, spec.hidden_size, device, dtype, router)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    try:
        with torch.no_grad():
            original = block(probe)
    except Exception as e:  # a block that needs more than hidden states (DeepSeek-V4's hash routing: input ids)
        return None, f"the block's forward needs more than hidden states ({type(e).__name__}: {str(e)[:80]})"
    label, note = None, "routing='external'"
    if fuse:
        label, note = _try_fuse_router(block, experts, layer, spec, configs, name, router, probe, original, tol)
    if label is None and isinstance(experts, nn.ModuleList):
        label, why = _try_router_module(block, experts, layer, spec, probe, original, tol)
        note = why if label is not None else f"{note}; {why}"
    return label, note


def _try_fuse_router(block, experts, layer, spec, configs, name, router, probe, original, tol):
    if router is None:
        return None, f"no router with a weight of shape [{spec.num_experts}, {spec.hidden_size}] found"
    top_k = _config_value(configs, TOP_K_NAMES) or getattr(router, "top_k", None)
    if not isinstance(top_k, int):
        return None, "top-k not found in the config"
    shared, shared_gate, _ = _shared_parts(block)
    returns_tuple = isinstance(original, tuple)
    flat_output = (original[0] if returns_tuple else original).dim() == 2
    llama4 = layer.apply_router_weight_on_input
    bias_path = None
    if llama4:
        candidates = [("llama4", {})] if top_k == 1 else []
    else:
        bias_path, bias = _correction_bias(block, spec.num_experts)
        candidates = _candidates(configs, spec.num_experts, top_k, bias)
    errors = []
    for method, route_args in candidates:
        fused = _make_fused_forward(block, layer, experts, router, method, route_args, top_k, shared, shared_gate,
                                    returns_tuple, flat_output, bias_path)
        try:
            ok, err = _block_close(block, fused, probe, tol)
        except Exception as e:  # a method whose arguments this router cannot take (e.g. top_k > kept experts)
            errors.append(f"{method}: {type(e).__name__}: {str(e)[:120]}")
            continue
        errors.append(f"{method}: rel err {err:.1e}")
        if ok:
            block.forward = types.MethodType(fused, block)
            scale = route_args.get("routed_scaling_factor", 1.0)
            detail = ", ".join(f"{k}={v}" for k, v in route_args.items()
                               if k != "correction_bias" and not (k == "routed_scaling_factor" and v == 1.0))
            if route_args.get("correction_bias") is not None:
                detail += (", " if detail else "") + "correction bias"
            label = f"fused ({method}{': ' + detail if detail else ''})"
            note = f"router {name}" + (", shared expert" if shared is not None else "") + \
                (" with sigmoid gate" if shared_gate is not None else "")
            if scale != 1.0:
                note += "; routed scale in the fp32 routing weights (fp16-safe)"
            return label, note
    return None, "router not recognised (" + "; ".join(errors) + ")"


def spec_device_dtype(experts: nn.Module):
    p = next(experts.parameters())
    return p.device, p.dtype


# ---------------------------------------------------------------------------------------------- patch_model

def _configs_of(model: nn.Module) -> list:
    config = getattr(model, "config", None)
    if config is None:
        return []
    configs = [config]
    for name in ("text_config", "thinker_config", "language_config"):
        sub = getattr(config, name, None)
        if sub is not None:
            configs.insert(0, sub)
    return configs


def patch_model(model: nn.Module, *, backend: str = "auto", routing: str = "auto") -> PatchReport:
    """Run every MoE block of ``model`` (a ``transformers`` model, or a ``peft.PeftModel``) on moelab.

    Args:
        model: patched in place; it stays a normal HF model (``generate``, ``torch.compile``, ``save_pretrained``
            of the original weights).
        backend: "auto" (triton on a CUDA GPU where its kernels run the layer's activation and biases, else
            torch), "torch" or "triton".
        routing: "auto" (fused where the router is recognised, else external), "fused" (error where not
            recognised) or "external" (keep the model's router; its top-k goes to moelab).

    Returns:
        :class:`PatchReport`. On a PeftModel the LoRA adapters on the experts move into each layer's
        :class:`moelab.LoRABank` (``report.adapters``: name -> slot) and PEFT's own expert wrapping is removed;
        see :mod:`moelab.hf.peft`.

    Example:
        >>> import moelab
        >>> from moelab.hf.tiny import tiny_causal_lm
        >>> report = moelab.patch_model(tiny_causal_lm("qwen3_moe"), backend="torch")
        >>> len(report), report[0].routing
        (2, 'fused (renormalize)')
    """
    from moelab.distributed.metadata import ExpertParallelMetadata

    if routing not in ("auto", "fused", "external"):
        raise ValueError(f"routing: expected 'auto', 'fused' or 'external', got {routing!r}")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'triton' (flashinfer's closed kernel has no "
                         f"activations or biases to offer here), got {backend!r}")
    peft_adapters = None
    root = model
    if _is_peft_model(model):
        from moelab.hf.peft import bypass_expert_wrappers, collect_peft_expert_adapters

        peft_adapters = collect_peft_expert_adapters(model)
        root = model.get_base_model()
        bypass_expert_wrappers(root)  # before the probes: they compare base blocks, LoRA comes with the banks
    configs = _configs_of(root)
    hidden_size = _config_value(configs, ("hidden_size", "d_model"))
    report = PatchReport()
    selection = root.__dict__.setdefault("_moelab_selection", AdapterSelection())
    for path, block, child_name, experts in find_moe_blocks(root):
        try:
            spec = _spec_of(experts, hidden_size)
        except UnsupportedExperts as e:
            report.skipped.append((f"{path}.{child_name}", str(e)))
            continue
        device, _ = spec_device_dtype(experts)
        chosen = resolve_hf_backend(backend, spec, device)
        if backend == "triton" and not spec.is_default:
            from moelab.hf.experts import _triton_runs

            if not _triton_runs(spec):
                raise ValueError(f"backend: the triton kernels do not run {path}.{child_name} "
                                 f"({spec.describe()}); use backend='torch' or 'auto'")
        modulelist = isinstance(experts, nn.ModuleList)
        undecorated = not is_experts_class(type(experts)) and not modulelist
        layer = MoELayer(spec, chosen, selection, ExpertParallelMetadata(spec.num_experts),
                         apply_router_weight_on_input=undecorated)
        experts.__dict__["_moelab_layer"] = layer
        if modulelist:  # fail closed: every expert's own MLP against moelab on the stacked weights
            from moelab.hf.modulelist import check_stacked

            try:
                check_stacked(experts, lambda x, ids, w, e=experts, b=chosen: call_experts_op(e, x, ids, w, backend=b),
                              1e-4 if spec_device_dtype(experts)[1] == torch.float32 else 3e-2)
            except UnsupportedExperts as e:
                experts.__dict__.pop("_moelab_layer", None)
                report.skipped.append((f"{path}.{child_name}", str(e)))
                continue
        elif not undecorated:  # an undecorated module (Llama-4) takes dense inputs: only the fused forward calls it
            experts.forward = types.MethodType(_experts_forward, experts)
        label, note = None, ""
        if routing != "external" or undecorated or modulelist:
            label, note = _try_fuse(path, block, experts, layer, spec, configs, strict=routing == "fused",
                                    fuse=routing != "external")
            fused = label is not None and label.startswith("fused")
            if label is None and (routing == "fused" or undecorated or modulelist) or routing == "fused" and not fused:
                experts.__dict__.pop("forward", None)
                experts.__dict__.pop("_moelab_layer", None)
                if label is not None:  # a ModuleList block routed by its router module, but "fused" was asked
                    block.__dict__.pop("forward", None)
                if routing == "fused" and not undecorated:
                    raise ValueError(f"routing: 'fused' asked, but the router of {path} ({type(block).__name__}) is "
                                     f"not one moelab recognises: {note}; use routing='auto' or 'external'")
                why = "its experts take dense routed inputs" if undecorated else \
                    "its experts are an nn.ModuleList (the block's forward loops over them itself)"
                report.skipped.append((f"{path}.{child_name}", f"{why} and {note}"))
                continue
        if label is None:
            label = "external"
            note = note if routing == "auto" else "routing='external'"
        if backend == "auto" and chosen == "torch" and device.type == "cuda":
            note += ("; " if note else "") + "torch backend: the triton kernels do not run this activation/bias yet"
        report.append(LayerReport(path, type(block).__name__, spec.describe(), label, chosen, note,
                                  layer.metadata))
    if peft_adapters is not None:
        from moelab.hf.peft import install_adapters

        install_adapters(model, root, report, peft_adapters)
    root.__dict__["_moelab_report"] = report
    return report


def _is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def unpatch_model(model: nn.Module) -> None:
    """Undo :func:`patch_model` (the HF forwards come back; adapters imported from PEFT stay in moelab's bank
    and are dropped)."""
    for module in model.modules():
        for name in ("forward", "_moelab_layer", "_moelab_weights", "_moelab_stack"):
            module.__dict__.pop(name, None)
