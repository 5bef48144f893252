"""moelab.distributed (issue 14): EPLB's invariants and bounds, the placement metadata, and ExpertParallelMoE on
2 and 4 gloo processes against the single-process LoRAExperts and the float64 reference.

The multi-process checks start few process groups (spawn is slow on 2 cores): one 2-rank and one 4-rank run, each
running every check of ``_rank_checks`` in one group. Each check returns what it measured; the assertions run here,
in the parent, so a failure names the rank and the check. The same checks run under torchrun:

    torchrun --nproc-per-node 2 tests/test_distributed.py      (gloo on CPU; NCCL on cuda:rank when CUDA is available)

Every tensor is built on the CPU from seeded generators (the same values on every rank and every device), then
moved to ``cuda:rank`` when the group is NCCL; on GPUs the checks also run the triton backend in bf16 and capture
the static-capacity layer in a CUDA graph.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moelab
import moelab.distributed
from moelab import reference
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


def test_plots_draw_what_they_are_given():
    from matplotlib.figure import Figure

    from moelab.distributed import plots

    fig = plots.plot_dispatch(torch.tensor([[0, 0], [0, 1], [1, 1]]), 2)
    assert isinstance(fig, Figure)
    labels = sorted(t.get_text() for t in fig.axes[0].texts)
    assert labels == ["1", "1", "2", "2"], f"cell labels {labels}: expected token 0 -> 2 on rank 0, 1+1, 2 on rank 1"
    assert "2 copies sent to other ranks" in fig.axes[0].get_title(loc="left")
    fig = plots.plot_expert_load(torch.tensor([[3, 1], [0, 4]]), torch.tensor([0, 1, 2, 0]))
    assert "max/mean rank load 1.00" in fig.axes[0].get_title(loc="left")
    assert "e2\n0" in [t.get_text() for t in fig.axes[0].texts]


def test_docstring_examples():
    import doctest

    from moelab.distributed import eplb, metadata

    for module in (metadata, eplb):
        assert doctest.testmod(module).failed == 0, f"{module.__name__}: a docstring example is wrong"


def test_import_moelab_does_not_import_distributed():
    import subprocess

    code = "import sys, moelab; assert 'moelab.distributed' not in sys.modules; moelab.distributed.ExpertParallelMoE"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------- ExpertParallelMoE

E, K, H, I, L, RANK = 8, 2, 32, 16, 2, 4  # tiny: the torch backend on 2 shared cores
MODES = moelab.distributed.DISPATCH_MODES


def _gloo_threads() -> list[str]:
    """The names of this process's gloo threads (ProcessGroupGloo's workers, its TCP loop), read from /proc."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return [n for n in names if "gloo" in n]


def _fail_in_a_frame_holding(group, fn):
    """``fn``'s error (as :func:`_expect_error` gives it), from a frame that holds ``group``."""
    return _expect_error(fn)


