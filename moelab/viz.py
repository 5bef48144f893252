"""Figures of the notebooks: each ``plot_*`` draws one idea of moelab.

One style for all of them:

- ``plot_*(..., ax=None) -> Figure`` draws into ``ax`` when given, else into a new figure, and returns the
  Figure. :func:`plot_layout_maps` draws three panels and takes a sequence of three Axes.
- Nothing here calls ``plt.show()``: a notebook's inline backend shows the figure, tests use Agg.
- Tensors may live on any device; they are copied to the CPU. The numbers drawn come from moelab's kernels
  and from ``moelab.reference``; the functions only arrange them (the layout maps are moelab.layout's own).
- Colours mean the same thing everywhere: :data:`COLORS` for fields and halves, :func:`expert_color` for experts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle
from matplotlib.ticker import EngFormatter, MaxNLocator

from moelab import layout
from moelab.lab import rel_err
from moelab.packing import unpack_topk_ids_weights

__all__ = ["COLORS", "expert_color", "save_figure", "PIPELINE_STEPS", "plot_pipeline", "plot_packed_bits",
           "plot_permutation_map", "plot_error_heatmap", "plot_token_errors", "plot_partial_output", "plot_bytes",
           "plot_row_map", "plot_layout_maps", "plot_block_major_k", "plot_roofline", "plot_times"]

#: Field and half colours shared by every figure.
COLORS = {
    "id": "#4C72B0", "sign": "#C44E52", "exponent": "#DD8452", "mantissa": "#55A868",
    "up": "#4C72B0", "gate": "#DD8452",
    "padding": "#D9D9D9", "dropped": "#8C8C8C", "nan": "#00C8FF", "roof": "#333333",
}


def expert_color(e: int):
    """The colour of local expert ``e`` (cycles through tab10)."""
    return plt.get_cmap("tab10")(int(e) % 10)


def detached_figure(nrows: int = 1, ncols: int = 1, *, figsize=(8, 3), **subplot_kw):
    """``(fig, axes)`` of a figure pyplot does not track, for ipywidgets callbacks; show it with ``display(fig)``.

    In JupyterLab 4.6 (ipykernel 7) a widget message can be handled on the kernel's second thread while
    matplotlib-inline's end-of-execution hook flushes and closes every pyplot figure, so a pyplot figure drawn in
    a callback can reach the browser blank or half drawn. A figure made here is out of pyplot's reach.
    """
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.subplots(nrows, ncols, **subplot_kw)


def _axes(ax, figsize) -> tuple[Figure, plt.Axes]:
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize, layout="constrained")
        return fig, ax
    return ax.get_figure(root=True), ax


def _numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64 if x.is_floating_point() else torch.int64).numpy()
    return np.asarray(x)


def save_figure(fig: Figure, out_dir: str | os.PathLike | None, name: str, *, dpi: int = 110) -> None:
    """Save ``fig`` as ``<out_dir>/<name>.png``, making the folders; ``out_dir=None`` saves nothing.

    Returns None, so a notebook cell ending with it shows only the figure.
    """
    if out_dir is None:
        return
    path = Path(out_dir) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)


# ---------------------------------------------------------------------------------------------- the pipeline

#: The steps of one MoE-LoRA layer as :func:`plot_pipeline` draws them: the moelab call, the tensors it makes
#: (name, symbolic shape), the notebook that teaches it, and the vLLM / FlashInfer function it mirrors. Steps with
#: ``inside`` run inside one ``moelab.routed_moe`` call (FlashInfer's ``trtllm_bf16_routed_moe``).
PIPELINE_STEPS = (
    dict(step="route", call="moelab.route", outputs=(("topk_ids", "[T, K]"), ("topk_weights", "[T, K]")),
         notebook="00 (here)", mirrors="vLLM fused_topk (FusedTopKRouter)"),
    dict(step="pack", call="moelab.pack_topk_ids_weights", outputs=(("packed", "[T, K]"),), notebook="01",
         mirrors="vLLM trtllm_moe_pack_topk_ids_weights"),
    dict(step="W13 delta", call="moelab.w13_lora_delta", outputs=(("gemm1_lora_delta", "[T, K, 2I] [up, gate]"),),
         notebook="02", mirrors="vLLM apply_w13_lora(swap_w13_slices=True)"),
    dict(step="map (routing)", call="routed_moe: sort slots by expert", inside=True,
         outputs=(("expanded_idx_to_permuted_idx", "[T*K]"),), notebook="03",
         mirrors="FlashInfer trtllm_bf16_routed_moe: routing"),
    dict(step="GEMM1 + SwiGLU", call="routed_moe: x W13^T + delta, silu(gate) * up", inside=True,
         outputs=(("gemm1_activation_output", "[R1, I] permuted"),), notebook="02, 06",
         mirrors="FlashInfer trtllm_bf16_routed_moe: GEMM1"),
    dict(step="GEMM2", call="routed_moe: act W2^T, do_finalize=False", inside=True,
         outputs=(("gemm2_output", "[R2, H] permuted"),), notebook="04",
         mirrors="FlashInfer trtllm_bf16_routed_moe: GEMM2"),
    dict(step="unpermute", call="moelab.unpermute_activation", outputs=(("act", "[T*K, I]"),), notebook="03",
         mirrors="vLLM _unpermute_activation_kernel"),
    dict(step="W2 delta", call="moelab.w2_lora_delta", outputs=(("w2_delta", "[T, K, H] weighted"),),
         notebook="05", mirrors="vLLM apply_w2_lora"),
    dict(step="finalize", call="moelab.finalize_with_w2_lora", outputs=(("output", "[T, H]"),), notebook="04",
         mirrors="vLLM _finalize_lora_kernel"),
)


def _shape_text(t) -> str:
    dtype = str(t.dtype).replace("torch.", "")
    return f"{list(t.shape)} {dtype}"


def plot_pipeline(tensors: Mapping[str, torch.Tensor], ax=None, *, title: str | None = None) -> Figure:
    """The whole MoE-LoRA layer as one picture: each step of :data:`PIPELINE_STEPS` with the real shapes and
    dtypes of the tensors it made, the notebook that teaches it and the vLLM / FlashInfer function it mirrors.
    The whole is ``moelab.LoRAExperts`` (vLLM's ``TrtLlmBf16LoRAExperts.apply``).

    Args:
        tensors: name -> tensor for every output named in :data:`PIPELINE_STEPS` (``topk_ids``, ``packed``,
            ``gemm1_lora_delta``, ..., ``output``), from one real call.
    """
    missing = [name for s in PIPELINE_STEPS for name, _ in s["outputs"] if name not in tensors]
    if missing:
        raise ValueError(f"tensors: expected every pipeline tensor, missing {missing}")
    n = len(PIPELINE_STEPS)
    fig, ax = _axes(ax, (15, 0.75 * n + 1.6))
    row_h = 1.0
    top = n * row_h
    inside = [i for i, s in enumerate(PIPELINE_STEPS) if s.get("inside")]
    if inside:  # the routed_moe bracket
        y0, y1 = top - (inside[-1] + 1) * row_h + 0.08, top - inside[0] * row_h - 0.08
        ax.add_patch(Rectangle((0.005, y0), 0.99, y1 - y0, facecolor="#EEF3FA", edgecolor=COLORS["up"],
                               linewidth=1.0, linestyle="--"))
        ax.text(0.31, y1 - 0.03, "one call: moelab.routed_moe(do_finalize=False, gemm1_lora_delta=...) = FlashInfer "
                "trtllm_bf16_routed_moe (vLLM invoke_routed_moe)", fontsize=8, va="top", color=COLORS["up"],
                style="italic")
    for i, s in enumerate(PIPELINE_STEPS):
        y = top - (i + 0.5) * row_h - (0.1 if s.get("inside") else 0.0)
        box = FancyBboxPatch((0.02, y - 0.3), 0.27, 0.6, boxstyle="round,pad=0.01", facecolor="white",
                             edgecolor="#444444", linewidth=1.0)
        ax.add_patch(box)
        ax.text(0.03, y + 0.1, s["step"], fontsize=10, weight="bold", va="center")
        ax.text(0.03, y - 0.14, s["call"], fontsize=7.5, va="center", family="monospace", color="#333333")
        outs = "\n".join(f"{name} {sym} = {_shape_text(tensors[name])}" for name, sym in s["outputs"])
        ax.text(0.31, y, outs, fontsize=8.5, va="center", family="monospace")
        ax.text(0.72, y + 0.12, f"notebook {s['notebook']}", fontsize=8.5, va="center", color=COLORS["gate"],
                weight="bold")
        ax.text(0.72, y - 0.14, s["mirrors"], fontsize=8, va="center", color="#555555")
        if i + 1 < n:
            nxt = top - (i + 1.5) * row_h - (0.1 if PIPELINE_STEPS[i + 1].get("inside") else 0.0)
            ax.annotate("", xy=(0.155, nxt + 0.31), xytext=(0.155, y - 0.31),
                        arrowprops=dict(arrowstyle="->", color="#444444", linewidth=1.0))
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.3, top + 0.1)
    ax.axis("off")
    ax.set_title(title or "moelab.LoRAExperts, step by step = vLLM TrtLlmBf16LoRAExperts.apply", loc="left",
                 fontsize=11)
    return fig


# ---------------------------------------------------------------------------------------------- packing

_BIT_FIELDS = (("expert id (int16)", 31, 16, "id"), ("sign", 15, 15, "sign"), ("exponent", 14, 7, "exponent"),
               ("mantissa", 6, 0, "mantissa"))


def plot_packed_bits(words, labels: Sequence[str] | None = None, ax=None, *, title: str | None = None) -> Figure:
    """The 32 bits of packed routing words, one row per word, bit 31 on the left.

    Bits 31..16 hold the expert id (signed int16), bits 15..0 the bf16 weight: sign, 8 exponent bits, 7 mantissa
    bits. A 1 bit is drawn in full colour, a 0 bit pale. Each row ends with what ``moelab.unpack_topk_ids_weights``
    decodes from it.

    Args:
        words: int32 routing words, any shape (flattened), e.g. from :func:`moelab.pack_topk_ids_weights`.
        labels: one label per word, drawn left of its row.
    """
    flat = torch.as_tensor(words, dtype=torch.int32).detach().cpu().reshape(-1)
    n = flat.numel()
    labels = list(labels) if labels is not None else [f"word {i}" for i in range(n)]
    if len(labels) != n:
        raise ValueError(f"labels: expected {n} labels (one per word), got {len(labels)}")
    ids, weights = unpack_topk_ids_weights(flat[None])
    fig, ax = _axes(ax, (12, 0.9 + 0.5 * n))
    field_of = {}
    for _, hi, lo, key in _BIT_FIELDS:
        for b in range(lo, hi + 1):
            field_of[b] = key
    for row, word in enumerate(flat.tolist()):
        unsigned = word & 0xFFFFFFFF
        for bit in range(32):
            x, value = 31 - bit, (unsigned >> bit) & 1
            ax.add_patch(Rectangle((x, row), 0.94, 0.86, color=COLORS[field_of[bit]], alpha=0.9 if value else 0.2,
                                   linewidth=0))
            ax.text(x + 0.47, row + 0.43, str(value), ha="center", va="center", fontsize=8,
                    color="white" if value else "black")
        ax.text(32.4, row + 0.43, f"id = {int(ids[0, row])}   w = {float(weights[0, row]):g}", va="center",
                fontsize=9, family="monospace")
    for name, hi, lo, key in _BIT_FIELDS:
        ax.text(31 - (hi + lo) / 2 + 0.47, -0.35, name, ha="center", va="bottom", fontsize=9, color=COLORS[key],
                weight="bold")
    ax.set_xlim(-0.2, 40)
    ax.set_ylim(n, -0.9)
    ax.set_yticks(np.arange(n) + 0.43, labels)
    ax.set_xticks([31 - b + 0.47 for b in (31, 16, 15, 7, 0)], ["31", "16", "15", "7", "0"])
    ax.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("bit")
    ax.set_title(title or "packed routing word: (id << 16) | (bf16 bits & 0xFFFF)", loc="left")
    return fig


# ---------------------------------------------------------------------------------------------- permutation

def plot_permutation_map(expanded_idx_to_permuted_idx, topk_ids, ax=None, *, local_expert_offset: int = 0,
                         num_local_experts: int | None = None, tile: int | None = None,
                         num_rows: int | None = None, title: str | None = None) -> Figure:
    """Each slot ``t*K+k`` (top) wired to its permuted row (bottom), coloured by local expert.

    Bottom: one segment per local expert in ascending order, each starting at a multiple of ``tile`` and padded
    to it (grey hatched rows belong to no slot). Top: a non-local slot (map -1: its expert lives on another rank)
    is grey, hatched and unwired.

    Args:
        expanded_idx_to_permuted_idx: int [T*K] (from :func:`moelab.routed_moe`).
        topk_ids: int [T, K], global ids.
        local_expert_offset, num_local_experts: this rank's window (default: every id is local).
        tile: rows per tile, to draw tile boundaries and the padding of the last segment.
        num_rows: rows allocated (R1 or R2): noted when it exceeds the rows drawn.
    """
    e2p = _numpy(expanded_idx_to_permuted_idx).reshape(-1).astype(np.int64)
    ids = _numpy(topk_ids).astype(np.int64)
    T, K = ids.shape
    if e2p.size != T * K:
        raise ValueError(f"expanded_idx_to_permuted_idx: expected {T * K} entries (T*K), got {e2p.size}")
    local = ids.reshape(-1) - local_expert_offset
    E_local = num_local_experts if num_local_experts is not None else int(ids.max()) + 1 - local_expert_offset
    live_end = int(e2p.max()) + 1 if (e2p >= 0).any() else 0
    if tile:
        live_end = -(-live_end // tile) * tile
    row_expert = np.full(live_end, -1)
    row_expert[e2p[e2p >= 0]] = local[e2p >= 0]
    S = T * K
    n = max(S, live_end, 1)
    fig, ax = _axes(ax, (min(14.0, 2.0 + 0.24 * n), 3.6))
    small = 7 if n > 56 else 9
    top, bottom = 3.0, 0.0
    for s in range(S):
        t, k = divmod(s, K)
        is_local = e2p[s] >= 0
        color = expert_color(local[s]) if is_local else COLORS["dropped"]
        ax.add_patch(Rectangle((s, top), 0.9, 0.8, facecolor=color, alpha=0.9 if is_local else 0.35,
                               hatch=None if is_local else "xxx", edgecolor="white", linewidth=0.5))
        ax.text(s + 0.45, top + 0.4, str(ids[t, k]), ha="center", va="center", fontsize=small,
                color="white" if is_local else "black", weight="bold")
        if is_local:
            ax.plot([s + 0.45, e2p[s] + 0.45], [top, bottom + 0.8], color=color, linewidth=1.0, alpha=0.9)
        else:
            ax.text(s + 0.45, top - 0.1, "-1", ha="center", va="top", fontsize=small, color="black")
    for t in range(T + 1):
        ax.plot([t * K - 0.05] * 2, [top - 0.05, top + 0.85], color="black", linewidth=0.6)
        if t < T:
            ax.text(t * K + K / 2 - 0.05, top + 0.95, f"t{t}", ha="center", va="bottom", fontsize=small)
    for p in range(live_end):
        e = row_expert[p]
        face = expert_color(e) if e >= 0 else COLORS["padding"]
        ax.add_patch(Rectangle((p, bottom), 0.9, 0.8, facecolor=face, alpha=0.9 if e >= 0 else 1.0,
                               hatch=None if e >= 0 else "////", edgecolor="white", linewidth=0.5))
    for e in range(E_local):
        rows = np.flatnonzero(row_expert == e)
        if rows.size:
            ax.text(rows[0], bottom - 0.1, f"expert {e + local_expert_offset}", ha="left", va="top", fontsize=9,
                    color=expert_color(e), weight="bold")
    if tile:
        for b in range(0, live_end + 1, tile):
            ax.plot([b - 0.05] * 2, [bottom - 0.1, bottom + 0.9], color="black", linewidth=1.0)
            ax.text(b - 0.05, bottom - 0.6, str(b), ha="center", va="top", fontsize=small)
    note = ""
    if num_rows is not None and num_rows > live_end:
        note = f"; rows {live_end}..{num_rows - 1} of the {num_rows} allocated are dead (no slot, never read)"
    ax.text(-0.6, top + 0.4, "slot t*K+k:\nits global expert", ha="right", va="center", fontsize=9)
    ax.text(-0.6, bottom + 0.4, "permuted row", ha="right", va="center", fontsize=9)
    ax.set_xlim(-0.5, n + 0.5)
    ax.set_ylim(bottom - 1.2, top + 1.6)
    ax.axis("off")
    window = f"local experts [{local_expert_offset}, {local_expert_offset + E_local})"
    ax.set_title((title or f"expanded_idx_to_permuted_idx, {window}") + (f", tile {tile}" if tile else "") + note,
                 loc="left", fontsize=9)
    return fig


# ---------------------------------------------------------------------------------------------- errors

def plot_error_heatmap(out, ref, ax=None, *, title: str | None = None, vmin: float = 1e-5, vmax: float = 1.0,
                       xlabel: str = "hidden column h", ylabel: str = "token t", colorbar: bool = True) -> Figure:
    """``|out - ref| / rms(ref)`` per element, on a log colour scale (NaN drawn cyan).

    Args:
        out: [T, H] (or any 2-D) result of a kernel.
        ref: same shape, the float64 truth from ``moelab.reference``.
        vmin, vmax: colour range; pass the same to heatmaps that should be compared. Exact zeros show as vmin.
    """
    o, r = _numpy(out).astype(np.float64), _numpy(ref).astype(np.float64)
    if o.ndim != 2 or o.shape != r.shape:
        raise ValueError(f"out: expected a 2-D array of the reference's shape {list(r.shape)}, got {list(o.shape)}")
    rms = float(np.sqrt(np.mean(r**2))) or 1.0
    err = np.abs(o - r) / rms
    shown = np.where(np.isnan(err), np.nan, np.clip(err, vmin, None))
    fig, ax = _axes(ax, (7, 3.6))
    cmap = plt.get_cmap("magma").with_extremes(bad=COLORS["nan"])
    image = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap=cmap, norm=LogNorm(vmin=vmin, vmax=vmax))
    if colorbar:
        fig.colorbar(image, ax=ax, label="|out - ref| / rms(ref)")
    e = rel_err(torch.from_numpy(o), torch.from_numpy(r))
    n_nan = int(np.isnan(err).sum())
    nan_note = f", {n_nan} NaN" if n_nan else ""
    if n_nan:  # the colour bar has no NaN: a legend entry says what the cyan cells are
        ax.legend(handles=[Patch(color=COLORS["nan"], label=f"NaN ({n_nan} cells)")], loc="lower right",
                  fontsize=8, framealpha=0.95)
    ax.set_title(f"{title + ': ' if title else ''}rel err = {e:.1e}{nan_note}", loc="left", fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return fig


def plot_token_errors(errors, ax=None, *, groups=None, group_name: str = "adapter", tol: float | None = None,
                      floor: float = 1e-8, title: str | None = None, ylabel: str = "rel err of the row") -> Figure:
    """One bar per token: its relative error (log scale), coloured by group (e.g. the token's adapter).

    Args:
        errors: float [T], e.g. ``||out[t] - ref[t]|| / ||ref[t]||``. Zeros are drawn at ``floor`` and marked.
        groups: int [T], the group of each token; -1 (no adapter) is grey.
        tol: draws the tolerance as a dashed line.
        ylabel: what the bars are (default: the row's relative error against a reference).
    """
    err = _numpy(errors).astype(np.float64).reshape(-1)
    T = err.size
    groups = np.full(T, -1) if groups is None else _numpy(groups).reshape(-1)
    fig, ax = _axes(ax, (8, 3))
    colors = [COLORS["dropped"] if g < 0 else expert_color(g) for g in groups]
    ax.bar(np.arange(T), np.maximum(np.nan_to_num(err, nan=np.inf, posinf=1e6), floor), color=colors, width=0.85,
           bottom=floor * 0.5)
    zeros = np.flatnonzero(err == 0)
    if zeros.size:
        ax.plot(zeros, np.full(zeros.size, floor), "k_", markersize=8, label="exactly 0")
    if tol is not None:
        ax.axhline(tol, color="black", linestyle="--", linewidth=1, label=f"tolerance {tol:g}")
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("token t")
    ax.set_ylabel(ylabel)
    handles = [Patch(color=COLORS["dropped"], label=f"no {group_name}")]
    handles += [Patch(color=expert_color(g), label=f"{group_name} {g}") for g in sorted(set(groups.tolist()))
                if g >= 0]
    extra, extra_labels = ax.get_legend_handles_labels()
    ax.legend(handles=handles + extra, labels=[h.get_label() for h in handles] + extra_labels, fontsize=8,
              loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title(title or "relative error per token", loc="left", fontsize=10)
    return fig


def plot_partial_output(partial, ax=None, *, title: str | None = None, row_label: str = "token t") -> Figure:
    """One expert-parallel rank's partial output ``[T, H]`` as an image (diverging colours, 0 is white), every
    all-zero row outlined and named: the tokens none of whose experts live on this rank.

    Args:
        partial: [T, H], e.g. ``LoRAExperts(..., local_expert_offset=...)(...)`` on one rank.
    """
    p = _numpy(partial).astype(np.float64)
    if p.ndim != 2:
        raise ValueError(f"partial: expected a 2-D [T, H] tensor, got shape {list(p.shape)}")
    T, H = p.shape
    fig, ax = _axes(ax, (7, 3.6))
    vmax = float(np.nanmax(np.abs(p))) if p.size and np.nanmax(np.abs(p)) > 0 else 1.0
    image = ax.imshow(p, aspect="auto", interpolation="nearest", cmap="RdBu_r", vmin=-vmax, vmax=vmax)
    fig.colorbar(image, ax=ax, label="value")
    zero_rows = np.flatnonzero(~p.any(axis=1))
    for t in zero_rows:
        ax.add_patch(Rectangle((-0.5, t - 0.5), H, 1, fill=False, edgecolor="black", linewidth=1.2, hatch="//"))
        ax.text(H / 2, t, f"token {t}: all zeros", ha="center", va="center", fontsize=8,
                bbox=dict(facecolor="white", edgecolor="none", pad=1))
    ax.set_xlabel("hidden column h")
    ax.set_ylabel(row_label)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    note = f"{zero_rows.size} of {T} rows all zero"
    ax.set_title(f"{title + ': ' if title else ''}{note}", loc="left", fontsize=10)
    return fig


# ---------------------------------------------------------------------------------------------- bytes and speed

def _human_bytes(n: float) -> str:
    return EngFormatter(unit="B", places=1)(n)


def plot_bytes(bytes_moved: Mapping[str, Mapping[str, float]], ax=None, *, title: str | None = None) -> Figure:
    """Stacked horizontal bars: for each variant, the bytes each of its steps reads and writes.

    Args:
        bytes_moved: ``{variant: {step: bytes}}``, e.g. ``{"unfused": {"gather": ..., "weight": ...},
            "fused": {"finalize kernel": ...}}``.
    """
    fig, ax = _axes(ax, (8, 0.9 + 0.7 * len(bytes_moved)))
    cmap = plt.get_cmap("Set2")
    step_colors: dict[str, object] = {}
    for y, steps in enumerate(bytes_moved.values()):
        left = 0.0
        for step, n in steps.items():
            color = step_colors.setdefault(step, cmap(len(step_colors) % 8))
            ax.barh(y, n, left=left, color=color, edgecolor="white", height=0.6)
            if len(steps) > 1:
                ax.text(left + n / 2, y, step, ha="center", va="center", fontsize=7, rotation=0, clip_on=True)
            left += n
        ax.text(left, y, f"  {_human_bytes(left)}", va="center", fontsize=9, weight="bold")
    ax.set_yticks(range(len(bytes_moved)), list(bytes_moved))
    ax.invert_yaxis()
    ax.xaxis.set_major_formatter(EngFormatter(unit="B"))
    ax.set_xlabel("bytes read + written (global memory)")
    ax.margins(x=0.2)
    ax.set_title(title or "memory traffic", loc="left", fontsize=10)
    return fig


def plot_roofline(points: Iterable[Mapping[str, object]], ax=None, *, bandwidth: float = 4.27e12,
                  peak_flops: float = 701e12, title: str | None = None) -> Figure:
    """The roofline: attainable FLOP/s = min(peak, intensity * bandwidth), and where each point sits.

    Args:
        points: dicts with ``label``, ``flops``, ``bytes`` and optionally ``seconds`` (a measurement). A
            point is drawn hollow on the roof (the speed of light) and, when measured, filled at
            ``flops / seconds``.
        bandwidth: bytes/s (default: H200 HBM3e, 4.27 TB/s); peak_flops: FLOP/s (default: H200 dense bf16,
            701 TFLOP/s).
    """
    points = list(points)
    fig, ax = _axes(ax, (7, 4.2))
    intensities = [p["flops"] / p["bytes"] for p in points] or [1.0]
    ridge = peak_flops / bandwidth
    lo, hi = min(min(intensities) / 4, ridge / 100), max(max(intensities) * 4, ridge * 10)
    x = np.geomspace(lo, hi, 200)
    ax.plot(x, np.minimum(peak_flops, x * bandwidth), color=COLORS["roof"], linewidth=2)
    ax.axvline(ridge, color=COLORS["roof"], linestyle=":", linewidth=1)
    ax.text(ridge / 1.1, peak_flops * 1.4, f"ridge {ridge:.0f} FLOP/B", fontsize=8, ha="right", va="bottom")
    ax.text(lo * 1.3, lo * 1.3 * bandwidth * 2.0, f"{bandwidth / 1e12:.2f} TB/s", fontsize=8, va="bottom")
    ax.text(hi / 1.2, peak_flops * 1.4, f"{peak_flops / 1e12:.0f} TFLOP/s", fontsize=8, ha="right", va="bottom")
    for i, (p, ai) in enumerate(zip(points, intensities)):
        color = plt.get_cmap("tab10")(i % 10)
        roof = min(peak_flops, ai * bandwidth)
        ax.plot(ai, roof, "o", mfc="none", mec=color, markersize=8)
        seconds = p.get("seconds")
        if seconds:
            ax.plot(ai, p["flops"] / seconds, "o", color=color, markersize=6)
            ax.plot([ai, ai], [p["flops"] / seconds, roof], color=color, linewidth=0.8, linestyle="--")
        ax.annotate(str(p.get("label", i)), (ai, roof), textcoords="offset points", xytext=(6, -12), fontsize=8,
                    color=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_ylim(top=peak_flops * 3)
    ax.set_title(title or "roofline: hollow = speed of light, filled = measured", loc="left", fontsize=10)
    return fig


def plot_times(sizes: Sequence[float], times: Mapping[str, Sequence[float]], ax=None, *,
               floor: Sequence[float] | None = None, xlabel: str = "tokens T", title: str | None = None) -> Figure:
    """Time per call against a size (log-log), one line per variant, and the roofline floor dashed.

    Args:
        sizes: x values (e.g. token counts). times: ``{variant: seconds per size}`` (NaN: not measured).
        floor: seconds per size, ``max(bytes / bandwidth, flops / peak)``.
    """
    fig, ax = _axes(ax, (7, 3.8))
    xs = np.asarray(sizes, dtype=np.float64)
    for i, (name, ts) in enumerate(times.items()):
        ax.plot(xs, np.asarray(ts, dtype=np.float64) * 1e6, "o-", color=plt.get_cmap("tab10")(i % 10), label=name)
    if floor is not None:
        ax.plot(xs, np.asarray(floor, dtype=np.float64) * 1e6, "--", color=COLORS["roof"], label="roofline floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("microseconds per call")
    ax.legend(fontsize=8)
    ax.set_title(title or "time per call", loc="left", fontsize=10)
    return fig


# ---------------------------------------------------------------------------------------------- FlashInfer layout

def plot_row_map(row_map, ax=None, *, half: int | None = None, source_half=None, names: Sequence[str] | None = None,
                 title: str | None = None, source_label: str = "source row", target_label: str = "new row") -> Figure:
    """A row gather ``new[j] = old[row_map[j]]`` as wires from the source rows (top) to the new rows (bottom).

    Args:
        row_map: int [N]: new row j takes source row ``row_map[j]``.
        half: rows below it are "up", the others "gate" (colours the wires); None: one colour.
        source_half: bool [N], optional: for each *source* row, True when it holds an up row (use it when the
            source rows are themselves permuted, e.g. after the gated reorder).
        names: optional name of each *source* row (e.g. ``"u3"``, ``"g7"``), written above it and, where it lands,
            below the new row; legible up to N = 32 (one shuffle block).
    """
    m = _numpy(row_map).reshape(-1).astype(np.int64)
    N = m.size
    if source_half is not None:
        is_up = _numpy(source_half).reshape(-1).astype(bool)
    else:
        is_up = np.arange(N) < (half if half is not None else N)
    if names is not None and len(names) != N:
        raise ValueError(f"names: expected {N} names (one per source row), got {len(names)}")
    fig, ax = _axes(ax, (12, 2.4))
    for j, src in enumerate(m):
        color = COLORS["up"] if is_up[src] else COLORS["gate"]
        ax.plot([src, j], [1, 0], color=color, linewidth=0.9, alpha=0.8)
    ax.scatter(np.arange(N), np.ones(N), c=[COLORS["up"] if u else COLORS["gate"] for u in is_up], s=14, zorder=3)
    ax.scatter(np.arange(N), np.zeros(N), c=[COLORS["up"] if is_up[s] else COLORS["gate"] for s in m], s=14,
               zorder=3)
    if names is not None:
        size = 8 if N <= 32 else 6
        for i in range(N):
            ax.text(i, 1.08, names[i], ha="center", va="bottom", fontsize=size,
                    color=COLORS["up"] if is_up[i] else COLORS["gate"])
            ax.text(i, -0.08, names[m[i]], ha="center", va="top", fontsize=size,
                    color=COLORS["up"] if is_up[m[i]] else COLORS["gate"])
    step = 8 if N > 32 else (4 if N > 16 else 1)
    ax.set_xticks(np.arange(0, N, step))
    ax.set_yticks([0, 1], [target_label, source_label])
    ax.set_ylim(-0.45 if names is not None else -0.25, 1.45 if names is not None else 1.25)
    ax.set_xlim(-1, N)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    if half is not None or source_half is not None:
        ax.legend(handles=[Patch(color=COLORS["up"], label="up (w3)"), Patch(color=COLORS["gate"], label="gate (w1)")],
                  fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or "row gather", loc="left", fontsize=10)
    return fig


def plot_layout_maps(intermediate_size: int, ax=None) -> Figure:
    """FlashInfer's GEMM1 row layout in three panels, from ``moelab.layout``: the gated reorder, the 32-row
    shuffle, and their composition :func:`moelab.layout.gemm1_row_map` (physical row -> logical row).

    Every one of the 2I rows is drawn and named (``u3`` = up row 3, ``g3`` = gate row 3): I = 16 draws exactly
    one 32-row shuffle block, which is the whole pattern (every block is shuffled alike).

    Args:
        intermediate_size: I, a multiple of 16 (2I must be a multiple of the 32-row shuffle block).
        ax: a sequence of three Axes, or None.
    """
    I = intermediate_size
    if ax is None:
        fig, axes = plt.subplots(3, 1, figsize=(12, 8.4), layout="constrained")
    else:
        axes = list(ax)
        if len(axes) != 3:
            raise ValueError(f"ax: expected three Axes (reorder, shuffle, combined), got {len(axes)}")
        fig = axes[0].get_figure(root=True)
    logical_is_up = torch.arange(2 * I) < I
    logical_names = [f"u{i}" for i in range(I)] + [f"g{i}" for i in range(I)]
    reorder = layout.gated_reorder_rows(I)
    reordered_names = [logical_names[r] for r in reorder.tolist()]
    plot_row_map(reorder, axes[0], source_half=logical_is_up, names=logical_names, source_label="[up; gate]",
                 target_label="reordered",
                 title="1. gated reorder: new row 2i = up_i, 2i+1 = gate_i  (source: [up; gate])")
    plot_row_map(layout.shuffle_rows(2 * I), axes[1], source_half=logical_is_up[reorder], names=reordered_names,
                 source_label="reordered", target_label="shuffled",
                 title="2. shuffle inside 32-row blocks: new row j = old row 4*(j%8) + j//8")
    plot_row_map(layout.gemm1_row_map(I), axes[2], source_half=logical_is_up, names=logical_names,
                 source_label="[up; gate]", target_label="physical",
                 title="1+2 = gemm1_row_map: physical row n holds logical row q//2 + (q%2)*I, "
                       "q = 32*(n//32) + 4*(n%8) + (n%32)//8")
    return fig


def plot_block_major_k(num_rows: int, k: int, ax=None, *, title: str | None = None) -> Figure:
    """Memory offset of element (n, k) of an [Mn, K] matrix once :func:`moelab.layout.block_major_k` has laid it
    out: K is cut into 64-element (128-byte bf16) blocks, and each block holds all Mn rows contiguously.

    Args:
        num_rows: Mn; k: K, a multiple of 64.
    """
    offsets = torch.arange(num_rows * k).view(num_rows, k)
    blocked = layout.block_major_k(offsets)  # [K/64, Mn, 64]: blocked.flatten()[address] = row-major offset
    address = torch.empty(num_rows * k, dtype=torch.long)
    address[blocked.flatten()] = torch.arange(num_rows * k)
    fig, ax = _axes(ax, (8, 3))
    image = ax.imshow(address.view(num_rows, k).numpy(), aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(image, ax=ax, label="address (elements)")
    for b in range(layout.BLOCK_K, k, layout.BLOCK_K):
        ax.axvline(b - 0.5, color="white", linewidth=1.5)
    ax.set_xlabel("k (column of the logical [Mn, K] matrix)")
    ax.set_ylabel("row n")
    ax.set_title(title or f"BlockMajorK: element (n, k) lives at [k // {layout.BLOCK_K}, n, k % {layout.BLOCK_K}]",
                 loc="left", fontsize=10)
    return fig
