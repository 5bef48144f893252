"""LoRA on the experts (docs/contract.md §5): the adapter bank and the two per-slot deltas vLLM feeds FlashInfer.

    LoRABank        L slots x E_local experts of zero-padded A and B matrices, scaling folded into B
    w13_lora_delta  [T, K, 2I] in [up, gate] order, unweighted: added to GEMM1's output before SwiGLU
    w2_lora_delta   [T, K, H], weighted by the caller's routing weights, not reduced over k

Index arrays, by name:

    topk_ids      int [T, K]   global expert id of slot (t, k); local iff 0 <= id - local_expert_offset < E_local
    lora_ids      int [T]      adapter slot of token t, -1 for none
    slot          t*K + k      expanded index; row of the [T*K, ...] views of the outputs and of ``act``
    segments      :class:`moelab.permutation.Segments` of the slots grouped by (adapter, local expert), plus one
                  last group of the slots whose delta is zero, or None for a small batch (the kernel then runs
                  one program per slot); get it once with :func:`lora_segments`, pass it to both deltas

Each delta validates, allocates, then launches the fused Triton kernel of ``moelab/kernels/lora.py`` when
Triton can run on the device (a CUDA GPU, or the interpreter on CPU), else runs the torch fallback below,
which follows the same tiles. ``use_triton`` forces either, ``per_slot`` the Triton kernel's mode (tests and
benchmarks compare them).
"""

from __future__ import annotations

import json
import math
import os

import torch

from moelab import _checks, _runtime
from moelab._checks import FLOAT_DTYPES, INT_DTYPES, check_int, check_tensor, dtype_name
from moelab.ops import _use_triton
from moelab.permutation import Segments, adapter_expert_groups, build_segments, next_pow2

__all__ = ["LoRABank", "lora_scaling", "lora_segments", "build_lora_segments", "w13_lora_delta", "w2_lora_delta",
           "per_slot_by_size"]

_BANK_FORMAT = "moelab.LoRABank/1"
#: (name, shape of one slot in the bank as a function of (E_local, H, I, r)), in the order of ``set``.
_BANK_TENSORS = {
    "gate_a": lambda e, h, i, r: (e, r, h),
    "gate_b": lambda e, h, i, r: (e, i, r),
    "up_a": lambda e, h, i, r: (e, r, h),
    "up_b": lambda e, h, i, r: (e, i, r),
    "down_a": lambda e, h, i, r: (e, r, i),
    "down_b": lambda e, h, i, r: (e, h, r),
}


def lora_scaling(alpha: float, rank: int, use_rslora: bool = False) -> float:
    """The LoRA scale PEFT applies to ``B @ A``: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA.

    Example:
        >>> lora_scaling(32, 16), lora_scaling(32, 16, use_rslora=True)
        (2.0, 8.0)
    """
    check_int("rank", rank, low=1)
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


