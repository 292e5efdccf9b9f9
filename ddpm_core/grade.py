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
- with ``--executed <notebook.ipynb>``: no cell of the executed copy ended in an error.

It prints one line per problem, names what is missing, and exits 1 when anything is; 0 when the
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

# The rows each measuring notebook must write (regular expressions on the ``variant`` column),
# in both modes. Notebooks that measure nothing (00, 01) have none.
EXPECTED: dict[str, list[str]] = {
    "02_profile_the_baseline": [r"^baseline$", r"^loss read every step$", r"^loss read once per \d+ steps$"],
    "03_batch_size": [r"^batch \d+$", r"^batch \d+$"],
    "03b_memory": [r"^no checkpointing$", r"^activation checkpointing$"],
    "04_torch_compile": [r"^eager$", r"^compile default$"],
    "05_sdpa_attention": [r"^math", r"^sdpa"],
    "06_mixed_precision": [r"^fp32$", r"^(bf16|fp16)$"],  # fp16 alone on a GPU without bf16 hardware (a T4)
    "07_data_loading": [r"0 workers \(baseline\)$", r"^device-resident"],
    "08_multi_gpu": [r"^1 processes$", r"^\d+ processes$"],
    "09_putting_it_together": [r"^baseline", r"^\+ batch \d+$"],
    "09b_the_fastest_step": [r"^ours \(baseline\)$", r"^ours \(fast\)$", r"^measured ceiling", r"^quality: baseline",
                             r"^quality: fast"],
    "10_optimizers_and_normalization": [r"^adam$", r"^sgd$"],
}
TIMED = ("median_ms", "images_per_s")
# Rows that measure something other than a step time (they carry their own numbers instead).
UNTIMED: dict[str, list[str]] = {"09b_the_fastest_step": [r"^quality: "]}


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

    patterns = EXPECTED.get(nb.stem, [])
    on_gpu = False  # whether the run's rows name a GPU: then the figures only a GPU writes are due too
    csv = results / f"{nb.stem}.csv"
    if patterns:
        if not csv.exists() or csv.stat().st_size == 0:
            report.problems.append(f"results: {csv} is missing or empty: run the notebook to the end (its Summary "
                                   f"section writes the rows)")
        else:
            df = load(csv)
            if start is not None and "timestamp" in df:
                stamps = pd.to_datetime(df["timestamp"], utc=True, errors="coerce")
                df = df[stamps >= pd.Timestamp(start)]
            on_gpu = any(str(d).strip() and str(d) != "nan" and not str(d).startswith("CPU")
                         for d in df.get("device_name", []))
            used: set[int] = set()
            for pat in patterns:
                hit = [i for i, v in df["variant"].astype(str).items() if re.search(pat, v) and i not in used]
                if not hit:
                    report.problems.append(f"results: no row whose variant matches {pat!r} in {csv.name}"
                                           + (f" since {since}" if since else ""))
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

    for name in declared_figures(nb, gpu=on_gpu):
        path = figures / name
        if not path.exists():
            report.problems.append(f"figure: {path} was not written")
        elif start is not None and datetime.fromtimestamp(path.stat().st_mtime, timezone.utc) < start:
            report.problems.append(f"figure: {path} is older than {since}: this run did not write it")
        else:
            report.checked.append(f"figure {name}")

    if executed is not None:
        book = json.loads(Path(executed).read_text())
        errors = [o.get("ename", "error") for c in book.get("cells", []) for o in c.get("outputs", [])
                  if o.get("output_type") == "error"]
        if errors:
            report.problems.append(f"executed notebook {executed}: {plural(len(errors), 'cell')} ended in an error ({errors[0]})")
        else:
            report.checked.append(f"executed notebook {Path(executed).name}: no errors")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpm_core.grade", description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="+", help="notebook numbers or names, e.g. 03 03b 09_putting_it_together")
    p.add_argument("--results", type=Path, default=None, help="folder of the results CSVs (default: data/results)")
    p.add_argument("--figures", type=Path, default=None, help="folder of the figures (default: figures/ or $DDPM_FIGURES_DIR)")
    p.add_argument("--since", default=None, help="only rows and figures written after this time (ISO 8601)")
    p.add_argument("--executed", type=Path, default=None, help="an executed copy of the notebook to check for errors")
    args = p.parse_args(argv)
    try:
        if args.since:
            _parse_time(args.since)
        reports = [grade(n, results=args.results, figures=args.figures, since=args.since, executed=args.executed)
                   for n in args.notebooks]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in reports:
        print(r.text())
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
