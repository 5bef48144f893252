"""The token-major decode kernels (``moelab/kernels/token_major.py``) over tiles and pipeline depths, each launch
timed by Nsight Compute (cold caches, the median of 3), on a CUDA GPU:

    ncu --profile-from-start off -k regex:token_major --metrics gpu__time_duration.sum --csv \\
        python scripts/token_major_ncu.py --plan plan.json > ncu.csv
    python scripts/token_major_ncu.py --report plan.json ncu.csv

For each shape (packed routing of ``--tokens`` tokens, K distinct uniform experts each, bf16 weights at the real
size): the default :class:`~moelab.kernels.token_major.TokenMajorConfig` and each candidate of ``CANDIDATES``, the
i-th GEMM1 tile beside the i-th GEMM2 tile in one call (the two kernels do not share work, so each is read alone).
Each call's output is compared with the default's before it is profiled. The report gives each kernel's median µs
per candidate and its ratio to the default's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch
from gemm_sweep import launch_for_ncu, ncu_durations  # noqa: E402  (scripts/ is on sys.path when run as a script)

import moelab
from moelab.bench.cli import _split_shapes
from moelab.kernels.token_major import TokenMajorConfig, choose_token_major_config, token_major_moe
from moelab.lab import rel_err
from moelab.permutation import next_pow2
from moelab.roofline import get_shape

#: (block_n1, block_k1, warps1, stages1) and (block_n2, block_k2, warps2, stages2), paired by position.
GEMM1 = [(16, 512, 8, 2), (16, 512, 8, 3), (16, 256, 8, 3), (16, 256, 4, 3), (16, 256, 4, 4), (32, 256, 8, 3),
         (8, 512, 4, 3), (16, 128, 4, 4), (32, 128, 8, 4), (8, 256, 4, 4), (16, 128, 8, 6), (32, 512, 8, 2)]
GEMM2 = [(16, 256, 8, 2), (16, 128, 8, 3), (8, 256, 8, 3), (8, 128, 4, 3), (8, 128, 4, 4), (16, 64, 4, 4),
         (4, 256, 4, 3), (8, 64, 4, 4), (16, 128, 4, 3), (4, 128, 4, 4), (8, 256, 4, 2), (16, 64, 8, 6)]
LAUNCHES = 3


def configs(T, K, H, I) -> list[TokenMajorConfig]:
    """The default config, then the candidates with BLOCK_K capped at the reduction's power of two."""
    default = choose_token_major_config(T, K, H, I)
    return [default] + [TokenMajorConfig(n1, min(k1, next_pow2(H)), w1, n2, min(k2, next_pow2(I)), w2, s1, s2)
                        for (n1, k1, w1, s1), (n2, k2, w2, s2) in zip(GEMM1, GEMM2)]


def sweep(shapes: str, T: int, plan_file: str) -> None:
    plan = []
    for shape in (get_shape(n) for n in _split_shapes(shapes)):
        sweep_shape(shape, T, plan, plan_file)
        torch.cuda.empty_cache()


def sweep_shape(shape, T: int, plan: list, plan_file: str) -> None:
    """Every config of :func:`configs` at one shape: checked against the default's output, then launched
    ``LAUNCHES`` times for ncu; ``plan`` (written to ``plan_file`` after each) gets an entry per config."""
    dev = torch.device("cuda")
    E, K, H, I = shape.E, shape.K, shape.H, shape.I
    w13 = (torch.randn(E, 2 * I, H, device=dev) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=dev) / I**0.5).bfloat16()
    x = torch.randn(T, H, device=dev).bfloat16()
    ids = torch.rand(T, E, device=dev).topk(K, dim=1).indices.int()
    packed = moelab.pack_topk_ids_weights(ids, torch.rand(T, K, device=dev) + 0.1)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    want = None
    for cfg in configs(T, K, H, I):
        def call(cfg=cfg):
            return token_major_moe(packed, None, x, w13, w2, out, config=cfg)
        out.fill_(float("nan"))
        got = call().clone()
        want = got if want is None else want
        err = rel_err(got, want)
        if not err < 1e-2:
            print(f"{shape.name} {cfg}: WRONG {err:.1e}", flush=True)
            continue
        launch_for_ncu(call, LAUNCHES)
        plan.append(dict(shape=shape.name, T=T, config=dataclasses.astuple(cfg), launches=LAUNCHES))
        Path(plan_file).write_text(json.dumps(plan, indent=1))


def report(plan_file: str, csv_file: str) -> None:
    plan, launches = json.loads(Path(plan_file).read_text()), ncu_durations(csv_file)
    if len(launches) != 2 * sum(e["launches"] for e in plan):
        raise SystemExit(f"{csv_file}: {len(launches)} launches profiled, the plan has two kernels of "
                         f"{sum(e['launches'] for e in plan)} calls: not the same run")
    default, best = {}, {}
    for e in plan:
        mine, launches = launches[:2 * e["launches"]], launches[2 * e["launches"]:]
        parts = []
        for kernel in ("gemm1", "gemm2"):
            us = statistics.median(t for name, t in mine if f"token_major_{kernel}" in name)
            key = (e["shape"], e["T"], kernel)
            default.setdefault(key, us)
            parts.append(f"{kernel} {us:.2f} µs ({us / default[key]:.3f}x)")
            if key not in best or us < best[key][0]:
                best[key] = (us, e["config"])
        print(f"{e['shape']} T={e['T']} {tuple(e['config'])}: {', '.join(parts)}", flush=True)
    for key, (us, cfg) in best.items():
        print(f"best {' '.join(map(str, key))}: {tuple(cfg)} {us:.2f} µs = {us / default[key]:.3f}x the default's "
              f"{default[key]:.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b;olmoe;64,6,2048,1408;gpt-oss-20b")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--plan", default=None, help="run under ncu: the launches' order goes to this JSON file")
    p.add_argument("--report", nargs=2, default=None, metavar=("PLAN", "CSV"))
    a = p.parse_args(argv)
    if a.report:
        return report(*a.report)
    if not a.plan or not torch.cuda.is_available():
        p.error("--plan: needs a CUDA GPU and a plan file (Nsight Compute times the launches)")
    sweep(a.shape, a.tokens, a.plan)


if __name__ == "__main__":
    main()
