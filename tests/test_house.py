"""The package's structure: imports run one way (no cycle between moelab's modules), and no module outside a
kernel file reaches for its private names."""

import ast
import pathlib

import pytest
import torch

import moelab

ROOT = pathlib.Path(moelab.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]) -> list[tuple[str, list[str]]]:
    """(moelab module, imported names) of every import in ``path``, the ones under ``if TYPE_CHECKING`` left out."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for child in node.body for n in ast.walk(child)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            subs = [a.name for a in node.names if f"{node.module}.{a.name}" in modules]
            found += [(f"{node.module}.{s}", []) for s in subs]
            names = [a.name for a in node.names if a.name not in subs]
            if names:
                found.append((node.module, names))
    return found


def _graph() -> dict[str, list[tuple[str, list[str]]]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _imports(path, set(files)) for name, path in files.items()}


def test_no_import_cycle():
    # a module's own package is imported before the module anyway: an edge up to it is no dependency
    graph = {m: {t for t, _ in edges if not (m == t or m.startswith(t + "."))} for m, edges in _graph().items()}
    # the registry imports its backends by name (importlib), which the source's import statements do not show
    graph["moelab.backends"] |= {m for m in graph if m.startswith("moelab.backends.") and m.endswith("_backend")}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path[path.index(t):] + [t])}")
            if t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_backends_do_not_import_the_front_ends():
    for m, edges in _graph().items():
        if m.startswith("moelab.backends"):
            assert not {t for t, _ in edges} & {"moelab.moe", "moelab.experts", "moelab"}, m


def test_no_module_imports_a_kernel_files_private_names():
    """Each kernels/ file launches its own private kernels; others call its public launchers."""
    for m, edges in _graph().items():
        for target, names in edges:
            if target.startswith("moelab.kernels.") and target != m:
                private = [n for n in names if n.startswith("_")]
                assert not private, f"{m} imports {private} from {target}"


#: The GPUs moelab claims to run on, as Triton reports them: (compute capability, shared memory a block may use).
GPUS = {"A100 (sm80)": ((8, 0), 166912), "L4 / RTX 4090 (sm89)": ((8, 9), 101376),
        "H100 / H200 (sm90)": ((9, 0), 232448), "B200 (sm100)": ((10, 0), 232448),
        "RTX 5090 (sm120)": ((12, 0), 101376)}


def test_gemm_configs_fit_every_gpu():
    """Every tile config chosen for these devices fits their shared memory (pipeline stages and the fused LoRA's
    expand operands), no tile grows past the tuned one, and the H200 keeps its tuned tiles."""
    import dataclasses
    import itertools

    from moelab.kernels.moe_gemm import CONFIG_BUCKETS, DeviceLimits, choose_config, shared_memory_bytes

    for (name, (cc, smem)), T, E, dtype, columns in itertools.product(
            GPUS.items(), (1, 32, 128, 1024, 4096, 16384), (8, 128), (torch.bfloat16, torch.float32), (0, 16, 64)):
        cfg = choose_config(T, 8, E, dtype, columns, device=DeviceLimits(cc, smem))
        tuned = next(c for limit, c in CONFIG_BUCKETS if T * 8 / E <= limit)
        need = shared_memory_bytes(cfg, dtype.itemsize, columns)
        assert need <= smem and cfg.num_stages >= 1, f"{name}: {cfg} needs {need} B of {smem}"
        assert cfg.block_m <= tuned.block_m and cfg.block_n <= tuned.block_n and cfg.block_k <= tuned.block_k, name
        if cc == (9, 0) and dtype == torch.bfloat16 and columns == 0:  # group_m: small experts sweep ungrouped
            assert dataclasses.replace(cfg, num_stages=0) == dataclasses.replace(tuned, num_stages=0, group_m=1), name


def test_group_m_only_for_experts_past_the_l2():
    """A bucket's grouped tile order holds for experts of GROUP_M_MIN_EXPERT_BYTES or more (Mixtral's), and
    experts below it sweep ungrouped (group_m 1), with the bucket's tiles otherwise unchanged; buckets without a
    group_m stay 1 for any expert."""
    import dataclasses

    from moelab.kernels.moe_gemm import CONFIG_BUCKETS, GROUP_M_MIN_EXPERT_BYTES, DeviceLimits, choose_config

    h200 = DeviceLimits((9, 0), 232448)
    grouped = [(limit, c) for limit, c in CONFIG_BUCKETS if c.group_m > 1]
    assert grouped, "the tuned table groups no bucket: this test checks nothing"
    for limit, tuned in CONFIG_BUCKETS:
        rows = min(limit, 4096)  # T * K / E for T = rows, K = 8, E = 8
        big = choose_config(rows, 8, 8, device=h200, expert_bytes=GROUP_M_MIN_EXPERT_BYTES)
        small = choose_config(rows, 8, 8, device=h200, expert_bytes=GROUP_M_MIN_EXPERT_BYTES - 1)
        assert big.group_m == tuned.group_m, (limit, big)
        assert small == dataclasses.replace(big, group_m=1), (limit, small)


def _tile_table_json(buckets) -> str:
    import json

    return json.dumps({"gpu": "a test", "buckets": [{"max_rows_per_expert": limit, "config": config}
                                                    for limit, config in buckets]})


@pytest.fixture
def own_tables(tmp_path, monkeypatch):
    """TILE_TABLE_DIR in ``tmp_path``, nothing read from it yet (and forgotten after the test)."""
    from moelab.kernels import moe_gemm

    monkeypatch.setattr(moe_gemm, "TILE_TABLE_DIR", tmp_path)
    moe_gemm.own_tile_table.cache_clear()
    yield tmp_path
    moe_gemm.own_tile_table.cache_clear()


def test_a_gpu_models_own_tile_table_comes_before_the_shipped_one(own_tables):
    """A tuning run's table for a GPU model (a file of TILE_TABLE_DIR named after the model) is the one that model's
    GEMMs take, fitted to its shared memory as the shipped one is; another model, or none named, keeps the shipped
    table of its capability; a table written during the process is read once cleared."""
    from moelab.kernels import moe_gemm
    from moelab.kernels.moe_gemm import CONFIG_BUCKETS, DeviceLimits, GemmConfig, choose_config

    b200, h200 = DeviceLimits((10, 0), 232448, "NVIDIA B200"), DeviceLimits((9, 0), 232448, "NVIDIA H200")
    path = moe_gemm.tile_table_path(b200.name)
    assert path == own_tables / "NVIDIA_B200.json"
    assert moe_gemm.tile_table_path(" NVIDIA H100 80GB HBM3/x ").name == "NVIDIA_H100_80GB_HBM3_x.json"
    shipped = [choose_config(T, 8, 128, device=b200) for T in (1, 1024, 16384)]
    assert [choose_config(T, 8, 128, device=h200) for T in (1, 1024, 16384)] == shipped  # the sm_90 table
    path.write_text(_tile_table_json([(4, [16, 64, 128, 4, 2]), (256, [64, 64, 32, 4, 2]),
                                      (1e18, [128, 128, 64, 8, 3, 4])]))
    assert choose_config(1024, 8, 128, device=b200) == shipped[1], "read before the file was written: kept"
    moe_gemm.own_tile_table.cache_clear()
    assert choose_config(1, 8, 128, device=b200) == GemmConfig(16, 64, 128, 4, 2)
    assert choose_config(1024, 8, 128, device=b200) == GemmConfig(64, 64, 32, 4, 2)  # 64 rows an expert
    assert choose_config(16384, 8, 128, device=b200) == GemmConfig(128, 128, 64, 8, 3, 1)  # small experts: group 1
    assert choose_config(16384, 8, 8, device=b200, expert_bytes=1 << 30).group_m == 4
    big = choose_config(16384, 8, 8, device=DeviceLimits((10, 0), 101376, "NVIDIA B200"), expert_bytes=1 << 30)
    assert big.num_stages < 3 or big.block_k < 64, f"not fitted to 99 KB of shared memory: {big}"
    assert [choose_config(T, 8, 128, device=h200) for T in (1, 1024, 16384)] == shipped
    assert choose_config(1024, 8, 128, device=DeviceLimits((10, 0), 232448)) == shipped[1]
    assert moe_gemm.own_tile_table_file(b200) == path and moe_gemm.own_tile_table_file(h200) is None
    assert moe_gemm.tile_table(h200) is CONFIG_BUCKETS
    # an sm_90 table without 128-row tiles: large experts keep the bucket's own tiles (no Gluon GEMM tiles to take)
    h100 = DeviceLimits((9, 0), 232448, "NVIDIA H100")
    moe_gemm.tile_table_path(h100.name).write_text(_tile_table_json([(1e18, [64, 64, 64, 4, 2])]))
    assert choose_config(1024, 1, 16, device=h100, expert_bytes=1 << 30, gluon_call=True).block_m == 64


def test_the_tile_tables_folder_follows_the_environment(monkeypatch, tmp_path):
    from moelab.kernels import moe_gemm

    monkeypatch.setattr(moe_gemm, "TILE_TABLE_DIR", None)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("MOELAB_TILE_TABLES", "~/tables")
    assert moe_gemm.tile_table_path("GPU") == tmp_path / "tables" / "GPU.json"
    monkeypatch.delenv("MOELAB_TILE_TABLES")
    assert moe_gemm.tile_table_path("GPU") == tmp_path / ".cache" / "moelab" / "tile_tables" / "GPU.json"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert moe_gemm.tile_table_path("GPU") == tmp_path / "xdg" / "moelab" / "tile_tables" / "GPU.json"


@pytest.mark.parametrize("text, fault", [
    ("not json", "expected JSON"),
    ('{"tables": []}', "expected JSON"),
    (_tile_table_json([(4, [16, 64, 128, 4])]), "expected JSON"),  # five or six config entries
    (_tile_table_json([(64, [16, 64, 128, 4, 2]), (4, [16, 64, 128, 4, 2]), (1e18, [64, 64, 64, 4, 2])]),
     "ascending"),
    (_tile_table_json([(4, [16, 64, 128, 4, 2]), (4096, [64, 64, 64, 4, 2])]), "the last at least 1e18"),
    (_tile_table_json([(4, [16, 48, 128, 4, 2]), (1e18, [64, 64, 64, 4, 2])]), "powers of two"),
    (_tile_table_json([(1e18, [64, 64, 64, 4, 0])]), "integers in \\[1, 64\\]"),
    (_tile_table_json([(1e18, [8, 64, 64, 4, 2])]), "powers of two in \\[16, 256\\]"),
    (_tile_table_json([(1e18, [16, 1, 1, 1, 1])]), "powers of two in \\[16, 256\\]"),  # tl.dot needs 16
    (_tile_table_json([(1e18, [64, 64, 64, True, 2])]), "warps a power of two"),
    (_tile_table_json([(4, [64, 64, 64, 4, 2]), (float("nan"), [64, 64, 64, 4, 2])]), "the last at least 1e18"),
    (_tile_table_json([(float("nan"), [64, 64, 64, 4, 2]), (1e18, [64, 64, 64, 4, 2])]), "positive finite"),
])
def test_a_broken_tile_table_is_refused_by_name(text, fault, own_tables):
    """A GPU model's own table that is not a valid table stops its first call with a ValueError naming the file,
    the fault and the fix, not a Triton error or a silent fallback."""
    from moelab.kernels import moe_gemm

    moe_gemm.tile_table_path("NVIDIA B200").write_text(text)
    with pytest.raises(ValueError, match=fault) as e:
        moe_gemm.choose_config(1, 8, 128, device=moe_gemm.DeviceLimits((10, 0), 232448, "NVIDIA B200"))
    assert "NVIDIA_B200.json" in str(e.value) and "tune_moe.py" in str(e.value)


def test_a_tuning_run_writes_its_gpu_models_own_table(own_tables, monkeypatch):
    """scripts/tune_moe.py's winner goes into the GPU model's own table (started from the shipped one, the other
    buckets kept), which that model's next process reads; ``--package`` names the shipped file instead."""
    import importlib.util
    import json

    from moelab.kernels import moe_gemm

    spec = importlib.util.spec_from_file_location("tune_moe", ROOT.parent / "scripts" / "tune_moe.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA B200")
    monkeypatch.delenv("OUT", raising=False)
    path = tune.table_file()
    monkeypatch.setattr(tune, "PACKAGE", True)
    assert path == own_tables / "NVIDIA_B200.json" and tune.table_file() == moe_gemm.CONFIG_FILE
    monkeypatch.setattr(tune, "PACKAGE", False)
    winner = moe_gemm.GemmConfig(64, 64, 32, 4, 2, 2)
    tune.record_winner(100, winner, path)
    tune.record_winner(2, moe_gemm.GemmConfig(16, 64, 128, 4, 2), path)  # a second bucket, the first one kept
    table = moe_gemm.read_tile_table(path)
    assert [limit for limit, _ in table] == [limit for limit, _ in moe_gemm.CONFIG_BUCKETS]
    changed = {limit: cfg for (limit, cfg), (_, shipped) in zip(table, moe_gemm.CONFIG_BUCKETS) if cfg != shipped}
    assert changed == {128: winner, 4: moe_gemm.GemmConfig(16, 64, 128, 4, 2)}
    assert json.loads(path.read_text())["gpu"].startswith("NVIDIA B200, torch ")
    assert moe_gemm.own_tile_table("NVIDIA B200") == table
    assert [p.name for p in own_tables.iterdir()] == ["NVIDIA_B200.json"], "a draft left behind"
    # the sweep's baseline: this model's own table, or with --package the shipped one
    b200 = moe_gemm.DeviceLimits((10, 0), 232448, "NVIDIA B200")
    monkeypatch.setattr(tune, "device_limits", lambda device: b200)
    assert moe_gemm.tile_table(tune.baseline_device()) == table and tune.bucket_of(100) == 128
    monkeypatch.setattr(tune, "PACKAGE", True)
    assert moe_gemm.tile_table(tune.baseline_device()) is moe_gemm.CONFIG_BUCKETS


