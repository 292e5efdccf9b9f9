"""Figures in one style, saved to data/figures/ (or $DDPM_FIGURES_DIR) and labeled with the device."""

from __future__ import annotations

import io
import math
import re
import textwrap
from pathlib import Path
from typing import Any, Callable

import matplotlib.pyplot as plt
import matplotlib.table
import matplotlib.ticker
import matplotlib.transforms
import torch

from .atomic import atomic_write_bytes
from .bench import OTHER_NETWORK, ranges_apart  # the end of a speedup cell that compares TFLOP/s (bench.work_factor)
from .paths import figures_dir
from .text import plural


def set_style() -> None:
    """The series' seaborn style."""
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")


LAYOUT_WARNING = "figure layout:"


def legend_overlaps(fig: "plt.Figure") -> list[str]:
    """The texts a legend of ``fig`` covers: titles, axis labels, tick labels and the texts drawn on the axes
    (bar labels, annotations), each as "<legend> covers <text>". Empty when every legend is clear of them."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [(ax, ax.get_legend()) for ax in fig.axes if ax.get_legend() is not None] + [(None, lg) for lg in fig.legends]
    found = []
    for owner, legend in legends:
        if not legend.get_visible():
            continue
        box = legend.get_window_extent(renderer).padded(-1)  # touching is not covering
        for ax in fig.axes:
            titles = [getattr(ax, a, None) for a in ("title", "_left_title", "_right_title")]  # the three title slots
            texts = [*titles, ax.xaxis.label, ax.yaxis.label, *ax.texts, *ax.get_xticklabels(), *ax.get_yticklabels()]
            for text in texts:
                if text is None or not text.get_visible() or not text.get_text().strip():
                    continue
                if box.overlaps(text.get_window_extent(renderer)):
                    what = "the legend" if owner is None else f"the legend of '{owner.get_title() or owner.get_ylabel()}'"
                    found.append(f"{what} covers '{text.get_text().strip()[:40]}'")
        for text in [*fig.texts, getattr(fig, "_suptitle", None)]:
            if text is not None and text.get_visible() and text.get_text().strip() and box.overlaps(
                    text.get_window_extent(renderer)):
                found.append(f"the legend covers the figure text '{text.get_text().strip()[:40]}'")
    return found


def legend_below(ax: "plt.Axes", align: str = "center", **kw: Any) -> "plt.Legend":
    """A legend under ``ax`` (centred, or flush with its right edge: ``align="right"``), below its tick labels and
    x label, whatever the figure's size.

    The gap is measured once drawn and kept in points, so a later ``tight_layout`` that shrinks the axes does not
    bring the legend back over the label (a fixed offset in axes units does).
    """
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    axes_bottom = ax.get_window_extent(renderer).y0
    texts = [t for t in (ax.xaxis.label, *ax.get_xticklabels()) if t.get_visible() and t.get_text().strip()]
    lowest = min([t.get_window_extent(renderer).y0 for t in texts], default=axes_bottom)
    drop = (axes_bottom - lowest) / fig.dpi + 4 / 72  # inches, and a 4-point gap
    anchor = ax.transAxes + matplotlib.transforms.ScaledTranslation(0, -drop, fig.dpi_scale_trans)
    if align not in ("center", "right"):
        raise ValueError(f"align must be 'center' or 'right', not {align!r}")
    return ax.legend(loc=f"upper {align}", bbox_to_anchor=(0.5 if align == "center" else 1, 0), bbox_transform=anchor,
                     frameon=False, **kw)


def source_metadata(source: str | None = None, mode: str | None = None) -> dict[str, str]:
    """What a PNG written by ``savefig`` records of where it comes from (text chunks that ``figure_source`` reads):
    the device and torch label (``source``, default the label the notebook's environment cell printed), the mode
    (``mode``, default ``DDPM_SMOKE`` as the notebooks read it: "smoke" or "full") and the date."""
    import datetime
    import os

    from . import env

    return {"Source": source or env.run_label(), "Mode": mode or ("smoke" if os.environ.get("DDPM_SMOKE") == "1" else "full"),
            "Created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def figure_source(path: Path | str) -> dict[str, str]:
    """The ``source_metadata`` a PNG holds ({} for a figure written before figures recorded it, or not a PNG)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            info = dict(im.info)
    except OSError:
        return {}
    return {k: str(info[k]) for k in ("Source", "Mode", "Created") if k in info}


def savefig(fig: "plt.Figure", name: str, dpi: int = 150, source: str | None = None, mode: str | None = None) -> Path:
    """Save ``fig`` as ``<figures dir>/<name>`` (PNG, written atomically) and return the path.

    The folder is ``paths.figures_dir()``: $DDPM_FIGURES_DIR when set, else data/figures/, which git ignores, so
    no run overwrites the committed figures in figures/ (``reference figures`` copies them there). A PNG records where it
    comes from (``source_metadata``: ``source``, default this process's device label; ``mode``; the date), which the
    README's sentence on the committed figures is written from. A legend that covers a label or a title is reported
    as a warning that starts with ``LAYOUT_WARNING`` (the suite fails on it).
    """
    import warnings

    plain_log_ticks(fig)  # also for the axes a notebook set to log itself (before the check: labels change width)
    for problem in legend_overlaps(fig):
        warnings.warn(f"{LAYOUT_WARNING} {Path(name).name}: {problem}", stacklevel=2)
    path = Path(name)
    if not path.is_absolute():
        path = figures_dir() / path
    if path.suffix == "":
        path = path.with_suffix(".png")
    buf = io.BytesIO()
    fmt = path.suffix.lstrip(".").lower()
    fig.savefig(buf, format=fmt, dpi=dpi, bbox_inches="tight",
                **({"metadata": source_metadata(source, mode)} if fmt == "png" else {}))
    atomic_write_bytes(path, buf.getvalue())
    return path


def _grid(images: torch.Tensor, nrow: int | None = None) -> tuple[torch.Tensor, int]:
    """A batch of images in [-1, 1] as one (3, H, W) grid in [0, 1], about square; and its row length."""
    from torchvision.utils import make_grid

    images = images.detach().float().cpu().clamp(-1, 1)
    nrow = nrow or max(1, int(round(images.shape[0] ** 0.5)))
    return make_grid((images + 1) / 2, nrow=nrow, padding=1, pad_value=1.0), nrow


def image_grid_figure(images: torch.Tensor, title: str | None = None, nrow: int | None = None) -> "plt.Figure":
    """A figure of a batch of images in [-1, 1] laid out as a grid."""
    grid, nrow = _grid(images, nrow)
    side = max(4.0, 0.55 * nrow)
    fig, ax = plt.subplots(figsize=(side, side * grid.shape[1] / grid.shape[2] + 0.4))
    ax.imshow(grid.permute(1, 2, 0).numpy(), interpolation="nearest")
    ax.set_axis_off()
    if title:
        ax.set_title(_wrap(title, side), fontsize=9)
    return fig


def _wrap(title: str, inches: float) -> str:
    """Wrap each line of a title to the figure's width (about 14 characters per inch at font size 9). A " · "-separated
    part that fits on a line is kept whole (no-break spaces): "torch 2.14.1" is never split between two lines."""
    width = max(20, int(14 * inches))
    return "\n".join(textwrap.fill(" · ".join(p.replace(" ", "\u00a0") if len(p) <= width else p for p in line.split(" · ")),
                                    width=width) for line in title.split("\n"))


def save_image_grid(images: torch.Tensor, name: str, title: str | None = None) -> Path:
    """Save a grid of images in [-1, 1] (see ``savefig`` for where it goes)."""
    fig = image_grid_figure(images, title)
    try:
        return savefig(fig, name)
    finally:
        plt.close(fig)


# ------------------------------------------------------------------------------ the series' charts
def _resolve(label: str | None) -> str:
    """Every chart names what it was measured on: ``label`` (e.g. a reference GPU's), else this machine."""
    if label is not None:
        return label
    from .env import label as this_machine

    return this_machine()


class _PlainLogFormatter(matplotlib.ticker.LogFormatterSciNotation):
    """matplotlib's choice of which log ticks to label, written 300 and 0.9 (not 3×10², 9×10⁻¹) where every major
    tick in view lies between 0.001 and 100,000, and all as powers (10⁻⁴, 10⁴) on an axis that reaches beyond: one
    format per axis (01's SNR axis read "10000, 100, 1, 0.01, 10⁻⁴")."""

    def _plain_axis(self, x: float) -> bool:
        if self.axis is None:
            return 1e-3 <= abs(x) < 1e5
        lo, hi = sorted(self.axis.get_view_interval())
        ticks = [t for t in self.axis.get_majorticklocs() if lo <= t <= hi and t > 0] or [x]
        return all(1e-3 <= t < 1e5 for t in ticks)

    def __call__(self, x: float, pos: Any = None) -> str:
        text = super().__call__(x, pos)
        return f"{x:g}" if text and self._plain_axis(x) else text

    def set_locs(self, locs: Any = None) -> None:
        """Over one to two decades matplotlib labels the minor ticks 2, 3, 4 and 6 of each, and 3 and 4 crowd each
        other (05's memory axis read "4/3", "0.4/0.3"): label 2 and 5 there, as a log axis is usually read."""
        super().set_locs(locs)
        if self._sublabels is None or self.axis is None or self._base != 10 or not 1 < len(self._sublabels) <= 6:
            return  # no minor labels (past two decades), or every minor tick (under half a decade)
        lo, hi = sorted(self.axis.get_view_interval())
        if lo > 0 and math.log10(hi / lo) > 1:
            self._sublabels = {1.0, 2.0, 5.0}


def plain_log_ticks(fig: "plt.Figure") -> "plt.Figure":
    """Log-scaled axes of ``fig`` labelled 300 and 0.9, not 3×10² and 9×10⁻¹; powers of two as 4, 8, 16, not 2².
    An axis whose ticks were already labelled one by one (:func:`log_ticks`) keeps its labels."""
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() != "log" or isinstance(axis.get_major_formatter(), matplotlib.ticker.FixedFormatter):
                continue
            base = axis.get_transform().base
            axis.set_major_formatter(_PlainLogFormatter(base=base))
            axis.set_minor_formatter(_PlainLogFormatter(base=base, labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    return fig


def titled(fig: "plt.Figure", title: str, label: str | None = None, fontsize: int = 10) -> "plt.Figure":
    """A figure made in a notebook cell, finished like the series' own charts: ``title`` with the machine's label
    (``label``, else this machine) on a second line, plain log ticks, and a layout that keeps the panel titles
    clear of it."""
    return _suptitle(fig, title, label, fontsize)


def _suptitle(fig: "plt.Figure", title: str, label: str | None, fontsize: int = 10) -> "plt.Figure":
    fig.suptitle(f"{title}\n{_resolve(label)}", fontsize=fontsize)
    plain_log_ticks(fig)
    fig.tight_layout()
    return fig


def mark_noise(fig: "plt.Figure", noise: Any, rule: str | None = None) -> "plt.Figure":
    """Stamp a noisy measurement on its figure: a red line under the plot saying why, and which
    ratios are still reported (``noise`` is a ``bench.Noise``; a quiet run leaves the figure as it is).
    ``rule``: what the figure's own comparison states despite the noise (``Noise.warning``)."""
    if noise is None or not noise.noisy:
        return fig
    if noise.busy or not getattr(fig, "ratios_checked", False):
        # No speedup is stated from a run on a busy machine: the figure drops its "(1.23x)" ratio labels too,
        # keeping the values. Where only some repeats spread widely, a figure whose labels came from the
        # comparison itself (``ratios_checked``: a ratio where it holds, "within noise" where not) keeps them.
        for ax in fig.axes:
            for t in ax.texts:
                t.set_text(re.sub(r"\s*\(\d+(?:\.\d+)?x\)", "", t.get_text()))
    return mark_caveat(fig, "NOISY MEASUREMENT. " + noise.warning(rule))


def mark_caveat(fig: "plt.Figure", text: str) -> "plt.Figure":
    """A red line of text under the figure and a red frame: what the figure must not be read as."""
    # below everything the axes drew (tick labels, axis labels, legends under the axes), so it covers none of it
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes] + [leg.get_window_extent(renderer) for leg in fig.legends]
    bottom = min([b.y0 for b in boxes if b is not None] + [0.0]) / fig.bbox.height
    width = max(60, int(14 * fig.get_figwidth()))  # characters per line at font size 8
    fig.text(0.5, bottom - 0.01, "\n".join(textwrap.wrap(text, width)), ha="center", va="top", fontsize=8, color="#b00020")
    fig.patch.set_edgecolor("#b00020")
    fig.patch.set_linewidth(3)
    return fig


def _ratio_text(ratio: float, name: str, base_name: str, comparison: Any = None) -> str:
    """A bar's speedup label: the ratio of the two medians, or, where ``comparison`` (a ``bench.Comparison``
    holding both variants) states none, why, as its table does: "within noise" where the ranges overlap, "noisy" where
    the machine was too busy or the repeats too wide to compare (a 12x gap on a busy machine is not "within noise"),
    "too few repeats" where too few calls were timed."""
    if comparison is None or name == base_name:
        return f"{ratio:.2f}x"
    if comparison.speedup(name, base_name) is not None:  # "(hint)" where the comparison states it only as a hint
        return f"{ratio:.2f}x" + (" (hint)" if comparison.hint(name, base_name) else "")
    why = comparison.factor(name, base_name)
    return "within noise" if why == "no measurable difference" else why


def _checked(fig: "plt.Figure", checked: bool) -> "plt.Figure":
    """Mark a figure whose ratio labels each came from a comparison's verdict (``mark_noise`` keeps them)."""
    fig.ratios_checked = checked
    return fig


def _title(ax, title: str, label: str | None) -> None:
    ax.set_title(f"{title}\n{_resolve(label)}", fontsize=10)
    plain_log_ticks(ax.figure)


def _labels_in_view(ax, lines: tuple[float, ...] = (), rounds: int = 6) -> None:
    """Place the texts drawn on ``ax`` (bar labels, anchored at a data x on a horizontal bar chart whose x axis starts
    at 0) so that none is crossed by a vertical reference line at one of ``lines`` and none runs past the right edge:
    a label a line would cross moves to just right of that line, and the x limit is set to where the longest label
    (or the rightmost line) ends, no further (09's waterfall ran to 1.7 with nothing past 1.12; 09b's peer labels ran
    past the frame)."""
    import matplotlib.text

    fig = ax.figure
    texts = [t for t in ax.texts if t.get_visible() and t.get_text().strip()]
    if not texts:
        return

    def anchor(t) -> float:
        return t.xy[0] if isinstance(t, matplotlib.text.Annotation) else t.get_position()[0]

    def move(t, x: float) -> None:
        if isinstance(t, matplotlib.text.Annotation):
            t.xy = (x, t.xy[1])
        else:
            t.set_position((x, t.get_position()[1]))

    for _ in range(rounds):  # moving a label or widening the axis moves the others in pixels: repeat until settled
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        changed = False
        for t in texts:
            box = t.get_window_extent(renderer)
            hit = [x for x in lines if box.x0 - 2 <= ax.transData.transform((x, 0))[0] <= box.x1 + 2 and x >= anchor(t)]
            if hit:  # 3 pixels clear of the line, then the label's own offset
                move(t, ax.transData.inverted().transform(ax.transData.transform((max(hit), 0)) + (3, 0))[0])
                changed = True
        fig.canvas.draw()
        left, right = ax.get_xlim()
        width = ax.get_window_extent(renderer).width
        need = 1.03 * max((*lines, 0.0)) - 0.03 * left
        for t in texts:
            # the label ends at a + f * (limit - left), f its width (from its anchor a) as a share of the axes: it fits,
            # with 2% to spare, where limit - left >= (a - left) / (1 - f - 0.02)
            a = anchor(t)
            f = (t.get_window_extent(renderer).x1 - ax.transData.transform((a, 0))[0]) / width
            need = max(need, left + (a - left) / max(1 - f - 0.02, 0.05))
        if abs(need - right) > 0.01 * (right - left):
            ax.set_xlim(left, need)
            changed = True
        if not changed:
            return


def _label_bars(ax, bars, fmt: str) -> None:
    for b in bars:
        w = b.get_width()
        ax.annotate(fmt.format(w), (w, b.get_y() + b.get_height() / 2), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize=8)


def throughput_bars(df, *, label: str | None = None, x: str = "variant", y: str = "images_per_s",
                    baseline: str | None = None, title: str = "Training throughput") -> "plt.Figure":
    """Horizontal bars of ``y`` per ``x`` with value labels, and the speedup over ``baseline``
    (default: the first row) - a ratio of two measurements in the same table."""
    set_style()
    df = df.reset_index(drop=True)
    if x not in df and "name" in df:  # Measurement.row() calls the variant "name"
        x = "name"
    base = df.loc[df[x] == baseline, y].iloc[0] if baseline is not None else df[y].iloc[0]
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(df) + 1.6))
    bars = ax.barh(df[x].astype(str), df[y])
    ax.invert_yaxis()
    for b, v in zip(bars, df[y]):
        ax.annotate(f"{v:,.0f}  ({v / base:.2f}x)", (b.get_width(), b.get_y() + b.get_height() / 2),
                    xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_xlabel("images / s" if y == "images_per_s" else y)
    ax.set_xlim(0, df[y].max() * 1.3)
    _title(ax, title, label)
    return fig


def _mib(df, column: str):
    """A memory column of a sweep in MiB, whatever unit its name says (``*_bytes``, ``*_gib``, else MiB)."""
    if column.endswith("bytes"):
        return df[column] / 2**20
    if column.endswith("gib"):
        return df[column] * 1024
    return df[column]


def batch_size_lines(df, *, label: str | None = None, x: str = "batch_size", y: str = "images_per_s",
                     memory: str = "peak_memory_bytes", step_time: str = "median_ms",
                     title: str = "Throughput, step time and memory vs batch size", ideal: bool = False) -> "plt.Figure":
    """Left: ``y`` against batch size (log2 axis) with the memory on a second axis, in MiB (the unit of the
    series' tables; from ``memory``, else a ``peak_memory_gib`` column). Right: time per step against batch
    size (log-log) and, with ``ideal``, two references from the smallest batch: its step time held constant
    (dotted grey: ideal scaling, throughput growing with the batch) and its step time growing in proportion to
    the batch (dash-dot grey: throughput staying where it was). A measured point between the two gained
    throughput; one on or above the proportional line did not. Both references span the measured batches, so
    they stay inside the axes (a linear-scaling line on the throughput axis left it after the first bend)."""
    set_style()
    panels = 2 if step_time in df else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4), squeeze=False)
    ax = axes[0][0]
    df = df.sort_values(x)
    ax.plot(df[x], df[y], marker="o", color="C0", label="images / s")
    ax.set_ylim(0, 1.15 * df[y].max())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("images / s", color="C0")
    if memory not in df and "peak_memory_gib" in df:
        memory = "peak_memory_gib"
    has_memory = memory in df and df[memory].notna().any()
    if has_memory:
        ax2 = ax.twinx()
        kind = df["memory_kind"].dropna().iloc[0] if "memory_kind" in df and df["memory_kind"].notna().any() else ""
        mem_name = "saved for backward" if "saved for backward" in kind else "peak memory"
        mib = _mib(df, memory)
        ax2.plot(df[x], mib, marker="s", ls="--", color="C1", label=mem_name)
        ax2.set_ylabel(textwrap.fill(f"memory (MiB): {kind}", 30) if kind else "peak memory (MiB)", color="C1")
        top = float(mib.max())
        if top > 0:  # from 0, as the throughput axis: on an axis starting near the smallest value, it read as ~0 MiB
            ax2.set_ylim(0, 1.15 * top)
        ax2.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(nbins=8, steps=[1, 2, 2.5, 5, 10]))  # 5-9 labels
        ax2.yaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))  # 40,000 MiB, as the tables
        ax2.grid(False)
    handles = [h for a in [ax] + fig.axes[panels:] for h in a.get_lines() if not h.get_label().startswith("_")]
    if len(handles) > 1:  # below the axes, where it covers no point
        legend_below(ax, handles=handles, labels=[h.get_label() for h in handles], fontsize=8, ncol=min(len(handles), 2))
    ax.set_title("throughput (solid)" + (f" and {mem_name} (dashed)" if has_memory else ""), fontsize=9)
    if panels == 2:
        axt = axes[0][1]
        axt.plot(df[x], df[step_time], marker="o", color="C2", label="measured (median)")
        if ideal and len(df) > 1:
            x0, t0 = df[x].iloc[0], df[step_time].iloc[0]
            axt.plot(df[x], [t0] * len(df), ls=":", color="C7",
                     label=f"ideal: batch {x0:g}'s time per step (throughput grows with the batch)")
            axt.plot(df[x], t0 * df[x] / x0, ls="-.", color="C7",
                     label=f"time in proportion to the batch from batch {x0:g} (no throughput gain)")
        axt.set_xscale("log", base=2)
        axt.set_yscale("log")
        axt.set_xlabel("batch size")
        axt.set_ylabel("ms per step (log scale)")  # the references' slopes read as such only on a log axis
        axt.set_title("time per step", fontsize=9)
        lo, hi = axt.get_ylim()
        axt.set_ylim(lo / 1.15, hi)  # the ideal line (the smallest batch's time) sat on the bottom frame
        log_ticks(axt, extend_down=True)  # a labelled gridline at or below the lowest point (03's 128 ms had none)
        if ideal and len(df) > 1:
            legend_below(axt, fontsize=8, ncol=1)
    return _suptitle(fig, title, label)


