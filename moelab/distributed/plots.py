"""Figures of notebook 09 (expert parallelism), in moelab.viz's style: ``plot_*(..., ax=None) -> Figure``, no
``plt.show()``, tensors copied to the CPU; the numbers come from the layer, the functions only arrange them."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = ["plot_dispatch", "plot_expert_load"]


def _axes(ax, figsize):
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize, layout="constrained")
        return fig, ax
    return ax.get_figure(root=True), ax


def plot_dispatch(dest_ranks, num_ranks: int, ax=None, *, source_rank: int = 0, title: str | None = None) -> Figure:
    """Which rank each of one rank's tokens goes to: a [T, R] grid, cell (t, r) = how many of token t's K
    experts live on rank r (0: the token is not sent there; the all_to_all mode sends it once if > 0).

    Args:
        dest_ranks: int [T, K], the rank of each slot's physical expert (``physical_ids // P_local``).
    """
    dest = torch.as_tensor(dest_ranks).to("cpu", torch.int64)
    T = dest.shape[0]
    grid = torch.zeros(T, num_ranks, dtype=torch.int64)
    if T:
        grid.scatter_add_(1, dest, torch.ones_like(dest))
    fig, ax = _axes(ax, (1.2 + 0.9 * num_ranks, 1.2 + 0.25 * max(T, 1)))
    image = ax.imshow(grid.numpy(), aspect="auto", interpolation="nearest", cmap="Blues", vmin=0,
                      vmax=max(int(dest.shape[1]) if dest.dim() == 2 else 1, 1))
    for t, r in zip(*np.nonzero(grid.numpy())):
        ax.text(r, t, str(int(grid[t, r])), ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="its experts on that rank", ticks=range(int(dest.shape[1]) + 1))
    ax.set_xticks(range(num_ranks), [f"{r}*" if r == source_rank else str(r) for r in range(num_ranks)])
    ax.set_xlabel("destination rank (* = its own)")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"token of rank {source_rank}")
    sent = int((grid > 0).sum()) - int((grid[:, source_rank] > 0).sum()) if T else 0
    ax.set_title(title or f"rank {source_rank}'s {T} tokens:\n{sent} copies sent to other ranks", loc="left",
                 fontsize=10)
    return fig


def plot_expert_load(load, expert_map, ax=None, *, title: str | None = None) -> Figure:
    """Slots each physical expert computed, as a [ranks, P_local] heatmap, each cell labelled with the logical
    expert it holds; the row totals (per-rank load) and max/mean on the right.

    Args:
        load: int [R, P_local]; expert_map: int [R * P_local], the logical expert of each physical expert.
    """
    load = torch.as_tensor(load).to("cpu", torch.int64)
    R, P_local = load.shape
    logical = torch.as_tensor(expert_map).to("cpu", torch.int64).view(R, P_local)
    fig, ax = _axes(ax, (1.5 + 0.7 * P_local, 1.0 + 0.6 * R))
    image = ax.imshow(load.numpy(), aspect="auto", interpolation="nearest", cmap="magma_r", vmin=0)
    for r in range(R):
        for j in range(P_local):
            ax.text(j, r, f"e{int(logical[r, j])}\n{int(load[r, j])}", ha="center", va="center", fontsize=7,
                    color="white" if load[r, j] > 0.6 * load.max() else "black")
    fig.colorbar(image, ax=ax, label="slots computed")
    totals = load.sum(1)
    ratio = (totals.max() / totals.double().mean()).item() if totals.sum() > 0 else float("nan")
    ax.set_yticks(range(R), [f"rank {r}: {int(totals[r])}" for r in range(R)])
    ax.set_xlabel("local physical expert (label: logical expert, slots)")
    ax.set_title(f"{title + ': ' if title else ''}max/mean rank load {ratio:.2f}", loc="left", fontsize=10)
    return fig
