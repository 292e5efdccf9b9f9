"""Where things live: the repo's data/ folder (datasets, and what runs write: results, figures) and its committed
figures/, each overridable by an environment variable."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# The package is meant to be installed editable (pip install -e .), so the repo is its parent.
REPO_ROOT = PACKAGE_DIR.parent if (PACKAGE_DIR.parent / "pyproject.toml").exists() else Path.cwd()


def data_dir() -> Path:
    """Folder for datasets: $DDPM_DATA_DIR if set, else <repo>/data."""
    return Path(os.environ.get("DDPM_DATA_DIR") or REPO_ROOT / "data")


def figures_dir() -> Path:
    """Where runs write their figures: $DDPM_FIGURES_DIR if set (tests use a temporary one), else <data dir>/figures.

    Git-ignored, like the results beside it (data/results): running a notebook, with papermill, `make run` or in
    JupyterLab, leaves the repository as it was. The figures the README shows are another folder,
    ``committed_figures_dir``, which only a maintainer's command writes."""
    return Path(os.environ.get("DDPM_FIGURES_DIR") or data_dir() / "figures")


def committed_figures_dir() -> Path:
    """The repository's committed figures, the ones the README shows: $DDPM_COMMITTED_FIGURES_DIR if set (tests use
    a temporary one), else <repo>/figures. Written on purpose only: ``reference unpack`` copies a GPU reference run's
    figures there, ``reference figures`` (`make figures`) a run's other figures."""
    return Path(os.environ.get("DDPM_COMMITTED_FIGURES_DIR") or REPO_ROOT / "figures")


def runs_dir() -> Path:
    """Folder for run outputs (traces, checkpoints): $DDPM_RUNS_DIR if set, else <repo>/runs."""
    return Path(os.environ.get("DDPM_RUNS_DIR") or REPO_ROOT / "runs")
