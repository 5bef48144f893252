"""The triton backend's token-major path (``moelab/kernels/token_major.py``): a few slots in two launches.

Every case goes through ``moelab.routed_moe`` with a spy on the path, draws fresh random inputs, poisons the output
(an unwritten element fails) and compares against the float64 reference: every activation, both biases, the
router weight on the input, packed and tuple routing, expert-parallel windows with non-local slots (and a token
with none local), shapes off the tiles (masked reduction steps and column blocks), K not a power of two.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import zlib

import pytest
import torch
from helpers import assert_close_to_reference, poison, random_topk_ids, random_weights

import moelab
from moelab import reference
from moelab.backends import eager_graphs, triton_backend
from moelab.contract import ACTIVATIONS
from moelab.kernels import token_major
from moelab.roofline import graphed

pytestmark = [
    pytest.mark.skipif("triton" not in moelab.available_backends(), reason="the triton backend cannot run"),
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),  # gelu_tanh: v / inf = -0
]


@pytest.fixture
def paths(monkeypatch):
    """Counts of the calls each path ran: {"token_major": n}. The rule's expert and byte limits are lifted (small
    test problems have few experts), so every eager call of at most TOKEN_MAJOR_MAX_SLOTS slots takes the path."""
    monkeypatch.setattr(eager_graphs, "ENABLED", False)  # eager calls on a GPU would replay graphs (tiled kernels)
    monkeypatch.setattr(triton_backend, "TOKEN_MAJOR_EXPERTS_PER_SLOT", 0)
    monkeypatch.setattr(triton_backend, "TOKEN_MAJOR_MAX_BYTES", 1 << 62)
    seen = {"token_major": 0}
    original = triton_backend.token_major_moe

    def spy(*args, **kwargs):
        seen["token_major"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "token_major_moe", spy)
    return seen


def _problem(T, K, E, H, I, *, gated=True, bias=False, dtype=torch.float32, device="cpu", seed=0, E_local=None):
    g = torch.Generator().manual_seed(seed)
    E_local = E if E_local is None else E_local
    rows = 2 * I if gated else I
    p = dict(w13=torch.randn(E_local, rows, H, generator=g) / H**0.5 * 3,  # * 3: outputs reach swigluoai's clamp
             w2=torch.randn(E_local, H, I, generator=g) / I**0.5,
             b13=torch.randn(E_local, rows, generator=g) if bias else None,
             b2=torch.randn(E_local, H, generator=g) if bias else None,
             x=torch.randn(T, H, generator=g))
    p = {k: v.to(dtype).to(device) if v is not None else None for k, v in p.items()}
    p["ids"] = random_topk_ids(T, K, E, generator=g, device=device)
    p["w"] = random_weights(T, K, generator=g, device=device)
    return p


def _routed(p, weights, *, E, K, packed, on_input=False, offset=0):
    topk = moelab.pack_topk_ids_weights(p["ids"], p["w"]) if packed else (p["ids"], p["w"])
    out = poison(torch.empty_like(p["x"]))
    got = moelab.routed_moe(topk, p["x"], weights, num_experts=E, top_k=K, local_expert_offset=offset, output=out,
                            apply_router_weight_on_input=on_input)[0]
    assert got is out
    return out


@pytest.mark.parametrize("T, K", [(1, 6), (1, 2), (2, 6)])
@pytest.mark.parametrize("rule_hidden", [None, 4096], ids=["rule-at-H", "rule-at-4096"])
def test_the_gpu_tiles(T, K, rule_hidden, device, monkeypatch):
    """The tiles ``choose_token_major_config`` gives a GPU (pipelined loops, GEMM2's 4- and 8-column tiles; at
    H >= 4096 with K <= 4 launched without programmatic dependent launch), run here on a problem off every tile (the
    interpreter ignores the pipeline depth): right against the float64 reference, every output element written."""
    from moelab import _runtime
    E, H, I = 16, 40, 24
    with monkeypatch.context() as m:
        m.setattr(_runtime, "INTERPRET", False)  # the GPU's choice, whatever runs it
        token_major.choose_token_major_config.cache_clear()
        cfg = token_major.choose_token_major_config(T, K, rule_hidden or H, I)
    token_major.choose_token_major_config.cache_clear()
    assert cfg.stages1 is not None and cfg.pdl == (rule_hidden is None or K > 4), cfg
    p = _problem(T, K, E, H, I, device=device, seed=70 + T * 10 + K)
    packed = moelab.pack_topk_ids_weights(p["ids"], p["w"])
    out = poison(torch.empty_like(p["x"]))
    token_major.token_major_moe(packed, None, p["x"], p["w13"], p["w2"], out, config=cfg)  # w13: HF order, as triton
    ref = reference.routed_moe(p["ids"], reference.bf16_round(p["w"]), p["x"], p["w13"], p["w2"])
    assert_close_to_reference(out, ref["output"], torch.float32, f"{cfg}")


@pytest.mark.parametrize("bias,on_input,packed", [(False, False, False), (True, False, False), (True, True, True),
                                                  (True, True, False)],
                         ids=["plain", "bias", "bias-oninput-packed", "bias-oninput-tuple"])
@pytest.mark.parametrize("activation,gated", sorted(ACTIVATIONS))
def test_every_activation_against_reference(activation, gated, bias, on_input, packed, device, paths):
    T, K, E, H, I = 3, 5, 7, 40, 24  # 15 slots; K_PAD 8; H and I off the tiles
    seed = zlib.crc32(repr((activation, gated, bias, on_input, packed)).encode())
    p = _problem(T, K, E, H, I, gated=gated, bias=bias, device=device, seed=seed)
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton", w13_bias=p["b13"], w2_bias=p["b2"],
                                     activation=activation, gated=gated)
    out = _routed(p, weights, E=E, K=K, packed=packed, on_input=on_input)
    assert paths["token_major"] == 1
    w_ref = reference.bf16_round(p["w"]) if packed else p["w"]
    ref = reference.routed_moe(p["ids"], w_ref, p["x"], p["w13"], p["w2"], w13_bias=p["b13"], w2_bias=p["b2"],
                               activation=activation, gated=gated, apply_router_weight_on_input=on_input)
    assert_close_to_reference(out, ref["output"], torch.float32, f"{activation} output")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T, K, E, H, I", [(1, 2, 8, 32, 32), (1, 8, 64, 48, 40), (2, 8, 16, 64, 16),
                                           (4, 3, 6, 24, 56), (3, 1, 16, 40, 24)])  # K = 1: Llama-4's top-1
def test_shapes_and_dtypes(T, K, E, H, I, dtype, device, paths):
    p = _problem(T, K, E, H, I, dtype=dtype, device=device, seed=T * 1000 + K * 100 + H)
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton")
    out = _routed(p, weights, E=E, K=K, packed=dtype == torch.bfloat16)
    assert paths["token_major"] == 1
    w_ref = reference.bf16_round(p["w"]) if dtype == torch.bfloat16 else p["w"]
    ref = reference.routed_moe(p["ids"], w_ref, p["x"], p["w13"], p["w2"])
    assert_close_to_reference(out, ref["output"], dtype, f"T={T} K={K} {dtype}")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "tuple"])
def test_expert_parallel_window(packed, device, paths):
    """Experts [2, 5) of 8 on this rank: slots outside it add nothing; token 0 has no local expert (zero row)."""
    T, K, E, E_local, offset, H, I = 4, 3, 8, 3, 2, 40, 24
    p = _problem(T, K, E, H, I, bias=True, device=device, seed=11, E_local=E_local)
    p["ids"][0] = torch.tensor([0, 1, 7], dtype=torch.int32)
    p["ids"][1] = torch.tensor([2, 3, 4], dtype=torch.int32)
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton", w13_bias=p["b13"], w2_bias=p["b2"])
    out = _routed(p, weights, E=E, K=K, packed=packed, offset=offset)
    assert paths["token_major"] == 1
    w_ref = reference.bf16_round(p["w"]) if packed else p["w"]
    ref = reference.routed_moe(p["ids"], w_ref, p["x"], p["w13"], p["w2"], local_expert_offset=offset,
                               w13_bias=p["b13"], w2_bias=p["b2"])["output"]
    assert torch.equal(out[0], torch.zeros_like(out[0])), "a token with no local expert must be a zero row"
    assert_close_to_reference(out, ref, torch.float32, "EP output")


def test_which_calls_take_it(device, paths):
    """Up to TOKEN_MAJOR_MAX_SLOTS slots asking for the output only; not past it, not without the finalize, not
    with a delta, not when the caller names the tiles. Each call still matches the reference."""
    K, E, H, I = 4, 8, 32, 16
    most = triton_backend.TOKEN_MAJOR_MAX_SLOTS // K
    weights_of = {}
    for T, expect in [(most, 1), (most + 1, 0)]:
        p = _problem(T, K, E, H, I, device=device, seed=T)
        weights_of[T] = p
        weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton")
        before = paths["token_major"]
        out = _routed(p, weights, E=E, K=K, packed=False)
        assert paths["token_major"] - before == expect, f"T={T}"
        ref = reference.routed_moe(p["ids"], p["w"], p["x"], p["w13"], p["w2"])["output"]
        assert_close_to_reference(out, ref, torch.float32, f"T={T}")
    p = weights_of[most]
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton")
    topk = (p["ids"], p["w"])
    before = paths["token_major"]
    moelab.routed_moe(topk, p["x"], weights, num_experts=E, top_k=K, do_finalize=False)
    delta = torch.zeros(most, K, 2 * I, device=device)
    moelab.routed_moe(topk, p["x"], weights, num_experts=E, top_k=K, gemm1_lora_delta=delta)
    call = moelab.moe.validate_call(topk, p["x"], weights, E, K, 0, None, True, None, True)
    config = triton_backend.choose_config(most, K, E, torch.float32, device=device)
    result = triton_backend.routed_moe(call, config)
    assert result.gemm2_output.numel() > 0, "a named tile config runs the tiled pipeline"
    assert paths["token_major"] == before, "the permuted intermediates, a delta or named tiles took token-major"


def test_the_rule():
    """Eager: few slots, over many experts, with little weight to stream; in a graph: the graph limit."""
    takes = triton_backend.takes_token_major
    qwen3 = dict(num_local_experts=128, expert_bytes=3 * 2048 * 768 * 2)
    assert takes(1, 8, True, False, **qwen3) and takes(2, 8, True, False, **qwen3)
    assert not takes(4, 8, True, False, **qwen3), "32 slots: past TOKEN_MAJOR_MAX_SLOTS"
    assert not takes(1, 8, False, False, **qwen3) and not takes(1, 8, True, True, **qwen3)
    assert not takes(0, 8, True, False, **qwen3)
    assert takes(1, 8, True, False, True, **qwen3) == (triton_backend.TOKEN_MAJOR_MAX_SLOTS_GRAPH >= 8)
    assert takes(1, 8, True, False, True, lora=True, **qwen3), "a bank in a graph: 8 slots take token-major"
    assert takes(2, 8, True, False, True, lora=True, **qwen3), "a bank in a graph: 16 slots take token-major"
    assert not takes(3, 8, True, False, True, lora=True, **qwen3), "a bank in a graph: 24 slots stay tiled"
    assert not takes(1, 8, True, False, lora=True, num_local_experts=16, expert_bytes=1), "8 slots share 16 experts"
    assert not takes(2, 2, True, False, num_local_experts=8, expert_bytes=1), "Mixtral T=2: 4 slots share 8 experts"
    mixtral = dict(num_local_experts=8, expert_bytes=3 * 4096 * 14336 * 2)
    assert takes(1, 2, True, False, **mixtral) and takes(1, 2, True, False, True, **mixtral), "one token, big experts"
    assert not takes(2, 2, True, False, **mixtral) and not takes(2, 2, True, False, True, **mixtral)
    gpt_oss = dict(num_local_experts=32, expert_bytes=3 * 2880 * 2880 * 2)
    assert takes(1, 4, True, False, **gpt_oss) and not takes(2, 4, True, False, **gpt_oss)
    assert takes(1, 4, True, False, True, **gpt_oss) and takes(2, 4, True, False, True, **gpt_oss), "graphs: no bytes"
    assert not takes(4, 4, True, False, True, **gpt_oss), "16 slots share 32 experts: the tiled pipeline in graphs"
    assert not takes(1, 4, True, False, True, lora=True, **gpt_oss), "a bank, 4 slots: the tiled pipeline in graphs"
    assert takes(2, 4, True, False, True, lora=True, **gpt_oss), "a bank, 8 slots: token-major in graphs"
    assert takes(1, 6, True, False, True, lora=True, num_local_experts=64, expert_bytes=1), "E64 K6: 6 slots"
    assert takes(1, 2, True, False, True, lora=True, **mixtral), "a bank, one token of big experts: token-major"
    e128 = dict(num_local_experts=128, expert_bytes=3 * 4096 * 1536 * 2)  # 8 slots of 37.7 MB: past the byte limit
    assert takes(1, 8, True, False, **e128), "one token eagerly: no byte limit"
    assert not takes(2, 8, True, False, **e128) and takes(1, 8, True, False, True, **e128)


def test_the_rule_sees_the_call(device, monkeypatch):
    """The backend hands the rule the call's slots, local experts and one expert's weight bytes."""
    monkeypatch.setattr(eager_graphs, "ENABLED", False)  # on a GPU the eager call would replay a graph
    seen = []
    rule = triton_backend.takes_token_major
    monkeypatch.setattr(triton_backend, "takes_token_major", lambda *a, **k: seen.append((a, k)) or rule(*a, **k))
    T, K, E, H, I = 3, 2, 6, 40, 24
    p = _problem(T, K, E, H, I, device=device, seed=41)
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton")
    _routed(p, weights, E=E, K=K, packed=True)
    (args, kwargs), = seen
    assert args[:4] == (T, K, True, False)
    assert kwargs == dict(num_local_experts=E, expert_bytes=(p["w13"][0].numel() + p["w2"][0].numel()) * 4)


def test_the_readme_switch_rules_it_out(monkeypatch):
    """README's way to rule the path out: both limits set as it says, no call takes it."""
    monkeypatch.setattr(triton_backend, "TOKEN_MAJOR_MAX_SLOTS", 0)
    monkeypatch.setattr(triton_backend, "TOKEN_MAJOR_MAX_SLOTS_GRAPH", 0)
    monkeypatch.setattr(triton_backend, "TOKEN_MAJOR_BIG_EXPERT_BYTES", 1 << 62)
    mixtral = dict(num_local_experts=8, expert_bytes=3 * 4096 * 14336 * 2)
    for capturing in (False, True):
        assert not triton_backend.takes_token_major(1, 2, True, False, capturing, **mixtral)
        assert not triton_backend.takes_token_major(1, 8, True, False, capturing, num_local_experts=128,
                                                    expert_bytes=1)


