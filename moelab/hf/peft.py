"""PEFT LoRA adapters on MoE experts, run unmerged by moelab: PEFT's factors -> each layer's ``LoRABank``.

PEFT's ``target_parameters`` LoRA on a 3-D expert parameter ``[E, d1, d2]`` keeps, per adapter,
``lora_A.weight [r*E, in]`` and ``lora_B.weight [out, r*E]`` (in/out in nn.Linear's sense: H -> 2I for
``gate_up_proj``, I -> H for ``down_proj``, whichever way round the family stores the parameter). Expert e's
factors are

    A_e = A[e*r:(e+1)*r, :]        [r, in]    expert-major rows
    B_e = B[:, e::E]               [out, r]   expert-fastest columns (B viewed as [out, r, E])

and its delta on an input x is ``s * B_e @ (A_e @ x)`` with ``s = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA),
in the parameter's own output order: rows ``[gate; up]``, or alternating for GPT-OSS. :func:`expert_factors`
turns that into a bank slot: gate and up share ``A_e``, their B's are the gate and up rows of ``s * B_e``.

An ``nn.ModuleList`` of expert MLPs (see :mod:`moelab.hf.modulelist`) takes PEFT's ordinary ``target_modules``
LoRA on its Linear layers (``experts.0.gate_proj``, or a regex over every expert): expert e's ``lora_A.weight
[r, in]`` and ``scaling * lora_B.weight [out, r]`` go straight into its gate/up/down rows of the bank (an expert or
projection without LoRA gets zeros). DoRA and ``lora_bias`` raise :class:`AdapterError`.

    collect_peft_expert_adapters(peft_model)     every adapter's expert factors, read off PEFT's ParamWrappers
    load_adapter(model, directory, name)         an adapter directory (adapter_config.json + safetensors)
    adapter_ids(model, ids)                      context manager: adapter slot per sequence [B] or token [B, S]
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import types
from dataclasses import dataclass

import torch
from torch import nn

from moelab.hf.experts import register_bank
from moelab.lora import LoRABank

__all__ = ["AdapterError", "ExpertFactors", "LinearFactors", "expert_factors", "collect_peft_expert_adapters",
           "load_adapter", "adapter_ids"]


class AdapterError(ValueError):
    """A LoRA adapter moelab cannot load (the message names the file and tensor)."""


@dataclass
class ExpertFactors:
    """One adapter on one experts module: PEFT's flat factors per targeted parameter, scaling not yet applied.

    ``params``: parameter name ("gate_up_proj", "up_proj", "down_proj") -> (A [r*E, in], B [out, r*E], scaling).
    """

    params: dict


@dataclass
class LinearFactors:
    """One adapter on an ``nn.ModuleList`` of expert MLPs: PEFT's LoRA on their Linear layers.

    ``params``: (expert index, "gate" | "up" | "down") -> (A [r, in], B [out, r], scaling), nn.Linear's
    orientation (delta = scaling * B @ A @ x); experts or projections without an entry get zeros.
    """

    params: dict


def _split(a: torch.Tensor, b: torch.Tensor, num_experts: int, where: str):
    """(A_e [E, r, in], B_e [E, out, r]) from PEFT's flat factors."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] % num_experts:
        raise AdapterError(f"{where}: expected lora_A [r*E, in] and lora_B [out, r*E] with E={num_experts}, got "
                           f"{list(a.shape)} and {list(b.shape)}")
    r = a.shape[0] // num_experts
    a_e = a.reshape(num_experts, r, a.shape[1])
    b_e = b.reshape(b.shape[0], r, num_experts).permute(2, 0, 1)
    return a_e, b_e


