"""``nn.ModuleList`` experts (older and remote-code MoE models) on moelab: per-expert MLPs stacked once.

A block whose ``experts`` is an ``nn.ModuleList`` of E expert MLPs, each with three ``nn.Linear`` (bias or not)

    gate_proj / up_proj / down_proj     (Qwen2-MoE, DeepSeek-V2/V3 and OLMoE remote code)
    w1 / w3 / w2                        (Mixtral's original layout: w1 gate, w3 up, w2 down)

and an activation ``act_fn`` (or ``act``), computing ``down(act(gate(x)) * up(x))``, runs on moelab after its
weights are stacked into moelab's layout: ``w13 [E, 2I, H]`` rows ``[gate; up]``, ``w2 [E, H, I]``, biases
``[E, 2I]`` / ``[E, H]``. The stack is a copy (a ModuleList has no single tensor to view), made once and made
again when any expert parameter changes (identity, storage or version counter: training steps,
``load_state_dict``); the original Linear weights stay the model's parameters (``state_dict``/``save_pretrained``
unchanged).

    modulelist_layout(experts)       the (gate, up, down) attribute names, or None for another kind of ModuleList
    modulelist_spec(experts)         :class:`~moelab.hf.experts.ExpertsSpec` (activation probed, every expert checked)
    modulelist_linears(experts)      [(gate, up, down) nn.Linear per expert], under PEFT's LoRA wrappers
    stacked_weights(experts)         (w13, w2, w13_bias, w2_bias) in moelab's order, cached on the module

Under ``torch.compile`` the stack made at the last eager call is used (re-stacking needs the version counters,
which a compiled graph does not read): run one eager forward after changing the weights.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from moelab.hf.experts import ExpertsSpec, UnsupportedExperts, _probe_activation

__all__ = ["LAYOUTS", "modulelist_layout", "modulelist_spec", "modulelist_linears", "stacked_weights",
           "check_stacked"]

#: (gate, up, down) attribute names of one expert MLP, first match wins.
LAYOUTS = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def _linear(module: nn.Module) -> nn.Module:
    """The ``nn.Linear`` under PEFT's LoRA wrapper (``base_layer``), or the module itself."""
    while not isinstance(module, nn.Linear) and isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    return module


def modulelist_layout(experts: nn.Module) -> tuple[str, str, str] | None:
    """The (gate, up, down) attribute names shared by every expert of an ``nn.ModuleList``, or None."""
    if not isinstance(experts, nn.ModuleList) or len(experts) == 0:
        return None
    for names in LAYOUTS:
        if all(all(isinstance(_linear(getattr(e, n, None) or nn.Identity()), nn.Linear) for n in names)
               for e in experts):
            return names
    return None


def modulelist_linears(experts: nn.ModuleList) -> list[tuple[nn.Linear, nn.Linear, nn.Linear]]:
    """[(gate, up, down)] base ``nn.Linear`` of every expert (PEFT's wrappers looked through)."""
    names = modulelist_layout(experts)
    return [tuple(_linear(getattr(e, n)) for n in names) for e in experts]


def _act_of(expert: nn.Module):
    for name in ("act_fn", "act", "activation_fn", "activation"):
        act = getattr(expert, name, None)
        if callable(act):
            return act
    return None


def modulelist_spec(experts: nn.Module) -> ExpertsSpec:
    """What the ModuleList computes, in moelab's terms (cached on it); :class:`UnsupportedExperts` otherwise."""
    spec = experts.__dict__.get("_moelab_spec")
    if spec is not None:
        return spec
    names = modulelist_layout(experts)
    if names is None:
        raise UnsupportedExperts(
            "an nn.ModuleList whose experts are not MLPs with nn.Linear " + " or ".join(
                "/".join(n) for n in LAYOUTS) + " (moelab runs gated expert MLPs)")
    linears = modulelist_linears(experts)
    gate, up, down = linears[0]
    E, I, H = len(linears), gate.out_features, gate.in_features
    has_bias = False
    for e, (g, u, d) in enumerate(linears):
        shapes = (tuple(g.weight.shape), tuple(u.weight.shape), tuple(d.weight.shape))
        if shapes != ((I, H), (I, H), (H, I)):
            raise UnsupportedExperts(f"an nn.ModuleList of experts of different sizes: expert {e} has {names} "
                                     f"weights {list(map(list, shapes))}, expert 0 [[{I}, {H}], [{I}, {H}], "
                                     f"[{H}, {I}]]")
        has_bias |= any(m.bias is not None for m in (g, u, d))
    acts = {type(_act_of(e)) for e in experts}
    act = _act_of(experts[0])
    if act is None or len(acts) != 1:
        raise UnsupportedExperts(f"an nn.ModuleList of experts without one shared act_fn (found "
                                 f"{sorted(map(str, acts))})")

    def apply_gate(gate_up):
        g, u = gate_up.chunk(2, dim=-1)
        return act(g) * u

    activation, alpha, limit = _probe_activation(types.SimpleNamespace(_apply_gate=apply_gate), True, False)
    spec = ExpertsSpec(E, H, I, True, activation, alpha, limit, has_bias, False, False)
    experts.__dict__["_moelab_spec"] = spec
    experts.__dict__["_moelab_layout"] = names
    experts.__dict__["_moelab_stacker"] = stacked_weights  # what moelab.hf.experts runs on (no import cycle)
    return spec


