"""The reference run: every notebook in full mode on a real GPU, committed under ``data/reference/<gpu>/``.

    make reference                               # = python -m ddpm_core.reference run
    python -m ddpm_core.reference run --parts nb-04        # one part (each fits an 8-minute command)
    python -m ddpm_core.reference pack FOLDER    # the whole folder into FOLDER.tar.gz (<= 15 MB)
    python -m ddpm_core.reference unpack data/reference/h100-80gb-hbm3.tar.gz

``run`` goes in parts (``PARTS``), each at most 8 minutes on one H100, and is resumable: a part
already done is skipped (``--force`` redoes it). After every notebook part the folder is whole
(its result rows merged into results.csv, its traces trimmed into traces/), so the scratch folder
``_work`` never has to travel: a run can go on in another command, on another machine, in another
session, from the committed folder alone. ``--archive-to DIR`` packs into DIR after every part what
this run added to the folder (the files new or changed since it started, and a DELTA.json naming
what it started from; the whole folder where that was empty), so a command killed at its time
limit still returns the parts it finished, and an archive holds one command's work however big
the reference grows (``unpack`` extracts it over the folder it started from). ``--keep-going``
runs the remaining parts after one fails (a shakedown of every notebook's GPU branches in one
command: ``run --smoke --keep-going``). ``scripts/gpu_call.sh`` is one device command.
Without a GPU the same command runs everything in smoke mode and writes a complete folder of the
same layout, which the test suite checks.

Layout of one reference folder::

    meta.json          GPU name and memory, driver, CUDA, cuDNN, torch, python, date, git commit, mode
    parts.json         each part's status, wall seconds and error
    tests.log          the output of the ``gpu``-marked tests that are not ``slow`` (pytest -m "gpu and not slow")
    tests-slow.log     the output of the ``gpu`` and ``slow`` ones: those that compile (CUDA graphs)
    tests-autotune.log the output of the ``gpu`` and ``autotune`` one: a training run compiled with max-autotune
    results.csv        every notebook's measurement rows (columns: see data/README.md)
    notebooks/         the executed notebooks, with their outputs
    figures/           the figures of the run, titled with its device
    traces/<name>/     trimmed profiler traces (rank<R>.pt.trace.json.gz), one folder per captured run

Notebooks show it with ``show(notebook, traces=[...])``: an "On <GPU> (reference run, not this
machine)" block beside their own numbers.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import io
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from .paths import REPO_ROOT, committed_figures_dir, figures_dir
from .text import plural

REFERENCE_DIR = REPO_ROOT / "data" / "reference"
# one device command is at most 10 minutes; keep 2 in hand. A detached run (scripts/gpu_call.sh --detach) outlives
# one command and gives each notebook its whole deadline through DDPM_PART_BUDGET_S.
PART_BUDGET_S = int(os.environ.get("DDPM_PART_BUDGET_S") or 8 * 60)
# A cell's limit in a smoke run, which has no device session to fit: the test suite's, two parts side by side beside
# the other tests on 2 cores, took 353 s for 04's cold compile of the tiny model (133 s alone).
SMOKE_CELL_TIMEOUT_S = 1500
ARCHIVE_LIMIT_BYTES = 15 * 2**20
# A run that packs after every part (``--archive-to``) closes an archive once it holds this much and starts the next
# one from there, so that no archive holds more than this plus one part (nb-02's traces are several MB), and a part
# too big to pack loses only its own archive. A device command returns at most 8 files.
SEGMENT_BYTES = 4 * 2**20
TRACE_STEPS = 3  # ProfilerSteps kept per trimmed trace (HTA drops the last one)
WORK = "_work"  # scratch inside the folder (runs, per-notebook results): never packed or committed
BASE_MANIFEST = "base-manifest.json"  # in WORK: the folder's files as a run found them, what its archives leave out
DELTA = "DELTA.json"  # at the top of an archive that holds only what one run added: never extracted, never packed
NOTEBOOK_PARTS: dict[str, list[str]] = {  # grouped so that each part fits PART_BUDGET_S on one H100
    # Sized from an estimate read off the code (2026-11-27: cells, steps, compiles, processes) against notebook 01's
    # H100 timings, after the full-mode trims of that day: about 6 minutes at most per part, so that two parts fit
    # one 15-minute device session. Only nb-00-01 has been timed (507 s).
    "nb-00-01": ["00", "01"],  # 01 trains the paper's model for 4 minutes (TRAIN_SECONDS) and samples 1000 steps
    "nb-02": ["02"],  # ~4.5 min: cuDNN autotuning in 6 fresh processes, the profiles, the sync demo
    "nb-03": ["03"],  # ~5 min: the sweep to out of memory, cuDNN at both ends in fresh processes, Exercise 3's trainings
    "nb-03b": ["03b"],  # ~2 min: largest-batch searches
    "nb-04": ["04"],  # ~5-7 min: default and reduce-overhead compiled cold, then CUDA graphs at batch 32 (Exercise 1)
    "nb-05-06": ["05", "06"],  # ~2 + ~3.5 min
    "nb-07": ["07"],  # ~4.5 min: 07 compiles its step, and builds every loader afresh in each of its interleaved rounds
    "nb-08": ["08"],  # ~3.5 min on one GPU: DDP in gloo CPU processes (torchrun launches)
    "nb-09": ["09"],  # ~5 min: ten stages, the last two compiled
    # 09b's quality runs went into a notebook of their own (09c): on the H200, cold compiles of the paper's model took
    # 76 s each, and 09b's five compiles with the quality runs came close to a whole session's window (2026-11-29)
    "nb-09b": ["09b"],  # ~7.5 min: the peers (their wheels: scripts/gpu_wheels.sh), five compiles, the ceiling, three profiles
    "nb-09c": ["09c"],  # ~3.5 min: three fp32 runs of 120 steps, the fast run (one cold compile), two sample grids
    "nb-10": ["10"],  # ~5 min: 10 trainings of 100 fp32 steps
}
# The gpu tests in two parts: on the H100 (2026-11-26) one cold reduce-overhead compile of the tiny model took 55 s
# and the max-autotune test ran past 160 s, so all of them together do not fit one part.
# The max-autotune one (estimated at 3-5 minutes alone) goes in a third part, for a session with minutes to spare.
GPU_TEST_PARTS = {"gpu-tests": ("gpu and not slow", "tests.log"),
                  "gpu-tests-slow": ("gpu and slow and not autotune", "tests-slow.log"),
                  "gpu-tests-autotune": ("gpu and autotune", "tests-autotune.log")}
# One gpu test's limit, where pytest-timeout is installed (the GPU image has it): a test that hangs (a CUDA graph's
# capture, a process group waiting for a peer) then fails alone, and the rest of its part and the parts after it still
# run, instead of the hang holding the part, and the session's minutes, until PART_BUDGET_S. Each is several times
# the slowest test of its part seen or estimated (a cold reduce-overhead compile of the tiny model: 55 s on the H100).
GPU_TEST_TIMEOUT_S = {"gpu-tests": 150, "gpu-tests-slow": 300, "gpu-tests-autotune": 600}
PARTS = ["meta", *GPU_TEST_PARTS, *NOTEBOOK_PARTS, "pack"]
# The order in which ``--parts next`` takes the parts a folder has not done yet. GPU time comes rarely and briefly
# (one task in about forty has drawn a GPU, for 15 minutes), so a session should spend it where the issues need it
# most: 09 (every stage on the GPU: the README's GPU table) and 09b (the fastest step against the peers and the
# ceiling, and the suspects in its trace: issue 12's evidence) with 09c (the fast step's quality against the
# baseline's seed band: the rest of that evidence), then the fast GPU tests ("GPU paths that work"; they ran on the
# H200, two failed and were fixed: short and predictable, they fit beside any part), then the notebooks that teach
# one technique each. 09b goes before the tests because its length is only estimated: first, it gets the whole of a
# run's deadline, and 09c (about 3.5 minutes) fits what 09b leaves of a session's window. 00-01 comes
# late: the H100's run committed its figures (a 4-minute training of the paper's model), and another GPU of the same
# compute adds little. nb-08 is last but the autotune test: on one GPU its DDP runs are CPU processes (_skip_reason).
PRIORITY = ["meta", "nb-09", "nb-09b", "nb-09c", "gpu-tests", "nb-02", "nb-03", "nb-04", "nb-05-06", "nb-03b", "nb-07",
            "nb-10", "gpu-tests-slow", "nb-00-01", "nb-08", "gpu-tests-autotune"]
NEXT = "next"  # a --parts word: every part of PRIORITY the folder has not done, in that order
# Seconds each part is expected to take in full mode on one H100 or H200: nb-00-01 as measured there (2026-11-26), the
# others estimated from the code as NOTEBOOK_PARTS' comments say. A part measured in a committed full reference
# (parts.json) is estimated by the longest such measurement instead (part_estimate_s).
PART_ESTIMATE_S = {"meta": 1, "gpu-tests": 150, "gpu-tests-slow": 280, "gpu-tests-autotune": 300, "nb-00-01": 507,
                   "nb-02": 270, "nb-03": 300, "nb-03b": 120, "nb-04": 390, "nb-05-06": 330, "nb-07": 270, "nb-08": 210,
                   "nb-09": 300, "nb-09b": 450, "nb-09c": 210, "nb-10": 300, "pack": 10}
# When a full run must end, in seconds since the epoch (scripts/gpu_call.sh sets it from its deadline): a part whose
# estimate does not fit the time left is not started, and a shorter one after it may be. A part cut off by the deadline
# is redone from its start (only the rows and executed copy it had written are kept), so on a machine lent for minutes,
# starting one that cannot end wastes them.
DEADLINE_ENV = "DDPM_RUN_DEADLINE"
# A file holding the time of the run's SIGINT, which a later command may move (scripts/gpu_call.sh --attach); where it
# is set it wins over DEADLINE_ENV, read before each part, with PACK_MARGIN_S kept for packing.
DEADLINE_FILE_ENV = "DDPM_RUN_DEADLINE_FILE"
PACK_MARGIN_S = 20


def run_deadline() -> float | None:
    """When a full run must have ended its parts, in seconds since the epoch, or None (no deadline: a run by hand)."""
    path = os.environ.get(DEADLINE_FILE_ENV)
    if path:
        try:
            return float(Path(path).read_text().strip()) - PACK_MARGIN_S
        except (OSError, ValueError):
            pass  # unreadable: the fixed deadline, if any
    return float(os.environ.get(DEADLINE_ENV) or 0) or None
SELF_ENV = "DDPM_REFERENCE_SELF"  # set while the reference run executes the notebooks
IS_REFERENCE = "This executed copy is the reference run itself"  # how self_line() begins, whatever the machine


def self_line() -> str:
    """What a notebook's reference block says inside the reference run: it is the reference, made where and how.

    A smoke-mode or GPU-less reference (the test suite's stand-in) says it holds no GPU numbers: its block sits
    under a heading about the reference GPU, and "everything above was measured there" must not read as a GPU run.
    """
    import torch

    from .env import device_name

    where = device_name()
    if os.environ.get("DDPM_SMOKE") == "1" or not torch.cuda.is_available():
        mode = "smoke mode" if os.environ.get("DDPM_SMOKE") == "1" else "full mode"
        return (f"{IS_REFERENCE}, made in {mode} on {where}: a stand-in made without a GPU (the test suite makes "
                "one), so it shows no GPU numbers. Copies of this notebook run elsewhere show the committed GPU "
                "reference in this place.")
    return (f"{IS_REFERENCE}, made in full mode on {where}: everything above was measured there. Copies of this "
            "notebook run elsewhere show its numbers in this place.")
NO_REFERENCE = ("No reference GPU run is committed in data/reference/ yet: run `make reference` on a GPU "
                "machine (README, 'Reference run').")
# Under HTA's idle-time table: why a stream's idle can exceed the GPU's idle of the temporal breakdown
IDLE_PER_STREAM = ("<small>Idle time per stream (HTA's idle-time analysis): the gaps between one stream's kernels, "
                   "split by why. The temporal breakdown below counts the GPU's idle time over the profiled steps, "
                   "all streams together. The two count differently (one stream's gaps against the whole GPU's, over "
                   "spans HTA sets for each), so their totals need not agree, either way.</small>")
RESULT_COLUMNS = [("variant", "variant"), ("batch_size", "batch"), ("precision", "precision"),
                  ("median_ms", "ms/step"), ("p10_ms", "p10 ms"), ("p90_ms", "p90 ms"), ("images_per_s", "img/s"),
                  ("tflops", "TFLOP/s"), ("mfu", "MFU"), ("mfu_bf16", "MFU vs bf16 peak"),
                  ("peak_memory_gib", "peak memory (GiB)"), ("memory_kind", "memory measured")]


# ------------------------------------------------------------------------------ reading
def reference_dir() -> Path:
    """Where reference folders live: $DDPM_REFERENCE_DIR if set, else <repo>/data/reference."""
    return Path(os.environ.get("DDPM_REFERENCE_DIR") or REFERENCE_DIR)


def reference_runs(root: Path | None = None) -> list[Path]:
    """The reference folders that hold a meta.json, by name."""
    root = Path(root) if root is not None else reference_dir()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / "meta.json").is_file())


def notebook_seconds(folder: Path, notebook: str) -> float | None:
    """How long ``notebook`` ran in the reference run in ``folder`` (from parts.json), or None."""
    path = Path(folder) / "parts.json"
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    for part in status.values():
        if isinstance(part, dict) and notebook in part.get("notebooks", {}):
            return float(part["notebooks"][notebook])
    return None


def cut_off_seconds(folder: Path, notebook: str) -> float | None:
    """How long ``notebook`` had run when the reference run in ``folder`` cut it off at its deadline (parts.json:
    an interrupted part's ``cut_in``), or None where it was not cut off."""
    try:
        status = json.loads((Path(folder) / "parts.json").read_text())
    except (OSError, ValueError):
        return None
    for part in status.values():
        if isinstance(part, dict) and part.get("status") == "interrupted" and part.get("cut_in") == notebook:
            return float(part.get("cut_after_s") or 0)
    return None


def meta(folder: Path) -> dict:
    """A reference folder's meta.json (device_name, torch_version, ...)."""
    return json.loads((Path(folder) / "meta.json").read_text())


def device_words(m: dict, folder: Path | str = "?") -> str:
    """The reference's GPU as a reader should see it: "NVIDIA H100 80GB HBM3", or "..., capped at 16 GiB" for a
    smaller card rehearsed on it (DDPM_GPU_MEMORY_GB)."""
    cap = m.get("gpu_memory_cap_gib")
    return (str(m.get("device_name", Path(folder).name)) + (f", capped at {float(cap):g} GiB" if cap else "")
            + (", bf16 off" if m.get("gpu_bf16_off") else ""))


def label(folder: Path) -> str:
    """"reference: NVIDIA H100 80GB HBM3 · torch 2.x · <date>" for figure titles."""
    m = meta(folder)
    parts = [f"reference: {device_words(m, folder)}", f"torch {m.get('torch_version', '?')}"]
    if m.get("date"):
        parts.append(str(m["date"])[:10])
    if m.get("mode") == "smoke":
        parts.append("smoke mode")
    return " · ".join(parts)


def trace_dir(folder: Path, run: str) -> Path | None:
    """The trace folder of ``run`` (e.g. "02_baseline") in a reference folder, if it was committed."""
    d = Path(folder) / "traces" / run
    return d if d.is_dir() and any(d.glob("*.json*")) else None


def trace_names(folder: Path, patterns: Sequence[str]) -> list[str]:
    """The trace folders of a reference that match ``patterns`` (globs relative to its traces/)."""
    root = Path(folder) / "traces"
    found: list[str] = []
    for pat in patterns:
        for d in sorted(root.glob(pat)):
            name = d.relative_to(root).as_posix()
            if d.is_dir() and any(d.glob("*.json*")) and name not in found:
                found.append(name)
    return found


def results(folder: Path, notebook: str | None = None):
    """The reference's results.csv as a DataFrame (only ``notebook``'s rows when given)."""
    import pandas as pd

    path = Path(folder) / "results.csv"
    if not path.exists():
        return pd.DataFrame()
    df = pd.read_csv(path, keep_default_na=False, na_values=[""])
    if notebook is not None and "notebook" in df:
        df = df[df["notebook"].astype(str) == notebook]
    return df


def peak_gib(folder: Path, notebook: str, variant: str, batch_size: int, precision: str) -> tuple[float, str] | None:
    """The peak memory (GiB) and what it measured (``memory_kind``) of one result row of ``notebook`` in a reference
    folder: the row of ``variant`` at ``batch_size`` in ``precision``; None where the run has no such row."""
    rows = results(folder, notebook)
    if not len(rows) or "peak_memory_gib" not in rows:
        return None
    match = rows[(rows["variant"] == variant) & (rows["batch_size"] == batch_size) & (rows["precision"] == precision)]
    if not len(match) or match["peak_memory_gib"].isna().iloc[0]:
        return None
    return float(match["peak_memory_gib"].iloc[0]), str(match["memory_kind"].iloc[0])


def _result_table(df):
    cols = [(c, n) for c, n in RESULT_COLUMNS if c in df and df[c].notna().any()]
    out = df[[c for c, _ in cols]].rename(columns=dict(cols)).reset_index(drop=True)
    for name in ("MFU", "MFU vs bf16 peak"):
        if name in out:
            out[name] = out[name].map(lambda v: None if v != v else f"{100 * float(v):.1f}%")
    from ddpm_core.bench import readable

    return readable(out.round(3))  # a missing value says n/a


def show(notebook: str, *, traces: Sequence[str] = (), figures: Sequence[str] | None = None) -> bool:
    """Show the committed reference GPU run(s) for ``notebook`` (e.g. "03_batch_size") in a notebook.

    For each reference folder: a heading "On <GPU> (reference run, not this machine)", the
    notebook's result rows, HTA's temporal / idle / kernel / launch analyses of the reference
    traces matching ``traces`` (their charts saved as ``<NN>_reference_<trace>_<kind>.png``), and
    the notebook's own figures from that run (``figures``: default, those it declares). Returns
    whether anything was shown; with no reference it prints one line saying how to make one.
    """
    from IPython.display import Image, Markdown, display

    from . import plots
    from . import traces as tr

    if os.environ.get(SELF_ENV) == "1":  # the H100 run's own copies said "no reference is committed yet"
        print(self_line())
        return False
    runs = reference_runs()
    if not runs:
        print(NO_REFERENCE)
        return False
    if figures is None:
        from .series import NOTEBOOKS_DIR, declared_figures

        nb_path = NOTEBOOKS_DIR / f"{notebook}.ipynb"
        figures = declared_figures(nb_path, gpu=True) if nb_path.exists() else []  # the reference ran on a GPU
    prefix = notebook.split("_")[0]  # "03", "03b"
    # A run made across several commands or sessions may not have reached this notebook: each run that has gets its
    # heading and block, and each that has not one line after them, not a heading with nothing under it.
    gaps = {folder: _not_reached(folder, notebook) for folder in runs}
    reached = [f for f in runs if gaps[f] is None]
    for folder in reached:
        m = meta(folder)
        ref_label = label(folder)
        mode = " in smoke mode (a stand-in made without a GPU)" if m.get("mode") == "smoke" else ""
        secs = notebook_seconds(folder, notebook)
        cut = cut_off_seconds(folder, notebook) if secs is None else None
        display(Markdown(
            f"### On {device_words(m, folder)} (reference run, not this machine)\n\n"
            f"Everything above this heading was measured on this machine. Everything below comes from the "
            f"reference run{mode} ({ref_label.removeprefix('reference: ')}), git commit `{str(m.get('git_commit') or '?')[:10]}`, "
            f"committed in `data/reference/{folder.name}/`."
            + (f" This notebook ran for **{secs / 60:.1f} min** there{mode or ' in full mode'}." if secs is not None else "")
            + (f" That run's deadline **cut this notebook off after {cut / 60:.1f} min**: the rows below are those of "
               "the sections it finished, and its executed copy there ends where it was cut; a later GPU session "
               "runs it again." if cut is not None else "")))
        rows = results(folder, notebook)
        if len(rows):
            display(_result_table(rows))
        for name in trace_names(folder, traces):
            try:
                rep = tr.analyze(folder / "traces" / name, verbose=False)
            except Exception as e:  # noqa: BLE001 - a damaged reference trace must not stop the notebook
                print(f"reference trace {name}: cannot be read ({type(e).__name__}: {e})")
                continue
            stem = f"{prefix}_reference_{name.replace('/', '_')}"
            display(Markdown(f"**Trace `{name}`** ({'GPU' if rep.has_gpu else 'CPU only'}, ranks {rep.ranks})"))
            if rep.has_gpu:  # kernels by what they do (HTA's own types only split computation from memory)
                temporal = rep.table("temporal")
                kinds = rep.kernel_kinds if rep.kernel_kinds is not None else rep.table("kernels")
                for what in ("idle", "launch_summary"):
                    df = rep.table(what)
                    if df is not None:
                        display(df)
                        if what == "idle":  # per stream, against the temporal table's whole-GPU idle below
                            display(Markdown(IDLE_PER_STREAM))
                title = "GPU time: compute, non-compute, idle (HTA)"
            else:
                temporal, kinds = rep.cpu_temporal, tr.op_categories(rep.cpu_ops)
                title = "CPU main thread: compute ops, other ops, outside ops (no GPU in this trace)"
            if temporal is not None and len(temporal):
                display(tr.per_rank(temporal))
                fig = plots.temporal_breakdown(temporal, label=ref_label, title=f"{name}: {title}")
                plots.savefig(fig, f"{stem}_temporal.png", source=ref_label, mode=m.get("mode"))
                plots.plt.show()
            if kinds is not None and len(kinds):
                fig = plots.kernel_breakdown(kinds, label=ref_label, title=f"{name}: " + (
                    "GPU kernel time by kind (HTA's per-kernel sums)" if rep.has_gpu else "CPU operator self time by kind"))
                plots.savefig(fig, f"{stem}_kernels.png", source=ref_label, mode=m.get("mode"))
                plots.plt.show()
        for fig_name in figures:
            path = folder / "figures" / fig_name
            if path.exists():
                display(Markdown(f"`{fig_name}` from the reference run:"))
                display(Image(filename=str(path)))
    for folder in runs:
        if gaps[folder] is not None:
            display(Markdown(f"The reference run on {device_words(meta(folder), folder)} "
                             f"(`data/reference/{folder.name}/`) {gaps[folder]}"
                             + (": its GPU numbers for this notebook will appear here once it has." if
                                gaps[folder].startswith("has not") else ": nothing here comes from it.")))
    return True


def _not_reached(folder: Path, notebook: str) -> str | None:
    """Why the reference run in ``folder`` shows nothing for ``notebook`` ("has not reached this notebook yet (parts
    done: ...)", "left this notebook out: <reason>"), or None where it ran it (or keeps no parts.json: a whole run)."""
    if notebook_seconds(folder, notebook) is not None or not (folder / "parts.json").exists():
        return None
    if cut_off_seconds(folder, notebook) is not None and len(results(folder, notebook)):
        return None  # cut off at the run's deadline after some of its sections: show shows what they measured
    prefix = notebook.split("_")[0]
    parts = json.loads((folder / "parts.json").read_text())
    done = [p for p, v in parts.items() if isinstance(v, dict) and v.get("status") == "done"]
    own = next((v for p, v in parts.items() if prefix in NOTEBOOK_PARTS.get(p, [])), None)
    if isinstance(own, dict) and own.get("status") == "skipped":
        return f"left this notebook out: {own.get('reason', '?')}"
    return f"has not reached this notebook yet (parts done: {', '.join(done) or 'none'})"


# A line of a reference notebook's own output that the README quotes under its status table (so that the README's
# GPU sentences are the run's printed words, never retyped): notebook -> a regular expression for the line.
HEADLINES = {"01_build_the_ddpm": r"^fastest eager configuration: .* per step on average.*$"}


def headlines(folder: Path) -> dict[str, str]:
    """The HEADLINES lines that the executed notebooks in ``folder`` printed, by notebook."""
    found = {}
    for name, pattern in HEADLINES.items():
        path = Path(folder) / "notebooks" / f"{name}.ipynb"
        if not path.exists():
            continue
        for cell in json.loads(path.read_text())["cells"]:
            text = "".join("".join(o.get("text", "")) for o in cell.get("outputs", []) if o.get("output_type") == "stream")
            if hit := re.search(pattern, text, flags=re.M):
                found[name] = hit.group(0).strip()
                break
    return found


STAGES_NOTEBOOK = "09_putting_it_together"


def _comparison_from_rows(rows):
    """``bench.Comparison`` rebuilt from result rows (the first row the baseline), and its measurements in row order.

    The machine's load, which a row does not keep, is the notebook's own to report: the rebuilt comparison counts the
    machine as quiet, and judges each pair by the rows' p10-p90 ranges and timed calls alone."""
    from .bench import Comparison, Measurement, Noise

    def measurement(r) -> Measurement:
        v = r.get("iters")
        return Measurement(name=str(r["variant"]), device=str(r.get("device", "")), device_name=str(r.get("device_name", "")),
                           torch_version=str(r.get("torch_version", "")), batch_size=int(r["batch_size"]),
                           iters=int(v) if v == v and v is not None else 10**6,  # no column: not held to MIN_TIMED
                           first_ms=float("nan"), median_ms=float(r["median_ms"]), p10_ms=float(r["p10_ms"]),
                           p90_ms=float(r["p90_ms"]), images_per_s=float(r["images_per_s"]), peak_memory_bytes=None,
                           memory_kind="")

    ms = [measurement(r) for _, r in rows.iterrows()]
    spreads = {m.name: (m.p90_ms - m.p10_ms) / m.median_ms for m in ms}
    return ms, Comparison(ms, Noise(cores=1, load_1min=0.0, other_cpu_share=0.0, spreads=spreads, threads=0))


def stages_markdown(folder: Path) -> str:
    """The README's GPU table: notebook 09's stages from a reference's results.csv ("" before 09 has run there).

    Each stage's img/s is compared with the first stage's by ``bench.Comparison.speedup`` itself, built from the
    rows; otherwise the cell says "noisy", as 09's table does. (The machine's load, which a row does not keep, is
    09's own to report: the rebuilt comparison counts the machine as quiet.)"""
    rows = results(folder, STAGES_NOTEBOOK)
    if not len(rows):
        return ""
    rows = rows.reset_index(drop=True)
    base = rows.iloc[0]
    ms, cmp = _comparison_from_rows(rows)

    lines = ["| stage | batch | precision | ms/step (p10-p90) | img/s | img/s vs the first stage | TFLOP/s | MFU | "
             "peak memory (GiB) |", "|---|---|---|---|---|---|---|---|---|"]
    for i, r in rows.iterrows():
        fold = cmp.speedup(ms[i])
        ratio = "noisy" if fold is None else f"{fold:.2f}x"  # "noisy": the word 09's own table uses
        mfu = f"{100 * float(r['mfu']):.1f}%" if "mfu" in r and r["mfu"] == r["mfu"] else "n/a"
        mem = f"{float(r['peak_memory_gib']):.2f}" if "peak_memory_gib" in r and r["peak_memory_gib"] == r["peak_memory_gib"] else "n/a"
        lines.append(f"| {r['variant']} | {int(r['batch_size'])} | {r['precision']} | {float(r['median_ms']):.1f} "
                     f"({float(r['p10_ms']):.1f}-{float(r['p90_ms']):.1f}) | {float(r['images_per_s']):,.0f} | {ratio} | "
                     f"{float(r['tflops']):.1f} | {mfu} | {mem} |")
    peaks = sorted({str(p) for p in rows.get("peak", []) if p == p and str(p)})
    kinds = sorted({str(k) for k in rows.get("memory_kind", []) if k == k and str(k)})
    notes = [f"MFU against {', '.join(peaks)}, by the stage's precision." if peaks else "No MFU: no datasheet peak for this device.",
             f"Memory: {'; '.join(kinds)}." if kinds else ""]
    return (f"Notebook 09's stages on {base.get('device_name', '?')} (from `results.csv`; a ratio only where the "
            f"per-image p10-p90 step times of the stage and the first stage lie apart, as in the notebook):\n\n"
            + "\n".join(lines) + "\n\n" + " ".join(n for n in notes if n))


PEERS_NOTEBOOK = "09b_the_fastest_step"
QUALITY_NOTEBOOK = "09c_nothing_given_up"


def _number(r, column: str) -> float | None:
    """``r[column]`` as a float, or None where the row has no number there."""
    v = r.get(column)
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if v == v else None


def peers_markdown(folder: Path) -> str:
    """The README's race: notebook 09b's contenders from a reference's results.csv and its measured ceiling ("" before
    09b has run there). A ratio against ours (baseline), and between ours (fast) and each
    peer at the same batch, only where ``bench.Comparison`` would state one (``_comparison_from_rows``)."""
    from .bench_peers import same_network

    rows = results(folder, PEERS_NOTEBOOK)
    if not len(rows) or "variant" not in rows:
        return ""
    rows = rows.drop_duplicates("variant", keep="last").reset_index(drop=True)  # a part rerun: its newest rows
    variant = rows["variant"].astype(str)
    race = rows[variant.str.startswith("ours (") | variant.isin(["diffusers", "lucidrains"])].reset_index(drop=True)
    if not len(race) or "ours (baseline)" not in set(race["variant"]):
        return ""
    race = race.reindex([race.index[race["variant"] == "ours (baseline)"][0]]
                        + [i for i in race.index if race.at[i, "variant"] != "ours (baseline)"]).reset_index(drop=True)
    ms, cmp = _comparison_from_rows(race)
    ceiling = rows[variant.str.startswith("measured ceiling")]
    ceil = ceiling.iloc[-1] if len(ceiling) else None
    ceil_tflops = _number(ceil, "ceiling_tflops") if ceil is not None else None
    lines = ["| contender | batch | precision | ms/step (p10-p90) | img/s | vs ours (baseline) | TFLOP/s | MFU | "
             "of the measured ceiling | peak memory (GiB) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in race.iterrows():
        tf, mfu, mem = _number(r, "tflops"), _number(r, "mfu"), _number(r, "peak_memory_gib")
        ratio = "1.00x" if i == 0 else cmp.factor(ms[i])
        same_net = same_network(str(r["variant"]), smoke=False)  # the README shows full-mode runs only
        of_ceil = (f"{100 * tf / ceil_tflops:.1f}%" if same_net and tf is not None and ceil_tflops else
                   "n/a (other network)" if not same_net else "n/a")
        lines.append(f"| {r['variant']} | {int(r['batch_size'])} | {r.get('precision', '')} | {float(r['median_ms']):.1f} "
                     f"({float(r['p10_ms']):.1f}-{float(r['p90_ms']):.1f}) | {float(r['images_per_s']):,.0f} | {ratio} | "
                     + (f"{tf:.1f}" if tf is not None else "n/a") + " | " + (f"{100 * mfu:.1f}%" if mfu is not None else "n/a")
                     + f" | {of_ceil} | " + (f"{mem:.2f}" if mem is not None else "n/a") + " |")
    said = []
    names = [m.name for m in ms]
    fast = next((m for m in ms if m.name == "ours (fast)"), None)
    for peer in ("diffusers", "lucidrains"):
        if fast is not None and peer in names:
            p = ms[names.index(peer)]
            said.append(f"ours (fast) against {peer} at batch {p.batch_size}: " + (
                cmp.verdict(fast, p) if p.batch_size == fast.batch_size else "not at the same batch"))
    if ceil is not None and ceil_tflops:
        parts = [f"{ceil_tflops:.1f} TFLOP/s in {ceil.get('precision', '?')}"]
        conv, mm, sheet = (_number(ceil, c) for c in ("conv_tflops", "matmul_tflops", "datasheet_tflops"))
        if conv is not None and mm is not None:
            parts.append(f"convolutions {conv:.1f}, a large matmul {mm:.1f}")
        if sheet is not None:
            parts.append(f"against the datasheet's {sheet:.1f}")
        said.append("The measured ceiling (the model's own convolution shapes and a large matmul, timed alone): "
                    + "; ".join(parts) + " (the share of it is for our network; the fp32 baseline's is of the same "
                    "16-bit yardstick, not a limit of its own)")
    base = race.iloc[0]
    return (f"Notebook 09b's race on {base.get('device_name', '?')} (from `results.csv`; each contender a whole training "
            "step in one process, interleaved; a ratio only where the per-image p10-p90 ranges lie apart, as in the "
            "notebook):\n\n" + "\n".join(lines) + ("\n\n" + ". ".join(said) + "." if said else ""))


def quality_markdown(folder: Path) -> str:
    """The README's line on notebook 09c's quality check in a reference's results.csv: the fast run against the
    baseline's seed band ("" before 09c has run there)."""
    rows = results(folder, QUALITY_NOTEBOOK)
    if not len(rows) or "variant" not in rows:
        return ""
    quality = rows[rows["variant"].astype(str).str.startswith("quality: fast")]
    if not len(quality):
        return ""
    q = quality.iloc[-1]  # a part rerun: its newest row
    inside, within = _number(q, "band_inside"), _number(q, "within_spread")
    passed = str(q.get("passed", "")).strip().lower()
    return (f"Notebook 09c's quality check on {q.get('device_name', '?')} (the fast run against the fp32 baseline's "
            f"seed band, {q.get('dataset', '?')}, {int(_number(q, 'steps') or 0)} steps of "
            f"{int(_number(q, 'batch_size') or 0)} images each): "
            + ("the check passed" if passed == "true" else "the check failed" if passed == "false" else "no verdict")
            + (f"; its smoothed loss within the seeds' spread of its same-seed twin at {within:.0%} of the judged steps"
               if within is not None else "")
            + (f", inside the band at {inside:.0%}" if inside is not None else "")
            + "; the notebook gives the whole verdict.")


def _last_stage_report(folder: Path):
    """HTA's report of 09's last stage in a reference folder's committed trace, or None (no such trace, or no GPU
    kernels in it)."""
    from . import traces as tr

    run = Path(folder) / "traces" / STAGES_NOTEBOOK / "final"
    if not run.is_dir():
        return None
    rep = tr.analyze(run, verbose=False)
    return rep if rep.has_gpu and rep.kernel_kinds is not None else None


def last_stage_kinds(root: Path | None = None):
    """Kernel time by kind (``traces.kernel_kinds``) of 09's last stage, from the newest reference run (by its date)
    whose trace of that stage is committed: ``(folder, table)``, or None where no reference run has one."""
    runs = sorted(reference_runs(root), key=lambda f: str(meta(f).get("date", "")), reverse=True)
    for folder in runs:
        rep = _last_stage_report(folder)
        if rep is not None:
            return folder, rep.kernel_kinds
    return None


def last_stage_trace_markdown(folder: Path) -> str:
    """Where the GPU time of 09's last stage goes, from its committed trace: GPU idle (HTA's temporal breakdown) and
    kernel time by kind (``traces.kernel_kinds``); "" where the trace is not committed or holds no GPU kernels."""
    rep = _last_stage_report(folder)
    if rep is None:
        return ""
    kinds = rep.kernel_kinds[rep.kernel_kinds["percentage"] >= 1]
    idle = (f"the GPU idle {float(rep.temporal['idle_time_pctg'].mean()):.1f}% of the profiled steps; "
            if rep.temporal is not None and len(rep.temporal) else "")
    return (f"Where the last stage's GPU time goes (its committed trace, `traces/{STAGES_NOTEBOOK}/final`, read with HTA): "
            + idle + "of the kernel time, " + ", ".join(f"{k} {p:.1f}%" for k, p in zip(kinds["kernel_type"], kinds["percentage"]))
            + ".")


def code_sha1(text: str) -> str:
    """The sha1 of a notebook's code cells (their sources, in order), from the notebook's JSON text: what decides what
    a run of it prints. Its markdown is left out, so that a text-only edit does not make a GPU session redo the part."""
    cells = json.loads(text).get("cells", [])
    code = [c.get("source", "") for c in cells if c.get("cell_type") == "code"]
    return hashlib.sha1(json.dumps(["".join(s) if isinstance(s, list) else s for s in code]).encode()).hexdigest()


def notebook_code_sha1(name: str) -> str | None:
    """``code_sha1`` of notebook ``name`` as it is now (None where there is no such notebook)."""
    from .series import NOTEBOOKS_DIR

    path = NOTEBOOKS_DIR / f"{name}.ipynb"
    return code_sha1(path.read_text()) if path.exists() else None


def stale_parts(status: dict) -> list[str]:
    """Done notebook parts whose notebooks' code cells changed since they ran: their executed copies show what older
    code printed. A change to the markdown alone does not count (the executed copy then shows the older text around
    the same outputs), nor does a change to ``ddpm_core``.

    A part records ``code_sha1`` of each notebook it ran, which needs no git (the GPU machine's copy of the repo may
    have none). Parts recorded before that are checked with git against the commit they ran at; where git or that
    commit is not available, a part is not called stale."""
    out = []
    for part, v in status.items():
        if not (isinstance(v, dict) and v.get("status") == "done" and v.get("notebooks")):
            continue
        if isinstance(v.get("code_sha1"), dict):
            if any(notebook_code_sha1(nb) not in (None, sha) for nb, sha in v["code_sha1"].items()):
                out.append(part)
            continue
        if not v.get("git_commit"):
            continue
        for nb in v["notebooks"]:
            then = subprocess.run(["git", "show", f"{v['git_commit']}:notebooks/{nb}.ipynb"], cwd=REPO_ROOT,
                                  capture_output=True, text=True)
            now = notebook_code_sha1(nb)
            # git could not show it (no such commit here, or no git): not called stale
            if then.returncode == 0 and now is not None and code_sha1(then.stdout) != now:
                out.append(part)
                break
    return out


def changed_since_run(root: Path | None = None) -> list[str]:
    """One line per stale part (``stale_parts``) of each committed reference, with the command that redoes it (``next``
    also redoes them, after every part not run yet)."""
    out = []
    for folder in reference_runs(root):
        status = json.loads((folder / "parts.json").read_text()) if (folder / "parts.json").exists() else {}
        for part in stale_parts(status):
            v = status[part]
            out.append(f"{folder.name}: {part} ran at `{str(v.get('git_commit') or '?')[:7]}`; "
                       f"the code cells of {', '.join(f'notebooks/{nb}.ipynb' for nb in v['notebooks'])} changed since (redo it with "
                       f"`FORCE=1 bash scripts/gpu_call.sh --detach {part}` when device time allows; `next` redoes it "
                       "after every part not run yet)")
    return out


def status_markdown(root: Path | None = None) -> str:
    """Where each committed reference run stands, as the README shows it: one table per run, a row per part
    (status and wall time from parts.json), written by ``python -m ddpm_core.reference status``."""
    runs = [f for f in reference_runs(root) if meta(f).get("mode") == "full"]
    if not runs:
        return NO_REFERENCE
    blocks = []
    for folder in runs:
        m = meta(folder)
        status = json.loads((folder / "parts.json").read_text()) if (folder / "parts.json").exists() else {}
        lines = [f"**{device_words(m, folder)}**, torch {m.get('torch_version', '?')}, CUDA "
                 f"{m.get('cuda_version', '?')}, started {str(m.get('date', '?'))[:10]}, commit "
                 f"`{str(m.get('git_commit') or '?')[:7]}` (`data/reference/{folder.name}/`):", "",
                 "| part | status | wall time | notebooks | finished (commit) |", "|---|---|---|---|---|"]
        for part in PARTS:
            v = status.get(part)
            if not isinstance(v, dict):
                lines.append(f"| {part} | not run yet | | | |")
                continue
            secs = f"{v['seconds']:.0f} s" if "seconds" in v else ""
            nbs = ", ".join(f"{n.split('_')[0]} {t:.0f} s" for n, t in v.get("notebooks", {}).items())
            when = (f"{v['finished'][:10]} (`{str(v.get('git_commit') or '?')[:7]}`)" if v.get("finished") else "")
            lines.append(f"| {part} | {v.get('status', '?')} | {secs} | {nbs} | {when} |")
        for part in PARTS:
            if isinstance(v := status.get(part), dict) and v.get("status") == "skipped":
                lines += ["", f"{part} skipped: {v.get('reason', '?')}."]
            elif isinstance(v, dict) and v.get("status") == "interrupted" and v.get("cut_in"):
                est, _ = part_estimate_s(part, root)
                rows = len(results(folder, v["cut_in"]))
                lines += ["", f"{part} was cut off by its run's deadline after {v['seconds']:.0f} s, "
                          f"{v.get('cut_after_s', 0):.0f} s into {v['cut_in']}: "
                          + (f"kept, {plural(rows, 'result row')} from the sections it finished"
                             if rows else "none of its sections had written a result row")
                          + f"; a later run starts it again only where more than {est:.0f} s are left."]
            elif isinstance(v, dict) and v.get("status") == "failed":  # why, without the GPU machine's scratch path
                why = str(v.get("error", "?")).split("; see ")[0]
                log = next((f for p, (_, f) in GPU_TEST_PARTS.items() if p == part and (folder / f).exists()), None)
                lines += ["", f"{part} failed: {why}" + (f" (`{log}` in the folder has the details)" if log else "")
                          + "; a later run redoes it."]
        for name, line in headlines(folder).items():
            lines += ["", f"{name.split('_')[0]} printed: *{line}*"]
        if stages := stages_markdown(folder):
            lines += ["", stages]
        if where := last_stage_trace_markdown(folder):
            lines += ["", where]
        if race := peers_markdown(folder):
            lines += ["", race]
        if check := quality_markdown(folder):
            lines += ["", check]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


# ------------------------------------------------------------------------------ where the committed figures come from
def figure_source(path: Path, root: Path | None = None) -> str | None:
    """Where the figure at ``path`` was measured, in words, or None where nothing records it.

    A figure with the same bytes as a full reference run's copy (what ``unpack`` copies into figures/) comes from
    that run: "the reference run on <GPU> (full mode, torch ..., <date>)". Otherwise the PNG's own record
    (``plots.figure_source``): "a smoke-mode run on <device> · torch ... (<date>)"."""
    from . import plots

    path = Path(path)
    if not path.is_file():
        return None
    digest, rec = _sha1(path), plots.figure_source(path)
    for folder in reference_runs(root):
        m = meta(folder)
        copy = folder / "figures" / path.name
        if m.get("mode") == "full" and copy.is_file() and _sha1(copy) == digest:
            day = (rec.get("Created") or str(m.get("date", "?")))[:10]
            return (f"the reference run on {device_words(m, folder)} (full mode, torch {m.get('torch_version', '?')}, "
                    f"{day})")
    if not rec.get("Source"):
        return None
    return f"a {rec.get('Mode', '?')}-mode run on {rec['Source']} ({rec.get('Created', '?')[:10]})"


def _and(words: Sequence[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    words = list(words)
    return " and ".join(words) if len(words) < 3 else ", ".join(words[:-1]) + " and " + words[-1]


def figures_markdown(figures: Path | None = None, root: Path | None = None) -> str:
    """The README's sentence on where the committed figures come from, written from the figures themselves
    (``figure_source``) for every figure a notebook declares; ``python -m ddpm_core.reference readme`` puts it there."""
    from .series import NOTEBOOKS_DIR, declared_figures, list_notebooks

    figures = Path(figures) if figures is not None else committed_figures_dir()
    notebooks = list_notebooks(NOTEBOOKS_DIR)
    declared = {nb.stem.split("_")[0]: declared_figures(nb) for nb in notebooks}
    # a figure only a GPU draws (03b's allocator timeline) counts where a reference run committed it, and is not
    # missing where none did
    gpu_only = {nb.stem.split("_")[0]: [n for n in declared_figures(nb, gpu=True)
                                        if n not in declared[nb.stem.split("_")[0]] and (figures / n).is_file()]
                for nb in notebooks}
    declared = {p: names + gpu_only[p] for p, names in declared.items()}
    groups: dict[str, list[tuple[str, str]]] = {}
    missing, unknown = [], []
    for prefix, names in declared.items():
        for name in names:
            if not (figures / name).is_file():
                missing.append(name)
            elif (src := figure_source(figures / name, root)) is None:
                unknown.append(name)
            else:
                groups.setdefault(src, []).append((prefix, name))

    def which(items: list[tuple[str, str]]) -> str:
        whole = [p for p in dict.fromkeys(p for p, _ in items) if len(declared[p]) == sum(q == p for q, _ in items)]
        parts = ([("notebook " if len(whole) == 1 else "notebooks ") + _and(whole)] if whole else []) + [
            f"`{n}`" for p, n in items if p not in whole]
        return f"the {len(items)} of " + _and(parts) if whole else _and(parts)

    total = sum(map(len, declared.values()))
    # the reference runs' figures first: they are the ones a reader should look at
    ordered = sorted(groups.items(), key=lambda kv: (not kv[0].startswith("the reference run"), kv[1][0]))
    said = "; ".join(f"{which(items)} from " + (src[:-1] + "; [where it stands](#where-the-reference-run-stands))"
                                                if src.startswith("the reference run") else src)
                     for src, items in ordered)
    on_gpu = sum(map(len, gpu_only.values()))
    text = (f"The figures in `figures/` (all {total} that the notebooks declare"
            + (f", {on_gpu} of which only a GPU draws" if on_gpu else "") + ") come from real runs, each titled with "
            f"its device (`python -m ddpm_core.reference readme` writes this sentence from the figures themselves): "
            f"{said or 'none is committed'}.")
    if unknown:
        text += f" No record says where {', '.join(f'`{n}`' for n in unknown)} came from."
    if missing:
        text += f" Missing: {', '.join(f'`{n}`' for n in missing)}."
    if any(not src.startswith("the reference run") for src in groups):
        text += " Each is replaced by its GPU figure as the reference run reaches its notebook."
    return text


def gallery(source: Path | None = None, figures: Path | None = None, root: Path | None = None) -> dict[str, list[str]]:
    """Copy a run's figures (``source``, default the folder runs write to) into the committed figures (``figures``,
    default figures/), except where the committed copy comes from a full reference GPU run (``figure_source``):
    those change only through ``unpack``. Every figure a notebook declares, its GPU-only ones too, where the run
    wrote it. Returns {"copied": [...], "kept": [...] (a reference run's), "missing": [...] (not in ``source``)}."""
    from .series import NOTEBOOKS_DIR, declared_figures, list_notebooks

    source = Path(source) if source is not None else figures_dir()
    figures = Path(figures) if figures is not None else committed_figures_dir()
    if source.resolve() == figures.resolve():
        raise ValueError(f"the run's figures and the committed ones are the same folder ({figures}). Fix: run the "
                         "notebooks with DDPM_FIGURES_DIR unset (they write to data/figures/), then copy from there.")
    done: dict[str, list[str]] = {"copied": [], "kept": [], "missing": []}
    for nb in list_notebooks(NOTEBOOKS_DIR):
        for name in declared_figures(nb, gpu=True):
            src, dst = source / name, figures / name
            if not src.is_file():
                if name in declared_figures(nb):  # a GPU-only figure is missing from every CPU run
                    done["missing"].append(name)
            elif dst.is_file() and (figure_source(dst, root) or "").startswith("the reference run"):
                done["kept"].append(name)
            else:
                figures.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
                done["copied"].append(name)
    return done


# The README describes the repository's own runs and figures, whatever DDPM_REFERENCE_DIR or DDPM_FIGURES_DIR say.
README_BLOCKS = {"reference-status": lambda: status_markdown(REFERENCE_DIR),
                 "figure-sources": lambda: figures_markdown(REPO_ROOT / "figures", REFERENCE_DIR)}


def readme_blocks(text: str) -> str:
    """``text`` (the README) with each README_BLOCKS block, between its ``<!-- name -->`` and ``<!-- /name -->``
    markers, written anew."""
    for name, make in README_BLOCKS.items():
        start, end = f"<!-- {name} -->\n", f"<!-- /{name} -->"
        if start not in text or end not in text.split(start, 1)[1]:
            raise ValueError(f"README has no {start.strip()} ... {end} markers")
        head, rest = text.split(start, 1)
        text = head + start + make().strip() + "\n" + end + rest.split(end, 1)[1]
    return text


# ------------------------------------------------------------------------------ traces
def trim_trace(src: Path, dst: Path, steps: int = TRACE_STEPS) -> dict[str, int]:
    """Copy a profiler trace keeping its first ``steps`` ProfilerStep windows.

    Kept: metadata, every host event inside the window, and the GPU kernels, copies and memsets
    launched from it (matched by correlation id: a kernel runs after its launch, often after the
    window), with their flow events. Launches are runtime calls (``cudaLaunchKernel``, category
    ``cuda_runtime``) or driver calls (``cuLaunchKernel``, ``cuda_driver``: how Triton kernels of a
    compiled step are launched). GPU-side ``record_function`` spans (``gpu_user_annotation``) are kept
    where they start inside the window. Returns the event counts before and after.
    """
    with gzip.open(src, "rt") if src.name.endswith(".gz") else open(src) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    from .traces import step_spans

    marks = sorted(step_spans(events), key=lambda e: e["ts"])  # the host's spans: Kineto copies each onto the GPU's row
    if len(marks) > steps:
        start, end = marks[0]["ts"], marks[steps - 1]["ts"] + marks[steps - 1].get("dur", 0)
        device_cats = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
        launch_cats = {"cuda_runtime", "cuda_driver"}

        def host_kept(e: dict) -> bool:
            return e.get("cat") not in device_cats and "ts" in e and start <= float(e["ts"]) <= end

        kept_corr = {e.get("args", {}).get("correlation") for e in events
                     if e.get("cat") in launch_cats and host_kept(e)} - {None}
        out = []
        for e in events:
            if e.get("ph") == "M" or "ts" not in e:
                out.append(e)
            elif e.get("cat") == "gpu_user_annotation":  # no launch of its own: kept where it starts in the window
                if start <= float(e["ts"]) <= end:
                    out.append(e)
            elif e.get("cat") in device_cats:
                if e.get("args", {}).get("correlation") in kept_corr:
                    out.append(e)
            elif e.get("ph") in ("s", "f"):
                if e.get("id") in kept_corr or host_kept(e):
                    out.append(e)
            elif host_kept(e):
                out.append(e)
        trace["traceEvents"] = out
    dst.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(dst, "wt", compresslevel=9) as f:
        json.dump(trace, f, separators=(",", ":"))
    return {"events_before": len(events), "events_after": len(trace["traceEvents"])}


# ------------------------------------------------------------------------------ the run
def slug(device_name: str) -> str:
    """A folder name for a device: "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3"."""
    s = re.sub(r"^nvidia\s+", "", device_name.strip(), flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "device"


def default_out(smoke: bool) -> Path:
    import torch

    if not torch.cuda.is_available():
        return reference_dir() / ("cpu-smoke" if smoke else "cpu-full")
    from .env import NO_BF16_ENV, memory_cap_gib

    # a smoke run on a GPU (the shakedown), or a smaller card rehearsed on this one (DDPM_GPU_MEMORY_GB, and
    # DDPM_GPU_NO_BF16 for a T4's lack of bf16), must never land in, or collide with, that GPU's full reference
    cap = memory_cap_gib()
    return reference_dir() / (slug(torch.cuda.get_device_name(0)) + (f"-cap{cap:g}gib" if cap else "")
                              + ("-nobf16" if os.environ.get(NO_BF16_ENV) == "1" else "") + ("-smoke" if smoke else ""))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _now_us() -> str:  # orders two archives made within one second (a chain's links, two copies of one)
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def _git(*args: str) -> str | None:
    """git's output, or None where git failed or took over 10 s (no git, no repository, a hung command)."""
    try:
        proc = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


# `git status` with the notebooks' nbstripout filter (.gitattributes) runs nbstripout, a Python start of a second or
# more, on every notebook whose index entry git cannot trust by its timestamps: every one of them in a fresh clone,
# where the files and the index were written in the same second. CI's clone spent 20 s there, past _git's 10 s, in
# every meta part (and said the tree was clean). The files as they are show whether the tree differs from the
# commit: a reference run writes its executed copies elsewhere, and the committed notebooks carry no outputs.
_STATUS = ("-c", "filter.nbstripout.clean=cat", "status", "--porcelain", "--untracked-files=no")


def _part_meta(out: Path, smoke: bool) -> None:
    import torch

    from .env import NO_BF16_ENV, device_name, memory_cap_gib

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "device_name": device_name("cuda:0" if cuda else "cpu"),
        "mode": "smoke" if smoke else "full",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if cuda else None,
        "python_version": platform.python_version(),
        # a device machine gets a copy of the working tree whose .git (if any) need not be the commit that
        # travelled (the H100 run of 2026-11-26 found the session's first commit there): the command names it
        "git_commit": os.environ.get("DDPM_GIT_COMMIT") or _git("rev-parse", "HEAD"),
        # unknown where the command names the commit (commit before the call, so that the tree is that commit), or
        # where git failed
        "git_dirty": None if os.environ.get("DDPM_GIT_COMMIT") or (status := _git(*_STATUS)) is None else bool(status),
        "cpu_cores": os.cpu_count(),
    }
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_memory_cap_gib"] = memory_cap_gib()  # DDPM_GPU_MEMORY_GB: a smaller card rehearsed on this one
        info["gpu_bf16_off"] = os.environ.get(NO_BF16_ENV) == "1" or None  # DDPM_GPU_NO_BF16: a T4's lack of bf16 rehearsed
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["gpu_count"] = torch.cuda.device_count()
        smi = shutil.which("nvidia-smi")
        if smi:
            lines = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30).stdout.split()
            info["driver_version"] = lines[0] if lines else None
    (out / "meta.json").write_text(json.dumps(info, indent=1))


def _part_gpu_tests(out: Path, smoke: bool, part: str = "gpu-tests") -> dict:
    import torch

    marker, log_name = GPU_TEST_PARTS[part]
    cmd = [sys.executable, "-m", "pytest", "-m", marker, "-v", "-rs", "--durations=10", "-p", "no:cacheprovider", "tests"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.insert(-1, f"--timeout={GPU_TEST_TIMEOUT_S[part]}")
    path = out / log_name
    if not torch.cuda.is_available():  # every one of them would be skipped: a pytest run only to say so took 15-18 s
        path.write_text(f"$ pytest -m '{marker}'\nnot run: this machine has no CUDA GPU; all gpu tests are skipped "
                        "without one (the test suite collects them on every run)\n")
        return {"skipped": "no CUDA GPU"}
    with open(path, "w") as f:  # written as it goes: a command stopped at its limit still shows how far it got
        f.write(f"$ {' '.join(cmd[2:4])} '{marker}' {' '.join(cmd[5:])}\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=PART_BUDGET_S)
    log = path.read_text()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", log)}
    if proc.returncode not in (0, 5) or counts.get("failed") or counts.get("error") or counts.get("errors"):
        raise RuntimeError(f"gpu tests failed (exit {proc.returncode}, {counts}); see {path}")
    return counts


def _env(out: Path) -> dict[str, str]:
    work = out / WORK
    (work / "no-reference").mkdir(parents=True, exist_ok=True)
    return {"DDPM_RUNS_DIR": str(work / "runs"), "DDPM_RESULTS_DIR": str(work / "results"),
            # the executed notebooks of a reference run ARE the reference: they show no other, and say so
            "DDPM_REFERENCE_DIR": str(work / "no-reference"), SELF_ENV: "1"}


def _part_notebooks(out: Path, smoke: bool, prefixes: list[str], only: Sequence[str] | None,
                    keep_going: bool = False) -> dict:
    from .series import NotebookFailed, run_notebook, temporary_env

    chosen = _chosen(prefixes, only)
    seconds: dict[str, float] = {}
    errors: list[str] = []
    with temporary_env(_env(out)):
        for nb in chosen:
            print(f"  {nb.name} ...", flush=True)
            # rows of an earlier try of this notebook (failed, killed or --force) must not count twice
            (out / WORK / "results" / f"{nb.stem}.csv").unlink(missing_ok=True)
            started = time.perf_counter()
            try:
                run = run_notebook(nb, out / "notebooks", smoke=smoke, figures=out / "figures",
                                   timeout=max(PART_BUDGET_S, SMOKE_CELL_TIMEOUT_S) if smoke else PART_BUDGET_S)
            except KeyboardInterrupt as e:  # the deadline: what ended, and where and when it was cut (run's interrupted)
                e.notebooks, e.cut = dict(seconds), (nb.stem, round(time.perf_counter() - started, 1))
                raise
            except NotebookFailed as e:
                if not keep_going:
                    raise
                print(f"  {nb.name}: FAILED: {e}", flush=True)
                errors.append(str(e))
                continue
            seconds[nb.stem] = round(run.seconds, 1)
            print(f"  {nb.name}: {run.seconds:.0f} s", flush=True)
    if errors:  # keep_going: the part's other notebooks ran; the part still fails
        raise NotebookFailed(" | ".join(errors))
    return {"notebooks": seconds}


def collect(out: Path, notebooks: Sequence[str] | None = None) -> dict:
    """Make the folder whole from its scratch: result rows into results.csv, traces trimmed into traces/.

    The rows of ``notebooks`` (stems such as "03_batch_size"; default: every notebook with rows in
    the scratch) replace that notebook's rows in results.csv, whatever an earlier command or session
    left there; the other notebooks' rows stay. A trace is trimmed again only when its source is
    newer than the trimmed copy. Idempotent: safe after every part.
    """
    import pandas as pd

    work = out / WORK
    csvs = sorted((work / "results").glob("*.csv")) if (work / "results").is_dir() else []
    frames = [pd.read_csv(p, keep_default_na=False, na_values=[""]) for p in csvs]
    frames = [f for f in frames if len(f)]
    replaced = set(notebooks) if notebooks is not None else set()
    for f in frames:
        if "notebook" in f:
            replaced |= set(f["notebook"].astype(str))
    old_path = out / "results.csv"
    if old_path.exists() and old_path.stat().st_size:
        old = pd.read_csv(old_path, keep_default_na=False, na_values=[""])
        if "notebook" in old:
            old = old[~old["notebook"].astype(str).isin(replaced)]
        frames = [old, *frames] if len(old) else frames
    rows = 0
    if frames:
        merged = pd.concat(frames, ignore_index=True)
        rows = len(merged)
        merged.to_csv(old_path, index=False)
    trimmed = 0
    runs = work / "runs"
    for f in sorted(runs.rglob("*.json.gz")) if runs.exists() else []:
        rel = f.parent.relative_to(runs)
        rel = rel.relative_to("traces") if rel.parts[:1] == ("traces",) else rel
        dst = out / "traces" / rel / f.name
        if not dst.exists() or dst.stat().st_mtime < f.stat().st_mtime:
            trim_trace(f, dst)
            trimmed += 1
    return {"results_rows": rows, "traces_trimmed": trimmed}


def _part_pack(out: Path, smoke: bool) -> dict:
    detail = collect(out)
    archive = pack(out, delta=True)  # what this run added (the whole folder where it started from nothing)
    return {**detail, "traces": len(list((out / "traces").rglob("*.json.gz"))), "archive": str(archive),
            "archive_mb": round(archive.stat().st_size / 2**20, 2)}


def _sha1(path: Path) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def manifest(out: Path) -> dict[str, dict]:
    """A reference folder's files: relative path -> {"size", "sha1"}; its scratch (WORK) and a DELTA.json left out."""
    out = Path(out)
    files: dict[str, dict] = {}
    for dirpath, dirnames, filenames in os.walk(out):
        dirnames[:] = sorted(d for d in dirnames if d != WORK)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(out).as_posix()
            if rel != DELTA and path.is_file():
                files[rel] = {"size": path.stat().st_size, "sha1": _sha1(path)}
    return files


def record_base(out: Path, run: str | None = None) -> Path:
    """Write WORK/base-manifest.json: the folder's files as this run finds them, before its first part (or, with
    ``run``, the id of the run whose next archive starts here: ``run --archive-to`` chains its archives).

    ``pack(out, delta=True)`` packs only the files that are new or changed since: what this run added."""
    path = Path(out) / WORK / BASE_MANIFEST
    path.parent.mkdir(parents=True, exist_ok=True)
    now = _now()
    path.write_text(json.dumps({"recorded": now, "run": run or now, "files": manifest(out)}, indent=0))
    return path


def _git_commit(out: Path) -> str | None:
    """The commit a run measured: DDPM_GIT_COMMIT (what a device command names), else meta.json's."""
    if os.environ.get("DDPM_GIT_COMMIT"):
        return os.environ["DDPM_GIT_COMMIT"]
    try:
        return meta(out).get("git_commit") or None
    except (OSError, ValueError):
        return None


def pack(out: Path, delta: bool = False, archive: Path | None = None, segment: int = 1) -> Path:
    """``<out>.tar.gz`` of the folder without its scratch; fails naming the biggest files past 15 MB.

    ``delta``: only the files that are new or changed since the run recorded its base (``record_base``, at the start
    of ``run``), with a DELTA.json at the top naming the base, so that an archive holds one run's work, never the
    whole reference (13 executed notebooks with their figures and the traces are well over 15 MB). Where that base
    is empty (a run into a new folder) the archive is a full one, as is every archive of ``delta=False``.
    ``archive``: where to write it (default ``<out>.tar.gz`` beside the folder), written whole or not at all;
    ``segment``: its place in its run's chain of archives (``run --archive-to``), which ``unpack`` follows.
    """
    out = Path(out)
    archive = Path(archive) if archive is not None else out.parent / f"{out.name}.tar.gz"
    now = manifest(out)
    marker = None
    if delta:
        base_path = out / WORK / BASE_MANIFEST
        if not base_path.exists():
            raise RuntimeError(f"{out} holds no {WORK}/{BASE_MANIFEST}: no run recorded what the folder held before it. "
                               f"Fix: pack the whole folder (without --delta), or pack during `run --archive-to`.")
        recorded = json.loads(base_path.read_text())
        base = recorded["files"]
        if base:
            files = [rel for rel, f in now.items() if base.get(rel, {}).get("sha1") != f["sha1"]]
            marker = {"delta": True, "folder": out.name, "made": _now_us(), "git_commit": _git_commit(out),
                      "run": recorded.get("run", recorded.get("recorded")), "segment": segment,
                      "base_files": len(base), "files": files,
                      "gone": sorted(set(base) - set(now)),  # never deleted by unpack: listed for the record
                      "base": {rel: f["sha1"] for rel, f in base.items()}}  # what unpack checks the folder against
        else:
            files = list(now)
    else:
        files = list(now)
    partial = archive.parent / f".{archive.name}.partial"  # a copy taken mid-write (gpu_call's follow) never sees it
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(out, arcname=out.name, recursive=False)
        if marker is not None:
            data = json.dumps(marker, indent=1).encode()
            info = tarfile.TarInfo(f"{out.name}/{DELTA}")
            info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
            tar.addfile(info, io.BytesIO(data))
        for rel in files:
            tar.add(out / rel, arcname=f"{out.name}/{rel}", recursive=False)
    size = partial.stat().st_size
    if size > ARCHIVE_LIMIT_BYTES:
        partial.unlink()
        biggest = ", ".join(f"{rel} ({now[rel]['size'] / 2**20:.1f} MB)"
                            for rel in sorted(files, key=lambda r: now[r]["size"], reverse=True)[:5])
        what = (f"what this run added to {out.name} ({len(files)} new or changed files of {len(now)})"
                if marker is not None else f"the whole of {out.name} ({len(files)} files)")
        fix = ("Fix: run fewer parts per command (each command's archive holds only what it added: unpack it, "
               "commit, and the next command goes on from there), or capture fewer steps or trim harder."
               if marker is not None else
               "Fix: capture fewer steps or trim harder, or pack only what a run added (`run --archive-to DIR`, or "
               "`pack --delta` after a run).")
        raise RuntimeError(f"{archive} is {size / 2**20:.1f} MB, over the {ARCHIVE_LIMIT_BYTES / 2**20:.0f} MB a "
                           f"reference archive may take; it holds {what}. Biggest files: {biggest}. {fix}")
    os.replace(partial, archive)
    return archive


def _extract(tar: tarfile.TarFile, root: Path, members: list[tarfile.TarInfo]) -> None:
    if hasattr(tarfile, "data_filter"):  # 3.12, and the 3.8-3.11 releases that got extraction filters
        tar.extractall(root, members=members, filter="data")
    else:
        tar.extractall(root, members=members)


def _check_base(archive: Path, folder: Path, marker: dict, brought: dict[str, str], force: bool) -> None:
    """Refuse a delta unless ``folder`` holds the files its run started from, each unchanged or already as the delta
    brings it (``brought``: relative path -> sha1; unpacking the same delta twice is harmless). ``force``: refuse only
    where the folder is missing and the delta holds no meta.json."""
    base: dict[str, str] = marker.get("base", {})
    started = (f"a run that started from commit {str(marker['git_commit'])[:10]} with {len(base)} files there"
               if marker.get("git_commit") else f"a run that started with {len(base)} files there")
    if not folder.is_dir():
        has_meta = "meta.json" in brought
        if not (has_meta and force):
            raise ValueError(
                f"{archive} adds the parts of {started} to {folder}, which is missing here. Fix: unpack the earlier "
                f"archives of that reference first, in the order they were made, or check out the commit that has it"
                + (" (`unpack --force` makes the folder from this archive alone)." if has_meta and base else "."))
        return
    if force:
        return
    missing = [rel for rel in base if not (folder / rel).is_file()]
    changed = [rel for rel in base if (folder / rel).is_file() and _sha1(folder / rel) not in (base[rel], brought.get(rel))]
    if missing or changed:
        said = [f"{len(missing)} missing here ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})"] if missing else []
        said += [f"{len(changed)} different here ({', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''})"] if changed else []
        raise ValueError(
            f"{archive} holds only what {started} added, but {folder} is not what it started from: of those files, "
            f"{' and '.join(said)}. Unpacked here, it would write its parts.json and results.csv (the run's whole "
            f"status and rows, its start's plus its own) over parts and rows it never saw. Fix: unpack the archives "
            f"in the order they were made, each over what the one before left (an archive made before this folder's "
            f"last unpack: rerun its parts from here), or check out the commit the run started from; "
            f"`unpack --force` extracts it anyway.")


def unpack(archive: Path, root: Path | None = None, figures: Path | None = None, force: bool = False) -> Path:
    """Extract a reference archive into ``root`` (data/reference) and copy its figures into the committed figures/.

    A full archive replaces the folder. A delta (DELTA.json at its top: what one run added, ``pack(delta=True)``)
    is extracted over the folder its run started from, which must be here, unchanged (``force``: anyway), and
    deletes nothing; only its own figures are copied."""
    root = Path(root) if root is not None else reference_dir()
    figures = Path(figures) if figures is not None else committed_figures_dir()
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        top = {n.split("/", 1)[0] for n in names}
        if len(top) != 1 or any(n.startswith("/") or ".." in Path(n).parts for n in names):
            raise ValueError(f"{archive} is not a reference archive (one top folder, relative paths). "
                             f"Fix: make it with `python -m ddpm_core.reference pack`.")
        name = top.pop()
        folder = root / name
        marker_name = f"{name}/{DELTA}"
        if marker_name in names:
            marker = json.load(tar.extractfile(marker_name))
            brought = {m.name.split("/", 1)[1]: hashlib.sha1(tar.extractfile(m).read()).hexdigest()
                       for m in members if m.isfile() and "/" in m.name and m.name != marker_name}
            _check_base(archive, folder, marker, brought, force)
            # parts.json and results.csv are written over: run() read the parts.json it started from and wrote it back
            # with its own parts added, and collect() rewrote results.csv as the start's rows with its notebooks' rows
            # replaced, so each is the base's plus this run's, and the base is what _check_base found here.
            members = [m for m in members if m.name != marker_name]
            root.mkdir(parents=True, exist_ok=True)
            _extract(tar, root, members)
            pngs = [root / n for n in names if n.startswith(f"{name}/figures/") and n.endswith(".png")]
        else:
            if f"{name}/meta.json" not in names:  # checked before the folder here is deleted
                raise ValueError(f"{archive} holds no meta.json: not a reference run")
            if folder.exists():
                shutil.rmtree(folder)
            root.mkdir(parents=True, exist_ok=True)
            _extract(tar, root, members)
            pngs = sorted((folder / "figures").glob("*.png"))
    if not (folder / "meta.json").exists():
        raise ValueError(f"{archive} holds no meta.json: not a reference run")
    figures.mkdir(parents=True, exist_ok=True)
    for png in sorted(pngs):
        if png.is_file():
            shutil.copy2(png, figures / png.name)
    return folder


def _chain_key(archive: Path) -> tuple[str, str, int, str]:
    """(folder, run id, segment, made) of a reference archive: a full archive (no DELTA.json) comes first."""
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        top = names[0].split("/", 1)[0] if names else ""
        marker = f"{top}/{DELTA}"
        if marker in names:
            m = json.load(tar.extractfile(marker))
            return top, str(m.get("run") or m.get("made", "")), int(m.get("segment", 1)), str(m.get("made", ""))
        made = max((t.mtime for t in tar.getmembers()), default=0)
        return top, "", 0, f"{made:020.3f}"


def unpack_all(archives: Sequence[Path], root: Path | None = None, figures: Path | None = None,
               force: bool = False) -> list[Path]:
    """Unpack a session's reference archives in the order their runs made them.

    The archives of one run form a chain (``<folder>.tar.gz``, ``<folder>.part2.tar.gz``, ...: see ``_archive_to``),
    each over the one before. A detached run returns some of them twice (the ``--detach`` call's copy and the
    ``--attach`` call's): of two copies of one link, the later-made one is kept, since it holds all the earlier held.
    Returns the archives unpacked, in order."""
    latest: dict[tuple[str, str, int], tuple[str, Path]] = {}
    for a in map(Path, archives):
        folder, run_id, segment, made = _chain_key(a)
        key = (folder, run_id, segment)
        if key not in latest or made > latest[key][0]:
            latest[key] = (made, a)
    done = []
    for key in sorted(latest):
        archive = latest[key][1]
        unpack(archive, root=root, figures=figures, force=force)
        done.append(archive)
    return done


def _timed_notebook_part(out: Path, smoke: bool, prefixes: list[str], only: Sequence[str] | None,
                         keep_going: bool) -> tuple[float, dict]:
    """One notebook part in a process of its own (``run(jobs=...)``): its seconds and ``_part_notebooks``' detail."""
    start = time.perf_counter()
    detail = _part_notebooks(out, smoke, prefixes, only, keep_going) or {}
    return time.perf_counter() - start, detail


_MP_START = "spawn"  # how run(jobs=...) starts its part processes: fresh ones, not forks of one that holds torch's threads


def _run_side_by_side(out: Path, smoke: bool, parts: list[str], only: Sequence[str] | None, keep_going: bool, jobs: int,
                      begin: Callable, finished: Callable, interrupted: Callable) -> None:
    """``run``'s notebook ``parts``, ``jobs`` at a time in their order, each in a process of its own (the kernels
    papermill starts read their settings from that process's environment, which each part sets for its own). This
    process alone writes the folder's status, results and archives, as each part ends, in the order they end.
    Without ``keep_going`` a failed part starts no other; the parts still running end and are recorded first."""
    import concurrent.futures as cf
    import multiprocessing

    queue, running, stop = list(parts), {}, None
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context(_MP_START)) as pool:
        def start_more() -> None:
            while queue and stop is None and len(running) < jobs:
                part = queue.pop(0)
                begin(part)
                fut = pool.submit(_timed_notebook_part, out, smoke, NOTEBOOK_PARTS[part], only, keep_going)
                running[fut] = (part, time.perf_counter())

        try:
            start_more()
            while running:
                ended, _ = cf.wait(list(running), return_when=cf.FIRST_COMPLETED)
                for fut in ended:
                    part, started = running.pop(fut)
                    try:
                        try:
                            seconds, detail = fut.result()
                        except Exception as e:  # noqa: BLE001 - the part's failure, recorded as one by one
                            finished(part, time.perf_counter() - started, error=e)  # raises without keep_going
                            continue
                        stems = [nb.stem for nb in _chosen(NOTEBOOK_PARTS[part], only)]
                        finished(part, seconds, {**detail, **collect(out, stems)})
                    except RuntimeError as e:
                        stop = stop or e
                start_more()
        except KeyboardInterrupt:
            for part, started in running.values():
                interrupted(part, time.perf_counter() - started)
            raise
    if stop is not None:
        raise stop


def run(out: Path | None = None, *, smoke: bool | None = None, parts: Sequence[str] | None = None,
        force: bool = False, notebooks: Sequence[str] | None = None, keep_going: bool = False,
        archive_to: Path | None = None, jobs: int = 1) -> Path:
    """Run the reference ``parts`` (default: all) into ``out``; skip parts already done unless ``force``.

    A part that raises is recorded as failed in parts.json; the run stops there unless
    ``keep_going``, which runs the rest and raises at the end naming every failed part. A part
    killed from outside stays "running" in parts.json, and the next run does it again.
    ``archive_to``: after every part, pack into that folder (``<name>.tar.gz``) what this run added to ``out``:
    the files new or changed since it started (``record_base``, ``pack(delta=True)``), or the whole folder where it
    started from an empty one. ``unpack`` puts such an archive over the folder it started from.
    ``jobs``: in smoke mode only, how many notebook parts run side by side, each in a process of its own (the test
    suite runs two on 2 cores: a notebook alone keeps about 1.25 of them busy, so one alone leaves most of a core idle).
    Their timings then share the CPU, and their comparisons say so; a full run's parts share one GPU, so it takes one.
    """
    import torch

    smoke = (not torch.cuda.is_available()) if smoke is None else smoke
    unknown = [p for p in (parts or []) if p not in PARTS and p != NEXT]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; the parts are {PARTS}, or {NEXT!r} (those not done yet, in the "
                         "order a short GPU session should take them)")
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a whole number of at least 1, got {jobs!r}")
    if jobs > 1 and not smoke:
        raise ValueError(f"jobs={jobs} runs notebook parts side by side, which only a smoke run may do: in full mode "
                         "they would share the GPU and time each other. Fix: --jobs 1 (the default), or --smoke.")
    # absolute: the notebooks run in notebooks/, where a relative --out would name another folder
    out = Path(out).resolve() if out is not None else default_out(smoke)
    out.mkdir(parents=True, exist_ok=True)
    status_path = out / "parts.json"
    status = json.loads(status_path.read_text()) if status_path.exists() else {}
    if status.get("_mode") not in (None, "smoke" if smoke else "full"):
        raise ValueError(f"{out} holds a {status['_mode']} run; this one is {'smoke' if smoke else 'full'}. "
                         f"Fix: another --out, or delete {out}.")
    status["_mode"] = "smoke" if smoke else "full"
    # What the folder holds before this run's first part: its archives (--archive-to, the pack part) hold only what it
    # adds. The status above is that base's parts.json, to which this run only adds or updates its own parts' entries,
    # so a delta's parts.json is the base's plus this run's, and unpack rightly writes it over the base's.
    chain = {"run": _now_us(), "segment": 1}  # archive_to: this run's chain of archives (see _archive_to)
    record_base(out, run=chain["run"])

    def notebook_part(pre: list[str]) -> dict:
        detail = _part_notebooks(out, smoke, pre, notebooks, keep_going) or {}
        stems = [nb.stem for nb in _chosen(pre, notebooks)]
        return {**detail, **collect(out, stems)}

    actions: dict[str, Callable[[], Any]] = {
        "meta": lambda: _part_meta(out, smoke),
        **{name: (lambda name=name: _part_gpu_tests(out, smoke, name)) for name in GPU_TEST_PARTS},
        **{name: (lambda pre=pre: notebook_part(pre)) for name, pre in NOTEBOOK_PARTS.items()},
        "pack": lambda: _part_pack(out, smoke),
    }
    print(f"reference run -> {out} ({'smoke' if smoke else 'full'} mode)" + (f", {jobs} notebook parts at a time" if jobs > 1 else ""),
          flush=True)
    total, run_start = 0.0, time.perf_counter()  # total: the parts' own seconds (more than the wall time side by side)
    failed: list[str] = []

    def begin(part: str) -> None:
        print(f"[{part}] ...", flush=True)
        status[part] = {"status": "running", "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        status_path.write_text(json.dumps(status, indent=1))  # a command killed here leaves "running": redone next time

    def interrupted(part: str, seconds: float, cut: BaseException | None = None) -> None:
        status[part] = {"status": "interrupted", "seconds": round(seconds, 1)}
        if part in NOTEBOOK_PARTS:
            # What the part finished stays: the notebooks that ended (their seconds), and of the one cut off its
            # executed copy so far (papermill saves it as cells end) and the rows its finished sections appended
            if getattr(cut, "notebooks", None):
                status[part]["notebooks"] = cut.notebooks
            if getattr(cut, "cut", None):
                status[part]["cut_in"], status[part]["cut_after_s"] = cut.cut
            try:
                status[part].update(collect(out, [nb.stem for nb in _chosen(NOTEBOOK_PARTS[part], notebooks)]))
            except Exception as e:  # noqa: BLE001 - the interrupt goes on; what was packed before stays
                print(f"[{part}] its rows could not be collected: {type(e).__name__}: {e}", flush=True)
        status_path.write_text(json.dumps(status, indent=1))
        print(f"[{part}] INTERRUPTED after {status[part]['seconds']:.0f} s: packing what it wrote", flush=True)
        _archive_to(out, archive_to, chain)

    def finished(part: str, seconds: float, detail: dict | None = None, error: BaseException | None = None) -> None:
        nonlocal total
        total += seconds
        if error is not None:
            status[part] = {"status": "failed", "seconds": round(seconds, 1), "error": f"{type(error).__name__}: {error}"}
            status_path.write_text(json.dumps(status, indent=1))
            _archive_to(out, archive_to, chain)
            if not keep_going:
                raise RuntimeError(f"reference part {part!r} failed: {type(error).__name__}: {error} "
                                   f"(status in {status_path})") from error
            print(f"[{part}] FAILED after {seconds:.0f} s: {type(error).__name__}: {error}", flush=True)
            failed.append(part)
            return
        # a reference made across sessions: each part says when and from which commit (meta.json has the first part's)
        status[part] = {"status": "done", "seconds": round(seconds, 1), "finished": _now(),
                        "git_commit": os.environ.get("DDPM_GIT_COMMIT") or _git("rev-parse", "HEAD"), **(detail or {})}
        if (detail or {}).get("notebooks"):  # what ran, so that a later change to a notebook's code shows (stale_parts)
            status[part]["code_sha1"] = {nb: notebook_code_sha1(nb) for nb in detail["notebooks"]}
        status_path.write_text(json.dumps(status, indent=1))
        _archive_to(out, archive_to, chain)
        over = " OVER BUDGET" if seconds > PART_BUDGET_S else ""
        print(f"[{part}] done in {seconds:.0f} s (budget {PART_BUDGET_S} s per part){over}", flush=True)

    if parts and NEXT in parts:  # the parts not done yet, most needed first (PRIORITY); any named beside it go first
        named = [p for p in parts if p != NEXT]
        parts = named + [p for p in PRIORITY if p not in named and status.get(p, {}).get("status") != "done"]
        # then the parts done at a notebook whose code cells have changed since (their executed copies show older output)
        stale = stale_parts(status)  # git reads for parts recorded before code_sha1: once, not per part
        redo = [p for p in PRIORITY if p in stale and p not in parts]
        parts += redo
        whose = "its notebook's" if len(redo) == 1 else "their notebooks'"
        print(f"{NEXT}: {' '.join(parts) or 'nothing: every part is done'}"
              + (f" ({', '.join(redo)}: done, but {whose} code changed since)" if redo else ""), flush=True)
    else:
        redo = []
    todo = [p for p in parts or PARTS if force or p in redo or status.get(p, {}).get("status") != "done"]
    if "meta" not in todo and not (out / "meta.json").exists():
        # A folder no run has described yet (a GPU that has no reference so far: the next session's may be an H200
        # where the committed one is an H100) is invisible without meta.json: reference_runs() lists, and every
        # notebook's block and the README's table show, only folders that hold one. A plan written for a folder
        # that has it ("gpu-tests nb-02 ...", no "meta") must not make a run nobody can read.
        print("[meta] not in the parts named, but this folder has no meta.json: doing it first", flush=True)
        todo.insert(0, "meta")
    for part in parts or PARTS:
        if part not in todo:
            print(f"[{part}] already done ({status[part]['seconds']:.0f} s): skipped", flush=True)
    side_by_side = [p for p in todo if p in NOTEBOOK_PARTS] if jobs > 1 else []
    if side_by_side:  # they run where the first of them stands in the order; the others (meta, tests, pack) one by one
        at = todo.index(side_by_side[0])
        todo = [p for p in todo[:at] if p not in side_by_side] + ["notebook parts"] + [p for p in todo[at:] if p not in side_by_side]
    not_started: list[str] = []
    for part in todo:
        if part == "notebook parts":
            _run_side_by_side(out, smoke, side_by_side, notebooks, keep_going, jobs, begin, finished, interrupted)
            continue
        if (why := _skip_reason(part, smoke)) is not None:  # recorded, never "done": a later run asks again
            status[part] = {"status": "skipped", "reason": why}  # no "finished": the README's table shows no date for it
            status_path.write_text(json.dumps(status, indent=1))
            print(f"[{part}] skipped: {why}", flush=True)
            continue
        if (deadline := None if smoke else run_deadline()) is not None:  # read each time: --attach may move it
            est, source = part_estimate_s(part)
            if est > (left := deadline - time.time()):
                print(f"[{part}] not started: it takes about {est:.0f} s ({source}) and {max(left, 0):.0f} s are left "
                      "before this run's deadline; a shorter part after it may fit", flush=True)
                not_started.append(part)
                continue
        begin(part)
        start = time.perf_counter()
        try:
            detail = actions[part]() or {}
        except KeyboardInterrupt as e:  # the deadline's SIGINT (scripts/gpu_call.sh) or Ctrl+C: keep what it shows
            interrupted(part, time.perf_counter() - start, e)
            raise
        except Exception as e:
            finished(part, time.perf_counter() - start, error=e)
            continue
        finished(part, time.perf_counter() - start, detail)
    done = [p for p in PARTS if isinstance(status.get(p), dict) and status[p].get("status") == "done"]
    wall = time.perf_counter() - run_start
    print(f"this command: {wall:.0f} s" + (f" ({total:.0f} s of parts side by side)" if total > wall + 1 else "")
          + f"; parts done in {out.name}: {len(done)} of {len(PARTS)} "
          f"(`python -m ddpm_core.reference status` for the table, `readme` to write it into the README)", flush=True)
    if not_started:
        print(f"not started for lack of time: {' '.join(not_started)} (the next command or session runs them)", flush=True)
    if failed:
        raise RuntimeError(f"reference parts failed: {', '.join(failed)} (errors in {status_path})")
    return out


CUT_MARGIN_S = 60  # a part cut off after t seconds is expected to need at least t + this


def part_estimate_s(part: str, root: Path | None = None) -> tuple[float, str]:
    """How long ``part`` takes in full mode, and where that figure comes from: the longest time a committed full
    reference measured for it (any GPU's folder under ``root``, by default the reference folder), else
    ``PART_ESTIMATE_S``.

    A run that cut the part off (status "interrupted") bounds it from below: it needed more than the seconds it ran,
    so the estimate is at least those plus ``CUT_MARGIN_S``. Otherwise a part longer than a session's window would be
    started, and cut off, in every session after it, each time spending the whole window on the same half run."""
    measured, cut = [], []
    for folder in reference_runs(root):
        try:
            if meta(folder).get("mode") != "full":
                continue
            v = json.loads((folder / "parts.json").read_text()).get(part)
        except (OSError, ValueError):
            continue
        if isinstance(v, dict) and "seconds" in v and v.get("status") in ("done", "interrupted"):
            (measured if v["status"] == "done" else cut).append((float(v["seconds"]), folder.name))
    if measured:
        secs, where = max(measured)
        return secs, f"measured in {where}"
    est, source = float(PART_ESTIMATE_S.get(part, 0)), "estimated from the code"
    if cut and max(cut)[0] + CUT_MARGIN_S > est:
        secs, where = max(cut)
        est, source = secs + CUT_MARGIN_S, f"cut off after {secs:.0f} s in {where}: it needs more"
    return est, source


def _skip_reason(part: str, smoke: bool) -> str | None:
    """Why a full run on this machine leaves ``part`` out, or None.

    Notebook 08 on fewer than two GPUs runs its DDP launches as gloo processes on the CPU with the tiny model (its
    section 1 says so): the mechanics every reader's own run shows, with no GPU number in it, for minutes of a GPU
    session. A machine with two or more GPUs runs it (NCCL), and ``DDPM_REFERENCE_ALL=1`` runs it anyway."""
    if smoke or part != "nb-08" or os.environ.get("DDPM_REFERENCE_ALL") == "1":
        return None
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() >= 2:  # a CPU's full run shows the CPU: it runs
        return None
    return ("one GPU on this machine: notebook 08's DDP runs would be gloo processes on its CPU with the tiny model, "
            "which show no GPU number; it needs two or more GPUs (NCCL) to show one (DDPM_REFERENCE_ALL=1 runs it)")


def _chosen(prefixes: list[str], only: Sequence[str] | None) -> list[Path]:
    from .series import select

    return [nb for nb in select(prefixes) if not only or nb in select(list(only))]


def archive_name(folder_name: str, segment: int = 1) -> str:
    """The name of a run's ``segment``-th archive: ``<folder>.tar.gz``, then ``<folder>.part2.tar.gz``, ..."""
    return f"{folder_name}.tar.gz" if segment == 1 else f"{folder_name}.part{segment}.tar.gz"


def _archive_to(out: Path, folder: Path | None, chain: dict | None = None) -> None:
    """Pack what this run added to ``out`` into ``folder`` (if given) after a part; a pack that fails is reported,
    never raised (the archive of the part before stays there).

    The archives form a chain (``chain``: the run's id and its current segment). Each holds what the run added since
    the archive before it; once one holds ``SEGMENT_BYTES``, it is closed: the folder as it now is becomes the base of
    the next (``<folder>.part2.tar.gz``, ...), so that no archive outgrows the limit however many parts a command
    runs. ``unpack`` applies a chain in order."""
    if folder is None:
        return
    chain = chain if chain is not None else {"run": _now_us(), "segment": 1}
    try:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        archive = pack(out, delta=True, archive=folder / archive_name(out.name, chain["segment"]),
                       segment=chain["segment"])
        size = archive.stat().st_size
        print(f"  packed -> {archive} ({size / 2**20:.1f} MB)", flush=True)
        if size >= SEGMENT_BYTES:  # closed: the next part's files go into the next archive of the chain
            record_base(out, run=chain["run"])
            chain["segment"] += 1
    except (OSError, RuntimeError, ValueError, KeyError) as e:  # e.g. a damaged base manifest: the part still counts
        print(f"  could not pack {out} into {folder}: {type(e).__name__}: {e}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpm_core.reference", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the reference parts (resumable)")
    mode = r.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", default=None, help="smoke mode (default without a GPU)")
    mode.add_argument("--full", action="store_true", help="full mode (default with a GPU)")
    r.add_argument("--out", default=None, help="the reference folder (default: data/reference/<gpu>)")
    r.add_argument("--parts", nargs="+", default=None, choices=[*PARTS, NEXT],
                   help=f"parts to run (default: all: {PARTS}); '{NEXT}': those the folder has not done, in the order a "
                        f"short GPU session should take them ({' '.join(PRIORITY)})")
    r.add_argument("--notebooks", nargs="+", default=None, help="only these notebooks: numbers (03 03b) or name prefixes (03_batch)")
    r.add_argument("--force", action="store_true", help="redo parts already done")
    r.add_argument("--jobs", type=int, default=1,
                   help="smoke mode only: notebook parts run side by side, each in its own process (default 1)")
    r.add_argument("--keep-going", action="store_true", help="after a part fails, run the others (exit 1 at the end)")
    r.add_argument("--archive-to", default=None, metavar="DIR",
                   help="after every part, pack the folder into DIR/<name>.tar.gz (e.g. $OUT on a device machine)")
    sub.add_parser("status", help="print where each committed full reference run stands (the README's table)")
    sub.add_parser("readme", help="write the README's blocks that come from the committed runs: where each reference "
                                  "run stands, and where the committed figures come from")
    k = sub.add_parser("pack", help="pack a reference folder into <folder>.tar.gz")
    k.add_argument("folder")
    k.add_argument("--delta", action="store_true",
                   help="only the files new or changed since the last run on the folder started (what `run` packs)")
    g = sub.add_parser("figures", help="copy a run's figures (data/figures/) into the committed figures/, except those "
                                       "a reference GPU run made (`make figures` runs the series first)")
    g.add_argument("--from", dest="source", default=None, metavar="DIR",
                   help="the run's figures (default: data/figures/, or $DDPM_FIGURES_DIR)")
    u = sub.add_parser("unpack", help="extract reference archives into data/reference and figures/")
    u.add_argument("archive", nargs="+", help="one archive, or all of a session's (a run's chain is applied in order, "
                                              "and of two copies of one archive the later-made one is kept)")
    u.add_argument("--force", action="store_true",
                   help="extract a delta archive even where the folder here is not the one its run started from")
    args = p.parse_args(argv)
    try:
        if args.cmd == "run":
            # The deadline's SIGINT (scripts/gpu_call.sh) must reach run() as KeyboardInterrupt, which packs what a cut
            # part finished. A run started in the background of a script (gpu_call.sh --detach) inherits SIGINT
            # ignored, and Python then installs no handler of its own: the SIGINT did nothing, and the kill that
            # followed lost the cut part's rows.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            smoke = True if args.smoke else (False if args.full else None)
            run(args.out, smoke=smoke, parts=args.parts, force=args.force, notebooks=args.notebooks,
                keep_going=args.keep_going, archive_to=Path(args.archive_to) if args.archive_to else None, jobs=args.jobs)
        elif args.cmd == "status":
            print(status_markdown())
            for line in changed_since_run():
                print(line)
        elif args.cmd == "readme":
            from .atomic import atomic_write_text

            readme = REPO_ROOT / "README.md"
            atomic_write_text(readme, readme_blocks(readme.read_text()))
            print(f"wrote {readme}'s blocks: {', '.join(README_BLOCKS)}")
        elif args.cmd == "pack":
            print(pack(Path(args.folder), delta=args.delta))
        elif args.cmd == "figures":
            done = gallery(Path(args.source) if args.source else None)
            print(f"copied {len(done['copied'])} figures into {committed_figures_dir()}"
                  + (f"; kept {len(done['kept'])} from a reference GPU run: {' '.join(done['kept'])}" if done["kept"] else "")
                  + (f"; not in the run: {' '.join(done['missing'])}" if done["missing"] else "")
                  + ". Then `python -m ddpm_core.reference readme` rewrites the README's sentence on where they come from.")
        else:
            for archive in unpack_all([Path(a) for a in args.archive], force=args.force):
                print(f"unpacked {archive}")
    except (RuntimeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