class LoRABank:
    """L adapter slots for the E_local experts of one MoE layer, each slot of rank up to ``max_rank``.

    Tensors (``dtype``, on ``device``, contiguous; a slot of rank r < max_rank is zero past r, which makes the
    padded products exact):

        gate_a, up_a  [L, E_local, max_rank, H]   A of the gate (w1) and up (w3) projections
        gate_b, up_b  [L, E_local, I, max_rank]   B of gate and up, scaling folded in
        down_a        [L, E_local, max_rank, I]   A of the down projection (w2)
        down_b        [L, E_local, H, max_rank]   B of down, scaling folded in
        ranks         list[int] [L]               rank of each slot, 0 for an empty slot

    The scaling (``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA: :func:`lora_scaling`) is folded into B by
    :meth:`set`, as vLLM does at load time, so the kernels take no scale.

    Example:
        >>> bank = LoRABank(2, num_local_experts=4, hidden_size=64, intermediate_size=32, max_rank=8,
        ...                 dtype=torch.float32)
        >>> E, H, I, r = 4, 64, 32, 4
        >>> bank.set(0, gate_a=torch.randn(E, r, H), gate_b=torch.randn(E, I, r), up_a=torch.randn(E, r, H),
        ...          up_b=torch.randn(E, I, r), down_a=torch.randn(E, r, I), down_b=torch.randn(E, H, r),
        ...          scaling=lora_scaling(alpha=16, rank=r))
        >>> bank.ranks
        [4, 0]
    """

    #: The names of the bank's six tensors, in the order of :meth:`set`.
    TENSOR_NAMES: tuple[str, ...] = tuple(_BANK_TENSORS)

    def __init__(self, max_loras: int, num_local_experts: int, hidden_size: int, intermediate_size: int,
                 max_rank: int, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"):
        self.max_loras = check_int("max_loras", max_loras, low=1)
        self.num_local_experts = check_int("num_local_experts", num_local_experts, low=1)
        self.hidden_size = check_int("hidden_size", hidden_size, low=1)
        self.intermediate_size = check_int("intermediate_size", intermediate_size, low=1)
        self.max_rank = check_int("max_rank", max_rank, low=1)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype: expected one of {FLOAT_DTYPES}, got {dtype}")
        L, E, H, I, r = max_loras, num_local_experts, hidden_size, intermediate_size, max_rank
        for name, shape in _BANK_TENSORS.items():
            setattr(self, name, torch.zeros((L, *shape(E, H, I, r)), dtype=dtype, device=device))
        self.ranks: list[int] = [0] * L
        self._rank_table = torch.zeros(L, dtype=torch.int32, device=device)  # ``ranks`` on the device
        self._rank_table_of = tuple(self.ranks)

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_a.dtype

    @property
    def device(self) -> torch.device:
        return self.gate_a.device

    @property
    def stacked_pads(self) -> tuple[int, int]:
        """(L_PAD, R_PAD) of the fused kernels' stacked layout (``moelab/kernels/moe_gemm.py``): slots and ranks
        padded to powers of two, with L_PAD * R_PAD >= 16 (``tl.dot``'s minimum)."""
        l_pad = next_pow2(self.max_loras)
        return l_pad, max(next_pow2(self.max_rank), 16 // min(l_pad, 16))

    def rank_table(self) -> torch.Tensor:
        """int32 [L] on the bank's device: :attr:`ranks`, for kernels that read only a slot's own ranks (the
        fused adapter loop). :meth:`set` and :meth:`reset` update it in place (a captured CUDA graph sees the new
        rank); a ``ranks`` list assigned directly is copied over here, on the host, at the next call.

        Example:
            >>> bank = LoRABank(2, num_local_experts=1, hidden_size=4, intermediate_size=4, max_rank=2)
            >>> bank.ranks = [2, 0]; bank.rank_table().tolist()
            [2, 0]
        """
        if tuple(self.ranks) != self._rank_table_of:
            self._rank_table.copy_(torch.tensor(self.ranks, dtype=torch.int32))
            self._rank_table_of = tuple(self.ranks)
        return self._rank_table

    def _set_rank(self, slot: int, rank: int) -> None:
        self.ranks[slot] = rank
        self._rank_table[slot] = rank  # in place, no host sync
        self._rank_table_of = tuple(self.ranks)

    def __repr__(self) -> str:
        return (f"LoRABank(max_loras={self.max_loras}, num_local_experts={self.num_local_experts}, "
                f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"max_rank={self.max_rank}, dtype={self.dtype}, device={self.device}, ranks={self.ranks})")

    def _check_slot(self, slot) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise TypeError(f"slot: expected an int, got {type(slot).__name__}")
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot: expected an int in [0, {self.max_loras}), got {slot}")
        return slot

    def set(self, slot: int, *, gate_a: torch.Tensor, gate_b: torch.Tensor, up_a: torch.Tensor,
            up_b: torch.Tensor, down_a: torch.Tensor, down_b: torch.Tensor, scaling: float = 1.0) -> None:
        """Load one adapter of rank r (1 <= r <= max_rank) into ``slot``, folding ``scaling`` into the B's.

        Args:
            gate_a, up_a: [E_local, r, H]; gate_b, up_b: [E_local, I, r];
            down_a: [E_local, r, I]; down_b: [E_local, H, r]. Any floating dtype and device: they are copied
            into the bank's, B multiplied by ``scaling`` in fp32 (or wider) first, then rounded once.
            scaling: e.g. ``lora_scaling(alpha, r, use_rslora)``.

        The tensors are copied (detached: an ``nn.Parameter`` leaves no autograd graph in the bank). A transposed
        matrix, a rank that differs between the six, or a rank above ``max_rank`` is a ``ValueError``.

        Example:
            >>> E, H, I, r = 2, 16, 8, 4
            >>> bank = LoRABank(1, num_local_experts=E, hidden_size=H, intermediate_size=I, max_rank=8)
            >>> bank.set(0, gate_a=torch.randn(E, r, H), gate_b=torch.randn(E, I, r), up_a=torch.randn(E, r, H),
            ...          up_b=torch.randn(E, I, r), down_a=torch.randn(E, r, I), down_b=torch.randn(E, H, r))
            >>> bank.ranks, list(bank.gate_a.shape)
            ([4], [1, 2, 8, 16])
        """
        self._check_slot(slot)
        given = {"gate_a": gate_a, "gate_b": gate_b, "up_a": up_a, "up_b": up_b, "down_a": down_a, "down_b": down_b}
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
            raise TypeError(f"scaling: expected a float, got {type(scaling).__name__}")
        if not math.isfinite(scaling):
            raise ValueError(f"scaling: expected a finite float, got {scaling}")
        for name, t in given.items():
            check_tensor(name, t, ndim=3)
            if not t.dtype.is_floating_point:
                raise TypeError(f"{name}: expected a floating dtype, got {str(t.dtype).replace('torch.', '')}")
        # The values only: a bank is inference data, never part of an autograd graph (nn.Parameter inputs).
        given = {name: t.detach() for name, t in given.items()}
        E, H, I = self.num_local_experts, self.hidden_size, self.intermediate_size
        rank = gate_a.shape[1]
        for name, t in given.items():  # a transposed matrix, before its size is read as a rank
            full = _BANK_TENSORS[name](E, H, I, "r")
            r_axis = full.index("r")
            transposed = list(full)
            transposed[1], transposed[2] = full[2], full[1]
            fits = [g == w or w == "r" for g, w in zip(t.shape, full)]
            fits_t = [g == w or w == "r" for g, w in zip(t.shape, transposed)]
            if not all(fits) and all(fits_t):
                want = "[" + ", ".join(map(str, full)) + "]"
                raise ValueError(f"{name}: expected shape {want} (E_local, and r the adapter's rank), got "
                                 f"{list(t.shape)}: it looks transposed; pass {name}.transpose(1, 2)")
            if all(fits) and name != "gate_a" and t.shape[r_axis] != rank:
                raise ValueError(f"{name}: expected rank {rank} (that of gate_a, gate_a.shape[1]) in dimension "
                                 f"{r_axis}, got shape {list(t.shape)}")
        if rank > self.max_rank:
            raise ValueError(f"gate_a: rank {rank} (gate_a.shape[1]) is larger than the bank's max_rank "
                             f"{self.max_rank}; make a bank with max_rank >= {rank}")
        check_int("rank", rank, low=1)
        converted = {}
        for name, t in given.items():
            check_tensor(name, t, shape=_BANK_TENSORS[name](E, H, I, rank))
            if name.endswith("_b"):
                t = t.to(torch.promote_types(t.dtype, torch.float32)) * scaling
            converted[name] = t.to(self.dtype)
            _check_finite(name, converted[name])
        self.reset(slot)
        for name, t in converted.items():
            dst = getattr(self, name)[slot]
            if name.endswith("_b"):
                dst[:, :, :rank].copy_(t)
            else:
                dst[:, :rank, :].copy_(t)
        self._set_rank(slot, rank)

    def reset(self, slot: int) -> None:
        """Zero ``slot``: it holds no adapter any more (rank 0), and ids naming it are refused when validated.

        Example:
            >>> bank = LoRABank(2, num_local_experts=1, hidden_size=4, intermediate_size=4, max_rank=2)
            >>> bank.ranks[1] = 2; bank.reset(1); bank.ranks
            [0, 0]
        """
        self._check_slot(slot)
        for name in _BANK_TENSORS:
            getattr(self, name)[slot].zero_()
        self._set_rank(slot, 0)

    def save(self, path: str | os.PathLike) -> None:
        """Write the bank to a safetensors file, sizes and ranks in its metadata (read it with :meth:`load`).

        Example:
            >>> import os, tempfile
            >>> path = os.path.join(tempfile.mkdtemp(), "bank.safetensors")
            >>> LoRABank(1, num_local_experts=1, hidden_size=4, intermediate_size=4, max_rank=2).save(path)
            >>> LoRABank.load(path).max_rank
            2
        """
        from safetensors.torch import save_file

        meta = {"format": _BANK_FORMAT, "max_loras": self.max_loras, "num_local_experts": self.num_local_experts,
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "max_rank": self.max_rank, "ranks": self.ranks}
        tensors = {name: getattr(self, name).detach().cpu().contiguous() for name in _BANK_TENSORS}
        save_file(tensors, os.fspath(path), metadata={k: json.dumps(v) for k, v in meta.items()})

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: torch.device | str = "cpu") -> LoRABank:
        """Read a bank written by :meth:`save` (dtype as saved) onto ``device``.

        The file is read with safetensors, which holds tensors and a string metadata table only, so loading runs
        no code from the file (a pickle is refused as "not a safetensors file"). Anything that is not a bank as
        :meth:`save` writes it raises ``ValueError`` naming the file and what is wrong: not safetensors
        (truncated, empty, garbage), another format, a missing tensor or size, ranks not ``max_loras`` ints in
        ``[0, max_rank]``, tensors of a non-float or mixed dtype, wrong shapes, inf/NaN, or values in a slot
        past its rank (padding must be zero).

        Example:
            >>> import tempfile, os
            >>> bank = LoRABank(2, num_local_experts=2, hidden_size=16, intermediate_size=8, max_rank=4)
            >>> path = os.path.join(tempfile.mkdtemp(), "bank.safetensors")
            >>> bank.save(path)
            >>> LoRABank.load(path).ranks
            [0, 0]
        """
        from safetensors import SafetensorError, safe_open

        where = os.fspath(path)

        def bad(what: str) -> ValueError:
            return ValueError(f"path: {where} is not a LoRABank file as LoRABank.save writes it: {what}")

        try:
            with safe_open(where, framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                names = set(f.keys())
                if meta.get("format") != json.dumps(_BANK_FORMAT):
                    raise bad(f"expected format {_BANK_FORMAT!r} in its metadata, got {meta.get('format')!r}")
                missing = [name for name in _BANK_TENSORS if name not in names]
                if missing:
                    raise bad(f"tensors {missing} are missing")
                tensors = {name: f.get_tensor(name) for name in _BANK_TENSORS}
        except SafetensorError as e:
            raise bad(f"not a readable safetensors file ({e})") from None
        try:
            sizes = {k: json.loads(meta[k]) for k in ("max_loras", "num_local_experts", "hidden_size",
                                                      "intermediate_size", "max_rank")}
            ranks = json.loads(meta["ranks"])
        except (KeyError, ValueError) as e:
            raise bad(f"its metadata lacks or garbles a size ({type(e).__name__}: {e})") from None
        for k, v in sizes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(f"{k}: expected a positive int, got {v!r}")
        if (not isinstance(ranks, list) or len(ranks) != sizes["max_loras"]
                or any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= sizes["max_rank"]
                       for r in ranks)):
            raise bad(f"ranks: expected {sizes['max_loras']} ints in [0, max_rank={sizes['max_rank']}], got {ranks!r}")
        dtypes = {name: t.dtype for name, t in tensors.items()}
        if any(d not in FLOAT_DTYPES for d in dtypes.values()) or len(set(dtypes.values())) != 1:
            raise bad(f"expected one dtype among {[dtype_name(d) for d in FLOAT_DTYPES]} for all six tensors, got "
                      f"{ {n: dtype_name(d) for n, d in dtypes.items()} }")
        bank = cls(**sizes, dtype=dtypes["gate_a"], device=device)
        for name, t in tensors.items():
            want = tuple(getattr(bank, name).shape)
            if tuple(t.shape) != want:
                raise bad(f"{name}: expected shape {list(want)} for these sizes, got {list(t.shape)}")
            if not bool(torch.isfinite(t).all()):
                raise bad(f"{name}: expected finite values, got inf or NaN")
            r_axis = 3 if name.endswith("_b") else 2  # [L, E_local, ...]: the rank axis of B is last, of A third
            for slot, r in enumerate(ranks):
                if bool(t[slot].narrow(r_axis - 1, r, t.shape[r_axis] - r).any()):
                    raise bad(f"{name}: slot {slot} of rank {r} holds non-zero values past its rank (padding must "
                              f"be zero)")
            getattr(bank, name).copy_(t)
        bank.ranks = list(ranks)
        return bank


def _check_finite(name: str, t: torch.Tensor) -> None:
    """A bank holds finite values only: the fused kernels multiply every slot's B by the other slots' zeros, and
    0 * inf would turn one adapter's overflow into NaN for every row of a tile (base tokens included)."""
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name}: expected finite values in the bank's dtype {t.dtype}, got inf or NaN "
                         f"(a large scaling can overflow float16: scale down, or use a bfloat16 bank)")