def test_the_rule_in_a_call(device, monkeypatch):
    """A call the rule sends down the path, and one past its expert limit, through ``moelab.routed_moe``."""
    monkeypatch.setattr(eager_graphs, "ENABLED", False)  # on a GPU these eager calls would replay graphs
    seen = []
    original = triton_backend.token_major_moe
    monkeypatch.setattr(triton_backend, "token_major_moe", lambda *a, **k: seen.append(1) or original(*a, **k))
    K, E, H, I = 2, 16, 32, 16
    for T, expect in [(2, 1), (3, 0)]:  # 4 slots over 16 experts; 6 slots: fewer than 4 experts a slot
        p = _problem(T, K, E, H, I, device=device, seed=20 + T)
        weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton")
        before = len(seen)
        out = _routed(p, weights, E=E, K=K, packed=False)
        assert len(seen) - before == expect, f"T={T}"
        ref = reference.routed_moe(p["ids"], p["w"], p["x"], p["w13"], p["w2"])["output"]
        assert_close_to_reference(out, ref, torch.float32, f"T={T}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA GPU (runs on the H200)")
@pytest.mark.parametrize("graph_limit, pdl", [(0, True), (1 << 30, True), (1 << 30, False)],
                         ids=["tiled-in-graphs", "token-major-in-graphs", "token-major-in-graphs-without-pdl"])
