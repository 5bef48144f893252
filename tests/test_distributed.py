"""moelab.distributed (issue 14): EPLB's invariants and bounds, the placement metadata, and ExpertParallelMoE on
2 and 4 gloo processes against the single-process LoRAExperts and the float64 reference.

The multi-process checks start few process groups (spawn is slow on 2 cores): one 2-rank and one 4-rank run, each
running every check of ``_rank_checks`` in one group. Each check returns what it measured; the assertions run here,
in the parent, so a failure names the rank and the check. The same checks run under torchrun:

    torchrun --nproc-per-node 2 tests/test_distributed.py      (gloo on CPU; NCCL when CUDA is available)
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moelab.distributed import (
    ExpertParallelMetadata,
    check_expert_map,
    default_expert_map,
    rebalance_experts,
    replica_maps,
)
from moelab.distributed.eplb import balanced_packing, replicate_experts

# ---------------------------------------------------------------------------------------------- EPLB, one process


def _check_rebalance_invariants(weight, num_replicas, num_groups, num_nodes, num_gpus):
    p2l, l2p, count = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    layers, E = weight.shape
    assert p2l.shape == (layers, num_replicas) and count.shape == (layers, E)
    assert l2p.shape[:2] == (layers, E) and l2p.shape[2] == int(count.max())
    assert bool((count >= 1).all()), f"a logical expert without a copy: counts {count.tolist()}"
    for layer in range(layers):
        assert torch.equal(torch.bincount(p2l[layer], minlength=E), count[layer]), "counts disagree with the map"
        for e in range(E):
            copies = l2p[layer, e]
            live = copies[copies >= 0]
            assert live.numel() == count[layer, e], f"layer {layer} expert {e}: {copies.tolist()} vs count"
            assert bool((copies[live.numel():] == -1).all()), f"padding is not -1 after the copies: {copies.tolist()}"
            assert bool((p2l[layer, live] == e).all()), f"logical_to_physical[{layer}, {e}] points at other experts"
    return p2l, l2p, count


def _gpu_loads(weight_row, p2l_row, count_row, num_gpus):
    per_copy = weight_row.double() / count_row.double()
    return per_copy[p2l_row].view(num_gpus, -1).sum(1)


def test_rebalance_matches_the_published_example():
    """DeepSeek's README example (hierarchical: 4 groups on 2 nodes of 4 GPUs): the same experts on each GPU."""
    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86]])
    p2l, _, count = _check_rebalance_invariants(weight, 16, 4, 2, 8)
    published = [[5, 6], [5, 7], [4, 8], [3, 4], [9, 10], [2, 10], [0, 1], [1, 11]]
    assert [sorted(gpu) for gpu in p2l[0].view(8, 2).tolist()] == published
    assert count[0].tolist() == [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]


@given(st.integers(1, 3), st.sampled_from([(8, 1, 1, 2), (8, 4, 2, 4), (12, 4, 2, 4), (16, 4, 1, 4), (6, 3, 2, 2)]),
       st.integers(0, 2), st.integers(0, 10**6))
