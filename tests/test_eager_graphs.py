"""Eager decode calls replayed from CUDA graphs (``moelab/backends/eager_graphs.py``): every replay against the
float64 reference with fresh inputs, every element of the output written, outputs of their own, one graph per key.

The replays need a CUDA GPU (the lent H200 runs them); on a CPU the rules run: nothing is replayed there, and which
LoRA keys past ``MAX_TOKENS`` capture.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from helpers import assert_close_to_reference, poison, random_experts, random_topk_ids, random_weights

import moelab
from moelab import experts as experts_module
from moelab import moe as moe_module
from moelab import reference
from moelab.backends import eager_graphs, triton_backend
from moelab.contract import LoRAExpertsCall, RoutedMoECall
from moelab.kernels import gluon_gemm

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA-graph replays need a CUDA GPU (runs on the H200)")
T, K, E, H, I = 4, 2, 8, 64, 32


@pytest.fixture
def graphs(monkeypatch):
    """A cache of its own for the test, on (a CPU box leaves it off: nothing is taken there anyway)."""
    monkeypatch.setattr(eager_graphs, "ENABLED", True)
    monkeypatch.setattr(eager_graphs, "_graphs", {})
    monkeypatch.setattr(eager_graphs, "_pools", {})
    monkeypatch.setattr(eager_graphs, "IN_PLACE", False)  # the copies, whatever MOELAB_EAGER_GRAPHS_IN_PLACE says
    monkeypatch.setattr(eager_graphs, "_sightings", {})
    monkeypatch.setattr(eager_graphs, "_repeats", set())
    monkeypatch.setattr(eager_graphs, "_in_place", {})
    monkeypatch.setattr(eager_graphs, "_evictions", {})
    monkeypatch.setattr(eager_graphs, "_plain", {})
    yield eager_graphs._graphs
    eager_graphs._graphs.clear()  # freed now, not by a later collection (a failed test's traceback holds the dict)


def _inputs(seed, T=T, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16().to(device)
    ids = random_topk_ids(T, K, E, generator=g, device=device)
    w = random_weights(T, K, generator=g, device=device)
    return x, ids, w


def _weights(seed, device="cuda"):
    torch.manual_seed(seed)
    w13, w2 = random_experts(E, H, I, torch.bfloat16, device=device)
    return w13, w2, moelab.prepare_weights(w13, w2, backend="triton")


def _reference(x, ids, w, w13, w2, packed=True):
    w = reference.bf16_round(w) if packed else w  # packed words carry bf16(w)
    return reference.routed_moe(ids, w, x, w13, w2)["output"]


def _moe(topk, x, W, **options):
    """``moelab.routed_moe``'s output on this file's E and K."""
    return moelab.routed_moe(topk, x, W, num_experts=E, top_k=K, validate=False, **options)[0]


def _call(x, ids, w, W):
    return RoutedMoECall((ids, w), None, x, W, E, K, 0, None, True, None)


def test_nothing_is_replayed_on_a_cpu(graphs):
    x, ids, w = _inputs(0, device="cpu")
    w13, w2 = random_experts(E, H, I, torch.bfloat16)
    W = moelab.prepare_weights(w13, w2, backend="torch")
    assert not eager_graphs.takes(_call(x, ids, w, W), lambda c: (0, 4))


@pytest.mark.parametrize("T,K,E,E_local", [(1, 8, 128, 128), (8, 8, 64, 64), (32, 6, 64, 16), (3, 2, 8, 8)])
def test_expected_touched_experts_is_the_mean_over_random_routings(T, K, E, E_local):
    """The estimate the byte rule reads, against the mean count of distinct local experts over random routings."""
    g = torch.Generator().manual_seed(T * K + E)
    trials = 4000
    ids = torch.rand(trials, T, E, generator=g).argsort(dim=2)[:, :, :K].reshape(trials, -1)  # K distinct a token
    hit = torch.zeros(trials, E).scatter_(1, ids, 1.0)
    touched = hit[:, :E_local].sum(dim=1)  # the local experts are the first E_local (where they sit: same count)
    expected = eager_graphs.expected_touched_experts(T, K, E, E_local)
    assert abs(touched.mean().item() - expected) <= 0.02 * expected, (touched.mean(), expected)


@needs_cuda
def test_taken_up_to_max_tokens_and_max_bytes_of_touched_experts(graphs):
    _, _, W = _weights(0)
    x, ids, w = _inputs(0)
    touched = eager_graphs.expected_touched_experts(T, K, E, E)
    for launches in (2, 4):
        most = int(launches * eager_graphs.MAX_BYTES_PER_LAUNCH // touched)  # one expert's bytes at the bound
        assert eager_graphs.takes(_call(x, ids, w, W), lambda c, cost=(most, launches): cost)
        assert not eager_graphs.takes(_call(x, ids, w, W), lambda c, cost=(most + 1, launches): cost)
    x, ids, w = _inputs(0, T=eager_graphs.MAX_TOKENS + 1)
    assert not eager_graphs.takes(_call(x, ids, w, W), lambda c: (1, 4))


def test_the_backend_weighs_its_eager_launches():
    """The triton backend hands ``takes`` 2 launches where the eager call would run the token-major path, else 4."""
    device = "cuda" if CUDA else "cpu"  # the triton backend's weights live where its kernels run
    _, _, W = _weights(0, device=device)
    for T_, expect in [(1, 2), (T, 4)]:  # one token: token-major; 4 tokens x 2 of 8 experts share them: tiled
        x, ids, w = _inputs(0, T=T_, device=device)
        expert_bytes, launches = triton_backend._eager_cost(_call(x, ids, w, W))
        assert expert_bytes == (2 * I * H + H * I) * 2 and launches == expect, (T_, launches)


@needs_cuda
@pytest.mark.parametrize("routing", ["packed", "tuple"])
def test_replays_match_the_reference_with_fresh_inputs_and_write_every_element(graphs, routing):
    w13, w2, W = _weights(0)
    outs = []
    for seed in range(4):  # the first call captures, the others replay
        x, ids, w = _inputs(seed)
        if routing == "packed":
            topk = moelab.pack_topk_ids_weights(ids, w)
        else:
            topk = (ids.long(), w)  # int64 ids: the graph's int32 buffer takes them as the pipeline would
        if graphs:
            poison(next(iter(graphs.values())).out)  # the replay must write every element of its output
        out = _moe(topk, x, W)
        assert len(graphs) == 1
        assert_close_to_reference(out, _reference(x, ids, w, w13, w2, routing == "packed"), torch.bfloat16,
                                  f"call {seed}")
        outs.append((out, out.clone(), x, ids, w))
    for out, kept, *_ in outs:  # every call got a tensor of its own: later replays left it alone
        assert torch.equal(out, kept)
        assert out.data_ptr() != next(iter(graphs.values())).out.data_ptr()


@needs_cuda
def test_the_first_call_computes_the_bits_of_every_later_one(graphs):
    _, _, W = _weights(0)
    x, ids, w = _inputs(1)
    packed = moelab.pack_topk_ids_weights(ids, w)
    first = _moe(packed, x, W)
    again = _moe(packed, x, W)
    assert torch.equal(first, again)


@needs_cuda
def test_output_argument_is_written_in_place(graphs):
    w13, w2, W = _weights(0)
    for seed in range(2):
        x, ids, w = _inputs(seed)
        out = poison(torch.empty_like(x))
        got = _moe(moelab.pack_topk_ids_weights(ids, w), x, W, output=out)
        assert got is out
        assert_close_to_reference(out, _reference(x, ids, w, w13, w2), torch.bfloat16, f"call {seed}")


@needs_cuda
def test_each_weights_and_each_size_get_their_own_graph_and_in_place_updates_are_read(graphs):
    a13, a2, A = _weights(0)
    b13, b2, B = _weights(1)
    for n_tokens, (w13, w2, W) in [(4, (a13, a2, A)), (4, (b13, b2, B)), (1, (a13, a2, A)), (4, (a13, a2, A))]:
        x, ids, w = _inputs(n_tokens, T=n_tokens)
        out = _moe(moelab.pack_topk_ids_weights(ids, w), x, W)
        assert_close_to_reference(out, _reference(x, ids, w, w13, w2), torch.bfloat16, f"T={n_tokens}")
    assert len(graphs) == 3
    a13.mul_(-0.5)  # the graph reads the weights where they live: an update in place is read
    x, ids, w = _inputs(9)
    out = _moe(moelab.pack_topk_ids_weights(ids, w), x, A)
    assert_close_to_reference(out, _reference(x, ids, w, a13, a2), torch.bfloat16, "updated weights")
    assert len(graphs) == 3


@needs_cuda
def test_a_side_stream_gets_its_own_graph(graphs):
    w13, w2, W = _weights(0)
    x, ids, w = _inputs(0)
    packed = moelab.pack_topk_ids_weights(ids, w)
    main = _moe(packed, x, W)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = _moe(packed, x, W)
    torch.cuda.current_stream().wait_stream(side)
    assert len(graphs) == 2
    assert torch.equal(main, on_side)


@needs_cuda
def test_not_taken_above_max_tokens_while_capturing_or_off(graphs, monkeypatch):
    w13, w2, W = _weights(0)
    x, ids, w = _inputs(0, T=eager_graphs.MAX_TOKENS + 1)
    out = _moe((ids, w), x, W)
    assert_close_to_reference(out, _reference(x, ids, w, w13, w2, packed=False), torch.bfloat16, "T > MAX_TOKENS")
    x, ids, w = _inputs(0)
    packed = moelab.pack_topk_ids_weights(ids, w)
    _moe(packed, x, W)  # compiles the eager kernels
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the caller's own capture holds the kernels, not a replay of another graph
        captured = _moe(packed, x, W)
    assert len(graphs) == 1
    poison(captured)
    graph.replay()
    assert_close_to_reference(captured, _reference(x, ids, w, w13, w2), torch.bfloat16, "caller's graph")
    monkeypatch.setattr(eager_graphs, "ENABLED", False)
    x, ids, w = _inputs(1, T=2)
    out = _moe((ids, w), x, W)
    assert len(graphs) == 1
    assert_close_to_reference(out, _reference(x, ids, w, w13, w2, packed=False), torch.bfloat16, "off")


@needs_cuda
def test_the_oldest_graph_goes_past_max_graphs(graphs, monkeypatch):
    monkeypatch.setattr(eager_graphs, "MAX_GRAPHS", 2)
    w13, w2, W = _weights(0)
    for n_tokens in (1, 2, 3, 1):
        x, ids, w = _inputs(n_tokens, T=n_tokens)
        out = _moe((ids, w), x, W)
        assert_close_to_reference(out, _reference(x, ids, w, w13, w2, packed=False), torch.bfloat16, f"T={n_tokens}")
    assert [key[1][0] for key in graphs] == [3, 1]  # T = 2 went, then the first T = 1 (re-captured last)


@needs_cuda
def test_backend_keeps_the_launches_for_a_forced_tile_config(graphs):
    _, _, W = _weights(0)
    x, ids, w = _inputs(0)
    from moelab.kernels.moe_gemm import choose_config

    triton_backend.routed_moe(_call(x, ids, w, W), config=choose_config(T, K, E, x.dtype))
    assert not graphs


# ------------------------------------------------------------------------------------- LoRAExperts calls replayed

def _lora_module(fused, ranks=(16, 8), seed=0, device="cuda"):
    """A LoRAExperts of this file's sizes with a bank of adapters of ``ranks`` (max rank 16), and its weights."""
    from test_experts import make_bank, random_adapters

    torch.manual_seed(seed)
    w13, w2 = random_experts(E, H, I, torch.bfloat16, device=device)
    bank = make_bank(random_adapters(len(ranks), E, H, I, list(ranks), seed=seed), E, 0, H, I, 16, torch.bfloat16,
                     device)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton", fused=fused)
    return experts, w13, w2, bank