def test_the_shipped_tile_table_reads_as_a_table():
    from moelab.kernels import moe_gemm

    assert moe_gemm.read_tile_table(moe_gemm.CONFIG_FILE) == moe_gemm.CONFIG_BUCKETS


def test_large_experts_take_128_row_tiles_past_32_rows(monkeypatch):
    """On an sm_90 GPU with the Gluon GEMMs, experts of TILE128_MIN_EXPERT_BYTES or more at more than
    TILE128_MIN_ROWS rows an expert take the table's first 128-row tiles where its own bucket has fewer rows; smaller
    experts, fewer rows, a fused LoRA's columns, another GPU, fp32, a call the Gluon GEMMs do not take and
    ``MOELAB_GLUON=0`` keep the table's tiles."""
    from moelab.kernels import gluon_gemm
    from moelab.kernels.moe_gemm import (
        CONFIG_BUCKETS,
        TILE128_MIN_EXPERT_BYTES,
        TILE128_MIN_ROWS,
        DeviceLimits,
        choose_config,
    )

    h200, a100 = DeviceLimits((9, 0), 232448), DeviceLimits((8, 0), 166912)
    big = TILE128_MIN_EXPERT_BYTES
    monkeypatch.setattr(gluon_gemm, "GLUON", True)  # as on the device (CPU boxes without Gluon have it off)

    def table(rows):
        return next(c for limit, c in CONFIG_BUCKETS if rows <= limit)

    def tile(rows, **kw):  # T * K / E_local = rows with K = 1 and 16 local experts
        return choose_config(rows * 16, 1, 16, **{"device": h200, "expert_bytes": big, "gluon_call": True,
                                                  **kw}).block_m

    moved = [rows for rows in (33, 48, 64) if table(rows).block_m < 128]
    assert moved, "the table has 128-row tiles from 33 rows an expert: this test checks nothing"
    for rows in moved:
        assert tile(rows) == 128, rows
        assert tile(rows, expert_bytes=big - 1) == table(rows).block_m, rows
        assert tile(rows, lora_columns=16) < 128, rows
        assert tile(rows, dtype=torch.float16) == 128, rows
        assert tile(rows, device=a100) == table(rows).block_m, rows
        assert tile(rows, dtype=torch.float32) == table(rows).block_m, rows  # the Gluon GEMMs take 2-byte dtypes
        assert tile(rows, gluon_call=False) == table(rows).block_m, rows  # e.g. Llama-4's weight on the input
    for rows in (1, 16, TILE128_MIN_ROWS):
        assert tile(rows) == table(rows).block_m, rows
    monkeypatch.setattr(gluon_gemm, "GLUON", False)
    assert all(tile(rows) == table(rows).block_m for rows in moved)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the launch recorder wraps the interpreter's launches (no GPU)")
