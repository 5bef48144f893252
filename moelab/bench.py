"""One MoE layer forward, bf16: moelab beside its peers and the roofline, all measured in one run (BENCH.md).

Command line (``python -m moelab.bench --help``)::

    python -m moelab.bench                                  # Qwen3-30B-A3B, T = 1,32,128,1024,4096,16384, uniform
    python -m moelab.bench --routing uniform,zipf --shape qwen3-30b-a3b,olmoe
    python -m moelab.bench --lora --ops                     # LoRA rows (r16, 1 and 4 adapters) + the two ops
    python -m moelab.bench --quick                          # fewer T, fewer repetitions
    python -m moelab.bench --tiny                           # E=8 K=2 H=64 I=32, T=1,8: runs on a CPU (CI)

What one run does, on a CUDA GPU:

1. Ceilings (:func:`measure_ceilings`): a 2 GiB device-to-device copy (bytes read + written) and an 8192^3 bf16
   matmul, on fresh random data, ``triton.testing.do_bench(..., return_mode="median")``.
2. For each shape, routing and T: ``--sets`` input sets (x, routing, adapter ids) drawn at random (never zeros),
   a float32 reference through moelab's ``"torch"`` backend (LoRA: on merged weights ``W + B @ A`` per adapter),
   then for every implementation: one call on set 0 checked against the reference (``||out - ref|| / ||ref||``),
   then the median time over calls that rotate through the sets. Each (T, implementation) is wrapped in
   try/except: a broken peer prints its error and the run goes on.
3. Each row is printed as it is measured, beside :func:`roofline` (touched experts' weight bytes + activations
   over the measured copy bandwidth, ``6*T*K*H*I`` FLOPs over the measured matmul rate, the larger wins), and
   written to ``--out`` (JSON, rewritten after every row) with a markdown table beside it (``.md``).

Implementations (base mode; ``--impls`` keeps those whose name contains one of its comma-separated words):

    moelab triton           routed_moe, packed routing, validate=False, do_finalize=True
    moelab triton [graph]   the same captured in a CUDA graph (one graph per input set), T <= --graph-max-t
    moelab torch            moelab's plain-PyTorch backend (per-expert loop, host syncs)
    naive loop              what a reader writes first: for each expert, where(), two matmuls, index_add_
    torch grouped_mm        sort slots by expert, int32 cumulative offsets, torch._grouped_mm for gate_up,
                            silu*up, torch._grouped_mm for down, weighted index_add_ (fp32); sync-free
    HF eager / HF grouped_mm   transformers' Qwen3MoeExperts (gate_up_proj [E,2I,H], down_proj [E,H,I]) with
                            config._experts_implementation = "eager" / "grouped_mm"
    Liger fused MoE         liger_kernel.ops.fused_moe.LigerFusedMoEFunction (Triton); skipped when not installed.
                            Its autotuner is pinned to one config (LIGER_FUSED_MOE_AUTOTUNE=0) unless
                            --liger-autotune (then the first call tunes ~100 configs: minutes)
    moelab flashinfer       only where that backend runs (SM 10.x with flashinfer installed)

LoRA mode (``--lora``; rank ``--rank``, ``--adapters 1,4`` or ``--lora-variants "1x all,4x half"``; "Nx all" = every
token has one of N adapters, "Nx half" = half the tokens have -1; for the half variants the rows of -1 tokens are
compared bit for bit with the base path, SPEC §5, and reported as ``base_rows_bitwise``):

    moelab triton               the base layer, no LoRA at all (the ratio column divides by this)
    moelab LoRAExperts          moelab.LoRAExperts(w13, w2, lora=bank, backend="triton") (LoRA fused into the
                                GEMMs), called as a serving engine would (has_lora known on the host,
                                validate=False); also with all ids -1
    moelab LoRA ops             vLLM's unfused flow from the public pieces: lora_segments, w13_lora_delta,
                                routed_moe(delta, do_finalize=False), unpermute_activation, w2_lora_delta,
                                finalize_with_w2_lora (what LoRAExperts(fused=False) runs)
    unfused LoRA (grouped_mm)   vLLM-style separate launches: slots sorted by (adapter, expert), shrink and expand
                                by torch._grouped_mm, W13 delta into moelab's routed_moe, torch gather of the
                                activation, W2 shrink/expand, torch finalize + delta sum
    HF grouped_mm + PEFT        peft.get_peft_model(LoraConfig(target_parameters=["gate_up_proj", "down_proj"]))
                                on HF's experts module; one adapter for the whole batch, so "1x all" only

``--ops``: ``unpermute_activation`` and ``finalize_with_w2_lora`` (Triton and torch fallback) at T=16384 as
achieved GB/s (bytes read + written) and the fraction of the measured copy bandwidth.

Functions for notebooks: :func:`get_shape`, :func:`measure_ceilings`, :func:`roofline`,
:func:`expected_touched_experts`, :func:`run` (the CLI as a function; returns the results dict).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import moelab
from moelab import _runtime
from moelab.moe import prepare_weights, routed_moe
from moelab.ops import finalize_with_w2_lora, unpermute_activation
from moelab.packing import pack_topk_ids_weights

__all__ = ["Shape", "SHAPES", "Ceilings", "H200_CEILINGS", "get_shape", "measure_ceilings", "roofline",
           "expected_touched_experts", "run", "main"]


# ---------------------------------------------------------------------------------------------- shapes

@dataclass(frozen=True)
class Shape:
    """One MoE layer: ``E`` experts, top-``K``, hidden size ``H``, intermediate size ``I`` per expert."""

    name: str
    E: int
    K: int
    H: int
    I: int

    @property
    def expert_bytes(self) -> int:
        """bf16 bytes of one expert's gate, up and down weights: ``6*H*I``."""
        return 6 * self.H * self.I

    def __str__(self) -> str:
        return f"{self.name} (E={self.E}, K={self.K}, H={self.H}, I={self.I})"


#: BENCH.md's shapes, plus ``tiny`` for CPU runs. Keys are what ``--shape`` takes.
SHAPES: dict[str, Shape] = {
    "qwen3-30b-a3b": Shape("Qwen3-30B-A3B", 128, 8, 2048, 768),
    "olmoe": Shape("OLMoE-1B-7B", 64, 8, 2048, 1024),
    "mixtral": Shape("Mixtral-8x7B", 8, 2, 4096, 14336),
    "gpt-oss-20b": Shape("GPT-OSS-20B", 32, 4, 2880, 2880),
    "deepseek-v3": Shape("DeepSeek-V3 layer", 256, 8, 7168, 2048),
    "tiny": Shape("tiny", 8, 2, 64, 32),
}
_ALIASES = {"qwen3": "qwen3-30b-a3b", "qwen3-30b": "qwen3-30b-a3b", "olmoe-1b-7b": "olmoe",
            "mixtral-8x7b": "mixtral", "gpt-oss": "gpt-oss-20b", "deepseek": "deepseek-v3", "dsv3": "deepseek-v3"}


def get_shape(shape: str | Shape | tuple[int, int, int, int]) -> Shape:
    """A :class:`Shape` from a name of :data:`SHAPES` (case-insensitive), ``"E,K,H,I"``, a tuple, or a Shape."""
    if isinstance(shape, Shape):
        return shape
    if isinstance(shape, tuple):
        return Shape("custom", *(int(v) for v in shape))
    key = shape.strip().lower()
    key = _ALIASES.get(key, key)
    if key in SHAPES:
        return SHAPES[key]
    parts = key.split(",")
    if len(parts) == 4 and all(p.strip().isdigit() for p in parts):
        return Shape(f"E{parts[0]}K{parts[1]}H{parts[2]}I{parts[3]}", *(int(p) for p in parts))
    raise ValueError(f"shape: expected one of {sorted(SHAPES)} or 'E,K,H,I', got {shape!r}")


# ---------------------------------------------------------------------------------------------- ceilings

