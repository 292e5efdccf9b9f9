import os
import signal
import subprocess
import sys
import textwrap

import matplotlib.colors
import pandas as pd
import pytest
import torch

from ddpm_core import bench, plots, results


def _measurement(name="baseline", ms=10.0, bs=8):
    return bench.Measurement(name=name, device="cpu", device_name="CPU (test)", torch_version=torch.__version__,
                             batch_size=bs, iters=3, first_ms=ms * 3, median_ms=ms, p10_ms=ms, p90_ms=ms,
                             images_per_s=bs / ms * 1e3, peak_memory_bytes=2**20, memory_kind="test")


def test_results_rows_are_appended_and_read_back_with_their_labels(tmp_path):
    path = tmp_path / "03_batch_size.csv"
    results.append("03_batch_size", _measurement().row(), config={"batch_size": 8}, path=path)
    results.append("03_batch_size", [_measurement("bs16", 15, 16).row()], path=path)
    df = results.load(path)
    assert list(df.columns[:6]) == results.ID_COLUMNS
    assert df["variant"].tolist() == ["baseline", "bs16"] and df["batch_size"].tolist() == [8, 16]
    assert df["device_name"].tolist() == ["CPU (test)"] * 2 and (df["torch_version"] == torch.__version__).all()
    assert '"batch_size": 8' in df["config"].iloc[0]


