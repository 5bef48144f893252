"""EPLB: place redundant copies of hot experts so every GPU gets about the same load.

DeepSeek's expert-parallel load balancer (github.com/deepseek-ai/EPLB), written here from its public description:

    hierarchical (num_groups divisible by num_nodes):
      1. pack the expert groups onto nodes, num_groups / num_nodes groups each, balancing the nodes' loads;
      2. within each node, replicate its experts into num_replicas / num_nodes physical experts, each new copy going
         to the expert with the highest load per copy (this minimises the largest load per copy);
      3. pack each node's physical experts onto its GPUs, num_replicas / num_gpus each, balancing the GPUs' loads.
    global (otherwise): the same with one group on one node, i.e. replicate over all experts, then pack onto GPUs.

Both packings are the greedy of the description: items in descending load, each to the lightest pack that still
has room (ties: the lower index). Every pack gets exactly its share of items. What the result guarantees (checked
by ``tests/test_distributed.py``): every logical expert has at least one copy; the largest load per copy
``max_e load[e] / count[e]`` is the smallest any choice of copy counts can reach (within a node in the hierarchical
policy); every GPU holds ``num_replicas / num_gpus`` physical experts, and its predicted load
``sum load[e] / count[e]`` over them is at most the mean GPU load plus ``(1 - 1/G)`` times the largest load per copy
(G GPUs per node; an LPT-style bound of the greedy packing, exhaustively checked on small cases).
"""

from __future__ import annotations

import torch

from moelab.distributed.metadata import check_int, replica_maps

__all__ = ["rebalance_experts", "balanced_packing", "replicate_experts"]


def balanced_packing(loads: list[float], num_packs: int) -> list[int]:
    """Pack ``len(loads)`` items into ``num_packs`` packs of exactly ``len(loads) / num_packs`` items each.

    Greedy: items by descending load (ties: lower index), each to the lightest pack with room (ties: lower pack).
    Returns the pack of every item; items keep, within a pack, the order they were placed in (see
    :func:`_placement_order`).
    """
    per_pack = len(loads) // num_packs
    pack_load, pack_size = [0.0] * num_packs, [0] * num_packs
    pack_of = [0] * len(loads)
    for item in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        open_packs = [p for p in range(num_packs) if pack_size[p] < per_pack]
        best = min(open_packs, key=lambda p: (pack_load[p], p))
        pack_of[item] = best
        pack_load[best] += loads[item]
        pack_size[best] += 1
    return pack_of


def _placement_order(loads: list[float], pack_of: list[int], num_packs: int) -> list[list[int]]:
    """The items of each pack in the order the greedy placed them (descending load)."""
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    for item in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        packs[pack_of[item]].append(item)
    return packs


def replicate_experts(loads: list[float], num_copies: int) -> list[int]:
    """Copy counts (>= 1 each, summing to ``num_copies``) minimising ``max load[e] / count[e]``.

    Each extra copy goes to the expert with the highest load per copy (ties: the lower index); that greedy is
    optimal for the largest load per copy.
    """
    counts = [1] * len(loads)
    for _ in range(num_copies - len(loads)):
        hot = max(range(len(loads)), key=lambda e: (loads[e] / counts[e], -e))
        counts[hot] += 1
    return counts