@dataclass
class Ceilings:
    """Measured ceilings: copy bandwidth (bytes read + written per second) and dense matmul rate (FLOP/s)."""

    bandwidth: float
    matmul_flops: float
    device: str = ""
    copy_bytes: int = 0
    copy_us: float = 0.0
    matmul_n: int = 0
    matmul_us: float = 0.0
    dtype: str = "bfloat16"

    def __str__(self) -> str:
        if not self.copy_bytes:
            return f"copy {_si(self.bandwidth, 'B/s')}, matmul {_si(self.matmul_flops, 'FLOP/s')}: {self.device}"
        return (f"copy {_si(self.bandwidth, 'B/s')} ({self.copy_bytes / 2**30:.2f} GiB, counted twice: read + "
                f"write), {self.dtype} matmul {_si(self.matmul_flops, 'FLOP/s')} (n={self.matmul_n}) on {self.device}")


def _si(v: float, unit: str) -> str:
    """3 significant digits with T/G/M prefix: 4.27e12 -> '4.27 TB/s'."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if v >= scale:
            return f"{v / scale:.3g} {prefix}{unit}"
    return f"{v:.3g} {unit}"


#: What BENCH.md measured on the lent H200 (2026-11-29); :func:`roofline`'s default when no ceilings are given.
H200_CEILINGS = Ceilings(bandwidth=4.27e12, matmul_flops=701e12, device="NVIDIA H200 (BENCH.md, 2026-11-29)")


def _median_us_cpu(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(reps, 1)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _median_us(fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 25, rep_ms: float = 100,
               cpu_reps: int = 3, cpu_warmup: int = 1) -> float:
    """Median µs of ``fn``: ``triton.testing.do_bench`` (CUDA events, L2 flushed before each call) on CUDA,
    ``time.perf_counter`` on a CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")) * 1e3
    return _median_us_cpu(fn, cpu_reps, cpu_warmup)


def _time_copy(n_elem: int, device: torch.device) -> float:
    src = torch.rand(n_elem, dtype=torch.float32, device=device)  # random, never zeros
    dst = torch.empty_like(src)
    return _median_us(lambda: dst.copy_(src), device, warmup_ms=50, rep_ms=200, cpu_reps=5)


def _time_matmul(n: int, dtype: torch.dtype, device: torch.device) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return _median_us(lambda: a @ b, device, warmup_ms=100, rep_ms=300, cpu_reps=3)


def measure_ceilings(device: torch.device | str | None = None, *, copy_bytes: int | None = None,
                     matmul_n: int | None = None, dtype: torch.dtype = torch.bfloat16) -> Ceilings:
    """Measure the two ceilings of the roofline on ``device`` (default: the CUDA GPU, else the CPU).

    * bandwidth: ``dst.copy_(src)`` of ``copy_bytes`` (default 2 GiB on CUDA, 64 MiB on CPU) of random data,
      counting bytes read + written (``2 * copy_bytes``) over the median time;
    * matmul rate: ``a @ b`` of two random ``n x n`` matrices of ``dtype`` (default n = 8192 on CUDA, 512 on CPU),
      ``2 n^3`` FLOPs over the median time.

    CUDA times come from ``triton.testing.do_bench(return_mode="median")``, CPU times from ``time.perf_counter``.

    Example:
        >>> c = measure_ceilings("cpu", copy_bytes=1 << 20, matmul_n=64)
        >>> c.bandwidth > 0 and c.matmul_flops > 0
        True
    """
    device = torch.device(device) if device is not None else _default_device()
    cuda = device.type == "cuda"
    copy_bytes = copy_bytes or ((2 << 30) if cuda else (64 << 20))
    matmul_n = matmul_n or (8192 if cuda else 512)
    n_elem = copy_bytes // 4
    copy_us = _time_copy(n_elem, device)
    mm_us = _time_matmul(matmul_n, dtype, device)
    if cuda:
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({torch.get_num_threads()} threads)"
    return Ceilings(bandwidth=2 * n_elem * 4 / (copy_us * 1e-6), matmul_flops=2 * matmul_n**3 / (mm_us * 1e-6),
                    device=name, copy_bytes=n_elem * 4, copy_us=copy_us, matmul_n=matmul_n, matmul_us=mm_us,
                    dtype=str(dtype).replace("torch.", ""))


# ---------------------------------------------------------------------------------------------- roofline

def expected_touched_experts(shape: str | Shape, num_tokens: int) -> float:
    """Expected distinct experts hit by ``T`` tokens under uniform routing: ``E * (1 - (1 - K/E)^T)``."""
    s = get_shape(shape)
    return s.E * (1.0 - (1.0 - s.K / s.E) ** num_tokens)


def roofline(shape: str | Shape, num_tokens: int, *, touched_experts: float | None = None,
             ceilings: Ceilings | None = None, bandwidth: float | None = None, flops_rate: float | None = None,
             lora_rank: int = 0, lora_pairs: float = 0.0, lora_slots: float | None = None,
             dtype_bytes: int = 2) -> dict:
    """The time floor of one MoE layer forward (BENCH.md "Roofline").

    * bytes = touched experts x ``6*H*I`` (bf16 gate, up, down) + activations in and out (``2*T*H``) + routing
      (``T*K`` int32 words); LoRA adds ``6*r*(H+I)`` per touched (adapter, expert) pair (A and B of gate, up,
      down);
    * FLOPs = ``6*T*K*H*I``; LoRA adds ``6*r*(H+I)`` (= ``2*r*(3H+3I)``) per slot that has an adapter;
    * floor = max(bytes / bandwidth, FLOPs / matmul rate).

    Args:
        shape: a name of :data:`SHAPES`, ``"E,K,H,I"`` or a :class:`Shape`.
        num_tokens: T.
        touched_experts: distinct experts hit (default: the uniform-routing expectation,
            :func:`expected_touched_experts`).
        ceilings: measured :class:`Ceilings` (default :data:`H200_CEILINGS`); ``bandwidth`` (bytes/s) and
            ``flops_rate`` (FLOP/s) override it.
        lora_rank, lora_pairs: LoRA rank and distinct (adapter, expert) pairs touched (0: no LoRA).
        lora_slots: (token, k) slots whose token has an adapter (default: all ``T*K`` when ``lora_rank``).

    Returns:
        dict with ``bytes``, ``flops``, ``bw_us``, ``compute_us``, ``floor_us``, ``bound`` ("bw" or "compute"),
        ``touched_experts``.

    Example (Qwen3-30B-A3B on the H200 of BENCH.md: ~18 µs at T=1, ~1765 µs at T=16384):
        >>> round(roofline("qwen3-30b-a3b", 1)["floor_us"])
        18
        >>> round(roofline("qwen3-30b-a3b", 16384)["floor_us"])
        1765
    """
    s = get_shape(shape)
    c = ceilings or H200_CEILINGS
    bw = bandwidth or c.bandwidth
    rate = flops_rate or c.matmul_flops
    T = num_tokens
    touched = expected_touched_experts(s, T) if touched_experts is None else float(touched_experts)
    nbytes = touched * s.expert_bytes / 2 * dtype_bytes + 2 * T * s.H * dtype_bytes + 4 * T * s.K
    flops = 6.0 * T * s.K * s.H * s.I
    if lora_rank:
        slots = T * s.K if lora_slots is None else lora_slots
        nbytes += lora_pairs * 3 * lora_rank * (s.H + s.I) * dtype_bytes
        flops += slots * 6.0 * lora_rank * (s.H + s.I)
    bw_us, compute_us = nbytes / bw * 1e6, flops / rate * 1e6
    return {"bytes": nbytes, "flops": flops, "bw_us": bw_us, "compute_us": compute_us,
            "floor_us": max(bw_us, compute_us), "bound": "bw" if bw_us >= compute_us else "compute",
            "touched_experts": touched}


# ---------------------------------------------------------------------------------------------- inputs