def _lora_inputs(seed, T, L, device="cuda"):
    """Fresh x, weights, ids and adapter ids: adapter ``seed % L`` on the first token, then every adapter and -1
    in turn."""
    x, ids, w = _inputs(seed, T=T, device=device)
    return x, w, ids, ((torch.arange(T) + seed % L + 1) % (L + 1) - 1).to(device)


def _lora_call(experts, x, w, ids, lora_ids):
    return experts(x, w, ids, lora_ids, has_lora=lora_ids is not None, validate=False)


def _backend_call(experts, bank, x, w, ids, lora_ids, out=None):
    """The :class:`LoRAExpertsCall` ``experts`` hands its backend for these inputs (``lora_ids`` None: a batch
    without adapters; the module's bank stays), writing ``out`` (default: a new one)."""
    return LoRAExpertsCall(x, ids, w, experts.weights, E, K, 0, torch.empty_like(x) if out is None else out,
                           None if lora_ids is None else bank, lora_ids, experts.fused, experts._path, bank)


def _cpu_call(T_, fused):
    """A LoRAExpertsCall of ``T_`` tokens on CPU tensors, torch-backend weights and a two-slot bank."""
    w13, w2 = random_experts(E, H, I, torch.bfloat16)
    bank = moelab.LoRABank(2, E, H, I, 16)
    x, w, ids, lora_ids = _lora_inputs(0, T_, bank.max_loras, device="cpu")
    W = moelab.prepare_weights(w13, w2, backend="torch")  # a GPU box runs no triton kernels on CPU tensors
    return LoRAExpertsCall(x, ids, w, W, E, K, 0, torch.empty_like(x), bank, lora_ids, fused, None, bank)


#: 5 slots of rank 16 -> L_PAD 8 x R_PAD 16 = 128 stacked columns, past the fused tiles' 64: the adapter loop at
#: decode, vLLM's flow past its crossover.
WIDE = (16,) * 5


@needs_cuda
@pytest.mark.parametrize("fused, ranks, T_", [
    (None, (16, 8), 1), (None, (16, 8), T), ("decode", (16, 8), T), ("tiles", (16, 8), T),
    ("adapter-loop", (16, 8), T), ("token-major", (16, 8), 1), ("token-major", (16, 8), T), (False, (16, 8), T),
    (None, WIDE, 1), (None, WIDE, 8)])  # T = 8 > 5 adapters + none: tokens without one too
