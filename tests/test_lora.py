"""moelab.lora against the float64 reference: the LoRABank and the W13 / W2 deltas (docs/contract.md §5, §7).

Adapters are drawn so their contribution is O(1) (A ~ randn / sqrt(width), B ~ randn), never near zero, so a
wrong slice, adapter or expert shows up as a large relative error. Every case runs the Triton kernel (the
interpreter on a CPU) and the torch fallback.
"""

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moelab.lora
from moelab import reference
from moelab.lora import LoRABank, build_lora_segments, lora_scaling, lora_segments, w2_lora_delta, w13_lora_delta
from tests.helpers import assert_close_to_reference, poison, random_topk_ids, random_weights

PATHS = [
    pytest.param("segments", id="triton-segments"),  # Triton, slots grouped by (adapter, expert) into tiles
    pytest.param("per-slot", id="triton-per-slot"),  # Triton, one program per slot, no grouping (decode)
    pytest.param("torch", id="torch"),  # the torch fallback (always grouped)
]
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


@pytest.fixture
def path(request):
    """The ``path`` parameter as the deltas' ``use_triton`` and ``per_slot`` arguments."""
    return {"segments": {"use_triton": True, "per_slot": False}, "per-slot": {"use_triton": True, "per_slot": True},
            "torch": {"use_triton": False}}[request.param]


