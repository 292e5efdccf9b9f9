"""Student copies of the notebooks: the same notebooks without their worked solutions.

    python -m ddpm_core.student                    # -> student/  (make student)
    python -m ddpm_core.student --out /tmp/lab3 03 03b

The solutions live in the notebooks themselves, in cells tagged ``solution`` (JupyterLab: the
property inspector, "Cell Tags"), right after the exercises, so instructors run and maintain
them with the rest of the notebook. A student copy drops those cells with nbconvert's
``TagRemovePreprocessor`` and clears every output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .paths import REPO_ROOT
from .text import plural

SOLUTION_TAG = "solution"


def strip_solutions(notebook: Path, out: Path) -> tuple[Path, int]:
    """Write ``notebook`` to ``out`` without its ``solution`` cells and without outputs.

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
    book, _ = ClearOutputPreprocessor().preprocess(book, {})
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(book, out)
    return out, before - len(book.cells)


def main(argv: list[str] | None = None) -> int:
    from .series import select

    p = argparse.ArgumentParser(prog="python -m ddpm_core.student", description=__doc__.split("\n\n")[0])
    p.add_argument("only", nargs="*", help="notebook numbers (default: all), e.g. 03 03b")
    p.add_argument("--out", default=str(REPO_ROOT / "student"), help="where the student copies go (default: student/)")
    args = p.parse_args(argv)
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