def test_lora_replays_match_the_reference_and_keep_base_rows_bit_for_bit(graphs, fused, ranks, T_):
    """Each path a LoRAExperts call can take, replayed with fresh inputs against the float64 reference, every
    element of the graph's output written; tokens without an adapter equal the replayed base call's rows."""
    experts, w13, w2, bank = _lora_module(fused, ranks)
    for seed in range(3):  # the first call of each key captures, the others replay
        x, w, ids, lora_ids = _lora_inputs(seed, T_, bank.max_loras)
        for entry in graphs.values():
            poison(entry.out)
        out = _lora_call(experts, x, w, ids, lora_ids)
        base = _lora_call(experts, x, w, ids, None)
        assert len(graphs) == 2  # the call with adapters and the base call: one graph each
        ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)
        assert ref["lora"].norm() > 0.3 * ref["base"].norm(), "the adapters must matter for this test"
        assert_close_to_reference(out, ref["output"], torch.bfloat16, f"seed {seed} output")
        assert_close_to_reference(base, ref["base"], torch.bfloat16, f"seed {seed} base")
        none = lora_ids < 0
        assert none.any() == (T_ > 1) and torch.equal(out[none], base[none])


@needs_cuda
@pytest.mark.parametrize("fused, T_", [(None, T), (None, 1), ("adapter-loop", T), ("token-major", 1), (False, T)])
@pytest.mark.parametrize("how", ["set", "ranks"])
def test_lora_replays_read_a_bank_slot_set_in_place_and_its_new_rank(graphs, fused, T_, how):
    """Slot 1 goes from rank 8 to 16 after the capture, by ``bank.set`` (in place, table included) or by writing
    its tensors and assigning ``bank.ranks`` (as ``LoRABank.load`` and expert-parallel rebalancing do): the replay
    reads all 16 columns (a stale rank table would read 8 and miss the reference)."""
    experts, w13, w2, bank = _lora_module(fused)
    x, w, ids, lora_ids = _lora_inputs(0, T_, bank.max_loras)
    lora_ids.fill_(1)
    _lora_call(experts, x, w, ids, lora_ids)
    from test_experts import random_adapters

    new = {k: v.to(torch.bfloat16).cuda() for k, v in random_adapters(1, E, H, I, [16], seed=7)[0].items()}
    if how == "set":
        bank.set(1, scaling=0.5, **new)
    else:
        for name, value in new.items():
            getattr(bank, name)[1].copy_(value * (0.5 if name.endswith("_b") else 1.0))
        bank.ranks = [16, 16]
    out = _lora_call(experts, x, w, ids, lora_ids)
    assert len(graphs) == 1
    ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)
    assert ref["lora"].norm() > 0.3 * ref["base"].norm(), "the new adapter must matter for this test"
    assert_close_to_reference(out, ref["output"], torch.bfloat16, f"after bank.{how}")


@needs_cuda
def test_modules_sharing_weights_with_other_banks_or_paths_get_graphs_of_their_own(graphs):
    """Three LoRAExperts on the same w13/w2: two banks, and the first bank unfused; each call its own graph and
    its own bank's result, and the first module's replay stays bit for bit its capture's."""
    first, w13, w2, bank = _lora_module(None)
    _, _, _, other = _lora_module(None, ranks=(8, 16), seed=1)
    second = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=other, backend="triton")
    unfused = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton", fused=False)
    x, w, ids, lora_ids = _lora_inputs(0, T, bank.max_loras)
    outs = [_lora_call(m, x, w, ids, lora_ids) for m in (first, second, unfused)]
    assert len(graphs) == 3
    for out, b, what in zip(outs, (bank, other, bank), ("first", "second", "unfused")):
        ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, b)["output"]
        assert_close_to_reference(out, ref, torch.bfloat16, what)
    assert not torch.equal(outs[0], outs[1])
    assert torch.equal(_lora_call(first, x, w, ids, lora_ids), outs[0]) and len(graphs) == 3


@needs_cuda
def test_lora_calls_keep_their_launches_above_max_lora_tokens_and_under_a_callers_capture(graphs, monkeypatch):
    monkeypatch.setattr(eager_graphs, "MAX_LORA_TOKENS", eager_graphs.MAX_TOKENS + 8)  # small tensors, same rule
    experts, w13, w2, bank = _lora_module(None)
    x, w, ids, lora_ids = _lora_inputs(0, eager_graphs.MAX_LORA_TOKENS + 1, bank.max_loras)
    for _ in range(3):
        out = _lora_call(experts, x, w, ids, lora_ids)
    assert not graphs and not eager_graphs._in_place
    assert_close_to_reference(out, reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)["output"],
                              torch.bfloat16, "T > MAX_LORA_TOKENS")
    x, w, ids, lora_ids = _lora_inputs(1, T, bank.max_loras)
    _lora_call(experts, x, w, ids, lora_ids)  # compiles the kernels (and captures one replay graph)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _lora_call(experts, x, w, ids, lora_ids)
    assert len(graphs) == 1
    poison(captured)
    graph.replay()
    assert_close_to_reference(captured, reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)["output"],
                              torch.bfloat16, "caller's graph")


@needs_cuda
@pytest.mark.parametrize("fused, ranks", [(False, (16, 8)), (None, (16, 8)), (None, WIDE)])
def test_lora_calls_past_max_tokens_replay_from_their_keys_second_call(graphs, fused, ranks):
    """Past ``MAX_TOKENS``: the first call of a key runs its launches (no graph), the second captures, the later
    ones replay; each with fresh inputs against the float64 reference, every element written (the graph's output
    poisoned before each call), and a replay of the first call's inputs gives the launches' bits (vLLM's flow and
    the fused tiles' GEMMs; the fused W2 shrink sums with fp32 atomics, so there the last bit may differ)."""
    experts, w13, w2, bank = _lora_module(fused, ranks)
    T_ = eager_graphs.MAX_TOKENS + 1
    first = None
    for seed in range(4):
        x, w, ids, lora_ids = _lora_inputs(seed, T_, bank.max_loras)
        for entry in graphs.values():
            poison(entry.out)
        out = _lora_call(experts, x, w, ids, lora_ids)
        assert len(graphs) == (seed > 0), seed  # no graph after the first call; one from the second on
        ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)
        assert ref["lora"].norm() > 0.3 * ref["base"].norm(), "the adapters must matter for this test"
        assert_close_to_reference(out, ref["output"], torch.bfloat16, f"seed {seed}")
        first = first or (x, w, ids, lora_ids, out)
    x, w, ids, lora_ids, launched = first
    replayed = _lora_call(experts, x, w, ids, lora_ids)
    if fused is False:
        assert torch.equal(replayed, launched)
    else:
        assert_close_to_reference(replayed, launched.double(), torch.bfloat16, "replay of the first call")


def _lora_key(T_, name="a"):
    """A stand-in for ``eager_graphs.lora_key``: what the rule reads of it (the tag and x's shape) and a name."""
    return ("lora", 0, torch.Size([T_, H]), name)


