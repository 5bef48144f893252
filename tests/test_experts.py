"""LoRAExperts (docs/contract.md §5) on the torch and triton backends against ``moelab.reference.lora_experts``.

Adapters are random with a large contribution, and the LoRA part alone (output - base) is compared too, so a
broken LoRA path cannot hide under the base output. The triton backend runs twice: with the LoRA fused into its
GEMMs (its default) and as vLLM's unfused flow (``fused=False``).
"""

import pytest
import torch
from helpers import (
    REL_TOL,
    assert_close_to_reference,
    lora_and_base_outputs,
    random_experts,
    random_topk_ids,
    random_weights,
    record_tma_choices,
    rel_err,
)

import moelab
from moelab import reference

#: "backend", "backend/flow" (the unfused vLLM flow on a backend that fuses by default) or "triton/tiles" (the
#: fused path with its per-tile shrink kernels, which prefill takes; small batches take the one-launch decode path).
BACKENDS = ["torch", "triton", "triton/tiles", "triton/flow"]


def make_experts(w13, w2, variant, **kwargs):
    backend, _, mode = variant.partition("/")
    fused = {"flow": False, "tiles": "tiles", "": None}[mode]
    experts = moelab.LoRAExperts(w13, w2, backend=backend, fused=fused, **kwargs)
    assert experts.fused == (backend == "triton" and mode != "flow" and kwargs.get("lora") is not None)
    return experts


def random_adapters(L, E, H, I, ranks, *, seed=0):
    """One dict of fp32 adapter tensors per slot (rank ranks[l]); B ~ N(0, 1): a contribution of the order of
    the base output."""
    g = torch.Generator().manual_seed(seed)
    adapters = []
    for r in ranks[:L]:
        adapters.append({
            "gate_a": torch.randn(E, r, H, generator=g) / H**0.5, "gate_b": torch.randn(E, I, r, generator=g),
            "up_a": torch.randn(E, r, H, generator=g) / H**0.5, "up_b": torch.randn(E, I, r, generator=g),
            "down_a": torch.randn(E, r, I, generator=g) / I**0.5, "down_b": torch.randn(E, H, r, generator=g) / 4,
        })
    return adapters


def make_bank(adapters, E_local, offset, H, I, max_rank, dtype, device, scaling=0.5):
    bank = moelab.LoRABank(len(adapters), E_local, H, I, max_rank, dtype=dtype, device=device)
    for slot, a in enumerate(adapters):
        bank.set(slot, scaling=scaling, **{k: v[offset:offset + E_local].to(dtype).to(device) for k, v in a.items()})
    return bank


