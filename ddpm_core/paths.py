"""Where things live: the repo's data/ and figures/ folders, overridable by environment variables."""

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
    """Folder for figures: $DDPM_FIGURES_DIR if set (tests use a temporary one), else <repo>/figures."""
    return Path(os.environ.get("DDPM_FIGURES_DIR") or REPO_ROOT / "figures")


def runs_dir() -> Path:
    """Folder for run outputs (traces, checkpoints): $DDPM_RUNS_DIR if set, else <repo>/runs."""
    return Path(os.environ.get("DDPM_RUNS_DIR") or REPO_ROOT / "runs")
