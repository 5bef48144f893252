"""Whole-model speed of a Hugging Face MoE stack on moelab against HF's own experts backends.

    python -m moelab.hf.bench --shape qwen3-30b-a3b --layers 4 --tokens 1,128,4096     (a GPU)
    python -m moelab.hf.bench --shape gpt-oss-20b --layers 2
    python -m moelab.hf.bench --tiny                                                   (CPU smoke run)

A random stack of ``--layers`` decoder layers of the real model's sizes (random weights: speed does not depend on
them; the vocabulary is cut to ``--vocab`` so the LM head does not dominate) is timed, one forward of one
sequence of T tokens, for:

    eager        transformers' own per-expert loop
    grouped_mm   transformers' default experts backend
    moelab       moelab.patch_model (backend "auto": triton on a GPU where its kernels run the family)
    peft         grouped_mm + one PEFT LoRA adapter on the experts (``target_parameters``), PEFT's forward
    moelab+lora  the same PeftModel after moelab.patch_model: the adapter runs unmerged in moelab's bank

plus the experts' share of the moelab forward (``experts_ms``: CUDA events around every experts call) against the
layer benchmark's call (``moelab.routed_moe`` on packed routing words, ``validate=False``, exactly what
``python -m moelab.bench`` times) on the same inputs (``layer_ms``), and their ratio ``experts/layer`` (the
integration's overhead; the target is <= 1.10); ``fwd_layer_ms`` is the same forward with each experts call replaced
by that layer call, so ``experts_ms / fwd_layer_ms`` is moelab.hf's own code path and ``fwd_layer_ms / layer_ms``
what running inside a forward costs any call (see :func:`experts_share`; stderr adds the experts module calls alone
and the host times). Those are eager, each call stamped alone: at small T they measure host launch time. The
``graph_*`` keys time the share as the layer benchmark times its call (:func:`graph_share`): a CUDA-graph replay
at T <= ``--graph-max-t`` (moelab.bench's, 1024), eager above, of the whole forward, of the same forward with
stand-in experts that do no work (``graph_experts_ms`` is the difference) and of the layer calls alone
(``graph_layer_ms``); ``graph_experts/layer`` is the issue's measure on the device alone. Then greedy
``generate()`` tokens/s. Every eager side is stamped alike: the device is synchronised before each call's start
event, so each call is timed from an empty queue (its host launch time included on every side, no earlier work
queued in front of it on any), and the sides are measured in interleaved rounds. Every forward is timed under
``torch.no_grad()`` (inference). Every moelab row is checked against HF (logits relative error). Prints a Markdown
table; ``--json`` writes the rows; ``--profile T`` adds torch.profiler's top ops of one moelab and one grouped_mm
forward at T, by device time and (on a GPU) by host time: the diagnosis of a gap.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import sys
import time
import traceback
import warnings

import torch

#: Real sizes (from the models' config.json). The vocabulary is --vocab, not the real one.
SHAPES = {
    "qwen3-30b-a3b": dict(family="qwen3_moe", hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                          num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, norm_topk_prob=True),
    "gpt-oss-20b": dict(family="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                        num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        sliding_window=128),
    "tiny": dict(family="qwen3_moe"),
}


def build(shape: str, layers: int, vocab: int, dtype: torch.dtype, device: torch.device):
    """A random causal LM of ``shape``'s sizes with ``layers`` layers (routers scaled, experts O(1))."""
    from moelab.hf.tiny import scale_routers, tiny_config

    sizes = dict(SHAPES[shape])
    family = sizes.pop("family")
    config = tiny_config(family, **sizes)
    config.num_hidden_layers = layers
    if shape != "tiny":
        config.vocab_size = vocab
    if hasattr(config, "layer_types") and config.layer_types is not None:
        kinds = list(dict.fromkeys(config.layer_types))
        config.layer_types = (kinds * layers)[:layers]
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="eager")
    scale_routers(model, generator=torch.Generator().manual_seed(1))
    return model.eval()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_call(fn, device, *, warmup: int = 2, iters: int = 5) -> float:
    """Median seconds of ``fn()`` under ``torch.no_grad()`` (CUDA events on a GPU)."""
    with torch.no_grad():
        return _time_call(fn, device, warmup, iters)


