"""moelab.bench (the CLI's tiny mode through its function API; CPU: Triton's interpreter) and moelab.roofline."""

import doctest
import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch

import moelab.reference
import moelab.roofline
from moelab import bench
from moelab.bench import impls, peers, runner

REQUIRED_BASE = ("moelab torch", "moelab triton", "naive loop", "torch grouped_mm", "HF eager", "HF grouped_mm")
HAVE_PEFT = importlib.util.find_spec("peft") is not None
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _rows(res, mode):
    return [r for r in res["rows"] if r["mode"] == mode]


def test_tiny_base(tmp_path):
    out = tmp_path / "bench.json"
    res = bench.run(["--tiny", "--cpu-reps", "1", "--out", str(out)])
    rows = _rows(res, "base")
    assert {r["T"] for r in rows} == {1, 8}
    for name in REQUIRED_BASE if HAVE_TRANSFORMERS else REQUIRED_BASE[:4]:
        got = [r for r in rows if r["impl"] == name]
        assert len(got) == 2, name
        for r in got:
            assert r.get("check") == "ok", r
            assert r["checked_tokens"] == r["T"] and r["all_finite"], r  # T <= --check-tokens: every token
            assert r["rel_err"] < 1e-2 and r["median_us"] > 0 and r["floor_us"] > 0 and r["x_floor"] > 0
            assert math.isclose(r["vs_moelab_triton"] * [m for m in rows if m["impl"] == "moelab triton"
                                                          and m["T"] == r["T"]][0]["median_us"], r["median_us"])
    # every row either measured, or says why not; nothing failed, so the CLI would exit 0
    assert all("median_us" in r or r.get("skipped") for r in rows), rows
    assert bench.failures(res) == []
    assert res["ceilings"]["bandwidth"] > 0 and res["ceilings"]["matmul_flops"] > 0
    # the files: JSON as returned, markdown tables with a row per T
    saved = json.loads(out.read_text())
    assert len(saved["rows"]) == len(res["rows"])
    md = (tmp_path / "bench.md").read_text()
    assert md == res["markdown"]
    assert "| T | touched | floor µs | moelab triton |" in md
    assert "\n| 1 |" in md and "\n| 8 |" in md
    assert "Command: `python -m moelab.bench --tiny" in md
    assert "Kernel switches: MOELAB_GLUON=" in md  # which kernels the process could pick


def test_tiny_lora(tmp_path):
    res = bench.run(["--tiny", "--lora", "--lora-variants", "1x all,3x mixed half", "--tokens", "4", "--cpu-reps",
                     "1", "--impls", "LoRAExperts,unfused,PEFT", "--no-ceilings", "--out", str(tmp_path / "l.json")])
    rows = {(r["impl"], r["variant"]): r for r in _rows(res, "lora")}
    expected = [("moelab LoRAExperts", v) for v in ("ids=-1", "1x all", "3x mixed half")]
    expected += [("unfused LoRA (grouped_mm)", "1x all"), ("unfused LoRA (grouped_mm)", "3x mixed half")]
    expected += [("HF grouped_mm + PEFT", "1x all")] if HAVE_PEFT else []
    for key in expected:
        assert rows[key].get("check") == "ok", rows[key]
    # tokens without an adapter: bit for bit the base path (all of them for ids=-1, half for "half")
    assert rows[("moelab LoRAExperts", "ids=-1")]["base_rows_bitwise"] is True
    assert rows[("moelab LoRAExperts", "3x mixed half")]["base_rows_bitwise"] is True
    assert "base_rows_bitwise" not in rows[("moelab LoRAExperts", "1x all")]  # no -1 token there
    assert bench.failures(res) == []
    # LoRA adds bytes and FLOPs to the floor; the mixed bank has ranks 64, 32, 16
    assert rows[("moelab LoRAExperts", "1x all")]["floor_us"] > rows[("moelab LoRAExperts", "ids=-1")]["floor_us"]
    assert rows[("moelab LoRAExperts", "3x mixed half")]["lora_pairs"] > 0


