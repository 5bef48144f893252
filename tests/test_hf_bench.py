"""The whole-model benchmark runs end to end at toy sizes (its numbers mean nothing on a CPU) and checks itself."""

import json
import math

import pytest

import moelab  # noqa: F401  (first: Triton's interpreter set-up)

pytest.importorskip("transformers")
pytest.importorskip("peft")


def test_bench_tiny(tmp_path, capsys):
    import torch

    from moelab.hf import bench

    out = tmp_path / "rows.json"
    assert bench.main(["--tiny", "--tokens", "3", "--iters", "1", "--generate", "2", "--json", str(out),
                       "--profile", "3"]) == 0
    rows = json.loads(out.read_text())
    impls = {r["impl"] for r in rows if r["T"] == 3}
    assert {"eager", "grouped_mm", "moelab", "peft", "moelab+lora"} <= impls
    for row in rows:
        if row["impl"].startswith("moelab") and "rel_err_vs" in row:
            assert float(row["rel_err_vs"].split()[0]) < 1e-4, row  # moelab agrees with HF / PEFT
    moelab_row = next(r for r in rows if r["impl"] == "moelab" and r["T"] == 3)
    sides = ("experts", "fwd_layer", "module", "layer")
    assert all(moelab_row[f"{k}_ms"] > 0 and moelab_row[f"host_{k}_ms"] > 0 for k in sides), moelab_row
    assert float(moelab_row["experts/layer"]) == pytest.approx(moelab_row["experts_ms"] / moelab_row["layer_ms"],
                                                               abs=0.01)
    graph_ms = [moelab_row[f"graph_{k}_ms"] for k in ("fwd", "stub", "layer")]
    if torch.cuda.is_available():
        assert moelab_row["graph_mode"] == "graph" and all(v > 0 for v in graph_ms), moelab_row
    else:  # no CUDA graphs on a CPU
        assert moelab_row["graph_mode"] == "not timed" and all(math.isnan(v) for v in graph_ms), moelab_row
    assert any("tokens_per_s" in r for r in rows)
    printed = capsys.readouterr()
    assert "| moelab |" in printed.out and "| eager experts/layer |" in printed.out
    assert "| graph: fwd - fwd with stand-in experts, ms |" in printed.out and "graph experts/layer" in printed.out
    assert "# experts share T=3: experts in the forward" in printed.err
    assert f"# experts share T=3, timed as moelab.bench ({moelab_row['graph_mode']}): forward " in printed.err
    assert "# profile moelab T=3" in printed.err and "# profile grouped_mm T=3" in printed.err