def _time_call(fn, device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class ExpertsTimer:
    """Records (module, args, kwargs, start, end, host start, host end) around every experts module call (CUDA
    events on a GPU, else the host clock; the host clock always too), to split the experts' share out of a whole
    forward. The device is synchronised before each start stamp, as :func:`experts_share` does for the calls made
    alone, so no call's time includes work queued before it."""

    def __init__(self, model):
        from moelab.hf.experts import base_experts

        self.calls, self.handles, self.enabled = [], [], False
        for name, module in model.named_modules():
            if name.endswith(".experts"):
                inner = base_experts(module)
                self.handles.append(inner.register_forward_pre_hook(self._pre, with_kwargs=True))
                self.handles.append(inner.register_forward_hook(self._post))

    def _pre(self, module, args, kwargs):
        if self.enabled:
            _sync(args[0].device)
            self.calls.append([module, args, kwargs, time.perf_counter(), _stamp(args[0].is_cuda), None, None])

    def _post(self, module, args, output):
        if self.enabled:
            call = self.calls[-1]
            call[5], call[6] = _stamp(output.is_cuda), time.perf_counter()

    def seconds(self) -> tuple[float, float]:
        """(device or host seconds, host seconds) of the calls recorded, summed."""
        return (sum(_elapsed(c[4], c[5]) for c in self.calls), sum(c[6] - c[3] for c in self.calls))

    def remove(self):
        for h in self.handles:
            h.remove()


def _stamp(cuda: bool):
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed(start, end) -> float:
    return start.elapsed_time(end) / 1e3 if isinstance(start, torch.cuda.Event) else end - start


def _routing_args(args, kwargs):
    """(hidden_states, top_k_index, top_k_weights) of an experts call, positional or by keyword (GPT-OSS's own
    block passes ``router_indices=``/``routing_weights=``)."""
    x = args[0]
    ids = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
    w = args[2] if len(args) > 2 else kwargs.get("top_k_weights", kwargs.get("routing_weights"))
    return x, ids, w


SHARE_SIDES = ("experts", "fwd_layer", "module", "layer")


def _record(model, ids, device, timer: ExpertsTimer, **forward_kwargs):
    """The experts module calls of one no-grad forward (after a warm one), stamped by ``timer``:
    ``[(module, (x, top_k_index, top_k_weights))]``, each call's layer benchmark arguments ``(packed, x, weights,
    E, K)`` and that call as a closure taking any arguments (a module forward's stand-in)."""
    from moelab.hf.experts import experts_spec, module_weights
    from moelab.moe import routed_moe
    from moelab.packing import pack_topk_ids_weights

    with torch.no_grad():
        model(ids, **forward_kwargs)  # warm
        timer.calls, timer.enabled = [], True
        model(ids, **forward_kwargs)
        _sync(device)
        timer.enabled = False
    recorded = [(m, _routing_args(a, k)) for m, a, k, *_ in timer.calls]
    layer_calls = []
    for module, (x, top_k_index, top_k_weights) in recorded:
        layer = module.__dict__.get("_moelab_layer")
        spec = experts_spec(module)
        weights = module_weights(module, spec, layer.backend if layer is not None else "auto")
        if top_k_weights.shape[-1] != top_k_index.shape[-1]:
            top_k_weights = top_k_weights.gather(1, top_k_index.long())
        packed = pack_topk_ids_weights(top_k_index, top_k_weights, validate=False)
        layer_calls.append((packed, x.contiguous(), weights, spec.num_experts, top_k_index.shape[1]))

    def layer_forward(packed, x, weights, E, K):
        return lambda *args, **kwargs: routed_moe(packed, x, weights, num_experts=E, top_k=K, validate=False)[0]

    return recorded, layer_calls, [layer_forward(*call) for call in layer_calls]


@contextlib.contextmanager
def replaced_forwards(modules, forwards):
    """Inside the block, each of ``modules`` runs its function of ``forwards`` as its forward (an instance
    attribute: hooks still fire); on exit, even by an exception, every module's forward is what it was."""
    saved = [(m, m.__dict__.get("forward")) for m in modules]  # all before any is replaced
    try:
        for m, fn in zip(modules, forwards, strict=True):
            m.forward = fn
        yield
    finally:
        for m, old in saved:
            m.__dict__.pop("forward", None)
            if old is not None:
                m.forward = old


def stand_in_experts(hidden_states, *args, **kwargs):
    """An experts forward that does no expert work: its input back (the experts' output has the input's shape,
    dtype and device: they map H to H), with no kernel and no allocation."""
    return hidden_states


def experts_share(model, ids, device, rounds: int = 10) -> dict[str, float]:
    """The experts' share of one forward against the layer benchmark's call, medians over ``rounds`` (seconds).

    Each round runs, back to back (so host speed drifts alike on every side):

        experts    one forward of ``model``, every experts module call stamped (a device sync, then an event pair)
        fwd_layer  the same forward with each experts module's forward replaced by the layer benchmark's call on
                   the inputs that module got (below), stamped by the same hooks: the forward's context (host caches
                   cold after attention, the module call, the hooks) without moelab.hf's code path
        module     the experts module calls made one by one outside the forward, same inputs, same hooks
        layer      the layer benchmark's call alone (``python -m moelab.bench``: ``moelab.routed_moe`` on packed
                   routing words packed beforehand, ``validate=False``, the module's converted weights)

    each call stamped alike (no side hides its launch time behind queued work). ``experts / layer`` is the
    issue's measure of the integration's cost; ``experts / fwd_layer`` is moelab.hf's own code path in the
    forward (the adapter lookup, weight-cache check and routing hand-over), ``fwd_layer / layer`` what any call
    pays for running inside a forward. Keys: the sides (device time on a GPU, else host) and ``host_<side>`` (host
    time from each call's start to its return, on every device). NaN where no experts module call is seen
    (ModuleList experts and Llama-4's are called by the block directly: no module hooks fire).
    """
    keys = SHARE_SIDES + tuple(f"host_{k}" for k in SHARE_SIDES)
    timer = ExpertsTimer(model)
    recorded, layer_calls, layer_fns = _record(model, ids, device, timer)
    if not recorded:
        timer.remove()
        return dict.fromkeys(keys, math.nan)

    def forward_with_layer_calls():  # each module runs the layer call it got in the recorded forward
        with replaced_forwards([m for m, _ in recorded], layer_fns):
            model(ids)

    times = {k: [] for k in keys}
    with torch.no_grad():
        for i in range(rounds + 1):  # round 0 warms every side
            sides = {}
            for side, run in (("experts", lambda: model(ids)), ("fwd_layer", forward_with_layer_calls),
                              ("module", lambda: [m(*args) for m, args in recorded])):
                timer.calls, timer.enabled = [], True
                run()
                _sync(device)
                timer.enabled = False
                sides[side] = timer.seconds()
            stamps = []
            for (_, x, *_), fn in zip(layer_calls, layer_fns):
                _sync(x.device)
                host = time.perf_counter()
                start = _stamp(x.is_cuda)
                fn()
                stamps.append((start, _stamp(x.is_cuda), host, time.perf_counter()))
            _sync(device)
            sides["layer"] = (sum(_elapsed(a, b) for a, b, _, _ in stamps), sum(d - c for _, _, c, d in stamps))
            if i:
                for side, (seconds, host) in sides.items():
                    times[side].append(seconds)
                    times[f"host_{side}"].append(host)
    timer.remove()
    return {k: statistics.median(v) for k, v in times.items()}


GRAPH_SIDES = ("fwd", "stub", "fwd_layer", "layer")
#: graph_share's times: its sides and the two differences of forwards.
GRAPH_TIMES = GRAPH_SIDES + ("experts", "layer_in_fwd")


def _graph_not_measured(error: str = "") -> dict:
    """A :func:`graph_share` result with nothing timed (NaN times, mode "not timed"), ``error`` saying why."""
    out = dict.fromkeys(GRAPH_TIMES + ("fwd_rel_err",), math.nan)
    out.update(mode="not timed", masks="", error=error)
    return out


def layer_masks(model, ids) -> dict | None:
    """``{layer type: the attention mask the model built for it}`` from one eager forward of ``ids`` (no grad,
    ``use_cache=False``), recorded at its decoder layers, for a model whose config lists ``layer_types``; None
    otherwise. transformers' models take such a mapping as ``attention_mask`` and then build no mask inside the
    forward, so a CUDA-graph capture never sees the mask code (transformers 5.17 builds GPT-OSS's eager mask with a
    host-to-device copy, which a capture refuses)."""
    types = getattr(model.config.get_text_config(), "layer_types", None)
    layers = None
    if types:
        layers = next((m for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)
                       and name.split(".")[-1] == "layers" and len(m) == len(types)), None)
    if layers is None:
        return None
    seen = {}

    def recorder(layer_type):
        def hook(module, args, kwargs):
            seen.setdefault(layer_type, kwargs.get("attention_mask"))
        return hook

    handles = [layer.register_forward_pre_hook(recorder(t), with_kwargs=True) for layer, t in zip(layers, types)]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen if len(seen) == len(set(types)) else None


