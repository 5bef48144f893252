"""The fused adapter loop (``LoRAExperts(fused="adapter-loop")``, what a wide bank takes on the triton backend)
against ``moelab.reference.lora_experts`` in float64: mixed ranks in a wider bank, several adapters in every tile,
tokens without an adapter bit for bit the base path's, every float buffer NaN-poisoned, in its decode mode, its
tile mode and its tile mode over rows sorted by adapter.
"""

import pytest
import torch
from helpers import assert_close_to_reference, lora_and_base_outputs
from test_experts import make_bank, make_problem

import moelab
from moelab import reference
from moelab.backends import triton_backend
from moelab.kernels import fused_lora
from moelab.kernels.moe_gemm import GemmConfig

#: "decode": the one-launch decode mode; "tiles": the tile shrinks (decode turned off); "sorted": tiles over rows
#: sorted by adapter inside each expert (few experts, many rows each).
MODES = {"decode": dict(E=8), "tiles": dict(E=8), "sorted": dict(E=2)}


def _poison_empty(monkeypatch):
    """Every float buffer ``torch.empty`` hands out starts as NaN: an element no kernel wrote cannot pass."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t

    monkeypatch.setattr(torch, "empty", poisoned)


def _spy(monkeypatch, names):
    calls = []
    for name in names:
        original = getattr(fused_lora, name)
        monkeypatch.setattr(fused_lora, name, lambda *a, _n=name, _f=original, **k: calls.append(_n) or _f(*a, **k))
    return calls


def _run(mode, monkeypatch, device, *, T=40, K=2, H=32, I=24, dtype=torch.bfloat16, ranks=(64, 8, 32, 16, 3),
         max_rank=64, seed=0, lora_ids=None):
    if mode != "decode":
        monkeypatch.setattr(triton_backend, "FUSED_DECODE_MAX_SLOTS", 0)
    E = MODES[mode]["E"]
    L = len(ranks)
    if lora_ids is None:  # every adapter and -1 in every tile
        lora_ids = (torch.arange(T) * 7 + seed) % (L + 1) - 1
    x, ids, w, w13, w2, lora_ids, adapters = make_problem(T, K, E, H, I, dtype, device, L=L, ranks=ranks, seed=seed,
                                                          lora_ids=lora_ids)
    bank = make_bank(adapters, E, 0, H, I, max_rank, dtype, device)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton", fused="adapter-loop")
    return experts, (x, w, ids, lora_ids), reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype, seed", [(torch.bfloat16, 0), (torch.float32, 1)])
def test_adapter_loop_matches_reference(mode, dtype, seed, monkeypatch, device):
    """Ranks 64, 8, 32, 16, 3 in a max_rank-64 bank (R_PAD 64: the rank-8 and rank-3 slots are mostly padding),
    all five adapters and tokens without one in every tile; all float buffers poisoned; -1 tokens equal the base
    path's rows bit for bit."""
    launches = _spy(monkeypatch, ["adapter_loop_decode_launch", "adapter_loop_shrink_w13", "adapter_loop_shrink_w2",
                                  "adapter_sorted_segments"])
    experts, (x, w, ids, lora_ids), ref = _run(mode, monkeypatch, device, dtype=dtype, seed=seed)
    assert ref["lora"].norm() > 0.3 * ref["base"].norm(), "the adapters must matter for this test to mean anything"
    _poison_empty(monkeypatch)
    out, base = lora_and_base_outputs(experts, x, w, ids, lora_ids)
    tiles = ["adapter_loop_shrink_w13", "adapter_loop_shrink_w2"]
    assert launches == {"decode": ["adapter_loop_decode_launch"], "tiles": tiles,
                        "sorted": ["adapter_sorted_segments"] + tiles}[mode]
    assert bool(torch.isfinite(out).all())
    assert_close_to_reference(out, ref["output"], dtype, f"{mode} output")
    assert_close_to_reference(out.double() - base.double(), ref["lora"], dtype, f"{mode} LoRA part")
    none = lora_ids < 0
    assert none.any() and torch.equal(out[none], base[none])


@pytest.mark.parametrize("dtype, on_one, tile", [(torch.bfloat16, 0.7, None), (torch.float32, 0.7, None),
                                                 (torch.float32, 1.0, None), (torch.float32, 0.7, 128),
                                                 (torch.float32, 1.0, 128)])