def wait_compute_bars(df, *, label: str | None = None, x: str = "variant", wait: str = "data_wait_ms",
                      compute: str = "compute_ms", title: str = "Data wait vs compute per step",
                      compute_label: str = "compute") -> "plt.Figure":
    """Two panels: stacked bars of the time per step spent waiting for data and computing, and the data wait
    alone on its own scale (next to a long step the wait is a sliver), with p10-p90 whiskers where ``df`` has
    ``<wait>`` with ``_ms`` replaced by ``_p10_ms`` / ``_p90_ms`` (``bench.loader_timing``'s columns)."""
    set_style()
    fig, (ax, axw) = plt.subplots(1, 2, figsize=(11, 0.5 * len(df) + 1.9), sharey=True,
                                  gridspec_kw={"width_ratios": [3, 2]})
    names = df[x].astype(str)
    ax.barh(names, df[compute], label=compute_label, color="C0")
    ax.barh(names, df[wait], left=df[compute], label="waiting for data", color="C3")
    ax.invert_yaxis()
    ax.set_xlabel("ms per step")
    ax.set_title("the whole step", fontsize=9)
    lo, hi = wait.replace("_ms", "_p10_ms"), wait.replace("_ms", "_p90_ms")
    spread = lo in df and hi in df
    err = [(df[wait] - df[lo]).clip(lower=0), (df[hi] - df[wait]).clip(lower=0)] if spread else None
    axw.barh(names, df[wait], xerr=err, capsize=3, color="C3", error_kw={"elinewidth": 1})
    ends = df[hi] if spread else df[wait]
    for i, (v, end) in enumerate(zip(df[wait], ends)):
        axw.annotate(f"{v:.1f}", (end, i), xytext=(6, 0), textcoords="offset points", va="center", fontsize=8)
    axw.set_xlim(0, 1.2 * float(ends.max()) if len(df) and float(ends.max()) > 0 else 1)
    axw.set_xlabel("ms per step")
    axw.set_title("waiting for data alone" + (": mean, p10-p90 whiskers" if spread else ""), fontsize=9)
    _suptitle(fig, title, label)
    legend_below(ax, fontsize=8, ncol=2)  # inside, it covered the end of the last bar: where its data wait is drawn
    return fig


