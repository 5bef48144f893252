"""Host cost of one eager ``moelab.routed_moe`` call on the triton backend, on a CPU (kernels stubbed) or a CUDA GPU.

    python scripts/host_cost.py                                   # T=1,32; Qwen3-30B-A3B, OLMoE, Mixtral, GPT-OSS
    python scripts/host_cost.py --shape qwen3-30b-a3b --tokens 1 --rounds 9 --calls 300
    python scripts/host_cost.py --profile 2000                    # + where the host time goes (cProfile)
    python scripts/host_cost.py --launches a.json                 # + what Triton was asked to compile (CPU only)
    python scripts/host_cost.py --lora 16                         # LoRAExperts, one rank-16 adapter on every token
    python scripts/host_cost.py --lora 16 --stub-replays          # CPU: a replayed call's host cost (graph stubbed)
    python scripts/host_cost.py --lora 64,32,16,8 --tokens 128,1024 --compare-replays   # + replays off, same process
    PYTHONPATH=/path/to/other/tree python scripts/host_cost.py    # another tree's moelab (the path printed first)

Each shape and T: the call the bench's "moelab triton" row makes (packed routing words, ``validate=False``, plain
SwiGLU unless ``--activation``/``--bias``), repeated ``--calls`` times back to back in each of ``--rounds`` rounds;
the best round's µs per call, and per kernel launch. ``--lora R[,R...]``: the bench's "moelab LoRAExperts" row
instead (``has_lora=True``, ``validate=False``): a bank of one adapter per rank given, the tokens spread over them
in turn (``--lora 16``: table 5's one rank-16 adapter on every token).

Without a CUDA GPU (any CPU box): moelab's kernels are built as they are for a GPU (``TRITON_INTERPRET=0``:
:class:`moelab.kernels.launch.CachedLaunchJIT`, not the interpreter), and Triton is stubbed below them: its
``JITFunction.run`` (the first launch of each signature: dispatch and compile) returns a stand-in compiled kernel
whose launch does nothing. The time is then moelab's own Python (checks, host arithmetic, ``torch.empty`` of CPU
buffers) and ``CachedLaunchJIT``'s argument binding and signature: everything of a call but Triton's compiled
launcher and the GPU (meant for decode sizes: from T ~ 1024 the CPU's own fills and page faults of large buffers
dominate and say nothing about a GPU). The tile configs are the H200's (its compute capability and shared memory),
and the weights are never written (``torch.empty``: a Mixtral layer costs no memory). ``dispatches`` counts
launches that missed ``CachedLaunchJIT``'s table in the timed rounds (each one is Triton's full dispatch on a GPU):
it must be 0.
``--launches FILE`` writes, for every launch that reached Triton's ``run``, the kernel, grid, launch options and
each parameter by name as Triton specializes it (a tensor by dtype and 16-byte alignment, anything else by value):
two trees whose files are equal launch the same compiled kernels with the same arguments.

On a CUDA GPU the calls are real: the time per call is wall time with ``torch.cuda.synchronize()`` only after each
round (at decode sizes the host is the bottleneck, so this is the host time; where the GPU work is longer, e.g.
Mixtral, it is the GPU's), beside the same call replayed from a CUDA graph (the GPU time) and their ratio (issue
12's target: eager <= 1.5x graph at T = 1 and 32), and then the same eager call timed as ``moelab.bench`` times it
(``moelab.roofline.median_us``: ``do_bench``, CUDA events around each call after an L2 flush, no synchronize
between calls). That timing hides host time up to the flush's GPU time: while the GPU clears the L2 buffer, the host
already launches the call, so host-bound calls read faster there than back to back. Prints only.

``--shape``: names of ``moelab.roofline.SHAPES`` (comma list) or ``E,K,H,I`` shapes (';' separates them).
``--layers N``: N layers of their own weights, each call one layer after the other (a model's forward pass, where
the next layer's weights are not in the L2, so back-to-back calls do not replay warm weights); the graph replays the
same N calls; every time is per layer.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # moelab's kernels as a GPU builds them (before moelab imports triton), launched by the stubs below
    os.environ["TRITON_INTERPRET"] = "0"
sys.path.append(str(Path(__file__).resolve().parents[1]))  # this tree's moelab, unless PYTHONPATH names another

import moelab  # noqa: E402
from moelab.bench.cli import _split_shapes  # noqa: E402
from moelab.roofline import back_to_back_us, get_shape, median_us  # noqa: E402

#: What the stubbed Triton saw: first launches of a signature (``dispatch``) and stubbed compiled launches.
COUNTS = {"dispatch": 0, "launch": 0}
#: ``--launches``: every launch that reached the stubbed ``JITFunction.run``, its arguments by name.
LAUNCHES: list = []


class _StubCompiledKernel:
    """Stands for Triton's ``CompiledKernel``: ``kernel[grid](*args)`` counts the launch and does nothing else."""

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args):
        COUNTS["launch"] += 1