def _forward_kwargs(model, ids) -> dict:
    """The keywords of graph_share's forwards: ``use_cache=False``, and the masks of :func:`layer_masks` where the
    model takes them and its logits with them are bit for bit its own (else the model builds its masks)."""
    kwargs = dict(use_cache=False)
    masks = layer_masks(model, ids)
    if masks is not None:
        with torch.no_grad():
            own = model(ids, use_cache=False).logits
            try:
                same = torch.equal(model(ids, use_cache=False, attention_mask=masks).logits, own)
            except Exception:  # noqa: BLE001 - a model that takes no mapping builds its own masks
                same = False
        if same:
            kwargs["attention_mask"] = masks
    return kwargs


def graph_share(model, ids, device, *, graph_max_t: int = 1024, rounds: int = 3) -> dict:
    """The experts' share of the moelab forward timed the way ``python -m moelab.bench`` times its call, against
    that call: ``moelab.roofline.median_us`` (``do_bench``: CUDA events around each call, L2 flushed before it) of a
    CUDA-graph replay at T <= ``graph_max_t`` (that benchmark's ``--graph-max-t``; captured after a warm-up on a
    side stream), of the eager call above. Four sides, each one call of the whole:

        fwd    one forward of ``model`` (``use_cache=False``, no grad), moelab's experts
        stub   the same forward with every experts module's forward replaced by :func:`stand_in_experts` (no
               kernel, its input back): attention, router and top-k, shared expert and LM head run as in fwd
        fwd_layer  the same forward with every experts module's forward replaced by its layer call (below, on the
               inputs the recorded forward gave it)
        layer  the layer benchmark's calls of every layer back to back (``routed_moe`` on routing words packed
               beforehand, ``validate=False``, the module's converted weights, the inputs the recorded forward gave)

    ``experts = fwd - stub`` is what the experts calls add to the forward: moelab.hf's own work there (routing
    hand-over, packing) counts, and so do the kernels' effects on their neighbours (L2, launch overlap), while
    the work both forwards share (router, top-k) cancels; ``experts / layer`` is then the integration's cost on
    the device alone, as the layer benchmark measures at this T. Median over ``rounds`` interleaved rounds.
    ``layer_in_fwd = fwd_layer - stub`` is the same difference for the layer call itself, so ``experts /
    layer_in_fwd`` compares moelab.hf's path with the bare call on equal terms (both differences cancel one
    replay's fixed cost, the graph launch and the L2 flush's write-back, which the ``layer`` side pays once).

    A capture fails on any host sync inside it, so a side captured is a side that does not sync. Where the model
    takes them, both forwards get the attention masks of one eager forward (:func:`layer_masks`, used only when the
    logits with them are bit for bit the model's own), so no mask is built under capture; else transformers builds
    them, and while a stream is captured it skips its host-syncing packed-sequence check of ``position_ids`` and
    builds an explicit causal mask (fwd and stub alike). Returns seconds for the sides and ``experts``, NaN
    where not measured (on a CPU, where each side still runs once untimed; no experts module call seen; a failed
    capture: its traceback goes to stderr); ``mode`` ("graph", "eager" or "not timed"), ``masks`` ("given" or
    "built by the forward"), ``error`` (why a side was not measured, "" if none) and ``fwd_rel_err`` (the fwd
    graph's replayed logits against an eager forward's, NaN when not replayed).
    """
    from moelab.lab import rel_err
    from moelab.roofline import graphed, median_us

    out = _graph_not_measured()
    timer = ExpertsTimer(model)
    try:
        recorded, _, layer_fns = _record(model, ids, device, timer, use_cache=False)
    finally:
        timer.remove()  # no hook (a host sync) left in what is captured
    if not recorded:
        out["error"] = "no experts module call seen (the block calls moelab directly)"
        return out
    modules = [m for m, _ in recorded]
    kwargs = _forward_kwargs(model, ids)
    out["masks"] = "given" if "attention_mask" in kwargs else "built by the forward"

    def fwd():
        return model(ids, **kwargs).logits

    def stub():
        with replaced_forwards(modules, [stand_in_experts] * len(modules)):
            return model(ids, **kwargs).logits

    def fwd_layer():
        with replaced_forwards(modules, layer_fns):
            return model(ids, **kwargs).logits

    def layer():
        return [fn() for fn in layer_fns]

    sides = dict(fwd=fwd, stub=stub, fwd_layer=fwd_layer, layer=layer)
    with torch.no_grad():
        if device.type != "cuda":
            for fn in sides.values():  # the paths run (a test counts their calls); CPU times are not the GPU's
                fn()
            return out
        out["mode"] = "graph" if ids.numel() <= graph_max_t else "eager"
        timed, errors = {}, []
        for name, fn in sides.items():
            try:
                timed[name] = graphed(fn, device) if out["mode"] == "graph" else fn
            except Exception as e:  # noqa: BLE001 - one side that cannot be captured must not lose the bench
                errors.append(f"{name}: {_reason(e)}")
                traceback.print_exc(file=sys.stderr)
        out["error"] = "; ".join(errors)
        if "fwd" in timed and out["mode"] == "graph":
            timed["fwd"]()
            out["fwd_rel_err"] = rel_err(timed["fwd"].out, fwd())
        times = {name: [] for name in timed}
        for _ in range(rounds):
            for name, fn in timed.items():
                times[name].append(median_us(fn, device) / 1e6)
    out.update({name: statistics.median(v) for name, v in times.items()})
    out["experts"] = out["fwd"] - out["stub"]
    out["layer_in_fwd"] = out["fwd_layer"] - out["stub"]
    return out


