"""Host time of one eager ``moelab.routed_moe`` call at decode sizes, split phase by phase (any CUDA GPU).

    python scripts/host_time.py                                       # T=1, Qwen3-30B-A3B, OLMoE, Mixtral, GPT-OSS
    python scripts/host_time.py --shape qwen3-30b-a3b --tokens 1,32 --calls 500

Each shape and T: ``--calls`` back-to-back eager calls as the bench's "moelab triton" makes them (packed routing,
``validate=False``, triton backend), after warm-up. Each call is timed with ``time.perf_counter`` and no
synchronize: at decode sizes the GPU finishes a kernel before the host has launched the next one, so a call's wall
time is its host time (the script prints the GPU-busy share to show it). Inside the call every Triton launch is
timestamped (``JITFunction.run`` and the compiled launcher ``CudaLauncher.__call__``, wrapped in this process
only), which splits the call into:

    moelab      moelab's own Python: checks, host arithmetic, allocations, launcher arguments (before, between
                and after the launches)
    dispatch    ``kernel[grid](...)`` around the compiled launcher: argument binding, specialization, cache key,
                launch metadata (Triton's ``JITFunction.run``, or ``moelab.kernels.launch.CachedLaunchJIT.run`` where
                this tree has it: its signature and Triton's ``CompiledKernel[grid]``)
    launch      the compiled launcher itself (scratch allocation and ``cuLaunchKernelEx``)

Medians over the calls, µs. A second pass times the same calls without the wrappers (the wrappers' own cost is
the difference). Writes nothing; print only.

Where the call replays a CUDA graph instead (``moelab/backends/eager_graphs.py``: no Triton launch to time), the
split is by the Python functions it passes through, each timed from entry to return:

    validate    ``moelab.moe.validate_call``: the argument checks and the call's bundle
    takes       ``eager_graphs.takes``: whether the call replays a graph
    key         ``eager_graphs.key``: the graph's key
    copies      ``Tensor.copy_`` into the graph's input buffers (and into ``output`` where given)
    in place    ``eager_graphs._replay_in_place`` less the replay it runs: the checks and lookup of an in-place
                replay (no copies, no clone), or of the attempt before the copies
    replay      ``CUDAGraph.replay``
    clone       ``Tensor.clone`` of the graph's output
    other       the rest: ``routed_moe``'s frames, the backend lookup, the dict lookup of the graph

``--lora R[,R...]``: ``moelab.LoRAExperts`` calls instead (a bank of one adapter per rank given, token t on
adapter t % len, ``has_lora=True``, ``validate=False``), where ``takes`` and ``key`` are ``takes_lora`` and
``lora_key``, ``copies`` includes the copy into the module's output, and two phases more split the rest:

    backend     the triton backend's ``lora_experts`` (takes, key, copies and replay are inside it)
    module      ``LoRAExperts.forward`` around it: its checks, the output's allocation, the call's bundle
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import moelab
from moelab.bench import SHAPES


def _instrument():
    """Wrap Triton's JIT dispatch and compiled launcher so each appends (what, name, time) to the returned list;
    returns (events, undo)."""
    import triton.runtime.jit as jit

    events: list[tuple[str, str, float]] = []
    clock = time.perf_counter
    patched = []

    classes = [jit.JITFunction]
    try:  # moelab's own dispatch in front of Triton's, where this tree has it
        from moelab.kernels.launch import CachedLaunchJIT
        classes.append(CachedLaunchJIT)
    except ImportError:
        pass
    for cls in classes:
        # CachedLaunchJIT's entry where the tree has it (``kernel[grid]`` reaches ``_launch``, not ``run``)
        name = "_launch" if "_launch" in cls.__dict__ else "run"
        run = cls.__dict__[name]

        def timed_run(self, *args, _run=run, **kwargs):
            events.append(("jit>", self.fn.__name__, clock()))
            out = _run(self, *args, **kwargs)
            events.append(("jit<", self.fn.__name__, clock()))
            return out

        setattr(cls, name, timed_run)
        patched.append((cls, name, run))
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except ImportError:
        CudaLauncher = None
    if CudaLauncher is not None:
        call = CudaLauncher.__call__

        def timed_call(self, *args, **kwargs):
            events.append(("run>", "", clock()))
            out = call(self, *args, **kwargs)
            events.append(("run<", "", clock()))
            return out

        CudaLauncher.__call__ = timed_call
        patched.append((CudaLauncher, "__call__", call))

    def undo():
        for owner, name, fn in patched:
            setattr(owner, name, fn)

    return events, undo


def _instrument_graphs(lora: bool = False):
    """Wrap the functions a graph replay passes through (module docstring) so each adds its time to the returned
    dict; returns (times, undo)."""
    from moelab import moe
    from moelab.backends import eager_graphs, triton_backend

    times: dict[str, float] = {}
    clock = time.perf_counter
    patched = []

    def wrap(owner, attr, phase):
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = clock()
            out = fn(*args, **kwargs)
            times[phase] = times.get(phase, 0.0) + clock() - t0
            return out

        setattr(owner, attr, timed)
        patched.append((owner, attr, fn))

    wrap(moe, "validate_call", "validate")
    wrap(eager_graphs, "takes_lora" if lora else "takes", "takes")
    wrap(eager_graphs, "lora_key" if lora else "key", "key")
    if lora:
        wrap(triton_backend, "lora_experts", "backend")
    wrap(torch.Tensor, "copy_", "copies")
    wrap(torch.cuda.CUDAGraph, "replay", "replay")
    wrap(torch.Tensor, "clone", "clone")
    attempt = eager_graphs._replay_in_place

    def in_place(*args):  # its own time, the replay it runs taken out (that is the "replay" phase's)
        t0, replays = clock(), times.get("replay", 0.0)
        placed = attempt(*args)
        times["in place"] = times.get("in place", 0.0) + clock() - t0 - (times.get("replay", 0.0) - replays)
        return placed

    eager_graphs._replay_in_place = in_place
    patched.append((eager_graphs, "_replay_in_place", attempt))

    def undo():
        for owner, attr, fn in reversed(patched):
            setattr(owner, attr, fn)

    return times, undo


GRAPH_PHASES = ("validate", "takes", "key", "copies", "in place", "replay", "clone")


def _split(events: list, start: float, end: float) -> dict:
    """Phases of one call from its events (see the module docstring), µs; ``launches`` the kernels in order."""
    moelab_us = dispatch_us = launch_us = 0.0
    last = start  # end of the last Triton frame (moelab's Python runs from there to the next one)
    depth = 0
    names = []
    run_start = None
    jit_start = None
    for what, name, t in events:
        if what == "jit>":
            if depth == 0:
                moelab_us += t - last
                jit_start = t
                names.append(name)
            depth += 1
        elif what == "run>":
            run_start = t
            if depth == 0:  # a compiled kernel launched without Triton's JIT dispatch
                moelab_us += t - last
                names.append("(compiled)")
            else:
                dispatch_us += t - jit_start
        elif what == "run<":
            launch_us += t - run_start
            if depth == 0:
                last = t
            else:
                jit_start = t
        elif what == "jit<":
            depth -= 1
            if depth == 0:
                dispatch_us += t - jit_start
                last = t
    moelab_us += end - last
    return {"moelab": moelab_us * 1e6, "dispatch": dispatch_us * 1e6, "launch": launch_us * 1e6,
            "total": (end - start) * 1e6, "launches": names}


def measure(shape: str, T: int, calls: int, lora_ranks: list[int] | None = None) -> None:
    from moelab.backends import eager_graphs
    eager_graphs.clear()  # held() > 0 after the warm-up: the calls replay a graph
    s = SHAPES[shape]
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(s.E, 2 * s.I, s.H, device=dev, dtype=dt, generator=g) / s.H**0.5
    w2 = torch.randn(s.E, s.H, s.I, device=dev, dtype=dt, generator=g) / s.I**0.5
    x = torch.randn(T, s.H, device=dev, dtype=dt, generator=g)
    ids = torch.rand(T, s.E, device=dev, generator=g).argsort(dim=1)[:, :s.K].int()
    packed = moelab.pack_topk_ids_weights(ids, torch.rand(T, s.K, device=dev, generator=g))
    W = moelab.prepare_weights(w13, w2, backend="triton")

    def call():
        return moelab.routed_moe(packed, x, W, num_experts=s.E, top_k=s.K, validate=False)[0]

    if lora_ranks:  # LoRAExperts with a bank of those adapters (their values do not change the host's work)
        bank = moelab.LoRABank(len(lora_ranks), s.E, s.H, s.I, max(lora_ranks), dtype=dt, device=dev)
        for slot, r in enumerate(lora_ranks):
            bank.set(slot, **{name: torch.zeros(s.E, *dims, dtype=dt, device=dev) for name, dims in (
                ("gate_a", (r, s.H)), ("up_a", (r, s.H)), ("gate_b", (s.I, r)), ("up_b", (s.I, r)),
                ("down_a", (r, s.I)), ("down_b", (s.H, r)))})
        module = moelab.LoRAExperts(w13, w2, num_experts=s.E, top_k=s.K, lora=bank, backend="triton")
        weights = torch.rand(T, s.K, device=dev, generator=g)
        lora_ids = (torch.arange(T, device=dev) % len(lora_ranks)).int()

        def call():  # noqa: F811 (the LoRA call replaces the base one)
            return module(x, weights, ids, lora_ids, has_lora=True, validate=False)

    for _ in range(30):
        call()
    torch.cuda.synchronize()
    # GPU time of one call (events around it, GPU idle before) to show the host is the bottleneck
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = []
    for _ in range(20):
        torch.cuda.synchronize()
        start.record()
        call()
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
    plain = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        plain.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    if eager_graphs.held():  # the calls replay a graph: split them by the functions they pass through
        _graph_split(shape, T, call, calls, plain, gpu, bool(lora_ranks))
        return
    events, undo = _instrument()
    rows = []
    try:
        for _ in range(calls):
            events.clear()
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            rows.append(_split(list(events), t0, t1))
    finally:
        undo()
    torch.cuda.synchronize()
    med = {k: statistics.median(r[k] for r in rows) for k in ("moelab", "dispatch", "launch", "total")}
    launches = rows[0]["launches"]
    print(f"{shape:15s} T={T:<5d} host {statistics.median(plain):7.1f} µs/call (p10 {_pct(plain, 10):.1f}, "
          f"p90 {_pct(plain, 90):.1f}); instrumented {med['total']:.1f} = moelab {med['moelab']:.1f} + "
          f"Triton dispatch {med['dispatch']:.1f} + launcher {med['launch']:.1f}; {len(launches)} launches "
          f"({', '.join(n.lstrip('_') for n in launches)}); GPU, one idle call: {statistics.median(gpu):.1f} µs",
          flush=True)


def _graph_split(shape: str, T: int, call, calls: int, plain: list[float], gpu: list[float],
                 lora: bool = False) -> None:
    times, undo = _instrument_graphs(lora)
    phases = (*GRAPH_PHASES, "other", "module") if lora else (*GRAPH_PHASES, "other")
    rows = []
    try:
        for _ in range(calls):
            times.clear()
            t0 = time.perf_counter()
            call()
            total = time.perf_counter() - t0
            row = {k: times.get(k, 0.0) * 1e6 for k in GRAPH_PHASES}
            if lora:  # "other": the backend's rest; "module": LoRAExperts.forward around the backend
                backend = times.get("backend", 0.0) * 1e6
                row["other"] = backend - sum(row[k] for k in GRAPH_PHASES if k != "validate")
                row["module"] = total * 1e6 - backend - row["validate"]
            else:
                row["other"] = total * 1e6 - sum(row.values())
            row["total"] = total * 1e6
            rows.append(row)
    finally:
        undo()
    torch.cuda.synchronize()
    med = {k: statistics.median(r[k] for r in rows) for k in (*phases, "total")}
    print(f"{shape:15s} T={T:<5d} {'LoRAExperts ' if lora else ''}host {statistics.median(plain):7.1f} µs/call "
          f"(p10 {_pct(plain, 10):.1f}, p90 {_pct(plain, 90):.1f}), a graph replay; instrumented "
          f"{med['total']:.1f} = " + " + ".join(f"{k} {med[k]:.1f}" for k in phases)
          + f"; GPU, one idle call: {statistics.median(gpu):.1f} µs", flush=True)


def _pct(values: list[float], p: int) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, len(v) * p // 100)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-30b-a3b,olmoe,mixtral,gpt-oss-20b")
    p.add_argument("--tokens", default="1")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--lora", help="LoRAExperts with one adapter of each rank of this comma list (e.g. 16)")
    a = p.parse_args()
    print(f"moelab {moelab.__file__}, torch {torch.__version__}, triton {__import__('triton').__version__}, "
          f"{torch.cuda.get_device_name()}")
    for shape in a.shape.split(","):
        for T in (int(t) for t in a.tokens.split(",")):
            measure(shape, T, a.calls, a.lora and [int(r) for r in a.lora.split(",")])
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
