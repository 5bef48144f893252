"""Benchmark of ExpertParallelMoE: 1 vs N GPUs, both dispatch modes, communication split out, EPLB's load balance.

    python -m moelab.distributed.bench --gpus 2                    Qwen3-30B-A3B layer, T = 4096 and 16384 per GPU
    python -m moelab.distributed.bench --tiny                      tiny shapes on 2 CPU processes (gloo): a smoke run

One spawn of ``--gpus`` processes (NCCL on GPUs, gloo on the CPU). The one-GPU baseline is the best single-GPU
moelab layer: :class:`moelab.LoRAExperts` over all E experts on rank 0's device, no process group (eager, and
replayed from a CUDA graph on GPUs); ``speedup`` of a row is its throughput ``gpus * T / time`` over the best
baseline's ``T / time`` at the same T and routing. Per (routing skew, T, mode, placement, variant): ``ms``, the
median time of a call over ``--iters`` calls (the slowest rank's); from separate instrumented calls, the split
route / wait / exchange / dispatch / experts / combine (the device is synchronised between phases, and the ranks
meet at a barrier before each collective, booked as "wait": the slowest rank's lead, i.e. imbalance; so
``comm_ms`` = exchange + dispatch + combine is transfer time), ``bytes_sent`` (bytes a rank sent to other ranks in
one call, the largest) and ``comm_GBps`` (bytes_sent / comm_ms).

Placements: "contiguous" (rank r holds experts r*E/N ..) and "eplb" (``--redundant`` extra copies per GPU placed by
:func:`moelab.distributed.rebalance_experts` from the batch's measured load). Variants: "dynamic" (split sizes
exchanged each call: one host sync), "static" (``max_tokens_per_rank = T``: padded equal splits, no host sync) and
"graph" (the static layer captured in a CUDA graph and replayed). Routing: ``--skews`` (Zipf exponents of a bias
on the router logits, expert 0 hottest; 0 is uniform). ``imbalance``: max/mean slots per rank.

Prints a Markdown table (rank 0) and, with ``--json PATH``, writes the rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import torch

from moelab.roofline import graphed

__all__ = ["main", "run_rank", "QWEN3_30B_A3B"]

#: A call captured in a CUDA graph (NCCL's watchdog thread polls events meanwhile: thread-local capture errors).
_graphed = functools.partial(graphed, capture_error_mode="thread_local")

#: Qwen3-30B-A3B's MoE layer: 128 experts, top-8, hidden 2048, expert intermediate 768.
QWEN3_30B_A3B = dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768)
TINY = dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)
PHASES = ("route", "wait", "exchange", "dispatch", "experts", "combine")
COMM_PHASES = ("exchange", "dispatch", "combine")


def _routing(T, E, K, skew, generator, device):
    """Skewed top-K routing: logits + skew * log of a Zipf weight (expert 0 hottest), softmax weights."""
    bias = -skew * torch.log(torch.arange(1, E + 1, dtype=torch.float32))
    logits = torch.randn(T, E, generator=generator) + bias
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
    return weights.to(device), ids.to(device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(call, iters, warmup, group, device):
    """Median seconds of ``call()``, the slowest rank's per call (the ranks start together at a barrier)."""
    import torch.distributed as dist

    totals = []
    for i in range(warmup + iters):
        if group is not None:
            dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        if group is not None:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        if i >= warmup:
            totals.append(elapsed.item())
    return statistics.median(totals)


def _split(layer, args, iters, group):
    """Median per-phase seconds and bytes sent (the largest over ranks), from instrumented calls."""
    import torch.distributed as dist

    splits = []
    for _ in range(iters):
        layer.timings = {}
        dist.barrier(group=group)
        layer(*args, validate=False)
        split = torch.tensor([layer.timings.get(p, 0.0) for p in PHASES] + [layer.timings.get("bytes_sent", 0)],
                             dtype=torch.float64, device=args[0].device)
        layer.timings = None
        dist.all_reduce(split, op=dist.ReduceOp.MAX, group=group)
        splits.append(split.tolist())
    return {name: statistics.median(s[j] for s in splits) for j, name in enumerate((*PHASES, "bytes_sent"))}


