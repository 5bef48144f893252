"""The GEMMs' TMA loads (``moelab.kernels.moe_gemm.TMA``) against their pointer loads, on a CUDA GPU (Hopper+).

    python scripts/tma_ab.py                                      # six shapes, T = 128, 1024, 4096, 16384
    python scripts/tma_ab.py --shape mixtral --tokens 4096 --json out.json
    python scripts/tma_ab.py --modes rule-a201208,rule             # HEAD's rule against a201208's

For each shape and T: one ``moelab.routed_moe`` call as the bench's "moelab triton" row makes it (bf16 random
weights at the real size, packed routing words of K distinct uniform experts, ``validate=False``), timed with the
pointer loads (``TMA`` off), with TMA where its rule takes it (``TMA_MIN_BLOCK_M``, ``TMA_MIN_HI``,
``TMA_MIN_HI_GEMM2``: "rule") and with TMA on every tile of 16 rows or more of any expert ("everywhere";
``--modes`` picks others of ``MODES``, the first the baseline), in the order A B C C B A (two medians each,
averaged: drift cancels), eagerly and, up to ``--graph-max-t``, replayed from a CUDA graph
(``moelab.roofline.median_us``: medians of ``triton.testing.do_bench``, L2 flushed). Each output is checked
against the baseline's (relative error < 1e-2; "bitwise" says whether they are equal) before it is timed. Prints a
table; ``--json`` writes the rows.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from token_major_ab import _call, _inputs, _layer, write_rows  # noqa: E402  (scripts/ is on sys.path when run as a script)

from moelab.backends import triton_backend
from moelab.bench.cli import _split_shapes
from moelab.kernels import gluon_gemm, moe_gemm
from moelab.lab import rel_err
from moelab.roofline import get_shape, graphed, median_us

#: The ``moe_gemm`` settings of each mode. 204f0a7's run named its modes by the block rows alone, on every expert:
#: "tma64" (TMA_MIN_BLOCK_M 64, TMA_MIN_HI 0) and "tma16" (16, 0). "rule-a201208": the rule before GEMM2 took TMA on
#: every expert size (TMA_MIN_HI_GEMM2) and at most GEMM2_MAX_STAGES stages on 128-row tiles.
RULE = dict(TMA=True, TMA_MIN_BLOCK_M=moe_gemm.TMA_MIN_BLOCK_M, TMA_MIN_HI=moe_gemm.TMA_MIN_HI,
            TMA_MIN_HI_GEMM2=moe_gemm.TMA_MIN_HI_GEMM2, GEMM2_MAX_STAGES=moe_gemm.GEMM2_MAX_STAGES)
#: "tiles128": the rule's loads on the tile table's first bucket of 128-row tiles or more wherever its own bucket has
#: fewer rows (``MIN_BLOCK_M``; on an sm_90 GPU the Gluon GEMMs then run), e.g. 64 rows an expert on one 128-row tile.
MODES = {"pointers": RULE | dict(TMA=False), "rule": RULE,  # pointers: what MOELAB_TMA=0 gives at HEAD
         "rule-a201208": RULE | dict(TMA_MIN_HI_GEMM2=moe_gemm.TMA_MIN_HI, GEMM2_MAX_STAGES=1 << 10),
         "everywhere": RULE | dict(TMA_MIN_BLOCK_M=16, TMA_MIN_HI=0, TMA_MIN_HI_GEMM2=0),
         "tiles128": RULE | dict(MIN_BLOCK_M=128),
         "static": RULE | dict(TILE_SCHEDULE="static"),
         "grid-tiles": RULE | dict(TILE_SCHEDULE="grid"), "dynamic": RULE | dict(TILE_SCHEDULE="dynamic"),
         "group2": RULE | dict(GROUP_M=2), "grid-tiles-group2": RULE | dict(TILE_SCHEDULE="grid", GROUP_M=2),
         "dynamic-group2": RULE | dict(TILE_SCHEDULE="dynamic", GROUP_M=2), "group8": RULE | dict(GROUP_M=8)}
#: "static", "grid-tiles", "dynamic": the Gluon GEMMs' tile schedule on every call (``gluon_gemm.TILE_SCHEDULE``;
#: "rule" has its rule): every num_programs-th tile, one program a tile, or tiles claimed from a counter;
#: "groupN": tiles of 128 rows or more take the tile order group_m = N on every expert size (two row tiles of one
#: expert, the second often a few rows past 128, then run side by side).
#: ``--ws MODE[,MODE]``: the rule's TMA launches with Triton's warp specialisation of GEMM2's K loop, or both's;
#: "ws-gemm1-tma": GEMM1's weight tiles through TMA on every expert size (TMA_MIN_HI 0) and its K loop warp
#: specialised, GEMM2's not.
WS_MODES = {"ws-gemm2": {"gemm1": False, "gemm2": True}, "ws-both": {"gemm1": True, "gemm2": True},
            "ws-gemm1-tma": {"gemm1": True, "gemm2": False}}
WS_SETTINGS = {"ws-gemm1-tma": RULE | dict(TMA_MIN_HI=0)}  # the rest run the rule's settings


_TABLE = triton_backend.choose_config


def tiles_of_at_least(block_m: int, lora_own_only: bool = False):
    """A ``choose_config`` giving the tile table's config, or its first bucket above with tiles of ``block_m`` rows
    or more (``lora_own_only``: only for the adapter loop's calls, ``lora_own=True``; the others keep the table's)."""
    def choose(num_tokens, *args, **kwargs):
        cfg, tokens = _TABLE(num_tokens, *args, **kwargs), num_tokens
        while (kwargs.get("lora_own") or not lora_own_only) and cfg.block_m < block_m and tokens < 1 << 24:
            tokens *= 2
            cfg = _TABLE(tokens, *args, **kwargs)
        return cfg
    return choose


def group_of(group_m: int, choose):
    """``choose`` with group_m = ``group_m`` on its tiles of 128 rows or more."""
    def grouped(*args, **kwargs):
        cfg = choose(*args, **kwargs)
        return dataclasses.replace(cfg, group_m=group_m) if cfg.block_m >= 128 else cfg
    return grouped


def apply_settings(settings: dict) -> None:
    """Set these ``moe_gemm`` module attributes (a mode of ``MODES``, or any such dict); ``MIN_BLOCK_M``: the
    pipeline's tiles (:func:`tiles_of_at_least`), ``GROUP_M``: their tile order (:func:`group_of`; the layout cache
    cleared for both), ``TILE_SCHEDULE``: ``gluon_gemm.TILE_SCHEDULE``."""
    settings = dict(settings)
    min_block_m = settings.pop("MIN_BLOCK_M", 0)
    group_m = settings.pop("GROUP_M", 0)
    gluon_gemm.TILE_SCHEDULE = settings.pop("TILE_SCHEDULE", "rule")
    choose = tiles_of_at_least(min_block_m) if min_block_m else _TABLE
    triton_backend.choose_config = group_of(group_m, choose) if group_m else choose
    triton_backend._layout.cache_clear()
    for key, value in settings.items():
        setattr(moe_gemm, key, value)


def _mode(name):
    moe_gemm.WARP_SPECIALIZE.update(WS_MODES.get(name, {"gemm1": False, "gemm2": False}))
    apply_settings(WS_SETTINGS.get(name, MODES["rule"]) if name in WS_MODES else MODES[name])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b;olmoe;mixtral;gpt-oss-20b;deepseek-v3;64,6,2048,1408")
    p.add_argument("--tokens", default="128,1024,4096,16384")
    p.add_argument("--graph-max-t", type=int, default=1024)
    p.add_argument("--json", default=None)
    p.add_argument("--ws", default=None, help=f"modes pointers, rule and these of {list(WS_MODES)} (comma list) "
                   "instead (one per process is safest: a compiler abort ends the process)")
    p.add_argument("--modes", default="pointers,rule,everywhere", help=f"comma list of {list(MODES)}; the first "
                   "is the baseline")
    a = p.parse_args(argv)
    if a.ws and a.modes != p.get_default("modes"):
        p.error("--ws sets the modes itself (pointers, rule and its own): leave --modes out")
    modes = ["pointers", "rule", *a.ws.split(",")] if a.ws else a.modes.split(",")
    unknown = [m for m in modes if m not in MODES and m not in WS_MODES]
    if unknown or len(set(modes)) < len(modes):
        p.error(f"modes {modes}: each once, from {list(MODES)} (--ws: {list(WS_MODES)})")
    base_mode = modes[0]
    device = torch.device("cuda")
    rows, modes_failed = [], set()
    print(f"| shape | T | mode | eager µs | graph µs | eager / {base_mode} | graph / {base_mode} | rel err | bitwise |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in (get_shape(name) for name in _split_shapes(a.shape)):
        weights = _layer(shape, torch.bfloat16, device)
        for T in (int(t) for t in a.tokens.split(",")):
            x, packed = _inputs(shape, T, torch.bfloat16, device)
            call = _call(packed, x, weights, shape)
            _mode(base_mode)
            want = call().clone()
            times = {m: [] for m in modes}
            checks = {}
            for name in modes + modes[::-1]:
                _mode(name)
                if name not in checks:
                    try:
                        got = call()
                    except Exception as e:  # a mode that does not compile: recorded, not fatal
                        print(f"# {shape.name} T={T} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        checks[name] = (float("inf"), False)
                        modes_failed.add(name)
                        continue
                    checks[name] = (rel_err(got, want), torch.equal(got, want))
                    assert checks[name][0] < 1e-2, f"{shape.name} T={T} {name}: rel err {checks[name][0]:.2e}"
                if name in modes_failed:
                    continue
                eager = median_us(call, device)
                graph = median_us(graphed(call, device), device) if T <= a.graph_max_t else None
                times[name].append((eager, graph))
            _mode(base_mode)
            for name in (m for m in modes if m not in modes_failed):
                eager = sum(t[0] for t in times[name]) / 2
                graph = None if times[name][0][1] is None else sum(t[1] for t in times[name]) / 2
                base_e = sum(t[0] for t in times[base_mode]) / 2
                base_g = None if graph is None else sum(t[1] for t in times[base_mode]) / 2
                row = dict(shape=shape.name, T=T, mode=name, eager_us=eager, graph_us=graph, rel_err=checks[name][0],
                           bitwise=checks[name][1], medians=times[name])
                rows.append(row)
                g = "" if graph is None else f"{graph:.1f}"
                gr = "" if graph is None else f"{graph / base_g:.3f}"
                print(f"| {shape.name} | {T} | {name} | {eager:.1f} | {g} | {eager / base_e:.3f} | {gr} | "
                      f"{checks[name][0]:.1e} | {checks[name][1]} |", flush=True)
        del weights, call
        torch.cuda.empty_cache()
    write_rows(a.json, rows)


if __name__ == "__main__":
    main()
