"""Tiny random Hugging Face MoE models, built offline from config classes (tests, notebook 08, ``--tiny`` bench).

    experts_classes()          every experts class of the installed transformers that declares
                               ``@use_experts_implementation``, as {family: [class, ...]}
    tiny_config(family)        the family's (text) config at toy sizes: H=64, I=32, 4-8 experts, top-2, 2 layers
    tiny_causal_lm(family)     ``AutoModelForCausalLM.from_config(tiny_config(family))`` with decisive routers

Nothing here downloads anything. A family whose config or model cannot be built at toy sizes raises
:class:`TinyModelError` saying why (the caller decides whether that matters).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings
from functools import cache

import torch

__all__ = ["TinyModelError", "experts_classes", "is_experts_class", "tiny_config", "tiny_causal_lm", "SMALL",
           "scale_routers", "tiny_experts"]


class TinyModelError(RuntimeError):
    """A family's toy-size config or model could not be built (the message says why)."""


#: Toy sizes, set on every config attribute of these names that the family's config has.
SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=32, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    num_experts_per_tok=2, top_k_experts=2, num_local_experts=4, num_experts=4, n_routed_experts=4, moe_num_experts=4,
    shared_expert_intermediate_size=32, shared_intermediate_size=32, n_shared_experts=1, moe_k=2, moe_topk=2,
    first_k_dense_replace=1, num_dense_layers=1, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, sliding_window=16, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=16, moe_layer_start_index=0, moe_layer_end_index=1,
    use_mamba_kernels=False, mamba_d_state=8, mamba_dt_rank=8, mamba_n_heads=8, mamba_d_head=16,
    mamba_n_groups=1, mamba_chunk_size=16, decoder_sparse_step=1, mlp_only_layers=[], block_size=16,
)


#: Per-family settings the generic sizes miss (layer patterns that must include an attention and an MoE layer).
FAMILY_OVERRIDES = {
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "gemma4": dict(enable_moe_block=True),
    "diffusion_gemma": dict(enable_moe_block=True),
}

#: Set even where the config's default is None (a dense default, e.g. Gemma-4's num_experts).
_SET_EVEN_IF_NONE = {"n_group", "topk_group", "num_experts", "num_local_experts", "n_routed_experts",
                     "moe_intermediate_size", "num_experts_per_tok", "top_k_experts", "n_shared_experts"}


def is_experts_class(cls) -> bool:
    """True for a class whose ``forward`` was wrapped by transformers' ``@use_experts_implementation``."""
    fwd = getattr(cls, "forward", None)
    code = getattr(fwd, "__code__", None)
    return code is not None and code.co_filename.replace("\\", "/").endswith("integrations/moe.py")


@cache
def experts_classes() -> dict[str, list[type]]:
    """{family: [experts classes]} of every model file of the installed transformers that uses
    ``@use_experts_implementation`` (found by reading the source first, then importing only those files)."""
    from transformers import models

    found: dict[str, list[type]] = {}
    for info in pkgutil.iter_modules(models.__path__):
        spec = importlib.util.find_spec(f"transformers.models.{info.name}")
        path = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None
        if path is None:
            continue
        source = f"{path}/modeling_{info.name}.py"
        try:
            with open(source) as f:
                if "@use_experts_implementation" not in f.read():
                    continue
        except OSError:
            continue
        module = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        classes = [obj for obj in vars(module).values()
                   if inspect.isclass(obj) and obj.__module__ == module.__name__ and is_experts_class(obj)]
        if classes:
            found[info.name] = classes
    return found


def _config_classes(family: str) -> list[type]:
    module = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    from transformers import PretrainedConfig

    return [obj for obj in vars(module).values() if inspect.isclass(obj) and obj.__module__ == module.__name__
            and issubclass(obj, PretrainedConfig)]


def _causal_lm_config_class(family: str) -> type | None:
    """The family's config class that ``AutoModelForCausalLM`` maps (the text config of a multimodal family)."""
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping
    classes = _config_classes(family)
    registered = [c for c in classes if c in mapping]
    text = [c for c in registered if "Text" in c.__name__]
    return (text or registered or [None])[0]


def _experts_config_class(family: str, experts_cls: type) -> type:
    """The config class an experts class is built from: its annotation, else the text config, else the first."""
    hint = inspect.signature(experts_cls.__init__).parameters.get("config")
    if hint is not None and hint.annotation is not inspect.Parameter.empty and inspect.isclass(hint.annotation):
        return hint.annotation
    classes = _config_classes(family)
    lm = _causal_lm_config_class(family)
    text = [c for c in classes if "Text" in c.__name__]
    choice = lm or (text or classes or [None])[0]
    if choice is None:
        raise TinyModelError(f"{family}: no config class found")
    return choice