def _rebalance_layer(loads: list[float], num_replicas: int, num_groups: int, num_nodes: int,
                     num_gpus: int) -> list[int]:
    """physical -> logical map [num_replicas] of one layer (hierarchical policy)."""
    E = len(loads)
    group_size, gpus_per_node = E // num_groups, num_gpus // num_nodes
    per_node_physical = num_replicas // num_nodes
    group_loads = [sum(loads[g * group_size:(g + 1) * group_size]) for g in range(num_groups)]
    node_groups = _placement_order(group_loads, balanced_packing(group_loads, num_nodes), num_nodes)
    physical_to_logical: list[int] = []
    for groups in node_groups:
        experts = [g * group_size + j for g in groups for j in range(group_size)]  # this node's logical experts
        node_loads = [loads[e] for e in experts]
        counts = replicate_experts(node_loads, per_node_physical)
        copies = [e for e, c in zip(experts, counts) for _ in range(c)]  # physical experts of this node
        copy_loads = [loads[e] / c for e, c in zip(experts, counts) for _ in range(c)]
        gpus = _placement_order(copy_loads, balanced_packing(copy_loads, gpus_per_node), gpus_per_node)
        physical_to_logical += [copies[i] for gpu in gpus for i in gpu]
    return physical_to_logical


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replicate and place experts from their measured load (DeepSeek EPLB's interface and method).

    Args:
        weight: [layers, E] load of each logical expert (e.g. tokens routed to it), any real dtype, >= 0.
        num_replicas: physical experts per layer P, a multiple of ``num_gpus``, >= E.
        num_groups: expert groups (DeepSeek-V3's group-limited routing); must divide E.
        num_nodes: server nodes (fast links inside a node); ``num_gpus`` must be a multiple of it.
        num_gpus: GPUs over all nodes; GPU g holds physical experts g*P/num_gpus .. (g+1)*P/num_gpus - 1.

    Returns (int64, CPU):
        physical_to_logical_map [layers, P]: the logical expert each physical expert holds
            (a row is the ``expert_map`` of :class:`moelab.distributed.ExpertParallelMoE`);
        logical_to_physical_map [layers, E, max_replicas]: the physical copies of each logical expert,
            ascending, padded with -1;
        logical_replica_count [layers, E]: copies of each logical expert (>= 1).

    The hierarchical policy runs when ``num_groups`` is divisible by ``num_nodes``, else the global one.

    Example:
        >>> load = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86]])
        >>> p2l, l2p, count = rebalance_experts(load, num_replicas=16, num_groups=4, num_nodes=2, num_gpus=8)
        >>> p2l.shape, l2p.shape, count.sum().item()
        (torch.Size([1, 16]), torch.Size([1, 12, 2]), 16)
    """
    if not isinstance(weight, torch.Tensor) or weight.dtype.is_complex or weight.dtype == torch.bool:
        raise TypeError(f"weight: expected a real torch.Tensor of loads, got {getattr(weight, 'dtype', type(weight))}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D tensor [layers, num_logical_experts], got shape {list(weight.shape)}")
    layers, E = weight.shape
    loads = weight.detach().to("cpu", torch.float64)
    if E == 0 or not bool(torch.isfinite(loads).all()) or bool((loads < 0).any()):
        raise ValueError(f"weight: expected finite loads >= 0 over at least one expert, got shape {[layers, E]} "
                         f"with min {loads.min().item() if loads.numel() else None}")
    check_int("num_gpus", num_gpus, low=1)
    check_int("num_nodes", num_nodes, low=1)
    check_int("num_groups", num_groups, low=1)
    check_int("num_replicas", num_replicas, low=E)
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus: expected a multiple of num_nodes={num_nodes}, got {num_gpus}")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas: expected a multiple of num_gpus={num_gpus} (every GPU holds as many "
                         f"physical experts), got {num_replicas}")
    if E % num_groups:
        raise ValueError(f"num_groups: expected a divisor of the {E} logical experts, got {num_groups}")
    if num_groups % num_nodes:  # the global policy: one group, one node
        num_groups, num_nodes = 1, 1
    maps = [_rebalance_layer(row, num_replicas, num_groups, num_nodes, num_gpus) for row in loads.tolist()]
    physical_to_logical = torch.tensor(maps, dtype=torch.int64).reshape(layers, num_replicas)
    inverse = [replica_maps(row, E) for row in physical_to_logical]
    counts = torch.stack([c for _, c in inverse]) if layers else torch.zeros(0, E, dtype=torch.int64)
    width = int(counts.max()) if layers else 1
    logical_to_physical = torch.full((layers, E, width), -1, dtype=torch.int64)
    for layer, (table, _) in enumerate(inverse):
        logical_to_physical[layer, :, :table.shape[1]] = table
    return physical_to_logical, logical_to_physical, counts
