"""moelab.bench: the CLI's tiny mode through its function API (CPU: Triton's interpreter), and the roofline."""

import json
import math

import pytest

from moelab import bench

REQUIRED_BASE = ("moelab torch", "moelab triton", "naive loop")


def _rows(res, mode):
    return [r for r in res["rows"] if r["mode"] == mode]


def test_tiny_base(tmp_path):
    out = tmp_path / "bench.json"
    res = bench.run(["--tiny", "--cpu-reps", "1", "--out", str(out)])
    rows = _rows(res, "base")
    assert {r["T"] for r in rows} == {1, 8}
    for name in REQUIRED_BASE:
        got = [r for r in rows if r["impl"] == name]
        assert len(got) == 2, name
        for r in got:
            assert r.get("check") == "ok", r
            assert r["rel_err"] < 1e-2 and r["median_us"] > 0 and r["floor_us"] > 0 and r["x_floor"] > 0
            assert math.isclose(r["vs_moelab_triton"] * [m for m in rows if m["impl"] == "moelab triton"
                                                          and m["T"] == r["T"]][0]["median_us"], r["median_us"])
    # every row either measured, or says why not
    assert all("median_us" in r or r.get("skipped") or r.get("error") for r in rows)
    assert res["ceilings"]["bandwidth"] > 0 and res["ceilings"]["matmul_flops"] > 0
    # the files: JSON as returned, markdown tables with a row per T
    saved = json.loads(out.read_text())
    assert len(saved["rows"]) == len(res["rows"])
    md = (tmp_path / "bench.md").read_text()
    assert md == res["markdown"]
    assert "| T | touched | floor µs | moelab triton |" in md
    assert "\n| 1 |" in md and "\n| 8 |" in md
    assert "Command: `python -m moelab.bench --tiny" in md


def test_tiny_lora(tmp_path):
    pytest.importorskip("moelab.experts")
    res = bench.run(["--tiny", "--lora", "--lora-variants", "1x all", "--tokens", "4", "--cpu-reps", "1",
                     "--impls", "LoRAExperts,unfused,PEFT", "--no-ceilings", "--out", str(tmp_path / "l.json")])
    rows = {(r["impl"], r["variant"]): r for r in _rows(res, "lora")}
    for key in [("moelab LoRAExperts", "ids=-1"), ("moelab LoRAExperts", "1x all")]:
        assert rows[key].get("check") == "ok", rows[key]
    # peers: right when they run; skipped (with the reason) where torch has no grouped_mm or peft is missing
    for key in [("unfused LoRA (grouped_mm)", "1x all"), ("HF grouped_mm + PEFT", "1x all")]:
        assert rows[key].get("check") == "ok" or rows[key].get("skipped"), rows[key]
    # LoRA adds bytes and FLOPs to the floor
    assert rows[("moelab LoRAExperts", "1x all")]["floor_us"] > rows[("moelab LoRAExperts", "ids=-1")]["floor_us"]


def test_roofline_matches_bench_md():
    # BENCH.md, Qwen3-30B-A3B on H200 (4.27 TB/s, 701 TFLOP/s): ~18 us at T=1, ~281-285 us once all experts are
    # touched, 1765 us (compute bound) at T=16384.
    assert round(bench.roofline("qwen3-30b-a3b", 1)["floor_us"]) == 18
    full = bench.roofline("qwen3", 1024, touched_experts=128)
    assert 280 < full["floor_us"] < 290 and full["bound"] == "bw"
    big = bench.roofline("qwen3-30b-a3b", 16384)
    assert round(big["floor_us"]) == 1765 and big["bound"] == "compute"
    lora = bench.roofline("qwen3-30b-a3b", 1, lora_rank=16, lora_pairs=8)
    assert lora["bytes"] > bench.roofline("qwen3-30b-a3b", 1)["bytes"]
    assert bench.get_shape("128,8,2048,768").E == 128
    with pytest.raises(ValueError, match="shape"):
        bench.get_shape("nope")


def test_measure_ceilings_cpu():
    c = bench.measure_ceilings("cpu", copy_bytes=1 << 20, matmul_n=64)
    assert c.bandwidth > 0 and c.matmul_flops > 0 and c.copy_bytes == 1 << 20