def temporal_breakdown(temporal, *, label: str | None = None, title: str = "GPU time: compute, non-compute, idle") -> "plt.Figure":
    """HTA's temporal breakdown (one stacked bar per rank, in % of the profiled time)."""
    set_style()
    parts = [("compute_time_pctg", "compute", "C2"), ("non_compute_time_pctg", "non-compute (memcpy, memset, comms)", "C1"),
             ("idle_time_pctg", "idle", "C7")]
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(temporal) + 1.6))
    ranks = [f"rank {r}" for r in temporal["rank"]]
    left = [0.0] * len(temporal)
    for col, name, color in parts:
        vals = temporal[col].astype(float).tolist()
        bars = ax.barh(ranks, vals, left=left, label=name, color=color)
        for b, v, l0 in zip(bars, vals, left):
            if v >= 4:
                ax.text(l0 + v / 2, b.get_y() + b.get_height() / 2, f"{v:.0f}%", ha="center", va="center", fontsize=8)
        left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of profiled time")
    # Beside the bars, not under them: below the axes it covered the x label on short figures.
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    _title(ax, title, label)
    return fig


def kernel_breakdown(kernels, *, label: str | None = None, title: str = "GPU kernel time by type",
                     xlabel: str = "% of kernel time") -> "plt.Figure":
    """HTA's kernel-type breakdown (kernel_type, sum, percentage) as bars."""
    set_style()
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(kernels) + 1.6))
    bars = ax.barh(kernels["kernel_type"].astype(str), kernels["percentage"].astype(float))
    ax.invert_yaxis()
    _label_bars(ax, bars, "{:.1f}%")
    ax.set_xlim(0, 110)
    ax.set_xlabel(xlabel)
    _title(ax, title, label)
    return fig


def top_ops(table, *, label: str | None = None, n: int = 10, value: str | None = None,
            title: str | None = None) -> "plt.Figure":
    """The ``n`` most time-consuming operators of an op table (``profiling.op_table`` or
    ``traces.TraceReport.cpu_ops``), by self device time when present, else self CPU time."""
    set_style()
    if value is None:
        value = "self_device_us" if "self_device_us" in table and table["self_device_us"].sum() > 0 else (
            "self_cpu_us" if "self_cpu_us" in table else "self_us")
    if "rank" in table and table["rank"].nunique() > 1:  # one rank: bars of several would overlap by name
        rank = int(table["rank"].min())
        table = table[table["rank"] == rank]
        title = f"{title or 'Top operators'} (rank {rank})"
    from .profiling import ANNOTATION

    table = table[~table["name"].astype(str).str.match(ANNOTATION.pattern)]  # step markers and phases are spans, not operators
    top = table.sort_values(value, ascending=False).head(n)
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(top) + 1.6))
    bars = ax.barh(top["name"].astype(str).str.slice(0, 60), top[value] / 1e3)
    ax.invert_yaxis()
    _label_bars(ax, bars, "{:,.1f} ms")
    ax.set_xlabel(f"{value.replace('_us', '').replace('_', ' ')} time (ms, all profiled steps)")
    _title(ax, title or f"Top {len(top)} operators by {value.replace('_us', '').replace('_', ' ')} time", label)
    return fig


