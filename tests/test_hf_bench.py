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
    assert moelab_row["experts_ms"] > 0 and moelab_row["module_ms"] > 0 and moelab_row["layer_ms"] > 0
    assert all(moelab_row[f"host_{k}_ms"] > 0 for k in ("experts", "module", "layer"))
    assert float(moelab_row["experts/layer"]) == pytest.approx(moelab_row["experts_ms"] / moelab_row["layer_ms"],
                                                               abs=0.01)
    assert any("tokens_per_s" in r for r in rows)
    printed = capsys.readouterr()
    assert "| moelab |" in printed.out and "experts/layer" in printed.out
    assert "# experts share T=3: in the forward" in printed.err
    assert "# profile moelab T=3" in printed.err and "# profile grouped_mm T=3" in printed.err
