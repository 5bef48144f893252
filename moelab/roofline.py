"""The roofline of one MoE layer forward: model shapes, measured ceilings and the time floor.

A layer's time floor is ``max(bytes / copy bandwidth, FLOPs / matmul rate)``: the weights of the experts the
tokens touch plus the activations in and out, against the dense bf16 matmul rate. Notebook 07 draws it and
``python -m moelab.bench`` prints it beside every measurement.

Example:
    >>> from moelab.roofline import get_shape, roofline
    >>> get_shape("qwen3-30b-a3b")
    Shape(name='Qwen3-30B-A3B', E=128, K=8, H=2048, I=768)
    >>> round(roofline("qwen3-30b-a3b", 1)["floor_us"])  # one token touches 8 experts: ~18 µs on the H200
    18
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moelab import _runtime

__all__ = ["Shape", "SHAPES", "get_shape", "Ceilings", "H200_CEILINGS", "si", "median_us", "measure_ceilings",
           "expected_touched_experts", "roofline"]


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


#: One MoE layer of each model moelab is measured on (from each model's config.json: ``num_experts`` or
#: ``num_local_experts`` / ``n_routed_experts``, ``num_experts_per_tok``, ``hidden_size``,
#: ``moe_intermediate_size`` or ``intermediate_size``), plus ``tiny`` for CPU runs. Keys are what
#: ``python -m moelab.bench --shape`` and ``scripts/tune_moe.py --shape`` take. (GPT-OSS's experts also have
#: biases and a clamped SwiGLU; here it is its shape, in bf16, with moelab's plain SwiGLU.)
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
    """A :class:`Shape` from a name of :data:`SHAPES` or an alias (``qwen3``, ``deepseek``, ...;
    case-insensitive), ``"E,K,H,I"``, a tuple ``(E, K, H, I)``, or a Shape.

    Example:
        >>> get_shape("128,8,2048,768").E
        128
    """
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
    raise ValueError(f"shape: expected one of {sorted(SHAPES)} (or an alias: {sorted(_ALIASES)}) or 'E,K,H,I', "
                     f"got {shape!r}")


# ---------------------------------------------------------------------------------------------- ceilings

def si(v: float, unit: str) -> str:
    """3 significant digits with T/G/M prefix: 4.27e12 -> '4.27 TB/s'."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if v >= scale:
            return f"{v / scale:.3g} {prefix}{unit}"
    return f"{v:.3g} {unit}"


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
            return f"copy {si(self.bandwidth, 'B/s')}, matmul {si(self.matmul_flops, 'FLOP/s')}: {self.device}"
        return (f"copy {si(self.bandwidth, 'B/s')} ({self.copy_bytes / 2**30:.2f} GiB, counted twice: read + "
                f"write), {self.dtype} matmul {si(self.matmul_flops, 'FLOP/s')} (n={self.matmul_n}) on {self.device}")


#: Measured on the lent H200 (2026-11-29); :func:`roofline`'s default when no ceilings are given.
H200_CEILINGS = Ceilings(bandwidth=4.27e12, matmul_flops=701e12, device="NVIDIA H200 (measured 2026-11-29)")


