"""Check a run of a notebook from what it leaves behind: its result rows and its figures.

    python -m ddpm_core.grade 03                 # make grade NB=03
    python -m ddpm_core.grade 03 --results path/to/results --figures path/to/figures --since 2026-11-23T09:00

For each notebook it checks:

- **the expected rows**: every measurement the notebook must write (``EXPECTED``: a pattern per
  required variant) is in its results CSV (``data/results/<notebook>.csv``);
- **labels**: every one of those rows names its device and torch version, and has a number
  where a number is due (ms/step and img/s for timed rows); every other row (optional variants)
  names its device and torch version too;
- **figures**: every figure the notebook declares was written (after ``--since`` when given);
- with ``--executed <notebook.ipynb> ...``: no cell of each notebook's executed copy ended in an error (the first
  failing cell is named, with its section).

It prints one line per problem, names what is missing in plain words and the section that writes it, and exits 1 when anything is; 0 when the
run is complete. Instructors run it on a student's ``data/results`` and ``figures`` folders.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .text import plural

# The rows each measuring notebook must write: a regular expression on the ``variant`` column, the row in plain words
# (what a student is told is missing), and the section that writes it, in both modes. Notebooks that measure nothing
# (00, 01) have none.
S = "its Summary"
EXPECTED: dict[str, list[tuple[str, str, str]]] = {
    "02_profile_the_baseline": [(r"^baseline$", "the baseline step", S),
                                (r"^loss read every step$", "the step that reads the loss every step", "section 7"),
                                (r"^loss read once per \d+ steps$", "the step that reads it once per N steps", "section 7")],
    "03_batch_size": [(r"^batch \d+$", "a batch size of the sweep (one row per size)", S),
                      (r"^batch \d+$", "a second batch size: the sweep needs at least two", S)],
    "03b_memory": [(r"^no checkpointing$", "the step without checkpointing", "section 4"),
                   (r"^activation checkpointing$", "the step with activation checkpointing", "section 4")],
    "04_torch_compile": [(r"^eager$", "the eager step", S), (r"^compile default$", "the step compiled in mode default", S)],
    "05_sdpa_attention": [(r"^math", "the step with math attention", S), (r"^sdpa", "the step with SDPA", S)],
    # fp16 alone on a GPU without bf16 hardware (a T4)
    "06_mixed_precision": [(r"^fp32$", "the fp32 step", S), (r"^(bf16|fp16)$", "the bf16 (or fp16) step", S)],
    "07_data_loading": [(r"0 workers \(baseline\)$", "the PNG loader with 0 workers, the baseline", S),
                        (r"^device-resident", "the device-resident dataset", S)],
    "08_multi_gpu": [(r"^1 processes$", "the launch with one process", S),
                     (r"^\d+ processes$", "a launch with more processes", S)],
    "09_putting_it_together": [(r"^baseline", "the baseline stage", S), (r"^\+ batch \d+$", "the '+ batch N' stage", S)],
    "09b_the_fastest_step": [(r"^ours \(baseline\)$", "our baseline step", S), (r"^ours \(fast\)$", "our fast step", S),
                             (r"^measured ceiling", "the measured ceiling", S)],
    "09c_nothing_given_up": [(r"^quality: baseline", "a quality run of the baseline", "section 2"),
                             (r"^quality: fast", "the quality run of the fast configuration", "section 2")],
    "10_optimizers_and_normalization": [(r"^adam$", "the Adam run", S), (r"^sgd$", "the SGD run", S)],
}
TIMED = ("median_ms", "images_per_s")
# Rows that measure something other than a step time (they carry their own numbers instead).
UNTIMED: dict[str, list[str]] = {"09c_nothing_given_up": [r"^quality: "]}


@dataclass
class Report:
    notebook: str
    problems: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        head = f"{self.notebook}: {'complete' if self.ok else plural(len(self.problems), 'problem')}"
        return "\n".join([head] + [f"  ok      {c}" for c in self.checked] + [f"  MISSING {p}" for p in self.problems])


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _first_line(cell: dict) -> str:
    line = next((ln for ln in _source(cell).splitlines() if ln.strip() and not ln.lstrip().startswith("#")), "")
    return line.strip()[:70]


def _section(cells: list[dict], index: int) -> str:
    """', in section "<heading>"': the last markdown heading above cell ``index``, or ''."""
    for cell in reversed(cells[:index + 1]):
        if cell.get("cell_type") == "markdown":
            heads = [ln.lstrip("#").strip() for ln in _source(cell).splitlines() if ln.startswith("#")]
            if heads:
                return f', in section "{heads[-1][:60]}"'
    return ""


def _drawn_in(cells: list[dict], figure: str) -> str:
    """Where the notebook saves ``figure``: ' (the cell that saves it is cell N, in section "...": run it again)',
    or ''."""
    for i, cell in enumerate(cells):
        if cell.get("cell_type") == "code" and figure in _source(cell):
            where = _section(cells, i)
            return f" (the cell that saves it is cell {i}{where}: run it again)" if where else f" (cell {i} saves it)"
    return ""


def _parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    t = datetime.fromisoformat(text)
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def grade(notebook: str, *, results: Path | None = None, figures: Path | None = None, since: str | None = None,
          executed: Path | None = None) -> Report:
    """Check one notebook's run; ``notebook`` is its stem ("03_batch_size") or a prefix ("03")."""
    import pandas as pd

    from .paths import figures_dir
    from .results import load, results_dir
    from .series import declared_figures, list_notebooks, select

    matches = [nb for nb in select([notebook]) if nb.stem == notebook or nb.name.split("_")[0] == notebook]
    if len(matches) != 1:
        names = ", ".join(nb.stem for nb in list_notebooks())
        raise ValueError(f"no single notebook is {notebook!r}; give one of: {names} (or its number, e.g. 03b)")
    nb = matches[0]
    report = Report(nb.stem)
    start = _parse_time(since)
    results = Path(results) if results is not None else results_dir()
    figures = Path(figures) if figures is not None else figures_dir()

    expected = EXPECTED.get(nb.stem, [])
    on_gpu = False  # whether the run's rows name a GPU: then the figures only a GPU writes are due too
    csv = results / f"{nb.stem}.csv"
    if expected:
        if not csv.exists() or csv.stat().st_size == 0:
            writers = sorted({section for *_, section in expected})
            report.problems.append(f"results: {csv} is missing or empty: run the notebook to the end ("
                                   f"{' and '.join(writers)} {'writes' if len(writers) == 1 else 'write'} the rows)")
        else:
            df = load(csv)
            if start is not None and "timestamp" in df:
                stamps = pd.to_datetime(df["timestamp"], utc=True, errors="coerce")
                df = df[stamps >= pd.Timestamp(start)]
            on_gpu = any(str(d).strip() and str(d) != "nan" and not str(d).startswith("CPU")
                         for d in df.get("device_name", []))
            used: set[int] = set()
            for pat, what, section in expected:
                hit = [i for i, v in df["variant"].astype(str).items() if re.search(pat, v) and i not in used]
                if not hit:
                    report.problems.append(f"results: {what} ({section}) is not in {csv.name}" + (f" since {since}" if since else "")
                                           + f" (no row whose variant matches {pat!r}"
                                           + (", other than the rows already counted)" if used else ")"))
                    continue
                i = hit[-1]  # the newest
                used.add(i)
                row = df.loc[i]
                unlabelled = [c for c in ("device_name", "torch_version") if not str(row.get(c, "") or "").strip()
                              or str(row.get(c)) == "nan"]
                if unlabelled:
                    report.problems.append(f"results: row {row['variant']!r} has no {' and no '.join(unlabelled)}")
                    continue
                # a timed notebook's rows carry their timings (07 and 10 write other measures)
                timed = not any(re.search(u, str(row["variant"])) for u in UNTIMED.get(nb.stem, []))
                missing = [c for c in TIMED if timed and c in df.columns and df[c].notna().any() and pd.isna(row.get(c))]
                if missing:
                    report.problems.append(f"results: row {row['variant']!r} has no {', '.join(missing)}")
                    continue
                report.checked.append(f"row {row['variant']!r} on {row['device_name']} (torch {row['torch_version']})")
            # every other row too: a notebook writes optional rows (09's stages, 09b's suspects, 03's sizes) that no
            # pattern names, and each of their numbers needs its device as much as the required ones do
            others = df.drop(index=list(used))
            bare = [str(v) for v, *labels in zip(others["variant"], *(others[c] if c in others else [""] * len(others)
                                                                       for c in ("device_name", "torch_version")))
                    if any(not str(x or "").strip() or str(x) == "nan" for x in labels)]
            if bare:
                report.problems.append(f"results: {plural(len(bare), 'other row')} without a device or torch version "
                                       f"(first: {bare[0]!r}): each measured number names the machine it ran on")
            elif len(others):
                report.checked.append(f"{plural(len(others), 'other row')}, each labelled with its device and torch version")

    cells = json.loads(nb.read_text()).get("cells", [])
    for name in declared_figures(nb, gpu=on_gpu):
        path = figures / name
        if not path.exists():
            report.problems.append(f"figure: {path} was not written" + _drawn_in(cells, name))
        elif start is not None and datetime.fromtimestamp(path.stat().st_mtime, timezone.utc) < start:
            report.problems.append(f"figure: {path} is older than {since}: this run did not write it")
        else:
            report.checked.append(f"figure {name}")

    if executed is not None:
        book = json.loads(Path(executed).read_text())
        errors = [(i, o.get("ename", "error"), c) for i, c in enumerate(book.get("cells", [])) for o in c.get("outputs", [])
                  if o.get("output_type") == "error"]
        if errors:
            i, ename, cell = errors[0]
            report.problems.append(f"executed notebook {executed}: {plural(len(errors), 'cell')} ended in an error; the "
                                   f"first: cell {i}{_section(book.get('cells', []), i)}, {ename}, in the cell that "
                                   f"begins {_first_line(cell)!r}")
        else:
            report.checked.append(f"executed notebook {Path(executed).name}: no errors")
    return report


