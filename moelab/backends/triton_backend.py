"""Backend "triton": the routed-MoE contract with moelab's own Triton kernels (any CUDA GPU; CPU through the
interpreter), bf16/fp16/fp32, no host synchronisation (CUDA-graph capturable), no alignment requirement.

This module only orchestrates; each step's launcher lives beside its kernels in ``moelab/kernels/``:

    segments by local expert       kernels/segments.py   build_segments_triton (one program up to 1024 slots)
    [fused LoRA: W13 shrink]       kernels/fused_lora.py shrink_w13_tiles, or at decode decode_segments_w13_shrink
                                                         (segments and W13 shrink in one launch)
    GEMM1 + bias + delta + act.    kernels/moe_gemm.py   gemm1_swiglu (+ the LoRA expand; at decode + the W2 shrink)
    [fused LoRA: W2 shrink]        kernels/fused_lora.py shrink_w2_tiles (not at decode)
    GEMM2 + bias                   kernels/moe_gemm.py   gemm2 (+ the LoRA expand)
    finalize                       kernels/finalize.py   finalize_triton

A decode-sized call that asks for the output only (no delta) may run ``kernels/token_major.py`` instead, where
:func:`takes_token_major` says: GEMM1 by slot and GEMM2 with the top-k combine, two launches (a LoRA bank: three).

The tile of the permuted space is the GEMMs' BLOCK_M (``moe_gemm.choose_config``), so a tile never mixes experts.
While a CUDA graph is captured on Hopper or newer, the kernels are chained by programmatic dependent launch
(``moelab._runtime.pdl_launch``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from moelab import _runtime
from moelab.backends import eager_graphs, lora_flow
from moelab.contract import LoRAExpertsCall, MoEWeights, RoutedMoECall, RoutedMoEResult, permuted_rows
from moelab.kernels import fused_lora, gluon_gemm
from moelab.kernels.finalize import finalize_triton
from moelab.kernels.moe_gemm import GemmConfig, choose_config, gemm1_swiglu, gemm2
from moelab.kernels.segments import MAX_CHUNK, build_segments_triton
from moelab.kernels.token_major import token_major_moe
from moelab.lora import LoRABank
from moelab.permutation import max_live_rows

__all__ = ["GemmConfig", "choose_config", "routed_moe", "lora_experts", "fused_lora_reason"]

def unavailable_reason(device: torch.device) -> str | None:
    if not _runtime.HAS_TRITON:
        return "the triton package is not installed"
    if _runtime.triton_can_run(device):
        return None
    return (f"moelab's Triton kernels run on CUDA tensors, or on CPU tensors in Triton's interpreter (where no CUDA "
            f"GPU is found unless TRITON_INTERPRET=0, or anywhere under TRITON_INTERPRET=1); got {device.type}")


def expert_options_reason(**options) -> str | None:
    """Every activation, bias and the router weight on the input run in the GEMMs' epilogues and prologue."""
    return None


