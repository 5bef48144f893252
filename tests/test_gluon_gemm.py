"""The Gluon GEMMs of the routed MoE (``moelab/kernels/gluon_gemm.py``): warp-specialised persistent kernels that the
triton backend runs on sm_90 GPUs for 128-row tiles.

On any machine both kernels must compile for sm_90 with the installed Triton (no GPU needed: a Triton that renames
a Gluon builtin fails here, not on a user's H100). On an sm_90 GPU, fresh random problems whose rows make 128-row
tiles, sized off every tile (H not a multiple of GEMM2's 256 columns, I not one of GEMM1's 128, more tiles than SMs,
experts with no rows and dead tiles, GEMM1 with vLLM's LoRA delta), run through ``moe_gemm`` with NaN-poisoned
outputs and in debug mode; each Gluon kernel must have run, and GEMM1's activations and GEMM2's rows must match
float64 products of the same inputs, the padding rows NaN (debug mode's dead fill); the whole layer must match the
float64 reference; so must GPT-OSS's epilogues (GEMM1's bias and clamped swigluoai, GEMM2's bias). With a fused
LoRA bank in the tile mode (prefill), or a bank of any width in the adapter loop (a tile's adapters packed side by
side in its LoRA K steps; what ``LoRAExperts`` takes by itself for banks wider than the tile mode's 64 stacked
columns), ``LoRAExperts`` must run both Gluon kernels with the bank and match
``moelab.reference.lora_experts``, its tokens without an adapter the base call's rows bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import assert_close_to_reference, lora_and_base_outputs, poison, random_topk_ids, random_weights

import moelab
from moelab import reference
from moelab.kernels import fused_lora, gluon_gemm, moe_gemm
from moelab.kernels.segments import build_segments_triton

pytestmark = pytest.mark.skipif(gluon_gemm.gluon is None, reason="this Triton has no Gluon")

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("gemm,group_m,delta", [("gemm1", 1, False), ("gemm1", 8, True), ("gemm2", 1, False)])
def test_gluon_kernels_compile_for_sm90(gemm, group_m, delta, monkeypatch):
    """Each Gluon kernel compiles to sm_90 PTX with wgmma, TMA and a warp-specialised register split."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    compiled = gluon_gemm.compile_sm90(gemm, group_m=group_m, delta=delta)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
    assert compiled.metadata.shared <= 232448, "more shared memory than an sm_90 block may take"
    if gemm == "gemm1":
        assert "cp.async.cg.shared.global" in ptx, "GEMM1's gathered rows: 16-byte cp.async copies"


@pytest.mark.parametrize("gemm,lora,own", [("gemm1", None, False), ("gemm2", None, False),
                                          ("gemm2", (4, 16, 16), False), ("gemm1", (1, 16, 16), True),
                                          ("gemm2", (1, 16, 16), True)])
def test_the_dynamic_tile_schedule_compiles_for_sm90(gemm, lora, own, monkeypatch):
    """With ``dynamic`` each kernel claims its tiles by a global atomic and still fits an sm_90 block's shared memory;
    the static schedule has no atomic."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dynamic = gluon_gemm.compile_sm90(gemm, lora=lora, lora_own=own, dynamic=True)
    static = gluon_gemm.compile_sm90(gemm, lora=lora, lora_own=own).asm["ptx"]
    assert "atom.global" in dynamic.asm["ptx"] and "atom.global" not in static
    assert "wgmma.mma_async" in dynamic.asm["ptx"] and dynamic.metadata.shared <= 232448


def test_the_tile_schedule_rule_claims_tiles_only_on_long_calls(monkeypatch):
    """The rule (the default) runs the dynamic schedule from DYNAMIC_MIN_TILES_A_PROGRAM tiles a multiprocessor, on
    the segments' own zeroed counter of that GEMM (or a fresh zeroed one where they have none), the static one (no
    counter) below; a named schedule runs on any call."""
    monkeypatch.setattr(gluon_gemm, "_multiprocessors", lambda device: 132)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (a GPU box runs no Triton kernel on CPU tensors)
    segments = build_segments_triton(torch.randint(0, 8, (2000,), dtype=torch.int32, device=device), 8, 128)
    counters = segments.tile_counters
    least = gluon_gemm.DYNAMIC_MIN_TILES_A_PROGRAM * 132
    monkeypatch.setattr(gluon_gemm, "TILE_SCHEDULE", "rule")
    grid, schedule = gluon_gemm._schedule(least - 1, segments, 1)
    assert grid == (132,) and schedule["DYNAMIC"] is False and schedule["tile_counter_ptr"] is segments.block_group
    for gemm in (1, 2):
        grid, schedule = gluon_gemm._schedule(least, segments, gemm)
        assert grid == (132,) and schedule["DYNAMIC"] is True
        counter = schedule["tile_counter_ptr"]
        assert counter.tolist() == [0] and counter.data_ptr() == counters.data_ptr() + 4 * (gemm - 1)
    fresh = gluon_gemm._schedule(least, dataclasses.replace(segments, tile_counters=None), 1)[1]["tile_counter_ptr"]
    assert fresh.tolist() == [0] and fresh.dtype == torch.int32 and fresh.data_ptr() != counters.data_ptr()
    monkeypatch.setattr(gluon_gemm, "TILE_SCHEDULE", "static")
    assert gluon_gemm._schedule(10 * least, segments, 1)[1]["DYNAMIC"] is False
    monkeypatch.setattr(gluon_gemm, "TILE_SCHEDULE", "dynamic")
    grid, schedule = gluon_gemm._schedule(100, segments, 2)
    assert grid == (100,) and schedule["DYNAMIC"] is True and schedule["tile_counter_ptr"].tolist() == [0]
    monkeypatch.setattr(gluon_gemm, "TILE_SCHEDULE", "grid")
    assert gluon_gemm._schedule(1000, segments, 1)[0] == (1000,)


def test_an_unknown_tile_schedule_is_refused(monkeypatch):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    segments = build_segments_triton(torch.zeros(8, dtype=torch.int32, device=device), 1, 128)
    monkeypatch.setattr(gluon_gemm, "TILE_SCHEDULE", "round-robin")
    with pytest.raises(ValueError, match="TILE_SCHEDULE"):
        gluon_gemm._schedule(4, segments, 1)


@pytest.mark.parametrize("gemm", ["gemm1", "gemm2"])
@pytest.mark.parametrize("lora,own", [((1, 16, 16), False), ((4, 16, 16), False), ((2, 32, 24), False),
                                      ((1, 16, 16), True), ((1, 64, 40), True), ((1, 128, 128), True)])
def test_gluon_kernels_with_a_lora_bank_compile_for_sm90(gemm, lora, own, monkeypatch):
    """With a tile-mode LoRA bank of (L_PAD, R_PAD, max_rank), or the adapter loop's (``own``), each kernel still
    fits shared memory, copies the rank vectors and B in 16-byte ``cp.async`` copies and runs more wgmma than
    without (the LoRA steps)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    base = gluon_gemm.compile_sm90(gemm).asm["ptx"]
    compiled = gluon_gemm.compile_sm90(gemm, lora=lora, lora_own=own)
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.shared <= 232448
    assert ptx.count("cp.async.cg.shared.global") > base.count("cp.async.cg.shared.global")
    assert ptx.count("wgmma.mma_async") > base.count("wgmma.mma_async")


