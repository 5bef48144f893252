"""The weights' L2 prefetch (``TokenMajorConfig.prefetch1/prefetch2``, ``moe_gemm.PREFETCH_W2``) against none, on a
CUDA GPU, in one process.

    python scripts/prefetch_ab.py                                         # six shapes, T = 1, 2, 8, 32, 128
    python scripts/prefetch_ab.py --shape qwen3-30b-a3b --tokens 1 --json out.json

For each shape and T: one ``moelab.routed_moe`` call as the bench's "moelab triton" row makes it (bf16 random
weights at the real size, packed routing words of K distinct uniform experts, ``validate=False``), captured in a
CUDA graph once a mode (the path the backend's rule picks: token-major up to 16 slots, the tiled pipeline above),
with each mode's switches:

- ``off``: no prefetch;
- ``w2``: GEMM2 asks the L2 for its W2 rows before it waits for GEMM1 (token-major ``prefetch2``, tiled
  ``PREFETCH_W2``);
- ``both``: ``w2`` and token-major GEMM1 asks for its W13 rows before its K loop (``prefetch1``).

Every mode's output must equal ``off``'s bit for bit (the prefetch moves no arithmetic). Times: medians of the graph
replays (``moelab.roofline.median_us``: L2 flushed before each, the bench's measure), the modes in the order
A B C C B A, each mode's two readings averaged; ratios against ``off``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch
from token_major_ab import _call, _inputs, _layer  # noqa: E402  (scripts/ is on sys.path when run as a script)

from moelab.bench.cli import _split_shapes
from moelab.kernels import moe_gemm, token_major
from moelab.roofline import get_shape, graphed, median_us

MODES = {"off": (False, False), "w2": (False, True), "both": (True, True)}  # (prefetch1, prefetch2 / PREFETCH_W2)


def set_mode(name: str) -> None:
    """The switches of mode ``name`` for the calls captured next."""
    p1, p2 = MODES[name]
    rule = _RULE
    token_major.choose_token_major_config = lambda *shape: dataclasses.replace(rule(*shape), prefetch1=p1,
                                                                               prefetch2=p2)
    moe_gemm.PREFETCH_W2 = p2


_RULE = token_major.choose_token_major_config


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b;olmoe;64,6,2048,1408;gpt-oss-20b;mixtral;deepseek-v3")
    p.add_argument("--tokens", default="1,2,8,32,128")
    p.add_argument("--modes", default="off,w2,both")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    modes = a.modes.split(",")
    order = modes + modes[::-1]
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | T | " + " | ".join(f"{m} µs" for m in modes) + " | "
          + " | ".join(f"{m} / {modes[0]}" for m in modes[1:]) + " |")
    print("|---|---|" + "---|" * (2 * len(modes) - 1))
    rows = []
    for spec in _split_shapes(a.shape):
        shape = get_shape(spec)
        weights = _layer(shape, torch.bfloat16, device)
        for T in (int(t) for t in a.tokens.split(",")):
            x, packed = _inputs(shape, T, torch.bfloat16, device)
            replays, outs = {}, {}
            for m in modes:
                set_mode(m)
                replays[m] = graphed(_call(packed, x, weights, shape), device)
                replays[m]()
                torch.cuda.synchronize()
                outs[m] = replays[m].out.clone()
            set_mode(modes[0])
            same = {m: torch.equal(outs[m], outs[modes[0]]) for m in modes}
            times = {m: [] for m in modes}
            for m in order:
                times[m].append(median_us(replays[m], device))
            mean = {m: statistics.mean(times[m]) for m in modes}
            row = dict(shape=shape.name, T=T, us=times, mean_us=mean, bitwise=same,
                       ratio={m: mean[m] / mean[modes[0]] for m in modes})
            rows.append(row)
            flags = "" if all(same.values()) else " NOT BIT-EQUAL: " + ",".join(m for m in modes if not same[m])
            print(f"| {shape.name} | {T} | " + " | ".join(f"{mean[m]:.1f} ({times[m][0]:.1f}, {times[m][1]:.1f})"
                                                        for m in modes) + " | "
                  + " | ".join(f"{row['ratio'][m]:.3f}" for m in modes[1:]) + f" |{flags}", flush=True)
            del replays, outs
        del weights
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