def _kept_error(fn):
    """The ValueError ``fn`` raises, kept (with its traceback), or None."""
    try:
        fn()
    except ValueError as err:
        return err
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc/self/task")
def test_layer_does_not_keep_its_group_alive(tmp_path):
    """destroy_process_group ends the group while layers built on it still live (a global of a script, say), also
    after failed calls from a frame holding the group (no reference cycle keeps that frame: the garbage collector is
    off) and with a failed construction's error kept: gloo's threads are gone, and the layer's next call raises. A
    group kept alive until the interpreter exits aborted torchrun ranks now and then: a gloo worker freeing a
    finished collective's tensors needs the GIL, which the exiting interpreter refuses ("terminate called without
    an active exception")."""
    import gc

    import torch.distributed as dist

    from moelab.distributed import ExpertParallelMoE

    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    g = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    x, weights = torch.randn(5, H, generator=g), torch.rand(5, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(5)])
    gc.disable()
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        try:
            layer = ExpertParallelMoE(w13, w2, num_experts=E, top_k=K, backend="torch")
            static = ExpertParallelMoE(w13, w2, num_experts=E, top_k=K, backend="torch", max_tokens_per_rank=8)
            out = layer(x, weights, ids)
            world = dist.group.WORLD  # failing calls from a frame that holds the group, as a user's function may
            failures = [_fail_in_a_frame_holding(world, lambda: ExpertParallelMoE(w13[:3], w2[:3], num_experts=E,
                                                                                   top_k=K)),
                        _fail_in_a_frame_holding(world, lambda: layer(x, weights, ids + E)),
                        _fail_in_a_frame_holding(world, lambda: static(x, weights, ids + E)),
                        _fail_in_a_frame_holding(world, lambda: layer.rebalance(torch.zeros(E, dtype=torch.int64)))]
            del world
            kept = _kept_error(lambda: ExpertParallelMoE(w13[:3], w2[:3], num_experts=E, top_k=K,
                                                         group=dist.group.WORLD))
            running = _gloo_threads()
        finally:
            dist.destroy_process_group()
        left = _gloo_threads()
    finally:
        gc.enable()
    expected = reference.lora_experts(x, weights, ids, None, w13, w2, None)["output"]
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max(), "the 1-rank layer's output"
    assert all(f and f.startswith("ValueError") for f in failures) and isinstance(kept, ValueError), failures
    assert running, "no gloo thread found while the group was up: this check would see nothing"
    assert left == [], f"gloo threads still running after destroy_process_group: {left}"
    with pytest.raises(RuntimeError, match="process group was destroyed"):
        layer(x, weights, ids)


def _model(seed=0, device="cpu"):
    """Global fp32 experts and a 2-slot bank over all E experts (slot 0 rank 4, slot 1 rank 2), the same on
    every rank (seeded on the CPU, then moved to ``device``)."""
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    bank = moelab.LoRABank(L, E, H, I, RANK, dtype=torch.float32)
    for slot, r in enumerate([RANK, 2]):
        f = {n: torch.randn(E, *shape, generator=g) for n, shape in
             [("gate_a", (r, H)), ("gate_b", (I, r)), ("up_a", (r, H)), ("up_b", (I, r)), ("down_a", (r, I)),
              ("down_b", (H, r))]}
        bank.set(slot, **f, scaling=0.3 / r)
    return w13.to(device), w2.to(device), _bank_as(bank, torch.float32, device)


def _bank_as(bank, dtype, device):
    """A copy of ``bank`` in ``dtype`` on ``device``."""
    new = moelab.LoRABank(bank.max_loras, bank.num_local_experts, H, I,
                          RANK, dtype=dtype, device=device)
    for name in ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"):
        getattr(new, name).copy_(getattr(bank, name))
    new.ranks = list(bank.ranks)
    return new


def _layer(w13, w2, bank, logical, **kwargs):
    """An ExpertParallelMoE over this rank's physical experts, holding ``logical`` (int [P_local])."""
    from moelab.distributed import ExpertParallelMoE

    w13_local, w2_local, local_bank = _local(w13, w2, bank, logical)
    kwargs.setdefault("backend", "torch")
    return ExpertParallelMoE(w13_local, w2_local, lora=local_bank, num_experts=E, top_k=K, **kwargs)


def _local(w13, w2, bank, logical):
    """The rows of the physical experts holding ``logical`` (int [P_local]), bank slices included."""
    local_bank = None
    if bank is not None:
        local_bank = moelab.LoRABank(L, len(logical), H, I, RANK, dtype=bank.dtype, device=bank.device)
        for name in ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"):
            getattr(local_bank, name).copy_(getattr(bank, name)[:, logical])
        local_bank.ranks = list(bank.ranks)
    logical = logical.to(w13.device)
    return w13[logical], w2[logical], local_bank