def scaling_efficiency(df, *, label: str | None = None, x: str = "world_size", y: str = "images_per_s",
                       title: str = "Scaling with the number of processes") -> "plt.Figure":
    """Throughput against the number of processes, with ideal linear scaling and efficiency labels.

    Where ``df`` has ``p10_ms``, ``p90_ms`` and ``global_batch``, each point gets the images/s range of its steps'
    p10-p90 as a vertical bar. An ``efficiency label`` column (text, e.g. "76-88%") replaces the label drawn from
    ``efficiency``."""
    set_style()
    df = df.sort_values(x)
    base = df[y].iloc[0] / df[x].iloc[0]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(df[x], df[x] * base, ls="--", color="C7", label="ideal (linear)")
    spread = {"p10_ms", "p90_ms", "global_batch"} <= set(df.columns)
    ax.plot(df[x], df[y], marker="o", color="C0", label="measured" + (": median step, bar: p10-p90 of the steps" if spread else ""))
    if spread:  # a slower step is fewer images/s: the p90 step time is the bar's bottom
        lo, hi = df["global_batch"] / (df["p90_ms"] / 1e3), df["global_batch"] / (df["p10_ms"] / 1e3)
        ax.errorbar(df[x], df[y], yerr=[df[y] - lo, hi - df[y]], fmt="none", ecolor="C0", capsize=4, lw=1)
    # Efficiency labels: from the "efficiency" column when there is one (None there means the
    # comparison flagged the number as noise or a measurement problem: it is not drawn as a result).
    effs = df["efficiency"] if "efficiency" in df else (df[y] / (df[x] * base))
    words = df["efficiency label"] if "efficiency label" in df else [None] * len(df)
    tops = (df["global_batch"] / (df["p10_ms"] / 1e3)) if spread else df[y]
    for n, v, e, w in zip(df[x], tops, effs, words):
        text = w if w else "n/a" if e is None or e != e else f"{100 * e:.0f}%"
        # above the bar's top and the ideal line's point, on an opaque box: the ideal line ran through "92% (79-97%)"
        ax.annotate(text, (n, max(float(v), float(n * base))), xytext=(0, 6), textcoords="offset points", ha="center",
                    fontsize=8, zorder=5, bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none"))
    ax.set_xticks(df[x].tolist())
    # from zero: a shortfall of 12% should look like 12%; room above the highest bar and ideal point for the labels
    ax.set_ylim(0, 1.15 * max(float(tops.max()), float((df[x] * base).max())))
    # training processes, not DataLoader workers (07's "workers"); a one-process row launched without DDP says so
    single_plain = "backend" in df and str(df["backend"].iloc[0]) == "none" and df[x].iloc[0] == 1
    ax.set_xlabel("training processes (one per GPU, or CPU processes)"
                  + ("; 1 process runs without DDP, so the gap to the ideal line\n(the efficiency) counts DDP's own overhead too"
                     if single_plain else ""), fontsize=9)
    ax.set_ylabel("images / s")
    ax.legend(fontsize=8, loc="lower right")
    _title(ax, title, label)
    fig.tight_layout()
    return fig


def image_strip(columns: list[tuple[str, torch.Tensor]], *, title: str, label: str | None = None) -> "plt.Figure":
    """Images in [-1, 1] laid out with one column per (heading, batch): e.g. the forward noising
    of a few images at increasing t, or snapshots of the reverse process."""
    rows = columns[0][1].shape[0]
    fig, axes = plt.subplots(rows, len(columns), figsize=(1.2 * len(columns), 1.2 * rows + 0.8), squeeze=False)
    for j, (heading, batch) in enumerate(columns):
        batch = ((batch.detach().float().cpu().clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).numpy()
        for i in range(rows):
            ax = axes[i][j]
            ax.imshow(batch[i], interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(heading, fontsize=8)
    return _suptitle(fig, _wrap(title, 1.2 * len(columns)), label, fontsize=9)


def noise_schedule_figure(diffusion, *, label: str | None = None) -> "plt.Figure":
    """beta_t, alpha_bar_t and the signal-to-noise ratio alpha_bar / (1 - alpha_bar) against t."""
    set_style()
    t = range(diffusion.timesteps)
    a_bar = diffusion.alphas_cumprod.cpu()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    axes[0].plot(t, diffusion.betas.cpu())
    axes[0].set_title(r"$\beta_t$ (linear)")
    axes[1].plot(t, a_bar, label=r"$\bar\alpha_t$ (signal variance)")
    axes[1].plot(t, 1 - a_bar, label=r"$1-\bar\alpha_t$ (noise variance)")
    axes[1].legend(fontsize=8)
    axes[1].set_title(r"$\bar\alpha_t=(1-\beta_1)\cdots(1-\beta_t)$")  # a \prod's subscript touched the frame
    axes[2].semilogy(t, a_bar / (1 - a_bar))
    axes[2].set_title(r"SNR $=\bar\alpha_t/(1-\bar\alpha_t)$")
    for ax in axes:
        ax.set_xlabel("t")
    return _suptitle(fig, f"DDPM noise schedule (T = {diffusion.timesteps})", label, fontsize=9)


# the palette's orange, vermillion and brown (C1, C3, C5) look alike as thin lines: the distinct hues come first
_CURVE_HUES = [f"C{k}" for k in (0, 1, 2, 4, 7, 9, 3, 5, 6, 8)]
_CURVE_STYLES = ["-", "--", "-.", ":"]


def run_styles(names, fixed: dict[str, tuple[str, str]] | None = None) -> dict[str, tuple[str, str]]:
    """(colour, line style) for each run in ``names``, as ``loss_curves`` draws them: ``fixed`` keeps a run's pair
    from another figure (notebook 10 draws one run alike in two figures); the others take, in order, the pairs whose
    colour no fixed run uses (``fixed`` may name runs that are not in ``names``: their colours count as taken too).
    Without ``fixed``, the i-th run gets the i-th pair."""
    fixed = {n: tuple(v) for n, v in (fixed or {}).items()}
    taken = {c for c, _ in fixed.values()}
    free = [(_CURVE_HUES[i % len(_CURVE_HUES)], _CURVE_STYLES[i % len(_CURVE_STYLES)]) for i in range(2 * len(_CURVE_HUES))]
    free = iter([p for p in free if p[0] not in taken] or free)
    return {n: fixed[n] if n in fixed else next(free) for n in names}


def loss_curves(curves: dict[str, list[tuple[int, float]]], *, label: str | None = None, smooth: int = 20,
                title: str = "Training loss", styles: dict[str, tuple[str, str]] | None = None) -> "plt.Figure":
    """Loss against step for one or more runs (raw, faint) with a centered moving average on top (a trailing one
    lags the raw curve by half its window: on the H100's 01 run the smoothed drop sat ~70 steps right of the data).

    A second legend under the axes (a figure legend, so the axes' own legend keeps one entry per run) says which line
    is which: "raw" and "centered moving average of N steps", N the window each curve was smoothed with (``smooth``,
    at most a third of the curve's steps); where that is one step, the line is the raw values and the key says so.

    ``styles``: run name -> (colour, line style), to draw a run as another figure drew it (``run_styles``)."""
    import pandas as pd
    from matplotlib.lines import Line2D

    set_style()
    fig, ax = plt.subplots(figsize=(7, 4))
    pairs = run_styles(list(curves), styles)
    drawn: dict[str, "pd.Series"] = {}
    windows: set[int] = set()
    for i, (name, points) in enumerate(curves.items()):
        s = pd.Series([v for _, v in points], index=[k for k, _ in points])
        # a curve that lies on an earlier one (within 0.1% at every step) hides it: the legend says so
        under = next((n for n, d in drawn.items() if d.index.equals(s.index)
                      and ((s - d).abs() <= 1e-3 * d.abs()).all()), None)
        drawn[name] = s
        window = max(1, min(smooth, len(s) // 3 or 1))
        windows.add(window)
        color, ls = pairs[name]
        ax.plot(s.index, s.values, color=color, alpha=0.25, lw=0.8)
        ax.plot(s.index, s.rolling(window, min_periods=1, center=True).mean(), color=color,
                ls=ls,  # distinct styles: overlapping curves stay visible
                label=name if under is None else f"{name}, on top of {under.split(' (')[0]}")
    ax.set_xlabel("optimizer step")
    # the mean over pixels (the loss starts at E[eps^2] = 1), not the squared norm, which would start at 3072
    ax.set_ylabel(r"loss: mean of $(\epsilon-\epsilon_\theta)^2$ (log scale)")
    ax.set_yscale("log")
    _title(ax, title, label)
    if len(curves) > 3:  # inside, a legend of many runs sits on some curve wherever it goes: below the axes
        legend_below(ax, fontsize=8, ncol=2)
    else:
        ax.legend(fontsize=8)
    # every gridline of the log axis labelled, down to the lowest curve (06's once ended at 0.61 under a lowest label of 0.7)
    log_ticks(ax, extend_down=True)
    # the key to the two kinds of line, in grey (the colours are the runs'), under everything the axes drew (tick
    # labels, the x label, a legend of many runs), right-aligned; kept in points, as legend_below does
    lo, hi = min(windows), max(windows)
    span = f"{lo}" if lo == hi else f"{lo}-{hi}"
    key = ([(Line2D([], [], color="0.35", alpha=0.35, lw=0.8), "raw (each step)"),
            (Line2D([], [], color="0.35", lw=1.5), f"centered moving average of {span} steps")] if hi > 1 else
           [(Line2D([], [], color="0.35", lw=1.5), "raw (each step; too few steps to smooth)")])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    below = [t.get_window_extent(renderer).y0 for t in (ax.xaxis.label, *ax.get_xticklabels())
             if t.get_visible() and t.get_text().strip()]
    legend = ax.get_legend()
    if legend is not None and legend.get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y0 + 1:
        below.append(legend.get_window_extent(renderer).y0)  # a legend of many runs, under the axes
    drop = (ax.get_window_extent(renderer).y0 - min(below, default=ax.get_window_extent(renderer).y0)) / fig.dpi + 4 / 72
    anchor = ax.transAxes + matplotlib.transforms.ScaledTranslation(0, -drop, fig.dpi_scale_trans)
    fig.legend([h for h, _ in key], [t for _, t in key], loc="upper right", bbox_to_anchor=(1, 0), bbox_transform=anchor,
               frameon=False, fontsize=8, ncol=len(key), title="each run is drawn as:", title_fontsize=8,
               alignment="right")
    return fig


def compile_breakeven(rows, *, label: str | None = None, steps: int | None = None,
                      title: str = "torch.compile: steady-state speed and when it pays off",
                      comparison: Any = None, breakeven_words: dict[str, str] | None = None,
                      breakeven_ranges: dict[str, tuple[float, float]] | None = None) -> "plt.Figure":
    """Left: steady-state ms/step per variant with speedup over the first (eager), and each step's p10-p90 range
    where ``rows`` has p10_ms and p90_ms. Right: total time against the number of steps, first call (compilation)
    included, with break-even points.

    ``rows``: a DataFrame with name, first_ms and median_ms (``Measurement.row()`` rows). The line is drawn from the
    medians, and a dotted line marks the medians' break-even; ``breakeven_words`` (variant name -> e.g. "3,300 to
    5,000") labels a variant's break-even with what its timings allow instead of the medians' one point, and
    ``breakeven_ranges`` (variant name -> (fewest, most) steps) shades that range and stretches the axis over it."""
    import numpy as np

    set_style()
    rows = rows.reset_index(drop=True)
    base = rows.iloc[0]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    spread = {"p10_ms", "p90_ms"} <= set(rows.columns)
    bars = ax.barh(rows["name"], rows["median_ms"], color=[f"C{i}" for i in range(len(rows))],
                   **({"xerr": [rows["median_ms"] - rows["p10_ms"], rows["p90_ms"] - rows["median_ms"]],
                       "error_kw": {"capsize": 4, "lw": 1, "ecolor": "0.2"}} if spread else {}))
    ax.invert_yaxis()
    for b, v, name, hi in zip(bars, rows["median_ms"], rows["name"], rows["p90_ms"] if spread else rows["median_ms"]):
        # one level of brackets: "143.0 ms (1.05x, a hint)", not "(1.05x (hint))"
        ratio = _ratio_text(base["median_ms"] / v, name, base["name"], comparison).replace(" (hint)", ", a hint")
        ax.annotate(f"{v:.1f} ms ({ratio})", (hi, b.get_y() + b.get_height() / 2),
                    xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_xlim(0, (rows["p90_ms"] if spread else rows["median_ms"]).max() * 1.45)
    ax.set_xlabel("ms per step (steady state)" + ("; bars: median, whiskers: p10-p90 of the timed steps" if spread else ""))
    def faster(r) -> bool:
        """A step measurably faster than the first row's: a lower median, and with ``comparison`` a stated
        speedup above 1 (a break-even drawn from medians inside the noise would be a point the text denies)."""
        if r["median_ms"] >= base["median_ms"]:
            return False
        return comparison is None or (comparison.speedup(r["name"], base["name"]) or 0) > 1

    evens = {i: (r["first_ms"] - base["first_ms"]) / (base["median_ms"] - r["median_ms"])
             for i, r in rows.iloc[1:].iterrows() if faster(r)}
    ranges = {r["name"]: (breakeven_ranges or {}).get(r["name"]) for i, r in rows.iterrows() if i in evens}
    ranges = {k: v for k, v in ranges.items() if v is not None and np.isfinite(v[1])}
    # the axis covers the range the label states (its upper end included), not only the medians' point
    horizon = steps or int(max([50.0] + [2.0 * e for e in evens.values() if np.isfinite(e)]
                               + [1.1 * hi for _, hi in ranges.values()]))
    n = np.linspace(0, horizon, 200)
    said = []  # the break-even labels: written inside the axes, top left, one line each
    for i, r in rows.iterrows():
        e = evens.get(i)
        # said in the legend: written at the line's end, the note ran across the line itself
        unstated = (e is None or not 0 < e <= horizon) and i and comparison is not None and r["median_ms"] < base["median_ms"]
        ax2.plot(n, (r["first_ms"] + n * r["median_ms"]) / 1e3, color=f"C{i}",
                 label=r["name"] + (": no measurable speedup, no break-even stated" if unstated else ""))
        if e is not None and 0 < e <= horizon:
            ax2.axvline(e, color=f"C{i}", ls=":", lw=1, label=f"{r['name']}: the medians' break-even, about {float(f'{e:.2g}'):,.0f} steps")
            if r["name"] in ranges:  # the range of step counts the two steps' p10-p90 ranges allow
                ax2.axvspan(*ranges[r["name"]], color=f"C{i}", alpha=0.12, lw=0,
                            label=f"{r['name']}: the range the p10-p90 timings allow")
            hinted = comparison is not None and comparison.hint(r["name"], base["name"])  # a ratio stated as a hint
            words = (breakeven_words or {}).get(r["name"], f"{e:,.0f}")
            said.append((f"{r['name']} pays off after {words} steps" + (",\nif its speedup holds: a hint from few timed calls" if hinted else ""),
                         f"C{i}"))
    for k, (text, color) in enumerate(said):
        ax2.text(0.02, 0.97 - 0.14 * k, text, transform=ax2.transAxes, ha="left", va="top", fontsize=8, color=color)
    ax2.set_xlabel("training steps")
    ax2.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(nbins=5, integer=True))  # 5-digit counts ran together
    ax2.xaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
    ax2.set_ylabel("total time (s), compilation included")
    ax2.legend(fontsize=7, loc="best")
    return _checked(_suptitle(fig, title, label), comparison is not None)


def sdpa_figure(model_rows, micro, *, label: str | None = None,
                title: str = "Math attention vs scaled_dot_product_attention",
                comparison: Any = None, versus: dict[str, str] | None = None, alone_busy: bool = False) -> "plt.Figure":
    """Left: whole-model step time per variant. Middle and right: attention alone (forward +
    backward) against sequence length: time and peak memory, for each implementation.

    ``model_rows``: name, median_ms. ``micro``: impl, seq_len, median_ms, peak_memory_mib (and p10_ms, p90_ms: drawn
    as each time's range, where present).
    With ``comparison`` (a ``bench.Comparison`` of the rows) and ``versus`` (row name -> the row it
    is compared with), each such bar also says its speedup, or "within noise" where none is stated.
    The middle panel's title says, at each length, how SDPA's time compares with math's, by the rule the notebook's
    text uses: a ratio where the two p10-p90 ranges lie apart, "within noise" where they overlap, and nothing compared
    where ``alone_busy`` (other work ran while attention alone was timed)."""
    set_style()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    rows = model_rows.reset_index(drop=True)
    bars = ax.barh(rows["name"], rows["median_ms"], color=[f"C{i}" for i in range(len(rows))])
    ax.invert_yaxis()
    for b, v, name in zip(bars, rows["median_ms"], rows["name"]):
        base = (versus or {}).get(name)
        vs = "" if comparison is None or base is None else (
            f" ({_ratio_text(float(rows.loc[rows['name'] == base, 'median_ms'].iloc[0]) / v, name, base, comparison)})")
        ax.annotate(f"{v:.1f} ms{vs}", (b.get_width(), b.get_y() + b.get_height() / 2), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize=8)
    ax.set_xlim(0, rows["median_ms"].max() * (1.3 if not versus else 1.6))
    ax.set_xlabel("ms per training step (whole model, not attention alone)" + ("\nin parentheses: against " + ", ".join(sorted(set(versus.values())))
                                                         if comparison is not None and versus else ""))
    ax.set_title("whole training step", fontsize=9)
    spread = {"p10_ms", "p90_ms"} <= set(micro.columns)
    for i, (impl, g) in enumerate(micro.groupby("impl", sort=False)):
        axes[1].loglog(g["seq_len"], g["median_ms"], marker="o", color=f"C{i}", label=impl)
        if spread:  # the p10-p90 range of each point: two medians whose ranges overlap are not told apart
            axes[1].errorbar(g["seq_len"], g["median_ms"], yerr=[g["median_ms"] - g["p10_ms"], g["p90_ms"] - g["median_ms"]],
                             fmt="none", ecolor=f"C{i}", capsize=4, lw=1)
        axes[2].loglog(g["seq_len"], g["peak_memory_mib"], marker="o", color=f"C{i}", label=impl)
    kind = micro["memory_kind"].dropna().iloc[0] if "memory_kind" in micro and micro["memory_kind"].notna().any() else ""
    for a, what in ((axes[1], "ms, forward + backward"), (axes[2], textwrap.fill(f"memory (MiB): {kind}", 30) if kind else "peak memory (MiB)")):
        a.set_xlabel("sequence length N (tokens = H x W)")
        lengths = sorted(micro["seq_len"].unique())  # ticks at the measured lengths (256, 1024), not at 300 and 1000
        # a FixedFormatter, which plain_log_ticks keeps (set_xticks' labels are a FuncFormatter, which it replaced: in
        # full mode, 256-16384 tokens, only 1024 kept its label)
        a.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(lengths))
        a.xaxis.set_major_formatter(matplotlib.ticker.FixedFormatter([f"{n:g}" for n in lengths]))
        a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        a.set_ylabel(what)
        a.legend(fontsize=8)
    said: dict[str, list[str]] = {}  # at each length, SDPA against math as the notebook's text says it -> the lengths
    for n in sorted(micro["seq_len"].unique()) if {"math", "sdpa"} <= set(micro["impl"]) else []:
        at = micro[micro["seq_len"] == n].set_index("impl")
        if not {"math", "sdpa"} <= set(at.index):
            continue
        m, s = at.loc["math"], at.loc["sdpa"]
        if alone_busy:
            verdict = "not compared (other work ran)"
        elif spread and not ranges_apart(s, m):
            verdict = "within noise"
        elif spread:
            verdict = (f"SDPA {'faster' if s['median_ms'] < m['median_ms'] else 'slower'}, "
                       f"{m['median_ms'] / s['median_ms']:.2f}x math's speed")
        else:
            continue
        said.setdefault(verdict, []).append(f"{n:g}")
    line = "; ".join(f"{v} at N = {', '.join(ns)}" for v, ns in said.items())
    axes[1].set_title("attention alone: time" + (" (bars: p10-p90 of the repeats)" if spread else "")
                      + ("\n" + textwrap.fill("SDPA vs math: " + line, 70) if said else ""), fontsize=9)
    axes[2].set_title("attention alone: memory (math keeps the N x N scores; SDPA does not)", fontsize=9)
    return _checked(_suptitle(fig, title, label), comparison is not None)


def throughput_memory_bars(rows, *, label: str | None = None, x: str = "name", title: str = "Throughput and memory",
                           comparison: Any = None) -> "plt.Figure":
    """Two panels per variant: images/s with the speedup over the first row, and peak memory."""
    set_style()
    rows = rows.reset_index(drop=True)
    base = rows["images_per_s"].iloc[0]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 0.5 * len(rows) + 2))
    colors = [f"C{i}" for i in range(len(rows))]
    bars = ax.barh(rows[x], rows["images_per_s"], color=colors)
    for b, v, name in zip(bars, rows["images_per_s"], rows[x]):
        ax.annotate(f"{v:,.0f} ({_ratio_text(v / base, name, rows[x].iloc[0], comparison)})",
                    (b.get_width(), b.get_y() + b.get_height() / 2), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize=8)
    ax.set_xlim(0, rows["images_per_s"].max() * 1.35)
    ax.set_xlabel("images / s")
    mib = rows["peak_memory_bytes"] / 2**20
    bars = ax2.barh(rows[x], mib, color=colors)
    for b, v in zip(bars, mib):
        ax2.annotate(f"{v:,.0f} MiB", (b.get_width(), b.get_y() + b.get_height() / 2), xytext=(3, 0),
                     textcoords="offset points", va="center", fontsize=8)
    ax2.set_xlim(0, max(mib.max(), 1) * 1.35)
    kind = rows["memory_kind"].iloc[0] if "memory_kind" in rows else ""
    ax2.set_xlabel("saved for backward (MiB)" if "saved for backward" in kind else
                   f"peak memory (MiB; {kind})" if kind else "peak memory (MiB)")
    if "saved for backward" in kind:
        # not only activations: under autocast the low-precision copies of the weights are saved too (06's text says so)
        ax2.set_title("CPU: tensors saved for the backward pass\n(activations, and under autocast the bf16 copies of the "
                      "weights:\nthe part of a step's memory that batch, precision and attention change)", fontsize=8)
    for a in (ax, ax2):
        a.invert_yaxis()
    return _checked(_suptitle(fig, title, label), comparison is not None)


def short_name(name: str, width: int = 48) -> str:
    """An operator or kernel name cut in the middle to ``width`` characters: both ends stay, so
    ``..._flash_attention_for_cpu`` and ``..._flash_attention_for_cpu_backward`` stay apart
    (pandas and a plain cut keep the start only, and they read alike)."""
    name = str(name)
    if len(name) <= width:
        return name
    head = (width - 3) // 2 + (width - 3) % 2
    return name[:head] + "..." + name[-(width - 3 - head):]


# Tokens of cuDNN / cuBLAS / CUTLASS kernel names that say how a kernel is tiled, not what it computes
_KERNEL_NOISE = re.compile(r"_(?:tilesize|warpgroupsize|warpsize|stage|align[a-z]?|cga|knob_)[0-9x]*\d(?=_|>|$)"
                           r"|_g1(?=_)|_execute(?:_segment_k_o(?:n|ff)|_split_k)?(?=_)|_kernel(?=__\dx_)")


def _params_cut(name: str) -> str:
    """``name`` without ``void `` and its trailing parameter list: "void f<float>(float*, int)" -> "f<float>"."""
    name = name.removeprefix("void ")
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i] if i else name
    return name


def name_dtype(name: str) -> str | None:
    """The data type a GPU kernel's name says it computes in ("bf16", "fp16", "tf32", "fp32"), or None: cuDNN and
    cuBLAS put it in the name ("..._bf16bf16_bf16f32_...", "..._ffma_...", "sgemm"), and so do templates ("<float")."""
    n = str(name).lower()
    if "bf16" in n or "bfloat16" in n:
        return "bf16"
    if re.search(r"(?<![a-z0-9])(?:f16|fp16|half|__half|h884|h1688|h16816)|_f16", n):
        return "fp16"
    if "tf32" in n:
        return "tf32"
    if re.search(r"f32|ffma|sgemm|<float\b", n):
        return "fp32"
    return None


# ATen's CUDA kernels are templates: a launcher (elementwise_kernel, reduce_kernel, multi_tensor_apply_kernel) whose
# template arguments name the operation (silu_kernel, MulFunctor, sum_functor, FusedAdamMathFunctor), among wrappers
_ATEN_WRAPPERS = {"gpu_kernel_impl_nocast", "gpu_kernel_impl", "ReduceOp", "func_wrapper_t", "BinaryFunctor",
                  "AUnaryFunctor", "BUnaryFunctor", "UnaryOpFunctor", "BinaryOpScalarFunctor", "BinaryOpScalarTensorFunctor",
                  "BinaryOpScalarListFunctor", "BinaryOpListAlphaFunctor", "TernaryOpScalarFunctor", "PointwiseOpScalarFunctor",
                  "PointwiseOpScalarListFunctor", "OpaqueType", "TensorIteratorBase", "TensorIterator", "Tensor", "Scalar",
                  "CUDAGeneratorImpl", "PhiloxCudaState", "TrivialOffsetCalculator", "LoadWithoutCast", "StoreWithoutCast",
                  "LoadWithCast", "StoreWithCast", "operator", "const", "lambda", "unsigned", "float", "double", "int",
                  "long", "bool", "char", "array", "native", "at", "std", "c10", "anonymous", "namespace", "detail",
                  "templates", "cuda", "memory", "BFloat16", "Half", "binary_internal", "true", "false"}
_ATEN_WHAT = re.compile(r"kernel|Kernel|Functor|functor|Ops$|Internal|_impl$")


def _aten_label(name: str) -> str | None:
    """"vectorized_elementwise_kernel<silu_kernel>" for ATen's templated CUDA kernels, or None for other names."""
    if not name.startswith("at::native::") or "<" not in name:
        return None
    outer, args = name.split("<", 1)
    outer = outer.split("::")[-1]
    found = [w for w in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", args)
             if w not in _ATEN_WRAPPERS and not w.endswith("Metadata") and len(w) > 2]
    what = next((w for w in found if _ATEN_WHAT.search(w)), None)
    if what is None and re.search(r"elementwise|multi_tensor_apply|reduce_kernel", outer) and found:
        what = found[0]  # std::multiplies, Copy, Sqrt: the operation of a generic launcher
    return f"{outer}<{what}>" if what else outer


def kernel_label(name: str, width: int = 48) -> str:
    """A kernel or operator name shortened to ``width`` characters for a figure's labels, keeping what a reader
    compares: the tiling tokens of cuDNN's and cuBLAS' names and C++ parameter lists go first, then the middle is cut
    (``short_name``); ATen's templated kernels are named by their launcher and the operation in its template
    ("vectorized_elementwise_kernel<silu_kernel>"). Where the label lost the data type the name states, it is added as
    " [bf16]" (notebook 09 asks the reader to find fp32 convolution kernels replaced by bf16 ones, and a plain cut took
    exactly that part)."""
    name = str(name)
    if len(name) <= width:
        return name
    short = _KERNEL_NOISE.sub("", _params_cut(name))
    short = _aten_label(short) or short
    dtype = name_dtype(name)
    if dtype is None or name_dtype(short_name(short, width)) == dtype:  # no type, or the label says it already
        return short_name(short, width)
    return short_name(short, width - len(dtype) - 3) + f" [{dtype}]"


def kernel_labels(names, width: int = 48) -> list[str]:
    """``kernel_label`` of each name; two different names that shorten alike (kernels that differ only in their tiling)
    are numbered, "... #2", so that no two bars of a figure carry one label."""
    labels, seen = [], {}
    for n in names:
        label = kernel_label(n, width)
        seen[label] = seen.get(label, 0) + 1
        labels.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return labels


# ATen operators that only call the one beneath them (torch 2.14.1's CPU traces: aten::conv2d -> aten::convolution ->
# aten::_convolution -> aten::mkldnn_convolution). Compiled code calls the operator beneath directly, so the wrapper
# vanishes from a trace while the work it wrapped still runs.
WRAPPED_BY = {"aten::conv1d": ("aten::convolution",), "aten::conv2d": ("aten::convolution",),
              "aten::conv3d": ("aten::convolution",), "aten::linear": ("aten::addmm", "aten::matmul"),
              "aten::group_norm": ("aten::native_group_norm",), "aten::layer_norm": ("aten::native_layer_norm",),
              "aten::dropout": ("aten::native_dropout",)}


def vanished_wrappers(diff, every=None) -> dict[str, tuple[str, float, float, float]]:
    """The rows of ``diff`` (``traces.diff``) that are a vanished wrapper: an operator of ``WRAPPED_BY`` whose calls went
    to 0 while the operator beneath it ran as often as before, at least as often as the wrapper had. Its bar is not work
    saved: the work moved into the operator beneath. ``every``: the whole diff (``traces.diff(..., top=<all>)``), where
    the operator beneath may not be among ``diff``'s rows. Returns {wrapper: (operator beneath, its calls before, its calls
    after, its time change in us)}."""
    rows = (every if every is not None else diff).set_index("name")
    found = {}
    for _, row in diff.iterrows():
        name, before, after = str(row["name"]), float(row["calls before"]), float(row["calls after"])
        if after or not before:
            continue
        for child in WRAPPED_BY.get(name, ()):
            if child in rows.index:
                c = rows.loc[child]
                c = c.iloc[0] if getattr(c, "ndim", 1) > 1 else c
                if c["calls before"] == c["calls after"] >= before:
                    found[name] = (child, float(c["calls before"]), float(c["calls after"]), float(c["time change (us)"]))
                    break
    return found


def trace_diff_bars(diff, *, label: str | None = None, title: str = "What changed in the trace",
                    inclusive: bool = True, by_kind=None, wrappers: dict | None = None) -> "plt.Figure":
    """The rows of ``traces.diff``: time change per operator or kernel, green where time was saved,
    red where it was added, with the call counts before -> after. ``inclusive``: the rows are CPU
    operators, whose times contain the operators they call (a GPU trace's diff compares kernels,
    which do not nest: pass False). ``by_kind`` (``traces.diff_by_kind``): a panel above, one step's time per kind of
    work before and after, with its call counts and how many kernel (operator) names of the kind appeared or vanished.
    ``wrappers`` (``vanished_wrappers``; None: found among ``diff``'s own rows): vanished wrappers, drawn hatched and
    grey with the operator beneath them, since their bars are not work saved."""
    set_style()
    diff = diff.reset_index(drop=True)
    if wrappers is None:
        wrappers = vanished_wrappers(diff) if inclusive else {}
    if by_kind is None:
        fig, ax = plt.subplots(figsize=(9, 0.4 * len(diff) + 1.6))
    else:
        import numpy as np

        compared = by_kind.attrs.get("compared")
        by_kind = by_kind.reset_index(drop=True)
        fig, (top, ax) = plt.subplots(2, 1, figsize=(9, 0.4 * len(diff) + 0.5 * len(by_kind) + 3.4),
                                      gridspec_kw={"height_ratios": [0.5 * len(by_kind) + 1.2, 0.4 * len(diff) + 1.4]})
        y = np.arange(len(by_kind))
        top.barh(y - 0.2, by_kind["time before (us)"] / 1e3, height=0.4, color="C7", label="before")
        top.barh(y + 0.2, by_kind["time after (us)"] / 1e3, height=0.4, color="C0", label="after")
        top.set_yticks(y, [f"{k}  ({b:,.0f} -> {a:,.0f} calls" + (f"; {n} new" if n else "") + (f", {g} gone" if g else "")
                           + ")" for k, b, a, n, g in zip(by_kind["kind"], by_kind["calls before"], by_kind["calls after"],
                                                           by_kind["appeared"], by_kind["vanished"])], fontsize=8)
        top.invert_yaxis()
        top.set_xlabel(("GPU kernel time" if compared == "kernels" else "CPU operator self time")
                       + " per step by kind (ms)\nnew / gone: names of the kind found in one of the two traces only",
                       fontsize=9)
        # outside the panel, right of it: inside, it covered the end of the longest "after" bar (09's convolution)
        top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
        _title(top, title, label)
    ms = diff["time change (us)"] / 1e3
    wrapped = [str(n) in wrappers for n in diff["name"]]
    ax.barh(range(len(diff)), ms, color=["C7" if w else "C2" if v < 0 else "C3" for v, w in zip(ms, wrapped)],
            hatch=["//" if w else "" for w in wrapped], edgecolor="white")
    names = kernel_labels(diff["name"].astype(str))
    ax.set_yticks(range(len(diff)), [f"{n}  ({b:.0f} -> {a:.0f} calls" + (
        f"; a wrapper: {wrappers[str(full)][0]} ran {wrappers[str(full)][1]:.0f} -> {wrappers[str(full)][2]:.0f})"
        if str(full) in wrappers else ")") for n, full, b, a in
                                     zip(names, diff["name"], diff["calls before"], diff["calls after"])], fontsize=8)
    ax.axvline(0, color="k", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("time change in one step (ms; negative = less time in this row)" + (
        "\ninclusive times: a row contains the rows it calls, so nested rows count the same time twice" if inclusive
        else "\nkernels: each row is GPU time of its own")
        + ("\nhatched grey: a wrapper that vanished while the operator beneath it kept its calls\n(compiled code calls "
           "that operator directly): its bar is the time it wrapped, not work saved" if any(wrapped) else ""), fontsize=9)
    if by_kind is None:
        _title(ax, title, label)
    else:
        ax.set_title(f"the {len(diff)} {'kernels' if not inclusive else 'operators'} whose time changed most", fontsize=9)
    fig.tight_layout()
    return fig


def waterfall(stages, *, label: str | None = None, x: str = "stage", y: str = "images_per_s",
              title: str = "Cumulative speedup, stage by stage",
              comparison: Any = None, why: Callable[[str, str], str | None] | None = None) -> "plt.Figure":
    """Each stage as a floating bar from the previous stage's speedup over the first stage to its own, labeled
    "total 1.25x · step 1.10x": its speedup over the first stage of the same run, and its own factor over the stage
    before. With ``comparison`` (a ``bench.Comparison`` holding every stage, named as in column ``x``) both come from
    its verdicts, and where it states no ratio the label says why, as its table does ("within noise", "noisy", "too
    few repeats"), on a grey bar; without one, every label is the ratio of the medians. ``why(name, base_name)``, where
    it returns a word, labels the pair by that word instead of its ratio or verdict, on a grey bar (09 says "noisy" where
    a stage's own repeats spread too widely, as its table and its sentences do, and "drift" where a stated step factor
    is more than the one part its stage changes could give). A key under the axis says what the bars' colours mean."""
    set_style()
    stages = stages.reset_index(drop=True)

    def word(name: str, base: str) -> str | None:
        return why(name, base) if why is not None and comparison is not None else None

    def ratio(r: float, name: str, base: str) -> str:
        return word(name, base) or _ratio_text(r, name, base, comparison)

    cum = stages[y] / stages[y].iloc[0]
    prev = cum.shift(1).fillna(0)
    names = list(stages[x])
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(stages) + 2.3))
    used = set()  # the colours drawn, for the key
    for i, (name, c, p) in enumerate(zip(names, cum, prev)):
        if i == 0:
            stated, text = True, "1.00x: the baseline"
        else:  # two lines: on one, the labels took half the axis and squeezed the bars
            stated = ((comparison is None or comparison.speedup(name, names[i - 1]) is not None)
                      and word(name, names[i - 1]) is None)
            text = f"total {ratio(c, name, names[0])}\nstep {ratio(c / p, name, names[i - 1])}"
        color = "C7" if i == 0 or not stated else ("C2" if c >= p else "C3")
        # a hint (a ratio from few timed calls, inside their spread) is not "measurably": drawn pale, keyed apart
        hinted = bool(color != "C7" and comparison is not None and comparison.hint(name, names[i - 1]))
        used.add((color, hinted))
        ax.barh(i, c - p, left=p, color=color, alpha=0.4 if hinted else 1.0)
        ax.text(max(c, p), i, text, va="center", fontsize=7.5, linespacing=1.1,
                transform=ax.transData + matplotlib.transforms.ScaledTranslation(4 / 72, 0, fig.dpi_scale_trans))
    ax.set_yticks(range(len(stages)), stages[x])
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlim(0, cum.max() * 1.3)
    ax.set_xlabel("speedup over the baseline (images/s ratio, same run)\n"
                  "each bar runs from the stage before's total to this stage's; "
                  "total: over the baseline, step: over the stage before", fontsize=9)
    _title(ax, title, label)
    fig.tight_layout()
    # the key: what each colour says about the step (the bar's length) against the stage before
    said = "measurably" if comparison is not None else "by the medians"
    key = [("C2", False, f"step {said} faster than the stage before"),
           ("C2", True, "step faster than the stage before, a hint: few timed calls, inside their spread"),
           ("C3", False, f"step {said} slower than the stage before"),
           ("C3", True, "step slower than the stage before, a hint: few timed calls, inside their spread"),
           ("C7", False, "the baseline" + (", or no ratio stated for the step (within noise, noisy, too few repeats"
                                           + (", or as its label says" if why is not None else "") + ")"
                                           if comparison is not None else ""))]
    from matplotlib.patches import Patch

    legend_below(ax, handles=[Patch(color=c, alpha=0.4 if h else 1.0, label=t) for c, h, t in key if (c, h) in used],
                 fontsize=8, ncol=1)
    _labels_in_view(ax, (1.0,))  # the axis ends at the longest label, and no label runs across the baseline's line
    return _checked(fig, comparison is not None)


