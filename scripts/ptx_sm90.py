"""Compile moelab's GEMM kernels for sm_90 on any machine (no GPU needed) and write their PTX, to check that a
refactor leaves the compiled code unchanged.

    python scripts/ptx_sm90.py build/ptx-before      # on the old commit
    python scripts/ptx_sm90.py build/ptx-after       # on the new one
    diff -r build/ptx-before build/ptx-after && echo identical
    python scripts/ptx_sm90.py build/ptx --options   # also the other activations, biases, weight on the input
    python scripts/ptx_sm90.py build/ptx --tma       # also the TMA loads of the wide tiles
    python scripts/ptx_sm90.py build/ptx --tma --ws  # and those with WARP_SPECIALIZE (compare gemm*_tma_ws.ptx)
    python scripts/ptx_sm90.py build/ptx --gluon     # also the Gluon GEMMs (both tile orders, delta, LoRA modes)
    python scripts/ptx_sm90.py build/ptx --segments  # also the segments kernels (moelab/kernels/segments.py)
    MOELAB_RECORD_LAUNCHES=build/launches pytest tests/test_token_major.py   # record the tests' launches, then
    python scripts/ptx_sm90.py build/ptx --launched build/launches           # compile each (tests/conftest.py)

Line info is off (a moved source line would change the debug labels only); pointers, sizes and strides carry
the divisibility-by-16 hint a real launch at the H200 shapes gets. Variants: the default SwiGLU GEMM1 and GEMM2 at
a prefill and a decode tile, with a delta, and with the fused LoRA in both modes (bf16).
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (before moelab imports triton)
os.environ["TRITON_DISABLE_LINE_INFO"] = "1"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moelab.kernels import moe_gemm  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BF16_POINTERS = {"x_ptr", "w13_ptr", "act_ptr", "w2_ptr", "out_ptr", "delta_ptr", "up_b_ptr", "gate_b_ptr",
                 "down_a_ptr", "down_b_ptr", "s13_ptr"}
BASE = dict(DOT_F32=False, DOT_PRECISION="tf32", DEAD_FILL=0.0)
PREFILL, DECODE = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64), dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)
TILES_LORA, DECODE_LORA = dict(LORA=True, L_PAD=2, R_PAD=16), dict(LORA=True, L_PAD=1, R_PAD=16, LORA_DECODE=True)
GEMM1, GEMM2 = moe_gemm._gemm1_swiglu_kernel, moe_gemm._gemm2_kernel
VARIANTS = {
    "gemm1_prefill": (GEMM1, dict(HAS_DELTA=False, EVEN_K=True, **PREFILL)),
    "gemm1_decode_delta": (GEMM1, dict(HAS_DELTA=True, EVEN_K=False, **DECODE)),
    "gemm1_lora_tiles": (GEMM1, dict(HAS_DELTA=False, EVEN_K=True, **PREFILL, **TILES_LORA)),
    "gemm1_lora_decode": (GEMM1, dict(HAS_DELTA=False, EVEN_K=True, USE_GDC=True, **DECODE, **DECODE_LORA)),
    "gemm2_prefill": (GEMM2, dict(EVEN_K=True, **PREFILL)),
    "gemm2_decode": (GEMM2, dict(EVEN_K=False, USE_GDC=True, **DECODE)),
    "gemm2_lora_tiles": (GEMM2, dict(EVEN_K=True, **PREFILL, **TILES_LORA)),
    "gemm2_lora_decode": (GEMM2, dict(EVEN_K=False, USE_GDC=True, **DECODE, **DECODE_LORA)),
}
#: The other expert activations, biases and the router weight on the input: compiled to show they build for sm_90
#: (a pointer argument given as its type string).
OPTIONS = {
    "gemm1_swigluoai_bias": (GEMM1, dict(HAS_DELTA=True, EVEN_K=True, **PREFILL, ACTIVATION="swigluoai",
                                         SWIGLU_ALPHA=1.702, SWIGLU_LIMIT=7.0, bias_ptr="*bf16")),
    "gemm1_gelu_on_input": (GEMM1, dict(HAS_DELTA=False, EVEN_K=True, **DECODE, ACTIVATION="gelu",
                                        in_weight_ptr="*i32", IN_WEIGHT_PACKED=True)),
    "gemm1_gelu_tanh_limit": (GEMM1, dict(HAS_DELTA=False, EVEN_K=True, **PREFILL, ACTIVATION="gelu_tanh",
                                          SWIGLU_LIMIT=3.0, in_weight_ptr="*fp32")),
    "gemm1_relu2_plain": (GEMM1, dict(HAS_DELTA=True, EVEN_K=False, **PREFILL, ACTIVATION="relu2", GATED=False,
                                      bias_ptr="*bf16")),
    "gemm2_bias": (GEMM2, dict(EVEN_K=True, **PREFILL, bias_ptr="*bf16")),
}

#: The TMA loads (``W_DESC``) on 128-row tiles (``--tma``).
TMA_TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, W_DESC=True)
TMA = {
    "gemm1_tma": (GEMM1, dict(HAS_DELTA=False, EVEN_K=True, **TMA_TILE)),
    "gemm1_tma_lora_tiles": (GEMM1, dict(HAS_DELTA=False, EVEN_K=True, **TMA_TILE, **TILES_LORA)),
    "gemm2_tma": (GEMM2, dict(EVEN_K=True, **TMA_TILE)),
    "gemm2_tma_lora_tiles": (GEMM2, dict(EVEN_K=True, **TMA_TILE, **TILES_LORA)),
}

#: The TMA variants with Triton's warp specialisation of the K loop (``--ws``; ``moe_gemm.WARP_SPECIALIZE``).
WS = {f"{name}_ws": (kernel, {**given, "WARP_SPECIALIZE": True}) for name, (kernel, given) in TMA.items()}


def arg_type(name: str, consts: dict) -> str:
    if isinstance(consts.get(name), str) and consts[name].startswith("*"):
        return consts[name]
    if name == "s2_ptr":
        return "*fp32" if consts.get("LORA_DECODE") else "*bf16"
    if name.endswith("_ptr"):
        return "*bf16" if name in BF16_POINTERS else ("*fp32" if name == "weights_ptr" else "*i32")
    return "i32"


def compile_for_sm90(kernel, types: dict, constexprs: dict, hinted, **options) -> str:
    """``kernel``'s PTX for sm_90: each argument a constexpr of ``constexprs`` or of its type in ``types``, the
    arguments named in ``hinted`` divisible by 16, Triton's ``options`` (num_warps, num_stages)."""
    signature = {n: "constexpr" if n in constexprs else types[n] for n in kernel.arg_names}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in hinted}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET, options=options).asm["ptx"]


