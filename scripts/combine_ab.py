"""The top-k combine in GEMM2's epilogue (``triton_backend.COMBINE_IN_GEMM2``) against the finalize pass, on a GPU.

    python scripts/combine_ab.py                                       # four shapes, T = 128, 1024, 4096, 16384
    python scripts/combine_ab.py --shape olmoe --tokens 4096 --json out.json

For each shape and T: one ``moelab.routed_moe`` call as the bench's "moelab triton" row makes it (``token_major_ab``'s
layer and inputs: bf16 random weights at the real size, packed routing words, ``validate=False``) in three modes:
"finalize" (GEMM2 writes the permuted rows, the finalize sums them: the deterministic path), "combine" (GEMM2's
epilogue adds each weighted row into a zeroed fp32 [T, H] sum by atomics, one rounding copy into the output) and
"combine-input" (the atomics add in bf16 into the zeroed output itself). Timed in the order A B C C B A (two medians
each, averaged: drift cancels), eagerly and, up to ``--graph-max-t``, replayed from a CUDA graph
(``moelab.roofline.median_us``: medians of ``triton.testing.do_bench``, L2 flushed); each output is first checked
against the finalize's (relative error < 1e-2), and the call's peak allocation is measured.
"""

from __future__ import annotations

import argparse
import re

import torch
from token_major_ab import _call, _inputs, _layer, write_rows  # noqa: E402  (scripts/ is on sys.path as a script)

from moelab.backends import triton_backend
from moelab.bench.cli import _split_shapes
from moelab.kernels import moe_gemm
from moelab.lab import rel_err
from moelab.roofline import get_shape, graphed, median_us

MODES = {"finalize": ("never", "fp32"), "combine": ("always", "fp32"), "combine-input": ("always", "input")}


def _mode(name: str) -> None:
    triton_backend.COMBINE_IN_GEMM2, triton_backend.COMBINE_SUM = MODES[name]


def _peak_mib(call, device) -> float:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    call()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b;olmoe;mixtral;gpt-oss-20b")
    p.add_argument("--tokens", default="128,1024,4096,16384")
    p.add_argument("--graph-max-t", type=int, default=4096)
    p.add_argument("--modes", default="finalize,combine,combine-input", help=f"comma list of {list(MODES)}; the "
                   "first is the baseline")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    if any(m not in MODES for m in modes) or len(set(modes)) < len(modes):
        p.error(f"--modes {a.modes}: each once, from {list(MODES)}")
    base = modes[0]
    device = torch.device("cuda")
    rows = []
    print(f"| shape | T | mode | eager µs | graph µs | eager / {base} | graph / {base} | peak MiB | rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in (get_shape(name) for name in _split_shapes(a.shape)):
        weights = _layer(shape, torch.bfloat16, device)
        for T in (int(t) for t in a.tokens.split(",")):
            x, packed = _inputs(shape, T, torch.bfloat16, device)
            call = _call(packed, x, weights, shape)
            _mode(base)
            want = call().clone()
            times, checks, peaks = {m: [] for m in modes}, {}, {}
            for name in modes + modes[::-1]:
                _mode(name)
                if name not in checks:
                    checks[name] = rel_err(call(), want)
                    assert checks[name] < 1e-2, f"{shape.name} T={T} {name}: rel err {checks[name]:.2e}"
                    peaks[name] = _peak_mib(call, device)
                eager = median_us(call, device)
                graph = median_us(graphed(call, device), device) if T <= a.graph_max_t else None
                times[name].append((eager, graph))
            _mode("finalize")
            mean = {m: [sum(t[i] for t in times[m]) / 2 if times[m][0][i] is not None else None for i in (0, 1)]
                    for m in modes}
            for name in modes:
                eager, graph = mean[name]
                row = dict(shape=shape.name, T=T, mode=name, eager_us=eager, graph_us=graph, rel_err=checks[name],
                           peak_mib=peaks[name], medians=times[name])
                rows.append(row)
                g, gr = ("", "") if graph is None else (f"{graph:.1f}", f"{graph / mean[base][1]:.3f}")
                print(f"| {shape.name} | {T} | {name} | {eager:.1f} | {g} | {eager / mean[base][0]:.3f} | {gr} | "
                      f"{peaks[name]:.1f} | {checks[name]:.1e} |", flush=True)
        del weights
        torch.cuda.empty_cache()
    write_rows(a.json, rows)
    print_gemm2_variants()


def print_gemm2_variants() -> None:
    """Registers, spills and the atomic instructions of every GEMM2 variant this process compiled."""
    for cache in moe_gemm._gemm2_kernel.device_caches.values():
        for kernel in cache[0].values():
            atomics = sorted(set(re.findall(r"(?:red|atom)\.[\w.]+", kernel.asm["ptx"])))
            print(f"GEMM2: {kernel.metadata.num_warps} warps, {kernel.n_regs} registers, {kernel.n_spills} spills, "
                  f"{kernel.metadata.shared} B shared, atomics {atomics}")


if __name__ == "__main__":
    main()
