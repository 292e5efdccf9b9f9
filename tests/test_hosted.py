"""The hosted-GPU install cell (ddpm_core.hosted): in every notebook, inert where the series is installed, a clear
error without a URL, and, on a simulated fresh runtime, a clone that installs and imports."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import nbformat
import pytest

from ddpm_core import hosted, series
from ddpm_core.paths import REPO_ROOT

NOTEBOOKS = series.list_notebooks()


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_opens_with_the_install_cell_and_says_how_to_use_it(nb):
    book = nbformat.read(nb, as_version=4)
    first_code = next(c for c in book.cells if c.cell_type == "code")
    assert hosted.cells(book) == [first_code], "one install cell, the first code cell"
    assert first_code.source == hosted.cell_source(""), "the install cell is generated: python -m ddpm_core.hosted set-url"
    assert "**On a hosted GPU notebook**" in book.cells[0].source


def test_the_cell_does_nothing_where_the_series_is_installed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = list(sys.path)
    namespace: dict = {}
    exec(hosted.cell_source("https://example.invalid/never-cloned.git"), namespace)
    assert Path.cwd() == tmp_path and sys.path == path


def test_without_a_url_the_cell_says_what_to_set_before_doing_anything(tmp_path):
    # -S: no site-packages, so ddpm_core is not importable, as on a fresh hosted runtime
    done = subprocess.run([sys.executable, "-S", "-c", hosted.cell_source("")], cwd=tmp_path,
                          capture_output=True, text=True, env={"HOME": str(tmp_path), "PATH": os.environ["PATH"]})
    assert done.returncode != 0
    assert "RuntimeError: ddpm_core is not installed" in done.stderr and "set REPO_URL" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing cloned, nothing written


def test_set_url_rewrites_every_install_cell_and_refuses_what_is_not_a_url(tmp_path):
    books = []
    for nb in NOTEBOOKS[:2]:
        books.append(tmp_path / nb.name)
        books[-1].write_bytes(nb.read_bytes())
    with pytest.raises(ValueError, match="not a Git URL"):
        hosted.set_url("my repo", books)
    assert [b.read_bytes() for b in books] == [nb.read_bytes() for nb in NOTEBOOKS[:2]]  # nothing changed
    assert hosted.set_url("https://github.com/someone/ddpm-series", books) == 2
    for b in books:
        cell = hosted.cells(nbformat.read(b, as_version=4))[0]
        assert cell.source == hosted.cell_source("https://github.com/someone/ddpm-series")
    assert hosted.set_url("https://github.com/someone/ddpm-series", books) == 0  # already so


def test_install_keeps_what_the_runtime_has_and_adds_what_it_lacks(monkeypatch):
    real = importlib.metadata.version
    gone = {"holistictraceanalysis", "plotly", "psutil", "jupyterlab"}

    def version(name):
        if name.lower() in gone:
            raise importlib.metadata.PackageNotFoundError(name)
        return "0.0.1" if name.lower() == "seaborn" else real(name)  # an old seaborn: below the >=0.13 required

    monkeypatch.setattr(hosted.metadata, "version", version)
    steps = hosted.plan(REPO_ROOT)
    assert steps[0][:2] == ["install", "-q"] and sorted(steps[0][2:]) == ["psutil>=5.9", "seaborn>=0.13"]
    assert steps[1] == ["install", "-q", "--no-deps", "holistictraceanalysis>=0.5"]  # without JupyterLab and pytest
    assert steps[2] == ["install", "-q", "plotly"]  # what HTA imports and the runtime lacks
    assert steps[3][-2:] == ["-e", str(REPO_ROOT)] and "--no-deps" in steps[3]
    assert not any("jupyterlab" in a for step in steps for a in step) and not any("torch" in a for s in steps for a in s)


@pytest.mark.slow
def test_on_a_fresh_runtime_the_cell_clones_installs_and_the_series_imports(tmp_path):
    """A fresh Python with torch and the rest preinstalled (as a hosted runtime has them) but no ddpm_core: the cell
    clones this repository's HEAD, installs it, and the notebook's kernel and the processes it starts import the
    clone. Nothing comes from the network: the URL is a file:// one and every requirement is already there."""
    venv = tmp_path / "runtime"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    # the project's environment's packages as the runtime's preinstalled ones, on PYTHONPATH, without the editable
    # ddpm_core (its .pth and finder module, whose name the clone's editable install reuses)
    preinstalled = tmp_path / "preinstalled"
    preinstalled.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("__editable__", "ddpm_core")):
            (preinstalled / entry.name).symlink_to(entry)
    env = {"HOME": str(tmp_path / "home"), "PATH": os.environ["PATH"], "PYTHONPATH": str(preinstalled),
           "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    (tmp_path / "home").mkdir()
    probe = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('ddpm_core'))"],
                           cwd=tmp_path, env=env, capture_output=True, text=True)
    assert probe.stdout.strip() == "None", probe.stdout + probe.stderr
    script = hosted.cell_source(REPO_ROOT.as_uri()) + textwrap.dedent("""
        import ddpm_core, subprocess
        print("kernel:", ddpm_core.__file__, os.getcwd())
        child = subprocess.run([sys.executable, "-c", "import ddpm_core; print(ddpm_core.__file__)"],
                               capture_output=True, text=True, cwd="/")
        print("child:", child.stdout.strip(), child.stderr[-500:])
        """)
    done = subprocess.run([python, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    clone = tmp_path / "home" / "ddpm-series"
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"kernel: {clone}/ddpm_core/__init__.py {clone}/notebooks" in done.stdout
    assert f"child: {clone}/ddpm_core/__init__.py" in done.stdout  # torchrun's workers would import it too
    assert (clone / "notebooks" / NOTEBOOKS[0].name).exists()
