"""Does a CUDA graph of the token-major LoRA path pay for the fills of its kept buffers? On a CUDA GPU.

    python scripts/kept_buffers_ab.py                                 # Qwen3-30B-A3B and OLMoE, T = 1 and 2
    python scripts/kept_buffers_ab.py --shape qwen3-30b-a3b --tokens 1 --json out.json

The token-major LoRA kernels read int32 buffers kept per device and stream (``moelab/kernels/token_major.py``,
``_kept_buffer``: the fused shrink's slot flags, and the -1 adapter ids of a call without ids). A capture on a
stream that no eager call has used finds none, so it fills a buffer of its own: a fill in the graph, run on every
replay. ``torch.cuda.graph`` captures on a stream of its own and ``moelab.roofline.graphed`` (the bench) warms up on
another, so the bench's LoRA graphs carry those fills. For each shape and T, three calls (one rank-16 adapter on
every token, the same bank with no token on an adapter, and the base ``routed_moe`` call) are each captured twice on
new streams: "fresh" as the bench does, "warm" after one eager call on the capture stream (the buffers kept, so no
fill is captured). The fills each capture launched are counted (``CUDAGraph.debug_dump`` wrote an empty file on
torch 2.11, so the graphs' nodes are not counted); the pair runs in the order A B B A, each timed as the bench times
a graph (median of single replays, L2 flushed) and back to back; the warm graph's output must equal the fresh one's
(bit for bit for the base call; within 1e-2 relative for the LoRA calls, whose W2 shrink sums by fp32 atomics).
"""

from __future__ import annotations

import argparse
import json
import types

import torch

import moelab
from moelab.backends import eager_graphs
from moelab.bench.cli import _split_shapes
from moelab.bench.impls import make_bank
from moelab.lab import rel_err
from moelab.roofline import back_to_back_us, get_shape, median_us


def _calls(shape, T, device):
    """name -> a function of no arguments: the LoRAExperts calls and the base call at ``T`` tokens."""
    g = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16
    w13 = torch.randn(shape.E, 2 * shape.I, shape.H, device=device, dtype=dt, generator=g) / shape.H**0.5
    w2 = torch.randn(shape.E, shape.H, shape.I, device=device, dtype=dt, generator=g) / shape.I**0.5
    x = torch.randn(T, shape.H, device=device, dtype=dt, generator=g)
    ids = torch.rand(T, shape.E, device=device, generator=g).argsort(dim=1)[:, :shape.K].int()
    weights = torch.rand(T, shape.K, device=device, generator=g)
    bank = make_bank(types.SimpleNamespace(shape=shape, dtype=dt, device=device), [16])  # the bench's bank
    mod = moelab.LoRAExperts(w13, w2, num_experts=shape.E, top_k=shape.K, lora=bank, backend="triton")
    on_adapter = torch.zeros(T, dtype=torch.int32, device=device)
    packed = moelab.pack_topk_ids_weights(ids, weights)
    W = moelab.prepare_weights(w13, w2, backend="triton")
    return {"one rank-16 adapter": lambda: mod(x, weights, ids, on_adapter, has_lora=True, validate=False),
            "the bank, no adapter": lambda: mod(x, weights, ids, None, validate=False),
            "base": lambda: moelab.routed_moe(packed, x, W, num_experts=shape.E, top_k=shape.K, validate=False)[0]}


def _graph(fn, warm: bool):
    """``fn`` captured on a new stream after two warm-up calls on another; ``warm``: one more call on the capture
    stream first. Returns (replay, its output, the number of fills captured in the graph)."""
    side, capture = torch.cuda.Stream(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    if warm:
        capture.wait_stream(side)
        with torch.cuda.stream(capture):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    fills, full = [], torch.full

    def counting_full(*args, **kwargs):  # the kept buffers' fills are torch.full calls (token_major._kept_buffer)
        if torch.cuda.is_current_stream_capturing():
            fills.append(args)
        return full(*args, **kwargs)

    torch.full = counting_full
    try:
        with torch.cuda.graph(graph, stream=capture):
            out = fn()
    finally:
        torch.full = full
    return graph.replay, out, len(fills)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b;olmoe")
    p.add_argument("--tokens", default="1,2")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    eager_graphs.ENABLED = False  # eager calls run the kernels, so the warm call keeps the buffers on its stream
    rows = []
    print("| shape | T | call | fresh: fills | warm: fills | fresh µs | warm µs | warm / fresh | fresh b2b | "
          "warm b2b |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in (get_shape(name) for name in _split_shapes(a.shape)):
        for T in (int(t) for t in a.tokens.split(",")):
            for name, fn in _calls(shape, T, device).items():
                fresh, warm = _graph(fn, False), _graph(fn, True)
                fresh[0]()
                warm[0]()
                torch.cuda.synchronize()
                if name == "base":
                    assert torch.equal(fresh[1], warm[1]), f"{shape.name} T={T} {name}: warm graph differs"
                else:  # the LoRA W2 shrink sums by fp32 atomics: a last bit may differ from run to run
                    err = rel_err(warm[1], fresh[1])
                    assert err < 1e-2, f"{shape.name} T={T} {name}: warm graph differs, rel err {err:.2e}"
                us = {0: [], 1: []}
                b2b = {0: [], 1: []}
                for i in (0, 1, 1, 0):
                    replay = (fresh, warm)[i][0]
                    us[i].append(median_us(replay, device))
                    b2b[i].append(back_to_back_us(replay, device, calls=200))
                m = {i: sum(v) / 2 for i, v in us.items()}
                b = {i: sum(v) / 2 for i, v in b2b.items()}
                rows.append(dict(shape=shape.name, T=T, call=name, fresh_fills=fresh[2], warm_fills=warm[2],
                                 fresh_us=us[0], warm_us=us[1], fresh_b2b_us=b2b[0], warm_b2b_us=b2b[1]))
                print(f"| {shape.name} | {T} | {name} | {fresh[2]} | {warm[2]} | {m[0]:.1f} | {m[1]:.1f} | "
                      f"{m[1] / m[0]:.3f} | {b[0]:.1f} | {b[1]:.1f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
