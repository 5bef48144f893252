"""Expert-parallel metadata: where each expert lives, under the names vLLM's ``MixtureOfExperts`` models use.

One layer's experts, split over ``ep_size`` ranks, with EPLB's redundant copies of hot experts:

    num_logical_experts         E        the experts the router picks from (``topk_ids`` are logical ids)
    num_physical_experts        P        expert copies over all ranks: E plus the redundant ones
    num_local_physical_experts  P_local  copies each rank holds, P / ep_size (the rows of its ``w13``/``w2``)
    num_redundant_experts       P - E    extra copies of hot experts
    expert_map                  int64 [P] the logical expert physical expert p holds (one row of
                                ``rebalance_experts``' ``physical_to_logical_map``); physical expert p is local
                                expert ``p % P_local`` of rank ``p // P_local``. The default (no EPLB) is the
                                identity: rank r holds logical experts r*E/R .. (r+1)*E/R - 1.

Unlike vLLM's per-rank ``expert_map`` (global id -> local index or -1), moelab's is the placement itself, the same
on every rank; the local indices follow from it. :class:`ExpertParallelMetadata` holds one layer's; a model keeps
one per MoE layer and forwards ``update_physical_experts_metadata`` to each.

Example:
    >>> meta = ExpertParallelMetadata(num_logical_experts=4, num_physical_experts=6, num_local_physical_experts=3)
    >>> meta.ep_size, meta.num_redundant_experts, meta.expert_map.tolist()
    (2, 2, [0, 1, 2, 3, 0, 1])
    >>> logical_to_physical, replica_count = replica_maps(meta.expert_map, 4)
    >>> logical_to_physical.tolist(), replica_count.tolist()
    ([[0, 4], [1, 5], [2, -1], [3, -1]], [2, 2, 1, 1])
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Own argument checks: moelab's private helpers may move; these errors read the same (name, expected, got).
INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def check_int(name: str, value, *, low: int | None = None, high: int | None = None) -> int:
    """An int (not a bool) in [low, high], else a TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name}: expected an int in [{low}, {high}], got {value}")
    return value

__all__ = ["ExpertParallelMetadata", "check_expert_map", "default_expert_map", "replica_maps"]


def default_expert_map(num_logical_experts: int, num_physical_experts: int | None = None) -> torch.Tensor:
    """int64 [P]: physical expert p holds logical expert ``p % E`` (the identity when P == E; redundant copies,
    if any, repeat the experts in order)."""
    check_int("num_logical_experts", num_logical_experts, low=1)
    P = num_logical_experts if num_physical_experts is None else num_physical_experts
    check_int("num_physical_experts", P, low=num_logical_experts)
    return torch.arange(P, dtype=torch.int64) % num_logical_experts