class Skip(Exception):
    """An implementation that cannot run here; the message says why."""


@dataclass
class InputSet:
    """One set of inputs of one T: hidden states, routing, and (LoRA) adapter ids per variant."""

    x: torch.Tensor  # [T, H]
    ids: torch.Tensor  # int32 [T, K]
    ids64: torch.Tensor  # int64 [T, K] (HF's one_hot wants int64)
    weights: torch.Tensor  # [T, K] routing weights rounded to bf16 (the x dtype): every impl gets these
    packed: torch.Tensor  # int32 [T, K] FlashInfer routing words
    lora_ids: dict[str, torch.Tensor] = field(default_factory=dict)  # variant -> int32 [T]


def _routing(T: int, shape: Shape, routing: str, zipf_s: float, device) -> torch.Tensor:
    E, K = shape.E, shape.K
    if routing == "uniform":
        return torch.rand(T, E, device=device).topk(K, dim=1).indices.to(torch.int32)
    if routing == "zipf":  # expert popularity ~ 1/rank^s, ranks shuffled; K distinct experts per token
        p = 1.0 / torch.arange(1, E + 1, device=device, dtype=torch.float32) ** zipf_s
        p = p[torch.randperm(E, device=device)]
        return torch.multinomial(p.expand(T, E).contiguous(), K, replacement=False).to(torch.int32)
    raise ValueError(f"routing: expected 'uniform' or 'zipf', got {routing!r}")


def _make_set(T: int, shape: Shape, routing: str, zipf_s: float, dtype, device) -> InputSet:
    x = torch.randn(T, shape.H, dtype=dtype, device=device)
    ids = _routing(T, shape, routing, zipf_s, device)
    w = torch.softmax(torch.randn(T, shape.K, device=device), dim=1).to(dtype)
    return InputSet(x, ids, ids.long(), w, pack_topk_ids_weights(ids, w, validate=False))


def _lora_ids(T: int, n_adapters: int, frac: float, device) -> torch.Tensor:
    ids = torch.randint(0, n_adapters, (T,), device=device, dtype=torch.int32)
    n_live = math.ceil(T * frac)
    if n_live < T:
        ids[torch.randperm(T, device=device)[n_live:]] = -1
    return ids


# ---------------------------------------------------------------------------------------------- context

@dataclass
class Ctx:
    """What every implementation builder gets: the shape, the HF-order weights, the LoRA bank."""

    shape: Shape
    w13: torch.Tensor  # [E, 2I, H] rows [gate; up]
    w2: torch.Tensor  # [E, H, I]
    device: torch.device
    dtype: torch.dtype
    args: argparse.Namespace
    bank: object | None = None  # moelab.lora.LoRABank
    rank: int = 0
    _f32: dict = field(default_factory=dict)  # adapter slot (-1 = base) -> fp32 merged (w13, w2), torch backend

    def merged_weights(self, slot: int):
        """fp32 moelab weights (torch backend) of ``W + B @ A`` for adapter ``slot`` (-1: the base weights)."""
        if slot not in self._f32:
            w13, w2 = self.w13.float(), self.w2.float()
            if slot >= 0:
                b = self.bank
                w13 = w13 + torch.cat([b.gate_b[slot].float() @ b.gate_a[slot].float(),
                                       b.up_b[slot].float() @ b.up_a[slot].float()], dim=1)
                w2 = w2 + b.down_b[slot].float() @ b.down_a[slot].float()
            self._f32[slot] = prepare_weights(w13, w2, backend="torch")
        return self._f32[slot]


def _reference(ctx: Ctx, s: InputSet, lora_ids: torch.Tensor | None = None) -> torch.Tensor:
    """float32 output through moelab's torch backend; with ``lora_ids``, each adapter's tokens on its merged
    weights (tokens with -1 on the base weights)."""
    E, K = ctx.shape.E, ctx.shape.K
    x, w = s.x.float(), s.weights.float()
    if lora_ids is None:
        return routed_moe((s.ids, w), x, ctx.merged_weights(-1), num_experts=E, top_k=K, validate=False)[0]
    out = torch.zeros_like(x)
    for slot in sorted(set(lora_ids.tolist())):
        rows = (lora_ids == slot).nonzero().squeeze(1)
        y = routed_moe((s.ids[rows], w[rows]), x[rows], ctx.merged_weights(slot), num_experts=E, top_k=K,
                       validate=False)[0]
        out[rows] = y
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN or a wrong shape gives inf."""
    if out.shape != ref.shape:
        return float("inf")
    o, r = out.detach().double(), ref.detach().double()
    if not torch.isfinite(o).all():
        return float("inf")
    d = r.norm().item()
    return (o - r).norm().item() / d if d > 0 else (o - r).norm().item()


# ---------------------------------------------------------------------------------------------- base impls

def _grouped_mm():
    fn = getattr(torch, "_grouped_mm", None) or getattr(F, "grouped_mm", None)
    if fn is None:
        raise Skip(f"torch {torch.__version__} has neither torch._grouped_mm nor F.grouped_mm")
    return fn


def build_moelab(ctx: Ctx, backend: str):
    from moelab.backends import get_backend

    reason = get_backend(backend).unavailable_reason(ctx.device)
    if reason is not None:
        raise Skip(f"moelab backend {backend!r}: {reason}")
    W = prepare_weights(ctx.w13, ctx.w2, backend=backend)
    E, K = ctx.shape.E, ctx.shape.K
    return lambda s: routed_moe(s.packed, s.x, W, num_experts=E, top_k=K, validate=False)[0]


def build_naive(ctx: Ctx):
    """Per-expert PyTorch loop: where() per expert (a host sync each), two matmuls, weighted index_add_."""
    w13, w2, E = ctx.w13, ctx.w2, ctx.shape.E

    def fn(s: InputSet):
        out = torch.zeros(s.x.shape, dtype=torch.float32, device=s.x.device)
        for e in range(E):
            tok, k = torch.where(s.ids64 == e)
            if tok.numel() == 0:
                continue
            gate, up = (s.x[tok] @ w13[e].T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ w2[e].T
            out.index_add_(0, tok, y.float() * s.weights[tok, k].float()[:, None])
        return out.to(s.x.dtype)

    return fn


def build_grouped_mm(ctx: Ctx):
    """A full MoE layer on torch._grouped_mm (CUTLASS grouped GEMM on Hopper), no host sync."""
    gmm = _grouped_mm()
    E, K, H, I = ctx.shape.E, ctx.shape.K, ctx.shape.H, ctx.shape.I
    w13_t = ctx.w13.transpose(1, 2)  # [E, H, 2I], column-major per expert: CUTLASS's B layout, a free view
    w2_t = ctx.w2.transpose(1, 2)  # [E, I, H]

    def fn(s: InputSet):
        T = s.x.shape[0]
        flat = s.ids64.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts, 0).to(torch.int32)  # cumulative end row of each expert's group
        tok = order // K
        h = gmm(s.x[tok], w13_t, offs=offs)  # [T*K, 2I], HF order [gate | up]
        a = F.silu(h[:, :I]) * h[:, I:]
        y = gmm(a, w2_t, offs=offs)  # [T*K, H]
        y = y.float() * s.weights.flatten()[order].float()[:, None]
        out = torch.zeros(T, H, dtype=torch.float32, device=s.x.device).index_add_(0, tok, y)
        return out.to(s.x.dtype)

    return fn


def _hf_experts(ctx: Ctx, implementation: str):
    """transformers' Qwen3MoeExperts (the generic HF experts layout) on our weights, no copy."""
    try:
        import transformers
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    except ImportError as e:
        raise Skip(f"transformers Qwen3MoeExperts not importable: {e}") from e
    s = ctx.shape
    cfg = Qwen3MoeConfig(hidden_size=s.H, moe_intermediate_size=s.I, num_experts=s.E, num_experts_per_tok=s.K,
                         hidden_act="silu")
    if implementation != "eager":
        try:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        except ImportError as e:
            raise Skip(f"transformers {transformers.__version__} has no experts_implementation registry") from e
        if implementation not in ALL_EXPERTS_FUNCTIONS:
            raise Skip(f"transformers {transformers.__version__}: experts_implementation {implementation!r} not "
                       f"registered (have {sorted(ALL_EXPERTS_FUNCTIONS.keys())})")
    cfg._experts_implementation = implementation
    with torch.device("meta"):
        m = Qwen3MoeExperts(cfg)
    if implementation != "eager" and getattr(m, "is_concatenated", None) is None:
        raise Skip(f"transformers {transformers.__version__}: Qwen3MoeExperts has no experts_implementation switch")
    if getattr(m.config, "_experts_implementation", "eager") != implementation:
        raise Skip(f"config._experts_implementation did not take {implementation!r}")
    m.gate_up_proj = torch.nn.Parameter(ctx.w13, requires_grad=False)
    m.down_proj = torch.nn.Parameter(ctx.w2, requires_grad=False)
    return m.eval()