def _rank_loads(layer, group, world):
    from moelab.distributed.expert_parallel import _all_gather

    mine = layer.physical_load.sum().reshape(1).to(torch.int64)
    every = torch.zeros(world, dtype=torch.int64, device=mine.device)
    _all_gather(every, mine, group)
    return every.tolist()


def _timed(row, call, config, group, device, rank):
    """Time ``call`` into ``row["ms"]``; a failure becomes ``row["error"]`` (a row that says why, not a lost run)."""
    try:
        row["ms"] = _median_time(call, config["iters"], config["warmup"], group, device) * 1e3
    except Exception as err:  # noqa: BLE001
        row["error"] = f"{type(err).__name__}: {err}"[:300]
        if rank == 0:
            print(f"{row}", file=sys.stderr)


def _baseline_rows(config, w13, w2, x, weights, ids, base, graphs, device):
    """The one-GPU baseline (rank 0 alone): LoRAExperts over all E experts, no process group."""
    import moelab

    E, K = config["num_experts"], config["top_k"]
    single = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, backend=config["backend"])
    rows = []
    for variant in ("eager", "graph") if graphs else ("eager",):
        row = dict(base, gpus=1, mode="LoRAExperts", placement="all", variant=variant)
        call = lambda: single(x, weights, ids, validate=False)  # noqa: E731
        try:
            _timed(row, _graphed(call, device) if variant == "graph" else call, config, None, device, 0)
        except Exception as err:  # noqa: BLE001 - the capture itself failed
            row["error"] = f"capture: {type(err).__name__}: {err}"[:300]
        rows.append(row)
    return rows


