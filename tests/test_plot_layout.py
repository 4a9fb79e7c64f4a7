"""Every kind of plot, drawn from the committed sample results: its title inside the figure,
no legend over the data, and bench's flagged points marked (issue 50)."""

from pathlib import Path

import pytest

from kvbench.report.load import read_results
from kvbench.report.plot import _plot_one, layout, with_planned_bytes

SAMPLES = Path(__file__).parents[1] / "results" / "sample"
FILES = ["bench-context-cpu.csv", "memory-cpu.csv", "capacity-80gib.csv",
         "cache-techniques.csv", "h2o-smollm2.csv", "kivi-smollm2.csv", "serve-sim.csv",
         "serve-sim-rates.csv", "serve-sim-smollm2-steps.csv", "model-techniques-verify.csv",
         "mla-bench.csv", "needle-smollm2-full.csv", "needle-smollm2.csv"]


def _drawn(name, monkeypatch):
    """The figure plot draws for a sample file (kept open, not saved), its older model rows
    given their planned bytes as `kvbench plot` gives them."""
    import matplotlib

    from kvbench.experiments.model.view import planned_row_bytes

    matplotlib.use("Agg")
    kind, df = read_results(name if isinstance(name, Path) else SAMPLES / name)
    df = with_planned_bytes(kind, df, planned_row_bytes)
    figures = []
    monkeypatch.setattr("kvbench.report.plot.layout", lambda fig: figures.append(
        layout(fig)) or fig)
    monkeypatch.setattr("matplotlib.figure.Figure.savefig", lambda *a, **k: None)
    monkeypatch.setattr("matplotlib.pyplot.close", lambda fig: None)
    _plot_one(kind, df, Path("unused.png"))
    return figures


@pytest.mark.parametrize("name", FILES)
def test_the_title_fits_and_no_legend_covers_the_data(name, monkeypatch):
    for fig in _drawn(name, monkeypatch):
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        box = fig.bbox
        if fig._suptitle is not None:
            t = fig._suptitle.get_window_extent(renderer)
            assert t.x0 >= box.x0 - 1 and t.x1 <= box.x1 + 1 and t.y1 <= box.y1 + 1, name
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is None:
                continue
            lb = legend.get_window_extent(renderer)
            assert not lb.overlaps(ax.get_window_extent(renderer)), name  # beside the axes
            assert lb.x1 <= box.x1 + 1, name  # and inside the figure


def test_bench_marks_noisy_points_hollow_and_draws_path_a_per_configuration(monkeypatch):
    import pandas as pd

    from kvbench.report import plot

    kind, df = read_results(SAMPLES / "bench-context-cpu.csv")
    df = df.copy()
    df["noisy"] = False
    df.loc[df.index[0], "noisy"] = True
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plot.plot_bench(df, plt)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(label.startswith("hollow: noisy or suspect") for label in labels)
    hollow = [line for line in ax.get_lines() if line.get_markerfacecolor() == "white"
              and line.get_linestyle() == "None" and len(line.get_xdata())]
    assert len(hollow) == 1 and len(hollow[0].get_xdata()) == 1
    # path A: one dashed line per configuration of the non-x key columns
    configs = df.dropna(subset=["recompute_ms_per_step"])
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == len(list(plot._series(configs.assign(impl="r"), "prompt_len")))
    plt.close(fig)
    assert isinstance(df, pd.DataFrame)


def test_needle_rows_of_several_tasks_draw_a_section_a_task_and_copy_without_depth(
        monkeypatch, tmp_path):
    import pandas as pd

    kind, df = read_results(SAMPLES / "needle-smollm2-full.csv")
    copy = df.drop_duplicates("context").assign(task="copy", depth=float("nan"))
    both = pd.concat([df, copy], ignore_index=True)
    path = tmp_path / "n.csv"
    both.to_csv(path, index=False)
    (fig,) = _drawn(path, monkeypatch)
    titles = [ax.get_title() for ax in fig.axes]
    # each task its own matrices and its own frontier; copy's has no depth axis
    assert any(t.startswith("passkey: ") for t in titles)
    copy_axes = [ax for ax in fig.axes if ax.get_title().startswith("copy: ")
                 and ax.get_xlabel() == "context, tokens"]
    assert copy_axes and all(ax.get_ylabel() != "needle depth" for ax in copy_axes)
    assert "copy: accuracy against the K/V bytes" in titles
    assert "passkey: accuracy against the K/V bytes" in titles
    assert "(copy, passkey)" in fig._suptitle.get_text() or \
        "(passkey, copy)" in fig._suptitle.get_text()
