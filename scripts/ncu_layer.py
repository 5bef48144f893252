"""One routed-MoE layer call, for Nsight Compute to profile its kernels (the GEMMs, the finalize) on a CUDA GPU.

    ncu --clock-control none -k regex:_gemm --launch-skip 2 --launch-count 2 --section SpeedOfLight \\
        python scripts/ncu_layer.py --shape qwen3-30b-a3b --tokens 16384

Makes the call as the bench's "moelab triton" row does (``scripts/token_major_ab.py``'s layer and inputs), once to
compile and warm up, then ``--calls`` more times (``--launch-skip 2`` above skips the warm-up call's two GEMMs).
"""

from __future__ import annotations

import argparse

import torch
from token_major_ab import _call, _force, _inputs, _layer  # noqa: E402  (scripts/ is on sys.path when run as a script)

from moelab.roofline import get_shape


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--calls", type=int, default=1)
    p.add_argument("--tiled", action="store_true", help="the tiled pipeline at every T (segments, GEMM1, GEMM2, "
                   "finalize: what a CUDA graph of a decode call runs), not the token-major path")
    a = p.parse_args(argv)
    if a.tiled:
        _force(0)
    shape, device = get_shape(a.shape), torch.device("cuda")
    x, packed = _inputs(shape, a.tokens, torch.bfloat16, device)
    call = _call(packed, x, _layer(shape, torch.bfloat16, device), shape)
    for _ in range(1 + a.calls):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
