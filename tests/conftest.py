"""Shared fixtures. Tests never touch the repo's data/ or figures/: both point at temp folders."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def data_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data"))


@pytest.fixture(autouse=True)
def _isolated_dirs(monkeypatch, data_root, tmp_path_factory):
    monkeypatch.setenv("DDPM_DATA_DIR", data_root)
    monkeypatch.setenv("DDPM_FIGURES_DIR", str(tmp_path_factory.getbasetemp() / "figures"))


@pytest.fixture(scope="session")
def synthetic_folder(data_root):
    from ddpm_core.data import make_synthetic

    return make_synthetic(data_root, n=256, seed=0, progress=False)


@pytest.fixture(scope="session")
def synthetic_batch(synthetic_folder) -> torch.Tensor:
    """16 synthetic images in [-1, 1]."""
    from ddpm_core.data import FolderImages, normalize

    ds = FolderImages(synthetic_folder)
    return normalize(torch.stack([ds[i] for i in range(16)]))


@pytest.fixture(scope="session")
def smoke_reference(tmp_path_factory, data_root):
    """The whole series, run once per test session in smoke mode through ``python -m ddpm_core.reference run``: the
    notebooks' smoke test and the reference command's test (test_reference.py); the browser's layout check reads
    its executed notebooks (test_browser.py). Returns (folder, stdout, seconds, environment).

    For development only: ``DDPM_TEST_SMOKE_REFERENCE=<a cpu-smoke folder>`` (one a run of this fixture left under
    pytest's temporary folders, with a notebook swapped for a freshly executed copy) reuses it instead of running the
    series again, so that e.g. the browser's layout check of one changed notebook takes a minute, not fifteen. The
    tests that check the run itself (its log and timing) then see an empty log. CI never sets it."""
    import subprocess
    import sys
    import time

    if os.environ.get("DDPM_TEST_SMOKE_REFERENCE"):
        from pathlib import Path

        folder = Path(os.environ["DDPM_TEST_SMOKE_REFERENCE"])
        if not (folder / "parts.json").exists():
            raise FileNotFoundError(f"DDPM_TEST_SMOKE_REFERENCE={folder} holds no parts.json: point it at a cpu-smoke "
                                    "folder a smoke reference run wrote, or unset it")
        return folder, "", 0.0, {**os.environ, "DDPM_DATA_DIR": data_root}
    root = tmp_path_factory.mktemp("reference")
    out = root / "cpu-smoke"
    env = {**os.environ, "DDPM_DATA_DIR": data_root, "DDPM_FIGURES_DIR": str(root / "ignored-figures"),
           "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ddpm_core.reference", "run", "--smoke", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout, time.perf_counter() - start, env
