"""The routed MoE's grouped GEMMs as warp-specialised, persistent Hopper kernels in Gluon (Triton's tile-level
dialect), for sm_90 GPUs and 128-row tiles:

    GEMM1:  act[p] = silu(x[t] @ W_gate[e]^T + d_gate) * (x[t] @ W_up[e]^T + d_up)     act [R, I]
    GEMM2:  y[p]   = act[p] @ W2[e]^T + s2[p] @ B_down[e]                              y [R, H]

or GPT-OSS's experts: GEMM1's bias b13[e] before a clamped "swigluoai" activation (``ACTIVATIONS``), GEMM2's bias
b2[e] on the live rows

(notation of ``moelab/kernels/moe_gemm.py``: p a permuted row, t its token, e its tile's local expert, d the
slot's optional LoRA delta in [up | gate] order, or with a fused bank's tile-mode operands ``TileLoRA``
d_gate = s_gate[p] @ B_gate[e] and d_up = s_up[p] @ B_up[e]: its stacked rank vectors by row times its stacked
B, as one more K step each on the tiles holding an adapter). The same products as ``moe_gemm.gemm1_swiglu`` and
``gemm2`` (with plain SwiGLU and without a bias in the same order: bit for bit on the shapes measured),
for the compute-bound regime, where Triton's own compilation of those kernels leaves the tensor cores idle while a
tile's loads and its epilogue run (Triton 3.6 gives sm_90 no warp specialisation). One program per SM walks the
output tiles (row tile by row tile, or ``GROUP_M`` row tiles down each column block). In it:

- a **load partition** fills a ring of ``STAGES`` shared-memory slots: GEMM2's one warp copies each tile's act and
  W2 blocks through TMA; GEMM1's four warps gather the tile's input rows ``x[t]`` with 16-byte ``cp.async`` copies
  (TMA cannot gather on Hopper) and copy the gate and up blocks through TMA; a LoRA step's rank vectors and
  stacked B come by ``cp.async`` (GEMM2's load partition has four warps then). One ``ready`` mbarrier a slot (the
  TMA's byte count completes it; in GEMM1 also each load thread's arrival once its copies have landed, which the
  hardware makes without the thread waiting, and in GEMM2 the LoRA steps' one), one ``empty`` mbarrier a slot (the
  MMA partition frees it);
- the **MMA partition** (the kernel's ``num_warps`` = 8: two warpgroups, 64 rows each) waits for each slot, runs
  ``wgmma`` into fp32 accumulators with one step in flight, frees the slot behind it, and after a tile's last K step
  (GEMM1: adds its bias and the delta, applies the activation; GEMM2: adds its bias) rounds the tile into shared
  memory and stores it with a TMA store that runs on while the next tile's products start.

Padding rows and tiles past the live rows (expert -1) are written with ``DEAD_FILL``; dead tiles read no weight.
:func:`takes_gluon_gemm1` and :func:`takes_gluon_gemm2` say when a call can take them; ``moe_gemm`` asks them.
"""

from __future__ import annotations

import functools
import os

import torch

from moelab import _runtime
from moelab.contract import SWIGLUOAI_ALPHA
from moelab.kernels._common import tma_ok
from moelab.kernels.fused_lora import AdapterLoopLoRA, TileLoRA, own_rank_pad
from moelab.permutation import Segments, cdiv

try:  # Gluon ships with Triton 3.4+; its Hopper module with wgmma, TMA and mbarriers
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # an older Triton: the Triton kernels serve every call
    gluon = None


__all__ = ["GLUON", "compile_sm90", "gathers_rows_of", "gemm1_swiglu_ws", "gemm2_ws", "runs_on", "takes_gluon_gemm1",
           "takes_gluon_gemm2", "takes_gluon_lora"]

#: The Gluon GEMMs on sm_90 for tiles of 128 rows; ``MOELAB_GLUON=0`` keeps the Triton kernels everywhere.
GLUON: bool = os.environ.get("MOELAB_GLUON", "1") == "1" and gluon is not None
#: (BLOCK_N, BLOCK_K, STAGES) of the Gluon GEMM2: 3 stages of 48 KB and a 64 KB epilogue tile fit 227 KB.
GEMM2_WS_TILE = (256, 64, 3)
#: (BLOCK_N, BLOCK_K, STAGES) of the Gluon GEMM1: BLOCK_N columns of gate and of up (two accumulators), stages of
#: 48 KB (the gathered rows, a gate and an up tile) and a 32 KB epilogue tile; STAGES is the deepest ring, which
#: :func:`gemm1_stages` gives most calls (:func:`gemm1_swiglu_ws` asks it unless given a tile).
GEMM1_WS_TILE = (128, 64, 4)
#: GEMM1 runs 4 stages (224 KB with the epilogue tile), except on experts that take the grouped tile order
#: (group_m > 1: experts of moe_gemm.GROUP_M_MIN_EXPERT_BYTES or more) at up to this many rows an expert, which keep
#: 3. H100, scripts/gluon_ab.py, GEMM1 alone, 4 stages against 3: 0.84-0.92x at 256-4096 rows an expert on
#: Qwen3-30B-A3B, OLMoE, E64 K6, GPT-OSS-20B and Mixtral (T = 4096, 16384; 6b9a3f9); at 96-128 rows (T = 1024)
#: 0.96x on OLMoE, 0.98x on E64 K6, 1.00x on GPT-OSS-20B; Mixtral at 256 rows (T = 1024) 1.14x (7f8eec3).
GEMM1_THREE_STAGES_GROUPED_ROWS = 512
#: How the programs share the output tiles: "static" (one program a multiprocessor, each walking every
#: num_programs-th tile), "dynamic" (one a multiprocessor, each claiming the next tile from a counter once its loads
#: of the last are issued, so tiles start in order whatever each program's pace), "grid" (one program a tile, which
#: the hardware hands out in order as multiprocessors free up) or "rule" (the default: dynamic on calls of at least
#: DYNAMIC_MIN_TILES_A_PROGRAM tiles a multiprocessor, else static). ``MOELAB_TILE_SCHEDULE`` sets it for a process.
TILE_SCHEDULE = os.environ.get("MOELAB_TILE_SCHEDULE", "rule")
TILE_SCHEDULES = ("rule", "static", "dynamic", "grid")
#: The rule's threshold. On the static schedule an expert's row tiles (the second often a few rows past the first
#: 128) run on programs that drift apart over a long call, so the L2 seldom serves the second tile's weights and
#: DRAM streams them twice; claimed in order, they run side by side. A dynamic call pays an atomic a tile; its
#: counter is the segments' own (``Segments.tile_counters``, zeroed by their first launch; else one launch more).
#: H100, scripts/tma_ab.py (d242bf6): DeepSeek-V3 T = 4096 0.79x the static schedule's time (GEMM1's DRAM reads
#: 23.2 -> 17.7 GB), T = 16384 0.88x; Qwen3-30B-A3B, Mixtral, OLMoE and GPT-OSS-20B at T = 1024-16384 0.97-1.02x.
DYNAMIC_MIN_TILES_A_PROGRAM = 2


#: The gated activations GEMM1's epilogue runs (``moelab.prepare_weights``' names), each with or without a
#: ``swiglu_limit`` and a bias: SwiGLU and GPT-OSS's clamped "swigluoai". Other activations, experts that are not
#: gated and the router weight on the input keep the Triton kernels.
ACTIVATIONS = ("silu", "swigluoai")


def gemm1_stages(rows_per_expert: float, group_m: int) -> int:
    """GEMM1's pipeline depth for ``rows_per_expert`` = T * K / E_local in the tile order ``group_m``."""
    return 3 if group_m > 1 and rows_per_expert <= GEMM1_THREE_STAGES_GROUPED_ROWS else 4