@needs_cuda
def test_lora_calls_past_max_tokens_at_the_same_addresses_capture_the_in_place_graph_alone(graphs, monkeypatch):
    """With in-place replays on: a key's first call past ``MAX_TOKENS`` runs its launches, the second at the same
    addresses captures the in-place graph (no copy graph, no buffers of its own), the third replays it; every output
    poisoned first, the launches' bits each time (vLLM's flow), against the float64 reference."""
    monkeypatch.setattr(eager_graphs, "IN_PLACE", True)
    experts, w13, w2, bank = _lora_module(False)
    x, w, ids, lora_ids = _lora_inputs(0, eager_graphs.MAX_TOKENS + 1, bank.max_loras)
    out = torch.empty_like(x)
    call = _backend_call(experts, bank, x, w, ids, lora_ids, out)
    ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)["output"]
    launched = None
    for n in range(3):
        poison(out)
        assert triton_backend.lora_experts(call) is out
        assert_close_to_reference(out, ref, torch.bfloat16, f"call {n}")
        launched = out.clone() if launched is None else launched
        assert torch.equal(out, launched), n
        assert not graphs and sum(map(len, eager_graphs._in_place.values())) == (n > 0), n


def test_a_lora_key_past_max_tokens_replays_from_its_second_call(graphs):
    """The rule alone, on any machine: a key seen once replays at its next call; one with a graph always; a key is
    forgotten by ``clear``."""
    T_ = eager_graphs.MAX_TOKENS + 1
    assert not eager_graphs._came_back(_lora_key(T_, "a"))
    assert not eager_graphs._came_back(_lora_key(T_, "b"))
    assert eager_graphs._came_back(_lora_key(T_, "a"))  # its second call: captures
    graphs[_lora_key(T_, "a")] = None
    assert eager_graphs._came_back(_lora_key(T_, "a")) and eager_graphs._came_back(_lora_key(T_, "a"))
    eager_graphs.clear()
    assert not eager_graphs._came_back(_lora_key(T_, "a"))


def test_no_new_lora_key_past_max_tokens_captures_beyond_the_budgets(graphs, monkeypatch):
    """Keys past ``MAX_TOKENS`` that hold graphs (copy or in-place, counted once) count against
    ``MAX_LORA_GRAPH_TOKENS`` and ``MAX_LORA_GRAPH_KEYS``; a new key past either keeps its launches, asked again at
    each call; base keys and keys of at most ``MAX_TOKENS`` do not count."""
    small = eager_graphs.MAX_TOKENS
    monkeypatch.setattr(eager_graphs, "MAX_LORA_GRAPH_TOKENS", 100)
    graphs[_lora_key(60, "held")] = None
    eager_graphs._in_place[_lora_key(60, "held")] = {}  # a key with both kinds of graph counts once
    graphs[_lora_key(small, "small")] = None
    graphs[(0, torch.Size([500, H]), "base")] = None
    eager_graphs._in_place[_lora_key(small, "small in place")] = {}
    for _ in range(3):
        assert not eager_graphs._came_back(_lora_key(41, "over"))  # 60 + 41 > 100
    assert not eager_graphs._came_back(_lora_key(40, "fits"))
    assert eager_graphs._came_back(_lora_key(40, "fits"))  # 60 + 40 = 100
    graphs[_lora_key(40, "fits")] = None
    assert eager_graphs._came_back(_lora_key(60, "held"))  # a key that holds its graph keeps replaying
    eager_graphs._in_place[_lora_key(33, "in place")] = {}
    assert sorted(map(eager_graphs._tokens, eager_graphs._large_keys_held())) == [33, 40, 60]
    monkeypatch.setattr(eager_graphs, "MAX_LORA_GRAPH_TOKENS", 10**6)
    monkeypatch.setattr(eager_graphs, "MAX_LORA_GRAPH_KEYS", 4)
    assert eager_graphs._came_back(_lora_key(41, "over"))  # seen before, 3 keys held: it fits now
    graphs[_lora_key(41, "over")] = None  # (its capture)
    for _ in range(3):
        assert not eager_graphs._came_back(_lora_key(50, "fifth"))  # 4 keys held


def test_past_max_tokens_no_path_rule_reads_a_capture():
    """The claim the replays past ``MAX_TOKENS`` rest on: the token-major kernels (the only path a capture picks
    differently) never take more than ``MAX_TOKENS`` tokens, whether a graph is captured or not."""
    T_ = eager_graphs.MAX_TOKENS + 1
    for capturing in (False, True):
        for lora in (False, True):
            for K_ in (1, 2, 8):
                assert not triton_backend.takes_token_major(T_, K_, True, False, capturing, num_local_experts=None,
                                                            expert_bytes=2**30, lora=lora)


def test_the_stand_in_keys_are_laid_out_as_lora_keys():
    """Its tag first, x's shape third: what the budget reads of a key."""
    key = eager_graphs.lora_key(_cpu_call(41, False), types.SimpleNamespace(cuda_stream=0))
    assert key[0] == "lora" and eager_graphs._tokens(key) == 41


def test_the_backend_weighs_a_lora_calls_eager_launches():
    """The token-major path's two launches, as the base call's (its W13 shrink runs in GEMM1's grid); the fused
    tiles count the base call's four in their decode mode, ``TILES_LAUNCHES`` past it (four where forced),
    vLLM's flow its own (forced, or a wide bank past the adapter loop's crossover). A batch without adapters
    counts as one with them, so both replay or both launch (and its rows stay bit for bit theirs)."""
    device = "cuda" if CUDA else "cpu"
    flow, tiles = triton_backend.FLOW_LAUNCHES, triton_backend.TILES_LAUNCHES
    wide = (16,) * 5  # 5 slots -> L_PAD 8, x R_PAD 16: 128 stacked columns
    big = triton_backend.FUSED_DECODE_MAX_SLOTS // K + 1  # past the decode mode: the tiles mode's launches
    for fused, ranks, T_, lora, expect in [(None, (16, 8), 1, True, 2), (None, (16, 8), 1, False, 2),
                                           (False, (16, 8), 1, True, flow), (False, (16, 8), 1, False, flow),
                                           (None, (16, 8), T, True, 4), ("token-major", (16, 8), T, True, 2),
                                           (None, wide, T, True, flow), (None, wide, T, False, flow),
                                           ("adapter-loop", wide, T, True, 4), (None, (16, 8), big, True, tiles),
                                           (None, (16, 8), big, False, tiles), ("tiles", (16, 8), big, True, 4)]:
        experts, *_, bank = _lora_module(fused, ranks, device=device)
        x, w, ids, lora_ids = _lora_inputs(0, T_, bank.max_loras, device=device)
        call = _backend_call(experts, bank, x, w, ids, lora_ids if lora else None)
        expert_bytes, launches = triton_backend._lora_eager_cost(call)
        assert expert_bytes == (2 * I * H + H * I) * 2 and launches == expect, (fused, ranks, T_, lora, launches)


@pytest.mark.parametrize("fused, ranks, T_, gluon_loop", [(None, (16, 8), T, False), (None, (16, 8), "big", False),
                                                        (False, (16, 8), T, False),
                                                        (None, (16,) * 5, "big", True)])