def _same_decimals(values: list, most: int = 4) -> list[str]:
    """A column's cells as text, its floats all with as many decimals as the longest of them needs (at most
    ``most``): "202.60, 399.10, 398.53", not "202.6, 399.1, 398.53"."""
    floats = [v for v in values if isinstance(v, float) and math.isfinite(v)]
    if not floats:
        return [str(v) for v in values]
    digits = max(min(most, len(f"{v:.{most}f}".rstrip("0").split(".")[1])) for v in floats)
    return [f"{v:,.{digits}f}" if isinstance(v, float) and math.isfinite(v) else str(v) for v in values]


TABLE_FONT, TABLE_ROW_SCALE = 8, 1.3
TABLE_CELL_CHARS = 36  # a longer cell is wrapped onto lines of at most this many characters
# matplotlib's cell height: its table's default font size (Table.FONTSIZE, whatever size the text is set to) in
# inches, times 1.2 (Table._approx_text_height), times the row scale
TABLE_ROW_IN = matplotlib.table.Table.FONTSIZE / 72 * 1.2 * TABLE_ROW_SCALE


def table_figure(df, *, label: str | None = None, title: str = "Summary") -> "plt.Figure":
    """A DataFrame rendered as a figure (for tables that should travel as an image).

    The figure is the table's size: as tall as its rows (a cell is ``TABLE_ROW_IN`` inches at this font size and
    scale), as wide as its columns once drawn. A fixed height per row plus a margin and a width per column, with the
    table centered, left bands of white around 09's table."""
    columns = [_same_decimals(df[c].tolist()) for c in df.columns]
    # a long cell is wrapped onto more lines, never cut: H200's "13.3% of H200 bf16 dense peak 989.4 TFLOP/s" lost its
    # unit to "TFLO..."; its row grows a line for each line its tallest cell has
    cells = [[textwrap.fill(v, TABLE_CELL_CHARS, break_on_hyphens=False) if len(v) > TABLE_CELL_CHARS else v for v in row]
             for row in zip(*columns)]
    lines = [1] + [max(v.count("\n") + 1 for v in row) for row in cells]  # the header's row, then each row's
    rows_in = TABLE_ROW_IN * sum(lines)
    fig = plt.figure(figsize=(min(18, 1.6 + 1.5 * len(df.columns)), rows_in))
    ax = fig.add_axes((0, 0, 1, 1))  # the title sits above it, and savefig's tight box takes it in
    ax.set_axis_off()
    tbl = ax.table(cellText=cells, colLabels=list(df.columns), loc="upper center", cellLoc="center")
    tbl.auto_set_font_size(False)
    tbl.set_fontsize(TABLE_FONT)
    tbl.auto_set_column_width(col=list(range(len(df.columns))))
    tbl.scale(1, TABLE_ROW_SCALE)
    for (r, _c), cell in tbl.get_celld().items():
        cell.set_height(cell.get_height() * lines[r])
        if r == 0:
            cell.set_text_props(weight="bold")
    fig.canvas.draw()  # the columns take their widths from their texts when drawn: the figure is then made that wide
    fig.set_size_inches(tbl.get_window_extent().width / fig.dpi + 0.1, rows_in)
    _title(ax, title, label)
    return fig