def _shrink(config, layers: int | None = None):
    """Set every :data:`SMALL` attribute the config has (and a layer count), plus per-layer lists to match."""
    for name, value in SMALL.items():
        try:
            if not hasattr(config, name):
                continue
            old = getattr(config, name)
            if isinstance(old, (list, tuple)) and old and not isinstance(value, list):
                value = [value] * len(old)  # per-modality sizes (Ernie-4.5-VL)
            if old is not None or name in _SET_EVEN_IF_NONE:
                setattr(config, name, value)
        except Exception:  # e.g. a per-layer attribute (Gemma-4's head_dim) that has no global setter
            continue
    try:
        mla = getattr(config, "kv_lora_rank", None) is not None
    except Exception:
        mla = False
    if mla:  # MLA: one rope head dim, as many KV heads as Q heads
        if hasattr(config, "head_dim"):
            config.head_dim = config.qk_rope_head_dim
        if hasattr(config, "num_key_value_heads"):
            config.num_key_value_heads = config.num_attention_heads
    if layers is not None and hasattr(config, "num_hidden_layers"):
        config.num_hidden_layers = layers
    n = getattr(config, "num_hidden_layers", 2)
    for name in ("layer_types", "mlp_layer_types", "layers_block_type"):
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and len(value) != n:
            kinds = list(dict.fromkeys(value))
            setattr(config, name, (kinds * n)[-n:] if len(kinds) > 1 else [kinds[0]] * n)
    return config


def tiny_config(family: str, experts_cls: type | None = None, **overrides):
    """The config an experts class (default: the family's causal-LM text config) is built from, at toy sizes."""
    cls = _experts_config_class(family, experts_cls) if experts_cls is not None else _causal_lm_config_class(family)
    if cls is None:
        raise TinyModelError(f"{family}: no config class that AutoModelForCausalLM maps")
    if experts_cls is None:
        overrides = {**FAMILY_OVERRIDES.get(family, {}), **overrides}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = cls()
            if not hasattr(config, "hidden_size"):  # a composite config (Qwen3-Omni's thinker): its text part
                config = next(getattr(config, n) for n in ("text_config", "thinker_config") if hasattr(config, n))
            overrides = dict(overrides)  # a layer count goes through _shrink, which resizes the per-layer lists too
            config = _shrink(config, layers=overrides.pop("num_hidden_layers", None))
            for name, value in overrides.items():
                setattr(config, name, value)
    except Exception as e:  # a config class with required arguments or a validator our sizes upset
        raise TinyModelError(f"{family}: {cls.__name__} at toy sizes: {type(e).__name__}: {e}") from e
    return config


def scale_routers(model: torch.nn.Module, std: float = 1.0, generator: torch.Generator | None = None) -> None:
    """Make the MoE part of a random model matter and its routing decisive: router weights ~N(0, std) (logits
    O(std * sqrt(H))), expert weights ~N(0, 1/fan_in), selection and expert biases non-zero, so every routing and
    bias path is exercised, no near-tie flips between two implementations, and the experts move the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            parts = name.split(".")
            owner = parts[-2] if len(parts) > 1 else ""
            if "experts" in parts and "shared_experts" not in parts and p.dim() == 3:
                p.copy_(torch.randn(p.shape, generator=generator) / min(p.shape[1:]) ** 0.5)
            elif "experts" in parts and parts[-1].endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
            elif owner in ("gate", "router", "wg") and p.dim() == 2 and p.shape[0] <= 64:
                p.copy_(torch.randn(p.shape, generator=generator) * std / p.shape[1] ** 0.5 * 4)
            elif parts[-1] in ("e_score_correction_bias", "expert_bias"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.copy_(torch.randn(b.shape, generator=generator) * 0.1)


def tiny_causal_lm(family: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, experts_implementation="eager",
                   **overrides):
    """A random tiny ``AutoModelForCausalLM`` of ``family`` (eval mode), routers scaled by :func:`scale_routers`."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                     experts_implementation=experts_implementation)
    except Exception as e:
        raise TinyModelError(f"{family}: AutoModelForCausalLM at toy sizes: {type(e).__name__}: {e}") from e
    scale_routers(model, generator=torch.Generator().manual_seed(seed + 1))
    model.eval()
    try:  # some families build at toy sizes but need sizes we do not set (per-layer configs) to run
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(torch.zeros(1, 2, dtype=torch.long, device=model.device))
    except Exception as e:
        raise TinyModelError(f"{family}: the toy model's own eager forward fails: {type(e).__name__}: "
                             f"{str(e)[:200]}") from e
    return model


def tiny_experts(family: str, experts_cls: type, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                 layer_idx: int = 0, **overrides):
    """One experts module of ``experts_cls`` at toy sizes, weights ~N(0, 1/fan_in), biases non-zero
    (``layer_idx``: for classes whose constructor takes one; ``overrides``: config attributes to set)."""
    config = tiny_config(family, experts_cls, **overrides)
    config._experts_implementation = "eager"
    kwargs = {}
    parameters = inspect.signature(experts_cls.__init__).parameters
    if isinstance(getattr(config, "moe_intermediate_size", None), (list, tuple)) and "intermediate_size" in parameters:
        kwargs["intermediate_size"] = SMALL["moe_intermediate_size"]  # per-modality sizes: the block passes one
    if "layer_idx" in parameters and parameters["layer_idx"].default is inspect.Parameter.empty:
        kwargs["layer_idx"] = layer_idx  # per-layer settings (Step-3.7's and Bailing-hybrid's SwiGLU limits)
    try:
        module = experts_cls(config, **kwargs)
    except Exception as e:
        raise TinyModelError(f"{family}: {experts_cls.__name__} at toy sizes: {type(e).__name__}: {e}") from e
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 3:
                p.copy_(torch.randn(p.shape, generator=g) / min(p.shape[1:]) ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return module.to(dtype).eval()
