"""How many times the grouped GEMMs stream each touched expert's weights when no tile finds them in the L2: the
row tiles of ``--block-m`` rows the experts' routed rows take, over the experts touched, on the bench's routing.

    python scripts/tile_passes.py                                   # the bench's shapes at T = 1024, 4096, 16384
    python scripts/tile_passes.py --shape deepseek-v3 --tokens 4096 --block-m 128

Each expert's rows take ceil(rows / block_m) tiles, and each tile reads the expert's whole weights: "weight passes"
(tiles / touched experts) above 1 is the weight bytes the L2 must save, or DRAM carry. "Over full tiles" is the
tiles against T·K / block_m, the share the partly filled last tiles add. Routing: the bench's (``--routing``,
``--zipf-s``; one seeded draw on the CPU). No GPU needed.
"""

from __future__ import annotations

import argparse

import torch

from moelab.bench.cli import _split_shapes, build_parser
from moelab.bench.runner import _routing
from moelab.roofline import get_shape


def tile_passes(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[int, int]:
    """(row tiles, touched experts) of the routing ``ids`` [T, K] on tiles of ``block_m`` rows."""
    rows = torch.bincount(ids.flatten().long(), minlength=num_experts)
    return int(((rows + block_m - 1) // block_m).sum()), int((rows > 0).sum())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b;olmoe;mixtral;gpt-oss-20b;deepseek-v3")
    p.add_argument("--tokens", default="1024,4096,16384")
    p.add_argument("--block-m", type=int, default=128)
    p.add_argument("--routing", default="uniform", help="uniform or zipf, as the bench's")
    p.add_argument("--zipf-s", type=float, default=build_parser().get_default("zipf_s"),
                   help="the Zipf exponent of --routing zipf (the bench's default)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(f"| shape | T | rows an expert | {a.block_m}-row tiles | over full tiles | touched experts | weight passes |")
    print("|---|---|---|---|---|---|---|")
    for shape in (get_shape(name) for name in _split_shapes(a.shape)):
        for T in (int(t) for t in a.tokens.split(",")):
            torch.manual_seed(a.seed)
            tiles, touched = tile_passes(_routing(T, shape, a.routing, a.zipf_s, "cpu"), shape.E, a.block_m)
            full = T * shape.K / a.block_m
            print(f"| {shape.name} | {T} | {T * shape.K / shape.E:.0f} | {tiles} | {tiles / full:.2f} | {touched} | "
                  f"{tiles / touched:.2f} |")


if __name__ == "__main__":
    main()
