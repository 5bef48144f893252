"""The routed MoE of a few tokens in two launches: each slot reads its own expert's weights, no permutation.

    gemm1:  act[s]  = activation(x[t] @ W13[e]^T + b13[e])            s = t*K + k, e = the slot's local expert
    gemm2:  out[t]  = sum_k w[t,k] * bf16(act[t*K+k] @ W2[e]^T + b2[e])   (the top-k combine in GEMM2 itself)

At decode the tiled pipeline (``moelab/backends/triton_backend.py``) runs four dependent launches: segments,
GEMM1, GEMM2 and the finalize, and every tile of its GEMMs holds one real row of 16. Here the slot's expert id is
read straight from the routing (packed words or ids), so the segments launch goes, and GEMM2 sums a token's K
expert rows in its own registers, so the finalize goes too. Both kernels are matrix-vector products on the CUDA
cores (a row at a time: there is nothing for tensor cores to reuse) in which each slot streams its expert's
weights itself, so slots that share an expert read it again; GEMM2 loads the K experts' [BLOCK_N, BLOCK_K]
weight tiles of one token together, as one [K_PAD, BLOCK_N, BLOCK_K] tile, so K times the bytes are in flight
per step.

Rounding follows the tiled path: the activation is stored in the input dtype, each expert's GEMM2 row is rounded to
it before it is weighted (the tiled path stores that row), the weighted sum is fp32 and rounded once. Non-local
slots (expert-parallel ranks) read nothing and add nothing. Weights stay in HF order (``w13 [E_local, 2I, H]``
rows [gate; up] or [E_local, I, H] up only, ``w2 [E_local, H, I]``), activations and biases as in
``moelab/kernels/moe_gemm.py``. :func:`token_major_moe` launches both; the triton backend takes this path where
``takes_token_major`` says (``moelab/backends/triton_backend.py``: few slots over many experts, or one token of
large experts, and only the output asked for; the rule's H200 measurements are beside it).

LoRA (``bank=``, :class:`moelab.LoRAExperts` at the same sizes): each token reads its own adapter's A and B (any
bank: nothing is stacked), in the same two launches:

    gemm1 (first programs of each slot)  s13[s] = [A_up x[t] | A_gate x[t]] of the slot's adapter and expert, s2[s] = 0
    gemm1 (the column blocks)            acc += B s13[s] before the activation; s2[s] += A_down[:, cols] act[s, cols]
                                         (fp32 atomics)
    gemm2                                each expert row += B_down bf16(s2[s] w / bf16(w)), then rounded and weighted
                                         by bf16(w)

as the tiled pipeline's fused decode mode computes them (``moelab/kernels/fused_lora.py``): rank vectors rounded
to the input dtype, the LoRA term weighted by the caller's w in the end. A slot without an adapter runs none of it,
so its rows are the base path's bit for bit; the atomics may change a LoRA row's last bit from run to run. Where the
LoRA steps keep their operands was measured (H200, T = 1, ``scripts/profile_lora_tm.py``, GPU µs of GEMM1 / GEMM2 with
one rank-16 adapter; without an adapter in brackets; the base kernels 15.6 / 12.0 Qwen3-30B-A3B, 112.5 / 65.1
DeepSeek-V3, 112.9 / 71.1 Mixtral):

    tiles of their own ([BLOCK_N, R_PAD], [K_PAD, BLOCK_N, R_PAD])  Qwen3 21.0 / 17.8 (20.2 / 17.0), DeepSeek-V3
                                                                   119.9 / 89.1 (116.9 / 87.1), Mixtral 124.6 / 66.2
                                                                   (119.0 / 65.5)
    the K loop's tiles, ranks along BLOCK_K                        Qwen3 23.8 / 11.5 (20.6 / 9.9), DeepSeek-V3
                                                                   187.7 / 74.4 (162.4 / 68.4), Mixtral 203.3 / 73.5
                                                                   (157.0 / 71.5)

so GEMM1 keeps tiles of its own, and GEMM2 takes the K loop's tiles where K_PAD is 8 or more (``LORA_K_TILES``, K >=
5; its BLOCK_K is 256 at K = 8), tiles of its own at K <= 4 (BLOCK_K 512). Measured at K = 8 and K = 2 only.
Where the ranks fit one such tile, GEMM2 loads its B_down tile before its K loop (``EARLY_DOWN_B``), so that load
hides behind the loop's: one rank-16 adapter at T = 2 in a four-layer CUDA graph, 45.2 against 47.4 µs a layer
(Qwen3), 56.0 against 57.6 (OLMoE), 60.8 against 62.5 (E64 K6); GPT-OSS (8 slots, then the tiled pipeline) and
T = 1 (then tiled too) unchanged (H200, 2026-12-04, c84b30f).
The other LoRA operands are read ahead too: GEMM2 reads the routing weights, their w / bf16(w) and the rank vectors
s2 with that B_down tile, before its K loop, and GEMM1 reads its B_up, B_gate and A_down tiles before it waits for
the slot's shrink; a bank's call without ids takes its -1 ids from a buffer kept per device and stream (no fill launch).
One rank-16 adapter in a CUDA graph, one call a replay, µs, before -> after (H100, 2026-12-07, BENCHMARKS.md
"Token-major LoRA operands read ahead"): T = 1 Qwen3-30B-A3B 48.65 -> 47.65 (base call 42.9), OLMoE 60.1 -> 56.75
(54.1), 8 adapters 53.55 -> 51.75 and 63.65 -> 61.95; GPT-OSS-20B T = 2 168.15 -> 164.3; but T = 2 Qwen3 74.5 ->
75.05 and OLMoE 92.35 -> 92.9; T = 4 within 0.6 %. The base kernels (no bank) keep their code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton.language as tl

from moelab import _runtime
from moelab.contract import SWIGLUOAI_ALPHA
from moelab.kernels import fused_lora
from moelab.kernels._common import (
    expert_activation,
    jit,
    routing_word_expert,
    routing_word_weight,
    to_output,
    wait_for_previous_kernel,
)
from moelab.kernels.fused_lora import caller_weight_ratio, own_rank_pad, slot_w13_shrink_step
from moelab.permutation import cdiv, next_pow2

if TYPE_CHECKING:
    from moelab.lora import LoRABank

__all__ = ["TokenMajorConfig", "choose_token_major_config", "token_major_moe"]



@dataclass(frozen=True)
class TokenMajorConfig:
    """Tiles of the two kernels: GEMM1 programs are (slot, BLOCK_N1 columns of I), GEMM2 programs (token, BLOCK_N2
    columns of H); each steps over its reduction in BLOCK_K elements. ``stages1``/``stages2``: the reduction loop's
    software pipeline depth (``tl.range(num_stages=...)``: Triton then prefetches the loop's loads, which it does
    not for loads that feed no ``tl.dot`` unless asked); None leaves the loop as Triton builds it unasked.
    ``pdl``: False launches both kernels without programmatic dependent launch in CUDA graphs too (each then starts
    once the kernel before it has ended)."""

    block_n1: int
    block_k1: int
    warps1: int
    block_n2: int
    block_k2: int
    warps2: int
    stages1: int | None = None
    stages2: int | None = None
    pdl: bool = True


@functools.lru_cache(maxsize=1024)
def choose_token_major_config(num_tokens: int, top_k: int, hidden: int, inter: int) -> TokenMajorConfig:
    """Tiles for ``num_tokens`` tokens of ``top_k`` experts, hidden size ``hidden`` (H), expert size ``inter`` (I).
    The interpreter takes small tiles (numpy runs each program); on a GPU BLOCK_K is capped at the reduction's
    power of two, so small test shapes do not mask most of a tile."""
    if _runtime.INTERPRET:
        return TokenMajorConfig(16, 32, 1, 16, 32, 1)
    # H200, 2026-12-04 (scripts/token_major_ncu.py: each kernel alone under Nsight Compute, the median of 3 launches
    # on cold caches; BENCHMARKS.md, "Pipelined token-major kernels"). Loads prefetched by a software pipeline
    # (stages) over shorter steps beat the unpipelined long steps of 2026-12-02 (GEMM1 16 x 512, 8 warps, 16 x 1024 at
    # H >= 4096; GEMM2 16 x 256 at K = 8, 8 x 512 at K <= 4) at T = 1 on six shapes: GEMM1 16 x 256 with 4 warps,
    # 0.72-0.91x of them at H = 2048-2880 (Qwen3-30B-A3B, OLMoE, E64 K6, GPT-OSS-20B; 3 stages, Qwen3 16.3 against
    # 18.0 µs) and 0.93-0.96x at H = 4096-7168 (Mixtral, DeepSeek-V3; 4 stages: 3 read 1.10x on DeepSeek-V3);
    # GEMM2 4 x 128 (K > 4) or 8 x 128 (K <= 4) with 4 warps and 4 stages, 0.58-0.84x (Qwen3 10.4 against 15.1 µs).
    # At T = 2 (the four shapes of H < 4096) GEMM2's 8 x 128 with 3 stages read 0.64-0.95x and 4 x 128 lost 6-11 %
    # to it; T >= 2 at H >= 4096 not measured. In the bench at 60e4b67 (CUDA graphs, T = 1) these tiles read Qwen3
    # 33.9 µs (tiled pipeline 38.4), DeepSeek-V3 178.9 (unpipelined 188.9) and E128 K8 93.6 (tiled 95.4), but
    # Mixtral 227.4 against the unpipelined tiles' 195.6 of 4d268ac, while its eager call read 186.1 against 196.7.
    # Programmatic dependent launch was what cost it: in a four-layer graph (scripts/host_cost.py --layers 4, T = 1,
    # µs a layer, 8b3771e) Mixtral's pipelined tiles read 216 with it and 172 without, the unpipelined ones 183-184
    # either way (not diagnosed further), so large experts of K <= 4 (Mixtral's) launch these tiles without it.
    # DeepSeek-V3 (H 7168, K 8) read 178.9 on them with it.
    pdl = not (hidden >= 4096 and top_k <= 4)
    block_n2 = 4 if num_tokens == 1 and top_k > 4 else 8
    return TokenMajorConfig(16, min(256, next_pow2(hidden)), 4, block_n2, min(128, next_pow2(inter)), 4,
                            stages1=3 if hidden < 4096 else 4, stages2=4 if num_tokens == 1 else 3, pdl=pdl)


@jit
def _local_expert(value, offset, num_local_experts, PACKED: tl.constexpr):
    """(expert, local) of a slot's routing ``value`` (a packed word: the id is its signed high half; else the id):
    the local expert index (0 where not local, so addresses stay in range) and whether the slot is this rank's."""
    if PACKED:
        value = routing_word_expert(value)
    expert = value - offset
    local = (expert >= 0) & (expert < num_local_experts)
    return tl.where(local, expert, 0).to(tl.int64), local