def make_problem(T, K, E, H, I, dtype, device, *, L=3, ranks=(4, 8, 2), seed=0, lora_ids=None):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = random_experts(E, H, I, dtype, device=device)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    ids = random_topk_ids(T, K, E, generator=g, device=device)
    w = random_weights(T, K, generator=g, device=device)
    if lora_ids is None:
        lora_ids = torch.randint(-1, L, (T,), generator=g)
    adapters = random_adapters(L, E, H, I, list(ranks), seed=seed)
    return x, ids, w, w13, w2, lora_ids.to(device), adapters


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "T, K, E, H, I, lora_ids",
    [
        (12, 2, 8, 48, 40, None),  # several adapters and ranks, some -1 tokens; odd H, I
        (1, 4, 8, 32, 32, torch.tensor([1])),  # T = 1 decode with an adapter
        (5, 6, 6, 32, 16, torch.tensor([0, 2, -1, 1, 0])),  # K == E: every token touches every expert
    ],
)
def test_lora_experts_matches_reference(backend, dtype, T, K, E, H, I, lora_ids, device):
    x, ids, w, w13, w2, lora_ids, adapters = make_problem(T, K, E, H, I, dtype, device, lora_ids=lora_ids)
    bank = make_bank(adapters, E, 0, H, I, 8, dtype, device)
    experts = make_experts(w13, w2, backend, num_experts=E, top_k=K, lora=bank)
    out = experts(x, w, ids, lora_ids)
    ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)
    assert ref["lora"].norm() > 0.3 * ref["base"].norm(), "the adapters must matter for this test to mean anything"
    assert_close_to_reference(out, ref["output"], dtype, f"{backend} output")
    base = experts(x, w, ids, None)
    assert_close_to_reference(out.double() - base.double(), ref["lora"], dtype, f"{backend} LoRA part")
    # Tokens without an adapter: bit-for-bit the base path's rows (users saw base requests corrupted: never here).
    no_adapter = (lora_ids < 0).to(out.device)
    assert torch.equal(out[no_adapter], base[no_adapter])


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_minus_one_takes_the_fast_path_and_equals_base(backend, device, monkeypatch):
    T, K, E, H, I = 7, 2, 8, 32, 16
    x, ids, w, w13, w2, _, adapters = make_problem(T, K, E, H, I, torch.bfloat16, device)
    bank = make_bank(adapters, E, 0, H, I, 8, torch.bfloat16, device)
    experts = make_experts(w13, w2, backend, num_experts=E, top_k=K, lora=bank)
    base = experts(x, w, ids, None)
    none = torch.full((T,), -1)
    lora_path = experts(x, w, ids, none.to(device), has_lora=True)  # forced LoRA path: all deltas zero
    assert torch.equal(lora_path, base)
    # The fast path is the backend's base MoE: a call that carries no bank (on every path, fused ones included).
    from moelab.backends import get_backend
    backend_module = get_backend(experts.backend)
    banks = []

    def spy(call):
        banks.append(call.lora)
        return run(call)

    run = backend_module.lora_experts
    monkeypatch.setattr(backend_module, "lora_experts", spy)
    assert torch.equal(experts(x, w, ids, none), base)  # CPU ids, all -1: decided on the host
    assert torch.equal(experts(x, w, ids, none.to(device), has_lora=False), base)
    assert banks == [None, None]
    assert torch.equal(experts(x, w, ids, none.to(device), has_lora=True), base)  # the LoRA path, as above
    assert banks[-1] is bank
    ref = reference.lora_experts(x, w, ids, none, w13, w2, bank)
    assert_close_to_reference(base, ref["output"], torch.bfloat16, "base")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tokens_without_adapter_are_the_base_path_bit_for_bit(backend, dtype, device):
    """In every dtype: a -1 token of a mixed batch, and a whole batch of -1 on the forced LoRA path, equal the base
    path's rows bit for bit (I = 16 fp32 once differed in the last bit on the torch backend: its SiLU ran on strided
    views without a delta and on contiguous tensors with one)."""
    T, K, E, H, I = 7, 2, 8, 32, 16
    x, ids, w, w13, w2, lora_ids, adapters = make_problem(T, K, E, H, I, dtype, device, seed=3,
                                                          lora_ids=torch.tensor([0, -1, 1, -1, -1, 2, -1]))
    experts = make_experts(w13, w2, backend, num_experts=E, top_k=K, lora=make_bank(adapters, E, 0, H, I, 8, dtype,
                                                                                     device))
    base = experts(x, w, ids, None)
    out = experts(x, w, ids, lora_ids)
    none = lora_ids < 0
    assert not torch.equal(out[~none], base[~none])
    assert torch.equal(out[none], base[none])
    assert torch.equal(experts(x, w, ids, torch.full((T,), -1, device=device), has_lora=True), base)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("E_local", [2, 3])  # even and uneven windows over E = 6
def test_expert_parallel_partial_sums(backend, E_local, device):
    T, K, E, H, I, dtype = 9, 3, 6, 32, 24, torch.float32
    x, ids, w, w13, w2, lora_ids, adapters = make_problem(T, K, E, H, I, dtype, device, seed=4)
    full = reference.lora_experts(x, w, ids, lora_ids, w13, w2, make_bank(adapters, E, 0, H, I, 8, dtype, "cpu"))
    total = torch.zeros(T, H, dtype=torch.float64)
    for offset in range(0, E, E_local):
        n = min(E_local, E - offset)
        bank = make_bank(adapters, n, offset, H, I, 8, dtype, device)
        experts = make_experts(w13[offset:offset + n], w2[offset:offset + n], backend, num_experts=E,
                               top_k=K, local_expert_offset=offset, lora=bank)
        part = experts(x, w, ids, lora_ids)
        ref_part = reference.lora_experts(x, w, ids, lora_ids, w13[offset:offset + n], w2[offset:offset + n], bank,
                                          local_expert_offset=offset)
        assert_close_to_reference(part, ref_part["output"], dtype, f"window at {offset}")
        total += part.double().cpu()
    assert rel_err(total, full["output"]) < REL_TOL[dtype]
    assert rel_err(total - full["base"], full["lora"]) < REL_TOL[dtype]