def run_rank(rank: int, world_size: int, config: dict) -> list[dict]:
    """One rank's share of the benchmark (called by :func:`moelab.distributed.spawn_ranks`); rank 0 returns the
    rows. ``config``: shape (num_experts, top_k, hidden_size, intermediate_size), tokens, skews, modes, iters,
    warmup, redundant, dtype, backend, device ("cpu" or "cuda"), capacity (bool: also the static-capacity
    variant), graphs (bool: also CUDA-graph replays, on GPUs)."""
    import torch.distributed as dist

    from moelab.distributed import ExpertParallelMoE, rebalance_experts

    device = torch.device(f"cuda:{rank}" if config["device"] == "cuda" else "cpu")
    dtype = getattr(torch, config["dtype"])
    E, K, H, I = (config[k] for k in ("num_experts", "top_k", "hidden_size", "intermediate_size"))
    g = torch.Generator().manual_seed(0)  # the same experts on every rank
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(device, dtype)
    graphs = bool(config.get("graphs")) and device.type == "cuda"
    variants = ["dynamic"] + (["static"] if config.get("capacity") else []) + \
               (["graph"] if graphs and config.get("capacity") else [])
    group, R = dist.group.WORLD, world_size
    rows = []
    for skew in config["skews"]:
        for T in config["tokens"]:
            tg = torch.Generator().manual_seed(1 + rank)
            x = torch.randn(T, H, generator=tg).to(device, dtype)
            weights, ids = _routing(T, E, K, skew, tg, device)
            base = dict(skew=skew, T=T)
            if rank == 0:
                rows += _baseline_rows(config, w13, w2, x, weights, ids, base, graphs, device)
            logical = torch.zeros(E, dtype=torch.int64, device=device)
            logical.scatter_add_(0, ids.flatten().long(), torch.ones(ids.numel(), dtype=torch.int64, device=device))
            dist.all_reduce(logical, group=group)
            placements = {"contiguous": (torch.arange(E), E // R)}
            if R > 1 and config["redundant"] > 0:
                P = E + config["redundant"] * R
                placements["eplb"] = (rebalance_experts(logical[None].cpu(), P, 1, 1, R)[0][0], P // R)
            for mode in config["modes"]:
                for placement, (expert_map, P_local) in placements.items():
                    mine = expert_map[rank * P_local:(rank + 1) * P_local].to(device)
                    for variant in variants:
                        row = dict(base, gpus=R, mode=mode, placement=placement, variant=variant)
                        layer = ExpertParallelMoE(w13[mine], w2[mine], num_experts=E, top_k=K, group=group,
                                                  dispatch=mode, backend=config["backend"], expert_map=expert_map,
                                                  max_tokens_per_rank=None if variant == "dynamic" else T)
                        call = lambda layer=layer, a=(x, weights, ids): layer(*a, validate=False)  # noqa: E731
                        if variant == "graph":
                            try:
                                call = _graphed(call, device)
                            except Exception as err:  # noqa: BLE001
                                row["error"] = f"capture: {type(err).__name__}: {err}"[:300]
                        if "error" not in row:
                            _timed(row, call, config, group, device, rank)
                        if "error" not in row and variant != "graph":
                            split = _split(layer, (x, weights, ids), max(1, min(3, config["iters"])), group)
                            row.update({f"{p}_ms": split[p] * 1e3 for p in PHASES})
                            row["comm_ms"] = sum(split[p] for p in COMM_PHASES) * 1e3
                            row["bytes_sent"] = int(split["bytes_sent"])
                            row["comm_GBps"] = split["bytes_sent"] / max(row["comm_ms"] * 1e6, 1e-30)
                            layer.reset_load()
                            layer(x, weights, ids, validate=False)
                            loads = _rank_loads(layer, group, R)
                            row["imbalance"] = max(loads) * R / max(sum(loads), 1)
                        rows.append(row)
                        del layer, call
            dist.barrier()
    if rank:
        return []
    best = {}
    for r in rows:
        if r["gpus"] == 1 and "ms" in r:
            key = (r["skew"], r["T"])
            best[key] = max(best.get(key, 0.0), r["T"] / (r["ms"] / 1e3))
    for r in rows:
        if "ms" in r:
            r["tokens_per_s"] = r["gpus"] * r["T"] / (r["ms"] / 1e3)
            r["speedup"] = r["tokens_per_s"] / best[(r["skew"], r["T"])] if (r["skew"], r["T"]) in best else None
    return rows


def _table(rows):
    from moelab.lab import markdown_table

    keys = ["skew", "T", "gpus", "mode", "placement", "variant", "ms", "tokens_per_s", "speedup", "imbalance",
            "comm_ms", "wait_ms", "experts_ms", "route_ms", "bytes_sent", "comm_GBps", "error"]
    return markdown_table([{k: r.get(k, "") for k in keys} for r in rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moelab.distributed.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2, help="ranks (GPUs, or CPU processes with --tiny)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="T per GPU (default 4096 16384)")
    parser.add_argument("--modes", nargs="+", default=["all_to_all", "allgather_reducescatter"])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skews", type=float, nargs="+", default=[0.0, 1.0],
                        help="Zipf exponents of the routing bias (0: uniform)")
    parser.add_argument("--no-capacity", action="store_true", help="skip the static-capacity and graph variants")
    parser.add_argument("--redundant", type=int, default=1, help="EPLB: redundant expert copies per GPU")
    parser.add_argument("--backend", default="auto", help="moelab compute backend on each rank")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU processes (gloo), fp32, torch")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a collective may take")
    args = parser.parse_args(argv)

    from moelab.distributed import spawn_ranks

    if args.tiny:
        config = dict(TINY, tokens=args.tokens or [16], dtype="float32", backend="torch", device="cpu")
        env = {"TRITON_INTERPRET": "0"}  # plain torch on the CPU (the interpreter is for kernel tests)
    else:
        if torch.cuda.device_count() < args.gpus:
            print(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} CUDA GPUs; use --tiny on a CPU",
                  file=sys.stderr)
            return 2
        config = dict(QWEN3_30B_A3B, tokens=args.tokens or [4096, 16384], dtype="bfloat16", backend=args.backend,
                      device="cuda")
        env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    config.update(modes=args.modes, iters=args.iters, warmup=args.warmup, skews=args.skews, redundant=args.redundant,
                  capacity=not args.no_capacity, graphs=not args.no_capacity)
    rows = spawn_ranks(run_rank, args.gpus, config, device=config["device"], timeout=args.timeout, env=env)[0]
    device = torch.cuda.get_device_name() if config["device"] == "cuda" else "CPU (gloo)"
    print(f"ExpertParallelMoE, E={config['num_experts']} K={config['top_k']} H={config['hidden_size']} "
          f"I={config['intermediate_size']} {config['dtype']}, on {device}, "
          f"torch {torch.__version__}")
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=config, device=device, torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
