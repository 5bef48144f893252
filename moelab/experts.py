"""``LoRAExperts``: vLLM's ``TrtLlmBf16LoRAExperts.apply`` flow as an ``nn.Module`` on every backend.

The module validates a call and hands it to its backend's ``lora_experts`` as a
:class:`moelab.contract.LoRAExpertsCall`; every backend can run vLLM's unfused flow
(:mod:`moelab.backends.lora_flow`):

    pack routing -> [fast path: no token has an adapter -> finalized base MoE straight into ``output``]
    W13 delta [T,K,2I] in [up, gate] order -> routed MoE, unfinalized (gemm2 [R2,H], act [R1,I], map [T*K])
    -> unpermute act to [T*K, I] (non-local rows zero) -> W2 delta [T,K,H], weighted -> one fused finalize

On the triton backend the same sums run *fused* by default (``fused=True``): small shrink kernels write rank
vectors (at decode inside the routing-metadata launch and GEMM1's epilogue) and the expands live in the grouped
GEMMs' tiles, so neither delta nor the unpermuted activation goes through memory (``moelab/kernels/moe_gemm.py``,
"Fused LoRA"). On that backend the kernels read the ids
and weights unpacked (the base path too), rounding the base term's weights to bf16 as the packing would.
``fused=False`` runs the flow above literally, as the flashinfer backend must (its kernel is closed) and the torch
backend does.

The base term uses the bf16 weights packing produces; the W2 LoRA term the caller's weights (as vLLM does).
A token without an adapter comes out bit-for-bit as the base path computes it (torch and triton backends): on the
flow its delta rows are exact zeros, the GEMMs run the same tiles, and the finalize finishes the base sum before
it adds the (zero) LoRA sum; on the fused path its rank vectors are exact zeros, so the GEMM epilogues add exact
zeros to the same accumulators. Both rest on a finite bank (``LoRABank`` rejects inf and NaN): a fused tile
multiplies every adapter's B by the other rows' zeros. At decode the fused path sums the W2 shrink over GEMM1's
column blocks with fp32 atomics, so a token *with* an adapter may differ in its last bit from run to run
(``fused=False`` is bitwise reproducible).
"""

from __future__ import annotations

import torch
from torch import nn

from moelab._checks import (
    FLOAT_DTYPES,
    INT_DTYPES,
    MAX_EXPERTS,
    check_dtype,
    check_int,
    check_same_device,
    check_same_rows,
    check_tensor,
    dtype_name,
)
from moelab.backends import eager_graphs, get_backend
from moelab.contract import LoRAExpertsCall
from moelab.lora import LoRABank, bank_layout_ok, check_bank_layout, check_ids_once
from moelab.moe import _plain_call_ok as _plain_routed_call_ok
from moelab.moe import prepare_weights, validate_call
from moelab.packing import check_routing

__all__ = ["LoRAExperts"]

#: Every LoRA path of :class:`LoRAExperts`, by the name ``fused=`` forces it with (tests, benchmarks):
#:     "tiles"          fused, stacked columns: shrink launches over the GEMMs' tiles (what prefill takes)
#:     "decode"         fused, stacked columns: the routing launch writes the rank vectors, no shrink launch
#:                      (batches of up to ``moelab.backends.triton_backend.FUSED_DECODE_MAX_SLOTS`` slots)
#:     "adapter-loop"   fused, each row's own adapter: the GEMM tiles loop over the adapters present in them
#:                      (any bank; its decode or tile mode by batch size as above)
#:     "token-major"    fused, each token's own adapter in the token-major decode kernels, two launches (any
#:                      bank; ``moelab/kernels/token_major.py``; taken left to itself where the base MoE of the
#:                      same call would take it, ``moelab.backends.triton_backend.takes_token_major``)
#:     "flow"           vLLM's unfused flow, the delta kernel's mode by batch size (what ``fused=False`` runs)
#:     "flow-grouped"   vLLM's unfused flow, the delta kernel over tiles grouped by (adapter, expert)
#:     "flow-per-slot"  vLLM's unfused flow, the delta kernel one program per slot (no grouping; Triton only)
#: Left to itself (None) the module takes the fused path where its backend has one, the flow elsewhere, and the
#: mode by batch size (``moelab.lora.per_slot_by_size`` for the flow's delta kernel). On the triton backend a bank
#: of at most ``MAX_FUSED_LORA_COLUMNS`` stacked columns takes the stacked modes (decode up to 1024 slots, tiles
#: above: BENCHMARKS.md, "LoRA paths"), a wider one the adapter loop at small batches and the flow above
#: (BENCHMARKS.md, "Wide LoRA banks"), but on an sm_90 GPU's 128-row tiles the adapter loop inside the Gluon GEMMs
#: from enough rows per (expert, slot) (BENCHMARKS.md, "Serving banks on the Gluon GEMMs"). The crossovers stand at
#: the constants that choose: ``MAX_FUSED_LORA_COLUMNS``, ``FUSED_DECODE_MAX_SLOTS``,
#: ``ADAPTER_LOOP_MAX_ROWS_PER_EXPERT`` and ``GLUON_ADAPTER_LOOP_MIN_ROWS_PER_PAIR`` of
#: ``moelab.backends.triton_backend``, ``moelab.lora.PER_SLOT_MAX_BYTES``.
LORA_PATHS = ("tiles", "decode", "adapter-loop", "token-major", "flow", "flow-grouped", "flow-per-slot")
FUSED_MODES = LORA_PATHS[:4]