def build_hf(ctx: Ctx, implementation: str):
    m = _hf_experts(ctx, implementation)
    return lambda s: m(s.x, s.ids64, s.weights)


def build_liger(ctx: Ctx):
    if ctx.device.type != "cuda":
        raise Skip("Liger's Triton kernels are timed on CUDA only (its bf16 tl.dot is wrong in the interpreter)")
    if not ctx.args.liger_autotune:
        os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")  # read when liger_kernel is first imported
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError as e:
        raise Skip(f"liger-kernel not installed ({e}); carry the wheel in .whl/") from e
    w13, w2 = ctx.w13.contiguous(), ctx.w2.contiguous()  # HF layout is Liger's layout
    return lambda s: LigerFusedMoEFunction.apply(s.x, w13, w2, s.ids, s.weights)


# ---------------------------------------------------------------------------------------------- LoRA impls

def _make_bank(ctx: Ctx, n_slots: int, rank: int):
    """A LoRABank of ``n_slots`` random rank-``rank`` adapters, scaling 1. Slot 0 shares one A between gate and
    up (PEFT's fused gate_up LoRA), so HF + PEFT computes the same function with it."""
    from moelab.lora import LoRABank

    E, H, I = ctx.shape.E, ctx.shape.H, ctx.shape.I
    bank = LoRABank(n_slots, E, H, I, rank, dtype=ctx.dtype, device=ctx.device)
    sa, sb = 1.0 / math.sqrt(H), 0.3 / math.sqrt(rank)  # delta ~30% of the base pre-activation
    for slot in range(n_slots):
        gate_a = torch.randn(E, rank, H, device=ctx.device) * sa
        up_a = gate_a if slot == 0 else torch.randn(E, rank, H, device=ctx.device) * sa
        bank.set(slot, gate_a=gate_a, up_a=up_a,
                 gate_b=torch.randn(E, I, rank, device=ctx.device) * sb,
                 up_b=torch.randn(E, I, rank, device=ctx.device) * sb,
                 down_a=torch.randn(E, rank, I, device=ctx.device) / math.sqrt(I),
                 down_b=torch.randn(E, H, rank, device=ctx.device) * sb)
    return bank


def build_lora_experts(ctx: Ctx, variant: str):
    from moelab.experts import LoRAExperts

    s = ctx.shape
    mod = LoRAExperts(ctx.w13, ctx.w2, num_experts=s.E, top_k=s.K, lora=ctx.bank, backend="triton")
    # As a serving engine calls it: the host knows whether any adapter is active; no host-syncing id checks.
    has_lora = variant != "ids=-1"
    return lambda st: mod(st.x, st.weights, st.ids, st.lora_ids[variant], has_lora=has_lora, validate=False)


def build_lora_ops(ctx: Ctx, variant: str):
    from moelab.lora import lora_segments, w2_lora_delta, w13_lora_delta

    W = prepare_weights(ctx.w13, ctx.w2, backend="triton")
    E, K, bank = ctx.shape.E, ctx.shape.K, ctx.bank

    def fn(s: InputSet):
        T, lora_ids = s.x.shape[0], s.lora_ids[variant]
        seg = lora_segments(s.ids, lora_ids, bank)
        d13 = w13_lora_delta(s.x, s.ids, lora_ids, bank, validate=False, segments=seg)
        gemm2, ew, e2p, act = routed_moe(s.packed, s.x, W, num_experts=E, top_k=K, gemm1_lora_delta=d13,
                                         do_finalize=False, validate=False)
        d2 = w2_lora_delta(unpermute_activation(act, e2p, T, K, validate=False), s.ids, s.weights, lora_ids, bank,
                           validate=False, segments=seg)
        return finalize_with_w2_lora(torch.empty_like(s.x), gemm2, ew, e2p, d2, validate=False)

    return fn