def test_gluon_lora_gate_takes_the_tile_mode_of_narrow_banks():
    """The Gluon GEMMs fold in the tile mode's operands of banks of at most 64 stacked columns and ranks padded to
    a multiple of 8; other banks and modes keep the Triton kernels."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (a GPU box runs no Triton kernel on CPU tensors)

    def tile_lora(max_loras, max_rank):
        bank = moelab.LoRABank(max_loras, 4, 64, 32, max_rank, device=dev)
        columns = bank.stacked_pads[0] * bank.stacked_pads[1]
        seg = build_segments_triton(torch.zeros(8, 2, dtype=torch.int32, device=dev), 4, 128, packed=False)
        return fused_lora.TileLoRA(bank, torch.zeros(8, dtype=torch.int32, device=dev), torch.ones(8, 2, device=dev),
                                   seg, 2, 4, s13_by_row=torch.zeros(128, 2, columns, device=dev),
                                   s2_by_row=torch.zeros(128, columns, device=dev),
                                   tile_flags=torch.ones(1, dtype=torch.int32, device=dev), shrink_meta={})

    assert gluon_gemm.takes_gluon_lora(tile_lora(1, 16)) and gluon_gemm.takes_gluon_lora(tile_lora(4, 16))
    assert gluon_gemm.takes_gluon_lora(tile_lora(2, 24))  # padded to 32: 64 columns
    assert not gluon_gemm.takes_gluon_lora(tile_lora(1, 12)), "rank rows of 24 bytes: no 16-byte copies"
    assert not gluon_gemm.takes_gluon_lora(tile_lora(8, 16)), "128 stacked columns: two K steps"
    assert not gluon_gemm.takes_gluon_lora(None)


def test_gluon_lora_gate_takes_the_adapter_loop_of_any_width_in_tiles():
    """The Gluon GEMMs fold in the adapter loop's tile operands (prefill) of any bank width whose ranks fill 16-byte
    rows; its decode operands (rank vectors by slot, the W2 shrink in GEMM1's epilogue) keep the Triton kernels, and
    so does a unit map too wide for its 16-bit fields."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def loop_lora(max_loras, max_rank, decode=False):
        bank = moelab.LoRABank(max_loras, 4, 64, 32, max_rank, device=dev)
        r_pad = fused_lora.own_rank_pad(bank)
        seg = build_segments_triton(torch.zeros(8, 2, dtype=torch.int32, device=dev), 4, 128, packed=False)
        packing = {} if decode else dict(  # the W13 shrink's output
            row_first_units=torch.zeros(128, dtype=torch.int32, device=dev),
            row_ranks=torch.zeros(128, dtype=torch.int32, device=dev),
            tile_units=torch.zeros(1, dtype=torch.int32, device=dev),
            unit_map=torch.zeros(1, 16, dtype=torch.int32, device=dev))
        return fused_lora.AdapterLoopLoRA(bank, torch.zeros(8, dtype=torch.int32, device=dev),
                                          torch.ones(8, 2, device=dev), seg, 2, 4, decode, bank.rank_table(),
                                          s13=torch.zeros(128, 2, r_pad, device=dev),
                                          s2=torch.zeros(128, r_pad, device=dev), **packing)

    assert gluon_gemm.takes_gluon_lora(loop_lora(8, 64)) and gluon_gemm.takes_gluon_lora(loop_lora(32, 128))
    assert not gluon_gemm.takes_gluon_lora(loop_lora(8, 64, decode=True)), "decode: the Triton kernels"
    assert not gluon_gemm.takes_gluon_lora(loop_lora(8, 12)), "rank rows of 24 bytes: no 16-byte copies"
    wide_map = dataclasses.replace(loop_lora(8, 64), unit_map=torch.zeros(1, 2**16, dtype=torch.int32, device=dev))
    assert not gluon_gemm.takes_gluon_lora(wide_map), "first units past the unit map's 16 bits"


def test_gluon_epilogues_compile_for_sm90(monkeypatch):
    """GEMM1 with a bias and GPT-OSS's clamped swigluoai, and GEMM2 with a bias, compile for sm_90: the biases add
    global loads to the plain kernels, the clamp adds min and max instructions, swigluoai changes the epilogue."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    plain1, plain2 = (gluon_gemm.compile_sm90(gemm).asm["ptx"] for gemm in ("gemm1", "gemm2"))
    oai = gluon_gemm.compile_sm90("gemm1", activation="swigluoai").asm["ptx"]
    gpt_oss = gluon_gemm.compile_sm90("gemm1", bias=True, activation="swigluoai", swiglu_limit=7.0)
    biased2 = gluon_gemm.compile_sm90("gemm2", bias=True)
    assert gpt_oss.metadata.shared <= 232448 and biased2.metadata.shared <= 232448
    same_as_swiglu = oai == plain1
    assert not same_as_swiglu and "min.f32" not in oai and "max.f32" not in oai
    assert "min.f32" in gpt_oss.asm["ptx"] and "max.f32" in gpt_oss.asm["ptx"]
    assert gpt_oss.asm["ptx"].count("ld.global") > oai.count("ld.global")
    assert biased2.asm["ptx"].count("ld.global") > plain2.count("ld.global")


def test_gluon_gemms_refuse_a_lora_bank_with_epilogue_options():
    """Called directly, the Gluon GEMMs refuse a fused LoRA bank together with a bias or another activation (their
    LoRA steps come before the bias, unlike the Triton kernels' order) with a ValueError naming the argument, before
    any launch."""
    x, w = torch.zeros(4, 64), torch.zeros(2, 64, 64)
    bank = object()  # never read: the check comes first
    with pytest.raises(ValueError, match="lora"):
        gluon_gemm.gemm1_swiglu_ws(x, w, x, None, top_k=2, lora=bank, bias=torch.zeros(2, 64))
    with pytest.raises(ValueError, match="lora"):
        gluon_gemm.gemm1_swiglu_ws(x, w, x, None, top_k=2, lora=bank, activation="swigluoai")
    with pytest.raises(ValueError, match="bias"):
        gluon_gemm.gemm2_ws(x, w, x, None, lora=bank, bias=torch.zeros(2, 64))


@pytest.mark.parametrize("gemm,options", [("gemm1", {}), ("gemm1", {"group_m": 8}), ("gemm1", {"lora": (4, 16, 16)}),
                                           ("gemm1", {"delta": True}),
                                           ("gemm1", {"bias": True, "activation": "swigluoai", "swiglu_limit": 7.0}),
                                           ("gemm1", {"bias": True, "delta": True, "activation": "swigluoai",
                                                      "swiglu_limit": 7.0}),
                                           ("gemm1", {"bias": True, "delta": True}),
                                           ("gemm2", {"bias": True}),
                                           ("gemm1", {"lora": (1, 64, 64), "lora_own": True}),
                                           ("gemm1", {"lora": (1, 128, 128), "lora_own": True}),
                                           ("gemm2", {}), ("gemm2", {"lora": (4, 16, 16)}),
                                           ("gemm2", {"lora": (1, 16, 16), "lora_own": True}),
                                           ("gemm1", {"dynamic": True}),
                                           ("gemm1", {"lora": (1, 64, 64), "lora_own": True, "dynamic": True}),
                                           ("gemm2", {"lora": (1, 16, 16), "lora_own": True, "dynamic": True})])
def test_gluon_kernels_spill_no_registers(gemm, options, monkeypatch, tmp_path):
    """``ptxas -v`` (Triton's own) on each kernel's sm_90 PTX reports no spilled registers: a spilling epilogue
    pays local-memory traffic on every tile."""
    import re
    import subprocess

    from triton.backends.nvidia.compiler import get_ptxas

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ptx = tmp_path / "kernel.ptx"
    ptx.write_text(gluon_gemm.compile_sm90(gemm, **options).asm["ptx"])
    report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(tmp_path / "k.o")],
                            capture_output=True, text=True, check=True)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report.stdout + report.stderr)
    assert spills and all(s == ("0", "0") for s in spills), report.stdout + report.stderr


@pytest.mark.parametrize("gemm,stages", [("gemm1", 2), ("gemm2", 1)])
def test_gluon_rings_too_shallow_do_not_compile(gemm, stages, monkeypatch):
    """A ring too shallow for the hand-over between the partitions would deadlock on the GPU: it fails to compile."""
    from triton.compiler.errors import CompilationError

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    block_n, block_k, _ = gluon_gemm.GEMM1_WS_TILE if gemm == "gemm1" else gluon_gemm.GEMM2_WS_TILE
    with pytest.raises(CompilationError, match="ring needs"):
        gluon_gemm.compile_sm90(gemm, (block_n, block_k, stages))


def _gluon_calls(monkeypatch, with_lora: bool = False) -> list:
    """Records each Gluon GEMM call from here on: its name, or with ``with_lora`` (name, type of its ``lora``
    operands); each call still runs."""
    calls = []

    def spy(real, name):
        def call(*a, **k):
            calls.append((name, type(k.get("lora")).__name__) if with_lora else name)
            return real(*a, **k)
        return call

    for name in ("gemm1_swiglu_ws", "gemm2_ws"):
        monkeypatch.setattr(gluon_gemm, name, spy(getattr(gluon_gemm, name), name))
    return calls


def _segments_and_poisoned_rows(ids, weights, E, config, I, H):
    """The packed routing, its segments on ``config``'s tiles, and NaN-poisoned bf16 GEMM outputs act [reach, I] and
    out [reach, H] on the GPU."""
    packed = moelab.pack_topk_ids_weights(ids, weights)
    seg = build_segments_triton(packed, E, config.block_m, packed=True)
    reach = seg.row_to_slot.numel()
    return (packed, seg, poison(torch.empty(reach, I, dtype=torch.bfloat16, device="cuda")),
            poison(torch.empty(reach, H, dtype=torch.bfloat16, device="cuda")))


def _problem(T, E, K, H, I, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16().cuda()
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16().cuda()
    x = torch.randn(T, H, generator=g).bfloat16().cuda()
    if skew:  # the first experts take every token: the others get no rows, the tile map has a dead tail
        ids = torch.arange(K, dtype=torch.int32).repeat(T, 1).cuda()
    else:
        ids = random_topk_ids(T, K, E, generator=g, device="cuda")
    return w13, w2, x, ids, random_weights(T, K, generator=g, device="cuda")


#: (T, E, K, H, I, skew, group_m, delta): 128-row tiles (more than 64 rows an expert), sizes off the Gluon tiles;
#: delta: GEMM1 adds a LoRA delta (vLLM's flow), every third token's zero
CASES = [(600, 4, 2, 384, 320, False, 1, False), (600, 4, 2, 384, 320, False, 1, True),
         (8192, 8, 2, 512, 256, False, 1, False), (8192, 8, 2, 512, 256, False, 8, True),
         (1000, 16, 3, 256, 192, True, 1, False)]


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels run wgmma: an sm_90 GPU (the H100/H200)")
@pytest.mark.parametrize("T,E,K,H,I,skew,group_m,delta", CASES)
def test_gluon_gemms_against_float64(T, E, K, H, I, skew, group_m, delta, monkeypatch):
    seed = hash((T, E, K, H, I, skew, group_m, delta)) % 2**31
    w13, w2, x, ids, weights = _problem(T, E, K, H, I, seed, skew)
    d = None
    if delta:  # [T, K, 2I], [up | gate]
        d = (torch.randn(T, K, 2 * I, generator=torch.Generator().manual_seed(seed)) * 0.5).bfloat16().cuda()
        d[::3] = 0
    config = dataclasses.replace(moe_gemm.choose_config(T, K, E), group_m=group_m)
    assert config.block_m == 128, "the case must make 128-row tiles"
    calls = _gluon_calls(monkeypatch)
    packed, seg, act, out = _segments_and_poisoned_rows(ids, weights, E, config, I, H)
    reach = seg.row_to_slot.numel()
    moe_gemm.gemm1_swiglu(x, w13, act, seg, top_k=K, config=config, dead_fill=float("nan"),
                          delta=d.view(T * K, 2 * I) if delta else None)
    moe_gemm.gemm2(act, w2, out, seg, config=config, dead_fill=float("nan"))
    assert calls == ["gemm1_swiglu_ws", "gemm2_ws"], "the Gluon kernels did not run"
    slots = seg.row_to_slot.long()
    live = slots >= 0
    experts = seg.block_group.long().repeat_interleave(config.block_m)[:reach]
    want_act = torch.full((reach, I), float("nan"), dtype=torch.float64, device="cuda")
    want_out = torch.full((reach, H), float("nan"), dtype=torch.float64, device="cuda")
    for e in range(E):  # float64 products expert by expert: GEMM2 of the kernel's own (rounded) activations
        rows = (live & (experts == e)).nonzero().squeeze(1)
        xs = x.double()[slots[rows] // K]
        gate, up = (xs @ w13.double()[e].T).split(I, dim=1)
        if delta:
            up_d, gate_d = d.double().view(T * K, 2 * I)[slots[rows]].split(I, dim=1)
            gate, up = gate + gate_d, up + up_d
        want_act[rows] = torch.nn.functional.silu(gate) * up
        want_out[rows] = act[rows].double() @ w2.double()[e].T
    assert_close_to_reference(act[live].double(), want_act[live], torch.bfloat16, "act")
    assert_close_to_reference(out[live].double(), want_out[live], torch.bfloat16, "gemm2")
    assert act[~live].isnan().all() and out[~live].isnan().all(), "padding and dead rows: debug mode's NaN fill"

    layer = moelab.prepare_weights(w13, w2, backend="triton")
    got = moelab.routed_moe(packed, x, layer, num_experts=E, top_k=K, output=poison(torch.empty_like(x)),
                            gemm1_lora_delta=d)[0]
    ref = reference.routed_moe(ids, reference.bf16_round(weights), x, w13, w2, gemm1_lora_delta=d)["output"]
    assert_close_to_reference(got, ref, torch.bfloat16, "output")


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels run wgmma: an sm_90 GPU (the H100/H200)")
@pytest.mark.parametrize("schedule", ["grid", "dynamic"])
@pytest.mark.parametrize("skew,group_m", [(False, 1), (True, 2)])
def test_tile_schedules_give_the_static_rows(schedule, skew, group_m, monkeypatch):
    """Eight times more output tiles than multiprocessors (and with ``skew`` a dead tail): each schedule writes every
    row tile once, the static schedule's bits (which test_gluon_gemms_against_float64 checks), no NaN poison left.
    The dynamic schedule claims its tiles from the segments' own counters and leaves them at zero: a second call
    on the same segments gives the same rows."""
    T, E, K, H, I = 16384, 8, 2, 512, 512
    w13, w2, x, ids, weights = _problem(T, E, K, H, I, hash((schedule, skew)) % 2**31, skew)
    config = dataclasses.replace(moe_gemm.choose_config(T, K, E), group_m=group_m)
    assert config.block_m == 128, "the case must make 128-row tiles"
    calls = _gluon_calls(monkeypatch)
    rows, seg = {}, None
    for name in ("static", schedule, "again"):  # again: the schedule's second call on its segments
        monkeypatch.setattr(gluon_gemm, "TILE_SCHEDULE", schedule if name == "again" else name)
        _, fresh, act, out = _segments_and_poisoned_rows(ids, weights, E, config, I, H)
        seg = seg if name == "again" else fresh
        moe_gemm.gemm1_swiglu(x, w13, act, seg, top_k=K, config=config, dead_fill=float("nan"))
        moe_gemm.gemm2(act, w2, out, seg, config=config, dead_fill=float("nan"))
        rows[name] = (act, out)
        assert seg.tile_counters.tolist() == [0, 0], f"{name}: the tile counters were not left at zero"
    assert calls == ["gemm1_swiglu_ws", "gemm2_ws"] * 3, "the Gluon kernels did not run"
    live = seg.row_to_slot >= 0
    for name in (schedule, "again"):
        for want, got in zip(rows["static"], rows[name]):
            assert not got[live].isnan().any(), f"{name}: rows left unwritten"
            assert torch.equal(got[live], want[live]) and got[~live].isnan().all()


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels run wgmma: an sm_90 GPU (the H100/H200)")
@pytest.mark.parametrize("skew", [False, True])
def test_the_dynamic_schedule_runs_the_adapter_loop_past_dead_tiles(skew, monkeypatch):
    """The adapter loop's GEMM2 loads owe their last LoRA step's arrival until the next live tile's loads; on the
    dynamic schedule a program claiming dead tiles after a LoRA tile must hand it over (else the tile ring and the
    stage ring wait on each other). Four times more tiles than programs, with ``skew`` a dead tail of six experts'
    padding: the dynamic schedule gives the static one's output bit for bit."""
    from test_experts import make_bank, random_adapters

    from moelab.backends import eager_graphs, triton_backend

    monkeypatch.setattr(triton_backend, "GLUON_ADAPTER_LOOP_MIN_ROWS_PER_PAIR", 32)
    monkeypatch.setattr(eager_graphs, "ENABLED", False)  # each call runs its launches
    T, E, K, H, I, ranks = 16384, 8, 2, 512, 256, (64, 32, 16, 8, 64, 32, 16, 8)
    w13, w2, x, ids, weights = _problem(T, E, K, H, I, 11, skew)
    bank = make_bank(random_adapters(len(ranks), E, H, I, list(ranks), seed=11), E, 0, H, I, 64, torch.bfloat16,
                     "cuda")
    lora_ids = torch.randint(0, len(ranks), (T,), generator=torch.Generator().manual_seed(11)).cuda()
    calls = _gluon_calls(monkeypatch, with_lora=True)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton")
    outs = {}
    for name in ("static", "dynamic"):
        monkeypatch.setattr(gluon_gemm, "TILE_SCHEDULE", name)
        outs[name] = experts(x, weights, ids, lora_ids)
    assert calls.count(("gemm2_ws", "AdapterLoopLoRA")) == 2, calls
    assert torch.equal(outs["dynamic"], outs["static"])


#: (activation, swiglu_limit, biases, delta): GPT-OSS's experts (swigluoai clamped at 7, both biases; with vLLM's
#: LoRA delta too), a limit that clamps a good share of the products, SwiGLU with biases, SwiGLU clamped (DeepSeek-V4's)
#: without biases
EPILOGUES = [("swigluoai", 7.0, True, False), ("swigluoai", 7.0, True, True), ("swigluoai", 0.75, True, False),
             ("silu", None, True, False), ("silu", 0.75, False, False)]


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels run wgmma: an sm_90 GPU (the H100/H200)")
@pytest.mark.parametrize("activation,limit,biases,delta", EPILOGUES)
def test_gluon_epilogues_against_float64(activation, limit, biases, delta, monkeypatch):
    """GEMM1's bias and the gated activations of ``gluon_gemm.ACTIVATIONS``, GEMM2's bias on the live rows: both Gluon
    kernels run them (sizes off their tiles, NaN-poisoned outputs, debug mode's NaN dead fill) and match float64
    products of the same inputs through ``moelab.reference.apply_activation``; the whole layer of
    ``prepare_weights`` with them matches ``moelab.reference.routed_moe``. The bias comes before the delta and the
    activation (as in the Triton kernel)."""
    T, E, K, H, I = 2048, 8, 4, 384, 320
    seed = 100 + EPILOGUES.index((activation, limit, biases, delta))  # (hash() of a str varies between processes)
    w13, w2, x, ids, weights = _problem(T, E, K, H, I, seed)
    g = torch.Generator().manual_seed(seed + 1)
    b13 = (torch.randn(E, 2 * I, generator=g) * 0.5).bfloat16().cuda() if biases else None
    b2 = (torch.randn(E, H, generator=g) * 0.5).bfloat16().cuda() if biases else None
    d = (torch.randn(T, K, 2 * I, generator=g) * 0.5).bfloat16().cuda() if delta else None  # [up | gate]
    config = moe_gemm.choose_config(T, K, E)
    assert config.block_m == 128, "the case must make 128-row tiles"
    calls = _gluon_calls(monkeypatch)
    packed, seg, act, out = _segments_and_poisoned_rows(ids, weights, E, config, I, H)
    reach = seg.row_to_slot.numel()
    moe_gemm.gemm1_swiglu(x, w13, act, seg, top_k=K, config=config, dead_fill=float("nan"), activation=activation,
                          swiglu_limit=limit, bias=b13, delta=d.view(T * K, 2 * I) if delta else None)
    moe_gemm.gemm2(act, w2, out, seg, config=config, dead_fill=float("nan"), bias=b2)
    assert calls == ["gemm1_swiglu_ws", "gemm2_ws"], "the Gluon kernels did not run"
    zero_act = torch.where(act.isnan(), 0.0, act)  # GEMM2 again on zero padding rows: its bias stays off them
    zero_fill = moe_gemm.gemm2(zero_act, w2, poison(torch.empty_like(out)), seg, config=config, bias=b2)
    assert (zero_fill[(seg.row_to_slot < 0)] == 0).all(), "GEMM2's bias on padding or dead rows"
    slots = seg.row_to_slot.long()
    live = slots >= 0
    experts = seg.block_group.long().repeat_interleave(config.block_m)[:reach]
    want_act = torch.full((reach, I), float("nan"), dtype=torch.float64, device="cuda")
    want_out = torch.full((reach, H), float("nan"), dtype=torch.float64, device="cuda")
    clamped = []
    for e in range(E):  # float64 products expert by expert: GEMM2 of the kernel's own (rounded) activations
        rows = (live & (experts == e)).nonzero().squeeze(1)
        h = x.double()[slots[rows] // K] @ w13.double()[e].T + (b13.double()[e] if biases else 0.0)
        if delta:  # h is [gate | up], the delta [up | gate]
            h += d.double().view(T * K, 2 * I)[slots[rows]].roll(I, dims=1)
        want_act[rows] = reference.apply_activation(h.cpu(), activation, swiglu_limit=limit).cuda()
        if limit is not None:  # gate > limit or |up| > limit
            clamped.append(torch.cat([h[:, :I] > limit, h[:, I:].abs() > limit], dim=1).double().mean())
        want_out[rows] = act[rows].double() @ w2.double()[e].T + (b2.double()[e] if biases else 0.0)
    if limit is not None and limit < 1:
        share = torch.stack(clamped).mean().item()
        assert share > 0.2, f"the limit must clamp a good share of the products, got {share:.0%}"
    assert_close_to_reference(act[live].double(), want_act[live], torch.bfloat16, "act")
    assert_close_to_reference(out[live].double(), want_out[live], torch.bfloat16, "gemm2")
    assert act[~live].isnan().all() and out[~live].isnan().all(), "padding and dead rows: debug mode's NaN fill"

    layer = moelab.prepare_weights(w13, w2, backend="triton", activation=activation, w13_bias=b13, w2_bias=b2,
                                   swiglu_limit=limit)
    del calls[:]
    got = moelab.routed_moe(packed, x, layer, num_experts=E, top_k=K, output=poison(torch.empty_like(x)),
                            gemm1_lora_delta=d)[0]
    assert calls == ["gemm1_swiglu_ws", "gemm2_ws"], "the layer did not run the Gluon kernels"
    ref = reference.routed_moe(ids, reference.bf16_round(weights), x, w13, w2, activation=activation, w13_bias=b13,
                               w2_bias=b2, swiglu_limit=limit, gemm1_lora_delta=d)["output"]
    assert_close_to_reference(got, ref, torch.bfloat16, "output")


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels run wgmma: an sm_90 GPU (the H100/H200)")
def test_gluon_takes_only_what_it_handles(monkeypatch):
    """The gates take a plain call and refuse: an x row stride Triton cannot prove 16-byte aligned, mixed dtypes,
    segments of another tile or with no rows, and everything once ``GLUON`` is off (``MOELAB_GLUON=0``)."""
    w13, w2, x, ids, weights = _problem(600, 4, 2, 384, 320, 1)
    seg = build_segments_triton(moelab.pack_topk_ids_weights(ids, weights), 4, 128, packed=True)
    act = torch.empty(seg.row_to_slot.numel(), 320, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(seg.row_to_slot.numel(), 384, dtype=torch.bfloat16, device="cuda")
    assert gluon_gemm.takes_gluon_gemm1(seg, 128, x, w13, act) and gluon_gemm.takes_gluon_gemm2(seg, 128, act, w2, out)
    b13, b2 = torch.zeros(4, 640, dtype=torch.bfloat16, device="cuda"), torch.zeros(4, 384, device="cuda")
    assert gluon_gemm.takes_gluon_gemm1(seg, 128, x, w13, act, activation="swigluoai", bias=b13)
    assert gluon_gemm.takes_gluon_gemm2(seg, 128, act, w2, out, b2)
    assert not gluon_gemm.takes_gluon_gemm1(seg, 128, x, w13, act, activation="gelu"), "no gelu epilogue"
    assert not gluon_gemm.takes_gluon_gemm1(seg, 128, x, w13, act, gated=False)
    assert not gluon_gemm.takes_gluon_gemm1(seg, 128, x, w13, act, input_weights=weights), "weights on the input"
    assert not gluon_gemm.takes_gluon_gemm1(seg, 128, x, w13, act, bias=b13.t().contiguous().t())
    assert not gluon_gemm.takes_gluon_gemm2(seg, 128, act, w2, out, b2.t().contiguous().t())
    unaligned = torch.zeros(4 * 640 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(4, 640)  # 2 bytes off
    assert not gluon_gemm.takes_gluon_gemm1(seg, 128, x, w13, act, bias=unaligned), "an unaligned bias"
    wide = torch.zeros(600, 384 + 8, dtype=torch.bfloat16, device="cuda")[:, :384]  # a row stride of 392 elements
    assert not gluon_gemm.takes_gluon_gemm1(seg, 128, wide, w13, act)
    assert not gluon_gemm.takes_gluon_gemm2(seg, 128, act, w2, out.float())
    assert not gluon_gemm.takes_gluon_gemm2(seg, 64, act, w2, out)
    assert not gluon_gemm.takes_gluon_gemm2(dataclasses.replace(seg, row_to_slot=seg.row_to_slot[:0]), 128, act, w2,
                                            out)
    monkeypatch.setattr(gluon_gemm, "GLUON", False)
    assert not gluon_gemm.takes_gluon_gemm2(seg, 128, act, w2, out)
    assert not gluon_gemm.takes_gluon_gemm1(seg, 128, x, w13, act)


#: (T, E, K, H, I, ranks, max_rank, who, fused): a fused bank of adapters of ``ranks`` on 128-row tiles, in the
#: tile mode ("tiles"), the adapter loop ("adapter-loop": one adapter, rows unsorted; 3 adapters and more, each
#: expert's rows sorted by adapter; max_rank 128: two K steps an adapter; ranks off 8 and 16; 8 adapters in every
#: tile, their ranks packed into 2 K steps) or fused=True (a bank wider than 64 stacked columns: its one fused path,
#: the adapter loop); who has an adapter: "all" (each token one of the bank's), "half" (every other token -1),
#: "first" (the first 3 tokens: most tiles hold no adapter and skip the LoRA steps)
LORA_CASES = [(600, 4, 2, 384, 320, (16,), 16, "all", "tiles"),
              (1000, 4, 2, 256, 192, (16, 8, 16, 8), 16, "half", "tiles"),
              (4096, 8, 2, 512, 256, (64,), 64, "first", "tiles"), (2000, 4, 2, 256, 320, (24, 16), 24, "all", "tiles"),
              (600, 4, 2, 384, 320, (16,), 16, "all", "adapter-loop"),
              (4096, 8, 2, 512, 256, (64, 32, 16, 8, 64, 24, 40, 8), 64, "all", True),
              (3000, 8, 2, 256, 192, (128, 72, 13), 128, "half", "adapter-loop"),
              (4096, 8, 2, 512, 256, (8, 5, 64), 64, "first", "adapter-loop"),
              (512, 8, 2, 256, 192, (8, 16, 24, 8, 40, 8, 16, 8), 40, "all", "adapter-loop")]


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels run wgmma: an sm_90 GPU (the H100/H200)")
@pytest.mark.parametrize("T,E,K,H,I,ranks,max_rank,who,fused", LORA_CASES)
def test_gluon_gemms_with_a_fused_bank_match_the_reference(T, E, K, H, I, ranks, max_rank, who, fused, monkeypatch):
    from test_experts import make_bank, random_adapters

    seed = hash((T, E, K, H, I, ranks, who, fused)) % 2**31
    w13, w2, x, ids, weights = _problem(T, E, K, H, I, seed)
    bank = make_bank(random_adapters(len(ranks), E, H, I, list(ranks), seed=seed), E, 0, H, I, max_rank,
                     torch.bfloat16, "cuda")
    lora_ids = torch.arange(T, device="cuda") % len(ranks)
    if who == "half":
        lora_ids[1::2] = -1
    elif who == "first":
        lora_ids[3:] = -1
    calls = _gluon_calls(monkeypatch, with_lora=True)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton", fused=fused)
    out, base = lora_and_base_outputs(experts, x, weights, ids, lora_ids)
    mode = "TileLoRA" if fused == "tiles" else "AdapterLoopLoRA"
    assert ("gemm1_swiglu_ws", mode) in calls and ("gemm2_ws", mode) in calls, f"no Gluon LoRA launch: {calls}"
    ref = reference.lora_experts(x, weights, ids, lora_ids, w13, w2, bank)
    if who == "all":
        assert ref["lora"].norm() > 0.3 * ref["base"].norm(), "the adapters must matter for this test"
    assert_close_to_reference(out, ref["output"], torch.bfloat16, "output")
    assert_close_to_reference(base, ref["base"], torch.bfloat16, "base")
    none = lora_ids < 0
    assert torch.equal(out[none], base[none]), "tokens without an adapter: the base rows bit for bit"


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels run wgmma: an sm_90 GPU (the H100/H200)")
def test_large_experts_base_rows_stay_bitwise_across_their_tiles(monkeypatch):
    """Experts of ``moe_gemm.TILE128_MIN_EXPERT_BYTES`` (lowered to these small experts) at 64 rows an expert: the
    base call takes the 128-row tiles (the Gluon GEMMs), a ``LoRAExperts`` batch with a narrow stacked bank the
    table's 64-row tiles (the Triton kernels with the bank); its tokens without an adapter must still get the base
    call's rows bit for bit, and both calls match the float64 reference."""
    from test_experts import make_bank, random_adapters

    from moelab.backends import eager_graphs, triton_backend

    T, E, K, H, I, ranks = 256, 8, 2, 512, 256, (16, 8)
    w13, w2, x, ids, weights = _problem(T, E, K, H, I, 11)
    monkeypatch.setattr(moe_gemm, "TILE128_MIN_EXPERT_BYTES", (w13[0].numel() + w2[0].numel()) * 2)
    monkeypatch.setattr(eager_graphs, "ENABLED", False)  # each call runs its own launches
    bank = make_bank(random_adapters(len(ranks), E, H, I, list(ranks), seed=11), E, 0, H, I, 16, torch.bfloat16,
                     "cuda")
    lora_ids = torch.arange(T, device="cuda") % len(ranks)
    lora_ids[1::2] = -1
    calls = _gluon_calls(monkeypatch, with_lora=True)
    triton_backend._layout.cache_clear()
    try:
        experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton", fused="tiles")
        out, base = lora_and_base_outputs(experts, x, weights, ids, lora_ids)
    finally:
        triton_backend._layout.cache_clear()
    assert ("gemm1_swiglu_ws", "NoneType") in calls and ("gemm2_ws", "NoneType") in calls, calls
    assert not any(lora == "TileLoRA" for _, lora in calls), f"the bank's call took 128-row tiles: {calls}"
    ref = reference.lora_experts(x, weights, ids, lora_ids, w13, w2, bank)
    assert_close_to_reference(out, ref["output"], torch.bfloat16, "output")
    assert_close_to_reference(base, ref["base"], torch.bfloat16, "base")
    none = lora_ids < 0
    assert torch.equal(out[none], base[none]), "tokens without an adapter: the base rows bit for bit"


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels run wgmma: an sm_90 GPU (the H100/H200)")
@pytest.mark.parametrize("min_rows", [32, 10**6])
def test_a_wide_bank_takes_the_gluon_adapter_loop_from_its_rows_per_pair(min_rows, monkeypatch):
    """Left to the module, a bank wider than the tile mode's 64 stacked columns runs the adapter loop inside the Gluon
    GEMMs from ``GLUON_ADAPTER_LOOP_MIN_ROWS_PER_PAIR`` rows per (local expert, slot) on (here 128), and vLLM's flow
    below (the flow's GEMMs take no bank); both match the reference."""
    from test_experts import make_bank, random_adapters

    from moelab.backends import triton_backend

    monkeypatch.setattr(triton_backend, "GLUON_ADAPTER_LOOP_MIN_ROWS_PER_PAIR", min_rows)
    T, E, K, H, I, ranks = 4096, 8, 2, 512, 256, (64, 32, 16, 8, 64, 32, 16, 8)
    w13, w2, x, ids, weights = _problem(T, E, K, H, I, 7)
    bank = make_bank(random_adapters(len(ranks), E, H, I, list(ranks), seed=7), E, 0, H, I, 64, torch.bfloat16, "cuda")
    lora_ids = torch.randint(0, len(ranks), (T,), generator=torch.Generator().manual_seed(7)).cuda()
    modes = []
    real = gluon_gemm.gemm2_ws
    monkeypatch.setattr(gluon_gemm, "gemm2_ws", lambda *a, **k: modes.append(type(k.get("lora")).__name__) or
                        real(*a, **k))
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton")
    out, _ = lora_and_base_outputs(experts, x, weights, ids, lora_ids)
    assert ("AdapterLoopLoRA" in modes) == (min_rows == 32), modes
    ref = reference.lora_experts(x, weights, ids, lora_ids, w13, w2, bank)
    assert_close_to_reference(out, ref["output"], torch.bfloat16, "output")


@pytest.mark.skipif(not ON_SM90, reason="the Gluon kernels run wgmma: an sm_90 GPU (the H100/H200)")
def test_the_gluon_adapter_loop_skips_empty_slots_and_steps_past_64_ranks(monkeypatch):
    """A bank with slots never set (rank 0) between its adapters (tiles span them: no units of their own), ranks of
    96 and 72 (past one K step, packed beside rank 40) and H, I off the Gluon tiles: the adapter loop inside the
    Gluon GEMMs matches the reference, and tokens without an adapter get the base call's rows bit for bit."""
    from test_experts import random_adapters

    T, E, K, H, I = 4096, 8, 2, 384, 320
    w13, w2, x, ids, weights = _problem(T, E, K, H, I, 11)
    bank = moelab.LoRABank(5, E, H, I, 96, dtype=torch.bfloat16, device="cuda")
    for slot, rank in ((0, 96), (2, 40), (3, 72)):  # slots 1 and 4 stay empty
        adapter = random_adapters(1, E, H, I, [rank], seed=slot)[0]
        bank.set(slot, scaling=0.5, **{k: v.bfloat16().cuda() for k, v in adapter.items()})
    lora_ids = torch.randint(-1, 5, (T,), generator=torch.Generator().manual_seed(11)).cuda()
    lora_ids[(lora_ids == 1) | (lora_ids == 4)] = -1  # tokens may not name an empty slot (the module says so)
    modes = _gluon_calls(monkeypatch, with_lora=True)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton", fused="adapter-loop")
    out, base = lora_and_base_outputs(experts, x, weights, ids, lora_ids)
    assert {("gemm1_swiglu_ws", "AdapterLoopLoRA"), ("gemm2_ws", "AdapterLoopLoRA")} <= set(modes), modes
    ref = reference.lora_experts(x, weights, ids, lora_ids, w13, w2, bank)
    assert_close_to_reference(out, ref["output"], torch.bfloat16, "output")
    none = lora_ids < 0
    assert torch.equal(out[none], base[none]), "tokens without an adapter: the base rows bit for bit"