def test_experts_share_times_each_side_on_the_same_calls(monkeypatch):
    """experts_share's four sides run what they say: the layer benchmark's packed-word call once per layer in the
    forward (fwd_layer) and once alone per round, the HF path's (ids, weights) call in the forward and alone; the
    model's own experts forward is back afterwards (the same logits on other tokens)."""
    import torch

    from moelab.hf import bench
    from moelab.hf.tiny import tiny_causal_lm

    model = tiny_causal_lm("qwen3_moe")  # 2 MoE layers
    moelab.patch_model(model, backend="torch")
    ids, other = torch.randint(3, 100, (2, 1, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(other).logits
    calls = _counting_routed_moe(monkeypatch)
    rounds = 3
    share = bench.experts_share(model, ids, torch.device("cpu"), rounds=rounds)
    assert calls["packed"] == (rounds + 1) * 2 * 2  # fwd_layer and layer, 2 layers, every round (+1 warm)
    assert calls["tuple"] == 2 * 2 + (rounds + 1) * 2 * 2  # 2 recording forwards, then experts and module
    assert all(share[k] > 0 for k in bench.SHARE_SIDES), share
    with torch.no_grad():
        assert torch.equal(model(other).logits, before)


def _counting_routed_moe(monkeypatch):
    """Counts of moelab.routed_moe calls by routing form: "tuple" (moelab.hf's experts path) and "packed" (the
    layer benchmark's call)."""
    from moelab import moe

    calls = {"packed": 0, "tuple": 0}
    real = moe.routed_moe

    def counting(topk, *args, **kwargs):
        calls["tuple" if isinstance(topk, tuple) else "packed"] += 1
        return real(topk, *args, **kwargs)

    monkeypatch.setattr(moe, "routed_moe", counting)
    monkeypatch.setattr("moelab.hf.experts.routed_moe", counting)
    return calls


def _patched_tiny(device="cpu", dtype=None, backend="torch", family="qwen3_moe"):
    import torch

    from moelab.hf.tiny import tiny_causal_lm

    model = tiny_causal_lm(family, dtype=dtype or torch.float32).to(device)  # 2 MoE layers
    moelab.patch_model(model, backend=backend)
    return model


def _experts_modules(model):
    from moelab.hf.experts import base_experts

    return [base_experts(m) for name, m in model.named_modules() if name.endswith(".experts")]


def test_graph_share_runs_each_side_once_on_a_cpu_and_the_stand_in_does_no_expert_work(monkeypatch):
    """Off CUDA graph_share times nothing (NaN) but runs its four sides once: the real forward (moelab.hf's
    experts path in each layer), the stand-in forward (no experts call at all), the forward with the layer calls in
    place of the experts and the layer calls alone (one packed call per layer each); every experts module has its
    own forward back afterwards."""
    import math

    import torch

    from moelab.hf import bench

    model = _patched_tiny()
    ids, other = torch.randint(3, 100, (2, 1, 5), generator=torch.Generator().manual_seed(1))
    forwards = [m.__dict__.get("forward") for m in _experts_modules(model)]  # patch_model's instance forwards
    assert all(f is not None for f in forwards)
    with torch.no_grad():
        before = model(other).logits
    calls = _counting_routed_moe(monkeypatch)
    share = bench.graph_share(model, ids, torch.device("cpu"))
    assert calls["tuple"] == 2 * 2 + 2  # the warm and the recorded forward, then fwd; the stand-in forward: none
    assert calls["packed"] == 2 + 2  # fwd_layer and the layer side: one call per layer each
    assert all(math.isnan(share[k]) for k in (*bench.GRAPH_SIDES, "experts", "layer_in_fwd", "fwd_rel_err")), share
    assert share["mode"] == "not timed" and share["error"] == ""
    assert [m.__dict__.get("forward") for m in _experts_modules(model)] == forwards
    with torch.no_grad():
        assert torch.equal(model(other).logits, before)


def test_stand_in_experts_have_the_experts_output_and_replaced_forwards_restores(monkeypatch):
    """Under replaced_forwards with the stand-in, the forward makes no experts call, each experts call returns a
    tensor of the real call's shape, dtype and device, and the module hooks still fire; on leaving (also by an
    exception) each module's forward is what it was: patch_model's instance forward, also for a module listed
    twice, or the class's."""
    import torch

    from moelab.hf import bench

    model = _patched_tiny()
    modules = _experts_modules(model)
    assert len(modules) == 2
    forwards = [m.__dict__["forward"] for m in modules]
    ids = torch.randint(3, 100, (1, 7), generator=torch.Generator().manual_seed(2))
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append((out.shape, out.dtype, out.device)))
             for m in modules]
    with torch.no_grad():
        before = model(ids).logits
        real = list(seen)
        calls = _counting_routed_moe(monkeypatch)
        seen.clear()
        with bench.replaced_forwards(modules, [bench.stand_in_experts] * 2):
            stub_logits = model(ids).logits
        assert calls["tuple"] == 0 and seen == real  # no expert work; the experts' own output shape/dtype/device
        assert stub_logits.shape == before.shape and not torch.equal(stub_logits, before)
        with pytest.raises(RuntimeError, match="inside"):
            with bench.replaced_forwards(modules, [bench.stand_in_experts] * 2):
                raise RuntimeError("inside")
        assert [m.__dict__["forward"] for m in modules] == forwards
        assert torch.equal(model(ids).logits, before) and calls["tuple"] == 2
        with bench.replaced_forwards([modules[0], modules[0], modules[1]], [bench.stand_in_experts] * 3):
            model(ids)
        assert [m.__dict__["forward"] for m in modules] == forwards
        assert torch.equal(model(ids).logits, before) and calls["tuple"] == 4
    for h in hooks:
        h.remove()
    linear = torch.nn.Linear(3, 3)  # no instance forward: the class's comes back
    with bench.replaced_forwards([linear], [bench.stand_in_experts]):
        assert linear(torch.ones(2, 3)).shape == (2, 3) and torch.equal(linear(torch.ones(2, 3)), torch.ones(2, 3))
    assert "forward" not in linear.__dict__ and not torch.equal(linear(torch.ones(2, 3)), torch.ones(2, 3))


def test_graph_share_default_is_the_layer_benchmarks_graph_limit():
    """The bench's --graph-max-t defaults to python -m moelab.bench's (graph replays at T <= 1024 there)."""
    from moelab.bench.cli import build_parser
    from moelab.hf import bench

    args = []
    real_run = bench.run
    try:
        bench.run = lambda a: args.append(a) or []
        bench.main(["--tiny", "--tokens", "1", "--lora-rank", "0", "--generate", "0"])
    finally:
        bench.run = real_run
    assert args[0].graph_max_t == build_parser().get_default("graph_max_t") == 1024


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="CUDA graphs need a GPU")
def test_graph_share_captures_the_forward_on_a_gpu():
    """On a GPU the three sides are captured and replayed (nothing in the forward syncs the host: a capture fails
    on a sync), the replayed forward's logits are the eager forward's (bf16: transformers builds its causal mask
    under capture, SDPA may pick another kernel), the stand-in forward is faster than the real one; above
    graph_max_t the sides are timed eagerly."""
    import math

    import torch

    from moelab.hf import bench

    model = _patched_tiny("cuda", torch.bfloat16, backend="auto")
    forwards = [m.__dict__.get("forward") for m in _experts_modules(model)]
    ids = torch.randint(3, 100, (1, 16), device="cuda")
    share = bench.graph_share(model, ids, torch.device("cuda"), graph_max_t=1024)
    assert share["mode"] == "graph" and share["error"] == "", share
    assert all(share[k] > 0 for k in bench.GRAPH_SIDES), share
    assert share["fwd"] > share["stub"] and share["fwd_layer"] > share["stub"] and share["fwd_rel_err"] < 3e-2, share
    eager = bench.graph_share(model, ids, torch.device("cuda"), graph_max_t=8)
    assert eager["mode"] == "eager" and eager["error"] == "" and math.isnan(eager["fwd_rel_err"]), eager
    assert all(eager[k] > 0 for k in bench.GRAPH_SIDES), eager
    assert [m.__dict__.get("forward") for m in _experts_modules(model)] == forwards


