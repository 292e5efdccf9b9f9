"""Student copies of the notebooks: the same notebooks without their worked solutions.

    python -m ddpm_core.student                    # -> student/  (make student)
    python -m ddpm_core.student --out /tmp/lab3 03 03b
    python -m ddpm_core.student --repo ../ddpm-student --url https://github.com/<you>/ddpm-student

The solutions live in the notebooks themselves, in cells tagged ``solution`` (JupyterLab: the
property inspector, "Cell Tags"), right after the exercises, so instructors run and maintain
them with the rest of the notebook. A student copy drops those cells with nbconvert's
``TagRemovePreprocessor`` and clears every output.

``--repo`` makes the students' edition of the whole repository, to publish where students clone from (the hosted
install cell clones it too): the committed tree (``git archive HEAD``) with the student copies as its notebooks, the
reference GPU runs' executed copies without their solution cells either, no tests (they check the solutions), and,
with ``--url``, that repository's address in every install cell.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
from pathlib import Path

from .paths import REPO_ROOT
from .text import plural

SOLUTION_TAG = "solution"


def strip_solutions(notebook: Path, out: Path, clear_outputs: bool = True) -> tuple[Path, int]:
    """Write ``notebook`` to ``out`` without its ``solution`` cells and (``clear_outputs``) without outputs.

    Returns (the written path, the number of cells removed).
    """
    import nbformat
    from nbconvert.preprocessors import ClearOutputPreprocessor, TagRemovePreprocessor
    from traitlets.config import Config

    book = nbformat.read(notebook, as_version=4)
    before = len(book.cells)
    cfg = Config()
    cfg.TagRemovePreprocessor.remove_cell_tags = {SOLUTION_TAG}
    cfg.TagRemovePreprocessor.enabled = True
    book, _ = TagRemovePreprocessor(config=cfg).preprocess(book, {})
    if clear_outputs:
        book, _ = ClearOutputPreprocessor().preprocess(book, {})
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(book, out)
    return out, before - len(book.cells)


# What the students' edition leaves out: the suite and CI check the worked solutions, which it does not have.
NOT_IN_STUDENT_REPO = ("tests/", ".ci/")
STUDENT_NOTE = ("> **Students' edition.** The notebooks here have no worked solutions: your instructor made this copy "
                "with `python -m ddpm_core.student --repo`. The rest of this README describes the full series.\n\n")


def student_repo(dest: Path, url: str | None = None, repo: Path = REPO_ROOT) -> dict[str, int]:
    """Write the students' edition of ``repo``'s committed tree (HEAD) into ``dest``, which must not exist or be
    empty. Returns counts: notebooks, solution cells removed from them and from the reference runs' executed copies."""
    from . import hosted

    dest = Path(dest).resolve()
    if dest.exists() and any(dest.iterdir()):
        raise ValueError(f"{dest} is not empty: the students' edition goes into a new folder. Fix: pick another one, "
                         "or empty it first.")
    if url is not None:
        url = hosted.check_url(url)  # before anything is written
    proc = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", "HEAD"], capture_output=True)
    if proc.returncode != 0:
        raise ValueError(f"git archive failed in {repo} ({proc.stderr.decode().strip()}): the students' edition is made "
                         "from the committed tree. Fix: run it in a git checkout of the series.")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        members = [m for m in tar.getmembers() if not m.name.startswith(NOT_IN_STUDENT_REPO)]
        tar.extractall(dest, members=members, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    notebooks = sorted((dest / "notebooks").glob("*.ipynb"))
    counts = {"notebooks": len(notebooks), "solution cells": 0, "reference solution cells": 0}
    for nb in notebooks:
        counts["solution cells"] += strip_solutions(nb, nb)[1]
    for nb in sorted((dest / "data" / "reference").glob("*/notebooks/*.ipynb")):
        counts["reference solution cells"] += strip_solutions(nb, nb, clear_outputs=False)[1]  # their outputs stay
    if url is not None:
        hosted.set_url(url, notebooks)
    readme = dest / "README.md"
    if readme.exists():
        readme.write_text(STUDENT_NOTE + readme.read_text())
    return counts


def main(argv: list[str] | None = None) -> int:
    from .series import select

    p = argparse.ArgumentParser(prog="python -m ddpm_core.student", description=__doc__.split("\n\n")[0])
    p.add_argument("only", nargs="*", help="notebook numbers (default: all), e.g. 03 03b")
    p.add_argument("--out", default=str(REPO_ROOT / "student"), help="where the student copies go (default: student/)")
    p.add_argument("--repo", default=None, metavar="DIR",
                   help="instead: the students' edition of the whole committed repository, in the new folder DIR")
    p.add_argument("--url", default=None, help="with --repo: the Git URL the students' edition will have (written into "
                                               "its notebooks' install cells, for hosted notebooks)")
    args = p.parse_args(argv)
    if args.url and not args.repo:
        print("error: --url goes with --repo (the address of the students' edition). Fix: add --repo DIR, or use "
              "`python -m ddpm_core.hosted set-url` for this repository's own notebooks.", file=sys.stderr)
        return 2
    if args.repo:
        if args.only:
            print("error: --repo makes the edition of every notebook; leave out the notebook numbers.", file=sys.stderr)
            return 2
        try:
            counts = student_repo(Path(args.repo), args.url)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"students' edition of the committed tree (HEAD; uncommitted changes are not in it) -> {Path(args.repo).resolve()}: "
              f"{plural(counts['notebooks'], 'notebook')} without {plural(counts['solution cells'], 'solution cell')}, "
              f"{plural(counts['reference solution cells'], 'solution cell')} removed from the reference runs' executed "
              f"copies, no {' or '.join(NOT_IN_STUDENT_REPO)}"
              + (f"; install cells clone {args.url.strip()}" if args.url else
                 "; no --url, so its install cells stop on a hosted runtime until `python -m ddpm_core.hosted set-url` "
                 "is run there") + ". Publish it: git init, commit, push.")
        return 0
    out = Path(args.out).resolve()
    if out == (REPO_ROOT / "notebooks").resolve():
        print("error: --out is the notebooks folder itself: the copies would replace the notebooks with their solutions. "
              "Fix: pick another folder.", file=sys.stderr)
        return 2
    chosen = select(args.only)
    if not chosen:
        print(f"error: no notebook matches {args.only}", file=sys.stderr)
        return 2
    total = 0
    for nb in chosen:
        path, removed = strip_solutions(nb, out / nb.name)
        total += removed
        print(f"{path.relative_to(out.parent) if out.parent in path.parents else path}: {plural(removed, 'solution cell')} removed")
    (out / "README.md").write_text(
        "# Student copies\n\nMade by `make student` from `notebooks/`: the same notebooks without the worked solutions "
        "(cells tagged `solution`). Run them from this folder or copy them next to `notebooks/`; they import `ddpm_core` "
        "like the originals.\n")
    print(f"{plural(len(chosen), 'notebook')}, {plural(total, 'solution cell')} removed -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
