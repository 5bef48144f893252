"""Router logits to top-k (weights, ids): the six routing methods FlashInfer and vLLM know (docs/contract.md §6).

    router_logits   [T, E]  bf16/fp16/fp32  one score per (token, expert), straight from the gate linear
    topk_ids        [T, K]  int32           chosen global experts, by descending selection score
    topk_weights    [T, K]  fp32            their routing weights, ``routed_scaling_factor`` folded in

Every method is a monotone *selection score* (which experts) plus a *weight* (how much of each), both in fp32.
Ids come out in the order of the float64 reference :func:`moelab.reference.route`: descending selection score,
ties to the lower expert id. ``torch.topk`` promises no order among equal values (bf16 logits tie often), so
the selection uses a stable descending sort instead; for E = 256 experts that is still a tiny kernel.

Where the selection score is a monotone function of the logit alone (softmax, renormalize_naive, sigmoid,
llama4), the logits themselves are sorted: same order, but no ties made up by fp32 rounding (fp32 sigmoid is
exactly 1.0 above a logit of ~17; an fp32 softmax underflows to 0 for logits ~104 below the maximum).

The weights feed :func:`moelab.pack_topk_ids_weights` unchanged: routed MoE applies no routing math itself.
"""

from __future__ import annotations

import math
import numbers

import torch

from moelab._checks import FLOAT_DTYPES, check_int, check_same_device, check_tensor

__all__ = ["ROUTING_METHODS", "route"]

#: The names ``route(..., method=...)`` accepts.
ROUTING_METHODS = ("softmax", "renormalize", "renormalize_naive", "sigmoid", "deepseek_v3", "llama4")

#: Methods whose selection score is a monotone function of the logit, so the logits are sorted directly.
_SELECT_BY_LOGIT = ("softmax", "renormalize", "renormalize_naive", "sigmoid", "llama4")