def test_sorted_shrinks_take_whole_pairs(dtype, on_one, tile, monkeypatch, device):
    """Over rows sorted by adapter the tile shrinks run each (adapter, expert) pair's rows from its first row, in
    runs of ``PAIR_M`` rows, by the program whose sub-tile holds that first row (forced on these small shapes'
    sub-tiles; the module takes it at ``SHRINK_PAIRS_SUB_M`` rows, the other tests here run the sub-tiles). Here
    adapter 0 has most tokens (``on_one``), so its pairs run past ``PAIR_M`` rows and across sub-tiles and GEMM
    tiles, and the other pairs start inside sub-tiles. K = E = 2, so each expert has T rows: with every token on
    adapter 0 (1.0) an expert's last row and the next expert's first are both adapter 0's, at a tile boundary
    (T = 160 on the device's own tiles: ten of 16 on a CPU; T = 256 on ``tile`` = 128-row tiles, two an expert,
    whose sub-tiles are narrower than the tile and the runs wider than the sub-tiles). Every row's rank vectors
    must still be written and right (float buffers poisoned, float64 reference, tokens without an adapter bit for
    bit the base path's)."""
    kept = []
    original = fused_lora.adapter_loop_shrink_w13
    monkeypatch.setattr(fused_lora, "adapter_loop_shrink_w13",
                        lambda *a, **k: kept.append(original(*a, **k)) or kept[-1])
    monkeypatch.setattr(fused_lora, "shrink_takes_pairs", lambda sub_m: True)  # on these small shapes' sub-tiles
    if tile:  # the pipeline caches its layout per shape: cleared before and after
        monkeypatch.setattr(triton_backend, "choose_config", lambda *a, **k: GemmConfig(tile, 32, 32, 4, 1))
        triton_backend._layout.cache_clear()
    T = 256 if tile else 160
    lora_ids = torch.where(torch.arange(T) % 10 < 10 * on_one, 0, (torch.arange(T) * 7) % 6 - 1)
    try:
        experts, (x, w, ids, lora_ids), ref = _run("sorted", monkeypatch, device, T=T, dtype=dtype, seed=3,
                                                   lora_ids=lora_ids)
        _poison_empty(monkeypatch)
        out, base = lora_and_base_outputs(experts, x, w, ids, lora_ids)
    finally:
        triton_backend._layout.cache_clear()
    lora = kept[0]
    meta = lora.shrink_meta
    assert meta["PAIRS"] and meta["SUB_M"] < meta["PAIR_M"]
    if tile:
        assert lora.segments.tile == tile and meta["SUB_M"] < tile and T % tile == 0
    longest = max(int(((ids == e) & (lora_ids == 0)[:, None]).sum()) for e in range(MODES["sorted"]["E"]))
    assert longest > meta["PAIR_M"], "a pair must need more than one run of PAIR_M rows"
    assert_close_to_reference(out, ref["output"], dtype, "output")
    assert_close_to_reference(out.double() - base.double(), ref["lora"], dtype, "LoRA part")
    none = lora_ids < 0
    assert torch.equal(out[none], base[none]) and none.any() == (on_one < 1)


def test_whole_pairs_only_over_rows_sorted_by_adapter(monkeypatch, device):
    """The tile shrinks take whole pairs only over segments built in the adapters' token order (what the segments
    say, not a rule recomputed beside them): with the pairs asked for on rows in slot order, the sub-tiles run. A
    speed rule: the whole-pair runs also give the right rows in slot order (tried), where a pair is many short runs."""
    kept = []
    original = fused_lora.adapter_loop_shrink_w13
    monkeypatch.setattr(fused_lora, "adapter_loop_shrink_w13",
                        lambda *a, **k: kept.append(original(*a, **k)) or kept[-1])
    monkeypatch.setattr(fused_lora, "shrink_takes_pairs", lambda sub_m: True)
    experts, (x, w, ids, lora_ids), ref = _run("tiles", monkeypatch, device, dtype=torch.float32, seed=4)
    _poison_empty(monkeypatch)
    out = experts(x, w, ids, lora_ids)
    (lora,) = kept
    assert not lora.segments.token_ordered and not lora.shrink_meta["PAIRS"]
    assert_close_to_reference(out, ref["output"], torch.float32, "output")
    # Segments sorted by adapter where the pipeline's own rule would not sort (few rows an expert): whole pairs
    E, ids32, lora_ids32 = MODES["tiles"]["E"], ids.to(torch.int32), lora_ids.to(torch.int32).contiguous()
    assert not fused_lora.sorts_by_adapter(ids.numel(), E, experts.lora.max_loras, lora.sub_m)
    seg = fused_lora.adapter_sorted_segments(ids32, lora_ids32, experts.lora.max_loras, E, lora.segments.tile, 0, {})
    by_adapter = original(x, experts.lora, lora_ids32, w.float().contiguous(), seg, top_k=ids.shape[1],
                          num_local_experts=E, pdl={})
    assert seg.token_ordered and by_adapter.shrink_meta["PAIRS"]


