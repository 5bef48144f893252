"""Benchmark of ExpertParallelMoE: 1 vs N GPUs, both dispatch modes, communication split out, EPLB's load balance.

    python -m moelab.distributed.bench --gpus 2                    Qwen3-30B-A3B layer, T = 4096 and 16384 per GPU
    python -m moelab.distributed.bench --tiny                      tiny shapes on 2 CPU processes (gloo): a smoke run

One spawn of ``--gpus`` processes (NCCL on GPUs, gloo on the CPU); the 1-GPU numbers come from a sub-group of
rank 0 alone, through the same layer. Per (GPUs, mode, T): the median time of a layer call over ``--iters``
calls, the slowest rank's, split into route / exchange / dispatch / experts / combine (the device is synchronised
between phases while timing them, so the split adds a little time; the total is timed without it), throughput
``GPUs * T / time``, and the speed-up over one GPU. Routing is skewed (``--skew``: logits of expert e get
``skew * log(1/(e+1))``-style Zipf bias), so the load-imbalance rows compare the default contiguous placement with
EPLB's placement (``--redundant`` extra copies per GPU, rebalanced from the measured load): max/mean slots per GPU,
and the time with each placement.

Prints a Markdown table (rank 0) and, with ``--json PATH``, writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

__all__ = ["main", "run_rank", "QWEN3_30B_A3B"]

#: Qwen3-30B-A3B's MoE layer: 128 experts, top-8, hidden 2048, expert intermediate 768.
QWEN3_30B_A3B = dict(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768)
TINY = dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16)
PHASES = ("route", "exchange", "dispatch", "experts", "combine")
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


def _time_layer(layer, args, iters, warmup, group):
    """Median seconds of one call (the slowest rank's per call), and the median per-phase split."""
    import torch.distributed as dist

    device = args[0].device
    totals, splits = [], []
    for i in range(warmup + iters):
        dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        layer(*args, validate=False)
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        layer.timings = {}
        dist.barrier(group=group)
        layer(*args, validate=False)  # the same call again, synchronised between phases, for the split
        split = torch.tensor([layer.timings.get(p, 0.0) for p in PHASES], dtype=torch.float64, device=device)
        layer.timings = None
        dist.all_reduce(split, op=dist.ReduceOp.MAX, group=group)
        if i >= warmup:
            totals.append(elapsed.item())
            splits.append(split.tolist())
    median_split = [statistics.median(s[j] for s in splits) for j in range(len(PHASES))]
    return statistics.median(totals), dict(zip(PHASES, median_split))


def _rank_loads(layer, group, world):
    from moelab.distributed.expert_parallel import _all_gather

    mine = layer.physical_load.sum().reshape(1).to(torch.int64)
    every = torch.zeros(world, dtype=torch.int64, device=mine.device)
    _all_gather(every, mine, group)
    return every.tolist()


def run_rank(rank: int, world_size: int, config: dict) -> list[dict]:
    """One rank's share of the benchmark (called by :func:`moelab.distributed.spawn_ranks`); rank 0 returns the
    rows. ``config``: shape (num_experts, top_k, hidden_size, intermediate_size), tokens, modes, iters, warmup,
    skew, redundant, dtype, backend, device ("cpu" or "cuda")."""
    import torch.distributed as dist

    from moelab.distributed import ExpertParallelMoE, default_expert_map, rebalance_experts

    device = torch.device(f"cuda:{rank}" if config["device"] == "cuda" else "cpu")
    dtype = getattr(torch, config["dtype"])
    E, K, H, I = (config[k] for k in ("num_experts", "top_k", "hidden_size", "intermediate_size"))
    g = torch.Generator().manual_seed(0)  # the same experts on every rank
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(device, dtype)
    rows = []
    sizes = sorted({1, world_size})
    groups = {w: dist.new_group(list(range(w))) for w in sizes}  # every rank creates every group
    for w in sizes:
        if rank < w:
            group = groups[w]
            for T in config["tokens"]:
                tg = torch.Generator().manual_seed(1 + rank)
                x = torch.randn(T, H, generator=tg).to(device, dtype)
                weights, ids = _routing(T, E, K, config["skew"], tg, device)
                for mode in config["modes"]:
                    row = dict(gpus=w, mode=mode, T=T)
                    block = slice(rank * E // w, (rank + 1) * E // w)
                    layer = ExpertParallelMoE(w13[block], w2[block], num_experts=E, top_k=K, group=group,
                                              dispatch=mode, backend=config["backend"])
                    row["ms"], split = _time_layer(layer, (x, weights, ids), config["iters"], config["warmup"], group)
                    row["ms"] *= 1e3
                    row.update({f"{p}_ms": v * 1e3 for p, v in split.items()})
                    row["comm_ms"] = sum(split[p] for p in COMM_PHASES) * 1e3
                    row["tokens_per_s"] = w * T / (row["ms"] / 1e3)
                    if w > 1:  # load balance: default placement vs EPLB with redundant copies
                        layer.reset_load()
                        layer(x, weights, ids, validate=False)
                        loads = _rank_loads(layer, group, w)
                        row["imbalance"] = max(loads) * w / max(sum(loads), 1)
                        P = E + config["redundant"] * w
                        start_map = default_expert_map(E, P)
                        P_local = P // w
                        mine = start_map[rank * P_local:(rank + 1) * P_local].to(device)
                        eplb = ExpertParallelMoE(w13[mine], w2[mine], num_experts=E, top_k=K, group=group,
                                                 dispatch=mode, backend=config["backend"], expert_map=start_map)
                        logical = torch.bincount(ids.flatten(), minlength=E).to(torch.int64)
                        dist.all_reduce(logical, group=group)
                        eplb.rebalance(rebalance_experts(logical[None].cpu(), P, 1, 1, w)[0][0])
                        eplb.reset_load()
                        eplb(x, weights, ids, validate=False)
                        loads = _rank_loads(eplb, group, w)
                        row["imbalance_eplb"] = max(loads) * w / max(sum(loads), 1)
                        ms, _ = _time_layer(eplb, (x, weights, ids), config["iters"], config["warmup"], group)
                        row["ms_eplb"] = ms * 1e3
                    rows.append(row)
        dist.barrier()
    if rank:
        return []
    one = {(r["mode"], r["T"]): r["tokens_per_s"] for r in rows if r["gpus"] == 1}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / one[(r["mode"], r["T"])]
    return rows


def _table(rows):
    from moelab.lab import markdown_table

    keys = ["gpus", "mode", "T", "ms", "comm_ms", "experts_ms", "route_ms", "tokens_per_s", "speedup", "imbalance",
            "imbalance_eplb", "ms_eplb"]
    return markdown_table([{k: r.get(k, "") for k in keys} for r in rows])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moelab.distributed.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2, help="ranks (GPUs, or CPU processes with --tiny)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="T per GPU (default 4096 16384)")
    parser.add_argument("--modes", nargs="+", default=["all_to_all", "allgather_reducescatter"])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of the routing bias (0: uniform)")
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
    config.update(modes=args.modes, iters=args.iters, warmup=args.warmup, skew=args.skew, redundant=args.redundant)
    rows = spawn_ranks(run_rank, args.gpus, config, device=config["device"], timeout=args.timeout, env=env)[0]
    device = torch.cuda.get_device_name() if config["device"] == "cuda" else "CPU (gloo)"
    print(f"ExpertParallelMoE, E={config['num_experts']} K={config['top_k']} H={config['hidden_size']} "
          f"I={config['intermediate_size']} {config['dtype']}, skew {args.skew}, on {device}, "
          f"torch {torch.__version__}")
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=config, device=device, torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