@jit
def _slot_weight(routing_ptr, weights_ptr, slots, mask, PACKED: tl.constexpr):
    """fp32 routing weights of ``slots`` (``mask``: the slots to read, None: all): a packed word's low half
    widened exactly, else the caller's weights."""
    if PACKED:
        if mask is None:
            word = tl.load(routing_ptr + slots)
        else:
            word = tl.load(routing_ptr + slots, mask=mask, other=0)
        w = routing_word_weight(word)
    elif mask is None:
        w = tl.load(weights_ptr + slots).to(tl.float32)
    else:
        w = tl.load(weights_ptr + slots, mask=mask, other=0.0).to(tl.float32)
    return w


@jit
def _token_adapter(lora_ids_ptr, ranks_ptr, token, num_loras, max_rank):
    """(adapter, rank) of ``token``: its adapter slot (-1 for none or an id outside the bank) and that adapter's
    rank (0 without one)."""
    adapter = tl.load(lora_ids_ptr + token).to(tl.int32)
    adapter = tl.where((adapter >= 0) & (adapter < num_loras), adapter, -1)
    rank = tl.load(ranks_ptr + tl.maximum(adapter, 0))
    return adapter, tl.where(adapter >= 0, tl.minimum(rank, max_rank), 0)


@jit
def _token_major_gemm1_kernel(
    x_ptr, w13_ptr, act_ptr, routing_ptr, weights_ptr, bias_ptr,
    H, I, top_k, num_local_experts, local_expert_offset, stride_x_t, stride_w_e, stride_w_n,
    PACKED: tl.constexpr, IN_WEIGHT: tl.constexpr, ACTIVATION: tl.constexpr, GATED: tl.constexpr,
    SWIGLU_ALPHA: tl.constexpr, SWIGLU_LIMIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr = False, lora_ids_ptr=None, ranks_ptr=None, s13_ptr=None, up_b_ptr=None, gate_b_ptr=None,
    down_a_ptr=None, s2_ptr=None, num_loras=0, max_rank=1, LORA: tl.constexpr = False, R_PAD: tl.constexpr = 16,
    STAGES: tl.constexpr = None, flags_ptr=None, up_a_ptr=None, gate_a_ptr=None, SHRINK_PROGRAMS: tl.constexpr = 0,
    SHRINK_COLS: tl.constexpr = 2, SHRINK_BLOCK_K: tl.constexpr = 16,
):
    """act [T*K, I] row ``slot`` = the activation of GEMM1 (+ bias) of the slot's token and expert, columns
    ``(program_id(1) - SHRINK_PROGRAMS) * BLOCK_N + ...``; rows of non-local slots are not written (GEMM2 never
    reads them). ``LORA``: a slot whose token has an adapter adds its W13 expand before the activation and this
    column block's share of its W2 shrink to ``s2`` (module docstring, "LoRA"). Its rank vectors come from this
    grid: programs ``program_id(1) < SHRINK_PROGRAMS`` are the slot's W13 shrink (``fused_lora.
    slot_w13_shrink_step``, SHRINK_COLS rank columns each), which write s13, zero s2 and then add 1 to
    ``flags_ptr[slot]``; the column-block programs run their K loop and wait for that count only before their
    LoRA epilogue. The shrink programs have the lowest block ids, so the GPU dispatches them before any program
    that waits on them (the order CUTLASS's stream-K fixup and CUB's decoupled look-back rely on too; the
    interpreter runs them first); GEMM2 sets the flags back to 0."""
    wait_for_previous_kernel(USE_GDC)
    slot = tl.program_id(0)
    col_block = tl.program_id(1) - SHRINK_PROGRAMS
    expert, local = _local_expert(tl.load(routing_ptr + slot), local_expert_offset, num_local_experts, PACKED)
    if LORA:
        adapter, rank = _token_adapter(lora_ids_ptr, ranks_ptr, slot // top_k, num_loras, max_rank)
    if SHRINK_PROGRAMS > 0:
        if col_block < 0:
            slot_w13_shrink_step(slot * SHRINK_PROGRAMS + tl.program_id(1), routing_ptr, local_expert_offset,
                                 num_local_experts, x_ptr, up_a_ptr, gate_a_ptr, s13_ptr, s2_ptr, lora_ids_ptr, H,
                                 top_k, num_loras, max_rank, stride_x_t, 1, R_PAD, SHRINK_COLS, SHRINK_BLOCK_K,
                                 ranks_ptr, True)
            if local & (adapter >= 0):  # every thread's stores, then one release of them (CUTLASS's semaphore)
                tl.debug_barrier()
                tl.atomic_add(flags_ptr + slot, 1, sem="release", scope="gpu")
    if local & (col_block >= 0):
        cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        ks = tl.arange(0, BLOCK_K)
        x_row = x_ptr + (slot // top_k).to(tl.int64) * stride_x_t + ks
        gate_ptrs = w13_ptr + expert * stride_w_e + cols.to(tl.int64)[:, None] * stride_w_n + ks[None, :]
        up_ptrs = gate_ptrs + I * stride_w_n if GATED else gate_ptrs  # rows [gate; up], or up only
        if IN_WEIGHT:  # the router weight on the input (Llama-4): the expert sees bf16(w * x), as the model rounds it
            in_weight = _slot_weight(routing_ptr, weights_ptr, slot, None, PACKED)
        acc_gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
            k_ok = ks + k0 < H
            a = tl.load(x_row + k0, mask=k_ok, other=0.0)
            if IN_WEIGHT:
                a = to_output(a.to(tl.float32) * in_weight, x_ptr.dtype.element_ty)
            a = a.to(tl.float32)[None, :]
            w_mask = col_ok[:, None] & k_ok[None, :]
            acc_up += tl.sum(tl.load(up_ptrs + k0, mask=w_mask, other=0.0).to(tl.float32) * a, axis=1)
            if GATED:
                acc_gate += tl.sum(tl.load(gate_ptrs + k0, mask=w_mask, other=0.0).to(tl.float32) * a, axis=1)
        if bias_ptr is not None:  # in w13's row order [gate; up]
            b_ptrs = bias_ptr + expert * (2 * I if GATED else I) + cols
            if GATED:
                acc_gate += tl.load(b_ptrs, mask=col_ok, other=0.0).to(tl.float32)
                acc_up += tl.load(b_ptrs + I, mask=col_ok, other=0.0).to(tl.float32)
            else:
                acc_up += tl.load(b_ptrs, mask=col_ok, other=0.0).to(tl.float32)
        if LORA:  # the bank's tiles first (none read without an adapter: rank_ok is all False), their latency
            # hidden behind the wait for the shrink; B [.., I, max_rank], A_down [.., max_rank, I]. The adapter and
            # its rank, read at the start, are first used here: the K loop's loads never wait for them.
            pair = tl.maximum(adapter, 0) * num_local_experts + expert  # (adapter, expert) of the bank's tensors
            r = tl.arange(0, R_PAD)
            rank_ok = r < rank  # LoRA tiles of their own, [BLOCK_N, R_PAD] (module docstring)
            b_mask = col_ok[:, None] & rank_ok[None, :]
            b_offs = (pair * I + cols.to(tl.int64)[:, None]) * max_rank + r[None, :]
            b_up = tl.load(up_b_ptr + b_offs, mask=b_mask, other=0.0)
            if GATED:
                b_gate = tl.load(gate_b_ptr + b_offs, mask=b_mask, other=0.0)
            a_offs = (pair * max_rank + r[None, :]) * I + cols.to(tl.int64)[:, None]
            a_t = tl.load(down_a_ptr + a_offs, mask=b_mask, other=0.0).to(tl.float32)  # [BLOCK_N, R_PAD]
            if adapter >= 0:  # acc += B (A x): the slot's rank vectors [up | gate] from the shrink
                done = tl.atomic_add(flags_ptr + slot, 0, sem="acquire", scope="gpu")  # the slot's shrink programs
                while done < SHRINK_PROGRAMS:
                    done = tl.atomic_add(flags_ptr + slot, 0, sem="acquire", scope="gpu")
                s_row = s13_ptr + slot.to(tl.int64) * (2 * R_PAD) + r
                s_up = tl.load(s_row, mask=rank_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
                acc_up += tl.sum(b_up.to(tl.float32) * s_up[None, :], 1)
                if GATED:
                    s_gate = tl.load(s_row + R_PAD, mask=rank_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
                    acc_gate += tl.sum(b_gate.to(tl.float32) * s_gate[None, :], 1)
        act = to_output(expert_activation(acc_gate, acc_up, ACTIVATION, GATED, SWIGLU_ALPHA, SWIGLU_LIMIT),
                        act_ptr.dtype.element_ty)
        tl.store(act_ptr + slot.to(tl.int64) * I + cols, act, mask=col_ok)
        if LORA:
            if adapter >= 0:  # s2 += A_down[:, cols] act[cols], the stored (rounded) activation
                part = tl.sum(a_t * tl.where(col_ok, act.to(tl.float32), 0.0)[:, None], 0)
                tl.atomic_add(s2_ptr + slot.to(tl.int64) * R_PAD + r, part, mask=rank_ok, sem="relaxed")


@jit
def _w2_down_b(ranks, rank, down_b_ptr, pair, H, cols, max_rank, w_rows_ok):
    """B_down[pair, cols, ranks] [K_PAD, BLOCK_N, len(ranks)] in the bank's dtype, the rank columns ``ranks`` below
    ``rank`` read (the rest 0)."""
    b_ptrs = (down_b_ptr + (pair[:, None, None] * H + cols.to(tl.int64)[None, :, None]) * max_rank
              + ranks[None, None, :])  # B_down [.., H, max_rank]
    return tl.load(b_ptrs, mask=w_rows_ok & (ranks < rank)[None, None, :], other=0.0)


@jit
def _w2_rank_vectors(ranks, rank, s2_ptr, slots, local, ratio, act_ptr, R_PAD: tl.constexpr):
    """The slots' W2 rank vectors over the rank columns ``ranks`` (those below ``rank`` read, the rest 0), fp32
    [K_PAD, len(ranks)]: s2 * ``ratio`` (w / bf16(w)) rounded to the input dtype, as the tiled path rounds them.
    The W2 expand is then ``sum(b * s2[:, None, :], axis=2)`` with ``b`` of :func:`_w2_down_b`."""
    r_ok = ranks < rank
    s2 = tl.load(s2_ptr + slots.to(tl.int64)[:, None] * R_PAD + ranks[None, :], mask=local[:, None] & r_ok[None, :],
                 other=0.0)
    return to_output(s2 * ratio, act_ptr.dtype.element_ty).to(tl.float32)


@jit
def _token_major_gemm2_kernel(
    act_ptr, w2_ptr, out_ptr, routing_ptr, weights_ptr, bias_ptr,
    H, I, top_k, num_local_experts, local_expert_offset, stride_w_e, stride_w_n, stride_out_t,
    PACKED: tl.constexpr, WEIGHTED: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr = False, ROUND_WEIGHTS: tl.constexpr = False, lora_ids_ptr=None, ranks_ptr=None,
    s2_ptr=None, down_b_ptr=None, num_loras=0, max_rank=1, LORA: tl.constexpr = False, R_PAD: tl.constexpr = 16,
    LORA_K_TILES: tl.constexpr = False, STAGES: tl.constexpr = None, EARLY_DOWN_B: tl.constexpr = False,
    flags_ptr=None,
):
    """out [T, H] row ``program_id(0)``, columns ``program_id(1) * BLOCK_N + ...``: the weighted sum over the
    token's local slots of GEMM2 (+ bias) rounded to the input dtype (``WEIGHTED`` False: summed unweighted, the
    weights having gone into the inputs; ``ROUND_WEIGHTS``: weighted by bf16(w), as a packing rounds it).
    ``LORA``: a token with an adapter adds each expert row's W2 expand before that row is rounded;
    ``EARLY_DOWN_B`` (the ranks in one tile: tiles of their own, or R_PAD <= BLOCK_K with ``LORA_K_TILES``): the
    B_down tile is loaded before the K loop; otherwise the K loop's tiles, one after another, after it.
    ``flags_ptr`` (GEMM1's fused shrink): programs of column block 0 set the token's slot flags back to 0."""
    wait_for_previous_kernel(USE_GDC)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    ks = tl.arange(0, BLOCK_K)
    kk = tl.arange(0, K_PAD)
    slots = t * top_k + kk
    k_ok = kk < top_k
    expert, local = _local_expert(tl.load(routing_ptr + slots, mask=k_ok, other=-1), local_expert_offset,
                                  num_local_experts, PACKED)
    local = local & k_ok
    if flags_ptr is not None:  # GEMM1 has ended (the wait above): no program reads them any more
        if tl.program_id(1) == 0:
            tl.store(flags_ptr + slots, tl.zeros((K_PAD,), dtype=tl.int32), mask=k_ok)
    a_ptrs = act_ptr + slots.to(tl.int64)[:, None] * I + ks[None, :]  # [K_PAD, BLOCK_K]
    w_ptrs = (w2_ptr + expert[:, None, None] * stride_w_e + cols.to(tl.int64)[None, :, None] * stride_w_n
              + ks[None, None, :])  # [K_PAD, BLOCK_N, BLOCK_K]
    w_rows_ok = local[:, None, None] & col_ok[None, :, None]
    if WEIGHTED and LORA:  # read before the K loop, whose loads hide its latency (a short kernel at T = 1)
        slot_w = _slot_weight(routing_ptr, weights_ptr, slots, local, PACKED)
    if LORA:
        adapter, rank = _token_adapter(lora_ids_ptr, ranks_ptr, t, num_loras, max_rank)
        pair = adapter * num_local_experts + expert  # [K_PAD]
        ratio = caller_weight_ratio(weights_ptr, slots, local)[:, None]
        if EARLY_DOWN_B:  # [K_PAD, BLOCK_N, BLOCK_K] (LORA_K_TILES) or [K_PAD, BLOCK_N, R_PAD]
            # All max_rank columns, so these loads wait for the adapter id only, not for its rank read after it:
            # past the rank both are 0 (the bank keeps B_down's zeros there, as the stacked tiles assume, and the
            # shrink zeroes s2's whole row and adds below the rank only)
            ranks = ks if LORA_K_TILES else tl.arange(0, R_PAD)
            columns = tl.where(adapter >= 0, max_rank, 0)
            b = _w2_down_b(ranks, columns, down_b_ptr, pair, H, cols, max_rank, w_rows_ok)
            s2 = _w2_rank_vectors(ranks, columns, s2_ptr, slots, local, ratio, act_ptr, R_PAD)
    acc = tl.zeros((K_PAD, BLOCK_N), dtype=tl.float32)
    for i0 in tl.range(0, I, BLOCK_K, num_stages=STAGES):
        i_ok = ks + i0 < I
        a = tl.load(a_ptrs + i0, mask=local[:, None] & i_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + i0, mask=w_rows_ok & i_ok[None, None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * a[:, None, :], axis=2)
    row_ok = local[:, None] & col_ok[None, :]
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + expert[:, None] * H + cols[None, :], mask=row_ok, other=0.0).to(tl.float32)
    if LORA:
        if adapter >= 0:  # acc += B_down (s2 w / bf16(w)): the LoRA term weighted by the caller's w in the end
            if EARLY_DOWN_B:
                acc += tl.sum(b.to(tl.float32) * s2[:, None, :], axis=2)
            else:  # LORA_K_TILES, R_PAD > BLOCK_K: [K_PAD, BLOCK_N, BLOCK_K] tiles, ranks along BLOCK_K
                for r0 in tl.static_range(0, R_PAD, BLOCK_K):
                    b = _w2_down_b(r0 + ks, rank, down_b_ptr, pair, H, cols, max_rank, w_rows_ok)
                    s2 = _w2_rank_vectors(r0 + ks, rank, s2_ptr, slots, local, ratio, act_ptr, R_PAD)
                    acc += tl.sum(b.to(tl.float32) * s2[:, None, :], axis=2)
    y = to_output(acc, act_ptr.dtype.element_ty).to(tl.float32)  # the expert's row, as the tiled path stores it
    if WEIGHTED:
        if not LORA:  # read here without a bank: read ahead, it cost the base call at T = 1 (BENCHMARKS.md)
            slot_w = _slot_weight(routing_ptr, weights_ptr, slots, local, PACKED)
        if ROUND_WEIGHTS:
            slot_w = to_output(slot_w, tl.bfloat16).to(tl.float32)
        y = y * slot_w[:, None]
    out = tl.sum(tl.where(row_ok, y, 0.0), axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_out_t + cols, to_output(out, out_ptr.dtype.element_ty), mask=col_ok)


_BUFFER_MIN_ELEMENTS = 1024  # the smallest kept buffer (slot flags, no-adapter ids): a few calls' sizes
_SLOT_FLAGS: dict[tuple, torch.Tensor] = {}
_NO_ADAPTER_IDS: dict[tuple, torch.Tensor] = {}
_RETIRED_BUFFERS: list[torch.Tensor] = []  # outgrown buffers, kept alive: a captured CUDA graph may hold one


def _kept_buffer(kept: dict, device: torch.device, size: int, fill: int) -> torch.Tensor:
    """int32 [>= size] of ``fill`` between calls, one buffer per device and CUDA stream in ``kept``: calls in turn on
    a stream share it, calls on two streams do not, and its fill runs on the stream whose calls use it. Grown
    outside CUDA-graph capture (an outgrown one is kept alive: a captured graph may hold it); a capture that finds
    it too small fills a buffer of its own (a memset in the graph)."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    buffer = kept.get(key)
    if buffer is None or buffer.numel() < size:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.full((size,), fill, dtype=torch.int32, device=device)
        if buffer is not None:
            _RETIRED_BUFFERS.append(buffer)
        buffer = kept[key] = torch.full((max(size, _BUFFER_MIN_ELEMENTS),), fill, dtype=torch.int32, device=device)
    return buffer


def _slot_flags(device: torch.device, num_slots: int) -> torch.Tensor:
    """int32 [>= num_slots] zeros between calls: the fused shrink's done-counts by slot (GEMM1 counts, GEMM2 sets
    them back to 0), kept per device and stream (:func:`_kept_buffer`)."""
    return _kept_buffer(_SLOT_FLAGS, device, num_slots, 0)


def _no_adapter_ids(device: torch.device, num_tokens: int) -> torch.Tensor:
    """int32 [num_tokens] of -1 (no token on an adapter): a view of a buffer kept per device and stream
    (:func:`_kept_buffer`) that no kernel writes, so a call launches no fill."""
    return _kept_buffer(_NO_ADAPTER_IDS, device, num_tokens, -1)[:num_tokens]


def token_major_moe(routing: torch.Tensor, expert_weights: torch.Tensor | None, x: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, output: torch.Tensor, *, local_expert_offset: int = 0,
                    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                    weight_on_input: bool = False, activation: str = "silu", gated: bool = True,
                    swiglu_alpha: float | None = None, swiglu_limit: float | None = None,
                    config: TokenMajorConfig | None = None, pdl: dict | None = None, round_weights: bool = False,
                    bank: LoRABank | None = None, lora_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``output`` [T, H] = the routed MoE of ``x`` [T, H] (unit column stride) in two launches (module docstring).

    ``routing``: contiguous int32 [T, K] packed words when ``expert_weights`` is None, else int ids [T, K] beside
    contiguous float ``expert_weights`` [T, K]. ``w13`` [E_local, 2I, H] (not ``gated``: [E_local, I, H]) and
    ``w2`` [E_local, H, I] contiguous; biases contiguous [E_local, 2I or I] and [E_local, H]; the activation
    keywords as :func:`moelab.kernels.moe_gemm.gemm1_swiglu` takes them. ``weight_on_input``: each slot's input
    is scaled by its weight and the expert rows summed unweighted; ``round_weights``: the rows are weighted by
    bf16(w), as a packing would round w. ``bank`` (a :class:`moelab.LoRABank` over the local experts) with
    ``lora_ids`` int [T] contiguous (-1: none; ids routing only): each token's adapter on top, one more launch (the
    W13 shrink; module docstring, "LoRA"); ``bank`` with ``lora_ids`` None: no token has an adapter, but the LoRA
    kernels run (no shrink), so the rows are those of a call with adapters bit for bit (a compiler may order a
    kernel's sums differently once it holds more code: in fp32 on the H200 the two kernels' rows differed in the
    last bit). Allocates the [T*K, I] activation (and the LoRA's rank vectors) only."""
    T, K = routing.shape
    E_local, H = w13.shape[0], w13.shape[2]
    I = w13.shape[1] // (2 if gated else 1)
    if T == 0:
        return output
    cfg = config or choose_token_major_config(T, K, H, I)
    pdl = pdl if cfg.pdl else None
    packed = expert_weights is None
    weights = routing if packed else expert_weights
    if activation == "swigluoai" and swiglu_alpha is None:
        swiglu_alpha = SWIGLUOAI_ALPHA
    act = torch.empty(T * K, I, dtype=x.dtype, device=x.device)
    common = dict(routing_ptr=routing, weights_ptr=weights, top_k=K, num_local_experts=E_local,
                  local_expert_offset=local_expert_offset, PACKED=packed, **(pdl or {}))
    lora1 = lora2 = {}
    if bank is not None:
        if packed or weight_on_input or not round_weights:
            raise ValueError("bank: the token-major LoRA takes (ids, expert_weights) routing with round_weights=True "
                             "and weight_on_input=False (its W2 term is weighted as the fused decode mode weights it)")
        if lora_ids is not None and not lora_ids.is_contiguous():
            raise ValueError("lora_ids: expected a contiguous int [T] tensor; pass lora_ids.contiguous()")
        r_pad = own_rank_pad(bank)
        if lora_ids is None:  # no adapter: rank vectors never read, no shrink programs (the flags are never waited
            # on, but GEMM1's code names them: a None pointer does not compile)
            lora_ids = _no_adapter_ids(x.device, T)
            s13, s2 = (torch.empty(0, dtype=d, device=x.device) for d in (x.dtype, torch.float32))
            shrink = dict(flags_ptr=_slot_flags(x.device, T * K))
        else:
            s13 = fused_lora.scratch((T * K, 2, r_pad), x.dtype, x.device)  # [up | gate]
            s2 = fused_lora.scratch((T * K, r_pad), torch.float32, x.device)
            block_k, cols = fused_lora.slot_shrink_shape(H, r_pad)
            shrink = dict(flags_ptr=_slot_flags(x.device, T * K), up_a_ptr=bank.up_a, gate_a_ptr=bank.gate_a,
                          SHRINK_PROGRAMS=2 * r_pad // cols, SHRINK_COLS=cols, SHRINK_BLOCK_K=block_k)
        lora1 = dict(lora_ids_ptr=lora_ids, ranks_ptr=bank.rank_table(), s2_ptr=s2, num_loras=bank.max_loras,
                     max_rank=bank.max_rank, LORA=True, R_PAD=r_pad)
        lora2 = dict(lora1, down_b_ptr=bank.down_b, LORA_K_TILES=K >= 5, flags_ptr=shrink.get("flags_ptr"))
        lora2["EARLY_DOWN_B"] = K < 5 or r_pad <= cfg.block_k2  # LORA_K_TILES: K_PAD 8 and more (module docstring)
        lora1.update(s13_ptr=s13, up_b_ptr=bank.up_b, gate_b_ptr=bank.gate_b, down_a_ptr=bank.down_a, **shrink)
    _token_major_gemm1_kernel[(T * K, lora1.get("SHRINK_PROGRAMS", 0) + cdiv(I, cfg.block_n1))](
        x_ptr=x, w13_ptr=w13, act_ptr=act, bias_ptr=w13_bias, H=H, I=I, stride_x_t=x.stride(0),
        stride_w_e=w13.stride(0), stride_w_n=w13.stride(1), IN_WEIGHT=weight_on_input, ACTIVATION=activation,
        GATED=gated, SWIGLU_ALPHA=swiglu_alpha, SWIGLU_LIMIT=swiglu_limit, BLOCK_N=cfg.block_n1,
        BLOCK_K=cfg.block_k1, num_warps=cfg.warps1, STAGES=cfg.stages1, **common, **lora1)
    _token_major_gemm2_kernel[(T, cdiv(H, cfg.block_n2))](
        act_ptr=act, w2_ptr=w2, out_ptr=output, bias_ptr=w2_bias, H=H, I=I, stride_w_e=w2.stride(0),
        stride_w_n=w2.stride(1), stride_out_t=output.stride(0), WEIGHTED=not weight_on_input, K_PAD=next_pow2(K),
        BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2, num_warps=cfg.warps2, STAGES=cfg.stages2,
        ROUND_WEIGHTS=round_weights, **common, **lora2)
    return output