def random_adapter(E: int, H: int, I: int, r: int, *, zero: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """fp32 factors of one adapter for ``LoRABank.set``; names in ``zero`` are all zeros."""
    shapes = {"gate_a": (E, r, H), "gate_b": (E, I, r), "up_a": (E, r, H), "up_b": (E, I, r),
              "down_a": (E, r, I), "down_b": (E, H, r)}
    fan_in = {"gate_a": H, "up_a": H, "down_a": I}
    return {name: torch.zeros(shape) if name in zero else torch.randn(shape) / fan_in.get(name, 1) ** 0.5
            for name, shape in shapes.items()}


def make_bank(L, E, H, I, max_rank, ranks, dtype, *, zero=(), device="cpu") -> LoRABank:
    """A bank whose slot s holds a random adapter of rank ``ranks[s]`` (0: left empty)."""
    bank = LoRABank(L, E, H, I, max_rank, dtype=dtype, device=device)
    for slot, r in enumerate(ranks):
        if r:
            bank.set(slot, **random_adapter(E, H, I, r, zero=zero))
    return bank


def zero_slots(topk_ids, lora_ids, num_local_experts, local_expert_offset=0) -> torch.Tensor:
    """bool [T, K]: the slots whose delta must be exactly zero (no adapter, or a non-local expert)."""
    e = topk_ids.long() - local_expert_offset
    return (lora_ids[:, None] < 0) | (e < 0) | (e >= num_local_experts)


@dataclass
class Case:
    T: int
    K: int
    E: int  # global experts
    E_local: int
    H: int
    I: int
    ranks: tuple[int, ...]  # one per bank slot; 0 = empty slot
    max_rank: int = 16
    offset: int = 0


CASES = [
    # several adapters of several ranks in one batch, -1 tokens, odd H and I (masked K and N tails)
    pytest.param(Case(T=13, K=3, E=4, E_local=4, H=48, I=40, ranks=(4, 16, 7)), id="mixed-ranks"),
    # max_rank 12 is no power of two: the kernel pads the rank to 16 with masked loads
    pytest.param(Case(T=9, K=2, E=5, E_local=5, H=40, I=24, ranks=(12, 3), max_rank=12), id="rank12"),
    # max_rank 32: BLOCK_R = 32, wider than tl.dot's minimum
    pytest.param(Case(T=8, K=2, E=3, E_local=3, H=64, I=64, ranks=(32, 5), max_rank=32), id="rank32"),
    # T = 1: every tile is mostly padding rows
    pytest.param(Case(T=1, K=2, E=4, E_local=4, H=32, I=16, ranks=(8, 8)), id="T1"),
    # K = E: every expert in every token; one adapter, so a group spans more than one 16-row tile
    pytest.param(Case(T=16, K=4, E=4, E_local=4, H=32, I=48, ranks=(16,)), id="K-eq-E-multitile"),
    # EP window [4, 8) of 8 global experts: ids below 4 must give exactly zero rows
    pytest.param(Case(T=12, K=3, E=8, E_local=4, H=48, I=40, ranks=(6, 16), offset=4), id="ep-window"),
    # an empty slot (rank 0) referenced by tokens: its rows are exactly zero too
    pytest.param(Case(T=10, K=2, E=3, E_local=3, H=16, I=16, ranks=(0, 5)), id="empty-slot"),
]


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_deltas_match_reference(case: Case, dtype, path, device):
    c = case
    L = len(c.ranks)
    bank = make_bank(L, c.E_local, c.H, c.I, c.max_rank, c.ranks, dtype, device=device)
    x = torch.randn(c.T, c.H).to(dtype).to(device)
    topk_ids = random_topk_ids(c.T, c.K, c.E, device=device)
    lora_ids = torch.randint(-1, L, (c.T,)).to(device)
    weights = random_weights(c.T, c.K) * torch.where(torch.rand(c.T, c.K) < 0.3, -1.0, 1.0)  # signed on purpose
    weights = weights.to(device)
    act = torch.randn(c.T * c.K, c.I).to(dtype).to(device)
    zero = zero_slots(topk_ids, lora_ids, c.E_local, c.offset)

    # An id naming an empty slot raises with validate=True (tests/test_errors.py); unvalidated it gives zero rows.
    validate = 0 not in c.ranks
    out13 = poison(torch.empty(c.T, c.K, 2 * c.I, dtype=dtype, device=device))
    got13 = w13_lora_delta(x, topk_ids, lora_ids, bank, local_expert_offset=c.offset, out=out13,
                           **path, validate=validate)
    assert got13 is out13 and got13.dtype == dtype
    ref13 = reference.w13_lora_delta(x, topk_ids, lora_ids, bank, local_expert_offset=c.offset)
    assert_close_to_reference(got13, ref13, dtype, "w13_lora_delta")
    assert torch.equal(got13[zero], torch.zeros_like(got13[zero]))

    out2 = poison(torch.empty(c.T, c.K, c.H, dtype=dtype, device=device))
    got2 = w2_lora_delta(act, topk_ids, weights, lora_ids, bank, local_expert_offset=c.offset, out=out2,
                         **path, validate=validate)
    assert got2 is out2 and got2.dtype == dtype
    ref2 = reference.w2_lora_delta(act, topk_ids, weights, lora_ids, bank, local_expert_offset=c.offset)
    assert_close_to_reference(got2, ref2, dtype, "w2_lora_delta")
    assert torch.equal(got2[zero], torch.zeros_like(got2[zero]))


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_all_tokens_without_adapter_give_exact_zeros(path, device):
    # every slot falls in the zero group: the kernel's zero-store branch writes the whole (poisoned) output
    T, K, E, H, I = 7, 2, 4, 24, 40
    bank = make_bank(2, E, H, I, 16, (8, 4), torch.bfloat16, device=device)
    topk_ids, lora_ids = random_topk_ids(T, K, E, device=device), torch.full((T,), -1, device=device)
    x, act = torch.randn(T, H, device=device).bfloat16(), torch.randn(T * K, I, device=device).bfloat16()
    out13 = poison(torch.empty(T, K, 2 * I, dtype=torch.bfloat16, device=device))
    out2 = poison(torch.empty(T, K, H, dtype=torch.bfloat16, device=device))
    w13_lora_delta(x, topk_ids, lora_ids, bank, out=out13, **path)
    w2_lora_delta(act, topk_ids, random_weights(T, K, device=device), lora_ids, bank, out=out2,
                  **path)
    assert torch.equal(out13, torch.zeros_like(out13))
    assert torch.equal(out2, torch.zeros_like(out2))


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_empty_batch(path, device):
    # T = 0: empty results of the right shape, nothing launched
    bank = make_bank(1, 2, 16, 8, 16, (4,), torch.float32, device=device)
    ids, lora = torch.zeros(0, 2, dtype=torch.int32, device=device), torch.zeros(0, dtype=torch.int32, device=device)
    d13 = w13_lora_delta(torch.zeros(0, 16, device=device), ids, lora, bank, **path)
    d2 = w2_lora_delta(torch.zeros(0, 8, device=device), ids, torch.zeros(0, 2, device=device), lora, bank,
                       **path)
    assert d13.shape == (0, 2, 16) and d2.shape == (0, 2, 16)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("zeroed, zero_cols", [
    (("up_a", "up_b"), slice(0, 24)),  # up is the FIRST half of the delta (FlashInfer order, the "swap")
    (("gate_a", "gate_b"), slice(24, 48)),  # gate is the second half
])
def test_w13_delta_is_up_then_gate(zeroed, zero_cols, path, device):
    T, K, E, H, I = 6, 2, 3, 32, 24
    bank = make_bank(2, E, H, I, 16, (16, 8), torch.float32, zero=zeroed, device=device)
    x, topk_ids = torch.randn(T, H, device=device), random_topk_ids(T, K, E, device=device)
    lora_ids = torch.tensor([0, 1, 0, 1, 0, 1], device=device)
    delta = w13_lora_delta(x, topk_ids, lora_ids, bank, **path)
    live_cols = slice(24, 48) if zero_cols.start == 0 else slice(0, 24)
    assert torch.equal(delta[..., zero_cols], torch.zeros(T, K, I, device=device))
    assert delta[..., live_cols].abs().min() > 0  # the other half is there, everywhere
    assert_close_to_reference(delta, reference.w13_lora_delta(x, topk_ids, lora_ids, bank), torch.float32)


def test_shared_segments_give_the_same_deltas(device):
    # one grouping passed to both deltas (what a layer does) matches the per-slot kernel, bit for bit
    T, K, E, H, I = 11, 3, 4, 32, 24
    bank = make_bank(3, E, H, I, 16, (16, 4, 9), torch.bfloat16, device=device)
    x, act = torch.randn(T, H, device=device).bfloat16(), torch.randn(T * K, I, device=device).bfloat16()
    topk_ids, w = random_topk_ids(T, K, E, device=device), random_weights(T, K, device=device)
    lora_ids = torch.randint(-1, 3, (T,), device=device)
    assert lora_segments(topk_ids, lora_ids, bank) is None  # 33 slots: the kernel needs no grouping
    assert lora_segments(topk_ids, lora_ids, bank, per_slot=True) is None
    segments = lora_segments(topk_ids, lora_ids, bank, per_slot=False)
    assert torch.equal(segments.slot_to_row, build_lora_segments(topk_ids, lora_ids, bank).slot_to_row)
    assert torch.equal(w13_lora_delta(x, topk_ids, lora_ids, bank, segments=segments),
                       w13_lora_delta(x, topk_ids, lora_ids, bank, per_slot=True))
    assert torch.equal(w2_lora_delta(act, topk_ids, w, lora_ids, bank, segments=segments),
                       w2_lora_delta(act, topk_ids, w, lora_ids, bank, per_slot=True))


@pytest.mark.parametrize("per_slot, grouped", [
    (True, False),
    (False, True),  # grouped at a size the choice by bytes runs per slot
    (None, False),  # by size (per_slot_by_size): these 6 slots stream a few KB
])
def test_per_slot_argument_picks_the_kernel_mode(per_slot, grouped, device, monkeypatch):
    """``per_slot=`` decides the Triton kernel's mode (segments passed or not); the result is right either way."""
    import moelab.kernels.lora as kernel

    T, K, E, H, I = 3, 2, 4, 32, 16
    bank = make_bank(2, E, H, I, 8, (8, 4), torch.float32, device=device)
    x, topk_ids = torch.randn(T, H, device=device), random_topk_ids(T, K, E, device=device)
    lora_ids = torch.randint(-1, 2, (T,), device=device)
    assert moelab.lora.per_slot_by_size(T * K, bank)
    seen, launch = [], kernel.lora_shrink_expand_triton
    monkeypatch.setattr(kernel, "lora_shrink_expand_triton",
                        lambda x, a, b, out, segments, **kw: seen.append(segments is not None) or launch(
                            x, a, b, out, segments, **kw))
    delta = w13_lora_delta(x, topk_ids, lora_ids, bank, use_triton=True, per_slot=per_slot)
    assert seen == [grouped]
    assert_close_to_reference(delta, reference.w13_lora_delta(x, topk_ids, lora_ids, bank), torch.float32)


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_unvalidated_id_outside_bank_gives_zero_rows(path, device):
    # validate=False (CUDA graphs): an id >= L reads no memory out of the bank and yields zero rows
    T, K, E, H, I = 4, 2, 3, 16, 16
    bank = make_bank(2, E, H, I, 16, (4, 4), torch.float32, device=device)
    x, topk_ids = torch.randn(T, H, device=device), random_topk_ids(T, K, E, device=device)
    lora_ids = torch.tensor([0, 2, 7, 1], device=device)
    delta = w13_lora_delta(x, topk_ids, lora_ids, bank, validate=False, **path)
    assert torch.equal(delta[1:3], torch.zeros(2, K, 2 * I, device=device))
    assert delta[[0, 3]].abs().min() > 0


@pytest.mark.parametrize("path", PATHS[:2], indirect=True)
def test_triton_deltas_read_each_adapter_only_to_its_own_rank(path, device):
    # A mixed bank streams each slot's own rank, not max_rank: values planted past a slot's rank (rounded up to
    # 8, the kernel's load width where max_rank is a multiple of 8) must not reach the deltas. The bank is zero
    # there by construction, so this is the one way to see what the kernel reads.
    T, K, E, H, I, max_rank = 12, 2, 3, 40, 24, 32
    ranks = (8, 16, 5)  # read to 8, 16 and 8
    bank = make_bank(len(ranks), E, H, I, max_rank, ranks, torch.float32, device=device)
    x, act = torch.randn(T, H, device=device), torch.randn(T * K, I, device=device)
    topk_ids = random_topk_ids(T, K, E, device=device)
    lora_ids = torch.arange(T, device=device) % len(ranks)
    w = random_weights(T, K, device=device)
    ref13 = reference.w13_lora_delta(x, topk_ids, lora_ids, bank)
    ref2 = reference.w2_lora_delta(act, topk_ids, w, lora_ids, bank)
    for slot, r in enumerate(ranks):
        read = -(-r // 8) * 8
        for name in ("gate_a", "up_a", "down_a"):
            getattr(bank, name)[slot, :, read:, :] = 1e3
        for name in ("gate_b", "up_b", "down_b"):
            getattr(bank, name)[slot, :, :, read:] = 1e3
    got13 = w13_lora_delta(x, topk_ids, lora_ids, bank, **path)
    got2 = w2_lora_delta(act, topk_ids, w, lora_ids, bank, **path)
    assert_close_to_reference(got13, ref13, torch.float32, "w13_lora_delta")
    assert_close_to_reference(got2, ref2, torch.float32, "w2_lora_delta")


@pytest.mark.parametrize("tiles", ["PER_SLOT_TILES", "GROUPED_TILES", "MANY_PROGRAMS_TILES", "MANY_W2_TILES"])
@pytest.mark.parametrize("grouped", [False, True], ids=["per-slot", "grouped"])
def test_every_default_delta_tiles_matches_reference(tiles, grouped, device):
    # Each launch choose_delta_tiles can make, in both modes, on widths that take several K and N steps of each
    # (H = 200, I = 136: masked tails too), against the float64 reference.
    from moelab.kernels import lora as kernel

    T, K, E, H, I, ranks = 7, 3, 4, 200, 136, (16, 8, 5)
    bank = make_bank(len(ranks), E, H, I, 16, ranks, torch.float32, device=device)
    x, act = torch.randn(T, H, device=device), torch.randn(T * K, I, device=device)
    topk_ids = random_topk_ids(T, K, E, device=device)
    lora_ids = torch.tensor([0, 1, 2, -1, 0, 1, 2], device=device)
    w = random_weights(T, K, device=device)
    seg = build_lora_segments(topk_ids, lora_ids, bank) if grouped else None
    kw = dict(topk_ids=topk_ids, lora_ids=lora_ids, ranks=bank.rank_table(), local_expert_offset=0,
              tiles=getattr(kernel, tiles))
    d13 = poison(torch.empty(T * K, 2 * I, device=device))
    kernel.lora_shrink_expand_triton(x, [bank.up_a, bank.gate_a], [bank.up_b, bank.gate_b], d13, seg,
                                     slots_per_input_row=K, **kw)
    d2 = poison(torch.empty(T * K, H, device=device))
    kernel.lora_shrink_expand_triton(act, [bank.down_a], [bank.down_b], d2, seg, slots_per_input_row=1,
                                     weight=w.flatten(), **kw)
    ref13 = reference.w13_lora_delta(x, topk_ids, lora_ids, bank)
    ref2 = reference.w2_lora_delta(act, topk_ids, w, lora_ids, bank)
    assert_close_to_reference(d13.view(T, K, 2 * I), ref13, torch.float32, "w13")
    assert_close_to_reference(d2.view(T, K, H), ref2, torch.float32, "w2")


@given(T=st.integers(0, 9), E=st.integers(1, 5), data=st.data(), L=st.integers(1, 3),
       max_rank=st.sampled_from([1, 8, 20]), H=st.integers(1, 40), I=st.integers(1, 40), seed=st.integers(0, 999),
       grouped=st.booleans())
def test_triton_deltas_property(T, E, data, L, max_rank, H, I, seed, grouped):
    # random sizes (1-wide H or I, rank 1, rank 20 -> BLOCK_R 32), EP offsets and adapters; fp32, Triton path,
    # grouped into segments or one program per slot
    K = data.draw(st.integers(1, E))
    E_local = data.draw(st.integers(1, E))
    offset = data.draw(st.integers(0, E - E_local))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # no fixture: hypothesis reruns the body
    g = torch.Generator().manual_seed(seed)
    ranks = [int(r) for r in torch.randint(0, max_rank + 1, (L,), generator=g)]
    bank = make_bank(L, E_local, H, I, max_rank, ranks, torch.float32, device=dev)
    x, act = torch.randn(T, H, generator=g).to(dev), torch.randn(T * K, I, generator=g).to(dev)
    topk_ids = random_topk_ids(T, K, E, generator=g, device=dev)
    lora_ids = torch.randint(-1, L, (T,), generator=g).to(dev)
    w = random_weights(T, K, generator=g, device=dev)
    seg = build_lora_segments(topk_ids, lora_ids, bank, local_expert_offset=offset) if grouped else None
    args = dict(local_expert_offset=offset, segments=seg, use_triton=True, per_slot=not grouped,
                validate=False)  # empty slots: zero rows
    d13 = w13_lora_delta(x, topk_ids, lora_ids, bank, **args)
    d2 = w2_lora_delta(act, topk_ids, w, lora_ids, bank, **args)
    ref13 = reference.w13_lora_delta(x, topk_ids, lora_ids, bank, local_expert_offset=offset)
    ref2 = reference.w2_lora_delta(act, topk_ids, w, lora_ids, bank, local_expert_offset=offset)
    if ref13.abs().sum() > 0:
        assert_close_to_reference(d13, ref13, torch.float32, "w13")
        assert_close_to_reference(d2, ref2, torch.float32, "w2")
    else:  # nothing to add: every row must be exactly zero
        assert torch.equal(d13, torch.zeros_like(d13)) and torch.equal(d2, torch.zeros_like(d2))


# ---------------------------------------------------------------------------------------------- the bank

def test_bank_set_folds_scaling_into_b_and_zero_pads():
    E, H, I, r = 2, 16, 8, 4
    bank = LoRABank(2, E, H, I, 8, dtype=torch.float32)
    adapter = random_adapter(E, H, I, r)
    scaling = lora_scaling(alpha=8, rank=r)
    assert scaling == 2.0 and lora_scaling(8, 4, use_rslora=True) == 4.0  # alpha / r, alpha / sqrt(r)
    bank.set(1, **adapter, scaling=scaling)
    assert bank.ranks == [0, r]
    for name in ("gate_a", "up_a", "down_a"):  # A as given, zero past rank r
        assert torch.equal(getattr(bank, name)[1, :, :r], adapter[name])
        assert torch.equal(getattr(bank, name)[1, :, r:], torch.zeros_like(getattr(bank, name)[1, :, r:]))
    for name in ("gate_b", "up_b", "down_b"):  # B times the scaling, zero past rank r
        assert torch.equal(getattr(bank, name)[1, :, :, :r], adapter[name] * scaling)
        assert not getattr(bank, name)[1, :, :, r:].any()
    assert not any(getattr(bank, name)[0].any() for name in ("gate_a", "gate_b", "down_b"))  # slot 0 untouched
    # the delta scales with it
    x, topk_ids, lora_ids = torch.randn(3, H), random_topk_ids(3, 2, E), torch.tensor([1, 1, 1])
    scaled = w13_lora_delta(x, topk_ids, lora_ids, bank)
    bank.set(1, **adapter)
    torch.testing.assert_close(scaled, scaling * w13_lora_delta(x, topk_ids, lora_ids, bank))


def test_bank_set_rounds_once_into_bf16():
    E, H, I, r = 1, 8, 8, 2
    bank = LoRABank(1, E, H, I, 4)  # bf16 by default
    adapter = random_adapter(E, H, I, r)
    bank.set(0, **adapter, scaling=0.3)
    assert bank.dtype == torch.bfloat16
    assert torch.equal(bank.up_b[0, :, :, :r], (adapter["up_b"] * 0.3).bfloat16())  # fp32 product, one rounding


def test_bank_reset_zeroes_the_slot():
    bank = make_bank(2, 3, 16, 8, 8, (8, 5), torch.bfloat16)
    bank.reset(1)
    assert bank.ranks == [8, 0]
    for name in ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"):
        assert not getattr(bank, name)[1].any()
        assert getattr(bank, name)[0].any()


def test_bank_save_load_round_trip(tmp_path):
    bank = make_bank(3, 2, 24, 16, 8, (8, 0, 3), torch.bfloat16)
    path = tmp_path / "bank.safetensors"
    bank.save(path)
    loaded = LoRABank.load(path, device="cpu")
    assert loaded.ranks == [8, 0, 3] and loaded.dtype == torch.bfloat16
    assert (loaded.max_loras, loaded.num_local_experts, loaded.hidden_size, loaded.intermediate_size,
            loaded.max_rank) == (3, 2, 24, 16, 8)
    for name in ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"):
        assert torch.equal(getattr(loaded, name), getattr(bank, name))


def test_bank_rejects_non_finite_values(tmp_path):
    """fp16 overflow from a large scaling, or a NaN factor: rejected, and the slot is left as it was."""
    E, H, I, r = 1, 8, 8, 2
    bank = LoRABank(1, E, H, I, 4, dtype=torch.float16)
    adapter = random_adapter(E, H, I, r)
    with pytest.raises(ValueError, match="gate_b.*finite.*float16"):
        bank.set(0, **adapter, scaling=1e6)  # B * 1e6 overflows float16
    assert bank.ranks == [0] and not bank.gate_b.any()
    with pytest.raises(ValueError, match="down_a.*finite"):
        bank.set(0, **{**adapter, "down_a": torch.full((E, r, I), float("nan"))})
    bank.set(0, **adapter)
    bank.up_b[0, 0, 0, 0] = float("inf")  # written behind the bank's back, then saved
    path = tmp_path / "bank.safetensors"
    bank.save(path)
    with pytest.raises(ValueError, match="up_b.*finite"):
        LoRABank.load(path)


def test_bank_load_rejects_foreign_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="path.*LoRABank.save"):
        LoRABank.load(path)


# ---------------------------------------------------------------------------------------------- errors

E_, H_, I_, T_, K_ = 2, 16, 8, 3, 2


def _bank():
    return make_bank(2, E_, H_, I_, 4, (4, 2), torch.float32)


def _w13(**over):
    args = {"hidden_states": torch.randn(T_, H_), "topk_ids": torch.zeros(T_, K_, dtype=torch.int32) + torch.arange(K_),
            "lora_ids": torch.tensor([0, -1, 1]), "bank": _bank()}
    kwargs = {k: over.pop(k) for k in ("local_expert_offset", "out", "segments", "per_slot", "use_triton")
              if k in over}
    args.update(over)
    return lambda: w13_lora_delta(*args.values(), **kwargs)


def _w2(**over):
    args = {"act": torch.randn(T_ * K_, I_), "topk_ids": torch.zeros(T_, K_, dtype=torch.int32) + torch.arange(K_),
            "topk_weights": torch.rand(T_, K_), "lora_ids": torch.tensor([0, -1, 1]), "bank": _bank()}
    kwargs = {k: over.pop(k) for k in ("out",) if k in over}
    args.update(over)
    return lambda: w2_lora_delta(*args.values(), **kwargs)


def _set(slot=0, **over):
    adapter = random_adapter(E_, H_, I_, 2)
    adapter.update(over)
    return lambda: _bank().set(slot, **adapter)


@pytest.mark.parametrize("call, error, match", [
    (lambda: LoRABank(0, E_, H_, I_, 4), ValueError, "max_loras"),  # no slot at all
    (lambda: LoRABank(1, E_, H_, I_, 4, dtype=torch.int32), TypeError, "dtype"),  # integer bank
    (_set(slot=2), ValueError, "slot.*got 2"),  # slot == L
    (_set(slot=-1), ValueError, "slot.*got -1"),  # negative slot
    (lambda: _bank().reset(5), ValueError, "slot"),  # reset outside the bank
    (_set(**random_adapter(E_, H_, I_, 6)), ValueError, "gate_a.*rank 6.*max_rank 4"),  # rank > max_rank
    (_set(gate_b=torch.randn(E_, I_ + 1, 2)), ValueError, r"gate_b.*expected shape \[2, 8, 2\].*\[2, 9, 2\]"),
    (_set(up_a=torch.randn(E_, 3, H_)), ValueError, "up_a.*shape"),  # ranks disagree between factors
    (_set(down_a=torch.ones(E_, 2, I_, dtype=torch.int32)), TypeError, "down_a.*dtype"),  # not floating
    (lambda: _bank().set(0, **random_adapter(E_, H_, I_, 2), scaling=float("nan")), ValueError, "scaling"),
    (_w13(lora_ids=torch.tensor([0, 2, 1])), ValueError, r"lora_ids.*\[-1, 2\).*got 2"),  # id == L
    (_w13(lora_ids=torch.tensor([0, -2, 1])), ValueError, "lora_ids.*got -2"),  # below -1
    (_w13(lora_ids=torch.tensor([0, 1])), ValueError, "lora_ids.*shape"),  # one id per token
    (_w13(hidden_states=torch.randn(T_, H_).bfloat16()), TypeError,
     r"hidden_states: expected dtype float32 \(that of the bank\), got bfloat16; convert it with "
     r"hidden_states\.to\(torch\.float32\)"),
    (_w13(hidden_states=torch.randn(T_, H_ + 1)), ValueError, "hidden_states.*shape"),  # H != bank's
    (_w13(out=torch.empty(T_, 2 * I_, K_).transpose(1, 2)), ValueError, "out.*contiguous"),  # written in place
    (_w13(topk_ids=torch.zeros(T_, K_)), TypeError, "topk_ids.*dtype"),  # float ids
    (_w13(local_expert_offset=-1), ValueError, "local_expert_offset"),
    (_w13(bank=object()), TypeError, "bank.*LoRABank"),
    (_w13(out=torch.empty(T_, K_, I_)), ValueError, "out.*shape"),  # [T, K, I] instead of [T, K, 2I]
    (_w13(segments=build_lora_segments(torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1), _bank())), ValueError,
     "segments"),  # grouping of another batch
    (_w13(per_slot=True, use_triton=False), ValueError, "per_slot: True runs the Triton kernel.*torch fallback"),
    (_w13(per_slot=True, segments=build_lora_segments(torch.zeros(T_, K_, dtype=torch.int32) + torch.arange(K_),
                                                      torch.tensor([0, -1, 1]), _bank())),
     ValueError, "per_slot: True.*takes no segments"),
    (_w13(per_slot="yes"), TypeError, "per_slot: expected True, False or None"),
    (_w2(act=torch.randn(T_, I_)), ValueError, r"act.*expected shape \[6, 8\]"),  # [T, I] instead of [T*K, I]
    (_w2(topk_weights=torch.rand(T_, K_ + 1)), ValueError, "topk_weights.*shape"),
    (_w2(out=torch.empty(T_, K_, H_, dtype=torch.bfloat16)), TypeError, "out.*dtype"),
])
def test_bad_input_raises_naming_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_validate_false_has_no_host_sync_and_captures_in_a_cuda_graph(path):
    dev = torch.device("cuda")
    T, K, E, H, I = 64, 4, 8, 256, 128
    bank = make_bank(3, E, H, I, 16, (16, 8, 4), torch.bfloat16)
    bank_gpu = LoRABank(3, E, H, I, 16, device=dev)
    for name in ("gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"):
        getattr(bank_gpu, name).copy_(getattr(bank, name))
    bank_gpu.ranks = list(bank.ranks)  # as code that copies a bank's tensors does: the kernels read each own rank
    x, act = torch.randn(T, H, device=dev).bfloat16(), torch.randn(T * K, I, device=dev).bfloat16()
    topk_ids = random_topk_ids(T, K, E, device=dev)
    lora_ids = torch.randint(-1, 3, (T,), device=dev)
    w = random_weights(T, K, device=dev)

    def layer():
        seg = lora_segments(topk_ids, lora_ids, bank_gpu, per_slot=path.get("per_slot"))
        d13 = w13_lora_delta(x, topk_ids, lora_ids, bank_gpu, validate=False, segments=seg, **path)
        d2 = w2_lora_delta(act, topk_ids, w, lora_ids, bank_gpu, validate=False, segments=seg,
                           **path)
        return d13, d2

    eager = layer()  # compiles the kernel outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer()
    lora_ids.copy_(torch.randint(-1, 3, (T,), device=dev))  # new ids, same buffers
    graph.replay()
    torch.cuda.synchronize()
    ref13 = reference.w13_lora_delta(x, topk_ids, lora_ids, bank)
    assert_close_to_reference(captured[0], ref13, torch.bfloat16, "graph w13")
    assert_close_to_reference(captured[1], reference.w2_lora_delta(act, topk_ids, w, lora_ids, bank),
                              torch.bfloat16, "graph w2")
    assert eager[0].shape == captured[0].shape
