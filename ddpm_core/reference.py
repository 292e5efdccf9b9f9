"""Reference results from full-mode runs on a real GPU, committed under ``data/reference/<gpu>/``.

Layout of one reference folder (written by the reference-run script on the GPU machine)::

    data/reference/<gpu>/meta.json                 device name, torch and CUDA versions, date
    data/reference/<gpu>/results.csv               one row per measured variant
    data/reference/<gpu>/traces/<run>/rank0.pt.trace.json.gz

Notebooks show these next to what they measure locally, always labeled as the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

from .paths import REPO_ROOT

REFERENCE_DIR = REPO_ROOT / "data" / "reference"


def reference_runs(root: Path = REFERENCE_DIR) -> list[Path]:
    """The reference folders that hold a meta.json, by name."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / "meta.json").is_file())


def meta(folder: Path) -> dict:
    """A reference folder's meta.json (device_name, torch_version, ...)."""
    return json.loads((Path(folder) / "meta.json").read_text())


def label(folder: Path) -> str:
    """"reference: NVIDIA H100 80GB HBM3 · torch 2.x · <date>" for figure titles."""
    m = meta(folder)
    parts = [f"reference: {m.get('device_name', Path(folder).name)}", f"torch {m.get('torch_version', '?')}"]
    if m.get("date"):
        parts.append(str(m["date"]))
    return " · ".join(parts)


def trace_dir(folder: Path, run: str) -> Path | None:
    """The trace folder of ``run`` (e.g. "baseline") in a reference folder, if it was committed."""
    d = Path(folder) / "traces" / run
    return d if d.is_dir() and any(d.glob("*.json*")) else None
