"""Figures in one style, saved to figures/ (or $DDPM_FIGURES_DIR) and labeled with the device."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from .atomic import atomic_write_bytes
from .paths import figures_dir


def set_style() -> None:
    """The series' seaborn style."""
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind")


def savefig(fig: "plt.Figure", name: str, dpi: int = 150) -> Path:
    """Save ``fig`` as ``<figures dir>/<name>`` (PNG, written atomically) and return the path.

    The folder is $DDPM_FIGURES_DIR when set, so test runs never overwrite committed figures.
    """
    path = Path(name)
    if not path.is_absolute():
        path = figures_dir() / path
    if path.suffix == "":
        path = path.with_suffix(".png")
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip("."), dpi=dpi, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())
    return path


def image_grid_figure(images: torch.Tensor, title: str | None = None, nrow: int | None = None) -> "plt.Figure":
    """A figure of a batch of images in [-1, 1] laid out as a grid."""
    from torchvision.utils import make_grid

    images = images.detach().float().cpu().clamp(-1, 1)
    nrow = nrow or max(1, int(round(images.shape[0] ** 0.5)))
    grid = make_grid((images + 1) / 2, nrow=nrow, padding=1, pad_value=1.0)
    side = max(3.0, 0.45 * nrow)
    fig, ax = plt.subplots(figsize=(side, side * grid.shape[1] / grid.shape[2] + 0.4))
    ax.imshow(grid.permute(1, 2, 0).numpy(), interpolation="nearest")
    ax.set_axis_off()
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def save_image_grid(images: torch.Tensor, name: str, title: str | None = None) -> Path:
    """Save a grid of images in [-1, 1] (see ``savefig`` for where it goes)."""
    fig = image_grid_figure(images, title)
    try:
        return savefig(fig, name)
    finally:
        plt.close(fig)