def test_cuda_graph_capture_and_replay(graph_limit, pdl, paths, monkeypatch):
    """Eager calls take token-major; a captured call takes the path ``TOKEN_MAJOR_MAX_SLOTS_GRAPH`` says (both
    replay right, with fresh inputs copied in: the token-major kernels read the routing on the device), its tiles
    launched with programmatic dependent launch or (``TokenMajorConfig.pdl`` False, Mixtral's) without."""
    rule = token_major.choose_token_major_config
    monkeypatch.setattr(token_major, "choose_token_major_config",
                        lambda *shape: dataclasses.replace(rule(*shape), pdl=pdl))
    monkeypatch.setattr(triton_backend, "TOKEN_MAJOR_MAX_SLOTS_GRAPH", graph_limit)
    T, K, E, H, I, device = 2, 4, 16, 256, 96, torch.device("cuda")
    p = _problem(T, K, E, H, I, dtype=torch.bfloat16, device=device, seed=5)
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton")
    packed = moelab.pack_topk_ids_weights(p["ids"], p["w"])
    out = torch.empty(T, H, dtype=torch.bfloat16, device=device)

    def call():
        return moelab.routed_moe(packed, p["x"], weights, num_experts=E, top_k=K, output=out, validate=False)

    replay = graphed(call, device)  # two eager warm-ups, then the capture
    assert paths["token_major"] == 2 + (graph_limit > 0)
    q = _problem(T, K, E, H, I, dtype=torch.bfloat16, device=device, seed=6)
    p["x"].copy_(q["x"])
    packed.copy_(moelab.pack_topk_ids_weights(q["ids"], q["w"]))
    poison(out)
    replay()
    torch.cuda.synchronize()
    ref = reference.routed_moe(q["ids"], reference.bf16_round(q["w"]), q["x"], p["w13"], p["w2"])["output"]
    assert_close_to_reference(out, ref, torch.bfloat16, "replayed graph")


