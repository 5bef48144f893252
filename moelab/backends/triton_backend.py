"""Backend "triton": the routed-MoE contract with moelab's own Triton kernels (any CUDA GPU; CPU through the
interpreter), bf16/fp16/fp32, no host synchronisation (CUDA-graph capturable), no alignment requirement.

Pipeline (launches): segments by local expert (one Triton program up to 1024 slots, else three) ->
GEMM1 + LoRA delta + SwiGLU -> GEMM2 -> finalize. The tile of the permuted space is the GEMM's BLOCK_M,
so a tile never mixes experts. With a fused LoRA bank (``LoRAExperts``): segments -> W13 shrink -> GEMM1 (+expand)
-> W2 shrink -> GEMM2 (+expand) -> finalize; at decode segments + W13 shrink -> GEMM1 (+expand, + W2 shrink by
atomics) -> GEMM2 (+expand) -> finalize, the base layer's four launches. While a CUDA graph is captured on Hopper or
newer, the kernels are chained by programmatic dependent launch (``moelab._runtime.pdl_launch``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from moelab import _runtime
from moelab.backends import lora_flow
from moelab.contract import LoRAExpertsCall, RoutedMoECall, RoutedMoEResult, permuted_rows
from moelab.kernels.finalize import finalize_triton
from moelab.kernels.moe_gemm import (
    _decode_segments_w13_shrink_kernel,
    _gemm1_swiglu_kernel,
    _gemm2_kernel,
    _lora_shrink_kernel,
)
from moelab.kernels.segments import MAX_CHUNK, build_segments_triton, plan_one_chunk
from moelab.lora import LoRABank
from moelab.permutation import cdiv, next_pow2


def unavailable_reason(device: torch.device) -> str | None:
    if not _runtime.HAS_TRITON:
        return "the triton package is not installed"
    if _runtime.triton_can_run(device):
        return None
    return f"Triton runs on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1; got {device.type}"


def prepare(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return w13.contiguous(), w2.contiguous()  # HF order is the kernels' own layout


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # = the tile of the permuted space
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


_CONFIG_FILE = Path(__file__).with_name("triton_configs.json")
#: (max rows per expert, config) ascending; tuned on a GPU by scripts/tune_moe.py.
CONFIG_BUCKETS = [(b["max_rows_per_expert"], GemmConfig(*b["config"]))
                  for b in json.loads(_CONFIG_FILE.read_text())["buckets"]]
#: Shared memory a config may pipeline through (H200: 228 KB per SM; leave room for the epilogue).
_SMEM_BUDGET = 200 * 1024
#: ... and with the fused LoRA's expand operands beside the pipeline (the H200 refuses kernels past 227 KB).
_SMEM_BUDGET_LORA = 216 * 1024


def choose_config(num_tokens: int, top_k: int, num_local_experts: int,
                  dtype: torch.dtype = torch.bfloat16, lora_columns: int = 0) -> GemmConfig:
    """Tile sizes by rows per local expert, from ``triton_configs.json``. Decode is weight-bandwidth bound
    (small BLOCK_M, many programs streaming weights); prefill is compute bound (big tiles for tensor-core reuse).
    fp32 operands take twice the shared memory per stage, so the pipeline depth shrinks to fit.

    ``lora_columns``: the fused LoRA's stacked width. On Hopper, tiles of BLOCK_M >= 64 (wgmma) keep GEMM1's
    expand operands, [BLOCK_M, 2*columns] rank vectors and [2*columns, BLOCK_N] B^T, in shared memory beside the
    pipeline's stages (measured: 196608 B + 16384 B for 16 columns at 128x128x64, 4 stages), so the pipeline
    gives up stages for them; the BLOCK_M = 16 decode tiles showed no such growth."""
    if _runtime.INTERPRET:  # numpy executes each program: few, modest tiles keep CPU tests quick
        return GemmConfig(16, 32, 32, 4, 1)
    rows_per_expert = num_tokens * top_k / max(num_local_experts, 1)
    cfg = next(c for limit, c in CONFIG_BUCKETS if rows_per_expert <= limit)
    itemsize = torch.finfo(dtype).bits // 8
    per_stage = (cfg.block_m * cfg.block_k + 2 * cfg.block_k * cfg.block_n) * itemsize
    stages = max(1, min(cfg.num_stages, _SMEM_BUDGET // per_stage))
    if lora_columns and cfg.block_m >= 64:
        expand_operands = 2 * lora_columns * (cfg.block_m + cfg.block_n) * itemsize
        stages = max(1, min(stages, (_SMEM_BUDGET_LORA - expand_operands) // per_stage))
    return GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, stages)


def _dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast dot operands to fp32, input precision). fp32 inputs use exact 'ieee' so fp32 paths meet 1e-5."""
    return _runtime.INTERPRET or dtype == torch.float32, "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class FusedLoRA:
    """A LoRABank folded into the GEMM tiles (``moelab/kernels/moe_gemm.py``, "Fused LoRA").

    ``bank``: a :class:`moelab.LoRABank` over the local experts; ``lora_ids`` int [T] contiguous (-1 = none).
    """

    bank: LoRABank
    lora_ids: torch.Tensor