def test_a_lora_calls_counted_launches_are_the_launches_it_runs(fused, ranks, T_, gluon_loop, monkeypatch):
    """``_lora_eager_cost``'s count against the Triton launches the call's path runs (interpreted on a CPU,
    compiled on a GPU): the fused decode mode, the tiles mode past it, vLLM's flow, and a wide bank's adapter loop
    in tiles (where the module takes it on the Gluon GEMMs: ``gluon_loop`` says it would, whatever the machine)."""
    if gluon_loop:
        monkeypatch.setattr(triton_backend, "_gluon_adapter_loop", lambda call, bank: True)
    from moelab.kernels.interpret import ScopedInterpretedFunction
    from moelab.kernels.launch import CachedLaunchJIT

    launched = []

    def counting(entry):
        def launch(self, *args, **kwargs):
            launched.append(self)
            return entry(self, *args, **kwargs)
        return launch

    hooks = [(ScopedInterpretedFunction, "run"), (CachedLaunchJIT, "_launch")]
    if gluon_gemm.gluon is not None:  # the Gluon GEMMs (sm_90, 128-row tiles) launch through their own class
        from triton.experimental.gluon._runtime import GluonJITFunction
        hooks.append((GluonJITFunction, "run"))
    for cls, name in hooks:
        monkeypatch.setattr(cls, name, counting(getattr(cls, name)))
    device = "cuda" if CUDA else "cpu"
    T_ = triton_backend.FUSED_DECODE_MAX_SLOTS // K + 1 if T_ == "big" else T_
    experts, *_, bank = _lora_module(fused, ranks, device=device)
    x, w, ids, lora_ids = _lora_inputs(0, T_, bank.max_loras, device=device)
    call = _backend_call(experts, bank, x, w, ids, lora_ids)
    triton_backend._lora_experts_launches(call)
    counted = triton_backend._lora_eager_cost(call)[1]
    assert len(launched) == counted, (fused, T_, [f.fn.__name__ for f in launched])


def test_no_lora_call_is_replayed_on_a_cpu(graphs):
    assert not eager_graphs.takes_lora(_cpu_call(1, True), lambda c: (0, 4))


# ------------------------------------------------------------------------------------- in-place replays

class _FakeGraph:
    """A stand-in CUDA graph on the CPU: its replay runs the captured launches again on the captured tensors."""

    def __init__(self, run):
        self.run, self.replays = run, 0

    def replay(self):
        self.replays += 1
        self.run()


@pytest.fixture
def fake_graphs(graphs, monkeypatch):
    """eager_graphs' replay policy on the CPU: ``_capture`` records launches of ``out = x * scale`` (``scale``
    int32: the buffers' dtype) on the tensors it is given, and counts them."""
    monkeypatch.setattr(eager_graphs, "IN_PLACE", True)
    captured = []

    def fake_capture(static, stream, launches, out=None):
        result = launches(*static, out=out)
        captured.append(static)
        return eager_graphs._Entry(_FakeGraph(lambda: launches(*static, out=result)), static, result)

    monkeypatch.setattr(eager_graphs, "_capture", fake_capture)
    return captured


def _scale(x, scale, out=None):
    out = torch.empty_like(x) if out is None else out
    return torch.mul(x, scale, out=out)


def _fake_replay(x, scale, output=None, key=("k",)):
    return eager_graphs._replay(key, None, (x, scale), (x.dtype, torch.int32), _scale, output, x.shape)


def _placed(key=("k",)):
    """The in-place graphs of ``key``: (input addresses..., output address) -> entry, least recently replayed
    first."""
    return eager_graphs._in_place.get(key, {})


def test_in_place_replays_start_once_the_addresses_came_back(fake_graphs):
    x, scale, out = torch.randn(4, 8), torch.full((4, 1), 3, dtype=torch.int32), torch.empty(4, 8)
    for call in range(5):  # call 0: the copy graph; call 1: the same addresses again, an in-place graph
        x.normal_()
        got = _fake_replay(x, scale, out)
        assert got is out and torch.equal(out, x * 3), call
        assert len(fake_graphs) == min(call + 1, 2)
    assert fake_graphs[1][0] is x  # the in-place graph read the caller's x itself
    (addresses, entry), = _placed().items()
    assert addresses == (x.data_ptr(), scale.data_ptr(), out.data_ptr())
    assert entry.inputs == () and entry.out is None and entry.graph.replays == 4
    assert eager_graphs.held() == 2
    other = torch.empty(4, 8)  # another output: counted anew, served by the copy graph meanwhile
    assert torch.equal(_fake_replay(x, scale, other), x * 3) and len(fake_graphs) == 2
    view = x.view(2, 16).view(4, 8)  # another tensor at x's address: the graph reads it there, as it should
    assert view is not x and torch.equal(_fake_replay(view, scale, out), x * 3) and entry.graph.replays == 5


def test_a_call_that_may_not_capture_runs_its_launches_and_counts_its_addresses(fake_graphs):
    """``capture=False`` (a LoRA key's first call past ``MAX_TOKENS``, or one past the budgets): the launches run on
    the caller's tensors and no graph is captured, but the addresses count, so the next call at the same addresses
    captures the in-place graph alone (no copy graph); a held graph replays whatever ``capture`` says."""
    x, scale, out = torch.randn(4, 8), torch.full((4, 1), 3, dtype=torch.int32), torch.empty(4, 8)
    for _ in range(2):  # the addresses count past IN_PLACE_AFTER, still no graph
        x.normal_()
        got = eager_graphs._replay(("k",), None, (x, scale), (x.dtype, torch.int32), _scale, out, x.shape, False)
        assert got is out and torch.equal(out, x * 3)
        assert not fake_graphs and not eager_graphs._graphs and not _placed()
    x.normal_()
    out.fill_(float("nan"))
    assert _fake_replay(x, scale, out) is out and torch.equal(out, x * 3)
    assert len(fake_graphs) == 1 and fake_graphs[0][0] is x and not eager_graphs._graphs  # in place, no copies
    (entry,) = _placed().values()
    x.normal_()
    out.fill_(float("nan"))
    got = eager_graphs._replay(("k",), None, (x, scale), (x.dtype, torch.int32), _scale, out, x.shape, False)
    assert got is out and torch.equal(out, x * 3) and entry.graph.replays == 2 and len(fake_graphs) == 1
    other = torch.empty(4, 8)  # other addresses, no capture: the launches again, into the caller's output
    got = eager_graphs._replay(("k",), None, (x, scale), (x.dtype, torch.int32), _scale, other, x.shape, False)
    assert got is other and torch.equal(other, x * 3) and len(fake_graphs) == 1 and not eager_graphs._graphs


def test_inputs_unlike_the_buffers_keep_the_copies(fake_graphs):
    scale = torch.full((4, 1), 2, dtype=torch.int32)
    strided = torch.randn(8, 4).t()
    misaligned = torch.randn(33)[1:].view(4, 8)
    cases = {"strided": (strided, scale, torch.empty(4, 8)), "int64 scale": (strided.contiguous(), scale.long(),
             torch.empty(4, 8)), "misaligned": (misaligned, scale, torch.empty(4, 8)),
             "output dtype": (strided.contiguous(), scale, torch.empty(4, 8, dtype=torch.float64))}
    for name, (x, s_, out) in cases.items():
        for _ in range(4):
            assert torch.equal(_fake_replay(x, s_, out, key=(name,)), (x * s_).to(out.dtype)), name
    assert len(fake_graphs) == len(cases) and not eager_graphs._in_place  # one copy graph each, never in place


