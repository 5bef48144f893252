"""moelab.viz: every ``plot_*`` returns a Figure, draws into a given Axes (Agg, set in conftest), never shows."""

import matplotlib.pyplot as plt
import pytest
import torch
from matplotlib.figure import Figure

import moelab
from moelab import viz


@pytest.fixture(autouse=True)
def _never_show(monkeypatch):
    """Library plot functions must never call plt.show(): the notebook's backend decides."""
    def fail(*args, **kwargs):
        raise AssertionError("moelab.viz called plt.show()")

    monkeypatch.setattr(plt, "show", fail)


def _map_problem():
    ids = torch.tensor([[0, 5], [2, 1], [6, 3]], dtype=torch.int32)  # experts 4..7 live on another rank
    w13, w2 = torch.randn(4, 16, 8), torch.randn(4, 8, 8)
    weights = moelab.prepare_weights(w13, w2, backend="torch")
    _, _, e2p = moelab.routed_moe((ids, torch.rand(3, 2)), torch.randn(3, 8), weights, num_experts=8, top_k=2,
                                  do_finalize=False)
    return e2p, ids


def _ref():
    return torch.randn(6, 10, dtype=torch.float64)


#: name -> a call drawing into ``ax`` (None: a new figure).
PLOTS = {
    "plot_packed_bits": lambda ax: viz.plot_packed_bits(
        moelab.pack_topk_ids_weights(torch.tensor([[3, 1]]), torch.tensor([[0.5, -0.25]])), ["a", "b"], ax),
    "plot_permutation_map": lambda ax: viz.plot_permutation_map(*_map_problem(), ax, num_local_experts=4, tile=8,
                                                                num_rows=64),
    "plot_error_heatmap": lambda ax: viz.plot_error_heatmap(_ref() + 1e-3, _ref(), ax, title="x"),
    "plot_token_errors": lambda ax: viz.plot_token_errors(torch.tensor([0.0, 1e-3, 2e-2]), ax,
                                                          groups=torch.tensor([-1, 0, 1]), tol=1e-2),
    "plot_bytes": lambda ax: viz.plot_bytes({"unfused": {"gather": 100, "sum": 50}, "fused": {"kernel": 60}}, ax),
    "plot_roofline": lambda ax: viz.plot_roofline(
        [dict(label="a", flops=1e9, bytes=1e8, seconds=1e-3), dict(label="b", flops=1e12, bytes=1e9)], ax),
    "plot_times": lambda ax: viz.plot_times([1, 2, 4], {"x": [1e-3, 2e-3, float("nan")]}, ax, floor=[1e-4] * 3),
    "plot_row_map": lambda ax: viz.plot_row_map(moelab.layout.gemm1_row_map(16), ax, half=16),
    "plot_block_major_k": lambda ax: viz.plot_block_major_k(8, 128, ax),
    "plot_pipeline": lambda ax: viz.plot_pipeline(
        {name: torch.zeros(2, 3) for step in viz.PIPELINE_STEPS for name, _ in step["outputs"]}, ax),
    "plot_partial_output": lambda ax: viz.plot_partial_output(torch.randn(4, 8) * torch.tensor([1, 0, 1, 0])[:, None],
                                                              ax),
}


def test_every_plot_function_is_covered():
    public = {name for name in viz.__all__ if name.startswith("plot_")}
    assert public == set(PLOTS) | {"plot_layout_maps"}


@pytest.mark.parametrize("name", sorted(PLOTS))
def test_returns_a_new_figure(name):
    fig = PLOTS[name](None)
    try:
        assert isinstance(fig, Figure)
        assert fig.axes and any(ax.has_data() or ax.texts or ax.patches for ax in fig.axes)
    finally:
        plt.close(fig)


@pytest.mark.parametrize("name", sorted(PLOTS))
def test_draws_into_the_given_axes(name):
    fig, (ax, other) = plt.subplots(1, 2)
    try:
        assert PLOTS[name](ax) is fig
        assert ax.has_data() or ax.texts or ax.patches or ax.images
        assert not (other.has_data() or other.texts or other.patches or other.images), "drew outside its Axes"
    finally:
        plt.close(fig)