def test_rebalance_invariants_and_bounds(layers, shape, extra_per_gpu, seed):
    """Every expert has a copy, maps agree; per node, the largest load per copy is the optimum (brute force), and
    every GPU's predicted load is at most mean + (1 - 1/G) * max load per copy (the greedy's bound)."""
    E, groups, nodes, gpus = shape
    replicas = E + gpus * extra_per_gpu if (E + gpus * extra_per_gpu) % gpus == 0 else gpus * (E // gpus + 1)
    g = torch.Generator().manual_seed(seed)
    weight = (torch.rand(layers, E, generator=g) ** 4 * 1000).round()  # skewed
    p2l, _, count = _check_rebalance_invariants(weight, replicas, groups, nodes, gpus)
    hierarchical = groups % nodes == 0
    nodes_used = nodes if hierarchical else 1
    gpus_per_node = gpus // nodes_used
    for layer in range(layers):
        loads = _gpu_loads(weight[layer], p2l[layer], count[layer], gpus)
        per_copy = weight[layer].double() / count[layer].double()
        for node in range(nodes_used):
            node_gpus = loads[node * gpus_per_node:(node + 1) * gpus_per_node]
            node_physical = p2l[layer].view(nodes_used, -1)[node]
            experts = node_physical.unique()
            biggest = per_copy[experts].max().item()
            bound = node_gpus.mean().item() + (1 - 1 / gpus_per_node) * biggest
            assert node_gpus.max().item() <= bound + 1e-9, f"layer {layer} node {node}: GPU loads {node_gpus.tolist()}"
            assert _copies_to_beat(weight[layer, experts].tolist(), biggest) > node_physical.numel(), \
                f"layer {layer} node {node}: max load per copy {biggest} is not the optimum"


def _copies_to_beat(loads, level):
    """Fewest copies (>= 1 each) that bring every load per copy strictly below ``level``: more than the node has
    means ``level`` is optimal. An expert of load w needs floor(w / level) + 1 copies (one when w = 0)."""
    return sum(max(1, math.floor(w / level) + 1) if w > 0 else 1 for w in loads) if level > 0 else math.inf


def test_the_optimality_check_can_fail():
    """_copies_to_beat accepts the greedy's counts and rejects a worse choice of counts."""
    loads = [10.0, 3.0, 4.0]
    assert _copies_to_beat(loads, 10 / 3) > 5  # [3, 1, 1]: 10/3 is optimal for 5 copies
    assert _copies_to_beat(loads, 5.0) <= 5  # [2, 2, 1] reaches 5.0; [3, 1, 1] beats it: not optimal


def test_packing_and_replication_helpers():
    # 5 -> pack 0; 1 -> pack 1; 1 -> pack 1 (lighter), now full; the last 1 joins pack 0: two items each.
    assert balanced_packing([5, 1, 1, 1], 2) == [0, 1, 1, 0]
    # the first extra copy goes to 10 (10 > 4), the second too (10 / 2 = 5 > 4); the third to 4 (4 > 10 / 3).
    assert replicate_experts([10, 3, 4], 5) == [3, 1, 1]
    assert replicate_experts([10, 3, 4], 6) == [3, 1, 2]


def test_rebalance_global_policy_when_groups_do_not_divide_nodes():
    weight = torch.tensor([[100.0, 1, 1, 1, 1, 1]])
    p2l, _, count = _check_rebalance_invariants(weight, 8, 3, 2, 2)  # 3 groups, 2 nodes: global policy
    assert count[0].tolist() == [3, 1, 1, 1, 1, 1], "the hot expert gets both redundant copies"


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_replicas=7, num_groups=1, num_nodes=1, num_gpus=2), "multiple of num_gpus"),
    (dict(num_replicas=4, num_groups=1, num_nodes=1, num_gpus=2), r"num_replicas: expected an int in \[6"),
    (dict(num_replicas=6, num_groups=4, num_nodes=1, num_gpus=2), "divisor"),
    (dict(num_replicas=6, num_groups=1, num_nodes=2, num_gpus=3), "multiple of num_nodes"),
])
def test_rebalance_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rebalance_experts(torch.ones(1, 6), **kwargs)


def test_rebalance_rejects_bad_loads():
    with pytest.raises(ValueError, match="finite loads >= 0"):
        rebalance_experts(torch.tensor([[1.0, -1.0]]), 2, 1, 1, 1)
    with pytest.raises(ValueError, match="2-D"):
        rebalance_experts(torch.ones(4), 4, 1, 1, 1)


# ---------------------------------------------------------------------------------------------- metadata

def test_metadata_names_and_update():
    meta = ExpertParallelMetadata(num_logical_experts=4, num_physical_experts=6, num_local_physical_experts=3)
    assert (meta.ep_size, meta.num_redundant_experts) == (2, 2)
    assert meta.expert_map.tolist() == [0, 1, 2, 3, 0, 1] == default_expert_map(4, 6).tolist()
    assert meta.local_logical_experts(1).tolist() == [3, 0, 1]
    meta.update_physical_experts_metadata(6, 3, expert_map=torch.tensor([0, 0, 0, 1, 2, 3]))
    assert meta.expert_map.tolist() == [0, 0, 0, 1, 2, 3] and meta.num_redundant_experts == 2
    with pytest.raises(ValueError, match="num_local_physical_experts: expected 3"):
        meta.update_physical_experts_metadata(8, 4)
    table, count = replica_maps(torch.tensor([2, 0, 2, 1]), 3)
    assert table.tolist() == [[1, -1], [3, -1], [0, 2]] and count.tolist() == [1, 1, 2]


@pytest.mark.parametrize("expert_map, kwargs, match", [
    ([0, 1, 1, 3], {}, r"logical expert\(s\) \[2\] have none"),
    ([0, 1, 2, 4], {}, r"ids in \[0, 4\), got 4 at physical expert 3"),
    ([0, 1, 2, 3, 0, 1], dict(num_local_physical_experts=2, ep_size=2), "on 3 ranks"),
    ([0, 1, 2], {}, "at least num_logical_experts"),
    ([[0, 1, 2, 3]], {}, "1-D int tensor"),
])
def test_check_expert_map_errors(expert_map, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        check_expert_map(torch.tensor(expert_map), num_logical_experts=4, **kwargs)


def test_import_moelab_does_not_import_distributed():
    import subprocess

    code = "import sys, moelab; assert 'moelab.distributed' not in sys.modules; moelab.distributed.ExpertParallelMoE"
    subprocess.run([sys.executable, "-c", code], check=True)