# ------------------------------------------------------------------------------ memory (notebook 03b)
def _count_axis(axis) -> None:
    """At most about five ticks, with thousands separators: four five-digit counts side by side ran together into
    '10000125001500017500' under 03b's bars of the paper's model on the H200."""
    axis.set_major_locator(matplotlib.ticker.MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]))
    axis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))


def memory_bars(df, *, value: str, name: str, label: str | None = None, title: str = "", xlabel: str = "MiB",
                fmt: str = "{:,.1f}") -> "plt.Figure":
    """Horizontal bars of ``df[value]`` named by ``df[name]``, largest first (memory by kind, by block)."""
    set_style()
    df = df.sort_values(value, ascending=False)
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(df) + 1.6))
    bars = ax.barh(df[name].astype(str), df[value])
    ax.invert_yaxis()
    _label_bars(ax, bars, fmt)
    ax.set_xlabel(xlabel)
    ax.margins(x=0.15)
    _count_axis(ax.xaxis)
    _title(ax, title, label)
    fig.tight_layout()
    return fig


def memory_budget(rows, *, label: str | None = None, title: str = "") -> "plt.Figure":
    """Stacked bars: the fixed state and the saved activations of each configuration (MiB).

    ``rows``: a DataFrame with ``config``, ``fixed_MiB`` and ``saved_MiB``."""
    set_style()
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(rows) + 1.8))
    y = range(len(rows))
    ax.barh(y, rows["fixed_MiB"], label="fixed state (weights, grads, Adam m and v, EMA)", color="C7")
    bars = ax.barh(y, rows["saved_MiB"], left=rows["fixed_MiB"], label="saved for backward", color="C0")
    for b, total in zip(bars, rows["fixed_MiB"] + rows["saved_MiB"]):
        ax.annotate(f"{total:,.0f} MiB", (total, b.get_y() + b.get_height() / 2), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(list(y), rows["config"].astype(str))
    ax.invert_yaxis()
    ax.set_xlabel("MiB")
    _count_axis(ax.xaxis)
    ax.margins(x=0.2)
    legend_below(ax, ncol=1, fontsize=8)
    _title(ax, title, label)
    fig.tight_layout()
    return fig


def memory_timeline(df, *, label: str | None = None, title: str = "") -> "plt.Figure":
    """Bytes allocated after each allocator event of one step (``memory.cuda_timeline``), with the peak marked."""
    set_style()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    x = df["event"]
    ax.plot(x, df["allocated"] / 2**20, lw=1.2, color="C0")
    i = int(df["allocated"].idxmax())
    ax.annotate(f"peak {df['allocated'].iloc[i] / 2**20:,.0f} MiB", (x.iloc[i], df["allocated"].iloc[i] / 2**20),
                xytext=(10, -15), textcoords="offset points", fontsize=8, arrowprops=dict(arrowstyle="->", lw=0.8))
    ax.set_xlabel("allocator event (allocations and frees, in order)")
    ax.set_ylabel("allocated (MiB)")
    _title(ax, title, label)
    fig.tight_layout()
    return fig


def epoch_time_vs_batch(df, *, label: str | None = None, images: int = 50_000,
                        title: str = "Training time per epoch vs batch size") -> "plt.Figure":
    """Seconds per epoch of ``images`` images against the batch per process, one line per
    (processes, precision): the seed project's figure, from measured images/s.

    ``df``: rows with ``world_size``, ``precision``, ``batch_per_process`` and ``images_per_s``; where it has them,
    ``times_ms`` (each point's timed steps: a vertical bar marks their p10-p90) and ``backend`` ("none": a launch of
    one process without DDP, so marked in the legend)."""
    set_style()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    # one hue per process count, a line style per precision: the palette's orange and vermillion (C1, C3) looked alike
    hues = [f"C{k}" for k in (0, 2, 4, 7, 9, 1)]
    worlds = sorted(df["world_size"].unique())
    for (world, precision), g in df.groupby(["world_size", "precision"], sort=True):
        g = g.sort_values("batch_per_process")
        color = hues[worlds.index(world) % len(hues)]
        ddp = "" if "backend" not in g else " (no DDP)" if str(g["backend"].iloc[0]) == "none" else " (DDP)"
        ax.plot(g["batch_per_process"], images / g["images_per_s"], marker="o" if precision == "fp32" else "s",
                color=color, ls="-" if precision == "fp32" else "--",
                label=f"{plural(world, 'process', 'processes')}{ddp}, {precision}")
        if "times_ms" in g:  # each point's p10-p90 over its timed steps (a vertical bar): the same share of the epoch
            import statistics

            for b, ts in zip(g["batch_per_process"], g["times_ms"]):
                ts = list(ts)
                q = statistics.quantiles(ts, n=10, method="inclusive") if len(ts) > 1 else [ts[0]] * 9
                ax.vlines(b, images * q[0] / 1e3 / (b * world), images * q[-1] / 1e3 / (b * world), color=color, lw=1.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    log_ticks(ax, extend_up=True)  # labelled gridlines, not a crammed column of minor-tick labels; one above the top
    ax.set_xlabel("batch size per process" + ("\neach point one launch: its median step; the vertical bar, the p10-p90 "
                                              "of its steps" if "times_ms" in df else ""), fontsize=10 if "times_ms" in df else None)
    ax.set_ylabel("seconds per epoch (log scale)")  # the epoch's size is in the title: a longer label ran into it
    legend_below(ax, fontsize=8, ncol=2)  # inside, it covered the last point of a line
    _title(ax, title, label)
    fig.tight_layout()
    return fig


def quality_band(result, *, label: str | None = None,
                 title: str = "Quality preserved? The fast run against the baseline's seed-to-seed band") -> "plt.Figure":
    """Left: the baseline seeds' smoothed training losses (faint), the band they span (shaded) and
    the fast run on top (dashed), log y, with the unjudged warm-up greyed. Right: each arm's EMA
    loss on the held-out batches (dots: baseline seeds; diamond: fast) with the seeds' range.

    ``result``: a ``quality.QualityResult``; ``label`` defaults to the device it was measured on."""
    import math

    from .quality import smooth

    set_style()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 5.4), gridspec_kw={"width_ratios": [3, 1]})
    band, arms = result.band, result.arms
    base = [n for n, a in arms.items() if a["kind"] == "baseline"]
    fast = next(n for n, a in arms.items() if a["kind"] == "fast")
    twin = arms[fast].get("twin")
    smoothed = "smoothed" if result.window > 1 else "not smoothed: too few steps"
    others = [n for n in base if n != twin]
    for i, name in enumerate(others):
        s = smooth(result.curves[name], result.window)
        ax.plot(s.index, s.values, color="C0", alpha=0.35, lw=0.8,
                label=f"the other baseline seeds ({smoothed})" if i == 0 else None)
    if twin in base:
        # wide and dark, under the fast run's thin dashed line: where the two coincide (the point of a twin), the twin
        # shows on both sides of the dashes instead of vanishing under them
        s = smooth(result.curves[twin], result.window)
        ax.plot(s.index, s.values, color="C0", lw=4.0, alpha=0.6, solid_capstyle="butt", zorder=2.1,
                label=f"{twin}: the fast run's twin (wide, under the dashes)")
    ax.fill_between(band["step"], band["low"], band["high"], color="C0", alpha=0.25, lw=0,
                    label=f"baseline band ({len(base)} seeds, min-max)")
    ax.plot(band["step"], band["fast"], color="C3", ls="--", lw=1.4, zorder=2.2,
            label=f"{fast}: inside the band at {100 * result.inside:.0f}% of judged steps"
                  + (f",\nwithin the seeds' spread of its twin at {100 * result.within_spread:.0f}%"
                     if not math.isnan(result.within_spread) else ""))
    unjudged = band.loc[~band["judged"], "step"]
    if len(unjudged):
        from .quality import SKIP  # the text's words: "first 10% not judged" (not the learning rate's warm-up)

        ax.axvspan(band["step"].min(), unjudged.max(), color="C7", alpha=0.12, lw=0,
                   label=f"first {100 * SKIP:.0f}% of the steps, not judged")
    ax.set_yscale("log")
    log_ticks(ax)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"loss (rolling mean of {result.window} steps)" if result.window > 1 else "loss (not smoothed)")
    legend_below(ax, fontsize=8, ncol=2)  # off the curves
    data = result.dataset or result.config.get("dataset")
    ax.set_title(f"training loss{f', {data}' if data else ''}", fontsize=9)

    ema = result.heldout[result.heldout["weights"] == "EMA"].set_index("arm")["loss"]
    lo, hi = result.heldout_range
    ax2.axhspan(lo, hi, color="C0", alpha=0.2, lw=0)
    ax2.scatter([0] * len(base), ema[base], color="C0", zorder=3)
    ax2.scatter([1], [ema[fast]], color="C3", marker="D", s=50, zorder=3)
    for x, name in [(0, n) for n in base] + [(1, fast)]:
        ax2.annotate(f"{ema[name]:.4f}", (x, ema[name]), xytext=(6, 0), textcoords="offset points", va="center", fontsize=7)
    ax2.set_xticks([0, 1], [f"baseline\n({len(base)} seeds)", "fast"])
    ax2.set_xlim(-0.5, 1.8)
    ax2.set_ylabel("held-out loss, EMA weights")
    ax2.set_title("held-out batches\n(same t and noise for every run)", fontsize=9)
    ax2.margins(y=0.3)
    steps, batch = result.config.get("steps"), result.config.get("batch_size")
    if math.isfinite(result.within_spread):
        verdict = (f"{'passed' if result.passed else 'FAILED'}: within the seeds' spread of its twin at "
                   f"{100 * result.within_spread:.0f}% of judged steps")
    else:
        verdict = f"{'passed' if result.passed else 'FAILED'}: inside the band at {100 * result.inside:.0f}% of judged steps"
    head = f"{title}\n{steps} steps x batch {batch} per run; {verdict}"
    return _suptitle(fig, head, label if label is not None else result.label)


