"""The whole-model benchmark runs end to end at toy sizes (its numbers mean nothing on a CPU) and checks itself."""

import json

import pytest

import moelab  # noqa: F401  (first: Triton's interpreter set-up)

pytest.importorskip("transformers")
pytest.importorskip("peft")


def test_bench_tiny(tmp_path, capsys):
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
    assert any("tokens_per_s" in r for r in rows)
    printed = capsys.readouterr()
    assert "| moelab |" in printed.out and "experts/layer" in printed.out
    assert "# experts share T=3: experts in the forward" in printed.err
    assert "# profile moelab T=3" in printed.err and "# profile grouped_mm T=3" in printed.err


def test_experts_share_times_each_side_on_the_same_calls(monkeypatch):
    """experts_share's four sides run what they say: the layer benchmark's packed-word call once per layer in the
    forward (fwd_layer) and once alone per round, the HF path's (ids, weights) call in the forward and alone; the
    model's own experts forward is back afterwards (the same logits on other tokens)."""
    import torch

    from moelab import moe
    from moelab.hf import bench
    from moelab.hf.tiny import tiny_causal_lm

    model = tiny_causal_lm("qwen3_moe")  # 2 MoE layers
    moelab.patch_model(model, backend="torch")
    ids, other = torch.randint(3, 100, (2, 1, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(other).logits
    calls = {"packed": 0, "tuple": 0}
    real = moe.routed_moe

    def counting(topk, *args, **kwargs):
        calls["tuple" if isinstance(topk, tuple) else "packed"] += 1
        return real(topk, *args, **kwargs)

    monkeypatch.setattr(moe, "routed_moe", counting)
    monkeypatch.setattr("moelab.hf.experts.routed_moe", counting)
    rounds = 3
    share = bench.experts_share(model, ids, torch.device("cpu"), rounds=rounds)
    assert calls["packed"] == (rounds + 1) * 2 * 2  # fwd_layer and layer, 2 layers, every round (+1 warm)
    assert calls["tuple"] == 2 * 2 + (rounds + 1) * 2 * 2  # 2 recording forwards, then experts and module
    assert all(share[k] > 0 for k in bench.SHARE_SIDES), share
    with torch.no_grad():
        assert torch.equal(model(other).logits, before)