def test_graph_share_gives_the_forward_its_own_attention_masks(monkeypatch):
    """GPT-OSS (sliding and full attention layers): layer_masks records each layer type's mask from an eager
    forward, and graph_share's forwards take them (so no mask is built under a capture) only because they give the
    model's own logits bit for bit; masks that do not (the two types swapped) are not used."""
    import torch

    from moelab.hf import bench
    from moelab.hf.tiny import tiny_causal_lm

    model = tiny_causal_lm("gpt_oss")
    moelab.patch_model(model, backend="torch")
    T = 2 * model.config.sliding_window  # longer than the window: the two types' masks differ
    ids = torch.randint(3, 100, (1, T), generator=torch.Generator().manual_seed(2))
    masks = bench.layer_masks(model, ids)
    assert set(masks) == {"sliding_attention", "full_attention"}
    assert not torch.equal(masks["sliding_attention"], masks["full_attention"])
    kwargs = bench._forward_kwargs(model, ids)
    assert kwargs["attention_mask"] is not None and kwargs["use_cache"] is False
    with torch.no_grad():
        assert torch.equal(model(ids, **kwargs).logits, model(ids, use_cache=False).logits)
    layers, types = model.model.layers, model.config.layer_types
    given = []  # (layer type, the mask that layer got) in graph_share's forwards

    def seen(layer_type):
        return lambda module, args, kw: given.append((layer_type, kw.get("attention_mask")))

    handles = [layer.register_forward_pre_hook(seen(t), with_kwargs=True) for layer, t in zip(layers, types)]
    real_layer_masks = bench.layer_masks
    monkeypatch.setattr(bench, "layer_masks", lambda model, ids: masks)  # these very tensors, to follow them
    try:
        got = bench.graph_share(model, ids, torch.device("cpu"))
    finally:
        for h in handles:
            h.remove()
        monkeypatch.setattr(bench, "layer_masks", real_layer_masks)
    assert got["masks"] == "given"
    # the last three forwards are fwd's, stub's and fwd_layer's: every layer of each got the recorded mask of its
    # type (the very tensor: a mask the forward built itself would be equal, not the same)
    last = given[-3 * len(layers):]
    assert len(last) == 3 * len(layers) and all(mask is masks[layer_type] for layer_type, mask in last), last
    swapped = {"sliding_attention": masks["full_attention"], "full_attention": masks["sliding_attention"]}
    monkeypatch.setattr(bench, "layer_masks", lambda model, ids: swapped)
    assert "attention_mask" not in bench._forward_kwargs(model, ids)
    assert bench.graph_share(model, ids, torch.device("cpu"))["masks"] == "built by the forward"


def test_a_failing_graph_share_does_not_lose_the_run(tmp_path, monkeypatch, capsys):
    """graph_share raising (say, a capture that leaves CUDA in a bad state) costs its own keys only: the run goes on,
    the row carries the reason, the JSON is written."""
    from moelab.hf import bench

    def broken(*args, **kwargs):
        raise RuntimeError("capture went wrong")

    monkeypatch.setattr(bench, "graph_share", broken)
    out = tmp_path / "rows.json"
    assert bench.main(["--tiny", "--tokens", "3", "--iters", "1", "--generate", "0", "--json", str(out)]) == 0
    row = next(r for r in json.loads(out.read_text()) if r["impl"] == "moelab")
    assert row["graph_error"] == "graph_share: RuntimeError: capture went wrong" and row["experts_ms"] > 0, row
    assert "RuntimeError: capture went wrong" in capsys.readouterr().err


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="CUDA graphs need a GPU")
def test_graph_share_captures_gpt_oss_with_its_masks_given_on_a_gpu():
    """GPT-OSS (sliding and full attention) is captured with the masks of an eager forward given (transformers 5.17
    builds its eager mask with a host copy that a capture refuses) and its replay is the eager forward's."""
    import torch

    from moelab.hf import bench

    model = _patched_tiny("cuda", torch.bfloat16, backend="auto", family="gpt_oss")
    ids = torch.randint(3, 100, (1, 2 * model.config.sliding_window), device="cuda")
    share = bench.graph_share(model, ids, torch.device("cuda"), graph_max_t=1024)
    assert share["masks"] == "given" and share["mode"] == "graph" and share["error"] == "", share
    assert all(share[k] > 0 for k in bench.GRAPH_SIDES) and share["fwd_rel_err"] < 1e-3, share