def log_ticks(ax, axis: str = "y", extend_down: bool = False, extend_up: bool = False) -> None:
    """Label a log axis at 1, 2, 3 and 5 times the powers of ten inside its limits, as plain numbers (0.2, 0.3,
    0.5, 1, 2,000), with no minor ticks: every gridline gets a label, also on a range of less than one decade. Where
    fewer than three of those fall inside the limits, at finer multiples (1.5, 2.5, 4, 6, 8 as well); where fewer
    than two of those do, at round numbers spaced evenly in value, the axis widened to the first outside the data.

    ``extend_down``: first move the lower limit to the labelled value just below the lowest point of the axes'
    lines, so that no curve runs on below the last label (10's loss curves went to 0.12 under a lowest label of 0.2).
    ``extend_up``: the same at the top (08's epoch times reached 1,378 s over a highest label of 1,000)."""
    lo, hi = sorted(ax.get_ylim() if axis == "y" else ax.get_xlim())
    coarse, fine = (1, 2, 3, 5), (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8)

    def multiples(ks):
        return [k * 10.0**e for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
                for k in ks if lo <= k * 10.0**e <= hi]

    if extend_down:
        points = [float(v) for line in ax.get_lines() for v in (line.get_ydata() if axis == "y" else line.get_xdata())
                  if math.isfinite(float(v)) and float(v) > 0]
        low = min(points, default=lo)

        def below(ks):  # the largest k x 10^e at or under the lowest point
            return max(k * 10.0**e for e in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(low)) + 1)
                       for k in ks if k * 10.0**e <= low)

        lo = below(fine)  # where fewer than three coarse labels fit, the finer ones label it; else start at a coarse one
        if len(multiples(coarse)) >= 3:
            lo = below(coarse)
        (ax.set_ylim if axis == "y" else ax.set_xlim)(lo, hi)
    ticks, family = multiples(coarse), coarse
    if len(ticks) < 3:  # less than a decade: finer steps (1,500, 2,000, 2,500, 3,000 for 1,270-3,300 s)
        ticks, family = multiples(fine), fine
    if len(ticks) < 2:  # a very narrow range (1,100-1,400): round numbers instead (1,100, 1,200, ...), the axis
        # widened to the first of them outside the data on each side, so that no point lies beyond the last label
        vals = [float(t) for t in matplotlib.ticker.MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi) if t > 0]
        lo = max([t for t in vals if t <= lo], default=lo)
        hi = min([t for t in vals if t >= hi], default=hi)
        ticks = [t for t in vals if lo <= t <= hi]
        (ax.set_ylim if axis == "y" else ax.set_xlim)(lo, hi)
    elif extend_up and ticks:  # the next value of the same series above the highest point, where one lies past the last label
        points = [float(v) for line in ax.get_lines() for v in (line.get_ydata() if axis == "y" else line.get_xdata())
                  if math.isfinite(float(v)) and float(v) > 0]
        high = max(points, default=ticks[-1])
        if high > ticks[-1]:
            nxt = min(k * 10.0**e for e in range(math.floor(math.log10(high)), math.ceil(math.log10(high)) + 2)
                      for k in family if k * 10.0**e >= high)
            ticks.append(nxt)
            (ax.set_ylim if axis == "y" else ax.set_xlim)(lo, nxt)
    which = ax.yaxis if axis == "y" else ax.xaxis
    which.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    which.set_major_formatter(matplotlib.ticker.FixedFormatter([f"{t:,.0f}" if t >= 1000 else f"{t:g}" for t in ticks]))
    which.set_minor_locator(matplotlib.ticker.NullLocator())