def test_results_default_to_the_data_folder_and_missing_files_say_so(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPM_DATA_DIR", str(tmp_path))
    p = results.append("nb", {"variant": "a", "images_per_s": 1.0})
    assert p == tmp_path / "results" / "nb.csv" and len(results.load("nb")) == 1
    with pytest.raises(FileNotFoundError, match=r"no results file .*other.csv"):
        results.load("other")


_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    import ddpm_core.results as R
    import ddpm_core.atomic as A
    path = sys.argv[1]
    R.append("nb", [{"variant": f"v{i}", "images_per_s": float(i)} for i in range(3)], path=path)
    print("first", flush=True)

    def stalling_write(p, text):  # writes half of the new file, then hangs
        with A.atomic_open(p, "wb") as f:
            f.write(text.encode()[: len(text) // 2])
            f.flush()
            print("writing", flush=True)
            time.sleep(600)

    R.atomic_write_text = stalling_write
    R.append("nb", [{"variant": f"w{i}", "images_per_s": float(i)} for i in range(1000)], path=path)
""")


def test_results_csv_is_whole_after_a_writer_is_killed_mid_write(tmp_path):
    script, path = tmp_path / "writer.py", tmp_path / "nb.csv"
    script.write_text(_KILLED_WRITER)
    proc = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "first"
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    df = results.load(path)
    assert df["variant"].tolist() == ["v0", "v1", "v2"]


@pytest.fixture
def figures(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPM_FIGURES_DIR", str(tmp_path / "figs"))
    return tmp_path / "figs"


def _saved(fig, name, figures):
    path = plots.savefig(fig, name)
    plots.plt.close(fig)
    assert path == figures / name and path.stat().st_size > 5000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return path


def test_every_plot_function_writes_a_png(figures):
    label = "CPU (test) · torch " + torch.__version__
    runs = pd.DataFrame([_measurement("baseline", 10).row(), _measurement("compiled", 6).row()])
    _saved(plots.throughput_bars(runs, label=label), "t_bars.png", figures)
    sweep = pd.DataFrame({"batch_size": [8, 16, 32], "images_per_s": [100, 180, 200], "peak_memory_gib": [1, 2, 4]})
    _saved(plots.batch_size_lines(sweep, label=label), "t_batch.png", figures)
    wait = pd.DataFrame({"variant": ["0 workers", "2 workers"], "data_wait_ms": [8, 1], "compute_ms": [10, 10]})
    _saved(plots.wait_compute_bars(wait, label=label), "t_wait.png", figures)
    # the column layout of HTA 0.5's get_temporal_breakdown / get_gpu_kernel_breakdown
    temporal = pd.DataFrame({"rank": [0, 1], "idle_time_pctg": [20, 25], "compute_time_pctg": [75, 70],
                             "non_compute_time_pctg": [5, 5]})
    _saved(plots.temporal_breakdown(temporal, label=label), "t_temporal.png", figures)
    kernels = pd.DataFrame({"kernel_type": ["COMPUTATION", "MEMORY"], "sum": [900, 100], "percentage": [90.0, 10.0]})
    _saved(plots.kernel_breakdown(kernels, label=label), "t_kernels.png", figures)
    ops = pd.DataFrame({"name": [f"aten::op{i}" for i in range(12)], "self_cpu_us": range(12, 0, -1),
                        "self_device_us": [0] * 12})
    _saved(plots.top_ops(ops, label=label), "t_top.png", figures)
    scaling = pd.DataFrame({"world_size": [1, 2, 4], "images_per_s": [100, 190, 350]})
    _saved(plots.scaling_efficiency(scaling, label=label), "t_scaling.png", figures)
    _saved(plots.image_grid_figure(torch.rand(4, 3, 32, 32) * 2 - 1, title=label), "t_grid.png", figures)
    fig, axes = plots.plt.subplots(1, 2)  # a notebook's own figure: its panel titles stay under the figure's title
    axes[0].set_title("panel")
    plots.titled(fig, "a notebook's figure", label)
    fig.canvas.draw()
    assert axes[0].title.get_window_extent().y1 < fig._suptitle.get_window_extent().y0
    assert fig._suptitle.get_text() == f"a notebook's figure\n{label}"
    _saved(fig, "t_titled.png", figures)


def test_the_batch_sweep_draws_its_references_inside_the_axes_and_memory_in_mib():
    # a sweep whose throughput bends after the first doubling: a linear-scaling line on the throughput axis left it
    sweep = pd.DataFrame({"batch_size": [4, 8, 16, 32], "images_per_s": [42.4, 52.3, 58.0, 51.7],
                          "median_ms": [94.4, 153.1, 276.0, 619.1], "peak_memory_bytes": [36 * 2**20, 71 * 2**20,
                                                                                          141 * 2**20, 282 * 2**20],
                          "memory_kind": ["saved for backward, CPU"] * 4})
    fig = plots.batch_size_lines(sweep, label="t", ideal=True)
    thr, time_ax, mem = fig.axes
    assert "MiB" in mem.get_ylabel() and mem.get_ylim()[1] > 282  # the tables' unit, not GiB
    refs = [ln for ln in time_ax.get_lines() if ln.get_color() == "C7"]
    assert len(refs) == 2
    lo, hi = time_ax.get_ylim()
    for ln in refs:  # each reference is drawn over every measured batch, inside the axes
        assert list(ln.get_xdata()) == [4, 8, 16, 32] and lo <= min(ln.get_ydata()) and max(ln.get_ydata()) <= hi
    assert max(ln.get_ydata()[-1] for ln in refs) == pytest.approx(94.4 * 8)  # time in proportion to the batch
    assert thr.get_ylim()[1] >= 58.0
    plots.plt.close(fig)


def test_log_ticks_extend_down_puts_a_label_under_the_lowest_curve():
    """10's loss curves ran on to 0.12 below a lowest label of 0.2."""
    for low, bottom in ((0.12, 0.1), (0.42, 0.4)):
        fig, ax = plots.plt.subplots()
        ax.plot([1, 2, 3], [1.0, 0.5, low])
        ax.set_yscale("log")
        plots.log_ticks(ax, extend_down=True)
        ticks = list(ax.get_yticks())
        assert ax.get_ylim()[0] == pytest.approx(bottom) and min(ticks) == pytest.approx(bottom) and min(ticks) <= low
        plots.plt.close(fig)


def test_every_gridline_of_a_log_axis_set_by_log_ticks_keeps_its_label():
    # 09b's quality figure: a loss axis of less than two decades had a gridline at 0.5 with no label, because the
    # figure's title step (plain_log_ticks) replaced log_ticks' labels with matplotlib's choice of which to label
    fig, ax = plots.plt.subplots()
    ax.plot([1, 30], [1.02, 0.34])
    ax.set_yscale("log")
    plots.log_ticks(ax)
    plots._suptitle(fig, "t", "test machine")
    fig.canvas.draw()
    ticks, labels = ax.get_yticks(), [t.get_text() for t in ax.get_yticklabels()]
    assert list(ticks) == pytest.approx([0.4, 0.5, 0.6, 0.8, 1.0]) and labels == ["0.4", "0.5", "0.6", "0.8", "1"]
    plots.plt.close(fig)
    # 08's epoch times, 1,057 to 2,574 s: one 1-2-3-5 multiple (2,000) in range, and the figure had a crammed column
    # of minor labels instead; now finer multiples. A range narrower still gets round numbers, the axis widened to them
    # (the highest, 2,574 s, lay over the last label, 2,500: a label above it now closes the axis)
    for seconds, labels, lim in (((2250, 2574, 1150, 1057), ["1,500", "2,000", "2,500", "3,000"], None),
                                 ((1150, 1200, 1250, 1300), ["1,100", "1,150", "1,200", "1,250", "1,300", "1,350"],
                                  (1100, 1350))):
        df = pd.DataFrame({"world_size": [1, 1, 2, 2], "precision": ["fp32"] * 4, "batch_per_process": [4, 8, 4, 8],
                           "images_per_s": [50_000 / s for s in seconds]})
        fig = plots.epoch_time_vs_batch(df, label="test machine")
        fig.canvas.draw()
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_yticklabels()] == labels
        assert lim is None or ax.get_ylim() == pytest.approx(lim)
        plots.plt.close(fig)


def test_savefig_never_writes_to_the_repo_figures_when_the_env_is_set(figures):
    from ddpm_core.paths import REPO_ROOT

    fig = plots.plt.figure()
    path = plots.savefig(fig, "probe")
    assert path == figures / "probe.png" and not (REPO_ROOT / "figures" / "probe.png").exists()


def test_atomic_writes_get_normal_file_permissions(tmp_path):
    from ddpm_core.atomic import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "f.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "f.txt").stat().st_mode & 0o777 == 0o644


def test_the_series_charts_write_pngs(figures):
    import numpy as np

    rows = pd.DataFrame([{**_measurement("eager", 10).row(), "first_ms": 30.0},
                         {**_measurement("compiled", 6).row(), "first_ms": 5000.0}])
    _saved(plots.compile_breakeven(rows), "t_compile.png", figures)
    _saved(plots.throughput_memory_bars(rows), "t_tm.png", figures)
    micro = pd.DataFrame({"impl": ["math", "math", "sdpa", "sdpa"], "seq_len": [256, 1024] * 2,
                          "median_ms": [1, 10, 1, 4], "peak_memory_mib": [1, 16, 0.1, 0.4]})
    _saved(plots.sdpa_figure(rows, micro), "t_sdpa.png", figures)
    _saved(plots.loss_curves({"a": [(i, 1 / i) for i in range(1, 30)], "b": [(i, 1.1 / i) for i in range(1, 30)]}), "t_loss.png", figures)
    from ddpm_core.diffusion import GaussianDiffusion
    _saved(plots.noise_schedule_figure(GaussianDiffusion()), "t_schedule.png", figures)
    _saved(plots.image_strip([("t=0", torch.zeros(2, 3, 32, 32)), ("t=1", torch.ones(2, 3, 32, 32))], title="strip"), "t_strip.png", figures)
    stages = pd.DataFrame({"stage": ["base", "+a", "+b"], "images_per_s": [10.0, 20.0, 15.0]})
    _saved(plots.waterfall(stages), "t_waterfall.png", figures)
    _saved(plots.table_figure(bench.summary_table([_measurement("base", 10), _measurement("fast", 5)])), "t_table.png", figures)
    assert np.isfinite(rows["median_ms"]).all()


def test_a_log_axis_over_one_to_two_decades_labels_2_and_5_not_3_and_4_side_by_side():
    import matplotlib.pyplot as plt

    def minor_labels(lo, hi):
        fig, ax = plt.subplots()
        ax.plot([1, 2], [lo, hi])
        ax.set_yscale("log")
        plots.plain_log_ticks(fig)
        fig.canvas.draw()
        labels = [t.get_text() for t in ax.get_yticklabels(minor=True) if t.get_text()]
        plots.plt.close(fig)
        return labels

    wide = minor_labels(0.28, 22)  # 05's memory panel: it read "4/3" and "0.4/0.3"
    assert {"0.5", "2", "5", "20"} <= set(wide) and not {"3", "4", "0.3", "0.4"} & set(wide), wide
    assert {"3", "4"} <= set(minor_labels(2, 5))  # under a decade: every minor tick, as before
    assert minor_labels(0.1, 1000) == []  # past two decades: the powers of ten alone, as before


def test_a_table_figure_gives_every_number_of_a_column_the_same_decimals():
    from ddpm_core.plots import _same_decimals

    assert _same_decimals([202.6, 399.1, 398.53, "n/a", None]) == ["202.60", "399.10", "398.53", "n/a", "None"]
    assert _same_decimals([0.06, 0.067, 0.00943]) == ["0.0600", "0.0670", "0.0094"]  # at most 4 decimals
    assert _same_decimals([8, 16]) == ["8", "16"] and _same_decimals([1234.0, 5.5]) == ["1,234.0", "5.5"]


def test_a_table_figure_is_the_size_of_its_table_with_no_band_of_white_around_it():
    rows = [_measurement(f"stage {i}", 10 + i) for i in range(8)]  # 09's summary: 8 rows had bands above and below
    fig = plots.table_figure(bench.summary_table(rows), title="t")
    fig.canvas.draw()
    table = fig.axes[0].tables[0].get_window_extent()
    width, height = fig.get_size_inches() * fig.dpi
    assert 0.9 < table.height / height <= 1.01 and 0.9 < table.width / width <= 1.01, (table, width, height)
    plots.plt.close(fig)


def test_a_table_figure_wraps_a_long_cell_instead_of_cutting_it():
    """The H200's 09 table read "13.3% of H200 bf16 dense peak 989.4 TFLO...": a long cell goes onto two lines, and its
    row grows to hold them."""
    rows = bench.summary_table([_measurement("base", 10), _measurement("fast", 5)])
    rows["MFU"] = ["13.3% of H200 bf16 dense peak 989.4 TFLOP/s", "1.0%"]
    fig = plots.table_figure(rows, title="t")
    fig.canvas.draw()
    cells = fig.axes[0].tables[0].get_celld()
    texts = [c.get_text().get_text() for c in cells.values()]
    assert not any(t.endswith("...") for t in texts)
    long = next(c for c in cells.values() if "989.4" in c.get_text().get_text())
    assert long.get_text().get_text().replace("\n", " ") == "13.3% of H200 bf16 dense peak 989.4 TFLOP/s"
    assert long.get_height() == pytest.approx(2 * cells[(0, 0)].get_height())  # its row: two lines tall
    r = fig.canvas.get_renderer()
    assert long.get_text().get_window_extent(r).height < long.get_window_extent(r).height  # the text fits its cell
    table = fig.axes[0].tables[0].get_window_extent()
    assert 0.9 < table.height / (fig.get_size_inches()[1] * fig.dpi) <= 1.01  # the figure still the table's size
    plots.plt.close(fig)


def test_readable_drops_a_named_column_only_where_no_row_has_a_value_and_fills_the_rest():
    df = pd.DataFrame({"a": [1.0, None], "note": ["", None], "kept": ["", "x"], "peak": [None, None]})
    out = bench.readable(df, drop_empty=("note", "kept", "peak"), na="—")
    assert list(out.columns) == ["a", "kept"] and out["a"].tolist() == [1.0, "—"]  # an empty string is no value


def test_summary_table_reports_speedups_from_the_same_table():
    table = bench.summary_table([_measurement("base", 10), _measurement("fast", 5)])
    assert table["speedup"].tolist() == ["1.00x", "2.00x"]
    assert list(table.columns[:5]) == ["variant", "batch", "ms/step", "img/s", "speedup"]
    assert "speedup" not in bench.summary_table([_measurement("alone", 10)]).columns  # one row: nothing to compare
    assert bench.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert not bench.is_out_of_memory(ValueError("x"))


def test_a_legend_over_a_label_is_found_and_warned_about(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    monkeypatch.setenv("DDPM_FIGURES_DIR", str(tmp_path))
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1], label="a line with a long label")
    ax.set_xlabel("the x label")
    ax.legend(loc="lower left", bbox_to_anchor=(0, -0.3))  # pushed down onto the x label
    assert plots.legend_overlaps(fig) == ["the legend of '' covers 'the x label'"]
    with pytest.warns(UserWarning, match=f"^{plots.LAYOUT_WARNING} bad.png: the legend"):
        plots.savefig(fig, "bad.png")
    ax.legend(loc="upper left")
    assert plots.legend_overlaps(fig) == []
    plots.legend_below(ax, ncol=2)  # under the x label, and still there once the layout is tightened
    fig.set_size_inches(4, 2)
    fig.tight_layout()
    assert plots.legend_overlaps(fig) == []
    plt.close(fig)


def test_short_name_keeps_both_ends_so_forward_and_backward_kernels_stay_apart():
    from ddpm_core.plots import short_name

    fwd = "aten::_scaled_dot_product_flash_attention_for_cpu"
    bwd = "aten::_scaled_dot_product_flash_attention_for_cpu_backward"
    assert short_name("aten::add_") == "aten::add_"
    a, b = short_name(fwd, 40), short_name(bwd, 40)
    assert len(a) == len(b) == 40 and a != b and b.endswith("cpu_backward") and a.startswith("aten::_scaled")


def _spread(name, ms, lo, hi, bs=8):
    m = _measurement(name, ms, bs)
    m.p10_ms, m.p90_ms = lo, hi
    return m


def _texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_a_bar_label_states_a_ratio_only_where_the_comparison_does():
    """A figure beside a 'no measurable difference' verdict must not print '0.98x' on its bar."""
    quiet = bench.Noise(cores=2, load_1min=0.0, other_cpu_share=0.0, spreads={})
    overlap = bench.Comparison([_spread("eager", 178.0, 170, 190), _spread("compiled", 181.0, 172, 195)], quiet)
    rows = pd.DataFrame([{**m.row(), "first_ms": f} for m, f in zip(overlap.measurements, (500.0, 90_000.0))])
    assert "181.0 ms (within noise)" in _texts(plots.compile_breakeven(rows, label="t", comparison=overlap))
    assert "181.0 ms (0.98x)" in _texts(plots.compile_breakeven(rows, label="t"))  # no comparison given: the ratio
    apart = bench.Comparison([_spread("fp32", 210.0, 180, 250), _spread("bf16", 2650.0, 2600, 2750)], quiet)
    labels = _texts(plots.throughput_memory_bars(pd.DataFrame([m.row() for m in apart.measurements]), label="t",
                                                 comparison=apart))
    assert labels[:2] == ["38 (1.00x)", "3 (0.08x)"]
    # the same 12x gap on a busy machine: no ratio, and not "within noise" either (06's bf16 bar said so in CI)
    busy = bench.Noise(cores=2, load_1min=0.0, other_cpu_share=0.5, spreads={})
    crowded = bench.Comparison(apart.measurements, busy)
    labels = _texts(plots.throughput_memory_bars(pd.DataFrame([m.row() for m in crowded.measurements]), label="t",
                                                 comparison=crowded))
    assert labels[:2] == ["38 (1.00x)", "3 (noisy)"]


def test_the_break_even_line_is_drawn_only_where_the_comparison_states_a_speedup():
    """04's figure said 'pays off after 26,165 steps' beside a table that said 'never: no measurable speedup'."""
    quiet = bench.Noise(cores=2, load_1min=0.0, other_cpu_share=0.0, spreads={})
    for compiled, says in ((_spread("compiled", 170.0, 160, 185), "no measurable speedup, no break-even"),
                           (_spread("compiled", 100.0, 98, 102), "pays off after")):
        cmp = bench.Comparison([_spread("eager", 178.0, 170, 190), compiled], quiet)
        rows = pd.DataFrame([{**m.row(), "first_ms": f} for m, f in zip(cmp.measurements, (500.0, 90_000.0))])
        fig = plots.compile_breakeven(rows, label="t", comparison=cmp)
        # the no-break-even note is in the legend (written at the line's end, it ran across the line)
        texts = _texts(fig) + [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
        assert any(says in t for t in texts), texts
        lines = [ln for ln in fig.axes[1].lines if ln.get_linestyle() == ":"]
        assert len(lines) == (1 if says == "pays off after" else 0)
        assert any("pays off after" in t for t in _texts(plots.compile_breakeven(rows, label="t")))  # medians alone
        if says == "pays off after":  # the range the timings allow replaces the medians' one point in the label
            worded = _texts(plots.compile_breakeven(rows, label="t", comparison=cmp, breakeven_words={"compiled": "1,100 to 1,200"}))
            assert any("pays off after 1,100 to 1,200 steps" in t for t in worded), worded
        plots.plt.close("all")


def test_mark_noise_drops_ratio_labels_and_puts_its_footer_below_the_axis_label():
    noisy = bench.Noise(cores=2, load_1min=0.0, other_cpu_share=0.0, spreads={"fp32": 0.34})
    rows = pd.DataFrame([m.row() for m in (_spread("fp32", 210.0, 180, 250), _spread("bf16", 2650.0, 2600, 2750))])
    fig = plots.mark_noise(plots.throughput_memory_bars(rows, label="t"), noisy)
    assert "3" in _texts(fig) and not [t for t in _texts(fig) if t.endswith("x)")]
    # labels drawn from the comparison's own verdicts keep the ratios the comparison states (a 12.6x gap is not noise)
    cmp = bench.Comparison([_spread("fp32", 210.0, 180, 250), _spread("bf16", 2650.0, 2600, 2750)], noisy)
    fig = plots.mark_noise(plots.throughput_memory_bars(rows, label="t", comparison=cmp), noisy)
    assert [t for t in _texts(fig) if t.endswith("(0.08x)")]
    busy = bench.Noise(cores=2, load_1min=9.0, other_cpu_share=0.0, spreads={}, threads=2)
    fig = plots.mark_noise(plots.throughput_memory_bars(rows, label="t", comparison=cmp), busy)
    assert not [t for t in _texts(fig) if t.endswith("x)")]
    waits = pd.DataFrame({"variant": ["float batches, 0 workers (baseline)", "device-resident dataset (no loader)"],
                          "compute_ms": [300.0, 300.0], "data_wait_ms": [6.0, 0.0]})
    fig = plots.mark_noise(plots.wait_compute_bars(waits, label="t"), noisy)  # its axis label once sat under the footer
    footer = next(t for t in fig.texts if t.get_text().startswith("NOISY MEASUREMENT"))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    top = footer.get_window_extent(renderer).y1
    assert all(top <= ax.xaxis.label.get_window_extent(renderer).y0 for ax in fig.axes if ax.get_xlabel())


def test_a_loss_curve_lying_on_an_earlier_one_says_so_in_the_legend():
    same = [(i, 1 / i) for i in range(1, 16)]
    fig = plots.loss_curves({"adam (lr 0.001)": same, "adamw (lr 0.001)": [(i, v * (1 + 1e-5)) for i, v in same],
                             "sgd (lr 0.05)": [(i, 0.9 / i) for i in range(1, 16)]})
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["adam (lr 0.001)", "adamw (lr 0.001), on top of adam", "sgd (lr 0.05)"]


def test_the_smoothed_loss_does_not_lag_the_raw_curve():
    """A drop at step 150 shows in the smoothed line at step 150, not half a window later."""
    points = [(i, 1.0 if i < 150 else 0.01) for i in range(1, 301)]
    fig = plots.loss_curves({"run": points}, smooth=30)
    x, y = fig.axes[0].lines[1].get_data()
    smoothed = dict(zip(x, y))
    assert smoothed[170] == pytest.approx(0.01) and smoothed[130] == pytest.approx(1.0)
    assert 0.3 < smoothed[150] < 0.7  # the middle of the drop, where the raw curve drops


def test_the_waterfall_prints_no_ratio_where_the_comparison_states_none():
    stages = pd.DataFrame({"stage": ["base", "+ a", "+ b", "+ c"], "images_per_s": [30.0, 31.5, 60.0, 58.0]})
    assert _texts(plots.waterfall(stages, label="t")) == ["1.00x: the baseline", "total 1.05x\nstep 1.05x",
                                                         "total 2.00x\nstep 1.90x", "total 1.93x\nstep 0.97x"]
    # from the comparison: where it states no ratio the bar says why, as its table does, and a busy run's bars read
    # "noisy", not "within noise"
    ms = [_spread("base", 200.0, 195, 205), _spread("+ a", 100.0, 98, 102), _spread("+ b", 98.0, 90, 110)]
    rows = pd.DataFrame({"stage": [m.name for m in ms], "images_per_s": [m.images_per_s for m in ms]})
    quiet = bench.Noise(cores=2, load_1min=0.0, other_cpu_share=0.0, spreads={})
    busy = bench.Noise(cores=2, load_1min=0.0, other_cpu_share=0.5, spreads={})
    fig = plots.waterfall(rows, label="t", comparison=bench.Comparison(ms, quiet))
    assert _texts(fig)[1:] == ["total 2.00x\nstep 2.00x", "total 2.04x\nstep within noise"]
    fig = plots.waterfall(rows, label="t", comparison=bench.Comparison(ms, busy))
    assert _texts(fig)[1:] == ["total noisy\nstep noisy", "total noisy\nstep noisy"]
    assert {bar.get_facecolor() for bar in fig.axes[0].patches[1:]} == {matplotlib.colors.to_rgba("C7")}  # all grey


def test_the_waterfall_has_a_key_for_its_colours_and_a_word_can_replace_a_stated_ratio():
    """09's waterfall said nowhere what green, vermilion and grey meant; and where a stated step factor is more than its
    stage's one changed part can give, 09 labels it "drift", on a grey bar, as its table does."""
    quiet = bench.Noise(cores=2, load_1min=0.0, other_cpu_share=0.0, spreads={})
    ms = [_spread("base", 200.0, 195, 205), _spread("+ a", 100.0, 98, 102), _spread("+ b", 130.0, 128, 132),
          _spread("+ c", 90.0, 89, 91)]
    rows = pd.DataFrame({"stage": [m.name for m in ms], "images_per_s": [m.images_per_s for m in ms]})
    fig = plots.waterfall(rows, label="t", comparison=bench.Comparison(ms, quiet),
                          why=lambda a, b: "drift" if a == "+ c" and b == "+ b" else None)
    assert _texts(fig)[1:] == ["total 2.00x\nstep 2.00x", "total 1.54x\nstep 0.77x", "total 2.22x\nstep drift"]
    colors = [bar.get_facecolor() for bar in fig.axes[0].patches]
    assert colors == [matplotlib.colors.to_rgba(c) for c in ("C7", "C2", "C3", "C7")]
    key = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert key[0].startswith("step measurably faster") and key[1].startswith("step measurably slower")
    assert key[2].startswith("the baseline, or no ratio stated")
    assert plots.legend_overlaps(fig) == []
    plots.plt.close(fig)


def test_the_waterfall_draws_a_hinted_step_pale_and_keys_it_apart_from_a_measurable_one():
    """09's waterfall drew "+ fused Adam: step 1.02x (hint)" in the green its key called "measurably faster"."""
    quiet = bench.Noise(cores=2, load_1min=0.0, other_cpu_share=0.0, spreads={})
    ms = [_spread("base", 200.0, 195, 205), _spread("+ a", 100.0, 98, 102), _spread("+ d", 94.0, 90.0, 96.0)]
    cmp = bench.Comparison(ms, quiet)
    assert cmp.hint("+ d", "+ a") and not cmp.hint("+ a", "base")
    rows = pd.DataFrame({"stage": [m.name for m in ms], "images_per_s": [m.images_per_s for m in ms]})
    fig = plots.waterfall(rows, label="t", comparison=cmp)
    bars = fig.axes[0].patches
    assert [b.get_alpha() for b in bars] == [1.0, 1.0, 0.4]
    key = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert key[0].startswith("step measurably faster") and key[1].startswith("step faster than the stage before, a hint")
    plots.plt.close(fig)


def test_the_peers_figure_prints_enough_digits_to_tell_distinct_ratios_apart():
    """09b's bars read "38 · 1.00x" and "38 · 1.02x (a hint)" for 37.5 and 38.2 img/s."""
    assert [plots._significant(v) for v in (37.5, 38.2, 1234.0, 0.01234, 5.0)] == ["37.5", "38.2", "1,234", "0.0123", "5.00"]
    table = pd.DataFrame({"variant": ["ours (baseline)", "ours (fast)"], "batch": [4, 4], "img/s": [37.5, 38.2],
                          "speedup": ["1.00x (baseline)", "1.02x (a hint)"], "TFLOP/s": [0.046, 0.047]})
    fig = plots.peers_figure(table, label="t")
    assert {"37.5 · 1.00x (baseline)", "38.2 · 1.02x (a hint)"} <= set(_texts(fig))
    assert "against ours (baseline)" in fig.axes[0].get_xlabel()  # which pair every factor compares
    plots.plt.close(fig)


def test_bar_labels_stay_inside_the_axes_and_off_the_reference_lines():
    """09b's peer label ran past its panel's frame and its ceiling lines ran through bar labels; 09's waterfall axis
    ran to 1.7 with nothing past 1.12."""
    from ddpm_core import ceiling

    def placed(ax):
        ax.figure.canvas.draw()
        r = ax.figure.canvas.get_renderer()
        frame = ax.get_window_extent(r)
        lines = [ax.transData.transform((line.get_xdata()[0], 0))[0] for line in ax.get_lines()
                 if line.get_gid() != "leader"]  # a leader runs along its own row to its label, by design
        for t in ax.texts:
            box = t.get_window_extent(r)
            assert box.x1 <= frame.x1, f"{t.get_text()!r} runs past the frame"
            assert not any(box.x0 - 1 <= x <= box.x1 + 1 for x in lines), f"a line runs through {t.get_text()!r}"
        return frame, [t.get_window_extent(r) for t in ax.texts]

    stages = pd.DataFrame({"stage": ["base", "+ a", "+ b"], "images_per_s": [30.0, 33.0, 29.0]})
    ax = plots.waterfall(stages, label="t").axes[0]
    frame, boxes = placed(ax)
    assert max(b.x1 for b in boxes) > frame.x1 - 0.1 * frame.width  # no long empty stretch right of the labels
    shapes = pd.DataFrame({"shape": ["a", "b", "c"], "count": [1, 1, 1], "GFLOP": [1.0] * 3, "ms": [1.0] * 3,
                           "spread": [0.0] * 3, "TFLOP/s": [0.078, 0.042, 0.029], "share of conv time": [0.5, 0.3, 0.2]})
    c = ceiling.Ceiling(device_name="CPU", label="t", model="m", precision="fp32", batch_size=4, channels_last=True,
                        shapes=shapes, conv_flops=int(0.0695e12 * 0.01), conv_ms=10.0, matmul_n=256, matmul_tflops=0.0739,
                        step_flops=int(0.0695e12 * 0.012), datasheet=None)
    placed(plots.ceiling_figure(c, label="t").axes[0])
    table = pd.DataFrame({"variant": ["ours (baseline)", "ours (fast)"], "batch": [4, 4], "img/s": [27.0, 30.0],
                          "speedup": ["1.00x (baseline)", "no measurable difference"], "TFLOP/s": [0.046, 0.069]})
    fig = plots.peers_figure(table, ceiling=c, label="t")
    for ax in fig.axes:
        placed(ax)
    # the panels sit close: the ceiling's legend, wider than its panel, once opened a gap of a fifth of the figure
    r = fig.canvas.get_renderer()
    left, right = fig.axes
    left_end = max([left.get_window_extent(r).x1] + [t.get_window_extent(r).x1 for t in left.texts])
    assert right.get_window_extent(r).x0 - left_end < 0.05 * fig.bbox.width
    legend = right.get_legend()
    assert legend.get_in_layout() and fig.get_tightbbox(r).y0 <= legend.get_tightbbox(r).y0 / fig.dpi  # saved with it


def test_a_ceiling_label_moved_past_a_line_is_tied_to_its_bar_by_a_leader():
    """09b's ceiling figure moved the labels of short bars past the matmul line, far from their bars, with nothing
    to say which bar each belonged to."""
    from ddpm_core import ceiling

    shapes = pd.DataFrame({"shape": ["a", "b", "c"], "count": [1, 1, 1], "GFLOP": [1.0] * 3, "ms": [1.0] * 3,
                           "spread": [0.0] * 3, "TFLOP/s": [0.305, 0.0794, 0.02], "share of conv time": [0.5, 0.3, 0.2]})
    c = ceiling.Ceiling(device_name="CPU", label="t", model="m", precision="fp32", batch_size=4, channels_last=True,
                        shapes=shapes, conv_flops=int(0.1e12 * 0.01), conv_ms=10.0, matmul_n=256, matmul_tflops=0.24,
                        step_flops=int(0.1e12 * 0.012), datasheet=None)
    ax = plots.ceiling_figure(c, label="t").axes[0]
    leaders = [line for line in ax.get_lines() if line.get_gid() == "leader"]
    bars = {round(b.get_width(), 6): b for b in ax.patches}
    moved = [t for t in ax.texts if t.xy[0] > bars[round(float(t.get_text().split()[0]), 4)].get_width() + 1e-9]
    assert moved, "the short bars' labels should sit past the lines"
    for t in moved:  # each moved label: one leader on its own row, from its bar's end to the label
        bar = bars[round(float(t.get_text().split()[0]), 4)]
        y = bar.get_y() + bar.get_height() / 2
        assert any(list(line.get_xdata()) == [bar.get_width(), t.xy[0]] and list(line.get_ydata()) == [y, y]
                   for line in leaders), t.get_text()
    assert len(leaders) == len(moved)  # a label beside its bar needs none
    plots.plt.close(ax.figure)


def test_the_peers_ceiling_line_runs_across_our_rows_only():
    """09b's dashed "measured ceiling of our step" crossed the diffusers and lucidrains rows, whose table cells say
    n/a (another network)."""
    from ddpm_core import ceiling

    shapes = pd.DataFrame({"shape": ["a"], "count": [1], "GFLOP": [1.0], "ms": [1.0], "spread": [0.0],
                           "TFLOP/s": [0.07], "share of conv time": [1.0]})
    c = ceiling.Ceiling(device_name="CPU", label="t", model="m", precision="fp32", batch_size=4, channels_last=False,
                        shapes=shapes, conv_flops=int(0.07e12 * 0.01), conv_ms=10.0, matmul_n=256, matmul_tflops=0.07,
                        step_flops=int(0.07e12 * 0.012), datasheet=None)
    table = pd.DataFrame({"variant": ["ours (baseline)", "ours (fast)", "diffusers", "lucidrains", "ours (fast, batch 8)"],
                          "batch": [4, 4, 4, 4, 8], "img/s": [27.0, 30.0, 20.0, 22.0, 33.0],
                          "speedup": ["1.00x (baseline)", "1.11x", "0.74x", "n/a", "1.22x"],
                          "TFLOP/s": [0.046, 0.05, 0.04, 0.066, 0.055]})
    ax = plots.peers_figure(table, ceiling=c, label="t").axes[1]
    segments = [sorted(line.get_ydata()) for line in ax.get_lines() if line.get_xdata()[0] == c.tflops]
    assert segments == [[-0.45, 1.45], [3.55, 4.45]]  # rows 0-1 and row 4; rows 2 and 3 (the peers) left clear
    assert "our rows only" in " ".join(t.get_text() for t in ax.get_legend().get_texts())
    # lucidrains' label (0.066) sits right of the ceiling line, away from its bar: a leader ties the two
    leaders = [line for line in ax.get_lines() if line.get_gid() == "leader"]
    assert any(list(line.get_xdata())[0] == 0.066 and list(line.get_ydata()) == [3.0, 3.0] for line in leaders)
    plots.plt.close(ax.figure)


def test_a_run_keeps_its_colour_and_line_style_across_two_loss_figures():
    """10 drew sgd at lr 0.05 blue and solid in one figure, orange and dashed in Exercise 1's."""
    first = {"sgd (lr 0.05)": [(1, 1.0), (2, 0.9)], "adam (lr 0.001)": [(1, 1.0), (2, 0.8)]}
    styles = plots.run_styles(list(first))
    fig = plots.loss_curves(first, label="t", smooth=1, styles=styles)
    drawn = {line.get_label(): (line.get_color(), line.get_linestyle()) for line in fig.axes[0].get_lines()
             if not line.get_label().startswith("_")}
    assert drawn["sgd (lr 0.05)"] == (styles["sgd (lr 0.05)"][0], "-")
    second = {"sgd, lr 0.01": [(1, 1.0), (2, 0.95)], "sgd, lr 0.05": first["sgd (lr 0.05)"],
              "adam, lr 0.001": first["adam (lr 0.001)"]}
    fixed = {"sgd, lr 0.05": styles["sgd (lr 0.05)"], "adam, lr 0.001": styles["adam (lr 0.001)"]}
    again = plots.run_styles(list(second), fixed)
    assert again["sgd, lr 0.05"] == styles["sgd (lr 0.05)"] and again["adam, lr 0.001"] == styles["adam (lr 0.001)"]
    assert again["sgd, lr 0.01"][0] not in {c for c, _ in fixed.values()}  # a new run: a colour of its own
    fig2 = plots.loss_curves(second, label="t", smooth=1, styles=fixed)
    drawn2 = {line.get_label(): line.get_color() for line in fig2.axes[0].get_lines() if not line.get_label().startswith("_")}
    assert drawn2["sgd, lr 0.05"] == drawn["sgd (lr 0.05)"][0]
    assert plots.run_styles(["a", "b"]) == {"a": ("C0", "-"), "b": ("C1", "--")}  # without fixed: as before
    plots.plt.close(fig)
    plots.plt.close(fig2)


def test_the_sdpa_figure_labels_each_pair_as_its_comparison_does():
    quiet = bench.Noise(cores=2, load_1min=0.0, other_cpu_share=0.0, spreads={})
    cmp = bench.Comparison([_spread("math (fp32)", 313.2, 300, 330), _spread("sdpa (fp32)", 300.7, 290, 320)], quiet)
    rows = pd.DataFrame([m.row() for m in cmp.measurements])
    micro = pd.DataFrame({"impl": ["math", "math", "sdpa", "sdpa"], "seq_len": [64, 256, 64, 256],
                          "median_ms": [1.0, 4.0, 0.8, 2.0], "peak_memory_mib": [1.0, 16.0, 0.5, 2.0]})
    fig = plots.sdpa_figure(rows, micro, label="t", comparison=cmp, versus={"sdpa (fp32)": "math (fp32)"})
    assert {"313.2 ms", "300.7 ms (within noise)"} <= set(_texts(fig))
    fig.canvas.draw()
    for ax in fig.axes[1:]:  # the attention-alone panels: ticks at the measured lengths only
        assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "256"]


def test_a_log_axis_uses_one_tick_format():
    """Plain numbers on an axis that stays within 0.001-100,000; powers for every tick on one that reaches beyond
    (01's SNR axis read '10000, 100, 1, 0.01, 10^-4')."""
    import matplotlib.pyplot as plt

    fig, (wide, narrow) = plt.subplots(1, 2)
    wide.semilogy([0, 1], [1e-5, 1e4])
    narrow.semilogy([0, 1], [0.01, 1000])
    plots.titled(fig, "t", label="x")
    fig.canvas.draw()
    labels = {ax: [t.get_text() for t in ax.get_yticklabels() if t.get_text()] for ax in (wide, narrow)}
    assert labels[wide] and all("10^" in t for t in labels[wide]), labels[wide]
    assert labels[narrow] and not any("10^" in t for t in labels[narrow]) and "100" in labels[narrow], labels[narrow]
    plt.close(fig)


def test_a_png_records_the_device_the_mode_and_the_date_it_was_made_with(figures, monkeypatch):
    from ddpm_core import env

    monkeypatch.setenv("DDPM_SMOKE", "1")
    monkeypatch.setattr(env, "_RUN_LABEL", "CPU (test, 2 threads) · torch 9.9")  # what env.show() printed
    fig = plots.plt.figure()
    rec = plots.figure_source(plots.savefig(fig, "made_here"))
    assert rec["Source"] == "CPU (test, 2 threads) · torch 9.9" and rec["Mode"] == "smoke"
    assert rec["Created"][:4].isdigit() and rec["Created"].endswith("UTC")
    # a figure drawn from a reference run's data says so, not this machine
    rec = plots.figure_source(plots.savefig(fig, "from_the_reference", source="reference: GPU X", mode="full"))
    assert (rec["Source"], rec["Mode"]) == ("reference: GPU X", "full")
    fig.savefig(figures / "bare.png")  # a PNG written without savefig records nothing
    assert plots.figure_source(figures / "bare.png") == {} and plots.figure_source(figures / "nothing.png") == {}


def test_memory_bar_ticks_do_not_run_together():
    """03b's saved-bytes bars of the paper's model on the H200 (up to 16,719 KiB per image) printed their x ticks
    as '10000125001500017500': at most about five ticks, with thousands separators, none overlapping."""
    import pandas as pd

    df = pd.DataFrame({"kind": ["convolution inputs", "GroupNorm", "attention", "dropout"],
                       "KiB_per_image": [16718.5, 13164.8, 5169.0, 1068.0]})
    budget = pd.DataFrame({"config": ["no checkpointing", "checkpointing"], "fixed_MiB": [681.8, 681.8],
                           "saved_MiB": [36000.0, 9000.0]})
    for fig in (plots.memory_bars(df, value="KiB_per_image", name="kind", xlabel="KiB per image"),
                plots.memory_budget(budget)):
        fig.canvas.draw()
        ax = fig.axes[0]
        ticks = [t for t in ax.get_xticklabels() if t.get_text() and t.get_visible()]
        boxes = [t.get_window_extent() for t in ticks]
        assert 2 <= len(ticks) <= 7, [t.get_text() for t in ticks]
        assert all(not a.overlaps(b) for a, b in zip(boxes, boxes[1:])), [t.get_text() for t in ticks]
        assert any("," in t.get_text() for t in ticks), [t.get_text() for t in ticks]
        plots.plt.close(fig)


def _diff_rows(rows):
    return pd.DataFrame(rows, columns=["name", "calls before", "calls after", "time before (us)", "time after (us)",
                                       "time change (us)", "change"])


def test_a_vanished_wrapper_whose_operator_beneath_kept_its_calls_is_marked_not_read_as_a_saving():
    """04's diff led with aten::conv2d (43 -> 0 calls, -28.7 ms) while aten::convolution beneath it still ran 43 -> 43:
    compiled code calls the operator beneath directly. Such a row is a vanished wrapper; a fused-away one (its operator
    beneath vanished too) is not."""
    diff = _diff_rows([["aten::conv2d", 43, 0, 30_000, 0, -30_000, "vanished"],
                       ["aten::convolution", 43, 43, 29_000, 24_000, -5_000, "same calls"],
                       ["aten::group_norm", 20, 0, 8_000, 0, -8_000, "vanished"],
                       ["aten::add", 36, 1, 3_000, 10, -2_990, "fewer calls"]])
    assert plots.vanished_wrappers(diff) == {"aten::conv2d": ("aten::convolution", 43.0, 43.0, -5_000.0)}
    # the operator beneath outside the top rows: found in the whole diff
    top = diff[diff["name"] != "aten::convolution"].reset_index(drop=True)
    assert plots.vanished_wrappers(top) == {}
    assert set(plots.vanished_wrappers(top, diff)) == {"aten::conv2d"}
    fig = plots.trace_diff_bars(diff, label="test")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert "a wrapper: aten::convolution ran 43 -> 43" in labels[0] and "wrapper" not in labels[2]
    assert ax.patches[0].get_hatch() == "//" and not ax.patches[2].get_hatch()
    assert "not work saved" in ax.get_xlabel()
    plots.plt.close(fig)


def test_the_trace_diff_legend_of_the_kind_panel_covers_no_bar():
    """09's kind panel: its before/after legend, inside the panel, covered the end of the convolution's "after" bar."""
    diff = _diff_rows([["aten::add", 10, 10, 2_000, 1_000, -1_000, "same calls"]])
    by_kind = pd.DataFrame({"kind": ["convolution", "elementwise"], "calls before": [40, 300], "calls after": [40, 100],
                            "time before (us)": [50_000, 9_000], "time after (us)": [52_000, 3_000],
                            "appeared": [0, 2], "vanished": [0, 5], "time change (us)": [2_000, -6_000]})
    fig = plots.trace_diff_bars(diff, label="test", by_kind=by_kind)
    fig.canvas.draw()
    top = fig.axes[0]
    box = top.get_legend().get_window_extent()
    assert not any(box.overlaps(p.get_window_extent()) for p in top.patches)
    assert plots.legend_overlaps(fig) == []
    plots.plt.close(fig)


def test_scaling_figure_starts_at_zero_and_names_training_processes_and_the_plain_single_process():
    scaling = pd.DataFrame({"world_size": [1, 2], "images_per_s": [40.0, 70.0], "backend": ["none", "gloo"],
                            "efficiency": [1.0, 0.88]})
    fig = plots.scaling_efficiency(scaling, label="test")
    ax = fig.axes[0]
    assert ax.get_ylim()[0] == 0
    assert "workers" not in ax.get_xlabel() and "without DDP" in ax.get_xlabel()
    plots.plt.close(fig)


def test_epoch_time_figure_shows_each_point_s_spread_and_which_launch_ran_without_ddp():
    df = pd.DataFrame({"world_size": [1, 1, 2, 2], "precision": ["fp32"] * 4, "batch_per_process": [4, 8, 4, 8],
                       "images_per_s": [40.0, 60.0, 70.0, 110.0], "backend": ["none", "none", "gloo", "gloo"],
                       "times_ms": [[100, 95, 105, 110], [133, 130, 140, 135], [114, 110, 120, 118], [145, 140, 150, 149]]})
    fig = plots.epoch_time_vs_batch(df, label="test")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["1 process (no DDP), fp32", "2 processes (DDP), fp32"]
    assert len(ax.collections) == 4 and len(ax.lines) == 2  # one p10-p90 bar per point, one line per curve
    lo, hi = ax.collections[0].get_segments()[0][:, 1]
    assert lo < 50_000 * 0.100 / 4 < hi  # the 1-process point at batch 4: its median step, 100 ms, inside its bar
    plots.plt.close(fig)


def test_the_break_even_figure_covers_the_range_it_states_and_draws_the_spread():
    """04's label said 'pays off after 2,900 to 46,000 steps' on an axis that stopped near 23,000, ran past the
    axes' edge, and its bars had no p10-p90 although the verdict rests on them."""
    quiet = bench.Noise(cores=2, load_1min=0.0, other_cpu_share=0.0, spreads={})
    cmp = bench.Comparison([_spread("eager", 178.0, 170, 190), _spread("compiled", 100.0, 98, 102)], quiet)
    rows = pd.DataFrame([{**m.row(), "first_ms": f} for m, f in zip(cmp.measurements, (500.0, 90_000.0))])
    fig = plots.compile_breakeven(rows, label="t", comparison=cmp, breakeven_words={"compiled": "1,000 to 9,000"},
                                  breakeven_ranges={"compiled": (1_000.0, 9_000.0)})
    ax, ax2 = fig.axes[:2]
    assert ax2.get_xlim()[1] >= 9_000  # the upper end of the stated range is on the chart
    said = [t for t in ax2.texts if "pays off after 1,000 to 9,000 steps" in t.get_text()]
    assert said and all(t.get_transform() == ax2.transAxes for t in said)  # placed inside the axes
    legend = [t.get_text() for t in ax2.get_legend().get_texts()]
    assert any("medians' break-even" in t for t in legend) and any("p10-p90" in t for t in legend)
    assert ax.containers and any(getattr(c, "has_xerr", False) for c in ax.containers)  # p10-p90 whiskers
    assert not any("(hint))" in t.get_text() for t in ax.texts)  # one level of brackets
    plots.plt.close("all")


def test_the_scaling_figure_draws_each_point_s_spread_and_a_given_label():
    scaling = pd.DataFrame({"world_size": [1, 2], "images_per_s": [36.7, 65.8], "global_batch": [8, 16],
                            "p10_ms": [215.0, 228.4], "p90_ms": [259.6, 282.3], "backend": ["none", "gloo"],
                            "efficiency": [1.0, None], "efficiency label": ["baseline", "n/a: ranges overlap"]})
    fig = plots.scaling_efficiency(scaling, label="test")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.texts] == ["baseline", "n/a: ranges overlap"]
    assert any(len(c.lines) > 2 and c.lines[2] for c in ax.containers)  # an errorbar container: the p10-p90 bars
    plots.plt.close(fig)