def test_tiny_lora_paths(tmp_path):
    """``--lora-paths`` times each forced path, checked like the default row; a path the bank cannot take is
    skipped (the mixed bank is too wide for the fused paths), not an error."""
    res = bench.run(["--tiny", "--lora", "--lora-variants", "1x all,3x mixed", "--tokens", "2", "--cpu-reps", "1",
                     "--lora-paths", "tiles,flow-per-slot", "--peers", "none", "--no-ceilings",
                     "--out", str(tmp_path / "p.json")])
    rows = {(r["impl"], r["variant"]): r for r in _rows(res, "lora")}
    for key in [("moelab LoRAExperts [tiles]", "1x all"), ("moelab LoRAExperts [flow-per-slot]", "1x all"),
                ("moelab LoRAExperts [flow-per-slot]", "3x mixed")]:
        assert rows[key].get("check") == "ok", rows[key]
    assert "stacked columns" in rows[("moelab LoRAExperts [tiles]", "3x mixed")]["skipped"]
    assert ("moelab LoRAExperts", "1x all") not in rows and bench.failures(res) == []


def _broken(monkeypatch, how):
    """moelab's naive-loop peer replaced by one that is wrong in the way ``how`` says."""
    good = peers.build_naive

    def build(ctx):
        fn = good(ctx)

        def wrong(s):
            out = fn(s)
            if how == "one token":
                out[0] += 1.0
            elif how == "nan outside the checked tokens":
                out[1] = float("nan")  # tokens 0 and 3 are the checked ones
            elif how == "raises":
                raise RuntimeError("planted")
            return out

        return wrong

    monkeypatch.setattr(peers, "build_naive", build)


@pytest.mark.parametrize("how,tokens,why", [("one token", "4", "check failed"),
                                            ("nan outside the checked tokens", "4", "not finite"),
                                            ("raises", "1", "error: RuntimeError: planted")])
def test_cli_exits_nonzero_when_a_row_fails(tmp_path, monkeypatch, capsys, how, tokens, why):
    _broken(monkeypatch, how)
    code = bench.main(["--tiny", "--tokens", tokens, "--impls", "naive", "--check-tokens", "2", "--cpu-reps", "1",
                       "--no-ceilings", "--out", str(tmp_path / "b.json")])
    err = capsys.readouterr().err
    assert code == 1 and "FAILED: base tiny uniform" in err and "naive loop" in err and why in err, err


def test_failures_lists_every_kind():
    ok = {"mode": "lora", "shape": "s", "routing": "uniform", "T": 1, "impl": "a", "variant": "1x half",
          "check": "ok", "rel_err": 1e-3, "base_rows_bitwise": True}
    assert bench.failures({"rows": [ok]}) == []
    bad = [dict(ok, base_rows_bitwise=False), dict(ok, check="FAIL", rel_err=0.5), dict(ok, error="OOM")]
    got = bench.failures({"rows": bad, "errors": ["s uniform: RuntimeError: no bank"]})
    assert len(got) == 4 and "lora_id -1 differ" in got[1] and "rel err 5.00e-01" in got[2] and "OOM" in got[3]


