"""The routed-MoE contract (docs/contract.md §3) on the torch and triton backends against the float64 reference.

On a CPU the triton backend runs in Triton's interpreter; on the lent H200 the same tests run compiled.
Permuted tensors are compared only through ``expanded_idx_to_permuted_idx``, never row by row.
"""

import pytest
import torch
from helpers import REL_TOL, assert_close_to_reference, poison, random_experts, random_topk_ids, random_weights, rel_err
from hypothesis import given
from hypothesis import strategies as st

import moelab
from moelab import reference

BACKENDS = ["torch", "triton"]


def make_problem(T, K, E, H, I, dtype, device, *, seed=0, E_local=None, offset=0):
    g = torch.Generator().manual_seed(seed)
    E_local = E if E_local is None else E_local
    w13, w2 = random_experts(E_local, H, I, dtype, device=device)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    ids = random_topk_ids(T, K, E, generator=g, device=device)
    w = random_weights(T, K, generator=g, device=device)
    return x, ids, w, w13, w2


def backend_tile(backend, T, K, E_local, dtype):
    """The tile of the backend's permuted space: FlashInfer's default on torch, the GEMMs' BLOCK_M on triton."""
    if backend == "torch":
        return moelab.permutation.default_tile(T, K, E_local)
    from moelab.kernels.moe_gemm import choose_config
    return choose_config(T, K, E_local, dtype).block_m


