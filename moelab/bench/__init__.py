"""One MoE layer forward, bf16: moelab beside its peers and the roofline, all measured in one run.

Command line (``python -m moelab.bench --help``)::

    python -m moelab.bench                                  # Qwen3-30B-A3B, T = 1,32,128,1024,4096,16384, uniform
    python -m moelab.bench --routing uniform,zipf --shape qwen3-30b-a3b,olmoe,mixtral,gpt-oss-20b,deepseek-v3
    python -m moelab.bench --shape 64,8,2048,1024           # any E,K,H,I
    python -m moelab.bench --peers grouped_mm,hf            # only these peers beside moelab (--peers none: none)
    python -m moelab.bench --lora --ops                     # LoRA rows (r16, 1 and 4 adapters) + the two ops
    python -m moelab.bench --lora --lora-variants "8x mixed,32x mixed"   # serving banks of ranks 8-64
    python -m moelab.bench --quick                          # fewer T, fewer repetitions
    python -m moelab.bench --tiny                           # E=8 K=2 H=64 I=32, T=1,8: runs on a CPU (CI)

The command exits 1 when any row errors, fails its check against the float64 reference, or gives tokens without
an adapter that are not bit for bit the base path's output (each is printed on stderr as FAILED: ...).

What one run does, on a CUDA GPU:

1. Ceilings (``moelab.roofline.measure_ceilings``): a 2 GiB device-to-device copy (bytes read + written) and an
   8192^3 bf16 matmul, on fresh random data, ``triton.testing.do_bench(..., return_mode="median")``.
2. For each shape, routing and T: ``--sets`` input sets (x, routing, adapter ids) drawn at random (never zeros)
   and the float64 truth of ``moelab.reference`` (``routed_moe``; LoRA: ``lora_experts``) for ``--check-tokens``
   of set 0's tokens (all of them when T is small). Then for every implementation: one call on set 0, its checked
   tokens compared with the reference (``||out - ref|| / ||ref||`` under 1e-2 for moelab, 2e-2 for peers) and
   every element of its output finite; the peak memory one eager call allocates
   (``torch.cuda.max_memory_allocated``, reset before the call, minus what was allocated before it); then the
   median time over calls that rotate through the sets. A broken peer records its error and the run goes on.
3. Each row is printed as it is measured, beside the roofline (``moelab.roofline.roofline``: touched experts'
   weight bytes + activations over the measured copy bandwidth, ``6*T*K*H*I`` FLOPs over the measured matmul
   rate, the larger wins), and written to ``--out`` (JSON, rewritten after every row; default
   ``build/bench/bench.json``, or ``$OUT/bench.json``) with the markdown tables beside it (``.md``).

Implementations, base mode (``--peers`` picks the peers by the key in brackets; ``--impls`` keeps those whose name
contains one of its comma-separated words):

    moelab triton           routed_moe, packed routing, validate=False, do_finalize=True
    moelab triton [graph]   the same captured in a CUDA graph (one graph per input set), T <= --graph-max-t
    moelab flashinfer       only where that backend runs (SM 10.x with flashinfer installed)
    moelab torch [torch]    moelab's plain-PyTorch backend (per-expert loop, host syncs)
    naive loop [naive]      what a reader writes first: for each expert, where(), two matmuls, index_add_
    torch grouped_mm [grouped_mm]   slots sorted by expert, torch._grouped_mm for gate_up and down; sync-free
    HF eager, HF grouped_mm [hf-eager, hf-grouped_mm]   transformers' Qwen3MoeExperts with
                            config._experts_implementation = "eager" / "grouped_mm"
    Liger fused MoE [liger] liger_kernel.ops.fused_moe.LigerFusedMoEFunction (Triton), pinned to one config
                            (LIGER_FUSED_MOE_AUTOTUNE=0) unless --liger-autotune

LoRA mode (``--lora``; variants from ``--lora-variants``, or "Nx all" and "Nx half" at ``--rank`` for each N of
``--adapters``; "Nx all": every token has one of N adapters, "Nx half": half of the tokens have -1, "Nx mixed":
N adapters of ranks 64, 32, 16, 8, 64, ... with tokens spread over all of them; the "all"/"half" variants share one
bank with as many slots as the widest, each mixed variant has its own bank of N slots):

    moelab triton               the base layer, no LoRA at all (the ratio column divides by this)
    moelab LoRAExperts          moelab.LoRAExperts(w13, w2, lora=bank, backend="triton"), called as a serving
                                engine would (has_lora known on the host, validate=False); also with all ids -1
    moelab LoRA ops [lora-ops]  vLLM's unfused flow from the public pieces: lora_segments, w13_lora_delta,
                                routed_moe(delta, do_finalize=False), unpermute_activation, w2_lora_delta,
                                finalize_with_w2_lora
    unfused LoRA (grouped_mm) [unfused]   vLLM-style separate launches, shrink and expand by torch._grouped_mm
    HF grouped_mm + PEFT [peft] peft.get_peft_model(LoraConfig(target_parameters=["gate_up_proj", "down_proj"]))
                                on HF's experts module; one adapter for the whole batch, so "1x all" only

moelab's rows with tokens of lora_id -1 are compared bit for bit with the base path's output
(``base_rows_bitwise``). transformers, PEFT and Liger are imported only when their peer runs.

``--ops``: ``unpermute_activation`` and ``finalize_with_w2_lora`` (Triton and torch fallback) at T=16384 as
achieved GB/s (bytes read + written) and the fraction of the measured copy bandwidth.

The roofline itself (shapes, ceilings, floor) is :mod:`moelab.roofline`; its names are re-exported here.
"""

from moelab.bench.cli import build_parser, main, run
from moelab.bench.report import failures, markdown
from moelab.roofline import (
    H200_CEILINGS,
    SHAPES,
    Ceilings,
    Shape,
    expected_touched_experts,
    get_shape,
    measure_ceilings,
    roofline,
)

__all__ = ["run", "main", "build_parser", "failures", "markdown", "Shape", "SHAPES", "Ceilings", "H200_CEILINGS",
           "get_shape", "measure_ceilings", "roofline", "expected_touched_experts"]
