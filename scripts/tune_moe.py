"""Sweep the triton backend's GEMM tile configs at one model shape on a GPU; print the best per T.

    python scripts/tune_moe.py [--shape qwen3-30b-a3b] [--tokens 1,32,128,1024,4096,16384] [--group-m 1,8,16]

``--shape`` takes what ``python -m moelab.bench --shape`` takes (``moelab.roofline.SHAPES``, or E,K,H,I).

Each candidate is checked against the torch backend before it is timed (do_bench median, 4 input sets
rotated); each timing is printed. ``--group-m``: every candidate is also tried with these ``GemmConfig.group_m``
(row tiles swept together down each column block), the current config's variants first. The winner of each T
replaces the config of its rows-per-expert bucket in this GPU model's own tile table
(``moe_gemm.tile_table_path``: ``$MOELAB_TILE_TABLES`` or ~/.cache/moelab/tile_tables, one JSON file a GPU model;
started from the shipped table), which ``choose_config`` reads on this GPU model from the next process on; with
``--package``, in the table shipped with moelab (moelab/kernels/moe_gemm_configs.json), which every GPU without a
table of its own reads (a maintainer's sweep, committed with its BENCHMARKS.md entry). A copy goes to $OUT.
A candidate's stages are GEMM1's; GEMM2 runs at most ``moe_gemm.GEMM2_MAX_STAGES`` of them on 128-row tiles, as
the backend does.

``--aggregate`` tunes the table for every shape at once, so no shape's sweep overwrites another's: each
(shape, T) point counts toward its rows-per-expert bucket, and a bucket takes the candidate with the lowest
geometric mean of time / the current config's time over every point of the bucket that timed it (a candidate
that failed or ran out of budget at one of them is out). The per-bucket table is printed and written.
"""

import argparse
import dataclasses
import json
import math
import os
import time

import torch
import triton

import moelab
from moelab.backends import triton_backend as tb
from moelab.kernels.moe_gemm import (
    CONFIG_FILE,
    GemmConfig,
    as_launched,
    choose_config,
    device_limits,
    fit_to_shared_memory,
    read_tile_table,
    tile_table,
    tile_table_path,
)
from moelab.kernels.segments import build_segments_triton
from moelab.lab import rel_err
from moelab.permutation import build_segments, local_expert_of_slot
from moelab.roofline import SHAPES, get_shape


def bucket_of(rows_per_expert):
    """The upper bound of the config file's bucket holding ``rows_per_expert`` (a sweep rewrites configs, not
    bounds)."""
    return next(limit for limit, _ in tile_table(baseline_device()) if rows_per_expert <= limit)


#: --package: the sweep starts from the shipped table (and rewrites it), not from this GPU model's own
PACKAGE = False


def baseline_device():
    """This GPU as the sweep's baseline sees it: without its model's name under ``--package`` (so the shipped
    table's tiles are the current ones), else as the backend sees it (its own table where it has one)."""
    device = device_limits(torch.device("cuda"))
    return dataclasses.replace(device, name="") if PACKAGE else device


def candidates(rows_per_expert, default, groups=None):
    """Likely winners first (the sweep stops at its time budget). (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages).
    The grid follows the bucket, so the points of a bucket get the same list (``--aggregate``; a point's budget
    can still cut it short)."""
    rows_per_expert = bucket_of(rows_per_expert)
    if rows_per_expert <= 4:  # weight streaming: many programs, deep pipelines
        grid = [(16, 32, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 3), (16, 32, 256, 4, 3),
                (16, 64, 64, 4, 5), (16, 128, 64, 4, 4), (16, 64, 128, 8, 4), (16, 32, 128, 2, 5),
                (16, 32, 64, 4, 6)]
    elif rows_per_expert <= 16:
        grid = [(16, 128, 128, 4, 3), (16, 64, 256, 4, 3), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
                (32, 128, 128, 8, 3), (16, 32, 128, 4, 4), (32, 64, 64, 4, 5)]
    elif rows_per_expert <= 128:  # tens of rows an expert: one or two row tiles each
        grid = [(64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (64, 64, 128, 4, 4), (32, 128, 128, 4, 3),
                (64, 128, 128, 8, 3), (128, 64, 64, 4, 4), (32, 64, 128, 4, 4), (64, 128, 64, 4, 4, 8)]
    else:  # compute-bound; a 6th entry is group_m (experts whose weights outgrow the L2: Mixtral)
        grid = [(128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 4, 8), (64, 256, 64, 8, 3), (64, 256, 64, 8, 3, 8),
                (128, 64, 64, 4, 4), (128, 64, 64, 4, 4, 8), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3),
                (128, 128, 64, 8, 4), (128, 128, 128, 8, 2)]
    configs = [default] + [GemmConfig(*c) for c in grid]
    out = []
    for c in configs:
        for g in groups or (c.group_m,):  # no groups: each candidate's own
            v = dataclasses.replace(c, group_m=g)
            if v not in out:
                out.append(v)
    return out