def test_under_torch_compile(device, paths):
    """Compiled (one custom op, fullgraph): the token-major path runs inside it and its output matches the reference;
    the op's fake agrees with the real op whichever path runs (output only: empty intermediates)."""
    T, K, E, H, I = 2, 4, 16, 32, 16
    p = _problem(T, K, E, H, I, device=device, seed=31)
    weights = moelab.prepare_weights(p["w13"], p["w2"], backend="triton")
    packed = moelab.pack_topk_ids_weights(p["ids"], p["w"])

    def layer(x, packed):
        return moelab.routed_moe(packed, x, weights, num_experts=E, top_k=K, validate=False)[0]

    compiled = torch.compile(layer, backend="aot_eager" if device.type == "cpu" else "inductor", fullgraph=True)
    out = compiled(p["x"], packed)
    assert paths["token_major"] >= 1
    ref = reference.routed_moe(p["ids"], reference.bf16_round(p["w"]), p["x"], p["w13"], p["w2"])["output"]
    assert_close_to_reference(out, ref, torch.float32, "compiled token-major")
    torch.library.opcheck(torch.ops.moelab.triton_routed_moe.default,
                          (p["ids"], p["w"], p["x"], p["w13"], p["w2"], E, 0, None, True),
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------- LoRA (two launches)

def _lora_problem(T, K, E, H, I, dtype, device, *, ranks, max_rank, lora_ids, seed, E_local=None, offset=0):
    from test_experts import make_bank, make_problem
    x, ids, w, w13, w2, lora_ids, adapters = make_problem(T, K, E, H, I, dtype, device, L=len(ranks), ranks=ranks,
                                                          seed=seed, lora_ids=lora_ids)
    E_local = E if E_local is None else E_local
    w13, w2 = w13[offset:offset + E_local].contiguous(), w2[offset:offset + E_local].contiguous()
    bank = make_bank(adapters, E_local, offset, H, I, max_rank, dtype, device)
    return x, ids, w, w13, w2, lora_ids, bank


def _poison_empty(monkeypatch):
    """Every float buffer ``torch.empty`` hands out starts as NaN (the output, the activation, the rank vectors):
    an element no kernel wrote, or a rank vector read where none was written, cannot pass."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (lambda t: t.fill_(float("nan")) if t.dtype.is_floating_point
                                                         else t)(empty(*a, **k)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ranks, max_rank", [((4, 8, 2), 8), ((64, 8, 3), 64)], ids=["narrow", "wide-mixed"])
@pytest.mark.parametrize("T, K, lora_ids", [(4, 3, [2, -1, 0, 1]), (2, 6, [-1, 0])], ids=["K3", "K6"])
def test_lora_against_reference(T, K, lora_ids, ranks, max_rank, dtype, device, paths, monkeypatch):
    """``LoRAExperts`` left to itself at a token-major size: its LoRA call and its base call both take the path (one
    launch each), the output matches the float64 reference, the LoRA part alone too, and the token without an
    adapter is the base call's row bit for bit. A bank of 3 adapters (narrow: stacked 64 columns; wide: ranks 64, 8
    and 3 in R_PAD 64, mostly padding), K not a power of two (K = 6: GEMM2's LoRA on its K loop's tiles, K = 3: on
    tiles of its own; adapter 0, of rank 64 in the wide bank, fills both of its K loop steps of 32 ranks in the
    interpreter), H and I off the tiles, every float buffer poisoned."""
    _poison_empty(monkeypatch)
    E, H, I = 8, 40, 24  # 12 slots
    lora_ids = torch.tensor(lora_ids)
    x, ids, w, w13, w2, lora_ids, bank = _lora_problem(T, K, E, H, I, dtype, device, ranks=ranks, max_rank=max_rank,
                                                       lora_ids=lora_ids, seed=max_rank)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton")
    out = experts(x, w, ids, lora_ids)
    base = experts(x, w, ids, None)
    assert paths["token_major"] == 2, "the LoRA call and the base call both take the token-major path"
    ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)
    assert ref["lora"].norm() > 0.3 * ref["base"].norm(), "the adapters must matter for this test to mean anything"
    assert_close_to_reference(out, ref["output"], dtype, "token-major LoRA output")
    assert_close_to_reference(out.double() - base.double(), ref["lora"], dtype, "token-major LoRA part")
    none = (lora_ids < 0).to(out.device)
    assert torch.equal(out[none], base[none]), "a token without an adapter must be the base call's row bit for bit"
    assert not torch.equal(out[~none], base[~none])


@pytest.mark.parametrize("shrink_shape", [None, (16, 2)], ids=["test-size", "16-programs"])
def test_lora_shrink_flags_return_to_zero(shrink_shape, device, monkeypatch):
    """GEMM1's own W13 shrink programs count themselves done on each slot's flag and GEMM2 sets the flags back to
    0, so the next call on the stream waits on fresh counts; two calls in turn, both right against the reference,
    and the flags all zero after each. 16-programs: the shrink spread as at H = 2048 (2 rank columns a program, 16
    programs a slot, here in K steps of 16 over H = 32), every float buffer poisoned."""
    if shrink_shape is not None:
        from moelab.kernels import fused_lora
        monkeypatch.setattr(fused_lora, "slot_shrink_shape", lambda H, r_pad: shrink_shape)
    _poison_empty(monkeypatch)
    T, K, E, H, I = 3, 4, 8, 32, 40
    for seed in (1, 2):
        x, ids, w, w13, w2, lora_ids, bank = _lora_problem(T, K, E, H, I, torch.float32, device, ranks=(8, 4),
                                                           max_rank=8, lora_ids=torch.tensor([1, -1, 0]), seed=seed)
        out = token_major.token_major_moe(ids.contiguous(), w.contiguous(), x, w13, w2, torch.empty_like(x),
                                          round_weights=True, bank=bank, lora_ids=lora_ids.contiguous())
        ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)
        assert_close_to_reference(out, ref["output"], torch.float32, f"fused shrink, call {seed}")
        flags = token_major._slot_flags(x.device, T * K)
        assert torch.count_nonzero(flags) == 0, f"slot flags left set after call {seed}: {flags[:T * K].tolist()}"


#: Run in a fresh process with scripts/ on its path (``ptx_sm90`` sets TRITON_INTERPRET=0: kernels compiled, not
#: interpreted): each token-major kernel compiled to sm_90 PTX at Qwen3-30B-A3B's T = 1 tiles. Prints one JSON line:
#: {variant: PTX length}.
SM90_CODE = """
import json
import ptx_sm90
from moelab.kernels import token_major as tm