def _params(linears) -> tuple:
    return tuple(p for trio in linears for m in trio for p in (m.weight, m.bias))


def stacked_weights(experts: nn.ModuleList) -> tuple:
    """(w13 [E, 2I, H], w2 [E, H, I], w13_bias [E, 2I] or None, w2_bias [E, H] or None), stacked once and again
    only when an expert parameter changed (its identity, storage or version counter)."""
    linears = modulelist_linears(experts)
    params = _params(linears)
    cached = experts.__dict__.get("_moelab_stack")
    if cached is not None and not torch.compiler.is_compiling():
        old, versions, ptrs, stack = cached
        if len(old) == len(params) and all(
                p is q and (p is None or (p._version == v and p.data_ptr() == ptr))
                for p, q, v, ptr in zip(params, old, versions, ptrs)):
            return stack
    elif cached is not None:
        return cached[3]
    with torch.no_grad():
        gate = torch.stack([g.weight for g, _, _ in linears])
        up = torch.stack([u.weight for _, u, _ in linears])
        w13 = torch.cat([gate, up], dim=1).contiguous()
        w2 = torch.stack([d.weight for _, _, d in linears]).contiguous()
        b13 = b2 = None
        if experts.__dict__["_moelab_spec"].has_bias:
            def bias(m, n):
                return m.bias if m.bias is not None else m.weight.new_zeros(n)

            I, H = w13.shape[1] // 2, w13.shape[2]
            b13 = torch.stack([torch.cat([bias(g, I), bias(u, I)]) for g, u, _ in linears])
            b2 = torch.stack([bias(d, H) for _, _, d in linears])
    stack = (w13, w2, b13, b2)
    experts.__dict__["_moelab_stack"] = (params, tuple(p._version if p is not None else None for p in params),
                                         tuple(p.data_ptr() if p is not None else None for p in params), stack)
    return stack


def check_stacked(experts: nn.ModuleList, run, tol: float) -> float:
    """Fail closed: every expert's own forward against ``run(x [T, H], ids [T, 1], weights [T, 1])`` (moelab on the
    stacked weights) on two random tokens per expert; returns the relative error, raises
    :class:`UnsupportedExperts` above ``tol`` (an expert MLP computing something else than
    ``down(act(gate(x)) * up(x))``)."""
    spec = experts.__dict__["_moelab_spec"]
    p = next(experts.parameters())
    g = torch.Generator().manual_seed(4321)
    x = torch.randn(2 * spec.num_experts, spec.hidden_size, generator=g).to(device=p.device, dtype=p.dtype)
    ids = torch.arange(spec.num_experts, device=p.device).repeat_interleave(2)[:, None]
    with torch.no_grad():
        want = torch.cat([experts[e](x[2 * e: 2 * e + 2]) for e in range(spec.num_experts)])
        got = run(x, ids.to(torch.int32), torch.ones(ids.shape, device=p.device, dtype=torch.float32))
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    if not err <= tol:
        raise UnsupportedExperts(f"an nn.ModuleList of {type(experts[0]).__name__}: moelab on the stacked weights is "
                                 f"{err:.1e} from the experts' own forward (tolerance {tol:g}); the expert MLP "
                                 f"computes something other than down(act(gate(x)) * up(x))")
    return err
