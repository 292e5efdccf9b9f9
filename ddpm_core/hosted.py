"""Running the series on a hosted GPU notebook (Google Colab, Kaggle, ...): the install cell and what it runs.

Every notebook's first code cell (tagged ``hosted-install``) is ``cell_source(url)``. Where ``ddpm_core`` is
importable (``make setup``, the test suite, JupyterLab on your machine) the cell does nothing. On a fresh hosted
runtime it clones the series from its ``REPO_URL`` into ``~/ddpm-series``, runs ``python -m ddpm_core.hosted
install`` there, and makes the clone's ``notebooks/`` the working folder.

``install`` keeps what the runtime already has: the hosted runtime's own torch and torchvision (built for its GPU
and driver) are left alone when they satisfy the project's requirements. It installs only the requirements that
are missing or too old, skips JupyterLab (a hosted notebook runs its own front end), installs HTA without its
JupyterLab and pytest requirements, and installs the series itself in editable mode, so that the processes the
notebooks start (``torchrun`` in 08) import it too.

An instructor who publishes the series writes its URL into every notebook once:

    python -m ddpm_core.hosted set-url https://github.com/<you>/<your copy of the series>
    python -m ddpm_core.hosted install            # (what the cell runs, from a clone's root)
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import re
import subprocess
import sys
from pathlib import Path

from .paths import REPO_ROOT
from .text import plural

TAG = "hosted-install"
CLONE = "~/ddpm-series"
# Requirements a hosted notebook does not need: it has its own front end (JupyterLab would also pull a
# jupyter_server that the runtime's own may not work with).
SKIP = {"jupyterlab"}
# HTA's declared requirements include JupyterLab and pytest, which its analyses never import: it is installed
# without them, and with these, the ones it does import, where they are missing.
HTA = "holistictraceanalysis"
HTA_RUNTIME = ["plotly", "pydot", "networkx"]

CELL = '''\
# On a hosted GPU notebook (Colab, Kaggle, ...) this cell installs the series; where ddpm_core is installed it does nothing.
REPO_URL = {url}  # the Git URL of this series; `python -m ddpm_core.hosted set-url URL` writes it into every notebook
import importlib.util, os, subprocess, sys
if importlib.util.find_spec("ddpm_core") is None:
    if not REPO_URL:
        raise RuntimeError("ddpm_core is not installed. On a hosted notebook: set REPO_URL in this cell to the Git URL "
                           "of this series, then run the cell again. On your own machine: `make setup`, then `make lab`.")
    CLONE = os.path.expanduser({clone})
    if not os.path.isdir(CLONE):
        subprocess.run(["git", "clone", "--depth", "1", REPO_URL, CLONE], check=True)
    subprocess.run([sys.executable, "-m", "ddpm_core.hosted", "install"], cwd=CLONE, check=True)
    sys.path.insert(0, CLONE)
    os.chdir(os.path.join(CLONE, "notebooks"))'''

URL_PATTERN = re.compile(r"^(https?://|ssh://|git@|file://|/)\S+$")


def cell_source(url: str = "") -> str:
    """The install cell, with ``url`` as its ``REPO_URL`` ("" until the series is published)."""
    return CELL.format(url=json.dumps(url), clone=json.dumps(CLONE))


def check_url(url: str) -> str:
    """``url`` if it looks like a Git URL a hosted runtime can clone; a ValueError naming the fix otherwise."""
    url = url.strip()
    if not URL_PATTERN.match(url):
        raise ValueError(f"{url!r} is not a Git URL: give the address `git clone` takes, e.g. "
                         "https://github.com/<you>/<repo> (or git@..., ssh://..., file://...).")
    return url


def _pyproject(pyproject: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pip carries the same parser
        from pip._vendor import tomli as tomllib

    return tomllib.loads(pyproject.read_text())


def requirements(pyproject: Path = REPO_ROOT / "pyproject.toml") -> list[str]:
    """The project's runtime requirements, as pyproject.toml declares them."""
    return list(_pyproject(pyproject)["project"]["dependencies"])


