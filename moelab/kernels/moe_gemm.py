"""Grouped GEMMs of the routed MoE over the permuted row space (see ``moelab/permutation.py``).

    gemm1_swiglu:  act[p]   = silu(x[t] @ W_gate[e]^T + d_gate) * (x[t] @ W_up[e]^T + d_up)   [R1, I]
    gemm2:         y[p]     = act[p] @ W2[e]^T                                                   [R2, H]

SwiGLU is the default; GEMM1's epilogue also runs every activation of :func:`moelab.prepare_weights` (a constexpr:
gelu/gelu_tanh gated, GPT-OSS's clamped ``swigluoai``, not gated silu/gelu/gelu_tanh/relu2 on an up-only w13), adds
GEMM1's bias before the delta and the activation, and scales each input row by its slot's routing weight for the
router weight on the input (Llama-4), rounded to the input dtype; GEMM2 adds its bias, unweighted, to live rows.

``p`` is a permuted row, ``t = row_to_slot[p] // K`` its token, ``e = block_group[p // BLOCK_M]`` the local
expert shared by the whole tile of rows, ``d`` the optional ``gemm1_lora_delta`` row of the slot
(FlashInfer's **[up, gate]** order) added to the fp32 accumulators before SwiGLU. The weights stay in HF
order (``w13 [E_local, 2I, H]`` rows [gate; up], ``w2 [E_local, H, I]``), read K-major like vLLM's
``fused_moe_kernel``: by pointer loads, or on Hopper's 128-row tiles through TMA descriptors (``TMA``: GEMM2's
weight and activation tiles on every expert, GEMM1's weight tiles on large experts; GEMM1 gathers its input rows
by pointer either way).
Padding rows (slot -1) and tiles past the live rows are written with ``DEAD_FILL``
(0, or NaN in debug mode); dead tiles touch no weight.

With a fused LoRA bank (``LORA``) the epilogues also expand the bank's rank vectors, which
``moelab/kernels/fused_lora.py`` shrinks and describes; its :class:`~moelab.kernels.fused_lora.TileLoRA` or
:class:`~moelab.kernels.fused_lora.DecodeLoRA` hands the launchers below their LoRA operands.

The launchers :func:`gemm1_swiglu` and :func:`gemm2` size the grids; :func:`choose_config` picks the tiles. On sm_90
they hand the calls on 128-row tiles to the Gluon kernels of ``moelab/kernels/gluon_gemm.py`` (``MOELAB_GLUON=0``:
never): plain SwiGLU with a delta (GEMM1) or a fused bank (the tile mode's or the adapter loop's), or without LoRA
a gated activation of ``gluon_gemm.ACTIVATIONS`` (GPT-OSS's clamped swigluoai) with or without the biases.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from moelab import _runtime
from moelab.contract import SWIGLUOAI_ALPHA
from moelab.kernels import gluon_gemm
from moelab.kernels._common import (
    dot_flags,
    expert_activation,
    jit,
    routing_word_weight,
    tma_ok,
    to_output,
    wait_for_previous_kernel,
)
from moelab.kernels.fused_lora import (
    AdapterLoopLoRA,
    DecodeLoRA,
    TileLoRA,
    caller_weight_ratio,
    expand_other_adapters,
    expand_other_adapters_w13,
    lora_expand,
    own_a_t,
    own_adapter_blocks,
    own_b,
    own_s,
    stacked_a,
    stacked_b,
    stacked_s,
    tile_adapters,
    w2_shrink_share,
)
from moelab.permutation import Segments, cdiv

__all__ = ["GemmConfig", "choose_config", "gemm1_swiglu", "gemm2"]


# ---------------------------------------------------------------------------------------------- configs

@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # = the tile of the permuted space
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    #: row tiles swept together down each column block (Triton's grouped order); 1: each row tile sweeps all
    #: columns before the next starts. For experts whose weights outgrow the L2 (Mixtral: 235 MB of W13 each),
    #: where group_m row tiles share one weight block's HBM read. An optional 6th entry of a config in
    #: moe_gemm_configs.json, which :func:`choose_config` keeps for experts of GROUP_M_MIN_EXPERT_BYTES or more.
    group_m: int = 1


def read_tile_table(path: Path) -> list[tuple[float, GemmConfig]]:
    """The (max rows per expert, config) buckets of a tile table file (the format of ``CONFIG_FILE``: ``buckets``, a
    list of ``{"max_rows_per_expert": limit, "config": [BLOCK_M, BLOCK_N, BLOCK_K, warps, stages(, group_m)]}``
    with ascending limits, the last at least 1e18), checked: a ValueError names the file and the fault."""
    def bad(why):
        return ValueError(f"tile table {path}: {why}; rewrite it with scripts/tune_moe.py (or delete it to use the "
                          "table shipped with moelab)")
    try:
        buckets = json.loads(Path(path).read_text())["buckets"]
        table = [(float(b["max_rows_per_expert"]), GemmConfig(*b["config"])) for b in buckets]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise bad(f"expected JSON with a 'buckets' list of max_rows_per_expert and config entries ({e})") from None
    limits = [limit for limit, _ in table]
    if (not table or limits != sorted(set(limits)) or not limits[-1] >= 1e18
            or not all(0 < limit < math.inf for limit in limits[:-1])):
        raise bad(f"expected positive finite limits ascending, each once, the last at least 1e18 (got {limits})")

    def power_of_two(v, low, high):
        return type(v) is int and low <= v <= high and v & (v - 1) == 0

    for limit, cfg in table:
        fields = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.group_m)
        if not (all(power_of_two(v, 16, 256) for v in fields[:3]) and power_of_two(cfg.num_warps, 1, 16)
                and all(type(v) is int and 1 <= v <= 64 for v in fields[4:])):
            raise bad(f"bucket {limit}: expected BLOCK_M, BLOCK_N and BLOCK_K powers of two in [16, 256], warps a "
                      f"power of two up to 16, stages and group_m integers in [1, 64] (got {list(fields)})")
    return table


CONFIG_FILE = Path(__file__).with_name("moe_gemm_configs.json")
#: (max rows per expert, config) ascending; tuned on a GPU by scripts/tune_moe.py (the file names the GPU).
CONFIG_BUCKETS = read_tile_table(CONFIG_FILE)
#: Tile tables by compute capability, tuned where a GPU of that capability ran scripts/tune_moe.py (the H200, sm_90).
#: A GPU never tuned takes the nearest tuned table below its capability (else the lowest one), fitted to its
#: shared memory by :func:`fit_to_shared_memory`; a GPU model with a table of its own (:func:`own_tile_table`)
#: takes that one.
TUNED_CONFIGS = {(9, 0): CONFIG_BUCKETS}
#: Where a GPU's own tuning run (``scripts/tune_moe.py``) keeps its table, one file a GPU model
#: (:func:`tile_table_path`); None: ``$MOELAB_TILE_TABLES``, else ``$XDG_CACHE_HOME/moelab/tile_tables`` (~/.cache),
#: as the environment says when a path is asked for.
TILE_TABLE_DIR: Path | None = None


def tile_table_path(device_name: str) -> Path:
    """The file of the GPU model ``device_name``'s own tile table (``torch.cuda.get_device_name``), in
    ``TILE_TABLE_DIR``: the name with every run of characters other than letters, digits, '.', '-' and '_' as '_'."""
    folder = TILE_TABLE_DIR
    if folder is None:
        own = os.environ.get("MOELAB_TILE_TABLES")
        cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
        folder = Path(own or Path(cache) / "moelab" / "tile_tables").expanduser()
    return Path(folder) / (re.sub(r"[^A-Za-z0-9._-]+", "_", device_name.strip()) + ".json")


@functools.lru_cache(maxsize=64)
def own_tile_table(device_name: str) -> list[tuple[float, GemmConfig]] | None:
    """The tile table a tuning run wrote for the GPU model ``device_name`` (:func:`tile_table_path`), read once
    per process (``own_tile_table.cache_clear()`` reads it again), or None where there is none."""
    path = tile_table_path(device_name)
    return read_tile_table(path) if device_name and path.is_file() else None


#: The smallest expert (bytes of its w13 and w2) that keeps its bucket's group_m; smaller experts sweep with
#: group_m = 1. H200, 2026-12-02 (BENCHMARKS.md, "One tile table for every shape"): group_m = 8 against 1 timed
#: 0.84-0.91x on Mixtral (352 MB an expert) at T = 1024-16384, 0.97-1.00x at 129-512 rows an expert on four
#: shapes of 9-50 MB experts, and 1.02-1.12x on those shapes above 512 rows (GPT-OSS-20B's 50 MB: 1.12x). The
#: bound sits at the geometric middle of 50 and 352 MB; DeepSeek-V3's 88 MB experts, timed since (T = 16384, 512
#: rows an expert, scripts/tune_moe.py at 755c443), read 0.99x with group_m = 8 (25534 against 25743 µs): within 1 %,
#: so they keep group_m = 1.
GROUP_M_MIN_EXPERT_BYTES = 128 << 20
#: Large experts at 33-64 rows an expert (the table's 64-row bucket) take the table's 128-row tiles instead where the
#: Gluon GEMMs run them (sm_90): one 128-row tile an expert, its weights streamed by the persistent kernels' TMA
#: rings. H100, 2026-12-06, ``scripts/tma_ab.py --modes rule,tiles128`` (a ``routed_moe`` call, graph / eager, the
#: 128-row tiles against the table's 64-row ones): Llama-4-Scout's experts (E16 K1 H5120 I8192, 252 MB an expert)
#: at 64 rows 0.82x (1467 against 1795 µs, where torch ``grouped_mm`` read 1694) and Mixtral (352 MB) at 64 rows
#: 0.76x (1006 against 1315), but E128 K8 H4096 I1536 (38 MB) at 64 rows 1.00-1.01x, Qwen3-30B-A3B (9 MB) at 64
#: rows 1.03x and at 16 rows 1.09x, and Scout at 32 rows 1.04x. The bound sits at the geometric middle of 38 and
#: 252 MB; DeepSeek-V3's 88 MB and GPT-OSS-20B's 50 MB experts, below it, were not measured. Only where the Gluon
#: GEMMs would run both GEMMs (bf16 or fp16, a gated activation of theirs, no router weight on the input, operands
#: of the shapes and strides they take; not with a fused LoRA's columns): the Triton kernels on such tiles were not
#: measured. The outputs were bitwise equal to the 64-row tiles' at every point of that A/B, so a ``LoRAExperts``
#: batch without adapters (the base call, which takes these tiles) keeps the rows its batches with a fused bank
#: (64-row tiles) give tokens without one.
TILE128_MIN_EXPERT_BYTES = 96 << 20
#: The rows an expert from which such experts take the 128-row tiles (above the 32-row point where Scout lost).
TILE128_MIN_ROWS = 32
#: Shared memory kept free of the pipeline's stages for the epilogue, and with the fused LoRA's expand operands
#: beside them (measured on the H200, 227 KB a block: 200 KB of stages ran, and 216 KB with the operands).
_EPILOGUE_RESERVE = 27 * 1024
_EPILOGUE_RESERVE_LORA = 11 * 1024
#: The GEMMs read their weight tiles (and GEMM2 its activation tiles) through Hopper's TMA (tensor descriptors built on
#: the device, ``W_DESC``) on tiles of TMA_MIN_BLOCK_M rows or more, GEMM1 for experts of TMA_MIN_HI = H * I elements or
#: more (GEMM2: TMA_MIN_HI_GEMM2, below), on SM 9.0+ GPUs and in the interpreter. ``MOELAB_TMA=0`` (or this flag) keeps
#: the pointer loads everywhere. H200, 2026-12-02 (scripts/tma_ab.py at 204f0a7, BENCHMARKS.md "TMA loads"; both GEMMs):
#: 0.86x on Mixtral (H * I = 58.7 Mi) at T = 16384 and 0.96x at 4096, 0.95-0.97x on DeepSeek-V3's layer (14 Mi) and
#: 0.94-0.96x on GPT-OSS-20B (7.9 Mi) at T = 4096-16384; 0.98-1.03x on the experts of 1.5-2.8 Mi (Qwen3-30B-A3B, OLMoE,
#: E64 K6), and 1.00-1.03x under graphs at 32-128 rows an expert (64-row tiles) on every shape.
TMA: bool = os.environ.get("MOELAB_TMA", "1") == "1"
TMA_MIN_BLOCK_M = 128
TMA_MIN_HI = 4 << 20
#: GEMM2 reads both operands as whole tiles (the permuted activation rows and w2), so it takes TMA on 128-row tiles
#: of every expert size: on the H200 (scripts/gemm_sweep.py at c738dd8, GEMM2 alone) its TMA loads timed 0.88-0.93x
#: of the pointer loads on the small experts of OLMoE and E64 K6 at T = 4096 (Qwen3-30B-A3B: 1.02x, within that
#: sweep's 4 % noise) and, with GEMM2_MAX_STAGES, 0.86-0.89x at T = 16384; the whole layer 0.945-0.98x at T = 4096
#: and 0.95-0.99x at 16384 (scripts/tma_ab.py --modes rule-a201208,rule at 20855fd). GEMM1 gathers its input rows by
#: pointer and keeps TMA_MIN_HI.
TMA_MIN_HI_GEMM2 = 0
#: GEMM2's pipeline depth on tiles of 128 rows or more. It holds one weight tile a stage (GEMM1 two), so at 3 stages of
#: 128x128x64 bf16 (96 KB) two of its blocks fit an SM's 227 KB of shared memory (occupancy not profiled); the 4 stages
#: (above 512 rows an expert) keep one. H200 (scripts/gemm_sweep.py at c738dd8), T = 16384: 3 stages against 4 timed
#: 0.94-0.97x on Qwen3-30B-A3B, OLMoE, E64 K6 and GPT-OSS-20B with the pointer loads, 0.86-0.94x with TMA. The cap holds
#: on every GPU and with the pointer loads too; only the H200 measured it.
GEMM2_MAX_STAGES = 3
#: Triton's warp specialisation of the K loop (``tl.range(..., warp_specialize=True)``) on the TMA launches of GEMM1
#: and GEMM2. Off. For sm_90 it changes nothing: Triton 3.6 (the H200's) and 3.9 compile both GEMMs' TMA variants to
#: byte-identical PTX with and without it (no warp partitions), so the H200 A/Bs of the flag (scripts/tma_ab.py --ws:
#: -1.1 % to +0.8 %) timed the same kernel twice (BENCHMARKS.md, "Persistent grid, warp specialisation"). It may
#: partition the loop on GPUs where Triton warp-specialises (not measured here). The warp-specialised schedule that
#: sm_90 does get is written by hand in Gluon (``gluon_gemm.py``).
WARP_SPECIALIZE = {"gemm1": False, "gemm2": False}


@dataclass(frozen=True)
class DeviceLimits:
    """What the tile choice needs of a GPU: its compute capability, the shared memory one block may use
    (bytes, opt-in maximum: H100/H200/B200 227 KB, A100 163 KB, L4/RTX 4090/RTX 5090 99 KB) and its model's name
    (``torch.cuda.get_device_name``: the key of a table of its own, :func:`own_tile_table`; "" for none)."""

    capability: tuple[int, int]
    shared_memory: int
    name: str = ""


_limits: dict[int, DeviceLimits] = {}


def device_limits(device: torch.device) -> DeviceLimits:
    """:class:`DeviceLimits` of a CUDA device, from Triton's device properties (read once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _limits:
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        _limits[index] = DeviceLimits(torch.cuda.get_device_capability(index), props["max_shared_mem"],
                                      torch.cuda.get_device_name(index))
    return _limits[index]