def test_layout_maps_take_three_axes():
    fig, axes = plt.subplots(3, 1)
    try:
        assert viz.plot_layout_maps(16, axes) is fig
        assert all(ax.has_data() for ax in axes)
        with pytest.raises(ValueError, match="three Axes"):
            viz.plot_layout_maps(16, axes[:2])
    finally:
        plt.close(fig)
    fig = viz.plot_layout_maps(16)
    assert isinstance(fig, Figure) and len(fig.axes) == 3
    plt.close(fig)


def test_heatmap_marks_nan_and_infinite_error():
    ref = _ref()
    out = ref.clone()
    out[1, 2] = float("nan")
    fig = viz.plot_error_heatmap(out, ref)
    try:
        assert "rel err = inf, 1 NaN" in fig.axes[0].get_title(loc="left")
        legend = fig.axes[0].get_legend()  # the colour bar has no NaN: the legend names the cyan cells
        assert legend is not None and [t.get_text() for t in legend.get_texts()] == ["NaN (1 cells)"]
    finally:
        plt.close(fig)
    fig = viz.plot_error_heatmap(ref, ref)
    try:
        assert fig.axes[0].get_legend() is None
    finally:
        plt.close(fig)


def test_token_errors_axis_says_what_is_plotted():
    fig = viz.plot_token_errors(torch.tensor([0.0, 1.0]), ylabel="||out - base|| / ||base||")
    try:
        assert fig.axes[0].get_ylabel() == "||out - base|| / ||base||"
    finally:
        plt.close(fig)


def test_layout_maps_name_every_row():
    fig = viz.plot_layout_maps(16)
    try:
        texts = [t.get_text() for t in fig.axes[2].texts]
        # top: the logical rows in order; bottom: what each physical row holds (gemm1_row_map)
        logical = [f"u{i}" for i in range(16)] + [f"g{i}" for i in range(16)]
        physical = [logical[r] for r in moelab.layout.gemm1_row_map(16).tolist()]
        assert texts[0::2] == logical and texts[1::2] == physical
    finally:
        plt.close(fig)


def test_partial_output_names_its_zero_rows():
    partial = torch.randn(5, 8)
    partial[[1, 3]] = 0
    fig = viz.plot_partial_output(partial)
    try:
        ax = fig.axes[0]
        assert "2 of 5 rows all zero" in ax.get_title(loc="left")
        assert [t.get_text() for t in ax.texts] == ["token 1: all zeros", "token 3: all zeros"]
    finally:
        plt.close(fig)


def test_save_figure(tmp_path):
    fig = viz.plot_bytes({"a": {"x": 1}})
    try:
        assert viz.save_figure(fig, tmp_path / "deep" / "er", "bytes") is None
        assert (tmp_path / "deep" / "er" / "bytes.png").stat().st_size > 0
        viz.save_figure(fig, None, "nothing")  # OUT_DIR=None: shown only
    finally:
        plt.close(fig)


def test_pipeline_draws_every_step_with_its_real_shape():
    tensors = {name: torch.zeros(i + 1, 3, dtype=torch.int32) for i, (name, _) in enumerate(
        out for step in viz.PIPELINE_STEPS for out in step["outputs"])}
    fig = viz.plot_pipeline(tensors)
    try:
        texts = " ".join(t.get_text() for t in fig.axes[0].texts)
        for step in viz.PIPELINE_STEPS:
            assert step["step"] in texts and step["mirrors"] in texts and f"notebook {step['notebook']}" in texts
        for name, tensor in tensors.items():
            assert f"= {list(tensor.shape)} int32" in texts, name
        for vllm_name in ("trtllm_moe_pack_topk_ids_weights", "_unpermute_activation_kernel", "_finalize_lora_kernel",
                          "trtllm_bf16_routed_moe", "TrtLlmBf16LoRAExperts.apply"):
            assert vllm_name in texts + fig.axes[0].get_title(loc="left")
    finally:
        plt.close(fig)
    with pytest.raises(ValueError, match="missing \\['output'\\]"):
        viz.plot_pipeline({k: v for k, v in tensors.items() if k != "output"})