def test_lora_experts_rejects_bad_input(device):
    E, K, H, I = 4, 2, 16, 16
    w13, w2 = random_experts(E, H, I, torch.float32, device=device)
    wrong = moelab.LoRABank(1, E, H, 32, 4, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="lora.*E_local, H, I"):
        moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=wrong, backend="torch")
    with pytest.raises(TypeError, match="lora.*LoRABank"):
        moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=object(), backend="torch")
    bank = moelab.LoRABank(2, E, H, I, 4, dtype=torch.float32, device=device)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="torch")
    x, ids, w = torch.randn(3, H, device=device), random_topk_ids(3, K, E, device=device), torch.rand(3, K)
    with pytest.raises(ValueError, match=r"lora_ids: expected 3 rows \(T, as hidden_states"):
        experts(x, w.to(device), ids, torch.zeros(2, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="lora_ids"):
        experts(x, w.to(device), ids, torch.tensor([0, 5, -1], device=device))  # adapter id outside the bank


@pytest.mark.parametrize("max_rank, ranks", [(6, (6, 1, 3, 5)), (16, (16, 16, 16, 16))])
def test_fused_lora_many_adapters_per_tile(max_rank, ranks, device):
    """Four adapters mixed inside each GEMM tile, ranks that are not powers of two, one wide bank; debug mode
    fills dead rows with NaN, which must not reach any output."""
    T, K, E, H, I, dtype = 40, 2, 4, 64, 48, torch.bfloat16
    x, ids, w, w13, w2, _, adapters = make_problem(T, K, E, H, I, dtype, device, L=4, ranks=ranks, seed=7)
    lora_ids = (torch.arange(T) % 5 - 1).to(device)  # -1, 0, 1, 2, 3, -1, ... : every tile mixes them
    bank = make_bank(adapters, E, 0, H, I, max_rank, dtype, device)
    experts = make_experts(w13, w2, "triton", num_experts=E, top_k=K, lora=bank)
    ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)
    out, base = lora_and_base_outputs(experts, x, w, ids, lora_ids)
    assert_close_to_reference(out, ref["output"], dtype, "fused output")
    assert_close_to_reference(out.double() - base.double(), ref["lora"], dtype, "fused LoRA part")
    assert torch.equal(out[lora_ids < 0], base[lora_ids < 0])


@pytest.mark.parametrize("L, max_rank", [(1, 4), (4, 16)])  # R_PAD padded past max_rank; the widest fused bank
def test_fused_lora_bank_widths(L, max_rank, device):
    T, K, E, H, I, dtype = 20, 2, 4, 32, 16, torch.bfloat16
    ranks = tuple(max_rank - (slot % 3) for slot in range(L))
    x, ids, w, w13, w2, _, adapters = make_problem(T, K, E, H, I, dtype, device, L=L, ranks=ranks, seed=3)
    lora_ids = (torch.arange(T) % (L + 1) - 1).to(device)
    bank = make_bank(adapters, E, 0, H, I, max_rank, dtype, device)
    experts = make_experts(w13, w2, "triton", num_experts=E, top_k=K, lora=bank)
    out, base = experts(x, w, ids, lora_ids), experts(x, w, ids, None)
    ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)
    assert_close_to_reference(out, ref["output"], dtype, f"L={L} output")
    assert_close_to_reference(out.double() - base.double(), ref["lora"], dtype, f"L={L} LoRA part")
    assert torch.equal(out[lora_ids < 0], base[lora_ids < 0])