def ptx(kernel, given, num_warps):
    # given: constexpr values, and "*type" for the pointers that default to None but are passed; the pointers,
    # strides, H and I hinted 16-divisible, as a real launch at these shapes is
    consts = ptx_sm90.constexprs_of(kernel, given)
    types = {n: ptx_sm90.arg_type(n, given) for n in kernel.arg_names if n not in consts}
    hinted = [n for n in types if n.endswith("_ptr") or n in ("H", "I") or n.startswith("stride_")]
    return ptx_sm90.compile_for_sm90(kernel, types, consts, hinted, num_warps=num_warps)


cfg = tm.choose_token_major_config(1, 8, 2048, 768)
act = dict(ACTIVATION="silu", GATED=True, SWIGLU_ALPHA=None, SWIGLU_LIMIT=None, IN_WEIGHT=False, PACKED=True,
           USE_GDC=True)
gemm1 = dict(act, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1, STAGES=cfg.stages1)
gemm2 = dict(PACKED=True, USE_GDC=True, WEIGHTED=True, ROUND_WEIGHTS=False, K_PAD=8, BLOCK_N=cfg.block_n2,
             BLOCK_K=cfg.block_k2, STAGES=cfg.stages2)
lora = dict(LORA=True, R_PAD=16, PACKED=False, lora_ids_ptr="*i32", ranks_ptr="*i32", s2_ptr="*fp32",
            flags_ptr="*i32")