def test_a_size_one_dimensions_stride_is_read_through_packed_strides(fake_graphs):
    """A one-token batch's top-k ids are a (1, K) slice of a (1, E) tensor: contiguous, stride (E, 1). Never stepped
    along, that stride would only make Triton specialise apart from the buffers; the in-place graph reads the same
    memory through a (K, 1) view."""
    wide = torch.randn(1, 32)
    x, scale, out = wide[:, :8], torch.full((1, 1), 3, dtype=torch.int32), torch.empty(1, 8)
    assert x.stride() == (32, 1) and x.is_contiguous()
    for _ in range(3):
        wide.normal_()
        assert torch.equal(_fake_replay(x, scale, out), x * 3)
    static_x = fake_graphs[1][0]
    assert static_x.stride() == (8, 1) and static_x.data_ptr() == x.data_ptr() and len(_placed()) == 1


def test_in_place_graphs_per_key_go_least_recently_replayed_first(fake_graphs, monkeypatch):
    x, scale = torch.randn(2, 8), torch.full((2, 1), 5, dtype=torch.int32)
    bound = eager_graphs.MAX_IN_PLACE_PER_KEY
    outs = [torch.empty(2, 8) for _ in range(bound + 1)]
    for out in outs[:bound] * 2:
        assert torch.equal(_fake_replay(x, scale, out), x * 5)
    assert len(fake_graphs) == 1 + bound and len(_placed()) == bound
    _fake_replay(x, scale, outs[0])  # outs[0]'s graph is now the most recently replayed, outs[1]'s the least
    for _ in range(2):  # a new address set: its second call replaces outs[1]'s graph
        assert torch.equal(_fake_replay(x, scale, outs[bound]), x * 5)
    held = [a[-1] for a in _placed()]  # the outputs' addresses
    assert len(held) == bound and outs[1].data_ptr() not in held and held[-1] == outs[bound].data_ptr()
    monkeypatch.setattr(eager_graphs, "MAX_IN_PLACE_GRAPHS", bound)
    y, y_out = torch.randn(2, 8), torch.empty(2, 8)
    for _ in range(2):  # another key's graph makes the budget: the least recently replayed key gives up its graphs
        assert torch.equal(_fake_replay(y, scale, y_out, key=("other",)), y * 5)
    assert list(eager_graphs._in_place) == [("other",)]


def test_a_call_site_whose_addresses_rotate_stops_capturing(fake_graphs):
    """Outputs rotating through one more address set than a key holds: each set's graph would go before its set came
    back, so every call would capture. Past ``MAX_IN_PLACE_EVICTIONS`` the key captures no more and its calls keep
    the copy graph, still right."""
    x, scale = torch.randn(2, 8), torch.full((2, 1), 7, dtype=torch.int32)
    outs = [torch.empty(2, 8) for _ in range(eager_graphs.MAX_IN_PLACE_PER_KEY + 1)]
    for step in range(200):
        x.normal_()
        assert torch.equal(_fake_replay(x, scale, outs[step % len(outs)]), x * 7), step
    # the copy graph, and in-place graphs until the key ran out of evictions
    assert len(fake_graphs) == 1 + eager_graphs.MAX_IN_PLACE_PER_KEY + eager_graphs.MAX_IN_PLACE_EVICTIONS
    assert eager_graphs._evictions[("k",)] == eager_graphs.MAX_IN_PLACE_EVICTIONS


