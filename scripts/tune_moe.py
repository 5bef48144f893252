"""Sweep the triton backend's GEMM tile configs at one model shape on a GPU; print the best per T.

    python scripts/tune_moe.py [--shape qwen3-30b-a3b] [--tokens 1,32,128,1024,4096,16384] [--group-m 1,8,16]

``--shape`` takes what ``python -m moelab.bench --shape`` takes (``moelab.roofline.SHAPES``, or E,K,H,I).

Each candidate is checked against the torch backend before it is timed (do_bench median, 4 input sets
rotated); each timing is printed. ``--group-m``: every candidate is also tried with these ``GemmConfig.group_m``
(row tiles swept together down each column block), the current config's variants first. The winner of each T
replaces the config of its rows-per-expert bucket in moelab/kernels/moe_gemm_configs.json (and a copy goes to
$OUT), which ``choose_config`` reads.
"""

import argparse
import dataclasses
import json
import os
import time

import torch
import triton

import moelab
from moelab.backends import triton_backend as tb
from moelab.kernels.moe_gemm import CONFIG_FILE, GemmConfig, choose_config
from moelab.kernels.segments import build_segments_triton
from moelab.lab import rel_err
from moelab.permutation import build_segments, local_expert_of_slot
from moelab.roofline import SHAPES, get_shape


def candidates(rows_per_expert, default, groups=(1,)):
    """Likely winners first (the sweep stops at its time budget). (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    if rows_per_expert <= 4:  # weight streaming: many programs, deep pipelines
        grid = [(16, 32, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 3), (16, 32, 256, 4, 3),
                (16, 64, 64, 4, 5), (16, 128, 64, 4, 4), (16, 64, 128, 8, 4), (16, 32, 128, 2, 5),
                (16, 32, 64, 4, 6)]
    elif rows_per_expert <= 32:
        grid = [(16, 128, 128, 4, 3), (16, 64, 256, 4, 3), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
                (32, 128, 128, 8, 3), (16, 32, 128, 4, 4), (32, 64, 64, 4, 5)]
    else:
        grid = [(128, 256, 64, 8, 3), (128, 128, 32, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
                (64, 256, 64, 8, 3), (128, 128, 64, 4, 3), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3)]
    configs = [default] + [GemmConfig(*c) for c in grid]
    out = []
    for c in configs:
        for g in groups:
            v = dataclasses.replace(c, group_m=g)
            if v not in out:
                out.append(v)
    return out


def record_winner(rows_per_expert, cfg):
    """Write ``cfg`` into the bucket of ``rows_per_expert`` in the package's config file (and $OUT)."""
    table = json.loads(CONFIG_FILE.read_text())
    bucket = next(b for b in table["buckets"] if rows_per_expert <= b["max_rows_per_expert"])
    bucket["config"] = [cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages] + (
        [cfg.group_m] if cfg.group_m != 1 else [])
    table["gpu"] = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    text = json.dumps(table, indent=2) + "\n"
    CONFIG_FILE.write_text(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], CONFIG_FILE.name), "w") as f:
            f.write(text)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", action="append", help=f"one of {sorted(SHAPES)} or E,K,H,I; repeat for several "
                   "[qwen3-30b-a3b]")
    p.add_argument("--tokens", default="1,32,128,1024,4096,16384")
    p.add_argument("--budget-s", type=float, default=60.0, help="wall-clock budget per T")
    p.add_argument("--group-m", default="1", help="comma list of group_m values tried with every candidate")
    p.add_argument("--max-configs", type=int, default=None, help="time at most this many candidates per T")
    args = p.parse_args()
    for name in args.shape or ["qwen3-30b-a3b"]:
        tune_shape(get_shape(name), args)
        torch.cuda.empty_cache()


def tune_shape(shape, args):
    E, K, H, I = shape.E, shape.K, shape.H, shape.I
    dev = "cuda"
    w13 = (torch.randn(E, 2 * I, H, device=dev) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=dev) / I**0.5).bfloat16()
    Wt = moelab.prepare_weights(w13, w2, backend="torch")
    print(f"shape {shape.name} E={E} K={K} H={H} I={I} on {torch.cuda.get_device_name()}", flush=True)
    for T in [int(t) for t in args.tokens.split(",")]:
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
        default = choose_config(T, K, E)  # the current file's config, timed beside the candidates
        for cfg in candidates(T * K / E, default, [int(g) for g in args.group_m.split(",")])[:args.max_configs]:
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
        results.sort(key=lambda r: r[0])
        if not results:
            print(f"T={T:6d} no candidate ran", flush=True)
            continue
        record_winner(T * K / E, results[0][1])
        dflt = next((ms for ms, c in results if c == default), float("nan"))
        print(f"T={T:6d} segments {seg_ms*1e3:7.1f} us | default {dflt*1e3:8.1f} us | best {results[0][0]*1e3:8.1f} us "
              f"{results[0][1]} | 2nd {results[1][0]*1e3 if len(results) > 1 else 0:8.1f} us "
              f"{results[1][1] if len(results) > 1 else ''}", flush=True)


if __name__ == "__main__":
    main()