@pytest.mark.parametrize("backend", ["triton", "triton/tiles"])
@pytest.mark.parametrize("T, K, H, I", [(1, 8, 32, 96), (9, 4, 48, 128)])
def test_fused_lora_when_i_spans_more_column_blocks_than_h(T, K, H, I, backend, device):
    """The decode path's W2 shrink is summed from one partial per GEMM1 column block (I / BLOCK_N of them): a count
    that differs from GEMM2's column blocks (H / BLOCK_N), every EP-free decode shape of a real model."""
    E, dtype = 8, torch.float32
    x, ids, w, w13, w2, lora_ids, adapters = make_problem(T, K, E, H, I, dtype, device, L=2, ranks=(16, 5), seed=7)
    bank = make_bank(adapters, E, 0, H, I, 16, dtype, device)
    experts = make_experts(w13, w2, backend, num_experts=E, top_k=K, lora=bank)
    out, base = experts(x, w, ids, lora_ids), experts(x, w, ids, None)
    ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)
    assert_close_to_reference(out, ref["output"], dtype, "output")
    assert_close_to_reference(out.double() - base.double(), ref["lora"], dtype, "LoRA part")


@pytest.mark.parametrize("max_rank, offset, E_local", [(16, 0, 8), (12, 3, 4)])  # (12: ranks past max_rank, EP)
def test_fused_decode_w13_shrink_over_several_programs_and_k_steps(max_rank, offset, E_local, device, monkeypatch):
    """The decode launch's W13 shrink as real shapes run it (H = 2048: 16 programs of 2 rank columns per slot, the
    first one zeroing the slot's W2 sums), forced at test size: 2 columns a program, K steps of 16 over H = 40; with
    max_rank = 12 the bank's padded ranks are masked, with a window of 4 of 8 experts some slots are not local.
    Scratch buffers are NaN-poisoned (debug mode), so a value no kernel wrote cannot pass."""
    from moelab import _runtime
    from moelab.kernels import fused_lora
    monkeypatch.setattr(fused_lora, "slot_shrink_shape", lambda H, r_pad: (16, 2))
    monkeypatch.setattr(_runtime, "DEBUG_DEAD_ROWS", True)
    T, K, E, H, I, dtype = 6, 3, 8, 40, 24, torch.float32
    x, ids, w, w13, w2, lora_ids, adapters = make_problem(T, K, E, H, I, dtype, device, L=2, ranks=(max_rank, 5),
                                                          seed=11, lora_ids=torch.tensor([0, 1, -1, 1, 0, 0]))
    w13, w2 = w13[offset:offset + E_local], w2[offset:offset + E_local]
    bank = make_bank(adapters, E_local, offset, H, I, max_rank, dtype, device)
    assert bank.stacked_pads[1] == 16
    experts = make_experts(w13, w2, "triton", num_experts=E, top_k=K, local_expert_offset=offset, lora=bank)
    out, base = experts(x, w, ids, lora_ids), experts(x, w, ids, None)
    ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank, local_expert_offset=offset)
    assert_close_to_reference(out, ref["output"], dtype, "output")
    assert_close_to_reference(out.double() - base.double(), ref["lora"], dtype, "LoRA part")


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_lora_ids_and_unvalidated_ids_outside_the_bank(backend, device):
    """A column view of a wider id tensor is read by its strides; with validate=False an id past the bank is
    "no adapter" on every path (validate=True rejects it: test_bad_calls_rejected_on_every_path)."""
    T, K, E, H, I, dtype = 9, 2, 4, 32, 16, torch.float32
    x, ids, w, w13, w2, lora_ids, adapters = make_problem(T, K, E, H, I, dtype, device, seed=5)
    bank = make_bank(adapters, E, 0, H, I, 8, dtype, device)
    experts = make_experts(w13, w2, backend, num_experts=E, top_k=K, lora=bank)
    strided = torch.stack([lora_ids, torch.full_like(lora_ids, 7)], dim=1)[:, 0]
    assert not strided.is_contiguous()
    assert torch.equal(experts(x, w, ids, strided), experts(x, w, ids, lora_ids.clone()))
    outside = lora_ids.clone()
    outside[::2] = 50  # past the bank's 3 slots
    no_adapter = torch.where(outside == 50, -1, lora_ids)
    assert torch.equal(experts(x, w, ids, outside, validate=False), experts(x, w, ids, no_adapter))


