"""Eager decode calls of the triton backend replayed from CUDA graphs captured on their first call.

At decode sizes an eager ``routed_moe`` call is host-bound: its launches cost the host more than the GPU's work
(moelab's Python, Triton's dispatch and launcher, ``scripts/host_time.py``). A graph replay costs the host one
``cudaGraphLaunch``. So an eager call of at most ``MAX_TOKENS`` tokens that asks for the output only runs as

    static_x.copy_(x); static_routing.copy_(routing)     two copies into the graph's input buffers
    graph.replay()                                        the pipeline, as a caller's own CUDA graph runs it
    out = static_out.clone()  (or output.copy_(...))      the caller gets a tensor of its own

The first call of each key captures the graph (its kernels compile in the capture, as under any capture) and
replays it, so every call of a key, the first included, computes the same bits: those of the pipeline in a CUDA
graph (the tiled GEMMs chained by PDL, or the token-major ones where ``takes_token_major`` says so while
capturing), which agree with the eager kernels to rounding only.

The key is everything the captured launches read by address or by value: the current stream (graphs of one
stream share one memory pool, and a stream runs its replays one after the other, so their intermediates may share
memory), T, the routing's kind and dtypes, ``num_experts``, ``top_k``, ``local_expert_offset``, the router weight
on the input, the expert options, and each weight and bias tensor's address, shape and dtype. A replay reads the
weights where the key says they are, so a call whose weights live there reads its own weights; weights updated in
place are read as updated. Entries live until ``MAX_GRAPHS`` are held (then the oldest goes) or :func:`clear`.
Each holds its static buffers (T x H inputs and output) and its share of the pool.

Not taken (the call runs its launches as before): experts expected to weigh more than ``MAX_BYTES_PER_LAUNCH`` per
eager launch (the GPU's work hides the launches there), T above ``MAX_TOKENS`` or 0, an ``output`` not asked for
alone (``do_finalize=False`` or a delta: the permuted intermediates would be the graph's), a tile ``config``
forced, CPU tensors, a tensor on a device other than the current one, while a graph is captured or
``torch.compile`` traces, inputs that require grad, inference mode switched since the capture (part of the key),
and ``MOELAB_EAGER_GRAPHS=0``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from moelab.contract import RoutedMoECall

__all__ = ["takes", "expected_touched_experts", "key", "run", "clear", "held", "MAX_TOKENS",
           "MAX_BYTES_PER_LAUNCH", "MAX_GRAPHS"]

#: Replay eager calls from CUDA graphs (``MOELAB_EAGER_GRAPHS=0``: never).
ENABLED: bool = os.environ.get("MOELAB_EAGER_GRAPHS", "1") == "1"
#: Largest T replayed from a graph (calls above run their launches eagerly).
MAX_TOKENS = 32
#: Largest expected bytes of touched experts (:func:`expected_touched_experts` x one expert's bytes) replayed from
#: a graph, per launch the call would run eagerly (2 on the token-major path, 4 on the tiled one): what the H200
#: streams (3.5 TB/s) in the ~85 µs of host time one launch costs a slow process. Past it the GPU's work hides the
#: launches, and the replay's copies and clone only add ~10 µs of GPU time. The launches' host time scatters up to
#: 2x between processes (Qwen3-30B-A3B T = 1: 72.9 µs in one, 140.7 in another) while a replay's stays put, so the
#: bound sits where the launches win on a slow host too. Measured on seven shapes at T = 1, 8, 32 in three
#: processes (BENCHMARKS.md, "Eager decode calls replayed from CUDA graphs").
MAX_BYTES_PER_LAUNCH = 280 * 2**20
#: Graphs held at once (the oldest goes first).
MAX_GRAPHS = 512

_graphs: dict[tuple, _Entry] = {}
_pools: dict[int, tuple] = {}  # stream -> its graphs' shared memory pool
_side_streams: dict[int, torch.cuda.Stream] = {}  # device index -> the stream captures run on


class _Entry:
    """One captured call: its graph, the input buffers the replay reads and the output buffer it writes."""

    __slots__ = ("graph", "x", "routing", "weights", "out")

    def __init__(self, graph, x, routing, weights, out):
        self.graph, self.x, self.routing, self.weights, self.out = graph, x, routing, weights, out


def takes(call: RoutedMoECall, eager_cost: Callable[[RoutedMoECall], tuple[int, int]]) -> bool:
    """Whether ``call`` runs as a graph replay (module docstring). ``eager_cost(call)`` gives one local expert's
    bytes and the launches the call would run eagerly; it is asked last, after the cheaper checks pass."""
    if not ENABLED or torch.compiler.is_compiling():
        return False
    x = call.hidden_states
    T = x.shape[0]
    if not (x.is_cuda and call.do_finalize and call.gemm1_lora_delta is None and 0 < T <= MAX_TOKENS
            and not x.requires_grad):
        return False
    if call.packed is None and (call.topk[1].requires_grad or not call.topk[0].is_cuda):
        return False
    if call.output is not None and call.output.requires_grad:
        return False
    if x.device.index != torch.cuda.current_device() or torch.cuda.is_current_stream_capturing():
        return False
    expert_bytes, launches = eager_cost(call)
    touched = expected_touched_experts(T, call.top_k, call.num_experts, call.weights.num_local_experts)
    return touched * expert_bytes <= launches * MAX_BYTES_PER_LAUNCH


def expected_touched_experts(T: int, K: int, num_experts: int, num_local_experts: int) -> float:
    """Local experts that T tokens are expected to touch when each picks K distinct of ``num_experts`` uniformly:
    ``E_local * (1 - (1 - K/E)**T)`` (each local expert escapes a token with probability 1 - K/E). Skewed routers
    touch fewer, so a real call's bytes are at most this, give or take chance."""
    return num_local_experts * (1.0 - max(0.0, 1.0 - K / num_experts) ** T)