def shared_memory_bytes(cfg: GemmConfig, itemsize: int, lora_columns: int = 0, lora_own: bool = False,
                        weight_tiles: int = 2) -> int:
    """Bytes of the pipeline's stages (an x tile and ``weight_tiles`` weight tiles each: GEMM1's gate and up; GEMM2
    has one, which a sweep of GEMM2 alone may pass), plus the fused LoRA's expand operands
    on wgmma tiles (BLOCK_M >= 64: [BLOCK_M, 2*columns] rank vectors and [2*columns, BLOCK_N] B^T). ``lora_own``
    (the adapter loop, ``lora_columns`` = R_PAD) with fp32 operands: two rank-vector tiles, two B^T and A_down^T
    [BLOCK_N, columns], on tiles of any size (on the H200 the fp32 16x128x128 decode tile asked for exactly this,
    245760 B at R_PAD 64 with one stage, where bf16 ones ran as the stacked count says)."""
    per_stage = (cfg.block_m * cfg.block_k + weight_tiles * cfg.block_k * cfg.block_n) * itemsize
    if lora_own and itemsize > 2:
        expand = lora_columns * (2 * cfg.block_m + 3 * cfg.block_n) * itemsize
    else:
        expand = 2 * lora_columns * (cfg.block_m + cfg.block_n) * itemsize if lora_columns and cfg.block_m >= 64 else 0
    return cfg.num_stages * per_stage + expand


