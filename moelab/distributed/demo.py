"""What notebook 09 runs on each rank: one ExpertParallelMoE layer, its dispatch, partial sums and EPLB.

:func:`dispatch_demo` is a module-level function so :func:`moelab.distributed.spawn_ranks` can start it in new
processes; it runs the same layer and dispatch code a user's ranks run, and returns what the figures draw.
"""

from __future__ import annotations

import torch

import moelab
from moelab.distributed.eplb import rebalance_experts
from moelab.distributed.expert_parallel import ExpertParallelMoE, _all_gather
from moelab.distributed.metadata import default_expert_map

__all__ = ["dispatch_demo", "demo_problem"]

_BANK = ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b")


def demo_problem(config: dict):
    """The global problem every rank builds from the same seed: fp32 experts, a 2-slot LoRA bank, and every
    rank's tokens (x, topk_weights, logical topk_ids, lora_ids), skewed towards low expert ids by ``skew``."""
    E, K, H, I, counts = (config[k] for k in ("E", "K", "H", "I", "tokens_per_rank"))
    g = torch.Generator().manual_seed(config.get("seed", 0))
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    bank = moelab.LoRABank(2, E, H, I, 4, dtype=torch.float32)
    for slot in range(2):
        shapes = dict(gate_a=(4, H), gate_b=(I, 4), up_a=(4, H), up_b=(I, 4), down_a=(4, I), down_b=(H, 4))
        bank.set(slot, **{n: torch.randn(E, *s, generator=g) for n, s in shapes.items()}, scaling=0.1)
    T = sum(counts)
    logits = torch.randn(T, E, generator=g) - config.get("skew", 0.0) * torch.log(torch.arange(1.0, E + 1))
    weights, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    x = torch.randn(T, H, generator=g)
    lora_ids = torch.randint(-1, 2, (T,), generator=g)
    return (w13, w2, bank), (x, weights, ids, lora_ids)


def _local_bank(bank, rows):
    local = moelab.LoRABank(bank.max_loras, len(rows), bank.hidden_size, bank.intermediate_size, bank.max_rank,
                            dtype=bank.dtype)
    for name in _BANK:
        getattr(local, name).copy_(getattr(bank, name)[:, rows])
    local.ranks = list(bank.ranks)
    return local


def dispatch_demo(rank: int, world_size: int, config: dict) -> dict:
    """One rank of notebook 09. ``config``: E, K, H, I, tokens_per_rank (list, one per rank), mode, skew,
    redundant (EPLB copies per rank). Returns this rank's view: its tokens' physical ids and destination ranks,
    the partial sums every rank's experts give for *this* rank's tokens, the layer's output, the single-process
    LoRAExperts output, and per-rank loads before / after EPLB with both placements."""
    (w13, w2, bank), (x, weights, ids, lora_ids) = demo_problem(config)
    E, K, R = config["E"], config["K"], world_size
    counts = config["tokens_per_rank"]
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])
    P = E + config["redundant"] * R
    P_local = P // R
    start_map = default_expert_map(E, P)
    rows = start_map[rank * P_local:(rank + 1) * P_local]
    layer = ExpertParallelMoE(w13[rows], w2[rows], num_experts=E, top_k=K, lora=_local_bank(bank, rows),
                              dispatch=config["mode"], backend="torch", expert_map=start_map)
    args = (x[mine], weights[mine], ids[mine], lora_ids[mine])
    out = layer(*args)
    physical = layer.physical_ids(ids[mine])
    # The partial-sum contract: every rank's experts on every token (what allgather_reducescatter computes);
    # each rank keeps the rows of the tokens of every other rank, gathered here to rank r's view.
    all_physical = torch.cat([_gathered(layer.physical_ids(ids[mine]), counts, rank)])
    partial_all = layer.experts(x, weights, all_physical, lora_ids)  # [T_total, H], this rank's experts only
    load_before = _loads(layer, R)
    logical_load = torch.bincount(ids.flatten(), minlength=E)
    p2l, _, _ = rebalance_experts(logical_load[None], P, 1, 1, R)
    layer.rebalance(p2l[0])
    out_after = layer(*args)
    load_after = _loads(layer, R)
    single = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="torch")(x, weights, ids,
                                                                                             lora_ids)
    return dict(rank=rank, token_range=(start, start + counts[rank]), physical_ids=physical, P_local=P_local,
                dest_ranks=physical // P_local, partial_all=partial_all, out=out, out_after=out_after,
                single=single[mine], map_before=start_map, map_after=p2l[0], load_before=load_before,
                load_after=load_after, logical_load=logical_load, lora_ids=lora_ids[mine])


def _gathered(mine: torch.Tensor, counts, rank) -> torch.Tensor:
    """Concatenate every rank's ``mine`` [T_r, ...] (uneven T_r) in rank order, through one all_gather."""
    T_max = max(counts)
    padded = mine.new_zeros(T_max, *mine.shape[1:])
    padded[:mine.shape[0]] = mine
    every = mine.new_empty(len(counts) * T_max, *mine.shape[1:])
    _all_gather(every, padded, None)
    return torch.cat([every[r * T_max:r * T_max + n] for r, n in enumerate(counts)])


def _loads(layer, R) -> torch.Tensor:
    """int64 [R, P_local]: slots each physical expert computed in the last call, every rank's."""
    every = layer.physical_load.new_empty(R * layer.num_local_physical_experts)
    _all_gather(every, layer.physical_load, layer.group)
    layer.reset_load()
    return every.view(R, -1)