# ---------------------------------------------------------------------------------------------- segments

#: The Triton kernel runs one program per slot (finding each slot's group itself, nothing sorted) while the A and B
#: bytes those programs stream, ``T*K * r * 3(H + I) * itemsize``, stay under this budget; above it the slots are
#: grouped into segments so each (adapter, expert) pair is read once per tile. ``per_slot=`` of the deltas (and
#: ``LoRAExperts(fused="flow-per-slot" | "flow-grouped")``) force either. Measured on one H200 on 2026-12-01 (main
#: ~64c5e1b; bf16 Qwen3-30B-A3B E128 K8 H2048 I768; ``python -m moelab.bench --quick --impls moelab --peers none
#: --no-ceilings --lora --lora-variants "1x all,8x mixed" --lora-paths auto,flow-grouped,flow-per-slot``), µs in a
#: CUDA graph, per slot vs grouped (the bytes the per-slot programs would stream):
#:     8 adapters, ranks 8-64 (r=64): T=32 358 vs 479 (264 MiB), T=128 586 vs 647 (1056 MiB),
#:                                    T=1024 2343 vs 978 (8448 MiB)
#:     1 adapter, rank 16:            T=32 312 vs 345 (66 MiB),  T=128 400 vs 403 (264 MiB),
#:                                    T=1024 942 vs 548 (2112 MiB)
#: so the crossover lies between 1056 and 2112 MiB; 1.5 GiB (T ~186 for the first bank, ~745 for the second) sits
#: in the middle. (The budget was 800 MiB, from a run when the grouping was ~25 torch launches; it made the first
#: bank group at T=128, 7% slower.)
PER_SLOT_MAX_BYTES = 1536 * 2**20