if gluon is not None:
    # Triton 3.6 (the H200's) and 3.9 spell four builtins differently: the barrier across a partition's warps and
    # the TMA copies into and out of shared memory, and cp.async
    _partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

    @gluon.constexpr_function
    def _acc_layout(block_n, num_warps):
        """The fp32 accumulators' layout: wgmma m64n{block_n}k16 per warpgroup, the warps stacked along the rows
        (two warpgroups of 64 rows each for 128-row tiles)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_n, 16])

    @gluon.constexpr_function
    def _gather_layout(block_k):
        """Pointer copies by a 4-warp load partition: 16 bytes a thread, a row's block_k columns across neighbouring
        threads."""
        return gl.BlockedLayout([1, 8], [32 // (block_k // 8), block_k // 8], [4, 1], [1, 0])

    @gluon.jit
    def _copy_rank_vectors(dst, s_ptr, row0, ROW_WIDTH: gl.constexpr, COLUMNS: gl.constexpr):
        """``cp.async`` the tile's stacked LoRA rank vectors into ``dst`` [BLOCK_M, BLOCK_K]: rows row0.. of ``s``
        (ROW_WIDTH elements apart), their first COLUMNS columns, zeros past them."""
        BLOCK_M: gl.constexpr = dst.shape[0]
        BLOCK_K: gl.constexpr = dst.shape[1]
        layout: gl.constexpr = _gather_layout(BLOCK_K)
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        j = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
        ptrs = s_ptr + rows.to(gl.int64)[:, None] * ROW_WIDTH + j[None, :]
        mask = (rows >= 0)[:, None] & (j < COLUMNS)[None, :]  # (rows >= 0 always: the mask takes the tile's shape)
        _cp_async(dst, ptrs, mask=mask)

    @gluon.jit
    def _copy_stacked_b(dst, b_ptr, expert, n0, D_out, num_local_experts, num_loras, MAX_RANK: gl.constexpr,
                        R_PAD: gl.constexpr):
        """``cp.async`` this expert's stacked LoRA B tile into ``dst`` [BLOCK_N, BLOCK_K] (K-major, as the weight
        tiles): row n = output column n0 + n, column j = rank j % R_PAD of adapter j // R_PAD, from the bank
        ``B [L, E_local, D_out, MAX_RANK]``; zeros past the bank's adapters, its ranks and D_out."""
        BLOCK_N: gl.constexpr = dst.shape[0]
        BLOCK_K: gl.constexpr = dst.shape[1]
        layout: gl.constexpr = _gather_layout(BLOCK_K)
        n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        j = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
        adapter = j // R_PAD
        rank = j % R_PAD
        col_offs = (adapter.to(gl.int64) * num_local_experts + expert) * D_out * MAX_RANK + rank
        ptrs = b_ptr + n.to(gl.int64)[:, None] * MAX_RANK + col_offs[None, :]
        mask = (n < D_out)[:, None] & ((adapter < num_loras) & (rank < MAX_RANK))[None, :]
        _cp_async(dst, ptrs, mask=mask)

    @gluon.jit
    def _copy_lora_operands(a_bufs, b_bufs, slot, s_ptr, row0, ROW_WIDTH: gl.constexpr, b_ptr, expert, n0, D_out,
                            num_local_experts, num_loras, MAX_RANK: gl.constexpr, R_PAD: gl.constexpr,
                            COLUMNS: gl.constexpr):
        """A LoRA K step's operands into ring slot ``slot``, as one ``cp.async`` group: the tile's rank vectors
        into ``a_bufs`` (:func:`_copy_rank_vectors`) and the expert's stacked B into ``b_bufs``
        (:func:`_copy_stacked_b`)."""
        _copy_rank_vectors(a_bufs.index(slot), s_ptr, row0, ROW_WIDTH, COLUMNS)
        _copy_stacked_b(b_bufs.index(slot), b_ptr, expert, n0, D_out, num_local_experts, num_loras, MAX_RANK, R_PAD)
        async_copy.commit_group()

    @gluon.jit
    def _wait_ready(ready, it):
        """Wait for K step ``it``'s slot, then order the ``cp.async`` writes that filled it (generic proxy, each load
        thread's arrival on ``ready`` once its copies landed) before this thread's wgmma reads (async proxy)."""
        mbarrier.wait(ready.index(it % ready.shape[0]), (it // ready.shape[0]) & 1)
        fence_async_shared()

    @gluon.jit
    def _lora_mma(a_bufs, b_bufs, ready, it, acc):
        """Once K step ``it``'s slot is ready, start acc += rank vectors @ stacked B^T on it (async)."""
        STAGES: gl.constexpr = a_bufs.shape[0]
        slot = it % STAGES
        _wait_ready(ready, it)
        return warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot).permute((1, 0)), acc, is_async=True)

    @gluon.jit
    def _lora_mma_step(a_bufs, b_bufs, ready, empty, it, acc):
        """GEMM2's LoRA K step ``it``: acc += rank vectors @ B^T once its slot is ready, waited for, the slot handed
        back. Returns (acc, it + 1)."""
        acc = _lora_mma(a_bufs, b_bufs, ready, it, acc)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        it += 1
        _free_previous_slot(empty, it)
        return acc, it

    @gluon.jit
    def _lora_mma_gate_up(a_bufs, g_bufs, u_bufs, ready, empty, it, acc_gate, acc_up):
        """GEMM1's two LoRA K steps ``it`` (gate) and ``it + 1`` (up), both in flight, waited for, their slots handed
        back. Returns (acc_gate, acc_up, it + 2)."""
        acc_gate = _lora_mma(a_bufs, g_bufs, ready, it, acc_gate)
        it += 1
        acc_up = _lora_mma(a_bufs, u_bufs, ready, it, acc_up)
        acc_gate, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc_gate, acc_up))
        _free_previous_slot(empty, it)
        it += 1
        _free_previous_slot(empty, it)
        return acc_gate, acc_up, it

    @gluon.jit
    def _column_bias(bias_ptr, expert_row0, col0, n_cols, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """fp32 [BLOCK_N] in ``layout`` (a slice of columns): ``bias_ptr[expert_row0 + c]`` for columns c = col0..
        col0 + BLOCK_N below ``n_cols``, zeros past them."""
        cols = col0 + gl.arange(0, BLOCK_N, layout=layout)
        return gl.load(bias_ptr + expert_row0 + cols, mask=cols < n_cols, other=0.0).to(gl.float32)

    @gluon.jit
    def _gated_activation(gate, up, ACTIVATION: gl.constexpr, SWIGLU_ALPHA: gl.constexpr,
                          SWIGLU_LIMIT: gl.constexpr):
        """The gated activations the Gluon GEMM1 runs on its fp32 accumulators (``moelab.reference``'s): "silu"
        (SwiGLU) ``silu(gate) * up`` and GPT-OSS's "swigluoai" ``gate * sigmoid(SWIGLU_ALPHA * gate) * (up + 1)``;
        with a SWIGLU_LIMIT, gate first clamped to <= the limit and up to [-limit, limit]. The same arithmetic as
        ``_common.expert_activation`` (the same PTX when called from here), kept in Gluon because on a machine
        without a CUDA GPU moelab's Triton helpers are interpreted functions, which :func:`compile_sm90` cannot
        inline into a Gluon kernel."""
        if SWIGLU_LIMIT is not None:
            gate = gl.minimum(gate, SWIGLU_LIMIT)
            up = gl.minimum(gl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
        if ACTIVATION == "swigluoai":
            out = gate / (1.0 + gl.exp(-SWIGLU_ALPHA * gate)) * (up + 1.0)
        else:
            out = gate / (1.0 + gl.exp(-gate)) * up
        return out

    @gluon.jit
    def _tile_rows_lora(row_first_ptr, row_ranks_ptr, row0, BLOCK_M: gl.constexpr, layout: gl.constexpr):
        """The adapter loop's packing of the tile's rows row0..row0 + BLOCK_M (``fused_lora._write_tile_packing``: the
        tile's adapters side by side in its LoRA K steps, in adapter order, ceil(rank / 8) units of 8 ranks each), in
        ``layout`` (a slice of rows): each row's adapter's first unit (0 without one) and its rank (0 without one), as
        the W13 shrink wrote them. Loaded at the tile's start, first used after its K loop: no wait shows."""
        rows = row0 + gl.arange(0, BLOCK_M, layout=layout)
        return gl.load(row_first_ptr + rows), gl.load(row_ranks_ptr + rows)

    @gluon.jit
    def _unit_map_step(unit_map_ptr, tile, units_max, step, BLOCK_K: gl.constexpr, layout: gl.constexpr):
        """The unit-map entries (``adapter << 16 | the adapter's first unit``) of packed K step ``step`` of tile
        ``tile``, one a column, int32 [BLOCK_K] in ``layout`` (a slice of columns); past the tile's units they hold
        whatever the map holds there (:func:`_packed_columns` masks them). Masked by ``units_max`` (a multiple of 8)
        alone, so the load waits for no other: the next step's is issued before this step's copies."""
        unit = step * (BLOCK_K // 8) + gl.arange(0, BLOCK_K, layout=layout) // 8
        return gl.load(unit_map_ptr + tile.to(gl.int64) * units_max + unit, mask=unit < units_max, other=0)

    @gluon.jit
    def _packed_columns(entries, units, step, BLOCK_K: gl.constexpr, layout: gl.constexpr):
        """Whose ranks the columns of packed K step ``step`` of a tile of ``units`` hold, from their unit-map
        ``entries`` (:func:`_unit_map_step`), int32 [BLOCK_K] in ``layout``: each column's unit, its adapter (-1 past
        the tile's units) and that adapter's first unit."""
        unit = step * (BLOCK_K // 8) + gl.arange(0, BLOCK_K, layout=layout) // 8
        packed = unit < units
        return unit, gl.where(packed, entries >> 16, -1), gl.where(packed, entries & 0xFFFF, 0)

    @gluon.jit
    def _copy_packed_operands(a_bufs, b_bufs, slot, s_ptr, row0, ROW_WIDTH: gl.constexpr, row_ranks, first_unit,
                              unit, col_adapter, col_first, b_ptr, expert, n0, D_out, num_local_experts,
                              MAX_RANK: gl.constexpr):
        """One packed adapter-loop K step's operands into ring slot ``slot``, as one ``cp.async`` group (16-byte
        copies): ``a_bufs`` gets each row's own rank vector where its adapter's units fall in this step (row p's
        ranks (unit - first_unit[p]) * 8.., ``s_ptr`` at rank 0 of row 0, rows ROW_WIDTH elements apart; zeros
        elsewhere and for rows without an adapter), ``b_bufs`` [BLOCK_N, BLOCK_K] (K-major) the matching ranks of
        each column's adapter's B at output columns n0.. of the bank ``B [L, E_local, D_out, MAX_RANK]`` (zeros past
        D_out and the packed ranks). Units past a rank hold the shrinks' zeros, so each product stops at its own
        rank whatever B holds there."""
        BLOCK_M: gl.constexpr = a_bufs.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.shape[2]
        BLOCK_N: gl.constexpr = b_bufs.shape[1]
        layout: gl.constexpr = _gather_layout(BLOCK_K)
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))  # 32-bit offsets: fewer registers
        within = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout)) % 8
        own_unit = unit[None, :] - first_unit[:, None]  # the unit of the row's own ranks each column would hold
        s_rows = s_ptr + row0.to(gl.int64) * ROW_WIDTH
        _cp_async(a_bufs.index(slot), s_rows + (rows * ROW_WIDTH)[:, None] + own_unit * 8 + within[None, :],
                  mask=(own_unit >= 0) & (own_unit * 8 < row_ranks[:, None]))
        n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        b_cols = ((col_adapter * num_local_experts + expert).to(gl.int64) * D_out + n0) * MAX_RANK \
            + (unit - col_first) * 8 + within
        _cp_async(b_bufs.index(slot), b_ptr + b_cols[None, :] + (n * MAX_RANK)[:, None],
                  mask=(n < D_out - n0)[:, None] & (col_adapter >= 0)[None, :])
        async_copy.commit_group()

    @gluon.jit
    def _tile_expert(block_group_ptr, t, num_m, num_n, num_live_blocks, GROUP_M: gl.constexpr):
        """(row tile, column block, local expert) of output tile ``t`` of num_m x num_n; expert -1: past the live
        rows. GROUP_M = 1: each row tile sweeps its column blocks; else GROUP_M row tiles go down each column block
        together (``moe_gemm._tile_of``'s order), so experts too large for the L2 read each weight block once for
        GROUP_M row tiles."""
        if GROUP_M == 1:
            pid_m = t // num_n
            pid_n = t % num_n
        else:
            per_group = GROUP_M * num_n
            first_m = (t // per_group) * GROUP_M
            size = gl.minimum(num_m - first_m, GROUP_M)
            pid_m = first_m + (t % per_group) % size
            pid_n = (t % per_group) // size
        expert = -1
        if pid_m < num_live_blocks:
            expert = gl.load(block_group_ptr + pid_m)
        return pid_m, pid_n, expert

    @gluon.jit
    def _tile_ring():
        """Two shared-memory slots for the tile ids a dynamic schedule's load partition claims, and their ``full``
        (the load partition's arrival) and ``empty`` (the MMA partition's) mbarriers."""
        ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        return ids, full, empty

    @gluon.jit
    def _claim_tile(counter_ptr, num_tiles, ids, full, empty, j, DYNAMIC: gl.constexpr):
        """The load partition's ``j``-th output tile: the next of the counter, handed to the MMA partition through
        slot j % 2 of the tile ring (DYNAMIC), or every num_programs-th from the program's own. Each program's
        last claim is the first past ``num_tiles``, so the call's last claim (num_tiles + num_programs - 1) sets
        the counter back to zero for the next call on the same segments."""
        if DYNAMIC:
            s = j % 2
            mbarrier.wait(empty.index(s), ((j // 2) & 1) ^ 1)
            t = gl.atomic_add(counter_ptr, 1)
            # a masked store, not an if: with the branch, Triton 3.6's dynamic GEMM1 hung on the H100 (even with
            # the if never taken)
            gl.store(counter_ptr, 0, mask=t == num_tiles + gl.num_programs(0) - 1)
            ids.index(s).store(gl.full([1], t, gl.int32, gl.BlockedLayout([1], [32], [gl.num_warps()], [0])))
            _partition_barrier()
            mbarrier.arrive(full.index(s))
        else:
            t = gl.program_id(0) + j * gl.num_programs(0)
        return t

    @gluon.jit
    def _take_tile(ids, full, empty, j, DYNAMIC: gl.constexpr):
        """The MMA partition's ``j``-th output tile, the one :func:`_claim_tile` gave the load partition."""
        if DYNAMIC:
            s = j % 2
            mbarrier.wait(full.index(s), (j // 2) & 1)
            t = gl.max(ids.index(s).load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0])), axis=0)
            _partition_barrier()  # every warp has read the slot before it goes back
            mbarrier.arrive(empty.index(s))
        else:
            t = gl.program_id(0) + j * gl.num_programs(0)
        return t

    @gluon.jit
    def _stage_barriers(STAGES: gl.constexpr, READY_ARRIVALS: gl.constexpr):
        """The ring's mbarriers, one pair a stage: ``ready`` (READY_ARRIVALS arrivals, the TMA's among them)
        and ``empty`` (the MMA partition's one)."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=READY_ARRIVALS)
            mbarrier.init(empty.index(i), count=1)
        return ready, empty

    @gluon.jit
    def _free_previous_slot(empty, it):
        """Hand the slot of K step ``it - 1`` back to the loads, once every warpgroup has waited for its wgmma."""
        STAGES: gl.constexpr = empty.shape[0]
        _partition_barrier()
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))

    @gluon.jit
    def _store_tile(out_desc, out_smem, tile, pid_m, pid_n):
        """Round fp32 ``tile`` into ``out_smem`` once the previous tile's TMA store has read it, and store it at
        output tile (pid_m, pid_n) with a TMA store that runs on while the next tile's products start."""
        BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
        tma.store_wait(pendings=0)
        _partition_barrier()
        out_smem.store(tile.to(out_desc.dtype))
        fence_async_shared()
        _partition_barrier()
        _tma_store(out_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], out_smem)

    @gluon.jit
    def _gemm2_load_partition(a_desc, w_desc, a_bufs, w_bufs, ready, empty, block_group_ptr, num_live_blocks,
                              num_m, num_n, k_steps, H, s2_ptr, tile_flags_ptr, down_b_ptr, num_local_experts,
                              num_loras, row_first_ptr, row_ranks_ptr, tile_units_ptr, unit_map_ptr, units_max,
                              tile_counter_ptr, tile_ids, tiles_full, tiles_empty, GROUP_M: gl.constexpr,
                              LORA: gl.constexpr, MAX_RANK: gl.constexpr, R_PAD: gl.constexpr,
                              COLUMNS: gl.constexpr, LORA_OWN: gl.constexpr, DYNAMIC: gl.constexpr):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.shape[0]
        it = 0  # K steps issued so far: slot it % STAGES, its (it // STAGES)-th use
        pending = -1  # the adapter loop: the slot of the last LoRA step, its copies in flight, its arrival owed
        j = 0  # output tiles so far
        t = _claim_tile(tile_counter_ptr, num_m * num_n, tile_ids, tiles_full, tiles_empty, j, DYNAMIC)
        while t < num_m * num_n:
            pid_m, pid_n, expert = _tile_expert(block_group_ptr, t, num_m, num_n, num_live_blocks, GROUP_M)
            if expert >= 0:
                if LORA_OWN:  # the tile's packing, loaded here, waited for after the K loop
                    first_unit, row_ranks = _tile_rows_lora(row_first_ptr, row_ranks_ptr, pid_m * BLOCK_M, BLOCK_M,
                                                            gl.SliceLayout(1, _gather_layout(BLOCK_K)))
                    units = gl.load(tile_units_ptr + pid_m)
                    entries = _unit_map_step(unit_map_ptr, pid_m, units_max, 0, BLOCK_K,
                                             gl.SliceLayout(0, _gather_layout(BLOCK_K)))
                w_row = expert * H + pid_n * BLOCK_N
                for k in range(k_steps):
                    slot = it % STAGES
                    # a fresh barrier passes a wait on parity 1: the first round finds every slot free
                    mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
                    bar = ready.index(slot)
                    mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
                    _tma_load(a_desc, [pid_m * BLOCK_M, k * BLOCK_K], bar, a_bufs.index(slot))
                    _tma_load(w_desc, [w_row, k * BLOCK_K], bar, w_bufs.index(slot))
                    if LORA_OWN:
                        if pending >= 0:  # the previous tile's last LoRA copies, handed over once this tile's
                            _rows_landed(ready.index(pending), 0)  # first loads are on their way
                            pending = -1
                    it += 1
                if LORA_OWN:  # the adapter loop: the tile's adapters packed side by side, BLOCK_K ranks a K step,
                    # each row's weighted W2 rank vector and each column's B_down
                    for c in range(gl.cdiv(units * 8, BLOCK_K)):
                        unit, col_adapter, col_first = _packed_columns(entries, units, c, BLOCK_K,
                                                                       gl.SliceLayout(0, _gather_layout(BLOCK_K)))
                        entries = _unit_map_step(unit_map_ptr, pid_m, units_max, c + 1, BLOCK_K,
                                                 gl.SliceLayout(0, _gather_layout(BLOCK_K)))
                        slot = it % STAGES
                        mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
                        _copy_packed_operands(a_bufs, w_bufs, slot, s2_ptr, pid_m * BLOCK_M, R_PAD, row_ranks,
                                              first_unit, unit, col_adapter, col_first, down_b_ptr, expert,
                                              pid_n * BLOCK_N, H, num_local_experts, MAX_RANK)
                        if pending >= 0:  # the previous step's copies have landed: its slot's one arrival
                            _rows_landed(ready.index(pending), 1)
                        pending = slot
                        it += 1
                elif LORA:  # one more K step: the tile's weighted W2 rank vectors and the stacked B_down
                    if gl.load(tile_flags_ptr + pid_m) != 0:
                        slot = it % STAGES
                        mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
                        _copy_lora_operands(a_bufs, w_bufs, slot, s2_ptr, pid_m * BLOCK_M, COLUMNS,
                                            down_b_ptr, expert, pid_n * BLOCK_N, H, num_local_experts, num_loras,
                                            MAX_RANK, R_PAD, COLUMNS)
                        _rows_landed(ready.index(slot), 0)  # the slot's one arrival, no TMA bytes
                        it += 1
            elif LORA_OWN and DYNAMIC:  # a dead tile: the owed LoRA arrival now, since the next claims wait for
                if pending >= 0:  # the MMA partition to take tiles, and it waits for that arrival
                    _rows_landed(ready.index(pending), 0)
                    pending = -1
            j += 1
            t = _claim_tile(tile_counter_ptr, num_m * num_n, tile_ids, tiles_full, tiles_empty, j, DYNAMIC)
        if LORA_OWN:
            if pending >= 0:  # the last tile's last LoRA copies
                _rows_landed(ready.index(pending), 0)

    @gluon.jit
    def _gemm2_mma_partition(a_bufs, w_bufs, ready, empty, out_desc, out_smem, block_group_ptr, num_live_blocks,
                             num_m, num_n, k_steps, tile_flags_ptr, tile_units_ptr, bias_ptr, row_to_slot_ptr, H,
                             tile_ids, tiles_full, tiles_empty, GROUP_M: gl.constexpr, DEAD_FILL: gl.constexpr,
                             LORA: gl.constexpr, MAX_RANK: gl.constexpr, LORA_OWN: gl.constexpr,
                             HAS_BIAS: gl.constexpr, DYNAMIC: gl.constexpr, NUM_WARPS: gl.constexpr):
        BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.shape[2]
        STAGES: gl.constexpr = a_bufs.shape[0]
        acc_layout: gl.constexpr = _acc_layout(BLOCK_N, NUM_WARPS)
        it = 0
        j = 0  # output tiles so far
        t = _take_tile(tile_ids, tiles_full, tiles_empty, j, DYNAMIC)
        while t < num_m * num_n:
            pid_m, pid_n, expert = _tile_expert(block_group_ptr, t, num_m, num_n, num_live_blocks, GROUP_M)
            acc = gl.full([BLOCK_M, BLOCK_N], DEAD_FILL, gl.float32, acc_layout)
            if expert >= 0:
                if LORA_OWN:  # the tile's packed units, loaded here, waited for after the K loop
                    units = gl.load(tile_units_ptr + pid_m)
                for k in range(k_steps):
                    slot = it % STAGES
                    mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
                    acc = warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc,
                                        use_acc=k > 0, is_async=True)
                    # one MMA in flight: the previous step's is done, so its slot goes back to the loads
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                    if k > 0:
                        _free_previous_slot(empty, it)
                    it += 1
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                _free_previous_slot(empty, it)
                if LORA_OWN:  # W2 LoRA: acc += s_down @ B_down, the tile's packed ranks, BLOCK_K a K step
                    for _ in range(gl.cdiv(units * 8, BLOCK_K)):
                        acc, it = _lora_mma_step(a_bufs, w_bufs, ready, empty, it, acc)
                elif LORA:  # W2 LoRA: acc += s_down @ B_down, the stacked rank vectors as one more K step
                    if gl.load(tile_flags_ptr + pid_m) != 0:
                        acc, it = _lora_mma_step(a_bufs, w_bufs, ready, empty, it, acc)
                if HAS_BIAS:  # GEMM2's bias [E_local, H], on the live rows only (as the Triton kernel)
                    rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
                    live = gl.load(row_to_slot_ptr + rows) >= 0
                    bias = _column_bias(bias_ptr, expert.to(gl.int64) * H, pid_n * BLOCK_N, H, BLOCK_N,
                                        gl.SliceLayout(0, acc_layout))
                    acc += gl.where(live[:, None], bias[None, :], 0.0)
            _store_tile(out_desc, out_smem, acc, pid_m, pid_n)
            j += 1
            t = _take_tile(tile_ids, tiles_full, tiles_empty, j, DYNAMIC)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _gemm2_ws_kernel(a_desc, w_desc, out_desc, block_group_ptr, num_live_blocks, num_rows, H, I,
                         s2_ptr, tile_flags_ptr, down_b_ptr, num_local_experts, num_loras, row_first_ptr,
                         row_ranks_ptr, tile_units_ptr, unit_map_ptr, units_max, bias_ptr, row_to_slot_ptr,
                         tile_counter_ptr,
                         STAGES: gl.constexpr, GROUP_M: gl.constexpr, DEAD_FILL: gl.constexpr, LORA: gl.constexpr,
                         MAX_RANK: gl.constexpr, R_PAD: gl.constexpr, COLUMNS: gl.constexpr, LORA_OWN: gl.constexpr,
                         HAS_BIAS: gl.constexpr, DYNAMIC: gl.constexpr,
                         num_warps: gl.constexpr):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        gl.static_assert(STAGES >= 2, "GEMM2's ring needs 2 stages: the MMAs free a stage one step behind")
        gl.static_assert(COLUMNS <= BLOCK_K, "the stacked LoRA columns are one K step")
        # the LoRA step's copies take four load warps; TMA alone, one; the adapter loop's took 120 registers while
        # it looped over the tile's adapters (88 spilled), and 88 no longer spill since its packing comes from the
        # shrink (not timed, so kept)
        LOAD_WARPS: gl.constexpr = 4 if LORA else 1
        LOAD_REGS: gl.constexpr = (120 if LORA_OWN else 88) if LORA else 40
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        out_smem = gl.allocate_shared_memory(out_desc.dtype, [BLOCK_M, BLOCK_N], out_desc.layout)
        ready, empty = _stage_barriers(STAGES, 1)
        tile_ids, tiles_full, tiles_empty = _tile_ring()
        num_m = gl.cdiv(num_rows, BLOCK_M)
        num_n = gl.cdiv(H, BLOCK_N)
        k_steps = gl.cdiv(I, BLOCK_K)
        gl.warp_specialize([
            (_gemm2_mma_partition, (a_bufs, w_bufs, ready, empty, out_desc, out_smem, block_group_ptr,
                                    num_live_blocks, num_m, num_n, k_steps, tile_flags_ptr, tile_units_ptr,
                                    bias_ptr, row_to_slot_ptr, H, tile_ids, tiles_full, tiles_empty, GROUP_M,
                                    DEAD_FILL, LORA, MAX_RANK, LORA_OWN, HAS_BIAS, DYNAMIC, num_warps)),
            (_gemm2_load_partition, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, block_group_ptr,
                                     num_live_blocks, num_m, num_n, k_steps, H, s2_ptr, tile_flags_ptr, down_b_ptr,
                                     num_local_experts, num_loras, row_first_ptr, row_ranks_ptr, tile_units_ptr,
                                     unit_map_ptr, units_max, tile_counter_ptr, tile_ids, tiles_full, tiles_empty,
                                     GROUP_M, LORA, MAX_RANK, R_PAD, COLUMNS, LORA_OWN, DYNAMIC)),
        ], [LOAD_WARPS], [LOAD_REGS])

    @gluon.jit
    def _gemm1_load_partition(x_ptr, stride_x, row_to_slot_ptr, top_k, w_desc, a_bufs, g_bufs, u_bufs, ready, empty,
                              block_group_ptr, num_live_blocks, num_m, num_n, k_steps, H, I, s13_ptr, tile_flags_ptr,
                              up_b_ptr, gate_b_ptr, num_local_experts, num_loras, row_first_ptr, row_ranks_ptr,
                              tile_units_ptr, unit_map_ptr, units_max, tile_counter_ptr, tile_ids, tiles_full,
                              tiles_empty, GROUP_M: gl.constexpr, LORA: gl.constexpr, MAX_RANK: gl.constexpr,
                              R_PAD: gl.constexpr, COLUMNS: gl.constexpr, LORA_OWN: gl.constexpr,
                              DYNAMIC: gl.constexpr):
        STAGES: gl.constexpr = a_bufs.shape[0]
        BLOCK_M: gl.constexpr = a_bufs.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.shape[2]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        gather: gl.constexpr = _gather_layout(BLOCK_K)  # the gathered input rows
        tile_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gather))
        ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gather))
        it = 0
        j = 0  # output tiles so far
        t = _claim_tile(tile_counter_ptr, num_m * num_n, tile_ids, tiles_full, tiles_empty, j, DYNAMIC)
        while t < num_m * num_n:
            pid_m, pid_n, expert = _tile_expert(block_group_ptr, t, num_m, num_n, num_live_blocks, GROUP_M)
            if expert >= 0:
                slots = gl.load(row_to_slot_ptr + pid_m * BLOCK_M + tile_rows)
                if LORA_OWN:  # the tile's packing, loaded here, waited for after the K loop
                    first_unit, row_ranks = _tile_rows_lora(row_first_ptr, row_ranks_ptr, pid_m * BLOCK_M, BLOCK_M,
                                                            gl.SliceLayout(1, gather))
                    units = gl.load(tile_units_ptr + pid_m)
                    entries = _unit_map_step(unit_map_ptr, pid_m, units_max, 0, BLOCK_K, gl.SliceLayout(0, gather))
                row_ok = slots >= 0
                x_rows = x_ptr + gl.where(row_ok, slots // top_k, 0).to(gl.int64)[:, None] * stride_x
                gate_row = expert * (2 * I) + pid_n * BLOCK_N
                for k in range(k_steps):
                    slot = it % STAGES
                    mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
                    bar = ready.index(slot)
                    mbarrier.expect(bar, 2 * w_desc.block_type.nbytes)  # the TMA's arrival, with its bytes
                    _tma_load(w_desc, [gate_row, k * BLOCK_K], bar, g_bufs.index(slot))
                    _tma_load(w_desc, [gate_row + I, k * BLOCK_K], bar, u_bufs.index(slot))
                    # H is a multiple of BLOCK_K (takes_gluon_gemm1): the rows' mask alone, 16-byte copies
                    _cp_async(a_bufs.index(slot), x_rows + (k * BLOCK_K + ks)[None, :], mask=row_ok[:, None])
                    # each thread's arrival, once its row copies have landed (the MMAs fence before reading them)
                    async_copy.mbarrier_arrive(bar, increment_count=False)
                    it += 1
                if LORA_OWN:  # the adapter loop: the tile's adapters packed side by side, two K steps a BLOCK_K
                    # ranks, the gate's rank vectors and B_gate, then the up's (s13 [R, 2, R_PAD], [up | gate])
                    for c in range(gl.cdiv(units * 8, BLOCK_K)):
                        unit, col_adapter, col_first = _packed_columns(entries, units, c, BLOCK_K,
                                                                       gl.SliceLayout(0, gather))
                        entries = _unit_map_step(unit_map_ptr, pid_m, units_max, c + 1, BLOCK_K,
                                                 gl.SliceLayout(0, gather))
                        for half in gl.static_range(2):  # gate (s13 column block 1, B_gate), then up (0, B_up)
                            slot = it % STAGES
                            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
                            mbarrier.arrive(ready.index(slot))  # no TMA bytes: the elected arrival now
                            _copy_packed_operands(a_bufs, g_bufs if half == 0 else u_bufs, slot,
                                                  s13_ptr + (1 - half) * R_PAD, pid_m * BLOCK_M, 2 * R_PAD, row_ranks,
                                                  first_unit, unit, col_adapter, col_first,
                                                  gate_b_ptr if half == 0 else up_b_ptr, expert, pid_n * BLOCK_N, I,
                                                  num_local_experts, MAX_RANK)
                            async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
                            it += 1
                elif LORA:  # two more K steps: the gate's stacked rank vectors and B, then the up's ([R, 2, COLUMNS]
                    if gl.load(tile_flags_ptr + pid_m) != 0:  # rows of s13, [up | gate])
                        for half in gl.static_range(2):  # gate (s13 column block 1, B_gate), then up (0, B_up)
                            slot = it % STAGES
                            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
                            mbarrier.arrive(ready.index(slot))  # no TMA bytes: the elected arrival now
                            _copy_lora_operands(a_bufs, g_bufs if half == 0 else u_bufs, slot,
                                                s13_ptr + (1 - half) * COLUMNS, pid_m * BLOCK_M, 2 * COLUMNS,
                                                gate_b_ptr if half == 0 else up_b_ptr, expert, pid_n * BLOCK_N, I,
                                                num_local_experts, num_loras, MAX_RANK, R_PAD, COLUMNS)
                            async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
                            it += 1
            j += 1
            t = _claim_tile(tile_counter_ptr, num_m * num_n, tile_ids, tiles_full, tiles_empty, j, DYNAMIC)

    @gluon.jit
    def _rows_landed(bar, OUTSTANDING: gl.constexpr):
        """Wait for this thread's row copies but the last OUTSTANDING groups, make them visible to wgmma (the async
        proxy), and arrive on ``bar`` once every warp of the partition has."""
        async_copy.wait_group(OUTSTANDING)
        fence_async_shared()
        _partition_barrier()
        mbarrier.arrive(bar)

    @gluon.jit
    def _delta_half(buf, d_ptr, stride_d, row_to_slot_ptr, row0, col0, I, acc_layout: gl.constexpr):
        """One half of the tile's LoRA delta, fp32 [BLOCK_M, BLOCK_N] in ``acc_layout``: rows ``d[slot]`` of the
        tile's slots (zeros for padding rows and past I), gathered by 16-byte ``cp.async`` copies into ``buf`` and
        read back from it (the MMA partition's warps; ``buf`` must be free)."""
        BLOCK_M: gl.constexpr = buf.shape[0]
        BLOCK_N: gl.constexpr = buf.shape[1]
        NUM_WARPS: gl.constexpr = gl.num_warps()
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BLOCK_N // 8), BLOCK_N // 8], [NUM_WARPS, 1],
                                                [1, 0])
        slots = gl.load(row_to_slot_ptr + row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout)))
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        ptrs = d_ptr + gl.where(slots >= 0, slots, 0).to(gl.int64)[:, None] * stride_d + cols[None, :]
        _cp_async(buf, ptrs, mask=(slots >= 0)[:, None] & (cols < I)[None, :])
        async_copy.commit_group()
        async_copy.wait_group(0)
        _partition_barrier()
        half = buf.load(acc_layout).to(gl.float32)
        _partition_barrier()  # every warp has read buf before it is written again
        return half

    @gluon.jit
    def _gemm1_mma_partition(a_bufs, g_bufs, u_bufs, ready, empty, out_desc, out_smem, row_to_slot_ptr,
                             block_group_ptr, num_live_blocks, num_m, num_n, k_steps, I, delta_ptr, stride_d,
                             tile_flags_ptr, tile_units_ptr, bias_ptr, tile_ids, tiles_full, tiles_empty,
                             HAS_DELTA: gl.constexpr, GROUP_M: gl.constexpr, DEAD_FILL: gl.constexpr,
                             LORA: gl.constexpr, MAX_RANK: gl.constexpr, LORA_OWN: gl.constexpr,
                             HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, SWIGLU_ALPHA: gl.constexpr,
                             SWIGLU_LIMIT: gl.constexpr, DYNAMIC: gl.constexpr, NUM_WARPS: gl.constexpr):
        BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.shape[2]
        STAGES: gl.constexpr = a_bufs.shape[0]
        acc_layout: gl.constexpr = _acc_layout(BLOCK_N, NUM_WARPS)
        tile_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        it = 0
        j = 0  # output tiles so far
        t = _take_tile(tile_ids, tiles_full, tiles_empty, j, DYNAMIC)
        while t < num_m * num_n:
            pid_m, pid_n, expert = _tile_expert(block_group_ptr, t, num_m, num_n, num_live_blocks, GROUP_M)
            act = gl.full([BLOCK_M, BLOCK_N], DEAD_FILL, gl.float32, acc_layout)
            if expert >= 0:
                slots = gl.load(row_to_slot_ptr + pid_m * BLOCK_M + tile_rows)
                row_ok = slots >= 0
                if LORA_OWN:  # the tile's packed units, loaded here, waited for after the K loop
                    units = gl.load(tile_units_ptr + pid_m)
                acc_gate = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
                acc_up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
                for k in range(k_steps):
                    slot = it % STAGES
                    _wait_ready(ready, it)
                    a = a_bufs.index(slot)
                    acc_gate = warpgroup_mma(a, g_bufs.index(slot).permute((1, 0)), acc_gate, use_acc=k > 0,
                                             is_async=True)
                    acc_up = warpgroup_mma(a, u_bufs.index(slot).permute((1, 0)), acc_up, use_acc=k > 0,
                                           is_async=True)
                    acc_gate, acc_up = warpgroup_mma_wait(num_outstanding=2, deps=(acc_gate, acc_up))
                    if k > 0:
                        _free_previous_slot(empty, it)
                    it += 1
                acc_gate, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc_gate, acc_up))
                _free_previous_slot(empty, it)
                if LORA_OWN:  # W13 LoRA before the activation, the tile's packed ranks: two K steps a BLOCK_K
                    for _ in range(gl.cdiv(units * 8, BLOCK_K)):
                        acc_gate, acc_up, it = _lora_mma_gate_up(a_bufs, g_bufs, u_bufs, ready, empty, it,
                                                                 acc_gate, acc_up)
                elif LORA:  # W13 LoRA before the activation: acc += s @ B, gate then up, as two more K steps
                    if gl.load(tile_flags_ptr + pid_m) != 0:
                        acc_gate, acc_up, it = _lora_mma_gate_up(a_bufs, g_bufs, u_bufs, ready, empty, it,
                                                                 acc_gate, acc_up)
                if HAS_BIAS:  # GEMM1's bias [E_local, 2I] in w13's row order [gate; up], before the activation
                    columns: gl.constexpr = gl.SliceLayout(0, acc_layout)
                    bias_row = expert.to(gl.int64) * (2 * I)
                    acc_gate += _column_bias(bias_ptr, bias_row, pid_n * BLOCK_N, I, BLOCK_N, columns)[None, :]
                    acc_up += _column_bias(bias_ptr, bias_row + I, pid_n * BLOCK_N, I, BLOCK_N, columns)[None, :]
                if HAS_DELTA:  # the slot's LoRA delta, [up | gate], added before the activation, unweighted:
                    # each half gathered into out_smem (free once the previous tile's store has read it) and read
                    # back in the accumulators' layout (a gather in that layout spills registers)
                    tma.store_wait(pendings=0)
                    _partition_barrier()
                    acc_up += _delta_half(out_smem, delta_ptr, stride_d, row_to_slot_ptr, pid_m * BLOCK_M,
                                          pid_n * BLOCK_N, I, acc_layout)
                    acc_gate += _delta_half(out_smem, delta_ptr + I, stride_d, row_to_slot_ptr, pid_m * BLOCK_M,
                                            pid_n * BLOCK_N, I, acc_layout)
                act = gl.where(row_ok[:, None], _gated_activation(acc_gate, acc_up, ACTIVATION, SWIGLU_ALPHA,
                                                                  SWIGLU_LIMIT), DEAD_FILL)
            _store_tile(out_desc, out_smem, act, pid_m, pid_n)
            j += 1
            t = _take_tile(tile_ids, tiles_full, tiles_empty, j, DYNAMIC)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _gemm1_swiglu_ws_kernel(x_ptr, stride_x, row_to_slot_ptr, top_k, w_desc, out_desc, block_group_ptr,
                                num_live_blocks, num_rows, H, I, delta_ptr, stride_d, s13_ptr, tile_flags_ptr,
                                up_b_ptr, gate_b_ptr, num_local_experts, num_loras, row_first_ptr,
                                row_ranks_ptr, tile_units_ptr, unit_map_ptr, units_max, bias_ptr, tile_counter_ptr,
                                HAS_DELTA: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                                GROUP_M: gl.constexpr, DEAD_FILL: gl.constexpr, LORA: gl.constexpr,
                                MAX_RANK: gl.constexpr, R_PAD: gl.constexpr, COLUMNS: gl.constexpr,
                                LORA_OWN: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr,
                                SWIGLU_ALPHA: gl.constexpr, SWIGLU_LIMIT: gl.constexpr, DYNAMIC: gl.constexpr,
                                num_warps: gl.constexpr):
        BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        dtype: gl.constexpr = w_desc.dtype
        # the MMAs keep one step in flight and free its slot a step later: 3 stages let the loads run a step ahead
        gl.static_assert(STAGES >= 3, "GEMM1's ring needs 3 stages")
        gl.static_assert(COLUMNS <= BLOCK_K, "the stacked LoRA columns are one K step")
        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
        g_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        u_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        out_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], out_desc.layout)
        LOAD_WARPS: gl.constexpr = 4  # the row gathers' layout (_gather_layout) spans 4 warps
        # a slot is ready on the TMA's arrival with its bytes (or a LoRA step's plain one) and each load thread's,
        # once its row copies have landed (async_copy.mbarrier_arrive)
        ready, empty = _stage_barriers(STAGES, 1 + LOAD_WARPS * 32)
        tile_ids, tiles_full, tiles_empty = _tile_ring()
        num_m = gl.cdiv(num_rows, BLOCK_M)
        num_n = gl.cdiv(I, BLOCK_N)
        k_steps = gl.cdiv(H, BLOCK_K)
        gl.warp_specialize([
            (_gemm1_mma_partition, (a_bufs, g_bufs, u_bufs, ready, empty, out_desc, out_smem, row_to_slot_ptr,
                                    block_group_ptr, num_live_blocks, num_m, num_n, k_steps, I, delta_ptr,
                                    stride_d, tile_flags_ptr, tile_units_ptr, bias_ptr, tile_ids, tiles_full,
                                    tiles_empty, HAS_DELTA, GROUP_M, DEAD_FILL, LORA, MAX_RANK, LORA_OWN, HAS_BIAS,
                                    ACTIVATION, SWIGLU_ALPHA, SWIGLU_LIMIT, DYNAMIC, num_warps)),
            (_gemm1_load_partition, (x_ptr, stride_x, row_to_slot_ptr, top_k, w_desc, a_bufs, g_bufs, u_bufs,
                                     ready, empty, block_group_ptr, num_live_blocks, num_m, num_n, k_steps, H, I,
                                     s13_ptr, tile_flags_ptr, up_b_ptr, gate_b_ptr, num_local_experts, num_loras,
                                     row_first_ptr, row_ranks_ptr, tile_units_ptr, unit_map_ptr, units_max,
                                     tile_counter_ptr, tile_ids, tiles_full, tiles_empty, GROUP_M, LORA, MAX_RANK,
                                     R_PAD, COLUMNS, LORA_OWN, DYNAMIC)),
        ], [LOAD_WARPS], [120 if LORA_OWN else 88])  # the adapter loop's copies spill at 88 registers


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _schedule(num_tiles: int, segments: Segments, gemm: int) -> tuple[tuple[int], dict]:
    """The grid for ``num_tiles`` output tiles and the kernels' schedule arguments under ``TILE_SCHEDULE``: a zeroed
    int32 tile counter (dynamic: ``segments.tile_counters[gemm - 1]``, or a fresh one where they have none; else
    ``segments.block_group``, never read) and DYNAMIC."""
    if TILE_SCHEDULE not in TILE_SCHEDULES:
        raise ValueError(f"gluon_gemm.TILE_SCHEDULE (MOELAB_TILE_SCHEDULE): expected one of {TILE_SCHEDULES}, got "
                         f"{TILE_SCHEDULE!r}")
    device = segments.block_group.device
    programs = _multiprocessors(device)
    schedule = TILE_SCHEDULE
    if schedule == "rule":
        schedule = "dynamic" if num_tiles >= DYNAMIC_MIN_TILES_A_PROGRAM * programs else "static"
    dynamic = schedule == "dynamic"
    if not dynamic:
        counter = segments.block_group
    elif segments.tile_counters is not None:
        counter = segments.tile_counters[gemm - 1:gemm]
    else:
        counter = torch.zeros(1, dtype=torch.int32, device=device)
    grid = num_tiles if schedule == "grid" else min(num_tiles, programs)
    return (grid,), dict(tile_counter_ptr=counter, DYNAMIC=dynamic)


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