def _stub_triton() -> None:
    """Replace what a CPU cannot run: Triton's dispatch and compile (``JITFunction.run``), the current CUDA device
    that ``CachedLaunchJIT`` keys launches on, the device limits the tile choice reads (an H200's), and the
    triton backend's availability check and moelab's (CPU tensors are not interpreted here: the LoRA deltas, the
    unpermute and the finalize of vLLM's flow take their Triton kernels, as on a GPU)."""
    import inspect

    from triton.runtime import JITFunction

    from moelab import _runtime
    from moelab.backends import triton_backend
    from moelab.kernels import launch, moe_gemm

    def run(self, *args, grid, warmup, **kwargs):
        # Triton's own binding would reject these; check them here, so a stubbed call binds as a real one would
        params = {k: v for k, v in kwargs.items() if k in self.arg_names}
        bound = inspect.signature(self.fn).bind(*args, **params)
        assert isinstance(grid, tuple) and all(type(g) is int and g > 0 for g in grid), (self.fn.__name__, grid)
        bound.apply_defaults()
        LAUNCHES.append(dict(kernel=self.fn.__name__, grid=list(grid), options=sorted(
            (k, repr(v)) for k, v in kwargs.items() if k not in params), args={
            k: f"tensor {v.dtype} aligned={v.data_ptr() % 16 == 0}" if isinstance(v, torch.Tensor) else repr(v)
            for k, v in bound.arguments.items()}))
        COUNTS["dispatch"] += 1
        COUNTS["launch"] += 1
        return _StubCompiledKernel()

    JITFunction.run = run
    launch.current_device = lambda: 0
    h200 = moe_gemm.DeviceLimits((9, 0), 232448)
    moe_gemm.device_limits = lambda device: h200
    triton_backend.unavailable_reason = lambda device: None
    _runtime.triton_can_run = lambda device: True


def _stub_replays() -> None:
    """CPU, ``--stub-replays``: eager calls of at most ``MAX_TOKENS`` (``LoRAExperts``: ``MAX_LORA_TOKENS``, from a
    key's second call) take ``eager_graphs``' replay path as on a GPU, with a stand-in graph whose replay does
    nothing and a stand-in current stream; the copies into its buffers (CPU memcpys here, copy kernels a GPU
    launches) and all of moelab's Python on the way run as they are (``MOELAB_EAGER_GRAPHS_IN_PLACE=0``: no in-place
    replays). The outputs' ``torch.empty`` (``eager_graphs``' and ``LoRAExperts.forward``'s) reuses freed blocks as
    CUDA's caching allocator does (``scripts/reusing_empty.py``)."""
    import types

    from reusing_empty import ReusingTorch  # scripts/ is on sys.path when run as a script

    from moelab import experts
    from moelab.backends import eager_graphs

    eager_graphs.torch = experts.torch = ReusingTorch()

    class _Graph:
        def replay(self):
            COUNTS["replay"] = COUNTS.get("replay", 0) + 1

    def capture(static, stream, launches, out=None):
        x = static[0]
        return eager_graphs._Entry(_Graph(), static, torch.empty(x.shape, dtype=x.dtype) if out is None else out)

    eager_graphs._capture = capture
    eager_graphs._replayable = lambda x, inputs, max_tokens=None: eager_graphs.ENABLED and 0 < x.shape[0] <= (
        eager_graphs.MAX_TOKENS if max_tokens is None else max_tokens)
    eager_graphs._may_replay = lambda x: eager_graphs.ENABLED
    stream = types.SimpleNamespace(cuda_stream=0)
    torch.cuda.current_stream = lambda device=None: stream