#: Widest stacked bank (L_PAD * R_PAD, :attr:`LoRABank.stacked_pads`) the fused path of ``LoRAExperts`` takes; wider
#: banks run vLLM's unfused flow. A prefill tile of GEMM1 holds its expand operands in shared memory, 2 * columns *
#: (BLOCK_M + BLOCK_N) elements: 64 KB at 64 columns, 128x128 bf16 tiles (the pipeline keeps 3 of its 4 stages).
#: Every row's expand runs over all stacked columns, so wide banks cost more than the flow anyway.
MAX_FUSED_LORA_COLUMNS = 64



def fused_lora_reason(bank: LoRABank) -> str | None:
    """None when :func:`lora_experts` can fold ``bank`` into the GEMMs (at most ``MAX_FUSED_LORA_COLUMNS``)."""
    columns = math.prod(bank.stacked_pads)
    if columns <= MAX_FUSED_LORA_COLUMNS:
        return None
    return (f"the fused path takes banks of at most {MAX_FUSED_LORA_COLUMNS} stacked columns (max_loras and "
            f"max_rank padded to powers of two, multiplied), got {columns} stacked columns")


#: The fused LoRA's decode path (routing metadata and W13 shrink in one launch, the W2 shrink in GEMM1's epilogue,
#: no separate shrink launch) runs up to this many slots (one program builds their segments) on BLOCK_M < 64 tiles.
FUSED_DECODE_MAX_SLOTS = MAX_CHUNK