def expert_factors(factors: ExpertFactors, spec, where: str) -> dict:
    """The six ``LoRABank.set`` tensors (scaling folded into B, ranks zero-padded to one r) for one layer."""
    if isinstance(factors, LinearFactors):
        return linear_expert_factors(factors, spec, where)
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    first = "gate_up_proj" if spec.gated else "up_proj"
    unknown = set(factors.params) - {first, "down_proj"}
    if unknown:
        raise AdapterError(f"{where}: LoRA on {sorted(unknown)} of the experts, which moelab does not serve "
                           f"(expected {first} and/or down_proj)")
    pieces = {}
    for name, (a, b, scaling) in factors.params.items():
        a_e, b_e = _split(a.float(), b.float(), E, f"{where}.{name}")
        want_in, want_out = (H, (2 if spec.gated else 1) * I) if name == first else (I, H)
        if a_e.shape[2] != want_in or b_e.shape[1] != want_out:
            raise AdapterError(f"{where}.{name}: expected lora_A [r*{E}, {want_in}] and lora_B [{want_out}, r*{E}] "
                               f"for experts {spec.describe()}, got {list(a.shape)} and {list(b.shape)}")
        pieces[name] = (a_e, b_e * scaling)
    rank = max(a_e.shape[1] for a_e, _ in pieces.values())

    def pad_a(t):
        return torch.nn.functional.pad(t, (0, 0, 0, rank - t.shape[1]))

    def pad_b(t):
        return torch.nn.functional.pad(t, (0, rank - t.shape[2]))

    zeros_a = lambda d: torch.zeros(E, rank, d)  # noqa: E731
    zeros_b = lambda d: torch.zeros(E, d, rank)  # noqa: E731
    out = dict(gate_a=zeros_a(H), gate_b=zeros_b(I), up_a=zeros_a(H), up_b=zeros_b(I), down_a=zeros_a(I),
               down_b=zeros_b(H))
    if first in pieces:
        a_e, b_e = pieces[first]
        a_e, b_e = pad_a(a_e), pad_b(b_e)
        if not spec.gated:
            out["up_a"], out["up_b"] = a_e, b_e
        else:
            if spec.interleaved:
                gate_rows, up_rows = b_e[:, 0::2], b_e[:, 1::2]
            else:
                gate_rows, up_rows = b_e[:, :I], b_e[:, I:]
            out.update(gate_a=a_e, up_a=a_e, gate_b=gate_rows, up_b=up_rows)
    if "down_proj" in pieces:
        a_e, b_e = pieces["down_proj"]
        out["down_a"], out["down_b"] = pad_a(a_e), pad_b(b_e)
    return out


def linear_expert_factors(factors: LinearFactors, spec, where: str) -> dict:
    """The six ``LoRABank.set`` tensors from per-expert Linear LoRA (scaling folded into B, ranks zero-padded)."""
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    shapes = {"gate": (H, I), "up": (H, I), "down": (I, H)}  # (in, out)
    for (e, role), (a, b, _) in factors.params.items():
        d_in, d_out = shapes[role]
        if not 0 <= e < E or a.dim() != 2 or b.dim() != 2 or a.shape[1] != d_in or b.shape[0] != d_out \
                or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{where}: expert {e} {role}: expected lora_A [r, {d_in}] and lora_B [{d_out}, r] "
                               f"for experts {spec.describe()}, got {list(a.shape)} and {list(b.shape)}")
    rank = max(a.shape[0] for a, _, _ in factors.params.values())
    out = dict(gate_a=torch.zeros(E, rank, H), gate_b=torch.zeros(E, I, rank), up_a=torch.zeros(E, rank, H),
               up_b=torch.zeros(E, I, rank), down_a=torch.zeros(E, rank, I), down_b=torch.zeros(E, H, rank))
    for (e, role), (a, b, scaling) in factors.params.items():
        r = a.shape[0]
        out[f"{role}_a"][e, :r] = a.float()
        out[f"{role}_b"][e, :, :r] = b.float() * scaling
    return out


# ---------------------------------------------------------------------------------------------- from a PeftModel

def _modulelist_wrappers(experts: nn.Module):
    """[(expert index, "gate" | "up" | "down", PEFT LoRA layer)] of an nn.ModuleList of expert MLPs."""
    from moelab.hf.modulelist import modulelist_layout

    names = modulelist_layout(experts)
    if names is None:
        return []
    found = []
    for e, expert in enumerate(experts):
        for role, name in zip(("gate", "up", "down"), names):
            layer = getattr(expert, name)
            if hasattr(layer, "lora_A") and hasattr(layer, "base_layer"):
                found.append((e, role, layer))
    return found


