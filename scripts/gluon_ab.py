"""GEMM1 and GEMM2 alone on an sm_90 GPU: the Gluon warp-specialised persistent kernels
(``moelab/kernels/gluon_gemm.py``) against the Triton kernels of the tile table (``moe_gemm.gemm1_swiglu`` and
``gemm2`` with ``gluon_gemm.GLUON`` off), on the same rows, in one process.

    python scripts/gluon_ab.py                                   # five shapes, T = 1024, 4096, 16384
    python scripts/gluon_ab.py --shape qwen3-30b-a3b --tokens 16384 --tiles "256,64,3" --gemm1-tiles "128,64,4"

For each shape and T: ``K`` distinct uniform experts per token, the segments on the table's 128-row tiles (points
with smaller tiles are skipped), GEMM1's real activations; GEMM1 by the Triton kernel (the reference output) and by
the Gluon kernel at each ``--gemm1-tiles`` entry, then GEMM2 likewise at each ``--tiles`` entry (BLOCK_N, BLOCK_K,
STAGES), both in the table's tile order (its group_m). Each Gluon output starts NaN-poisoned and must match the
Triton kernel's on every row of the grid (live rows within 1e-2 relative error, padding and dead rows equal) before
it is timed. Times: ``triton.testing.do_bench`` medians (L2 flushed), A B B A over the two kernels; TFLOP/s over
the live rows (T * K rows of 2 * H * I FLOPs in GEMM2, twice that in GEMM1).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
from gemm_sweep import routed_rows  # noqa: E402  (scripts/ is on sys.path when run as a script)

from moelab.bench.cli import _split_shapes
from moelab.kernels import gluon_gemm, moe_gemm
from moelab.lab import rel_err
from moelab.roofline import get_shape


def triton_only(fn):
    """``fn`` with the Gluon kernels switched off: moe_gemm launches its Triton kernels."""
    def run():
        gluon_gemm.GLUON = False
        try:
            return fn()
        finally:
            gluon_gemm.GLUON = True
    return run


def _time(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def ab(label, triton_fn, gluon_fn, want, out, live, flops, tile, extra):
    """One Gluon tile against the Triton kernel: the poisoned output checked, then A B B A timed; the row or None."""
    try:
        gluon_fn()
        torch.cuda.synchronize()
    except Exception as e:  # a tile that does not compile or fit: recorded, not fatal
        print(f"{label} tile {tile}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None
    err = rel_err(out[live], want[live])
    same_dead = torch.equal(out[~live], want[~live])
    exact = torch.equal(out, want)
    if not (err < 1e-2 and same_dead):
        print(f"{label} tile {tile}: WRONG rel_err {err:.2e}, dead rows equal {same_dead}, "
              f"NaN rows {int(out.isnan().any(1).sum())}", flush=True)
        return None
    t_a1, t_b1, t_b2, t_a2 = _time(triton_fn), _time(gluon_fn), _time(gluon_fn), _time(triton_fn)
    tri, glu = statistics.mean((t_a1, t_a2)), statistics.mean((t_b1, t_b2))
    row = dict(extra, tile=list(tile), triton_us=[t_a1, t_a2], gluon_us=[t_b1, t_b2], ratio=glu / tri, rel_err=err,
               bitwise=exact, triton_tflops=flops / tri / 1e6, gluon_tflops=flops / glu / 1e6)
    print(f"| {label} | {tile} | {tri:.1f} ({t_a1:.1f}, {t_a2:.1f}) | {glu:.1f} ({t_b1:.1f}, {t_b2:.1f}) | "
          f"{glu / tri:.3f} | {row['triton_tflops']:.0f} / {row['gluon_tflops']:.0f} | "
          f"{err:.1e}{' bitwise' if exact else ''} |", flush=True)
    return row


def run_point(shape, T, w13, w2, tiles, gemm1_tiles):
    K, H, I = shape.K, shape.H, shape.I
    dev = w13.device
    x, table, seg = routed_rows(shape, T, w13, w2)
    if table.block_m != 128:
        print(f"{shape.name} T={T}: table tile {table.block_m} rows, not the Gluon kernel's 128: skipped")
        return []
    reach = seg.row_to_slot.numel()
    act = torch.zeros(reach, I, dtype=torch.bfloat16, device=dev)
    triton_only(lambda: moe_gemm.gemm1_swiglu(x, w13, act, seg, top_k=K, config=table))()
    want = torch.empty(reach, H, dtype=torch.bfloat16, device=dev)
    triton_only(lambda: moe_gemm.gemm2(act, w2, want, seg, config=table))()
    live = seg.row_to_slot >= 0
    flops = 2.0 * T * K * H * I
    rows = []
    point = dict(shape=shape.name, T=T, triton_config=list(table.__dict__.values()))
    want1 = act.clone()
    for tile in gemm1_tiles:
        out = torch.full_like(act, float("nan"))
        row = ab(f"{shape.name} | {T} | gemm1",
                 triton_only(lambda: moe_gemm.gemm1_swiglu(x, w13, act, seg, top_k=K, config=table)),
                 lambda tile=tile, out=out: gluon_gemm.gemm1_swiglu_ws(x, w13, out, seg, top_k=K, tile=tile,
                                                                        group_m=table.group_m),
                 want1, out, live, 2 * flops, tile, dict(point, gemm="gemm1"))
        rows += [row] if row else []
    for tile in tiles:
        out = torch.full((reach, H), float("nan"), dtype=torch.bfloat16, device=dev)
        row = ab(f"{shape.name} | {T} | gemm2", triton_only(lambda: moe_gemm.gemm2(act, w2, want, seg, config=table)),
                 lambda tile=tile, out=out: gluon_gemm.gemm2_ws(act, w2, out, seg, tile=tile, group_m=table.group_m),
                 want, out, live, flops, tile, dict(point, gemm="gemm2"))
        rows += [row] if row else []
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b;olmoe;64,6,2048,1408;gpt-oss-20b;mixtral")
    p.add_argument("--tokens", default="1024,4096,16384")
    p.add_argument("--tiles", default="256,64,3;128,64,4", help="BLOCK_N,BLOCK_K,STAGES entries separated by ';'")
    p.add_argument("--gemm1-tiles", default="128,64,3;128,64,4", help="GEMM1's tiles, as --tiles ('' for none)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    tiles = [tuple(int(v) for v in t.split(",")) for t in a.tiles.split(";") if t]
    gemm1_tiles = [tuple(int(v) for v in t.split(",")) for t in a.gemm1_tiles.split(";") if t]
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| shape | T | GEMM | Gluon tile | Triton µs (A1, A2) | Gluon µs (B1, B2) | Gluon / Triton | TFLOP/s T / G | "
          "rel err |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for spec in _split_shapes(a.shape):
        shape = get_shape(spec)
        g = torch.Generator(device="cuda").manual_seed(0)
        w13 = (torch.randn(shape.E, 2 * shape.I, shape.H, device="cuda", generator=g) * 0.02).bfloat16()
        w2 = (torch.randn(shape.E, shape.H, shape.I, device="cuda", generator=g) * 0.02).bfloat16()
        for T in (int(t) for t in a.tokens.split(",")):
            rows += run_point(shape, T, w13, w2, tiles, gemm1_tiles)
        del w13, w2
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