def median_us(fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 25, rep_ms: float = 100,
              cpu_reps: int = 3, cpu_warmup: int = 1) -> float:
    """Median µs of ``fn()``: ``triton.testing.do_bench(return_mode="median")`` (CUDA events, L2 flushed before
    each call) on CUDA; ``time.perf_counter`` over ``cpu_reps`` calls after ``cpu_warmup`` on a CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")) * 1e3
    for _ in range(cpu_warmup):
        fn()
    times = []
    for _ in range(max(cpu_reps, 1)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def back_to_back_us(fn: Callable[[], object], device: torch.device, *, calls: int = 50, rounds: int = 3) -> float:
    """µs per call of ``fn`` called ``calls`` times back to back, one synchronize per round, best of ``rounds``; no
    L2 flush (the same weights every call, so small experts may stay in the L2; ``scripts/host_cost.py --layers``
    calls layers of their own). The host's time shows where it exceeds the GPU's. :func:`median_us` hides host time
    up to its L2 flush's GPU time (the host launches the call while the GPU clears the flush buffer)."""
    best = float("inf")
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def graphed(fn: Callable[[], object], device: torch.device, *, capture_error_mode: str = "global"):
    """``fn`` captured in a CUDA graph after two warm-up calls on a side stream (as ``torch.cuda.graph`` asks): a
    function of no arguments that replays it, its captured output at ``.out``. ``capture_error_mode``: that of
    ``torch.cuda.graph`` ("thread_local" where another thread polls CUDA events meanwhile, e.g. NCCL's watchdog)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # the outer stream context puts the caller's stream back even when the capture's end raises (a host sync in
    # ``fn``), which torch.cuda.graph's own exit then skips
    with torch.cuda.stream(torch.cuda.current_stream(device)), torch.cuda.graph(
            graph, capture_error_mode=capture_error_mode):
        captured = fn()

    def replay():
        graph.replay()

    replay.out = captured
    return replay


def _time_copy(n_elem: int, device: torch.device) -> float:
    src = torch.rand(n_elem, dtype=torch.float32, device=device)  # random, never zeros
    dst = torch.empty_like(src)
    return median_us(lambda: dst.copy_(src), device, warmup_ms=50, rep_ms=200, cpu_reps=5)


def _time_matmul(n: int, dtype: torch.dtype, device: torch.device) -> float:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return median_us(lambda: a @ b, device, warmup_ms=100, rep_ms=300, cpu_reps=3)


def measure_ceilings(device: torch.device | str | None = None, *, copy_bytes: int | None = None,
                     matmul_n: int | None = None, dtype: torch.dtype = torch.bfloat16) -> Ceilings:
    """Measure the two ceilings of the roofline on ``device`` (default: the CUDA GPU, else the CPU).

    * bandwidth: ``dst.copy_(src)`` of ``copy_bytes`` (default 2 GiB on CUDA, 64 MiB on CPU) of random data,
      counting bytes read + written (``2 * copy_bytes``) over the median time;
    * matmul rate: ``a @ b`` of two random ``n x n`` matrices of ``dtype`` (default n = 8192 on CUDA, 512 on CPU),
      ``2 n^3`` FLOPs over the median time.

    Example:
        >>> c = measure_ceilings("cpu", copy_bytes=1 << 20, matmul_n=64)
        >>> c.bandwidth > 0 and c.matmul_flops > 0
        True
    """
    device = _runtime.default_device() if device is None else torch.device(device)
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
    """Expected distinct experts hit by ``T`` tokens under uniform routing: ``E * (1 - (1 - K/E)^T)``.

    Example:
        >>> expected_touched_experts("qwen3-30b-a3b", 1)
        8.0
    """
    s = get_shape(shape)
    return s.E * (1.0 - (1.0 - s.K / s.E) ** num_tokens)


def roofline(shape: str | Shape, num_tokens: int, *, touched_experts: float | None = None,
             ceilings: Ceilings | None = None, bandwidth: float | None = None, flops_rate: float | None = None,
             lora_rank: float = 0, lora_pairs: float = 0.0, lora_slots: float | None = None,
             lora_slot_rank: float | None = None, dtype_bytes: int = 2) -> dict:
    """The time floor of one MoE layer forward.

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
        lora_rank, lora_pairs: LoRA rank and distinct (adapter, expert) pairs touched (0: no LoRA). For a bank
            of mixed ranks, ``lora_rank`` is the mean rank over the touched pairs.
        lora_slots: (token, k) slots whose token has an adapter (default: all ``T*K`` when ``lora_rank``).
        lora_slot_rank: mean rank over those slots (default ``lora_rank``).

    Returns:
        dict with ``bytes``, ``flops``, ``bw_us``, ``compute_us``, ``floor_us``, ``bound`` ("bw" or "compute"),
        ``touched_experts``.

    Example (Qwen3-30B-A3B on the H200: ~18 µs at T=1, ~1765 µs at T=16384):
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
        slot_rank = lora_rank if lora_slot_rank is None else lora_slot_rank
        nbytes += lora_pairs * 3 * lora_rank * (s.H + s.I) * dtype_bytes
        flops += slots * 6.0 * slot_rank * (s.H + s.I)
    bw_us, compute_us = nbytes / bw * 1e6, flops / rate * 1e6
    return {"bytes": nbytes, "flops": flops, "bw_us": bw_us, "compute_us": compute_us,
            "floor_us": max(bw_us, compute_us), "bound": "bw" if bw_us >= compute_us else "compute",
            "touched_experts": touched}