def as_run(configs, expert_bytes, keep_group_m=False):
    """The bf16 candidates as the backend runs them (``as_launched``), duplicates dropped; with ``keep_group_m``
    (``--group-m`` asks for group sizes explicitly) only their stages fitted."""
    smem = device_limits(torch.device("cuda")).shared_memory
    out = []
    for cfg in configs:
        cfg = fit_to_shared_memory(cfg, 2, 0, smem) if keep_group_m else as_launched(cfg, 2, smem,
                                                                                      expert_bytes=expert_bytes)
        if cfg not in out:
            out.append(cfg)
    return out


def table_file():
    """The table a sweep rewrites: this GPU model's own, or under ``--package`` the one shipped with moelab."""
    return CONFIG_FILE if PACKAGE else tile_table_path(torch.cuda.get_device_name())


def record_winner(rows_per_expert, cfg, path):
    """Write ``cfg`` into the bucket of ``rows_per_expert`` of the tile table file ``path`` (:func:`table_file`;
    a GPU model's first sweep starts it from the shipped table), check it, and copy it to $OUT."""
    table = json.loads((path if path.is_file() else CONFIG_FILE).read_text())
    bucket = next(b for b in table["buckets"] if rows_per_expert <= b["max_rows_per_expert"])
    bucket["config"] = [cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages] + (
        [cfg.group_m] if cfg.group_m != 1 else [])
    table["gpu"] = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    text = json.dumps(table, indent=2) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(path.name + ".draft")
    draft.write_text(text)
    read_tile_table(draft)  # checked before it replaces the table (in one step: a reader never sees half a file)
    os.replace(draft, path)
    print(f"tile table {path}: bucket <= {bucket['max_rows_per_expert']:g} rows an expert now {cfg}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], path.name), "w") as f:
            f.write(text)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", action="append", help=f"one of {sorted(SHAPES)} or E,K,H,I; repeat for several "
                   "[qwen3-30b-a3b]")
    p.add_argument("--tokens", default="1,32,128,1024,4096,16384")
    p.add_argument("--budget-s", type=float, default=60.0, help="wall-clock budget per T")
    p.add_argument("--group-m", default=None, help="comma list of group_m values tried with every candidate "
                   "[each candidate's own]")
    p.add_argument("--max-configs", type=int, default=None, help="time at most this many candidates per T")
    p.add_argument("--total-s", type=float, default=None, help="wall-clock budget of the whole sweep: no point "
                   "starts after it (so --aggregate still picks from the points timed)")
    p.add_argument("--aggregate", action="store_true", help="one table for all shapes: per bucket, the best "
                   "geometric mean of time / the current config's time")
    p.add_argument("--package", action="store_true", help="rewrite the table shipped with moelab instead of this "
                   "GPU model's own (moe_gemm.tile_table_path)")
    args = p.parse_args()
    global PACKAGE
    PACKAGE = args.package
    points = []  # (shape, T, rows per expert, {config: ms}, the current config)
    args.deadline = time.time() + args.total_s if args.total_s else float("inf")
    for name in args.shape or ["qwen3-30b-a3b"]:
        points += tune_shape(get_shape(name), args)
        torch.cuda.empty_cache()
    if args.aggregate:
        pick_by_bucket(points, table_file())


#: --aggregate changes a bucket only for a geometric-mean gain above this host's run-to-run noise (2 %)
CHANGE_BELOW = 0.98


