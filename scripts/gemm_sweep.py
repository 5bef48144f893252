"""Each grouped GEMM alone, over tile configs of its own, on a CUDA GPU: does GEMM1 or GEMM2 want other tiles than
the one config the table gives both?

    python scripts/gemm_sweep.py                                  # six shapes, T = 4096, 16384
    python scripts/gemm_sweep.py --shape qwen3-30b-a3b --tokens 1024 --json out.json
    python scripts/gemm_sweep.py --gemms gemm1 --candidates "64,64,8,3;64,64,8,4"   # other candidates
    ncu --profile-from-start off -k regex:gemm --metrics gpu__time_duration.sum --csv \
        python scripts/gemm_sweep.py --tokens 1 --ncu plan.json > ncu.csv                # decode: ncu's durations
    python scripts/gemm_sweep.py --ncu-report plan.json ncu.csv

For each shape and T: the routing of ``K`` distinct uniform experts per token (packed words, bf16 random weights at
the real size), the segments at the table's ``BLOCK_M`` (``choose_config``), then GEMM1 (``gemm1_swiglu``) and
GEMM2 (``gemm2``) launched alone, each with the table's config and with every candidate of ``CANDIDATES`` (the
same BLOCK_M: the segments' tile) at the stages it names (``GEMM2_MAX_STAGES`` lifted), with the TMA loads where
a201208's rule takes them (tiles of 128 rows or more over experts of ``TMA_MIN_HI`` elements, both GEMMs: "rule")
and, as a second variant, on every tile of 64 rows or more ("all"). Each candidate's output is compared with
the table config's (relative error < 1e-2) on every live row before it is timed (``triton.testing.do_bench``
median, L2 flushed). Prints a table per point (µs, time / the table config's); ``--json`` writes the rows.
Kernels of a few µs (decode) read several µs apart from one ``do_bench`` to the next; under ``--ncu`` Nsight
Compute times each launch alone on cold caches instead (the median of 3 per point), and ``--ncu-report`` prints those.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
import triton
from tma_ab import MODES, apply_settings  # noqa: E402  (scripts/ is on sys.path when run as a script)
from token_major_ab import write_rows  # noqa: E402

import moelab
from moelab.bench.cli import _split_shapes
from moelab.kernels import moe_gemm
from moelab.kernels.moe_gemm import GemmConfig, choose_config, device_limits, fit_to_shared_memory
from moelab.kernels.segments import build_segments_triton
from moelab.lab import rel_err
from moelab.roofline import get_shape

#: (BLOCK_N, BLOCK_K, num_warps, num_stages, group_m) tried at the table's BLOCK_M; stages fitted to the device.
CANDIDATES = [(128, 64, 8, 3, 1), (128, 64, 8, 4, 1), (128, 64, 8, 5, 1), (256, 64, 8, 3, 1), (256, 64, 8, 4, 1),
              (128, 128, 8, 3, 1), (128, 128, 8, 2, 1), (256, 128, 8, 2, 1), (64, 64, 4, 4, 1), (128, 64, 4, 4, 1),
              (128, 32, 8, 6, 1), (128, 64, 8, 3, 8), (256, 64, 8, 3, 8)]


#: ``--ncu PLAN``: instead of timing, each point's launches run between ``cudaProfilerStart``/``Stop`` for Nsight
#: Compute (``--profile-from-start off``), and PLAN lists them in order: ``--ncu-report`` joins ncu's durations.
NCU_PLAN: list | None = None
NCU_LAUNCHES = 3


def launch_for_ncu(fn, launches: int = NCU_LAUNCHES) -> None:
    """``fn()`` ``launches`` times between ``cudaProfilerStart`` and ``Stop``: the launches an ``ncu
    --profile-from-start off`` run times (its kernel replay flushes the caches before each)."""
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _ in range(launches):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _time(fn, label=None):
    if NCU_PLAN is not None:
        launch_for_ncu(fn)
        NCU_PLAN.append(dict(label, launches=NCU_LAUNCHES))
        return float("nan")
    if not torch.cuda.is_available():  # a smoke run in Triton's interpreter: one call's wall time
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return triton.testing.do_bench(fn, return_mode="median") * 1e3


#: The ``moe_gemm`` settings of the two variants: a201208's rule ("rule-a201208" of scripts/tma_ab.py, which also
#: lifts GEMM2_MAX_STAGES, so each candidate runs its stages) and TMA on every tile of 64 rows or more.
VARIANTS = {False: MODES["rule-a201208"],
            True: MODES["rule-a201208"] | dict(TMA_MIN_HI=0, TMA_MIN_HI_GEMM2=0, TMA_MIN_BLOCK_M=64)}


def _variant(everywhere):
    apply_settings(VARIANTS[everywhere])


def sweep_point(shape, T, w13, w2, a, smem):
    """The rows of one (shape, T): each GEMM of ``a.gemms`` over the table config and the candidates."""
    saved = {key: getattr(moe_gemm, key) for key in VARIANTS[False]}
    try:
        return _sweep_point(shape, T, w13, w2, a, smem)
    finally:
        apply_settings(saved)


def routed_rows(shape, T, w13, w2):
    """One point's inputs: x [T, H] bf16, the table's config for its rows an expert (``choose_config`` for these
    experts' bytes), and the segments at its BLOCK_M of ``K`` distinct uniform experts per token (packed words)."""
    E, K = shape.E, shape.K
    dev = w13.device
    x = torch.randn(T, shape.H, device=dev).bfloat16()
    ids = torch.rand(T, E, device=dev).topk(K, dim=1).indices.int()
    packed = moelab.pack_topk_ids_weights(ids, torch.rand(T, K, device=dev) + 0.1)
    table = choose_config(T, K, E, expert_bytes=(w13[0].numel() + w2[0].numel()) * 2)
    return x, table, build_segments_triton(packed, E, table.block_m, packed=True)


def _sweep_point(shape, T, w13, w2, a, smem):
    _variant(False)
    K, H, I = shape.K, shape.H, shape.I
    dev = w13.device
    x, table, seg = routed_rows(shape, T, w13, w2)
    reach = seg.row_to_slot.numel()
    live = seg.row_to_slot >= 0
    act = torch.zeros(reach, I, dtype=torch.bfloat16, device=dev)
    moe_gemm.gemm1_swiglu(x, w13, act, seg, top_k=K, config=table)
    gemms = {"gemm1": (lambda cfg, out: moe_gemm.gemm1_swiglu(x, w13, out, seg, top_k=K, config=cfg), I),
             "gemm2": (lambda cfg, out: moe_gemm.gemm2(act, w2, out, seg, config=cfg), H)}
    print(f"\n{shape.name} T={T}: table {table}, {reach} rows", flush=True)
    rows = []
    for name in a.gemms.split(","):
        fn, width = gemms[name]
        out = torch.empty(reach, width, dtype=torch.bfloat16, device=dev)
        want = fn(table, out).clone()
        point = dict(shape=shape.name, T=T, gemm=name)
        base = _time(lambda fn=fn, out=out: fn(table, out), dict(point, config=dataclasses.astuple(table),
                                                                tma_everywhere=False, table=True))
        print(f"| {name} | config | TMA | µs | / table |\n|---|---|---|---|---|\n"
              f"| {name} | {table} | rule | {base:.1f} | 1.000 |", flush=True)
        start, seen = time.time(), set()
        for cfg in [table] + [GemmConfig(table.block_m, *c) for c in a.candidates]:
            cfg = fit_to_shared_memory(cfg, 2, 0, smem, weight_tiles=2 if name == "gemm1" else 1)
            # below moe_gemm's smallest TMA tile both variants launch the same kernel: time it once
            for everywhere in (False, True) if cfg.block_m >= VARIANTS[True]["TMA_MIN_BLOCK_M"] else (False,):
                if time.time() - start > a.budget_s or (cfg, everywhere) in seen:
                    continue
                seen.add((cfg, everywhere))
                _variant(everywhere)
                try:
                    out.fill_(float("nan"))
                    err = rel_err(fn(cfg, out)[live], want[live])
                    if not err < 1e-2:
                        print(f"| {name} | {cfg} | {everywhere} | WRONG {err:.1e} | |", flush=True)
                        continue
                    us = _time(lambda fn=fn, cfg=cfg, out=out: fn(cfg, out),
                               dict(point, config=dataclasses.astuple(cfg), tma_everywhere=everywhere, table=False))
                except Exception as e:  # a config that does not compile: recorded, not fatal
                    print(f"| {name} | {cfg} | {everywhere} | {type(e).__name__}: {str(e)[:120]} | |", flush=True)
                    continue
                finally:
                    _variant(False)
                rows.append(dict(shape=shape.name, T=T, gemm=name, config=dataclasses.astuple(cfg),
                                 tma_everywhere=everywhere, us=us, table_us=base, rel_err=err))
                print(f"| {name} | {cfg} | {'all' if everywhere else 'rule'} | {us:.1f} | {us / base:.3f} |",
                      flush=True)
        best = min((r for r in rows if r["gemm"] == name), key=lambda r: r["us"], default=None)
        if best:
            print(f"best {name} {shape.name} T={T}: {best['config']} tma_all={best['tma_everywhere']} "
                  f"{best['us']:.1f} µs = {best['us'] / base:.3f}x the table's", flush=True)
    return rows


def _candidate(p: argparse.ArgumentParser, text: str) -> tuple[int, ...]:
    """One ``--candidates`` entry: BLOCK_N,BLOCK_K,warps,stages[,group_m] as ints (else the parser's error)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) not in (4, 5):
        p.error(f"--candidates: expected BLOCK_N,BLOCK_K,warps,stages[,group_m] (4 or 5 integers), got {text!r}")
    return values


def ncu_durations(csv_file: str) -> list[tuple[str, float]]:
    """(kernel name, µs) of each launch in an ``ncu --csv --metrics gpu__time_duration.sum`` output, in launch order
    (the program's own output may come first)."""
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    lines = Path(csv_file).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    return [(r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * scale[r["Metric Unit"]])
            for r in csv.DictReader(lines[start:]) if r.get("Metric Name") == "gpu__time_duration.sum"]


def ncu_report(plan_file: str, csv_file: str) -> None:
    """Join ncu's ``--csv`` durations (``gpu__time_duration.sum``, launch order) with the PLAN of a ``--ncu`` run:
    per point the median of its launches, in µs, and its ratio to the table config's; the best per GEMM."""
    plan = json.loads(Path(plan_file).read_text())
    durations = [us for _, us in ncu_durations(csv_file)]
    if len(durations) != sum(e["launches"] for e in plan):
        raise SystemExit(f"{csv_file}: {len(durations)} GEMM launches profiled, the plan has "
                         f"{sum(e['launches'] for e in plan)}: not the same run")
    table, best = {}, {}
    for e in plan:
        e["us"] = statistics.median(durations[:e["launches"]])
        del durations[:e["launches"]]
        key = (e["shape"], e["T"], e["gemm"])
        if e["table"]:
            table.setdefault(key, e["us"])
        ratio = e["us"] / table[key]
        print(f"{e['shape']} T={e['T']} {e['gemm']} {tuple(e['config'])}{' tma_all' if e['tma_everywhere'] else ''}"
              f"{' (table)' if e['table'] else ''}: {e['us']:.2f} µs, {ratio:.3f}x", flush=True)
        if key not in best or e["us"] < best[key]["us"]:
            best[key] = e
    for key, e in best.items():
        print(f"best {' '.join(map(str, key))}: {tuple(e['config'])} {e['us']:.2f} µs = {e['us'] / table[key]:.3f}x "
              f"the table's {table[key]:.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b;olmoe;64,6,2048,1408;gpt-oss-20b;deepseek-v3;mixtral")
    p.add_argument("--tokens", default="4096,16384")
    p.add_argument("--gemms", default="gemm1,gemm2")
    p.add_argument("--budget-s", type=float, default=40.0, help="wall-clock budget per (shape, T, GEMM)")
    p.add_argument("--json", default=None)
    p.add_argument("--candidates", default=None, help="BLOCK_N,BLOCK_K,warps,stages[,group_m] tuples separated by "
                   "';' instead of CANDIDATES")
    p.add_argument("--ncu", default=None, metavar="PLAN", help="run under Nsight Compute (--profile-from-start off "
                   "-k regex:gemm --metrics gpu__time_duration.sum --csv > CSV): no timing here, the launches' order "
                   "goes to the JSON file PLAN")
    p.add_argument("--ncu-report", nargs=2, default=None, metavar=("PLAN", "CSV"),
                   help="print each point's median ncu duration (µs) and its ratio to the table config's")
    a = p.parse_args(argv)
    if a.ncu_report:
        return ncu_report(*a.ncu_report)
    if a.ncu and not torch.cuda.is_available():
        p.error("--ncu: needs a CUDA GPU (Nsight Compute times its launches)")
    global NCU_PLAN
    NCU_PLAN = [] if a.ncu else None
    a.candidates = CANDIDATES if a.candidates is None else [_candidate(p, c) for c in a.candidates.split(";")
                                                             if c.strip()]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    smem = device_limits(dev).shared_memory if dev.type == "cuda" else 232448
    rows = []
    for shape in (get_shape(n) for n in _split_shapes(a.shape)):
        w13 = (torch.randn(shape.E, 2 * shape.I, shape.H, device=dev) / shape.H**0.5).bfloat16()
        w2 = (torch.randn(shape.E, shape.H, shape.I, device=dev) / shape.I**0.5).bfloat16()
        for T in (int(t) for t in a.tokens.split(",")):
            rows += sweep_point(shape, T, w13, w2, a, smem)
            write_rows(a.json, rows)
            if a.ncu:
                Path(a.ncu).write_text(json.dumps(NCU_PLAN, indent=1))
        del w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
