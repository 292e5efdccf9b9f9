"""Measurement rows appended to one CSV per notebook, atomically, and read back as a DataFrame.

Each row carries what makes it interpretable later: notebook, variant, the config that produced
it, device name, torch version and a timestamp, then the metrics. The file is rewritten through
a temporary file and a rename, so a writer killed mid-write leaves the previous file whole.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, is_dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping

import pandas as pd
import torch

from .atomic import atomic_write_text, file_lock
from .paths import data_dir

ID_COLUMNS = ["notebook", "variant", "device_name", "torch_version", "timestamp", "config"]


def results_dir() -> Path:
    """$DDPM_RESULTS_DIR if set, else <data dir>/results (git-ignored; tests use a temp folder)."""
    return Path(os.environ.get("DDPM_RESULTS_DIR") or data_dir() / "results")


def results_path(notebook: str) -> Path:
    """The CSV of one notebook, e.g. ``results_path("03_batch_size")``."""
    return results_dir() / f"{notebook}.csv"


def _config_text(config: Any) -> str:
    if config is None:
        return ""
    if is_dataclass(config):
        config = asdict(config)
    return json.dumps(config, sort_keys=True, default=str)


def append(
    notebook: str,
    rows: Iterable[Mapping[str, Any]] | Mapping[str, Any],
    *,
    variant: str | None = None,
    config: Any = None,
    device_name: str | None = None,
    path: str | os.PathLike | None = None,
) -> Path:
    """Append measurement rows (dicts, e.g. ``Measurement.row()``) to the notebook's CSV.

    ``variant``, ``config`` and ``device_name`` fill those columns where a row lacks them.
    Returns the CSV path.
    """
    if isinstance(rows, Mapping):
        rows = [rows]
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    new = []
    for r in rows:
        r = dict(r)
        r.setdefault("notebook", notebook)
        r["variant"] = r.get("variant") or variant or r.get("name") or ""
        r["config"] = _config_text(r.get("config", config))
        r["device_name"] = r.get("device_name") or device_name or ""
        r.setdefault("torch_version", torch.__version__)
        r.setdefault("timestamp", stamp)
        new.append(r)
    if not new:
        raise ValueError("append() needs at least one row")
    path = Path(path) if path is not None else results_path(notebook)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Read, add, rewrite under an exclusive lock: without it, concurrent writers (ranks, notebooks
    # run side by side) each read the old file and the last rename wins, dropping the others' rows.
    with file_lock(path):
        old = load(path) if path.exists() and path.stat().st_size > 0 else pd.DataFrame()
        df = pd.concat([old, pd.DataFrame(new)], ignore_index=True)
        cols = [c for c in ID_COLUMNS if c in df.columns] + [c for c in df.columns if c not in ID_COLUMNS]
        atomic_write_text(path, df[cols].to_csv(index=False))
    return path


def load(notebook_or_path: str | os.PathLike) -> pd.DataFrame:
    """Read a results CSV back, by notebook name or path."""
    p = Path(notebook_or_path)
    if p.suffix != ".csv":
        p = results_path(str(notebook_or_path))
    if not p.exists():
        raise FileNotFoundError(f"no results file {p}. Fix: run the notebook that writes it, or check the name.")
    if p.stat().st_size == 0:
        raise ValueError(f"results file {p} is empty (0 bytes; a writer was interrupted before the atomic writes "
                         "of this version). Fix: delete it; the next run writes it again.")
    try:
        # Identity columns stay text: a variant named "NA" or "1e3" must not come back as NaN or 1000.0.
        header = pd.read_csv(p, nrows=0).columns
        missing = ["", "NaN", "nan", "NA", "N/A", "<NA>", "null", "None"]
        return pd.read_csv(p, dtype={c: str for c in ID_COLUMNS if c in header}, keep_default_na=False,
                           na_values={c: missing for c in header if c not in ID_COLUMNS})
    except (pd.errors.ParserError, UnicodeDecodeError) as e:
        raise ValueError(f"results file {p} is not a readable CSV: {e}") from e
