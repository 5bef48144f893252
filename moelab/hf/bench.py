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
and the host times). Then greedy ``generate()`` tokens/s. Every
side is stamped alike: the device is synchronised before each call's start event, so each call is timed from an
empty queue (its host launch time included on every side, no earlier work queued in front of it on any), and the
sides are measured in interleaved rounds. Every forward is timed under ``torch.no_grad()`` (inference). Every
moelab row is checked against HF (logits relative error). Prints a Markdown table; ``--json`` writes the rows;
``--profile T`` adds torch.profiler's top ops of one moelab and one grouped_mm forward at T, by device time and (on
a GPU) by host time: the diagnosis of a gap.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
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
    from moelab.hf.experts import experts_spec, module_weights
    from moelab.moe import routed_moe
    from moelab.packing import pack_topk_ids_weights

    keys = SHARE_SIDES + tuple(f"host_{k}" for k in SHARE_SIDES)
    timer = ExpertsTimer(model)
    with torch.no_grad():
        model(ids)  # warm
        timer.calls, timer.enabled = [], True
        model(ids)
        _sync(device)
        timer.enabled = False
    recorded = [(m, _routing_args(a, k)) for m, a, k, *_ in timer.calls]
    if not recorded:
        timer.remove()
        return dict.fromkeys(keys, math.nan)
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

    layer_fns = [layer_forward(*call) for call in layer_calls]  # each module's call, as the layer benchmark makes it

    def forward_with_layer_calls():  # each module runs the layer call it got in the recorded forward
        saved = [m.__dict__.get("forward") for m, _ in recorded]
        try:
            for (m, _), fn in zip(recorded, layer_fns):
                m.forward = fn
            model(ids)
        finally:
            for (m, _), old in zip(recorded, saved):
                m.__dict__.pop("forward", None)
                if old is not None:
                    m.forward = old

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


def _share_line(T, share: dict[str, float]) -> str:
    """One stderr line of :func:`experts_share`'s numbers (ms), device and host time."""
    ms = {k: v * 1e3 for k, v in share.items()}
    names = dict(experts="experts in the forward", fwd_layer="layer calls in the forward",
                 module="experts module calls alone", layer="layer calls alone")
    sides = ", ".join(f"{names[k]} {ms[k]:.3g} ms (host {ms['host_' + k]:.3g})" for k in SHARE_SIDES)
    return (f"# experts share T={T}: {sides}; experts/fwd_layer {ms['experts'] / ms['fwd_layer']:.2f} (moelab.hf's "
            f"path), fwd_layer/layer {ms['fwd_layer'] / ms['layer']:.2f} (the forward's context)")


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
                if not math.isnan(share["experts"]):
                    row.update({f"{k}_ms": v * 1e3 for k, v in share.items()})
                    row["experts/layer"] = f"{share['experts'] / share['layer']:.2f}"
                    print(_share_line(T, share), file=sys.stderr)
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


def markdown(rows: list[dict]) -> str:
    from moelab.lab import markdown_table

    keys = ["shape", "layers", "T", "impl", "ms", "experts_ms", "fwd_layer_ms", "layer_ms", "experts/layer",
            "tokens_per_s", "rel_err_vs"]
    return markdown_table([{k: row.get(k, "") for k in keys} for row in rows])


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