# ------------------------------------------------------------------------------ the fastest step (notebook 09b)
def _significant(v: float, digits: int = 3) -> str:
    """``v`` with at least ``digits`` significant figures, thousands separated and never in e-notation: 37.5, 38.2,
    1,234, 0.0123."""
    if not math.isfinite(v) or v == 0:
        return f"{v:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(v))))
    return f"{v:,.{decimals}f}"


def peers_figure(table, *, ceiling=None, label: str | None = None,
                 title: str = "Our training step and the peers, side by side") -> "plt.Figure":
    """Left: images/s per contender, labelled with the comparison's own speedup text (a ratio only
    where it separated from the noise). Right: achieved TFLOP/s (each step's own FLOP count), with
    the measured ceiling of this model's step and the datasheet peak drawn as lines."""
    set_style()
    table = table.reset_index(drop=True)
    # the left panel carries the longer labels ("30 · no measurable difference"): the wider of the two
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 0.5 * len(table) + 2.2), sharey=True, width_ratios=(1.4, 1))
    names = table["variant"].astype(str) + "  (batch " + table["batch"].astype(str) + ")"
    bars = ax1.barh(names, table["img/s"], color=["C7"] + ["C0"] * (len(table) - 1))
    ax1.invert_yaxis()
    # another network's cell compares TFLOP/s (Comparison.table(by_work=...)): its factor goes on the TFLOP/s bar, not
    # beside an images/s bar it does not describe
    other = [OTHER_NETWORK in s for s in table["speedup"].astype(str)]
    for b, v, s, o in zip(bars, table["img/s"], table["speedup"].astype(str), other):
        # three significant figures: "38 · 1.00x" beside "38 · 1.02x" read as a contradiction (37.5 and 38.2 img/s)
        ax1.annotate(f"{_significant(v)} · " + ("another network: compare TFLOP/s" if o else s),
                     (b.get_width(), b.get_y() + b.get_height() / 2), xytext=(3, 0),
                     textcoords="offset points", va="center", fontsize=8)
    ax1.set_xlim(0, table["img/s"].max() * 1.6)
    ax1.set_xlabel(f"images / s; each factor against {table['variant'].iloc[0]}")
    tf = table["TFLOP/s"].astype(float)
    bars = ax2.barh(names, tf, color="C1")
    for b, v, s, o in zip(bars, tf, table["speedup"].astype(str), other):
        # another network's verdict wrapped under its number: on one line it set the panel's width, and the bars
        # shrank to slivers (0.06 TFLOP/s on an axis to 2.5)
        said = textwrap.fill(f"{s.replace(OTHER_NETWORK, '').strip()} vs {table['variant'].iloc[0]}", 26)
        ax2.annotate(_significant(v, 3 if v >= 1 else 2) + (f" ·\n{said}" if o else ""),  # 0.070, not 0.07 beside 0.071
                     (b.get_width(), b.get_y() + b.get_height() / 2), xytext=(3, 0),
                     textcoords="offset points", va="center", fontsize=8)
    top = tf.max()
    if ceiling is not None:
        # the ceiling is our network's: drawn across our rows only (a run of adjacent rows per segment), never across a
        # peer's row, whose table cell says "n/a (other network)"
        ours = [i for i, v in enumerate(table["variant"].astype(str)) if v.startswith("ours")] or list(range(len(table)))
        runs = [[ours[0], ours[0]]]
        for i in ours[1:]:
            if i == runs[-1][1] + 1:
                runs[-1][1] = i
            else:
                runs.append([i, i])
        for k, (lo, hi) in enumerate(runs):
            ax2.plot([ceiling.tflops] * 2, [lo - 0.45, hi + 0.45], color="C3", ls="--", lw=1.2, scaley=False,
                     label=None if k else f"measured ceiling of our step, our rows only ({ceiling.precision}"
                          f"{', channels_last' if ceiling.channels_last else ''}, batch {ceiling.batch_size}): "
                          f"{ceiling.tflops:.3g} TFLOP/s" + (f", rough: timed {ceiling.how_noisy}" if ceiling.noisy else ""))
        top = max(top, ceiling.tflops)
        if ceiling.datasheet is not None:
            ax2.axvline(ceiling.datasheet.tflops, color="k", ls=":", lw=1.2, label=f"datasheet: {ceiling.datasheet}")
            top = max(top, ceiling.datasheet.tflops)
    ax2.set_xlim(0, top * 1.15)
    ax2.set_xlabel("achieved TFLOP/s (each step's own FLOPs)")
    if ceiling is not None:
        # below: off the bars; flush with the panel's right edge, as it is wider than the panel. Left out of
        # tight_layout, which otherwise opened a wide gap between the panels to make room for its overhang; back in
        # for the saved figure's tight bounding box, which must hold it
        leg = legend_below(ax2, align="right", fontsize=7)
        leg.set_in_layout(False)
    fig.tight_layout()
    _suptitle(fig, title, label)
    if ceiling is not None:
        leg.set_in_layout(True)
    # each panel as wide as its longest label ("30 · no measurable difference" ran past the frame), no label under a line
    _labels_in_view(ax1)
    _labels_in_view(ax2, tuple(line.get_xdata()[0] for line in ax2.get_lines()))
    # a label moved right of a line sits away from its bar's end: a thin leader ties it to its bar (as ceiling_figure)
    for b, t in zip(bars, ax2.texts):
        if t.xy[0] > b.get_width() * (1 + 1e-9) + 1e-12:
            y = b.get_y() + b.get_height() / 2
            ax2.plot([b.get_width(), t.xy[0]], [y, y], color="0.45", lw=0.6, zorder=4, scalex=False, scaley=False, gid="leader")
    return fig


def ceiling_figure(c, *, top: int = 12, label: str | None = None,
                   title: str = "The measured ceiling: this model's convolutions, each timed alone") -> "plt.Figure":
    """The conv shapes that take most of the step's conv time, each at the TFLOP/s it reaches alone
    (forward + backward), with the large-matmul rate, the convs' overall rate and the datasheet peak."""
    set_style()
    df = c.shapes.head(top).iloc[::-1]
    fig, ax = plt.subplots(figsize=(9, 0.38 * len(df) + 2.0))
    bars = ax.barh([f"{s}  x{n}" for s, n in zip(df["shape"], df["count"])], df["TFLOP/s"], color="C0")
    for b, share in zip(bars, df["share of conv time"]):
        ax.annotate(f"{b.get_width():.3g}  ({100 * share:.0f}% of conv time)", (b.get_width(), b.get_y() + b.get_height() / 2),
                    xytext=(3, 0), textcoords="offset points", va="center", fontsize=7, zorder=5,
                    bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none"))
    lines = [(c.conv_tflops, "C0", "--", f"all convs: {c.conv_tflops:.3g} TFLOP/s"),
             (c.matmul_tflops, "C2", "-.", f"{c.matmul_n}x{c.matmul_n} matmul: {c.matmul_tflops:.3g} TFLOP/s")]
    if c.datasheet is not None:
        lines.append((c.datasheet.tflops, "k", ":", f"datasheet: {c.datasheet}"))
    for x, color, ls, text in lines:
        ax.axvline(x, color=color, ls=ls, lw=1.2, label=text)
    ax.set_xlim(0, max(x for x, *_ in lines + [(df["TFLOP/s"].max(),)]) * 1.35)
    ax.set_xlabel(f"TFLOP/s, forward + backward, {c.precision}" + (", channels_last" if c.channels_last else ""))
    _title(ax, f"{title}\n{c.model}, batch {c.batch_size}: the {min(top, len(c.shapes))} shapes with most conv time", label)
    legend_below(ax, fontsize=7)  # below the axes: inside, it covered a bar's label whenever a long bar sat under it
    fig.tight_layout()
    # a label a reference line would run through (a line stopped at an opaque label still read as struck through)
    # sits right of that line, and the axis ends where the longest label does
    _labels_in_view(ax, tuple(x for x, *_ in lines))
    # a label moved right of a line sits away from its bar's end: a thin leader from the bar's end to the label ties
    # the two together, so that no value reads as the neighbouring bar's
    leaders = [(b.get_width(), t.xy[0], b.get_y() + b.get_height() / 2) for b, t in zip(bars, ax.texts)
               if t.xy[0] > b.get_width() * (1 + 1e-9) + 1e-12]
    for x0, x1, y in leaders:
        ax.plot([x0, x1], [y, y], color="0.45", lw=0.6, ls="-", zorder=4, scalex=False, scaley=False, gid="leader")
    if c.noisy:  # the bars' digits say more than the timings hold: the figure says so where it is seen without the text
        mark_caveat(fig, f"Timed {c.how_noisy}, so read these rates as rough: " + "; ".join(c.noise_reasons) + ".")
    return fig


def grids_side_by_side(grids: dict, *, title: str, label: str | None = None) -> "plt.Figure":
    """Batches of images in [-1, 1], one grid per (heading -> batch), side by side: e.g. the samples of
    two runs drawn with the same seed, so that they compare image by image."""
    set_style()
    fig, axes = plt.subplots(1, len(grids), figsize=(4.2 * len(grids), 4.9), squeeze=False)
    for ax, (heading, images) in zip(axes[0], grids.items()):
        grid, _ = _grid(images)
        ax.imshow(grid.permute(1, 2, 0).numpy(), interpolation="nearest")
        ax.set_axis_off()
        ax.set_title(_wrap(heading, 4.2), fontsize=9)
    return _suptitle(fig, _wrap(title, 4.2 * len(grids)), label, fontsize=9)