def _reason(e: BaseException) -> str:
    """The first line of ``e`` and of the exceptions it was raised during (a failed capture's first error is
    raised again as a capture error at the block's end)."""
    parts = []
    while e is not None and len(parts) < 3:
        parts.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        e = e.__context__
    return " <- ".join(parts)


def _share_line(T, share: dict[str, float], graph: dict | None = None) -> str:
    """The stderr lines of :func:`experts_share`'s numbers (ms, device and host time) and, when given,
    :func:`graph_share`'s."""
    ms = {k: v * 1e3 for k, v in share.items()}
    names = dict(experts="experts in the forward", fwd_layer="layer calls in the forward",
                 module="experts module calls alone", layer="layer calls alone")
    sides = ", ".join(f"{names[k]} {ms[k]:.3g} ms (host {ms['host_' + k]:.3g})" for k in SHARE_SIDES)
    line = (f"# experts share T={T}: {sides}; experts/fwd_layer {ms['experts'] / ms['fwd_layer']:.2f} (moelab.hf's "
            f"path), fwd_layer/layer {ms['fwd_layer'] / ms['layer']:.2f} (the forward's context)")
    if graph is None:
        return line
    g = {k: graph[k] * 1e3 for k in GRAPH_TIMES}
    line += (f"\n# experts share T={T}, timed as moelab.bench ({graph['mode']}): forward {g['fwd']:.3g} ms, forward "
             f"with stand-in experts {g['stub']:.3g} ms, experts (the difference) {g['experts']:.3g} ms, layer calls "
             f"alone {g['layer']:.3g} ms, layer calls in the forward (the difference) {g['layer_in_fwd']:.3g} ms; "
             f"{graph['mode']} experts/layer {g['experts'] / g['layer']:.2f}, experts/layer_in_fwd "
             f"{g['experts'] / g['layer_in_fwd']:.2f}; replayed "
             f"logits vs eager {graph['fwd_rel_err']:.1e}; attention masks {graph['masks'] or 'n/a'}")
    if graph["error"]:
        line += f"\n#   not measured: {graph['error']}"
    return line