def test_kernel_labels_keep_the_data_type_a_middle_cut_would_remove():
    """09's trace diff asks the reader to find fp32 convolution kernels replaced by bf16 ones; cut in the middle to 48
    characters, the H200's cuDNN kernel names lost exactly the part that says so (a student read of its reference)."""
    from ddpm_core.plots import kernel_label, kernel_labels, name_dtype, short_name

    bf16 = ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1_g1_"
            "execute_segment_k_off_kernel__5x_cudnn")
    fp32 = ("sm80_xmma_fprop_implicit_gemm_f32f32_f32f32_f32_nchwkcrs_nchw_tilesize256x64x8_stage3_warpsize2x2x1_g1_"
            "ffma_aligna4_alignc4_execute_kernel__5x_cudnn")
    assert name_dtype(short_name(bf16)) is None  # the old cut: "sm90_xmma_fprop_implici...k_off_kernel__5x_cudnn"
    a, b = kernel_label(bf16), kernel_label(fp32)
    assert len(a) <= 48 and len(b) <= 48
    assert name_dtype(a) == "bf16" and name_dtype(b) == "fp32" and "fprop" in a and "fprop" in b
    assert "tilesize" not in a + b and "nhwc" in a and "nchw" in b  # the layout stays, the tiling goes first
    assert kernel_label("void fft2d_r2c_32x32<float, false, 1u, false>(float2*, float const*, int, int)") == \
        "fft2d_r2c_32x32<float, false, 1u, false>"  # a C++ parameter list goes before anything is cut
    assert kernel_label("aten::add_") == "aten::add_" and name_dtype("aten::add_") is None
    silu = ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel("
            "at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, "
            "std::array<char*, 2ul> >(int, at::native::(anonymous namespace)::silu_kernel(at::TensorIteratorBase&)"
            "::{lambda()#1}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>)")
    mul = ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, "
           "float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&, at::native::"
           "BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > const&)::{lambda(int)#1}>("
           "int, at::native::gpu_kernel_impl_nocast<...>::{lambda(int)#1})")
    adam = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
            "(at::native::ADAM_MODE)0, false>, float*, double, double, double, double, double, bool, bool*, float*, float*, "
            "float const*, float const*>(at::native::(anonymous namespace)::FusedOptimizerTensorListMetadata<4>, ...)")
    # ATen's templated kernels: the launcher and the operation in its template, not "at::native::vectorized_...>"
    assert kernel_label(silu) == "vectorized_elementwise_kernel<silu_kernel>"
    assert kernel_label(mul) == "elementwise_kernel<MulFunctor> [fp32]"
    assert kernel_label(adam) == "multi_tensor_apply_...sedAdamMathFunctor> [fp32]"
    other = bf16.replace("tilesize128x128x64", "tilesize64x64x64")  # the same kernel with another tiling
    assert kernel_labels([bf16, other, fp32]) == [a, a + " #2", b]