def fit_to_shared_memory(cfg: GemmConfig, itemsize: int, lora_columns: int, shared_memory: int,
                         lora_own: bool = False, weight_tiles: int = 2) -> GemmConfig:
    """``cfg`` with as many of its pipeline stages as fit the device's shared memory less the epilogue's reserve
    (at least one stage, if that fits the device at all); where not even one stage fits, BLOCK_K, then BLOCK_N
    (down to 32), then BLOCK_M (down to 16) halve until it does. ``weight_tiles``: as :func:`shared_memory_bytes`."""
    budget = shared_memory - (_EPILOGUE_RESERVE_LORA if lora_columns and cfg.block_m >= 64 else _EPILOGUE_RESERVE)
    while True:
        for stages in range(cfg.num_stages, 0, -1):
            fitted = replace(cfg, num_stages=stages)
            need = shared_memory_bytes(fitted, itemsize, lora_columns, lora_own, weight_tiles)
            if need <= (budget if stages > 1 else shared_memory):
                return fitted
        if cfg.block_k > 32:
            cfg = replace(cfg, block_k=cfg.block_k // 2)
        elif cfg.block_n > 32:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        elif cfg.block_m > 16:
            cfg = replace(cfg, block_m=cfg.block_m // 2)
        else:
            return replace(cfg, num_stages=1)


def own_tile_table_file(device: DeviceLimits) -> Path | None:
    """The file of ``device``'s own tile table where it has one (:func:`tile_table` then reads it), else None."""
    return tile_table_path(device.name) if own_tile_table(device.name) is not None else None


def tile_table(device: DeviceLimits) -> list[tuple[float, GemmConfig]]:
    """The tile table ``device`` takes: its model's own (:func:`own_tile_table`), else the one tuned for the nearest
    compute capability at or below its own (else the lowest) of ``TUNED_CONFIGS``."""
    own = own_tile_table(device.name)
    if own is not None:
        return own
    below = [cc for cc in TUNED_CONFIGS if cc <= device.capability]
    return TUNED_CONFIGS[max(below) if below else min(TUNED_CONFIGS)]


def choose_config(num_tokens: int, top_k: int, num_local_experts: int,
                  dtype: torch.dtype = torch.bfloat16, lora_columns: int = 0,
                  device: torch.device | DeviceLimits | None = None, lora_own: bool = False,
                  expert_bytes: int = 0, gluon_call: bool = False) -> GemmConfig:
    """Tile sizes by rows per local expert, from the device's tile table (:func:`tile_table`). Decode is
    weight-bandwidth bound (small BLOCK_M, many programs streaming weights); prefill is compute bound (big tiles for
    tensor-core reuse). The pipeline's depth then shrinks to the device's shared memory (fp32 operands take twice
    the bytes a stage).

    ``lora_columns``: the fused LoRA's stacked width. On Hopper, tiles of BLOCK_M >= 64 (wgmma) keep GEMM1's
    expand operands beside the pipeline's stages in shared memory (measured: 196608 B + 16384 B for 16 columns at
    128x128x64, 4 stages), so the pipeline gives up stages for them; the BLOCK_M = 16 decode tiles showed no such
    growth. ``lora_own``: ``lora_columns`` is the adapter loop's R_PAD (see :func:`shared_memory_bytes`).
    ``device``: a CUDA device (default: the current one) or its :class:`DeviceLimits`. ``expert_bytes``: one local
    expert's w13 and w2 bytes; the bucket's ``group_m`` holds only from GROUP_M_MIN_EXPERT_BYTES on.
    ``gluon_call``: the call's experts and operands are ones the Gluon GEMMs take on 128-row tiles (the pipeline's
    ``_gluon_call``); with a 2-byte ``dtype`` and ``expert_bytes`` of TILE128_MIN_EXPERT_BYTES or more such calls
    take 128-row tiles above TILE128_MIN_ROWS rows an expert."""
    if not isinstance(device, DeviceLimits):
        if _runtime.INTERPRET:  # numpy executes each program: few, modest tiles keep CPU tests quick
            return GemmConfig(16, 32, 32, 4, 1)
        device = device_limits(torch.device("cuda") if device is None else torch.device(device))
    buckets = tile_table(device)
    rows_per_expert = num_tokens * top_k / max(num_local_experts, 1)
    cfg = next(c for limit, c in buckets if rows_per_expert <= limit)
    if (cfg.block_m < 128 and rows_per_expert > TILE128_MIN_ROWS and expert_bytes >= TILE128_MIN_EXPERT_BYTES
            and not lora_columns and gluon_call and dtype in (torch.bfloat16, torch.float16)
            and gluon_gemm.GLUON and device.capability == (9, 0)):
        # the Gluon GEMMs' tiles (TILE128_MIN_EXPERT_BYTES), where the table has 128-row tiles
        cfg = next((c for _, c in buckets if c.block_m >= 128), cfg)
    return as_launched(cfg, torch.finfo(dtype).bits // 8, device.shared_memory, lora_columns, lora_own, expert_bytes)


def as_launched(cfg: GemmConfig, itemsize: int, shared_memory: int, lora_columns: int = 0, lora_own: bool = False,
                expert_bytes: int = 0) -> GemmConfig:
    """A table entry ``cfg`` as the GEMMs launch it: group_m 1 for experts below GROUP_M_MIN_EXPERT_BYTES, and the
    stages fitted to ``shared_memory`` (:func:`fit_to_shared_memory`; the other arguments as there)."""
    if expert_bytes < GROUP_M_MIN_EXPERT_BYTES:
        cfg = replace(cfg, group_m=1)
    return fit_to_shared_memory(cfg, itemsize, lora_columns, shared_memory, lora_own)


# ---------------------------------------------------------------------------------------------- kernels

@jit
def _tile_of(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program ``pid`` over num_m x num_n tiles: with GROUP_M = 1 consecutive programs share a
    row tile and sweep its columns; else GROUP_M row tiles go down each column block together (Triton's grouped
    ordering), so one block of the expert's weights serves GROUP_M row tiles from the L2."""
    if GROUP_M == 1:
        pid_m = pid // num_n
        pid_n = pid % num_n
    else:
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        size = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size
        pid_n = (pid % per_group) // size
    return pid_m, pid_n


@jit
def _tile_prologue(out_ptr, stride_out_r, block_group_ptr, num_live_blocks, num_rows, N, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, USE_GDC: tl.constexpr):
    """The start both GEMM kernels share: wait for the previous kernel (PDL), find this program's tile of the
    [num_rows, N] output and its local expert; a tile past the live rows (expert -1) is filled with ``DEAD_FILL``
    by the caller, which returns without reading a weight. Returns (pid_m, rows, cols, col_ok, out_ptrs, out_mask,
    expert, n0), n0 the tile's first column."""
    wait_for_previous_kernel(USE_GDC)
    pid_m, pid_n = _tile_of(tl.program_id(0), tl.cdiv(num_rows, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out_r + cols[None, :]
    out_mask = (rows < num_rows)[:, None] & col_ok[None, :]
    expert = -1
    if pid_m < num_live_blocks:
        expert = tl.load(block_group_ptr + pid_m)
    return pid_m, rows, cols, col_ok, out_ptrs, out_mask, expert, n0


@jit
def _gemm1_swiglu_kernel(
    x_ptr, w13_ptr, delta_ptr, act_ptr, row_to_slot_ptr, block_group_ptr,
    num_live_blocks, num_rows, H, I, top_k,
    stride_x_t, stride_w_e, stride_w_n, stride_d_slot, stride_act_r,
    # fused LoRA (LORA): stacked W13 rank vectors [R, 2, L_PAD*R_PAD], tile flags, the bank's B_up and B_gate;
    # LORA_DECODE: s13 by slot, the adapter ids, the bank's A_down and s2 by slot [T*K, L_PAD*R_PAD] (fp32, added to)
    s13_ptr, tile_flags_ptr, up_b_ptr, gate_b_ptr, num_local_experts, num_loras, max_rank,
    lora_ids_ptr, down_a_ptr, s2_ptr,
    HAS_DELTA: tl.constexpr, DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, DEAD_FILL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    LORA: tl.constexpr = False, L_PAD: tl.constexpr = 1, R_PAD: tl.constexpr = 16, LORA_DECODE: tl.constexpr = False,
    USE_GDC: tl.constexpr = False, GROUP_M: tl.constexpr = 1,
    # the expert activation (_common.expert_activation); not GATED: w13 is [E_local, I, H] (up only), delta [T*K, I];
    # bias_ptr: GEMM1's bias [E_local, 2I] ([gate; up]) or [E_local, I], None: none; in_weight_ptr: each slot's
    # routing weight, to scale its input row (the router weight on the input): float [T*K], or the packed routing
    # words (IN_WEIGHT_PACKED), None: inputs as they are
    bias_ptr=None, in_weight_ptr=None, ACTIVATION: tl.constexpr = "silu", GATED: tl.constexpr = True,
    SWIGLU_ALPHA: tl.constexpr = None, SWIGLU_LIMIT: tl.constexpr = None, IN_WEIGHT_PACKED: tl.constexpr = False,
    # LORA_OWN (the adapter loop, fused_lora.py): s13 [T*K or R, 2, R_PAD] of each row's own adapter, the bank's rank
    # table ranks_ptr int32 [L]; the tile's lowest adapter expanded from operands read before the K loop, the others
    # after it, RANK_CHUNK ranks a step
    ranks_ptr=None, LORA_OWN: tl.constexpr = False, RANK_CHUNK: tl.constexpr = 16,
    # W_DESC: the weight tiles come through a Hopper TMA descriptor over w13 as [w_rows, H] (w_rows = E_local * 2I, or
    # E_local * I not gated; H * itemsize a multiple of 16 B), zero-filled past H; columns a tile reads past I (the
    # up rows, or the next expert's) are never stored
    w_rows=0, W_DESC: tl.constexpr = False, WARP_SPECIALIZE: tl.constexpr = False,
):
    pid_m, rows, cols, col_ok, out_ptrs, out_mask, expert, n0 = _tile_prologue(
        act_ptr, stride_act_r, block_group_ptr, num_live_blocks, num_rows, I, BLOCK_M, BLOCK_N, GROUP_M, USE_GDC)
    if expert < 0:  # past the live rows: no weights to read
        tl.store(out_ptrs, tl.full((BLOCK_M, BLOCK_N), DEAD_FILL, act_ptr.dtype.element_ty), mask=out_mask)
        return
    slots = tl.load(row_to_slot_ptr + rows)
    row_ok = slots >= 0
    tokens = tl.where(row_ok, slots // top_k, 0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_x_t + ks[None, :]
    w_base = w13_ptr + expert.to(tl.int64) * stride_w_e
    gate_ptrs = w_base + cols[None, :].to(tl.int64) * stride_w_n + ks[:, None]  # [BLOCK_K, BLOCK_N]
    if GATED:
        up_ptrs = gate_ptrs + I * stride_w_n
    else:  # the up rows are all of w13
        up_ptrs = gate_ptrs
    if in_weight_ptr is not None:  # the routing weight of each row's slot, widened exactly to fp32
        if IN_WEIGHT_PACKED:  # the low half of the routing word is the bf16 weight
            word = tl.load(in_weight_ptr + tl.where(row_ok, slots, 0), mask=row_ok, other=0)
            in_weight = routing_word_weight(word)
        else:
            in_weight = tl.load(in_weight_ptr + tl.where(row_ok, slots, 0), mask=row_ok, other=0.0).to(tl.float32)
    if LORA:  # read the LoRA operands now: the K loop hides their latency (an epilogue load would not be hidden)
        if LORA_OWN:  # by slot at decode, by row in tiles; the lowest adapter's rows, its B (and A_down at decode)
            if LORA_DECODE:
                s_rows = tl.where(row_ok, slots, 0).to(tl.int64)
            else:
                s_rows = rows.to(tl.int64)
            adapters, row_ranks, lo, hi, rank_lo = tile_adapters(lora_ids_ptr, tokens, row_ok, num_loras, ranks_ptr,
                                                                 max_rank)
            has_lora = hi >= 0
            s_up = own_s(s13_ptr, s_rows, 2 * R_PAD, adapters == lo, rank_lo, R_PAD)
            s_gate = own_s(s13_ptr + R_PAD, s_rows, 2 * R_PAD, adapters == lo, rank_lo, R_PAD)
            b_up = own_b(up_b_ptr, lo, rank_lo, expert, cols, col_ok, I, num_local_experts, max_rank, R_PAD)
            b_gate = own_b(gate_b_ptr, lo, rank_lo, expert, cols, col_ok, I, num_local_experts, max_rank, R_PAD)
            if LORA_DECODE:
                a2 = own_a_t(down_a_ptr, lo, rank_lo, expert, cols, col_ok, I, num_local_experts, max_rank, R_PAD)
        else:  # stacked columns
            if LORA_DECODE:  # rank vectors by slot, in the block of each row's own adapter
                _, has_lora, own = own_adapter_blocks(lora_ids_ptr, tokens, row_ok, num_loras, L_PAD, R_PAD)
                j = tl.arange(0, L_PAD * R_PAD)
                s_ptrs = s13_ptr + tl.where(row_ok, slots, 0).to(tl.int64)[:, None] * (2 * L_PAD * R_PAD) + j[None, :]
                s_up = tl.load(s_ptrs, mask=own, other=0.0)
                s_gate = tl.load(s_ptrs + L_PAD * R_PAD, mask=own, other=0.0)
                a_cols, a_ok, _ = stacked_a(expert, num_local_experts, num_loras, max_rank, I, L_PAD, R_PAD)
                a2_mask = tl.where(has_lora, col_ok[:, None] & a_ok[None, :], False)
                a2 = tl.load(down_a_ptr + a_cols[None, :] + cols[:, None], mask=a2_mask, other=0.0)  # [BLOCK_N, cols]
            else:
                has_lora = tl.load(tile_flags_ptr + pid_m) != 0
                s_up = stacked_s(s13_ptr, rows, 2 * L_PAD * R_PAD, has_lora, L_PAD, R_PAD)
                s_gate = stacked_s(s13_ptr + L_PAD * R_PAD, rows, 2 * L_PAD * R_PAD, has_lora, L_PAD, R_PAD)
            bank = (expert, cols, col_ok, I, num_local_experts, num_loras, max_rank, has_lora)
            b_up = stacked_b(up_b_ptr, *bank, L_PAD, R_PAD)
            b_gate = stacked_b(gate_b_ptr, *bank, L_PAD, R_PAD)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if W_DESC:
        w_desc = tl.make_tensor_descriptor(w13_ptr, shape=[w_rows, H], strides=[H, 1], block_shape=[BLOCK_N, BLOCK_K])
        gate_row = expert * (2 * I if GATED else I) + n0
    for k0 in tl.range(0, tl.cdiv(H, BLOCK_K), warp_specialize=WARP_SPECIALIZE):
        if EVEN_K:  # the input rows, gathered by pointer on either path
            a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            k_ok = ks + k0 * BLOCK_K < H
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:
            if GATED:
                wg = w_desc.load([gate_row, k0 * BLOCK_K]).T
                wu = w_desc.load([gate_row + I, k0 * BLOCK_K]).T
            else:
                wu = w_desc.load([gate_row, k0 * BLOCK_K]).T
        elif EVEN_K:
            if GATED:
                wg = tl.load(gate_ptrs, mask=col_ok[None, :], other=0.0)
            wu = tl.load(up_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            if GATED:
                wg = tl.load(gate_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            wu = tl.load(up_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if in_weight_ptr is not None:  # the expert sees w * x, rounded to the input dtype (as the model rounds it)
            a = to_output(a.to(tl.float32) * in_weight[:, None], x_ptr.dtype.element_ty)
        if DOT_F32:  # the interpreter mis-multiplies bf16 in tl.dot (triton #11584); fp32 inputs need ieee
            if GATED:
                a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
            else:
                a, wu = a.to(tl.float32), wu.to(tl.float32)
        if GATED:
            acc_gate = tl.dot(a, wg, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, wu, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if bias_ptr is not None:  # GEMM1's bias, in w13's row order [gate; up], before the delta and the activation
        if GATED:
            b_ptrs = bias_ptr + expert.to(tl.int64) * (2 * I) + cols
            acc_gate += tl.load(b_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_up += tl.load(b_ptrs + I, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        else:
            acc_up += tl.load(bias_ptr + expert.to(tl.int64) * I + cols, mask=col_ok, other=0.0).to(tl.float32)[
                None, :]
    if HAS_DELTA:  # LoRA delta of the slot, [up | gate], added before the activation, unweighted
        d_ptrs = delta_ptr + tl.where(row_ok, slots, 0).to(tl.int64)[:, None] * stride_d_slot + cols[None, :]
        d_mask = row_ok[:, None] & col_ok[None, :]
        acc_up += tl.load(d_ptrs, mask=d_mask, other=0.0).to(tl.float32)
        if GATED:  # not gated: the delta is up only
            acc_gate += tl.load(d_ptrs + I, mask=d_mask, other=0.0).to(tl.float32)
    if LORA:
        if has_lora:  # W13 LoRA, [up | gate] rank vectors, expanded before the activation
            acc_up = lora_expand(s_up, b_up, acc_up, DOT_F32, DOT_PRECISION)
            acc_gate = lora_expand(s_gate, b_gate, acc_gate, DOT_F32, DOT_PRECISION)
            if LORA_OWN:  # the tile's other adapters
                acc_up, acc_gate = expand_other_adapters_w13(
                    acc_up, acc_gate, adapters, row_ranks, lo, hi, s13_ptr, s_rows, up_b_ptr, gate_b_ptr, expert,
                    cols, col_ok, I, num_local_experts, max_rank, R_PAD, RANK_CHUNK, DOT_F32, DOT_PRECISION)
    act = expert_activation(acc_gate, acc_up, ACTIVATION, GATED, SWIGLU_ALPHA, SWIGLU_LIMIT)
    act = to_output(tl.where(row_ok[:, None], act, DEAD_FILL), act_ptr.dtype.element_ty)
    tl.store(out_ptrs, act, mask=out_mask)
    if LORA_DECODE:
        if has_lora:  # this column block's share of the W2 shrink, from the stored (rounded) activation
            if W_DESC:  # columns past I came from other weight rows: finite, but no term of the shrink
                act = tl.where(col_ok[None, :], act, 0.0)
            if LORA_OWN:
                w2_shrink_share(act, a2, adapters, row_ranks, lo, hi, rank_lo, down_a_ptr, s2_ptr, s_rows, expert,
                                cols, col_ok, I, num_local_experts, max_rank, R_PAD, RANK_CHUNK, DOT_F32, DOT_PRECISION)
            else:
                part = lora_expand(act, a2, tl.zeros((BLOCK_M, L_PAD * R_PAD), dtype=tl.float32), DOT_F32,
                                   DOT_PRECISION)
                s2_ptrs = s2_ptr + tl.where(row_ok, slots, 0).to(tl.int64)[:, None] * (L_PAD * R_PAD) + j[None, :]
                tl.atomic_add(s2_ptrs, part, mask=own, sem="relaxed")


@jit
def _gemm2_kernel(
    act_ptr, w2_ptr, out_ptr, block_group_ptr,
    num_live_blocks, num_rows, H, I,
    stride_act_r, stride_w_e, stride_w_n, stride_out_r,
    # fused LoRA (LORA): stacked W2 rank vectors [R, L_PAD*R_PAD] (weighted), tile flags, the bank's B_down;
    # LORA_DECODE: s2 by slot [T*K, L_PAD*R_PAD] (fp32, unweighted; GEMM1's sums), the slots, adapter ids, weights
    s2_ptr, tile_flags_ptr, down_b_ptr, num_local_experts, num_loras, max_rank,
    row_to_slot_ptr, lora_ids_ptr, weights_ptr, top_k,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr, DEAD_FILL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    LORA: tl.constexpr = False, L_PAD: tl.constexpr = 1, R_PAD: tl.constexpr = 16, LORA_DECODE: tl.constexpr = False,
    USE_GDC: tl.constexpr = False, GROUP_M: tl.constexpr = 1,
    bias_ptr=None,  # GEMM2's bias [E_local, H] (None: none), added to live rows (row_to_slot_ptr: the real slots)
    # LORA_OWN (the adapter loop): s2 of each row's own adapter, [T*K, R_PAD] fp32 unweighted (decode) or [R, R_PAD]
    # weighted (tiles); the rank table; the lowest adapter's operands read now, the others after the K loop
    ranks_ptr=None, LORA_OWN: tl.constexpr = False, RANK_CHUNK: tl.constexpr = 16,
    # W_DESC: act [num_rows, I] and w2 as [w_rows = E_local * H, I] through Hopper TMA descriptors (I * itemsize and
    # stride_act_r * itemsize multiples of 16 B), zero-filled past I; columns read past H are never stored
    w_rows=0, W_DESC: tl.constexpr = False, WARP_SPECIALIZE: tl.constexpr = False,
):
    pid_m, rows, cols, col_ok, out_ptrs, out_mask, expert, n0 = _tile_prologue(
        out_ptr, stride_out_r, block_group_ptr, num_live_blocks, num_rows, H, BLOCK_M, BLOCK_N, GROUP_M, USE_GDC)
    if expert < 0:
        tl.store(out_ptrs, tl.full((BLOCK_M, BLOCK_N), DEAD_FILL, out_ptr.dtype.element_ty), mask=out_mask)
        return
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_act_r + ks[None, :]  # live rows: contiguous
    w_ptrs = w2_ptr + expert.to(tl.int64) * stride_w_e + cols[None, :].to(tl.int64) * stride_w_n + ks[:, None]
    if LORA:  # read the LoRA operands now, as GEMM1 does
        if LORA_OWN:
            slots = tl.load(row_to_slot_ptr + rows)
            row_ok = slots >= 0
            slots = tl.where(row_ok, slots, 0).to(tl.int64)
            adapters, row_ranks, lo, hi, rank_lo = tile_adapters(lora_ids_ptr, slots // top_k, row_ok, num_loras,
                                                                 ranks_ptr, max_rank)
            has_lora = hi >= 0
            if LORA_DECODE:  # GEMM1's sums by slot, weighted and rounded after the K loop
                s_rows = slots
                ratio = caller_weight_ratio(weights_ptr, slots, adapters >= 0)
                s2_sum = own_s(s2_ptr, s_rows, R_PAD, adapters == lo, rank_lo, R_PAD)
            else:
                s_rows = rows.to(tl.int64)
                ratio = None
                s_down = own_s(s2_ptr, s_rows, R_PAD, adapters == lo, rank_lo, R_PAD)
            b_down = own_b(down_b_ptr, lo, rank_lo, expert, cols, col_ok, H, num_local_experts, max_rank, R_PAD)
        else:  # stacked columns
            if LORA_DECODE:  # GEMM1's W2 shrink of each row's own adapter block, by slot, weighted after the K loop
                slots = tl.load(row_to_slot_ptr + rows)
                row_ok = slots >= 0
                slots = tl.where(row_ok, slots, 0).to(tl.int64)
                adapters, has_lora, own = own_adapter_blocks(lora_ids_ptr, slots // top_k, row_ok, num_loras, L_PAD,
                                                              R_PAD)
                j = tl.arange(0, L_PAD * R_PAD)
                s2_sum = tl.load(s2_ptr + slots[:, None] * (L_PAD * R_PAD) + j[None, :], mask=own, other=0.0)
                ratio = caller_weight_ratio(weights_ptr, slots, adapters >= 0)
            else:
                has_lora = tl.load(tile_flags_ptr + pid_m) != 0
                s_down = stacked_s(s2_ptr, rows, L_PAD * R_PAD, has_lora, L_PAD, R_PAD)
            b_down = stacked_b(down_b_ptr, expert, cols, col_ok, H, num_local_experts, num_loras, max_rank, has_lora,
                                L_PAD, R_PAD)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if W_DESC:
        a_desc = tl.make_tensor_descriptor(act_ptr, shape=[num_rows, I], strides=[stride_act_r, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w2_ptr, shape=[w_rows, I], strides=[I, 1], block_shape=[BLOCK_N, BLOCK_K])
        w_row = expert * H + n0
    for k0 in tl.range(0, tl.cdiv(I, BLOCK_K), warp_specialize=WARP_SPECIALIZE):
        if W_DESC:
            a = a_desc.load([pid_m * BLOCK_M, k0 * BLOCK_K])
            w = w_desc.load([w_row, k0 * BLOCK_K]).T
        elif EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks + k0 * BLOCK_K < I
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if bias_ptr is not None:  # unweighted, before the LoRA term (base rows stay the base path's bit for bit)
        live = tl.load(row_to_slot_ptr + rows) >= 0  # padding rows keep DEAD_FILL's product
        bias = tl.load(bias_ptr + expert.to(tl.int64) * H + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = tl.where(live[:, None], acc + bias[None, :], acc)
    if LORA:
        if LORA_DECODE:  # the W2 rank vectors: weighted, rounded to the input dtype
            s_down = to_output(s2_sum * ratio[:, None], act_ptr.dtype.element_ty)
        if has_lora:  # W2 LoRA: expand the (weighted) rank vectors
            acc = lora_expand(s_down, b_down, acc, DOT_F32, DOT_PRECISION)
            if LORA_OWN:  # the tile's other adapters
                acc = expand_other_adapters(acc, adapters, row_ranks, lo, hi, s2_ptr, s_rows, R_PAD, down_b_ptr, expert,
                                            cols, col_ok, H, num_local_experts, max_rank, ratio,
                                            act_ptr.dtype.element_ty, LORA_DECODE, RANK_CHUNK, DOT_F32, DOT_PRECISION)
    tl.store(out_ptrs, to_output(acc, out_ptr.dtype.element_ty), mask=out_mask)


# ---------------------------------------------------------------------------------------------- launchers

#: GEMM1's LoRA operands when no bank is fused (never read: ``LORA`` is False).
_GEMM1_NO_LORA = ("s13_ptr", "tile_flags_ptr", "up_b_ptr", "gate_b_ptr", "lora_ids_ptr", "down_a_ptr", "s2_ptr")
_GEMM2_NO_LORA = ("s2_ptr", "tile_flags_ptr", "down_b_ptr", "row_to_slot_ptr", "lora_ids_ptr", "weights_ptr")
_NO_BANK = dict(num_local_experts=0, num_loras=0, max_rank=0)


def takes_tma(config: GemmConfig, hidden_x_inter: int, weight: torch.Tensor, *operands: torch.Tensor,
              min_hi: int | None = None) -> bool:
    """Whether a GEMM of ``config`` over experts of ``hidden_x_inter`` = H * I reads ``weight`` [E_local, N, K]
    (contiguous; GEMM1's w13 or GEMM2's w2) and ``operands`` through TMA descriptors (see ``TMA``). ``min_hi``: the
    smallest H * I that takes them (default ``TMA_MIN_HI``, GEMM1's; GEMM2 passes ``TMA_MIN_HI_GEMM2``)."""
    if (not TMA or config.block_m < TMA_MIN_BLOCK_M or hidden_x_inter < (TMA_MIN_HI if min_hi is None else min_hi)
            or not weight.is_contiguous()):
        return False
    if not all(map(tma_ok, (weight, *operands))):
        return False
    if weight.device.type != "cuda":
        return _runtime.INTERPRET
    if not _runtime.is_hopper_or_newer(weight.device):
        return False
    _runtime.ensure_triton_allocator()
    return True


def gemm1_swiglu(x: torch.Tensor, w13: torch.Tensor, act: torch.Tensor, segments: Segments, *, top_k: int,
                 config: GemmConfig, delta: torch.Tensor | None = None,
                 lora: TileLoRA | DecodeLoRA | AdapterLoopLoRA | None = None,
                 dead_fill: float = 0.0, pdl: dict | None = None, activation: str = "silu", gated: bool = True,
                 swiglu_alpha: float | None = None, swiglu_limit: float | None = None,
                 bias: torch.Tensor | None = None, input_weights: torch.Tensor | None = None) -> torch.Tensor:
    """``act`` [R1, I] = the activation (default SwiGLU) of GEMM1 over the rows ``segments`` reaches (tile
    ``config.block_m``); rows past them are left as they are. ``x`` [T, H] (unit column stride), ``w13``
    [E_local, 2I, H] HF order, ``delta`` contiguous [T*K, 2I] [up | gate] or None, ``lora`` the fused bank's
    operands or None; ``pdl``: the launch options of :func:`moelab._runtime.pdl_launch`.

    ``activation``, ``gated``, ``swiglu_alpha``, ``swiglu_limit``: as :func:`moelab.prepare_weights` takes them (not
    ``gated``: ``w13`` [E_local, I, H], ``delta`` [T*K, I]); ``bias`` contiguous [E_local, 2I] ([gate; up]) or
    [E_local, I]; ``input_weights``: each slot's routing weight to scale its input row by (the router weight on
    the input), contiguous [T, K] float, or the int32 packed routing words."""
    if lora is not None and not gated:
        raise ValueError("lora: the fused LoRA bank runs gated activations only (it expands gate and up)")
    I, H = w13.shape[1] // (2 if gated else 1), w13.shape[2]
    reach = segments.row_to_slot.numel()
    lora_args = lora.gemm1_args(x) if lora is not None else dict.fromkeys(_GEMM1_NO_LORA, x) | _NO_BANK
    options = {}  # plain SwiGLU: the kernel's defaults (fewer arguments for the launcher to bind at decode)
    if (activation, gated, swiglu_limit, bias, input_weights) != ("silu", True, None, None, None):
        if activation == "swigluoai" and swiglu_alpha is None:
            swiglu_alpha = SWIGLUOAI_ALPHA
        options = dict(bias_ptr=bias, in_weight_ptr=input_weights, ACTIVATION=activation, GATED=gated,
                       SWIGLU_ALPHA=swiglu_alpha, SWIGLU_LIMIT=swiglu_limit,
                       IN_WEIGHT_PACKED=input_weights is not None and input_weights.dtype == torch.int32)
    # on 128-row tiles of an sm_90 GPU: a fused bank with plain SwiGLU, or a gated activation of the Gluon epilogue
    lora_ok = lora is None or (delta is None and not options and gluon_gemm.takes_gluon_lora(lora))
    if lora_ok and gluon_gemm.takes_gluon_gemm1(segments, config.block_m, x, w13, act, delta, activation=activation,
                                                gated=gated, bias=bias, input_weights=input_weights):
        return gluon_gemm.gemm1_swiglu_ws(x, w13, act, segments, top_k=top_k, block_m=config.block_m,
                                          group_m=config.group_m, delta=delta, dead_fill=dead_fill, lora=lora,
                                          activation=activation, swiglu_alpha=swiglu_alpha,
                                          swiglu_limit=swiglu_limit, bias=bias)
    if takes_tma(config, H * I, w13):
        options |= dict(w_rows=w13.shape[0] * w13.shape[1], W_DESC=True, WARP_SPECIALIZE=WARP_SPECIALIZE["gemm1"])
    _gemm1_swiglu_kernel[(cdiv(reach, config.block_m) * cdiv(I, config.block_n),)](
        x_ptr=x, w13_ptr=w13, delta_ptr=delta if delta is not None else x, act_ptr=act,
        row_to_slot_ptr=segments.row_to_slot, block_group_ptr=segments.block_group,
        num_live_blocks=segments.block_group.numel(), num_rows=reach, H=H, I=I, top_k=top_k,
        stride_x_t=x.stride(0), stride_w_e=w13.stride(0), stride_w_n=w13.stride(1),
        stride_d_slot=delta.shape[-1] if delta is not None else 0, stride_act_r=act.stride(0), **lora_args,
        **options,
        HAS_DELTA=delta is not None, **dot_flags(x.dtype), DEAD_FILL=dead_fill,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=H % config.block_k == 0,
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages, **(pdl or {}))
    return act


def gemm2(act: torch.Tensor, w2: torch.Tensor, out: torch.Tensor, segments: Segments, *, config: GemmConfig,
          lora: TileLoRA | DecodeLoRA | AdapterLoopLoRA | None = None, dead_fill: float = 0.0, pdl: dict | None = None,
          bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` [R2, H] = GEMM2 of ``act`` [R1, I] (GEMM1's output, same rows) with ``w2`` [E_local, H, I], over the
    rows ``segments`` reaches (unweighted; plus ``bias`` contiguous [E_local, H] on live rows, and the fused bank's
    W2 term with ``lora``)."""
    if ((lora is None or (bias is None and gluon_gemm.takes_gluon_lora(lora)))
            and gluon_gemm.takes_gluon_gemm2(segments, config.block_m, act, w2, out, bias)):
        return gluon_gemm.gemm2_ws(act, w2, out, segments, block_m=config.block_m, group_m=config.group_m,
                                   dead_fill=dead_fill, lora=lora, bias=bias)
    H, I = w2.shape[1], w2.shape[2]
    reach = segments.row_to_slot.numel()
    lora_args = lora.gemm2_args(act) if lora is not None else dict.fromkeys(_GEMM2_NO_LORA, act) | _NO_BANK | {
        "top_k": 0}
    if bias is not None:  # the bias goes to live rows only: the kernel reads the slots
        lora_args |= dict(row_to_slot_ptr=segments.row_to_slot, bias_ptr=bias)
    if takes_tma(config, H * I, w2, act, min_hi=TMA_MIN_HI_GEMM2):
        lora_args |= dict(w_rows=w2.shape[0] * w2.shape[1], W_DESC=True, WARP_SPECIALIZE=WARP_SPECIALIZE["gemm2"])
    stages = min(config.num_stages, GEMM2_MAX_STAGES) if config.block_m >= 128 else config.num_stages
    _gemm2_kernel[(cdiv(reach, config.block_m) * cdiv(H, config.block_n),)](
        act_ptr=act, w2_ptr=w2, out_ptr=out, block_group_ptr=segments.block_group,
        num_live_blocks=segments.block_group.numel(), num_rows=reach, H=H, I=I,
        stride_act_r=act.stride(0), stride_w_e=w2.stride(0), stride_w_n=w2.stride(1), stride_out_r=out.stride(0),
        **lora_args, **dot_flags(act.dtype), DEAD_FILL=dead_fill,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=I % config.block_k == 0,
        GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=stages, **(pdl or {}))
    return out