def generate_tokens_per_s(model, prompt, new_tokens: int, device) -> float:
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(prompt, **kwargs)  # warm
        _sync(device)
        t0 = time.perf_counter()
        model.generate(prompt, **kwargs)
        _sync(device)
    return new_tokens / (time.perf_counter() - t0)


def _peft(model, rank: int):
    import peft

    block = next(n for n, _ in model.named_modules() if n.endswith(".experts")).split(".")[-2]
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[], init_lora_weights=False,
                             target_parameters=[f"{block}.experts.gate_up_proj", f"{block}.experts.down_proj"])
    torch.manual_seed(2)
    pm = peft.get_peft_model(model, config).eval()
    with torch.no_grad():  # keep the adapter's effect O(1) at real sizes
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.mul_(0.1)
    return pm


def run(args) -> list[dict]:
    import moelab.hf  # noqa: F401  (registers the experts implementations)
    from moelab.lab import rel_err

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    base = build(args.shape, args.layers, args.vocab, dtype, device)
    models = {"eager": base}
    for impl in ("grouped_mm",):
        m = copy.deepcopy(base)
        try:
            m.set_experts_implementation(impl)
            models[impl] = m
        except Exception as e:  # e.g. no grouped_mm on this torch/device
            print(f"# {impl}: not available here ({type(e).__name__}: {e})", file=sys.stderr)
    patched = copy.deepcopy(base)
    report = moelab.hf.patch_model(patched, backend=args.backend)
    models["moelab"] = patched
    print(f"# {report}".replace("\n", "\n# "), file=sys.stderr)
    if args.lora_rank:
        reference = models.get("grouped_mm", base)
        models["peft"] = _peft(copy.deepcopy(reference), args.lora_rank)
        lora = _peft(copy.deepcopy(base), args.lora_rank)
        moelab.hf.patch_model(lora, backend=args.backend)
        models["moelab+lora"] = lora
    rows = []
    for T in args.tokens:
        ids = torch.randint(3, min(args.vocab, base.config.vocab_size), (1, T), device=device,
                            generator=torch.Generator(device).manual_seed(T) if device.type == "cuda" else None)
        truth = {}
        for name, model in models.items():
            if name == "eager" and T > args.eager_max_tokens:
                continue
            with torch.no_grad():
                logits = model(ids).logits
            seconds = time_call(lambda m=model, x=ids: m(x), device, iters=args.iters)
            row = dict(shape=args.shape, layers=args.layers, T=T, impl=name, ms=seconds * 1e3)
            ref_name = "peft" if name == "moelab+lora" else "grouped_mm" if "grouped_mm" in models else "eager"
            if name in ("eager", "grouped_mm", "peft"):
                truth[name] = logits
            if name.startswith("moelab") and ref_name in truth:
                row["rel_err_vs"] = f"{rel_err(logits, truth[ref_name]):.1e} vs {ref_name}"
            if name == "moelab":
                share = experts_share(model, ids, device, rounds=max(2 * args.iters, 10))
                try:
                    graph = graph_share(model, ids, device, graph_max_t=args.graph_max_t)
                except Exception as e:  # noqa: BLE001 - the rest of the run (and its JSON) must not be lost
                    traceback.print_exc(file=sys.stderr)
                    graph = _graph_not_measured(f"graph_share: {_reason(e)}")
                if not math.isnan(share["experts"]):
                    row.update({f"{k}_ms": v * 1e3 for k, v in share.items()})
                    row["experts/layer"] = f"{share['experts'] / share['layer']:.2f}"
                    row.update({f"graph_{k}_ms": graph[k] * 1e3 for k in GRAPH_TIMES})
                    row["graph_experts/layer"] = f"{graph['experts'] / graph['layer']:.2f}"
                    row["graph_experts/layer_in_fwd"] = f"{graph['experts'] / graph['layer_in_fwd']:.2f}"
                    row.update(graph_mode=graph["mode"], graph_fwd_rel_err=graph["fwd_rel_err"],
                               graph_masks=graph["masks"], graph_error=graph["error"])
                    print(_share_line(T, share, graph), file=sys.stderr)
            rows.append(row)
    if args.profile:
        profile_forward({k: models[k] for k in ("grouped_mm", "moelab") if k in models}, args.profile, base, device)
    if args.generate:
        prompt = torch.randint(3, 100, (1, args.prompt), device=device)
        for name in ("grouped_mm", "eager", "moelab"):
            if name in models:
                rows.append(dict(shape=args.shape, layers=args.layers, T=f"generate {args.generate}", impl=name,
                                 tokens_per_s=generate_tokens_per_s(models[name], prompt, args.generate, device)))
    return rows