@functools.cache
def _smem_layout(block: tuple[int, int], dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _gl_dtype(dtype))


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor over 2-D ``t`` in ``block`` tiles (128-byte swizzled, zero-filled past the edges)."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _smem_layout(tuple(block), t.dtype))


def takes_gluon_lora(lora: TileLoRA | AdapterLoopLoRA) -> bool:
    """Whether the Gluon GEMMs can fold this fused LoRA bank in, with a bank whose max_rank is a multiple of 8
    (16-byte copies of B's rows): the tile mode's operands (prefill) of at most one K step (64) of stacked columns,
    or the adapter loop's tile operands (prefill, any width: a tile's adapters packed side by side in K steps)."""
    if isinstance(lora, TileLoRA):
        l_pad, r_pad = lora.bank.stacked_pads
        operands = (lora.s13_by_row, lora.s2_by_row)
        if l_pad * r_pad > GEMM1_WS_TILE[1]:
            return False
    elif isinstance(lora, AdapterLoopLoRA) and lora.row_first_units is not None:  # tiles: the tiles' packing
        if lora.bank.max_loras >= 2**15 or lora.unit_map.shape[1] >= 2**16:  # the unit map's 16-bit fields
            return False
        operands = (lora.s13, lora.s2)
    else:
        return False
    bank = lora.bank
    operands += (bank.up_b, bank.gate_b, bank.down_b)
    return bank.max_rank % 8 == 0 and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in operands)