def _tokens(counts, seed, *, skew=None, own_experts_on=None, P_local=None, device="cpu"):
    """Every rank's tokens (global batch, the same on every rank): x [T, H], weights [T, K], logical ids [T, K],
    adapter ids [T] (-1 = none). ``skew`` [E]: routing probabilities; ``own_experts_on``: a rank whose tokens
    route only to experts it holds (it sends nothing to the others)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(counts)
    probs = torch.ones(E) if skew is None else torch.as_tensor(skew, dtype=torch.float64)
    ids = torch.stack([torch.multinomial(probs, K, generator=g) for _ in range(T)]) if T else torch.zeros(0, K)
    ids = ids.long()
    if own_experts_on is not None:
        start = sum(counts[:own_experts_on])
        for t in range(start, start + counts[own_experts_on]):
            ids[t] = own_experts_on * P_local + torch.randperm(P_local, generator=g)[:K]
    x = torch.randn(T, H, generator=g)
    weights = torch.rand(T, K, generator=g)
    lora_ids = torch.randint(-1, L, (T,), generator=g)
    lora_ids[::3] = -1  # a third of the tokens without an adapter, whatever the draw
    return x.to(device), weights.to(device), ids.to(device), lora_ids.to(device)


def _mine(rank, counts, *tensors):
    start = sum(counts[:rank])
    return [t[start:start + counts[rank]] for t in tensors]


def _rel(out, ref):
    out, ref = out.double(), ref.double()
    if not bool(torch.isfinite(out).all()):
        return math.inf
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _expect_error(fn):
    try:
        fn()
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _rank_checks(rank, R, device="cpu"):
    """Every multi-process check on one group; returns what each measured (asserted in the parent). ``device``:
    "cpu" (gloo) or "cuda" (NCCL, this rank on cuda:rank)."""
    import torch.distributed as dist

    torch.manual_seed(rank)  # nothing below may depend on it: the batch is seeded, the same on every rank
    dev = torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")
    w13, w2, bank = _model(device=dev)
    P_local = E // R
    block = torch.arange(rank * P_local, (rank + 1) * P_local)
    single = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="torch")
    single_base = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, backend="torch")
    results = {}
    # uneven T with a rank of T = 0; a rank whose tokens all stay home (sends nothing to others)
    cases = {"uneven": ([5, 0, 7, 3] if R == 4 else [9, 0], {})}
    if R == 2:  # (4 ranks share 2 cores in CI: their run keeps to the other checks)
        cases["stays_home"] = ([4, 6], dict(own_experts_on=0, P_local=P_local))
    for mode in MODES:
        layer = _layer(w13, w2, bank, block, dispatch=mode)
        base_layer = _layer(w13, w2, None, block, dispatch=mode)
        for name, (counts, kw) in cases.items():
            x, w, ids, lora_ids = _tokens(counts, seed=1, device=dev, **kw)
            want = single(x, w, ids, lora_ids)
            mx, mw, mids, mlora = _mine(rank, counts, x, w, ids, lora_ids)
            layer.reset_load()
            out = layer(mx, mw, mids, mlora)
            load = layer.physical_load.tolist()
            out_base = base_layer(mx, mw, mids, None)
            # the adapter tokens change adapter (0 <-> 1): a token without one must not move by a bit
            swapped = layer(mx, mw, mids, torch.where(mlora >= 0, 1 - mlora, mlora))
            ref = reference.lora_experts(mx, mw, mids, mlora, w13, w2, bank)["output"]
            no_adapter = mlora < 0
            one_rank = (mids // P_local == mids[:, :1] // P_local).all(1)
            mine_want, = _mine(rank, counts, want)
            mine_base, = _mine(rank, counts, single_base(x, w, ids, None))
            results[(mode, name)] = dict(
                shape=tuple(out.shape), T=counts[rank], rel_single=_rel(out, mine_want), rel_ref=_rel(out, ref),
                rel_base=_rel(out_base, reference.lora_experts(mx, mw, mids, None, w13, w2, None)["output"]),
                no_adapter=int(no_adapter.sum()),
                adapter_bitwise=torch.equal(out[no_adapter], swapped[no_adapter]),
                adapter_moved=bool((out[~no_adapter] != swapped[~no_adapter]).any(1).all()),
                one_rank=int(one_rank.sum()),
                single_bitwise=torch.equal(out[one_rank], mine_want[one_rank]),
                base_single_bitwise=torch.equal(out_base, mine_base),
                sent_home_only=bool((mids // P_local == rank).all()))
            # the same tokens through the static-capacity layer (capturable): capacity above T, padded rows
            static = _layer(w13, w2, bank, block, dispatch=mode, max_tokens_per_rank=max(counts) + 2)
            out_static = static(mx, mw, mids, mlora)
            static_load = static.physical_load.tolist()
            swapped_static = static(mx, mw, mids, torch.where(mlora >= 0, 1 - mlora, mlora))
            results[(mode, name)].update(
                static_rel_single=_rel(out_static, mine_want), static_shape=tuple(out_static.shape),
                static_adapter_bitwise=torch.equal(out_static[no_adapter], swapped_static[no_adapter]),
                static_load=static_load, load=load)
        # T = 0 on every rank
        empty = layer(torch.zeros(0, H, device=dev), torch.zeros(0, K, device=dev),
                      torch.zeros(0, K, dtype=torch.long, device=dev), torch.zeros(0, dtype=torch.long, device=dev))
        results[(mode, "all_empty")] = tuple(empty.shape)
        if R == 2:
            # rank 1 passes lora_ids=None (its tokens have no adapter) while rank 0 uses adapters
            x, w, ids, lora_ids = _tokens([4, 5], seed=4, device=dev)
            lora_ids[4:] = -1
            mx, mw, mids, mlora = _mine(rank, [4, 5], x, w, ids, lora_ids)
            out = layer(mx, mw, mids, mlora if rank == 0 else None)
            results[(mode, "mixed_none")] = _rel(out, _mine(rank, [4, 5], single(x, w, ids, lora_ids))[0])
            # bf16 weights, bank and activations: within 1e-2 of the float64 reference
            bank16 = _bank_as(bank, torch.bfloat16, dev)
            w13_16, w2_16 = w13.bfloat16(), w2.bfloat16()
            mx16 = mx.bfloat16()
            ref16 = reference.lora_experts(mx16, mw, mids, mlora, w13_16, w2_16, bank16)["output"]
            backends = ["torch", "triton"] if device == "cuda" else ["torch"]
            for backend in backends:
                for capacity in (None, 8):
                    layer16 = _layer(w13_16, w2_16, bank16, block, dispatch=mode, backend=backend,
                                     max_tokens_per_rank=capacity)
                    out16 = layer16(mx16, mw, mids, mlora)
                    key = "bf16" if (backend, capacity) == ("torch", None) else f"bf16_{backend}_{capacity}"
                    results[(mode, key)] = (str(out16.dtype), _rel(out16, ref16))
            if device == "cuda":
                results[(mode, "graph")] = _graph_checks(rank, R, mode, w13_16, w2_16, bank16, block, dev)
        # static capacity: T above it on one rank -> every rank raises (validate=True); with validate=False the
        # bad rank raises after taking part with no tokens, and the others finish with correct outputs
        counts = [3] * R
        x, w, ids, lora_ids = _tokens(counts, seed=5, device=dev)
        mx, mw, mids, mlora = _mine(rank, counts, x, w, ids, lora_ids)
        static = _layer(w13, w2, bank, block, dispatch=mode, max_tokens_per_rank=3)
        big = [t.repeat(2, *[1] * (t.dim() - 1)) if rank == R - 1 else t for t in (mx, mw, mids, mlora)]
        results[(mode, "static_over_capacity")] = _expect_error(lambda f=static, a=big: f(*a))
        bad_shape = mw[:, :1] if rank == R - 1 else mw
        results[(mode, "static_unvalidated_bad_rank")] = _expect_error(
            lambda f=static, a=(mx, bad_shape, mids, mlora): f(*a, validate=False))
        try:
            out = static(mx, bad_shape, mids, mlora, validate=False)
            want, = _mine(rank, counts, single(x, w, ids, lora_ids))
            # without rank R-1's tokens, the others' outputs are still exact (rank R-1 computed its experts)
            results[(mode, "static_unvalidated_others")] = _rel(out, want)
        except ValueError:
            results[(mode, "static_unvalidated_others")] = None
        # bad input on rank R-1 only: every rank raises, and the group still works afterwards
        x, w, ids, lora_ids = _tokens([3] * R, seed=2, device=dev)
        mx, mw, mids, mlora = _mine(rank, [3] * R, x, w, ids, lora_ids)
        bad_ids = mids.clone()
        if rank == R - 1:
            bad_ids[0, 0] = E
        results[(mode, "bad_input")] = _expect_error(lambda f=layer, a=(mx, mw, bad_ids, mlora): f(*a))
        results[(mode, "after_bad_input")] = _rel(layer(mx, mw, mids, mlora), _mine(rank, [3] * R,
                                                                                    single(x, w, ids, lora_ids))[0])
        # EPLB under skewed routing: one redundant copy per rank, measured load before and after rebalancing
        P = E + R
        start_map = moelab.distributed.default_expert_map(E, P).to(dev)
        mine_map = start_map[rank * (P_local + 1):(rank + 1) * (P_local + 1)]
        eplb_layer = _layer(w13, w2, bank, mine_map, dispatch=mode, expert_map=start_map)
        counts = [40 + 3 * r for r in range(R)]
        x, w, ids, lora_ids = _tokens(counts, seed=3, skew=[30, 12, 1, 1, 1, 1, 1, 1], device=dev)
        mx, mw, mids, mlora = _mine(rank, counts, x, w, ids, lora_ids)
        before = eplb_layer(mx, mw, mids, mlora)
        load_before = _rank_loads(eplb_layer, R)
        logical_load = torch.bincount(ids.flatten(), minlength=E)
        p2l, _, replica_count = rebalance_experts(logical_load[None].cpu(), P, 1, 1, R)
        eplb_layer.rebalance(p2l[0])
        after = eplb_layer(mx, mw, mids, mlora)
        load_after = _rank_loads(eplb_layer, R)
        mine_want, = _mine(rank, counts, single(x, w, ids, lora_ids))
        per_copy = logical_load.cpu().double() / replica_count[0].double()
        results[(mode, "eplb")] = dict(
            rel_before=_rel(before, mine_want), rel_after=_rel(after, mine_want), rel_move=_rel(after, before),
            load_before=load_before, load_after=load_after, max_per_copy=per_copy.max().item(),
            predicted=per_copy[p2l[0]].view(R, -1).sum(1).tolist(), map=eplb_layer.expert_map.tolist(),
            P_local=eplb_layer.num_local_physical_experts)
    # bad maps: every rank raises a clear error (no collective hangs)
    no_copy = torch.arange(E).clone()
    no_copy[3] = 2  # logical expert 3 has no physical copy
    results["map_no_copy"] = _expect_error(lambda: _layer(w13, w2, None, block, expert_map=no_copy))
    too_long = torch.arange(E + P_local) % E  # physical experts on rank R: out of range
    results["map_rank_out_of_range"] = _expect_error(lambda: _layer(w13, w2, None, block, expert_map=too_long))
    differs = torch.arange(E).flip(0) if rank == 0 else torch.arange(E)  # valid, but not the same on every rank
    results["map_differs"] = _expect_error(
        lambda: _layer(w13, w2, None, differs[rank * P_local:(rank + 1) * P_local], expert_map=differs))
    if R == 2:  # the benchmark's tiny run, in this group (its 1-rank numbers from a sub-group of rank 0)
        from moelab.distributed import bench

        on_gpu = dict(dtype="bfloat16", backend="triton") if device == "cuda" else {}  # triton: capturable
        config = dict(bench.TINY, tokens=[6], dtype="float32", backend="torch", device=device, modes=list(MODES),
                      iters=1, warmup=0, skews=[1.0], redundant=1, capacity=True, graphs=device == "cuda")
        config.update(on_gpu)
        results["bench"] = bench.run_rank(rank, R, config)
    dist.barrier()
    return results


def _graph_checks(rank, R, mode, w13, w2, bank, block, dev):
    """CUDA graphs on NCCL (bf16, triton): the static-capacity layer captured once and replayed on new tokens
    equals its eager call bit for bit; the dynamic layer refuses capture with a RuntimeError on every rank."""
    C = 8
    static = _layer(w13, w2, bank, block, dispatch=mode, backend="triton", max_tokens_per_rank=C)
    counts = [6] * R
    batches = []
    for seed in (11, 12):
        x, w, ids, lora_ids = _tokens(counts, seed=seed, device=dev)
        batches.append([t.bfloat16() if t.is_floating_point() and t.dim() == 2 and t.shape[1] == H else t
                        for t in _mine(rank, counts, x, w, ids, lora_ids)])
    inputs = [t.clone() for t in batches[0]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream: NCCL communicators, Triton compiles
        for _ in range(2):
            static(*inputs, validate=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # the NCCL watchdog thread polls events
            captured = static(*inputs, validate=False)
    except Exception as err:  # reported by the parent with its message (every rank captures the same ops)
        return dict(capture_error=f"{type(err).__name__}: {err}")
    for t, new in zip(inputs, batches[1]):
        t.copy_(new)
    captured.fill_(float("nan"))  # poison: the replay must write every element
    graph.replay()
    torch.cuda.synchronize()
    eager = static(*batches[1], validate=False)
    ref = reference.lora_experts(*batches[1][:3], batches[1][3], w13, w2, bank)["output"]
    dynamic = _layer(w13, w2, bank, block, dispatch=mode, backend="triton")
    dynamic(*batches[0], validate=False)
    refused = None
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            dynamic(*inputs, validate=False)
    except RuntimeError as err:
        refused = str(err)
    after = _rel(dynamic(*batches[1]), eager)  # the group still works after the refusal
    return dict(replay_equals_eager=torch.equal(captured, eager), rel_eager=_rel(captured, eager),
                rel_ref=_rel(captured, ref), refused=refused, after_refusal=after)


def _rank_loads(layer, R):
    import torch.distributed as dist

    mine = layer.physical_load.sum().reshape(1)
    every = [torch.zeros_like(mine) for _ in range(R)]
    dist.all_gather(every, mine)
    return [int(v) for v in every]


def _check_results(results, R, device="cpu"):
    for mode in MODES:
        for name in ("uneven", "stays_home") if R == 2 else ("uneven",):
            for rank, res in enumerate(results):
                r = res[(mode, name)]
                where = f"{mode}, {name}, rank {rank} (T={r['T']})"
                assert r["shape"] == (r["T"], H), f"{where}: output shape {r['shape']}"
                assert r["rel_single"] <= 1e-5, f"{where}: rel err {r['rel_single']:.2e} vs one process"
                assert r["rel_ref"] <= 1e-5, f"{where}: rel err {r['rel_ref']:.2e} vs the float64 reference"
                assert r["rel_base"] <= 1e-5, f"{where}: no-LoRA layer rel err {r['rel_base']:.2e} vs the reference"
                assert r["adapter_bitwise"], f"{where}: a token without an adapter moved when others changed adapter"
                assert r["adapter_moved"] or r["T"] == 0, f"{where}: swapping adapters changed nothing (test is void)"
                if device == "cpu":  # cuBLAS may pick another GEMM for another batch size: bitwise on the CPU only
                    assert r["single_bitwise"], f"{where}: a token with all experts on one rank differs from one " \
                                                f"process"
                assert r["static_shape"] == r["shape"], f"{where}: static-capacity output shape {r['static_shape']}"
                assert r["static_rel_single"] <= 1e-5, f"{where}: static-capacity rel err {r['static_rel_single']:.2e}"
                assert r["static_adapter_bitwise"], f"{where}: static capacity: a token without an adapter moved"
                assert r["static_load"] == r["load"], f"{where}: padding rows were counted as load"
            if name == "uneven":
                assert any(res[(mode, name)]["T"] == 0 for res in results), "no rank with T = 0 in the uneven case"
                assert sum(res[(mode, name)]["no_adapter"] for res in results) > 0, "no token without an adapter"
            else:
                assert results[0][(mode, name)]["sent_home_only"], "rank 0's tokens were meant to stay home"
        for rank, res in enumerate(results):
            if R == 2:
                assert res[(mode, "mixed_none")] <= 1e-5, f"{mode}, rank {rank}: lora_ids None on one rank only"
                keys = [k for k in res if isinstance(k, tuple) and k[0] == mode and k[1].startswith("bf16")]
                assert len(keys) == (4 if device == "cuda" else 2), f"{mode}: bf16 checks ran: {keys}"
                for key in keys:
                    dtype, err = res[key]
                    assert dtype == "torch.bfloat16" and err <= 1e-2, f"{key}, rank {rank}: {dtype} rel err {err}"
                if device == "cuda":
                    g = res[(mode, "graph")]
                    assert "capture_error" not in g, f"{mode}, rank {rank}: capture failed: {g.get('capture_error')}"
                    # the replay may use the kernels' PDL variants (moelab._runtime): same math, so equal in
                    # practice; bitwise equality is reported (replay_equals_eager), not required
                    assert g["rel_eager"] <= 1e-3, f"{mode}, rank {rank}: replay vs eager rel err {g['rel_eager']}"
                    assert g["rel_ref"] <= 1e-2, f"{mode}, rank {rank}: replay rel err {g['rel_ref']:.2e}"
                    assert g["refused"] and "max_tokens_per_rank" in g["refused"], \
                        f"{mode}, rank {rank}: the dynamic layer under capture: {g['refused']!r}"
                    assert g["after_refusal"] <= 1e-2, f"{mode}, rank {rank}: wrong after refusing capture"
            err = res[(mode, "static_over_capacity")]
            want = "max_tokens_per_rank = 3" if rank == R - 1 else f"rank(s) [{R - 1}] rejected"
            assert err is not None and want in err, f"{mode}, rank {rank}: over capacity raised {err!r}"
            err = res[(mode, "static_unvalidated_bad_rank")]
            if rank == R - 1:
                assert err is not None and "topk_weights" in err, f"{mode}: the bad rank raised {err!r}"
                assert res[(mode, "static_unvalidated_others")] is None
            else:
                assert err is None, f"{mode}, rank {rank}: raised {err!r} for another rank's unvalidated input"
                rel = res[(mode, "static_unvalidated_others")]
                assert rel is not None and rel <= 1e-5, f"{mode}, rank {rank}: rel err {rel} beside a bad rank"
            assert res[(mode, "all_empty")] == (0, H), f"{mode}: T = 0 everywhere gave {res[(mode, 'all_empty')]}"
            err = res[(mode, "bad_input")]
            assert err is not None, f"{mode}: rank {rank} did not raise when rank {R - 1} passed a bad expert id"
            want = "topk_ids: expected logical expert ids" if rank == R - 1 else f"rank(s) [{R - 1}] rejected"
            assert want in err, f"{mode}: rank {rank} raised {err!r}, expected {want!r}"
            assert res[(mode, "after_bad_input")] <= 1e-5, f"{mode}: the call after a rejected one is wrong"
        eplb = [res[(mode, "eplb")] for res in results]
        for rank, r in enumerate(eplb):
            for key in ("rel_before", "rel_after", "rel_move"):
                assert r[key] <= 1e-5, f"{mode}, EPLB, rank {rank}: {key} = {r[key]:.2e}"
        before, after = eplb[0]["load_before"], eplb[0]["load_after"]
        assert sum(before) == sum(after), f"{mode}: slots lost in rebalancing: {before} vs {after}"
        mean = sum(after) / R
        # the algorithm's promise on the predicted loads, plus the round-robin split's rounding: each rank's slots
        # of an expert split over its copies within one slot, so a GPU's measured load is off by < R * P_local
        promise = mean + (1 - 1 / R) * eplb[0]["max_per_copy"] + R * eplb[0]["P_local"]
        assert max(after) <= promise, f"{mode}: loads after EPLB {after}, promised max {promise:.1f}"
        assert max(eplb[0]["predicted"]) <= mean + (1 - 1 / R) * eplb[0]["max_per_copy"] + 1e-9
        assert max(after) / mean < max(before) / (sum(before) / R), f"{mode}: EPLB did not help: {before} -> {after}"
    for rank, res in enumerate(results):
        for key, want in (("map_no_copy", "have none"), ("map_rank_out_of_range", f"in a group of {R}"),
                          ("map_differs", "rank")):
            assert res[key] is not None, f"rank {rank}: no error for {key}"
            assert want in res[key], f"rank {rank}, {key}: {res[key]!r} does not say {want!r}"
        assert ("same expert_map" in res["map_differs"]) or ("rejected" in res["map_differs"]), res["map_differs"]


def _check_bench(rows, device="cpu"):
    graphs = device == "cuda"
    want = (2 if graphs else 1) + 2 * 2 * (3 if graphs else 2)  # baseline + modes x placements x variants
    assert len(rows) == want, f"expected {want} rows, got {len(rows)}: {rows}"
    for row in rows:
        assert "error" not in row, row
        assert row["ms"] > 0 and row["tokens_per_s"] > 0 and row["speedup"] > 0, row
        if row["gpus"] == 2 and row["variant"] != "graph":
            assert row["comm_ms"] > 0 and row["experts_ms"] > 0 and row["bytes_sent"] > 0, row
            assert 1 <= row["imbalance"] <= 2, row
    eplb = [r["imbalance"] for r in rows if r.get("placement") == "eplb" and "imbalance" in r]
    contiguous = [r["imbalance"] for r in rows if r.get("placement") == "contiguous" and "imbalance" in r]
    assert eplb and max(eplb) <= max(contiguous), f"EPLB {eplb} vs contiguous {contiguous}"
    from moelab.distributed.bench import _table

    assert "| skew | T | gpus | mode |" in _table(rows)


def test_bench_needs_gpus_or_tiny(capsys):
    from moelab.distributed import bench

    if torch.cuda.device_count() < 64:
        assert bench.main(["--gpus", "64"]) == 2
        assert "use --tiny" in capsys.readouterr().err


NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL); the gloo test covers the CPU")
def test_expert_parallel_on_nccl():
    """The same checks on 2 GPUs under NCCL, plus the triton backend in bf16 and CUDA-graph capture."""
    results = moelab.distributed.spawn_ranks(_rank_checks, 2, "cuda", device="cuda", timeout=120, env=NCCL_ENV)
    _check_results(results, 2, "cuda")
    _check_bench(results[0]["bench"], "cuda")


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_parallel_on_gloo(world_size):
    # TRITON_INTERPRET=0: the ranks' torch backend runs in plain torch; in Triton's interpreter its LoRA grouping
    # alone takes ~2 s a call on 2 cores (the kernels have their own tests; here the dispatch is under test).
    results = moelab.distributed.spawn_ranks(_rank_checks, world_size, timeout=60, env={"TRITON_INTERPRET": "0"})
    _check_results(results, world_size)
    if world_size == 2:
        _check_bench(results[0]["bench"])


if __name__ == "__main__":  # torchrun --nproc-per-node N tests/test_distributed.py
    import torch.distributed as dist

    rank, world_size = moelab.distributed.init_from_env()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # init_from_env: NCCL exactly when CUDA is available
    mine = _rank_checks(rank, world_size, device)
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    if rank == 0:
        _check_results(every, world_size, device)
        print(f"test_distributed: all checks passed on {world_size} ranks")
    dist.destroy_process_group()  # before the interpreter exits (moelab.distributed's docstring says why)
    left = _gloo_threads() if sys.platform.startswith("linux") else []
    assert not left, f"rank {rank}: the process group outlived destroy_process_group (gloo threads {left})"