def pick_by_bucket(points, path):
    """Per bucket, the candidate with the lowest geometric mean of time / current time over the bucket's points
    (only candidates timed at all of them); printed, and written into the tile table file ``path``."""
    by_bucket = {}
    for point in points:
        by_bucket.setdefault(bucket_of(point[2]), []).append(point)
    print("\n| bucket (rows/expert <=) | points | current | winner | geomean winner/current | per point |")
    print("|---|---|---|---|---|---|")
    for bucket, pts in sorted(by_bucket.items()):
        common = set.intersection(*(set(times) for *_, times, _ in pts))
        if any(current not in times for *_, times, current in pts):
            print(f"| {bucket:g} | {len(pts)} | - | no candidate timed at every point | | |")
            continue

        def score(cfg, pts=pts):
            return math.exp(sum(math.log(times[cfg] / times[current]) for *_, times, current in pts) / len(pts))

        best = min(common, key=score)
        each = ", ".join(f"{name} T={T}: {times[best] / times[current]:.3f}" for name, T, _, times, current in pts)
        print(f"| {bucket:g} | {len(pts)} | {pts[0][4]} | {best} | {score(best):.3f} | {each} |", flush=True)
        if score(best) < CHANGE_BELOW:
            record_winner(bucket, best, path)


def tune_shape(shape, args):
    E, K, H, I = shape.E, shape.K, shape.H, shape.I
    dev = "cuda"
    w13 = (torch.randn(E, 2 * I, H, device=dev) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=dev) / I**0.5).bfloat16()
    Wt = moelab.prepare_weights(w13, w2, backend="torch")
    print(f"shape {shape.name} E={E} K={K} H={H} I={I} on {torch.cuda.get_device_name()}", flush=True)
    points = []
    for T in [int(t) for t in args.tokens.split(",")]:
        if time.time() > args.deadline:
            print(f"T={T} not timed: the sweep's --total-s ran out", flush=True)
            continue
        sets = []
        for _ in range(4):
            x = torch.randn(T, H, device=dev).bfloat16()
            ids = torch.rand(T, E, device=dev).topk(K, dim=1).indices.int()
            w = torch.rand(T, K, device=dev) + 0.1
            sets.append((moelab.pack_topk_ids_weights(ids, w), None, x))  # packed words, as vLLM passes them
        ids, ew, x = sets[0]
        ref = moelab.routed_moe(ids, x, Wt, num_experts=E, top_k=K)[0].float() if T <= 4096 else None
        seg_ms = triton.testing.do_bench(lambda ids=ids: build_segments(local_expert_of_slot(ids >> 16, 0), E, 64),
                                         return_mode="median")
        seg_tr_ms = triton.testing.do_bench(lambda ids=ids: build_segments_triton(ids, E, 16, packed=True),
                                             return_mode="median")
        print(f"T={T} segments torch {seg_ms*1e3:.1f} us, triton {seg_tr_ms*1e3:.1f} us", flush=True)
        results = []
        start = time.time()
        expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        # the current table's, as the backend runs it
        default = choose_config(T, K, E, device=baseline_device(), expert_bytes=expert_bytes)
        groups = args.group_m and [int(g) for g in args.group_m.split(",")]
        for cfg in as_run(candidates(T * K / E, default, groups), expert_bytes, args.group_m is not None)[
                :args.max_configs]:
            if time.time() - start > args.budget_s:
                break
            try:
                out = tb._pipeline(ids, ew, x, w13, w2, E, 0, None, True, config=cfg)[0]
                if ref is not None:
                    err = rel_err(out, ref)
                    if not err < 1e-2:
                        print(f"  T={T} {cfg} WRONG rel err {err:.2e}", flush=True)
                        continue
                def run(i=[0], sets=sets, cfg=cfg):  # noqa: B006 (a call counter rotating the input sets)
                    ids_, ew_, x_ = sets[i[0] % 4]
                    i[0] += 1
                    tb._pipeline(ids_, ew_, x_, w13, w2, E, 0, None, True, config=cfg)

                ms = triton.testing.do_bench(run, return_mode="median", warmup=10, rep=50)
                results.append((ms, cfg))
                print(f"  T={T} {cfg} {ms*1e3:.1f} us", flush=True)
            except Exception as e:  # a config that does not compile (shared memory) is skipped
                print(f"  T={T} {cfg} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
        points.append((shape.name, T, T * K / E, {c: ms for ms, c in results}, default))
        results.sort(key=lambda r: r[0])
        if not results:
            print(f"T={T:6d} no candidate ran", flush=True)
            continue
        if not args.aggregate:
            record_winner(T * K / E, results[0][1], table_file())
        dflt = next((ms for ms, c in results if c == default), float("nan"))
        print(f"T={T:6d} segments {seg_ms*1e3:7.1f} us | default {dflt*1e3:8.1f} us | best {results[0][0]*1e3:8.1f} us "
              f"{results[0][1]} | 2nd {results[1][0]*1e3 if len(results) > 1 else 0:8.1f} us "
              f"{results[1][1] if len(results) > 1 else ''}", flush=True)
    return points


if __name__ == "__main__":
    main()