@pytest.mark.parametrize("setting, expected", [(None, "True"), ("1", "True"), ("0", "False")])
def test_in_place_is_on_unless_switched_off(graphs, setting, expected):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MOELAB_EAGER_GRAPHS_IN_PLACE"}
    if setting is not None:
        env["MOELAB_EAGER_GRAPHS_IN_PLACE"] = setting
    got = subprocess.run([sys.executable, "-c", "import moelab.backends.eager_graphs as e; print(e.IN_PLACE)"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert got == expected


@needs_cuda
@pytest.mark.parametrize("lora", [False, True])
def test_in_place_replays_match_the_copies_bit_for_bit_and_hold_no_input(graphs, monkeypatch, lora):
    """A decode loop's call site: the same x, routing (and, for the base call, output) tensors written anew
    before each call, LoRAExperts' own output freed after each. Once the addresses came back ``IN_PLACE_AFTER``
    times the calls replay in place; each output equals the copy graph's bits on the same inputs (I = 32: one
    tile of columns, so no atomics sum in the LoRA W2 shrink) and the float64 reference, and no graph keeps the
    caller's tensors alive."""
    import weakref

    if lora:
        experts, w13, w2, bank = _lora_module(None)
        x, w, ids, lora_ids = _lora_inputs(0, T, bank.max_loras)
    else:
        w13, w2, W = _weights(0)
        x, ids, w = _inputs(0)
        packed, out = moelab.pack_topk_ids_weights(ids, w), torch.empty_like(x)

    def call(x):
        if lora:
            return experts(x, w, ids, lora_ids, has_lora=True, validate=False)
        packed.copy_(moelab.pack_topk_ids_weights(ids, w))
        return _moe(packed, x, W, output=out)

    replayed = []  # one bool a call that reached an in-place replay: by its addresses, or by its signature alone
    in_place, signed = eager_graphs._replay_in_place, eager_graphs._replay_signed
    monkeypatch.setattr(eager_graphs, "_replay_in_place", lambda *a: replayed.append(in_place(*a)) or replayed[-1])

    def replay_signed(*a):
        output = signed(*a)
        if output is not None:  # a None goes on to the checks, and to _replay_in_place
            replayed.append(True)
        return output

    monkeypatch.setattr(eager_graphs, "_replay_signed", replay_signed)
    monkeypatch.setattr(eager_graphs, "IN_PLACE", True)
    fresh = [_inputs(seed, device="cpu") for seed in range(8)]  # on the CPU: no device allocation between calls
    outs = []
    for cpu_x, cpu_ids, cpu_w in fresh:
        x.copy_(cpu_x), ids.copy_(cpu_ids), w.copy_(cpu_w)
        got = call(x)
        outs.append(got.cpu())
        del got  # LoRAExperts' next output may take this one's block, as in a decode loop
    assert sum(replayed) >= len(fresh) - 3, f"in-place replays: {replayed}"
    probe_out = weakref.ref(out) if not lora else None
    monkeypatch.setattr(eager_graphs, "IN_PLACE", False)
    for got, (cpu_x, cpu_ids, cpu_w) in zip(outs, fresh):
        x.copy_(cpu_x), ids.copy_(cpu_ids), w.copy_(cpu_w)
        copied = call(x).cpu()
        assert torch.equal(got, copied), "in place against the copies"
        if lora:
            ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)["output"]
        else:
            ref = _reference(x, ids, w, w13, w2)
        assert_close_to_reference(got.to(x.device), ref, torch.bfloat16, "in place")
    probe = weakref.ref(x)
    del x
    if not lora:
        del out
    assert probe() is None, "a graph keeps the caller's input alive"
    assert probe_out is None or probe_out() is None, "a graph keeps the caller's output alive"


# ------------------------------------------------------------------------------------- plain calls by signature

def _reusing_torch():
    """scripts/reusing_empty.py's ReusingTorch: outputs take the block of the last one freed, as on a GPU."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "reusing_empty.py"
    spec = importlib.util.spec_from_file_location("reusing_empty", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ReusingTorch()


@pytest.fixture(params=["cpu", "cuda"])
def plain_replays(request, graphs, monkeypatch):
    """In-place replays on; on "cpu" the pipeline under the interpreter, replayed by stand-in graphs that run the
    captured launches again on the caller's tensors (every replay check passes there as on a GPU's current
    device); on "cuda" real graphs. Returns the device and the list of calls that took ``validate_call``."""
    device = request.param
    monkeypatch.setattr(eager_graphs, "IN_PLACE", True)
    if device == "cuda" and not CUDA:
        pytest.skip("CUDA-graph replays need a CUDA GPU (runs on the H200)")
    if device == "cpu" and CUDA:  # Triton's interpreter takes CPU tensors only where no GPU is found
        pytest.skip("the CPU stand-in runs where no CUDA GPU is; here the 'cuda' variant replays real graphs")
    if device == "cpu":
        def fake_capture(static, stream, launches, out=None):
            result = launches(*static, out=out)
            # the replay reads and writes the memory through views of its own, as a graph holds no tensor; the
            # launches it keeps (a graph does not) drop the LoRA call's first output they hold (replays pass `out`)
            views, into = [None if t is None else t.view(t.shape) for t in static], result.view(result.shape)
            for cell in launches.__closure__ or ():
                if isinstance(cell.cell_contents, LoRAExpertsCall):
                    cell.cell_contents = dataclasses.replace(cell.cell_contents, output=None)
            return eager_graphs._Entry(_FakeGraph(lambda: launches(*views, out=into)), static, result)

        monkeypatch.setattr(eager_graphs, "_capture", fake_capture)
        monkeypatch.setattr(eager_graphs, "_replayable", lambda x, inputs, max_tokens=None: 0 < x.shape[0] <= (
            eager_graphs.MAX_TOKENS if max_tokens is None else max_tokens))
        monkeypatch.setattr(eager_graphs, "_may_replay", lambda x: eager_graphs.ENABLED)
        stream = types.SimpleNamespace(cuda_stream=0)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
        reusing = _reusing_torch()  # the outputs' allocations: LoRAExperts.forward's and replay_plain's
        monkeypatch.setattr(eager_graphs, "torch", reusing)
        monkeypatch.setattr(experts_module, "torch", reusing)
    checked = []
    validate_call = moe_module.validate_call
    monkeypatch.setattr(moe_module, "validate_call", lambda *a: checked.append(a) or validate_call(*a))
    return device, checked


@pytest.mark.parametrize("routing", ["packed", "tuple"])
def test_a_plain_call_that_replayed_in_place_replays_by_its_signature_alone(plain_replays, routing):
    """A decode loop's plain calls (no output, delta or weight on the input, ``validate=False``): x and the routing
    written anew before each, each output dropped after it. Once a call replayed in place, the next ones at the
    same addresses skip the checks, the key and the count (``validate_call`` not called) and still match the
    float64 reference on fresh inputs (each output takes the block of the one before, so a row left unwritten
    would hold the last step's values)."""
    device, checked = plain_replays
    w13, w2, W = _weights(0, device)
    x, ids, w = _inputs(0, device=device)
    packed = moelab.pack_topk_ids_weights(ids, w)
    fresh = [_inputs(100 + step, device="cpu") for step in range(8)]  # no allocation of x's size in the loop
    outs = []
    for new_x, new_ids, new_w in fresh:
        x.copy_(new_x), ids.copy_(new_ids), w.copy_(new_w)
        packed.copy_(moelab.pack_topk_ids_weights(ids, w))
        got = _moe(packed if routing == "packed" else (ids, w), x, W)  # (ids, weights): what moelab.hf hands over
        outs.append(got.float().cpu())
        del got  # the next call's output may take this one's block, as in a decode loop
    assert len(checked) <= 3, f"{len(checked)} of {len(fresh)} calls took the checks"
    assert eager_graphs._plain, "no plain call was remembered"
    for step, (got, (new_x, new_ids, new_w)) in enumerate(zip(outs, fresh)):
        ref = _reference(new_x.to(device), new_ids.to(device), new_w.to(device), w13, w2, routing == "packed")
        assert_close_to_reference(got.to(device).bfloat16(), ref, torch.bfloat16, f"step {step}")


def _remembered_plain_call(device, seed):
    """Weights (w13, w2, MoEWeights), inputs (x, ids, w) and their packed words of a plain call made four times
    (each output dropped): remembered by now."""
    w13, w2, W = _weights(0, device)
    x, ids, w = _inputs(seed, device=device)
    packed = moelab.pack_topk_ids_weights(ids, w)
    for _ in range(4):
        got = _moe(packed, x, W)
        del got
    return w13, w2, W, x, ids, w, packed


def test_a_plain_call_that_differs_from_a_remembered_one_takes_the_checks(plain_replays):
    """Anything a signature holds that changes sends the call through the checks again: an int of another type
    (a float num_experts: the TypeError it always got), a bad shape (ValueError), new weights in the same ``MoEWeights``
    (read, not the old ones), another ``num_experts``."""
    device, checked = plain_replays
    w13, w2, W, x, ids, w, packed = _remembered_plain_call(device, 1)
    taken = len(checked)
    assert _moe(packed, x, W).shape == x.shape and len(checked) == taken  # remembered: no checks
    with pytest.raises(TypeError, match="num_experts"):  # 8.0 == 8 and hashes as 8: the types tell them apart
        moelab.routed_moe(packed, x, W, num_experts=float(E), top_k=K, validate=False)
    with pytest.raises(ValueError, match="hidden_states"):
        moelab.routed_moe(packed, x[:, :-8], W, num_experts=E, top_k=K, validate=False)
    new13, new2 = random_experts(E, H, I, torch.bfloat16, device=device)
    W.gemm1_weights, W.gemm2_weights = new13, new2
    checked.clear()
    got = _moe(packed, x, W)
    assert checked, "new weights at new addresses skipped the checks"
    assert_close_to_reference(got, _reference(x, ids, w, new13, new2), torch.bfloat16, "new weights")
    checked.clear()
    got = moelab.routed_moe(packed, x, W, num_experts=2 * E, top_k=K, validate=False)[0]
    assert checked, "another num_experts skipped the checks"
    assert_close_to_reference(got, _reference(x, ids, w, new13, new2), torch.bfloat16, "num_experts")


def test_a_plain_call_whose_graph_went_takes_the_checks(plain_replays, monkeypatch):
    """A remembered signature whose in-place graph the budgets (or :func:`clear`) took away: the call goes the
    whole way again (checks, key, count, capture) and still matches the reference."""
    device, checked = plain_replays
    w13, w2, W, x, ids, w, packed = _remembered_plain_call(device, 2)
    assert eager_graphs._plain
    eager_graphs._in_place.clear()
    checked.clear()
    got = _moe(packed, x, W)
    assert checked, "a signature without its graph skipped the checks"
    assert_close_to_reference(got, _reference(x, ids, w, w13, w2), torch.bfloat16, "graph gone")
    eager_graphs.clear()
    assert not eager_graphs._plain


def _checks_taken(monkeypatch):
    """The LoRAExperts calls that took forward's checks (its ``_plain_call_ok``)."""
    taken = []
    plain_ok = moelab.LoRAExperts._plain_call_ok
    monkeypatch.setattr(moelab.LoRAExperts, "_plain_call_ok", lambda self, *a: taken.append(a) or plain_ok(self, *a))
    return taken


def test_a_plain_lora_call_that_replayed_in_place_replays_by_its_signature_alone(plain_replays, monkeypatch):
    """LoRAExperts' decode loop (``validate=False``, adapter ids on the device): once a call replayed in place,
    the next ones skip forward's checks and still match the float64 reference on fresh inputs, a slot set anew in
    the bank (a new rank) included: the replay reads the bank and its rank table where they live."""
    device, _ = plain_replays
    taken = _checks_taken(monkeypatch)
    experts, w13, w2, bank = _lora_module(None, device=device)
    x, w, ids, lora_ids = _lora_inputs(0, T, bank.max_loras, device=device)
    fresh = [_lora_inputs(100 + step, T, bank.max_loras, device="cpu") for step in range(8)]
    outs = []
    for step, (new_x, new_w, new_ids, new_lora_ids) in enumerate(fresh):
        if step == 5:  # slot 1 anew, rank 4: read by the next replays
            from test_experts import random_adapters

            bank.set(1, **{k: v.to(device) for k, v in random_adapters(1, E, H, I, [4], seed=9)[0].items()})
        x.copy_(new_x), w.copy_(new_w), ids.copy_(new_ids), lora_ids.copy_(new_lora_ids)
        got = _lora_call(experts, x, w, ids, lora_ids)
        outs.append(got.float().cpu())
        del got
        if step == 4:
            ref_bank = [(s, r) for s, r in enumerate(bank.ranks)]
            refs_before = [reference.lora_experts(fx.to(device), fw.to(device), fi.to(device), fl.to(device), w13,
                                                  w2, bank)["output"] for fx, fw, fi, fl in fresh[:5]]
    assert len(taken) <= 3, f"{len(taken)} of {len(fresh)} calls took the checks"
    refs_after = [reference.lora_experts(fx.to(device), fw.to(device), fi.to(device), fl.to(device), w13, w2,
                                         bank)["output"] for fx, fw, fi, fl in fresh[5:]]
    assert ref_bank != [(s, r) for s, r in enumerate(bank.ranks)], "the new slot did not change the ranks"
    for step, (got, ref) in enumerate(zip(outs, refs_before + refs_after)):
        assert_close_to_reference(got.to(device).bfloat16(), ref, torch.bfloat16, f"step {step}")


def test_a_plain_lora_call_that_differs_takes_the_checks(plain_replays, monkeypatch):
    """A remembered LoRA call's signature changed: a bank tensor restrided at its own address (the layout check's
    ValueError, not a replay of the old layout), adapter ids read as another dtype at their address (TypeError),
    ``has_lora=False`` (the base call; ids of the wrong length still refused)."""
    device, _ = plain_replays
    taken = _checks_taken(monkeypatch)
    experts, w13, w2, bank = _lora_module(None, device=device)
    x, w, ids, lora_ids = _lora_inputs(3, T, bank.max_loras, device=device)
    for _ in range(4):
        got = _lora_call(experts, x, w, ids, lora_ids)
        del got
    taken.clear()
    got = _lora_call(experts, x, w, ids, lora_ids)
    assert not taken, "a remembered call took the checks"
    assert_close_to_reference(got, reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)["output"],
                              torch.bfloat16, "remembered")
    base = experts(x, w, ids, lora_ids, has_lora=False, validate=False)
    assert taken, "has_lora=False skipped the checks"
    assert_close_to_reference(base, _reference(x, ids, w, w13, w2), torch.bfloat16, "has_lora=False")
    with pytest.raises(TypeError, match="lora_ids"):  # the same bytes read as floats, at the same address
        _lora_call(experts, x, w, ids, lora_ids.view(torch.float32))
    with pytest.raises(ValueError, match="lora_ids"):  # ids the call then drops are checked all the same
        experts(x, w, ids, torch.zeros(T + 1, dtype=torch.int32, device=device), has_lora=False, validate=False)
    del got, base
    for _ in range(3):  # remembered again: no checks
        taken.clear()
        got = _lora_call(experts, x, w, ids, lora_ids)
        del got
    assert not taken, "the remembered call took the checks"
    down_a = bank.down_a
    strides = (*down_a.stride()[:-2], 1, down_a.shape[-2])  # its last two dimensions read column-major
    bank.down_a = down_a.as_strided(down_a.shape, strides)  # at the same address
    with pytest.raises(ValueError, match="down_a"):
        _lora_call(experts, x, w, ids, lora_ids)
    assert taken, "a restrided bank tensor skipped the checks (a real graph would read the old layout)"