@pytest.mark.parametrize("mode", list(MODES))
def test_rank_vectors_are_zero_past_each_adapters_rank(mode, monkeypatch, device):
    """A rank-8 adapter in a max_rank-64 bank: its rows' rank vectors are written in all 64 columns, zeros past 8
    (the scratch starts as NaN), so nothing past an adapter's rank can reach a product."""
    kept = []
    for name in ("adapter_loop_decode_launch", "adapter_loop_shrink_w13"):
        original = getattr(fused_lora, name)
        monkeypatch.setattr(fused_lora, name, lambda *a, _f=original, **k: kept.append(_f(*a, **k)) or kept[-1])
    experts, (x, w, ids, lora_ids), ref = _run(mode, monkeypatch, device, dtype=torch.float32, ranks=(8, 64), seed=2)
    moelab.set_debug(True)  # the scratch buffers are NaN-poisoned
    try:
        out = experts(x, w, ids, lora_ids)
    finally:
        moelab.set_debug(False)
    assert_close_to_reference(out, ref["output"], torch.float32, f"{mode} output")
    (lora,) = kept
    if lora.decode:  # by slot
        slot_adapter = torch.repeat_interleave(lora_ids, ids.shape[1])
        rows = torch.arange(slot_adapter.numel(), device=device)
    else:  # by permuted row
        live = lora.segments.row_to_slot >= 0
        rows = torch.nonzero(live).flatten()
        slot_adapter = lora_ids[lora.segments.row_to_slot[rows].long() // ids.shape[1]]
        rows = rows[slot_adapter >= 0]
        slot_adapter = slot_adapter[slot_adapter >= 0]
    rank8 = rows[slot_adapter == 0]
    assert rank8.numel() > 0
    assert torch.equal(lora.s13[rank8][:, :, 8:], torch.zeros_like(lora.s13[rank8][:, :, 8:]))
    assert not lora.s13[rank8][:, :, :8].eq(0).all()
    if not lora.decode:  # the W2 shrink's rank vectors too (at decode GEMM1 sums them by slot)
        assert torch.equal(lora.s2[rank8][:, 8:], torch.zeros_like(lora.s2[rank8][:, 8:]))


@pytest.mark.parametrize("mode,wide", [("tiles", False), ("sorted", False), ("sorted", True)])
def test_the_tile_shrink_writes_each_tiles_packing(mode, wide, monkeypatch, device):
    """The W13 tile shrink also writes how the Gluon GEMMs pack each live tile's adapters side by side in their LoRA
    K steps (adapter order, ceil(rank / 8) units of 8 ranks each): each row's rank (0 without an adapter) and its
    adapter's first unit, the tile's units in all and each unit's ``adapter << 16 | first unit``. Checked tile by
    tile against a model built from the segments, the tokens' adapters and the bank's ranks (the buffers start at a
    value no entry can hold). ``wide``: max_rank 136 (17 units an adapter) and an empty slot between adapters."""
    kept = []
    original = fused_lora.adapter_loop_shrink_w13
    monkeypatch.setattr(fused_lora, "adapter_loop_shrink_w13",
                        lambda *a, **k: kept.append(original(*a, **k)) or kept[-1])
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(-7))
    ranks, max_rank = ((136, 8, 40, 3), 136) if wide else ((64, 8, 32, 16, 3), 64)
    experts, (x, w, ids, lora_ids), _ = _run(mode, monkeypatch, device, dtype=torch.float32, ranks=ranks,
                                             max_rank=max_rank)
    if wide:  # slot 1 emptied: no token names it, tiles hold slots 0 and 2 around it
        experts.lora.reset(1)
        lora_ids[lora_ids == 1] = -1
    experts(x, w, ids, lora_ids)
    (lora,) = kept
    seg = lora.segments
    slots = seg.row_to_slot.long()
    adapter = torch.where(slots >= 0, lora_ids.long()[slots.clamp(min=0) // ids.shape[1]], -1)
    rank = torch.where(adapter >= 0, experts.lora.rank_table().long()[adapter.clamp(min=0)], 0)
    several = 0
    for t in (seg.block_group >= 0).nonzero().squeeze(1).tolist():
        rows = slice(t * seg.tile, (t + 1) * seg.tile)
        first, units, unit_map = {}, 0, []
        for a in sorted(set(adapter[rows].tolist()) - {-1}):
            first[a] = units
            n = -(-int(rank[rows][adapter[rows] == a].max()) // 8)
            unit_map += [a << 16 | units] * n
            units += n
        several += len(first) > 1
        want_first = [first.get(a, 0) for a in adapter[rows].tolist()]
        assert lora.row_first_units[rows].tolist() == want_first, f"tile {t}: rows' first units"
        assert torch.equal(lora.row_ranks[rows].long(), rank[rows]), f"tile {t}: rows' ranks"
        assert lora.tile_units[t].item() == units, f"tile {t}: units in all"
        assert lora.unit_map[t, :units].tolist() == unit_map, f"tile {t}: the unit map"
    assert several and (adapter[(seg.block_group >= 0).repeat_interleave(seg.tile)] == -1).any()


def test_rank_table_follows_set_reset_and_direct_assignment(monkeypatch, device):
    """The kernels read each slot's rank from ``LoRABank.rank_table()``: ``set`` and ``reset`` update it in place
    (the same tensor, as a captured CUDA graph reads it), a ``ranks`` list assigned directly is copied at the next
    call; a slot reloaded with a higher rank is then right (a stale table would cut its ranks)."""
    experts, (x, w, ids, lora_ids), _ = _run("decode", monkeypatch, device, dtype=torch.float32, ranks=(4, 8),
                                             max_rank=16)
    bank = experts.lora
    table = bank.rank_table()
    assert table.tolist() == [4, 8]
    experts(x, w, ids, lora_ids)
    E, H, I, r = bank.num_local_experts, bank.hidden_size, bank.intermediate_size, 16
    g = torch.Generator().manual_seed(5)
    bank.set(0, gate_a=torch.randn(E, r, H, generator=g) / H**0.5, gate_b=torch.randn(E, I, r, generator=g),
             up_a=torch.randn(E, r, H, generator=g) / H**0.5, up_b=torch.randn(E, I, r, generator=g),
             down_a=torch.randn(E, r, I, generator=g) / I**0.5, down_b=torch.randn(E, H, r, generator=g))
    assert bank.rank_table() is table and table.tolist() == [16, 8]
    w13, w2 = experts.weights.gemm1_weights, experts.weights.gemm2_weights
    ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)
    assert_close_to_reference(experts(x, w, ids, lora_ids), ref["output"], torch.float32, "after set")
    bank.reset(1)
    assert table.tolist() == [16, 0]
    bank.ranks = [16, 8]  # as code that copies a bank's tensors does
    assert bank.rank_table().tolist() == [16, 8]


def test_adapter_sorted_segments_are_the_expert_segments_sorted_by_adapter(device):
    """Same tile-aligned expert segments as the base path's (same sizes, same tiles), each expert's rows holding its
    slots ordered by (adapter, token), tokens with no adapter (-1 or an id outside the bank) last; slot_to_row and
    row_to_slot inverse to each other. Sizes on both sides of the one-program segments (1024 slots)."""
    E, tile, offset, L = 4, 16, 2, 5
    for T, K in ((37, 3), (1030, 2)):
        _check_adapter_sorted_segments(T, K, E, tile, offset, L, device)


def _check_adapter_sorted_segments(T, K, E, tile, offset, L, device):
    from moelab.kernels.segments import build_segments_triton
    from moelab.permutation import Segments

    g = torch.Generator().manual_seed(T)
    ids = torch.rand(T, E + offset, generator=g).topk(K, dim=1).indices.to(torch.int32)  # some slots not local
    lora_ids = torch.randint(-2, L + 2, (T,), generator=g)  # ids outside [0, L): no adapter
    seg = fused_lora.adapter_sorted_segments(ids.to(device), lora_ids.to(device), L, E, tile, offset, {})
    base = build_segments_triton(ids.to(device), E, tile, offset=offset)
    seg, base = (Segments(v.slot_to_row.cpu(), v.row_to_slot.cpu(), v.block_group.cpu(), v.tile, v.num_groups)
                 for v in (seg, base))
    assert torch.equal(seg.block_group, base.block_group)
    assert torch.equal(seg.slot_to_row < 0, base.slot_to_row < 0)
    live = torch.nonzero(seg.slot_to_row >= 0).flatten()
    assert torch.equal(seg.row_to_slot[seg.slot_to_row[live].long()], live.to(torch.int32))
    assert int((seg.row_to_slot >= 0).sum()) == live.numel()
    for e in range(E):
        rows = torch.nonzero(base.block_group.repeat_interleave(tile) == e).flatten()
        slots = seg.row_to_slot[rows]
        slots = slots[slots >= 0].long()
        assert sorted(slots.tolist()) == sorted(base.row_to_slot[rows][base.row_to_slot[rows] >= 0].tolist())
        key = [(int(lora_ids[s // K]) if 0 <= lora_ids[s // K] < L else L, int(s)) for s in slots]
        assert key == sorted(key)
        assert (ids.flatten()[slots] - offset == e).all()


def test_adapter_loop_under_expert_parallelism(monkeypatch, device):
    """A window of 3 of 8 experts (slots outside it write nothing), tile mode: this rank's partial sum."""
    monkeypatch.setattr(triton_backend, "FUSED_DECODE_MAX_SLOTS", 0)
    T, K, E, H, I, offset, n, dtype = 12, 3, 8, 32, 16, 4, 3, torch.float32
    x, ids, w, w13, w2, lora_ids, adapters = make_problem(T, K, E, H, I, dtype, device, L=3, ranks=(20, 4, 9), seed=6)
    bank = make_bank(adapters, n, offset, H, I, 20, dtype, device)
    experts = moelab.LoRAExperts(w13[offset:offset + n], w2[offset:offset + n], num_experts=E, top_k=K, lora=bank,
                                 local_expert_offset=offset, backend="triton", fused="adapter-loop")
    ref = reference.lora_experts(x, w, ids, lora_ids, w13[offset:offset + n], w2[offset:offset + n], bank,
                                 local_expert_offset=offset)
    assert_close_to_reference(experts(x, w, ids, lora_ids), ref["output"], dtype, "window")


def test_wide_banks_take_the_adapter_loop_at_small_batches_and_narrow_ones_keep_stacked_columns(monkeypatch, device):
    """The module's own choice: a bank past MAX_FUSED_LORA_COLUMNS stacked columns (4 adapters of max_rank 64: 256)
    runs the adapter loop up to ADAPTER_LOOP_MAX_ROWS_PER_EXPERT rows per expert (T=1, K=2, 4 experts: 0.5) and
    vLLM's flow above (T=3), fused=True the adapter loop at both; a narrow bank keeps the stacked decode mode;
    forcing a stacked mode on a wide bank raises, naming the argument."""
    from moelab.backends import lora_flow

    calls = _spy(monkeypatch, ["adapter_loop_decode_launch", "decode_segments_w13_shrink"])
    flow = lora_flow.lora_experts
    monkeypatch.setattr(lora_flow, "lora_experts", lambda *a, **k: calls.append("flow") or flow(*a, **k))
    assert triton_backend.ADAPTER_LOOP_MAX_ROWS_PER_EXPERT == 0.5
    for T, max_rank, fused, want in [(1, 64, None, "adapter_loop_decode_launch"), (3, 64, None, "flow"),
                                     (3, 64, True, "adapter_loop_decode_launch"),
                                     (3, 8, None, "decode_segments_w13_shrink")]:
        x, ids, w, w13, w2, lora_ids, adapters = make_problem(T, 2, 4, 32, 16, torch.float32, device, L=4,
                                                              ranks=(8, 4, 2, 8), lora_ids=torch.arange(T) % 4)
        bank = make_bank(adapters, 4, 0, 32, 16, max_rank, torch.float32, device)
        experts = moelab.LoRAExperts(w13, w2, num_experts=4, top_k=2, lora=bank, backend="triton", fused=fused)
        assert experts.fused
        calls.clear()
        out = experts(x, w, ids, lora_ids)
        assert calls == [want], (T, max_rank, fused)
        assert_close_to_reference(out, reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)["output"],
                                  torch.float32, f"T={T} max_rank {max_rank} fused={fused}")
    wide = make_bank(adapters, 4, 0, 32, 16, 64, torch.float32, device)
    for path in ("tiles", "decode"):
        with pytest.raises(ValueError, match=f"fused:.*'{path}' path takes banks of at most 64 stacked columns"):
            moelab.LoRAExperts(w13, w2, num_experts=4, top_k=2, lora=wide, backend="triton", fused=path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU sizes and CUDA graphs (runs on the H200)")
def test_adapter_loop_at_gpu_sizes_sorted_rows_and_cuda_graph():
    """T = 2048, 8 experts (512 rows each: tiles of 128 rows over rows sorted by adapter), 8 adapters of ranks
    64..8 in a max_rank-64 bank, a quarter of the tokens without one: checked against float64 on 64 tokens, -1
    tokens bit for bit the base path's; then captured in a CUDA graph, replayed on new inputs, and replayed again
    after ``bank.set`` reloads a slot with a higher rank (the rank table is updated in place)."""
    T, K, E, H, I, dtype, device = 2048, 2, 8, 256, 128, torch.bfloat16, "cuda"
    ranks = (64, 32, 16, 8) * 2
    g = torch.Generator().manual_seed(4)
    lora_ids = torch.randint(-1, 8, (T,), generator=g)
    lora_ids[::4] = -1
    x, ids, w, w13, w2, lora_ids, adapters = make_problem(T, K, E, H, I, dtype, device, L=8, ranks=ranks, seed=4,
                                                          lora_ids=lora_ids)
    bank = make_bank(adapters, E, 0, H, I, 64, dtype, device)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton", fused="adapter-loop")
    out, base = experts(x, w, ids, lora_ids), experts(x, w, ids, None)
    none = lora_ids < 0
    assert torch.equal(out[none], base[none])
    rows = torch.arange(0, T, T // 64, device=device)
    ref = reference.lora_experts(x[rows], w[rows], ids[rows], lora_ids[rows], w13, w2, bank)
    assert_close_to_reference(out[rows], ref["output"], dtype, "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = experts(x, w, ids, lora_ids, has_lora=True, validate=False)
    x2, ids2, w2_, _, _, _, _ = make_problem(T, K, E, H, I, dtype, device, L=8, ranks=ranks, seed=9, lora_ids=lora_ids)
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2_)
    for step in ("replay", "after set"):
        if step == "after set":  # slot 3 (rank 8) reloaded at rank 48
            a = make_problem(1, K, E, H, I, dtype, "cpu", L=1, ranks=(48,), seed=12)[-1][0]
            bank.set(3, scaling=0.5, **{k: v.to(dtype).to(device) for k, v in a.items()})
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.lora_experts(x[rows], w[rows], ids[rows], lora_ids[rows], w13, w2, bank)
        assert_close_to_reference(captured[rows], ref["output"], dtype, step)


def test_adapter_loop_fp32_decode_tile_fits_the_h200_shared_memory():
    """fp32 decode tiles hold the adapter loop's operands in shared memory: the H200 refused the 16x128x128 tile
    at one stage (245760 B asked, 232448 there, R_PAD 64); counted, the tile choice halves BLOCK_K to fit."""
    from moelab.kernels.moe_gemm import DeviceLimits, GemmConfig, choose_config, shared_memory_bytes

    h200 = DeviceLimits((9, 0), 232448)
    assert shared_memory_bytes(GemmConfig(16, 128, 128, 4, 1), 4, 64, lora_own=True) == 245760
    cfg = choose_config(3, 2, 8, torch.float32, 64, device=h200, lora_own=True)
    assert cfg.block_m == 16 and shared_memory_bytes(cfg, 4, 64, lora_own=True) <= h200.shared_memory
    bf16 = choose_config(32, 8, 128, torch.bfloat16, 64, device=h200, lora_own=True)  # as measured: unchanged
    assert bf16 == choose_config(32, 8, 128, torch.bfloat16, 64, device=h200)