def test_import_and_base_run_need_no_hf_peft_liger(tmp_path):
    code = ("import sys; from moelab import bench; "
            "bench.run(['--tiny', '--tokens', '1', '--peers', 'naive', '--impls', 'naive', '--no-ceilings', "
            f"'--cpu-reps', '1', '--out', {str(tmp_path / 'b.json')!r}]); "
            "print('loaded:', sorted(m for m in ('transformers', 'peft', 'liger_kernel') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "loaded: []" in out.stdout, out.stdout
    assert "naive loop" in out.stdout and "HF eager" not in out.stdout


def test_bad_flags_name_the_flag(capsys):
    for argv, flag in [(["--peers", "vllm"], "--peers"), (["--lora", "--lora-variants", "8x some"], "--lora-variants"),
                       (["--shape", "nope"], "shape"), (["--check-tokens", "0"], "--check-tokens"),
                       (["--lora", "--lora-paths", "auto,fast"], "--lora-paths")]:
        with pytest.raises(SystemExit) as e:
            bench.run(["--no-ceilings"] + argv)  # (--tiny would replace --shape)
        assert e.value.code == 2 and flag in capsys.readouterr().err, argv


def test_peers_and_variants_parse():
    assert runner.parse_peers("all") == set(runner.BASE_PEERS + runner.LORA_PEERS)
    assert runner.parse_peers("none") == set()
    assert runner.parse_peers("hf, liger") == {"hf-eager", "hf-grouped_mm", "liger"}
    v = runner.parse_variants("8x mixed, 32x  mixed half,1x all", "1")
    assert [x.name for x in v] == ["8x mixed", "32x mixed half", "1x all"]
    assert v[0].ranks(16) == [64, 32, 16, 8] * 2 and v[0].live == 1.0 and v[1].live == 0.5
    assert v[2].ranks(16) == [16]
    assert [x.name for x in runner.parse_variants("", "1,4")] == ["1x all", "1x half", "4x all", "4x half"]


def test_mixed_banks_have_their_ranks():
    ctx = runner.Ctx(moelab.roofline.get_shape("tiny"), torch.zeros(8, 64, 64), torch.zeros(8, 64, 32),
                     torch.device("cpu"), torch.float32, None)
    runner._make_banks(ctx, runner.parse_variants("1x all,2x half,5x mixed", ""), rank=8)
    assert ctx.bank_of("1x all") is ctx.bank_of("2x half") and ctx.bank_of("2x half").ranks == [8, 8]
    assert ctx.bank_of("5x mixed").ranks == [64, 32, 16, 8, 64]
    assert ctx.bank_of("ids=-1") is ctx.bank_of("1x all")


def test_reference_rows_is_the_float64_reference():
    # the sliced, chunked call of moelab.reference equals one call on all experts
    shape = moelab.roofline.get_shape("tiny")
    ctx = runner.Ctx(shape, torch.randn(8, 64, 64) / 8, torch.randn(8, 64, 32) / 6, torch.device("cpu"),
                     torch.float32, None)
    s = runner.make_set(6, shape, "uniform", 1.2, torch.float32, "cpu")
    rows = runner.check_rows(6, 4, "cpu")
    assert rows[0] == 0 and rows[-1] == 5 and len(rows) == 4
    full = moelab.reference.routed_moe(s.ids, s.weights, s.x, ctx.w13, ctx.w2)["output"]
    got = runner.reference_rows(ctx, s, rows)
    assert torch.allclose(got, full[rows], rtol=0, atol=1e-12)
    runner._make_banks(ctx, runner.parse_variants("3x mixed half", ""), rank=8)
    s.lora_ids["3x mixed half"] = torch.tensor([2, -1, 0, 1, -1, 2], dtype=torch.int32)
    bank = ctx.bank_of("3x mixed half")
    full = moelab.reference.lora_experts(s.x, s.weights, s.ids, s.lora_ids["3x mixed half"], ctx.w13, ctx.w2,
                                         bank)["output"]
    got = runner.reference_rows(ctx, s, rows, "3x mixed half")
    assert torch.allclose(got, full[rows], rtol=0, atol=1e-12)
    none = torch.tensor([1, 4])  # checked tokens that all have -1: no adapter slot in the slice
    assert torch.allclose(runner.reference_rows(ctx, s, none, "3x mixed half"), full[none], rtol=0, atol=1e-12)


def test_markdown_names_the_kernel_switches(monkeypatch):
    """The run's env records the switches that pick the triton backend's kernels as the process has them (two runs
    of an A/B, ``MOELAB_GLUON=0`` and 1, say which is which), and the markdown prints them."""
    from moelab.kernels import gluon_gemm

    monkeypatch.setattr(gluon_gemm, "GLUON", False)
    switches = bench.cli.kernel_switches()
    assert set(switches) == {"MOELAB_GLUON", "MOELAB_TMA", "MOELAB_FAST_LAUNCH", "MOELAB_EAGER_GRAPHS",
                             "MOELAB_TILE_SCHEDULE"}
    assert switches["MOELAB_GLUON"] is False
    md = bench.markdown({"rows": [], "env": {"switches": switches}})
    assert "Kernel switches: MOELAB_GLUON=0, MOELAB_TMA=" in md
    assert f"MOELAB_TILE_SCHEDULE={gluon_gemm.TILE_SCHEDULE}" in md
    monkeypatch.setattr(gluon_gemm, "GLUON", True)
    assert "MOELAB_GLUON=1" in bench.markdown({"rows": [], "env": {"switches": bench.cli.kernel_switches()}})


def test_markdown_names_the_tile_table(monkeypatch, tmp_path):
    """The run's env says which tile table the GEMMs read (a tuning run's own file or the shipped one); the markdown
    prints it."""
    from moelab.kernels import moe_gemm

    assert bench.cli._tile_table(torch.device("cpu")).startswith("shipped")
    monkeypatch.setattr(moe_gemm, "TILE_TABLE_DIR", tmp_path)
    monkeypatch.setattr(moe_gemm, "device_limits", lambda device: moe_gemm.DeviceLimits((10, 0), 232448, "GPU X"))
    moe_gemm.own_tile_table.cache_clear()
    assert bench.cli._tile_table(torch.device("cuda")).startswith("shipped")
    moe_gemm.tile_table_path("GPU X").write_text(moe_gemm.CONFIG_FILE.read_text())
    moe_gemm.own_tile_table.cache_clear()
    assert bench.cli._tile_table(torch.device("cuda")) == str(tmp_path / "GPU_X.json")
    moe_gemm.own_tile_table.cache_clear()
    md = bench.markdown({"rows": [], "env": {"tile_table": "/cache/moelab/tile_tables/NVIDIA_B200.json"}})
    assert "Tile table: /cache/moelab/tile_tables/NVIDIA_B200.json" in md


def test_markdown_has_the_peak_memory_table():
    row = {"mode": "base", "shape": "s", "routing": "uniform", "T": 1, "impl": "moelab triton", "variant": "none",
           "median_us": 10.0, "floor_us": 5.0, "x_floor": 2.0, "touched_experts": 8.0, "rel_err": 1e-3,
           "check": "ok", "peak_bytes": 3 << 20}
    md = bench.markdown({"rows": [row]})
    assert "peak MiB allocated by one eager call" in md and "| 1 | 8.0 | 5.0 | 3.0 |" in md
    assert "peak MiB" not in bench.markdown({"rows": [{k: v for k, v in row.items() if k != "peak_bytes"}]})


def test_every_model_shape_is_selectable():
    # E, K, H, I of one MoE layer, from each model's config.json
    want = {"qwen3-30b-a3b": (128, 8, 2048, 768), "olmoe": (64, 8, 2048, 1024), "mixtral": (8, 2, 4096, 14336),
            "gpt-oss-20b": (32, 4, 2880, 2880), "deepseek-v3": (256, 8, 7168, 2048)}
    for name, dims in want.items():
        s = bench.get_shape(name)
        assert (s.E, s.K, s.H, s.I) == dims, name
    assert bench.SHAPES is moelab.roofline.SHAPES
    assert bench.get_shape("DeepSeek") is bench.get_shape("deepseek-v3")
    assert bench.get_shape("128,8,2048,768").E == 128
    with pytest.raises(ValueError, match="shape"):
        bench.get_shape("nope")


def test_roofline():
    # Qwen3-30B-A3B on H200 (4.27 TB/s, 701 TFLOP/s): ~18 us at T=1, ~281-285 us once all experts are
    # touched, 1765 us (compute bound) at T=16384.
    roofline = moelab.roofline.roofline
    assert round(roofline("qwen3-30b-a3b", 1)["floor_us"]) == 18
    full = roofline("qwen3", 1024, touched_experts=128)
    assert 280 < full["floor_us"] < 290 and full["bound"] == "bw"
    big = roofline("qwen3-30b-a3b", 16384)
    assert round(big["floor_us"]) == 1765 and big["bound"] == "compute"
    base = roofline("qwen3-30b-a3b", 1)
    lora = roofline("qwen3-30b-a3b", 1, lora_rank=16, lora_pairs=8)
    assert lora["bytes"] - base["bytes"] == 8 * 3 * 16 * (2048 + 768) * 2
    assert lora["flops"] - base["flops"] == 8 * 6 * 16 * (2048 + 768)
    mixed = roofline("qwen3-30b-a3b", 1, lora_rank=16, lora_pairs=8, lora_slot_rank=32)
    assert mixed["bytes"] == lora["bytes"] and mixed["flops"] - base["flops"] == 8 * 6 * 32 * (2048 + 768)


def test_roofline_docstring_examples():
    assert doctest.testmod(moelab.roofline, raise_on_error=False).failed == 0


def test_measure_ceilings_cpu():
    c = bench.measure_ceilings("cpu", copy_bytes=1 << 20, matmul_n=64)
    assert c.bandwidth > 0 and c.matmul_flops > 0 and c.copy_bytes == 1 << 20


def test_builders_skip_with_a_reason():
    ctx = runner.Ctx(moelab.roofline.get_shape("tiny"), torch.zeros(8, 64, 64), torch.zeros(8, 64, 32),
                     torch.device("cpu"), torch.bfloat16, None)
    with pytest.raises(impls.Skip, match="CUDA"):
        peers.build_liger(ctx)
    with pytest.raises(impls.Skip, match="one adapter"):
        peers.build_peft(ctx, "4x all")


def test_graph_rows_divide_by_the_graph_base(tmp_path):
    args = bench.build_parser().parse_args(["--out", str(tmp_path / "b.json")])
    args.time_budget = None
    r = runner.Runner(args, torch.device("cpu"), bench.H200_CEILINGS, {"rows": []})
    where = {"mode": "lora", "shape": "s", "routing": "uniform", "T": 1, "variant": "none"}
    for impl, us in [("moelab triton", 200.0), ("moelab triton [graph]", 40.0), ("moelab LoRAExperts", 220.0),
                     ("moelab LoRAExperts [graph]", 44.0)]:
        r._emit(dict(where, impl=impl, median_us=us), quiet=True)
    got = {row["impl"]: row["vs_moelab_triton"] for row in r.results["rows"]}
    assert got == pytest.approx({"moelab triton": 1.0, "moelab triton [graph]": 1.0, "moelab LoRAExperts": 1.1,
                                 "moelab LoRAExperts [graph]": 1.1})


def test_markdown_eager_over_graph():
    where = {"mode": "base", "shape": "s", "routing": "uniform", "variant": "none", "floor_us": 1.0, "x_floor": 1.0}
    rows = [dict(where, T=T, impl=impl, median_us=us) for T, impl, us in
            [(1, "moelab triton", 120.0), (1, "moelab triton [graph]", 40.0), (1, "naive loop", 900.0),
             (32, "moelab triton", 300.0), (32, "moelab triton [graph]", 250.0)]]
    md = bench.markdown({"rows": rows})
    table = md[md.index("eager / [graph] time"):]
    assert "| T | moelab triton |" in table and "| 1 | 3.00 |" in table and "| 32 | 1.20 |" in table
    assert "naive" not in table  # measured eagerly only
    assert "eager / [graph]" not in bench.markdown({"rows": rows[2:3]})
    assert "back to back" not in md  # no back_to_back_us in these rows
    rows[0]["back_to_back_us"], rows[1]["back_to_back_us"] = 105.0, 35.0
    b2b = bench.markdown({"rows": rows})
    b2b = b2b[b2b.index("calls back to back"):]
    assert "| 1 | moelab triton | 105.0 | 35.0 | 3.00 |" in b2b, b2b


def test_tiny_expert_options(tmp_path):
    """--activation/--bias: moelab's rows and the grouped_mm peer run GPT-OSS's experts and pass the float64
    check (which then has the activation and the biases); SwiGLU-only peers say why they are skipped."""
    res = bench.run(["--tiny", "--cpu-reps", "1", "--activation", "swigluoai", "--bias", "--peers",
                     "torch,grouped_mm,naive", "--out", str(tmp_path / "bench.json")])
    rows = _rows(res, "base")
    for name in ("moelab triton", "moelab torch", "torch grouped_mm"):
        got = [r for r in rows if r["impl"] == name]
        assert len(got) == 2 and all(r.get("check") == "ok" and r["rel_err"] < 1e-2 for r in got), got
    assert all("SwiGLU without biases" in r["skipped"] for r in rows if r["impl"] == "naive loop")
    assert bench.failures(res) == []
    with pytest.raises(SystemExit):
        bench.cli.build_parser().parse_args(["--activation", "relu2"])


def test_back_to_back_us_is_the_time_per_call():
    """``roofline.back_to_back_us``: every call made, the best round's wall time divided by its calls."""
    import time

    from moelab.roofline import back_to_back_us

    calls = []
    us = back_to_back_us(lambda: calls.append(time.sleep(0.002)), torch.device("cpu"), calls=10, rounds=2)
    assert len(calls) == 20
    assert 2000 <= us < 8000, us  # each call sleeps 2 ms (not the round: 20 ms)