def constexprs_of(kernel, given: dict) -> dict:
    """``kernel``'s constexprs: its constexpr parameters (``given`` or their defaults), and the arguments that default
    to None and are not ``given`` (None arguments specialise to constexprs)."""
    return {p.name: given.get(p.name, p.default) for p in kernel.params
            if p.is_constexpr or (p.name not in given and p.default is None)}


def compile_ptx(kernel, given: dict) -> str:
    consts = constexprs_of(kernel, given)
    types = {n: arg_type(n, {**BASE, **given}) for n in kernel.arg_names if n not in consts}
    hinted = [n for n in types if n.endswith("_ptr") or n in ("H", "I") or n.startswith("stride_")]
    return compile_for_sm90(kernel, types, consts, hinted, num_warps=4, num_stages=3 if given["BLOCK_M"] >= 64 else 4)


def segment_variants() -> dict:
    """The segments kernels (``--segments``): name -> (kernel, constexprs and pointer types, warps), at the sizes
    the routed MoE launches (1024-slot chunks, 256 or 8192 bins; the one program with and without bisection)."""
    from moelab.kernels import segments as seg

    chunk = dict(CHUNK=1024, G_BINS=256, PACKED=True, BY_ADAPTER=False)
    return {
        "seg_count": (seg._segments_count_kernel, dict(chunk, ATOMIC=False), 4),
        "seg_count_atomic": (seg._segments_count_kernel, dict(chunk, G_BINS=8192, PACKED=False, BY_ADAPTER=True,
                                                              ATOMIC=True, adapter_ptr="*i32"), 4),
        "seg_scan_one": (seg._segments_scan_kernel, dict(TILE=128, G_BINS=256, CB=16, BG=256), 4),
        "seg_scan_many": (seg._segments_scan_kernel, dict(TILE=128, G_BINS=8192, CB=4, BG=256), 4),
        "seg_scatter": (seg._segments_scatter_kernel, dict(chunk, TILE=128, CB=16, BISECT=False), 4),
        "seg_scatter_scan": (seg._segments_scatter_kernel, dict(chunk, TILE=128, CB=16, BISECT=False, SCAN=True,
                                                                SCAN_CB=8, hist_ptr="*i32"), 4),
        "seg_one_chunk": (seg._segments_one_chunk_kernel, dict(chunk, TILE=64, CB=16, BISECT=False), 8),
        "seg_one_chunk_bisect": (seg._segments_one_chunk_kernel, dict(chunk, TILE=64, G_BINS=1024, PACKED=False,
                                                                      CB=seg.BISECT_CB, BISECT=True), 4),
    }


def compile_segments_ptx(kernel, given: dict, num_warps: int) -> str:
    """A segments kernel's PTX: int32 pointers (or the type ``given`` names) hinted 16-byte aligned, i32 scalars."""
    consts = constexprs_of(kernel, given)
    types = {n: given[n] if isinstance(given.get(n), str) else "*i32" if n.endswith("_ptr") else "i32"
             for n in kernel.arg_names if n not in consts}
    return compile_for_sm90(kernel, types, consts, [n for n in types if n.endswith("_ptr")], num_warps=num_warps)