def prepare(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return w13.contiguous(), w2.contiguous()  # HF order is the kernels' own layout


@dataclass(frozen=True)
class FusedLoRA:
    """A LoRABank folded into the GEMM tiles (``moelab/kernels/fused_lora.py``).

    ``bank``: a :class:`moelab.LoRABank` over the local experts; ``lora_ids`` int [T] contiguous (-1 = none).
    """

    bank: LoRABank
    lora_ids: torch.Tensor
    mode: str | None = None  # "tiles" or "decode" forces that mode; None: decode up to FUSED_DECODE_MAX_SLOTS slots
    adapter_loop: bool = False  # each row's own adapter (fused_lora.py, "the adapter loop"), else stacked columns


#: Widest stacked bank (L_PAD * R_PAD, :attr:`LoRABank.stacked_pads`) the stacked modes ("tiles", "decode") take;
#: wider banks take the adapter loop (``moelab/kernels/fused_lora.py``, "the adapter loop", which explains the
#: choice; before it they ran vLLM's unfused flow). A prefill tile of GEMM1 holds its expand operands in shared
#: memory, 2 * columns * (BLOCK_M + BLOCK_N) elements: 64 KB at 64 columns, 128x128 bf16 tiles (the pipeline keeps 3
#: of its 4 stages), and every row's expand runs over all stacked columns. Within it the
#: fused path beats the flow at every batch size: one H200, 2026-12-01, main ~64c5e1b, bf16 Qwen3-30B-A3B
#: (E128 K8 H2048 I768), one rank-16 adapter on every token, µs in a CUDA graph, fused (best mode) vs the flow's
#: best mode: T=1 43 vs 75, T=32 276 vs 312, T=128 330 vs 400, T=1024 444 vs 548; eager T=4096 900 vs 1958 (base
#: MoE without LoRA: 40, 268, 309, 404; eager 820). ``python -m moelab.bench --quick --impls moelab --peers none
#: --no-ceilings --lora --lora-variants "1x all,8x mixed" --lora-paths auto,tiles,decode,flow-grouped,flow-per-slot``
#: (BENCHMARKS.md, "LoRA paths"). Wider banks (8 adapters up to rank 64 stack 512) take the adapter loop or the
#: flow: ``ADAPTER_LOOP_MAX_ROWS_PER_EXPERT`` below.
MAX_FUSED_LORA_COLUMNS = 64


def stacked_fits(bank: LoRABank) -> bool:
    """Whether the stacked modes take ``bank`` (at most ``MAX_FUSED_LORA_COLUMNS`` stacked columns)."""
    return math.prod(bank.stacked_pads) <= MAX_FUSED_LORA_COLUMNS


def fused_lora_reason(bank: LoRABank, path: str | None = None) -> str | None:
    """None when :func:`lora_experts` can fold ``bank`` into the GEMMs: always (the adapter loop takes any bank),
    but the stacked modes ``path`` "tiles" and "decode" only up to ``MAX_FUSED_LORA_COLUMNS`` stacked columns."""
    if path not in ("tiles", "decode") or stacked_fits(bank):
        return None
    return (f"the {path!r} path takes banks of at most {MAX_FUSED_LORA_COLUMNS} stacked columns (max_loras and "
            f"max_rank padded to powers of two, multiplied), got {math.prod(bank.stacked_pads)} stacked columns; "
            f"the 'adapter-loop' path takes any bank")


#: The fused LoRA's decode path (routing metadata and W13 shrink in one launch, the W2 shrink in GEMM1's epilogue,
#: no separate shrink launch) runs up to this many slots (one program builds their segments) on BLOCK_M < 64 tiles.
#: It wins wherever it can run, by less as T grows (same H200 run and command as above, one rank-16 adapter, µs in a
#: CUDA graph, decode vs tiles): T=1 43 vs 51, T=32 276 vs 287, T=128 (1024 slots, the limit) 330 vs 332; beyond,
#: the tiles mode runs (T=1024: 444).
FUSED_DECODE_MAX_SLOTS = MAX_CHUNK

#: Left to itself, ``LoRAExperts`` runs a bank too wide for the stacked modes through the adapter loop while the
#: batch has at most this many routed rows per local expert (T*K / E_local), and vLLM's unfused flow above
#: (``fused=True`` or ``"adapter-loop"``: the adapter loop at every size). Measured on one H200, 2026-12-01, commit
#: d629e95 (BENCHMARKS.md, "Wide LoRA banks"), bf16 Qwen3-30B-A3B (E128 K8 H2048 I768), µs in a CUDA graph
#: (T=16384: eager), adapter loop vs the flow, base MoE 39.6 / 269 / 405 / 2786:
#:     8 adapters, ranks 64-8:   T=1 44.9 vs 81.7,  T=32 376 vs 359,  T=1024 1076 vs 977,   T=16384 4192 vs 4230
#:     32 adapters, ranks 64-8:  T=1 44.9 vs 81.9,  T=32 391 vs 362,  T=1024 2443 vs 1704,  T=16384 5836 vs 4878
#: The loop wins at T=1 (0.06 rows per expert: one row a tile, its adapter's operands read before the K loop) and
#: loses from T=32 (2 rows per expert) on, where tiles hold several adapters and each one past the first costs the
#: epilogue a wait on its loads (and at T >= 1024 the shrinks' per-adapter K loops); at 16384 the 8-adapter bank
#: ties (1 %). 0.5 (T <= 8 here) sits between the two measured points and was not itself measured.
ADAPTER_LOOP_MAX_ROWS_PER_EXPERT = 0.5

#: Where the GEMMs run the Gluon kernels (``_gluon_adapter_loop``: sm_90, 128-row tiles), the adapter loop runs inside
#: them (a tile's adapters packed side by side in a few more K steps of their rings, 8 ranks a unit) and takes a wide
#: bank from this many routed rows per (local expert, bank slot) on: T*K / (E_local * max_loras). Its K steps compute
#: all 128 rows of a tile for the tile's adapters, so they pay where each adapter fills a good part of a tile. H100,
#: 2026-12-06, ``scripts/profile_lora_banks.py`` (GPU µs of the call's kernels, adapter loop / vLLM's flow in one
#: run), banks of ranks 64/32/16/8, the tiles' packing of 9013e62: 8 rows a pair 1.19 (Qwen3-30B-A3B T = 4096, 32
#: adapters), 32 rows 0.93 (T = 4096 with 8) and 0.91 (T = 16384 with 32), 128 rows 0.80 (T = 16384 with 8); before
#: the packed steps (fc8ff7d) also 16 rows 1.20 (OLMoE T = 4096, 32), 64 rows 0.91 (OLMoE), 256 rows 0.84. 32 is
#: the lowest measured point where the loop wins; 9-31 rows were not measured on the packed steps.
#: It counts the bank's slots (``max_loras``), known on the host, not the adapters a batch uses (that would take a
#: device sync): a bank of 32 slots with 4 in use counts 32, and keeps the flow longer than it needs to.
GLUON_ADAPTER_LOOP_MIN_ROWS_PER_PAIR = 32


#: When the two-launch token-major path (``moelab/kernels/token_major.py``) runs instead of the tiled pipeline, for
#: calls that ask for the output only (the permuted intermediates, ``do_finalize=False`` or a delta always take the
#: tiled pipeline). ``LoRAExperts`` on its fused paths follows the same rule with and without adapters (its base rows
#: then equal its LoRA path's bit for bit, both token-major or both tiled), its bank adding one launch; with
#: ``fused=False`` and under ``torch.compile`` it keeps the tiled pipeline:
#:
#: - eagerly, at most ``TOKEN_MAJOR_MAX_SLOTS`` slots (T*K) that rarely share an expert
#:   (``TOKEN_MAJOR_EXPERTS_PER_SLOT`` local experts or more per slot: each slot streams its expert's weights
#:   itself) and whose weights are few enough (``TOKEN_MAJOR_MAX_BYTES``) that the call is host-bound: two launches
#:   cost the host less than four. One token has no byte limit: its K slots read K distinct experts on either path,
#:   and in graphs the two paths' GPU times tie or the token-major one wins at 200-704 MB (GPT-OSS-20B, DeepSeek-V3,
#:   Mixtral below; it loses 9-17 % at 100-104 MB of small experts: OLMoE, E64 K6), while the tiled pipeline's four
#:   launches cost an eager call 2-3x its GPU time. Not measured between 200 MB and the 256 MB limit's first case
#:   past it (E128 K8 H4096 I1536: 302 MB, 3.16x eagerly on the tiled pipeline);
#: - eagerly and in CUDA graphs, one token whose experts are large (``TOKEN_MAJOR_BIG_EXPERT_BYTES`` each): the
#:   token-major GEMMs then beat the tiled ones on the GPU itself;
#: - in CUDA graphs otherwise up to ``TOKEN_MAJOR_MAX_SLOTS_GRAPH`` slots that rarely share an expert (as eagerly),
#:   since the token-major loops are pipelined (``choose_token_major_config``, 2026-12-04): two launches instead of
#:   four, each GEMM as fast as the tiled one or faster. H200, ``scripts/host_cost.py --layers 4`` (four layers in
#:   turn in one graph, µs a layer), T = 1, tiled against token-major: Qwen3-30B-A3B 30.0 against 23.2, OLMoE 36.6-36.8
#:   against 36.3-36.4, E64 K6 38.2 against 36.8-36.9, GPT-OSS-20B 64.4-64.5 against 63.2; ``scripts/token_major_ab.py``
#:   (one call a graph) at T = 2: Qwen3 55.2 against 51.9, OLMoE 74.3 against 67.5, E64 K6 71.8 against 67.1,
#:   GPT-OSS 120.0 against 120.4. ``LoRAExperts`` with a bank takes it in graphs from
#:   ``TOKEN_MAJOR_MIN_SLOTS_GRAPH_LORA`` to ``TOKEN_MAJOR_MAX_SLOTS_GRAPH_LORA`` slots (two launches, the W13
#:   shrink in GEMM1's grid): one rank-16 adapter, four layers in one graph, µs a layer, tiled against token-major
#:   (``PART=fused bash scripts/device_prefetch.sh`` at 69f4d6d, two rounds; the base call of the same run in
#:   brackets): T = 1 Qwen3 (8 slots) 34.0-34.1 against 29.2 (23.0), OLMoE 41.0-41.1 against 37.6-37.7 (36.6), E64 K6
#:   (6 slots) 41.2-41.3 against 39.6-39.7 (37.1), but GPT-OSS's 4 slots 66.0 against 67.4-67.7 (62.1); at T = 2
#:   (16 slots; GPT-OSS 8) token-major 43.9-44.0 (42.5), 53.2 (53.1), 58.8-59.0 (57.5), GPT-OSS 108.4-108.6 against
#:   the tiled 110.0-110.6 (105.8). With the shrink as a launch of its own before GEMM1 (c464b25-c84b30f) one token
#:   lost to the tiled pipeline (8 slots: Qwen3 34.2-34.3 against 33.9-34.0), so the window began at 9 slots then.
#:   Before the pipelined loops the tiled pipeline was as fast or faster at most points.
#:
#: One H200, 2026-12-02, commit 4d268ac, bf16, µs, token-major against tiled (``scripts/token_major_ab.py``;
#: BENCHMARKS.md, "The token-major decode path"). Eager: Qwen3-30B-A3B T=1 50-126 against 123-287 (the bench: 45
#: against 38 in a graph), T=2 53 against 139; OLMoE T=2 68 against 160; GPT-OSS-20B T=2 (8 slots over 32 experts,
#: 400 MB) 135 against 187 but 158 against 153 in the run before; Mixtral T=2 (4 slots over 8 experts) 326 against
#: 272. In graphs, T=1: Mixtral (352 MB an expert) 196 against 229, DeepSeek-V3 (88 MB) 189 against 195, GPT-OSS
#: (50 MB) 75.0 against 75.0, Qwen3 39.1 against 38.5, OLMoE 50.6 against 46.3.
TOKEN_MAJOR_MAX_SLOTS = 16
TOKEN_MAJOR_EXPERTS_PER_SLOT = 4
TOKEN_MAJOR_MAX_BYTES = 256 * 2**20
TOKEN_MAJOR_BIG_EXPERT_BYTES = 64 * 2**20
TOKEN_MAJOR_MAX_SLOTS_GRAPH = 16
TOKEN_MAJOR_MIN_SLOTS_GRAPH_LORA = 5
TOKEN_MAJOR_MAX_SLOTS_GRAPH_LORA = 16


def takes_token_major(T: int, K: int, do_finalize: bool, has_delta: bool, capturing: bool = False, *,
                      num_local_experts: int | None = None, expert_bytes: int = 0, lora: bool = False) -> bool:
    """Whether :func:`routed_moe` runs ``T`` tokens of ``K`` experts on the token-major path, eagerly or
    (``capturing``) while a CUDA graph is captured; ``num_local_experts`` (None: not limited) and
    ``expert_bytes`` (one expert's weights) as ``TOKEN_MAJOR_MAX_SLOTS`` explains; ``lora``: a ``LoRAExperts``
    call with a bank (its own limit in graphs)."""
    slots = T * K
    if not do_finalize or has_delta or slots == 0:
        return False
    if T == 1 and expert_bytes >= TOKEN_MAJOR_BIG_EXPERT_BYTES:
        return True
    few_shared = num_local_experts is None or TOKEN_MAJOR_EXPERTS_PER_SLOT * slots <= num_local_experts
    if capturing and lora:
        return few_shared and TOKEN_MAJOR_MIN_SLOTS_GRAPH_LORA <= slots <= TOKEN_MAJOR_MAX_SLOTS_GRAPH_LORA
    if capturing:
        return few_shared and slots <= TOKEN_MAJOR_MAX_SLOTS_GRAPH
    return slots <= TOKEN_MAJOR_MAX_SLOTS and few_shared and (T == 1 or slots * expert_bytes <= TOKEN_MAJOR_MAX_BYTES)


def _gluon_call(expert: dict, weight_on_input: bool, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the Gluon GEMMs take this call on 128-row tiles, as far as its experts (the activation keywords
    ``expert``; empty: SwiGLU), shapes and strides tell (the same in the fake: no pointer's alignment;
    ``gluon_gemm.takes_gluon_gemm1`` has the last word)."""
    return (gluon_gemm.runs_activation(expert.get("activation", "silu"), expert.get("gated", True), weight_on_input)
            and gluon_gemm.takes_shapes_of(x, w13, w2))


def _expert_bytes(w13: torch.Tensor, w2: torch.Tensor) -> int:
    """Bytes of one local expert's w13 and w2 (shape arithmetic: ``w13[0]`` would build a view, ~8 µs of host)."""
    return (w13.shape[1] * w13.shape[2] + w2.shape[1] * w2.shape[2]) * w13.element_size()


def _pipeline(routing: torch.Tensor, expert_weights: torch.Tensor | None, x: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, num_experts: int, local_expert_offset: int, delta: torch.Tensor | None,
              do_finalize: bool, output: torch.Tensor | None = None,
              config: GemmConfig | None = None, lora: FusedLoRA | None = None,
              round_weights: bool = False, expert: dict | None = None, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, weight_on_input: bool = False,
              token_major: bool = False) -> tuple[torch.Tensor, ...]:
    """Segments -> [LoRA shrink] -> GEMM1(+delta, SwiGLU) -> GEMM2 -> finalize. Returns (output, gemm2, e2p, act).

    ``routing``: int32 [T, K] packed words when ``expert_weights`` is None (the kernels decode them), else
    the int ids beside the caller's ``expert_weights`` [T, K] (contiguous). ``round_weights``: the finalize
    weights the base term by bf16(w), as a packing would have rounded it. ``lora`` (ids and weights only, with
    ``round_weights``): fold a LoRA bank into the GEMMs, its term weighted by w; gemm2 then holds base + LoRA
    terms and is only meant for the finalize. ``expert``: the activation keywords of :func:`moelab.prepare_weights`
    (``activation, gated, swiglu_alpha, swiglu_limit``; None: SwiGLU); ``w13_bias``/``w2_bias`` the GEMMs' biases;
    ``weight_on_input``: each slot's input row is scaled by its weight and the finalize sums unweighted.
    ``token_major``: where :func:`takes_token_major` says so, run the two-launch path instead (then gemm2, e2p and
    act come back None: nothing asked for them).
    """
    packed = expert_weights is None
    if lora is not None and (packed or not round_weights):
        raise ValueError("lora: the fused LoRA path takes (ids, expert_weights) routing and round_weights=True")
    T, K = routing.shape
    expert = expert or {}
    E_local, H = w13.shape[0], w13.shape[2]
    I = w13.shape[1] // (2 if expert.get("gated", True) else 1)
    expert_bytes = _expert_bytes(w13, w2)
    if token_major and lora is None and not round_weights and takes_token_major(
            T, K, do_finalize, delta is not None, x.is_cuda and torch.cuda.is_current_stream_capturing(),
            num_local_experts=E_local, expert_bytes=expert_bytes):
        if output is None:
            output = torch.empty(T, H, dtype=x.dtype, device=x.device)
        token_major_moe(routing, expert_weights, x, w13, w2, output, local_expert_offset=local_expert_offset,
                        w13_bias=w13_bias, w2_bias=w2_bias, weight_on_input=weight_on_input,
                        pdl=_runtime.pdl_launch(x.device), **expert)
        return output, None, None, None
    lora_columns = 0
    if lora is not None:  # the operands the GEMM tiles hold across the K loop (the adapter loop: one adapter's)
        lora_columns = fused_lora.own_rank_pad(lora.bank) if lora.adapter_loop else math.prod(lora.bank.stacked_pads)
    device = x.device
    cfg, act_rows, gemm2_rows, reach = _layout(T, K, E_local, I, H, num_experts, x.dtype, lora_columns, device,
                                               config, lora is not None and lora.adapter_loop, expert_bytes,
                                               _gluon_call(expert, weight_on_input, x, w13, w2))
    pdl = _runtime.pdl_launch(device)  # in a CUDA graph, each kernel is scheduled as the previous one ends
    act = torch.empty(act_rows, I, dtype=x.dtype, device=device)
    gemm2_out = torch.empty(gemm2_rows, H, dtype=x.dtype, device=device)
    dead_fill = _runtime.dead_row_fill()
    # The GEMM grids cover the rows live data can reach (the segments' rows); FlashInfer's 128 KiB floor can make a
    # buffer taller (tiny H or I, decode): that tail is filled here instead of by thousands of do-nothing programs.
    if act_rows > reach:
        act[reach:].fill_(dead_fill)
    if gemm2_rows > reach:
        gemm2_out[reach:].fill_(dead_fill)
    lora_args = None  # the GEMMs' LoRA operands (moelab/kernels/fused_lora.py), by mode
    decode = lora is not None and (lora.mode == "decode" or (
        lora.mode is None and cfg.block_m < 64 and T * K <= FUSED_DECODE_MAX_SLOTS))
    if decode:  # segments + W13 shrink in one launch
        launch = fused_lora.adapter_loop_decode_launch if lora.adapter_loop else fused_lora.decode_segments_w13_shrink
        lora_args = launch(routing, x, lora.bank, lora.lora_ids, expert_weights, num_local_experts=E_local,
                           tile=cfg.block_m, local_expert_offset=local_expert_offset, pdl=pdl)
    if lora_args is not None:
        seg = lora_args.segments
    elif lora is not None and lora.adapter_loop and fused_lora.sorts_by_adapter(
            T * K, E_local, lora.bank.max_loras,
            fused_lora.adapter_sub_m(T * K, E_local, cfg.block_m, lora.bank.max_loras)):
        seg = fused_lora.adapter_sorted_segments(routing, lora.lora_ids, lora.bank.max_loras, E_local, cfg.block_m,
                                                 local_expert_offset, pdl)  # each expert's rows by adapter
    else:
        seg = build_segments_triton(routing, E_local, cfg.block_m, offset=local_expert_offset, packed=packed, pdl=pdl)
    if lora is not None and lora_args is None:  # prefill: a W13 shrink launch before GEMM1, a W2 shrink after
        shrink = fused_lora.adapter_loop_shrink_w13 if lora.adapter_loop else fused_lora.shrink_w13_tiles
        lora_args = shrink(x, lora.bank, lora.lora_ids, expert_weights, seg, top_k=K, num_local_experts=E_local,
                           pdl=pdl)
    input_weights = (routing if packed else expert_weights) if weight_on_input else None
    gemm1_swiglu(x, w13, act, seg, top_k=K, config=cfg, delta=delta, lora=lora_args, dead_fill=dead_fill, pdl=pdl,
                 bias=w13_bias, input_weights=input_weights, **expert)
    if isinstance(lora_args, fused_lora.TileLoRA):
        fused_lora.shrink_w2_tiles(act, lora_args)
    elif isinstance(lora_args, fused_lora.AdapterLoopLoRA) and not lora_args.decode:
        fused_lora.adapter_loop_shrink_w2(act, lora_args)
    gemm2(act, w2, gemm2_out, seg, config=cfg, lora=lora_args, dead_fill=dead_fill, pdl=pdl, bias=w2_bias)
    if do_finalize:
        if output is None:
            output = torch.empty(T, H, dtype=x.dtype, device=device)
        if weight_on_input:  # the weights went into the inputs: sum the expert outputs unweighted
            finalize_triton(output, gemm2_out, torch.ones(T, K, device=device), seg.slot_to_row, None, pdl=pdl)
        else:
            finalize_triton(output, gemm2_out, routing if packed else expert_weights, seg.slot_to_row, None,
                            packed_weights=packed, round_weights=round_weights, pdl=pdl)
    else:
        output = x.new_empty(T, 0)  # FlashInfer's placeholder when nothing is finalized
    return output, gemm2_out, seg.slot_to_row, act


def _no_intermediates(x: torch.Tensor, routing: torch.Tensor, H: int, I: int) -> tuple[torch.Tensor, ...]:
    """Empty (gemm2 [0, H], e2p [0], act [0, I]): what a call that asks for the output only gets back."""
    return x.new_empty(0, H), routing.new_empty(0, dtype=torch.int32), x.new_empty(0, I)


@functools.lru_cache(maxsize=4096)
def _layout(T: int, K: int, E_local: int, I: int, H: int, num_experts: int, dtype: torch.dtype, lora_columns: int,
            device: torch.device, config: GemmConfig | None,
            lora_own: bool = False, expert_bytes: int = 0,
            gluon_call: bool = False) -> tuple[GemmConfig, int, int, int]:
    """The pipeline's host arithmetic, computed once per shape (decode calls are host-bound): the tile config
    (``config``, else :func:`choose_config`'s for experts of ``expert_bytes``), the rows of the act and gemm2
    buffers (FlashInfer's sizes) and the rows live data can reach."""
    cfg = config or choose_config(T, K, E_local, dtype, lora_columns, device=device, lora_own=lora_own,
                                  expert_bytes=expert_bytes, gluon_call=gluon_call)
    return (cfg, permuted_rows(T, K, num_experts, cfg.block_m, I), permuted_rows(T, K, num_experts, cfg.block_m, H),
            max_live_rows(T * K, E_local, cfg.block_m))


@torch.library.custom_op("moelab::triton_routed_moe", mutates_args=())
def _routed_moe_op(routing: torch.Tensor, expert_weights: torch.Tensor | None, hidden_states: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor, num_experts: int, local_expert_offset: int,
                   gemm1_lora_delta: torch.Tensor | None, do_finalize: bool, activation: str = "silu",
                   gated: bool = True, swiglu_alpha: float | None = None, swiglu_limit: float | None = None,
                   w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                   weight_on_input: bool = False, token_major: bool = True) -> list[torch.Tensor]:
    """The whole pipeline as one opaque op, so torch.compile traces through it (see :func:`routed_moe`). A call
    that asks for the output only returns empty intermediates, whichever path ran (the fake cannot know which)."""
    expert = dict(activation=activation, gated=gated, swiglu_alpha=swiglu_alpha, swiglu_limit=swiglu_limit)
    outs = list(_pipeline(routing, expert_weights, hidden_states, w13, w2, num_experts, local_expert_offset,
                          gemm1_lora_delta, do_finalize, expert=expert, w13_bias=w13_bias, w2_bias=w2_bias,
                          weight_on_input=weight_on_input, token_major=token_major))
    if do_finalize and gemm1_lora_delta is None:
        return [outs[0], *_no_intermediates(hidden_states, routing, w2.shape[1], w2.shape[2])]
    return outs


@_routed_moe_op.register_fake
def _routed_moe_fake(routing, expert_weights, hidden_states, w13, w2, num_experts, local_expert_offset,
                     gemm1_lora_delta, do_finalize, activation="silu", gated=True, swiglu_alpha=None,
                     swiglu_limit=None, w13_bias=None, w2_bias=None, weight_on_input=False, token_major=True):
    T, K = routing.shape
    E_local, H = w13.shape[0], w13.shape[2]
    two_i = w13.shape[1] * (1 if gated else 2)
    x = hidden_states
    if do_finalize and gemm1_lora_delta is None:
        return [x.new_empty(T, H), *_no_intermediates(x, routing, H, two_i // 2)]
    tile = choose_config(T, K, E_local, hidden_states.dtype, device=hidden_states.device,
                         expert_bytes=_expert_bytes(w13, w2),  # the pipeline's tile (its _layout)
                         gluon_call=_gluon_call(dict(activation=activation, gated=gated), weight_on_input,
                                                hidden_states, w13, w2)).block_m
    return [x.new_empty(T, H if do_finalize else 0),
            x.new_empty(permuted_rows(T, K, num_experts, tile, H), H),
            routing.new_empty(T * K, dtype=torch.int32),
            x.new_empty(permuted_rows(T, K, num_experts, tile, two_i // 2), two_i // 2)]


def _expert_options(W: MoEWeights) -> dict:
    """The activation keywords of the weights, as :func:`moelab.kernels.moe_gemm.gemm1_swiglu` takes them (none
    for plain SwiGLU)."""
    if W.activation == "silu" and W.gated and W.swiglu_limit is None:
        return {}
    return dict(activation=W.activation, gated=W.gated, swiglu_alpha=W.swiglu_alpha, swiglu_limit=W.swiglu_limit)


def routed_moe(call: RoutedMoECall, config: GemmConfig | None = None, token_major: bool = True) -> RoutedMoEResult:
    """Eager calls run the pipeline directly (no dispatcher overhead, ``output`` written in place); under
    ``torch.compile`` it goes through the registered custom op ``moelab::triton_routed_moe``. A few slots take the
    token-major path (:func:`takes_token_major`) unless ``config`` names the tiles or ``token_major`` is False.
    Eager decode calls that ``eager_graphs.takes`` replay a CUDA graph of the pipeline instead."""
    W = call.weights
    if token_major and config is None and eager_graphs.takes(call, _eager_cost):
        return RoutedMoEResult(eager_graphs.run(call, _graph_pipeline), None, None, None)
    routing = call.packed if call.packed is not None else call.topk_ids
    weights = None if call.packed is not None else call.expert_weights.contiguous()  # the kernel's stride is 1
    args = (routing, weights, call.hidden_states, W.gemm1_weights, W.gemm2_weights,
            call.num_experts, call.local_expert_offset, call.gemm1_lora_delta, call.do_finalize)
    options = dict(w13_bias=W.gemm1_bias, w2_bias=W.gemm2_bias, weight_on_input=call.apply_router_weight_on_input,
                   token_major=token_major and config is None)
    if torch.compiler.is_compiling():
        output, gemm2, e2p, act = _routed_moe_op(*args, **_expert_options(W), **options)
        if call.output is not None:
            output = call.output.copy_(output)
    else:
        output, gemm2, e2p, act = _pipeline(*args, output=call.output, config=config, expert=_expert_options(W),
                                            **options)
    return RoutedMoEResult(output if call.do_finalize else None, gemm2, e2p, act)


def _eager_cost(call: RoutedMoECall) -> tuple[int, int]:
    """One local expert's bytes and the launches ``call`` runs eagerly: 2 on the token-major path, else 4
    (segments, GEMM1, GEMM2, finalize) — what ``eager_graphs.takes`` weighs."""
    W = call.weights
    expert_bytes = _expert_bytes(W.gemm1_weights, W.gemm2_weights)
    token_major = takes_token_major(call.hidden_states.shape[0], call.top_k, True, False,
                                    num_local_experts=W.num_local_experts, expert_bytes=expert_bytes)
    return expert_bytes, 2 if token_major else 4


#: Triton launches of vLLM's flow (``lora_flow``) at decode sizes, as ``scripts/host_cost.py`` counted them on the
#: H200 (8 adapters, T = 8 and 32): the unfinalized routed MoE's three (segments, GEMM1, GEMM2) and the flow's four.
FLOW_LAUNCHES = 7
#: Triton launches of the stacked bank's tiles mode (past ``FUSED_DECODE_MAX_SLOTS`` slots), as
#: ``scripts/host_cost.py --lora 16 --launches`` counted them at Qwen3-30B-A3B T = 1024: the segments' two (count and
#: scatter: more than ``MAX_CHUNK`` slots), the W13 shrink, GEMM1, the W2 shrink, GEMM2 and the finalize.
TILES_LAUNCHES = 7


def _lora_eager_cost(call: LoRAExpertsCall) -> tuple[int, int]:
    """As :func:`_eager_cost`, for a ``lora_experts`` call, counted as the module's call with adapters would run
    eagerly whether this batch has any (so a batch without adapters replays or launches as one with them does,
    and its rows stay bit for bit theirs): vLLM's flow ``FLOW_LAUNCHES``; the token-major path its 2, as the base
    call's (the W13 shrink runs in GEMM1's grid); the fused tiles 4 in their decode mode, ``TILES_LAUNCHES`` past it
    (left to the module: a forced path counts 4)."""
    expert_bytes, launches = _eager_cost(call)  # 2: the token-major path, as the rule would take it
    bank = call.lora if call.lora is not None else call.bank
    if call.path not in (None, "token-major") or (bank is not None and not call.fused):
        launches = 4  # a forced tiled path, or a bank the module runs unfused
    elif call.path == "token-major":
        launches = 2
    if (bank is not None and not call.fused) or (launches == 4 and _wide_past_crossover(call, bank)):
        return expert_bytes, FLOW_LAUNCHES
    if launches == 4 and call.path is None and bank is not None and call.topk_ids.numel() > FUSED_DECODE_MAX_SLOTS:
        if _wide(call, bank):  # the adapter loop in tiles (Gluon): one more where it sorts the rows by adapter
            slots, E_local = call.topk_ids.numel(), call.weights.num_local_experts
            return expert_bytes, TILES_LAUNCHES + fused_lora.sorts_by_adapter(
                slots, E_local, bank.max_loras, fused_lora.adapter_sub_m(slots, E_local, 128, bank.max_loras))
        return expert_bytes, TILES_LAUNCHES
    return expert_bytes, launches


def _lora_unfused(call: LoRAExpertsCall) -> bool:
    """Whether :func:`lora_experts` runs ``call`` through vLLM's flow whatever its size: a bank the module runs
    unfused, or the base MoE under ``torch.compile`` (its one registered op)."""
    return not (call.fused if call.lora is not None else not torch.compiler.is_compiling())


def _wide_past_crossover(call: LoRAExpertsCall, bank: LoRABank | None) -> bool:
    """Whether ``call`` with ``bank`` (``call.lora``, or the module's) is too wide for the stacked modes, left to the
    module (no path forced), with more routed rows per local expert than the adapter loop's crossover, and GEMMs
    that would not fold the adapter loop into the Gluon kernels: vLLM's flow then takes it, unless the token-major
    path does first."""
    rows_bound = ADAPTER_LOOP_MAX_ROWS_PER_EXPERT * call.weights.num_local_experts
    return _wide(call, bank) and call.topk_ids.numel() > rows_bound and not _gluon_adapter_loop(call, bank)


def _gluon_adapter_loop(call: LoRAExpertsCall, bank: LoRABank) -> bool:
    """Whether the module takes ``bank``'s adapter loop inside the Gluon GEMMs for ``call``: at least
    ``GLUON_ADAPTER_LOOP_MIN_ROWS_PER_PAIR`` rows per (local expert, slot), and GEMMs that would run it there:
    ``gluon_gemm.runs_on`` the device, 128-row tiles, plain SwiGLU without biases, bf16 or fp16, ranks in 16-byte
    rows (``max_rank`` a multiple of 8), contiguous weights, x rows ``gluon_gemm.gathers_rows_of`` (the gates'
    conditions known before the pipeline's buffers exist; the gates have the last word: where they refuse, the
    Triton kernels run the loop)."""
    W, x = call.weights, call.hidden_states
    w13, w2 = W.gemm1_weights, W.gemm2_weights
    rows_per_pair = call.topk_ids.numel() / (W.num_local_experts * bank.max_loras)
    if not (rows_per_pair >= GLUON_ADAPTER_LOOP_MIN_ROWS_PER_PAIR and gluon_gemm.runs_on(x.device)
            and bank.max_rank % 8 == 0 and x.dtype in (torch.bfloat16, torch.float16)
            and not _expert_options(W) and W.gemm1_bias is None and W.gemm2_bias is None
            and w13.is_contiguous() and w2.is_contiguous() and gluon_gemm.gathers_rows_of(x, w13)):
        return False
    T, K = call.topk_ids.shape
    cfg = _layout(T, K, w13.shape[0], w2.shape[2], w13.shape[2], call.num_experts, x.dtype,
                  fused_lora.own_rank_pad(bank), x.device, None, True, _expert_bytes(w13, w2))[0]
    return cfg.block_m == 128


def _wide(call: LoRAExpertsCall, bank: LoRABank | None) -> bool:
    """Whether ``bank`` is too wide for the stacked modes and ``call`` leaves the path to the module."""
    return bank is not None and call.path is None and not stacked_fits(bank)


def _graph_pipeline(routing: torch.Tensor, weights: torch.Tensor | None, x: torch.Tensor,
                    call: RoutedMoECall, output: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``call``'s pipeline on these inputs (the buffers ``eager_graphs`` captures it over), into ``output`` or an
    output allocated."""
    W = call.weights
    return _pipeline(routing, weights, x, W.gemm1_weights, W.gemm2_weights, call.num_experts,
                     call.local_expert_offset, None, True, output, expert=_expert_options(W), w13_bias=W.gemm1_bias,
                     w2_bias=W.gemm2_bias, weight_on_input=call.apply_router_weight_on_input, token_major=True)


def lora_experts(call: LoRAExpertsCall) -> torch.Tensor:
    """:class:`moelab.LoRAExperts` on this backend. With ``call.fused`` (or no adapter in the batch) it runs the base
    pipeline, the bank folded into its GEMMs (the W13 and W2 shrinks, extra launches but at decode; no [T,K,2I] or
    [T,K,H] delta); else, and for the base MoE under ``torch.compile`` (one registered custom op), vLLM's unfused
    flow. The pipeline reads the ids and the caller's weights directly (no packing launches) and weights the base
    term by bf16(w), as the packed routed MoE does, so every token without an adapter is bit for bit the base
    call's of the same mode: both take the same GEMMs, the tiled pipeline or, eagerly on the fused paths where
    :func:`takes_token_major` says (or ``fused="token-major"``), the token-major kernels with each token's adapter
    (``routed_moe``'s token-major calls weight by the packed bf16(w) too, but agree with the tiled GEMMs to rounding
    only; so does ``torch.compile``'s tiled op with an eager token-major call)."""
    if eager_graphs.takes_lora(call, _lora_eager_cost):
        return eager_graphs.run_lora(call, _lora_experts_launches)
    return _lora_experts_launches(call)


def _lora_experts_launches(call: LoRAExpertsCall) -> torch.Tensor:
    """:func:`lora_experts`' launches, into ``call.output``."""
    tiled = functools.partial(routed_moe, token_major=False)
    flow = functools.partial(lora_flow.lora_experts, routed_moe=tiled, pack=False)  # the kernels read the ids
    if _lora_unfused(call):
        return flow(call)
    if _lora_token_major(call):
        return call.output
    if _wide_past_crossover(call, call.lora):
        return flow(call)
    if call.hidden_states.shape[0] == 0:
        return call.output
    weights = _kernel_weights(call.topk_weights)
    lora = None
    if call.lora is not None:  # the stacked modes for a narrow bank, the adapter loop for a wide one (or forced)
        adapter_loop = _wide(call, call.lora) or call.path == "adapter-loop"
        lora = FusedLoRA(call.lora, call.lora_ids.contiguous(), call.path if not adapter_loop else None, adapter_loop)
    if lora is not None and lora.mode == "decode" and call.topk_ids.numel() > FUSED_DECODE_MAX_SLOTS:
        raise ValueError(f"fused: the decode mode takes at most {FUSED_DECODE_MAX_SLOTS} slots (T*K), got "
                         f"{call.topk_ids.numel()}; pass fused=True or 'tiles'")
    W = call.weights
    _pipeline(call.topk_ids.contiguous(), weights.contiguous(), call.hidden_states, W.gemm1_weights,
              W.gemm2_weights, call.num_experts, call.local_expert_offset, None, True, output=call.output, lora=lora,
              round_weights=True, expert=_expert_options(W), w13_bias=W.gemm1_bias, w2_bias=W.gemm2_bias)
    return call.output


def _kernel_weights(topk_weights: torch.Tensor) -> torch.Tensor:
    """The routing weights as the kernels read them: float64 ones in fp32, others as they are."""
    return topk_weights.float() if topk_weights.dtype == torch.float64 else topk_weights


def _lora_token_major(call: LoRAExpertsCall) -> bool:
    """Run ``call`` (bank or not) on the token-major path into ``call.output`` where it takes it: forced by
    ``fused="token-major"``, or left to the module where :func:`takes_token_major` says (the batch's adapters do not
    enter the rule, so a call with and one without them take the same path). Never for a module whose bank takes
    vLLM's flow (``fused=False``: its LoRA calls run the tiled pipeline, so its base calls do too), nor under
    ``torch.compile`` (the base call is then the tiled pipeline's registered op)."""
    W, x = call.weights, call.hidden_states
    T, K = call.topk_ids.shape
    if torch.compiler.is_compiling() or (call.bank is not None and not call.fused):
        return False
    if call.path != "token-major" and (call.path is not None or not takes_token_major(
            T, K, True, False, x.is_cuda and torch.cuda.is_current_stream_capturing(),
            num_local_experts=W.num_local_experts, expert_bytes=_expert_bytes(W.gemm1_weights, W.gemm2_weights),
            lora=call.bank is not None)):
        return False
    weights = _kernel_weights(call.topk_weights)
    # The module's bank also without adapters in this batch: the same kernels run, none of its slots adding anything
    # (a bank on another device cannot take a LoRA call at all: its base calls keep the plain kernels)
    bank = call.lora or (call.bank if call.bank is not None and call.bank.device == x.device else None)
    token_major_moe(call.topk_ids.contiguous(), weights.contiguous(), x, W.gemm1_weights, W.gemm2_weights, call.output,
                    local_expert_offset=call.local_expert_offset, w13_bias=W.gemm1_bias, w2_bias=W.gemm2_bias,
                    pdl=_runtime.pdl_launch(x.device), round_weights=True, bank=bank,
                    lora_ids=None if call.lora is None else call.lora_ids.contiguous(), **_expert_options(W))
    return True