variants = {
    "gemm1": (tm._token_major_gemm1_kernel, gemm1),
    "gemm1_lora_shrink": (tm._token_major_gemm1_kernel, dict(gemm1, **lora, s13_ptr="*bf16", up_b_ptr="*bf16",
                                                           gate_b_ptr="*bf16", down_a_ptr="*bf16", up_a_ptr="*bf16",
                                                           gate_a_ptr="*bf16", SHRINK_PROGRAMS=16)),
    "gemm2": (tm._token_major_gemm2_kernel, gemm2),
    "gemm2_lora_k_tiles": (tm._token_major_gemm2_kernel, dict(gemm2, **lora, down_b_ptr="*bf16", LORA_K_TILES=True,
                                                            EARLY_DOWN_B=True, ROUND_WEIGHTS=True)),
}
print(json.dumps({name: len(ptx(kernel, given, 4)) for name, (kernel, given) in variants.items()}))
"""


def test_kernels_compile_for_sm90(tmp_path):
    """Every token-major kernel compiles to sm_90 PTX at Qwen3-30B-A3B's T = 1 tiles with the installed Triton (no
    GPU needed): the interpreter runs code that Triton's compiler refuses (a variable of two types across the
    branches of an ``if`` runs on a CPU and fails to compile for a GPU)."""
    (tmp_path / "sm90.py").write_text(SM90_CODE)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([root, os.path.join(root, "scripts")]))
    done = subprocess.run([sys.executable, str(tmp_path / "sm90.py")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lengths = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(lengths) == ["gemm1", "gemm1_lora_shrink", "gemm2", "gemm2_lora_k_tiles"]
    assert all(n > 1000 for n in lengths.values()), lengths


def test_no_adapter_ids_buffer(device, monkeypatch):
    """A bank's call without ids reads its -1 ids from one buffer kept per device and stream (no fill launch a
    call): the buffer grows past its first size for a bigger call, no kernel writes it, and the rows equal those of
    the same call given explicit -1 ids (every float buffer poisoned)."""
    _poison_empty(monkeypatch)
    monkeypatch.setattr(token_major, "_NO_ADAPTER_IDS", {})
    monkeypatch.setattr(token_major, "_BUFFER_MIN_ELEMENTS", 4)
    K, E, H, I = 2, 4, 16, 16
    for T in (3, 9):  # 9: past the first buffer's 4
        x, ids, w, w13, w2, lora_ids, bank = _lora_problem(T, K, E, H, I, torch.float32, device, ranks=(4,),
                                                           max_rank=4, lora_ids=torch.full((T,), -1), seed=T)
        run = functools.partial(token_major.token_major_moe, ids.contiguous(), w.contiguous(), x, w13, w2,
                                round_weights=True, bank=bank)
        out = run(torch.empty_like(x))
        explicit = run(torch.empty_like(x), lora_ids=lora_ids.to(torch.int32).contiguous())
        assert torch.equal(out, explicit), f"T={T}: rows without ids must equal those of explicit -1 ids"
        (kept,) = token_major._NO_ADAPTER_IDS.values()
        assert kept.numel() >= T and bool((kept == -1).all()), f"T={T}: the kept -1 ids were written or too short"


@pytest.mark.parametrize("window", [True, False], ids=["window", "all-local"])
@pytest.mark.parametrize("K", [2, 6])
def test_lora_expert_parallel_and_forced(window, K, device, monkeypatch):
    """``fused="token-major"`` at a size the rule would not pick (too many slots per expert), under an
    expert-parallel window (experts [2, 5)): non-local slots add nothing (their rank vectors are never written or
    read: every float buffer poisoned), token 0 has no local expert (a zero row), and the result matches the
    reference's partial sum; K = 2 and 6, GEMM2's two LoRA variants."""
    _poison_empty(monkeypatch)
    T, E, H, I = 5, 12, 32, 48
    E_local, offset = (3, 2) if window else (E, 0)
    lora_ids = torch.tensor([1, 0, -1, 1, 0])
    x, ids, w, w13, w2, lora_ids, bank = _lora_problem(T, K, E, H, I, torch.float32, device, ranks=(8, 5),
                                                       max_rank=8, lora_ids=lora_ids, seed=7 + K, E_local=E_local,
                                                       offset=offset)
    if window:  # token 0: no expert in [2, 5)
        ids[0] = torch.tensor([0, 7, 1, 5, 9, 11][:K], dtype=ids.dtype)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, local_expert_offset=offset, lora=bank,
                                 backend="triton", fused="token-major")
    seen = []
    original = triton_backend.token_major_moe
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_backend, "token_major_moe",
                   lambda *a, **k: seen.append((k["bank"], k["lora_ids"] is None)) or original(*a, **k))
        out = experts(x, w, ids, lora_ids)
        base = experts(x, w, ids, None)
    assert seen == [(bank, False), (bank, True)], "both calls run the bank's kernels, the base call without ids"
    ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank, local_expert_offset=offset)
    assert_close_to_reference(out, ref["output"], torch.float32, "forced token-major, EP")
    if window:
        assert torch.equal(out[0], torch.zeros_like(out[0])), "a token with no local expert must be a zero row"
    none = (lora_ids < 0).to(out.device)
    assert torch.equal(out[none], base[none])


def test_lora_follows_the_base_rule(device):
    """Left to itself, ``LoRAExperts`` takes the token-major path exactly where ``routed_moe`` would for the same
    call (the rule's own limits, not lifted here), with and without adapters."""
    seen = []
    original = triton_backend.token_major_moe
    K, E, H, I = 2, 16, 32, 16
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eager_graphs, "ENABLED", False)  # on a GPU these eager calls would replay graphs (tiled kernels)
        mp.setattr(triton_backend, "token_major_moe", lambda *a, **k: seen.append(1) or original(*a, **k))
        for T in (2, 3):  # 4 slots over 16 experts: token-major; 6 slots: fewer than 4 experts a slot, tiled
            x, ids, w, w13, w2, lora_ids, bank = _lora_problem(T, K, E, H, I, torch.float32, device, ranks=(4,),
                                                               max_rank=4, lora_ids=torch.zeros(T, dtype=torch.long),
                                                               seed=T)
            expect = int(triton_backend.takes_token_major(T, K, True, False, num_local_experts=E,
                                                          expert_bytes=(w13[0].numel() + w2[0].numel()) * 4))
            assert expect == (T == 2)
            experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton")
            for ids_of_call in (lora_ids, None):
                before = len(seen)
                experts(x, w, ids, ids_of_call)
                assert len(seen) - before == expect, f"T={T}, lora_ids={ids_of_call}"