class LoRAExperts(nn.Module):
    """Routed experts with multi-adapter LoRA, FlashInfer's contract on any backend.

    Args:
        w13: [E_local, 2I, H] HF order (rows [gate; up]); w2: [E_local, H, I]; bf16 (any backend) or
            fp16/fp32 (torch and triton backends).
        num_experts: global E; top_k: K; local_expert_offset: this rank's first expert (expert parallel).
        lora: a :class:`moelab.LoRABank` over the same local experts, or None (base MoE only).
        backend: "auto", "flashinfer", "triton" or "torch".
        fused: fold the LoRA into the backend's own kernels (see above). None: where the backend can (the
            triton backend: stacked columns up to ``moelab.backends.triton_backend.MAX_FUSED_LORA_COLUMNS``, L and
            max_rank padded to powers of two and multiplied; a wider bank through the adapter loop at small batches,
            ``ADAPTER_LOOP_MAX_ROWS_PER_EXPERT`` there, and vLLM's flow above, or on an sm_90 GPU's 128-row tiles
            through the adapter loop inside the Gluon GEMMs from ``GLUON_ADAPTER_LOOP_MIN_ROWS_PER_PAIR`` rows per
            (expert, slot)); True: fold at every batch size,
            raise where the backend cannot; False: vLLM's unfused flow. A name of ``LORA_PATHS`` forces that one
            path (tests, benchmarks): "tiles" / "decode" / "adapter-loop" / "token-major", a mode of the fused
            path, or "flow" /
            "flow-grouped" / "flow-per-slot", the unfused flow with that mode of the delta kernel; a path this
            backend or bank cannot run raises.

    Call: ``(hidden_states [T,H], topk_weights [T,K], topk_ids int [T,K] global, lora_ids int [T] or None)
    -> [T, H]`` in the input dtype. Under expert parallelism the result is this rank's partial sum.

    The fast path (no adapter anywhere in the batch) is decided on the host without reading the device:
    from ``has_lora=`` when given, else from ``lora_ids`` when it lives on the CPU (it is then copied to the
    device), else the LoRA path runs (its base tokens are exact anyway). Under CUDA graphs the branch is fixed
    at capture time: pass ``has_lora=`` and ``lora_ids`` already on the device (a copy from pageable host memory
    cannot be captured), and ``validate=False`` (it skips the host-syncing id checks).

    Example:
        >>> E, K, H, I = 4, 2, 32, 16
        >>> experts = LoRAExperts(torch.randn(E, 2 * I, H), torch.randn(E, H, I), num_experts=E, top_k=K,
        ...                       backend="torch")
        >>> ids = torch.tensor([[0, 1], [2, 3]]); w = torch.rand(2, 2)
        >>> experts(torch.randn(2, H), w, ids, None).shape
        torch.Size([2, 32])
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, *, num_experts: int, top_k: int,
                 local_expert_offset: int = 0, lora: LoRABank | None = None, backend: str = "auto",
                 fused: bool | str | None = None):
        super().__init__()
        self.weights = prepare_weights(w13, w2, backend=backend)
        E_local = self.weights.num_local_experts
        check_int("num_experts", num_experts, low=max(1, E_local), high=MAX_EXPERTS)
        check_int("top_k", top_k, low=1, high=num_experts)
        check_int("local_expert_offset", local_expert_offset, low=0, high=num_experts - E_local)
        self.num_experts, self.top_k, self.local_expert_offset = num_experts, top_k, local_expert_offset
        if lora is not None:
            if not isinstance(lora, LoRABank):
                raise TypeError(f"lora: expected a moelab.LoRABank, got {type(lora).__name__}")
            want = (self.weights.num_local_experts, self.weights.hidden_size, self.weights.intermediate_size)
            got = (lora.num_local_experts, lora.hidden_size, lora.intermediate_size)
            if got != want:
                raise ValueError(f"lora: expected a bank over (E_local, H, I) = {want}, got {got}")
            if lora.dtype != self.weights.dtype:
                raise TypeError(f"lora: expected dtype {dtype_name(self.weights.dtype)} (that of the weights), got "
                                f"{dtype_name(lora.dtype)}; make the bank with dtype={self.weights.dtype}")
        self.lora = lora
        self.fused = self._check_fused(fused)
        self._path = fused if isinstance(fused, str) else None
        if fused is True and self.fused and get_backend(self.backend).fused_lora_reason(self.lora, "tiles"):
            self._path = "adapter-loop"  # the one fused path a bank this wide takes, at every batch size

    def _check_fused(self, fused: bool | str | None) -> bool:
        if fused is not None and not isinstance(fused, bool) and fused not in LORA_PATHS:
            raise TypeError(f"fused: expected True, False, None or one of {LORA_PATHS}, got {fused!r}")
        if self.lora is None or fused is False or (isinstance(fused, str) and fused not in FUSED_MODES):
            return False
        backend = get_backend(self.backend)
        reason = backend.fused_lora_reason(self.lora)
        if reason is None and fused in ("tiles", "decode"):  # the stacked modes take narrow banks only
            reason = backend.fused_lora_reason(self.lora, fused)
        if fused and reason is not None:
            raise ValueError(f"fused: backend {self.backend!r} cannot fold this bank into its kernels: {reason}; "
                             f"pass fused=False")
        return reason is None

    @property
    def backend(self) -> str:
        return self.weights.backend

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                lora_ids: torch.Tensor | None = None, *, has_lora: bool | None = None,
                validate: bool = True) -> torch.Tensor:
        """The routed experts with each token's adapter: ``[T, H]`` in the input dtype.

        Args:
            hidden_states: [T, H], the weights' dtype; any strides.
            topk_weights: float [T, K] routing weights (e.g. from :func:`moelab.route`); the base term uses them
                rounded to bf16 as packing does, the W2 LoRA term as given.
            topk_ids: int [T, K] global expert ids in ``[0, num_experts)``, distinct per token.
            lora_ids: int [T] adapter slot of each token, -1 for none; None (or all -1) runs the base MoE.
                Only for experts built with ``lora=``.
            has_lora: whether any token has an adapter, when the caller knows it (CUDA graphs); default: read
                from ``lora_ids`` when it is on the CPU.
            validate: check ids on the device (expert ids in range and distinct, adapter ids in ``[-1, L)`` and
                naming set slots): one host sync. Pass False under CUDA-graph capture and in benchmarks.

        Returns:
            [T, H]: the MoE output plus every token's LoRA; under expert parallelism this rank's partial sum.

        Example:
            >>> import moelab
            >>> E, K, H, I, r = 4, 2, 32, 16, 4
            >>> bank = moelab.LoRABank(2, num_local_experts=E, hidden_size=H, intermediate_size=I, max_rank=r,
            ...                        dtype=torch.float32)
            >>> bank.set(1, gate_a=torch.randn(E, r, H), gate_b=torch.randn(E, I, r), up_a=torch.randn(E, r, H),
            ...          up_b=torch.randn(E, I, r), down_a=torch.randn(E, r, I), down_b=torch.randn(E, H, r))
            >>> experts = LoRAExperts(torch.randn(E, 2 * I, H), torch.randn(E, H, I), num_experts=E, top_k=K,
            ...                       lora=bank, backend="torch")
            >>> x = torch.randn(3, H); weights, ids = moelab.route(torch.randn(3, E), K)
            >>> out = experts(x, weights, ids, torch.tensor([1, -1, 1]))   # token 1: base output only
            >>> out.shape, torch.equal(out[1], experts(x, weights, ids, None)[1])
            (torch.Size([3, 32]), True)
        """
        if validate is False:  # a decode step's call that replayed in place before: its signature stands for the checks
            replayed = eager_graphs.replay_plain_lora(self, hidden_states, topk_weights, topk_ids, lora_ids, has_lora)
            if replayed is not None:
                return replayed
        plain = self._plain_call_ok(hidden_states, topk_weights, topk_ids, lora_ids)
        if plain:
            x = hidden_states.contiguous()  # every check below would pass (decode calls are host-bound)
        else:
            x = self._checked(hidden_states, topk_weights, topk_ids, lora_ids)
        output = torch.empty(x.shape[0], self.weights.hidden_size, dtype=x.dtype, device=x.device)
        if validate:  # expert ids, and adapter ids in [-1, L) naming set slots (fast path or not): one host read
            check_ids_once(topk_ids, self.num_experts, self.lora, lora_ids)
        if lora_ids is not None:
            if has_lora is None and lora_ids.device.type == "cpu":
                has_lora = bool((lora_ids >= 0).any())  # host memory: no device sync
        with_lora = lora_ids is not None and has_lora is not False
        if with_lora:
            if lora_ids.device != x.device:
                lora_ids = lora_ids.to(x.device, non_blocking=True)
            if not plain:  # the rest of check_lora_routing was checked above (ids, shapes, offset)
                check_bank_layout(self.lora)
                check_same_device(hidden_states=x, lora_ids=lora_ids, bank=self.lora.gate_a)
        call = LoRAExpertsCall(x, topk_ids, topk_weights, self.weights, self.num_experts,
                               self.top_k, self.local_expert_offset, output, self.lora if with_lora else None,
                               lora_ids if with_lora else None, self.fused, self._path, self.lora)
        return get_backend(self.backend).lora_experts(call)

    def _plain_call_ok(self, hidden_states, topk_weights, topk_ids, lora_ids) -> bool:
        """True when every check of :meth:`_checked` would pass (False says nothing: those checks then name what is
        wrong): ``validate_call``'s one predicate, and the adapter ids and the bank's layout and device. The checks
        one by one cost a decode call more host time than its GPU work."""
        if not _plain_routed_call_ok((topk_ids, topk_weights), hidden_states, self.weights, self.num_experts,
                                     self.top_k, self.local_expert_offset):
            return False
        bank = self.lora
        return lora_ids is None or (bank is not None and type(lora_ids) is torch.Tensor
                                    and lora_ids.dtype in INT_DTYPES and lora_ids.shape == hidden_states.shape[:1]
                                    and bank.gate_a.device == hidden_states.device and bank_layout_ok(bank))

    def _checked(self, hidden_states, topk_weights, topk_ids, lora_ids) -> torch.Tensor:
        """The call's argument checks one by one, each naming what is wrong (the bank's layout and device: in
        :meth:`forward`, where the batch has adapters); returns ``hidden_states`` contiguous."""
        check_tensor("hidden_states", hidden_states, dtypes=FLOAT_DTYPES, ndim=2)
        check_dtype("hidden_states", hidden_states, self.weights.dtype, "the weights")
        check_tensor("topk_weights", topk_weights, ndim=2)
        check_tensor("topk_ids", topk_ids, ndim=2)
        if lora_ids is not None:
            if self.lora is None:
                raise ValueError("lora_ids: this LoRAExperts has no LoRABank (lora=None), so no adapter can apply; "
                                 "pass lora_ids=None, or build it with lora=moelab.LoRABank(...)")
            check_tensor("lora_ids", lora_ids, dtypes=INT_DTYPES, ndim=1)
        check_same_rows(hidden_states=hidden_states, topk_weights=topk_weights, topk_ids=topk_ids, lora_ids=lora_ids)
        # The checks routed_moe and the deltas make, once, before any launch (the backend trusts its call).
        check_routing(topk_ids, topk_weights, num_experts=self.num_experts, validate=False)  # ids: forward
        weights = topk_weights.float() if topk_weights.dtype == torch.float64 else topk_weights
        return validate_call((topk_ids, weights), hidden_states, self.weights, self.num_experts, self.top_k,
                             self.local_expert_offset, None, True, None, validate=False).hidden_states