def _executed_for(notebook: str, paths: list[Path] | None, count: int) -> Path | None:
    """The executed copy of ``notebook`` among ``paths``: the one whose file name starts with its number and an
    underscore ("03_", "03b_"); the only one when one notebook is checked. None where no path is
    that notebook's: one notebook's errors are never reported under another's."""
    if not paths:
        return None
    prefix = notebook.split("_")[0]
    mine = [p for p in paths if p.name.startswith(prefix + "_")]
    if len(mine) > 1:
        raise ValueError(f"several executed copies match {notebook}: {', '.join(map(str, mine))}")
    if mine:
        return mine[0]
    if count == 1 and len(paths) == 1:
        return paths[0]
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpm_core.grade", description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="+", help="notebook numbers or names, e.g. 03 03b 09_putting_it_together")
    p.add_argument("--results", type=Path, default=None,
                   help="folder of the results CSVs (default: $DDPM_RESULTS_DIR, else data/results)")
    p.add_argument("--figures", type=Path, default=None, help="folder of the figures (default: data/figures/, where runs write them, or $DDPM_FIGURES_DIR)")
    p.add_argument("--since", default=None, help="only rows and figures written after this time (ISO 8601)")
    p.add_argument("--executed", type=Path, nargs="+", default=None,
                   help="executed copies of the notebooks to check for errors, one per notebook (matched by name: "
                        "03_batch_size.ipynb, or any file when one notebook is checked)")
    args = p.parse_args(argv)
    try:
        if args.since:
            _parse_time(args.since)
        reports = []
        for n in args.notebooks:
            executed = _executed_for(n, args.executed, len(args.notebooks))
            reports.append(grade(n, results=args.results, figures=args.figures, since=args.since, executed=executed))
            if args.executed and executed is None:  # copies were given, none of them this notebook's
                reports[-1].problems.append(f"executed notebook: none of the copies given is {reports[-1].notebook}'s "
                                            f"(its file name starts with {n.split('_')[0] + '_'!r})")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in reports:
        print(r.text())
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
