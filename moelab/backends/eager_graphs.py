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

``LoRAExperts`` calls on the triton backend replay the same way (:func:`takes_lora`, :func:`run_lora`): their inputs
are x, the ids, the weights and the adapter ids, each copied into a buffer of the caller's dtype, and the graph
holds the launches the backend's rule picks for the call while capturing (in a graph mostly the fused decode kernels
or tiles; the token-major kernels only at T = 1 with large experts or when forced; the adapter loop or vLLM's flow
for wide banks), so each call computes the bits of that path in a CUDA graph. Past ``MAX_TOKENS`` tokens, up to
``MAX_LORA_TOKENS``, a LoRA call replays from the second call of its key on: the first runs its launches, so a size
that comes once captures nothing, and both compute the same values (no path rule reads a capture there; the graph's
kernels are built with PDL's wait at their start, which lets them start early and wait for their inputs). A wide
bank's flow runs 7-13 launches there, whose host time outweighs the GPU's work up to ~1024 tokens. Their key adds
the dtypes of those inputs, whether the batch has adapters, the path options, and each tensor of the bank (and of
the module's bank) by address, shape and dtype, its rank table too: ``LoRABank.set`` writes a slot in place and is
read by the next replay; an assigned ``bank.ranks`` reaches the table at the next call, as on the launches.

The key is everything the captured launches read by address or by value: the current stream (graphs of one
stream share one memory pool, and a stream runs its replays one after the other, so their intermediates may share
memory), T, the routing's kind and dtypes, ``num_experts``, ``top_k``, ``local_expert_offset``, the router weight
on the input, the expert options, the dead-row fill (:func:`moelab.set_debug`), and each weight and bias tensor's
address, shape and dtype. A replay reads the
weights where the key says they are, so a call whose weights live there reads its own weights; weights updated in
place are read as updated. Entries live until ``MAX_GRAPHS`` are held (then the oldest goes) or :func:`clear`.
Each holds its static buffers (T x H inputs and output) and its share of the pool.

In place (``IN_PLACE``, on unless ``MOELAB_EAGER_GRAPHS_IN_PLACE=0``; on the H200 it takes a T = 1 call's host time
from 1.15-1.34x its graph's to 1.07-1.26x, a LoRA call's from 1.5-3.0x to 1.1-1.4x), a call whose inputs and output
lie where an earlier call's did (``IN_PLACE_AFTER`` times, as a decode loop's caching allocator hands a layer the
same blocks step after step) replays a graph of its own that reads those tensors and writes the output where they
lie: no copies in, no clone out, the host's work a key, a lookup and the replay. Its key adds the addresses; it
holds no reference to the caller's tensors; inputs of another dtype than the buffers', strided or not 16-byte
aligned keep the copies (a size-1 dimension's stride aside: read through a packed view). A key holds at most
``MAX_IN_PLACE_PER_KEY`` such graphs (a new address set replaces the one replayed least recently), all keys
``MAX_IN_PLACE_GRAPHS``; a key that lost ``MAX_IN_PLACE_EVICTIONS`` of them to those budgets captures no more. The
bits are the copy graph's: the same kernels on the same values (where fp32 atomics sum, as the LoRA W2 shrink does
for I > its tile's columns, the last bit may differ from run to run in either graph).

Plain calls by signature (:func:`replay_plain`, :func:`replay_plain_lora`): a ``moelab.routed_moe`` call with
``validate=False`` that asks for the output alone (no ``output``, delta or router weight on the input), or a
``LoRAExperts`` call with ``validate=False``, that replayed in place leaves its signature: what the checks,
:func:`takes` and the key read of it (its tensors' addresses, shapes, strides, dtypes and devices, its ints and their
types, the weights' and banks' keys, the stream, inference mode, the dead-row fill, the replay budgets) and its
output's address. The next call of that signature replays that graph before any check: it would pass them all and
find that key and those addresses. On the development CPU (``scripts/host_cost.py --stub-replays``, Qwen3-30B-A3B
and OLMoE at T = 1-32) that took a base call's host time from 20.0-20.5 to 11.3-11.5 µs and a one-adapter call's
from 35.6-39.0 to 22.9-23.1. A call whose graph went (the budgets, :func:`clear`) takes the whole way.

Not in any key: the module-level constants of the path rules (``FUSED_DECODE_MAX_SLOTS``, the token-major
thresholds, ``ADAPTER_LOOP_MAX_ROWS_PER_EXPERT``, ``MAX_FUSED_LORA_COLUMNS``, the TMA switches of
``moelab.kernels.moe_gemm``). A graph holds the path its capture chose; after changing one of them, call
:func:`clear` so the next call captures the new path.

Not taken (the call runs its launches as before): experts expected to weigh more than ``MAX_BYTES_PER_LAUNCH`` per
eager launch (the GPU's work hides the launches there), T above ``MAX_TOKENS`` (``LoRAExperts``: the first call of
a key past it, any above ``MAX_LORA_TOKENS``, and new keys past it once ``MAX_LORA_GRAPH_KEYS`` of them or
``MAX_LORA_GRAPH_TOKENS`` tokens hold graphs) or 0, an ``output`` not asked for
alone (``do_finalize=False`` or a delta: the permuted intermediates would be the graph's), a tile ``config``
forced, CPU tensors, a tensor on a device other than the current one, while a graph is captured or
``torch.compile`` traces, inputs that require grad, inference mode switched since the capture (part of the key),
and ``MOELAB_EAGER_GRAPHS=0``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from collections.abc import Callable

import torch

from moelab import _runtime
from moelab.contract import LoRAExpertsCall, MoEWeights, RoutedMoECall
from moelab.lora import LoRABank

__all__ = ["takes", "takes_lora", "expected_touched_experts", "key", "lora_key", "run", "run_lora", "replay_plain",
           "replay_plain_lora", "clear", "held",
           "MAX_TOKENS", "MAX_LORA_TOKENS", "MAX_LORA_GRAPH_KEYS", "MAX_LORA_GRAPH_TOKENS", "MAX_BYTES_PER_LAUNCH",
           "MAX_GRAPHS"]

#: Replay eager calls from CUDA graphs (``MOELAB_EAGER_GRAPHS=0``: never).
ENABLED: bool = os.environ.get("MOELAB_EAGER_GRAPHS", "1") == "1"
#: Largest T replayed from a graph (calls above run their launches eagerly; ``LoRAExperts``: ``MAX_LORA_TOKENS``).
MAX_TOKENS = 32
#: ``LoRAExperts`` calls of more than ``MAX_TOKENS`` tokens, up to this many, replay too, from the second call of
#: their key on: the first runs its launches, so a size that comes once (a prompt's prefill) captures nothing. A
#: wide bank's flow runs 7-13 launches there, and their host time outweighs the GPU's work: on an H100, eager calls
#: of 8 adapters (ranks 64/32/16/8) at Qwen3-30B-A3B T = 128 and 1024 took 850 and 1144-1321 µs of host time
#: against 600 and 794 µs in a CUDA graph (``scripts/host_cost.py``; 1321 µs from ``scripts/host_time.py``;
#: BENCHMARKS.md "Eager LoRA calls past 32 tokens"). Above 32 tokens no path rule reads whether a graph is captured
#: (the token-major kernels take at most 16 slots): the replay computes what the launches do, the graph's kernels
#: built with PDL's wait at their start.
MAX_LORA_TOKENS = 1024
#: Keys past ``MAX_TOKENS`` that hold graphs, and their tokens summed, beyond which no further such key captures (its
#: calls run their launches; ``clear`` frees them, and ``MAX_GRAPHS`` lets the oldest copy graphs go): each holds
#: T-row input and output buffers (8 KiB a token at H = 2048 in bf16: 512 MiB for the tokens here) and its share of
#: the pool, a model's layers each have keys of their own, and their copy graphs share ``MAX_GRAPHS`` with the
#: decode keys'.
MAX_LORA_GRAPH_KEYS = 128
MAX_LORA_GRAPH_TOKENS = 65536
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
#: In-place replays (on unless ``MOELAB_EAGER_GRAPHS_IN_PLACE=0``): a call whose inputs and
#: output lie where an earlier call's did replays a graph that reads them there and writes the output there, with
#: no copy in or out. Such a graph is captured once the same addresses came ``IN_PLACE_AFTER`` times (a decode
#: loop's caching allocator hands each layer the same blocks step after step); every other call takes the copies.
IN_PLACE: bool = os.environ.get("MOELAB_EAGER_GRAPHS_IN_PLACE", "1") != "0"
IN_PLACE_AFTER = 2
#: In-place graphs of one key (the least recently replayed goes for a new address set) and of all keys (the key
#: that replayed least recently loses its graphs first); their own budget, beside ``MAX_GRAPHS`` copy graphs.
MAX_IN_PLACE_PER_KEY = 4
MAX_IN_PLACE_GRAPHS = 512
#: In-place graphs a key may lose to those budgets before it captures no more (its calls keep the copy graph): a
#: call site whose addresses rotate through more sets than a key holds would otherwise capture on every call.
MAX_IN_PLACE_EVICTIONS = 2 * MAX_IN_PLACE_PER_KEY
#: Address sets counted at once before they earn a graph, and keys' eviction counts (all forgotten past it).
MAX_SIGHTINGS = 4096

_graphs: dict[tuple, _Entry] = {}
_sightings: dict[tuple, int] = {}  # (key, addresses) -> calls seen at those addresses without a graph
_repeats: set[tuple] = set()  # keys of LoRA calls past MAX_TOKENS seen once, without a graph yet
_in_place: dict[tuple, dict[tuple, _Entry]] = {}  # key -> addresses -> graph, least recently replayed first
_evictions: dict[tuple, int] = {}  # key -> in-place graphs it lost to the budgets
_plain: dict[tuple, tuple[tuple, tuple]] = {}  # a plain call's signature -> its key and addresses (replay_plain)
_pools: dict[int, tuple] = {}  # stream -> its graphs' shared memory pool
_side_streams: dict[int, torch.cuda.Stream] = {}  # device index -> the stream captures run on


class _Entry:
    """One captured call: its graph, the input buffers the replay reads and the output buffer it writes."""

    __slots__ = ("graph", "inputs", "out")

    def __init__(self, graph, inputs, out):
        self.graph, self.inputs, self.out = graph, inputs, out


def _replayable(x: torch.Tensor, inputs: tuple[torch.Tensor | None, ...], max_tokens: int | None = None) -> bool:
    """The checks every replayed call passes: CUDA inputs of at most ``max_tokens`` (None: ``MAX_TOKENS``) tokens
    on the current device, none requiring grad, no capture on this thread, replays on, not under
    ``torch.compile``."""
    max_tokens = MAX_TOKENS if max_tokens is None else max_tokens
    if not 0 < x.shape[0] <= max_tokens or any(t is not None and (t.requires_grad or not t.is_cuda) for t in inputs):
        return False
    return _may_replay(x)


def _may_replay(x: torch.Tensor) -> bool:
    """Replays on, not under ``torch.compile``, ``x`` on the current CUDA device and no capture on this thread."""
    return (ENABLED and not torch.compiler.is_compiling() and x.is_cuda
            and x.device.index == torch.cuda.current_device() and not torch.cuda.is_current_stream_capturing())


def _within_bound(T: int, top_k: int, num_experts: int, num_local_experts: int, cost: tuple[int, int]) -> bool:
    """Whether the expected bytes of touched experts stay within ``MAX_BYTES_PER_LAUNCH`` per eager launch
    (``cost``: one local expert's bytes and the launches the call would run eagerly)."""
    expert_bytes, launches = cost
    return expected_touched_experts(T, top_k, num_experts, num_local_experts) * expert_bytes <= (
        launches * MAX_BYTES_PER_LAUNCH)


def takes(call: RoutedMoECall, eager_cost: Callable[[RoutedMoECall], tuple[int, int]]) -> bool:
    """Whether ``call`` runs as a graph replay (module docstring). ``eager_cost(call)`` gives one local expert's
    bytes and the launches the call would run eagerly; it is asked last, after the cheaper checks pass."""
    x = call.hidden_states
    if not (call.do_finalize and call.gemm1_lora_delta is None):
        return False
    routing = (call.packed,) if call.packed is not None else call.topk
    if not _replayable(x, (x, *routing, call.output)):
        return False
    return _within_bound(x.shape[0], call.top_k, call.num_experts, call.weights.num_local_experts, eager_cost(call))


def takes_lora(call: LoRAExpertsCall, eager_cost: Callable[[LoRAExpertsCall], tuple[int, int]]) -> bool:
    """Whether a backend's ``lora_experts`` call runs as a graph replay: as :func:`takes` says for the base call, a
    bank with it or not (the bank's tensors, like the weights, are read where they live), up to
    ``MAX_LORA_TOKENS`` tokens (past ``MAX_TOKENS``, :func:`run_lora` runs a key's first call's launches)."""
    x = call.hidden_states
    if not _replayable(x, (x, call.topk_ids, call.topk_weights, call.lora_ids, call.output), MAX_LORA_TOKENS):
        return False
    return _within_bound(x.shape[0], call.top_k, call.num_experts, call.weights.num_local_experts, eager_cost(call))


def _came_back(entry_key: tuple) -> bool:
    """Whether a call of ``entry_key`` (:func:`lora_key`) replays where only a repeated key does: its key holds a
    graph, or came once before (this call captures it) and the keys past ``MAX_TOKENS`` that hold graphs stay
    within ``MAX_LORA_GRAPH_KEYS`` and ``MAX_LORA_GRAPH_TOKENS`` with it (counted only then: a size that comes once
    costs a set lookup)."""
    if entry_key in _graphs or entry_key in _in_place:
        return True
    if entry_key not in _repeats:
        if len(_repeats) >= MAX_SIGHTINGS:
            _repeats.clear()
        _repeats.add(entry_key)
        return False
    held = _large_keys_held()
    if len(held) >= MAX_LORA_GRAPH_KEYS or sum(map(_tokens, held)) + _tokens(entry_key) > MAX_LORA_GRAPH_TOKENS:
        return False  # stays in _repeats: asked again at its next call
    _repeats.discard(entry_key)
    return True


def _tokens(entry_key: tuple) -> int:
    """T of a :func:`lora_key` (its third item is x's shape)."""
    return entry_key[2][0]


def _large_keys_held() -> set[tuple]:
    """The LoRA keys past ``MAX_TOKENS`` that hold a copy graph or in-place graphs."""
    return {k for keys in (_graphs, _in_place) for k in keys if k[0] == "lora" and _tokens(k) > MAX_TOKENS}


def expected_touched_experts(T: int, K: int, num_experts: int, num_local_experts: int) -> float:
    """Local experts that T tokens are expected to touch when each picks K distinct of ``num_experts`` uniformly:
    ``E_local * (1 - (1 - K/E)**T)`` (each local expert escapes a token with probability 1 - K/E). Skewed routers
    touch fewer, so a real call's bytes are at most this, give or take chance."""
    return num_local_experts * (1.0 - max(0.0, 1.0 - K / num_experts) ** T)


def _tensor_key(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype)


def _weights_key(W: MoEWeights) -> tuple:
    """What a graph reads of the experts: their options by value, each weight and bias tensor by address."""
    return (W.activation, W.gated, W.swiglu_alpha, W.swiglu_limit, _tensor_key(W.gemm1_weights),
            _tensor_key(W.gemm2_weights), _tensor_key(W.gemm1_bias), _tensor_key(W.gemm2_bias))


def _bank_key(bank: LoRABank | None) -> tuple | None:
    """A bank's sizes and dtype, and the address of each of its tensors and of its rank table (brought up to date
    with ``bank.ranks`` first, as every eager call does: a replay reads the table where it lives). The tensors'
    shapes follow from the sizes (``LoRABank`` allocates them contiguous)."""
    if bank is None:
        return None
    # bank.rank_table() is load-bearing, not just an address: it copies ranks assigned since the last call
    # (bank.ranks = ..., LoRABank.load, expert-parallel rebalancing) into the table before a capture or replay
    return (bank.gate_a.device, bank.max_loras, bank.num_local_experts, bank.hidden_size, bank.intermediate_size,
            bank.max_rank, bank.gate_a.dtype, bank.gate_a.data_ptr(), bank.gate_b.data_ptr(), bank.up_a.data_ptr(),
            bank.up_b.data_ptr(), bank.down_a.data_ptr(), bank.down_b.data_ptr(), bank.rank_table().data_ptr())


def key(call: RoutedMoECall, stream: torch.cuda.Stream) -> tuple:
    """What a graph of ``call`` replayed on ``stream`` reads by address or value (module docstring)."""
    x = call.hidden_states
    routing_kind = None if call.packed is not None else (call.topk[0].dtype, call.topk[1].dtype)
    return (stream.cuda_stream, x.shape, x.dtype, routing_kind, call.num_experts, call.top_k,
            call.local_expert_offset, call.apply_router_weight_on_input, torch.is_inference_mode_enabled(),
            _runtime.DEBUG_DEAD_ROWS, _weights_key(call.weights))


def lora_key(call: LoRAExpertsCall, stream: torch.cuda.Stream) -> tuple:
    """As :func:`key`, for a ``lora_experts`` call: also the dtypes of its ids, weights and adapter ids, whether
    the batch has adapters, the path options and both banks (``call.lora`` and the module's ``call.bank``)."""
    x, ids = call.hidden_states, call.topk_ids
    lora_ids = None if call.lora_ids is None else call.lora_ids.dtype
    return ("lora", stream.cuda_stream, x.shape, x.dtype, ids.dtype, call.topk_weights.dtype, lora_ids,
            call.num_experts, call.top_k, call.local_expert_offset, call.fused, call.path,
            torch.is_inference_mode_enabled(), _runtime.DEBUG_DEAD_ROWS, _weights_key(call.weights),
            _bank_key(call.lora), call.bank is call.lora or _bank_key(call.bank))


def run(call: RoutedMoECall, pipeline: Callable[..., tuple]) -> torch.Tensor:
    """``call``'s output from its key's graph (captured now if new). ``pipeline(routing, expert_weights, x, call)``
    runs the call's launches on those inputs and returns its output first (``triton_backend._pipeline``)."""
    x = call.hidden_states
    stream = torch.cuda.current_stream(x.device)
    routing, weights = (call.packed, None) if call.packed is not None else call.topk
    buffers = (x.dtype, torch.int32, None if weights is None else weights.dtype)  # as the pipeline reads them
    entry_key = key(call, stream)

    def launches(static_x, static_routing, static_weights, out=None):
        return pipeline(static_routing, static_weights, static_x, call, out)[0]

    def remember(addresses: tuple, output: torch.Tensor) -> None:  # replay_plain's entry for the next such call
        # not where the graph reads a copy of the caller's words (strided: validate_call's contiguous copy)
        if (call.output is None and not call.apply_router_weight_on_input
                and (call.packed is None or call.packed is call.topk)):
            _remember(_plain_signature(call.topk, x, call.weights, call.num_experts, call.top_k,
                                       call.local_expert_offset, stream.cuda_stream, output), entry_key, addresses)

    return _replay(entry_key, stream, (x, routing, weights), buffers, launches, call.output, x.shape,
                   remember=remember)


def replay_plain(topk, x, weights, num_experts, top_k, local_expert_offset) -> torch.Tensor | None:
    """The output of a plain ``routed_moe`` call (``moelab.routed_moe``'s arguments; no ``output``, delta or
    ``apply_router_weight_on_input``, ``validate=False``, ``do_finalize``) that replays in place, or None (the call
    takes the checks and :func:`run`). A call whose signature (:func:`_plain_signature`: its tensors' addresses,
    shapes, strides, dtypes and devices, its ints, the weights' key, the stream, the output's address) equals that
    of an earlier call that replayed in place passed the same checks and has the same key and addresses: it
    replays that graph without them, the host's work one signature, two lookups and the replay. The ints' types
    are checked first (8.0 == 8 in a tuple's comparison, and a float would fail the checks)."""
    if not _plain or not (type(x) is torch.Tensor and type(weights) is MoEWeights and type(num_experts) is int
                          and type(top_k) is int and type(local_expert_offset) is int):
        return None
    return _replay_signed(x, lambda stream, output: _plain_signature(topk, x, weights, num_experts, top_k,
                                                                     local_expert_offset, stream, output))


def _plain_signature(topk, x: torch.Tensor, weights: MoEWeights, num_experts: int, top_k: int,
                     local_expert_offset: int, stream: int, output: torch.Tensor) -> tuple | None:
    """What :func:`validate_call <moelab.moe.validate_call>`, :func:`takes` and :func:`key` read of a plain call,
    and its tensors' addresses (None: routing neither a tensor nor a tuple of two)."""
    if type(topk) is torch.Tensor:
        routing = (topk.data_ptr(), topk.shape, topk.stride(), topk.dtype, topk.device)
    elif type(topk) is tuple and len(topk) == 2 and all(type(t) is torch.Tensor for t in topk):
        ids, w = topk
        routing = (ids.data_ptr(), ids.shape, ids.stride(), ids.dtype, ids.device, ids.requires_grad,
                   w.data_ptr(), w.shape, w.stride(), w.dtype, w.device, w.requires_grad)
    else:
        return None
    return (stream, x.data_ptr(), x.shape, x.stride(), x.dtype, x.device, x.requires_grad, routing,
            output.data_ptr(), num_experts, top_k, local_expert_offset, torch.is_inference_mode_enabled(),
            _runtime.DEBUG_DEAD_ROWS, MAX_TOKENS, MAX_BYTES_PER_LAUNCH, weights.backend, weights.num_local_experts,
            weights.hidden_size, weights.intermediate_size, _weights_key(weights))


def run_lora(call: LoRAExpertsCall, lora_experts: Callable[[LoRAExpertsCall], torch.Tensor]) -> torch.Tensor:
    """``call.output`` written from its key's graph of ``lora_experts(call)`` (a backend's launches for it) over
    input buffers of the graph's own, captured now if new. Past ``MAX_TOKENS`` a key's first call (and any call
    past the budgets of :func:`_came_back`) runs the launches on its own tensors, its addresses counted as an
    in-place replay's sighting: a second call at the same addresses captures the in-place graph alone."""
    x = call.hidden_states
    stream = torch.cuda.current_stream(x.device)
    entry_key = lora_key(call, stream)
    inputs = (x, call.topk_ids, call.topk_weights, call.lora_ids)
    buffers = tuple(None if t is None else t.dtype for t in inputs)  # as the caller gave them

    def launches(static_x, static_ids, static_weights, static_lora_ids, out=None):
        if out is None:
            out = torch.empty_like(call.output, memory_format=torch.contiguous_format)
        return lora_experts(dataclasses.replace(call, hidden_states=static_x, topk_ids=static_ids,
                                                topk_weights=static_weights, lora_ids=static_lora_ids, output=out))

    def remember(addresses: tuple, output: torch.Tensor) -> None:  # replay_plain_lora's entry for the next call
        _remember(_plain_lora_signature(x, call.topk_weights, call.topk_ids, call.lora_ids, call.weights,
                                        call.num_experts, call.top_k, call.local_expert_offset, call.lora, call.bank,
                                        call.fused, call.path, stream.cuda_stream, output), entry_key, addresses)

    capture = x.shape[0] <= MAX_TOKENS or _came_back(entry_key)
    return _replay(entry_key, stream, inputs, buffers, launches, call.output, call.output.shape, capture, remember)


def replay_plain_lora(module, x, topk_weights, topk_ids, lora_ids, has_lora) -> torch.Tensor | None:
    """As :func:`replay_plain`, for a :class:`moelab.LoRAExperts` ``module`` called with ``validate=False`` (its
    arguments): the output of a call whose signature equals that of an earlier call that replayed in place, or
    None (the call takes ``forward``'s checks and :func:`run_lora`). The signature adds the module's options and
    both banks' tensors by address, shape and stride (the rank table brought up to date, as every call does). Not
    taken where ``forward`` would read the adapter ids on the host (``has_lora`` None, ids on the CPU) or check ids
    it then drops (``has_lora=False``)."""
    if not _plain or not (type(x) is torch.Tensor and type(topk_weights) is torch.Tensor
                          and type(topk_ids) is torch.Tensor and (lora_ids is None or type(lora_ids) is torch.Tensor)):
        return None
    if lora_ids is not None and (has_lora is False or (has_lora is None and lora_ids.device.type == "cpu")):
        return None  # forward checks ids it then drops, or reads them on the host
    lora = None if lora_ids is None else module.lora  # the bank the call applies (has_lora True or None here)
    return _replay_signed(x, lambda stream, output: _plain_lora_signature(
        x, topk_weights, topk_ids, lora_ids, module.weights, module.num_experts, module.top_k,
        module.local_expert_offset, lora, module.lora, module.fused, module._path, stream, output))


def _remember(signature: tuple | None, entry_key: tuple, addresses: tuple) -> None:
    """Keep the in-place graph of ``entry_key`` at ``addresses`` for calls of ``signature`` (None: nothing kept)."""
    if signature is not None:
        if len(_plain) >= MAX_SIGHTINGS:
            _plain.clear()
        _plain[signature] = (entry_key, addresses)


def _replay_signed(x: torch.Tensor, signature_of: Callable[[int, torch.Tensor], tuple | None]) -> torch.Tensor | None:
    """A new output shaped as ``x``, written by the in-place graph kept (:func:`_remember`) for
    ``signature_of(stream, output)``; None where in-place replays are off or not allowed here (:func:`_may_replay`)
    or no graph is held for that signature."""
    if not (IN_PLACE and _may_replay(x)):
        return None
    output = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    known = _plain.get(signature_of(torch.cuda.current_stream(x.device).cuda_stream, output))
    if known is None or not _replay_held(*known):
        return None
    return output


def _plain_lora_signature(x, topk_weights, topk_ids, lora_ids, weights, num_experts, top_k, local_expert_offset,
                          lora, bank, fused, path, stream: int, output: torch.Tensor) -> tuple | None:
    """What ``LoRAExperts.forward``'s checks, :func:`takes_lora` and :func:`lora_key` read of a call (``lora``:
    the bank the call applies, None without adapters; ``bank``: the module's), and its tensors' addresses (None:
    ints of other types, which the checks would refuse)."""
    if not (type(num_experts) is int and type(top_k) is int and type(local_expert_offset) is int):
        return None
    ids = None if lora_ids is None else (lora_ids.data_ptr(), lora_ids.shape, lora_ids.stride(), lora_ids.dtype,
                                         lora_ids.device)
    banks = None if bank is None else (_bank_key(bank), lora is bank, *(
        (t.shape, t.stride()) for t in (bank.gate_a, bank.gate_b, bank.up_a, bank.up_b, bank.down_a, bank.down_b)))
    return ("lora", stream, x.data_ptr(), x.shape, x.stride(), x.dtype, x.device, x.requires_grad,
            topk_weights.data_ptr(), topk_weights.shape, topk_weights.stride(), topk_weights.dtype,
            topk_weights.device, topk_weights.requires_grad, topk_ids.data_ptr(), topk_ids.shape,
            topk_ids.stride(), topk_ids.dtype, topk_ids.device, ids, lora is None, banks, output.data_ptr(),
            num_experts, top_k, local_expert_offset, fused, path, torch.is_inference_mode_enabled(),
            _runtime.DEBUG_DEAD_ROWS, MAX_TOKENS, MAX_LORA_TOKENS, MAX_BYTES_PER_LAUNCH, weights.backend,
            weights.num_local_experts, weights.hidden_size, weights.intermediate_size, _weights_key(weights))


def _replay(entry_key: tuple, stream: torch.cuda.Stream, inputs: tuple[torch.Tensor | None, ...],
            buffers: tuple[torch.dtype | None, ...], launches: Callable[..., torch.Tensor],
            output: torch.Tensor | None, out_shape: torch.Size, capture: bool = True,
            remember: Callable[[tuple, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Copy ``inputs`` into the graph's buffers (of dtypes ``buffers``; None: no input), replay, and return a copy
    of its output (or ``output`` written). A new key captures ``launches(*buffers)`` first. With ``IN_PLACE``,
    :func:`_replay_in_place` first (``out_shape``: the output's, in ``inputs[0]``'s dtype; ``remember(addresses,
    output)`` after an in-place replay). ``capture`` False: no new graph; where none is held,
    ``launches(*inputs, out=output)`` runs on the caller's tensors."""
    if IN_PLACE:
        if output is None:  # the caller's new output; where it lies decides the in-place graph, as the inputs do
            output = torch.empty(out_shape, dtype=inputs[0].dtype, device=inputs[0].device)
        if _replay_in_place(entry_key, stream, inputs, buffers, launches, output, capture, remember):
            return output
    entry = _graphs.get(entry_key)
    if entry is None:
        if not capture:
            return launches(*inputs, out=output)
        entry = _capture(_buffers_like(inputs, buffers), stream, launches)
        if len(_graphs) >= MAX_GRAPHS:
            del _graphs[next(iter(_graphs))]
        _graphs[entry_key] = entry
    for static, given in zip(entry.inputs, inputs):
        if given is not None:
            static.copy_(given)
    entry.graph.replay()
    return entry.out.clone() if output is None else output.copy_(entry.out)


def _replay_in_place(entry_key: tuple, stream: torch.cuda.Stream, inputs: tuple[torch.Tensor | None, ...],
                     buffers: tuple[torch.dtype | None, ...], launches: Callable[..., torch.Tensor],
                     output: torch.Tensor, capture: bool = True,
                     remember: Callable[[tuple, torch.Tensor], None] | None = None) -> bool:
    """Whether ``output`` was written by replaying a graph that reads ``inputs`` and writes ``output`` where they
    lie now. Not (False) for an input or output not as the buffers would hold it (dtype, contiguous, 16-byte
    aligned) or for addresses not yet seen ``IN_PLACE_AFTER`` times. A contiguous tensor's memory is laid out as the
    buffers' are, whatever the stride of a size-1 dimension (a one-token batch's top-k ids, a (1, K) slice of a
    (1, E) tensor); the capture reads it through packed strides, so the kernels specialise as on the buffers and
    both graphs run the same kernels. The graph holds no reference to those tensors (one would keep their blocks
    from coming back to the next call). ``capture`` False: the addresses are counted, but no graph is captured.
    ``remember(addresses, output)``: called after the replay."""
    pointers = []
    for t, dtype in zip((*inputs, output), (*buffers, inputs[0].dtype)):
        if t is None:
            pointers.append(0)
        elif t.dtype != dtype or not t.is_contiguous() or (pointer := t.data_ptr()) % 16:
            return False  # the copies into the buffers make it so
        else:
            pointers.append(pointer)
    addresses = tuple(pointers)
    if not _replay_held(entry_key, addresses):
        if _evictions.get(entry_key, 0) >= MAX_IN_PLACE_EVICTIONS:
            return False  # this call site's addresses do not come back often enough to pay for captures
        seen = _sightings.get((entry_key, addresses), 0) + 1
        if seen < IN_PLACE_AFTER or not capture:
            if len(_sightings) >= MAX_SIGHTINGS:
                _sightings.clear()
            _sightings[entry_key, addresses] = seen
            return False
        _sightings.pop((entry_key, addresses), None)
        entry = _capture(tuple(map(_packed, inputs)), stream, launches, _packed(output))
        entry.inputs, entry.out = (), None  # nothing of the caller's stays alive through the entry
        graphs = _in_place.pop(entry_key, None) or {}
        if len(_evictions) >= MAX_SIGHTINGS:
            _evictions.clear()
        while len(graphs) >= MAX_IN_PLACE_PER_KEY:
            del graphs[next(iter(graphs))]
            _evictions[entry_key] = _evictions.get(entry_key, 0) + 1
        while _in_place and sum(map(len, _in_place.values())) + len(graphs) >= MAX_IN_PLACE_GRAPHS:
            oldest = next(iter(_in_place))
            _evictions[oldest] = _evictions.get(oldest, 0) + len(_in_place.pop(oldest))
        graphs[addresses] = entry
        _in_place[entry_key] = graphs
        entry.graph.replay()
    if remember is not None:
        remember(addresses, output)
    return True


def _replay_held(entry_key: tuple, addresses: tuple) -> bool:
    """Whether ``entry_key`` held an in-place graph of ``addresses``, now replayed (and the most recent)."""
    graphs = _in_place.get(entry_key)
    entry = None if graphs is None else graphs.pop(addresses, None)
    if entry is None:
        return False
    _in_place.pop(entry_key, None)  # to be put back last (another thread may have taken it out)
    graphs[addresses] = entry  # the most recently replayed last, of the key and among the keys
    _in_place[entry_key] = graphs
    entry.graph.replay()
    return True


def _packed(t: torch.Tensor | None) -> torch.Tensor | None:
    """Contiguous ``t`` viewed with the strides of a contiguous tensor of its shape (the same memory)."""
    if t is None:
        return None
    strides = _packed_strides(t.shape)
    return t if t.stride() == strides else t.as_strided(t.shape, strides)


def _packed_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (``is_contiguous`` also accepts other strides of size-1
    dimensions, which Triton would specialise differently)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _buffers_like(inputs: tuple[torch.Tensor | None, ...],
                  buffers: tuple[torch.dtype | None, ...]) -> tuple[torch.Tensor | None, ...]:
    """Contiguous input buffers of the graph's own, shaped as ``inputs``, of dtypes ``buffers``."""
    device = inputs[0].device
    return tuple(None if t is None else torch.empty(t.shape, dtype=dtype, device=device)
                 for t, dtype in zip(inputs, buffers))


def _capture(static: tuple[torch.Tensor | None, ...], stream: torch.cuda.Stream,
             launches: Callable[..., torch.Tensor], out: torch.Tensor | None = None) -> _Entry:
    """A graph of ``launches`` over the tensors ``static`` (its output allocated in the graph's pool, or written
    to ``out``)."""
    device = static[0].device
    if device.index not in _side_streams:
        _side_streams[device.index] = torch.cuda.Stream(device)
    if stream.cuda_stream not in _pools:
        _pools[stream.cuda_stream] = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    # No cyclic garbage collection while capturing: a CUDA graph it frees (one the caller dropped) would run its
    # destructor's CUDA calls in the capture, which invalidates it. The outer stream context puts the caller's
    # stream back even when the capture's end raises; "thread_local": other threads (NCCL's watchdog polls CUDA
    # events) go on while this one captures.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph, pool=_pools[stream.cuda_stream],
                                                         stream=_side_streams[device.index],
                                                         capture_error_mode="thread_local"):
            out = launches(*static, out=out)
    finally:
        if collecting:
            gc.enable()
    return _Entry(graph, static, out)


def clear() -> None:
    """Drop every captured graph and its buffers (their memory returns to torch's allocator)."""
    _graphs.clear()
    _pools.clear()
    _sightings.clear()
    _repeats.clear()
    _in_place.clear()
    _evictions.clear()
    _plain.clear()


def held() -> int:
    """How many graphs are held now (copy graphs and in-place ones)."""
    return len(_graphs) + sum(map(len, _in_place.values()))