def _lora_args(lora: TileLoRA | AdapterLoopLoRA | None, gemm: int, like: torch.Tensor) -> dict:
    """GEMM ``gemm``'s (1 or 2) LoRA arguments: the tile mode's rank vectors by row, tile flags and B banks, or the
    adapter loop's own rank vectors, its tiles' packing and B banks (LORA_OWN), or ``like`` in their place (never
    read: LORA False)."""
    unused = dict.fromkeys(("tile_flags_ptr", "row_first_ptr", "row_ranks_ptr", "tile_units_ptr", "unit_map_ptr"),
                           like) | dict(units_max=8)
    if lora is None:
        banks = ("s13_ptr", "up_b_ptr", "gate_b_ptr") if gemm == 1 else ("s2_ptr", "down_b_ptr")
        return unused | dict.fromkeys(banks, like) | dict(
            num_local_experts=0, num_loras=0, LORA=False, MAX_RANK=8, R_PAD=8, COLUMNS=8, LORA_OWN=False)
    bank = lora.bank
    own = isinstance(lora, AdapterLoopLoRA)
    if own:  # rows of s13 [up | gate] and of s2 are R_PAD wide, copied by 8-rank units (COLUMNS: not read)
        r_pad = own_rank_pad(bank)
        columns = 8
        s13, s2 = lora.s13, lora.s2
        unused |= dict(row_first_ptr=lora.row_first_units, row_ranks_ptr=lora.row_ranks,
                       tile_units_ptr=lora.tile_units, unit_map_ptr=lora.unit_map, units_max=lora.unit_map.shape[1])
    else:
        l_pad, r_pad = bank.stacked_pads
        columns = l_pad * r_pad
        s13, s2 = lora.s13_by_row, lora.s2_by_row
        unused |= dict(tile_flags_ptr=lora.tile_flags)
    if gemm == 1:
        banks = dict(s13_ptr=s13, up_b_ptr=bank.up_b, gate_b_ptr=bank.gate_b)
    else:
        banks = dict(s2_ptr=s2, down_b_ptr=bank.down_b)
    return unused | banks | dict(num_local_experts=lora.num_local_experts, num_loras=bank.max_loras, LORA=True,
                                 MAX_RANK=bank.max_rank, R_PAD=r_pad, COLUMNS=columns, LORA_OWN=own)