def test_fused_choice_and_its_errors(device):
    E, K, H, I = 4, 2, 16, 16
    w13, w2 = random_experts(E, H, I, torch.float32, device=device)
    bank = moelab.LoRABank(2, E, H, I, 4, dtype=torch.float32, device=device)
    with pytest.raises(ValueError, match="fused.*triton backend"):
        moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="torch", fused=True)
    with pytest.raises(TypeError, match="fused"):
        moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="triton", fused="yes")
    wide = moelab.LoRABank(8, E, H, I, 64, dtype=torch.float32, device=device)  # 8 * 64 stacked columns
    assert moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=wide, backend="triton").fused  # adapter loop
    assert moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=wide, backend="triton", fused=True).fused
    with pytest.raises(ValueError, match="fused.*'tiles' path.*got 512 stacked columns"):
        moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=wide, backend="triton", fused="tiles")
    for backend in ("triton", "torch"):  # no bank: nothing to fold, fused=True builds the base MoE
        base_only = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=None, backend=backend, fused=True)
        assert not base_only.fused and base_only._path is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_calls_rejected_on_every_path(backend, device):
    """The fused path calls neither routed_moe nor the deltas: it must reject what they reject."""
    E, K, H, I = 4, 2, 16, 16
    w13, w2 = random_experts(E, H, I, torch.float32, device=device)
    bank = moelab.LoRABank(2, E, H, I, 4, dtype=torch.float32, device=device)
    experts = make_experts(w13, w2, backend, num_experts=E, top_k=K, lora=bank)
    x, ids = torch.randn(3, H, device=device), random_topk_ids(3, K, E, device=device)
    w, lora_ids = torch.rand(3, K, device=device), torch.tensor([0, 1, -1], device=device)
    with pytest.raises(ValueError, match="hidden_states.*shape"):
        experts(torch.randn(3, H + 1, device=device), w, ids, lora_ids)
    with pytest.raises(TypeError, match="hidden_states.*dtype"):
        experts(x.double(), w, ids, lora_ids)
    with pytest.raises(ValueError, match="topk_weights|weights"):
        experts(x, w[:, :1], ids, lora_ids)
    with pytest.raises(ValueError, match="lora_ids"):
        experts(x, w, ids, torch.tensor([0, 2, -1], device=device))  # slot 2 of a 2-slot bank
    with pytest.raises(ValueError, match="expert ids|topk"):
        experts(x, w, torch.full((3, K), E, dtype=torch.int32, device=device), lora_ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA GPU (runs on the H200)")
@pytest.mark.parametrize("backend", ["triton", "triton/flow"])
def test_lora_experts_cuda_graph_capture_and_replay(backend):
    T, K, E, H, I, dtype, device = 32, 4, 8, 128, 64, torch.bfloat16, "cuda"
    x, ids, w, w13, w2, lora_ids, adapters = make_problem(T, K, E, H, I, dtype, device)
    bank = make_bank(adapters, E, 0, H, I, 8, dtype, device)
    experts = make_experts(w13, w2, backend, num_experts=E, top_k=K, lora=bank)
    # compiles the eager variants; the PDL variants (moelab._runtime.pdl_launch) compile inside the capture
    experts(x, w, ids, lora_ids, has_lora=True, validate=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(x, w, ids, lora_ids, has_lora=True, validate=False)
    x2, ids2, wts2, _, _, lora2, _ = make_problem(T, K, E, H, I, dtype, device, seed=9)
    x.copy_(x2), ids.copy_(ids2), w.copy_(wts2), lora_ids.copy_(lora2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.lora_experts(x2, wts2, ids2, lora2, w13, w2, bank)
    assert_close_to_reference(out, ref["output"], dtype, "replayed graph")


def test_base_path_under_torch_compile(device):
    """Without adapters LoRAExperts is routed_moe (a registered custom op: the tiled pipeline) under torch.compile,
    and its result is the eager call's (which reads ids and weights unpacked on the triton backend) where the eager
    call takes the tiled pipeline too (not a token-major size: 12 slots over 4 experts; those agree to rounding:
    ``tests/test_token_major.py::test_lora_module_under_torch_compile``)."""
    T, K, E, H, I, dtype = 6, 2, 4, 32, 16, torch.float32
    x, ids, w, w13, w2, _, _ = make_problem(T, K, E, H, I, dtype, device)
    experts = make_experts(w13, w2, "triton", num_experts=E, top_k=K)
    compiled = torch.compile(lambda x, w, ids: experts(x, w, ids, None, validate=False),
                             backend="aot_eager" if device.type == "cpu" else "inductor", fullgraph=True)
    assert torch.equal(compiled(x, w, ids), experts(x, w, ids, None))


@pytest.mark.parametrize("fused, launches", [
    (None, ["decode_segments_w13_shrink"]),  # a small batch takes the fused decode path
    ("decode", ["decode_segments_w13_shrink"]),
    ("tiles", ["shrink_w13_tiles"]),
    ("adapter-loop", ["adapter_loop_decode_launch"]),  # the adapter loop, its decode mode at this size
    ("token-major", ["token_major_moe"]),  # the token-major kernels (their W13 shrink in GEMM1's grid)
    (False, ["per-slot delta", "per-slot delta"]),  # the flow, delta kernel by batch size: per slot here
    ("flow", ["per-slot delta", "per-slot delta"]),
    ("flow-per-slot", ["per-slot delta", "per-slot delta"]),
    ("flow-grouped", ["grouped delta", "grouped delta"]),
])
def test_fused_argument_forces_each_lora_path(fused, launches, device, monkeypatch):
    """``fused=`` forces each of ``LORA_PATHS`` (what tests and benchmarks of one path rely on); the result is right
    on every path."""
    from moelab.backends import triton_backend
    from moelab.kernels import fused_lora
    from moelab.kernels import lora as delta_kernel
    T, K, E, H, I = 3, 2, 4, 32, 16
    x, ids, w, w13, w2, lora_ids, adapters = make_problem(T, K, E, H, I, torch.float32, device)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, backend="triton", fused=fused,
                                 lora=make_bank(adapters, E, 0, H, I, 8, torch.float32, device))
    calls = []
    for module, name in [(fused_lora, "decode_segments_w13_shrink"), (fused_lora, "shrink_w13_tiles"),
                         (fused_lora, "adapter_loop_decode_launch"), (triton_backend, "token_major_moe")]:
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _f=original, **k: calls.append(_n) or _f(*a, **k))
    launch = delta_kernel.lora_shrink_expand_triton
    monkeypatch.setattr(delta_kernel, "lora_shrink_expand_triton", lambda x, a, b, out, segments, **k: calls.append(
        "per-slot delta" if segments is None else "grouped delta") or launch(x, a, b, out, segments, **k))
    out = experts(x, w, ids, lora_ids)
    assert calls == launches
    assert_close_to_reference(out, reference.lora_experts(x, w, ids, lora_ids, w13, w2, experts.lora)["output"],
                              torch.float32, f"fused={fused}")


def test_forced_path_the_backend_cannot_run_raises(device):
    E, K, H, I = 4, 2, 16, 16
    x, ids, w, w13, w2, lora_ids, adapters = make_problem(3, K, E, H, I, torch.float32, device)
    bank = make_bank(adapters, E, 0, H, I, 8, torch.float32, device)
    for path in ("tiles", "decode", "adapter-loop", "token-major"):
        with pytest.raises(ValueError, match="fused.*cannot fold"):
            moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="torch", fused=path)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="torch", fused="flow-per-slot")
    with pytest.raises(ValueError, match="fused: 'flow-per-slot'.*torch fallback"):
        experts(x, w, ids, lora_ids)
    grouped = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="torch", fused="flow-grouped")
    assert_close_to_reference(grouped(x, w, ids, lora_ids),
                              reference.lora_experts(x, w, ids, lora_ids, w13, w2, bank)["output"], torch.float32)