#: The Gluon GEMMs (``--gluon``): name -> compile_sm90's arguments (tile None: the default).
GLUON = {"gluon_gemm1": dict(gemm="gemm1"), "gluon_gemm1_3stages_grouped": dict(gemm="gemm1", tile=(128, 64, 3),
                                                                                group_m=8),
         "gluon_gemm1_delta": dict(gemm="gemm1", delta=True), "gluon_gemm1_lora": dict(gemm="gemm1", lora=(4, 16, 16)),
         "gluon_gemm2": dict(gemm="gemm2"), "gluon_gemm2_grouped": dict(gemm="gemm2", group_m=8),
         "gluon_gemm2_lora": dict(gemm="gemm2", lora=(4, 16, 16)),
         "gluon_gemm1_adapter_loop": dict(gemm="gemm1", lora=(1, 64, 64), lora_own=True),
         "gluon_gemm2_adapter_loop": dict(gemm="gemm2", lora=(1, 64, 64), lora_own=True),
         "gluon_gemm1_dynamic": dict(gemm="gemm1", dynamic=True),
         "gluon_gemm2_dynamic": dict(gemm="gemm2", dynamic=True),
         "gluon_gemm1_adapter_loop_dynamic": dict(gemm="gemm1", lora=(1, 64, 64), lora_own=True, dynamic=True),
         "gluon_gemm2_adapter_loop_dynamic": dict(gemm="gemm2", lora=(1, 64, 64), lora_own=True, dynamic=True)}


def write_ptx(out_dir: str, name: str, ptx: str) -> None:
    """``<out_dir>/<name>.ptx``, and a line with its hash."""
    with open(os.path.join(out_dir, f"{name}.ptx"), "w") as f:
        f.write(ptx)
    print(f"{name:<34} {hashlib.sha256(ptx.encode()).hexdigest()[:16]} {len(ptx)} chars")


def launched_variants(folder: str) -> dict:
    """The kernel launches the tests recorded under ``folder`` (``MOELAB_RECORD_LAUNCHES``, tests/conftest.py), once
    each: name -> (record, constexprs), with the GPU's dot flags (the interpreter upcasts bf16 dot operands:
    ``moelab.kernels._common.dot_flags``), and each launch with a ``USE_GDC`` switch also with it on (the
    interpreter never launches with programmatic dependent launch; the GPU's graphs do). The interpreter's launches
    run its own modest tiles, so these cover each kernel's code at those tiles; the GPU's tiles are the fixed
    variants above. No record under ``folder``: a SystemExit (a wrong folder, or tests run under TRITON_INTERPRET=1,
    whose launches are not moelab's to record)."""
    variants = {}
    paths = sorted(glob.glob(os.path.join(folder, "*.jsonl")))
    for path in paths:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                constexprs = dict(record["constexprs"])
                if "DOT_F32" in constexprs:
                    constexprs["DOT_F32"] = constexprs.get("DOT_PRECISION") == "ieee"
                both = "USE_GDC" in constexprs
                for chosen in ([{**constexprs, "USE_GDC": gdc} for gdc in (False, True)] if both else [constexprs]):
                    key = json.dumps([record["module"], record["kernel"], record["signature"], chosen,
                                      record["options"]], sort_keys=True)
                    name = f"{record['kernel']}_{hashlib.sha256(key.encode()).hexdigest()[:8]}"
                    variants.setdefault(name, (record, chosen))
    if not variants:
        sys.exit(f"--launched {folder}: no recorded launch there (record them with `make sm90-launches`)")
    return variants


def compile_launched(record: dict, constexprs: dict) -> str:
    """A recorded launch's PTX for sm_90: its argument types, its 16-byte-aligned pointers and multiples of 16
    hinted, its constexprs and warps."""
    kernel = getattr(importlib.import_module(record["module"]), record["kernel"])
    return compile_for_sm90(kernel, record["signature"], constexprs, record["hinted"],
                            num_warps=record["options"].get("num_warps", 4),
                            num_stages=record["options"].get("num_stages", 3))


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    chosen = VARIANTS | (OPTIONS if "--options" in sys.argv else {}) | (TMA if "--tma" in sys.argv else {}) \
        | (WS if "--ws" in sys.argv else {})
    for name, (kernel, given) in chosen.items():
        write_ptx(out_dir, name, compile_ptx(kernel, {**BASE, **given}))
    if "--segments" in sys.argv:
        for name, (kernel, given, warps) in segment_variants().items():
            write_ptx(out_dir, name, compile_segments_ptx(kernel, given, warps))
    if "--gluon" in sys.argv:
        from moelab.kernels import gluon_gemm

        for name, args in GLUON.items():
            write_ptx(out_dir, name, gluon_gemm.compile_sm90(**args).asm["ptx"])
    if "--launched" in sys.argv:
        failed = []
        for name, (record, constexprs) in launched_variants(sys.argv[sys.argv.index("--launched") + 1]).items():
            try:
                write_ptx(out_dir, name, compile_launched(record, constexprs))
            except Exception as e:  # every launch tried, each failure named; the script fails at the end
                last = [line for line in str(e).splitlines() if line.strip()][-1:] or [""]  # Triton's reason
                failed.append(f"{name} ({record['module']}): {type(e).__name__}: {last[0][:200]}")
                print(f"{name:<34} FAILED")
        if failed:
            sys.exit("kernels that did not compile for sm_90:\n  " + "\n  ".join(failed))


if __name__ == "__main__":
    main(sys.argv[1])