def test_recorded_launches_compile_for_sm90(monkeypatch, tmp_path):
    """``make sm90-launches`` then ``make sm90-compile LAUNCHES=...``: a routed call's interpreted launches are
    recorded with their argument types and constexprs (bf16 operands; the interpreter's fp32 dots turned back into
    the GPU's bf16 ones), and every recorded launch compiles for sm_90 in a process that does not interpret."""
    import json
    import os
    import subprocess
    import sys

    from conftest import recording_run

    from moelab.kernels.interpret import ScopedInterpretedFunction

    monkeypatch.setattr(ScopedInterpretedFunction, "run", recording_run(str(tmp_path), ScopedInterpretedFunction.run))
    T, K, E, H, I = 5, 2, 4, 64, 32
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int()
    weights = moelab.prepare_weights(torch.randn(E, 2 * I, H).bfloat16(), torch.randn(E, H, I).bfloat16(),
                                     backend="triton")
    moelab.routed_moe((ids, torch.rand(T, K)), torch.randn(T, H).bfloat16(), weights, num_experts=E, top_k=K)
    records = [json.loads(line) for path in tmp_path.glob("*.jsonl") for line in path.read_text().splitlines()]
    with_x = [r for r in records if "x_ptr" in r["signature"]]
    assert with_x and all(r["signature"]["x_ptr"] == "*bf16" and "x_ptr" in r["hinted"] for r in with_x), records
    assert any(r["constexprs"].get("DOT_F32") is True for r in records), "the interpreter's launches upcast"
    scripts = ROOT.parent / "scripts"
    code = ("import sys, ptx_sm90\n"
            "variants = ptx_sm90.launched_variants(sys.argv[1])\n"
            "assert not any(c.get('DOT_F32') for r, c in variants.values()), 'the GPU multiplies bf16 as it is'\n"
            "assert any(c.get('USE_GDC') for r, c in variants.values()), 'the graphs launch with PDL'\n"
            "ptxs = [(ptx_sm90.compile_launched(r, c), r['options'].get('num_warps', 4))\n"
            "        for r, c in variants.values()]\n"
            "print(len(ptxs), sum(f'.reqntid {32 * warps}' in p for p, warps in ptxs))\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=scripts, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT.parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    compiled, warps_kept = map(int, done.stdout.split()[-2:])
    assert compiled == warps_kept and compiled >= len({r["kernel"] for r in records}), done.stdout