def make_call(shape: str, T: int, activation: str, bias: bool, lora_ranks: list[int] | None = None):
    """The bench's eager call of ``shape`` at ``T`` tokens (returns a function of no arguments); with
    ``lora_ranks``, its ``LoRAExperts`` call of a bank of those adapters, token t on adapter t % len."""
    s = get_shape(shape)
    dev, dt = ("cuda" if CUDA else "cpu"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = 2 * s.I
    if CUDA:
        w13 = torch.randn(s.E, rows, s.H, device=dev, dtype=dt, generator=g) / s.H**0.5
        w2 = torch.randn(s.E, s.H, s.I, device=dev, dtype=dt, generator=g) / s.I**0.5
    else:  # never read: the kernels do not run
        w13, w2 = torch.empty(s.E, rows, s.H, dtype=dt), torch.empty(s.E, s.H, s.I, dtype=dt)
    expert = {} if activation == "silu" else {"activation": activation}
    if bias:
        expert |= dict(w13_bias=torch.randn(s.E, rows, device=dev, dtype=dt, generator=g) / 8,
                       w2_bias=torch.randn(s.E, s.H, device=dev, dtype=dt, generator=g) / 8)
    W = moelab.prepare_weights(w13, w2, backend="triton", **expert)
    x = torch.randn(T, s.H, device=dev, dtype=dt, generator=g)
    ids = torch.rand(T, s.E, device=dev, generator=g).argsort(dim=1)[:, :s.K].int()
    packed = moelab.pack_topk_ids_weights(ids, torch.rand(T, s.K, device=dev, generator=g))
    E, K = s.E, s.K
    if lora_ranks:
        bank = moelab.LoRABank(len(lora_ranks), E, s.H, s.I, max(lora_ranks), dtype=dt, device=dev)
        for slot, r in enumerate(lora_ranks):  # the values do not matter here: the call's path does
            bank.set(slot, **{name: torch.zeros(E, *dims, dtype=dt, device=dev) for name, dims in (
                ("gate_a", (r, s.H)), ("up_a", (r, s.H)), ("gate_b", (s.I, r)), ("up_b", (s.I, r)),
                ("down_a", (r, s.I)), ("down_b", (s.H, r)))})
        mod = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton")
        weights = torch.rand(T, K, device=dev, generator=g)
        lora_ids = (torch.arange(T, device=dev) % len(lora_ranks)).int()
        return lambda: mod(x, weights, ids, lora_ids, has_lora=True, validate=False)
    return lambda: moelab.routed_moe(packed, x, W, num_experts=E, top_k=K, validate=False)[0]


def launches_per_call(call) -> int:
    """Kernel launches of one call (on a GPU: calls of moelab's launch entry, ``CachedLaunchJIT._launch`` where the
    tree has it, else ``CachedLaunchJIT.run``)."""
    if not CUDA:
        before = COUNTS["launch"]
        call()
        return COUNTS["launch"] - before
    from moelab.kernels.launch import CachedLaunchJIT

    name = "_launch" if "_launch" in CachedLaunchJIT.__dict__ else "run"
    entry = CachedLaunchJIT.__dict__[name]
    seen = []

    def counting(self, *args, **kwargs):
        seen.append(self)
        return entry(self, *args, **kwargs)

    setattr(CachedLaunchJIT, name, counting)
    try:
        call()
        torch.cuda.synchronize()
    finally:
        setattr(CachedLaunchJIT, name, entry)
    return len(seen)


def in_place_replays(call, calls: int = 5) -> tuple[int, int, int]:
    """Of the graph replays ``calls`` calls of ``call`` ask for, how many ran in place (no input copies, no output
    clone: ``eager_graphs._replay_in_place`` true, or a plain call replayed by its signature), how many there were,
    and how many of the in-place ones went by signature (``replay_plain``, ``replay_plain_lora``: no checks, no key;
    trees without them: 0)."""
    from moelab.backends import eager_graphs

    outcomes, by_signature = [], []

    def counting(tried, into):  # what each call gave: True, False, or whether an output (held not: its block)
        def run(*args):
            got = tried(*args)
            into.append(got if isinstance(got, bool) else got is not None)
            return got
        return run

    names = [name for name in ("replay_plain", "replay_plain_lora") if hasattr(eager_graphs, name)]
    originals = {name: getattr(eager_graphs, name) for name in ["_replay_in_place", *names]}
    eager_graphs._replay_in_place = counting(originals["_replay_in_place"], outcomes)
    for name in names:
        setattr(eager_graphs, name, counting(originals[name], by_signature))
    try:
        for _ in range(calls):
            call()
    finally:
        for name, fn in originals.items():
            setattr(eager_graphs, name, fn)
    signed = sum(by_signature)
    return sum(outcomes) + signed, len(outcomes) + signed, signed


def host_us(call, rounds: int, calls: int) -> float:
    """Best round's µs per call (``calls`` back to back; on a GPU one synchronize after each round)."""
    return back_to_back_us(call, torch.device("cuda" if CUDA else "cpu"), calls=calls, rounds=rounds)


def graph_us(call, calls: int) -> float:
    """µs per replay of ``call`` captured in a CUDA graph (the GPU time of the call)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def measure(shape: str, T: int, a) -> None:
    layers = [make_call(shape, T, a.activation, a.bias, a.lora and [int(r) for r in a.lora.split(",")])
              for _ in range(a.layers)]
    call = layers[0] if a.layers == 1 else lambda: [layer() for layer in layers]
    for _ in range(20):  # first launches: Triton's dispatch (and on a GPU the compile)
        call()
    n = launches_per_call(call) // a.layers
    dispatched = COUNTS["dispatch"]
    us = host_us(call, a.rounds, a.calls) / a.layers
    # no Triton launch counted: the call replays a graph of its own (moelab/backends/eager_graphs.py)
    launches = f"{us / n:6.1f} µs/launch  ({n} launches" if n else "  one graph replay  (eager_graphs"
    if not n:  # whether the replays ran in place or through the copies, counted after the timed rounds
        placed, replays, signed = in_place_replays(call)
        launches += f", in place {placed}/{replays}, by signature {signed}"
    line = f"{shape:15s} T={T:<4d} host {us:7.1f} µs/call  {launches}"
    if a.layers > 1:
        line += f", {a.layers} layers in turn"
    off = None
    if a.compare_replays:  # the same calls with the eager replays off, in this process (rounds alternating)
        from moelab.backends import eager_graphs

        ons, offs = [us], []
        for _ in range(2):
            eager_graphs.ENABLED = False
            offs.append(host_us(call, a.rounds, a.calls) / a.layers)
            eager_graphs.ENABLED = True
            ons.append(host_us(call, a.rounds, a.calls) / a.layers)
        us, off = min(ons), min(offs)
        line += f"; replays off {off:7.1f} µs/call (best of 2 passes; on: best of 3)"
    if CUDA:
        g = graph_us(call, a.calls) / a.layers
        line += f"); CUDA graph {g:7.1f} µs/call; eager / graph {us / g:5.2f}"
        if off is not None:
            line += f", replays off {off / g:5.2f}"
        bench = median_us(call, torch.device("cuda")) / a.layers
        line += f"; the bench's eager timing {bench:7.1f} µs/call ({bench / g:4.2f}x)"
    else:
        line += f", dispatches {COUNTS['dispatch'] - dispatched} in the timed rounds)"
    print(line, flush=True)
    if a.profile:
        prof = cProfile.Profile()
        prof.runcall(calls_dropping_outputs, call, a.profile)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(45)


def calls_dropping_outputs(call, n: int) -> None:
    """``n`` calls of ``call``, each output dropped before the next call (as the timed rounds do: a kept output
    holds its block, so the next call's output lies elsewhere and takes no in-place replay or signature)."""
    for _ in range(n):
        call()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b,olmoe,mixtral,gpt-oss-20b")
    p.add_argument("--tokens", default="1,32")
    p.add_argument("--rounds", type=int, default=7, help="rounds of --calls calls; the best round counts")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--activation", default="silu", help="the experts' activation (prepare_weights)")
    p.add_argument("--bias", action="store_true", help="GEMM1 and GEMM2 biases")
    p.add_argument("--profile", type=int, default=0, help="also N calls under cProfile, by own and cumulative time")
    p.add_argument("--launches", help="CPU: write what Triton's run was asked to launch to this JSON file")
    p.add_argument("--lora", help="LoRAExperts with one adapter of each rank of this comma list (e.g. 16)")
    p.add_argument("--stub-replays", action="store_true", help="CPU: eager calls of T <= 32 take the CUDA-graph "
                   "replay path, the graph stubbed (the host's Python and copies of a replayed call)")
    p.add_argument("--compare-replays", action="store_true", help="also the same calls with eager_graphs' replays "
                   "off, alternating with on, in this process")
    p.add_argument("--layers", type=int, default=1, help="this many layers of their own weights, called in turn "
                   "(as a model's layers are: on a GPU no layer finds its weights in the L2); µs per layer")
    a = p.parse_args()
    if a.layers < 1:
        p.error(f"--layers: expected 1 or more layers, got {a.layers}")
    if not CUDA:
        _stub_triton()
        if a.stub_replays:
            _stub_replays()
    where = torch.cuda.get_device_name() if CUDA else "CPU, Triton stubbed below CachedLaunchJIT" + (
        ", CUDA-graph replays stubbed" if a.stub_replays else "")
    print(f"moelab {moelab.__file__}, torch {torch.__version__}, triton {__import__('triton').__version__}, {where}")
    for shape in _split_shapes(a.shape):
        for T in (int(t) for t in a.tokens.split(",")):
            measure(shape, T, a)
            if CUDA:
                torch.cuda.empty_cache()
    if a.launches and not CUDA:
        Path(a.launches).write_text(json.dumps(LAUNCHES, indent=1) + "\n")


if __name__ == "__main__":
    main()