def _tensor_key(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype)


def key(call: RoutedMoECall, stream: torch.cuda.Stream) -> tuple:
    """What a graph of ``call`` replayed on ``stream`` reads by address or value (module docstring)."""
    x, W = call.hidden_states, call.weights
    routing_kind = None if call.packed is not None else (call.topk[0].dtype, call.topk[1].dtype)
    return (stream.cuda_stream, x.shape, x.dtype, routing_kind, call.num_experts, call.top_k,
            call.local_expert_offset, call.apply_router_weight_on_input, W.activation, W.gated, W.swiglu_alpha,
            W.swiglu_limit, torch.is_inference_mode_enabled(), _tensor_key(W.gemm1_weights),
            _tensor_key(W.gemm2_weights), _tensor_key(W.gemm1_bias), _tensor_key(W.gemm2_bias))


def run(call: RoutedMoECall, pipeline: Callable[..., tuple]) -> torch.Tensor:
    """``call``'s output from its key's graph (captured now if new). ``pipeline(routing, expert_weights, x, call)``
    runs the call's launches on those inputs and returns its output first (``triton_backend._pipeline``)."""
    x = call.hidden_states
    stream = torch.cuda.current_stream(x.device)
    routing, weights = (call.packed, None) if call.packed is not None else call.topk
    entry_key = key(call, stream)
    entry = _graphs.get(entry_key)
    if entry is None:
        entry = _capture(call, routing, weights, stream, pipeline)
        if len(_graphs) >= MAX_GRAPHS:
            del _graphs[next(iter(_graphs))]
        _graphs[entry_key] = entry
    entry.x.copy_(x)
    entry.routing.copy_(routing)
    if weights is not None:
        entry.weights.copy_(weights)
    entry.graph.replay()
    return entry.out.clone() if call.output is None else call.output.copy_(entry.out)


def _capture(call: RoutedMoECall, routing: torch.Tensor, weights: torch.Tensor | None,
             stream: torch.cuda.Stream, pipeline: Callable[..., tuple]) -> _Entry:
    """The call's graph over input buffers of its own (int32 ids, contiguous weights, as the pipeline reads them)."""
    x = call.hidden_states
    device = x.device
    static_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    static_routing = torch.empty(routing.shape, dtype=torch.int32, device=device)
    static_weights = None if weights is None else torch.empty(weights.shape, dtype=weights.dtype, device=device)
    if device.index not in _side_streams:
        _side_streams[device.index] = torch.cuda.Stream(device)
    if stream.cuda_stream not in _pools:
        _pools[stream.cuda_stream] = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    # the outer stream context puts the caller's stream back even when the capture's end raises; "thread_local":
    # other threads (NCCL's watchdog polls CUDA events) go on while this one captures
    with torch.cuda.stream(stream), torch.cuda.graph(graph, pool=_pools[stream.cuda_stream],
                                                     stream=_side_streams[device.index],
                                                     capture_error_mode="thread_local"):
        out = pipeline(static_routing, static_weights, static_x, call)[0]
    return _Entry(graph, static_x, static_routing, static_weights, out)


def clear() -> None:
    """Drop every captured graph and its buffers (their memory returns to torch's allocator)."""
    _graphs.clear()
    _pools.clear()


def held() -> int:
    """How many graphs are held now."""
    return len(_graphs)