def test_lora_flow_module_keeps_the_tiled_pipeline(device):
    """``fused=False`` (vLLM's flow: the tiled pipeline for the LoRA calls) keeps its base calls on the tiled
    pipeline too, at a size the rule sends down the token-major path: the token without an adapter is the base
    call's row bit for bit."""
    seen = []
    original = triton_backend.token_major_moe
    T, K, E, H, I = 2, 2, 16, 32, 16
    assert triton_backend.takes_token_major(T, K, True, False, num_local_experts=E, expert_bytes=3 * H * I * 4)
    x, ids, w, w13, w2, lora_ids, bank = _lora_problem(T, K, E, H, I, torch.float32, device, ranks=(4,), max_rank=4,
                                                       lora_ids=torch.tensor([0, -1]), seed=0)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton", fused=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_backend, "token_major_moe", lambda *a, **k: seen.append(1) or original(*a, **k))
        out, base = experts(x, w, ids, lora_ids), experts(x, w, ids, None)
    assert seen == [], "a flow module's calls take the tiled pipeline, with and without adapters"
    assert torch.equal(out[1], base[1])


def test_lora_module_under_torch_compile(device):
    """Under torch.compile a LoRAExperts call without adapters is the tiled pipeline's registered op, also at a size
    where the eager call takes the token-major kernels: the two agree to rounding (not bit for bit), both right."""
    T, K, E, H, I = 2, 2, 16, 32, 16
    x, ids, w, w13, w2, _, bank = _lora_problem(T, K, E, H, I, torch.float32, device, ranks=(4,), max_rank=4,
                                                lora_ids=torch.tensor([0, -1]), seed=1)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton")
    compiled = torch.compile(lambda x, w, ids: experts(x, w, ids, None, validate=False),
                             backend="aot_eager" if device.type == "cpu" else "inductor", fullgraph=True)
    ref = reference.lora_experts(x, w, ids, torch.full((T,), -1), w13, w2, bank)["output"]
    assert_close_to_reference(compiled(x, w, ids), ref, torch.float32, "compiled")
    assert_close_to_reference(experts(x, w, ids, None), ref, torch.float32, "eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA GPU (runs on the H200)")
