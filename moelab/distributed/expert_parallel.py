"""``ExpertParallelMoE``: one MoE layer's experts spread over the ranks of a ``torch.distributed`` group.

Each rank holds ``P_local`` physical experts (rows of its ``w13``/``w2``, and of its ``LoRABank``) and calls the
layer on its own tokens; each gets its tokens' finished outputs. Per call:

    1. route logical -> physical: a slot of logical expert e goes to copy ``(i + rank) % count[e]`` of e, where i
       counts the earlier slots of e on this rank (deterministic; each rank spreads its slots round-robin over
       the copies, and the ranks start at different copies);
    2. one all_gather of a small int header per rank (token count, input-error flag, adapter flag, tokens sent
       to each rank): every rank learns every split size, and every rank raises when any rank's input is bad;
       reading it is the call's one host sync (routing, dispatch order and load counting run on the device);
    3. dispatch, compute, combine, by ``dispatch``:
       "all_to_all"              all_to_all_single with split sizes: a token goes once to each rank that holds
                                 one of its experts (with its top-k row), that rank returns its partial sum over
                                 its experts, and the owner adds the partials in rank order in fp32;
       "allgather_reducescatter" all_gather every rank's tokens (padded to the largest T), every rank computes the
                                 partial sums of its experts for all tokens (moelab's ``local_expert_offset``
                                 contract), reduce_scatter sums them back to their owners (in the input dtype);
    4. the partial sums are :class:`moelab.LoRAExperts` over the local window of physical ids, LoRA included.

A token's routing travels as one int32 row (its fp32 weights' bits, physical ids, adapter id): two collectives
dispatch (hidden states, routing), one combines.

CUDA graphs. NCCL collectives can be captured when their sizes are fixed; all_to_all with split sizes that depend
on the routing cannot (the sizes must reach the host first). So:

    max_tokens_per_rank=None   (default) "dynamic": split sizes exchanged per call, no padding; not capturable:
                               a call under capture raises RuntimeError on every rank before any collective.
    max_tokens_per_rank=C      "static": a fixed capacity of C tokens per rank (T_r <= C; T_r still varies):
                               allgather_reducescatter gathers C rows per rank (padded), all_to_all sends C rows
                               to every rank (row j of block d: the j-th token that needs rank d; padded) with
                               equal splits; nothing reads the device from the host, so the call is capturable
                               (both modes), as a vLLM-style fixed batch size. Padding rows have weight 0 and use
                               another rank's experts, so they cost no expert compute; they are not counted in
                               ``physical_load``. Eager calls with ``validate=True`` exchange an error flag (one
                               host sync) so that every rank raises on bad input. Capture with
                               ``torch.cuda.graph(g, capture_error_mode="thread_local")``: ProcessGroupNCCL's
                               watchdog thread queries CUDA events, which global capture mode forbids. Under
                               capture, or with ``validate=False``, a rank whose input fails the host-side checks
                               takes part with no tokens and raises alone (the others' outputs are complete and
                               correct).

Tensors by name (T_r tokens on rank r, K = top_k, E logical, P physical, P_local per rank, R ranks):

    topk_ids           int [T_r, K]     logical expert ids of this rank's tokens
    physical_ids       int64 [T_r, K]   the copy each slot uses; rank ``id // P_local``, local expert ``id % P_local``
    token_ranks        bool [T_r, R]    whether token t has an expert on rank r (it is sent there once)
    header             int64 [R, 3 + R] per rank: T_r, input error, has adapters, tokens sent to each rank

Exactness: the layer adds nothing to :class:`moelab.LoRAExperts`' own guarantee for a token without an adapter
(each rank's partial sum is LoRAExperts' output; it travels unchanged and the partials are added in a fixed order),
so such a token does not change by a bit when other tokens change adapter. Against one process, a token whose experts
all sit on one rank matches bit for bit when the backend's GEMM rows do not depend on the batch around them (the
other ranks add exact zeros, or nothing); a token whose experts span ranks differs in rounding: each rank rounds its
partial sum to the input dtype before the partials are added (in fp32 for all_to_all, in the input dtype and the
collective's order for allgather_reducescatter).
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist
from torch import nn

import moelab
from moelab.distributed.metadata import ExpertParallelMetadata, check_expert_map, check_int, replica_maps

__all__ = ["ExpertParallelMoE", "DISPATCH_MODES"]

DISPATCH_MODES = ("all_to_all", "allgather_reducescatter")
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_BANK_TENSORS = moelab.LoRABank.TENSOR_NAMES


def _reraise(error: Exception, note: str):
    """Raise ``error`` again with ``note`` appended to its message (the same type when it can be rebuilt).

    Callers hold ``error`` in a local until every rank has learnt of it; they ``del`` it once this raises. The
    error's traceback holds the caller's frame, so a frame still holding the error is a cycle that keeps it and the
    frames above it (and any process group in them) alive until the garbage collector runs, past
    ``destroy_process_group``: see :attr:`ExpertParallelMoE.group` for why a group must not outlive that."""
    if type(error) in (TypeError, ValueError, RuntimeError, IndexError):
        raise type(error)(f"{error} {note}") from error
    raise error


def _reduce_scatter(output, tensor, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    fn(output, tensor, group=group)


def _all_gather(output, tensor, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, tensor, group=group)


class ExpertParallelMoE(nn.Module):
    """Routed experts (with multi-adapter LoRA) over the ranks of a process group: expert parallelism.

    Args:
        w13: [P_local, 2I, H] this rank's experts, HF order (rows [gate; up]); w2: [P_local, H, I]. Rank r holds
            physical experts ``r*P_local .. (r+1)*P_local - 1``; without ``expert_map`` those are logical experts
            ``r*E/R .. (r+1)*E/R - 1`` (so P_local = E/R).
        num_experts: E, the logical experts ``topk_ids`` name; top_k: K.
        lora: a :class:`moelab.LoRABank` over the same P_local experts, or None.
        group: the process group (default: the world), held weakly (see :attr:`group`). gloo on CPU tensors,
            NCCL on CUDA tensors.
        dispatch: "all_to_all" or "allgather_reducescatter" (module docstring).
        backend: moelab's compute backend on each rank ("auto", "torch", "triton", "flashinfer").
        expert_map: int [P = R * P_local], the logical expert each physical expert holds (a row of
            :func:`moelab.distributed.rebalance_experts`' ``physical_to_logical_map``); None: the identity.
        max_tokens_per_rank: None (split sizes per call) or C, a fixed per-rank token capacity: padded equal
            splits, no host sync, CUDA-graph capturable (module docstring).

    Every rank must construct the layer with the same E, K, I, H, P_local, dispatch, map and adapter slots; the
    constructor checks that collectively and every rank raises the same error otherwise. Construction and each
    call are collective: every rank of the group must take part, with T_r = 0 if it has no tokens.

    Call: ``(hidden_states [T_r, H], topk_weights float [T_r, K], topk_ids int [T_r, K] logical, lora_ids int
    [T_r] or None, *, validate=True) -> [T_r, H]`` in the input dtype. ``validate`` checks the ids on the
    device (id ranges, duplicates; a host sync the header exchange makes anyway).

    Metadata (:class:`moelab.distributed.ExpertParallelMetadata`, vLLM's names): ``num_logical_experts``,
    ``num_physical_experts``, ``num_local_physical_experts``, ``num_redundant_experts``, ``expert_map``;
    ``logical_to_physical_map`` / ``logical_replica_count`` as EPLB returns them. :meth:`rebalance` (or
    ``update_physical_experts_metadata(..., expert_map=)``) moves experts and their LoRA slices to a new placement.
    ``physical_load`` int64 [P_local] counts the slots each local expert computed since :meth:`reset_load`.

    Example (two ranks; each runs this, e.g. under ``torchrun --nproc-per-node 2``):
        >>> E, K, H, I = 4, 2, 32, 16
        >>> rank, R = dist.get_rank(), dist.get_world_size()  # doctest: +SKIP
        >>> w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)  # same seed on every rank
        >>> layer = ExpertParallelMoE(w13[rank * E // R:(rank + 1) * E // R], w2[rank * E // R:(rank + 1) * E // R],
        ...                           num_experts=E, top_k=K, backend="torch")  # doctest: +SKIP
        >>> layer(torch.randn(3, H), torch.rand(3, K), torch.tensor([[0, 3], [1, 2], [2, 0]])).shape  # doctest: +SKIP
        torch.Size([3, 32])
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, *, num_experts: int, top_k: int,
                 lora: moelab.LoRABank | None = None, group=None, dispatch: str = "all_to_all",
                 backend: str = "auto", expert_map=None, max_tokens_per_rank: int | None = None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ExpertParallelMoE: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group first (or run under torchrun)")
        self._group = weakref.ref(group if group is not None else dist.group.WORLD)  # torch.distributed owns it
        del group  # nor does this frame hold it (a failed construction's traceback holds the frame)
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        error = None
        try:  # local checks first; the collective check below makes every rank raise if any rank failed
            self._setup(w13, w2, num_experts, top_k, lora, dispatch, backend, expert_map)
            self.max_tokens_per_rank = (None if max_tokens_per_rank is None else
                                        check_int("max_tokens_per_rank", max_tokens_per_rank, low=1))
        except Exception as err:  # any local failure: every rank must learn of it, or the others would hang
            error = err
        try:
            self._agree_or_raise(error, w13, w2, num_experts, top_k, lora, dispatch, expert_map,
                                 capacity=max_tokens_per_rank)
        finally:
            del error  # no frame <-> traceback cycle (see _reraise)
        self.reset_load()
        #: None, or a dict the forward adds seconds per phase to: "route", "exchange" (the header all_gather),
        #: "wait" (for the slowest rank, before each collective), "dispatch", "experts", "combine"
        #: (communication: exchange + dispatch + the combine's collective), and "bytes_sent" (bytes this rank
        #: sent to other ranks in dispatch and combine).
        self.timings: dict[str, float] | None = None
        self._last_mark = 0.0

    @property
    def group(self):
        """The layer's process group. The layer holds it weakly, so that ``dist.destroy_process_group()`` really
        ends it: a group still alive when the interpreter exits (held by a layer in a global, say) keeps gloo's
        worker threads running, and one that frees a finished collective's tensors then needs the GIL, which
        the exiting interpreter no longer gives: the process aborts ("terminate called without an active
        exception")."""
        group = self._group()
        if group is None:
            raise RuntimeError("ExpertParallelMoE: its process group was destroyed (destroy_process_group); build "
                               "the layer again in the new group")
        return group

    # ------------------------------------------------------------------------------------------ construction

    def _setup(self, w13, w2, num_experts, top_k, lora, dispatch, backend, expert_map):
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch: expected one of {DISPATCH_MODES}, got {dispatch!r}")
        E, R = check_int("num_experts", num_experts, low=1), self.world_size
        check_int("top_k", top_k, low=1, high=E)
        if not isinstance(w13, torch.Tensor) or w13.dim() != 3:
            raise TypeError(f"w13: expected a 3-D tensor [P_local, 2I, H], got {getattr(w13, 'shape', type(w13))}")
        P_local = w13.shape[0]
        if expert_map is None:
            if P_local * R != E:
                raise ValueError(f"w13: expected num_experts / world size = {E} / {R} local experts (the default "
                                 f"contiguous blocks), got {P_local}; pass expert_map for another placement")
            expert_map = torch.arange(E)
        expert_map = check_expert_map(expert_map, num_logical_experts=E, num_local_physical_experts=P_local,
                                      ep_size=R)
        self.dispatch, self.top_k = dispatch, top_k
        self.metadata = ExpertParallelMetadata(E, P_local * R, P_local, expert_map)
        self._set_experts(w13, w2, lora, backend)

    def _set_experts(self, w13, w2, lora, backend):
        """(Re)build this rank's experts over physical ids [rank * P_local, (rank + 1) * P_local)."""
        P_local = self.metadata.num_local_physical_experts
        self.w13, self.w2 = w13, w2  # HF order, kept to move experts when rebalancing
        self.experts = moelab.LoRAExperts(w13, w2, num_experts=self.metadata.num_physical_experts, top_k=self.top_k,
                                          local_expert_offset=self.rank * P_local, lora=lora, backend=backend)
        self.lora = lora
        table, count = replica_maps(self.metadata.expert_map, self.metadata.num_logical_experts)
        self.logical_to_physical_map, self.logical_replica_count = table.to(w13.device), count.to(w13.device)
        self._one_copy_each = bool((count == 1).all())  # host-side: no replica choice to make per slot
        P, P_local, K, rank = self.metadata.num_physical_experts, P_local, self.top_k, self.rank
        others = [p for p in range(P) if p // P_local != rank]
        #: int64 [K]: distinct physical ids a padding row uses on this rank: another rank's when there are enough
        #: (then a padding row costs no compute here); made once, as a capture may not copy from the host.
        self._idle_ids = torch.tensor(others[:K] if len(others) >= K else list(range(K)), device=w13.device)

    def _signature(self, w13, w2, num_experts, top_k, lora, dispatch, expert_map, capacity) -> list[int]:
        """What every rank must agree on, as ints (the map as a position-weighted checksum)."""
        shape = list(w13.shape) if isinstance(w13, torch.Tensor) and w13.dim() == 3 else [-1, -1, -1]
        w2_shape = list(w2.shape) if isinstance(w2, torch.Tensor) and w2.dim() == 3 else [-1, -1, -1]
        if expert_map is None:
            checksum = -1
        else:
            try:
                m = torch.as_tensor(expert_map).to("cpu", torch.int64).flatten()
                checksum = int(((m + 1) * torch.arange(1, m.numel() + 1)).sum()) * 1000003 + m.numel()
            except (TypeError, ValueError, RuntimeError):
                checksum = -2
        slots = lora.max_loras if isinstance(lora, moelab.LoRABank) else 0
        return [*shape, *w2_shape, int(num_experts) if isinstance(num_experts, int) else -1,
                int(top_k) if isinstance(top_k, int) else -1, DISPATCH_MODES.index(dispatch)
                if dispatch in DISPATCH_MODES else -1, checksum, slots,
                capacity if isinstance(capacity, int) else -1]

    def _agree_or_raise(self, error, w13, w2, num_experts, top_k, lora, dispatch, expert_map, capacity=None):
        signature = self._signature(w13, w2, num_experts, top_k, lora, dispatch, expert_map, capacity)
        device = w13.device if isinstance(w13, torch.Tensor) else torch.device("cpu")
        mine = torch.tensor([int(error is not None), *signature], dtype=torch.int64, device=device)
        every = torch.empty(self.world_size * mine.numel(), dtype=torch.int64, device=device)
        _all_gather(every, mine, self.group)
        every = every.view(self.world_size, -1).cpu()
        if error is not None:
            _reraise(error, f"(rank {self.rank}; every rank of the group raised)")
        failed = every[:, 0].nonzero().flatten().tolist()
        if failed:
            raise ValueError(f"ExpertParallelMoE: rank(s) {failed} rejected their arguments (their error says why); "
                             f"no rank built the layer")
        differ = (every[:, 1:] != every[0, 1:]).any(dim=1).nonzero().flatten().tolist()
        if differ:
            names = ["P_local", "2I", "H", "w2.P_local", "w2.H", "w2.I", "num_experts", "top_k", "dispatch",
                     "expert_map", "lora.max_loras", "max_tokens_per_rank"]
            fields = [names[i] for i in (every[:, 1:] != every[0, 1:]).any(dim=0).nonzero().flatten().tolist()]
            raise ValueError(f"ExpertParallelMoE: every rank must pass the same {', '.join(fields)}; ranks {differ} "
                             f"differ from rank 0")

    # ------------------------------------------------------------------------------------------ metadata

    num_logical_experts = property(lambda self: self.metadata.num_logical_experts)
    num_physical_experts = property(lambda self: self.metadata.num_physical_experts)
    num_local_physical_experts = property(lambda self: self.metadata.num_local_physical_experts)
    num_redundant_experts = property(lambda self: self.metadata.num_redundant_experts)
    expert_map = property(lambda self: self.metadata.expert_map)

    def update_physical_experts_metadata(self, num_physical_experts: int, num_local_physical_experts: int,
                                         expert_map=None) -> None:
        """vLLM's hook; with ``expert_map`` it moves the experts there (:meth:`rebalance`). Collective."""
        if num_local_physical_experts != self.num_local_physical_experts:
            raise ValueError(f"num_local_physical_experts: expected {self.num_local_physical_experts} (each rank's "
                             f"weights are sized by it), got {num_local_physical_experts}")
        if num_physical_experts != self.num_physical_experts:
            raise ValueError(f"num_physical_experts: expected {self.num_physical_experts} = world size * "
                             f"num_local_physical_experts, got {num_physical_experts}")
        if expert_map is not None:
            self.rebalance(expert_map)

    def reset_load(self) -> None:
        """Zero ``physical_load`` (int64 [P_local]: slots each local expert computed)."""
        self.physical_load = torch.zeros(self.num_local_physical_experts, dtype=torch.int64, device=self.w13.device)

    @torch.no_grad()
    def rebalance(self, expert_map) -> None:
        """Move experts (weights and LoRA slices) so that physical expert p holds logical ``expert_map[p]``.

        Collective; every rank passes the same map (checked: every rank raises otherwise). A new copy of
        logical expert e comes from its lowest-numbered current copy, through one all_to_all_single. The layer's
        outputs do not change (only which rank computes a slot). ``physical_load`` is reset.
        """
        P_local, R, E = self.num_local_physical_experts, self.world_size, self.num_logical_experts
        error = None
        try:
            new_map = check_expert_map(expert_map, num_logical_experts=E, num_local_physical_experts=P_local,
                                       ep_size=R)
        except Exception as err:
            error, new_map = err, None
        try:
            self._agree_or_raise(error, self.w13, self.w2, E, self.top_k, self.lora, self.dispatch, expert_map,
                                 capacity=self.max_tokens_per_rank)
        finally:
            del error  # no frame <-> traceback cycle (see _reraise)
        old_map = self.metadata.expert_map
        first_copy = torch.full((E,), -1, dtype=torch.int64)
        first_copy.scatter_reduce_(0, old_map, torch.arange(old_map.numel()), "amin", include_self=False)
        source = first_copy[new_map]  # [P]: the current physical copy each new physical expert is copied from
        dest_rank, source_rank = torch.arange(R * P_local) // P_local, source // P_local
        # Rows travel ordered by destination rank, then destination physical id; receivers see them by source.
        outgoing = (source_rank == self.rank).nonzero().flatten()  # new physical ids whose source is here
        incoming = (dest_rank == self.rank).nonzero().flatten()
        incoming = incoming[torch.sort(source_rank[incoming], stable=True).indices]
        send_counts = torch.bincount(dest_rank[outgoing], minlength=R).tolist()
        recv_counts = torch.bincount(source_rank[incoming], minlength=R).tolist()
        views = self._expert_major()
        rows = torch.cat([v[source[outgoing] % P_local].reshape(len(outgoing), v[0].numel()) for v in views], dim=1)
        received = rows.new_empty(len(incoming), rows.shape[1])
        dist.all_to_all_single(received, rows.contiguous(), recv_counts, send_counts, group=self.group)
        new_views, offset = [], 0
        for v in views:
            width = v[0].numel()
            new = torch.empty_like(v)
            new[incoming % P_local] = received[:, offset:offset + width].reshape(len(incoming), *v.shape[1:])
            new_views.append(new)
            offset += width
        new_tensors = new_views[:2] + [v.transpose(0, 1).contiguous() for v in new_views[2:]]
        w13, w2 = new_tensors[0], new_tensors[1]
        lora = None
        if self.lora is not None:
            old = self.lora
            lora = moelab.LoRABank(old.max_loras, P_local, old.hidden_size, old.intermediate_size, old.max_rank,
                                   dtype=old.dtype, device=old.device)
            for name, t in zip(_BANK_TENSORS, new_tensors[2:]):
                getattr(lora, name).copy_(t)
            lora.ranks = list(old.ranks)
        self.metadata = ExpertParallelMetadata(E, P_local * R, P_local, new_map)
        self._set_experts(w13, w2, lora, self.experts.backend)
        self.reset_load()

    def _mark(self, phase: str | None) -> None:
        """With ``timings`` on (a dict), add the seconds since the last mark to ``timings[phase]`` (the device is
        synchronised first, so phases do not overlap: for measuring, not for serving)."""
        if self.timings is None:
            return
        if self.w13.device.type == "cuda":
            torch.cuda.synchronize(self.w13.device)
        now = time.perf_counter()
        if phase is not None:
            self.timings[phase] = self.timings.get(phase, 0.0) + now - self._last_mark
        self._last_mark = now

    def _before_collective(self, phase: str) -> None:
        """Close ``phase``; with ``timings`` on, wait at a barrier for every rank and book that as "wait", so the
        collective's own time is transfer, not the slowest rank's compute."""
        self._mark(phase)
        if self.timings is not None:
            dist.barrier(group=self.group)
            self._mark("wait")

    def _count_bytes(self, n: int) -> None:
        if self.timings is not None:
            self.timings["bytes_sent"] = self.timings.get("bytes_sent", 0) + int(n)

    def _expert_major(self) -> list[torch.Tensor]:
        """Everything a local expert owns, indexed by local expert in dim 0: w13 [P_local, 2I, H], w2, then the
        bank's six tensors as [P_local, L, ...] (copies)."""
        bank = [] if self.lora is None else [getattr(self.lora, n).transpose(0, 1).contiguous() for n in _BANK_TENSORS]
        return [self.w13, self.w2, *bank]

    # ------------------------------------------------------------------------------------------ forward

    def physical_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """int64 [T, K]: the physical copy each slot of logical ``topk_ids`` [T, K] uses on this rank (copy
        ``(i + rank) % count[e]`` for the i-th slot of logical expert e, counting in slot order). No host sync."""
        flat = topk_ids.reshape(-1).long()
        if self._one_copy_each:
            return self.logical_to_physical_map[flat, 0].reshape(topk_ids.shape)
        order = torch.sort(flat, stable=True).indices
        per_expert = torch.zeros(self.num_logical_experts, dtype=torch.int64, device=flat.device)
        per_expert.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync to size its output
        first = torch.cumsum(per_expert, 0) - per_expert
        occurrence = torch.empty_like(flat)
        occurrence[order] = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]
        copy = (occurrence + self.rank) % self.logical_replica_count[flat]
        return self.logical_to_physical_map[flat, copy].reshape(topk_ids.shape)

    def _check_call(self, hidden_states, topk_weights, topk_ids, lora_ids, validate):
        H, E, K = self.w13.shape[2], self.num_logical_experts, self.top_k
        for name, t in (("hidden_states", hidden_states), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if hidden_states.dtype != self.w13.dtype:
            raise TypeError(f"hidden_states: expected the weights' dtype {self.w13.dtype}, got {hidden_states.dtype}")
        if hidden_states.dim() != 2 or hidden_states.shape[1] != H:
            raise ValueError(f"hidden_states: expected shape [T, {H}], got {list(hidden_states.shape)}")
        T = hidden_states.shape[0]
        if topk_weights.dtype not in _FLOATS:
            raise TypeError(f"topk_weights: expected a float dtype in {_FLOATS}, got {topk_weights.dtype}")
        if topk_ids.dtype not in _INTS:
            raise TypeError(f"topk_ids: expected an int dtype, got {topk_ids.dtype}")
        for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
            if tuple(t.shape) != (T, K):
                raise ValueError(f"{name}: expected shape [{T}, {K}] (T tokens, top_k), got {list(t.shape)}")
        for name, t in (("hidden_states", hidden_states), ("topk_weights", topk_weights), ("topk_ids", topk_ids),
                        ("lora_ids", lora_ids)):
            if t is not None and t.device != self.w13.device:
                raise ValueError(f"{name}: expected device {self.w13.device} (that of the weights), got {t.device}")
        if lora_ids is not None:
            if not isinstance(lora_ids, torch.Tensor) or lora_ids.dtype not in _INTS or tuple(lora_ids.shape) != (T,):
                raise ValueError(f"lora_ids: expected an int tensor of shape [{T}], got "
                                 f"{getattr(lora_ids, 'dtype', type(lora_ids))} {list(getattr(lora_ids, 'shape', []))}")
            if self.lora is None:
                raise ValueError("lora_ids: this layer has no LoRABank (lora=None); pass lora_ids=None")
        if validate and T:
            lo, hi = int(topk_ids.min()), int(topk_ids.max())
            if lo < 0 or hi >= E:
                raise ValueError(f"topk_ids: expected logical expert ids in [0, {E}), got {lo if lo < 0 else hi}")
            if K > 1:
                s = topk_ids.sort(dim=1).values
                dup = (s[:, 1:] == s[:, :-1]).any(dim=1).nonzero()
                if dup.numel():
                    t = int(dup[0, 0])
                    raise ValueError(f"topk_ids: expected distinct expert ids per token, token {t} has "
                                     f"{topk_ids[t].tolist()}")
            if lora_ids is not None:
                lo, hi = int(lora_ids.min()), int(lora_ids.max())
                if lo < -1 or hi >= self.lora.max_loras:
                    raise ValueError(f"lora_ids: expected adapter slots in [-1, {self.lora.max_loras}) (-1 = no "
                                     f"adapter), got {lo if lo < -1 else hi}")

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                lora_ids: torch.Tensor | None = None, *, validate: bool = True) -> torch.Tensor:
        capturing = self.w13.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing and self.max_tokens_per_rank is None:
            # every rank raises here, before any collective: nobody is left waiting
            raise RuntimeError("ExpertParallelMoE: this layer cannot be captured in a CUDA graph: without "
                               "max_tokens_per_rank each call exchanges its split sizes through the host, which "
                               "capture forbids; build it with max_tokens_per_rank=C (a fixed per-rank token "
                               "capacity: padded buffers, equal splits, no host sync) to capture it")
        if self.max_tokens_per_rank is not None:
            return self._static_forward(hidden_states, topk_weights, topk_ids, lora_ids, validate and not capturing)
        R, device = self.world_size, self.w13.device
        error, physical, token_ranks = None, None, None
        self._mark(None)
        try:
            self._check_call(hidden_states, topk_weights, topk_ids, lora_ids, validate)
            physical = self.physical_ids(topk_ids)
            token_ranks = self._token_ranks(physical)
            send_counts = token_ranks.sum(0)
        except Exception as err:  # any local failure: every rank must learn of it, or the others would hang
            error, send_counts = err, torch.zeros(R, dtype=torch.int64, device=device)
        T = hidden_states.shape[0] if error is None else 0
        header = torch.cat([torch.tensor([T, int(error is not None), int(lora_ids is not None)], device=device),
                            send_counts.to(torch.int64)])
        every = torch.empty(R * header.numel(), dtype=torch.int64, device=device)
        self._before_collective("route")
        _all_gather(every, header, self.group)
        every = every.view(R, -1).cpu()  # the call's one host sync: the split sizes
        self._mark("exchange")
        try:
            if error is not None:
                _reraise(error, f"(rank {self.rank}; every rank of the group raised)")
        finally:
            del error  # no frame <-> traceback cycle (see _reraise)
        failed = every[:, 1].nonzero().flatten().tolist()
        if failed:
            raise ValueError(f"ExpertParallelMoE: rank(s) {failed} rejected their input (their error says why); no "
                             f"rank ran the layer")
        with_lora = bool(every[:, 2].any())
        if with_lora and lora_ids is None:
            lora_ids = torch.full((T,), -1, dtype=torch.int64, device=device)
        meta = self._pack(topk_weights, physical, lora_ids if with_lora else None)
        if self.dispatch == "all_to_all":
            return self._all_to_all(hidden_states, meta, token_ranks, every[:, 3:], with_lora)
        return self._allgather_reducescatter(hidden_states, meta, every[:, 0].tolist(), with_lora)

    # ------------------------------------------------------------------------------------------ pieces

    def _token_ranks(self, physical: torch.Tensor) -> torch.Tensor:
        """bool [T, R]: whether token t has a slot on rank r."""
        token_ranks = torch.zeros(physical.shape[0], self.world_size, dtype=torch.bool, device=physical.device)
        return token_ranks.scatter_(1, physical // self.num_local_physical_experts, True)

    def _pack(self, weights, physical, lora_ids) -> torch.Tensor:
        """int32 [T, 2K (+1)]: the fp32 routing weights' bits, the physical ids (and the adapter id), so that one
        collective carries a token's routing."""
        cols = [weights.float().contiguous().view(torch.int32), physical.to(torch.int32)]
        if lora_ids is not None:
            cols.append(lora_ids.to(torch.int32)[:, None])
        return torch.cat(cols, 1)

    def _meta_width(self, with_lora: bool) -> int:
        return 2 * self.top_k + int(with_lora)

    def _pad_rows(self, n: int, with_lora: bool, device) -> torch.Tensor:
        """int32 [n, 2K (+1)]: padding rows: weight 0, expert id -1 (replaced by idle ids before computing), no
        adapter. They are never added into a real token's output."""
        pad = torch.full((n, self._meta_width(with_lora)), -1, dtype=torch.int32, device=device)
        pad[:, :self.top_k] = 0  # +0.0's bits
        return pad

    def _local_experts(self, x, meta, with_lora):
        """This rank's partial sums [N, H] for N rows; ``meta`` int32 [N, 2K (+1)] as :meth:`_pack` makes it
        (padding rows: expert ids -1)."""
        K, P_local = self.top_k, self.num_local_physical_experts
        weights = meta[:, :K].contiguous().view(torch.float32)
        ids = meta[:, K:2 * K].long()
        local = ids - self.rank * P_local
        live = (local >= 0) & (local < P_local)
        self.physical_load.scatter_add_(0, local.clamp(0, P_local - 1).flatten(), live.flatten().long())
        if x.shape[0] == 0:
            return x.new_empty(0, x.shape[1])
        ids = torch.where(ids >= 0, ids, self._idle_ids)
        lora_ids = meta[:, 2 * K].long() if with_lora else None
        return self.experts(x, weights, ids, lora_ids, has_lora=True if with_lora else None, validate=False)

    def _dest_order(self, token_ranks, total: int) -> torch.Tensor:
        """int64 [total]: the token of each row sent, ordered by destination rank, then token (no host sync)."""
        T, R = token_ranks.shape
        flat = token_ranks.T.reshape(-1)
        slot = torch.where(flat, torch.cumsum(flat, 0) - 1, total)  # non-sent pairs land in a discarded last slot
        token = torch.empty(total + 1, dtype=torch.int64, device=token_ranks.device)
        token.scatter_(0, slot, torch.arange(T, device=token_ranks.device).repeat(R))
        return token[:total]

    def _row_bytes(self, x, with_lora) -> int:
        return x.shape[1] * x.element_size() + 4 * self._meta_width(with_lora)

    def _all_to_all(self, x, meta, token_ranks, counts, with_lora):
        R = self.world_size
        send_counts, recv_counts = counts[self.rank].tolist(), counts[:, self.rank].tolist()
        token = self._dest_order(token_ranks, sum(send_counts))
        x_recv = x.new_empty(sum(recv_counts), x.shape[1])
        meta_recv = meta.new_empty(sum(recv_counts), meta.shape[1])
        x_send, meta_send = x[token], meta[token]
        self._before_collective("route")
        dist.all_to_all_single(x_recv, x_send, recv_counts, send_counts, group=self.group)
        dist.all_to_all_single(meta_recv, meta_send, recv_counts, send_counts, group=self.group)
        self._mark("dispatch")
        self._count_bytes(sum(send_counts[d] * self._row_bytes(x, with_lora) for d in range(R) if d != self.rank))
        partial = self._local_experts(x_recv, meta_recv, with_lora)
        back = partial.new_empty(len(token), x.shape[1])
        self._before_collective("experts")
        dist.all_to_all_single(back, partial, send_counts, recv_counts, group=self.group)
        self._mark("combine")
        self._count_bytes(sum(recv_counts[d] * x.shape[1] * x.element_size() for d in range(R) if d != self.rank))
        total = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for n in send_counts:  # rank by rank: no token twice in one index_add_, so the order is fixed
            total.index_add_(0, token[start:start + n], back[start:start + n].float())
            start += n
        total = total.to(x.dtype)
        self._mark("experts")  # the owner's sum of the partials is compute
        return total

    def _allgather_reducescatter(self, x, meta, token_counts, with_lora):
        T, T_max = x.shape[0], max(token_counts)
        if T_max == 0:
            return x.new_empty(0, x.shape[1])
        if T < T_max:  # padding rows (weight 0, idle experts) up to the largest rank's T
            x = torch.cat([x, x.new_zeros(T_max - T, x.shape[1])])
            meta = torch.cat([meta, self._pad_rows(T_max - T, with_lora, x.device)])
        out = self._gather_compute_scatter(x, meta, with_lora)
        return out[:T]

    def _gather_compute_scatter(self, x, meta, with_lora):
        """all_gather C rows per rank, partial sums of this rank's experts over all R * C, reduce_scatter: [C, H]."""
        R, C = self.world_size, x.shape[0]
        x_all = x.new_empty(R * C, x.shape[1])
        meta_all = meta.new_empty(R * C, meta.shape[1])
        self._before_collective("route")
        _all_gather(x_all, x, self.group)
        _all_gather(meta_all, meta, self.group)
        self._mark("dispatch")
        self._count_bytes((R - 1) * C * self._row_bytes(x, with_lora))
        partial = self._local_experts(x_all, meta_all, with_lora)
        out = x.new_empty(C, x.shape[1])
        self._before_collective("experts")
        _reduce_scatter(out, partial, self.group)
        self._mark("combine")
        self._count_bytes((R - 1) * C * x.shape[1] * x.element_size())
        return out

    # ------------------------------------------------------------------------------------------ static capacity

    def _static_forward(self, hidden_states, topk_weights, topk_ids, lora_ids, validate):
        """Fixed per-rank capacity C = ``max_tokens_per_rank``: every collective has sizes known at construction
        (C rows per rank pair), nothing reads the device from the host: CUDA-graph capturable."""
        error = None
        self._mark(None)
        try:
            self._check_call(hidden_states, topk_weights, topk_ids, lora_ids, validate)
            if hidden_states.shape[0] > self.max_tokens_per_rank:
                raise ValueError(f"hidden_states: expected at most max_tokens_per_rank = {self.max_tokens_per_rank} "
                                 f"tokens, got {hidden_states.shape[0]}; build the layer with a larger capacity or "
                                 f"split the batch")
        except Exception as err:
            error = err
        try:
            if validate:  # eager: every rank learns whether any rank's input was bad (one host sync)
                flags = torch.zeros(self.world_size, dtype=torch.int64, device=self.w13.device)
                _all_gather(flags, torch.tensor([int(error is not None)], device=self.w13.device), self.group)
                flags = flags.cpu()
                if error is not None:
                    _reraise(error, f"(rank {self.rank}; every rank of the group raised)")
                failed = flags.nonzero().flatten().tolist()
                if failed:
                    raise ValueError(f"ExpertParallelMoE: rank(s) {failed} rejected their input (their error says "
                                     f"why); no rank ran the layer")
            elif error is not None:  # take part with no tokens (the others must not wait), then raise here only
                H, K, device = self.w13.shape[2], self.top_k, self.w13.device
                self._static_call(self.w13.new_zeros(0, H), torch.zeros(0, K, device=device),
                                  torch.zeros(0, K, dtype=torch.int64, device=device), None)
                _reraise(error, f"(rank {self.rank}; the other ranks finished the call without this rank's "
                                f"tokens)")
        finally:
            del error  # no frame <-> traceback cycle (see _reraise)
        return self._static_call(hidden_states, topk_weights, topk_ids, lora_ids)

    def _static_call(self, x, topk_weights, topk_ids, lora_ids):
        C, T, H, R = self.max_tokens_per_rank, x.shape[0], x.shape[1], self.world_size
        with_lora = self.lora is not None
        if with_lora and lora_ids is None:
            lora_ids = torch.full((T,), -1, dtype=torch.int64, device=x.device)
        physical = self.physical_ids(topk_ids)
        meta = self._pack(topk_weights, physical, lora_ids if with_lora else None)
        if self.dispatch == "allgather_reducescatter":
            x_pad = x.new_zeros(C, H)
            x_pad[:T] = x
            meta_pad = self._pad_rows(C, with_lora, x.device)
            meta_pad[:T] = meta
            return self._gather_compute_scatter(x_pad, meta_pad, with_lora)[:T]
        # all_to_all with equal splits: C rows to each rank (row j of block d: the j-th token needing rank d)
        token_ranks = self._token_ranks(physical)  # [T, R]
        pos = torch.cumsum(token_ranks, 0) - 1  # [T, R]: the row of token t in block d
        slot = torch.where(token_ranks, pos, C) + torch.arange(R, device=x.device) * (C + 1)  # C: a discarded row
        x_send = x.new_zeros(R * (C + 1), H)
        x_send[slot.flatten()] = x.repeat_interleave(R, dim=0)
        meta_send = self._pad_rows(R * (C + 1), with_lora, x.device)
        meta_send[slot.flatten()] = meta.repeat_interleave(R, dim=0)
        x_send = x_send.view(R, C + 1, H)[:, :C].reshape(R * C, H)
        meta_send = meta_send.view(R, C + 1, -1)[:, :C].reshape(R * C, -1)
        x_recv, meta_recv = torch.empty_like(x_send), torch.empty_like(meta_send)
        self._before_collective("route")
        dist.all_to_all_single(x_recv, x_send, group=self.group)
        dist.all_to_all_single(meta_recv, meta_send, group=self.group)
        self._mark("dispatch")
        self._count_bytes((R - 1) * C * self._row_bytes(x, with_lora))
        partial = self._local_experts(x_recv, meta_recv, with_lora)
        back = torch.empty_like(partial)
        self._before_collective("experts")
        dist.all_to_all_single(back, partial, group=self.group)
        self._mark("combine")
        self._count_bytes((R - 1) * C * H * x.element_size())
        total = torch.zeros(T, H, dtype=torch.float32, device=x.device)
        rows = torch.where(token_ranks, pos, 0)  # [T, R]
        for d in range(R):  # rank by rank, as the dynamic all_to_all adds them
            total += torch.where(token_ranks[:, d:d + 1], back[d * C + rows[:, d]].float(), 0.0)
        total = total.to(x.dtype)
        self._mark("experts")
        return total
