"""The token-major decode path against the tiled pipeline, and a sweep of its tiles, on a CUDA GPU.

    python scripts/token_major_ab.py                                  # every bench shape, T = 1, 2, 4, 8
    python scripts/token_major_ab.py --shape qwen3-30b-a3b --tokens 1 --sweep --json out.json

For each shape and T: one ``moelab.routed_moe`` call as the bench's "moelab triton" row makes it (bf16 random
weights at the real size, packed routing words of K distinct uniform experts, ``validate=False``), timed on the
tiled pipeline, on the token-major path with its default tiles (both forced, eagerly and in graphs) and as
the backend's own rule chooses, each eagerly and replayed from a CUDA graph (``moelab.roofline.median_us``:
medians of ``triton.testing.do_bench``, L2 flushed). ``--sweep`` also times the token-major path with each tile
candidate below (GEMM1's candidates with GEMM2's default, then GEMM2's with GEMM1's default), in graph replays.
Every token-major result is checked against the tiled output (relative error < 2e-2) before it is timed. Prints a
table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

import moelab
from moelab.backends import triton_backend
from moelab.bench.cli import _split_shapes
from moelab.kernels import token_major
from moelab.lab import rel_err
from moelab.roofline import get_shape, graphed, median_us

#: (BLOCK_N, BLOCK_K, num_warps) candidates of GEMM1 (by slot) and GEMM2 (by token, K experts a tile).
GEMM1_CANDIDATES = [(16, 256, 4), (8, 512, 8), (16, 512, 8), (8, 1024, 8), (16, 1024, 8), (16, 512, 16),
                    (32, 512, 8)]
GEMM2_CANDIDATES = [(16, 128, 8), (16, 256, 8), (8, 256, 8), (8, 512, 8), (16, 512, 8), (16, 256, 16), (32, 256, 8),
                    (16, 1024, 8)]


def _layer(shape, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(shape.E, 2 * shape.I, shape.H, generator=g, device=device, dtype=dtype) / shape.H**0.5
    w2 = torch.randn(shape.E, shape.H, shape.I, generator=g, device=device, dtype=dtype) / shape.I**0.5
    return moelab.prepare_weights(w13, w2, backend="triton")


def _inputs(shape, T, dtype, device, seed=1):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, shape.H, generator=g, device=device, dtype=dtype)
    ids = torch.rand(T, shape.E, generator=g, device=device).topk(shape.K, dim=1).indices.to(torch.int32)
    w = torch.rand(T, shape.K, generator=g, device=device) + 0.1
    return x, moelab.pack_topk_ids_weights(ids, w)


def _call(packed, x, weights, shape):
    out = torch.empty(x.shape[0], shape.H, dtype=x.dtype, device=x.device)
    return lambda: moelab.routed_moe(packed, x, weights, num_experts=shape.E, top_k=shape.K, output=out,
                                     validate=False)[0]


_TAKES_TOKEN_MAJOR = triton_backend.takes_token_major


def _force(limit):
    """The triton backend's choice replaced: token-major for at most ``limit`` slots, eagerly and in graphs (0: the
    tiled pipeline always, a large one the token-major path); None puts its own rule back."""
    def takes(T, K, do_finalize, has_delta, capturing=False, **_):
        return do_finalize and not has_delta and 0 < T * K <= limit

    triton_backend.takes_token_major = _TAKES_TOKEN_MAJOR if limit is None else takes


def _time(fn, device):
    eager = median_us(fn, device)
    replay = graphed(fn, device)
    return eager, median_us(replay, device)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b;olmoe;mixtral;gpt-oss-20b;deepseek-v3;64,6,2048,1408",
                   help="as python -m moelab.bench --shape takes it (';' between shapes when one is E,K,H,I)")
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--sweep", action="store_true", help="also time each tile candidate (graph replays)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    shapes = [get_shape(name) for name in _split_shapes(a.shape)]
    rows = []
    print("| shape | T | slots | tiled eager | tiled graph | token-major eager | token-major graph | graph tiled/tm "
          "| default eager | default graph | tiles |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        weights = _layer(shape, torch.bfloat16, device)
        for T in (int(t) for t in a.tokens.split(",")):
            x, packed = _inputs(shape, T, torch.bfloat16, device)
            call = _call(packed, x, weights, shape)

            auto = _time(call, device)  # what a user gets: the default limits, eagerly and in a graph
            _force(0)
            want = call().clone()
            tiled = _time(call, device)
            _force(1 << 30)
            default = token_major.choose_token_major_config(T, shape.K, shape.H, shape.I)
            err = rel_err(call(), want)
            assert err < 2e-2, f"{shape.name} T={T}: token-major vs tiled rel err {err:.2e}"
            tm = _time(call, device)
            row = dict(shape=shape.name, E=shape.E, K=shape.K, H=shape.H, I=shape.I, T=T, tiled_eager_us=tiled[0],
                       tiled_graph_us=tiled[1], auto_eager_us=auto[0], auto_graph_us=auto[1], tm_eager_us=tm[0],
                       tm_graph_us=tm[1], rel_err=err, default=dataclasses.asdict(default), sweep=[])
            if a.sweep:
                original = token_major.choose_token_major_config
                for which, cands in (("gemm1", GEMM1_CANDIDATES), ("gemm2", GEMM2_CANDIDATES)):
                    for bn, bk, nw in cands:
                        cfg = (dataclasses.replace(default, block_n1=bn, block_k1=bk, warps1=nw) if which == "gemm1"
                               else dataclasses.replace(default, block_n2=bn, block_k2=bk, warps2=nw))
                        token_major.choose_token_major_config = lambda *args, _c=cfg: _c
                        try:
                            err = rel_err(call(), want)
                            assert err < 2e-2, f"{shape.name} T={T} {cfg}: rel err {err:.2e}"
                            us = median_us(graphed(call, device), device)
                        except Exception as e:  # a candidate that does not compile or fit: recorded, not fatal
                            us = None
                            print(f"# {shape.name} T={T} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                        finally:
                            token_major.choose_token_major_config = original
                        row["sweep"].append(dict(which=which, block_n=bn, block_k=bk, warps=nw, graph_us=us))
            _force(None)
            rows.append(row)
            best = ""
            if row["sweep"]:
                for which in ("gemm1", "gemm2"):
                    timed = [s for s in row["sweep"] if s["which"] == which and s["graph_us"] is not None]
                    b = min(timed, key=lambda s: s["graph_us"])
                    best += f"{which} best {b['block_n']}x{b['block_k']} w{b['warps']} {b['graph_us']:.1f}; "
            print(f"| {shape.name} | {T} | {T * shape.K} | {tiled[0]:.1f} | {tiled[1]:.1f} | {tm[0]:.1f} | "
                  f"{tm[1]:.1f} | {tiled[1] / tm[1]:.2f} | {auto[0]:.1f} | {auto[1]:.1f} | {best} |", flush=True)
        del weights, call
        torch.cuda.empty_cache()
    write_rows(a.json, rows)


def write_rows(path: str | None, rows: list) -> None:
    """Write the rows, with the GPU and torch version, to the JSON file ``path`` (None: nothing)."""
    if path:
        with open(path, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