def test_lora_cuda_graph_capture_and_replay():
    """The forced token-major LoRA path captured in a CUDA graph (PDL between its two launches on Hopper),
    replayed on fresh inputs and adapter ids copied in, then after ``bank.set`` reloads a slot at a higher rank (the
    rank table is read on the device): right against the reference each time."""
    from test_experts import make_problem
    T, K, E, H, I, dtype, device = 2, 8, 64, 512, 256, torch.bfloat16, torch.device("cuda")
    x, ids, w, w13, w2, lora_ids, bank = _lora_problem(T, K, E, H, I, dtype, device, ranks=(16, 8), max_rank=32,
                                                       lora_ids=torch.tensor([1, -1]), seed=3)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton", fused="token-major")
    replay = graphed(lambda: experts(x, w, ids, lora_ids, has_lora=True, validate=False), device)
    x2, ids2, w2_, *_ = make_problem(T, K, E, H, I, dtype, device, L=2, ranks=(16, 8), seed=4,
                                     lora_ids=torch.tensor([0, 1]))
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2_), lora_ids.copy_(torch.tensor([0, 1], device=device))
    for step in ("replay", "after set"):
        if step == "after set":  # slot 1 (rank 8) reloaded at rank 32
            a = make_problem(1, K, E, H, I, dtype, "cpu", L=1, ranks=(32,), seed=12)[-1][0]
            bank.set(1, scaling=0.5, **{k: v.to(dtype).to(device) for k, v in a.items()})
        out = poison(replay.out)
        replay()
        torch.cuda.synchronize()
        ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)
        assert_close_to_reference(out, ref["output"], dtype, f"graph {step}")