def profile_forward(models: dict, T: int, base, device, top: int = 15) -> None:
    """Print (stderr) torch.profiler's ``top`` ops by self device time (CPU time on a CPU; on a GPU by self host
    time too) of one no-grad forward of T tokens for each model, with the op count: where one forward spends more
    than another."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(3, base.config.vocab_size, (1, T), device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for name, model in models.items():
        with torch.no_grad():
            model(ids)
            _sync(device)
            with profile(activities=activities) as prof:
                model(ids)
                _sync(device)
        events = prof.key_averages()
        ops = sum(e.count for e in events if e.key.startswith("aten::"))
        print(f"# profile {name} T={T}: {ops} aten ops\n" + events.table(sort_by=sort, row_limit=top),
              file=sys.stderr)
        if device.type == "cuda":  # where the host's time goes (the share of small T is host-bound)
            print(f"# profile {name} T={T}, by host time\n" + events.table(sort_by="self_cpu_time_total",
                                                                            row_limit=top), file=sys.stderr)


#: The table's columns: row key -> header. "eager": :func:`experts_share` (each experts call stamped alone, host
#: time included); "graph": :func:`graph_share` (whole forwards as moelab.bench times its call: a CUDA-graph replay
#: at T <= --graph-max-t, eager above, the "timed as" column).
COLUMNS = {"shape": "shape", "layers": "layers", "T": "T", "impl": "impl", "ms": "ms",
           "experts_ms": "eager: experts in fwd, ms", "fwd_layer_ms": "eager: layer calls in fwd, ms",
           "layer_ms": "eager: layer calls alone, ms", "experts/layer": "eager experts/layer",
           "graph_mode": "graph: timed as", "graph_experts_ms": "graph: fwd - fwd with stand-in experts, ms",
           "graph_layer_ms": "graph: layer calls alone, ms", "graph_experts/layer": "graph experts/layer",
           "graph_experts/layer_in_fwd": "graph experts/(fwd with layer calls - stand-in)",
           "tokens_per_s": "tokens_per_s", "rel_err_vs": "rel_err_vs"}


def markdown(rows: list[dict]) -> str:
    from moelab.lab import markdown_table

    return markdown_table([{head: row.get(k, "") for k, head in COLUMNS.items()} for row in rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; gpt-oss 2)")
    parser.add_argument("--tokens", default=None, help="comma-separated T, one sequence of T tokens (1,128,4096)")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None)
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--lora-rank", type=int, default=16, help="0: no PEFT rows")
    parser.add_argument("--generate", type=int, default=None, help="greedy new tokens for tokens/s (32; 0: skip)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--iters", type=int, default=None, help="timed calls per row, median (10; --tiny 2)")
    parser.add_argument("--eager-max-tokens", type=int, default=1024, help="skip the (slow) eager loop above this T")
    parser.add_argument("--graph-max-t", type=int, default=None, help="graph sides of the experts' share as CUDA-graph "
                        "replays for T <= this, eager above (default: python -m moelab.bench's, 1024)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tiny", action="store_true", help="toy sizes on any device (a smoke run)")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--profile", type=int, default=0, help="T: print torch.profiler's top ops of one moelab and "
                        "one grouped_mm forward (stderr)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.shape, args.prompt, args.lora_rank = "tiny", 4, min(args.lora_rank, 4)
    big = not args.tiny
    args.tokens = args.tokens or ("1,128,4096" if big else "1,8")
    args.iters = args.iters or (10 if big else 2)
    args.generate = (32 if big else 4) if args.generate is None else args.generate
    args.layers = args.layers or (2 if args.shape == "gpt-oss-20b" else 4 if args.shape != "tiny" else 2)
    args.dtype = args.dtype or ("bf16" if torch.cuda.is_available() and not args.tiny else "fp32")
    args.tokens = [int(t) for t in str(args.tokens).split(",")]
    if args.graph_max_t is None:
        from moelab.bench.cli import build_parser

        args.graph_max_t = build_parser().get_default("graph_max_t")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    rows = run(args)
    print(markdown(rows))
    import peft

    print(f"\ntorch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