def _linear_factors(path: str, wrapper, name: str):
    """(A, B, scaling) of adapter ``name`` on one PEFT LoRA Linear, or an AdapterError for what moelab cannot run."""
    where = f"PeftModel: adapter {name!r} on {path}"
    if getattr(wrapper, "use_dora", {}).get(name):
        raise AdapterError(f"{where}: DoRA (use_dora=True) is not a LoRA moelab's bank can run")
    if getattr(wrapper, "lora_bias", {}).get(name):
        raise AdapterError(f"{where}: lora_bias=True is not a LoRA moelab's bank can run")
    return (wrapper.lora_A[name].weight.detach(), wrapper.lora_B[name].weight.detach(),
            float(wrapper.scaling[name]))

def _expert_wrappers(module: nn.Module):
    """PEFT ParamWrappers above an HF experts module, outermost first."""
    chain = []
    while hasattr(module, "base_layer") and hasattr(module, "parameter_name"):
        chain.append(module)
        module = module.base_layer
    return chain


def collect_peft_expert_adapters(peft_model) -> dict:
    """{adapter name: {experts module path (in the base model): ExpertFactors}} from PEFT's ParamWrappers."""
    from moelab.hf.experts import base_experts

    base = peft_model.get_base_model()
    adapters: dict[str, dict] = {name: {} for name in peft_model.peft_config}
    for path, module in base.named_modules():
        experts = module._modules.get("experts") if hasattr(module, "_modules") else None
        if experts is None:
            continue
        for e, role, wrapper in _modulelist_wrappers(experts):
            for name in wrapper.lora_A:
                entry = adapters.setdefault(name, {}).setdefault(f"{path}.experts", LinearFactors({}))
                entry.params[(e, role)] = _linear_factors(f"{path}.experts.{e}", wrapper, name)
        chain = _expert_wrappers(experts)
        for wrapper in chain:
            for name in wrapper.lora_A:
                a = wrapper.lora_A[name].weight.detach()
                b = wrapper.lora_B[name].weight.detach()
                entry = adapters.setdefault(name, {}).setdefault(f"{path}.experts", ExpertFactors({}))
                entry.params[wrapper.parameter_name] = (a, b, float(wrapper.scaling[name]))
        if isinstance(experts, nn.ModuleList) or base_experts(experts) is experts:
            continue
    return adapters


def _bypass(wrapper: nn.Module) -> None:
    """Turn a PEFT expert wrapper into a pass-through (its factors now live in moelab's bank)."""

    def forward(self, x, *args, **kwargs):
        kwargs.pop("adapter_names", None)
        return self.base_layer(x, *args, **kwargs)

    wrapper.forward = types.MethodType(forward, wrapper)


def bypass_expert_wrappers(root: nn.Module) -> None:
    """Make PEFT's wrappers of every experts module pass-throughs (their factors go to moelab's banks), so nothing
    is applied twice; the wrappers and their weights stay, so ``PeftModel.save_pretrained`` still writes them."""
    for module in root.modules():
        experts = module._modules.get("experts") if hasattr(module, "_modules") else None
        if experts is not None:
            for wrapper in _expert_wrappers(experts) + [w for _, _, w in _modulelist_wrappers(experts)]:
                _bypass(wrapper)


def _layers_by_path(root: nn.Module) -> dict:
    layers = {}
    for path, module in root.named_modules():
        experts = module._modules.get("experts") if hasattr(module, "_modules") else None
        if experts is None:
            continue
        from moelab.hf.experts import base_experts

        inner = base_experts(experts)
        layer = inner.__dict__.get("_moelab_layer")
        if layer is not None:
            layers[f"{path}.experts"] = (layer, experts)
    return layers


