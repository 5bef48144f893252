"""Sweep the triton backend's GEMM tile configs at one model shape on a GPU; print the best per T.

    python scripts/tune_moe.py [--shape qwen3] [--tokens 1,32,128,1024,4096,16384]

Each candidate is checked against the torch backend before it is timed (do_bench median, 4 input sets
rotated). The winners go into ``choose_config`` in moelab/backends/triton_backend.py by hand.
"""

import argparse
import itertools
import time

import torch
import triton

import moelab
from moelab.backends import triton_backend as tb
from moelab.permutation import build_segments, local_expert_of_slot

SHAPES = {"qwen3": (128, 8, 2048, 768), "olmoe": (64, 8, 2048, 1024), "mixtral": (8, 2, 4096, 14336)}


def candidates(rows_per_expert):
    if rows_per_expert <= 4:
        grid = itertools.product([16], [32, 64, 128], [64, 128, 256], [4], [3, 4, 5])
    elif rows_per_expert <= 32:
        grid = itertools.product([16, 32], [64, 128], [64, 128], [4], [3, 4])
    else:
        grid = itertools.product([64, 128], [64, 128, 256], [32, 64], [4, 8], [3, 4])
    return [tb.GemmConfig(*c) for c in grid]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3")
    p.add_argument("--tokens", default="1,32,128,1024,4096,16384")
    p.add_argument("--budget-s", type=float, default=60.0, help="wall-clock budget per T")
    args = p.parse_args()
    E, K, H, I = SHAPES[args.shape]
    dev = "cuda"
    w13 = (torch.randn(E, 2 * I, H, device=dev) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=dev) / I**0.5).bfloat16()
    Wt = moelab.prepare_weights(w13, w2, backend="torch")
    print(f"shape {args.shape} E={E} K={K} H={H} I={I} on {torch.cuda.get_device_name()}", flush=True)
    for T in [int(t) for t in args.tokens.split(",")]:
        sets = []
        for _ in range(4):
            x = torch.randn(T, H, device=dev).bfloat16()
            ids = torch.rand(T, E, device=dev).topk(K, dim=1).indices.int()
            w = torch.rand(T, K, device=dev) + 0.1
            sets.append((ids, moelab.unpack_topk_ids_weights(moelab.pack_topk_ids_weights(ids, w))[1], x))
        ids, ew, x = sets[0]
        ref = moelab.routed_moe((ids, ew), x, Wt, num_experts=E, top_k=K)[0].float() if T <= 4096 else None
        seg_ms = triton.testing.do_bench(lambda ids=ids: build_segments(local_expert_of_slot(ids, 0), E, 64),
                                         return_mode="median")
        results = []
        start = time.time()
        default = tb.choose_config(T, K, E)
        for cfg in [default] + candidates(T * K / E):
            if time.time() - start > args.budget_s:
                break
            try:
                out = tb._pipeline(ids, ew, x, w13, w2, E, 0, None, True, config=cfg)[0]
                if ref is not None:
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        print(f"  T={T} {cfg} WRONG rel err {err:.2e}", flush=True)
                        continue
                def run(i=[0], sets=sets, cfg=cfg):  # noqa: B006 (a call counter rotating the input sets)
                    ids_, ew_, x_ = sets[i[0] % 4]
                    i[0] += 1
                    tb._pipeline(ids_, ew_, x_, w13, w2, E, 0, None, True, config=cfg)

                ms = triton.testing.do_bench(run, return_mode="median", warmup=10, rep=50)
                results.append((ms, cfg))
            except Exception as e:  # a config that does not compile (shared memory) is skipped
                print(f"  T={T} {cfg} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
        results.sort(key=lambda r: r[0])
        dflt = next((ms for ms, c in results if c == default), float("nan"))
        print(f"T={T:6d} segments {seg_ms*1e3:7.1f} us | default {dflt*1e3:8.1f} us | best {results[0][0]*1e3:8.1f} us "
              f"{results[0][1]} | 2nd {results[1][0]*1e3 if len(results) > 1 else 0:8.1f} us "
              f"{results[1][1] if len(results) > 1 else ''}", flush=True)


if __name__ == "__main__":
    main()