def build_requirements(pyproject: Path = REPO_ROOT / "pyproject.toml") -> list[str]:
    """What building the project needs (``[build-system] requires``: a recent enough setuptools)."""
    return list(_pyproject(pyproject)["build-system"]["requires"])


def _requirement_class():
    try:
        from packaging.requirements import Requirement
    except ModuleNotFoundError:  # a runtime without packaging: pip carries it
        from pip._vendor.packaging.requirements import Requirement
    return Requirement


def missing(reqs: list[str]) -> list[str]:
    """The requirements in ``reqs`` that no installed distribution satisfies (absent, or a version outside)."""
    Requirement = _requirement_class()
    out = []
    for line in reqs:
        req = Requirement(line)
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(line)
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            out.append(line)
    return out


def plan(repo: Path = REPO_ROOT) -> list[list[str]]:
    """The pip commands ``install`` runs for the clone at ``repo``, in order (each as pip's arguments)."""
    Requirement = _requirement_class()

    todo = [r for r in missing(requirements(repo / "pyproject.toml")) if Requirement(r).name.lower() not in SKIP]
    hta = [r for r in todo if Requirement(r).name.lower() == HTA]
    rest = [r for r in todo if r not in hta]
    steps = []
    if rest:
        steps.append(["install", "-q", *rest])
    if hta:
        steps.append(["install", "-q", "--no-deps", *hta])
        extra = missing(HTA_RUNTIME)
        if extra:
            steps.append(["install", "-q", *extra])
    # the series itself, editable and without its requirements (handled above), so torchrun's workers import it;
    # built with the runtime's setuptools where it is recent enough, so nothing more is downloaded
    isolation = [] if missing(build_requirements(repo / "pyproject.toml")) else ["--no-build-isolation"]
    steps.append(["install", "-q", "--no-deps", *isolation, "-e", str(repo)])
    return steps


def install(repo: Path = REPO_ROOT, *, dry_run: bool = False) -> list[list[str]]:
    """Install what the series needs into this Python, keeping what it already has; returns the pip commands."""
    steps = plan(repo)
    for args in steps:
        cmd = [sys.executable, "-m", "pip", *args]
        print("$ " + " ".join(cmd), flush=True)
        if not dry_run:
            subprocess.run(cmd, check=True)
    return steps


def cells(book) -> list:
    """The install cells of a notebook (nbformat object)."""
    return [c for c in book.cells if c.cell_type == "code" and TAG in c.metadata.get("tags", [])]


def set_url(url: str, notebooks: list[Path]) -> int:
    """Write ``url`` into the install cell of each notebook; returns how many changed. Checks all before writing."""
    import nbformat

    url = check_url(url)
    books = {}
    for nb in notebooks:
        book = nbformat.read(nb, as_version=4)
        if len(cells(book)) != 1:
            raise ValueError(f"{nb.name} has {len(cells(book))} cells tagged {TAG!r}, not 1: nothing was changed.")
        books[nb] = book
    changed = 0
    for nb, book in books.items():
        cell = cells(book)[0]
        if cell.source != cell_source(url):
            cell.source = cell_source(url)
            nbformat.write(book, nb)
            changed += 1
    return changed


def main(argv: list[str] | None = None) -> int:
    from .series import select

    p = argparse.ArgumentParser(prog="python -m ddpm_core.hosted", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install", help="install what the series needs into this Python (the install cell runs it)")
    i.add_argument("--dry-run", action="store_true", help="print the pip commands without running them")
    s = sub.add_parser("set-url", help="write the series' Git URL into every notebook's install cell")
    s.add_argument("url")
    args = p.parse_args(argv)
    if args.cmd == "install":
        install(REPO_ROOT, dry_run=args.dry_run)
        return 0
    try:
        changed = set_url(args.url, select([]))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{plural(changed, 'notebook')} now clone {args.url.strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