def build_unfused_lora(ctx: Ctx, variant: str):
    """vLLM-style unfused LoRA: separate launches, grouped_mm shrink/expand per (adapter, expert) group."""
    gmm = _grouped_mm()
    b, (E, K, H, I), r = ctx.bank, (ctx.shape.E, ctx.shape.K, ctx.shape.H, ctx.shape.I), ctx.rank
    L = b.max_loras
    G = L * E
    a13_t = torch.cat([b.up_a, b.gate_a], dim=2).reshape(G, 2 * r, H).transpose(1, 2)  # [G, H, 2r]
    b13 = torch.zeros(G, 2 * I, 2 * r, dtype=ctx.dtype, device=ctx.device)  # block diagonal: [up, gate] out
    b13[:, :I, :r] = b.up_b.reshape(G, I, r)
    b13[:, I:, r:] = b.gate_b.reshape(G, I, r)
    b13_t = b13.transpose(1, 2)  # [G, 2r, 2I]
    a2_t = b.down_a.reshape(G, r, I).transpose(1, 2)  # [G, I, r]
    b2_t = b.down_b.reshape(G, H, r).transpose(1, 2)  # [G, r, H]
    W = prepare_weights(ctx.w13, ctx.w2, backend="triton")

    def fn(s: InputSet):
        T = s.x.shape[0]
        lora = s.lora_ids[variant].long().repeat_interleave(K)
        live = lora >= 0
        group = torch.where(live, lora * E + s.ids64.flatten(), G)
        order = torch.argsort(group, stable=True)
        counts = torch.zeros(G + 1, dtype=torch.int64, device=group.device).scatter_add_(0, group,
                                                                                          torch.ones_like(group))
        offs = torch.cumsum(counts[:G], 0).to(torch.int32)
        live_s = live[order][:, None]
        d13_s = gmm(gmm(s.x[order // K], a13_t, offs=offs), b13_t, offs=offs)  # shrink, expand
        d13 = torch.empty_like(d13_s)
        d13[order] = torch.where(live_s, d13_s, torch.zeros((), dtype=d13_s.dtype, device=d13_s.device))
        gemm2, ew, e2p, act = routed_moe(s.packed, s.x, W, num_experts=E, top_k=K,
                                         gemm1_lora_delta=d13.view(T, K, 2 * I), do_finalize=False, validate=False)
        idx = e2p.clamp(min=0).long()
        d2_s = gmm(gmm(act[idx][order], a2_t, offs=offs), b2_t, offs=offs).float()
        d2_s = d2_s * s.weights.flatten()[order].float()[:, None]
        d2 = torch.empty_like(d2_s)
        d2[order] = torch.where(live_s, d2_s, torch.zeros((), device=d2_s.device))
        out = (gemm2[idx].float() * ew.flatten().float()[:, None] + d2).view(T, K, H).sum(1)
        return out.to(s.x.dtype)

    return fn


def build_peft(ctx: Ctx, variant: str):
    """HF experts + PEFT LoRA on the 3-D parameters (``target_parameters``), adapter = bank slot 0."""
    if variant != "1x all":
        raise Skip("PEFT applies one adapter to the whole batch: only the '1x all' variant")
    try:
        import peft
    except ImportError as e:
        raise Skip(f"peft not installed ({e})") from e
    try:
        m = _hf_experts(ctx, "grouped_mm")
    except Skip as e:
        print(f"HF grouped_mm + PEFT: {e}; PEFT runs on HF eager instead", flush=True)
        m = _hf_experts(ctx, "eager")

    class Holder(torch.nn.Module):
        def __init__(self, experts):
            super().__init__()
            self.experts = experts

        def forward(self, x, ids, w):
            return self.experts(x, ids, w)

    r, b, E = ctx.rank, ctx.bank, ctx.shape.E
    config = peft.LoraConfig(r=r, lora_alpha=r, lora_dropout=0.0, target_modules=[],
                             target_parameters=["gate_up_proj", "down_proj"])
    model = peft.get_peft_model(Holder(m), config)
    # PEFT's layout (peft/tuners/lora/layer.py ParamWrapper): lora_A [E*r, in] (expert-major),
    # lora_B [out, r*E] (expert fastest); delta[e] = B[:, :, e] @ A[e] * alpha/r with out/in of W[e] [out, in].
    factors = {"gate_up_proj": (b.gate_a[0], torch.cat([b.gate_b[0], b.up_b[0]], dim=1)),
               "down_proj": (b.down_a[0], b.down_b[0])}
    found = set()
    for mod in model.modules():
        name = getattr(mod, "parameter_name", None)
        if name in factors and hasattr(mod, "lora_A"):
            a, bb = factors[name]  # [E, r, in], [E, out, r]
            with torch.no_grad():
                mod.lora_A["default"].weight.copy_(a.reshape(E * r, -1))
                mod.lora_B["default"].weight.copy_(bb.permute(1, 2, 0).reshape(bb.shape[1], r * E))
            found.add(name)
    if found != set(factors):
        raise Skip(f"peft {peft.__version__}: target_parameters wrapped {sorted(found)}, expected {sorted(factors)}")
    model.eval()
    return lambda s: model(s.x, s.ids64, s.weights)


# ---------------------------------------------------------------------------------------------- runner

@dataclass
class Impl:
    name: str
    build: Callable[[], Callable[[InputSet], torch.Tensor]]
    moelab: bool = False  # moelab's own: tolerance 1e-2 (SPEC §7), peers 2e-2
    graph: bool = False  # also time a CUDA-graph capture of it
    variant: str = "none"


class Runner:
    def __init__(self, args: argparse.Namespace, device: torch.device, ceilings: Ceilings, results: dict):
        self.args, self.device, self.ceilings, self.results = args, device, ceilings, results
        self.t0 = time.monotonic()
        self._built: dict[tuple, object] = {}

    # -- bookkeeping
    def over_budget(self) -> bool:
        b = self.args.time_budget
        return b is not None and time.monotonic() - self.t0 > b

    def save(self) -> None:
        self.results["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.results["markdown"] = markdown(self.results)
        out = self.args.out
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(self.results, f, indent=1, default=str)
        with open(os.path.splitext(out)[0] + ".md", "w") as f:
            f.write(self.results["markdown"])

    def log(self, msg: str) -> None:
        print(msg, flush=True)

    def fn_of(self, impl: Impl):
        key = (impl.name, impl.variant)
        if key not in self._built:
            try:
                self._built[key] = impl.build()
            except Skip as e:
                self._built[key] = Skip(str(e))
        return self._built[key]

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _graphs(self, fn, sets):
        """One CUDA graph per input set; returns (replay callables, static outputs)."""
        replays, outs = [], []
        for s in sets:
            fn(s)  # warm (compiles, caches) outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = fn(s)
            replays.append(g.replay)
            outs.append(out)
        return replays, outs

    # -- one measurement
    def measure(self, impl: Impl, sets: list[InputSet], ref: torch.Tensor, base: dict, *, graph: bool = False):
        a = self.args
        name = impl.name + (" [graph]" if graph else "")
        T = sets[0].x.shape[0]
        row = {"mode": base["mode"], "shape": base["shape"], "routing": base["routing"], "impl": name,
               "variant": impl.variant, "T": T, "touched_experts": base["touched"],
               "floor_us": base["roof"]["floor_us"], "bound": base["roof"]["bound"]}
        if impl.variant in base.get("lora_roof", {}):
            roof = base["lora_roof"][impl.variant]
            row.update(floor_us=roof["floor_us"], bound=roof["bound"], lora_pairs=roof["pairs"])
        if self.over_budget():
            row["skipped"] = "time budget spent"
            return self._emit(row, quiet=True)
        fn = self.fn_of(impl)
        if isinstance(fn, Skip):
            row["skipped"] = str(fn)
            return self._emit(row)
        try:
            if graph:
                replays, outs = self._graphs(fn, sets)
                replays[0]()
                self._sync()
                out0 = outs[0]
                cyc = itertools.cycle(replays)
                timed = lambda: next(cyc)()
            else:
                out0 = fn(sets[0])
                self._sync()
                cyc = itertools.cycle(sets)
                timed = lambda: fn(next(cyc))
            err = rel_err(out0, ref)
            tol = 1e-2 if impl.moelab else 2e-2
            row.update(rel_err=err, tol=tol, check="ok" if err < tol else "FAIL")
            base_out = base.get("base_out")
            if impl.moelab and impl.variant.endswith("half") and base_out is not None:
                keep = sets[0].lora_ids[impl.variant] < 0  # tokens without an adapter: SPEC §5, bit for bit
                row["base_rows_bitwise"] = bool(torch.equal(out0[keep], base_out[keep]))
            del out0
            row["median_us"] = _median_us(timed, self.device, warmup_ms=a.warmup_ms, rep_ms=a.rep_ms,
                                          cpu_reps=a.cpu_reps, cpu_warmup=0)  # the checked call warmed it
            row["x_floor"] = row["median_us"] / row["floor_us"]
        except Exception as e:  # one broken peer must not lose the run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            if a.verbose:
                traceback.print_exc()
        return self._emit(row)

    def _emit(self, row: dict, quiet: bool = False) -> dict:
        self.results["rows"].append(row)
        ref_rows = [r for r in self.results["rows"] if r["mode"] == row["mode"] and r["shape"] == row["shape"]
                    and r["routing"] == row["routing"] and r["T"] == row["T"] and r["impl"] == "moelab triton"
                    and "median_us" in r]
        if "median_us" in row and ref_rows:
            row["vs_moelab_triton"] = row["median_us"] / ref_rows[0]["median_us"]
        if not quiet:
            self.log(format_row(row))
        self.save()
        return row


def format_row(row: dict) -> str:
    tag = f"[{row['mode']} {row['shape']} {row['routing']}]"
    var = f" ({row['variant']})" if row.get("variant", "none") != "none" else ""
    head = f"{tag} T={row['T']:>6} {row['impl'] + var:<44}"
    if "skipped" in row:
        return f"{head} skipped: {row['skipped']}"
    if "error" in row and "median_us" not in row:
        chk = f" (check {row['check']} {row['rel_err']:.1e})" if "check" in row else ""
        return f"{head} ERROR{chk}: {row['error']}"
    vs = f" vs moelab {row['vs_moelab_triton']:5.2f}x" if "vs_moelab_triton" in row else ""
    if "base_rows_bitwise" in row:
        vs += f"  -1 rows bitwise={'yes' if row['base_rows_bitwise'] else 'NO'}"
    return (f"{head} {row['median_us']:10.1f} us  floor {row['floor_us']:8.1f} us ({row['bound']:<7})"
            f" x{row['x_floor']:6.2f} floor{vs}  err {row['rel_err']:.1e} {row['check']}")


# ---------------------------------------------------------------------------------------------- plans

def _base_impls(ctx: Ctx) -> list[Impl]:
    cuda = ctx.device.type == "cuda"
    impls = [Impl("moelab triton", lambda: build_moelab(ctx, "triton"), moelab=True, graph=cuda),
             Impl("moelab torch", lambda: build_moelab(ctx, "torch"), moelab=True),
             Impl("naive loop", lambda: build_naive(ctx)),
             Impl("torch grouped_mm", lambda: build_grouped_mm(ctx), graph=cuda),
             Impl("HF eager", lambda: build_hf(ctx, "eager")),
             Impl("HF grouped_mm", lambda: build_hf(ctx, "grouped_mm")),
             Impl("Liger fused MoE", lambda: build_liger(ctx))]
    if cuda and "flashinfer" in moelab.available_backends(ctx.device):
        impls.insert(1, Impl("moelab flashinfer", lambda: build_moelab(ctx, "flashinfer"), moelab=True))
    return impls


def _lora_impls(ctx: Ctx, variants: list[str]) -> list[Impl]:
    cuda = ctx.device.type == "cuda"
    impls = [Impl("moelab triton", lambda: build_moelab(ctx, "triton"), moelab=True, graph=cuda),
             Impl("moelab LoRAExperts", lambda: build_lora_experts(ctx, "ids=-1"), moelab=True, graph=cuda,
                  variant="ids=-1")]
    for v in variants:
        impls += [Impl("moelab LoRAExperts", lambda v=v: build_lora_experts(ctx, v), moelab=True, graph=cuda,
                       variant=v),
                  Impl("moelab LoRA ops", lambda v=v: build_lora_ops(ctx, v), moelab=True, graph=cuda, variant=v),
                  Impl("unfused LoRA (grouped_mm)", lambda v=v: build_unfused_lora(ctx, v), variant=v),
                  Impl("HF grouped_mm + PEFT", lambda v=v: build_peft(ctx, v), variant=v)]
    return impls


def _keep(impl: Impl, args) -> bool:
    if not args.impls:
        return True
    words = [w.strip().lower() for w in args.impls.split(",") if w.strip()]
    return any(w in impl.name.lower() for w in words)


def _lora_variants(args) -> list[str]:
    """'Nx all' (every token has one of N adapters) and 'Nx half' (half the tokens have -1) for N in --adapters,
    or exactly --lora-variants."""
    if args.lora_variants:
        out = [" ".join(v.split()) for v in args.lora_variants.split(",") if v.strip()]
        for v in out:
            n, _, h = v.partition("x ")
            if not n.isdigit() or h not in ("all", "half"):
                raise ValueError(f"--lora-variants: expected items like '1x all' or '4x half', got {v!r}")
        return out
    return [f"{n}x {h}" for n in _ints(args.adapters) for h in ("all", "half")]


def _run_shape(runner: Runner, shape: Shape, routing: str, mode: str) -> None:
    a, device, dtype = runner.args, runner.device, torch.bfloat16
    torch.manual_seed(a.seed)
    E, H, I = shape.E, shape.H, shape.I
    w13 = (torch.randn(E, 2 * I, H, device=device) / math.sqrt(H)).to(dtype)
    w2 = (torch.randn(E, H, I, device=device) / math.sqrt(I)).to(dtype)
    ctx = Ctx(shape, w13, w2, device, dtype, a)
    variants = []
    if mode == "lora":
        variants = _lora_variants(a)
        ctx.rank = a.rank
        ctx.bank = _make_bank(ctx, max(int(v.split("x")[0]) for v in variants), a.rank)
        impls = _lora_impls(ctx, variants)
    else:
        impls = _base_impls(ctx)
    impls = [i for i in impls if _keep(i, a)]
    runner._built.clear()
    runner.log(f"== {mode}: {shape}, {routing} routing, bf16, T = {a.tokens}, {a.sets} input sets"
               + (f", LoRA r={a.rank} variants {variants}" if variants else ""))
    for T in _ints(a.tokens):
        if runner.over_budget():
            runner.log(f"[{mode} {shape.name} {routing}] T={T}: time budget {a.time_budget} s spent, skipped")
            for impl in impls:
                runner._emit({"mode": mode, "shape": shape.name, "routing": routing, "impl": impl.name,
                              "variant": impl.variant, "T": T, "skipped": "time budget spent"}, quiet=True)
            continue
        try:
            _run_tokens(runner, ctx, impls, variants, T, routing, mode)
        except Exception as e:  # inputs or reference failed (e.g. out of memory): record it, go on with next T
            runner.log(f"[{mode} {shape.name} {routing}] T={T}: {type(e).__name__}: {e}")
            for impl in impls:
                runner._emit({"mode": mode, "shape": shape.name, "routing": routing, "impl": impl.name,
                              "variant": impl.variant, "T": T, "error": f"setup: {type(e).__name__}: {e}"},
                             quiet=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del ctx
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _run_tokens(runner: Runner, ctx: Ctx, impls: list[Impl], variants: list[str], T: int, routing: str,
                mode: str) -> None:
    a, device, dtype, shape = runner.args, ctx.device, ctx.dtype, ctx.shape
    E = shape.E
    torch.manual_seed(a.seed + T)
    t_ref = time.monotonic()
    sets = [_make_set(T, shape, routing, a.zipf_s, dtype, device) for _ in range(a.sets)]
    touched = statistics.mean(len(torch.unique(s.ids)) for s in sets)
    base = {"mode": mode, "shape": shape.name, "routing": routing, "touched": touched,
            "roof": roofline(shape, T, touched_experts=touched, ceilings=runner.ceilings)}
    refs = {"none": _reference(ctx, sets[0])}
    if mode == "lora":
        base["lora_roof"] = {}
        for v in variants + ["ids=-1"]:
            for s in sets:
                if v == "ids=-1":
                    s.lora_ids[v] = torch.full((T,), -1, dtype=torch.int32, device=device)
                else:
                    n, half = int(v.split("x")[0]), v.endswith("half")
                    s.lora_ids[v] = _lora_ids(T, n, 0.5 if half else 1.0, device)
            pairs = statistics.mean(_lora_pairs(s, v, E) for s in sets)
            slots = statistics.mean(int((s.lora_ids[v] >= 0).sum()) * shape.K for s in sets)
            roof = roofline(shape, T, touched_experts=touched, ceilings=runner.ceilings, lora_rank=a.rank,
                            lora_pairs=pairs, lora_slots=slots)
            base["lora_roof"][v] = dict(roof, pairs=pairs)
            refs[v] = refs["none"] if v == "ids=-1" else _reference(ctx, sets[0], sets[0].lora_ids[v])
        with contextlib.suppress(Exception):  # the base path's output, for the bit-for-bit check of -1 tokens
            base["base_out"] = build_moelab(ctx, "triton")(sets[0])
    runner.log(f"[{mode} {shape.name} {routing}] T={T}: {touched:.1f} experts touched, floor "
               f"{base['roof']['floor_us']:.1f} us ({base['roof']['bound']}), inputs + float32 reference in "
               f"{time.monotonic() - t_ref:.1f} s, {time.monotonic() - runner.t0:.0f} s elapsed")
    for impl in impls:
        ref = refs[impl.variant]
        runner.measure(impl, sets, ref, base)
        if impl.graph and a.graphs and T <= a.graph_max_t:
            runner.measure(impl, sets, ref, base, graph=True)


def _lora_pairs(s: InputSet, variant: str, E: int) -> int:
    lora = s.lora_ids[variant].long()[:, None].expand_as(s.ids64)
    live = lora >= 0
    return len(torch.unique((lora * E + s.ids64)[live]))


def _run_ops(runner: Runner, shape: Shape) -> None:
    """unpermute_activation and finalize_with_w2_lora at --ops-tokens as achieved GB/s."""
    a, device, dtype = runner.args, runner.device, torch.bfloat16
    T = a.ops_tokens
    E, K, H, I = shape.E, shape.K, shape.H, shape.I
    torch.manual_seed(a.seed)
    runner.log(f"== ops: {shape}, T={T}, bf16")
    try:
        w13 = (torch.randn(E, 2 * I, H, device=device) / math.sqrt(H)).to(dtype)
        w2 = (torch.randn(E, H, I, device=device) / math.sqrt(I)).to(dtype)
        W = prepare_weights(w13, w2, backend="triton")
        s = _make_set(T, shape, "uniform", a.zipf_s, dtype, device)
        delta = torch.randn(T, K, 2 * I, device=device, dtype=dtype) * 0.1
        gemm2, ew, e2p, act = routed_moe(s.packed, s.x, W, num_experts=E, top_k=K, gemm1_lora_delta=delta,
                                         do_finalize=False, validate=False)
        w2_delta = torch.randn(T, K, H, device=device, dtype=dtype) * 0.1
        out = torch.empty(T, H, device=device, dtype=dtype)
        del w13, w2, W
    except Exception as e:
        runner.log(f"ops: could not build inputs: {type(e).__name__}: {e}")
        return
    b = dtype.itemsize
    live = int((e2p >= 0).sum())
    cases = []
    for use_triton in (True, False):
        tag = "triton" if use_triton else "torch"
        cases += [
            (f"unpermute_activation ({tag})",
             lambda u=use_triton: unpermute_activation(act, e2p, T, K, validate=False, use_triton=u),
             live * I * b + T * K * 4 + T * K * I * b,
             lambda: moelab.ops.unpermute_torch(act, e2p)),
            (f"finalize_with_w2_lora ({tag})",
             lambda u=use_triton: finalize_with_w2_lora(out, gemm2, ew, e2p, w2_delta, validate=False,
                                                        use_triton=u),
             live * H * b + T * K * (H * b + b + 4) + T * H * b,
             lambda: moelab.ops.finalize_torch(torch.empty_like(out), gemm2, ew, e2p, w2_delta)),
            (f"finalize_with_w2_lora, no delta ({tag})",
             lambda u=use_triton: finalize_with_w2_lora(out, gemm2, ew, e2p, None, validate=False,
                                                        use_triton=u),
             live * H * b + T * K * (b + 4) + T * H * b,
             lambda: moelab.ops.finalize_torch(torch.empty_like(out), gemm2, ew, e2p, None)),
        ]
    for name, fn, nbytes, ref_fn in cases:
        row = {"mode": "ops", "shape": shape.name, "routing": "uniform", "impl": name, "variant": "none", "T": T,
               "bytes": nbytes}
        if runner.over_budget():
            row["skipped"] = "time budget spent"
        else:
            try:
                got = fn().clone()
                ref = ref_fn()
                row["rel_err"] = rel_err(got, ref.to(got.dtype))
                row["check"] = "ok" if row["rel_err"] < 1e-2 else "FAIL"
                us = _median_us(fn, device, warmup_ms=a.warmup_ms, rep_ms=a.rep_ms, cpu_reps=a.cpu_reps,
                                cpu_warmup=0)
                row.update(median_us=us, GB_s=nbytes / (us * 1e-6) / 1e9,
                           frac_copy_bw=nbytes / (us * 1e-6) / runner.ceilings.bandwidth)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
        runner.results["rows"].append(row)
        if "median_us" in row:
            runner.log(f"[ops {shape.name}] T={T} {name:<44} {row['median_us']:10.1f} us  {row['GB_s']:8.1f} GB/s"
                       f"  {100 * row['frac_copy_bw']:5.1f}% of copy BW  err {row['rel_err']:.1e} {row['check']}")
        else:
            runner.log(f"[ops {shape.name}] T={T} {name:<44} {row.get('skipped') or row.get('error')}")
        runner.save()


# ---------------------------------------------------------------------------------------------- report

def _fmt(v: float | None, digits: int = 0) -> str:
    if v is None:
        return "-"
    if v >= 10**6:
        return f"{v:.3g}"
    return f"{v:.{max(digits, 1) if v < 10 else digits}f}"


def _pivot(mode: str, shape: str, routing: str, rs: list[dict]) -> list[str]:
    """Three T x implementation tables (µs, measured/floor, time/moelab triton). LoRA mode indexes rows by
    (T, variant) and repeats the base layer ("moelab triton", no LoRA) in each row as the reference column."""
    lora = mode == "lora"
    cols: list[str] = []
    for r in rs:
        if r["impl"] not in cols:
            cols.append(r["impl"])
    variants = []
    for r in rs:
        if r.get("variant", "none") not in variants and (r.get("variant", "none") != "none" or not lora):
            variants.append(r.get("variant", "none"))
    cell = {(r["T"], r.get("variant", "none"), r["impl"]): r for r in rs}
    floors = {(r["T"], r.get("variant", "none")): r for r in rs if "floor_us" in r}
    lines = []
    for title, key, digits in (("median µs", "median_us", 0), ("measured / floor", "x_floor", 2),
                               ("time / moelab triton (no LoRA)" if lora else "time / moelab triton",
                                "vs_moelab_triton", 2)):
        head = "| T | " + ("LoRA | " if lora else "") + "touched | floor µs | " + " | ".join(cols) + " |"
        lines += ["", f"**{mode}: {shape}, {routing} routing, bf16: {title}**", "", head,
                  "|" + "---|" * (head.count("|") - 1)]
        for T in sorted({r["T"] for r in rs}):
            for v in variants:
                if not any((T, v, c) in cell for c in cols):
                    continue
                vals = []
                for col in cols:
                    r = cell.get((T, v, col)) or (cell.get((T, "none", col)) if lora else None)
                    if r is None:
                        vals.append("")
                    elif key in r:
                        vals.append(_fmt(r[key], digits) + (" ✗" if r.get("check") == "FAIL" else ""))
                    elif "median_us" in r:
                        vals.append("-")
                    else:
                        vals.append("err" if "error" in r else "skip")
                f = floors.get((T, v)) or floors.get((T, "none"), {})
                touched = f.get("touched_experts")
                lines.append(f"| {T} | " + (f"{v} | " if lora else "")
                             + f"{_fmt(touched, 1) if touched is not None else ''} | {_fmt(f.get('floor_us'))} | "
                             + " | ".join(vals) + " |")
    return lines


def markdown(results: dict) -> str:
    """Markdown tables of ``results`` (from :func:`run`), ready to paste into BENCHMARKS.md."""
    env, c = results.get("env", {}), results.get("ceilings", {})
    lines = [f"GPU: {env.get('device', '?')} · torch {env.get('torch')} · triton {env.get('triton')} · "
             f"transformers {env.get('transformers')} · peft {env.get('peft')} · liger-kernel {env.get('liger_kernel')}"
             f" · moelab commit {env.get('commit')}",
             f"Command: `{results.get('command', '')}`"]
    if c:
        where = "Ceilings in the same run" if c.get("copy_bytes") else f"Ceilings not measured ({c.get('device')})"
        timer = "triton.testing.do_bench" if env.get("device", "CPU") != "CPU" else "time.perf_counter"
        lines.append(f"{where}: copy {_si(c['bandwidth'], 'B/s')}, {c.get('dtype', 'bf16')} "
                     f"matmul {_si(c['matmul_flops'], 'FLOP/s')}. floor = max((touched experts' weights + "
                     f"activations) / copy BW, 6·T·K·H·I FLOPs / matmul rate); µs are medians of {timer}, "
                     f"rotating {results.get('config', {}).get('sets')} input sets; ✗ marks a failed check.")
    rows = [r for r in results.get("rows", []) if r["mode"] != "ops"]
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["mode"], r["shape"], r["routing"]), []).append(r)
    for (mode, shape, routing), rs in groups.items():
        lines += _pivot(mode, shape, routing, rs)
    ops = [r for r in results.get("rows", []) if r["mode"] == "ops"]
    if ops:
        lines += ["", "**ops (bytes read + written)**", "", "| op | T | µs | GB/s | % of copy BW |",
                  "|---|---|---|---|---|"]
        for r in ops:
            if "median_us" in r:
                lines.append(f"| {r['impl']} | {r['T']} | {r['median_us']:.1f} | {r['GB_s']:.0f} | "
                             f"{100 * r['frac_copy_bw']:.1f} |")
            else:
                lines.append(f"| {r['impl']} | {r['T']} | {r.get('skipped') or r.get('error')} | | |")
    notes = sorted({f"{r['impl']}: {r.get('skipped') or r.get('error')}" for r in results.get("rows", [])
                    if ("skipped" in r or "error" in r) and "median_us" not in r})
    if notes:
        lines += ["", "Not measured:"] + [f"- {n}" for n in notes]
    bitwise = [r for r in rows if "base_rows_bitwise" in r]
    if bitwise:
        lines += ["", "Tokens with lora_id -1 bit-for-bit equal to the base path (SPEC §5): " + ", ".join(
            f"{r['impl']} ({r['variant']}) T={r['T']}: {'yes' if r['base_rows_bitwise'] else 'NO'}"
            for r in bitwise)]
    fails = [r for r in rows if r.get("check") == "FAIL"]
    if fails:
        lines += ["", "✗ = correctness check failed (rel err above tolerance):"]
        lines += [f"- {r['impl']} ({r.get('variant')}) T={r['T']}: {r['rel_err']:.2e}" for r in fails]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- env, CLI

def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:
        return None


def _commit() -> str:
    for var in ("MOELAB_COMMIT", "GIT_COMMIT"):
        if os.environ.get(var):
            return os.environ[var]
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("+dirty" if dirty else "")) if sha else "unknown"
    except Exception:
        return "unknown"


def _env(device: torch.device) -> dict:
    import triton

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": _version("transformers"), "peft": _version("peft"),
            "liger_kernel": _version("liger-kernel") or _version("liger_kernel"), "moelab": moelab.__version__,
            "commit": _commit(), "python": sys.version.split()[0], "triton_interpret": _runtime.INTERPRET}


def _ints(text: str) -> list[int]:
    return [int(v) for v in str(text).split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moelab.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b",
                   help=f"comma list of {sorted(SHAPES)} or E,K,H,I (one shape) [qwen3-30b-a3b]")
    p.add_argument("--tokens", default=None, help="comma list of T [1,32,128,1024,4096,16384]")
    p.add_argument("--routing", default="uniform", help="comma list of uniform, zipf [uniform]")
    p.add_argument("--zipf-s", type=float, default=1.2, help="Zipf exponent of expert popularity [1.2]")
    p.add_argument("--lora", action="store_true", help="LoRA rows instead of the base-layer peers")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank [16]")
    p.add_argument("--adapters", default="1,4", help="comma list of adapter counts [1,4]")
    p.add_argument("--lora-variants", default="",
                   help="comma list like '1x all,4x half' (overrides --adapters' all/half pairs)")
    p.add_argument("--ops", action="store_true", help="also unpermute_activation / finalize_with_w2_lora GB/s")
    p.add_argument("--ops-tokens", type=int, default=16384, help="T of --ops [16384]")
    p.add_argument("--impls", default="", help="keep implementations whose name contains one of these words")
    p.add_argument("--sets", type=int, default=None, help="input sets rotated while timing [4; quick 2]")
    p.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up ms [25; quick 10]")
    p.add_argument("--rep-ms", type=float, default=None, help="do_bench repetition ms [100; quick 40]")
    p.add_argument("--cpu-reps", type=int, default=3, help="timed calls per measurement on a CPU [3]")
    p.add_argument("--no-graphs", dest="graphs", action="store_false", help="skip the CUDA-graph rows")
    p.add_argument("--graph-max-t", type=int, default=1024, help="CUDA-graph rows only for T <= this [1024]")
    p.add_argument("--liger-autotune", action="store_true",
                   help="let Liger autotune (~100 Triton compiles on first call) instead of its pinned config")
    p.add_argument("--quick", action="store_true", help="T = 1,128,4096, 2 input sets, shorter do_bench")
    p.add_argument("--tiny", action="store_true", help="shape tiny (E=8 K=2 H=64 I=32), T = 1,8: CPU-friendly")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; once spent, remaining measurements are recorded as skipped")
    p.add_argument("--no-ceilings", dest="ceilings", action="store_false",
                   help="use BENCH.md's H200 ceilings instead of measuring them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path ($OUT/bench.json if OUT is set, else build/bench.json);"
                   " a .md of the tables is written beside it")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing implementations")
    return p


def _finish_args(args: argparse.Namespace) -> argparse.Namespace:
    if args.tiny:
        args.shape = "tiny"
        args.tokens = args.tokens or "1,8"
        args.ops_tokens = min(args.ops_tokens, 64)
    args.tokens = args.tokens or ("1,128,4096" if args.quick else "1,32,128,1024,4096,16384")
    args.sets = args.sets or (2 if (args.quick or args.tiny) else 4)
    args.warmup_ms = args.warmup_ms if args.warmup_ms is not None else (10 if args.quick else 25)
    args.rep_ms = args.rep_ms if args.rep_ms is not None else (40 if args.quick else 100)
    if args.out is None:
        args.out = os.path.join(os.environ["OUT"], "bench.json") if os.environ.get("OUT") else "build/bench.json"
    return args


def run(argv: list[str] | None = None) -> dict:
    """Run the benchmark as the CLI would (``argv`` as for ``python -m moelab.bench``); return the results dict
    (``rows``, ``ceilings``, ``env``, ``markdown``, ...), also written to ``--out``."""
    args = _finish_args(build_parser().parse_args(argv))
    device = _default_device()
    results = {"command": "python -m moelab.bench " + " ".join(shlex.quote(a) for a in (argv or [])),
               "config": {k: v for k, v in vars(args).items()}, "env": _env(device), "rows": []}
    print(f"moelab.bench on {results['env']['device']}: torch {torch.__version__}, triton "
          f"{results['env']['triton']}, transformers {results['env']['transformers']}, peft {results['env']['peft']},"
          f" liger-kernel {results['env']['liger_kernel']}, commit {results['env']['commit']}", flush=True)
    if device.type != "cuda" and not args.tiny:
        print("no CUDA GPU: timings come from time.perf_counter on the CPU (use --tiny there)", flush=True)
    if args.ceilings:
        ceilings = measure_ceilings(device)
    else:
        ceilings = H200_CEILINGS
    results["ceilings"] = dataclasses.asdict(ceilings)
    print(f"ceilings: {ceilings}", flush=True)
    runner = Runner(args, device, ceilings, results)
    with torch.no_grad():
        for shape_name in args.shape.split(";") if ";" in args.shape else _split_shapes(args.shape):
            shape = get_shape(shape_name)
            for routing in [r.strip() for r in args.routing.split(",") if r.strip()]:
                try:
                    _run_shape(runner, shape, routing, "lora" if args.lora else "base")
                except Exception as e:  # weights or bank did not fit, ...: keep what was measured, go on
                    print(f"{shape.name} {routing}: {type(e).__name__}: {e}", flush=True)
                    results.setdefault("errors", []).append(f"{shape.name} {routing}: {type(e).__name__}: {e}")
                    if args.verbose:
                        traceback.print_exc()
            if args.ops:
                _run_ops(runner, shape)
    runner.save()
    print("\n" + results["markdown"], flush=True)
    print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.md in {results['elapsed_s']} s", flush=True)
    return results


def _split_shapes(text: str) -> list[str]:
    """'qwen3,olmoe' -> two names; '128,8,2048,768' (all digits) -> one E,K,H,I shape."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if parts and all(p.isdigit() for p in parts):
        return [",".join(parts)]
    return parts


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    results = run(args)
    bad = [r for r in results["rows"] if r.get("check") == "FAIL" and r["impl"].startswith("moelab")]
    return 1 if bad else 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