def per_slot_by_size(num_slots: int, bank: LoRABank) -> bool:
    """The deltas' choice when ``per_slot`` is None: one program per slot while the bytes it streams stay under
    ``PER_SLOT_MAX_BYTES`` (see above), else grouped tiles."""
    h, i = bank.hidden_size, bank.intermediate_size
    return num_slots * bank.max_rank * 3 * (h + i) * bank.gate_a.element_size() <= PER_SLOT_MAX_BYTES


def _block_m(num_slots: int, num_groups: int) -> int:
    """Rows per tile: ~slots per (adapter, expert) group, clamped to [16, 64] (16 is tl.dot's minimum; 64 measured
    best at T=16384 against 32 and 128). A tile holds one group's rows, so rows per expert would leave most of a
    wide bank's tiles empty (8 adapters at Qwen3 T = 1024: 8 live rows in 64), and the larger tile costs shared
    memory and occupancy (Nsight Compute on the H200: one program an SM at 64 rows, 46 % of the DRAM peak)."""
    per_group = -(-num_slots // max(num_groups, 1))
    return min(max(next_pow2(per_group), 16), 64)


def build_lora_segments(topk_ids: torch.Tensor, lora_ids: torch.Tensor, bank: LoRABank, *,
                        local_expert_offset: int = 0, tile: int | None = None) -> Segments:
    """Group the T*K slots by (adapter, local expert), tile-aligned, on the device (no host sync).

    Group ``lora_id * E_local + e`` for a local slot whose token has an adapter in ``[0, L)``; every other slot
    goes to the last group ``L * E_local``, whose tiles the kernel fills with zeros. ``tile``: rows per tile (16,
    32, 64 or 128), None for the rule of ``_block_m``.
    """
    L, E_local = bank.max_loras, bank.num_local_experts
    T, K = topk_ids.shape
    loaded = sum(1 for r in bank.ranks if r > 0)  # host list: the groups tokens can fall in
    tile = tile or _block_m(T * K, E_local * max(loaded, 1))
    if not _runtime.triton_can_run(topk_ids.device):
        return build_segments(adapter_expert_groups(topk_ids, lora_ids, L, E_local, local_expert_offset),
                              L * E_local + 1, tile)
    from moelab.kernels.segments import build_segments_triton  # triton is optional (no wheel on macOS)

    # 1-3 launches that read the ids themselves (the groups in torch were a dozen small kernels)
    return build_segments_triton(topk_ids, L * E_local + 1, tile, local_expert_offset, adapter_ids=lora_ids,
                                 num_experts=E_local)


def lora_segments(topk_ids: torch.Tensor, lora_ids: torch.Tensor, bank: LoRABank, *,
                  local_expert_offset: int = 0, per_slot: bool | None = None) -> Segments | None:
    """The grouping both deltas of a layer share: build it once, pass it as ``segments=`` to each.

    None where the Triton kernel runs one program per slot and needs no grouping (``per_slot`` True, or None and
    a small batch: :func:`per_slot_by_size`, T up to ~745 at Qwen3-30B-A3B shapes, rank 16); pass the same ``per_slot``
    to the deltas. Otherwise :func:`build_lora_segments`. Arguments as in :func:`w13_lora_delta` (not validated).
    """
    if per_slot if per_slot is not None else per_slot_by_size(topk_ids.numel(), bank):
        return None
    return build_lora_segments(topk_ids, lora_ids, bank, local_expert_offset=local_expert_offset)


# ---------------------------------------------------------------------------------------------- torch fallback

def lora_shrink_expand_torch(x: torch.Tensor, a_banks: list[torch.Tensor], b_banks: list[torch.Tensor],
                             out: torch.Tensor, segments: Segments, *, slots_per_input_row: int, zero_group: int,
                             weight: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's tiles in torch: gather each tile's rows and its group's A and B, two batched matmuls.

    Same arguments and precision as :func:`moelab.kernels.lora.lora_shrink_expand_triton`.
    """
    num_slots = out.shape[0]
    tile = segments.tile
    slot = segments.row_to_slot.long()  # [R]
    live = slot >= 0
    slot_c = slot.clamp(min=0)
    block_group = segments.block_group.long()  # [R / tile]
    adapter_tile = (block_group >= 0) & (block_group < zero_group)
    group = block_group.clamp(0, zero_group - 1)
    num_tiles = block_group.numel()
    rank, d_in = a_banks[0].shape[-2:]
    d_out = b_banks[0].shape[-2]
    xs = x[slot_c // slots_per_input_row].float().view(num_tiles, tile, d_in)
    pieces = []
    for a, b in zip(a_banks, b_banks):
        a_t = a.reshape(-1, rank, d_in)[group].float()  # [tiles, r, D_in]: one A per tile, as in the kernel
        rank_vec = (xs @ a_t.transpose(1, 2)).to(x.dtype).float()  # fp32 shrink, rounded to the input dtype
        b_t = b.reshape(-1, d_out, rank)[group].float()  # [tiles, D_out, r]
        pieces.append(rank_vec @ b_t.transpose(1, 2))  # fp32 expand
    y = torch.cat(pieces, dim=-1).view(-1, len(a_banks) * d_out)
    if weight is not None:
        y = y * weight.reshape(-1).float()[slot_c][:, None]
    keep = live & adapter_tile.repeat_interleave(tile)
    y = torch.where(keep[:, None], y, torch.zeros((), device=y.device))
    # Every slot owns exactly one live row; padding rows land in a spill row that is cut off.
    spill = torch.empty(num_slots + 1, out.shape[1], dtype=out.dtype, device=out.device)
    spill[torch.where(live, slot, num_slots)] = y.to(out.dtype)
    out.copy_(spill[:num_slots])
    return out


# ---------------------------------------------------------------------------------------------- deltas

def check_lora_ids(bank: LoRABank, lora_ids: torch.Tensor) -> None:
    """Every adapter id in ``[-1, L)`` and naming a slot that holds an adapter (``bank.ranks[id] > 0``): an id of
    an empty slot would silently give the base output. Reads ``lora_ids`` (one host sync)."""
    check_ids_once(None, 0, bank, lora_ids)


def check_ids_once(topk_ids: torch.Tensor | None, num_experts: int, bank: LoRABank | None = None,
                   lora_ids: torch.Tensor | None = None) -> None:
    """The device checks of :func:`moelab.pack_topk_ids_weights` (expert ids in ``[0, num_experts)``, distinct per
    token; skipped for None) and, with ``lora_ids``, of :func:`check_lora_ids`, in one host read: all that
    ``LoRAExperts(validate=True)`` costs in syncs. Same errors as those checks; shapes and dtypes are checked by
    the caller. No ``torch.unique`` or ``bincount`` (each syncs on CUDA by itself): the slots in use are marked
    with ``index_fill_``."""
    parts, lora_parts = [], []
    if topk_ids is not None and topk_ids.numel():
        ids = topk_ids.long()
        parts += [ids.min().view(1), ids.max().view(1)]
        if ids.shape[1] > 1:
            s = ids.sort(dim=-1).values
            dup = (s[:, 1:] == s[:, :-1]).any(dim=-1)
            parts += [dup.any().long().view(1), dup.long().argmax().view(1)]
    if lora_ids is not None and lora_ids.numel():
        lids = lora_ids.long()
        L = bank.max_loras
        used = torch.zeros(L + 1, dtype=torch.long, device=lids.device)
        used.index_fill_(0, lids.clamp(-1, L - 1) + 1, 1)  # slot i used -> used[1 + i] = 1
        lora_parts = [lids.min().view(1), lids.max().view(1), used[1:]]
    if lora_parts and parts and lora_ids.device != topk_ids.device:  # lora_ids in host memory: read for free
        vals = torch.cat(parts).tolist() + torch.cat(lora_parts).tolist()
    elif parts or lora_parts:
        vals = torch.cat(parts + lora_parts).tolist()  # the one host read
    else:
        return
    if parts:
        (lo, hi), vals = vals[:2], vals[2:]
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"topk_ids: expected expert ids in [0, {num_experts}), got {lo if lo < 0 else hi}")
        if topk_ids.shape[1] > 1:
            (has_dup, t), vals = vals[:2], vals[2:]
            if has_dup:
                raise ValueError(f"topk_ids: expected distinct expert ids per token, token {t} has "
                                 f"{topk_ids[t].tolist()}")
    if vals:
        (lo, hi), used = vals[:2], vals[2:]
        if lo < -1 or hi >= bank.max_loras:
            raise ValueError(f"lora_ids: expected adapter ids in [-1, {bank.max_loras}) (-1 = no adapter), got "
                             f"{lo if lo < -1 else hi}")
        empty = [i for i, u in enumerate(used) if u and bank.ranks[i] == 0]
        if empty:
            raise ValueError(f"lora_ids: slots {empty} hold no adapter (bank.ranks = {bank.ranks}); load one with "
                             f"bank.set({empty[0]}, ...) or use -1 (no adapter) for those tokens")


def bank_layout_ok(bank: LoRABank) -> bool:
    """Whether every tensor of ``bank`` is contiguous, as the kernels index them (one pass; the eager calls' path)."""
    return all(getattr(bank, name).is_contiguous() for name in _BANK_TENSORS)


def check_bank_layout(bank: LoRABank) -> None:
    """Every tensor of ``bank`` contiguous, as the kernels index them (a tensor assigned to the bank may not be)."""
    if bank_layout_ok(bank):
        return
    for name in _BANK_TENSORS:
        _checks.check_contiguous(f"bank.{name}", getattr(bank, name))


def check_lora_routing(bank, topk_ids, lora_ids, local_expert_offset, validate, segments=None):
    """Check a bank and the routing its deltas see; with ``validate`` also the adapter ids (one host sync).
    Returns (T, K)."""
    if not isinstance(bank, LoRABank):
        raise TypeError(f"bank: expected a LoRABank, got {type(bank).__name__}")
    check_tensor("topk_ids", topk_ids, dtypes=INT_DTYPES, ndim=2)
    T, K = topk_ids.shape
    if K < 1:
        raise ValueError(f"topk_ids: expected at least one column (top_k >= 1), got shape {list(topk_ids.shape)}")
    check_tensor("lora_ids", lora_ids, dtypes=INT_DTYPES, shape=(T,))
    check_int("local_expert_offset", local_expert_offset, low=0)
    check_bank_layout(bank)
    if segments is not None:
        if not isinstance(segments, Segments):
            raise TypeError(f"segments: expected moelab.permutation.Segments from lora_segments, "
                            f"got {type(segments).__name__}")
        groups = bank.max_loras * bank.num_local_experts + 1
        if (segments.slot_to_row.numel() != T * K or segments.tile not in (16, 32, 64, 128)
                or segments.num_groups != groups):
            raise ValueError(f"segments: expected lora_segments of these {T * K} slots over this bank's {groups} "
                             f"groups, got {segments.slot_to_row.numel()} slots, {segments.num_groups} groups, "
                             f"tile {segments.tile}")
    if validate:
        check_lora_ids(bank, lora_ids)
    return T, K


def _check_per_slot(per_slot, segments, triton_path: bool) -> None:
    if per_slot is not None and not isinstance(per_slot, bool):
        raise TypeError(f"per_slot: expected True, False or None, got {per_slot!r}")
    if per_slot and segments is not None:
        raise ValueError("per_slot: True runs one program per slot, which takes no segments; pass segments=None "
                         "(or per_slot=None to use the grouping)")
    if per_slot and not triton_path:
        raise ValueError("per_slot: True runs the Triton kernel one program per slot, and this call runs the torch "
                         "fallback (use_triton=False, or a device Triton cannot run on); pass per_slot=None or False")


def _run(x, a_banks, b_banks, out, topk_ids, lora_ids, bank, local_expert_offset, segments, use_triton, per_slot, *,
         slots_per_input_row, weight=None):
    triton_path = _use_triton(out.device, use_triton)
    _check_per_slot(per_slot, segments, triton_path)
    if out.numel() == 0:
        return out
    out2d = out.view(out.shape[0] * out.shape[1], -1)
    if per_slot is None:
        per_slot = triton_path and per_slot_by_size(topk_ids.numel(), bank)
    if segments is None and not per_slot:
        segments = build_lora_segments(topk_ids, lora_ids, bank, local_expert_offset=local_expert_offset)
    if not triton_path:
        lora_shrink_expand_torch(x, a_banks, b_banks, out2d, segments, slots_per_input_row=slots_per_input_row,
                                 zero_group=bank.max_loras * bank.num_local_experts, weight=weight)
        return out
    from moelab.kernels.lora import lora_shrink_expand_triton

    lora_shrink_expand_triton(x, a_banks, b_banks, out2d, segments, topk_ids=topk_ids, lora_ids=lora_ids,
                              ranks=bank.rank_table(), local_expert_offset=local_expert_offset,
                              slots_per_input_row=slots_per_input_row, weight=weight)
    return out


def _check_out(out, shape, dtype, device):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    check_tensor("out", out, dtypes=FLOAT_DTYPES, shape=shape)
    _checks.check_dtype("out", out, dtype, "the input")
    if out.device != device:
        raise ValueError(f"out: expected the inputs' device {device}, got {out.device}")
    _checks.check_contiguous("out", out)
    return out


def w13_lora_delta(hidden_states: torch.Tensor, topk_ids: torch.Tensor, lora_ids: torch.Tensor, bank: LoRABank, *,
                   local_expert_offset: int = 0, validate: bool = True, segments: Segments | None = None,
                   out: torch.Tensor | None = None, use_triton: bool | None = None,
                   per_slot: bool | None = None) -> torch.Tensor:
    """The W13 LoRA delta FlashInfer adds to GEMM1's output before SwiGLU (docs/contract.md §5), [up, gate] order.

    ``delta[t, k] = cat(B_up @ (A_up @ x[t]), B_gate @ (A_gate @ x[t]))`` for a local slot whose token has an
    adapter, unweighted; every other row is exactly zero. The rank vector is accumulated in fp32 and rounded to
    the input dtype, the expand accumulates in fp32 (vLLM's precision).

    Args:
        hidden_states: [T, H], the bank's dtype (bf16, fp16 or fp32); any strides (copied when not contiguous).
        topk_ids: int [T, K], **global** expert ids (any id outside the EP window gives a zero row).
        lora_ids: int [T], the adapter slot of each token in [0, L), or -1 for none.
        bank: :class:`LoRABank` on the same device.
        local_expert_offset: first global expert id of this rank's window [offset, offset + E_local).
        validate: check ``lora_ids`` on the device (one host sync): in ``[-1, L)`` and naming slots that hold an
            adapter. Pass False under CUDA-graph capture and in benchmarks: then nothing syncs, and an id >= L or
            of an empty slot gives zero rows instead of an error.
        segments: :func:`lora_segments` of these ids, to share one grouping with :func:`w2_lora_delta`.
        out: optional contiguous [T, K, 2I] buffer of the input dtype, written in full and returned.
        use_triton: True / False force the Triton kernel / the torch fallback; None picks Triton where it runs.
        per_slot: the Triton kernel's mode: True one program per slot (no grouping; ``segments`` must be None),
            False tiles grouped by (adapter, expert), None by batch size (:func:`per_slot_by_size`). The torch
            fallback always groups (True raises there).

    Returns:
        [T, K, 2I] in the dtype of ``hidden_states``: columns 0:I are up, I:2I gate (FlashInfer order).

    Example:
        >>> E, H, I, r = 4, 16, 8, 2
        >>> bank = LoRABank(1, num_local_experts=E, hidden_size=H, intermediate_size=I, max_rank=r,
        ...                 dtype=torch.float32)
        >>> bank.set(0, gate_a=torch.randn(E, r, H), gate_b=torch.randn(E, I, r), up_a=torch.randn(E, r, H),
        ...          up_b=torch.randn(E, I, r), down_a=torch.randn(E, r, I), down_b=torch.randn(E, H, r))
        >>> ids = torch.tensor([[0, 3], [1, 2]]); lora_ids = torch.tensor([0, -1])  # token 1: no adapter
        >>> delta = w13_lora_delta(torch.randn(2, H), ids, lora_ids, bank)
        >>> list(delta.shape), bool(delta[1].eq(0).all())
        ([2, 2, 16], True)
    """
    T, K = check_lora_routing(bank, topk_ids, lora_ids, local_expert_offset, validate, segments)
    check_tensor("hidden_states", hidden_states, dtypes=FLOAT_DTYPES, shape=(T, bank.hidden_size))
    _checks.check_dtype("hidden_states", hidden_states, bank.dtype, "the bank")
    hidden_states = hidden_states.contiguous()
    device = _checks.check_same_device(hidden_states=hidden_states, topk_ids=topk_ids, lora_ids=lora_ids,
                                       bank=bank.gate_a)
    out = _check_out(out, (T, K, 2 * bank.intermediate_size), hidden_states.dtype, device)
    return _run(hidden_states, [bank.up_a, bank.gate_a], [bank.up_b, bank.gate_b], out, topk_ids, lora_ids, bank,
                local_expert_offset, segments, use_triton, per_slot, slots_per_input_row=K)


def w2_lora_delta(act: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, lora_ids: torch.Tensor,
                  bank: LoRABank, *, local_expert_offset: int = 0, validate: bool = True,
                  segments: Segments | None = None, out: torch.Tensor | None = None,
                  use_triton: bool | None = None, per_slot: bool | None = None) -> torch.Tensor:
    """The W2 LoRA delta (docs/contract.md §5): ``w[t, k] * B_down @ (A_down @ act[t*K + k])`` per slot, not reduced.

    The routing weight is the caller's (e.g. fp32, not the bf16-rounded one the base path uses), multiplied in
    fp32 after the fp32 expand. Rows of non-local slots and of tokens without an adapter are exactly zero.

    Args:
        act: [T*K, I], the unpermuted SwiGLU activation (:func:`moelab.unpermute_activation`), the bank's
            dtype; any strides.
        topk_ids: int [T, K] global ids; topk_weights: float [T, K]; lora_ids: int [T] (-1 = none).
        bank, local_expert_offset, validate, segments, out, use_triton, per_slot: as in :func:`w13_lora_delta`
            (``out``: [T, K, H]).

    Returns:
        [T, K, H] in the dtype of ``act``.

    Example:
        >>> E, H, I, r = 4, 16, 8, 2
        >>> bank = LoRABank(1, num_local_experts=E, hidden_size=H, intermediate_size=I, max_rank=r,
        ...                 dtype=torch.float32)
        >>> bank.set(0, gate_a=torch.randn(E, r, H), gate_b=torch.randn(E, I, r), up_a=torch.randn(E, r, H),
        ...          up_b=torch.randn(E, I, r), down_a=torch.randn(E, r, I), down_b=torch.randn(E, H, r))
        >>> ids = torch.tensor([[0, 3], [1, 2]]); weights = torch.tensor([[0.6, 0.4], [0.5, 0.5]])
        >>> w2_lora_delta(torch.randn(4, I), ids, weights, torch.tensor([0, 0]), bank).shape
        torch.Size([2, 2, 16])
    """
    T, K = check_lora_routing(bank, topk_ids, lora_ids, local_expert_offset, validate, segments)
    check_tensor("act", act, dtypes=FLOAT_DTYPES, shape=(T * K, bank.intermediate_size))
    _checks.check_dtype("act", act, bank.dtype, "the bank")
    act = act.contiguous()
    check_tensor("topk_weights", topk_weights, dtypes=FLOAT_DTYPES + (torch.float64,), shape=(T, K))
    device = _checks.check_same_device(act=act, topk_ids=topk_ids, topk_weights=topk_weights, lora_ids=lora_ids,
                                       bank=bank.down_a)
    out = _check_out(out, (T, K, bank.hidden_size), act.dtype, device)
    return _run(act, [bank.down_a], [bank.down_b], out, topk_ids, lora_ids, bank, local_expert_offset, segments,
                use_triton, per_slot, slots_per_input_row=1, weight=topk_weights.contiguous())