def _decode_w13_shrink_shape(H: int, r_pad: int) -> tuple[int, int]:
    """(BLOCK_K, COLS) of the decode launch's W13 shrink: x and a program's A rows in one K step up to H = 2048 (on
    the H200 that launch took 7.9 µs with 4 steps of 512, 3.7 with one: each dependent step waits on memory), at
    most 4096 elements of A a program, so a slot's 2*R_PAD rank columns spread over 2*R_PAD / COLS programs."""
    block_k = min(next_pow2(H), 2048)
    return block_k, max(2, min(2 * r_pad, 4096 // block_k))


def _scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fused-LoRA scratch buffer, NaN-poisoned in debug mode (``moelab.set_debug``) so that a read of a value no
    kernel wrote shows up in the output."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    return buf.fill_(float("nan")) if _runtime.DEBUG_DEAD_ROWS else buf


def _shrink_block_k(block_m: int, columns: int, itemsize: int) -> int:
    """BLOCK_K of the LoRA shrink kernels: 256 for decode tiles, 64 for prefill tiles (H200), smaller when a
    pipeline stage (x tile + two stacked A tiles, ``BK * (BLOCK_M + 2 * columns)`` elements) would pass 64 KB."""
    fits = 65536 // (itemsize * (block_m + 2 * columns))
    return max(16, min(256 if block_m < 64 else 64, 1 << (fits.bit_length() - 1)))


def _pipeline(routing: torch.Tensor, expert_weights: torch.Tensor | None, x: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, num_experts: int, local_expert_offset: int, delta: torch.Tensor | None,
              do_finalize: bool, output: torch.Tensor | None = None,
              config: GemmConfig | None = None, lora: FusedLoRA | None = None,
              round_weights: bool = False) -> tuple[torch.Tensor, ...]:
    """Segments -> [LoRA shrink] -> GEMM1(+delta, SwiGLU) -> GEMM2 -> finalize. Returns (output, gemm2, e2p, act).

    ``routing``: int32 [T, K] packed words when ``expert_weights`` is None (the kernels decode them), else
    the int ids beside the caller's ``expert_weights`` [T, K] (contiguous). ``round_weights``: the finalize
    weights the base term by bf16(w), as a packing would have rounded it. ``lora`` (ids and weights only, with
    ``round_weights``): fold a LoRA bank into the GEMMs, its term weighted by w; gemm2 then holds base + LoRA
    terms and is only meant for the finalize.
    """
    packed = expert_weights is None
    if lora is not None and (packed or not round_weights):
        raise ValueError("lora: the fused LoRA path takes (ids, expert_weights) routing and round_weights=True")
    T, K = routing.shape
    E_local, two_i, H = w13.shape
    I = two_i // 2
    if lora is not None:
        bank = lora.bank
        l_pad, r_pad = bank.stacked_pads
        bank_args = (E_local, bank.max_loras, bank.max_rank)
    lora_cols = l_pad * r_pad if lora is not None else 0
    cfg = config or choose_config(T, K, E_local, x.dtype, lora_cols)
    num_n1 = cdiv(I, cfg.block_n)
    decode = None  # the fused LoRA's decode plan: one launch for the segments and the W13 shrink
    if lora is not None and cfg.block_m < 64 and T * K <= FUSED_DECODE_MAX_SLOTS:
        decode = plan_one_chunk(routing, E_local, cfg.block_m, local_expert_offset, packed=False)
    if decode is not None:
        seg = decode.segments
    else:
        seg = build_segments_triton(routing, E_local, cfg.block_m, offset=local_expert_offset, packed=packed)
    R1 = permuted_rows(T, K, num_experts, cfg.block_m, I)
    R2 = permuted_rows(T, K, num_experts, cfg.block_m, H)
    act = torch.empty(R1, I, dtype=x.dtype, device=x.device)
    gemm2 = torch.empty(R2, H, dtype=x.dtype, device=x.device)
    dead_fill = float("nan") if _runtime.DEBUG_DEAD_ROWS else 0.0
    dot_f32, precision = _dot_flags(x.dtype)
    pdl = _runtime.pdl_launch(x.device)  # in a CUDA graph, each kernel is scheduled as the previous one ends
    live_blocks = seg.block_group.numel()
    # The GEMM grids cover the rows live data can reach; FlashInfer's 128 KiB floor can make a buffer taller
    # (tiny H or I, decode): that tail is filled here instead of by thousands of do-nothing programs.
    reach = seg.row_to_slot.numel()
    for buf in (act, gemm2):
        if buf.shape[0] > reach:
            buf[reach:].fill_(dead_fill)
    # placeholders, never read without LoRA
    lora_g1, lora_g2 = (x,) * 4 + (0,) * 3 + (x,) * 3, (x,) * 3 + (0,) * 3 + (x,) * 3 + (0,)
    lora_flags1 = lora_flags2 = {}
    if decode is not None:  # one launch: segments + W13 shrink by slot; GEMM1 adds the W2 shrink to s2 by slot
        s13 = _scratch((T * K, 2, lora_cols), x.dtype, x.device)  # by slot, stacked [up | gate]
        s2 = _scratch((T * K, lora_cols), torch.float32, x.device)
        block_k, cols = _decode_w13_shrink_shape(H, r_pad)
        _decode_segments_w13_shrink_kernel[(1 + T * K * (2 * r_pad // cols),)](
            *decode.args, x, bank.up_a, bank.gate_a, s13, s2, lora.lora_ids, H, K, bank.max_loras, bank.max_rank,
            x.stride(0), **decode.meta, L_PAD=l_pad, R_PAD=r_pad, COLS=cols, BLOCK_K=block_k,
            num_warps=decode.num_warps, **pdl)
        lora_g1 = (s13, x, bank.up_b, bank.gate_b, *bank_args, lora.lora_ids, bank.down_a, s2)
        lora_g2 = (s2, x, bank.down_b, *bank_args, seg.row_to_slot, lora.lora_ids, expert_weights, K)
        lora_flags1 = lora_flags2 = dict(LORA=True, L_PAD=l_pad, R_PAD=r_pad, LORA_DECODE=True)
    elif lora is not None:  # two shrink launches; the GEMMs expand (moelab/kernels/moe_gemm.py, "Fused LoRA")
        tile_flags = torch.empty(live_blocks, dtype=torch.int32, device=x.device)
        s13 = _scratch((reach, 2, lora_cols), x.dtype, x.device)  # stacked [up | gate]
        s2 = _scratch((reach, lora_cols), x.dtype, x.device)
        shrink_args = (seg.row_to_slot, seg.block_group, lora.lora_ids, expert_weights)
        shrink_flags = dict(DOT_F32=dot_f32, DOT_PRECISION=precision, L_PAD=l_pad, R_PAD=r_pad,
                            BLOCK_M=cfg.block_m, BLOCK_K=_shrink_block_k(cfg.block_m, lora_cols, x.element_size()),
                            num_warps=8 if cfg.block_m * lora_cols > 128 * 64 else 4, **pdl)
        if live_blocks:
            _lora_shrink_kernel[(live_blocks,)](
                x, bank.up_a, bank.gate_a, s13, tile_flags, *shrink_args, H, K, *bank_args, x.stride(0),
                GATHER=True, NUM_SLICES=2, WEIGHTED=False, WRITE_FLAGS=True, **shrink_flags)
        lora_g1 = (s13, tile_flags, bank.up_b, bank.gate_b, *bank_args, x, x, x)
        lora_g2 = (s2, tile_flags, bank.down_b, *bank_args, x, x, x, 0)
        lora_flags1 = lora_flags2 = dict(LORA=True, L_PAD=l_pad, R_PAD=r_pad)
    _gemm1_swiglu_kernel[(cdiv(reach, cfg.block_m) * num_n1,)](
        x, w13, delta if delta is not None else x, act, seg.row_to_slot, seg.block_group,
        live_blocks, reach, H, I, K,
        x.stride(0), w13.stride(0), w13.stride(1), 2 * I if delta is not None else 0, act.stride(0),
        *lora_g1,
        HAS_DELTA=delta is not None, DOT_F32=dot_f32, DOT_PRECISION=precision, DEAD_FILL=dead_fill,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=H % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **lora_flags1, **pdl,
    )
    if lora is not None and decode is None and live_blocks:
        _lora_shrink_kernel[(live_blocks,)](
            act, bank.down_a, bank.down_a, s2, tile_flags, *shrink_args, I, K, *bank_args, act.stride(0),
            GATHER=False, NUM_SLICES=1, WEIGHTED=True, WRITE_FLAGS=False, **shrink_flags)
    _gemm2_kernel[(cdiv(reach, cfg.block_m) * cdiv(H, cfg.block_n),)](
        act, w2, gemm2, seg.block_group,
        live_blocks, reach, H, I,
        act.stride(0), w2.stride(0), w2.stride(1), gemm2.stride(0),
        *lora_g2,
        DOT_F32=dot_f32, DOT_PRECISION=precision, DEAD_FILL=dead_fill,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=I % cfg.block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **lora_flags2, **pdl,
    )
    if do_finalize:
        if output is None:
            output = torch.empty(T, H, dtype=x.dtype, device=x.device)
        finalize_triton(output, gemm2, routing if packed else expert_weights, seg.slot_to_row, None,
                        packed_weights=packed, round_weights=round_weights)
    else:
        output = x.new_empty(T, 0)  # FlashInfer's placeholder when nothing is finalized
    return output, gemm2, seg.slot_to_row, act


@torch.library.custom_op("moelab::triton_routed_moe", mutates_args=())
def _routed_moe_op(routing: torch.Tensor, expert_weights: torch.Tensor | None, hidden_states: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor, num_experts: int, local_expert_offset: int,
                   gemm1_lora_delta: torch.Tensor | None, do_finalize: bool) -> list[torch.Tensor]:
    """The whole pipeline as one opaque op, so torch.compile traces through it (see :func:`routed_moe`)."""
    return list(_pipeline(routing, expert_weights, hidden_states, w13, w2, num_experts, local_expert_offset,
                          gemm1_lora_delta, do_finalize))


@_routed_moe_op.register_fake
def _routed_moe_fake(routing, expert_weights, hidden_states, w13, w2, num_experts, local_expert_offset,
                     gemm1_lora_delta, do_finalize):
    T, K = routing.shape
    E_local, two_i, H = w13.shape
    tile = choose_config(T, K, E_local, hidden_states.dtype).block_m
    x = hidden_states
    return [x.new_empty(T, H if do_finalize else 0),
            x.new_empty(permuted_rows(T, K, num_experts, tile, H), H),
            routing.new_empty(T * K, dtype=torch.int32),
            x.new_empty(permuted_rows(T, K, num_experts, tile, two_i // 2), two_i // 2)]


def routed_moe(call: RoutedMoECall, config: GemmConfig | None = None) -> RoutedMoEResult:
    """Eager calls run the pipeline directly (no dispatcher overhead, ``output`` written in place); under
    ``torch.compile`` it goes through the registered custom op ``moelab::triton_routed_moe``."""
    W = call.weights
    routing = call.packed if call.packed is not None else call.topk_ids
    weights = None if call.packed is not None else call.expert_weights.contiguous()  # the kernel's stride is 1
    args = (routing, weights, call.hidden_states, W.gemm1_weights, W.gemm2_weights,
            call.num_experts, call.local_expert_offset, call.gemm1_lora_delta, call.do_finalize)
    if torch.compiler.is_compiling():
        output, gemm2, e2p, act = _routed_moe_op(*args)
        if call.output is not None:
            output = call.output.copy_(output)
    else:
        output, gemm2, e2p, act = _pipeline(*args, output=call.output, config=config)
    return RoutedMoEResult(output if call.do_finalize else None, gemm2, e2p, act)


def lora_experts(call: LoRAExpertsCall) -> torch.Tensor:
    """:class:`moelab.LoRAExperts` on this backend. With ``call.fused`` (or no adapter in the batch) it runs the base
    pipeline, the bank folded into its GEMMs (the W13 and W2 shrinks, extra launches but at decode; no [T,K,2I] or
    [T,K,H] delta); else, and for the base MoE under ``torch.compile`` (one registered custom op), vLLM's unfused
    flow. The pipeline reads the ids and the caller's weights directly (no packing launches) and weights the base
    term by bf16(w), as the packed routed MoE does, so every token without an adapter is bit for bit the packed
    base path's."""
    if not (call.fused if call.lora is not None else not torch.compiler.is_compiling()):
        return lora_flow.lora_experts(call, routed_moe)
    if call.hidden_states.shape[0] == 0:
        return call.output
    weights = call.topk_weights.float() if call.topk_weights.dtype == torch.float64 else call.topk_weights
    lora = None if call.lora is None else FusedLoRA(call.lora, call.lora_ids.contiguous())
    W = call.weights
    _pipeline(call.topk_ids.contiguous(), weights.contiguous(), call.hidden_states, W.gemm1_weights,
              W.gemm2_weights, call.num_experts, call.local_expert_offset, None, True, output=call.output, lora=lora,
              round_weights=True)
    return call.output