#: aten ops that read device data on the host (or size their output by it, which syncs on CUDA).
SYNCING_OPS = ("_local_scalar_dense", "is_nonzero", "_unique", "unique_", "nonzero", "bincount", "masked_select")


@pytest.mark.parametrize("validate, reads", [(False, 0), (True, 1)])
def test_validate_reads_the_device_at_most_once(validate, reads, device, monkeypatch):
    """validate=False never reads device data; validate=True reads it once (expert ids in range and distinct,
    adapter ids in range and naming set slots, all in one read). The backend is stubbed: this is the module's
    own host work. Fails if a check goes back to torch.unique, bincount or one .tolist() per check."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moelab.backends import get_backend

    T, K, E, H, I = 9, 2, 8, 32, 16
    x, ids, w, w13, w2, _, adapters = make_problem(T, K, E, H, I, torch.float32, device)
    bank = make_bank(adapters, E, 0, H, I, 8, torch.float32, device)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, lora=bank, backend="torch")
    lora_ids = torch.tensor([0, 1, 2, -1, 0, 1, 2, -1, 0], device=device)
    monkeypatch.setattr(get_backend("torch"), "lora_experts", lambda call: call.output)
    host_reads, syncing = [], []
    for method in ("tolist", "item", "__bool__"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method, lambda t, *a, _f=original, _m=method: host_reads.append(_m)
                            or _f(t, *a))

    class Syncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(name in str(func) for name in SYNCING_OPS):
                syncing.append(str(func))
            return func(*args, **(kwargs or {}))

    with Syncs():
        experts(x, w, ids, lora_ids, has_lora=True, validate=validate)
    assert (host_reads, syncing) == (["tolist"] * reads, [])


@pytest.mark.parametrize("config, tma", [((32, 64, 64, 4, 1, 1), False), ((128, 128, 64, 8, 1, 8), False),
                                         ((128, 128, 64, 8, 1, 8), True)], ids=["32-row", "128-row-g8", "128-row-tma"])
@pytest.mark.parametrize("fused", ["decode", "tiles", "adapter-loop", False])
def test_lora_paths_on_the_gpu_tile_shapes(config, tma, fused, device, monkeypatch):
    """Every LoRA path on tile shapes of the GPU table that the interpreter's own 16-row tile never tries: 32-row
    tiles (12-16 rows an expert) and 128-row tiles in the grouped order (Mixtral-sized experts), with the GEMMs'
    pointer loads and with their TMA loads (thresholds lowered to this small shape). Right against the float64
    reference; tokens without an adapter bit for bit the base path on the same tiles."""
    from moelab.backends import triton_backend
    from moelab.kernels import moe_gemm
    from moelab.kernels.moe_gemm import GemmConfig

    monkeypatch.setattr(moe_gemm, "TMA", tma)
    monkeypatch.setattr(moe_gemm, "TMA_MIN_HI", 0)
    monkeypatch.setattr(moe_gemm, "TMA_MIN_HI_GEMM2", 0)
    if tma and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("TMA descriptors need an SM 9.0+ GPU (Hopper)")
    launched = record_tma_choices(monkeypatch)
    monkeypatch.setattr(triton_backend, "choose_config", lambda *a, **k: GemmConfig(*config))
    monkeypatch.setattr(triton_backend, "_layout", triton_backend._layout.__wrapped__)  # uncached: the config above
    T, K, E, H, I = 24, 2, 4, 64, 48  # ~12 rows an expert: one row tile of either size holds several adapters
    x, ids, w, w13, w2, lora_ids, adapters = make_problem(T, K, E, H, I, torch.float32, device)
    experts = moelab.LoRAExperts(w13, w2, num_experts=E, top_k=K, backend="triton", fused=fused,
                                 lora=make_bank(adapters, E, 0, H, I, 8, torch.float32, device))
    out = experts(x, w, ids, lora_ids)
    assert launched and set(launched) == {tma}, f"the GEMMs' TMA loads: expected {tma} at every launch"
    ref = reference.lora_experts(x, w, ids, lora_ids, w13, w2, experts.lora)
    assert_close_to_reference(out, ref["output"], torch.float32, f"fused={fused}, tiles {config}")
    base = experts(x, w, ids, None)
    no_adapter = (lora_ids < 0).to(out.device)
    assert no_adapter.any() and torch.equal(out[no_adapter], base[no_adapter])
