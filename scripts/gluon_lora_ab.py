"""A fused LoRA bank's tile mode on the Gluon GEMMs against the Triton kernels, whole ``LoRAExperts`` calls on an
sm_90 GPU, in one process.

    python scripts/gluon_lora_ab.py                      # Qwen3-30B-A3B, OLMoE, Mixtral at T = 1024, 4096, 16384
    python scripts/gluon_lora_ab.py --shape olmoe --tokens 4096 --banks "1x16,4x16"

For each shape, T and bank (``NxR``: N adapters of rank R, every token one of them, ``fused="tiles"``): one module,
one set of inputs; the call with ``gluon_gemm.GLUON`` off (the Triton kernels) and on, each checked against
``moelab.reference.lora_experts`` on 4 tokens and against each other (max |difference|, bit for bit or not); then
``triton.testing.do_bench`` medians, A B B A, of the LoRA call and of the base call (no adapters) in both modes
(``validate=False``, as the bench calls them):
the LoRA / base ratio each mode gives, in the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from gluon_ab import _time, triton_only  # noqa: E402  (scripts/ is on sys.path when run as a script)

import moelab
from moelab import reference
from moelab.bench.cli import _split_shapes
from moelab.lab import rel_err
from moelab.roofline import get_shape


def point(shape, T: int, adapters: int, rank: int, seed: int = 0) -> dict:
    E, K, H, I = shape.E, shape.K, shape.H, shape.I
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16().cuda()
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16().cuda()
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K].int().cuda()
    w = torch.rand(T, K, generator=g).softmax(dim=1).cuda()
    bank = moelab.LoRABank(adapters, E, H, I, rank, dtype=torch.bfloat16, device="cuda")
    for slot in range(adapters):
        bank.set(slot, scaling=0.5, **{
            name: (torch.randn(E, *dims, generator=g) / dims[-1]**0.5).bfloat16().cuda()
            for name, dims in dict(gate_a=(rank, H), up_a=(rank, H), down_a=(rank, I), gate_b=(I, rank),
                                   up_b=(I, rank), down_b=(H, rank)).items()})
    lora_ids = (torch.arange(T) % adapters).cuda()
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton", fused="tiles")
    lora_call = lambda: experts(x, w, ids, lora_ids, has_lora=True, validate=False)  # noqa: E731  (the bench's)
    base_call = lambda: experts(x, w, ids, None, has_lora=False, validate=False)  # noqa: E731
    calls = {"triton": (triton_only(lora_call), triton_only(base_call)), "gluon": (lora_call, base_call)}
    outs = {mode: lora_fn() for mode, (lora_fn, _) in calls.items()}
    check = slice(0, 4)
    ref = reference.lora_experts(x[check], w[check], ids[check], lora_ids[check], w13, w2, bank)["output"]
    row = dict(shape=shape.name, T=T, bank=f"{adapters}x{rank}",
               rel_err={m: rel_err(o[check], ref) for m, o in outs.items()},
               max_abs_diff=(outs["gluon"].float() - outs["triton"].float()).abs().max().item(),
               bitwise=torch.equal(outs["gluon"], outs["triton"]))
    times = {f"{what} {mode}": [] for what in ("lora", "base") for mode in ("triton", "gluon")}
    for mode in ("triton", "gluon", "gluon", "triton"):
        times[f"lora {mode}"].append(_time(calls[mode][0]))
        times[f"base {mode}"].append(_time(calls[mode][1]))
    row["us"] = {k: statistics.mean(v) for k, v in times.items()}
    row["lora/base"] = {m: row["us"][f"lora {m}"] / row["us"][f"base {m}"] for m in ("triton", "gluon")}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b;olmoe;mixtral")
    p.add_argument("--tokens", default="1024,4096,16384")
    p.add_argument("--banks", default="1x16,4x16", help="comma list of NxR: N adapters of rank R")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    for name in _split_shapes(a.shape):
        for T in map(int, a.tokens.split(",")):
            for spec in a.banks.split(","):
                n, r = map(int, spec.split("x"))
                row = point(get_shape(name), T, n, r)
                rows.append(row)
                us, ratio = row["us"], row["lora/base"]
                print(f"{row['shape']} T={T} {row['bank']}: lora triton {us['lora triton']:.1f} gluon "
                      f"{us['lora gluon']:.1f} us ({us['lora gluon'] / us['lora triton']:.3f}x); base triton "
                      f"{us['base triton']:.1f} gluon {us['base gluon']:.1f}; lora/base triton {ratio['triton']:.3f}"
                      f" gluon {ratio['gluon']:.3f}; rel_err {row['rel_err']['triton']:.1e}/"
                      f"{row['rel_err']['gluon']:.1e}, max|diff| {row['max_abs_diff']:.2e}, bitwise "
                      f"{row['bitwise']}", flush=True)
                if a.json:
                    with open(a.json, "w") as f:
                        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