def runs_on(device: torch.device) -> bool:
    """Whether the Gluon GEMMs run on ``device``: ``GLUON`` on, compiled kernels (not the interpreter), an sm_90
    GPU (wgmma)."""
    return (GLUON and not _runtime.INTERPRET and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0))


def gathers_rows_of(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """Whether GEMM1 can gather the rows of ``x`` [T, H] by 16-byte copies against ``w13`` [E_local, 2I, H]: x of
    their dtype with a unit column stride, a row stride of a multiple of 16 elements and a 16-byte aligned base
    (what lets Triton prove the copies 16 bytes wide), and H a multiple of GEMM1_WS_TILE's BLOCK_K."""
    return _gathered_shapes_ok(x, w13) and x.dtype == w13.dtype and x.data_ptr() % 16 == 0


def _gathered_shapes_ok(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """What of :func:`gathers_rows_of` the shapes and strides decide: H a multiple of GEMM1_WS_TILE's BLOCK_K, x of
    a unit column stride and a row stride of a multiple of 16 elements."""
    return w13.shape[-1] % GEMM1_WS_TILE[1] == 0 and x.stride(-1) == 1 and x.stride(0) % 16 == 0


def runs_activation(activation: str, gated: bool, weight_on_input: bool) -> bool:
    """Whether the Gluon GEMM1 runs these experts: a gated ``activation`` of ``ACTIVATIONS``, no router weight on
    the input."""
    return activation in ACTIVATIONS and gated and not weight_on_input


def takes_shapes_of(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The part of :func:`takes_gluon_gemm1` and :func:`takes_gluon_gemm2` that the call's shapes and strides decide
    (no pointer's alignment, so a fake tensor answers it too): contiguous weights, the gathered rows' shapes
    (:func:`gathers_rows_of`) and 16-byte rows of the [R, I] activation."""
    return (w13.is_contiguous() and w2.is_contiguous() and _gathered_shapes_ok(x, w13)
            and (w2.shape[-1] * w2.element_size()) % 16 == 0)


def _bias_ok(bias: torch.Tensor) -> bool:
    """A bias the epilogues read: contiguous, 16-byte aligned (Triton then proves its loads aligned; GEMM1's epilogue
    with a bias and a delta spills registers on an unaligned one)."""
    return bias.is_contiguous() and bias.data_ptr() % 16 == 0


def takes_gluon_gemm2(segments: Segments, block_m: int, act: torch.Tensor, w2: torch.Tensor,
                      out: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`gemm2_ws` can run this GEMM2: :func:`runs_on` its device, segments of 128-row tiles with rows
    (``block_m`` their tile), ``act``, ``w2`` and ``out`` all bf16 or all fp16, contiguous ``w2`` and TMA-able
    ``act`` and ``out`` (unit column stride, 16-byte rows and base), ``bias`` None or contiguous and 16-byte
    aligned."""
    if bias is not None and not _bias_ok(bias):
        return False
    if (block_m != 128 or segments.tile != block_m or segments.row_to_slot.numel() == 0
            or not runs_on(w2.device)):
        return False
    if act.dtype not in (torch.bfloat16, torch.float16) or not act.dtype == w2.dtype == out.dtype:
        return False
    return w2.is_contiguous() and all(map(tma_ok, (act, out, w2)))


def gemm2_ws(act: torch.Tensor, w2: torch.Tensor, out: torch.Tensor, segments: Segments, *, block_m: int = 128,
             tile: tuple[int, int, int] = GEMM2_WS_TILE, group_m: int = 1, dead_fill: float = 0.0,
             lora: TileLoRA | AdapterLoopLoRA | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` [R, H] = ``act`` [R, I] @ ``w2`` [E_local, H, I]^T per row tile's expert, over the rows ``segments``
    reaches (tile ``block_m`` = 128); ``tile`` = (BLOCK_N, BLOCK_K, STAGES), ``group_m`` the tile order's (as
    ``GemmConfig.group_m``); ``lora`` the fused bank's tile-mode or adapter-loop operands (+ s2 @ B_down on its
    tiles) or None; ``bias`` None or [E_local, H] (+ bias[e] on the live rows; not with ``lora``).
    Check :func:`takes_gluon_gemm2` (and :func:`takes_gluon_lora`) first."""
    if lora is not None and bias is not None:
        raise ValueError("bias: the Gluon GEMM2 adds a bias without a fused LoRA bank only (its LoRA step would come "
                         "before the bias, unlike the Triton kernel's order); pass lora=None or use moe_gemm.gemm2")
    E_local, H, I = w2.shape
    reach = segments.row_to_slot.numel()
    block_n, block_k, stages = tile
    a_desc = _descriptor(act[:reach], [block_m, block_k])
    w_desc = _descriptor(w2.view(E_local * H, I), [block_n, block_k])
    out_desc = _descriptor(out[:reach], [block_m, block_n])
    grid, schedule = _schedule(cdiv(reach, block_m) * cdiv(H, block_n), segments, 2)
    _gemm2_ws_kernel[grid](a_desc, w_desc, out_desc, segments.block_group, segments.block_group.numel(), reach, H,
                           I, **_lora_args(lora, 2, act), bias_ptr=bias if bias is not None else act,
                           row_to_slot_ptr=segments.row_to_slot, **schedule, STAGES=stages, GROUP_M=group_m,
                           DEAD_FILL=dead_fill, HAS_BIAS=bias is not None, num_warps=8)
    return out


def takes_gluon_gemm1(segments: Segments, block_m: int, x: torch.Tensor, w13: torch.Tensor,
                      act: torch.Tensor, delta: torch.Tensor | None = None, *, activation: str = "silu",
                      gated: bool = True, bias: torch.Tensor | None = None,
                      input_weights: torch.Tensor | None = None) -> bool:
    """Whether :func:`gemm1_swiglu_ws` can run this GEMM1: as :func:`takes_gluon_gemm2`, and :func:`gathers_rows_of`
    ``x``; a gated ``activation`` of ``ACTIVATIONS``, ``bias`` None or contiguous and 16-byte aligned, no
    ``input_weights``; a ``delta``
    contiguous, of their dtype, 16-byte aligned, with I a multiple of 16 (its rows are gathered by 16-byte copies
    too)."""
    if not runs_activation(activation, gated, input_weights is not None):
        return False
    if bias is not None and not _bias_ok(bias):
        return False
    if delta is not None and not (delta.is_contiguous() and delta.dtype == w13.dtype and delta.data_ptr() % 16 == 0
                                  and w13.shape[1] % 32 == 0):
        return False
    return takes_gluon_gemm2(segments, block_m, act, w13, act) and gathers_rows_of(x, w13)


def gemm1_swiglu_ws(x: torch.Tensor, w13: torch.Tensor, act: torch.Tensor, segments: Segments, *, top_k: int,
                    block_m: int = 128, tile: tuple[int, int, int] | None = None, group_m: int = 1,
                    delta: torch.Tensor | None = None, dead_fill: float = 0.0,
                    lora: TileLoRA | AdapterLoopLoRA | None = None, activation: str = "silu",
                    swiglu_alpha: float | None = None, swiglu_limit: float | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``act`` [R, I] = silu(x[t] @ W_gate[e]^T + d_gate) * (x[t] @ W_up[e]^T + d_up) over the rows ``segments``
    reaches (tile ``block_m`` = 128; row p's slot s = row_to_slot[p], token t = s // top_k), ``x`` [T, H], ``w13``
    [E_local, 2I, H] ([gate; up] rows), ``delta`` None or contiguous [T*K, 2I] ([up | gate], the slot's row d);
    ``tile`` = (BLOCK_N, BLOCK_K, STAGES) (default GEMM1_WS_TILE with :func:`gemm1_stages`' depth for this call),
    ``group_m`` as :func:`gemm2_ws`'s; ``lora`` the fused bank's tile-mode or adapter-loop operands (+ s_gate @ B_gate
    and s_up @ B_up before the activation, on its tiles) or None. Padding rows get ``dead_fill``. Check
    :func:`takes_gluon_gemm1` (and :func:`takes_gluon_lora`) first. ``activation`` one of ``ACTIVATIONS`` (gated),
    with ``swiglu_alpha`` (swigluoai: default 1.702) and ``swiglu_limit`` as :func:`moelab.prepare_weights` takes
    them; ``bias`` None or [E_local, 2I] ([gate; up], added before the delta and the activation)."""
    if lora is not None and (bias is not None or (activation, swiglu_limit) != ("silu", None)):
        raise ValueError("lora: the Gluon GEMM1 folds a fused LoRA bank into plain SwiGLU without a bias only; pass "
                         "lora=None or use moe_gemm.gemm1_swiglu")
    if activation == "swigluoai" and swiglu_alpha is None:
        swiglu_alpha = SWIGLUOAI_ALPHA
    E_local, two_i, H = w13.shape
    I = two_i // 2
    reach = segments.row_to_slot.numel()
    if tile is None:
        tile = GEMM1_WS_TILE[:2] + (gemm1_stages(x.shape[0] * top_k / E_local, group_m),)
    block_n, block_k, stages = tile
    w_desc = _descriptor(w13.view(E_local * two_i, H), [block_n, block_k])
    out_desc = _descriptor(act[:reach], [block_m, block_n])
    grid, schedule = _schedule(cdiv(reach, block_m) * cdiv(I, block_n), segments, 1)
    _gemm1_swiglu_ws_kernel[grid](x, x.stride(0), segments.row_to_slot, top_k, w_desc, out_desc,
                                  segments.block_group, segments.block_group.numel(), reach, H, I,
                                  delta if delta is not None else x, two_i,
                                  **_lora_args(lora, 1, x), bias_ptr=bias if bias is not None else x,
                                  **schedule, HAS_DELTA=delta is not None, HAS_BIAS=bias is not None,
                                  ACTIVATION=activation,
                                  SWIGLU_ALPHA=swiglu_alpha, SWIGLU_LIMIT=swiglu_limit,
                                  BLOCK_K=block_k, STAGES=stages, GROUP_M=group_m, DEAD_FILL=dead_fill, num_warps=8)
    return act


def compile_sm90(gemm: str, tile: tuple[int, int, int] | None = None, group_m: int = 1, delta: bool = False,
                 lora: tuple[int, int, int] | None = None, lora_own: bool = False, bias: bool = False,
                 activation: str = "silu", swiglu_limit: float | None = None, dynamic: bool = False):
    """The Gluon kernel of ``gemm`` ("gemm1" or "gemm2") compiled for sm_90 on any machine (no GPU needed), bf16, at
    ``tile`` (default GEMM1_WS_TILE or GEMM2_WS_TILE), GEMM1 with a LoRA ``delta`` or without, with a fused bank's
    tile-mode LoRA of ``lora`` = (L_PAD, R_PAD, max_rank) or without (``lora_own``: the adapter loop's, L_PAD 1),
    with a bf16 ``bias`` or without, GEMM1's ``activation`` (swigluoai: alpha 1.702) and ``swiglu_limit``,
    with the divisibility hints a launch at real shapes gets, with the ``dynamic`` tile schedule or the static one
    (``TILE_SCHEDULE``). Returns Triton's compiled kernel: ``.asm["ptx"]``,
    ``.metadata.shared`` (bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(block):
        return f"tensordesc<bf16[{block[0]}, {block[1]}],{_smem_layout(tuple(block), torch.bfloat16)!r}>"

    block_n, block_k, stages = tile or (GEMM1_WS_TILE if gemm == "gemm1" else GEMM2_WS_TILE)
    l_pad, r_pad, max_rank = lora or (1, 8, 8)
    tiles = dict(block_group_ptr="*i32", num_live_blocks="i32", num_rows="i32", H="i32", I="i32")
    bank = dict(s13_ptr="*bf16", s2_ptr="*bf16", tile_flags_ptr="*i32", up_b_ptr="*bf16", gate_b_ptr="*bf16",
                down_b_ptr="*bf16", num_local_experts="i32", num_loras="i32", row_first_ptr="*i32",
                row_ranks_ptr="*i32", tile_units_ptr="*i32", unit_map_ptr="*i32", units_max="i32", bias_ptr="*bf16",
                tile_counter_ptr="*i32")
    constexprs = dict(GROUP_M=group_m, DEAD_FILL=0.0, LORA=lora is not None, MAX_RANK=max_rank, R_PAD=r_pad,
                      COLUMNS=8 if lora_own else l_pad * r_pad, LORA_OWN=lora_own, STAGES=stages,
                      HAS_BIAS=bias, DYNAMIC=dynamic, num_warps=8)
    hinted = ("block_group_ptr", "s13_ptr", "s2_ptr", "up_b_ptr", "gate_b_ptr", "down_b_ptr", "row_to_slot_ptr",
              "row_first_ptr", "row_ranks_ptr", "tile_units_ptr", "unit_map_ptr", "units_max", "bias_ptr")
    if gemm == "gemm1":
        kernel = _gemm1_swiglu_ws_kernel
        hinted += ("x_ptr", "stride_x", "row_to_slot_ptr", "delta_ptr", "stride_d", "I")
        args = dict(x_ptr="*bf16", stride_x="i32", row_to_slot_ptr="*i32", top_k="i32",
                    w_desc=desc([block_n, block_k]), out_desc=desc([128, block_n]), **tiles, delta_ptr="*bf16",
                    stride_d="i32", **bank)
        constexprs |= dict(HAS_DELTA=delta, BLOCK_K=block_k, ACTIVATION=activation, SWIGLU_LIMIT=swiglu_limit,
                           SWIGLU_ALPHA=SWIGLUOAI_ALPHA if activation == "swigluoai" else None)
    else:
        kernel = _gemm2_ws_kernel
        hinted += ("H",) if bias else ()  # the bias's row offset (a launch with H a multiple of 16 gets the hint)
        args = dict(a_desc=desc([128, block_k]), w_desc=desc([block_n, block_k]), out_desc=desc([128, block_n]),
                    **tiles, **bank, row_to_slot_ptr="*i32")
    signature = {name: args.get(name, "constexpr") for name in kernel.arg_names}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in hinted if name in kernel.arg_names}
    source = GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