def check_map_invariants(e2p, ids, offset, E_local, tile):
    """int32; -1 exactly for non-local slots; one contiguous, token-ascending run per local expert, in ascending
    expert order, each starting where the previous expert's tile-padded segment ends (empty experts take none)."""
    assert e2p.dtype == torch.int32 and e2p.dim() == 1 and e2p.numel() == ids.numel()
    e2p, local_e = e2p.cpu().long(), ids.flatten().cpu().long() - offset
    is_local = (local_e >= 0) & (local_e < E_local)
    assert torch.equal(e2p < 0, ~is_local) and bool((e2p[~is_local] == -1).all())
    start = 0
    for e in range(E_local):
        r = e2p[local_e == e]  # in slot order = token order
        assert torch.equal(r, torch.arange(start, start + r.numel())), f"expert {e}: rows {r.tolist()}, start {start}"
        start += -(-r.numel() // tile) * tile


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(
    "T, K, E, H, I",
    [
        (1, 2, 8, 32, 32),  # decode: one token, most experts empty
        (13, 4, 8, 48, 40),  # odd H and I: masked K loop and masked columns
        (64, 8, 64, 32, 16),  # the test range's corner: T=64, E=64, K=8, many tiles
        (6, 6, 6, 16, 24),  # K == E: every token touches every expert
    ],
)
def test_finalized_output_matches_reference(backend, dtype, T, K, E, H, I, device):
    x, ids, w, w13, w2 = make_problem(T, K, E, H, I, dtype, device)
    weights = moelab.prepare_weights(w13, w2, backend=backend)
    packed = moelab.pack_topk_ids_weights(ids, w)
    out = poison(torch.empty(T, H, dtype=dtype, device=device))
    result = moelab.routed_moe(packed, x, weights, num_experts=E, top_k=K, output=out)
    assert isinstance(result, list) and len(result) == 1 and result[0] is out
    ref = reference.routed_moe(ids, reference.unpack_topk_ids_weights(packed)[1], x, w13, w2)
    assert_close_to_reference(out, ref["output"], dtype, f"{backend} output")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_delta", [False, True])  # the four-way return table: 2 x do_finalize, 2 x delta
@pytest.mark.parametrize("do_finalize", [True, False])
@pytest.mark.parametrize("packed", [True, False])  # packed int32 words, or the (ids, weights) tuple
def test_return_table(backend, with_delta, do_finalize, packed, device):
    T, K, E, H, I, dtype = 9, 3, 8, 32, 24, torch.bfloat16
    x, ids, w, w13, w2 = make_problem(T, K, E, H, I, dtype, device, seed=1)
    weights = moelab.prepare_weights(w13, w2, backend=backend)
    delta = (torch.randn(T, K, 2 * I) * 0.5).to(dtype).to(device) if with_delta else None
    topk = moelab.pack_topk_ids_weights(ids, w) if packed else (ids, w)
    result = moelab.routed_moe(topk, x, weights, num_experts=E, top_k=K, gemm1_lora_delta=delta,
                               do_finalize=do_finalize)
    w_used = reference.unpack_topk_ids_weights(topk)[1] if packed else w
    ref = reference.routed_moe(ids, w_used, x, w13, w2, gemm1_lora_delta=delta)
    act = None
    if do_finalize and not with_delta:
        (out,) = result
    elif do_finalize:
        out, e2p, act = result
    else:
        assert len(result) == (4 if with_delta else 3)
        gemm2, expert_weights, e2p = result[:3]
        if packed:
            assert expert_weights.dtype == torch.bfloat16
            assert torch.equal(expert_weights.cpu().double(), w_used)
        else:
            assert expert_weights is w  # the caller's own tensor object
        check_map_invariants(e2p, ids, 0, E, backend_tile(backend, T, K, E, dtype))
        assert_close_to_reference(gemm2[e2p.long()], ref["gemm2"], dtype, "gemm2 through the map")
        act = result[3] if with_delta else None
    if do_finalize:
        assert_close_to_reference(out, ref["output"], dtype, "output")
    if act is not None:
        assert act.shape[1] == I
        unpermuted = moelab.unpermute_activation(act, e2p, T, K)
        assert_close_to_reference(unpermuted, ref["act"], dtype, "gemm1_activation_output through the map")


@pytest.mark.parametrize("backend", BACKENDS)
# on a GPU each example's shapes compile kernels of their own: on a cold cache, beside 7 other compiling workers,
# the likely reason the GPU run's 120 s limit ended this test's worker (H100, 2026-12-07; alone: 2-3 s a run)
@pytest.mark.timeout(600)
@given(T=st.integers(0, 64), E=st.integers(1, 64), H=st.integers(1, 40), I=st.integers(1, 40),
       k_frac=st.floats(0, 1), seed=st.integers(0, 1000))
def test_property_shapes(backend, T, E, H, I, k_frac, seed):
    K = max(1, round(k_frac * E))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, ids, w, w13, w2 = make_problem(T, K, E, H, I, torch.float32, device, seed=seed)
    weights = moelab.prepare_weights(w13, w2, backend=backend)
    gemm2, _, e2p = moelab.routed_moe((ids, w), x, weights, num_experts=E, top_k=K, do_finalize=False)
    check_map_invariants(e2p, ids, 0, E, backend_tile(backend, T, K, E, torch.float32))
    out = moelab.routed_moe((ids, w), x, weights, num_experts=E, top_k=K)[0]
    ref = reference.routed_moe(ids, w, x, w13, w2)
    assert out.shape == (T, H)
    if T > 0:
        assert rel_err(out, ref["output"]) < REL_TOL[torch.float32]
        assert rel_err(gemm2[e2p.long()], ref["gemm2"]) < REL_TOL[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_permuted_buffer_sizes_follow_flashinfer(backend, device):
    # R2 = max(Rmax, ceil(65536/H)), R1 = max(Rmax, ceil(65536/I)): with tiny H and I the floors win.
    T, K, E, H, I = 3, 2, 4, 16, 32
    x, ids, w, w13, w2 = make_problem(T, K, E, H, I, torch.float32, device)
    weights = moelab.prepare_weights(w13, w2, backend=backend)
    gemm2, _, e2p, act = moelab.routed_moe((ids, w), x, weights, num_experts=E, top_k=K, do_finalize=False,
                                           gemm1_lora_delta=torch.zeros(T, K, 2 * I, device=device))
    assert gemm2.shape == (65536 // H, H) and act.shape == (65536 // I, I)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dead_rows_zero_or_nan_in_debug(backend, device):
    T, K, E, H, I = 5, 2, 4, 16, 16
    x, ids, w, w13, w2 = make_problem(T, K, E, H, I, torch.float32, device)
    weights = moelab.prepare_weights(w13, w2, backend=backend)
    for debug, check in ((False, lambda t: bool((t == 0).all())), (True, lambda t: bool(t.isnan().all()))):
        moelab.set_debug(debug)
        try:
            gemm2, _, e2p = moelab.routed_moe((ids, w), x, weights, num_experts=E, top_k=K, do_finalize=False)
        finally:
            moelab.set_debug(False)
        dead = torch.ones(gemm2.shape[0], dtype=torch.bool)
        dead[e2p.long().cpu()] = False
        assert dead.any() and check(gemm2[dead.to(gemm2.device)])
        assert not gemm2[e2p.long()].isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("E_local", [1, 3, 4])  # one expert per rank; uneven split of 8; two ranks of 4
def test_expert_parallel_windows_sum_to_single_rank(backend, E_local, device):
    T, K, E, H, I, dtype = 11, 3, 8, 32, 24, torch.float32
    x, ids, w, w13, w2 = make_problem(T, K, E, H, I, dtype, device, seed=3)
    full = reference.routed_moe(ids, w, x, w13, w2)["output"]
    total = torch.zeros(T, H, dtype=torch.float64)
    for offset in range(0, E, E_local):
        n = min(E_local, E - offset)
        weights = moelab.prepare_weights(w13[offset:offset + n], w2[offset:offset + n], backend=backend)
        out, e2p, _ = moelab.routed_moe((ids, w), x, weights, num_experts=E, top_k=K,
                                        local_expert_offset=offset,
                                        gemm1_lora_delta=torch.zeros(T, K, 2 * I, device=device))
        check_map_invariants(e2p, ids, offset, n, backend_tile(backend, T, K, n, dtype))
        part = reference.routed_moe(ids, w, x, w13[offset:offset + n], w2[offset:offset + n],
                                    local_expert_offset=offset)["output"]
        assert_close_to_reference(out, part, dtype, f"partial output, window at {offset}")
        total += out.double().cpu()
    assert_close_to_reference(total, full, dtype, "sum of the windows")


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_without_local_slot_gets_zero_row(backend, device):
    T, K, E, H, I = 4, 2, 8, 16, 16
    x, _, w, w13, w2 = make_problem(T, K, E, H, I, torch.float32, device)
    ids = torch.tensor([[0, 1], [6, 7], [1, 6], [7, 5]], dtype=torch.int32, device=device)  # window [0, 4)
    weights = moelab.prepare_weights(w13[:4], w2[:4], backend=backend)
    out = poison(torch.empty(T, H, device=device))
    moelab.routed_moe((ids, w), x, weights, num_experts=E, top_k=K, output=out)
    assert bool((out[1] == 0).all()) and bool((out[3] == 0).all()) and not out.isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_tokens(backend, device):
    x, ids, w, w13, w2 = make_problem(0, 2, 4, 16, 16, torch.bfloat16, device)
    weights = moelab.prepare_weights(w13, w2, backend=backend)
    (out,) = moelab.routed_moe(moelab.pack_topk_ids_weights(ids, w), x, weights, num_experts=4, top_k=2)
    assert out.shape == (0, 16)
    gemm2, ew, e2p = moelab.routed_moe((ids, w), x, weights, num_experts=4, top_k=2, do_finalize=False)
    assert e2p.shape == (0,) and ew.shape == (0, 2)


def test_permuted_map_follows_its_definition(device):
    """expanded_to_permuted_torch (the torch backend's map) and the segments kernel (the triton backend's) against
    the definition written out slot by slot: experts ascending, tokens ascending, each segment tile-padded."""
    from moelab.kernels.segments import build_segments_triton
    from moelab.permutation import expanded_to_permuted_torch
    ids = random_topk_ids(40, 4, 16, device=device)
    ids[::3] = ids[::3] + 16  # some slots outside the window [0, 12) of 12 local experts
    E_local, tile, flat = 12, 16, ids.flatten().tolist()
    want, start = [-1] * len(flat), 0
    for e in range(E_local):
        slots = [s for s, v in enumerate(flat) if v == e]
        for j, s in enumerate(slots):
            want[s] = start + j
        start += -(-len(slots) // tile) * tile
    want = torch.tensor(want, dtype=torch.int32)
    assert torch.equal(expanded_to_permuted_torch(ids, 0, E_local, tile).cpu(), want)
    if moelab.backends.get_backend("triton").unavailable_reason(ids.device) is None:
        seg = build_segments_triton(ids.flatten(), E_local, tile)
        assert torch.equal(seg.slot_to_row.cpu(), want)
        live = want >= 0
        assert torch.equal(seg.row_to_slot.cpu()[want[live].long()], torch.arange(len(flat))[live].int())


def test_available_backends_and_auto(device):
    names = moelab.available_backends()
    assert names[-1] == "torch" and "torch" in names
    assert ("triton" in names) == (moelab._runtime.HAS_TRITON)
    w13, w2 = random_experts(2, 16, 16, torch.float32, device=device)
    assert moelab.prepare_weights(w13, w2).backend == names[0]  # "auto" = fastest that runs here
    if device.type == "cpu":
        with pytest.raises(ValueError, match="flashinfer.*cannot run.*use one of"):
            moelab.prepare_weights(w13.bfloat16(), w2.bfloat16(), backend="flashinfer")


def _bad_call_cases():
    T, K, E, H, I = 4, 2, 8, 16, 16
    x, ids, w, w13, w2 = make_problem(T, K, E, H, I, torch.float32, "cpu")
    W = lambda: moelab.prepare_weights(w13, w2, backend="torch")  # noqa: E731
    dup = ids.clone()
    dup[1, 1] = dup[1, 0]
    big = ids.clone()
    big[0, 0] = E
    packed = moelab.pack_topk_ids_weights(ids, w)
    return [
        # (what, callable, error, match)
        ("dtype mismatch", lambda: moelab.routed_moe((ids, w), x.bfloat16(), W(), num_experts=E, top_k=K),
         TypeError, "hidden_states.*dtype"),
        ("id == E", lambda: moelab.routed_moe((big, w), x, W(), num_experts=E, top_k=K), ValueError, r"\[0, 8\)"),
        ("duplicate ids", lambda: moelab.routed_moe((dup, w), x, W(), num_experts=E, top_k=K), ValueError,
         "distinct"),
        ("E > 32767", lambda: moelab.routed_moe((ids, w), x, W(), num_experts=40000, top_k=K), ValueError,
         "num_experts"),
        ("window past E", lambda: moelab.routed_moe((ids, w), x, W(), num_experts=E, top_k=K,
                                                    local_expert_offset=1), ValueError, "local_expert_offset"),
        ("delta shape", lambda: moelab.routed_moe((ids, w), x, W(), num_experts=E, top_k=K,
                                                  gemm1_lora_delta=torch.zeros(T, K, I)), ValueError,
         "gemm1_lora_delta.*shape"),
        ("K > E", lambda: moelab.routed_moe((ids, w), x, W(), num_experts=1, top_k=K), ValueError, "top_k"),
        ("topk shape", lambda: moelab.routed_moe((ids[:, :1], w), x, W(), num_experts=E, top_k=K), ValueError,
         "topk.*shape"),
        ("packed dtype", lambda: moelab.routed_moe(ids.long(), x, W(), num_experts=E, top_k=K), TypeError,
         "topk.*int32"),
        ("H mismatch", lambda: moelab.routed_moe((ids, w), x[:, :8], W(), num_experts=E, top_k=K), ValueError,
         "hidden_states.*shape"),
        ("weights type", lambda: moelab.routed_moe((ids, w), x, w13, num_experts=E, top_k=K), TypeError,
         "weights.*MoEWeights"),
        ("output w/o finalize", lambda: moelab.routed_moe((ids, w), x, W(), num_experts=E, top_k=K,
                                                          do_finalize=False, output=torch.empty(T, H)),
         ValueError, "output"),
        ("non-contiguous output", lambda: moelab.routed_moe((ids, w), x, W(), num_experts=E, top_k=K,
                                                            output=torch.empty(H, T).t()), ValueError,
         "output.*contiguous"),
        # packed routing without delta or output: moelab.moe checks it in one expression first (decode host time)
        ("packed: dtype mismatch", lambda: moelab.routed_moe(packed, x.bfloat16(), W(), num_experts=E, top_k=K),
         TypeError, "hidden_states.*dtype"),
        ("packed: H mismatch", lambda: moelab.routed_moe(packed, x[:, :8], W(), num_experts=E, top_k=K), ValueError,
         "hidden_states.*shape"),
        ("packed: 3-D hidden_states", lambda: moelab.routed_moe(packed, x[None], W(), num_experts=E, top_k=K),
         ValueError, "hidden_states.*2-D"),
        ("packed: K columns", lambda: moelab.routed_moe(packed[:, :1], x, W(), num_experts=E, top_k=K), ValueError,
         "topk.*shape"),
        ("packed: T rows", lambda: moelab.routed_moe(packed[:3], x, W(), num_experts=E, top_k=K), ValueError,
         "topk.*shape"),
        ("packed: E > 32767", lambda: moelab.routed_moe(packed, x, W(), num_experts=40000, top_k=K), ValueError,
         "num_experts"),
        ("packed: E < E_local", lambda: moelab.routed_moe(packed, x, W(), num_experts=E - 1, top_k=K), ValueError,
         "at most num_experts"),
        ("packed: K > E", lambda: moelab.routed_moe(torch.zeros(T, E + 1, dtype=torch.int32), x, W(), num_experts=E,
                                                    top_k=E + 1, validate=False), ValueError, "top_k"),
        ("packed: K = 0", lambda: moelab.routed_moe(packed[:, :0], x, W(), num_experts=E, top_k=0), ValueError,
         "top_k"),
        ("packed: top_k float", lambda: moelab.routed_moe(packed, x, W(), num_experts=E, top_k=2.0), TypeError,
         "top_k"),
        ("packed: window past E", lambda: moelab.routed_moe(packed, x, W(), num_experts=E, top_k=K,
                                                            local_expert_offset=1), ValueError, "local_expert_offset"),
        ("packed: id == E", lambda: moelab.routed_moe(moelab.pack_topk_ids_weights(big, w, validate=False), x, W(),
                                                      num_experts=E, top_k=K), ValueError, r"\[0, 8\)"),
        ("packed: duplicate ids", lambda: moelab.routed_moe(moelab.pack_topk_ids_weights(dup, w, validate=False), x,
                                                            W(), num_experts=E, top_k=K), ValueError, "distinct"),
        ("unknown backend", lambda: moelab.prepare_weights(w13, w2, backend="cutlass"), ValueError, "backend"),
        ("w2 shape", lambda: moelab.prepare_weights(w13, w2[:, :, :3], backend="torch"), ValueError, "w2.*shape"),
        ("w2 dtype", lambda: moelab.prepare_weights(w13, w2.half(), backend="torch"), TypeError, "w2.*dtype"),
    ]


@pytest.mark.parametrize("what, call, error, match", _bad_call_cases(), ids=lambda c: c if isinstance(c, str) else "")
def test_bad_input_raises_clear_error(what, call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_triton_routed_moe_under_torch_compile(device):
    # The pipeline is one registered custom op with a fake implementation: dynamo traces it with fake tensors.
    if "triton" not in moelab.available_backends(device):
        pytest.skip("no triton on this machine")
    T, K, E, H, I = 6, 2, 4, 32, 16
    x, ids, w, w13, w2 = make_problem(T, K, E, H, I, torch.float32, device)
    weights = moelab.prepare_weights(w13, w2, backend="triton")

    def layer(x, packed):
        return moelab.routed_moe(packed, x, weights, num_experts=E, top_k=K, validate=False)[0]

    packed = moelab.pack_topk_ids_weights(ids, w)
    compiled = torch.compile(layer, backend="aot_eager" if device.type == "cpu" else "inductor", fullgraph=True)
    assert_close_to_reference(compiled(x, packed), reference.routed_moe(ids, reference.unpack_topk_ids_weights(
        packed)[1], x, w13, w2)["output"], torch.float32, "compiled routed_moe")
    torch.library.opcheck(torch.ops.moelab.triton_routed_moe.default,
                          (ids, w, x, w13, w2, E, 0, None, True), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("activation, gated, on_input, H, gluon", [
    ("silu", True, False, 64, True), ("swigluoai", True, False, 64, True), ("gelu", True, False, 64, False),
    ("silu", False, False, 64, False), ("silu", True, True, 64, False), ("silu", True, False, 48, False)])
def test_pipeline_and_its_fake_ask_the_tile_table_alike(activation, gated, on_input, H, gluon, monkeypatch, device):
    """The pipeline and its torch.compile fake ask the tile table with the same experts' bytes and the same answer to
    "do the Gluon GEMMs take this call" (a gated activation of ``gluon_gemm.ACTIVATIONS``, no router weight on the
    input, H a multiple of their BLOCK_K, ...), which sets the tiles of large experts
    (``moe_gemm.TILE128_MIN_EXPERT_BYTES``), so the fake's buffer shapes stay the real op's."""
    from moelab.backends import triton_backend

    if "triton" not in moelab.available_backends(device):
        pytest.skip("no triton on this machine")
    T, K, E, I = 6, 2, 4, 16
    x, ids, w, w13, w2 = make_problem(T, K, E, H, I, torch.float32, device)
    weights = moelab.prepare_weights(w13 if gated else w13[:, I:], w2, backend="triton", activation=activation,
                                     gated=gated)
    asked = []
    table = triton_backend.choose_config
    monkeypatch.setattr(triton_backend, "choose_config",
                        lambda *a, **k: asked.append((k["expert_bytes"], k["gluon_call"])) or table(*a, **k))
    triton_backend._layout.cache_clear()
    try:
        real = moelab.routed_moe((ids, w), x, weights, num_experts=E, top_k=K, do_finalize=False, validate=False,
                                 apply_router_weight_on_input=on_input)
    finally:
        triton_backend._layout.cache_clear()
    w13p, w2p = weights.gemm1_weights, weights.gemm2_weights
    fake = triton_backend._routed_moe_fake(ids, w, x, w13p, w2p, E, 0, None, False, activation, gated,
                                           weight_on_input=on_input)
    expert_bytes = (w13p[0].numel() + w2p[0].numel()) * w13p.element_size()
    assert asked == [(expert_bytes, gluon)] * 2
    assert fake[1].shape == real[0].shape and fake[2].shape == real[2].shape  # gemm2 rows [R, H], e2p [T*K]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA GPU (runs on the H200)")
def test_triton_routed_moe_cuda_graph_capture_and_replay():
    T, K, E, H, I, device = 16, 4, 8, 64, 32, "cuda"
    x, ids, w, w13, w2 = make_problem(T, K, E, H, I, torch.bfloat16, device)
    weights = moelab.prepare_weights(w13, w2, backend="triton")
    packed = moelab.pack_topk_ids_weights(ids, w)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=device)
    # warm-up: compiles the eager variants (the PDL ones, moelab._runtime.pdl_launch, compile in the capture)
    moelab.routed_moe(packed, x, weights, num_experts=E, top_k=K, output=out, validate=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moelab.routed_moe(packed, x, weights, num_experts=E, top_k=K, output=out, validate=False)
    x2, ids2, w2_, _, _ = make_problem(T, K, E, H, I, torch.bfloat16, device, seed=7)
    x.copy_(x2)
    packed.copy_(moelab.pack_topk_ids_weights(ids2, w2_))
    poison(out)
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.routed_moe(ids2, reference.unpack_topk_ids_weights(packed)[1], x2, w13, w2)["output"]
    assert_close_to_reference(out, ref, torch.bfloat16, "replayed graph")


@pytest.mark.parametrize("N, G", [(5000, 8), (3000, 600)])
def test_segments_past_the_scatters_own_scan_take_the_scan_launch(N, G, monkeypatch, device):
    """Past SCAN_IN_SCATTER_MAX_COUNTS histogram counts the scan runs as a launch of its own: same segments."""
    from moelab.kernels import segments
    from moelab.permutation import build_segments

    monkeypatch.setattr(segments, "SCAN_IN_SCATTER_MAX_COUNTS", 0)
    values = torch.randint(-1, G + 5, (N,), dtype=torch.int32, device=device)
    got = segments.build_segments_triton(values, G, 16)
    want = build_segments(values.long(), G, 16)
    for name in ("slot_to_row", "row_to_slot", "block_group"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize(
    "N, G, tile, offset, low, high",
    [
        (8, 128, 16, 0, 0, 128),  # decode: 8 slots over 128 experts, one chunk
        (300, 17, 16, 3, 0, 30),  # EP window [3, 20): slots outside belong to no group; several chunks
        (1000, 513, 32, 0, -1, 600),  # LoRA-sized grouping (4 adapters x 128 experts + 1): narrow chunks
        (5000, 8, 16, 0, 0, 8),  # several chunks of 1024 slots: the scan across chunks
        (5000, 600, 16, 2, -1, 640),  # 1024 bins: each scatter program scans the 5 chunks in two steps
        (40, 2000, 16, 0, 0, 2000),  # 2000 groups in one program (8 adapters x 250 experts)
        (3000, 4097, 16, 0, -1, 4097),  # 32 adapters x 128 experts + 1, several chunks of 8192 bins each
        (40, 9000, 16, 0, 0, 9000),  # more groups than MAX_GROUPS: the torch construction
    ],
)
def test_segments_kernel_equals_torch_construction(N, G, tile, offset, low, high, device, monkeypatch):
    """Every output of the segments kernels written (their buffers come poisoned), equal to the torch construction's;
    the Gluon GEMMs' two tile counters zeroed (the torch construction has none)."""
    from moelab.kernels import segments
    from moelab.permutation import build_segments

    values = torch.randint(low, high, (N,), dtype=torch.int32, device=device)
    want = build_segments(values.long() - offset, G, tile)
    empty = torch.empty
    monkeypatch.setattr(segments.torch, "empty", lambda *a, **k: empty(*a, **k).fill_(-7))
    got = segments.build_segments_triton(values, G, tile, offset)
    assert torch.equal(got.slot_to_row, want.slot_to_row)
    assert torch.equal(got.row_to_slot, want.row_to_slot)
    assert torch.equal(got.block_group, want.block_group)
    if G <= segments.MAX_GROUPS:
        assert got.tile_counters.tolist() == [0, 0] and got.tile_counters.dtype == torch.int32
    else:
        assert got.tile_counters is None
    no_map = segments.build_segments_triton(values, G, tile, offset, tile_map=False)  # the slot maps alone
    assert no_map.block_group.numel() == 0
    assert torch.equal(no_map.slot_to_row, want.slot_to_row)
    assert torch.equal(no_map.row_to_slot, want.row_to_slot)


@pytest.mark.parametrize(
    "T, K, E_local, L, offset",
    [
        (5, 4, 16, 8, 0),  # 129 groups, one program
        (40, 8, 128, 8, 0),  # 1025 groups (8 adapters of Qwen3-30B-A3B), one program: the bisection
        (300, 8, 128, 8, 2),  # several chunks, the EP window [2, 130)
        (200, 8, 128, 32, 0),  # 4097 groups (32 adapters), several chunks
        (10, 2, 64, 200, 0),  # 12801 groups, more than MAX_GROUPS: the torch construction
    ],
)
def test_segments_by_adapter_follow_their_definition(T, K, E_local, L, offset, device):
    """The (adapter, local expert) grouping the LoRA kernels share, read by the segments kernels from the ids
    themselves, against the groups written out slot by slot (adapters out of the bank and non-local experts: the
    last group) and the torch construction of those groups."""
    from moelab.kernels.segments import build_segments_triton
    from moelab.permutation import adapter_expert_groups, build_segments

    g = torch.Generator().manual_seed(T * L)
    topk_ids = torch.randint(0, E_local + offset + 3, (T, K), generator=g, dtype=torch.int32)
    lora_ids = torch.randint(-1, L + 2, (T,), generator=g)
    want = [a * E_local + e - offset if 0 <= a < L and 0 <= e - offset < E_local else L * E_local
            for t, a in enumerate(lora_ids.tolist()) for e in topk_ids[t].tolist()]
    groups = adapter_expert_groups(topk_ids, lora_ids, L, E_local, offset)
    assert groups.tolist() == want
    want_seg = build_segments(groups, L * E_local + 1, 16)
    got = build_segments_triton(topk_ids.to(device), L * E_local + 1, 16, offset, adapter_ids=lora_ids.to(device),
                                num_experts=E_local)
    for name in ("slot_to_row", "row_to_slot", "block_group"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want_seg, name)), name
    # the caller's ids as strided views (every other column of a wider tensor, the adapters of every other token)
    wide_ids = torch.stack([topk_ids, topk_ids + 1], dim=2).flatten(1).to(device)
    wide_lora = torch.stack([lora_ids, lora_ids], dim=1).flatten().to(device)
    got = build_segments_triton(wide_ids[:, ::2], L * E_local + 1, 16, offset, adapter_ids=wide_lora[::2],
                                num_experts=E_local)
    assert torch.equal(got.slot_to_row.cpu(), want_seg.slot_to_row)


def test_segments_by_adapter_reject_mismatched_sizes():
    from moelab.kernels.segments import build_segments_triton

    ids = torch.zeros(10, dtype=torch.int32)
    with pytest.raises(ValueError, match="adapter_ids: expected one id per token"):
        build_segments_triton(ids, 2 * 4 + 1, 16, adapter_ids=torch.zeros(3, dtype=torch.int32), num_experts=4)
    with pytest.raises(ValueError, match="num_groups = adapters"):
        build_segments_triton(ids, 2 * 4, 16, adapter_ids=torch.zeros(5, dtype=torch.int32), num_experts=4)


@pytest.mark.parametrize(
    "T, K, G, offset",
    [
        (7, 4, 16, 0),  # one program
        (600, 4, 128, 2),  # several chunks (2400 slots), the EP window [2, 130)
        (9, 2, 9000, 0),  # more groups than MAX_GROUPS: the torch construction
    ],
)
def test_segments_in_token_order_follow_their_definition(T, K, G, offset, device):
    """``token_order``: each group's rows hold its slots in the order of their tokens' places in the permutation
    (then slot order), the slot ids written are the slots' own: the segments of the tokens' reordered ids, mapped
    back slot by slot."""
    from moelab.kernels.segments import build_segments_triton
    from moelab.permutation import build_segments

    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, G + offset + 3, (T, K), generator=g, dtype=torch.int32)  # some outside the window
    order = torch.randperm(T, generator=g).to(torch.int32)
    ref = build_segments(ids[order.long()].flatten().long() - offset, G, 16)  # over places in the order
    place_slot = [int(order[i // K]) * K + i % K for i in range(T * K)]
    want_slot_to_row = [0] * (T * K)
    for place, slot in enumerate(place_slot):
        want_slot_to_row[slot] = int(ref.slot_to_row[place])
    want_row_to_slot = [place_slot[p] if p >= 0 else -1 for p in ref.row_to_slot.tolist()]
    got = build_segments_triton(ids.to(device), G, 16, offset, token_order=order.to(device))
    assert got.slot_to_row.dtype == got.row_to_slot.dtype == torch.int32
    assert got.slot_to_row.cpu().tolist() == want_slot_to_row
    assert got.row_to_slot.cpu().tolist() == want_row_to_slot
    assert torch.equal(got.block_group.cpu(), ref.block_group)
    assert got.token_ordered and not ref.token_ordered  # what the adapter loop's shrinks read (whole pairs or not)
    assert not build_segments_triton(ids.to(device), G, 16, offset).token_ordered
    assert build_segments_triton(ids.to(device), G, 16, offset, token_order=order.to(device),
                                 tile_map=False).token_ordered


def test_segments_in_token_order_reject_bad_orders():
    from moelab.kernels.segments import build_segments_triton

    ids = torch.zeros(10, dtype=torch.int32)
    with pytest.raises(ValueError, match="token_order: expected an int32 permutation"):
        build_segments_triton(ids, 4, 16, token_order=torch.arange(5))  # int64
    with pytest.raises(ValueError, match="token_order: expected an int32 permutation"):
        build_segments_triton(ids, 4, 16, token_order=torch.arange(3, dtype=torch.int32))  # 10 slots, 3 tokens
    with pytest.raises(ValueError, match="without adapter_ids"):
        build_segments_triton(ids, 9, 16, token_order=torch.arange(5, dtype=torch.int32),
                              adapter_ids=torch.zeros(5, dtype=torch.int32), num_experts=4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_routing_weights(backend, device):
    # The caller's (ids, weights) may be a transposed view: the kernels must not assume its strides.
    T, K, E, H, I = 6, 3, 8, 16, 16
    x, ids, _, w13, w2 = make_problem(T, K, E, H, I, torch.float32, device)
    w = torch.rand(K, T, device=device).t()
    assert not w.is_contiguous()
    weights = moelab.prepare_weights(w13, w2, backend=backend)
    out = moelab.routed_moe((ids, w), x, weights, num_experts=E, top_k=K)[0]
    assert_close_to_reference(out, reference.routed_moe(ids, w, x, w13, w2)["output"], torch.float32, "output")


def test_zero_sized_weights_rejected():
    with pytest.raises(ValueError, match="w13.*non-zero"):
        moelab.prepare_weights(torch.zeros(0, 8, 4), torch.zeros(0, 4, 4), backend="torch")