def _install(root: nn.Module, report, adapters: dict, source: str) -> None:
    """Validate every adapter's tensors for every layer first, then write the banks (nothing half-loaded)."""
    layers = _layers_by_path(root)
    staged = {}  # path -> {adapter name: tensors}
    for name, per_layer in adapters.items():
        for path, factors in per_layer.items():
            if path not in layers:
                raise AdapterError(f"{source}: adapter {name!r} targets the experts at {path}, which patch_model did "
                                   f"not replace (see report.skipped)")
            staged.setdefault(path, {})[name] = expert_factors(factors, layers[path][0].spec, f"{source}: {path}")
    names = list(report.adapters) + [n for n in adapters if n not in report.adapters]
    for path, (layer, _) in layers.items():
        per_adapter = staged.get(path, {})
        old = layer.bank
        rank = max([t["gate_a"].shape[1] for t in per_adapter.values()] + ([old.max_rank] if old else []) + [1])
        if old is not None and old.max_loras >= len(names) and old.max_rank >= rank:
            bank = old
        else:
            p = next(iter(_param_of(layers[path][1])))
            spec = layer.spec
            bank = LoRABank(max(len(names), 1), num_local_experts=spec.num_experts, hidden_size=spec.hidden_size,
                            intermediate_size=spec.intermediate_size, max_rank=rank, dtype=p.dtype, device=p.device)
            if old is not None:
                for slot, r in enumerate(old.ranks):
                    if r:
                        bank.set(slot, **{k: getattr(old, k)[slot, :, :r] if k.endswith("_a") else
                                          getattr(old, k)[slot, :, :, :r] for k in
                                          ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b")})
        for adapter, tensors in per_adapter.items():
            bank.set(names.index(adapter), **tensors)
        layer.bank = bank
        register_bank(bank)
    report.adapters.update({n: i for i, n in enumerate(names)})


def _param_of(module):
    return module.parameters()


def install_adapters(peft_model, root: nn.Module, report, adapters: dict) -> None:
    """Called by :func:`moelab.patch_model` on a PeftModel: import the expert adapters, bypass PEFT's expert
    wrappers, serve the PeftModel's active adapter by default."""
    _install(root, report, {n: a for n, a in adapters.items() if a}, "PeftModel")
    selection = root.__dict__["_moelab_selection"]
    selection.adapters = report.adapters
    wrappers = [w for _, (_, wrapped) in _layers_by_path(root).items()
                for w in _expert_wrappers(wrapped) + [w for _, _, w in _modulelist_wrappers(wrapped)]]
    selection.peft_layer = wrappers[0] if wrappers else None


# ---------------------------------------------------------------------------------------------- from a directory

def _read_config(directory: str) -> dict:
    path = os.path.join(directory, "adapter_config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError as e:
        raise AdapterError(f"{path}: no adapter_config.json in the adapter directory") from e
    for key in ("r", "lora_alpha"):
        if key not in config:
            raise AdapterError(f"{path}: missing {key!r} (LoRA's scaling is lora_alpha / r)")
    return config


def _pattern_value(patterns: dict, key: str, default):
    for pattern, value in (patterns or {}).items():
        if key == pattern or key.endswith("." + pattern) or pattern.split(".")[-1] == key.split(".")[-1]:
            return value
    return default


def load_adapter(model: nn.Module, directory: str | os.PathLike, adapter_name: str = "default") -> int:
    """Load a PEFT LoRA adapter directory onto a model patched by :func:`moelab.patch_model`; returns its slot.

    Reads ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern``, ``alpha_pattern``) and
    ``adapter_model.safetensors`` (never a pickle). Every expert tensor is checked before any bank is written.
    """
    from safetensors.torch import load_file

    directory = os.fspath(directory)
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    report = root.__dict__.get("_moelab_report")
    if report is None:
        raise AdapterError(f"model: call moelab.patch_model(model) before loading {directory}")
    config = _read_config(directory)
    weights = os.path.join(directory, "adapter_model.safetensors")
    if not os.path.exists(weights):
        pickles = [f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth", ".pkl"))]
        raise AdapterError(f"{directory}: no adapter_model.safetensors" + (
            f"; {pickles[0]} is a pickle file, which moelab does not load (it can run code): convert it with "
            f"safetensors first" if pickles else ""))
    tensors = load_file(weights)
    layers = _layers_by_path(root)
    per_layer: dict[str, dict] = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            if ".lora_B." not in key:
                raise AdapterError(f"{weights}: tensor {key!r} is not a LoRA factor (lora_A / lora_B)")
            continue
        b_key = key.replace(".lora_A.", ".lora_B.")
        if b_key not in tensors:
            raise AdapterError(f"{weights}: tensor {key!r} has no matching {b_key!r}")
        module_path = key.split(".lora_A.")[0]
        for prefix in ("base_model.model.",):
            module_path = module_path.removeprefix(prefix)
        depth = 0
        while module_path.endswith(".base_layer"):
            module_path, depth = module_path[: -len(".base_layer")], depth + 1
        if module_path not in layers:
            raise AdapterError(f"{weights}: tensor {key!r} targets {module_path!r}, which is not an experts module "
                               f"moelab replaced (moelab serves LoRA on the experts; load other targets with PEFT)")
        spec = layers[module_path][0].spec
        b = tensors[b_key]
        first = "gate_up_proj" if spec.gated else "up_proj"
        first_shape = (spec.hidden_size, (2 if spec.gated else 1) * spec.intermediate_size)
        down_shape = (spec.intermediate_size, spec.hidden_size)
        got = (a.shape[-1], b.shape[0]) if a.dim() == 2 and b.dim() == 2 else None
        param = first if got == first_shape else "down_proj" if got == down_shape else None
        if param is None or first_shape == down_shape:
            raise AdapterError(f"{weights}: tensor {key!r} of shape {list(a.shape)} (with lora_B {list(b.shape)}) "
                               f"fits neither {first} (in {first_shape[0]}, out {first_shape[1]}) nor down_proj (in "
                               f"{down_shape[0]}, out {down_shape[1]}) of {module_path}")
        if a.shape[0] % spec.num_experts:
            raise AdapterError(f"{weights}: tensor {key!r} has {a.shape[0]} rows, not a multiple of the "
                               f"{spec.num_experts} experts")
        r = a.shape[0] // spec.num_experts
        want_r = _pattern_value(config.get("rank_pattern"), f"{module_path}.{param}", config["r"])
        if r != want_r:
            raise AdapterError(f"{weights}: tensor {key!r} has rank {r} per expert, adapter_config.json says "
                               f"{want_r}")
        alpha = _pattern_value(config.get("alpha_pattern"), f"{module_path}.{param}", config["lora_alpha"])
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        per_layer.setdefault(module_path, ExpertFactors({})).params[param] = (a, b, scaling)
    if not per_layer:
        raise AdapterError(f"{weights}: no LoRA factor on any experts module moelab replaced")
    _install(root, report, {adapter_name: per_layer}, weights)
    return report.adapters[adapter_name]


# ---------------------------------------------------------------------------------------------- choosing adapters

@contextlib.contextmanager
def adapter_ids(model: nn.Module, ids):
    """Within the block, tokens use adapter slots ``ids``: int [B] per sequence or [B, S] per token, -1 = none.

    Slots are ``report.adapters[name]``. Outside any block, the PeftModel's active adapter serves every token.

    Example:
        >>> with moelab.hf.adapter_ids(model, torch.tensor([0, 1, -1])):  # doctest: +SKIP
        ...     logits = model(input_ids).logits
    """
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    selection = root.__dict__.get("_moelab_selection")
    if selection is None:
        raise ValueError("model: call moelab.patch_model(model) first")
    ids = torch.as_tensor(ids)
    if ids.dtype.is_floating_point or ids.dim() not in (1, 2):
        raise TypeError(f"ids: expected an int tensor [B] or [B, S], got {ids.dtype} of shape {list(ids.shape)}")
    report = root.__dict__["_moelab_report"]
    if ids.numel() and (int(ids.max()) >= max(len(report.adapters), 0) or int(ids.min()) < -1):
        raise ValueError(f"ids: expected slots in [-1, {len(report.adapters)}) (report.adapters: "
                         f"{report.adapters}), got values in [{int(ids.min())}, {int(ids.max())}]")
    device = next(root.parameters()).device
    previous = selection.ids
    selection.ids = ids.to(device=device, dtype=torch.int32)
    try:
        yield
    finally:
        selection.ids = previous