def _top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [..., k]: indices of the k largest scores along the last dim, largest first, ties to the lower index."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def _check_deepseek_args(num_experts: int, top_k: int, n_group, topk_group) -> tuple[int, int]:
    """(n_group, topk_group) with their defaults filled in: one group, all groups kept."""
    n_group = 1 if n_group is None else check_int("n_group", n_group, low=1, high=num_experts)
    if num_experts % n_group:
        raise ValueError(f"n_group: expected a divisor of the number of experts E={num_experts} "
                         f"(router_logits.shape[1]), got {n_group}")
    topk_group = n_group if topk_group is None else check_int("topk_group", topk_group, low=1, high=n_group)
    kept = topk_group * (num_experts // n_group)
    if top_k > kept:
        raise ValueError(f"top_k: expected at most the {kept} experts of the kept groups (topk_group * E / n_group "
                         f"= {topk_group} * {num_experts} / {n_group}), got {top_k}")
    return n_group, topk_group


def _deepseek_v3_ids(biased: torch.Tensor, top_k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """Group-limited selection on the biased scores [T, E]: best top-2 sums pick groups, then top-k within them."""
    T, E = biased.shape
    group_size = E // n_group
    grouped = biased.view(T, n_group, group_size)
    group_scores = grouped.topk(min(2, group_size), dim=-1).values.sum(dim=-1)  # [T, n_group]; values only
    kept_groups = _top(group_scores, topk_group)  # [T, topk_group]
    group_mask = torch.zeros(T, n_group, dtype=torch.bool, device=biased.device)
    group_mask.scatter_(1, kept_groups, True)
    kept_biased = grouped.masked_fill(~group_mask.unsqueeze(-1), float("-inf")).view(T, E)  # dropped: -inf
    return _top(kept_biased, top_k)


def route(router_logits: torch.Tensor, top_k: int, method: str = "renormalize", *, n_group: int | None = None,
          topk_group: int | None = None, correction_bias: torch.Tensor | None = None,
          routed_scaling_factor: float = 1.0, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token from router logits and weigh them, in fp32, on the logits' device.

    Args:
        router_logits: bf16/fp16/fp32 (fp64 accepted) [T, E]; upcast to fp32 before any math.
        top_k: K, in ``[1, E]``; must be 1 for ``"llama4"``.
        method: with ``x`` the fp32 logits of one token, ``S`` the K chosen experts:

            - ``"softmax"``: ``p = softmax(x)``; ``S`` = top-k of ``p``; ``w = p[S]`` (not renormalised).
            - ``"renormalize"`` (default): ``S`` = top-k of ``x``; ``w = softmax(x[S])``.
            - ``"renormalize_naive"``: ``p = softmax(x)``; ``S`` = top-k of ``p``; ``w = p[S] / sum(p[S])``.
            - ``"sigmoid"``: ``s = sigmoid(x)``; ``S`` = top-k of ``s``; ``w = s[S]`` (not renormalised).
            - ``"deepseek_v3"``: ``s = sigmoid(x)``, ``b = s + correction_bias`` (selection only); split the E
              experts into ``n_group`` equal groups of consecutive ids, score each group by the sum of its two
              largest ``b``; keep the ``topk_group`` best groups; ``S`` = top-k of ``b`` among the kept experts;
              ``w = s[S] / sum(s[S])`` (unbiased scores).
            - ``"llama4"``: ``S`` = top-1 of ``x``; ``w = sigmoid(x[S])``.

            Every method then multiplies ``w`` by ``routed_scaling_factor``.
        n_group: deepseek_v3 only; a divisor of E (default 1: one group).
        topk_group: deepseek_v3 only; groups kept, in ``[1, n_group]`` (default ``n_group``: all). The kept
            groups must hold at least ``top_k`` experts.
        correction_bias: deepseek_v3 only; float [E] on the logits' device (default: no bias).
        routed_scaling_factor: multiplies the final weights of every method (default 1.0); finite.
        validate: read ``correction_bias`` to reject NaN and inf (one host sync, deepseek_v3 with a bias only).
            Pass False under CUDA-graph capture.

    Returns:
        ``(topk_weights fp32 [T, K], topk_ids int32 [T, K])``, ids by descending selection score (ties: lower
        id first), as :func:`moelab.reference.route`. T = 0 gives empty ``[0, K]`` tensors. No host sync except
        the ``correction_bias`` check (``validate=False`` skips it): ``route`` is then safe under CUDA-graph capture.

    Raises:
        TypeError: ``router_logits`` or ``correction_bias`` not a float tensor, a non-int ``top_k``/``n_group``/
            ``topk_group``, a non-real ``routed_scaling_factor``.
        ValueError: a bad shape, range or method (the message names the argument, what was expected and what
            was given), or a deepseek_v3-only argument passed to another method.

    Example:
        >>> logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
        >>> weights, ids = route(logits, 2)
        >>> ids.tolist(), [round(w, 4) for w in weights[0].tolist()]
        ([[1, 2]], [0.7311, 0.2689])
        >>> route(logits, 2, "deepseek_v3", n_group=2, topk_group=1, routed_scaling_factor=2.5)[1].tolist()
        [[1, 0]]
    """
    check_tensor("router_logits", router_logits, dtypes=FLOAT_DTYPES + (torch.float64,), ndim=2)
    if method not in ROUTING_METHODS:
        raise ValueError(f"method: expected one of {', '.join(map(repr, ROUTING_METHODS))}, got {method!r}")
    T, E = router_logits.shape
    check_int("top_k", top_k, low=1, high=E)
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor, numbers.Real):
        raise TypeError(f"routed_scaling_factor: expected a real number, got {type(routed_scaling_factor).__name__}")
    if not math.isfinite(routed_scaling_factor):
        raise ValueError(f"routed_scaling_factor: expected a finite number, got {routed_scaling_factor}")
    if method != "deepseek_v3":
        # The reference ignores them; here they are an error, since ignoring them would hide a mis-configured router.
        for name, value in (("n_group", n_group), ("topk_group", topk_group), ("correction_bias", correction_bias)):
            if value is not None:
                raise ValueError(f"{name}: expected None for method {method!r} (only 'deepseek_v3' uses it), "
                                 f"got {type(value).__name__ if isinstance(value, torch.Tensor) else value}")
    if method == "llama4" and top_k != 1:
        raise ValueError(f"top_k: expected 1 for method 'llama4' (top-1 routing), got {top_k}")

    x = router_logits.float()
    if method in _SELECT_BY_LOGIT:
        ids = _top(x, top_k)
        if method == "softmax":
            weights = x.softmax(dim=-1).gather(1, ids)
        elif method == "renormalize":
            weights = x.gather(1, ids).softmax(dim=-1)
        elif method == "renormalize_naive":
            weights = x.softmax(dim=-1).gather(1, ids)
            weights = weights / weights.sum(dim=-1, keepdim=True)
        else:  # sigmoid, llama4 (top_k == 1)
            weights = x.gather(1, ids).sigmoid()
    else:  # deepseek_v3
        n_group, topk_group = _check_deepseek_args(E, top_k, n_group, topk_group)
        scores = x.sigmoid()
        biased = scores
        if correction_bias is not None:
            check_tensor("correction_bias", correction_bias, dtypes=FLOAT_DTYPES + (torch.float64,), shape=(E,))
            check_same_device(router_logits=router_logits, correction_bias=correction_bias)
            if validate and not bool(torch.isfinite(correction_bias).all()):
                bad = (~torch.isfinite(correction_bias)).nonzero().flatten().tolist()
                raise ValueError(f"correction_bias: expected finite values, got {correction_bias[bad[0]].item()} at "
                                 f"expert {bad[0]} ({len(bad)} of {E} not finite); a NaN or inf bias would pick "
                                 f"its expert for every token")
            biased = scores + correction_bias.float()
        ids = _deepseek_v3_ids(biased, top_k, n_group, topk_group)
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routed_scaling_factor, ids.to(torch.int32)