def check_expert_map(expert_map, *, num_logical_experts: int, num_physical_experts: int | None = None,
                     num_local_physical_experts: int | None = None, ep_size: int | None = None) -> torch.Tensor:
    """Validate a placement and return it as int64 [P] on the CPU (see the module docstring).

    Raises ValueError naming what is wrong: a length other than ``num_physical_experts`` (or than
    ``ep_size * num_local_physical_experts``: a physical expert on a rank that does not exist), a logical id
    outside [0, E), or a logical expert with no physical copy (tokens routed to it would have nowhere to go).
    """
    check_int("num_logical_experts", num_logical_experts, low=1)
    if not isinstance(expert_map, torch.Tensor):
        try:
            expert_map = torch.as_tensor(expert_map, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"expert_map: expected an int tensor [num_physical_experts], got "
                            f"{type(expert_map).__name__}") from err
    if expert_map.dtype not in INT_DTYPES or expert_map.dim() != 1:
        raise TypeError(f"expert_map: expected a 1-D int tensor [num_physical_experts], got {expert_map.dtype} "
                        f"of shape {list(expert_map.shape)}")
    expert_map = expert_map.detach().to("cpu", torch.int64)
    P = expert_map.numel()
    if num_physical_experts is not None and P != num_physical_experts:
        raise ValueError(f"expert_map: expected {num_physical_experts} entries (one per physical expert), got {P}")
    if num_local_physical_experts is not None and ep_size is not None and P != ep_size * num_local_physical_experts:
        ranks = -(-P // num_local_physical_experts)
        raise ValueError(f"expert_map: expected ep_size * num_local_physical_experts = {ep_size} * "
                         f"{num_local_physical_experts} = {ep_size * num_local_physical_experts} entries, got {P}: "
                         f"physical expert p lives on rank p // {num_local_physical_experts}, so this map places "
                         f"experts on {ranks} ranks (ranks 0..{ranks - 1}) in a group of {ep_size}")
    if P < num_logical_experts:
        raise ValueError(f"expert_map: expected at least num_logical_experts={num_logical_experts} physical experts "
                         f"(one copy of each), got {P}")
    bad = ((expert_map < 0) | (expert_map >= num_logical_experts)).nonzero()
    if bad.numel():
        p = int(bad[0, 0])
        raise ValueError(f"expert_map: expected logical expert ids in [0, {num_logical_experts}), got "
                         f"{int(expert_map[p])} at physical expert {p}")
    count = torch.bincount(expert_map, minlength=num_logical_experts)
    missing = (count == 0).nonzero().flatten().tolist()
    if missing:
        raise ValueError(f"expert_map: every logical expert needs at least one physical copy; logical expert(s) "
                         f"{missing[:8]}{' ...' if len(missing) > 8 else ''} have none")
    return expert_map


def replica_maps(expert_map: torch.Tensor, num_logical_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EPLB's two inverse maps of a (checked) placement ``expert_map`` int [P].

    Returns ``(logical_to_physical_map int64 [E, max_replicas], logical_replica_count int64 [E])``: row e lists
    the physical experts holding logical expert e in ascending order, padded with -1.
    """
    expert_map = expert_map.to("cpu", torch.int64)
    count = torch.bincount(expert_map, minlength=num_logical_experts)
    table = torch.full((num_logical_experts, max(int(count.max()), 1)), -1, dtype=torch.int64)
    order = torch.sort(expert_map, stable=True).indices  # physical ids grouped by logical id, ascending
    start = torch.cumsum(count, 0) - count
    replica = torch.arange(expert_map.numel()) - start[expert_map[order]]
    table[expert_map[order], replica] = order
    return table, count


@dataclass
class ExpertParallelMetadata:
    """One MoE layer's expert placement (names as in vLLM's ``MixtureOfExperts``; see the module docstring).

    ``num_physical_experts`` defaults to E (no redundancy), ``num_local_physical_experts`` to P (one rank),
    ``expert_map`` to :func:`default_expert_map`. ``ep_size`` and ``num_redundant_experts`` follow from them.
    """

    num_logical_experts: int
    num_physical_experts: int | None = None
    num_local_physical_experts: int | None = None
    expert_map: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        E = check_int("num_logical_experts", self.num_logical_experts, low=1)
        if self.num_physical_experts is None:
            self.num_physical_experts = E if self.expert_map is None else len(self.expert_map)
        P = check_int("num_physical_experts", self.num_physical_experts, low=E)
        if self.num_local_physical_experts is None:
            self.num_local_physical_experts = P
        P_local = check_int("num_local_physical_experts", self.num_local_physical_experts, low=1, high=P)
        if P % P_local:
            raise ValueError(f"num_physical_experts: expected a multiple of num_local_physical_experts={P_local} "
                             f"(every rank holds as many), got {P}")
        if self.expert_map is None:
            self.expert_map = default_expert_map(E, P)
        self.expert_map = check_expert_map(self.expert_map, num_logical_experts=E, num_physical_experts=P)

    @property
    def ep_size(self) -> int:
        """Ranks the physical experts are spread over: P / P_local."""
        return self.num_physical_experts // self.num_local_physical_experts

    @property
    def num_redundant_experts(self) -> int:
        """P - E: the extra copies of hot experts."""
        return self.num_physical_experts - self.num_logical_experts

    def update_physical_experts_metadata(self, num_physical_experts: int, num_local_physical_experts: int,
                                         expert_map: torch.Tensor | None = None) -> None:
        """Take a new physical layout (vLLM's hook of the same name; ``expert_map`` is moelab's addition).

        The local count cannot change (each rank's weight buffers are sized by it), as in vLLM. Without
        ``expert_map`` the map must still fit (same P), else pass the new placement, e.g. a row of
        :func:`moelab.distributed.rebalance_experts`' ``physical_to_logical_map``.
        """
        check_int("num_physical_experts", num_physical_experts, low=self.num_logical_experts)
        if num_local_physical_experts != self.num_local_physical_experts:
            raise ValueError(f"num_local_physical_experts: expected {self.num_local_physical_experts} (each rank's "
                             f"weights are sized by it), got {num_local_physical_experts}")
        if num_physical_experts % num_local_physical_experts:
            raise ValueError(f"num_physical_experts: expected a multiple of num_local_physical_experts="
                             f"{num_local_physical_experts}, got {num_physical_experts}")
        if expert_map is None:
            expert_map = self.expert_map
        expert_map = check_expert_map(expert_map, num_logical_experts=self.num_logical_experts,
                                      num_physical_experts=num_physical_experts)
        self.num_physical_experts, self.expert_map = num_physical_experts, expert_map

    def local_logical_experts(self, rank: int) -> torch.Tensor:
        """int64 [P_local]: the logical expert each of ``rank``'s local experts holds (its rows of w13/w2)."""
        check_int("rank", rank, low=0, high=self.ep_size - 1)
        P_local = self.num_local_physical_experts
        return self.expert_map[rank * P_local:(rank + 1) * P_local].clone()