def test_strided_packed_routing_never_replays_by_signature(plain_replays):
    """Packed words in a strided view (a [T, K] slice of a wider tensor): the checks hand the graph a contiguous
    copy, whose block the next call's copy may not take, so no signature is left and every call takes the checks
    (a remembered one would replay a graph reading a freed copy)."""
    device, checked = plain_replays
    w13, w2, W = _weights(0, device)
    x, ids, w = _inputs(4, device=device)
    wide = torch.zeros(T, 2 * K, dtype=torch.int32, device=device)
    packed = wide[:, :K]
    assert not packed.is_contiguous()
    for step in range(6):
        new_x, new_ids, new_w = _inputs(200 + step, device=device)
        x.copy_(new_x), ids.copy_(new_ids), w.copy_(new_w)
        packed.copy_(moelab.pack_topk_ids_weights(ids, w))
        got = _moe(packed, x, W)
        assert_close_to_reference(got, _reference(x, ids, w, w13, w2), torch.bfloat16, f"step {step}")
        del got
    assert len(checked) == 6 and not eager_graphs._plain


def test_a_call_whose_graph_reads_a_copy_of_the_words_leaves_no_signature(plain_replays):
    """The same contiguous copy of strided packed words handed in twice (what a caching allocator may do to
    ``validate_call``'s copies): the call replays in place on the copy, but signs nothing, since the next caller's
    strided words would not be where the graph reads them."""
    device, _ = plain_replays
    w13, w2, W = _weights(0, device)
    x, ids, w = _inputs(5, device=device)
    wide = torch.zeros(T, 2 * K, dtype=torch.int32, device=device)
    strided = wide[:, :K]
    strided.copy_(moelab.pack_topk_ids_weights(ids, w))
    copy = strided.contiguous()
    call = RoutedMoECall(strided, copy, x, W, E, K, 0, None, True, None)
    for _ in range(3):
        got = triton_backend.routed_moe(call).output
        assert_close_to_reference(got, _reference(x, ids, w, w13, w2), torch.bfloat16, "copied words")
        del got
    assert eager_graphs._in_place and not eager_graphs._plain


@pytest.mark.parametrize("switch", ["ENABLED", "IN_PLACE"])
def test_a_remembered_call_takes_the_checks_once_replays_are_switched_off(plain_replays, monkeypatch, switch):
    """``MOELAB_EAGER_GRAPHS=0`` / ``MOELAB_EAGER_GRAPHS_IN_PLACE=0`` set at run time (the module flags): a
    remembered signature no longer replays by itself."""
    device, checked = plain_replays
    w13, w2, W, x, ids, w, packed = _remembered_plain_call(device, 6)
    checked.clear()
    got = _moe(packed, x, W)
    assert not checked, "the remembered call took the checks"
    del got
    monkeypatch.setattr(eager_graphs, switch, False)
    got = _moe(packed, x, W)
    assert checked, f"{switch} off: the remembered call skipped the checks"
    assert_close_to_reference(got, _reference(x, ids, w, w13, w2), torch.bfloat16, f"{switch} off")
